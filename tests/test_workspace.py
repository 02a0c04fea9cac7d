"""Workspace lifecycle: reserved ahead, never freed, never allocated under capture.

The GPU-only parts (real graph capture, the helper-thread allocation, pools)
run in ``bench/hazards.py`` on a GPU; here the rules are checked on CPU
tensors, with capture simulated where a rule depends on it.
"""

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import _workspace

DEVICE = torch.device("cpu")


@pytest.fixture(autouse=True)
def fresh_workspaces(monkeypatch):
    monkeypatch.setattr(_workspace, "_buffers", {})
    monkeypatch.setattr(_workspace, "_retired", [])
    monkeypatch.setattr(_workspace, "_shared_capture_user", {})


def test_buffers_persist_and_start_at_zero():
    first = _workspace.buffers(DEVICE, {"op.counters": (4, torch.int32)})["op.counters"]
    assert first.tolist() == [0, 0, 0, 0]
    again = _workspace.buffers(DEVICE, {"op.counters": (3, torch.int32)})["op.counters"]
    assert again.data_ptr() == first.data_ptr()


def test_growth_keeps_the_old_buffer_alive():
    """A graph captured before the growth may still read the old buffer: it must never be freed."""
    small = _workspace.buffers(DEVICE, {"op.scratch": (8, torch.int64)})["op.scratch"]
    large = _workspace.buffers(DEVICE, {"op.scratch": (100, torch.int64)})["op.scratch"]
    assert large.numel() >= 100 and large.data_ptr() != small.data_ptr()
    assert any(retired is small for retired in _workspace._retired)


def test_no_allocation_under_capture(monkeypatch):
    monkeypatch.setattr(_workspace, "_capturing", lambda device: True)
    with pytest.raises(RuntimeError, match="reserve_workspace"):
        _workspace.buffers(DEVICE, {"op.counters": (4, torch.int32)})
    with pytest.raises(RuntimeError, match="before CUDA-graph capture"):
        _workspace.reserve(DEVICE, {"op.counters": (4, torch.int32)})


def test_capture_uses_the_reservation_for_capture(monkeypatch):
    _workspace.reserve(DEVICE, {"op.counters": (16, torch.int32)}, for_capture=True)
    reserved = _workspace._buffers[("op.counters", torch.int32, DEVICE, _workspace._CAPTURE)]
    monkeypatch.setattr(_workspace, "_capturing", lambda device: True)
    monkeypatch.setattr(_workspace, "_stream_key", lambda device: 12345)  # a capture stream never used before
    captured = _workspace.buffers(DEVICE, {"op.counters": (10, torch.int32)})["op.counters"]
    assert captured.data_ptr() == reserved.data_ptr()
    with pytest.raises(RuntimeError, match="needs a workspace of 17"):
        _workspace.buffers(DEVICE, {"op.counters": (17, torch.int32)})


def test_reserve_workspace_checks_its_sizes():
    with pytest.raises(ValueError, match="`vocab_size` must be a positive int"):
        sk.reserve_workspace("cpu", batch_size=1, max_draft_tokens=4, vocab_size=0)


def test_a_reservation_serves_a_captured_call(monkeypatch):
    """reserve_workspace at the largest sizes, then a smaller call "under capture" on a new stream
    allocates nothing and still equals the reference."""
    from conftest import backend_or_skip

    backend = backend_or_skip("chain_verify", "triton")
    sk.reserve_workspace("cpu", batch_size=5, max_draft_tokens=3, vocab_size=2100, logits=True)
    generator = torch.Generator().manual_seed(1)
    target = torch.softmax(torch.randn(3, 3, 1500, generator=generator), -1)
    draft = torch.softmax(torch.randn(3, 2, 1500, generator=generator), -1)
    ids = torch.multinomial(draft.view(-1, 1500), 1, generator=generator).view(3, 2)
    expected = sk.chain_verify(ids, target, draft, seed=4, offset=1, backend="reference")
    reserved = dict(_workspace._buffers)
    monkeypatch.setattr(_workspace, "_capturing", lambda device: True)
    monkeypatch.setattr(_workspace, "_stream_key", lambda device: 777)
    actual = sk.chain_verify(ids, target, draft, seed=4, offset=1, backend=backend)
    assert _workspace._buffers == reserved  # nothing allocated
    assert all(torch.equal(e, a) for e, a in zip(expected, actual))


def test_a_tree_reservation_serves_a_captured_tree_call(monkeypatch):
    """``trees=True`` reserves tree_verify's scratch: a smaller tree call "under capture" allocates nothing."""
    from conftest import backend_or_skip
    from test_tree_verify import random_problem

    backend = backend_or_skip("tree_verify", "triton")
    sk.reserve_workspace("cpu", batch_size=4, max_draft_tokens=1, vocab_size=2100, trees=True)
    generator = torch.Generator().manual_seed(2)
    ids, parents, target, draft, num_nodes, _ = random_problem(generator, 3, 6, 1500, bushy=True)
    expected = sk.tree_verify(ids, parents, target, draft, num_nodes=num_nodes, seed=4, backend="reference")
    reserved = dict(_workspace._buffers)
    monkeypatch.setattr(_workspace, "_capturing", lambda device: True)
    monkeypatch.setattr(_workspace, "_stream_key", lambda device: 778)
    actual = sk.tree_verify(ids, parents, target, draft, num_nodes=num_nodes, seed=4, backend=backend)
    assert _workspace._buffers == reserved  # nothing allocated
    assert all(torch.equal(e, a) for e, a in zip(expected, actual))


