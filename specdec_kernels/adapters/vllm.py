"""vLLM V1's rejection sampler in front of ``sk.chain_verify_packed``.

Two functions, both called with vLLM V1's eight positional arguments
(``vllm/v1/sample/rejection_sampler.py``):

* :func:`rejection_sample` is vLLM's ``rejection_sample``, drop-in: its sixth
  argument is ``target_probs``, the law as vLLM computed it (logits
  processors, temperature and top-k/top-p applied before the softmax), used
  as given.
* :func:`rejection_sample_from_logits` takes the raw ``target_logits`` there
  and applies ``sampling_metadata``'s temperature, top-k and top-p inside the
  verification launch: the fused replacement for vLLM's
  ``apply_sampling_constraints`` + softmax + ``rejection_sample``.

The shared layout:

* ``draft_token_ids [T]``: every request's drafts concatenated;
  ``cu_num_draft_tokens [B]``: the *inclusive* cumulative counts, without
  the leading 0 (``n_0, n_0 + n_1, ...``); ``num_draft_tokens``: the counts,
  a list (vLLM's) or a ``[B]`` tensor. The kernels count from ``cu``.
* ``target [T, V]``: the draft positions only, no bonus rows (vLLM samples
  the bonus token with its own sampler and passes it as
  ``bonus_token_ids [B, 1]``): ``chain_verify_packed``'s bonus-free layout.
* ``draft_probs [T, V]`` or ``None`` (n-gram, EAGLE: the drafts are
  verified as deterministic proposals).
* ``sampling_metadata``: read by attribute, vLLM's names. ``all_greedy``
  (every request greedy), ``temperature [B]`` or ``None`` (``None`` or an
  entry ``<= 0`` marks a greedy request: vLLM's markers are ``-1`` and, in
  newer versions, ``0``), ``generators`` (batch index to
  ``torch.Generator``); and, read by :func:`rejection_sample_from_logits`
  only, ``top_k [B]`` and ``top_p [B]`` or ``None``. A missing attribute
  means what vLLM means by its default (``False``, ``None``, ``{}``).
* The output: ``output_token_ids [B, max_spec_len + 1]`` int32, the accepted
  drafts, the recovered or bonus token, then ``-1`` (vLLM's
  ``PLACEHOLDER_TOKEN_ID``).

Random numbers: every request gets its own 63-bit seed on the device. A
request in ``generators`` draws its seed from its generator, so a seeded
request gives the same tokens whatever its batch and position in it, and a
request without drafts leaves its generator alone (as vLLM does, for
reproducibility). The others draw from torch's default generator of the
device, in one launch and without a host read (so the call is CUDA-graph
safe when ``generators`` is empty). Each generator costs two small launches
(the draw and its copy); with generators, ``num_draft_tokens`` given as a GPU
tensor is read on the host once.
"""

from __future__ import annotations

import torch

from .. import _validation
from ..ops.chain_verify_packed import chain_verify_packed
from .vllm_v2 import rejection_sample_v2

__all__ = ["rejection_sample", "rejection_sample_from_logits", "rejection_sample_v2"]


