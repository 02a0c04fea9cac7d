"""Ahead-of-time compilation of every Triton kernel for real GPUs, without one.

The interpreter accepts programs that cannot lower to a GPU (dynamic
``tl.arange`` bounds, type errors in lowering, unsupported ops), so CI also
compiles each kernel variant for ``sm_90a`` and ``sm_80``, reads ptxas's
register and spill report and checks that every stride is widened to 64
bits before use. Run as ``python -m specdec_kernels._kernels.aot``
(with ``TRITON_INTERPRET`` unset); it prints one line per variant and exits
non-zero on a compile error or a spill.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import tempfile

TARGETS = ((90, "sm_90a"), (80, "sm_80"))


H200_MULTIPROCESSORS = 132

# (batch, drafts, vocabulary, dtype, draft given, logits, per-request seeds,
# packed layout): the launcher's configurations for these shapes are the ones
# compiled. The tiny vocabularies pack the most rows into a program (the
# register-bound cases). Packed (chain_verify_packed): the same kernel with
# PACKED, rows found from cu_num_draft_tokens; one case per mode (probability
# slices, logits waves, logits walk) and the most rows per program.
CHAIN_VERIFY_SHAPES = (
    (1, 4, 128256, "fp32", True, False, False, False),
    (64, 8, 151936, "bf16", False, False, True, False),
    (64, 4, 128256, "bf16", True, True, True, False),
    (512, 4, 128256, "bf16", True, True, True, False),
    (8, 1, 32000, "fp16", False, True, False, False),
    (256, 3, 8, "fp32", True, False, False, False),
    (1024, 8, 1, "fp32", True, False, False, False),
    (1024, 8, 16, "bf16", True, True, False, False),
    (8, 4, 128256, "fp32", True, False, True, True),
    (64, 4, 128256, "bf16", True, True, True, True),
    (512, 4, 128256, "bf16", False, True, False, True),
    (1024, 8, 16, "bf16", True, True, False, True),
)

# The same fields, compiled with every sampling parameter (top_k, top_p,
# min_p, bonus ids). Batches below 2 * 132 at large vocabularies take the
# staged plan (kernels/chain_verify_stages.py: probabilities, logits, no
# draft, and K = 15, whose 16-row search tile is the widest); larger ones and
# tiny vocabularies the whole-row walk with the truncation search
# (kernels/truncation.py), one request per program at large vocabularies and
# the most rows per program at a tiny one.
CHAIN_VERIFY_SAMPLING_SHAPES = (
    (1, 4, 128256, "fp32", True, False, False, False),
    (64, 4, 128256, "bf16", True, True, True, True),
    (8, 7, 151936, "bf16", False, True, False, False),
    (2, 15, 32000, "fp16", True, False, True, False),
    (512, 4, 128256, "bf16", True, True, False, False),
    (256, 3, 8, "fp32", False, False, False, False),
)


# The same fields, compiled with ``logprobs`` (the kind, then whether with every sampling parameter): one case
# per plan (the one-wave slices, the two waves, the walk of logits and of truncated rows, the staged plan), at
# the most rows per program and the widest staged search.
CHAIN_VERIFY_LOGPROBS_SHAPES = (
    ((1, 4, 128256, "fp32", True, False, False, False), "processed", False),
    ((64, 4, 128256, "bf16", True, True, True, False), "raw", False),
    ((512, 4, 128256, "bf16", True, True, True, True), "raw", False),
    ((1024, 8, 16, "bf16", True, True, False, False), "raw", False),
    ((8, 7, 151936, "bf16", False, True, False, False), "raw", True),
    ((2, 15, 32000, "fp16", True, False, True, False), "processed", True),
    ((512, 4, 128256, "bf16", True, True, False, False), "processed", True),
    ((512, 4, 128256, "bf16", True, True, True, True), "raw", True),
    ((256, 3, 8, "fp32", False, False, False, False), "processed", True),
)


# (batch, tree size, vocabulary, dtype, draft given, draft sampling, logits,
# per-request seeds): the EAGLE range, the largest tree (N = 1024, one node
# tile) and vocabularies below one chunk (V = 1000: a one-chunk tile of 1024,
# which Triton 3.6 compiles only with two-chunk sampler tiles). On an H200
# batches up to 66 split the vocabulary (the SPLIT variant), larger ones do not.
TREE_VERIFY_SHAPES = (
    (8, 64, 128256, "fp32", True, "without_replacement", False, False),
    (128, 64, 128256, "bf16", True, "without_replacement", False, False),
    (64, 32, 32000, "bf16", True, "with_replacement", True, True),
    (1, 1024, 151936, "bf16", False, "without_replacement", False, True),
    (256, 8, 100, "fp16", True, "without_replacement", True, False),
    (256, 8, 1000, "fp16", True, "without_replacement", True, False),
    (512, 64, 16, "fp32", True, "without_replacement", False, True),
)

# The same fields, with every sampling parameter (top_k, top_p, min_p, bonus ids).
TREE_VERIFY_SAMPLING_SHAPES = (
    (8, 64, 128256, "fp32", True, "without_replacement", False, False),
    (64, 32, 32000, "bf16", False, "without_replacement", True, True),
)

# The same fields with ``logprobs`` (the kind, then whether with every sampling parameter): both plans (split
# and one program), raw and processed, probabilities and logits.
TREE_VERIFY_LOGPROBS_SHAPES = (
    ((8, 64, 128256, "fp32", True, "without_replacement", False, False), "processed", True),
    ((64, 32, 32000, "bf16", False, "without_replacement", True, True), "raw", True),
    ((128, 64, 128256, "bf16", True, "without_replacement", True, False), "raw", False),
    ((256, 8, 1000, "fp16", True, "without_replacement", True, False), "processed", False),
)

# Kernel arguments of the sampling parameters, after ``temperature_ptr``.
SAMPLING_POINTERS = {"top_k_ptr": "*i32", "top_p_ptr": "*fp32", "min_p_ptr": "*fp32", "bonus_ptr": "*i64"}


def _with_sampling_pointers(signature: dict) -> dict:
    """``signature`` with the sampling parameters' pointers inserted after ``temperature_ptr`` (kernel order)."""
    ordered = {}
    for name, kind in signature.items():
        ordered[name] = kind
        if name == "temperature_ptr":
            ordered.update(SAMPLING_POINTERS)
    return ordered


