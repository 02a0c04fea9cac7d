"""The CUDA chain_verify (csrc/include/specdec/chain_verify.cuh) against the reference.

Two ways in:

* ``sk.chain_verify(..., backend="cuda")`` runs the kernel (GPU only);
* ``torch.ops.specdec_C.chain_verify`` on CPU tensors runs the kernel's block
  program on the host: an emulated block of 8 std::threads (2 warps of 4
  lanes), blocks one after another, the vocabulary split over up to 8 blocks
  per batch (or the count the test forces). It shares the kernel's index
  math, workspace layout, acceptance tests, sampler (chunk scans, 128-bit
  chunk choice) and finishing logic (not the warp shuffles, the hardware
  barriers or the memory ordering), so these cases check the .cuh files on
  machines without a GPU.

With probabilities both must equal the reference bit for bit.
"""

import itertools

import pytest
import torch

import specdec_kernels as sk
from conftest import extension_op_marks
from specdec_kernels import _faults
from specdec_kernels._extension import cuda_extension_available, extension_error, extension_ops
from specdec_kernels.launchers.chain_verify import cuda_stage_words, cuda_workspace_specs
from specdec_kernels.reference import chain_verify as reference
from sampling_parameter_cases import (
    PARAMETER_SETS,
    SAMPLING_PARAMETERS,
    assert_logits_agree,
    quantised,
    sampling_parameters,
    with_parameters,
)

needs_op, needs_gpu, _ = extension_op_marks("chain_verify")

PROB_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def make_case(batch_size, max_drafts, vocab_size, *, seed, dtype=torch.float32, device="cpu", with_draft=True,
              logits=False, greedy_fraction=0.25, ragged=True, invalid_fraction=0.05):
    """Random inputs, generated on ``device``, with the awkward parts mixed in.

    Greedy requests (temperature 0) get their target's argmax as most draft
    tokens so that they accept a few; some ids are out of range (rejections);
    num_draft_tokens is ragged. Logits: target ``3 * N(0, 1)``, draft =
    target + ``N(0, 0.5)`` so that acceptance is high.
    """
    generator = torch.Generator(device=device).manual_seed(seed)

    def uniform(*shape):
        return torch.rand(shape, generator=generator, device=device)

    shape = (batch_size, max_drafts + 1, vocab_size)
    target_logits = torch.randn(shape, generator=generator, device=device) * 3.0
    draft_logits = target_logits[:, :max_drafts] + torch.randn(
        (batch_size, max_drafts, vocab_size), generator=generator, device=device) * 0.5
    target = target_logits if logits else torch.softmax(target_logits, -1)
    draft = torch.softmax(draft_logits, -1)  # `logits` covers the target only (v1.3)
    # Rounded to the storage dtype before any backend sees them.
    target, draft = target.to(dtype), draft.to(dtype)
    if max_drafts > 0:
        draft_probs = torch.softmax(draft_logits, -1).reshape(-1, vocab_size)
        ids = torch.multinomial(draft_probs, 1, generator=generator).view(batch_size, -1)
    else:
        ids = torch.zeros((batch_size, 0), dtype=torch.int64, device=device)
    greedy = uniform(batch_size) < greedy_fraction
    temperature = torch.where(greedy, 0.0, 0.5 + uniform(batch_size) if logits else torch.ones(batch_size,
                                                                                               device=device))
    argmax = target[:, :max_drafts].float().argmax(-1)
    ids = torch.where(greedy.view(-1, 1) & (uniform(*ids.shape) < 0.8), argmax, ids)
    bad_ids = torch.where(uniform(*ids.shape) < 0.5, -1, vocab_size + 3)
    ids = torch.where(uniform(*ids.shape) < invalid_fraction, bad_ids, ids)
    num_drafts = None
    if ragged:
        num_drafts = torch.randint(0, max_drafts + 1, (batch_size,), generator=generator, dtype=torch.int32,
                                   device=device)
    return dict(draft_token_ids=ids, target=target, draft=draft if with_draft else None,
                num_draft_tokens=num_drafts, temperature=temperature.to(torch.float32), logits=logits)


def random_state(kind, batch_size, device, step=0):
    """(seed, offset) in one of the API's forms."""
    seeds = torch.tensor([(7919 * b + 13) * (-1) ** b for b in range(batch_size)], dtype=torch.int64, device=device)
    forms = {
        "int": (1234, 5 + step),
        "int-large": (2**63 + 99, 2**32 + 7 + step),
        "per-request-seed": (seeds, 17 + step),
        "offset-scalar-tensor": (-42, torch.tensor(3 + step, dtype=torch.int64, device=device)),
        "offset-per-request": (seeds, torch.arange(batch_size, dtype=torch.int64, device=device) * 2**31 + step),
    }
    return forms[kind]


RANDOM_STATES = ["int", "int-large", "per-request-seed", "offset-scalar-tensor", "offset-per-request"]