class _Stream:
    """Stands in for a ``torch.cuda.Stream`` (only its id is read)."""

    def __init__(self, stream_id):
        self.stream_id = stream_id


def test_a_capture_never_uses_the_buffers_of_eager_calls(monkeypatch):
    """A graph replays on its caller's stream, maybe beside eager calls on its capture stream: it gets the
    capture set, which the eager allocation grew alongside its own buffer."""
    monkeypatch.setattr(_workspace, "_stream_key", lambda device: 5)
    eager = _workspace.buffers(DEVICE, {"op.counters": (8, torch.int32)})["op.counters"]
    monkeypatch.setattr(_workspace, "_capturing", lambda device: True)
    captured = _workspace.buffers(DEVICE, {"op.counters": (8, torch.int32)})["op.counters"]
    assert captured.data_ptr() != eager.data_ptr() and captured.numel() >= 8


def test_a_capture_stream_of_its_own_gets_its_own_set(monkeypatch):
    """Graphs replayed concurrently reserve a capture set each, on their capture streams."""
    for stream_id in (21, 22):
        _workspace.reserve(DEVICE, {"op.counters": (4, torch.int32)}, stream=_Stream(stream_id), for_capture=True)
    monkeypatch.setattr(_workspace, "_capturing", lambda device: True)
    captured = {}
    for stream_id in (21, 22, 23):
        monkeypatch.setattr(_workspace, "_stream_key", lambda device, stream_id=stream_id: stream_id)
        captured[stream_id] = _workspace.buffers(DEVICE, {"op.counters": (4, torch.int32)})["op.counters"]
    assert len({buffer.data_ptr() for buffer in captured.values()}) == 3  # 23: the shared capture set


def test_device_buffers_are_shared_by_every_stream_and_capture(monkeypatch):
    """The fault counters: one buffer per device, under capture too (only atomics touch it)."""
    first = _workspace.device_buffer("op.faults", 3, torch.int32, DEVICE)
    monkeypatch.setattr(_workspace, "_stream_key", lambda device: 99)
    assert _workspace.device_buffer("op.faults", 3, torch.int32, DEVICE).data_ptr() == first.data_ptr()
    monkeypatch.setattr(_workspace, "_capturing", lambda device: True)
    assert _workspace.device_buffer("op.faults", 3, torch.int32, DEVICE).data_ptr() == first.data_ptr()


def _capture_on(monkeypatch, stream_id):
    monkeypatch.setattr(_workspace, "_capturing", lambda device: True)
    monkeypatch.setattr(_workspace, "_stream_key", lambda device: stream_id)
    return _workspace.buffers(DEVICE, {"op.counters": (4, torch.int32)})["op.counters"]


def test_two_streams_capturing_at_once_never_share_the_shared_set(monkeypatch):
    """Two streams of one multi-stream capture, or two threads capturing at once: the second stream to reach
    the shared capture set while the first one's capture runs gets an error that says how to reserve."""
    _workspace.reserve(DEVICE, {"op.counters": (4, torch.int32)})
    monkeypatch.setattr(_workspace, "_still_capturing", lambda stream: True)
    first = _capture_on(monkeypatch, 31)
    assert _capture_on(monkeypatch, 31).data_ptr() == first.data_ptr()  # the same stream again: its own calls
    with pytest.raises(RuntimeError, match=r"stream 32 would share .* stream 31\b.*"
                                           r"sk.reserve_workspace\(\.\.\., stream=capture_stream, for_capture=True\)"):
        _capture_on(monkeypatch, 32)


def test_the_shared_set_passes_on_once_its_capture_ended(monkeypatch):
    """Graphs captured one after another (torch.compile's, an engine's per-batch-size graphs) share the set."""
    _workspace.reserve(DEVICE, {"op.counters": (4, torch.int32)})
    monkeypatch.setattr(_workspace, "_still_capturing", lambda stream: False)
    first = _capture_on(monkeypatch, 41)
    assert _capture_on(monkeypatch, 42).data_ptr() == first.data_ptr()


def test_a_stream_with_its_own_set_captures_beside_the_shared_set(monkeypatch):
    _workspace.reserve(DEVICE, {"op.counters": (4, torch.int32)}, stream=_Stream(52), for_capture=True)
    monkeypatch.setattr(_workspace, "_still_capturing", lambda stream: True)
    shared = _capture_on(monkeypatch, 51)
    own = _capture_on(monkeypatch, 52)
    assert own.data_ptr() != shared.data_ptr()
    assert _workspace._shared_capture_user[DEVICE][0] == 51
