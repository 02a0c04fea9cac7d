"""``sk.chain_verify``: validate, allocate, dispatch."""

from __future__ import annotations

import functools

import torch

from .. import _backend, _library, _validation, _workspace
from ..reference import chain_verify as reference

OP_NAME = "chain_verify"


def chain_verify(
    draft_token_ids,
    target,
    draft=None,
    *,
    num_draft_tokens=None,
    temperature=None,
    logits=False,
    seed=0,
    offset=0,
    backend="auto",
    validate=False,
):
    """Exact speculative verification of chain drafts.

    Accepts draft token ``t_i`` with probability ``min(1, p_i(t_i) / q_i(t_i))``
    until the first rejection, then emits one token from the normalised
    residual ``max(0, p - q)`` at that position (or from the bonus row when
    every draft was accepted). The emitted tokens are distributed exactly as
    autoregressive sampling from the target.

    Parameters
    ----------
    draft_token_ids : Tensor, int32 or int64
        Proposed tokens; entries at or past ``num_draft_tokens[b]`` are ignored.
        An id outside ``[0, V)`` (e.g. ``-1``) is a rejection.
    target : Tensor, float32, bfloat16 or float16
        Target distribution at each position; row ``n_b`` is the bonus row.
    draft : Tensor or None
        Distribution each draft token was sampled from; ``None`` verifies the
        drafts as deterministic (one-hot) proposals.
    num_draft_tokens : Tensor, int32, optional
        Drafts per request, ``0 <= n_b <= K``; default ``K``.
    temperature : Tensor, float32, optional
        Per-request temperature; ``0`` makes a request greedy. With
        ``logits=True`` the distributions are ``softmax(x / T_b)``.
    logits : bool
        ``target``/``draft`` hold logits.
    seed : int or Tensor
        One int for the batch, or int64 ``[B]`` (one per request).
    offset : int or Tensor
        int, or int64 ``[]``/``[B]`` read on the device (advance it between
        CUDA-graph replays).
    backend : {"auto", "reference", "triton", "cuda"}
    validate : bool
        Check token ids and counts on the host (synchronises) and raise.

    Returns
    -------
    output_token_ids : Tensor, int32 ``[B, K+1]``
        Accepted drafts, then the target's token, then ``-1``.
    num_accepted : Tensor, int32 ``[B]``

    Shape
    -----
    ``draft_token_ids [B, K]``, ``target [B, K+1, V]``, ``draft [B, K, V]``,
    ``num_draft_tokens [B]``, ``temperature [B]``.

    Examples
    --------
    >>> import torch, specdec_kernels as sk
    >>> target = torch.softmax(torch.randn(2, 4, 50), -1)
    >>> draft = torch.softmax(torch.randn(2, 3, 50), -1)
    >>> ids = torch.multinomial(draft.view(-1, 50), 1).view(2, 3)
    >>> tokens, accepted = sk.chain_verify(ids, target, draft, seed=1, offset=0)
    >>> tokens.shape, accepted.shape
    (torch.Size([2, 4]), torch.Size([2]))
    """
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"{OP_NAME}: `target` must be a torch.Tensor; got {type(target).__name__}")
    check = _validation.Checker(OP_NAME, target.device)
    check.tensor("target", target, (None, None, None), _validation.FLOAT_DTYPES, "[B, K+1, V]")
    batch_size, rows, vocab_size = target.shape
    max_drafts = rows - 1
    if rows < 1:
        check.fail(f"`target` must have shape [B, K+1, V] with K+1 >= 1; got {list(target.shape)}")
    check.tensor("draft_token_ids", draft_token_ids, (batch_size, max_drafts), _validation.TOKEN_DTYPES, "[B, K]")
    check.optional_tensor("draft", draft, (batch_size, max_drafts, vocab_size), _validation.FLOAT_DTYPES, "[B, K, V]")
    check.optional_tensor("num_draft_tokens", num_draft_tokens, (batch_size,), (torch.int32,), "[B]")
    check.optional_tensor("temperature", temperature, (batch_size,), (torch.float32,), "[B]")
    if not isinstance(logits, bool):
        check.fail(f"`logits` must be a bool; got {type(logits).__name__}", TypeError)
    if vocab_size < 1:
        check.fail("`target` must have a vocabulary of at least 1 (V >= 1); got V = 0")
    check.random_state(batch_size, seed, offset)
    resolved = _backend.resolve(OP_NAME, backend, target.device)
    if validate:
        _validate_values(check, draft_token_ids, num_draft_tokens, temperature, max_drafts, vocab_size)
    seed_tensor, seed_int, offset_tensor, offset_int = _validation.split_random_state(seed, offset)
    return _library.op(OP_NAME)(
        draft_token_ids, target, draft, num_draft_tokens, temperature, logits,
        seed_tensor, seed_int, offset_tensor, offset_int, resolved,
    )


def _validate_values(check, draft_token_ids, num_draft_tokens, temperature, max_drafts, vocab_size):
    if num_draft_tokens is not None:
        bad = (num_draft_tokens < 0) | (num_draft_tokens > max_drafts)
        if bool(bad.any()):
            request = int(bad.nonzero()[0, 0])
            check.fail(
                f"`num_draft_tokens` must lie in [0, K] = [0, {max_drafts}]; "
                f"request {request} has {int(num_draft_tokens[request])}"
            )
    counts = num_draft_tokens if num_draft_tokens is not None else torch.full(
        (draft_token_ids.shape[0],), max_drafts, device=draft_token_ids.device)
    used = torch.arange(max_drafts, device=draft_token_ids.device).view(1, -1) < counts.view(-1, 1)
    bad = used & ((draft_token_ids < 0) | (draft_token_ids >= vocab_size))
    if bool(bad.any()):
        request, position = (int(i) for i in bad.nonzero()[0])
        check.fail(
            f"`draft_token_ids` must lie in [0, V) = [0, {vocab_size}); request {request} position {position} "
            f"has {int(draft_token_ids[request, position])}"
        )
    if temperature is not None and bool((~(temperature >= 0) | ~torch.isfinite(temperature)).any()):
        check.fail("`temperature` must be finite and >= 0 (0 means greedy)")


