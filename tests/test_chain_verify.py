"""chain_verify: edge cases, invariants, RNG contract and argument checks.

Every test runs on each backend that can run here; kernels must equal the
reference bit for bit with probability inputs (``test_backends_match_reference``).
"""

import numpy as np
import pytest
import torch
from scipy import stats

import specdec_kernels as sk
from conftest import ALL_BACKENDS, backend_or_skip
from markov import SIGNIFICANCE


def random_case(batch_size, max_drafts, vocab_size, *, seed, dtype=torch.float32, device="cpu", sharp=1.0):
    generator = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(batch_size, max_drafts + 1, vocab_size, generator=generator) * sharp, -1)
    draft = torch.softmax(torch.randn(batch_size, max_drafts, vocab_size, generator=generator) * sharp, -1)
    draft_ids = torch.multinomial(draft.reshape(-1, vocab_size), 1, generator=generator).view(batch_size, max_drafts)
    num_drafts = torch.randint(0, max_drafts + 1, (batch_size,), generator=generator, dtype=torch.int32)
    return (draft_ids.to(device), target.to(dtype).to(device), draft.to(dtype).to(device), num_drafts.to(device))


def expected_counts(probabilities: torch.Tensor, total: int) -> np.ndarray:
    weights = probabilities.double().numpy()
    return weights / weights.sum() * total


