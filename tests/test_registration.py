"""Every op is a registered torch op, callable directly and inside CUDA graphs.

``torch.library.opcheck``: test_opcheck.py; ``torch.compile``: test_compile.py.
"""

import pytest
import torch

import specdec_kernels as sk
from conftest import backend_or_skip
from op_inputs import cache_inputs, chain_inputs, tree_inputs
from specdec_kernels import _library


def test_every_op_in_the_contract_is_registered():
    for name in ("chain_verify", "chain_verify_packed", "tree_verify", "build_tree", "tree_attention", "compact_kv"):
        assert hasattr(torch.ops.specdec, name)
        assert name in _library.SCHEMAS


@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_chain_verify_in_a_cuda_graph_draws_fresh_numbers_per_offset(backend, device):
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    backend_or_skip("chain_verify", backend)
    draft_ids, target, draft = chain_inputs(device, batch_size=8, max_drafts=4, vocab_size=32000)
    offset = torch.tensor(0, device=device)
    # Warm up on the capture stream: compiles the kernel and allocates that
    # stream's workspace outside the capture.
    capture_stream = torch.cuda.Stream()
    with torch.cuda.stream(capture_stream):
        sk.chain_verify(draft_ids, target, draft, seed=5, offset=offset, backend=backend)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=capture_stream):
        tokens, accepted = sk.chain_verify(draft_ids, target, draft, seed=5, offset=offset, backend=backend)
    outputs = []
    for step in range(4):
        offset.fill_(step)
        graph.replay()
        expected = sk.chain_verify(draft_ids, target, draft, seed=5, offset=step, backend="reference")
        assert torch.equal(tokens, expected[0]) and torch.equal(accepted, expected[1])
        outputs.append(tokens.clone())
    assert any(not torch.equal(outputs[0], later) for later in outputs[1:])


def test_direct_torch_ops_calls_take_the_public_leading_arguments(device):
    """Schemas carry defaults, and "auto" is resolved inside the op."""
    draft_ids, target, draft = chain_inputs(device)
    direct = torch.ops.specdec.chain_verify(draft_ids, target, draft, seed=7, offset=2)
    public = sk.chain_verify(draft_ids, target, draft, seed=7, offset=2)
    assert torch.equal(direct[0], public[0]) and torch.equal(direct[1], public[1])
    tokens, parents, tree_target = tree_inputs(device)
    assert all(torch.equal(a, b) for a, b in zip(torch.ops.specdec.tree_verify(tokens, parents, tree_target, seed=1),
                                                 sk.tree_verify(tokens, parents, tree_target, seed=1)))
    assert all(torch.equal(a, b) for a, b in zip(torch.ops.specdec.build_tree(parents), sk.build_tree(parents)))
    q, k_cache, v_cache, tables, lens = cache_inputs(device)
    mask = sk.build_tree(parents).mask
    assert torch.equal(torch.ops.specdec.tree_attention(q, k_cache, v_cache, tables, lens, mask),
                       sk.tree_attention(q, k_cache, v_cache, tables, lens, mask))


# ----------------------------------------------------------------------------- the public call's path

def _chain_call(device):
    draft_ids, target, draft = chain_inputs(device, batch_size=3, max_drafts=2, vocab_size=50)
    return lambda: sk.chain_verify(draft_ids, target, draft, seed=4, offset=1, backend="reference")


def test_plain_eager_calls_skip_the_torch_dispatcher(device, monkeypatch):
    """The public functions call the op's dispatch function directly (_library.run) in plain eager mode."""
    call = _chain_call(device)
    expected = call()

    def unexpected(*args):
        raise AssertionError("went through torch.ops")

    monkeypatch.setitem(_library._OVERLOADS, "chain_verify", unexpected)
    for got, want in zip(call(), expected):
        assert torch.equal(got, want)


def test_a_dispatch_mode_sees_the_op(device):
    """Under a TorchDispatchMode (as FakeTensorMode and torch.export use) the call goes through torch.ops."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    call = _chain_call(device)
    expected = call()
    with Recorder():
        result = call()
    assert "specdec.chain_verify.default" in seen
    for got, want in zip(result, expected):
        assert torch.equal(got, want)


def test_the_profiler_records_the_op(device):
    call = _chain_call(device)
    with torch.profiler.profile() as profile:
        call()
    assert any(event.name == "specdec::chain_verify" for event in profile.events())
