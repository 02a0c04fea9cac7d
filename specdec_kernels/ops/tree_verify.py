"""``sk.tree_verify``: validate, allocate, dispatch."""

from __future__ import annotations

import torch

from .. import _library, _validation
from .._verify_options import LOGPROBS_KINDS, VerifyOptions
from ..launchers.tree_verify import cuda_tree_verify, triton_tree_verify
from ..reference import _logprobs, tree_verify as reference

OP_NAME = "tree_verify"
DRAFT_SAMPLING = ("without_replacement", "with_replacement")


def tree_verify(
    tree_token_ids,
    parents,
    target,
    draft=None,
    *,
    num_nodes=None,
    temperature=None,
    logits=False,
    draft_sampling="without_replacement",
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
    """Exact speculative verification of a draft tree.

    From the root, children are tried in increasing node index; child ``c``
    is accepted with probability ``min(1, p(c)/q(c))`` under the current
    residual target ``p`` and proposal ``q``. A rejection sets
    ``p <- normalise(max(0, p - q))`` (and, without replacement, removes the
    child's token from ``q``). When every child is rejected, or at a leaf,
    one token is drawn from the current ``p``. The emitted tokens follow the
    target exactly in every draft mode.

    Parameters
    ----------
    tree_token_ids : Tensor, int32 or int64 ``[B, N]``
        Token of each node; node 0 is the root (last committed token).
    parents : Tensor, int32 or int64 ``[B, N]``
        ``parents[b, 0] == -1`` and ``0 <= parents[b, i] < i``. Nodes whose
        parent breaks this are never visited (``validate=True`` raises).
    target : Tensor ``[B, N, V]``
        Target distribution following each node.
    draft : Tensor ``[B, N, V]`` or None
        Distribution node ``i``'s children were drawn from; ``None``:
        deterministic candidates (top-k trees).
    num_nodes : Tensor, int32 or int64 ``[B]``, optional
        Nodes per request, ``1 <= n_b <= N``.
    temperature, logits, seed, offset, top_k, top_p, min_p, backend, validate
        As in :func:`specdec_kernels.chain_verify`; the truncation applies
        to every node's target row.
    bonus_token_ids : Tensor int32/int64 ``[B]`` or None
        A request whose accepted path ends where no child was rejected (a
        leaf: as a chain whose drafts were all accepted) emits this token
        instead of sampling or taking the argmax (greedy requests too);
        that row is then not read.
    draft_sampling : {"without_replacement", "with_replacement"}
        How the children of a node were drawn from ``draft``.
    logprobs : {None, "raw", "processed"}
        As in :func:`specdec_kernels.chain_verify`: one more output, each emitted
        token's log-probability under the row it was emitted from (its path
        node's row). On the reference and Triton backends so far.

    Returns
    -------
    accepted_nodes : Tensor, int32 ``[B, N]``
        The accepted path's node indices, starting with 0, then ``-1``.
    output_token_ids : Tensor, int32 ``[B, N]``
        Tokens of the accepted nodes after the root, then the emitted token.
    num_accepted : Tensor, int32 ``[B]``
        Accepted nodes after the root.

    Examples
    --------
    >>> import torch, specdec_kernels as sk
    >>> parents = torch.tensor([[-1, 0, 0, 1]], dtype=torch.int32)
    >>> tokens = torch.tensor([[5, 1, 2, 3]])
    >>> target = torch.softmax(torch.randn(1, 4, 8), -1)
    >>> nodes, out, count = sk.tree_verify(tokens, parents, target, seed=3)
    >>> int(nodes[0, 0])
    0
    """
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"{OP_NAME}: `target` must be a torch.Tensor; got {type(target).__name__}")
    check = _validation.Checker(OP_NAME, target.device)
    check.tensor("target", target, (None, None, None), _validation.FLOAT_DTYPES, "[B, N, V]")
    batch_size, max_nodes, vocab_size = target.shape
    if max_nodes < 1 or vocab_size < 1:
        check.fail(f"`target` must have shape [B, N, V] with N >= 1 and V >= 1; got {list(target.shape)}")
    check.tensor("tree_token_ids", tree_token_ids, (batch_size, max_nodes), _validation.TOKEN_DTYPES, "[B, N]")
    check.tensor("parents", parents, (batch_size, max_nodes), _validation.TOKEN_DTYPES, "[B, N]")
    check.optional_tensor("draft", draft, (batch_size, max_nodes, vocab_size), _validation.FLOAT_DTYPES, "[B, N, V]")
    num_nodes = check.counts("num_nodes", num_nodes, batch_size)
    temperature = check.temperature(temperature, batch_size)
    if not isinstance(logits, bool):
        check.fail(f"`logits` must be a bool; got {type(logits).__name__}", TypeError)
    check.choice("draft_sampling", draft_sampling, DRAFT_SAMPLING)
    check.random_state(batch_size, seed, offset)
    sampling_parameters = check.sampling_parameters(top_k, top_p, min_p, bonus_token_ids, batch_size)
    if logprobs is not None:
        check.choice("logprobs", logprobs, LOGPROBS_KINDS)
    resolved = _library.verification_backend(OP_NAME, logprobs, backend, target.device)
    if validate:
        try:
            reference.validate_tree(parents, num_nodes, tree_token_ids, vocab_size)
        except ValueError as error:
            check.fail(str(error))
        check.sampling_values(temperature, logits, target, draft)
        check.sampling_parameter_values(*sampling_parameters, vocab_size)
    seed_tensor, seed_int, offset_tensor, offset_int = _validation.split_random_state(seed, offset)
    return _library.run_verification(
        OP_NAME, logprobs, tree_token_ids, parents, target, draft, num_nodes, temperature, logits, draft_sampling,
        seed_tensor, seed_int, offset_tensor, offset_int, *sampling_parameters, resolved,
    )


def _reference(tree_token_ids, parents, target, draft, num_nodes, temperature, logits, draft_sampling, *bundle_tail):
    options = VerifyOptions(temperature, logits, *bundle_tail)
    return reference.tree_verify(tree_token_ids, parents, target, draft, num_nodes, temperature, logits,
                                 draft_sampling, *options.random_state, *options.parameters)


def _fake(tree_token_ids, parents, target, *args):
    batch_size, max_nodes, _ = target.shape
    return (
        target.new_empty((batch_size, max_nodes), dtype=torch.int32),
        target.new_empty((batch_size, max_nodes), dtype=torch.int32),
        target.new_empty((batch_size,), dtype=torch.int32),
    )


def _reference_logprobs(tree_token_ids, parents, target, draft, num_nodes, temperature, logits, draft_sampling,
                        *bundle_tail):
    accepted_nodes, output, num_accepted = _reference(tree_token_ids, parents, target, draft, num_nodes,
                                                      temperature, logits, draft_sampling, *bundle_tail)
    options = VerifyOptions(temperature, logits, *bundle_tail)
    # Token j follows path node j: it was emitted from that node's row.
    return accepted_nodes, output, num_accepted, _logprobs.emitted_logprobs(options.logprobs, target,
                                                                            accepted_nodes, output, options)


def _fake_logprobs(tree_token_ids, parents, target, *args):
    accepted_nodes, output, num_accepted = _fake(tree_token_ids, parents, target, *args)
    return accepted_nodes, output, num_accepted, output.new_empty(output.shape, dtype=torch.float32)


_library.register(OP_NAME, {"reference": _reference, "triton": triton_tree_verify, "cuda": cuda_tree_verify},
                  _fake)
_library.register(f"{OP_NAME}.logprobs", {"reference": _reference_logprobs, "triton": triton_tree_verify},
                  _fake_logprobs)
