"""top_k / top_p / min_p and bonus_token_ids on chain_verify and tree_verify.

Three layers: the reference's truncation against an independent twin in
plain Python and numpy (the rule written out once more); every kernel
against the reference bit for bit; and the semantics the contract names
(top_k = 1 is greedy, extremes of top_p, ties at a threshold, the bonus
token). Exactness of verification against the truncated target is in
``test_sampling_parameters_exactness.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import specdec_kernels as sk
from conftest import ALL_BACKENDS, backend_or_skip
from specdec_kernels.reference import _truncation

KERNELS = [backend for backend in ALL_BACKENDS if backend != "reference"]


# ----------------------------------------------------------------------------- the rule, once more


def truncation_twin(row: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """The contract's truncation of one float32 row, in Python integers and numpy scalars."""
    vocab_size = row.shape[0]
    cleaned = np.where(row > 0, np.minimum(row, np.float32(1)), np.float32(0)).astype(np.float32)
    keys = cleaned.view(np.int32).astype(np.int64)
    weights = [int(np.float64(value) * 2.0**52) for value in cleaned]
    threshold = 0
    if 0 < top_k < vocab_size:
        threshold = sorted(keys, reverse=True)[top_k - 1]
    if 0 < top_p < 1:  # outside its range (NaN included) a parameter is off (v1.3)
        kept_total = sum(w for w, key in zip(weights, keys) if key >= threshold)
        goal = float(np.float64(np.float32(top_p))) * float(kept_total)
        for value in sorted(set(keys[keys >= threshold]), reverse=True):
            if float(sum(w for w, key in zip(weights, keys) if key >= value)) >= goal:
                threshold = max(threshold, value)
                break
    if 0 < min_p <= 1:
        scaled = np.float32(min_p) * np.float32(cleaned.max())
        threshold = max(threshold, int(np.array([scaled], dtype=np.float32).view(np.int32)[0]))
    kept = [w if key >= threshold else 0 for w, key in zip(weights, keys)]
    total = sum(kept)
    reciprocal = np.float32(1) / np.float32(float(total)) if total else np.float32(1)
    return np.array([np.float32(float(w) * float(reciprocal)) for w in kept], dtype=np.float32)


def awkward_rows(generator: torch.Generator, rows: int, vocab_size: int) -> torch.Tensor:
    """Rows with ties, zeros, NaN, negatives, values above 1 and probabilities below 2**-52."""
    values = torch.softmax(torch.randn(rows, vocab_size, generator=generator) * 3, -1)
    values[0] = torch.round(values[0] * 40) / 40  # many ties
    values[1, ::3] = 0.0
    values[2, 0], values[2, 1], values[2, 2] = float("nan"), -0.5, 1.5
    values[3, 1:] = 1e-17  # almost every weight is 0 in fixed point
    values[4] = 0.0  # no mass
    return values


@pytest.mark.parametrize("top_k, top_p, min_p", [
    (0, 1.0, 0.0), (1, 1.0, 0.0), (3, 1.0, 0.0), (12, 1.0, 0.0), (0, 0.5, 0.0), (0, 0.999, 0.0), (0, 0.0, 0.0),
    (0, 1.0, 0.3), (0, 1.0, 1.0), (5, 0.8, 0.1), (40, 0.95, 0.02), (0, 1.5, 2.0), (3, float("nan"), -0.5),
])
def test_reference_truncation_matches_the_twin(top_k, top_p, min_p):
    generator = torch.Generator().manual_seed(7)
    rows = awkward_rows(generator, 8, 41)
    batch = rows.shape[0]
    truncated = _truncation.truncate(
        rows.view(batch, 1, -1), torch.full((batch,), top_k), torch.full((batch,), top_p),
        torch.full((batch,), min_p)).view(batch, -1)
    off = not (0 < top_k < rows.shape[1] or 0 < top_p < 1 or 0 < min_p <= 1)
    for index in range(batch):
        expected = rows[index].numpy() if off else truncation_twin(rows[index].numpy(), top_k, top_p, min_p)
        np.testing.assert_array_equal(truncated[index].numpy().view(np.int32), expected.view(np.int32))


