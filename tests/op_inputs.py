"""Small inputs for every op, shared by the registration, opcheck and torch.compile tests."""

import torch


def chain_inputs(device, batch_size=3, max_drafts=3, vocab_size=40):
    generator = torch.Generator().manual_seed(0)
    target = torch.softmax(torch.randn(batch_size, max_drafts + 1, vocab_size, generator=generator), -1)
    draft = torch.softmax(torch.randn(batch_size, max_drafts, vocab_size, generator=generator), -1)
    draft_ids = torch.randint(0, vocab_size, (batch_size, max_drafts), generator=generator)
    return draft_ids.to(device), target.to(device), draft.to(device)


def tree_inputs(device):
    parents = torch.tensor([[-1, 0, 0, 1, 1], [-1, 0, 1, 2, 0]], dtype=torch.int32)
    tokens = torch.tensor([[7, 1, 2, 3, 4], [7, 5, 6, 7, 8]])
    target = torch.softmax(torch.randn(2, 5, 12, generator=torch.Generator().manual_seed(1)), -1)
    return tokens.to(device), parents.to(device), target.to(device)


def cache_inputs(device):
    """float16: every backend's dtype (the Triton kernel refuses float32)."""
    generator = torch.Generator().manual_seed(2)
    q = torch.randn(2, 5, 4, 64, generator=generator).half()
    k_cache = torch.randn(6, 4, 2, 64, generator=generator).half()
    v_cache = torch.randn(6, 4, 2, 64, generator=generator).half()
    tables = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    lens = torch.tensor([3, 5], dtype=torch.int32)
    return tuple(t.to(device) for t in (q, k_cache, v_cache, tables, lens))