def run_reference(case, seed, offset):
    return reference.chain_verify(case["draft_token_ids"], case["target"], case["draft"], case["num_draft_tokens"],
                                  case["temperature"], case["logits"], seed, offset, *sampling_parameters(case))


def run_op(case, seed, offset, num_splits=0, workspace_words=None, staged=True):
    """The raw op as the CUDA launcher calls it: on CPU tensors, the block program on the host.

    ``num_splits`` forces the blocks per request (0: the launcher's choice);
    ``workspace_words`` overrides the launcher's workspace size; ``staged``
    False passes no stage records, so top_k/top_p/min_p get one block per
    request (the walk plan). The counters and stage records must be left at zero.
    """
    target = case["target"]
    batch_size, rows, vocab_size = target.shape
    seed_tensor, seed_value = (seed, 0) if isinstance(seed, torch.Tensor) else (None, _wrap(seed))
    offset_tensor, offset_value = (offset, 0) if isinstance(offset, torch.Tensor) else (None, _wrap(offset))
    device = target.device
    specs = cuda_workspace_specs(batch_size, rows, vocab_size, case["logits"], device)
    if workspace_words is None:
        workspace_words = specs["chain_verify_cuda.workspace"][0]
        if num_splits:  # room for the forced split count
            workspace_words += batch_size * num_splits * 2 * rows
    # Garbage in the workspace: the program must not rely on its contents.
    workspace = torch.full((workspace_words,), -123456789, dtype=torch.int64, device=device)
    arrivals = torch.zeros(specs["chain_verify_cuda.arrivals"][0], dtype=torch.int32, device=device)
    # Records for every request, so that forced splits of any batch stage.
    stages = torch.zeros(cuda_stage_words(batch_size, rows), dtype=torch.int64, device=device) if staged else None
    output = torch.full((batch_size, rows), 77, dtype=torch.int32, device=device)
    num_accepted = torch.full((batch_size,), 77, dtype=torch.int32, device=device)
    errors = torch.zeros(len(_faults.KINDS), dtype=torch.int32, device=device)
    torch.ops.specdec_C.chain_verify(
        case["draft_token_ids"], target, case["draft"], case["num_draft_tokens"], case["temperature"],
        case["logits"], seed_tensor, seed_value, offset_tensor, offset_value, workspace, arrivals, output,
        num_accepted, num_splits, *sampling_parameters(case), stages=stages, errors=errors,
    )
    assert torch.equal(arrivals, torch.zeros_like(arrivals)), f"counters must be left at zero: {arrivals.tolist()}"
    assert not errors.any(), f"no wait may give up: {errors.tolist()}"
    if staged:
        assert not stages.any(), f"stage records must be left at zero: {stages.nonzero().flatten()[:8].tolist()}"
    return output, num_accepted


def run_cuda(case, seed, offset):
    return sk.chain_verify(case["draft_token_ids"], case["target"], case["draft"],
                           num_draft_tokens=case["num_draft_tokens"], temperature=case["temperature"],
                           logits=case["logits"], seed=seed, offset=offset, backend="cuda",
                           **{name: case[name] for name in SAMPLING_PARAMETERS if case.get(name) is not None})


def _wrap(value: int) -> int:
    value &= 0xFFFFFFFFFFFFFFFF
    return value - 2**64 if value >= 2**63 else value


def assert_same(actual, expected, what):
    output, num_accepted = (t.cpu() for t in actual)
    expected_output, expected_accepted = (t.cpu() for t in expected)
    if torch.equal(output, expected_output) and torch.equal(num_accepted, expected_accepted):
        return
    rows = ((output != expected_output).any(-1) | (num_accepted != expected_accepted)).nonzero().flatten()
    b = int(rows[0])
    raise AssertionError(
        f"{what}: {rows.numel()} of {output.shape[0]} requests differ; request {b}: "
        f"output {output[b].tolist()} != {expected_output[b].tolist()}, "
        f"num_accepted {int(num_accepted[b])} != {int(expected_accepted[b])}"
    )


def agreement(actual, expected) -> float:
    output, num_accepted = (t.cpu() for t in actual)
    expected_output, expected_accepted = (t.cpu() for t in expected)
    same = (output == expected_output).all(-1) & (num_accepted == expected_accepted)
    return float(same.float().mean())


# ---------------------------------------------------------------------------
# Registration (runs wherever the extension is built).