def test_ties_at_a_threshold_are_kept():
    row = torch.tensor([[[0.3, 0.2, 0.2, 0.2, 0.1]]])
    top_two = _truncation.truncate(row, torch.tensor([2]), None, None)
    assert (top_two[0, 0] > 0).tolist() == [True, True, True, True, False]
    half_of_max = _truncation.truncate(torch.tensor([[[0.4, 0.2, 0.2, 0.1, 0.1]]]), None, None, torch.tensor([0.5]))
    assert (half_of_max[0, 0] > 0).tolist() == [True, True, True, False, False]
    # 0.3 + 0.2 reaches 0.5 with every 0.2 tied: all of them are kept.
    top_half = _truncation.truncate(row, None, torch.tensor([0.5]), None)
    assert (top_half[0, 0] > 0).tolist() == [True, True, True, True, False]


def test_parameters_off_leave_the_rows_untouched():
    rows = torch.softmax(torch.randn(3, 2, 17), -1)
    untouched = _truncation.truncate(rows, torch.tensor([0, 17, -1]), torch.tensor([1.0, 2.0, float("nan")]),
                                     torch.tensor([0.0, -1.0, float("nan")]))
    assert torch.equal(untouched, rows)


# ----------------------------------------------------------------------------- kernels == reference


def chain_problem(generator, batch_size=7, max_drafts=4, vocab_size=2100):
    target = torch.softmax(torch.randn(batch_size, max_drafts + 1, vocab_size, generator=generator) * 2, -1)
    target[0] = torch.round(target[0] * 300) / 300  # ties
    draft = torch.softmax(torch.randn(batch_size, max_drafts, vocab_size, generator=generator) * 2, -1)
    ids = torch.multinomial(draft.view(-1, vocab_size), 1, generator=generator).view(batch_size, max_drafts)
    if batch_size > 3:
        ids[3, 2] = -1
    num_drafts = torch.tensor([4, 3, 0, 4, 2, 4, 1])[:batch_size].clamp_max(max_drafts)
    temperature = torch.tensor([1.0, 0.0, 0.7, 1.0, 2.0, 1.0, 0.0])[:batch_size]
    return ids, target, draft, num_drafts, temperature


def parameter_sets(batch_size, vocab_size, gpu_tiles=False):
    """Each parameter alone and together; with the GPU's tiles (slow under the interpreter) all together."""
    top_k = torch.tensor([0, 1, 5, 50, vocab_size - 1, 3, 2], dtype=torch.int32)[:batch_size]
    top_p = torch.tensor([0.5, 0.5, 0.9, 0.0, 0.99, 1.0, 0.7])[:batch_size]
    min_p = torch.tensor([0.0, 0.3, 0.1, 0.5, 0.02, 0.0, 0.05])[:batch_size]
    bonus = torch.arange(batch_size) + 100
    if gpu_tiles:
        return [dict(top_k=top_k, top_p=top_p, min_p=min_p, bonus_token_ids=bonus)]
    return [dict(top_k=top_k), dict(top_p=top_p), dict(min_p=min_p), dict(top_k=top_k, top_p=top_p, min_p=min_p),
            dict(bonus_token_ids=bonus), dict(top_p=top_p, bonus_token_ids=bonus.to(torch.int32))]


def on(device, arguments):
    return {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in arguments.items()}


def use_gpu_tiles(monkeypatch, op_name):
    """Give the Triton launcher the GPU's tiles under the interpreter (one request per program)."""
    if op_name == "chain_verify":
        from specdec_kernels.launchers import chain_verify as launcher

        monkeypatch.setattr(launcher, "INTERPRETER_LIMITS", launcher.GPU_LIMITS._replace(max_splits=3))
    else:
        from specdec_kernels.launchers import tree_verify as launcher

        monkeypatch.setattr(launcher, "INTERPRETER_TILE", launcher.TILE)


