"""Persistent scratch buffers for kernels that combine partial results.

A kernel whose programs meet at an arrival counter needs the counter at zero
when it starts. Zeroing it per call would be a second launch, so the buffers
live across calls and every kernel leaves its counters at zero when it ends.

Lifecycle rules, each one a way a serving process could otherwise read
garbage counters (wrong tokens or an endless spin):

* A buffer is keyed by ``(name, dtype, device, stream)``: concurrent streams
  never share counters.
* A captured graph never uses the buffers of eager calls: it replays on
  whatever stream its caller uses at replay time, so it could run
  alongside eager calls on its capture stream. A call under capture on
  stream ``C`` uses the capture set reserved for ``C`` (:func:`reserve`
  with ``stream=C, for_capture=True``), else the shared capture set, which
  every eager allocation grows alongside its own: a warm-up call outside
  capture is enough. Graphs sharing that set must not be replayed
  concurrently; concurrent graphs reserve a set each, on their own capture
  streams. With neither, a call under capture raises and says how to
  reserve. So does a call that would share the shared set with a capture
  still running on another stream (two streams of one multi-stream capture,
  or two threads capturing at once): their counters would meet in one graph,
  or in two graphs that may replay together.
* A buffer is never freed. When a call needs more, a larger one replaces it
  and the old one is kept alive, because a CUDA graph captured earlier may
  still point at it.
* Nothing is allocated while a stream is being captured (the zero-fill would
  be recorded into the graph, and the memory would belong to the graph's
  pool).
* Allocation happens on a helper thread: memory pools that PyTorch routes to
  the calling thread (CUDA-graph capture, ``torch.compile(mode=
  "reduce-overhead")`` warm-up) never own a workspace, so they cannot reclaim
  it.
"""

from __future__ import annotations

import itertools
import os
import threading

import torch

_CAPTURE = "capture"  # the stream key of the shared capture set; ("capture", stream) of a stream's own
_DEVICE_WIDE = "device"  # the stream key of buffers every stream and graph of a device shares
_buffers: dict[tuple, torch.Tensor] = {}
_retired: list[torch.Tensor] = []  # replaced buffers: a captured graph may still use them
_lock = threading.Lock()
# Per device, (stream key, stream) of the capture that last took the shared capture set: another stream may take
# it only once that capture has ended.
_shared_capture_user: dict[torch.device, tuple] = {}


def _stream_key(device: torch.device):
    if device.type == "cuda":
        return torch.cuda.current_stream(device).stream_id
    return 0


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _current_stream(device: torch.device):
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def _still_capturing(stream) -> bool:
    """Whether ``stream`` (a ``torch.cuda.Stream``, ``None`` off CUDA) is being captured now."""
    if stream is None:
        return False
    with torch.cuda.device(stream.device), torch.cuda.stream(stream):
        return torch.cuda.is_current_stream_capturing()


# Launch stamps (kernels/stage_records.py, ``claim``): distinct for every launch of the process, and in
# [2**40, 2**61) from a random start, so no small count and no -1 left in a word reads as one (a claim word holds
# 2 * stamp or 2 * stamp + 1, and an int64 kernel argument keeps one compiled signature).
_stamps = itertools.count((1 << 40) + int.from_bytes(os.urandom(7), "little") % (1 << 59))


def launch_stamp() -> int:
    """A number for one kernel launch that no other launch of this process is given (the claim of its
    workspace words). A captured CUDA graph replays the stamp it was captured with; its last program puts every
    claim word back to zero, so each replay claims again."""
    return next(_stamps)


def buffers(device: torch.device, specs: dict[str, tuple[int, torch.dtype]]) -> dict[str, torch.Tensor]:
    """Zero-initialised-once flat buffers, ``{name: (min numel, dtype)}``, for one launch.

    The stream is looked up once per call: this runs on every launch.
    """
    stream = _stream_key(device)
    if _capturing(device):
        return {name: _captured_buffer(name, numel, dtype, device, stream) for name, (numel, dtype) in specs.items()}
    return {name: _buffer(name, numel, dtype, device, stream) for name, (numel, dtype) in specs.items()}