@pytest.mark.skipif(not cuda_extension_available(), reason=f"CUDA extension not built: {extension_error()}")
def test_op_is_registered():
    assert "chain_verify" in extension_ops()
    for key in ("CPU", "CUDA", "Meta"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key("specdec_C::chain_verify", key), key


@pytest.mark.skipif(not cuda_extension_available(), reason=f"CUDA extension not built: {extension_error()}")
def test_cuda_backend_is_registered_for_the_public_op():
    """With the extension built, backend="cuda" resolves for CUDA tensors (metadata only, no GPU needed)."""
    from specdec_kernels import _backend, _extension

    if not _extension.cuda_extension_available():
        pytest.skip(_extension.extension_error())
    assert _backend.resolve("chain_verify", "cuda", torch.device("cuda")) == "cuda"
    assert _backend.resolve("chain_verify", "auto", torch.device("cuda")) == "cuda"


# ---------------------------------------------------------------------------
# The block program on the host (CPU).

HOST_VOCABS = [1, 7, 111, 1024, 1025, 3000]
HOST_DRAFTS = [1, 3, 7]
HOST_BATCHES = [1, 5]


def _check_host(batch_size, max_drafts, vocab_size, dtype, variants, num_splits=0, **case_options):
    for index, (with_draft, state) in enumerate(variants):
        case = make_case(batch_size, max_drafts, vocab_size, seed=1000 * vocab_size + 10 * max_drafts + index,
                         dtype=dtype, with_draft=with_draft, **case_options)
        if index % 2:
            case["draft_token_ids"] = case["draft_token_ids"].to(torch.int32)
        seed, offset = random_state(state, batch_size, "cpu", step=index)
        assert_same(run_op(case, seed, offset, num_splits), run_reference(case, seed, offset),
                    f"draft={with_draft} state={state} splits={num_splits}")


@needs_op
@pytest.mark.parametrize("vocab_size", HOST_VOCABS)
@pytest.mark.parametrize("max_drafts", HOST_DRAFTS)
@pytest.mark.parametrize("batch_size", HOST_BATCHES)
def test_host_program_matches_reference_bitwise(batch_size, max_drafts, vocab_size):
    """Greedy requests mixed in, ragged counts, invalid ids, every seed/offset form, one-hot and full drafts,
    int32 and int64 ids."""
    variants = [(index % 2 == 0, state) for index, state in enumerate(RANDOM_STATES)]
    _check_host(batch_size, max_drafts, vocab_size, torch.float32, variants)


@needs_op
@pytest.mark.parametrize("dtype", PROB_DTYPES, ids=str)
@pytest.mark.parametrize("vocab_size", [111, 3000])
def test_host_program_matches_reference_bitwise_storage_dtypes(dtype, vocab_size):
    _check_host(5, 3, vocab_size, dtype, list(itertools.product([True, False], ["per-request-seed", "int-large"])))


@needs_op
def test_host_program_without_drafts():
    _check_host(3, 0, 1025, torch.float32, [(True, "int"), (False, "offset-per-request")])


@needs_op
@pytest.mark.parametrize("logits", [False, True])
def test_host_program_tokens_do_not_depend_on_the_split(logits):
    """Integer sums: the same tokens whatever the number of blocks per request (probabilities).

    With logits the one-block walk and the staged split round the softmax
    sums differently, so only near-ties may differ; this case has none.
    """
    case = make_case(5, 3, 5000, seed=12, logits=logits, greedy_fraction=0.4)
    seed, offset = random_state("per-request-seed", 5, "cpu")
    expected = run_op(case, seed, offset, num_splits=1)
    if not logits:
        assert_same(expected, run_reference(case, seed, offset), "one split")
    for num_splits in (2, 3, 5, 8):
        assert_same(run_op(case, seed, offset, num_splits), expected, f"{num_splits} splits")


@needs_op
@pytest.mark.parametrize("with_draft", [True, False])
def test_host_program_int32_ids_and_strided_inputs(with_draft):
    case = make_case(5, 4, 2100, seed=3, with_draft=with_draft)
    case["draft_token_ids"] = case["draft_token_ids"].to(torch.int32).t().contiguous().t()  # stride (1, B)
    case["target"] = case["target"].transpose(0, 1).contiguous().transpose(0, 1)  # stride_b < stride_k
    if with_draft:
        case["draft"] = torch.cat([case["draft"], case["draft"]], dim=-1)[..., :2100]  # row stride 2V
    seed, offset = random_state("offset-per-request", 5, "cpu")
    for num_splits in (1, 3):
        assert_same(run_op(case, seed, offset, num_splits), run_reference(case, seed, offset), "strided")


@needs_op
def test_host_program_without_num_drafts_or_temperature():
    case = make_case(4, 3, 1500, seed=11, ragged=False)
    case["temperature"] = None
    assert_same(run_op(case, 5, 6), run_reference(case, 5, 6), "defaults")


@needs_op
def test_host_program_small_workspace_means_fewer_splits():
    """The workspace's statistics room caps the number of slices, never the result."""
    batch_size, max_drafts, vocab_size = 3, 3, 4000
    case = make_case(batch_size, max_drafts, vocab_size, seed=21, greedy_fraction=0.5)
    chunk_words = 3 * batch_size * 4
    expected = run_reference(case, 9, 1)
    for extra_splits in (0, 1, 2):
        words = chunk_words + extra_splits * batch_size * (max_drafts + 1)  # two int32 fields per row
        assert_same(run_op(case, 9, 1, num_splits=4, workspace_words=words), expected, f"{words} words")


@needs_op
@pytest.mark.parametrize("with_draft", [True, False])
def test_host_program_logits_agree(with_draft):
    rates = []
    for index, (vocab_size, num_splits) in enumerate([(7, 0), (111, 0), (3000, 1), (3000, 3)]):
        case = make_case(16, 4, vocab_size, seed=77 + index, logits=True, with_draft=with_draft)
        rates.append(agreement(run_op(case, 3, index, num_splits), run_reference(case, 3, index)))
    print(f"host logits agreement with the reference (draft={with_draft}): {rates}")
    # The softmax sums are gathered per thread and merged, so they round
    # differently from torch's; a test within an ulp of its threshold may go
    # the other way. Anything beyond that is a bug.
    assert min(rates) >= 0.9 and sum(rates) / len(rates) >= 0.97


@needs_op
def test_host_program_edge_values():
    """One-hot and uniform (tied) rows, the last index, invalid ids."""
    batch_size, vocab_size = 6, 50
    target = torch.zeros(batch_size, 3, vocab_size)
    target[:, :, 10] = 1.0  # one-hot target: only token 10 may be emitted
    target[1] = 1.0 / vocab_size  # uniform: ties everywhere
    target[2, :, :] = 0.0
    target[2, :, 49] = 1.0  # the last index
    draft = torch.full((batch_size, 2, vocab_size), 1.0 / vocab_size)
    ids = torch.tensor([[10, 10], [3, 4], [49, 0], [-5, 10], [10, 60], [0, 0]])
    temperature = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    for with_draft in (True, False):
        case = dict(draft_token_ids=ids, target=target, draft=draft if with_draft else None,
                    num_draft_tokens=torch.tensor([2, 2, 2, 2, 2, 1], dtype=torch.int32),
                    temperature=temperature, logits=False)
        for offset in range(4):
            assert_same(run_op(case, 8, offset), run_reference(case, 8, offset), f"draft={with_draft}")


def degenerate_cases(device, vocab_size):
    """Probabilities: residual without mass (p = q / 2: the fallback to p), all-zero rows (-1), ties,
    NaN and negative entries (weight 0), entries above 1 (clamped), a NaN row."""
    generator = torch.Generator(device=device).manual_seed(vocab_size)
    batch_size, max_drafts = 12, 3
    draft = torch.softmax(torch.randn(batch_size, max_drafts, vocab_size, generator=generator, device=device), -1)
    target = torch.cat([draft, draft[:, :1]], dim=1) * 0.5
    target[3] = 0.0  # nothing to emit anywhere
    target[4, :, : vocab_size // 2] = 1.0 / vocab_size  # ties
    target[6, :, ::3] = float("nan")
    target[7, :, 1::4] = -0.25
    target[8, :, ::5] = 3.0  # above 1: counts as 1
    target[9] = float("nan")
    ids = torch.multinomial(draft.reshape(-1, vocab_size), 1, generator=generator).view(batch_size, max_drafts)
    temperature = torch.ones(batch_size, device=device)
    temperature[4:6] = 0.0
    temperature[9] = 0.0
    for with_draft in (True, False):
        yield dict(draft_token_ids=ids, target=target, draft=draft if with_draft else None,
                   num_draft_tokens=None, temperature=temperature, logits=False)


def degenerate_logits_cases(device, vocab_size):
    """Logits: NaN rows, all -inf rows, +inf entries, NaN entries, T = inf, a tiny T, greedy over -inf/NaN."""
    inf, nan = float("inf"), float("nan")
    generator = torch.Generator(device=device).manual_seed(vocab_size + 1)
    batch_size, max_drafts = 10, 2
    target = torch.randn(batch_size, max_drafts + 1, vocab_size, generator=generator, device=device) * 3
    target[0] = nan
    target[1] = -inf
    target[2, 1, vocab_size // 2] = inf
    target[3, :, 100:] = -inf  # with T = inf: uniform over the first 100
    target[4, :, ::7] = nan  # with T = inf
    target[6] = nan  # greedy: nothing to choose
    target[7, :, :] = -inf  # greedy
    target[7, 0, 3] = 1.0
    ids = torch.randint(0, vocab_size, (batch_size, max_drafts), generator=generator, device=device)
    ids[3] = torch.tensor([3, 50]) % vocab_size
    ids[7, 0] = 3
    temperature = torch.tensor([1.0, 1.0, 1.0, inf, inf, 1e-30, 0.0, 0.0, 1e-38, 2.0], device=device)
    draft = target[:, :max_drafts] + torch.randn(batch_size, max_drafts, vocab_size, generator=generator,
                                                 device=device)
    draft[8] = nan
    for with_draft in (True, False):
        yield dict(draft_token_ids=ids, target=target, draft=draft if with_draft else None,
                   num_draft_tokens=None, temperature=temperature, logits=True)


@needs_op
@pytest.mark.parametrize("vocab_size", [5, 300, 2100])
def test_host_program_degenerate_rows(vocab_size):
    for case in degenerate_cases("cpu", vocab_size):
        for offset in range(3):
            expected = run_reference(case, 4, offset)
            for num_splits in (1, 3):
                assert_same(run_op(case, 4, offset, num_splits), expected, f"offset {offset} splits {num_splits}")


@needs_op
@pytest.mark.parametrize("vocab_size", [120, 2100])
def test_host_program_degenerate_logits_match_the_reference(vocab_size):
    """Exactly the reference's outcome (-1, uniform, argmax), in the one-block walk and split (staged)."""
    for case in degenerate_logits_cases("cpu", vocab_size):
        for offset in range(3):
            expected = run_reference(case, 4, offset)
            for num_splits in (1, 3):
                assert_same(run_op(case, 4, offset, num_splits), expected, f"offset {offset} splits {num_splits}")


@needs_op
def test_host_program_clamps_num_draft_tokens():
    case = make_case(4, 3, 100, seed=5)
    case["num_draft_tokens"] = torch.tensor([-2, 0, 3, 9], dtype=torch.int32)
    output, num_accepted = run_op(case, 1, 2)
    clamped = dict(case, num_draft_tokens=torch.tensor([0, 0, 3, 3], dtype=torch.int32))
    assert_same((output, num_accepted), run_reference(clamped, 1, 2), "clamped")


@needs_op
def test_host_program_reuses_its_buffers_across_calls():
    """One workspace and one set of counters for calls of every mode, as the launcher keeps them."""
    batch_size, max_drafts, vocab_size = 3, 3, 2100
    rows = max_drafts + 1
    workspace = torch.full((4096,), -1, dtype=torch.int64)
    arrivals = torch.zeros(1 + 2 * batch_size, dtype=torch.int32)
    for index, (logits, num_splits) in enumerate([(False, 3), (True, 3), (True, 1), (False, 1), (True, 2)]):
        case = make_case(batch_size, max_drafts, vocab_size, seed=50 + index, logits=logits, greedy_fraction=0.4)
        output = torch.zeros(batch_size, rows, dtype=torch.int32)
        num_accepted = torch.zeros(batch_size, dtype=torch.int32)
        torch.ops.specdec_C.chain_verify(case["draft_token_ids"], case["target"], case["draft"],
                                         case["num_draft_tokens"], case["temperature"], logits, None, 7, None, index,
                                         workspace, arrivals, output, num_accepted, num_splits)
        assert torch.equal(arrivals, torch.zeros_like(arrivals)), f"call {index}: {arrivals.tolist()}"
        assert_same((output, num_accepted), run_op(case, 7, index, num_splits), f"call {index}")


# ---------------------------------------------------------------------------
# top_k / top_p / min_p and bonus_token_ids, the block program on the host.

@needs_op
@pytest.mark.parametrize("parameters", list(PARAMETER_SETS))
@pytest.mark.parametrize("with_draft", [True, False])
def test_host_program_sampling_parameters_match_reference_bitwise(with_draft, parameters):
    """Greedy requests mixed in, ragged counts, invalid ids; V = 111 (one chunk), 2100 (three, the last
    partial) and quantised rows (ties at every threshold); every seed/offset form. A forced split count must
    not change anything: batches that split their rows take the staged truncation plan
    (test_chain_verify_staged_cuda.py), the others one block per request; bonus ids alone keep the split."""
    cases = [
        make_case(9, 4, 111, seed=31, with_draft=with_draft),
        make_case(6, 3, 2100, seed=32, with_draft=with_draft, greedy_fraction=0.4),
        quantised(make_case(7, 5, 300, seed=33, with_draft=with_draft, invalid_fraction=0.0)),
    ]
    for index, (case, state) in enumerate(zip(cases, RANDOM_STATES)):
        case = with_parameters(case, PARAMETER_SETS[parameters], seed=40 + index)
        seed, offset = random_state(state, case["target"].shape[0], "cpu", step=index)
        expected = run_reference(case, seed, offset)
        for num_splits in (0, 3):
            assert_same(run_op(case, seed, offset, num_splits), expected,
                        f"{parameters} case {index} state={state} splits={num_splits}")


@needs_op
@pytest.mark.parametrize("vocab_size", [300, 2100])
def test_host_program_sampling_parameters_on_degenerate_rows(vocab_size):
    """NaN, negative, above-1, tied and all-zero rows: keys and weights of the cleaned values, as the reference."""
    for case in degenerate_cases("cpu", vocab_size):
        case = with_parameters(case, PARAMETER_SETS["all+bonus"], seed=5)
        for offset in range(3):
            assert_same(run_op(case, 4, offset), run_reference(case, 4, offset), f"offset {offset}")


@needs_op
def test_host_program_sampling_parameters_large_vocabulary():
    """V = 128256: the radix search's digits spread over many chunks."""
    case = with_parameters(make_case(2, 2, 128256, seed=8, greedy_fraction=0.0), PARAMETER_SETS["all"], seed=9)
    seed, offset = random_state("per-request-seed", 2, "cpu")
    assert_same(run_op(case, seed, offset), run_reference(case, seed, offset), "V=128256")


@needs_op
def test_host_program_top_k_one_emits_the_argmax():
    """The parameters reach the kernel: with top_k = 1 and no drafts, each request emits its row's argmax."""
    case = make_case(6, 2, 111, seed=35, greedy_fraction=0.0, invalid_fraction=0.0, ragged=False)
    case["num_draft_tokens"] = torch.zeros(6, dtype=torch.int32)
    case["top_k"] = torch.ones(6, dtype=torch.int32)
    output, num_accepted = run_op(case, 1, 0)
    assert torch.equal(num_accepted, torch.zeros(6, dtype=torch.int32))
    assert torch.equal(output[:, 0], case["target"][:, 0].argmax(-1).to(torch.int32))


@needs_op
@pytest.mark.parametrize("num_splits", [1, 3])
def test_host_program_bonus_ids_with_logits_and_split_rows(num_splits):
    """Bonus ids in every plan: the one-block walk and the staged split (logits, 3 splits), greedy requests too."""
    rates = []
    for index, with_draft in enumerate((True, False)):
        case = make_case(12, 3, 2100, seed=60 + index, logits=True, with_draft=with_draft, greedy_fraction=0.4)
        case = with_parameters(case, PARAMETER_SETS["bonus"], seed=index)
        output, num_accepted = run_op(case, 2, index, num_splits)
        expected_output, expected_accepted = run_reference(case, 2, index)
        takes_bonus = num_accepted == case["num_draft_tokens"]
        assert bool(takes_bonus.any())
        emitted = output[torch.arange(12), num_accepted.long()]
        assert torch.equal(emitted[takes_bonus], case["bonus_token_ids"][takes_bonus].to(torch.int32))
        rates.append(agreement((output, num_accepted), (expected_output, expected_accepted)))
    assert min(rates) >= 0.9, rates


@needs_op
@pytest.mark.parametrize("with_draft", [True, False])
def test_host_program_sampling_parameters_logits_agree(with_draft):
    rates = []
    for index, vocab_size in enumerate([7, 111, 2100]):
        case = make_case(16, 4, vocab_size, seed=90 + index, logits=True, with_draft=with_draft)
        case = with_parameters(case, PARAMETER_SETS["all+bonus"], seed=index)
        rates.append(agreement(run_op(case, 3, index), run_reference(case, 3, index)))
    assert_logits_agree(rates, f"draft={with_draft}")


@needs_op
def test_rejects_bad_sampling_parameters():
    case = make_case(2, 2, 50, seed=1)
    specs = cuda_workspace_specs(2, 3, 50, False, "cpu")
    arguments = (case["draft_token_ids"], case["target"], case["draft"], None, None, False, None, 0, None, 0,
                 torch.zeros(specs["chain_verify_cuda.workspace"][0], dtype=torch.int64),
                 torch.zeros(specs["chain_verify_cuda.arrivals"][0], dtype=torch.int32),
                 torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2, dtype=torch.int32), 0)
    with pytest.raises(TypeError, match="`top_k` must be Int or Long"):
        torch.ops.specdec_C.chain_verify(*arguments, torch.ones(2))
    with pytest.raises(ValueError, match=r"`bonus_token_ids` must have shape \[B\] = \[2\]"):
        torch.ops.specdec_C.chain_verify(*arguments, bonus_token_ids=torch.zeros(3, dtype=torch.int64))
    with pytest.raises(TypeError, match="`min_p` must be Float"):
        torch.ops.specdec_C.chain_verify(*arguments, min_p=torch.zeros(2, dtype=torch.float64))


def test_workspace_specs():
    specs = cuda_workspace_specs(5, 4, 3000, False, "cpu")
    (workspace, workspace_dtype), (arrivals, arrivals_dtype), (stages, stages_dtype), claims = specs.values()
    assert workspace_dtype == torch.int64 and arrivals_dtype == torch.int32 and stages_dtype == torch.int64
    assert arrivals == 2 * 5  # per request its arrivals and failure flag
    assert claims == (5, torch.int64)  # per request the launch's claim of its words
    # Three words per chunk and request, then two int32 statistics per row for B + 8 = 13 slices (two per
    # request: 10).
    assert workspace == 3 * 5 * 3 + 13 * 4 * 2 // 2
    assert stages == cuda_stage_words(5, 4)
    # One chunk: a single split, no statistics.
    assert cuda_workspace_specs(64, 4, 1000, True, "cpu")["chain_verify_cuda.workspace"] == (3 * 64, torch.int64)


@needs_op
@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        (dict(target=torch.zeros(2, 3, 5, dtype=torch.float64)), TypeError, "`target` must be Float, BFloat16 or Half"),
        (dict(draft_token_ids=torch.zeros(2, 3, dtype=torch.int64)), ValueError, r"`draft_token_ids` must have shape"),
        (dict(workspace=torch.zeros(5, dtype=torch.int64)), ValueError, r"`workspace` must be a contiguous \[N\]"),
        (dict(workspace=torch.zeros(100, dtype=torch.int32)), TypeError, "`workspace` must be Long"),
        (dict(arrivals=torch.zeros(3, dtype=torch.int32)), ValueError, r"`arrivals` must be a contiguous \[N\]"),
        (dict(num_splits=-1), ValueError, "`num_splits` must be >= 0"),
        (dict(output_token_ids=torch.zeros(2, 2, dtype=torch.int32)), ValueError, "`output_token_ids` must have shape"),
        (dict(temperature=torch.zeros(2, dtype=torch.float64)), TypeError, "`temperature` must be Float"),
        (dict(offset=torch.zeros(3, dtype=torch.int64)), ValueError, r"`offset` must have shape \[\] or \[B\]"),
    ],
)
def test_rejects_bad_arguments(change, error, message):
    arguments = dict(
        draft_token_ids=torch.zeros(2, 2, dtype=torch.int64), target=torch.full((2, 3, 5), 0.2), draft=None,
        num_draft_tokens=None, temperature=None, logits=False, seed=None, seed_value=0, offset=None, offset_value=0,
        workspace=torch.zeros(100, dtype=torch.int64), arrivals=torch.zeros(5, dtype=torch.int32),
        output_token_ids=torch.zeros(2, 3, dtype=torch.int32), num_accepted=torch.zeros(2, dtype=torch.int32),
        num_splits=0,
    )
    arguments.update(change)
    with pytest.raises(error, match=message):
        torch.ops.specdec_C.chain_verify(*arguments.values())


