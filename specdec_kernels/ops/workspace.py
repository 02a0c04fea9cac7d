"""``sk.reserve_workspace``: allocate the kernels' scratch ahead of CUDA-graph capture."""

from __future__ import annotations

import torch

from .. import _backend, _faults, _workspace
from ..launchers import chain_verify as chain_verify_launchers
from ..launchers import tree_verify as tree_verify_launchers
from ..launchers._shapes import multiprocessor_count


def reserve_workspace(device=None, *, batch_size: int, max_draft_tokens: int, vocab_size: int,
                      logits: bool = False, truncation: bool = True, trees: bool = False,
                      max_tree_nodes: int = 1024, stream=None, for_capture: bool = True) -> None:
    """Reserve the scratch buffers of ``chain_verify`` (and ``tree_verify``) for calls up to the given sizes.

    The fused kernels keep arrival counters and partial results in buffers
    that persist across calls, one set per device and stream. They are
    allocated on first use, which cannot happen inside CUDA-graph capture. A
    captured graph never shares the eager calls' set (it replays on its
    caller's stream, maybe beside them): it uses a capture set, which every
    eager call grows alongside its own, so one call outside capture before
    capturing is enough; an op called under capture with a capture set too
    small for it raises. Call this once, outside capture, with the largest
    sizes a graph will see.

    Parameters
    ----------
    device : torch.device or str, optional
        Default: the current CUDA device.
    batch_size, max_draft_tokens, vocab_size : int
        The largest ``B``, ``K`` and ``V`` of the calls to come.
    logits : bool
        Whether the calls pass logits (they need more scratch, and ``logprobs="raw"`` twice the normalisers).
    truncation : bool
        Whether the calls may pass ``top_k`` / ``top_p`` / ``min_p``. Small
        truncating batches share each row's truncation search among the
        programs of a request through stage records: per request, for at
        most twice as many requests as the GPU has SMs, Triton's
        ``20 * (16 + 32 * next_pow2(K + 1))`` int64 and the CUDA kernel's
        ``192 + 4125 * (K + 1)`` int64 (about 165 KB at ``K = 4``, so about
        43 MB on a 132-SM GPU). ``False`` reserves none (the CUDA kernel's
        logits calls still get 16 words a request, their normalisers' stage);
        a truncating call captured afterwards then raises for want of them.
    trees : bool
        Also reserve for ``tree_verify`` calls of up to ``batch_size``
        requests over ``vocab_size`` tokens: its scratch rows are
        ``2 * B * V`` float32.
    max_tree_nodes : int
        With ``trees``, the largest ``N`` of those calls: small batches
        share each request's vocabulary passes among programs through
        ``N + 1`` records of 128 bytes per request (for at most half as
        many requests as the GPU has SMs).
    stream : torch.cuda.Stream, optional
        The stream the eager calls will run on (default: the current stream).
    for_capture : bool
        With ``stream``: also reserve a capture set of that stream's own, used
        by graphs captured on it (``torch.cuda.graph(g, stream=stream)``).
        Graphs without one (``torch.cuda.graph(g)`` captures on a side stream
        of its own) share the shared capture set, and must not be replayed
        concurrently: concurrent graphs need a capture stream and a set each.

    Examples
    --------
    >>> sk.reserve_workspace("cuda", batch_size=64, max_draft_tokens=4, vocab_size=128256)  # doctest: +SKIP
    >>> with torch.cuda.graph(graph):  # doctest: +SKIP
    ...     tokens, accepted = sk.chain_verify(ids, target, draft, seed=seeds, offset=step)
    """
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    for name, value in (("batch_size", batch_size), ("max_draft_tokens", max_draft_tokens),
                        ("vocab_size", vocab_size), ("max_tree_nodes", max_tree_nodes)):
        if not isinstance(value, int) or value < (1 if name != "max_draft_tokens" else 0):
            raise ValueError(f"reserve_workspace: `{name}` must be a positive int; got {value!r}")
    rows_per_request = max_draft_tokens + 1
    specs = {}
    if _backend.available("chain_verify", "triton", device):
        specs.update(chain_verify_launchers.triton_workspace_specs(
            batch_size, rows_per_request, vocab_size, logits, device, truncation, raw_logprobs=logits))
    if _backend.available("chain_verify", "cuda", device):
        specs.update(chain_verify_launchers.cuda_workspace_specs(
            batch_size, rows_per_request, vocab_size, logits, device, truncation))
    multiprocessors = multiprocessor_count(device) if device.type == "cuda" else None
    if trees and _backend.available("tree_verify", "triton", device):
        specs.update(tree_verify_launchers.triton_workspace_specs(batch_size, max_tree_nodes, vocab_size,
                                                                  multiprocessors))
    if trees and _backend.available("tree_verify", "cuda", device):
        specs.update(tree_verify_launchers.cuda_workspace_specs(batch_size, max_tree_nodes, vocab_size,
                                                                multiprocessors))
    _workspace.reserve(device, specs, stream=stream, for_capture=for_capture)
    _faults.error_counters(device)  # every stream and graph of the device shares them