def reserve(device: torch.device, specs: dict[str, tuple[int, torch.dtype]], stream=None,
            for_capture: bool = False) -> None:
    """Allocate the buffers ``specs`` ahead of use, outside capture.

    ``stream`` (a ``torch.cuda.Stream``; default the current one) is the
    stream the eager calls will run on; the shared capture set grows with
    them. ``for_capture=True`` with a ``stream`` also reserves a capture set
    of that stream's own, for graphs captured on it (graphs replayed
    concurrently need one each).
    """
    if _capturing(device):
        raise RuntimeError("specdec_kernels: reserve workspaces before CUDA-graph capture, not during it")
    stream_key = _stream_key(device) if stream is None else stream.stream_id
    for name, (numel, dtype) in specs.items():
        _buffer(name, numel, dtype, device, stream_key)
        if for_capture and stream is not None:
            _buffer(name, numel, dtype, device, (_CAPTURE, stream_key))


def device_buffer(name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-initialised-once buffer of fixed size that every stream and every captured graph of ``device``
    shares (only atomics touch it: the kernels' fault counters). Created on first use outside capture."""
    if _capturing(device):
        return _captured_buffer(name, numel, dtype, device, _DEVICE_WIDE)
    return _buffer(name, numel, dtype, device, _DEVICE_WIDE)


def existing_device_buffer(name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """:func:`device_buffer` if it was ever created, else ``None`` (nothing is allocated)."""
    return _buffers.get((name, dtype, device, _DEVICE_WIDE))


def _buffer(name: str, numel: int, dtype: torch.dtype, device: torch.device, stream) -> torch.Tensor:
    current = _buffers.get((name, dtype, device, stream))
    if current is None or current.numel() < numel:
        with _lock:
            current = _grown((name, dtype, device, stream), numel)
            if isinstance(stream, int):  # an eager stream's: a graph captured after this call needs as much
                _grown((name, dtype, device, _CAPTURE), numel)
    return current


def _grown(key: tuple, numel: int) -> torch.Tensor:
    """The buffer ``key`` with at least ``numel`` elements (under ``_lock``)."""
    current = _buffers.get(key)
    if current is None or current.numel() < numel:
        size = max(numel, 2 * current.numel() if current is not None else 0, 1)
        if current is not None:
            _retired.append(current)
        name, dtype, device, _ = key
        current = _zeros_outside_pools(size, dtype, device)
        _buffers[key] = current
    return current


def _captured_buffer(name: str, numel: int, dtype: torch.dtype, device: torch.device, stream) -> torch.Tensor:
    """The buffer a call captured on ``stream`` uses: the stream's own capture set, else the shared one (the
    device-wide set for device buffers); never an eager stream's."""
    keys = [(name, dtype, device, _DEVICE_WIDE)] if stream == _DEVICE_WIDE else [
        (name, dtype, device, (_CAPTURE, stream)), (name, dtype, device, _CAPTURE)]
    for key in keys:
        current = _buffers.get(key)
        if current is not None and current.numel() >= numel:
            if key[3] == _CAPTURE:
                _take_shared_capture_set(name, device, stream)
            return current
    raise RuntimeError(
        f"specdec_kernels: `{name}` needs a workspace of {numel} {dtype} elements on {device}, and none is "
        "reserved for this capture. Call the op once outside capture first (with sizes at least the graph's), "
        "or call sk.reserve_workspace(...) with the largest sizes the graph will see."
    )


def _take_shared_capture_set(name: str, device: torch.device, stream) -> None:
    """Records that the capture on ``stream`` uses the shared capture set; raises if a capture on another stream
    that used it is still running (their graphs would share counters)."""
    with _lock:
        user = _shared_capture_user.get(device)
        if user is not None and user[0] != stream and _still_capturing(user[1]):
            raise RuntimeError(
                f"specdec_kernels: `{name}` under capture on stream {stream} would share the capture workspace "
                f"with the capture still running on stream {user[0]}, so both graphs would count in the same "
                "words (wrong tokens when they run together). Before capturing, reserve a set for each capture "
                "stream: sk.reserve_workspace(..., stream=capture_stream, for_capture=True)."
            )
        _shared_capture_user[device] = (stream, _current_stream(device))


def _zeros_outside_pools(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return torch.zeros(numel, dtype=dtype, device=device)
    result: list = []
    # The caller's stream, not the helper thread's (the legacy default stream): zeroing or synchronising that
    # one would break a global-mode capture that another thread is running.
    stream = torch.cuda.current_stream(device)

    def allocate():
        try:
            with torch.cuda.device(device), torch.cuda.stream(stream):
                buffer = torch.zeros(numel, dtype=dtype, device=device)
                stream.synchronize()  # zeroed before any other stream (a graph's replay) uses it
            result.append(buffer)
        except BaseException as error:  # re-raised on the calling thread
            result.append(error)

    worker = threading.Thread(target=allocate, name="specdec-workspace")
    worker.start()
    worker.join()
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]
