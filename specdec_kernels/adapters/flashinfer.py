"""FlashInfer's ``chain_speculative_sampling`` in front of ``sk.chain_verify``.

The signature, shapes and outputs are FlashInfer's (``flashinfer/sampling.py``,
``chain_speculative_sampling``; its kernel ``ChainSpeculativeSampling`` in
``include/flashinfer/sampling.cuh``); the verification is ``chain_verify``'s,
exact, with this package's random numbers (not FlashInfer's bits).

What FlashInfer's kernel does, and what is kept
-----------------------------------------------
* Acceptance: draft token ``t_i`` is accepted iff ``u_i * q_i(t_i) <
  p_i(t_i)`` (``q`` the draft row, ``p`` the target row), in order, until
  the first rejection ``j``; then one token is drawn at ``j`` from
  ``max(0, p_j - q_j)``, or from the bonus row ``p_K`` when every draft was
  accepted; the rest of the row is ``-1``. ``chain_verify`` with ``draft``
  given is this rule. (Where the residual has no mass FlashInfer falls back
  to its last valid index; ``chain_verify`` draws from ``p_j``.)
* ``emitted`` counter: ``j``, the accepted drafts (``num_accepted``).
* ``accepted`` counter: ``j`` plus, for every position ``i >= j``, one more
  acceptance test ``u'_i * q_i(t_i) < p_i(t_i)`` with a fresh uniform: after
  the first rejection FlashInfer's kernel judges every remaining position,
  *the rejected one included*, with new draws of its generator. So the count
  is ``j + Bernoulli(a_j) + sum_{i > j} Bernoulli(a_i)``, all independent
  given the tokens, ``a_i = min(1, p_i(t_i) / q_i(t_i))``: ``chain_verify``'s
  test, so a token with ``q_i(t_i)`` not ``> 0`` (not drawable from the
  draft) counts with ``a_i = p_i(t_i)``, the point mass's (v1.3).
* Both counters are added to the caller's tensors in place, int32 ``[B]``
  (FlashInfer's kernel writes int32; its Python casts other dtypes with
  ``.int()``, so only an int32 tensor is actually updated: others are
  refused here). Without them, zeros are the start.
* Return value: the current FlashInfer returns the tuple
  ``(output_token_ids, output_accepted_token_num,
  output_emitted_draft_token_num)`` whether or not the counters are given,
  and so does this shim. Older signatures: the first versions took
  ``uniform_samples`` (after ``draft_token_ids``) and returned only
  ``output_token_ids``; the next ones added ``maybe_output_accepted_token_num``
  and ``maybe_output_emitted_token_num`` and returned the tuple; then
  ``uniform_samples`` gave way to ``generator`` (the counter renamed
  ``maybe_output_emitted_draft_token_num``), and ``seed``/``offset`` were
  added last. The shim follows the current one.
* ``deterministic``: accepted and ignored; the sampler here is deterministic
  under any decomposition (``docs/rng.md``).

Random numbers
--------------
FlashInfer seeds one Philox stream per request from ``(seed, offset)`` (a
tensor's first entry, whatever its length); ``generator`` (or, when it is
``None``, the device's default generator) supplies them when either is
``None``. Here:

* int ``seed`` and ``offset``: ``chain_verify``'s int seed and offset;
* tensors (int64 or uint64, 1-D, length 1 or ``B``, on the device): their
  first entries, as if they were those ints, read on the device: the seed
  becomes a per-request seed tensor and request ``b`` the offset
  ``offset ^ (b << 32)``, which gives every request exactly the counters an
  int seed gives it (``docs/rng.md``: the request index is XORed into the
  offset's high word); four small device ops (the seed copied per request,
  an ``arange``, a shift, an XOR), no host read;
* not both: a seed drawn from ``generator`` (a CPU generator: on the host;
  one on the tensors' device: on the device, no host read) or, without one,
  a fresh seed from torch's default CPU generator (``chain_verify``'s
  ``seed=None`` rule), offset 0. As in FlashInfer, a lone ``seed`` or
  ``offset`` is not an error: it is not read, and ``generator`` decides.

The ``accepted`` counter redraws the acceptance uniforms of positions after
``j`` from the same key and counters ``chain_verify`` used, so it agrees with
the tokens: ``(stream 0, position i, index 0)``, ``chain_verify``'s own, for
``i > j`` (which ``chain_verify`` never read), and ``(stream 0, position j,
index 1)``, a counter nothing else uses, for the second judgement of ``j``.

Launches: ``chain_verify``'s, then one for both counters
(``kernels/flashinfer_counters.py``) on the Triton and CUDA backends (torch
ops on the reference), plus the four small seed ops when the seed is a
tensor (five when a device generator draws it).
"""

