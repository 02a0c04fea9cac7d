"""sk.compact_kv against a sequential Python implementation that copies sources first."""

from __future__ import annotations

import pytest
import torch

import specdec_kernels as sk
from conftest import backend_or_skip

BACKENDS = ["reference", "triton"]
BLOCK_SIZE = 4


def expected_compact(k_cache, v_cache, block_tables, prefix_lens, accepted_nodes):
    """Request by request: read every source, then write every destination."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    num_blocks, block_size = k_cache.shape[:2]
    max_blocks = block_tables.shape[1]

    def locate(b, position):
        if position < 0 or position // block_size >= max_blocks:
            return None
        block = int(block_tables[b, position // block_size])
        return (block, position % block_size) if 0 <= block < num_blocks else None

    for b in range(block_tables.shape[0]):
        prefix = int(prefix_lens[b])
        moves = []
        for depth, node in enumerate(accepted_nodes[b].tolist()):
            if node < 0:
                break
            source, destination = locate(b, prefix + node), locate(b, prefix + depth)
            if source is not None and destination is not None:
                moves.append((source, destination))
        copies = [(k_cache[source].clone(), v_cache[source].clone()) for source, _ in moves]
        for (_, destination), (key, value) in zip(moves, copies):
            k_cache[destination] = key
            v_cache[destination] = value
    return k_cache, v_cache


def make_cache(generator, batch_size, max_blocks, dtype, num_kv_heads=2, head_dim=8, spare_blocks=3):
    """Shuffled block tables over a cache with a few blocks no request owns."""
    num_blocks = batch_size * max_blocks + spare_blocks
    order = torch.randperm(num_blocks, generator=generator)
    block_tables = order[: batch_size * max_blocks].view(batch_size, max_blocks).to(torch.int32)
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator).to(dtype)
    v_cache = torch.randn(shape, generator=generator).to(dtype)
    return k_cache, v_cache, block_tables


def check(k_cache, v_cache, block_tables, prefix_lens, accepted_nodes, backend, device):
    backend_or_skip("compact_kv", backend)
    want_k, want_v = expected_compact(k_cache, v_cache, block_tables, prefix_lens, accepted_nodes)
    assert not torch.equal(want_k, k_cache), "the case moves nothing"
    k_on_device, v_on_device = k_cache.to(device), v_cache.to(device)
    result = sk.compact_kv(
        k_on_device, v_on_device, block_tables.to(device), prefix_lens.to(device), accepted_nodes.to(device),
        backend=backend,
    )
    assert result is None
    # Whole caches, bit for bit: moved slots and every untouched slot.
    assert torch.equal(k_on_device.cpu(), want_k)
    assert torch.equal(v_on_device.cpu(), want_v)


# Case builders return (k_cache, v_cache, block_tables, prefix_lens,
# accepted_nodes) on the CPU; tests/test_compact_kv_cuda.py runs them too.


def overlapping_moves_case(dtype):
    generator = torch.Generator().manual_seed(0)
    k_cache, v_cache, block_tables = make_cache(generator, 6, 8, dtype)
    prefix_lens = torch.tensor([5, 3, 6, 2, 0, 11], dtype=torch.int32)
    accepted_nodes = torch.tensor(
        [
            [0, 2, 3, -1, -1, -1, -1, -1],  # 2 -> 1 and 3 -> 2 overlap
            [0, 1, 5, 6, -1, -1, -1, -1],  # 5 -> 2, 6 -> 3 across a block edge
            [0, 3, 7, 9, 12, 13, 17, 19],  # a full-length path over five blocks
            [0, -1, -1, -1, -1, -1, -1, -1],  # root only: nothing moves
            [0, 1, 2, 4, 8, 9, 10, -1],  # prefix 0, a path that keeps its head
            [0, 4, 5, 6, 7, 8, 9, 10],  # every move overlaps the next source
        ],
        dtype=torch.int32,
    )
    return k_cache, v_cache, block_tables, prefix_lens, accepted_nodes


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_overlapping_moves(dtype, backend, device):
    check(*overlapping_moves_case(dtype), backend, device)


def random_paths_case(index_dtype):
    generator = torch.Generator().manual_seed(1)
    batch_size, tree_size = 7, 20
    prefix_lens = torch.randint(0, 30, (batch_size,), generator=generator, dtype=torch.int32)
    max_blocks = (int(prefix_lens.max()) + tree_size + BLOCK_SIZE - 1) // BLOCK_SIZE
    k_cache, v_cache, block_tables = make_cache(generator, batch_size, max_blocks, torch.float16, 4, 16)
    accepted_nodes = torch.full((batch_size, tree_size), -1, dtype=index_dtype)
    for b in range(batch_size):
        # An accepted path climbs the tree, so its node indices increase.
        length = int(torch.randint(1, tree_size + 1, (), generator=generator))
        nodes = torch.randperm(tree_size - 1, generator=generator)[: length - 1] + 1
        accepted_nodes[b, :length] = torch.cat([torch.zeros(1, dtype=torch.int64), nodes.sort().values])
    return k_cache, v_cache, block_tables, prefix_lens, accepted_nodes


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_random_paths(index_dtype, backend, device):
    check(*random_paths_case(index_dtype), backend, device)


def bad_entries_case():
    generator = torch.Generator().manual_seed(2)
    k_cache, v_cache, block_tables = make_cache(generator, 6, 5, torch.bfloat16)
    num_blocks = k_cache.shape[0]
    prefix_lens = torch.tensor([2, 2, 4, 1, 3, 0], dtype=torch.int32)
    block_tables[3, 2] = -1  # positions 8..11 of request 3 are not stored
    block_tables[4, 1] = num_blocks  # positions 4..7 of request 4 point past the cache
    block_tables[5, 0] = 2**31 - 1
    accepted_nodes = torch.tensor(
        [
            [0, 3, -1, 4, 5, 6],  # entries after the -1 are ignored
            [0, 2, 5, -7, 6, 7],  # any negative entry ends the path
            [0, 1, 40, 5, 7, 9],  # node 40 is past the table: only that move is skipped
            [0, 2, 8, 9, 10, 12],  # sources or destinations in a missing block are skipped
            [0, 5, 6, 9, 10, 13],  # likewise for a block id >= num_blocks
            [0, 5, 6, 7, 9, 11],  # destinations 0..3 are in a bad block, the rest move
        ],
        dtype=torch.int32,
    )
    return k_cache, v_cache, block_tables, prefix_lens, accepted_nodes


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_entries_are_skipped(backend, device):
    check(*bad_entries_case(), backend, device)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8, torch.float64])
def test_fp8_int8_and_float64_caches_move_their_bits(dtype, backend, device):
    """A move copies bits, whatever the cache dtype: random bytes (NaN and subnormal patterns included) land
    where the sequential oracle, run on the bytes, puts them."""
    backend_or_skip("compact_kv", backend)
    _, _, block_tables, prefix_lens, accepted_nodes = overlapping_moves_case(torch.float32)
    generator = torch.Generator().manual_seed(29)
    num_blocks = int(block_tables.max()) + 4
    width = 8 * torch.empty((), dtype=dtype).element_size()  # 8 elements a head, as bytes
    k_bytes, v_bytes = (torch.randint(0, 256, (num_blocks, BLOCK_SIZE, 2, width), generator=generator,
                                      dtype=torch.uint8) for _ in range(2))
    want_k, want_v = expected_compact(k_bytes, v_bytes, block_tables, prefix_lens, accepted_nodes)
    got_k, got_v = k_bytes.view(dtype).to(device), v_bytes.view(dtype).to(device)
    sk.compact_kv(got_k, got_v, block_tables.to(device), prefix_lens.to(device), accepted_nodes.to(device),
                  backend=backend)
    assert torch.equal(got_k.cpu().view(torch.uint8), want_k)
    assert torch.equal(got_v.cpu().view(torch.uint8), want_v)


def test_other_cache_dtypes_are_refused_by_name():
    cache = torch.zeros(2, BLOCK_SIZE, 1, 8, dtype=torch.complex128)
    index = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(TypeError, match=r"compact_kv: `k_cache` must have dtype .*float8_e4m3fn.*; got complex128"):
        sk.compact_kv(cache, cache.clone(), index, index[0], index, backend="reference")


def check_against_reference(k_cache, v_cache, block_tables, prefix_lens, accepted_nodes, device):
    """The Triton backend leaves both caches bit-equal to the reference's (whole caches)."""
    backend_or_skip("compact_kv", "triton")
    want_k, want_v = k_cache.clone(), v_cache.clone()
    sk.compact_kv(want_k, want_v, block_tables, prefix_lens, accepted_nodes, backend="reference")
    assert not torch.equal(want_k, k_cache), "the case moves nothing"
    got_k, got_v = k_cache.to(device), v_cache.to(device)
    sk.compact_kv(got_k, got_v, block_tables.to(device), prefix_lens.to(device), accepted_nodes.to(device),
                  backend="triton")
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[k_cache.element_size()]
    assert torch.equal(got_k.cpu().view(bits), want_k.view(bits))
    assert torch.equal(got_v.cpu().view(bits), want_v.view(bits))


