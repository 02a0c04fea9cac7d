"""The CUDA twin of the RNG (csrc/include/specdec/rng.cuh) against specdec_kernels.rng, bit for bit.

Philox words and the acceptance uniforms; the sampler uses the words
themselves (csrc/include/specdec/sampling.cuh), so there is no other float
transform to check.

``torch.ops.specdec_C.rng_fill`` on CPU tensors runs the same
``__host__ __device__`` functions as the GPU kernel, in a host loop, so these
tests check the .cuh arithmetic on machines without a GPU; with a GPU the
same cases also run through the kernel.
"""

import pytest
import torch

from specdec_kernels import rng
from specdec_kernels._extension import cuda_extension_available, extension_error

pytestmark = pytest.mark.skipif(
    not cuda_extension_available(), reason=f"CUDA extension not built: {extension_error()}"
)

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU: the kernel path is not run")
    ),
]

_U64 = 2**64


def _wrap_int64(value: int) -> int:
    """A Python int as the 64-bit two's complement value the RNG reads."""
    value %= _U64
    return value - _U64 if value >= 2**63 else value


def _rng_fill(seed, offset, batch_size, stream, positions, num_indices, device):
    """Calls the raw op with the API's seed/offset forms (Python int or int64 tensor)."""
    seed_tensor, seed_value = (seed.to(device), 0) if isinstance(seed, torch.Tensor) else (None, _wrap_int64(seed))
    offset_tensor, offset_value = (
        (offset.to(device), 0) if isinstance(offset, torch.Tensor) else (None, _wrap_int64(offset))
    )
    words, uniforms = torch.ops.specdec_C.rng_fill(
        seed_tensor, seed_value, offset_tensor, offset_value, batch_size, stream, positions.to(device), num_indices
    )
    return words.cpu(), uniforms.cpu()


def _reference(seed, offset, batch_size, stream, positions, num_indices):
    keys = rng.RequestKeys(seed, offset, batch_size, "cpu")
    words = keys.words(stream, positions.view(1, -1, 1), torch.arange(num_indices).view(1, 1, -1))
    return words, rng.uniform_from_word(words[0])


def _assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, what: str):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    mismatch = actual != expected
    if mismatch.any():
        first = tuple(mismatch.nonzero()[0].tolist())
        raise AssertionError(
            f"{what}: {int(mismatch.sum())} of {mismatch.numel()} differ; first at {first}: "
            f"{actual[first].item()!r} != {expected[first].item()!r}"
        )


def _check_against_reference(seed, offset, batch_size, stream, positions, num_indices, device):
    words, uniforms = _rng_fill(seed, offset, batch_size, stream, positions, num_indices, device)
    ref_words, ref_uniforms = _reference(seed, offset, batch_size, stream, positions, num_indices)
    assert words.dtype == torch.int32 and words.shape == (batch_size, positions.numel(), num_indices, 4)
    unsigned = words.to(torch.int64) & 0xFFFFFFFF
    for j in range(4):
        _assert_bitwise_equal(unsigned[..., j], ref_words[j], f"word {j}")
    _assert_bitwise_equal(uniforms.view(torch.int32), ref_uniforms.view(torch.int32), "uniform bits")
    return words, uniforms


POSITIONS_EDGE = torch.tensor([0, 1, 2**24 - 1, 12345, 7], dtype=torch.int64)