@needs_op
@pytest.mark.parametrize("stamp", [0, 5, 2**61])
def test_claims_need_a_launch_stamp(stamp):
    """A stamp a damaged word could hold (0, a small count) would read as this launch's claim."""
    arguments = (torch.zeros(2, 2, dtype=torch.int64), torch.full((2, 3, 5), 0.2), None, None, None, False, None, 0,
                 None, 0, torch.zeros(100, dtype=torch.int64), torch.zeros(5, dtype=torch.int32),
                 torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"`stamp` must be in \[2\*\*40, 2\*\*61\)"):
        torch.ops.specdec_C.chain_verify(*arguments, claims=torch.zeros(2, dtype=torch.int64), stamp=stamp)


@needs_op
def test_opcheck():
    """Schema (mutated arguments), Meta kernel and dispatcher registration agree."""
    case = make_case(3, 2, 40, seed=2)
    rows = 3
    arguments = (case["draft_token_ids"], case["target"], case["draft"], case["num_draft_tokens"],
                 case["temperature"], False, None, 4, torch.tensor(2), 0,
                 torch.zeros(64, dtype=torch.int64), torch.zeros(7, dtype=torch.int32),
                 torch.zeros(3, rows, dtype=torch.int32), torch.zeros(3, dtype=torch.int32), 0)
    torch.library.opcheck(torch.ops.specdec_C.chain_verify.default, arguments)


