"""vLLM V1's ``rejection_sample`` in front of ``sk.chain_verify_packed``.

The inputs and output are vLLM V1's (``vllm/v1/sample/rejection_sampler.py``):

* ``draft_token_ids [T]``: every request's drafts concatenated;
  ``cu_num_draft_tokens [B]``: the *inclusive* cumulative counts, without
  the leading 0 (``n_0, n_0 + n_1, ...``); ``num_draft_tokens``: the counts,
  a list or a ``[B]`` tensor, checked against nothing on the device (the
  counts the kernels use are read from ``cu_num_draft_tokens``).
* ``target_logits [T, V]``: raw logits of the draft positions only, no bonus
  rows (vLLM samples the bonus token with its own sampler and passes it as
  ``bonus_token_ids [B, 1]``): ``chain_verify_packed``'s bonus-free layout.
* ``draft_probs [T, V]`` or ``None`` (n-gram, EAGLE: the drafts are
  verified as deterministic proposals).
* ``temperature [B]`` or ``None``: ``None`` means every request is greedy;
  an entry ``<= 0`` (vLLM's greedy markers ``0`` and, in older versions,
  ``-1``) makes that request greedy. ``top_k [B]`` and ``top_p [B]``:
  vLLM's truncation (``top_k`` entries ``<= 0`` or ``>= V`` and ``top_p``
  ``1`` are off), applied after the temperature as vLLM does.
* The output: ``output_token_ids [B, max_spec_len + 1]`` int32, the accepted
  drafts, the recovered or bonus token, then ``-1`` (vLLM's
  ``PLACEHOLDER_TOKEN_ID``).

Random numbers: every request gets its own 63-bit seed on the device. A
request in ``generators`` (vLLM's ``sampling_metadata.generators``, batch
index to ``torch.Generator``) draws its seed from its generator, so a seeded
request gives the same tokens whatever its batch and position in it; the
others draw from torch's default generator of the device, in one launch and
without a host read (so the call is CUDA-graph safe when ``generators`` is
empty). Each generator costs two small launches (the draw and its copy).
"""

from __future__ import annotations

import torch

from .. import _validation
from ..ops.chain_verify_packed import chain_verify_packed

OP_NAME = "vllm.rejection_sample"
_SEED_BOUND = 2**63 - 1  # chain_verify's 63-bit seeds


