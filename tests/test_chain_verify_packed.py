"""chain_verify_packed: the packed ragged layout gives chain_verify's tokens on the padded equivalent.

Every backend that runs here (reference; Triton under the interpreter; the
CUDA kernel's block program on the host through ``torch.ops.specdec_C``)
must give, on the same rows:

* bit for bit the outputs of the same backend's ``chain_verify`` on the
  padded equivalent (same kernel, same rows, same random numbers), for
  probabilities and logits;
* with probabilities, bit for bit the reference's.

The padded equivalent is built here by a loop over requests, independently
of the reference's gather; its padding rows hold garbage that no backend may
read.
"""

import itertools

import pytest
import torch

import specdec_kernels as sk
from conftest import ALL_BACKENDS, backend_or_skip, extension_op_marks
from specdec_kernels.launchers.chain_verify import cuda_stage_words, cuda_workspace_specs
from specdec_kernels.reference.chain_verify_packed import packed_requests
from sampling_parameter_cases import (
    PARAMETER_SETS,
    SAMPLING_PARAMETERS,
    parameter_values,
    sampling_parameters,
)
from test_chain_verify_cuda import assert_same, random_state

needs_host_op, _, _ = extension_op_marks("chain_verify_packed")


def packed_case(counts, max_drafts, vocab_size, *, seed, device, with_draft=True, logits=False, greedy=(),
                dtype=torch.float32):
    """Packed inputs for requests with ``counts`` drafts; ``greedy`` lists the requests with temperature 0.

    Some greedy drafts are the target's argmax (so greedy requests accept a
    few); one id in seven is out of range (a rejection).
    """
    generator = torch.Generator().manual_seed(seed)
    batch_size, num_tokens = len(counts), sum(counts)
    cu = torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int64)
    target_logits = torch.randn(num_tokens + batch_size, vocab_size, generator=generator) * 3.0
    draft_logits = torch.randn(num_tokens, vocab_size, generator=generator) * 0.5
    for b in range(batch_size):  # draft close to the target at the same position: a fair share is accepted
        draft_logits[cu[b]:cu[b + 1]] += target_logits[cu[b] + b:cu[b + 1] + b]
    target = target_logits if logits else torch.softmax(target_logits, -1)
    draft = torch.softmax(draft_logits, -1)  # `logits` covers the target only (v1.3)
    ids = (torch.multinomial(torch.softmax(draft_logits, -1), 1, generator=generator).view(-1) if num_tokens
           else torch.zeros(0, dtype=torch.int64))
    for b in greedy:
        rows = slice(int(cu[b]) + b, int(cu[b + 1]) + b)
        ids[cu[b]:cu[b + 1]] = target_logits[rows].argmax(-1)
    ids[3::7] = torch.where(torch.arange(ids[3::7].numel()) % 2 == 0, -1, vocab_size)
    temperature = 0.5 + torch.rand(batch_size, generator=generator) if logits else torch.ones(batch_size)
    temperature[list(greedy)] = 0.0
    return dict(draft_token_ids=ids.to(device), cu_num_draft_tokens=cu.to(device), target=target.to(dtype).to(device),
                draft=draft.to(dtype).to(device) if with_draft else None, max_num_draft_tokens=max_drafts,
                temperature=temperature.to(device), logits=logits)


def padded_equivalent(case):
    """``chain_verify``'s arguments for the same rows; the requests as ``packed_requests`` reads ``cu``.

    Rows past each request's own (target past ``n_b``, draft and ids past
    ``n_b - 1``) hold garbage: no backend may read them.
    """
    ids, cu, target, draft = (case[name] for name in ("draft_token_ids", "cu_num_draft_tokens", "target", "draft"))
    max_drafts = case["max_num_draft_tokens"]
    batch_size, vocab_size = cu.shape[0] - 1, target.shape[-1]
    garbage = torch.Generator().manual_seed(99)
    padded_target = torch.rand(batch_size, max_drafts + 1, vocab_size, generator=garbage).to(target)
    padded_draft = torch.rand(batch_size, max_drafts, vocab_size, generator=garbage).to(target)
    padded_ids = torch.full((batch_size, max_drafts), 5, dtype=ids.dtype, device=ids.device)
    starts, counts = packed_requests(cu, ids.shape[0], max_drafts)
    for b, (start, count) in enumerate(zip(starts.tolist(), counts.tolist())):
        padded_target[b, :count + 1] = target[start + b:start + b + count + 1]
        padded_ids[b, :count] = ids[start:start + count]
        if draft is not None:
            padded_draft[b, :count] = draft[start:start + count]
    return dict(draft_token_ids=padded_ids, target=padded_target, draft=None if draft is None else padded_draft,
                num_draft_tokens=counts.to(torch.int32), temperature=case["temperature"], logits=case["logits"],
                **{name: case[name] for name in SAMPLING_PARAMETERS if name in case})