@pytest.mark.parametrize("backend", ["triton"])
@pytest.mark.parametrize("logits", [False, True], ids=["probabilities", "logits"])
@pytest.mark.parametrize("gpu_tiles", [False, True], ids=["interpreter-tiles", "gpu-tiles"])
def test_chain_kernels_match_the_reference(backend, logits, gpu_tiles, device, monkeypatch):
    """Bit for bit with probabilities; with logits the softmax may round differently, so the
    kernels are compared on these fixed inputs only where they agree untruncated too.

    Under the interpreter this is the whole-row walk plan (forced: these rows would split, and the staged
    plan's one request per program costs minutes here; ``test_chain_verify_staged.py`` checks it on smaller
    cases). A GPU runs the launcher's choice, the staged plan."""
    backend_or_skip("chain_verify", backend)
    if device.type != "cuda":
        from specdec_kernels.launchers import chain_verify as launcher

        monkeypatch.setattr(launcher, "STAGED_TRUNCATION", False)
    if gpu_tiles:
        if device.type == "cuda":
            pytest.skip("the interpreter's tiles are the only ones to swap")
        use_gpu_tiles(monkeypatch, "chain_verify")
    generator = torch.Generator().manual_seed(2)
    ids, target, draft, num_drafts, temperature = chain_problem(generator)
    wide = torch.zeros(target.shape[:-1] + (target.shape[-1] + 30,))
    wide[..., 30:] = target.log() if logits else target
    target = wide[..., 30:]  # strided rows
    for parameters in parameter_sets(ids.shape[0], target.shape[-1], gpu_tiles):
        for draft_rows in (None, draft)[gpu_tiles:]:
            arguments = dict(num_draft_tokens=num_drafts, temperature=temperature, logits=logits,
                             seed=torch.tensor([3, 2**40, -5, 0, 1, 2, 9]), offset=5, **parameters)
            expected = sk.chain_verify(ids, target, draft_rows, backend="reference", **arguments)
            result = sk.chain_verify(ids.to(device), target.to(device),
                                     None if draft_rows is None else draft_rows.to(device), backend=backend,
                                     **on(device, arguments))
            for got, want in zip(result, expected):
                assert torch.equal(got.cpu(), want), (list(parameters), draft_rows is None)


@pytest.mark.parametrize("backend", ["triton"])
@pytest.mark.parametrize("draft_sampling", ["with_replacement", "without_replacement", None])
@pytest.mark.parametrize("gpu_tiles", [False, True], ids=["interpreter-tiles", "gpu-tiles"])
def test_tree_kernels_match_the_reference(backend, draft_sampling, gpu_tiles, device, monkeypatch):
    backend_or_skip("tree_verify", backend)
    if gpu_tiles:
        if device.type == "cuda":
            pytest.skip("the interpreter's tiles are the only ones to swap")
        use_gpu_tiles(monkeypatch, "tree_verify")
    generator = torch.Generator().manual_seed(1)
    batch_size, tree_size, vocab_size = 7, 9, 1500
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 3, 3, 0]]).expand(batch_size, -1)
    target = torch.softmax(torch.randn(batch_size, tree_size, vocab_size, generator=generator) * 2, -1)
    target[0] = torch.round(target[0] * 200) / 200
    draft = torch.softmax(torch.randn(batch_size, tree_size, vocab_size, generator=generator) * 2, -1)
    ids = torch.multinomial(draft[:, 0], tree_size, replacement=True, generator=generator)
    temperature = torch.tensor([1.0, 0.0, 0.7, 1.0, 2.0, 1.0, 0.0])
    num_nodes = torch.tensor([9, 9, 1, 5, 9, 3, 9])
    for parameters in parameter_sets(batch_size, vocab_size, gpu_tiles):
        arguments = dict(num_nodes=num_nodes, temperature=temperature, seed=11, offset=torch.tensor(3),
                         draft_sampling=draft_sampling or "with_replacement", **parameters)
        draft_rows = None if draft_sampling is None else draft
        expected = sk.tree_verify(ids, parents, target, draft_rows, backend="reference", **arguments)
        result = sk.tree_verify(ids.to(device), parents.to(device), target.to(device),
                                None if draft_rows is None else draft_rows.to(device), backend=backend,
                                **on(device, arguments))
        for got, want in zip(result, expected):
            assert torch.equal(got.cpu(), want), list(parameters)