from __future__ import annotations

import torch

from .. import _backend, _validation, rng
from ..launchers.flashinfer_counters import triton_flashinfer_counters
from ..ops.chain_verify import chain_verify
from ..reference import _rows

OP_NAME = "flashinfer.chain_speculative_sampling"


def chain_speculative_sampling(
    draft_probs,
    draft_token_ids,
    target_probs,
    maybe_output_accepted_token_num=None,
    maybe_output_emitted_draft_token_num=None,
    deterministic=True,
    generator=None,
    seed=None,
    offset=None,
    *,
    backend="auto",
):
    """FlashInfer's chain speculative sampling, verified exactly by :func:`specdec_kernels.chain_verify`.

    Parameters
    ----------
    draft_probs : Tensor, float32, bfloat16 or float16 ``[B, K, V]``
        Distribution each draft token was drawn from.
    draft_token_ids : Tensor, int32 or int64 ``[B, K]``
    target_probs : Tensor, float32, bfloat16 or float16 ``[B, K+1, V]``
        Target probabilities; row ``K`` is the bonus row.
    maybe_output_accepted_token_num : Tensor, int32 ``[B]``, optional
        Drafts accepted when each position is judged on its own (module
        docstring), added in place.
    maybe_output_emitted_draft_token_num : Tensor, int32 ``[B]``, optional
        Accepted drafts of the chain, added in place.
    deterministic : bool
        Accepted for FlashInfer's signature; the sampling is always deterministic.
    generator : torch.Generator, optional
        Draws the seed unless both ``seed`` and ``offset`` are given.
    seed, offset : int or Tensor, optional
        Both ints, or both int64/uint64 tensors of length 1 or ``B`` (their
        first entries are used, read on the device).
    backend : {"auto", "reference", "triton", "cuda"}

    Returns
    -------
    output_token_ids : Tensor, int32 ``[B, K+1]``
        Accepted drafts, the target's token, then ``-1``.
    output_accepted_token_num, output_emitted_draft_token_num : Tensor, int32 ``[B]``
        The counters: the given tensors after the addition, or new ones.

    Shape:
        - draft_probs: ``[B, K, V]``; draft_token_ids: ``[B, K]``; target_probs: ``[B, K+1, V]``
        - output_token_ids: ``[B, K+1]``; the counters: ``[B]``

    Examples
    --------
    FlashInfer's documented case: draft 2 has target probability 0.6 >= 0.3
    (accepted surely), draft 1 has target probability 0 (rejected surely), and
    the residual at position 1 is all on token 0:

    >>> import torch
    >>> from specdec_kernels.adapters import flashinfer
    >>> draft_probs = torch.tensor([[[0.1, 0.2, 0.3, 0.4], [0.2, 0.3, 0.4, 0.1]]])
    >>> draft_token_ids = torch.tensor([[2, 1]], dtype=torch.int32)
    >>> target_probs = torch.tensor([[[0.0, 0.1, 0.6, 0.3], [1.0, 0.0, 0.0, 0.0], [0.7, 0.1, 0.1, 0.1]]])
    >>> tokens, accepted, emitted = flashinfer.chain_speculative_sampling(
    ...     draft_probs, draft_token_ids, target_probs, seed=0, offset=0)
    >>> tokens.tolist(), accepted.tolist(), emitted.tolist()
    ([[2, 0, -1]], [1], [1])
    """
    if not isinstance(target_probs, torch.Tensor):
        raise TypeError(f"{OP_NAME}: `target_probs` must be a torch.Tensor; got {type(target_probs).__name__}")
    check = _validation.Checker(OP_NAME, target_probs.device)
    check.tensor("draft_probs", draft_probs, (None, None, None), _validation.FLOAT_DTYPES, "[B, K, V]")
    batch_size, max_drafts, vocab_size = draft_probs.shape
    check.tensor("draft_token_ids", draft_token_ids, (batch_size, max_drafts), _validation.TOKEN_DTYPES, "[B, K]",
                 sizes_from="draft_probs")
    check.tensor("target_probs", target_probs, (batch_size, max_drafts + 1, vocab_size), _validation.FLOAT_DTYPES,
                 "[B, K+1, V]", sizes_from="draft_probs")
    counters = {"maybe_output_accepted_token_num": maybe_output_accepted_token_num,
                "maybe_output_emitted_draft_token_num": maybe_output_emitted_draft_token_num}
    for name, counter in counters.items():
        check.optional_tensor(name, counter, (batch_size,), (torch.int32,), "[B]")
        if counter is not None and counter.numel() > 0 and counter.stride(0) != 1:
            check.fail(f"`{name}` must be contiguous (it is added to in place); got stride {counter.stride(0)}")
    if not isinstance(deterministic, bool):
        check.fail(f"`deterministic` must be a bool; got {type(deterministic).__name__}", TypeError)
    device = target_probs.device
    seed, offset = _random_state(check, seed, offset, generator, batch_size, device)

    output_token_ids, num_accepted = chain_verify(draft_token_ids, target_probs, draft_probs, seed=seed,
                                                  offset=offset, backend=backend)
    accumulate = maybe_output_accepted_token_num is not None
    accepted_count = maybe_output_accepted_token_num
    emitted_count = maybe_output_emitted_draft_token_num
    if _backend.resolve("chain_verify", backend, device) != "reference" and _backend.triton_runs_on(device):
        # One launch writes both: the counter not given starts from a new tensor the kernel stores into.
        if accepted_count is None:
            accepted_count = torch.empty((batch_size,), dtype=torch.int32, device=device)
        if emitted_count is None:
            emitted_count = torch.empty((batch_size,), dtype=torch.int32, device=device)
        if (maybe_output_accepted_token_num is None) != (maybe_output_emitted_draft_token_num is None):
            # The kernel either adds to both or stores both: start the missing one at zero.
            (emitted_count if accumulate else accepted_count).zero_()
            accumulate = True
        triton_flashinfer_counters(draft_token_ids, target_probs, draft_probs, num_accepted, accepted_count,
                                   emitted_count, *_validation.split_random_state(seed, offset), accumulate)
        return output_token_ids, accepted_count, emitted_count
    accepted, emitted = reference_counters(draft_token_ids, target_probs, draft_probs, num_accepted, seed, offset)
    return output_token_ids, _add_into(accepted_count, accepted), _add_into(emitted_count, emitted)


