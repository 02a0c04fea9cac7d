"""vLLM model runner V2's ``rejection_sample`` in front of ``sk.chain_verify_packed``.

vLLM's newer GPU model runner (``vllm/v1/worker/gpu/spec_decode/
rejection_sampler_utils.py``) lays a step out by logits rows:

* ``target_logits [L, V]``: request ``b`` owns rows ``cu_num_logits[b] ..
  cu_num_logits[b+1] - 1``, its draft positions then its bonus row: the
  package's packed layout with bonus rows, as it is (``cu_num_draft_tokens =
  cu_num_logits - b``). The logits are vLLM's processed ones: the law is
  their softmax, so the op runs at ``T = 1`` (``0`` for a greedy request).
* ``draft_sampled [L]``: row ``r`` judges the draft ``draft_sampled[r + 1]``
  (the request's first entry is the last verified token).
* ``draft_logits [R, K, V]`` per request *state*: request ``b``'s draft
  ``j`` was drawn from ``softmax(draft_logits[idx_mapping[b], j])``; ``None``
  for one-hot drafts (n-gram, greedy drafting).
* ``temperature [R]`` and ``seed [R]`` per request state, ``pos [L]`` each
  row's position in its sequence.

Random numbers: request ``b`` runs with ``seed[idx_mapping[b]]`` as its
per-request seed and the position of its first row, ``pos[cu_num_logits[b]]``,
as its offset. So its tokens are a function of its seed, its positions and
its rows only, whatever its batch, its index in it and ``idx_mapping`` (the
package's RNG draws per request from ``(seed, offset, stream, position)``).

Indices are read on the device: a value out of range (a malformed
``cu_num_logits`` or mapping) reads the nearest row or state, never outside
a tensor.

Launches on the Triton and CUDA backends: three, no host read. One
prepares the op's inputs (``kernels/vllm_v2.py``: the drafts' ids and,
from ``draft_logits``, their probabilities, each request's seed, offset and
temperature), then ``chain_verify_packed``'s, then one writes vLLM's
``sampled`` (int64) and ``num_sampled``. (The contract's target is one
beside the verification: the op writing vLLM's outputs itself would save
the last.) On the reference backend the same steps are torch ops. The draft
softmax is float32 on both paths, each with its own rounding, as the ops'
``logits=True`` rows are.
"""

from __future__ import annotations

import torch

from .. import _backend, _validation
from ..launchers.vllm_v2 import triton_vllm_v2_outputs, triton_vllm_v2_prepare
from ..ops.chain_verify_packed import chain_verify_packed

OP_NAME = "vllm.rejection_sample_v2"
_INDEX_DTYPES = (torch.int32, torch.int64)