def run_packed(case, backend, seed, offset):
    return sk.chain_verify_packed(**case, seed=seed, offset=offset, backend=backend)


def run_padded(case, backend, seed, offset):
    padded = padded_equivalent(case)
    return sk.chain_verify(padded.pop("draft_token_ids"), padded.pop("target"), padded.pop("draft"), **padded,
                           seed=seed, offset=offset, backend=backend)


def run_host(case, seed, offset, num_splits=0, padded=False, staged=True):
    """The CUDA kernel's block program on the host (``torch.ops.specdec_C``), as the CUDA launcher calls it;
    ``staged`` False: no stage records (top_k/top_p/min_p with one block per request)."""
    seed_tensor, seed_value = (seed, 0) if isinstance(seed, torch.Tensor) else (None, seed)
    offset_tensor, offset_value = (offset, 0) if isinstance(offset, torch.Tensor) else (None, offset)
    max_drafts, target = case["max_num_draft_tokens"], case["target"]
    batch_size = case["cu_num_draft_tokens"].shape[0] - 1
    specs = cuda_workspace_specs(batch_size, max_drafts + 1, target.shape[-1], case["logits"], "cpu")
    words = specs["chain_verify_cuda.workspace"][0] + batch_size * num_splits * 2 * (max_drafts + 1)
    workspace = torch.full((words,), -123456789, dtype=torch.int64)  # garbage: never relied on
    arrivals = torch.zeros(specs["chain_verify_cuda.arrivals"][0], dtype=torch.int32)
    output = torch.full((batch_size, max_drafts + 1), 77, dtype=torch.int32)
    num_accepted = torch.full((batch_size,), 77, dtype=torch.int32)
    random = (case["temperature"], case["logits"], seed_tensor, seed_value, offset_tensor, offset_value)
    scratch = (workspace, arrivals, output, num_accepted, num_splits, *sampling_parameters(case))
    stages = torch.zeros(cuda_stage_words(batch_size, max_drafts + 1), dtype=torch.int64) if staged else None
    if padded:
        p = padded_equivalent(case)
        torch.ops.specdec_C.chain_verify(p["draft_token_ids"], p["target"], p["draft"], p["num_draft_tokens"],
                                         *random, *scratch, stages=stages)
    else:
        torch.ops.specdec_C.chain_verify_packed(case["draft_token_ids"], case["cu_num_draft_tokens"], target,
                                                case["draft"], max_drafts, *random, *scratch, stages=stages)
    assert torch.equal(arrivals, torch.zeros_like(arrivals)), f"counters must be left at zero: {arrivals.tolist()}"
    assert not staged or not stages.any(), "stage records must be left at zero"
    return output, num_accepted


def check_backend(case, backend, seed, offset, what):
    actual = run_packed(case, backend, seed, offset)
    assert_same(actual, run_padded(case, backend, seed, offset), f"{what}: packed vs padded on {backend}")
    if not case["logits"]:
        assert_same(actual, run_padded(case, "reference", seed, offset), f"{what}: {backend} vs reference")


