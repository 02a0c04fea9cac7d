"""The counter-based RNG: known answers, the Triton twin bit for bit, the uniform's law.

``tests/test_rng_cuda_host.py`` checks the CUDA twin the same way.
"""

import pytest
import torch
from scipy import stats

from markov import SIGNIFICANCE
from specdec_kernels import rng

# Random123's known-answer vectors for Philox4x32-10: (counter, key) -> output.
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter, key, expected", KNOWN_ANSWERS)
def test_philox_known_answers(counter, key, expected):
    words = rng.philox4x32_10(*(torch.tensor([value], dtype=torch.int64) for value in (*counter, *key)))
    assert tuple(int(word) for word in words) == expected


def reference_draws(seed, offset, batch_size, stream, positions, num_indices):
    keys = rng.RequestKeys(seed, offset, batch_size, "cpu")
    position = torch.as_tensor(positions, dtype=torch.int64).view(1, -1, 1).expand(batch_size, -1, num_indices)
    index = torch.arange(num_indices, dtype=torch.int64).view(1, 1, -1).expand_as(position)
    words = keys.words(stream, position.reshape(batch_size, -1), index.reshape(batch_size, -1))
    return (torch.stack(words, -1).view(batch_size, len(positions), num_indices, 4),
            rng.uniform_from_word(words[0]).view(batch_size, len(positions), num_indices))


def triton_draws(seed, offset, batch_size, stream, positions, num_indices, device):
    import triton

    from rng_draw_kernel import draw_kernel
    from specdec_kernels.launchers.chain_verify import split_words

    shape = (batch_size, len(positions), num_indices)
    words = torch.empty(*shape, 4, dtype=torch.int32, device=device)
    uniforms = torch.empty(shape, dtype=torch.float32, device=device)
    positions_tensor = torch.tensor(positions, dtype=torch.int64, device=device)
    seed_tensor = seed.to(device) if isinstance(seed, torch.Tensor) else positions_tensor
    offset_tensor = offset.to(device) if isinstance(offset, torch.Tensor) else positions_tensor
    draw_kernel[(batch_size, len(positions))](
        seed_tensor, *split_words(0 if isinstance(seed, torch.Tensor) else seed),
        offset_tensor, *split_words(0 if isinstance(offset, torch.Tensor) else offset),
        positions_tensor, words, uniforms, len(positions), num_indices,
        STREAM=stream, SEED_PER_REQUEST=isinstance(seed, torch.Tensor),
        OFFSET_FROM_TENSOR=isinstance(offset, torch.Tensor),
        OFFSET_PER_REQUEST=isinstance(offset, torch.Tensor) and offset.dim() == 1,
        BLOCK=triton.next_power_of_2(num_indices),
    )
    return words.cpu().to(torch.int64) & 0xFFFFFFFF, uniforms.cpu()


@pytest.mark.parametrize(
    "seed, offset",
    [
        (0, 0),
        (-7, 2**33 + 3),
        (2**40 + 11, 5),
        (torch.tensor([3, -1, 2**35, 7]), torch.tensor(9)),
        (12345, torch.tensor([0, 1, 2**32, 2**40 + 1])),
    ],
)
@pytest.mark.parametrize("stream", [rng.ACCEPT_STREAM, rng.SAMPLE_STREAM, rng.DRAFT_STREAM])
def test_triton_twin_draws_the_same_bits(seed, offset, stream, device):
    """Under the interpreter on a CPU; compiled (without FMA contraction) on a GPU."""
    pytest.importorskip("triton")
    args = (seed, offset, 4, stream, [0, 1, 7, 2**24 - 1], 1000)
    expected_words, expected_uniforms = reference_draws(*args)
    words, uniforms = triton_draws(*args, device)
    assert torch.equal(words, expected_words)
    assert torch.equal(uniforms.view(torch.int32), expected_uniforms.view(torch.int32))


def test_per_request_seed_ignores_the_batch_and_shared_seed_separates_requests():
    alone = reference_draws(torch.tensor([77]), 3, 1, rng.SAMPLE_STREAM, [2], 50)[0]
    in_batch = reference_draws(torch.tensor([5, 77, 9]), 3, 3, rng.SAMPLE_STREAM, [2], 50)[0]
    assert torch.equal(alone[0], in_batch[1])
    shared = reference_draws(77, 3, 3, rng.SAMPLE_STREAM, [2], 50)[0]
    assert torch.equal(shared[0], alone[0])  # request 0 of an int seed == that seed as a tensor
    assert not torch.equal(shared[1], shared[0]) and not torch.equal(shared[2], shared[1])


def test_streams_positions_and_offsets_never_share_a_counter():
    draws = [reference_draws(1, offset, 2, stream, [0, 1], 64)[0]
             for stream in (0, 1, 2) for offset in (0, 1)]
    flat = torch.cat([d.reshape(-1, 4) for d in draws])
    assert torch.unique(flat, dim=0).shape[0] == flat.shape[0]


def test_uniforms_are_never_zero_or_one():
    extremes = torch.tensor([0, 0x1FF, 0xFFFFFFFF, 0xFFFFFE00], dtype=torch.int64)
    uniforms = rng.uniform_from_word(extremes)
    assert uniforms.min() == 2.0**-24 and uniforms.max() == 1 - 2.0**-24
    assert bool(((uniforms > 0) & (uniforms < 1)).all())


def test_uniform_law():
    _, uniforms = reference_draws(2024, 0, 1, rng.SAMPLE_STREAM, [0], 1_000_000)
    assert stats.kstest(uniforms.flatten().double().numpy(), "uniform").pvalue >= SIGNIFICANCE