# (seed, offset, batch_size, stream, positions, num_indices): about 1e5 values in all.
CASES = {
    "shared-seed-zero": (0, 0, 3, rng.ACCEPT_STREAM, torch.arange(7), 111),
    "shared-seed-negative": (-1, 5, 4, rng.SAMPLE_STREAM, POSITIONS_EDGE, 1000),
    "shared-seed-above-2**32": (2**32 + 5, 2**32 + 3, 2, rng.DRAFT_STREAM, torch.arange(3), 4099),
    "shared-seed-above-2**63": (2**63 + 12345, -(2**40) + 7, 1, 255, torch.tensor([0]), 32000),
    "shared-seed-offset-tensor-scalar": (1234, torch.tensor(2**33 + 1), 5, rng.SAMPLE_STREAM, torch.arange(5), 777),
    "shared-seed-offset-per-request": (
        -(2**40) + 7,
        torch.tensor([0, 1, 2**32, 2**32 + 1, -1, 2**63 - 1, -(2**63)]),
        7,
        rng.ACCEPT_STREAM,
        torch.tensor([3, 0]),
        501,
    ),
    "per-request-seeds": (
        torch.tensor([0, -1, 2**32 + 5, 2**62, -(2**63)]),
        2**32 + 3,
        5,
        rng.SAMPLE_STREAM,
        POSITIONS_EDGE,
        600,
    ),
    "per-request-seeds-offsets": (
        torch.tensor([11, 11, -12345678901234]),
        torch.tensor([0, 2**32 + 9, 42]),
        3,
        rng.DRAFT_STREAM,
        torch.arange(4),
        1003,
    ),
    "single-index": (99, 123456789, 13, rng.ACCEPT_STREAM, torch.arange(16), 1),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_rng_fill_matches_reference(case, device):
    _check_against_reference(*CASES[case], device)


@pytest.mark.parametrize("device", DEVICES)
def test_per_request_seed_is_independent_of_the_batch(device):
    seeds = torch.tensor([5, -3, 2**40 + 1, 5])
    offsets = torch.tensor([0, 2**32 + 1, 17, 0])
    positions = torch.arange(3)
    words, _ = _rng_fill(seeds, offsets, 4, rng.SAMPLE_STREAM, positions, 64, device)
    for b in range(4):
        alone, _ = _rng_fill(seeds[b : b + 1], offsets[b : b + 1], 1, rng.SAMPLE_STREAM, positions, 64, device)
        assert torch.equal(words[b], alone[0])
    # Same seed and offset: same numbers, whatever the row.
    assert torch.equal(words[0], words[3])


@pytest.mark.parametrize("device", DEVICES)
def test_shared_seed_rows_and_streams_differ(device):
    positions = torch.arange(2)
    words, _ = _rng_fill(7, 0, 3, rng.ACCEPT_STREAM, positions, 32, device)
    other_stream, _ = _rng_fill(7, 0, 3, rng.SAMPLE_STREAM, positions, 32, device)
    assert not torch.equal(words[0], words[1])
    assert not (words == other_stream).all(dim=-1).any()


def test_uniform_extremes():
    """Words 0 and 2**32 - 1 give the smallest and largest uniforms, 2**-24 and 1 - 2**-24."""
    positions = torch.arange(1)
    _, uniforms = _rng_fill(0, 0, 1, rng.ACCEPT_STREAM, positions, 1, "cpu")
    assert 0.0 < float(uniforms.min()) and float(uniforms.max()) < 1.0
    words = torch.tensor([0, 2**32 - 1, 2**31], dtype=torch.int64)
    assert rng.uniform_from_word(words).tolist() == [2.0**-24, 1 - 2.0**-24, 0.5 + 2.0**-24]


def test_empty_sizes():
    words, uniforms = torch.ops.specdec_C.rng_fill(None, 1, None, 0, 0, 0, torch.arange(3), 5)
    assert words.shape == (0, 3, 5, 4) and uniforms.shape == (0, 3, 5)
    words, _ = torch.ops.specdec_C.rng_fill(None, 1, None, 0, 2, 0, torch.arange(3), 0)
    assert words.shape == (2, 3, 0, 4)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"seed": torch.tensor([1, 2], dtype=torch.int32)}, TypeError, "`seed` must be Long"),
        ({"seed": torch.tensor([1, 2, 3])}, ValueError, r"`seed` must have shape \[batch_size\] = \[2\], got \[3\]"),
        ({"offset": torch.zeros(2, 1, dtype=torch.int64)}, ValueError, r"`offset` must have shape \[\] or \[batch_size\]"),
        ({"stream": 256}, ValueError, r"`stream` must be in \[0, 256\), got 256"),
        ({"positions": torch.zeros(2, 2, dtype=torch.int64)}, ValueError, r"`positions` must have shape \[P\]"),
        ({"positions": torch.zeros(2)}, TypeError, "`positions` must be Long"),
        ({"num_indices": -1}, ValueError, "`num_indices` must be in"),
    ],
)
def test_rng_fill_rejects_bad_arguments(kwargs, error, message):
    arguments = {"seed": None, "offset": None, "stream": 0, "positions": torch.arange(3), "num_indices": 4}
    arguments.update(kwargs)
    with pytest.raises(error, match=message):
        torch.ops.specdec_C.rng_fill(
            arguments["seed"], 0, arguments["offset"], 0, 2, arguments["stream"], arguments["positions"],
            arguments["num_indices"],
        )


def test_opcheck():
    """Schema, Meta (fake) kernel and dispatcher registration are consistent."""
    positions = torch.arange(3)
    torch.library.opcheck(torch.ops.specdec_C.rng_fill.default, (torch.tensor([1, -2]), 0, None, 7, 2, 1, positions, 5))
    torch.library.opcheck(torch.ops.specdec_C.rng_fill.default, (None, 3, torch.tensor(2**33), 0, 2, 0, positions, 5))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-graph capture needs a GPU")
def test_cuda_graph_replay_reads_new_offsets():
    """Seed and offset are read from device memory, so each replay draws the numbers of the current offset."""
    seeds = torch.tensor([3, 2**40 + 7], device="cuda")
    offset = torch.tensor(0, dtype=torch.int64, device="cuda")
    positions = torch.arange(4, device="cuda")
    torch.ops.specdec_C.rng_fill(seeds, 0, offset, 0, 2, rng.SAMPLE_STREAM, positions, 256)  # warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        words, uniforms = torch.ops.specdec_C.rng_fill(seeds, 0, offset, 0, 2, rng.SAMPLE_STREAM, positions, 256)
    for step in (5, 2**32 + 1):
        offset.fill_(step)
        graph.replay()
        torch.cuda.synchronize()
        ref_words, ref_uniforms = _reference(seeds.cpu(), step, 2, rng.SAMPLE_STREAM, positions.cpu(), 256)
        _assert_bitwise_equal(words.cpu().to(torch.int64)[..., 0] & 0xFFFFFFFF, ref_words[0], f"word 0, offset {step}")
        _assert_bitwise_equal(uniforms.cpu().view(torch.int32), ref_uniforms.view(torch.int32), f"uniform, offset {step}")