# ---------------------------------------------------------------------------
# The kernel (GPU).

GPU_VOCABS = [1, 7, 111, 32000, 128256]


@needs_gpu
@pytest.mark.parametrize("vocab_size", GPU_VOCABS)
@pytest.mark.parametrize("dtype", PROB_DTYPES, ids=str)
def test_kernel_matches_reference_bitwise(vocab_size, dtype):
    for index, (batch_size, max_drafts) in enumerate(itertools.product([1, 3, 64], [0, 1, 3, 7])):
        with_draft = index % 2 == 0
        state = RANDOM_STATES[index % len(RANDOM_STATES)]
        case = make_case(batch_size, max_drafts, vocab_size, seed=vocab_size + index, dtype=dtype, device="cuda",
                         with_draft=with_draft)
        seed, offset = random_state(state, batch_size, "cuda", step=index)
        assert_same(run_cuda(case, seed, offset), run_reference(case, seed, offset),
                    f"B={batch_size} K={max_drafts} V={vocab_size} {dtype} draft={with_draft} state={state}")


@needs_gpu
@pytest.mark.parametrize("with_draft", [True, False])
def test_kernel_int32_ids_strided_inputs_and_defaults(with_draft):
    case = make_case(7, 4, 5000, seed=3, device="cuda", with_draft=with_draft)
    case["draft_token_ids"] = case["draft_token_ids"].to(torch.int32).t().contiguous().t()
    case["target"] = case["target"].transpose(0, 1).contiguous().transpose(0, 1)
    seed, offset = random_state("offset-per-request", 7, "cuda")
    assert_same(run_cuda(case, seed, offset), run_reference(case, seed, offset), "strided")
    case = make_case(5, 3, 3000, seed=4, device="cuda", with_draft=with_draft, ragged=False)
    case["temperature"] = None
    assert_same(run_cuda(case, 11, 0), run_reference(case, 11, 0), "defaults")


