"""sk.tree_mask_dense and sk.tree_mask_flashinfer: build_tree's mask in other kernels' layouts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import specdec_kernels as sk
from test_tree_attention import ancestor_bits, pack_bits


@pytest.mark.parametrize("tree_size", [1, 31, 32, 33, 64, 100])
def test_dense_unpacks_every_bit(tree_size, device):
    # Random bits, bit 31 of each word (negative int32 words) included.
    generator = torch.Generator().manual_seed(tree_size)
    bits = torch.rand(3, tree_size, tree_size, generator=generator) < 0.5
    bits[:, :, 31::32] = True
    assert torch.equal(sk.tree_mask_dense(pack_bits(bits).to(device)).cpu(), bits)


def test_dense_of_build_tree_is_the_ancestor_relation(device):
    generator = torch.Generator().manual_seed(1)
    parents = torch.full((4, 40), -1, dtype=torch.int32)
    for b in range(4):
        for i in range(1, 40):
            parents[b, i] = int(torch.randint(max(0, i - 5), i, (), generator=generator))
    expected = torch.zeros(4, 40, 40, dtype=torch.bool)
    for b in range(4):
        for i in range(40):
            node = i
            while node >= 0:
                expected[b, i, node] = True
                node = int(parents[b, node])
    mask = sk.build_tree(parents.to(device)).mask
    assert torch.equal(sk.tree_mask_dense(mask).cpu(), expected)


def test_dense_drops_padding_nodes(device):
    bits = ancestor_bits(torch.Generator().manual_seed(2), 2, 9)
    num_nodes = torch.tensor([4, 9], dtype=torch.int32)
    dense = sk.tree_mask_dense(pack_bits(bits).to(device), num_nodes.to(device)).cpu()
    assert torch.equal(dense[1], bits[1])
    assert torch.equal(dense[0, :4, :4], bits[0, :4, :4])
    assert not dense[0, 4:].any() and not dense[0, :, 4:].any()


def test_flashinfer_layout_by_hand(device):
    # Nodes 0 and 1 (child of 0) after 3 prefix positions: rows 1111|0 and
    # 1111|1, 10 bits, little-endian within each byte.
    mask = sk.build_tree(torch.tensor([[-1, 0]], dtype=torch.int32, device=device)).mask
    packed, indptr = sk.tree_mask_flashinfer(mask, torch.tensor([3], dtype=torch.int32, device=device))
    assert packed.dtype == torch.uint8 and indptr.dtype == torch.int32
    assert packed.tolist() == [0b11101111, 0b00000011] and indptr.tolist() == [0, 2]


def test_flashinfer_layout_unpacks_to_the_dense_rows(device):
    """Each request's segment, unpacked with numpy (bitorder little), is its
    [n_b, P_b + n_b] row-major mask: all true over the prefix, then the tree bits."""
    generator = torch.Generator().manual_seed(3)
    batch_size, tree_size = 4, 37
    bits = ancestor_bits(generator, batch_size, tree_size)
    prefix_lens = torch.tensor([0, 5, 64, 13], dtype=torch.int32)
    num_nodes = torch.tensor([37, 1, 20, 33], dtype=torch.int32)
    packed, indptr = sk.tree_mask_flashinfer(pack_bits(bits).to(device), prefix_lens.to(device),
                                             num_nodes.to(device))
    packed, indptr = packed.cpu().numpy(), indptr.cpu().tolist()
    assert indptr[0] == 0 and len(indptr) == batch_size + 1
    for b in range(batch_size):
        count, prefix = int(num_nodes[b]), int(prefix_lens[b])
        assert indptr[b + 1] - indptr[b] == -(-count * (prefix + count) // 8)
        unpacked = np.unpackbits(packed[indptr[b]:indptr[b + 1]], bitorder="little")
        rows = torch.from_numpy(unpacked[: count * (prefix + count)].astype(bool)).view(count, prefix + count)
        assert rows[:, :prefix].all()
        assert torch.equal(rows[:, prefix:], bits[b, :count, :count])
        assert not unpacked[count * (prefix + count):].any(), "padding bits of the last byte are zero"


def test_checks_name_the_argument():
    with pytest.raises(TypeError, match="tree_mask_dense: `tree_mask`"):
        sk.tree_mask_dense(torch.zeros(1, 2, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"ceil\(N/32\)"):
        sk.tree_mask_dense(torch.zeros(1, 40, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="prefix_lens"):
        sk.tree_mask_flashinfer(torch.zeros(2, 3, 1, dtype=torch.int32), torch.zeros(3, dtype=torch.int32))


def test_dense_mask_drives_sdpa_to_the_same_attention(device):
    """The dense mask, with the prefix prepended, fed to PyTorch SDPA gives sk.tree_attention's output."""
    generator = torch.Generator().manual_seed(4)
    batch_size, tree_size, num_q_heads, num_kv_heads, head_dim, block_size = 2, 6, 4, 2, 64, 4
    prefix_lens = torch.tensor([7, 7], dtype=torch.int32)
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2], [-1, 0, 1, 2, 3, 0]], dtype=torch.int32)
    mask = sk.build_tree(parents).mask
    length = 7 + tree_size
    blocks = -(-length // block_size)
    tables = torch.arange(batch_size * blocks, dtype=torch.int32).view(batch_size, blocks)
    k_cache = torch.randn(batch_size * blocks, block_size, num_kv_heads, head_dim, generator=generator)
    v_cache = torch.randn(batch_size * blocks, block_size, num_kv_heads, head_dim, generator=generator)
    q = torch.randn(batch_size, tree_size, num_q_heads, head_dim, generator=generator)
    expected = sk.tree_attention(*(t.to(device) for t in (q, k_cache, v_cache, tables, prefix_lens, mask)),
                                 backend="reference").cpu()

    keys = k_cache.view(batch_size, blocks * block_size, num_kv_heads, head_dim)[:, :length]
    values = v_cache.view(batch_size, blocks * block_size, num_kv_heads, head_dim)[:, :length]
    visible = torch.cat([torch.ones(batch_size, tree_size, 7, dtype=torch.bool), sk.tree_mask_dense(mask)], 2)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=visible[:, None],
        enable_gqa=True,
    ).transpose(1, 2)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