# Ragged batches: B = 1 and a prime B, n_b = 0 requests among them, K from 1 to 5.
COUNTS = {1: [[1], [0, 1, 1, 0, 1, 0, 0]], 2: [[2], [2, 0, 1, 2, 2, 0, 1]], 3: [[0], [3, 1, 0, 3, 2, 3, 0]],
          4: [[4], [4, 0, 2, 4, 3, 1, 4]], 5: [[5], [5, 0, 3, 5, 1, 5, 2]]}


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("max_drafts", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("logits", [False, True], ids=["probs", "logits"])
def test_matches_padded_chain_verify(backend, max_drafts, logits, device):
    backend_or_skip("chain_verify_packed", backend)
    for index, (counts, with_draft, state) in enumerate(itertools.product(
            COUNTS[max_drafts], [True, False], ["int", "per-request-seed", "offset-per-request"])):
        greedy = [b for b in range(len(counts)) if b % 3 == 1]
        case = packed_case(counts, max_drafts, 111, seed=10 * max_drafts + index, device=device, logits=logits,
                           with_draft=with_draft, greedy=greedy)
        seed, offset = random_state(state, len(counts), device, step=index)
        check_backend(case, backend, seed, offset, f"counts={counts} draft={with_draft} state={state}")


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_vocabulary_across_chunks_and_dtypes(backend, dtype, device):
    """V = 2100 spans three sampler chunks (and, on the interpreter and the host, several slices)."""
    backend_or_skip("chain_verify_packed", backend)
    for logits in (False, True):
        case = packed_case([3, 0, 2], 3, 2100, seed=5, device=device, logits=logits, greedy=[2], dtype=dtype)
        case["draft_token_ids"] = case["draft_token_ids"].to(torch.int32)
        case["cu_num_draft_tokens"] = case["cu_num_draft_tokens"].to(torch.int32)
        seed, offset = random_state("offset-scalar-tensor", 3, device)
        check_backend(case, backend, seed, offset, f"logits={logits}")


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_strided_views_are_read_in_place(backend, device):
    """Row strides other than V: a target holding every other row of a wider buffer, a draft cut from a wider one."""
    backend_or_skip("chain_verify_packed", backend)
    case = packed_case([2, 3, 0, 1, 3], 3, 64, seed=8, device=device, greedy=[3])
    target, draft = case["target"], case["draft"]
    wide_target = torch.zeros(2 * target.shape[0], 80, device=device)
    wide_target[::2, :64] = target
    wide_draft = torch.zeros(draft.shape[0], 70, device=device)
    wide_draft[:, 5:69] = draft
    strided = dict(case, target=wide_target[::2, :64], draft=wide_draft[:, 5:69])
    assert strided["target"].stride() == (160, 1) and strided["draft"].stride() == (70, 1)
    for state in ("int", "per-request-seed"):
        seed, offset = random_state(state, 5, device)
        expected = run_padded(case, "reference", seed, offset)
        assert_same(run_packed(strided, backend, seed, offset), expected, f"strided, {state}")


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_no_drafts_at_all(backend, device):
    """T = 0 (every n_b is 0): each request samples its bonus row; draft is [0, V]."""
    backend_or_skip("chain_verify_packed", backend)
    for with_draft in (True, False):
        case = packed_case([0, 0, 0], 2, 50, seed=3, device=device, with_draft=with_draft, greedy=[1])
        assert case["draft_token_ids"].shape == (0,)
        output, num_accepted = run_packed(case, backend, 4, 1)
        assert_same((output, num_accepted), run_padded(case, "reference", 4, 1), f"draft={with_draft}")
        assert num_accepted.tolist() == [0, 0, 0] and bool((output[:, 1:] == -1).all())


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_empty_batch(backend, device):
    backend_or_skip("chain_verify_packed", backend)
    case = packed_case([], 3, 20, seed=1, device=device)
    output, num_accepted = run_packed(case, backend, 1, 0)
    assert output.shape == (0, 4) and num_accepted.shape == (0,)


# Malformed cu over T = 6 drafts, K = 2, B = 4: each row is (cu, the (start, n) every backend reads).
MALFORMED_CU = [
    ([0, 4, 5, 6, 6], [(0, 2), (4, 1), (5, 1), (6, 0)]),  # request 0 longer than K: clamped to K
    ([0, 3, 1, 5, 6], [(0, 2), (3, 0), (1, 2), (5, 1)]),  # decreasing: n = 0 there
    ([-4, 1, 9, 12, 2], [(0, 1), (1, 2), (6, 0), (6, 0)]),  # below 0 and past T: clamped into [0, T]
    ([2, 2, 4, 6, 5], [(2, 0), (2, 2), (4, 2), (6, 0)]),  # not starting at 0, not ending at T
]


@pytest.mark.parametrize("cu, expected", MALFORMED_CU)
def test_malformed_cu_is_read_as_documented(cu, expected):
    starts, counts = packed_requests(torch.tensor(cu), 6, 2)
    assert list(zip(starts.tolist(), counts.tolist())) == expected


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_malformed_cu_gives_the_same_outcome_on_every_backend(backend, device):
    """Clamped counts and rows, never an out-of-bounds read: equal to the padded equivalent of the clamped requests."""
    backend_or_skip("chain_verify_packed", backend)
    for index, ((cu, _), dtype) in enumerate(itertools.product(MALFORMED_CU, [torch.int64, torch.int32])):
        case = packed_case([2, 1, 2, 1], 2, 40, seed=20 + index, device=device, greedy=[1])
        case["cu_num_draft_tokens"] = torch.tensor(cu, dtype=dtype, device=device)
        check_backend(case, backend, 6, index, f"cu={cu} {dtype}")


@needs_host_op
@pytest.mark.parametrize("logits", [False, True], ids=["probs", "logits"])
def test_host_program_packed_equals_padded(logits):
    """The CUDA block program on the host: packed equals padded bit for bit, whatever the split, and the reference
    with probabilities; malformed cu included."""
    for index, (counts, with_draft) in enumerate(itertools.product([[3, 0, 4, 1, 4], [0, 0], [2]], [True, False])):
        case = packed_case(counts, 4, 3000, seed=30 + index, device="cpu", logits=logits, with_draft=with_draft,
                           greedy=[0] if len(counts) > 1 else [])
        seed, offset = random_state("offset-per-request", len(counts), "cpu", step=index)
        for num_splits in (0, 1, 3):
            actual = run_host(case, seed, offset, num_splits)
            assert_same(actual, run_host(case, seed, offset, num_splits, padded=True), f"{counts} splits={num_splits}")
            if not logits:
                assert_same(actual, run_padded(case, "reference", seed, offset), f"{counts} vs reference")
    for index, (cu, _) in enumerate(MALFORMED_CU):
        case = packed_case([2, 1, 2, 1], 2, 1500, seed=40 + index, device="cpu", logits=logits, greedy=[2])
        case["cu_num_draft_tokens"] = torch.tensor(cu, dtype=torch.int32)
        for num_splits in (1, 2):
            assert_same(run_host(case, 5, index, num_splits), run_host(case, 5, index, num_splits, padded=True),
                        f"malformed cu={cu}")


@needs_host_op
@pytest.mark.parametrize("logits", [False, True], ids=["probs", "logits"])
def test_host_program_sampling_parameters_packed_equals_padded(logits):
    """top_k/top_p/min_p and bonus ids reach the packed layout's block program: it equals the padded one bit for
    bit, and the reference with probabilities."""
    counts = [3, 0, 4, 1, 4, 2, 2]
    for index, parameters in enumerate(("all", "all+bonus", "bonus")):
        case = packed_case(counts, 4, 1500, seed=60 + index, device="cpu", logits=logits, greedy=[5])
        case.update(parameter_values(PARAMETER_SETS[parameters], len(counts), 1500, seed=index))
        actual = run_host(case, 3, index)
        assert_same(actual, run_host(case, 3, index, padded=True), f"{parameters}: packed vs padded")
        if not logits:
            assert_same(actual, run_padded(case, "reference", 3, index), f"{parameters}: vs reference")


@needs_host_op
def test_host_op_opcheck():
    """Schema (mutated arguments), Meta kernel and dispatcher registration agree (tests/test_extension.py checks
    that every dispatch key has a kernel)."""
    case = packed_case([2, 0, 1], 2, 40, seed=2, device="cpu")
    arguments = (case["draft_token_ids"], case["cu_num_draft_tokens"], case["target"], case["draft"], 2,
                 case["temperature"], False, None, 4, torch.tensor(2), 0, torch.zeros(64, dtype=torch.int64),
                 torch.zeros(7, dtype=torch.int32), torch.zeros(3, 3, dtype=torch.int32),
                 torch.zeros(3, dtype=torch.int32), 0)
    torch.library.opcheck(torch.ops.specdec_C.chain_verify_packed.default, arguments)


@needs_host_op
@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        (dict(target=torch.zeros(6, 5)), ValueError, r"`target` must have shape \[T\+B, V\] with T \+ B = 3 \+ 2"),
        (dict(cu_num_draft_tokens=torch.zeros(3, dtype=torch.float32)), TypeError, "`cu_num_draft_tokens` must be Int"),
        (dict(cu_num_draft_tokens=torch.zeros(0, dtype=torch.int64)), ValueError, r"with B\+1 >= 1"),
        (dict(draft_token_ids=torch.zeros(1, 3, dtype=torch.int64)), ValueError, r"`draft_token_ids` must have shape \[T\]"),
        (dict(draft=torch.zeros(4, 5)), ValueError, r"`draft` must have shape \[T, V\] = \[3, 5\]"),
        (dict(max_num_draft_tokens=-1), ValueError, "`max_num_draft_tokens` must be >= 0"),
        (dict(output_token_ids=torch.zeros(2, 4, dtype=torch.int32)), ValueError, "`output_token_ids` must have shape"),
    ],
)
def test_host_op_rejects_bad_arguments(change, error, message):
    arguments = dict(
        draft_token_ids=torch.zeros(3, dtype=torch.int64), cu_num_draft_tokens=torch.tensor([0, 1, 3]),
        target=torch.full((5, 5), 0.2), draft=None, max_num_draft_tokens=2, temperature=None, logits=False,
        seed=None, seed_value=0, offset=None, offset_value=0, workspace=torch.zeros(100, dtype=torch.int64),
        arrivals=torch.zeros(5, dtype=torch.int32), output_token_ids=torch.zeros(2, 3, dtype=torch.int32),
        num_accepted=torch.zeros(2, dtype=torch.int32), num_splits=0,
    )
    arguments.update(change)
    with pytest.raises(error, match=message):
        torch.ops.specdec_C.chain_verify_packed(*arguments.values())


