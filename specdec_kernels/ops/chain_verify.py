"""``sk.chain_verify``: validate, allocate, dispatch."""

from __future__ import annotations

import torch

from .. import _library, _validation
from .._verify_options import LOGPROBS_KINDS, VerifyOptions
from ..launchers.chain_verify import cuda_chain_verify, triton_chain_verify
from ..reference import _logprobs, chain_verify as reference

OP_NAME = "chain_verify"


def chain_verify(
    draft_token_ids,
    target,
    draft=None,
    *,
    num_draft_tokens=None,
    temperature=None,
    logits=False,
    seed=None,
    offset=0,
    top_k=None,
    top_p=None,
    min_p=None,
    bonus_token_ids=None,
    logprobs=None,
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
    num_draft_tokens : Tensor, int32 or int64, optional
        Drafts per request, ``0 <= n_b <= K``; default ``K``.
    temperature : Tensor, float32, or a real number, optional
        Per-request temperature, or one Python or numpy number for the batch.
        ``T_b > 0`` samples; any other value (``0``, a negative marker such as
        vLLM's ``-1``, NaN in a tensor) makes request ``b`` greedy; ``None``
        is ``T = 1`` for all; a Python NaN raises ``ValueError``. With
        ``logits=True`` the distributions are ``softmax(x / T_b)``.
    logits : bool
        ``target`` holds logits (then ``softmax(x / T_b)``). ``draft`` is
        always probabilities, the distribution its tokens were drawn from
        (v1.3; before, the flag covered both).
    seed : None, int or Tensor
        ``None`` (default): a fresh 63-bit seed drawn from torch's default CPU
        generator when the op runs, so ``torch.manual_seed`` makes runs
        repeatable and no two calls share numbers; no device is touched, and
        under CUDA-graph capture it raises (the drawn value would repeat on
        every replay). An int (numpy integers too) is one seed for the batch;
        an int64 tensor ``[B]`` holds one per request.
    offset : int or Tensor
        int, or int64 ``[]``/``[B]`` read on the device (advance it between
        CUDA-graph replays). Under ``torch.compile`` a stepping Python int
        (or int ``seed``) costs one recompilation, when its second value
        makes it symbolic, not one per step.
    top_k : Tensor int32/int64 ``[B]``, int, or None
        Keep the ``top_k`` most probable tokens of every target row (ties at
        the threshold kept); ``0`` or ``>= V`` = off. A Python int below 0
        raises; a tensor entry below 0 is off for its request.
    top_p : Tensor float32 ``[B]``, float, or None
        Then keep the smallest set of most probable tokens whose mass reaches
        ``top_p``; ``1`` = off. A Python float outside ``(0, 1]`` raises; a
        tensor entry outside it (NaN included) is off for its request.
    min_p : Tensor float32 ``[B]``, float, or None
        Then drop tokens below ``min_p`` times the row's largest probability;
        ``0`` = off; outside ``[0, 1]``: raises (Python) or off (entry). The truncated target is renormalised and verification is
        exact with respect to it (``docs/algorithms.md``); a request with
        every parameter off pays nothing.
    bonus_token_ids : Tensor int32/int64 ``[B]`` or None
        A request whose drafts are all accepted emits this token (from the engine's own sampler)
        instead of sampling or taking the argmax (greedy requests too); that row is then not read. An id
        outside ``[0, V)`` is no bonus: that request samples its bonus row.
    logprobs : {None, "raw", "processed"}
        Also return ``output_logprobs`` (float32, the shape of the tokens):
        the natural log of each emitted token's probability under the target
        row it was emitted from, that row as given (``"raw"``:
        ``log_softmax`` of logits, the log of a probability) or as
        verification used it (``"processed"``: after temperature and
        truncation; greedy requests report the raw value); ``-inf`` where the
        token is ``-1``. On the reference and Triton backends so far (CUDA
        raises ``NotImplementedError`` naming itself; ``"auto"`` passes over
        it).
    backend : {"auto", "reference", "triton", "cuda"}
    validate : bool
        Check token ids, counts, temperatures and the distributions' values
        (no NaN; probabilities finite and >= 0, rows summing to 1 within 1e-3;
        logits not +inf) on the host
        (synchronises) and raise.

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
    num_draft_tokens = check.counts("num_draft_tokens", num_draft_tokens, batch_size)
    temperature = check_sampling_arguments(check, batch_size, vocab_size, temperature, logits, seed, offset)
    sampling_parameters = check.sampling_parameters(top_k, top_p, min_p, bonus_token_ids, batch_size)
    if logprobs is not None:
        check.choice("logprobs", logprobs, LOGPROBS_KINDS)
    resolved = _library.verification_backend(OP_NAME, logprobs, backend, target.device)
    if validate:
        _validate_values(check, draft_token_ids, num_draft_tokens, max_drafts, vocab_size)
        check.sampling_values(temperature, logits, target, draft)
        check.sampling_parameter_values(*sampling_parameters, vocab_size)
    seed_tensor, seed_int, offset_tensor, offset_int = _validation.split_random_state(seed, offset)
    return _library.run_verification(
        OP_NAME, logprobs, draft_token_ids, target, draft, num_draft_tokens, temperature, logits,
        seed_tensor, seed_int, offset_tensor, offset_int, *sampling_parameters, resolved,
    )


def check_sampling_arguments(check, batch_size, vocab_size, temperature, logits, seed, offset):
    """The checks ``chain_verify`` and ``chain_verify_packed`` share once their layouts gave ``B`` and ``V``.

    Returns ``temperature`` as the ops take it (``None`` or float32 ``[B]``).
    """
    temperature = check.temperature(temperature, batch_size)
    if not isinstance(logits, bool):
        check.fail(f"`logits` must be a bool; got {type(logits).__name__}", TypeError)
    if vocab_size < 1:
        check.fail("`target` must have a vocabulary of at least 1 (V >= 1); got V = 0")
    check.random_state(batch_size, seed, offset)
    return temperature


def _validate_values(check, draft_token_ids, num_draft_tokens, max_drafts, vocab_size):
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


def _reference(draft_token_ids, target, draft, num_draft_tokens, *bundle):
    options = VerifyOptions(*bundle)
    return reference.chain_verify(draft_token_ids, target, draft, num_draft_tokens, options.temperature,
                                  options.logits, *options.random_state, *options.parameters)


def _fake(draft_token_ids, target, *args):
    batch_size, rows, _ = target.shape
    output = target.new_empty((batch_size, rows), dtype=torch.int32)
    return output, target.new_empty((batch_size,), dtype=torch.int32)


def _reference_logprobs(draft_token_ids, target, draft, num_draft_tokens, *bundle):
    output, num_accepted = _reference(draft_token_ids, target, draft, num_draft_tokens, *bundle)
    rows = torch.arange(output.shape[1], device=output.device).expand_as(output)  # token j: row j
    options = VerifyOptions(*bundle)
    return output, num_accepted, _logprobs.emitted_logprobs(options.logprobs, target, rows, output, options)


def _fake_logprobs(draft_token_ids, target, *args):
    output, num_accepted = _fake(draft_token_ids, target, *args)
    return output, num_accepted, output.new_empty(output.shape, dtype=torch.float32)


_library.register(OP_NAME, {"reference": _reference, "triton": triton_chain_verify, "cuda": cuda_chain_verify}, _fake)
_library.register(f"{OP_NAME}.logprobs", {"reference": _reference_logprobs, "triton": triton_chain_verify},
                  _fake_logprobs)