def check_invariants(output, num_accepted, draft_ids, num_drafts, vocab_size):
    batch_size, width = output.shape
    assert output.dtype == torch.int32 and num_accepted.dtype == torch.int32
    assert output.shape == (batch_size, draft_ids.shape[1] + 1) and num_accepted.shape == (batch_size,)
    output, num_accepted = output.cpu().long(), num_accepted.cpu().long()
    draft_ids = draft_ids.cpu().long()
    limit = num_drafts.cpu().long() if num_drafts is not None else torch.full((batch_size,), width - 1)
    assert bool(((num_accepted >= 0) & (num_accepted <= limit)).all())
    positions = torch.arange(width).view(1, -1)
    accepted = positions < num_accepted.view(-1, 1)
    assert bool((output[:, :-1][accepted[:, :-1]] == draft_ids[accepted[:, :-1]]).all())
    emitted = output[torch.arange(batch_size), num_accepted]
    assert bool(((emitted >= 0) & (emitted < vocab_size)).all())
    assert bool((output[positions > num_accepted.view(-1, 1)] == -1).all())


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("batch_size, max_drafts, vocab_size",
                         [(1, 1, 7), (5, 3, 111), (3, 4, 1), (2, 2, 1024), (3, 2, 1025), (2, 3, 3000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_backends_match_reference(backend, batch_size, max_drafts, vocab_size, dtype, device):
    backend_or_skip("chain_verify", backend)
    draft_ids, target, draft, num_drafts = random_case(batch_size, max_drafts, vocab_size, seed=vocab_size,
                                                       dtype=dtype, device=device)
    greedy_mix = torch.ones(batch_size, device=device)
    greedy_mix[::2] = 0.0  # greedy and sampling requests in one batch
    for offset, temperature in [(0, None), (1, greedy_mix), (2, None)]:
        kwargs = dict(num_draft_tokens=num_drafts, temperature=temperature, seed=42, offset=offset)
        expected = sk.chain_verify(draft_ids, target, draft, backend="reference", **kwargs)
        actual = sk.chain_verify(draft_ids, target, draft, backend=backend, **kwargs)
        check_invariants(*actual, draft_ids, num_drafts, vocab_size)
        assert torch.equal(actual[0], expected[0]) and torch.equal(actual[1], expected[1])
        expected = sk.chain_verify(draft_ids, target, None, backend="reference", **kwargs)
        actual = sk.chain_verify(draft_ids, target, None, backend=backend, **kwargs)
        assert torch.equal(actual[0], expected[0]) and torch.equal(actual[1], expected[1])


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_strided_inputs(backend, device):
    backend_or_skip("chain_verify", backend)
    draft_ids, target, draft, num_drafts = random_case(5, 3, 64, seed=12, device=device)
    strided_ids = draft_ids.t().contiguous().t()
    strided_target = target.transpose(1, 2).contiguous().transpose(1, 2)
    seeds = torch.arange(10, device=device)[::2]
    expected = sk.chain_verify(draft_ids, target, draft, num_draft_tokens=num_drafts, seed=seeds.contiguous(),
                               backend="reference")
    actual = sk.chain_verify(strided_ids, strided_target, draft, num_draft_tokens=num_drafts, seed=seeds,
                             backend=backend)
    assert torch.equal(actual[0], expected[0]) and torch.equal(actual[1], expected[1])


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_out_of_range_counts_are_clamped(backend, device):
    backend_or_skip("chain_verify", backend)
    draft_ids, target, draft, _ = random_case(3, 3, 50, seed=13, device=device)
    counts = torch.tensor([-3, 9, 2], dtype=torch.int32, device=device)
    actual = sk.chain_verify(draft_ids, target, draft, num_draft_tokens=counts, seed=4, backend=backend)
    clamped = sk.chain_verify(draft_ids, target, draft, num_draft_tokens=counts.clamp(0, 3), seed=4,
                              backend="reference")
    assert torch.equal(actual[0], clamped[0]) and torch.equal(actual[1], clamped[1])


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_equal_distributions_accept_everything(backend, device):
    backend_or_skip("chain_verify", backend)
    draft_ids, target, _, _ = random_case(64, 5, 50, seed=1, device=device)
    output, num_accepted = sk.chain_verify(draft_ids, target, target[:, :-1], seed=3, backend=backend)
    assert bool((num_accepted == 5).all())
    assert torch.equal(output[:, :5], draft_ids.to(torch.int32))


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_zero_probability_tokens_are_never_emitted(backend, device):
    backend_or_skip("chain_verify", backend)
    batch_size, vocab_size = 4000, 6
    target = torch.full((batch_size, 3, vocab_size), 1.0 / 3)
    target[..., 3:] = 0.0  # tokens 3, 4, 5 have zero target probability
    draft = torch.full((batch_size, 2, vocab_size), 1.0 / vocab_size)
    draft_ids = torch.randint(0, vocab_size, (batch_size, 2), generator=torch.Generator().manual_seed(0))
    output, num_accepted = sk.chain_verify(draft_ids.to(device), target.to(device), draft.to(device), seed=9,
                                           backend=backend)
    output, num_accepted = output.cpu(), num_accepted.cpu()
    emitted = output[torch.arange(batch_size), num_accepted.long()]
    assert bool((emitted < 3).all())
    kept = output[output >= 0]
    assert bool((kept < 3).all())


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_invalid_draft_ids_are_rejections(backend, device):
    backend_or_skip("chain_verify", backend)
    target = torch.full((4, 3, 5), 0.2)
    draft_ids = torch.tensor([[-1, 0], [5, 1], [0, 99], [2, -7]])
    output, num_accepted = sk.chain_verify(draft_ids.to(device), target.to(device), None, seed=1, backend=backend)
    assert num_accepted.cpu().tolist()[0] == 0 and num_accepted.cpu().tolist()[1] == 0
    assert int(num_accepted[2]) <= 1 and int(num_accepted[3]) <= 1
    check_invariants(output, num_accepted, draft_ids, None, 5)


def test_invalid_draft_id_emits_from_the_target(device):
    """An invalid id is no proposal: the emitted token follows p exactly."""
    batch_size = 60_000
    p = torch.tensor([0.1, 0.2, 0.3, 0.4])
    target = p.view(1, 1, 4).expand(batch_size, 2, 4)
    draft = torch.tensor([0.7, 0.1, 0.1, 0.1]).view(1, 1, 4).expand(batch_size, 1, 4)
    draft_ids = torch.full((batch_size, 1), -1)
    output, _ = sk.chain_verify(draft_ids, target, draft, seed=5, backend="reference")
    counts = torch.bincount(output[:, 0].long(), minlength=4).numpy()
    assert stats.chisquare(counts, expected_counts(p, counts.sum())).pvalue >= SIGNIFICANCE


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_vocabulary_of_one(backend, device):
    backend_or_skip("chain_verify", backend)
    target = torch.ones(3, 4, 1)
    draft_ids = torch.zeros(3, 3, dtype=torch.int32)
    output, num_accepted = sk.chain_verify(draft_ids.to(device), target.to(device), target[:, :3].to(device),
                                           backend=backend)
    assert num_accepted.cpu().tolist() == [3, 3, 3]
    assert bool((output.cpu() == 0).all())


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_zero_drafts_sample_the_bonus_row(backend, device):
    backend_or_skip("chain_verify", backend)
    batch_size = 20_000
    p = torch.tensor([0.5, 0.25, 0.125, 0.125])
    target = p.view(1, 1, 4).expand(batch_size, 3, 4).contiguous()
    draft_ids = torch.zeros(batch_size, 2, dtype=torch.int64)
    num_drafts = torch.zeros(batch_size, dtype=torch.int32)
    output, num_accepted = sk.chain_verify(draft_ids.to(device), target.to(device), None,
                                           num_draft_tokens=num_drafts.to(device), seed=2, backend=backend)
    assert bool((num_accepted == 0).all()) and bool((output[:, 1:] == -1).all())
    counts = torch.bincount(output[:, 0].cpu().long(), minlength=4).numpy()
    assert stats.chisquare(counts, expected_counts(p, counts.sum())).pvalue >= SIGNIFICANCE


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_empty_chain(backend, device):
    backend_or_skip("chain_verify", backend)
    target = torch.softmax(torch.randn(2, 1, 9), -1).to(device)
    output, num_accepted = sk.chain_verify(torch.zeros(2, 0, dtype=torch.int64, device=device), target,
                                           backend=backend)
    assert output.shape == (2, 1) and num_accepted.tolist() == [0, 0]


def test_residual_without_mass_falls_back_to_the_target(device):
    # Unnormalised target p = q / 2: rejections happen, max(0, p - q) is 0.
    batch_size = 40_000
    q = torch.tensor([0.1, 0.2, 0.3, 0.4])
    target = (q / 2).view(1, 1, 4).expand(batch_size, 2, 4)
    draft = q.view(1, 1, 4).expand(batch_size, 1, 4)
    draft_ids = torch.multinomial(q, batch_size, replacement=True, generator=torch.Generator().manual_seed(1))
    output, num_accepted = sk.chain_verify(draft_ids.view(-1, 1), target, draft, seed=3, backend="reference")
    rejected = num_accepted == 0
    assert 0.4 < float(rejected.float().mean()) < 0.6
    counts = torch.bincount(output[rejected, 0].long(), minlength=4).numpy()
    assert stats.chisquare(counts, expected_counts(q, counts.sum())).pvalue >= SIGNIFICANCE


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_greedy_and_sampling_requests_in_one_batch(backend, device):
    backend_or_skip("chain_verify", backend)
    draft_ids, target, draft, num_drafts = random_case(8, 4, 30, seed=7, device=device, sharp=3.0)
    logits = torch.log(target)
    argmax = target.argmax(-1)
    draft_ids[::2] = argmax[::2, :4]  # greedy requests propose the target's argmax...
    draft_ids[::2, 2] = (argmax[::2, 2] + 1) % 30  # ...until position 2
    temperature = torch.tensor([0.0, 1.0] * 4, device=device)
    output, num_accepted = sk.chain_verify(draft_ids, logits, torch.log(draft), temperature=temperature,
                                           logits=True, seed=1, backend=backend)
    assert num_accepted[::2].tolist() == [2] * 4
    assert output[::2, 2].tolist() == argmax[::2, 2].tolist()
    full_greedy = sk.chain_verify(draft_ids, target, draft, temperature=torch.zeros(8, device=device),
                                  backend=backend)
    assert torch.equal(full_greedy[1][::2], num_accepted[::2])


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_per_request_seeds_are_batch_invariant(backend, device):
    backend_or_skip("chain_verify", backend)
    draft_ids, target, draft, _ = random_case(6, 3, 40, seed=4, device=device)
    seeds = torch.tensor([11, 22, 33, 44, 55, 66], device=device)
    offsets = torch.tensor([5, 6, 7, 8, 9, 10], device=device)
    batch = sk.chain_verify(draft_ids, target, draft, seed=seeds, offset=offsets, backend=backend)
    for request in range(6):
        alone = sk.chain_verify(draft_ids[request:request + 1], target[request:request + 1],
                                draft[request:request + 1], seed=seeds[request:request + 1],
                                offset=offsets[request:request + 1], backend=backend)
        assert torch.equal(alone[0][0], batch[0][request]) and torch.equal(alone[1][0], batch[1][request])


def test_shared_int_seed_gives_independent_requests(device):
    batch_size = 50_000
    p = torch.tensor([0.25, 0.25, 0.25, 0.25])
    target = p.view(1, 1, 4).expand(batch_size, 1, 4)
    output, _ = sk.chain_verify(torch.zeros(batch_size, 0, dtype=torch.int64), target, seed=8, backend="reference")
    pairs = (output[0::2, 0] * 4 + output[1::2, 0]).long()
    counts = torch.bincount(pairs, minlength=16).numpy()
    assert stats.chisquare(counts, np.full(16, batch_size / 2 / 16)).pvalue >= SIGNIFICANCE


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_offset_forms_agree_and_offsets_change_the_draws(backend, device):
    backend_or_skip("chain_verify", backend)
    draft_ids, target, draft, _ = random_case(16, 3, 64, seed=9, device=device, sharp=0.3)
    as_int = sk.chain_verify(draft_ids, target, draft, seed=1, offset=2**33 + 5, backend=backend)
    scalar = torch.tensor(2**33 + 5, device=device)
    as_scalar = sk.chain_verify(draft_ids, target, draft, seed=1, offset=scalar, backend=backend)
    as_vector = sk.chain_verify(draft_ids, target, draft, seed=1, offset=scalar.repeat(16), backend=backend)
    assert torch.equal(as_int[0], as_scalar[0]) and torch.equal(as_int[0], as_vector[0])
    other = sk.chain_verify(draft_ids, target, draft, seed=1, offset=2**33 + 6, backend=backend)
    assert not torch.equal(as_int[0], other[0])


def test_argument_errors_name_the_argument(device):
    draft_ids, target, draft, num_drafts = random_case(2, 3, 10, seed=0, device=device)
    with pytest.raises(ValueError, match=r"`target` must have shape \[B, K\+1, V\]"):
        sk.chain_verify(draft_ids, target[0])
    with pytest.raises(ValueError, match=r"`draft_token_ids` must have shape \[B, K\] = \[2, 3\]; got \[2, 2\]"):
        sk.chain_verify(draft_ids[:, :2], target)
    with pytest.raises(TypeError, match=r"`draft_token_ids` must have dtype int32 or int64; got float32"):
        sk.chain_verify(draft_ids.float(), target)
    with pytest.raises(ValueError, match=r"`draft` must have shape \[B, K, V\] = \[2, 3, 10\]; got \[2, 3, 9\]"):
        sk.chain_verify(draft_ids, target, draft[..., :9])
    with pytest.raises(TypeError, match=r"`num_draft_tokens` must have dtype int32 or int64; got float32"):
        sk.chain_verify(draft_ids, target, num_draft_tokens=num_drafts.float())
    with pytest.raises(TypeError, match=r"`temperature` must be a float32 tensor of shape \[B\] or a Python float"):
        sk.chain_verify(draft_ids, target, temperature="hot")
    with pytest.raises(TypeError, match=r"`temperature` must have dtype float32"):
        sk.chain_verify(draft_ids, target, temperature=torch.ones(2, dtype=torch.float64, device=device))
    with pytest.raises(ValueError, match=r"`seed` must have shape \[B\]"):
        sk.chain_verify(draft_ids, target, seed=torch.zeros(3, dtype=torch.int64, device=device))
    with pytest.raises(TypeError, match=r"`offset` must be an int or an int64 tensor"):
        sk.chain_verify(draft_ids, target, offset=1.5)
    with pytest.raises(ValueError, match=r"`backend` must be one of"):
        sk.chain_verify(draft_ids, target, backend="fast")


def test_validate_rejects_bad_values(device):
    draft_ids, target, draft, _ = random_case(2, 3, 10, seed=0, device=device)
    bad_ids = draft_ids.clone()
    bad_ids[1, 2] = 10
    with pytest.raises(ValueError, match=r"request 1 position 2 has 10"):
        sk.chain_verify(bad_ids, target, draft, validate=True)
    sk.chain_verify(bad_ids, target, draft, num_draft_tokens=torch.tensor([3, 2], dtype=torch.int32,
                                                                          device=device), validate=True)
    with pytest.raises(ValueError, match=r"`num_draft_tokens` must lie in \[0, K\] = \[0, 3\]; request 0 has 4"):
        sk.chain_verify(draft_ids, target, num_draft_tokens=torch.tensor([4, 0], dtype=torch.int32,
                                                                         device=device), validate=True)
    with pytest.raises(ValueError, match=r"`temperature` must not be \+inf"):
        sk.chain_verify(draft_ids, target, temperature=torch.tensor([float("inf"), 1.0], device=device),
                        validate=True)


def test_unavailable_backend_says_why(device):
    from specdec_kernels import _extension

    draft_ids, target, _, _ = random_case(1, 1, 4, seed=0, device=device)
    if not _extension.cuda_extension_available() or device.type != "cuda":
        with pytest.raises(RuntimeError, match=r"backend 'cuda' cannot run"):
            sk.chain_verify(draft_ids, target, backend="cuda")


def test_triton_is_one_launch_per_call(monkeypatch, device):
    backend_or_skip("chain_verify", "triton")
    from specdec_kernels._kernels.chain_verify import _chain_verify_kernel

    launches = []
    original_run = _chain_verify_kernel.run

    def counting_run(*args, **kwargs):
        launches.append(kwargs.get("grid"))
        return original_run(*args, **kwargs)

    monkeypatch.setattr(_chain_verify_kernel, "run", counting_run)
    draft_ids, target, draft, num_drafts = random_case(3, 4, 300, seed=2, device=device)
    temperature = torch.tensor([0.0, 1.0, 0.7], device=device)
    sk.chain_verify(draft_ids, target, draft, num_draft_tokens=num_drafts, temperature=temperature,
                    backend="triton")
    sk.chain_verify(draft_ids, torch.log(target), draft, temperature=temperature, logits=True,
                    backend="triton")
    assert len(launches) == 2
    assert_counters_at_zero(device)


def assert_counters_at_zero(device):
    """No memset precedes a launch: each call must leave its counters at zero (and no wait may give up)."""
    from specdec_kernels import _workspace

    names = ("chain_verify.wave1_arrivals", "chain_verify.arrivals", "chain_verify.failed_row_blocks")
    counters = _workspace.buffers(device, {"chain_verify.tickets": (2, torch.int64),
                                           **{name: (1, torch.int32) for name in names}})
    for name, counter in counters.items():
        assert int(counter.abs().sum()) == 0, name
    assert not any(sk.kernel_errors(device).values())


def test_per_call_integers_are_not_specialised():
    """Seeds, offsets, the batch size and slice counts change per call: no compile may be keyed on them.

    Triton specialises an int on ``== 1`` and ``% 16`` and types it by its
    range, so seeds and offsets travel as two words, each a signed 32-bit int.
    """
    pytest.importorskip("triton")
    from specdec_kernels._kernels.chain_verify import _chain_verify_kernel as kernel
    from specdec_kernels.launchers.chain_verify import split_words

    if hasattr(kernel, "params"):
        names = {param.name for param in kernel.params if param.do_not_specialize}
    else:  # the interpreter's wrapper keeps the decorator's arguments
        names = set(kernel.kwargs["do_not_specialize"])
    assert {"seed_low", "seed_high", "offset_low", "offset_high", "batch_size", "max_drafts", "num_chunks",
            "num_splits", "chunks_per_split"} <= names
    for value in (0, 1, -1, 2**31, 2**32 + 5, -(2**63), 2**63 - 1):
        low, high = split_words(value)
        assert -(2**31) <= low < 2**31 and -(2**31) <= high < 2**31
        assert high * 2**32 + (low & 0xFFFFFFFF) == value


@pytest.mark.parametrize("multiprocessors", [None, 132])
def test_workspace_specs_cover_every_smaller_call(monkeypatch, multiprocessors):
    """A reservation for the largest B, K, V (``sk.reserve_workspace``) covers every smaller call's indices."""
    from specdec_kernels.launchers import chain_verify as launcher

    device = torch.device("cpu" if multiprocessors is None else "cuda")
    monkeypatch.setattr(launcher, "_multiprocessor_count", lambda _: multiprocessors)
    largest = dict(batch_size=300, rows_per_request=9, vocab_size=130000, logits=True, device=device)
    reserved = launcher.triton_workspace_specs(**largest)
    for batch_size in (1, 2, 3, 5, 17, 64, 131, 132, 133, 263, 264, 300):
        for rows_per_request in (1, 2, 5, 9):
            for vocab_size in (1, 16, 1000, 1025, 5000, 32000, 130000):
                config = launcher.launch_config(batch_size, rows_per_request, vocab_size, multiprocessors)
                needed = {
                    "chain_verify.chunk_total": batch_size * config.num_chunks,
                    "chain_verify.stat_max": batch_size * config.block_k1 * config.num_splits,
                    "chain_verify.arrivals": -(-batch_size // config.rows),
                }
                for name, numel in needed.items():
                    assert numel <= reserved[name][0], (name, batch_size, rows_per_request, vocab_size)


def _launcher_limits(monkeypatch, device, limits):
    from specdec_kernels.launchers import chain_verify as launcher

    monkeypatch.setattr(launcher, "GPU_LIMITS" if device.type == "cuda" else "INTERPRETER_LIMITS", limits)


@pytest.mark.parametrize("tile, decision_tile, combine_tile, max_splits", [
    (32768, 1 << 20, 1 << 20, 1),  # one program per row block: the whole vocabulary
    (1024, 4, 2, 2),  # slices of 3 and 2 chunks; the finishing program loops over chunk tiles
    (1024, 1 << 20, 1, 5),  # one chunk per slice; one slice and one chunk per combine step
    (2048, 8, 16, 4),  # slices of 2, 2 and 1 chunks
])
def test_tokens_do_not_depend_on_the_split(monkeypatch, device, tile, decision_tile, combine_tile, max_splits):
    """Any assignment of chunks to programs gives the reference's tokens (probabilities, bit for bit)."""
    backend_or_skip("chain_verify", "triton")
    from specdec_kernels.launchers.chain_verify import Limits

    _launcher_limits(monkeypatch, device, Limits(tile, decision_tile, combine_tile, max_splits))
    draft_ids, target, draft, num_drafts = random_case(3, 3, 4100, seed=5, device=device, sharp=4.0)
    target[2] = 1.0  # a garbage row: its total, 4100 * 2**52, passes 2**64 (128-bit chunk choice)
    temperature = torch.tensor([1.0, 0.0, 0.5], device=device)
    for case_draft, case_temperature in [(draft, None), (None, temperature), (draft, temperature)]:
        kwargs = dict(num_draft_tokens=num_drafts, temperature=case_temperature, seed=77, offset=3)
        expected = sk.chain_verify(draft_ids, target, case_draft, backend="reference", **kwargs)
        actual = sk.chain_verify(draft_ids, target, case_draft, backend="triton", **kwargs)
        assert torch.equal(actual[0], expected[0]) and torch.equal(actual[1], expected[1])
    assert_counters_at_zero(device)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_residual_without_mass_matches_reference(backend, device):
    """p = q / 2 has no residual mass: every rejection samples p, bit for bit on every backend."""
    backend_or_skip("chain_verify", backend)
    draft_ids, _, draft, _ = random_case(6, 2, 1500, seed=21, device=device)
    target = torch.cat([draft / 2, draft[:, :1]], dim=1)
    for seed in range(3):
        expected = sk.chain_verify(draft_ids, target, draft, seed=seed, backend="reference")
        actual = sk.chain_verify(draft_ids, target, draft, seed=seed, backend=backend)
        assert bool((expected[1] < 2).any())
        assert torch.equal(actual[0], expected[0]) and torch.equal(actual[1], expected[1])


def degenerate_probabilities(device):
    """Rows of NaN, zeros, negatives and weights above 1, in the target and the draft."""
    draft_ids, target, draft, _ = random_case(8, 2, 1100, seed=31, device=device)
    target, draft = target.clone(), draft.clone()
    target[0, 0] = float("nan")  # rejected (p NaN), residual NaN, fallback NaN: no mass
    target[1, 2] = 0.0  # bonus row without mass
    draft[2, 0] = float("nan")  # q NaN: rejected, residual NaN -> falls back to p
    target[3, 0, ::2] = -1.0  # negatives count as 0
    target[4, :] = 2.0  # weights above 1 count as 1: the total passes 2**62
    target[5, 1, :1024] = 0.0  # the first chunk has no mass
    draft_ids[6, 0] = -1  # an invalid id: sample p
    return draft_ids, target, draft


def degenerate_logits(device):
    """Outcomes that are exact in float32 (weights 0 or 1), so backends must agree bit for bit."""
    draft_ids, target, draft, _ = random_case(8, 2, 1100, seed=32, device=device)
    target, draft = torch.log(target), torch.log(draft)
    target[0, 0] = -float("inf")  # no mass: rejected, then -1
    target[1, 1] = float("nan")  # NaN row: no mass
    target[2, 0, 7] = float("inf")  # +inf: no mass
    draft[3, 0] = -float("inf")  # draft row without mass: rejected, residual falls back to p
    target[4, :, 100:] = -float("inf")  # with T = inf: uniform over 100 tokens
    target[5, :, :] = target[5, :, :1].expand(-1, 1100)  # all equal: uniform
    target[6, :, 50] = 1e4  # with a tiny T: one-hot (1e4 / 1e-30 must not overflow into NaN)
    target[6, :, 900] = 1e4  # ... a two-way tie
    temperature = torch.tensor([1.0, 1.0, 1.0, 1.0, float("inf"), 0.7, 1e-30, 1e-45], device=device)
    target[7] = target[6]  # denormal T: 1 / T overflows
    return draft_ids, target, draft, temperature


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("one_slice", [False, True])
def test_degenerate_rows_match_reference(backend, one_slice, monkeypatch, device):
    """``one_slice``: Triton takes each row whole (logits walk the rows) instead of two slices (two waves)."""
    backend_or_skip("chain_verify", backend)
    if one_slice:
        if backend != "triton":
            pytest.skip("a Triton launch configuration")
        from specdec_kernels.launchers.chain_verify import INTERPRETER_LIMITS

        _launcher_limits(monkeypatch, device, INTERPRETER_LIMITS._replace(max_splits=1))
    draft_ids, target, draft = degenerate_probabilities(device)
    greedy_mix = torch.tensor([0.0, 1.0] * 4, device=device)
    for temperature in (None, greedy_mix, torch.zeros(8, device=device)):
        for case_draft in (draft, None):
            kwargs = dict(temperature=temperature, seed=5, offset=1)
            expected = sk.chain_verify(draft_ids, target, case_draft, backend="reference", **kwargs)
            actual = sk.chain_verify(draft_ids, target, case_draft, backend=backend, **kwargs)
            assert torch.equal(actual[0], expected[0]) and torch.equal(actual[1], expected[1])
    draft_ids, target, draft, temperature = degenerate_logits(device)
    for case_temperature in (temperature, torch.where(torch.arange(8, device=device) % 3 == 0, 0.0, temperature)):
        kwargs = dict(temperature=case_temperature, logits=True, seed=6, offset=2)
        expected = sk.chain_verify(draft_ids, target, draft, backend="reference", **kwargs)
        actual = sk.chain_verify(draft_ids, target, draft, backend=backend, **kwargs)
        assert torch.equal(actual[0], expected[0]) and torch.equal(actual[1], expected[1])
    assert expected[0][0, 0] == -1 and expected[0][2, 0] == -1
    if backend == "triton":
        assert_counters_at_zero(device)


@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("vocab_size", [500, 2100])
def test_logits_agree_with_reference(backend, vocab_size, device):
    """Logits are not bit-for-bit: the kernels normalise with an online
    max/sum over vocabulary slices, the reference with ``torch.softmax``, so
    ``p(t)`` can differ in the last bits and flip an acceptance test or a
    sample at a prefix boundary. The rate is reported and must stay near 1;
    the distribution is exact on every backend (exactness suite). Under the
    interpreter V = 500 is one slice per row (Triton walks the rows), V =
    2100 three (two waves)."""
    backend_or_skip("chain_verify", backend)
    agree = total = 0
    for case in range(12 if vocab_size < 1000 else 6):
        dtype = (torch.float32, torch.bfloat16, torch.float16)[case % 3]
        draft_ids, target, draft, num_drafts = random_case(16, 4, vocab_size, seed=100 + case, device=device,
                                                           sharp=2.0)
        temperature = torch.rand(16, generator=torch.Generator().manual_seed(case)).to(device) + 0.3
        temperature[::5] = 0.0
        kwargs = dict(num_draft_tokens=num_drafts, temperature=temperature, logits=True, seed=case, offset=case)
        target_logits, draft_logits = torch.log(target).to(dtype), torch.log(draft).to(dtype)
        expected = sk.chain_verify(draft_ids, target_logits, draft_logits, backend="reference", **kwargs)
        actual = sk.chain_verify(draft_ids, target_logits, draft_logits, backend=backend, **kwargs)
        check_invariants(*actual, draft_ids, num_drafts, vocab_size)
        same = (actual[0] == expected[0]).all(dim=1) & (actual[1] == expected[1])
        agree += int(same.sum())
        total += same.numel()
    print(f"{backend} logits agreement with the reference: {agree}/{total} = {agree / total:.4f}")
    assert agree / total >= 0.99
