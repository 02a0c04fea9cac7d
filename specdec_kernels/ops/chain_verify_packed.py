"""``sk.chain_verify_packed``: validate, allocate, dispatch (the packed ragged layout of ``chain_verify``)."""

from __future__ import annotations

import torch

from .. import _library, _validation
from .._verify_options import LOGPROBS_KINDS, VerifyOptions
from ..launchers.chain_verify import cuda_chain_verify_packed, triton_chain_verify_packed
from ..reference import _logprobs, chain_verify_packed as reference
from .chain_verify import check_sampling_arguments

OP_NAME = "chain_verify_packed"


def chain_verify_packed(
    draft_token_ids,
    cu_num_draft_tokens,
    target,
    draft=None,
    *,
    max_num_draft_tokens,
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
    """Exact speculative verification of chain drafts given in the packed ragged layout.

    The same decisions and tokens as :func:`specdec_kernels.chain_verify` on
    the padded equivalent (request ``b``'s rows moved to ``[b, 0..n_b]``,
    ``num_draft_tokens = n_b``) under the same ``seed``/``offset``, bit for
    bit with probabilities. The kernels read the packed rows in place (no
    padded copy) and read ``cu_num_draft_tokens`` on the device: the call
    never synchronises.

    Parameters
    ----------
    draft_token_ids : Tensor, int32 or int64
        The drafts of all requests concatenated. An id outside ``[0, V)``
        (e.g. ``-1``) is a rejection.
    cu_num_draft_tokens : Tensor, int32 or int64
        ``0, n_0, n_0 + n_1, ...``: request ``b``'s drafts are
        ``draft_token_ids[cu[b]:cu[b+1]]``. Any other values have a defined
        outcome (counts clamped into ``[0, K]``, rows into range; see
        ``reference/chain_verify_packed.packed_requests``); ``validate=True``
        raises on them instead.
    target : Tensor, float32, bfloat16 or float16
        ``[T+B, V]``: request ``b``'s ``n_b + 1`` rows, contiguous from row
        ``cu[b] + b``: its draft positions, then its bonus row. Or, with
        ``bonus_token_ids``, ``[T, V]`` (vLLM's ``target_logits``): request
        ``b``'s draft positions only, rows ``cu[b] .. cu[b+1] - 1``; a request
        that accepts all its drafts emits its bonus id, ``-1`` for an id
        outside ``[0, V)``.
    draft : Tensor or None
        Request ``b``'s rows ``cu[b] .. cu[b+1] - 1``: the distribution each
        draft token was sampled from; ``None`` verifies the drafts as
        deterministic (one-hot) proposals.
    max_num_draft_tokens : int
        ``K >= max(n_b)``; the width of the output is ``K + 1``.
    temperature, logits, seed, offset, backend
        As for :func:`specdec_kernels.chain_verify`.
    validate : bool
        Also check on the host (synchronises) that ``cu`` starts at 0, never
        decreases, ends at ``T`` and has every ``n_b <= K``, that the ids lie
        in ``[0, V)``, and the temperatures and distributions' values; raise
        ``ValueError`` otherwise.
    logprobs : {None, "raw", "processed"}
        As in :func:`specdec_kernels.chain_verify`: one more output, each emitted
        token's log-probability under the row it was emitted from; NaN for a
        bonus id emitted in the bonus-free layout (its row was not given).
        On the reference and Triton backends so far.

    Returns
    -------
    output_token_ids : Tensor, int32 ``[B, K+1]``
        Accepted drafts, then the target's token, then ``-1``.
    num_accepted : Tensor, int32 ``[B]``

    Shape
    -----
    ``draft_token_ids [T]`` (``T = sum(n_b)``), ``cu_num_draft_tokens [B+1]``,
    ``target [T+B, V]`` (or ``[T, V]`` with ``bonus_token_ids [B]``), ``draft [T, V]``, ``temperature [B]``.

    Examples
    --------
    >>> import torch, specdec_kernels as sk
    >>> cu = torch.tensor([0, 3, 3, 5])  # three requests with 3, 0 and 2 drafts
    >>> target = torch.softmax(torch.randn(5 + 3, 50), -1)
    >>> draft = torch.softmax(torch.randn(5, 50), -1)
    >>> ids = torch.multinomial(draft, 1).view(5)
    >>> tokens, accepted = sk.chain_verify_packed(ids, cu, target, draft, max_num_draft_tokens=4, seed=1)
    >>> tokens.shape, accepted.shape
    (torch.Size([3, 5]), torch.Size([3]))
    """
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"{OP_NAME}: `target` must be a torch.Tensor; got {type(target).__name__}")
    check = _validation.Checker(OP_NAME, target.device)
    check.tensor("draft_token_ids", draft_token_ids, (None,), _validation.TOKEN_DTYPES, "[T]")
    check.tensor("cu_num_draft_tokens", cu_num_draft_tokens, (None,), _validation.TOKEN_DTYPES, "[B+1]")
    check.tensor("target", target, (None, None), _validation.FLOAT_DTYPES, "[T+B, V]")
    num_tokens = draft_token_ids.shape[0]
    batch_size = cu_num_draft_tokens.shape[0] - 1
    rows, vocab_size = target.shape
    if batch_size < 0:
        check.fail("`cu_num_draft_tokens` must have shape [B+1] with B+1 >= 1; got [0]")
    if rows != num_tokens + batch_size and (bonus_token_ids is None or rows != num_tokens):
        check.fail(
            f"`target` must have T + B = {num_tokens} + {batch_size} = {num_tokens + batch_size} rows "
            f"(T = draft_token_ids.shape[0], B = cu_num_draft_tokens.shape[0] - 1), or T = {num_tokens} rows "
            f"without bonus rows when `bonus_token_ids` is given; got shape {list(target.shape)}"
        )
    check.optional_tensor("draft", draft, (num_tokens, vocab_size), _validation.FLOAT_DTYPES, "[T, V]")
    max_drafts = max_num_draft_tokens
    if not isinstance(max_drafts, int) or isinstance(max_drafts, bool):
        check.fail(f"`max_num_draft_tokens` must be an int; got {type(max_drafts).__name__}", TypeError)
    if max_drafts < 0:
        check.fail(f"`max_num_draft_tokens` must be >= 0; got {max_drafts}")
    temperature = check_sampling_arguments(check, batch_size, vocab_size, temperature, logits, seed, offset)
    sampling_parameters = check.sampling_parameters(top_k, top_p, min_p, bonus_token_ids, batch_size)
    if logprobs is not None:
        check.choice("logprobs", logprobs, LOGPROBS_KINDS)
    resolved = _library.verification_backend(OP_NAME, logprobs, backend, target.device)
    if validate:
        _validate_values(check, draft_token_ids, cu_num_draft_tokens, max_drafts, vocab_size)
        check.sampling_values(temperature, logits, target, draft)
        check.sampling_parameter_values(*sampling_parameters, vocab_size)
    seed_tensor, seed_int, offset_tensor, offset_int = _validation.split_random_state(seed, offset)
    return _library.run_verification(
        OP_NAME, logprobs, draft_token_ids, cu_num_draft_tokens, target, draft, max_drafts, temperature, logits,
        seed_tensor, seed_int, offset_tensor, offset_int, *sampling_parameters, resolved,
    )