def random_cache(generator, shape, dtype):
    return torch.randn(shape, generator=generator, dtype=torch.float32).to(dtype)


def malformed_paths_case(block_size, index_dtype):
    # B = 5 (prime), shuffled disjoint block tables; paths that climb, swap,
    # repeat, go backwards or out of the table.
    generator = torch.Generator().manual_seed(block_size)
    batch_size, width, max_blocks = 5, 12, 3
    num_blocks = batch_size * max_blocks + 2
    tables = torch.randperm(num_blocks, generator=generator)[: batch_size * max_blocks].view(batch_size, max_blocks)
    shape = (num_blocks, block_size, 2, 4)
    k_cache, v_cache = random_cache(generator, shape, torch.float16), random_cache(generator, shape, torch.float16)
    prefix_lens = torch.tensor([block_size - 2, 0, 3, 2 * block_size - 5, 1], dtype=torch.int32)
    accepted = torch.tensor(
        [
            [0, 2, 3, 5, 8, 9, 10, 11, -1, -1, -1, -1],  # climbs across a block edge
            [1, 0, 3, 2, -1, 6, 7, 8, 9, 10, 11, 0],  # swaps: every read before any write
            [0, 4, 4, 4, 1, 1, 11, 2, 9, 0, 5, 3],  # repeated and decreasing sources
            [0, 3, 2 * block_size, 10 * block_size, 2, -5, 1, 1, 1, 1, 1, 1],  # past the table; -5 ends
            [11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0],  # reversed
        ],
        dtype=torch.int32,
    )
    return k_cache, v_cache, tables.to(index_dtype), prefix_lens.to(index_dtype), accepted