def rejection_sample_v2(
    target_logits,
    draft_logits,
    draft_sampled,
    cu_num_logits,
    pos,
    idx_mapping,
    expanded_idx_mapping,
    expanded_local_pos,
    temperature,
    seed,
    num_speculative_steps,
    synthetic_conditional_rates=None,
    *,
    use_fp64=False,
    use_block_verification=False,
    backend="auto",
):
    """vLLM model runner V2's ``rejection_sample``, verified exactly by :func:`specdec_kernels.chain_verify_packed`.

    Parameters
    ----------
    target_logits : Tensor, float32, bfloat16 or float16 ``[L, V]``
    draft_logits : Tensor ``[R, K, V']`` or None
        The draft's logits per request state and step; with ``V' < V`` only
        the first ``V'`` tokens are in play, as in vLLM.
    draft_sampled : Tensor, int32 or int64 ``[L]``
    cu_num_logits : Tensor, int32 or int64 ``[B + 1]``
    pos : Tensor, int32 or int64 ``[L]``
    idx_mapping : Tensor, int32 or int64 ``[B]``
        Each request's state, in ``[0, R)``.
    expanded_idx_mapping, expanded_local_pos : Tensor, int32 or int64 ``[L]``
        Each row's request state and step (vLLM's; they index ``draft_logits``).
    temperature : Tensor, float32 ``[R]``
        ``0``: the request is greedy; any other value samples from the
        softmax of its rows (the logits already carry vLLM's temperature).
    seed : Tensor, int64 ``[R]``
    num_speculative_steps : int
        ``K``: the output has ``K + 1`` columns.
    synthetic_conditional_rates : None
        vLLM's synthetic acceptance (a benchmarking mode that does not keep
        the target's law) is refused: anything but ``None`` raises.
    use_fp64 : bool
        vLLM's Gumbel precision switch; accepted, without effect: the
        package's sampler is exact in fixed point (``docs/rng.md``).
    use_block_verification : bool
        Block verification: ``True`` raises ``NotImplementedError`` until
        the ops have ``method="block"``.
    backend : {"auto", "reference", "triton", "cuda"}

    Returns
    -------
    sampled : Tensor, int64 ``[B, K + 1]``
        ``sampled[b, :num_sampled[b]]``: the accepted drafts, then the
        recovered or bonus token; ``-1`` after them.
    num_sampled : Tensor, int32 ``[B]``
    """
    if not isinstance(target_logits, torch.Tensor):
        raise TypeError(f"{OP_NAME}: `target_logits` must be a torch.Tensor; got {type(target_logits).__name__}")
    check = _validation.Checker(OP_NAME, target_logits.device)
    if synthetic_conditional_rates is not None:
        check.fail("`synthetic_conditional_rates` (vLLM's synthetic acceptance) must be None: it does not keep the "
                   "target's law", ValueError)
    if use_block_verification:
        raise NotImplementedError(f"{OP_NAME}: `use_block_verification=True` maps to method=\"block\", which the "
                                  "ops do not have yet")
    if isinstance(num_speculative_steps, bool) or not hasattr(num_speculative_steps, "__index__") \
            or num_speculative_steps < 0:
        check.fail(f"`num_speculative_steps` must be an int >= 0; got {num_speculative_steps!r}", TypeError)
    num_logits, vocab_size = check.tensor("target_logits", target_logits, (None, None), _validation.FLOAT_DTYPES,
                                          "[L, V]").shape
    batch_size = check.tensor("cu_num_logits", cu_num_logits, (None,), _INDEX_DTYPES, "[B + 1]").shape[0] - 1
    if batch_size < 0:
        check.fail("`cu_num_logits` must have B + 1 >= 1 entries; got 0")
    for name, value in (("draft_sampled", draft_sampled), ("pos", pos),
                        ("expanded_idx_mapping", expanded_idx_mapping), ("expanded_local_pos", expanded_local_pos)):
        check.tensor(name, value, (num_logits,), _INDEX_DTYPES, "[L]", sizes_from="target_logits")
    check.tensor("idx_mapping", idx_mapping, (batch_size,), _INDEX_DTYPES, "[B]", sizes_from="cu_num_logits")
    num_states = check.tensor("temperature", temperature, (None,), (torch.float32,), "[R]").shape[0]
    check.tensor("seed", seed, (num_states,), (torch.int64,), "[R]", sizes_from="temperature")
    if draft_logits is not None:
        check.tensor("draft_logits", draft_logits, (num_states, int(num_speculative_steps), None),
                     _validation.FLOAT_DTYPES, "[R, num_speculative_steps, V]", sizes_from="temperature")
        vocab_size = min(vocab_size, draft_logits.shape[2])
        if num_speculative_steps == 0:
            draft_logits = None  # no step has a draft law; no draft row is read
    if num_logits < batch_size:
        check.fail(f"`target_logits` must have at least one row per request (L >= B = {batch_size}); got L = "
                   f"{num_logits}")
    if batch_size > 0 and num_states == 0:
        check.fail("`temperature` and `seed` must have a state for the requests (R >= 1); got R = 0")

    device = target_logits.device
    inputs = (cu_num_logits, draft_sampled, pos, idx_mapping, expanded_idx_mapping, expanded_local_pos, temperature,
              seed, draft_logits, vocab_size, int(num_speculative_steps))
    kernels = _backend.resolve("chain_verify_packed", backend, device) != "reference" \
        and _backend.triton_runs_on(device)
    prepare = triton_vllm_v2_prepare if kernels else _torch_prepare
    cu_drafts, draft_token_ids, draft, seeds, offsets, temperatures = prepare(*inputs)
    tokens, num_accepted = chain_verify_packed(
        draft_token_ids, cu_drafts, target_logits[:, :vocab_size], draft,
        max_num_draft_tokens=int(num_speculative_steps), temperature=temperatures, logits=True, seed=seeds,
        offset=offsets, backend=backend)
    if kernels:
        return triton_vllm_v2_outputs(tokens, num_accepted)
    return tokens.to(torch.int64), num_accepted + 1


def _torch_prepare(cu_num_logits, draft_sampled, pos, idx_mapping, expanded_idx_mapping, expanded_local_pos,
                   temperature, seed, draft_logits, vocab_size, max_drafts):
    """Torch twin of ``_vllm_v2_prepare_kernel``: ``chain_verify_packed``'s per-request inputs, on the device."""
    device = draft_sampled.device
    batch_size = cu_num_logits.shape[0] - 1
    num_logits, num_states = draft_sampled.shape[0], temperature.shape[0]
    cu_logits = cu_num_logits.to(torch.int64)
    cu_drafts = cu_logits - torch.arange(batch_size + 1, device=device)
    # Draft t of the packed layout sits at logits row t + (its request's index): the rows but each bonus row.
    drafts = torch.arange(num_logits - batch_size, device=device)
    draft_rows = drafts + torch.searchsorted(cu_drafts[1:], drafts, right=True)
    draft_token_ids = draft_sampled.to(torch.int64)[_clamped(draft_rows + 1, num_logits)]
    draft = None
    if draft_logits is not None:
        chosen = draft_logits[_clamped(expanded_idx_mapping[draft_rows], num_states),
                              _clamped(expanded_local_pos[draft_rows], draft_logits.shape[1]), :vocab_size]
        draft = torch.softmax(chosen.to(torch.float32), -1)
    states = _clamped(idx_mapping, num_states)
    return (cu_drafts, draft_token_ids, draft, seed[states], pos.to(torch.int64)[_clamped(cu_logits[:-1], num_logits)],
            torch.where(temperature[states] == 0, 0.0, 1.0))

def _clamped(index, size):
    """``index`` as int64 within ``[0, size)``: a value vLLM never passes (a malformed ``cu_num_logits`` or
    mapping) reads the nearest row or state, never outside the tensor."""
    return index.to(torch.int64).clamp(0, max(size - 1, 0))
