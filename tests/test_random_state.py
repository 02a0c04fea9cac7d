"""``seed=None`` (a fresh seed per call from torch's default CPU generator) and the forms of seed and offset."""

import numpy as np
import pytest
import torch

import specdec_kernels as sk
from conftest import backend_or_skip
from op_inputs import chain_inputs, tree_inputs
from specdec_kernels import _validation

BACKENDS = ["reference", "triton", "cuda"]


def bonus_inputs(device):
    """8 requests without drafts, each emitting a sample of a 1000-token row: two different seeds
    give the same 8 tokens with probability prod_b sum_v p[b, v]**2 = 5e-21."""
    return chain_inputs(device, batch_size=8, max_drafts=0, vocab_size=1000)


@pytest.mark.parametrize("backend", BACKENDS)
def test_seed_none_is_repeatable_under_manual_seed_and_fresh_per_call(backend, device):
    backend_or_skip("chain_verify", backend)
    draft_ids, target, draft = bonus_inputs(device)
    torch.manual_seed(3)
    first = [sk.chain_verify(draft_ids, target, draft, backend=backend)[0] for _ in range(3)]
    torch.manual_seed(3)
    again = [sk.chain_verify(draft_ids, target, draft, backend=backend)[0] for _ in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[0], first[1]) and not torch.equal(first[1], first[2])


@pytest.mark.parametrize("backend", BACKENDS)
def test_seed_none_is_the_int_seed_drawn_from_the_cpu_generator(backend, device):
    """The same numbers as an explicit seed drawn from the generator in the
    same state, on every backend (so backends agree under ``manual_seed``)."""
    backend_or_skip("tree_verify", backend)
    tokens, parents, target = tree_inputs(device)
    torch.manual_seed(8)
    drawn = _validation.fresh_seed("test", torch.device("cpu"))
    assert 0 <= drawn < 2**63 - 1
    torch.manual_seed(8)
    implicit = sk.tree_verify(tokens, parents, target, offset=2, backend=backend)
    explicit = sk.tree_verify(tokens, parents, target, seed=drawn, offset=2, backend="reference")
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(implicit, explicit))


def test_direct_op_calls_draw_too(device):
    draft_ids, target, draft = bonus_inputs(device)
    torch.manual_seed(4)
    direct = torch.ops.specdec.chain_verify(draft_ids, target, draft)
    torch.manual_seed(4)
    public = sk.chain_verify(draft_ids, target, draft)
    assert torch.equal(direct[0], public[0])


def test_seed_none_reads_no_tensor_value_but_the_drawn_seed(monkeypatch, device):
    """The only host read is the CPU scalar the seed is drawn into: no value
    of the op's tensors, so no device synchronisation on a GPU."""
    # On a CPU the reference may read values (it is no GPU path): test the kernel path there.
    backend = backend_or_skip("chain_verify", "triton") if device.type == "cpu" else "auto"
    draft_ids, target, draft = bonus_inputs(device)
    sk.chain_verify(draft_ids, target, draft, seed=1, backend=backend)  # compile the kernel first
    inputs = {draft_ids.data_ptr(), target.data_ptr(), draft.data_ptr()}
    reads = []

    def recording(name):
        original = getattr(torch.Tensor, name)

        def read(tensor, *args, **kwargs):
            reads.append((tensor.device.type, tensor.dim(), tensor.data_ptr() in inputs))
            return original(tensor, *args, **kwargs)

        return read

    for name in ("item", "tolist", "__int__", "__float__", "__bool__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, recording(name))
    sk.chain_verify(draft_ids, target, draft, backend=backend)
    monkeypatch.undo()
    assert reads == [("cpu", 0, False)]


def test_capture_state_is_read_only_for_cuda_tensors(monkeypatch):
    def no_cuda():
        raise AssertionError("CUDA was queried for CPU tensors")

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", no_cuda)
    draft_ids, target, draft = bonus_inputs(torch.device("cpu"))
    sk.chain_verify(draft_ids, target, draft, backend="reference")


def test_seed_none_under_capture_raises(monkeypatch):
    """The branch taken under CUDA-graph capture, without a GPU: the capture
    query is patched (the real capture is the GPU-only test below)."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match=r"chain_verify: seed=None .* CUDA graph .* int64 tensor"):
        _validation.fresh_seed("chain_verify", torch.device("cuda", 0))


@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_seed_none_in_a_real_cuda_graph_capture_raises(backend, device):
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    backend_or_skip("chain_verify", backend)
    draft_ids, target, draft = chain_inputs(device)
    capture_stream = torch.cuda.Stream()
    with torch.cuda.stream(capture_stream):
        sk.chain_verify(draft_ids, target, draft, seed=1, backend=backend)  # compile and allocate outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="seed=None"):
        with torch.cuda.graph(graph, stream=capture_stream):
            sk.chain_verify(draft_ids, target, draft, backend=backend)


def test_numpy_integers_are_seeds_and_offsets(device):
    draft_ids, target, draft = bonus_inputs(device)
    expected = sk.chain_verify(draft_ids, target, draft, seed=7, offset=3, backend="reference")
    for seed, offset in ((np.int64(7), np.int64(3)), (np.int32(7), np.uint8(3)), (7, np.int16(3))):
        actual = sk.chain_verify(draft_ids, target, draft, seed=seed, offset=offset, backend="reference")
        assert torch.equal(actual[0], expected[0])
    tokens, parents, tree_target = tree_inputs(device)
    assert torch.equal(sk.tree_verify(tokens, parents, tree_target, seed=np.uint64(2**63 + 5), backend="reference")[1],
                       sk.tree_verify(tokens, parents, tree_target, seed=-(2**63) + 5, backend="reference")[1])


@pytest.mark.parametrize("bad", [1.5, np.float64(2.0), True, np.bool_(True), "3"])
def test_seeds_and_offsets_that_are_not_integers_are_refused(bad, device):
    draft_ids, target, draft = bonus_inputs(device)
    with pytest.raises(TypeError, match=r"`seed` must be None, an int or an int64 tensor of shape \[B\]"):
        sk.chain_verify(draft_ids, target, draft, seed=bad)
    with pytest.raises(TypeError, match=r"`offset` must be an int or an int64 tensor"):
        sk.tree_verify(*tree_inputs(device), seed=1, offset=bad)