@pytest.mark.parametrize("block_size", [8, 16, 256])
def test_triton_block_sizes_and_malformed_paths(block_size, device):
    check_against_reference(*malformed_paths_case(block_size, torch.int32), device)
    check_against_reference(*malformed_paths_case(block_size, torch.int64), device)


def repeated_block_cases():
    # Request 0's table holds block 1 twice (columns 0 and 2): destinations
    # d and d + 8 land in one slot, and the later move must win; a source is
    # also another move's destination through the alias.
    generator = torch.Generator().manual_seed(5)
    shape = (4, 4, 1, 8)
    k_cache, v_cache = random_cache(generator, shape, torch.float32), random_cache(generator, shape, torch.float32)
    tables = torch.tensor([[1, 0, 1, 2], [3, -1, -1, -1]], dtype=torch.int32)
    prefix_lens = torch.tensor([1, 0], dtype=torch.int32)
    accepted = torch.tensor([[0, 3, 4, 5, 6, 7, 8, 12, 9, 10, 11, 13], [0, 2, -1, 0, 0, 0, 0, 0, 0, 0, 0, 0]],
                            dtype=torch.int32)
    first = (k_cache, v_cache, tables, prefix_lens, accepted)
    # Move 1 writes slot 1 of block 1 (from position 6), then move 5 copies
    # that slot onto itself: the last move wins, so the slot keeps its value.
    tables = torch.tensor([[1, 1, 3, 0]], dtype=torch.int32)
    accepted = torch.tensor([[0, 6, 2, 9, 4, 5]], dtype=torch.int32)
    return [first, (k_cache, v_cache, tables, torch.tensor([0], dtype=torch.int32), accepted)]


def test_triton_repeated_block_in_one_table_last_move_wins(device):
    for case in repeated_block_cases():
        check_against_reference(*case, device)