def _reference(draft_token_ids, target, draft, num_draft_tokens, temperature, logits,
               seed_tensor, seed, offset_tensor, offset):
    seed, offset = _validation.random_state_from_schema(seed_tensor, seed, offset_tensor, offset)
    return reference.chain_verify(draft_token_ids, target, draft, num_draft_tokens, temperature, logits, seed, offset)


def _launch_config(batch_size: int, vocab_size: int, device: torch.device):
    """``(rows, block_v, split_size, num_splits)`` for the Triton kernel.

    On a GPU a program handles a 1024-element tile and there are about two
    programs per SM, so one request's vocabulary spreads over the machine.
    Under the interpreter (CPU) programs run one after another, so tiles are
    made wide and many requests share a program; tiles stay at most 256 wide
    so tests with a few thousand tokens still cross several slices.
    """
    import triton

    vocab_tile = triton.next_power_of_2(vocab_size)
    if device.type == "cuda":
        block_v = min(vocab_tile, 1024)
        rows = min(max(1, 1024 // block_v), triton.next_power_of_2(batch_size))
        target_programs = 2 * _multiprocessor_count(device)
        max_splits = 1 << 30
    else:
        block_v = min(vocab_tile, 256)
        rows = min(max(1, 4096 // block_v), triton.next_power_of_2(batch_size))
        target_programs = 1
        max_splits = 3
    tiles = triton.cdiv(vocab_size, block_v)
    row_blocks = triton.cdiv(batch_size, rows)
    splits = max(1, min(tiles, max_splits, triton.cdiv(target_programs, row_blocks)))
    split_size = triton.cdiv(tiles, splits) * block_v
    return rows, block_v, split_size, triton.cdiv(vocab_size, split_size)


@functools.lru_cache(maxsize=None)
def _multiprocessor_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _triton(draft_token_ids, target, draft, num_draft_tokens, temperature, logits,
            seed_tensor, seed, offset_tensor, offset):
    import triton

    from .._kernels.chain_verify import _chain_verify_kernel

    batch_size, rows_per_request, vocab_size = target.shape
    max_drafts = rows_per_request - 1
    device = target.device
    output = torch.empty((batch_size, rows_per_request), dtype=torch.int32, device=device)
    num_accepted = torch.empty((batch_size,), dtype=torch.int32, device=device)
    if batch_size == 0:
        return output, num_accepted
    target = target if target.stride(-1) == 1 else target.contiguous()
    draft = draft if draft is None or draft.stride(-1) == 1 else draft.contiguous()
    rows, block_v, split_size, num_splits = _launch_config(batch_size, vocab_size, device)
    block_k1 = triton.next_power_of_2(rows_per_request)
    row_blocks = triton.cdiv(batch_size, rows)
    slots = row_blocks * num_splits * rows
    waves = 2 if logits else 1

    def scratch(name, dtype, per_slot=1):
        return _workspace.buffer(f"chain_verify.{name}", slots * per_slot, dtype, device)

    placeholder = target
    _chain_verify_kernel[(waves * row_blocks * num_splits,)](
        draft_token_ids, target, placeholder if draft is None else draft,
        placeholder if num_draft_tokens is None else num_draft_tokens,
        placeholder if temperature is None else temperature,
        placeholder if seed_tensor is None else seed_tensor, seed,
        placeholder if offset_tensor is None else offset_tensor, offset,
        output, num_accepted,
        scratch("race_key", torch.float32), scratch("race_arg", torch.int32),
        scratch("fallback_key", torch.float32), scratch("fallback_arg", torch.int32),
        scratch("has_mass", torch.int32),
        scratch("scan_max", torch.float32, block_k1), scratch("scan_arg", torch.int32, block_k1),
        scratch("scan_sum", torch.float32, block_k1), scratch("scan_dmax", torch.float32, block_k1),
        scratch("scan_dsum", torch.float32, block_k1),
        _workspace.buffer("chain_verify.arrivals", row_blocks, torch.int32, device),
        batch_size, max_drafts, vocab_size, num_splits, split_size,
        draft_token_ids.stride(0), target.stride(0), target.stride(1),
        0 if draft is None else draft.stride(0), 0 if draft is None else draft.stride(1), output.stride(0),
        HAS_DRAFT=draft is not None, HAS_NUM_DRAFTS=num_draft_tokens is not None,
        HAS_TEMPERATURE=temperature is not None, LOGITS=logits,
        SEED_PER_REQUEST=seed_tensor is not None, OFFSET_FROM_TENSOR=offset_tensor is not None,
        OFFSET_PER_REQUEST=offset_tensor is not None and offset_tensor.dim() == 1,
        ROWS=rows, BLOCK_K1=block_k1, BLOCK_V=block_v,
        num_warps=4, enable_fp_fusion=False,
    )
    return output, num_accepted


def _fake(draft_token_ids, target, *args):
    batch_size, rows, _ = target.shape
    output = target.new_empty((batch_size, rows), dtype=torch.int32)
    return output, target.new_empty((batch_size,), dtype=torch.int32)


_library.register(OP_NAME, {"reference": _reference, "triton": _triton}, _fake)