def rejection_sample(
    draft_token_ids,
    num_draft_tokens,
    max_spec_len,
    cu_num_draft_tokens,
    draft_probs,
    target_logits,
    bonus_token_ids,
    *,
    temperature=None,
    top_k=None,
    top_p=None,
    generators=None,
    backend="auto",
):
    """vLLM V1's rejection sampling, verified exactly by :func:`specdec_kernels.chain_verify_packed`.

    Parameters
    ----------
    draft_token_ids : Tensor, int32 or int64 ``[T]``
    num_draft_tokens : list of int or Tensor ``[B]``
        Drafts per request (its length gives ``B`` when a list).
    max_spec_len : int
        The most drafts of any request: the output has ``max_spec_len + 1`` columns.
    cu_num_draft_tokens : Tensor, int32 or int64 ``[B]``
        Inclusive cumulative draft counts (vLLM's, without the leading 0).
    draft_probs : Tensor, float32, bfloat16 or float16 ``[T, V]``, or None
    target_logits : Tensor, float32, bfloat16 or float16 ``[T, V]``
        Raw target logits of the draft positions.
    bonus_token_ids : Tensor, int32 or int64 ``[B, 1]``
        The token each request emits when it accepts all its drafts.
    temperature : Tensor, float32 ``[B]``, or None
        ``None``: every request is greedy; an entry ``<= 0``: that one is.
    top_k, top_p : Tensor ``[B]`` or None
    generators : dict of int to torch.Generator, or None
        Per-request generators, keyed by batch index.
    backend : {"auto", "reference", "triton", "cuda"}

    Returns
    -------
    output_token_ids : Tensor, int32 ``[B, max_spec_len + 1]``

    Examples
    --------
    vLLM's own greedy case (its ``test_perfect_match``): every draft matches
    the target's argmax, so the bonus token follows them.

    >>> import torch
    >>> from specdec_kernels.adapters import vllm
    >>> logits = torch.full((3, 100), -100.0)
    >>> logits[0, 1] = logits[1, 2] = logits[2, 3] = 100.0
    >>> vllm.rejection_sample(torch.tensor([1, 2, 3]), [3], 3, torch.tensor([3], dtype=torch.int32), None,
    ...                       logits, torch.tensor([[4]])).tolist()
    [[1, 2, 3, 4]]
    """
    if not isinstance(target_logits, torch.Tensor):
        raise TypeError(f"{OP_NAME}: `target_logits` must be a torch.Tensor; got {type(target_logits).__name__}")
    check = _validation.Checker(OP_NAME, target_logits.device)
    check.tensor("cu_num_draft_tokens", cu_num_draft_tokens, (None,), _validation.TOKEN_DTYPES, "[B]")
    batch_size = cu_num_draft_tokens.shape[0]
    _check_counts(check, num_draft_tokens, batch_size)
    if isinstance(max_spec_len, bool) or not hasattr(max_spec_len, "__index__"):
        check.fail(f"`max_spec_len` must be an int; got {type(max_spec_len).__name__}", TypeError)
    check.tensor("bonus_token_ids", bonus_token_ids, (batch_size, 1), _validation.TOKEN_DTYPES, "[B, 1]",
                 sizes_from="cu_num_draft_tokens")
    device = target_logits.device
    output_token_ids, _ = chain_verify_packed(
        draft_token_ids,
        torch.nn.functional.pad(cu_num_draft_tokens, (1, 0)),
        target_logits,
        draft_probs,
        max_num_draft_tokens=int(max_spec_len),
        temperature=0.0 if temperature is None else temperature,
        logits=True,
        # Greedy requests draw nothing: with every request greedy no seed is drawn (and no generator advances).
        seed=0 if temperature is None else _request_seeds(check, generators, batch_size, device),
        top_k=top_k,
        top_p=top_p,
        bonus_token_ids=bonus_token_ids.view(-1),
        backend=backend,
    )
    return output_token_ids


def _check_counts(check, num_draft_tokens, batch_size):
    """``num_draft_tokens`` has ``B`` entries (its values are not read: the kernels count from ``cu``)."""
    if isinstance(num_draft_tokens, torch.Tensor):
        check.tensor("num_draft_tokens", num_draft_tokens, (batch_size,), _validation.TOKEN_DTYPES, "[B]",
                     sizes_from="cu_num_draft_tokens")
    elif not isinstance(num_draft_tokens, (list, tuple)) or len(num_draft_tokens) != batch_size:
        check.fail(f"`num_draft_tokens` must be a list of B = {batch_size} ints (B = cu_num_draft_tokens.shape[0]) "
                   f"or a [B] tensor; got {type(num_draft_tokens).__name__} of length "
                   f"{len(num_draft_tokens) if hasattr(num_draft_tokens, '__len__') else 'none'}", TypeError)


def _request_seeds(check, generators, batch_size, device):
    """int64 ``[B]`` seeds on ``device``: fresh ones, with each generator's request drawing from its generator."""
    seeds = torch.randint(_SEED_BOUND, (batch_size,), dtype=torch.int64, device=device)
    if generators is None:
        return seeds
    if not isinstance(generators, dict):
        check.fail(f"`generators` must be a dict of batch index to torch.Generator, or None; got "
                   f"{type(generators).__name__}", TypeError)
    for index, generator in generators.items():
        if isinstance(index, bool) or not hasattr(index, "__index__") or not 0 <= index < batch_size:
            check.fail(f"`generators` keys must be batch indices in [0, B) = [0, {batch_size}); got {index!r}")
        if not isinstance(generator, torch.Generator):
            check.fail(f"`generators[{index}]` must be a torch.Generator; got {type(generator).__name__}", TypeError)
        drawn = torch.randint(_SEED_BOUND, (1,), dtype=torch.int64, generator=generator, device=generator.device)
        seeds[index:index + 1].copy_(drawn, non_blocking=True)
    return seeds