def small_case(device):
    return packed_case([2, 0, 1], 3, 10, seed=0, device=device)


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        (dict(target=torch.zeros(5, 10)), ValueError,
         r"`target` must have T \+ B = 3 \+ 3 = 6 rows \(T = draft_token_ids.shape\[0\], B = "),
        (dict(target=torch.zeros(6, 10, dtype=torch.float64)), TypeError, "`target` must have dtype float32"),
        (dict(target=torch.zeros(6, 1, 10)), ValueError, r"`target` must have shape \[T\+B, V\]"),
        (dict(draft_token_ids=torch.zeros(3, 1, dtype=torch.int64)), ValueError,
         r"`draft_token_ids` must have shape \[T\]"),
        (dict(cu_num_draft_tokens=torch.tensor([[0, 2, 2, 3]])), ValueError,
         r"`cu_num_draft_tokens` must have shape \[B\+1\]"),
        (dict(cu_num_draft_tokens=torch.tensor([0.0, 2.0, 2.0, 3.0])), TypeError,
         "`cu_num_draft_tokens` must have dtype int32 or int64"),
        (dict(cu_num_draft_tokens=torch.zeros(0, dtype=torch.int64)), ValueError,
         r"`cu_num_draft_tokens` must have shape \[B\+1\] with B\+1 >= 1; got \[0\]"),
        (dict(draft=torch.zeros(4, 10)), ValueError, r"`draft` must have shape \[T, V\] = \[3, 10\]; got \[4, 10\]"),
        (dict(max_num_draft_tokens=2.0), TypeError, "`max_num_draft_tokens` must be an int; got float"),
        (dict(max_num_draft_tokens=-1), ValueError, "`max_num_draft_tokens` must be >= 0; got -1"),
        (dict(temperature=torch.ones(4)), ValueError, r"`temperature` must have shape \[B\] = \[3\]"),
        (dict(logits=1), TypeError, "`logits` must be a bool"),
    ],
)
def test_rejects_bad_arguments(change, error, message):
    case = dict(small_case("cpu"), **change)
    with pytest.raises(error, match=f"^chain_verify_packed: {message}"):
        sk.chain_verify_packed(**case, seed=1, backend="reference")