@needs_gpu
@pytest.mark.parametrize("vocab_size", [5, 300, 128256])
def test_kernel_degenerate_rows(vocab_size):
    for make in (degenerate_cases, degenerate_logits_cases):
        for case in make("cuda", vocab_size):
            for offset in range(3):
                expected = run_reference(case, 4, offset)
                assert_same(run_cuda(case, 4, offset), expected, f"{make.__name__} offset {offset}")
                for num_splits in (1, 7):
                    assert_same(run_op(case, 4, offset, num_splits), expected, f"offset {offset} {num_splits}")


@needs_gpu
def test_kernel_tokens_do_not_depend_on_the_split():
    case = make_case(3, 4, 128256, seed=40, device="cuda", greedy_fraction=0.3)
    seed, offset = random_state("per-request-seed", 3, "cuda")
    expected = run_reference(case, seed, offset)
    for num_splits in (1, 2, 7, 64, 126):
        assert_same(run_op(case, seed, offset, num_splits), expected, f"{num_splits} splits")


@needs_gpu
def test_kernel_staged_logits_far_beyond_resident_blocks_complete():
    """Logits with 64 x 126 blocks (~30x what is resident): a block waits only for slices running blocks took,
    never for one that is not resident."""
    case = make_case(64, 4, 128256, seed=41, device="cuda", logits=True, dtype=torch.bfloat16)
    walked = run_op(case, 5, 0, num_splits=1)
    split = run_op(case, 5, 0, num_splits=126)  # run_op asserts the counters and records are back at zero
    assert agreement(split, walked) >= 0.95
    assert agreement(split, run_reference(case, 5, 0)) >= 0.95