def rejection_sample(
    draft_token_ids,
    num_draft_tokens,
    max_spec_len,
    cu_num_draft_tokens,
    draft_probs,
    target_probs,
    bonus_token_ids,
    sampling_metadata,
    *,
    backend="auto",
):
    """vLLM V1's ``rejection_sample``, verified exactly by :func:`specdec_kernels.chain_verify_packed`.

    Parameters
    ----------
    draft_token_ids : Tensor, int32 or int64 ``[T]``
    num_draft_tokens : list of int or Tensor ``[B]``
        Drafts per request.
    max_spec_len : int
        The most drafts of any request: the output has ``max_spec_len + 1`` columns.
    cu_num_draft_tokens : Tensor, int32 or int64 ``[B]``
        Inclusive cumulative draft counts (vLLM's, without the leading 0).
    draft_probs : Tensor, float32, bfloat16 or float16 ``[T, V]``, or None
    target_probs : Tensor, float32, bfloat16 or float16 ``[T, V]``
        vLLM's processed target law at the draft positions, used as given: its
        temperature and top-k/top-p were applied before its softmax, so this
        function applies neither (it reads ``temperature`` only to tell greedy
        requests, which take the argmax of their rows).
    bonus_token_ids : Tensor, int32 or int64 ``[B, 1]``
        The token each request emits when it accepts all its drafts.
    sampling_metadata : vLLM's ``SamplingMetadata``, or any object with its attribute names
        ``all_greedy``, ``temperature`` and ``generators`` are read.
    backend : {"auto", "reference", "triton", "cuda"}

    Returns
    -------
    output_token_ids : Tensor, int32 ``[B, max_spec_len + 1]``

    Examples
    --------
    vLLM's own greedy case (its ``test_perfect_match``): every draft is the
    target's argmax, so the bonus token follows them.

    >>> import torch
    >>> from types import SimpleNamespace
    >>> from specdec_kernels.adapters import vllm
    >>> target_probs = torch.zeros(3, 100)
    >>> target_probs[0, 1] = target_probs[1, 2] = target_probs[2, 3] = 1.0
    >>> vllm.rejection_sample(torch.tensor([1, 2, 3]), [3], 3, torch.tensor([3], dtype=torch.int32), None,
    ...                       target_probs, torch.tensor([[4]]), SimpleNamespace(all_greedy=True)).tolist()
    [[1, 2, 3, 4]]
    """
    return _verify("vllm.rejection_sample", "target_probs", draft_token_ids, num_draft_tokens, max_spec_len,
                   cu_num_draft_tokens, draft_probs, target_probs, bonus_token_ids, sampling_metadata,
                   logits=False, backend=backend)


def rejection_sample_from_logits(
    draft_token_ids,
    num_draft_tokens,
    max_spec_len,
    cu_num_draft_tokens,
    draft_probs,
    target_logits,
    bonus_token_ids,
    sampling_metadata,
    *,
    logprobs=None,
    backend="auto",
):
    """vLLM's ``apply_sampling_constraints`` + softmax + ``rejection_sample`` in one verification launch.

    The arguments are :func:`rejection_sample`'s, except the sixth:

    target_logits : Tensor, float32, bfloat16 or float16 ``[T, V]``
        Raw target logits of the draft positions, after vLLM's logits
        processors and penalties. The law of a sampled request is
        ``softmax(target_logits / T)`` truncated by its ``top_k`` (entries
        ``<= 0`` or ``>= V`` are off) then its ``top_p`` (``1`` is off), as
        vLLM's sampler computes it; ``sampling_metadata.top_k`` and ``.top_p``
        are read too.
    logprobs : {None, "raw", "processed"}
        Also return ``output_logprobs [B, max_spec_len + 1]`` float32, the
        ops' ``logprobs``: each emitted token's log-probability under its row
        of ``target_logits`` as given (``"raw"``: after vLLM's logits
        processors and penalties, so not vLLM's ``raw_logprobs``, taken before
        them) or as verified (``"processed"``: after temperature and top-k/
        top-p, vLLM's ``processed_logprobs``); ``-inf`` at ``-1``
        placeholders, NaN for the bonus token (vLLM's sampler gave it; its row
        is not here). On the reference and Triton backends so far.

    Returns ``output_token_ids``, or ``(output_token_ids, output_logprobs)``
    with ``logprobs``.
    """
    return _verify("vllm.rejection_sample_from_logits", "target_logits", draft_token_ids, num_draft_tokens,
                   max_spec_len, cu_num_draft_tokens, draft_probs, target_logits, bonus_token_ids,
                   sampling_metadata, logits=True, logprobs=logprobs, backend=backend)