def test_rejects_bad_random_state_like_chain_verify():
    with pytest.raises(ValueError, match=r"`seed` must have shape \[B\] = \[3\]"):
        sk.chain_verify_packed(**small_case("cpu"), seed=torch.ones(2, dtype=torch.int64), backend="reference")


@pytest.mark.parametrize(
    ("cu", "ids", "message"),
    [
        ([1, 2, 2, 3], [1, 2, 3], "must start at 0; got cu\\[0\\] = 1"),
        ([0, 2, 1, 3], [1, 2, 3], r"must be non-decreasing; cu\[2\] = 1 < cu\[1\] = 2"),
        ([0, 2, 2, 2], [1, 2, 3], r"must end at T = draft_token_ids.shape\[0\] = 3; got cu\[B\] = 2"),
        ([0, 0, 0, 3], [1, 2, 3], r"request 2 has 3 drafts .*more than max_num_draft_tokens = 2"),
        ([0, 2, 2, 3], [1, -1, 3], r"`draft_token_ids` must lie in \[0, V\) = \[0, 10\); draft_token_ids\[1\] = -1"),
        ([0, 2, 2, 3], [1, 2, 10], r"draft_token_ids\[2\] = 10"),
    ],
)
def test_validate_checks_cu_and_ids(cu, ids, message):
    case = dict(small_case("cpu"), cu_num_draft_tokens=torch.tensor(cu), draft_token_ids=torch.tensor(ids),
                max_num_draft_tokens=2)
    with pytest.raises(ValueError, match=message):
        sk.chain_verify_packed(**case, seed=1, backend="reference", validate=True)
    sk.chain_verify_packed(**case, seed=1, backend="reference")  # without validate: the documented outcome