@needs_gpu
def test_kernel_large_batch_and_repeated_calls_leave_counters_at_zero():
    from specdec_kernels import _workspace

    case = make_case(300, 5, 32000, seed=8, device="cuda")
    for offset in range(3):
        assert_same(run_cuda(case, 2, offset), run_reference(case, 2, offset), f"offset {offset}")
    torch.cuda.synchronize()
    counters = [buffer for key, buffer in _workspace._buffers.items() if key[0] == "chain_verify_cuda.arrivals"]
    assert counters and all(int(buffer.abs().sum()) == 0 for buffer in counters)


@needs_gpu
@pytest.mark.parametrize("vocab_size", [111, 32000, 128256])
@pytest.mark.parametrize("with_draft", [True, False])
def test_kernel_sampling_parameters_match_reference_bitwise(vocab_size, with_draft):
    for index, parameters in enumerate(PARAMETER_SETS):
        case = make_case(8, 4, vocab_size, seed=vocab_size + index, device="cuda", with_draft=with_draft)
        if index % 3 == 2:
            case = quantised(case)
        case = with_parameters(case, PARAMETER_SETS[parameters], seed=index)
        seed, offset = random_state(RANDOM_STATES[index % len(RANDOM_STATES)], 8, "cuda", step=index)
        assert_same(run_cuda(case, seed, offset), run_reference(case, seed, offset),
                    f"{parameters} V={vocab_size} draft={with_draft}")


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_draft", [True, False])
def test_kernel_logits_agree(dtype, with_draft):
    rates = []
    for index, (batch_size, vocab_size) in enumerate([(64, 111), (64, 32000), (16, 128256), (1, 128256)]):
        for step in range(4):
            case = make_case(batch_size, 4, vocab_size, seed=500 + 10 * index + step, dtype=dtype, device="cuda",
                             logits=True, with_draft=with_draft)
            rates.append(agreement(run_cuda(case, 3, step), run_reference(case, 3, step)))
    mean = sum(rates) / len(rates)
    print(f"CUDA logits agreement with the reference ({dtype}, draft={with_draft}): mean {mean:.4f}, "
          f"min {min(rates):.4f}")
    # The kernel's softmax sums are online (per thread, rescaled, merged
    # across slices) while the reference sums exp((x - m) / T) in torch's
    # order; p = z / sum differs by an ulp or so, so an acceptance test
    # u * q < p or a fixed-point weight near a chunk threshold can go the
    # other way. Such near-ties are rare; a real bug (wrong denominator,
    # wrong row) would disagree on most requests.
    assert mean >= 0.99


@needs_gpu
def test_cuda_graph_replay_reads_new_offsets():
    batch_size = 8
    case = make_case(batch_size, 4, 32000, seed=31, device="cuda")
    offset = torch.zeros((), dtype=torch.int64, device="cuda")
    seeds = torch.arange(batch_size, dtype=torch.int64, device="cuda") * 1000 + 1

    def call():
        return sk.chain_verify(case["draft_token_ids"], case["target"], case["draft"],
                               num_draft_tokens=case["num_draft_tokens"], temperature=case["temperature"],
                               seed=seeds, offset=offset, backend="cuda")

    # Warm up on the capture stream: the workspace is per stream, and must be
    # allocated (and zeroed) before capture, not inside it.
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        output, num_accepted = call()
    outputs = set()
    for step in range(1, 6):
        offset.add_(1)
        graph.replay()
        torch.cuda.synchronize()
        assert int(offset) == step
        expected = run_reference(case, seeds, step)
        assert_same((output, num_accepted), expected, f"replay at offset {step}")
        outputs.add(tuple(output.flatten().tolist()))
    assert len(outputs) > 1, "replays at different offsets should draw different tokens"