def _validate_values(check, draft_token_ids, cu_num_draft_tokens, max_drafts, vocab_size):
    num_tokens = draft_token_ids.shape[0]
    cu = cu_num_draft_tokens.tolist()  # B + 1 ints, one synchronisation
    if cu[0] != 0:
        check.fail(f"`cu_num_draft_tokens` must start at 0; got cu[0] = {cu[0]}")
    for request, (start, end) in enumerate(zip(cu[:-1], cu[1:])):
        if end < start:
            check.fail(f"`cu_num_draft_tokens` must be non-decreasing; cu[{request + 1}] = {end} < "
                       f"cu[{request}] = {start}")
        if end - start > max_drafts:
            check.fail(f"request {request} has {end - start} drafts (cu[{request + 1}] - cu[{request}]), more than "
                       f"max_num_draft_tokens = {max_drafts}")
    if cu[-1] != num_tokens:
        check.fail(f"`cu_num_draft_tokens` must end at T = draft_token_ids.shape[0] = {num_tokens}; "
                   f"got cu[B] = {cu[-1]}")
    bad = (draft_token_ids < 0) | (draft_token_ids >= vocab_size)
    if bool(bad.any()):
        index = int(bad.nonzero()[0, 0])
        check.fail(f"`draft_token_ids` must lie in [0, V) = [0, {vocab_size}); draft_token_ids[{index}] = "
                   f"{int(draft_token_ids[index])}")


def _reference(draft_token_ids, cu_num_draft_tokens, target, draft, max_drafts, *bundle):
    options = VerifyOptions(*bundle)
    return reference.chain_verify_packed(draft_token_ids, cu_num_draft_tokens, target, draft, max_drafts,
                                         options.temperature, options.logits, *options.random_state,
                                         *options.parameters)


def _fake(draft_token_ids, cu_num_draft_tokens, target, draft, max_drafts, *args):
    batch_size = cu_num_draft_tokens.shape[0] - 1
    output = target.new_empty((batch_size, max_drafts + 1), dtype=torch.int32)
    return output, target.new_empty((batch_size,), dtype=torch.int32)


def _reference_logprobs(draft_token_ids, cu_num_draft_tokens, target, draft, max_drafts, *bundle):
    output, num_accepted = _reference(draft_token_ids, cu_num_draft_tokens, target, draft, max_drafts, *bundle)
    start, num_drafts = reference.packed_requests(cu_num_draft_tokens, draft_token_ids.shape[0], max_drafts)
    bonus_rows = target.shape[0] == draft_token_ids.shape[0] + output.shape[0]
    padded = reference.padded_target_rows(target, start, num_drafts, max_drafts, bonus_rows)
    positions = torch.arange(max_drafts + 1, device=output.device).expand_as(output)  # token j: padded row j
    given = None if bonus_rows else positions < num_drafts.view(-1, 1)
    options = VerifyOptions(*bundle)
    return output, num_accepted, _logprobs.emitted_logprobs(options.logprobs, padded, positions, output, options,
                                                            given)


def _fake_logprobs(draft_token_ids, cu_num_draft_tokens, target, draft, max_drafts, *args):
    output, num_accepted = _fake(draft_token_ids, cu_num_draft_tokens, target, draft, max_drafts, *args)
    return output, num_accepted, output.new_empty(output.shape, dtype=torch.float32)


_library.register(
    OP_NAME,
    {"reference": _reference, "triton": triton_chain_verify_packed, "cuda": cuda_chain_verify_packed},
    _fake,
)
_library.register(f"{OP_NAME}.logprobs", {"reference": _reference_logprobs, "triton": triton_chain_verify_packed},
                  _fake_logprobs)