def test_validate_accepts_well_formed_inputs():
    case = small_case("cpu")
    case["draft_token_ids"] = case["draft_token_ids"].clamp(0, 9)
    expected = sk.chain_verify_packed(**case, seed=3, backend="reference")
    actual = sk.chain_verify_packed(**case, seed=3, backend="reference", validate=True)
    assert torch.equal(actual[0], expected[0]) and torch.equal(actual[1], expected[1])


def test_triton_reads_no_tensor_value_on_the_host(device, monkeypatch):
    """``cu_num_draft_tokens`` is read by the kernel only: with every way of reading a tensor's value on the host
    disabled, the public call still runs (logits with vocabulary slices: the two-wave plan)."""
    backend_or_skip("chain_verify_packed", "triton")
    case = packed_case([2, 0, 3], 3, 2100, seed=9, device=device, logits=True, greedy=[2])
    offset = torch.tensor(4, device=device)
    expected = run_padded(case, "triton", 7, offset)

    def host_read(*args, **kwargs):
        raise AssertionError("a tensor value was read on the host")

    for name in ("item", "tolist", "__int__", "__float__", "__bool__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, host_read)
    actual = run_packed(case, "triton", 7, offset)
    monkeypatch.undo()
    assert_same(actual, expected, "no host read")


@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_cuda_graph_replays_read_new_offsets(backend, device):
    """Captured once, replayed at new offsets: cu and the rows are read on the device at every replay."""
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    backend_or_skip("chain_verify_packed", backend)
    case = packed_case([4, 0, 2, 4, 1, 3, 4, 2], 4, 32000, seed=31, device=device, greedy=[5])
    offset = torch.zeros((), dtype=torch.int64, device=device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compiles and allocates this stream's workspace outside the capture
        run_packed(case, backend, 5, offset)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        output, num_accepted = run_packed(case, backend, 5, offset)
    for step in range(1, 4):
        offset.fill_(step)
        graph.replay()
        torch.cuda.synchronize()
        assert_same((output, num_accepted), run_padded(case, "reference", 5, step), f"replay at offset {step}")


def bonus_free(case, bonus_token_ids):
    """``case`` in the bonus-free layout (vLLM's ``target_logits``): each request's bonus row removed."""
    cu, target = case["cu_num_draft_tokens"].cpu(), case["target"]
    rows = [row for b in range(cu.shape[0] - 1) for row in range(int(cu[b]) + b, int(cu[b + 1]) + b)]
    return dict(case, target=target[torch.tensor(rows, dtype=torch.int64, device=target.device)],
                bonus_token_ids=bonus_token_ids)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("logits", [False, True], ids=["probs", "logits"])
def test_bonus_free_layout_gives_the_tokens_of_the_full_one(backend, logits, device):
    """``target [T, V]`` with bonus ids: the tokens of ``[T+B, V]`` with the same ids, whose bonus rows are
    never read then (filled with NaN here), bit for bit; an id outside ``[0, V)`` gives -1 where the request
    accepted everything (there is no row to sample), and nothing else changes."""
    backend_or_skip("chain_verify_packed", backend)
    counts = [3, 0, 2, 3, 1, 0, 3]
    case = packed_case(counts, 3, 300, seed=21, device=device, logits=logits, greedy=[1, 3])
    cu = case["cu_num_draft_tokens"].cpu()
    # Drafts equal to the target's argmax: many requests accept everything and take the bonus id.
    for b, count in enumerate(counts):
        rows = slice(int(cu[b]) + b, int(cu[b]) + b + count)
        case["draft_token_ids"][int(cu[b]):int(cu[b + 1])] = case["target"][rows].float().argmax(-1)
    bonus = torch.tensor([7, 300, 11, -1, 12, 2**40, 13], device=device)
    poisoned = case["target"].clone()
    for b, count in enumerate(counts):
        poisoned[int(cu[b]) + b + count] = float("nan")  # the bonus rows: read by nobody when bonus ids are given
    in_range = (bonus >= 0) & (bonus < 300)
    for state in ("int", "per-request-seed"):
        seed, offset = random_state(state, len(counts), device)
        expected_tokens, expected_accepted = run_packed(dict(case, target=poisoned, bonus_token_ids=bonus.clamp(0, 299)),
                                                        backend, seed, offset)
        tokens, accepted = run_packed(bonus_free(case, bonus), backend, seed, offset)
        took_bonus = accepted.cpu() == torch.tensor(counts, dtype=torch.int32)
        assert took_bonus.sum() >= 4, "the case must exercise the bonus"
        rows = torch.arange(len(counts))
        expected_tokens = expected_tokens.cpu().clone()
        bonus_position = accepted.cpu().long()
        missing = took_bonus & ~in_range.cpu()
        expected_tokens[rows[missing], bonus_position[missing]] = -1
        assert torch.equal(accepted.cpu(), expected_accepted.cpu())
        assert torch.equal(tokens.cpu(), expected_tokens), f"{state}: {tokens.tolist()} vs {expected_tokens.tolist()}"
        if not logits:
            assert_same((tokens, accepted), run_packed(bonus_free(case, bonus), "reference", seed, offset), state)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_bonus_free_layout_without_drafts(backend, device):
    """T = 0 rows: every request emits its bonus id, or -1 for one out of range."""
    backend_or_skip("chain_verify_packed", backend)
    case = packed_case([0, 0, 0], 2, 50, seed=3, device=device, greedy=[1])
    output, num_accepted = run_packed(bonus_free(case, torch.tensor([4, 50, 9], device=device)), backend, 4, 1)
    assert num_accepted.tolist() == [0, 0, 0]
    assert output.tolist() == [[4, -1, -1], [-1, -1, -1], [9, -1, -1]]


def test_bonus_free_layout_needs_bonus_ids():
    case = small_case("cpu")
    with pytest.raises(ValueError, match=r"or T = 3 rows without bonus rows when `bonus_token_ids` is given"):
        sk.chain_verify_packed(**dict(case, target=case["target"][:3]), seed=1, backend="reference")