def _sampling_constexprs(sampling: bool, search_block: int) -> dict:
    return {"HAS_TOP_K": sampling, "HAS_TOP_P": sampling, "HAS_MIN_P": sampling, "TRUNCATE": sampling,
            "HAS_BONUS": sampling, "SEARCH_BLOCK": search_block}


# (tree size, parents dtype, prefix_lens dtype): N <= 64 is one program per
# request, N = 1024 the widest mask row (32 words).
BUILD_TREE_SHAPES = (
    (8, "i32", "i32"),
    (64, "i32", "i64"),
    (256, "i64", "i32"),
    (1024, "i32", "i64"),
)

# (path width N, features Hkv * D, cache element bits, index dtype): EAGLE
# widths, a 1024-node tree (BLOCK_F = 2) and fp32/fp8 caches.
COMPACT_KV_SHAPES = (
    (8, 8 * 128, 16, "i32"),
    (64, 8 * 128, 16, "i64"),
    (1024, 8 * 128, 16, "i32"),
    (32, 4 * 64, 32, "i32"),
    (16, 2 * 256, 8, "i64"),
)

# (batch, tree size, query heads, KV heads, head dim, dtype, block size,
# context): one shape per tile the launcher picks (rows x keys: 32x64,
# 64x64, 128x32 at D = 128; 128x64 at D = 64; 16x64, 64x32 at D = 256), with
# the sweep corners among them (one request at 32k splits the
# context; 32 requests of 64 nodes, 8 query heads per KV head, fill four
# 128-row tiles and do not split) and plain multi-head attention.
TREE_ATTENTION_SHAPES = (
    (1, 8, 32, 8, 128, "bf16", 16, 32768),
    (32, 64, 64, 8, 128, "bf16", 16, 8192),
    (8, 32, 32, 8, 64, "fp16", 256, 1024),
    (4, 16, 16, 16, 256, "bf16", 8, 4096),
    (8, 8, 64, 8, 128, "bf16", 32, 8192),
    (2, 64, 64, 8, 256, "fp16", 64, 32768),
)


# The SGLang adapter's kernels (kernels/eagle_layout.py), one program per request.
# Parents: (tree size, links dtype, depth limited, predicts cleared): EAGLE
# sizes and a 1024-node tree (the widest tile, 10 pointer-jumping rounds).
EAGLE_PARENTS_SHAPES = (
    (8, "i64", True, True),
    (64, "i32", True, False),
    (1024, "i64", True, True),
)
# Outputs: (tree size, accept_index width, retrive_index dtype, in place).
EAGLE_OUTPUTS_SHAPES = (
    (64, 7, "i64", False),
    (64, 7, "i32", True),
    (1024, 17, "i64", True),
)
# Greedy walk: (tree size, accept_index width, ids dtype): SGLang's int64 ids at EAGLE sizes, int32, and the
# widest tile.
EAGLE_GREEDY_SHAPES = (
    (8, 4, "i64"),
    (64, 7, "i32"),
    (1024, 17, "i64"),
)


# The vLLM V2 adapter's kernels (kernels/vllm_v2.py). Preparation: (index dtype, draft logits dtype or None
# for one-hot drafts); outputs: the output width K + 1.
VLLM_V2_PREPARE_SHAPES = (
    ("i32", "bf16"),
    ("i64", "fp32"),
    ("i32", None),
)
VLLM_V2_OUTPUTS_SHAPES = (5, 33)

# The FlashInfer adapter's counter kernel (kernels/flashinfer_counters.py), one program per request:
# (drafts K, token dtype, probability dtype, per-request seed and offset tensors, accumulate).
FLASHINFER_COUNTERS_SHAPES = (
    (1, "i32", "fp32", False, True),
    (7, "i64", "bf16", True, False),
    (16, "i32", "fp16", True, True),
)


def _jit_divisibility(signature: dict, values: dict, kernel) -> dict:
    """The ``tt.divisibility = 16`` attributes Triton's JIT gives these arguments (what a real launch compiles).

    Pointers of torch allocations are 16-byte aligned, and an int divisible
    by 16 is specialised unless the kernel says ``do_not_specialize``.
    Without them the compile would not vectorise loads and its register and
    instruction counts would not be the ones a GPU runs.
    """
    unspecialised = set(kernel.do_not_specialize) if hasattr(kernel, "do_not_specialize") else set()
    unspecialised |= {kernel.arg_names[index] if isinstance(index, int) else index for index in unspecialised}
    attrs = {}
    for index, (name, kind) in enumerate(signature.items()):
        aligned_pointer = kind.startswith("*")
        divisible_int = kind == "i32" and name not in unspecialised and values.get(name, 1) % 16 == 0
        if aligned_pointer or divisible_int:
            attrs[(index,)] = [["tt.divisibility", 16]]
    return attrs


