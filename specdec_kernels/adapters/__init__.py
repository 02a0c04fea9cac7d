"""Adapters from engines' own verification layouts to the package's ops.

``sk.adapters.sglang``: sgl-kernel's ``tree_speculative_sampling_target_only``
and ``verify_tree_greedy``, and ``eagle_tree_verify``: SGLang's EAGLE trees
(linked lists of children and siblings, outputs indexed by flattened token
position) onto ``sk.tree_verify`` (``adapters/eagle_layout.py`` converts them).
``sk.adapters.flashinfer``: FlashInfer's ``chain_speculative_sampling``
(signature, outputs and counters) onto ``sk.chain_verify``.
``sk.adapters.vllm``: vLLM V1's ``rejection_sample`` (its eight arguments,
``sampling_metadata`` included), and ``rejection_sample_from_logits`` with
vLLM's temperature and truncation fused, and model runner V2's
``rejection_sample_v2``, onto ``sk.chain_verify_packed``.
"""

from . import flashinfer, sglang, vllm

__all__ = ["flashinfer", "sglang", "vllm"]