def reference_counters(draft_token_ids, target_probs, draft_probs, num_accepted, seed, offset):
    """``(accepted, emitted)``, int32 ``[B]``, of the module docstring, in torch ops (any device).

    ``kernels/flashinfer_counters.py`` is its twin, bit for bit; ``seed`` and
    ``offset`` are ``chain_verify``'s (int, or tensors as it takes them).
    """
    batch_size, max_drafts = draft_token_ids.shape
    device = target_probs.device
    keys = rng.RequestKeys(seed, offset, batch_size, device)
    positions = torch.arange(max_drafts, device=device)
    # [B, K, 2]: index 0 is chain_verify's uniform at each position, index 1 the second judgement's.
    words = keys.words(rng.ACCEPT_STREAM, positions.view(1, -1, 1), torch.arange(2, device=device).view(1, 1, 2))
    uniforms = rng.uniform_from_word(words[0])
    emitted = num_accepted.to(torch.int64)
    after_prefix = positions.view(1, -1) >= emitted.view(-1, 1)
    uniform = torch.where(positions.view(1, -1) == emitted.view(-1, 1), uniforms[..., 1], uniforms[..., 0])
    token_ids = draft_token_ids.to(torch.int64)
    valid = (token_ids >= 0) & (token_ids < target_probs.shape[-1])
    safe_ids = torch.where(valid, token_ids, 0).unsqueeze(-1)
    target_at = target_probs[:, :max_drafts].gather(-1, safe_ids).squeeze(-1).to(torch.float32)
    draft_at = draft_probs.gather(-1, safe_ids).squeeze(-1).to(torch.float32)
    judged = valid & after_prefix & _rows.acceptance(uniform, target_at, draft_at)[0]
    return (emitted + judged.sum(dim=-1)).to(torch.int32), num_accepted.to(torch.int32)