def chain_verify_variants():
    """``(name, kernel, signature, constexprs, options, attrs)`` for the launcher's configurations."""
    from specdec_kernels.launchers._options import LOGPROBS_FLAGS
    from specdec_kernels.launchers.chain_verify import GPU_LIMITS, chain_plan

    from .chain_verify import _chain_verify_kernel

    variants = []
    shapes = ([(shape, None, False) for shape in CHAIN_VERIFY_SHAPES]
              + [(shape, None, True) for shape in CHAIN_VERIFY_SAMPLING_SHAPES] + list(CHAIN_VERIFY_LOGPROBS_SHAPES))
    for (batch, drafts, vocab, dtype, draft, logits, per_request, packed), logprobs, sampling in shapes:
        # The launcher's plan rule (sampling: truncation, staged where rows split, else the walk).
        plan = chain_plan(batch, drafts + 1, vocab, H200_MULTIPROCESSORS, GPU_LIMITS, logits, sampling)
        config, staged = plan.config, plan.staged
        signature = {
            "draft_ids_ptr": "*i64", "target_ptr": f"*{dtype}", "draft_ptr": f"*{dtype}",
            "num_drafts_ptr": "*i32", "cu_ptr": "*i64", "temperature_ptr": "*fp32",
            "seed_ptr": "*i64", "seed_low": "i32", "seed_high": "i32",
            "offset_ptr": "*i64", "offset_low": "i32", "offset_high": "i32",
            "output_ptr": "*i32", "num_accepted_ptr": "*i32", "logprobs_ptr": "*fp32",
            "chunk_total_ptr": "*i64", "chunk_pick_ptr": "*i32", "stat_max_ptr": "*fp32", "stat_arg_ptr": "*i32",
            "stat_sum_ptr": "*fp32",
            "tickets_ptr": "*i64", "wave1_arrivals_ptr": "*i32", "arrivals_ptr": "*i32",
            "failed_ptr": "*i32", "claims_ptr": "*i64", "stages_ptr": "*i64", "errors_ptr": "*i32",
            "fault_role": "i32", "stamp": "i64",
            "batch_size": "i32", "max_drafts": "i32", "num_tokens": "i32", "vocab_size": "i32", "num_chunks": "i32",
            "num_splits": "i32", "chunks_per_split": "i32",
            "stride_ids_b": "i32", "stride_target_b": "i32", "stride_target_k": "i32",
            "stride_draft_b": "i32", "stride_draft_k": "i32", "stride_output_b": "i32",
        }
        constexprs = {
            "HAS_DRAFT": draft, "HAS_NUM_DRAFTS": not packed, "PACKED": packed, "BONUS_ROWS": True,
            "HAS_TEMPERATURE": True,
            "LOGITS": logits,
            "SEED_PER_REQUEST": per_request, "OFFSET_FROM_TENSOR": True, "OFFSET_PER_REQUEST": per_request,
            "WALK": plan.walk, "STAGED": staged,
            **_sampling_constexprs(sampling, config.search_block), "LOGPROBS": LOGPROBS_FLAGS[logprobs],
            "ROWS": config.rows, "BLOCK_K1": config.block_k1,
            "BLOCK_V": config.block_v, "SPLIT_TILE": config.split_tile, "CHUNK_TILE": config.chunk_tile,
        }
        signature = _with_sampling_pointers(signature)
        signature.update({key: "constexpr" for key in constexprs})
        mode = ("logits walk" if constexprs["WALK"] else "logits waves") if logits else "probs"
        mode = f"{mode.split()[0]} staged" if staged else mode
        name = (f"chain_verify{'_packed' if packed else ''} B={batch} K={drafts} V={vocab} {dtype} {mode}"
                f"{'' if draft else ' one-hot'}{' top-k/top-p/min-p/bonus' if sampling else ''}"
                f"{f' logprobs={logprobs}' if logprobs else ''} rows={config.rows}")
        options = plan.options
        # Contiguous inputs: the strides and sizes the launcher passes for these
        # shapes (packed rows: both strides are the row stride).
        values = {"vocab_size": vocab, "stride_target_b": vocab if packed else (drafts + 1) * vocab,
                  "stride_target_k": vocab, "stride_draft_b": (vocab if packed else drafts * vocab) if draft else 0,
                  "stride_draft_k": vocab if draft else 0}
        attrs = _jit_divisibility(signature, values, _chain_verify_kernel)
        variants.append((name, _chain_verify_kernel, signature, constexprs, options, attrs))
    return variants