def strided_wide_path_case():
    # Caches that are views (every other head of a wider cache, K and V with
    # different strides), strided tables, prefixes and paths; N = 1024.
    generator = torch.Generator().manual_seed(6)
    batch_size, width, block_size = 3, 1024, 16
    max_blocks = (width + 40) // block_size + 1
    num_blocks = batch_size * max_blocks
    k_wide = random_cache(generator, (num_blocks, block_size, 4, 8), torch.bfloat16)
    v_store = random_cache(generator, (num_blocks, 2, block_size, 8), torch.bfloat16)
    k_cache, v_cache = k_wide[:, :, ::2], v_store.transpose(1, 2)
    assert not k_cache.is_contiguous() and v_cache.stride() != k_cache.stride()
    tables = torch.randperm(num_blocks, generator=generator).view(batch_size, max_blocks)
    wide_tables = torch.zeros((batch_size, 2 * max_blocks), dtype=torch.int64)
    wide_tables[:, ::2] = tables
    prefix_store = torch.tensor([[7, 0], [0, 0], [40, 0]], dtype=torch.int64)
    accepted = torch.full((batch_size, 2 * width), -1, dtype=torch.int32)
    for b, length in enumerate((6, 1024, 300)):
        nodes = torch.randperm(width - 1, generator=generator)[: length - 1] + 1
        accepted[b, : length] = torch.cat([torch.zeros(1, dtype=torch.int64), nodes.sort().values]).to(torch.int32)
    return k_cache, v_cache, wide_tables[:, ::2], prefix_store[:, 0], accepted[:, ::2]


def test_triton_strided_inputs_and_a_wide_path(device):
    check_against_reference(*strided_wide_path_case(), device)


def moved_bits_case():
    # NaN payloads and negative zero survive a move unchanged.
    k_cache = torch.tensor([0x7E01, 0x7C01, -0x8000, 0x3C00, 0x7D55, 0x1234, 0x0001, 0xFFFF - 0x10000],
                           dtype=torch.int16).view(torch.float16).view(1, 8, 1, 1)
    v_cache = k_cache.flip(1).contiguous()
    tables = torch.tensor([[0]], dtype=torch.int32)
    return k_cache, v_cache, tables, torch.tensor([1], dtype=torch.int32), torch.tensor([[0, 2, 4, 6]],
                                                                                        dtype=torch.int32)


def test_triton_moves_bits(device):
    check_against_reference(*moved_bits_case(), device)


def check_in_a_cuda_graph(backend, device):
    """Captures one ``backend`` call and replays it with new paths: the reference's caches every time."""
    backend_or_skip("compact_kv", backend)
    generator = torch.Generator().manual_seed(7)
    k_cache, v_cache, tables = make_cache(generator, 3, 6, torch.float16)
    k_cache, v_cache, tables = k_cache.to(device), v_cache.to(device), tables.to(device)
    prefix = torch.tensor([2, 5, 0], dtype=torch.int32, device=device)
    accepted = torch.tensor([[0, 2, 3, -1], [0, 1, 3, 7], [0, 4, -1, -1]], dtype=torch.int32, device=device)
    sk.compact_kv(k_cache.clone(), v_cache.clone(), tables, prefix, accepted, backend=backend)  # compile first
    graph = torch.cuda.CUDAGraph()
    captured_k, captured_v = k_cache.clone(), v_cache.clone()
    with torch.cuda.graph(graph):
        sk.compact_kv(captured_k, captured_v, tables, prefix, accepted, backend=backend)
    for step in range(3):
        accepted[:, 1] = step + 1
        captured_k.copy_(k_cache)
        captured_v.copy_(v_cache)
        graph.replay()
        want_k, want_v = k_cache.clone(), v_cache.clone()
        sk.compact_kv(want_k, want_v, tables, prefix, accepted, backend="reference")
        assert torch.equal(captured_k, want_k) and torch.equal(captured_v, want_v)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-graph capture needs a GPU")
def test_triton_compact_kv_in_a_cuda_graph(device):
    check_in_a_cuda_graph("triton", device)


def test_triton_gpu_launch_config_under_the_interpreter(device, monkeypatch):
    # The GPU's tile (N = 1024 x one feature per program), so the interpreter
    # also runs the configuration a GPU launches.
    from specdec_kernels.launchers import compact_kv as launcher

    monkeypatch.setattr(launcher, "INTERPRETER_MAX_TILE", launcher.MAX_TILE)
    generator = torch.Generator().manual_seed(9)
    batch_size, width, block_size, max_blocks = 2, 1024, 256, 5
    num_blocks = batch_size * max_blocks
    tables = torch.randperm(num_blocks, generator=generator).view(batch_size, max_blocks).to(torch.int32)
    shape = (num_blocks, block_size, 2, 3)
    k_cache, v_cache = random_cache(generator, shape, torch.float32), random_cache(generator, shape, torch.float32)
    accepted = torch.full((batch_size, width), -1, dtype=torch.int32)
    accepted[0, :5] = torch.tensor([0, 300, 301, 700, 1000])
    accepted[1, :3] = torch.tensor([0, 2, 1])
    check_against_reference(k_cache, v_cache, tables, torch.tensor([3, 250], dtype=torch.int32), accepted, device)