def _add_into(counter, count):
    if counter is None:
        return count
    return counter.add_(count)


def _random_state(check, seed, offset, generator, batch_size, device):
    """FlashInfer's ``seed``/``offset``/``generator`` as ``chain_verify``'s ``(seed, offset)`` (module docstring)."""
    if seed is None or offset is None:  # FlashInfer's rule: the pair, or else the generator
        if generator is None:
            return _validation.fresh_seed(OP_NAME, device), 0
        if not isinstance(generator, torch.Generator):
            check.fail(f"`generator` must be a torch.Generator or None; got {type(generator).__name__}", TypeError)
        if generator.device.type == "cpu":  # a host draw: no device is touched
            return int(_validation.device_seeds((), "cpu", generator)), 0
        if generator.device != device:
            check.fail(f"`generator` must be on the CPU or on the tensors' device {device}; got one on "
                       f"{generator.device}")
        drawn = _validation.device_seeds((1,), device, generator)
        return _per_request(drawn, 0, batch_size)
    if isinstance(seed, torch.Tensor) != isinstance(offset, torch.Tensor):
        check.fail(f"`seed` and `offset` must both be tensors or both be ints; got {type(seed).__name__} and "
                   f"{type(offset).__name__}", TypeError)
    if not isinstance(seed, torch.Tensor):
        for name, value in (("seed", seed), ("offset", offset)):
            if isinstance(value, bool) or not hasattr(value, "__index__"):
                check.fail(f"`{name}` must be an int or a tensor; got {type(value).__name__}", TypeError)
        return int(seed), int(offset)
    for name, value in (("seed", seed), ("offset", offset)):
        if value.dtype not in (torch.int64, torch.uint64):
            check.fail(f"`{name}` must have dtype int64 or uint64; got {str(value.dtype).replace('torch.', '')}",
                       TypeError)
        if value.dim() != 1 or value.shape[0] not in (1, batch_size):
            check.fail(f"`{name}` must have shape [1] or [B] = [{batch_size}]; got {list(value.shape)}")
        if value.device != device:
            check.fail(f"`{name}` must be on {device}; got {value.device}")
    return _per_request(seed, offset, batch_size)


def _per_request(seed, offset, batch_size):
    """A device seed (and offset) read at entry 0, as per-request tensors that draw what the ints would draw."""
    # Contiguous: the kernels read seed_ptr + b (an expanded view has one element behind it).
    seed64 = seed[:1].view(torch.int64).expand(batch_size).contiguous()
    shifted = torch.arange(batch_size, dtype=torch.int64, device=seed.device).bitwise_left_shift_(32)
    first_offset = offset[:1].view(torch.int64) if isinstance(offset, torch.Tensor) else offset
    return seed64, shifted.bitwise_xor_(first_offset)