def build_tree_variants():
    """``(name, kernel, signature, constexprs, options, attrs)`` for the launcher's build_tree configurations."""
    from specdec_kernels.launchers.build_tree import NUM_WARPS, launch_config

    from .build_tree import _build_tree_kernel

    variants = []
    for tree_size, parents_dtype, prefix_dtype in BUILD_TREE_SHAPES:
        config = launch_config(tree_size)
        signature = {
            "parents_ptr": f"*{parents_dtype}", "num_nodes_ptr": f"*{parents_dtype}",
            "prefix_lens_ptr": f"*{prefix_dtype}",
            "mask_ptr": "*i32", "depth_ptr": "*i32", "positions_ptr": "*i64",
            "max_nodes": "i32", "num_words": "i32",
            "stride_parents_b": "i32", "stride_parents_n": "i32", "stride_num_nodes": "i32", "stride_prefix": "i32",
        }
        constexprs = {"HAS_NUM_NODES": True, "HAS_PREFIX": True, "BLOCK_NODES": config.block_nodes,
                      "BLOCK_WORDS": config.block_words}
        signature.update({key: "constexpr" for key in constexprs})
        name = f"build_tree N={tree_size} parents {parents_dtype} prefix {prefix_dtype} nodes={config.block_nodes}"
        values = {"max_nodes": tree_size, "num_words": -(-tree_size // 32), "stride_parents_b": tree_size,
                  "stride_parents_n": 1, "stride_num_nodes": 1, "stride_prefix": 1}
        attrs = _jit_divisibility(signature, values, _build_tree_kernel)
        variants.append((name, _build_tree_kernel, signature, constexprs, {"num_warps": NUM_WARPS}, attrs))
    return variants


def eagle_layout_variants():
    """``(name, kernel, signature, constexprs, options, attrs)`` for the SGLang adapters' three kernels."""
    from specdec_kernels.launchers.eagle_layout import NUM_WARPS, greedy_num_warps, rounds
    from specdec_kernels.launchers._shapes import next_power_of_2

    from .eagle_layout import _eagle_greedy_kernel, _eagle_outputs_kernel, _eagle_parents_kernel

    variants = []
    for tree_size, links_dtype, limit_depth, clear_predicts in EAGLE_PARENTS_SHAPES:
        signature = {
            "next_token_ptr": f"*{links_dtype}", "next_sibling_ptr": f"*{links_dtype}", "parents_ptr": "*i32",
            "scratch_ptr": "*i32", "predicts_ptr": "*i32", "tree_size": "i32", "spec_steps": "i32",
            "num_predicts": "i32", "stride_next_token_b": "i32", "stride_next_sibling_b": "i32",
            "stride_parents_b": "i32",
        }
        constexprs = {"LIMIT_DEPTH": limit_depth, "CLEAR_PREDICTS": clear_predicts, "ROUNDS": rounds(tree_size),
                      "BLOCK_N": next_power_of_2(tree_size)}
        signature.update({key: "constexpr" for key in constexprs})
        values = {"tree_size": tree_size, "spec_steps": 5, "num_predicts": 64 * tree_size + 1,
                  "stride_next_token_b": tree_size, "stride_next_sibling_b": tree_size, "stride_parents_b": tree_size}
        attrs = _jit_divisibility(signature, values, _eagle_parents_kernel)
        name = f"eagle_parents N={tree_size} links {links_dtype}{' depth' if limit_depth else ''}" \
               f"{' clear' if clear_predicts else ''}"
        variants.append((name, _eagle_parents_kernel, signature, constexprs, {"num_warps": NUM_WARPS}, attrs))
    for tree_size, width, index_dtype, in_place in EAGLE_OUTPUTS_SHAPES:
        signature = {
            "accepted_ptr": "*i32", "tokens_ptr": "*i32", "num_accepted_ptr": "*i32",
            "retrive_index_ptr": f"*{index_dtype}", "predicts_ptr": "*i32", "accept_index_ptr": "*i32",
            "accept_token_num_ptr": "*i32", "tree_size": "i32", "width": "i32", "num_rows": "i32",
            "stride_accepted_b": "i32", "stride_tokens_b": "i32", "stride_retrive_b": "i32",
            "stride_accept_index_b": "i32",
        }
        constexprs = {"IN_PLACE": in_place, "BLOCK_W": next_power_of_2(width)}
        signature.update({key: "constexpr" for key in constexprs})
        values = {"tree_size": tree_size, "width": width, "num_rows": 64 * tree_size, "stride_accepted_b": tree_size,
                  "stride_tokens_b": tree_size, "stride_retrive_b": tree_size, "stride_accept_index_b": width}
        attrs = _jit_divisibility(signature, values, _eagle_outputs_kernel)
        name = f"eagle_outputs N={tree_size} W={width} index {index_dtype}{' in place' if in_place else ''}"
        variants.append((name, _eagle_outputs_kernel, signature, constexprs, {"num_warps": NUM_WARPS}, attrs))
    for tree_size, width, ids_dtype in EAGLE_GREEDY_SHAPES:
        signature = {
            "candidates_ptr": f"*{ids_dtype}", "retrive_index_ptr": f"*{ids_dtype}",
            "next_token_ptr": f"*{ids_dtype}", "next_sibling_ptr": f"*{ids_dtype}",
            "target_predict_ptr": f"*{ids_dtype}", "predicts_ptr": "*i32", "accept_index_ptr": "*i32",
            "accept_token_num_ptr": "*i32", "tree_size": "i32", "width": "i32", "num_rows": "i32",
            "stride_candidates_b": "i32", "stride_retrive_b": "i32", "stride_next_token_b": "i32",
            "stride_next_sibling_b": "i32", "stride_target_b": "i32", "stride_accept_index_b": "i32",
        }
        constexprs = {"BLOCK_N": next_power_of_2(tree_size), "BLOCK_W": next_power_of_2(width)}
        signature.update({key: "constexpr" for key in constexprs})
        values = {"tree_size": tree_size, "width": width, "num_rows": 64 * tree_size,
                  **{key: tree_size for key in signature if key.startswith("stride_")}, "stride_accept_index_b": width}
        attrs = _jit_divisibility(signature, values, _eagle_greedy_kernel)
        variants.append((f"eagle_greedy N={tree_size} W={width} ids {ids_dtype}", _eagle_greedy_kernel, signature,
                         constexprs, {"num_warps": greedy_num_warps(constexprs["BLOCK_N"])}, attrs))
    return variants


def vllm_v2_variants():
    """``(name, kernel, signature, constexprs, options, attrs)`` for the vLLM V2 adapter's two kernels."""
    from specdec_kernels.launchers._shapes import next_power_of_2
    from specdec_kernels.launchers.vllm_v2 import BLOCK_V, NUM_WARPS

    from .vllm_v2 import _vllm_v2_outputs_kernel, _vllm_v2_prepare_kernel

    variants = []
    vocab = 128256
    for index_dtype, draft_dtype in VLLM_V2_PREPARE_SHAPES:
        signature = {
            **{name: f"*{index_dtype}" for name in ("cu_num_logits_ptr", "draft_sampled_ptr", "pos_ptr",
                                                    "idx_mapping_ptr", "expanded_idx_ptr", "expanded_pos_ptr")},
            "temperature_ptr": "*fp32", "seed_ptr": "*i64", "draft_logits_ptr": f"*{draft_dtype or 'i64'}",
            "cu_drafts_ptr": "*i64", "draft_ids_ptr": "*i64", "draft_probs_ptr": "*fp32" if draft_dtype else "*i64",
            "seeds_ptr": "*i64", "offsets_ptr": "*i64", "temperatures_ptr": "*fp32",
            "num_logits": "i32", "num_states": "i32", "draft_steps": "i32", "vocab_size": "i32",
            "stride_draft_state": "i32", "stride_draft_step": "i32", "stride_probs": "i32",
        }
        constexprs = {"HAS_DRAFT": draft_dtype is not None, "BLOCK_V": BLOCK_V}
        signature.update({key: "constexpr" for key in constexprs})
        values = {"num_logits": 320, "num_states": 256, "draft_steps": 4, "vocab_size": vocab,
                  "stride_draft_state": 4 * vocab, "stride_draft_step": vocab, "stride_probs": vocab}
        attrs = _jit_divisibility(signature, values, _vllm_v2_prepare_kernel)
        variants.append((f"vllm_v2_prepare {index_dtype} draft {draft_dtype or 'one-hot'}", _vllm_v2_prepare_kernel,
                         signature, constexprs, {"num_warps": NUM_WARPS}, attrs))
    for width in VLLM_V2_OUTPUTS_SHAPES:
        signature = {"tokens_ptr": "*i32", "num_accepted_ptr": "*i32", "sampled_ptr": "*i64",
                     "num_sampled_ptr": "*i32", "width": "i32", "stride_tokens": "i32", "stride_sampled": "i32"}
        constexprs = {"BLOCK_W": next_power_of_2(width)}
        signature.update({key: "constexpr" for key in constexprs})
        attrs = _jit_divisibility(signature, {"width": width, "stride_tokens": width, "stride_sampled": width},
                                  _vllm_v2_outputs_kernel)
        variants.append((f"vllm_v2_outputs W={width}", _vllm_v2_outputs_kernel, signature, constexprs,
                         {"num_warps": 1}, attrs))
    return variants


def flashinfer_counters_variants():
    """``(name, kernel, signature, constexprs, options, attrs)`` for the FlashInfer adapter's counter kernel."""
    from specdec_kernels.launchers.flashinfer_counters import NUM_WARPS
    from specdec_kernels.launchers._shapes import next_power_of_2

    from .flashinfer_counters import _flashinfer_counters_kernel

    variants = []
    vocab = 128256
    for max_drafts, ids_dtype, dtype, per_request, accumulate in FLASHINFER_COUNTERS_SHAPES:
        signature = {
            "ids_ptr": f"*{ids_dtype}", "target_ptr": f"*{dtype}", "draft_ptr": f"*{dtype}",
            "num_accepted_ptr": "*i32", "accepted_count_ptr": "*i32", "emitted_count_ptr": "*i32",
            "seed_ptr": "*i64", "seed_low": "i32", "seed_high": "i32",
            "offset_ptr": "*i64", "offset_low": "i32", "offset_high": "i32",
            "max_drafts": "i32", "vocab_size": "i32",
            "stride_ids_b": "i32", "stride_target_b": "i32", "stride_target_k": "i32",
            "stride_draft_b": "i32", "stride_draft_k": "i32",
        }
        constexprs = {"SEED_PER_REQUEST": per_request, "OFFSET_FROM_TENSOR": per_request,
                      "OFFSET_PER_REQUEST": per_request, "ACCUMULATE": accumulate,
                      "BLOCK_K": next_power_of_2(max_drafts)}
        signature.update({key: "constexpr" for key in constexprs})
        values = {"max_drafts": max_drafts, "vocab_size": vocab, "stride_ids_b": max_drafts,
                  "stride_target_b": (max_drafts + 1) * vocab, "stride_target_k": vocab,
                  "stride_draft_b": max_drafts * vocab, "stride_draft_k": vocab}
        attrs = _jit_divisibility(signature, values, _flashinfer_counters_kernel)
        name = f"flashinfer_counters K={max_drafts} {ids_dtype} {dtype}{' seeds' if per_request else ''}" \
               f"{' accumulate' if accumulate else ''}"
        variants.append((name, _flashinfer_counters_kernel, signature, constexprs, {"num_warps": NUM_WARPS}, attrs))
    return variants


def fault_counters_variants():
    """``(name, kernel, signature, constexprs, options, attrs)`` for the kernel that takes the fault counters."""
    from specdec_kernels._faults import _COUNTER_BLOCK, KINDS

    from .faults import _take_counters_kernel

    signature = {"counters_ptr": "*i32", "taken_ptr": "*i32", "num_kinds": "i32", "BLOCK": "constexpr"}
    attrs = _jit_divisibility(signature, {"num_kinds": len(KINDS)}, _take_counters_kernel)
    return [("take_counters", _take_counters_kernel, signature, {"BLOCK": _COUNTER_BLOCK}, {"num_warps": 1}, attrs)]


def tree_verify_variants():
    """``(name, kernel, signature, constexprs, options, attrs)`` for the launcher's tree_verify configurations."""
    from specdec_kernels.launchers._options import LOGPROBS_FLAGS
    from specdec_kernels.launchers.tree_verify import launch_config, launch_options, scratch_rows

    from .tree_verify import _tree_verify_kernel

    variants = []
    shapes = ([(shape, None, False) for shape in TREE_VERIFY_SHAPES]
              + [(shape, None, True) for shape in TREE_VERIFY_SAMPLING_SHAPES] + list(TREE_VERIFY_LOGPROBS_SHAPES))
    for (batch, tree_size, vocab, dtype, draft, draft_sampling, logits, per_request), logprobs, sampling in shapes:
        config = launch_config(batch, tree_size, vocab, multiprocessors=H200_MULTIPROCESSORS)
        rows = scratch_rows(draft, draft_sampling)
        signature = {
            "ids_ptr": "*i64", "parents_ptr": "*i32", "target_ptr": f"*{dtype}", "draft_ptr": f"*{dtype}",
            "num_nodes_ptr": "*i32", "temperature_ptr": "*fp32",
            "seed_ptr": "*i64", "seed_low": "i32", "seed_high": "i32",
            "offset_ptr": "*i64", "offset_low": "i32", "offset_high": "i32",
            "accepted_ptr": "*i32", "output_ptr": "*i32", "num_accepted_ptr": "*i32", "logprobs_ptr": "*fp32",
            "scratch_ptr": "*fp32", "chunk_total_ptr": "*i64", "chunk_pick_ptr": "*i32",
            "stages_ptr": "*i64", "errors_ptr": "*i32", "fault_role": "i32", "stamp": "i64",
            "batch_size": "i32", "tree_size": "i32", "vocab_size": "i32", "num_chunks": "i32",
            "num_splits": "i32", "chunks_per_split": "i32", "stride_ids_b": "i32", "stride_ids_n": "i32", "stride_parents_b": "i32", "stride_parents_n": "i32",
            "stride_target_b": "i32", "stride_target_n": "i32", "stride_draft_b": "i32", "stride_draft_n": "i32",
            "stride_accepted_b": "i32", "stride_output_b": "i32",
        }
        constexprs = {
            "HAS_DRAFT": draft, "HAS_NUM_NODES": True, "HAS_TEMPERATURE": True, "LOGITS": logits,
            "REMOVE_DRAWN": rows == 2, "SEED_PER_REQUEST": per_request, "OFFSET_FROM_TENSOR": True,
            "OFFSET_PER_REQUEST": per_request, "SCRATCH_ROWS": rows,
            **_sampling_constexprs(sampling, config.search_block), "SPLIT": config.num_splits > 1,
            "LOGPROBS": LOGPROBS_FLAGS[logprobs], "ROWS": config.rows, "BLOCK_N": config.block_n, "BLOCK_V": config.block_v,
            "CHUNK_TILE": config.chunk_tile, "REPLAY_SLOTS": config.replay_slots,
        }
        signature = _with_sampling_pointers(signature)
        signature.update({key: "constexpr" for key in constexprs})
        name = (f"tree_verify B={batch} N={tree_size} V={vocab} {dtype} {'logits' if logits else 'probs'} "
                f"{draft_sampling if draft else 'one-hot'}{' top-k/top-p/min-p/bonus' if sampling else ''} "
                f"{f'logprobs={logprobs} ' if logprobs else ''}rows={config.rows} splits={config.num_splits}")
        values = {"tree_size": tree_size, "vocab_size": vocab, "stride_ids_b": tree_size, "stride_ids_n": 1,
                  "stride_parents_b": tree_size, "stride_parents_n": 1,
                  "stride_target_b": tree_size * vocab, "stride_target_n": vocab,
                  "stride_draft_b": tree_size * vocab if draft else 0, "stride_draft_n": vocab if draft else 0,
                  "stride_accepted_b": tree_size, "stride_output_b": tree_size}
        attrs = _jit_divisibility(signature, values, _tree_verify_kernel)
        def options(capability, config=config, sampling=sampling, logits_with_draft=logits and draft):
            return {**launch_options(config, sampling, logits_with_draft, capability), "enable_fp_fusion": False}

        variants.append((name, _tree_verify_kernel, signature, constexprs, options, attrs))
    return variants


def compact_kv_variants():
    """``(name, kernel, signature, constexprs, options, attrs)`` for the launcher's compact_kv configurations."""
    from specdec_kernels.launchers.compact_kv import NUM_WARPS, launch_config

    from .compact_kv import _compact_kv_kernel

    variants = []
    for path_width, num_features, bits, index_dtype in COMPACT_KV_SHAPES:
        config = launch_config(path_width, num_features)
        cache = {8: "*u8", 16: "*i16", 32: "*i32"}[bits]
        signature = {
            "k_cache_ptr": cache, "v_cache_ptr": cache, "block_tables_ptr": f"*{index_dtype}",
            "prefix_lens_ptr": f"*{index_dtype}", "accepted_ptr": "*i32",
            "path_width": "i32", "num_blocks": "i32", "block_size": "i32", "max_blocks": "i32", "head_dim": "i32",
            "num_features": "i32",
            "stride_k_block": "i32", "stride_k_slot": "i32", "stride_k_head": "i32", "stride_k_dim": "i32",
            "stride_v_block": "i32", "stride_v_slot": "i32", "stride_v_head": "i32", "stride_v_dim": "i32",
            "stride_table_b": "i32", "stride_table_m": "i32", "stride_prefix": "i32",
            "stride_accepted_b": "i32", "stride_accepted_n": "i32",
        }
        constexprs = {"BLOCK_N": config.block_n, "BLOCK_F": config.block_f}
        signature.update({key: "constexpr" for key in constexprs})
        name = f"compact_kv N={path_width} F={num_features} {bits}-bit {index_dtype} tile={config.block_n}x{config.block_f}"
        block_size = 16
        values = {"path_width": path_width, "num_blocks": 4096, "block_size": block_size, "max_blocks": 64,
                  "head_dim": 128, "num_features": num_features,
                  "stride_k_block": block_size * num_features, "stride_k_slot": num_features,
                  "stride_k_head": 128, "stride_k_dim": 1,
                  "stride_v_block": block_size * num_features, "stride_v_slot": num_features,
                  "stride_v_head": 128, "stride_v_dim": 1,
                  "stride_table_b": 64, "stride_table_m": 1, "stride_prefix": 1,
                  "stride_accepted_b": path_width, "stride_accepted_n": 1}
        attrs = _jit_divisibility(signature, values, _compact_kv_kernel)
        variants.append((name, _compact_kv_kernel, signature, constexprs, {"num_warps": NUM_WARPS}, attrs))
    return variants


def tree_attention_variants():
    """``(name, kernel, signature, constexprs, options, attrs)`` for the launcher's tree_attention configurations;
    ``options`` is a function of the target's capability (80, 90).

    A configuration that splits the context also compiles its merge kernel, and (small row tiles) the variant
    that merges in the last split program (``MERGE_LAST``).
    """
    from specdec_kernels.launchers.tree_attention import (MERGE_IN_KERNEL_MAX_TILE, MERGE_NUM_WARPS, MERGE_ROWS,
                                                          launch_config, launch_options)

    from .tree_attention import _tree_attention_kernel, _tree_attention_merge_kernel

    variants = []
    for batch, tree_size, query_heads, kv_heads, head_dim, dtype, block_size, context in TREE_ATTENTION_SHAPES:
        group = query_heads // kv_heads
        max_blocks = -(-context // block_size)
        config = launch_config(batch, tree_size, group, kv_heads, head_dim, max_blocks * block_size,
                               H200_MULTIPROCESSORS)
        signature = {
            "q_ptr": f"*{dtype}", "k_cache_ptr": f"*{dtype}", "v_cache_ptr": f"*{dtype}",
            "block_tables_ptr": "*i32", "prefix_lens_ptr": "*i32", "tree_mask_ptr": "*i32", "num_nodes_ptr": "*i32",
            "out_ptr": f"*{dtype}", "partial_acc_ptr": "*fp32", "partial_max_ptr": "*fp32",
            "partial_sum_ptr": "*fp32", "merge_counter_ptr": "*i32",
            "scale_log2": "fp32",
            "max_nodes": "i32", "group": "i32", "num_q_heads": "i32", "num_kv_heads": "i32", "row_tiles": "i32",
            "num_splits": "i32", "num_blocks": "i32", "max_blocks": "i32", "block_size_log2": "i32",
            "stride_q_b": "i32", "stride_q_n": "i32", "stride_q_h": "i32",
            "stride_k_block": "i32", "stride_k_slot": "i32", "stride_k_head": "i32",
            "stride_v_block": "i32", "stride_v_slot": "i32", "stride_v_head": "i32",
            "stride_table_b": "i32", "stride_table_m": "i32", "stride_prefix": "i32",
            "stride_mask_b": "i32", "stride_mask_n": "i32", "stride_num_nodes": "i32",
        }
        split = config.num_splits > 1
        constexprs = {"HAS_NUM_NODES": True, "SPLIT": split, "MERGE_LAST": False, "FLOAT32_TILES": False,
                      "HEAD_DIM": head_dim, "BLOCK_M": config.block_m, "BLOCK_N": config.block_n,
                      "MERGE_ROWS": MERGE_ROWS}
        signature.update({key: "constexpr" for key in constexprs})
        name = (f"tree_attention B={batch} N={tree_size} Hq={query_heads} Hkv={kv_heads} D={head_dim} {dtype} "
                f"tile={config.block_m}x{config.block_n} splits={config.num_splits}")
        words = -(-tree_size // 32)
        features = kv_heads * head_dim
        values = {"max_nodes": tree_size, "group": group, "num_q_heads": query_heads, "num_kv_heads": kv_heads,
                  "row_tiles": config.row_tiles, "num_splits": config.num_splits, "num_blocks": batch * max_blocks,
                  "max_blocks": max_blocks, "block_size_log2": block_size.bit_length() - 1,
                  "stride_q_b": tree_size * query_heads * head_dim, "stride_q_n": query_heads * head_dim,
                  "stride_q_h": head_dim,
                  "stride_k_block": block_size * features, "stride_k_slot": features, "stride_k_head": head_dim,
                  "stride_v_block": block_size * features, "stride_v_slot": features, "stride_v_head": head_dim,
                  "stride_table_b": max_blocks, "stride_table_m": 1, "stride_prefix": 1,
                  "stride_mask_b": tree_size * words, "stride_mask_n": words, "stride_num_nodes": 1}
        attrs = _jit_divisibility(signature, values, _tree_attention_kernel)
        # The options depend on the target (capability): compile_all calls this.
        options = functools.partial(launch_options, config, head_dim)
        variants.append((name, _tree_attention_kernel, signature, constexprs, options, attrs))
        if split and config.block_m * head_dim <= MERGE_IN_KERNEL_MAX_TILE:
            variants.append((name + " merge-last", _tree_attention_kernel, signature,
                             {**constexprs, "MERGE_LAST": True}, options, attrs))
        if split:
            merge_signature = {"out_ptr": f"*{dtype}", "partial_acc_ptr": "*fp32", "partial_max_ptr": "*fp32",
                               "partial_sum_ptr": "*fp32", "num_rows": "i32", "num_splits": "i32"}
            merge_constexprs = {"HEAD_DIM": head_dim, "BLOCK_R": MERGE_ROWS}
            merge_signature.update({key: "constexpr" for key in merge_constexprs})
            merge_attrs = _jit_divisibility(merge_signature,
                                            {"num_rows": batch * tree_size * query_heads,
                                             "num_splits": config.num_splits}, _tree_attention_merge_kernel)
            variants.append((f"tree_attention merge D={head_dim} {dtype} splits={config.num_splits}",
                             _tree_attention_merge_kernel, merge_signature, merge_constexprs,
                             {"num_warps": MERGE_NUM_WARPS}, merge_attrs))
    return variants


def all_variants():
    """Every compiled variant of every Triton kernel (``options``: a dict, or a function of the target's
    capability)."""
    return (chain_verify_variants() + tree_verify_variants() + build_tree_variants() + compact_kv_variants()
            + tree_attention_variants() + eagle_layout_variants() + vllm_v2_variants()
            + flashinfer_counters_variants() + fault_counters_variants())


def _ptxas_path(capability: int) -> str:
    """The ptxas Triton itself uses (its signature differs across Triton 3.6-3.9)."""
    from triton.backends.nvidia.compiler import get_ptxas

    try:
        return get_ptxas(capability).path
    except TypeError:
        return get_ptxas().path


def ptxas_report(ptx: str, capability: int, arch: str) -> tuple[int, int, int]:
    """``(registers, spill stores, spill loads)`` from ``ptxas -v`` on the kernel's PTX."""
    with tempfile.TemporaryDirectory() as folder:
        source = os.path.join(folder, "kernel.ptx")
        with open(source, "w") as handle:
            handle.write(ptx)
        result = subprocess.run(
            [_ptxas_path(capability), "-v", "--fmad=false", "--regAllocOptLevel=2", f"--gpu-name={arch}", source, "-o",
             os.path.join(folder, "kernel.cubin")],
            check=True, capture_output=True, text=True,
        )
    log = result.stderr + result.stdout
    registers = int(re.search(r"Used (\d+) registers", log).group(1))
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return registers, int(spills.group(1)), int(spills.group(2))


def narrow_stride_uses(ptx: str, signature: dict) -> list[str]:
    """PTX lines that use a 32-bit stride parameter other than in 64-bit arithmetic.

    A stride multiplied in 32 bits (``mul.lo.s32``) overflows once
    ``index * stride`` passes ``2**31`` (strided inputs); the kernels widen
    every stride first, which ptxas sees as ``cvt.s64.s32`` or as the exact
    32 x 32 -> 64-bit ``mul.wide.s32`` (or ``mad.wide.s32``, the same product
    added to a 64-bit value).
    """
    runtime_params = [name for name, kind in signature.items() if kind != "constexpr"]
    registers = []
    for index, name in enumerate(runtime_params):
        if name.startswith("stride_") and signature[name] == "i32":
            match = re.search(rf"ld\.param\.b32\s+(%r\d+), \[\w+_param_{index}\];", ptx)
            if match:
                registers.append(match.group(1))
    return [line.strip() for line in ptx.splitlines() for register in registers
            if re.search(rf"{re.escape(register)}\b", line) and "ld.param" not in line
            and not line.strip().startswith(("cvt.s64.s32", "mul.wide.s32", "mad.wide.s32"))]


def approximate_divisions(ptx: str) -> list[str]:
    """PTX lines with an approximate division (``div.full``, ``div.approx``).

    Every division in these kernels feeds a value another backend must match
    bit for bit, so each must be correctly rounded (``div.rn``).
    """
    return [line.strip() for line in ptx.splitlines() if re.search(r"\bdiv\.(full|approx)\.", line)]


def compile_all() -> list[dict]:
    import triton
    from triton.backends.compiler import GPUTarget

    rows = []
    for name, kernel, signature, constexprs, options, attrs in all_variants():
        for capability, arch in TARGETS:
            source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
            target_options = options(capability) if callable(options) else options
            compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32), options=target_options)
            registers, spill_stores, spill_loads = ptxas_report(compiled.asm["ptx"], capability, arch)
            rows.append({"kernel": name, "arch": arch, "registers": registers, "spill_stores": spill_stores,
                         "spill_loads": spill_loads,
                         "narrow_strides": narrow_stride_uses(compiled.asm["ptx"], signature),
                         "approximate_divisions": approximate_divisions(compiled.asm["ptx"])})
    return rows


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the interpreter replaces compilation", file=sys.stderr)
        return 2
    rows = compile_all()
    for row in rows:
        print(f"{row['kernel']:<66} {row['arch']:<7} {row['registers']:>4} registers, "
              f"{row['spill_stores']} B spill stores, {row['spill_loads']} B spill loads")
        for line in row["narrow_strides"]:
            print(f"    32-bit use of a stride: {line}")
        for line in row["approximate_divisions"]:
            print(f"    approximate division: {line}")
    failed = (row["spill_stores"] or row["spill_loads"] or row["narrow_strides"] or row["approximate_divisions"]
              for row in rows)
    return 1 if any(failed) else 0


if __name__ == "__main__":
    sys.exit(main())