# ----------------------------------------------------------------------------- semantics


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_top_k_one_and_tiny_top_p_are_greedy(backend, device):
    backend_or_skip("chain_verify", backend)
    generator = torch.Generator().manual_seed(4)
    ids, target, draft, num_drafts, _ = chain_problem(generator, vocab_size=300)
    target[0] = torch.softmax(torch.randn(target.shape[1:], generator=generator), -1)  # no tied maxima
    ids[:, 0] = target[:, 0].argmax(-1)  # some drafts agree with the argmax
    batch_size = ids.shape[0]
    greedy = sk.chain_verify(ids, target, draft, num_draft_tokens=num_drafts, temperature=torch.zeros(batch_size),
                             backend="reference")
    for parameters in (dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)):
        for seed in range(3):
            result = sk.chain_verify(ids.to(device), target.to(device), draft.to(device),
                                     num_draft_tokens=num_drafts.to(device), seed=seed, backend=backend,
                                     **parameters)
            for got, want in zip(result, greedy):
                assert torch.equal(got.cpu(), want), parameters


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_top_k_one_in_a_tree_follows_the_argmax_path(backend, device):
    backend_or_skip("tree_verify", backend)
    generator = torch.Generator().manual_seed(5)
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2]]).expand(4, -1)
    target = torch.softmax(torch.randn(4, 6, 50, generator=generator) * 2, -1)
    ids = torch.randint(0, 50, (4, 6), generator=generator)
    ids[:, 2] = target[:, 0].argmax(-1)
    greedy = sk.tree_verify(ids, parents, target, temperature=0.0, backend="reference")
    result = sk.tree_verify(ids.to(device), parents.to(device), target.to(device), top_k=1, seed=3, backend=backend)
    for got, want in zip(result, greedy):
        assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_tokens_outside_the_truncated_set_are_never_emitted(backend, device):
    """min_p = 0.5 on rows [0.4, 0.2, 0.2, 0.1, 0.1]: tokens 3 and 4 are gone, the tied 0.2s stay."""
    backend_or_skip("chain_verify", backend)
    batch_size = 400
    target = torch.tensor([0.4, 0.2, 0.2, 0.1, 0.1]).expand(batch_size, 2, -1).contiguous()
    draft = torch.tensor([0.1, 0.1, 0.1, 0.35, 0.35]).expand(batch_size, 1, -1).contiguous()
    ids = torch.multinomial(draft[:, 0], 1, generator=torch.Generator().manual_seed(0))
    output, _ = sk.chain_verify(ids.to(device), target.to(device), draft.to(device), min_p=0.5, seed=1,
                                backend=backend)
    emitted = output.cpu()
    emitted = emitted[emitted >= 0]
    assert not bool(((emitted == 3) | (emitted == 4)).any())
    assert {int(token) for token in emitted.unique()} == {0, 1, 2}


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_parameters_at_their_neutral_values_change_nothing(backend, device):
    backend_or_skip("chain_verify", backend)
    generator = torch.Generator().manual_seed(6)
    ids, target, draft, num_drafts, temperature = chain_problem(generator, vocab_size=200)
    plain = sk.chain_verify(ids, target, draft, num_draft_tokens=num_drafts, temperature=temperature, seed=2,
                            backend="reference")
    result = sk.chain_verify(ids.to(device), target.to(device), draft.to(device),
                             num_draft_tokens=num_drafts.to(device), temperature=temperature.to(device), seed=2,
                             top_k=0, top_p=1.0, min_p=0.0, backend=backend)
    for got, want in zip(result, plain):
        assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_chain_bonus_token_replaces_the_bonus_sample_and_its_row_is_not_read(backend, device):
    backend_or_skip("chain_verify", backend)
    generator = torch.Generator().manual_seed(8)
    batch_size, max_drafts, vocab_size = 6, 3, 64
    target = torch.softmax(torch.randn(batch_size, max_drafts + 1, vocab_size, generator=generator), -1)
    draft = target[:, :max_drafts].clone()  # draft == target: every draft is accepted
    ids = torch.multinomial(draft.reshape(-1, vocab_size), 1, generator=generator).view(batch_size, max_drafts)
    num_drafts = torch.tensor([3, 2, 0, 3, 1, 3])
    temperature = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    ids[3] = target[3, :max_drafts].argmax(-1)  # the greedy request accepts all too
    ids[5, 0] = target[5, 0].argmax()
    ids[5, 1] = (target[5, 1].argmax() + 1) % vocab_size  # ... and this one stops at position 1
    bonus = torch.arange(batch_size) + 10
    poisoned = target.clone()
    poisoned[torch.arange(batch_size), num_drafts] = float("nan")  # the bonus rows
    output, accepted = sk.chain_verify(ids.to(device), poisoned.to(device), draft.to(device),
                                       num_draft_tokens=num_drafts.to(device), temperature=temperature.to(device),
                                       bonus_token_ids=bonus.to(device), seed=1, backend=backend)
    output, accepted = output.cpu(), accepted.cpu()
    takes_bonus = accepted == num_drafts
    assert takes_bonus.tolist() == [True, True, True, True, True, False]
    assert torch.equal(output[torch.arange(batch_size), accepted][takes_bonus], bonus[takes_bonus].to(torch.int32))
    assert output[5, 1] == target[5, 1].argmax()


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_tree_bonus_token_at_a_leaf_only(backend, device):
    backend_or_skip("tree_verify", backend)
    generator = torch.Generator().manual_seed(9)
    parents = torch.tensor([[-1, 0, 1], [-1, 0, 1], [-1, 0, 0]])
    target = torch.softmax(torch.randn(3, 3, 40, generator=generator), -1)
    ids = torch.tensor([[0, 5, 6], [0, 5, 6], [0, 7, 8]])
    target[0, 0] = torch.nn.functional.one_hot(torch.tensor(5), 40)  # request 0 accepts 5 then 6
    target[0, 1] = torch.nn.functional.one_hot(torch.tensor(6), 40)
    target[1, 0] = torch.nn.functional.one_hot(torch.tensor(9), 40)  # request 1 rejects node 1 at the root
    target[2, 0] = torch.nn.functional.one_hot(torch.tensor(8), 40)  # request 2 rejects 7, accepts 8: a leaf
    bonus = torch.tensor([21, 22, 23])
    nodes, output, accepted = sk.tree_verify(ids.to(device), parents.to(device), target.to(device),
                                             bonus_token_ids=bonus.to(device), seed=0, backend=backend)
    assert accepted.cpu().tolist() == [2, 0, 1]
    assert output.cpu().tolist() == [[5, 6, 21], [9, -1, -1], [8, 23, -1]]


