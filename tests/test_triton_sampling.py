"""The Triton sampler primitives (``kernels/sampling.py``) against Python integers, at the extremes.

The chain tests reach the 128-bit chunk choice only with totals just above
``2**64``; here chunk totals near ``2**62`` over hundreds of chunks, draws at
``0`` and ``2**64 - 1``, and weights at the clamp check every carry. Under
the interpreter on a CPU; compiled on a GPU.
"""

import pytest
import torch

from specdec_kernels.reference import _sampling

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from specdec_kernels._kernels.sampling import choose_chunk, chunk_pick, chunk_sums, fixed_point  # noqa: E402

TWO64 = 2**64


@triton.jit
def _choose_kernel(total_ptr, pick_ptr, draw_ptr, token_ptr, num_rows, num_chunks,
                   ROWS: tl.constexpr, CHUNK_TILE: tl.constexpr):
    rows = tl.arange(0, ROWS)
    active = rows < num_rows
    row_offset = rows.to(tl.int64) * num_chunks
    high31, low31 = chunk_sums(total_ptr, row_offset, active, num_chunks, ROWS, CHUNK_TILE)
    draw = tl.load(draw_ptr + rows, mask=active, other=0).to(tl.uint64, bitcast=True)
    token = choose_chunk(total_ptr, pick_ptr, row_offset, active, num_chunks, high31, low31, draw, ROWS, CHUNK_TILE)
    tl.store(token_ptr + rows, token, mask=active)


@triton.jit
def _pick_kernel(weight_ptr, draw_ptr, total_ptr, offset_ptr, fixed_ptr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.arange(0, ROWS)[:, None]
    lanes = tl.arange(0, BLOCK)[None, :]
    weights = fixed_point(tl.load(weight_ptr + rows * BLOCK + lanes))
    tl.store(fixed_ptr + rows * BLOCK + lanes, weights)
    total, offset = chunk_pick(weights, tl.load(draw_ptr + tl.arange(0, ROWS)).to(tl.uint64, bitcast=True))
    tl.store(total_ptr + tl.arange(0, ROWS), total)
    tl.store(offset_ptr + tl.arange(0, ROWS), offset)


def as_signed(value: int) -> int:
    return value - TWO64 if value >= 2**63 else value


def python_choice(totals: list[int], picks: list[int], draw: int) -> int:
    total = sum(totals)
    if total == 0:
        return -1
    target = (draw * total) >> 64
    prefix, chosen = 0, 0
    for chunk_total in totals:
        prefix += chunk_total
        chosen += prefix <= target
    return picks[min(chosen, len(totals) - 1)]


@pytest.mark.parametrize("chunk_tile", [4, 512])
def test_chunk_choice_matches_python_integers(chunk_tile, device):
    generator = torch.Generator().manual_seed(7)
    num_rows, num_chunks = 8, 300
    totals = torch.randint(0, 2**62, (num_rows, num_chunks), generator=generator, dtype=torch.int64)
    totals[0] = 2**62 - 1  # the largest chunk totals: T near 2**70.2
    totals[1, ::2] = 0
    totals[2] = 0  # no mass
    totals[3, :-1] = 0  # only the last chunk
    totals[4, 1:] = 0  # only the first chunk
    picks = torch.randint(0, 2**31 - 1, (num_rows, num_chunks), generator=generator, dtype=torch.int32)
    draws = [0, TWO64 - 1, 2**63, 1, 2**64 - 2**32, 12345678901234567890, 2**62 + 3, 999]
    draw_bits = torch.tensor([as_signed(draw) for draw in draws], dtype=torch.int64)
    tokens = torch.empty(num_rows, dtype=torch.int32, device=device)
    _choose_kernel[(1,)](totals.to(device), picks.to(device), draw_bits.to(device), tokens, num_rows, num_chunks,
                         ROWS=num_rows, CHUNK_TILE=chunk_tile)
    expected = [python_choice(totals[row].tolist(), picks[row].tolist(), draws[row]) for row in range(num_rows)]
    assert tokens.cpu().tolist() == expected


def test_fixed_point_and_chunk_pick_match_the_reference(device):
    generator = torch.Generator().manual_seed(8)
    rows, block = 4, 1024
    weights = torch.rand(rows, block, generator=generator) * 2 - 0.5  # negatives and weights above 1
    weights[0, :7] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1.0, 2.0**-52])
    weights[1] = 1.0  # the largest chunk total, 1024 * 2**52
    weights[2] = 0.0
    weights[3] = weights[3].abs() * 1e-9
    draws = [TWO64 - 1, 0, 2**63 + 1, 31337]
    draw_bits = torch.tensor([as_signed(draw) for draw in draws], dtype=torch.int64)
    total = torch.empty(rows, dtype=torch.int64, device=device)
    offset = torch.empty(rows, dtype=torch.int32, device=device)
    fixed = torch.empty(rows, block, dtype=torch.int64, device=device)
    _pick_kernel[(1,)](weights.to(device), draw_bits.to(device), total, offset, fixed, ROWS=rows, BLOCK=block)
    expected_fixed = _sampling.fixed_point(weights)
    assert torch.equal(fixed.cpu(), expected_fixed)
    for row in range(rows):
        row_weights = expected_fixed[row].tolist()
        threshold = (draws[row] * sum(row_weights)) >> 64
        prefix, expected_offset = 0, 0
        for weight in row_weights:
            prefix += weight
            expected_offset += prefix <= threshold
        assert int(total[row]) == sum(row_weights) and int(offset[row]) == expected_offset