def _verify(op_name, target_name, draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens,
            draft_probs, target, bonus_token_ids, sampling_metadata, *, logits, backend, logprobs=None):
    """One ``chain_verify_packed`` launch on the bonus-free layout, with a seed per request."""
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"{op_name}: `{target_name}` must be a torch.Tensor; got {type(target).__name__}")
    check = _validation.Checker(op_name, target.device)
    check.tensor("cu_num_draft_tokens", cu_num_draft_tokens, (None,), _validation.TOKEN_DTYPES, "[B]")
    batch_size = cu_num_draft_tokens.shape[0]
    _check_counts(check, num_draft_tokens, batch_size)
    if isinstance(max_spec_len, bool) or not hasattr(max_spec_len, "__index__"):
        check.fail(f"`max_spec_len` must be an int; got {type(max_spec_len).__name__}", TypeError)
    check.tensor("bonus_token_ids", bonus_token_ids, (batch_size, 1), _validation.TOKEN_DTYPES, "[B, 1]",
                 sizes_from="cu_num_draft_tokens")
    temperature = getattr(sampling_metadata, "temperature", None)
    all_greedy = bool(getattr(sampling_metadata, "all_greedy", False)) or temperature is None
    truncation = {}
    if logits and not all_greedy:
        truncation = dict(top_k=getattr(sampling_metadata, "top_k", None),
                          top_p=getattr(sampling_metadata, "top_p", None))
    outputs = chain_verify_packed(
        draft_token_ids,
        torch.nn.functional.pad(cu_num_draft_tokens, (1, 0)),
        target,
        draft_probs,
        max_num_draft_tokens=int(max_spec_len),
        # With probabilities the temperature only marks greedy requests: the law is the rows as given.
        temperature=0.0 if all_greedy else temperature,
        logits=logits,
        # Greedy requests draw nothing: with every request greedy no seed is drawn (and no generator advances).
        seed=0 if all_greedy else _request_seeds(check, sampling_metadata, num_draft_tokens, batch_size,
                                                 target.device),
        bonus_token_ids=bonus_token_ids.view(-1),
        logprobs=logprobs,
        backend=backend,
        **truncation,
    )
    return outputs[0] if logprobs is None else (outputs[0], outputs[2])


def _check_counts(check, num_draft_tokens, batch_size):
    """``num_draft_tokens`` has ``B`` entries."""
    if isinstance(num_draft_tokens, torch.Tensor):
        check.tensor("num_draft_tokens", num_draft_tokens, (batch_size,), _validation.TOKEN_DTYPES, "[B]",
                     sizes_from="cu_num_draft_tokens")
    elif not isinstance(num_draft_tokens, (list, tuple)) or len(num_draft_tokens) != batch_size:
        check.fail(f"`num_draft_tokens` must be a list of B = {batch_size} ints (B = cu_num_draft_tokens.shape[0]) "
                   f"or a [B] tensor; got {type(num_draft_tokens).__name__} of length "
                   f"{len(num_draft_tokens) if hasattr(num_draft_tokens, '__len__') else 'none'}", TypeError)


def _request_seeds(check, sampling_metadata, num_draft_tokens, batch_size, device):
    """int64 ``[B]`` seeds on ``device``: fresh ones, with each generator's request drawing from its generator.

    A request without drafts draws no random number, so its generator is left alone.
    """
    seeds = _validation.device_seeds((batch_size,), device)
    generators = getattr(sampling_metadata, "generators", None) or {}
    if not isinstance(generators, dict):
        check.fail(f"`sampling_metadata.generators` must be a dict of batch index to torch.Generator; got "
                   f"{type(generators).__name__}", TypeError)
    if not generators:
        return seeds
    counts = num_draft_tokens.tolist() if isinstance(num_draft_tokens, torch.Tensor) else num_draft_tokens
    for index, generator in generators.items():
        if isinstance(index, bool) or not hasattr(index, "__index__") or not 0 <= index < batch_size:
            check.fail(f"`sampling_metadata.generators` keys must be batch indices in [0, B) = [0, {batch_size}); "
                       f"got {index!r}")
        if not isinstance(generator, torch.Generator):
            check.fail(f"`sampling_metadata.generators[{index}]` must be a torch.Generator; got "
                       f"{type(generator).__name__}", TypeError)
        if counts[index] == 0:
            continue
        drawn = _validation.device_seeds((1,), generator.device, generator)
        seeds[index:index + 1].copy_(drawn, non_blocking=True)
    return seeds