@pytest.mark.parametrize("arguments, pattern", [
    (dict(top_k=torch.tensor([1, 2, 3])), r"`top_k` must have shape \[B\] = \[2\]; got \[3\]"),
    (dict(top_p=torch.tensor([0.5, 0.5], dtype=torch.float64)), r"`top_p` must have dtype float32"),
    (dict(min_p="0.1"), r"`min_p` must be a tensor of shape \[B\] or a Python number"),
    (dict(bonus_token_ids=torch.tensor([1.0, 2.0])), r"`bonus_token_ids` must have dtype int32 or int64"),
])
def test_bad_parameters_name_the_argument(arguments, pattern):
    ids, target, draft, _, _ = chain_problem(torch.Generator().manual_seed(0), batch_size=2, vocab_size=50)
    with pytest.raises((TypeError, ValueError), match=pattern):
        sk.chain_verify(ids, target, draft, backend="reference", **arguments)


@pytest.mark.parametrize("arguments, pattern", [
    (dict(top_k=torch.tensor([-1, 2])), r"`top_k` must be >= 0"),
    (dict(top_p=0.0), r"`top_p` must be in \(0, 1\]"),
    (dict(min_p=1.5), r"`min_p` must be in \[0, 1\]"),
    (dict(bonus_token_ids=torch.tensor([0, 50])), r"`bonus_token_ids` must be in \[0, V\)"),
])
def test_validate_checks_parameter_values(arguments, pattern):
    ids, target, draft, _, _ = chain_problem(torch.Generator().manual_seed(0), batch_size=2, vocab_size=50)
    target = target / target.sum(-1, keepdim=True)  # chain_problem's tie row is not normalised: validate refuses it
    with pytest.raises(ValueError, match=pattern):
        sk.chain_verify(ids, target, draft, backend="reference", validate=True, **arguments)
