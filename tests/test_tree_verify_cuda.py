"""The CUDA tree_verify (csrc/include/specdec/tree_verify.cuh) against the reference.

Two ways in:

* ``sk.tree_verify(..., backend="cuda")`` runs the kernel (GPU only);
* ``torch.ops.specdec_C.tree_verify`` on CPU tensors runs the kernel's block
  program on the host: an emulated block of 8 std::threads (2 warps of 4
  lanes, host_block.cuh), one request after another. It shares the kernel's
  walk, child search, index math, workspace layout, acceptance tests,
  normaliser and sampler (not the warp shuffles, the hardware barriers or
  the memory ordering), so these cases check the .cuh files on machines
  without a GPU.

With probabilities both must equal the reference bit for bit. Inputs come
from the tree tests' generators (tests/test_tree_verify.py) and random
states in every form of the contract (tests/test_chain_verify_cuda.py).
"""

import itertools

import pytest
import torch

import specdec_kernels as sk
from conftest import extension_op_marks
from specdec_kernels import rng
from specdec_kernels._extension import cuda_extension_available, extension_error, extension_ops
from specdec_kernels.launchers.tree_verify import cuda_workspace_specs
from specdec_kernels.reference import _sampling
from specdec_kernels.reference import tree_verify as reference
from sampling_parameter_cases import (
    PARAMETER_SETS,
    SAMPLING_PARAMETERS,
    assert_logits_agree,
    quantised,
    sampling_parameters,
    with_parameters,
)
from test_chain_verify_cuda import RANDOM_STATES, _wrap, random_state
from test_tree_verify import check_structure, random_parents, random_problem, rejected_root_case, rows_after_rejections

needs_op, needs_gpu, _ = extension_op_marks("tree_verify")

PROB_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DRAFT_MODES = ["with_replacement", "without_replacement", None]  # None: draft=None (deterministic candidates)


def make_case(batch_size, tree_size, vocab_size, *, seed, draft_mode="without_replacement", dtype=torch.float32,
              device="cpu", logits=False, **problem_options):
    """A tree batch from ``random_problem`` (ragged, invalid ids, zeros, greedy requests mixed in)."""
    generator = torch.Generator().manual_seed(seed)
    options = dict(invalid_fraction=0.1, zero_fraction=0.3, greedy_fraction=0.3)
    options.update(problem_options)
    ids, parents, target, draft, num_nodes, temperature = random_problem(
        generator, batch_size, tree_size, vocab_size, **options)
    if logits:
        target = torch.randn(target.shape, generator=generator) * 3
        # `logits` covers the target only (v1.3): the draft stays probabilities.
        draft = torch.softmax(target + torch.randn(target.shape, generator=generator) * 0.5, -1)
    return dict(
        tree_token_ids=ids.to(device), parents=parents.to(device), target=target.to(dtype).to(device),
        draft=None if draft_mode is None else draft.to(dtype).to(device),
        num_nodes=None if num_nodes is None else num_nodes.to(device),
        temperature=None if temperature is None else temperature.to(device), logits=logits,
        draft_sampling=draft_mode or "without_replacement",
    )


def aligned_case(batch_size, tree_size, vocab_size, *, seed, draft_mode="without_replacement", bushy=False):
    """A sharp target and a draft close to it: long accepted paths with rejections along the way
    (``random_problem``'s independent rows reject almost everything once V is large)."""
    generator = torch.Generator().manual_seed(seed)
    parents = random_parents(generator, batch_size, tree_size, bushy=bushy)
    target = torch.softmax(torch.randn(batch_size, tree_size, vocab_size, generator=generator) * 8, dim=-1)
    noise = torch.softmax(torch.randn(batch_size, tree_size, vocab_size, generator=generator), dim=-1)
    draft = 0.75 * target + 0.25 * noise
    parent_rows = draft[torch.arange(batch_size).view(-1, 1), parents.clamp_min(0).long()]
    ids = torch.multinomial(parent_rows.view(-1, vocab_size), 1, generator=generator).view(batch_size, tree_size)
    ids = torch.where(torch.rand(ids.shape, generator=generator) < 0.03, -1, ids)
    num_nodes = torch.randint(tree_size // 2 + 1, tree_size + 1, (batch_size,), generator=generator,
                              dtype=torch.int32)
    temperature = torch.where(torch.arange(batch_size) % 4 == 3, 0.0, 1.0)
    return dict(tree_token_ids=ids, parents=parents, target=target, draft=None if draft_mode is None else draft,
                num_nodes=num_nodes, temperature=temperature, logits=False,
                draft_sampling=draft_mode or "without_replacement")


def run_reference(case, seed, offset):
    return reference.tree_verify(case["tree_token_ids"], case["parents"], case["target"], case["draft"],
                                 case["num_nodes"], case["temperature"], case["logits"], case["draft_sampling"],
                                 seed, offset, *sampling_parameters(case))


def run_op(case, seed, offset, workspace_words=None):
    """The raw op as the CUDA launcher calls it: on CPU tensors, the block program on the host."""
    target = case["target"]
    batch_size, tree_size, vocab_size = target.shape
    seed_tensor, seed_value = (seed, 0) if isinstance(seed, torch.Tensor) else (None, _wrap(seed))
    offset_tensor, offset_value = (offset, 0) if isinstance(offset, torch.Tensor) else (None, _wrap(offset))
    if workspace_words is None:
        workspace_words = cuda_workspace_specs(batch_size, tree_size, vocab_size, None)["tree_verify_cuda.workspace"][0]
    # Garbage everywhere: the program must write every output entry and never rely on the workspace.
    workspace = torch.full((workspace_words,), -123456789, dtype=torch.int64, device=target.device)
    accepted_nodes = torch.full((batch_size, tree_size), 77, dtype=torch.int32, device=target.device)
    output = torch.full((batch_size, tree_size), 77, dtype=torch.int32, device=target.device)
    num_accepted = torch.full((batch_size,), 77, dtype=torch.int32, device=target.device)
    torch.ops.specdec_C.tree_verify(
        case["tree_token_ids"], case["parents"], target, case["draft"], case["num_nodes"], case["temperature"],
        case["logits"], case["draft_sampling"], seed_tensor, seed_value, offset_tensor, offset_value, workspace,
        accepted_nodes, output, num_accepted, *sampling_parameters(case),
    )
    return accepted_nodes, output, num_accepted


def run_cuda(case, seed, offset):
    return sk.tree_verify(case["tree_token_ids"], case["parents"], case["target"], case["draft"],
                          num_nodes=case["num_nodes"], temperature=case["temperature"], logits=case["logits"],
                          draft_sampling=case["draft_sampling"], seed=seed, offset=offset, backend="cuda",
                          **{name: case[name] for name in SAMPLING_PARAMETERS if case.get(name) is not None})


def assert_same(actual, expected, what):
    actual = [t.cpu() for t in actual]
    expected = [t.cpu() for t in expected]
    if all(torch.equal(a, e) for a, e in zip(actual, expected)):
        return
    differ = ((actual[0] != expected[0]).any(-1) | (actual[1] != expected[1]).any(-1) | (actual[2] != expected[2]))
    rows = differ.nonzero().flatten()
    b = int(rows[0])
    raise AssertionError(
        f"{what}: {rows.numel()} of {differ.numel()} requests differ; request {b}: "
        f"accepted_nodes {actual[0][b].tolist()} != {expected[0][b].tolist()}, "
        f"output {actual[1][b].tolist()} != {expected[1][b].tolist()}, "
        f"num_accepted {int(actual[2][b])} != {int(expected[2][b])}"
    )


def agreement(actual, expected) -> float:
    actual = [t.cpu() for t in actual]
    expected = [t.cpu() for t in expected]
    same = (actual[0] == expected[0]).all(-1) & (actual[1] == expected[1]).all(-1) & (actual[2] == expected[2])
    return float(same.float().mean())


def check_case(case, seed, offset, what, runner=run_op):
    result = runner(case, seed, offset)
    assert_same(result, run_reference(case, seed, offset), what)
    ids, parents, num_nodes = (None if case[k] is None else case[k].cpu()
                               for k in ("tree_token_ids", "parents", "num_nodes"))
    check_structure(result, ids, parents, num_nodes, case["target"].shape[-1])


# ---------------------------------------------------------------------------
# Registration (runs wherever the extension is built).

@pytest.mark.skipif(not cuda_extension_available(), reason=f"CUDA extension not built: {extension_error()}")
def test_op_is_registered():
    assert "tree_verify" in extension_ops()
    for key in ("CPU", "CUDA", "Meta"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key("specdec_C::tree_verify", key), key


@pytest.mark.skipif(not cuda_extension_available(), reason=f"CUDA extension not built: {extension_error()}")
def test_cuda_backend_is_registered_for_the_public_op():
    """With the extension built, backend="cuda" resolves for CUDA tensors (metadata only, no GPU needed)."""
    from specdec_kernels import _backend

    assert _backend.resolve("tree_verify", "cuda", torch.device("cuda")) == "cuda"
    assert _backend.resolve("tree_verify", "auto", torch.device("cuda")) == "cuda"


# ---------------------------------------------------------------------------
# The block program on the host (CPU).

HOST_SHAPES = [  # (B, N, V, bushy)
    (1, 1, 7, False),
    (5, 9, 111, False),
    (7, 12, 5, True),
    (3, 16, 1025, True),
    (4, 10, 1, True),
    (2, 6, 3000, False),
]


@needs_op
@pytest.mark.parametrize("draft_mode", DRAFT_MODES)
@pytest.mark.parametrize("batch_size, tree_size, vocab_size, bushy", HOST_SHAPES)
def test_host_program_matches_reference_bitwise(draft_mode, batch_size, tree_size, vocab_size, bushy):
    """Greedy requests mixed in, ragged counts, invalid ids, zero entries, every seed/offset form,
    int32 and int64 ids."""
    for index, state in enumerate(RANDOM_STATES):
        case = make_case(batch_size, tree_size, vocab_size, seed=1000 * vocab_size + 10 * tree_size + index,
                         draft_mode=draft_mode, bushy=bushy)
        if index % 2:
            case["tree_token_ids"] = case["tree_token_ids"].to(torch.int32)
        seed, offset = random_state(state, batch_size, "cpu", step=index)
        check_case(case, seed, offset, f"draft={draft_mode} state={state}")


@needs_op
@pytest.mark.parametrize("dtype", PROB_DTYPES, ids=str)
@pytest.mark.parametrize("draft_mode", DRAFT_MODES)
def test_host_program_matches_reference_bitwise_storage_dtypes(dtype, draft_mode):
    """V = 2100: three chunks, the last one partial."""
    for index, state in enumerate(["per-request-seed", "int-large"]):
        case = make_case(4, 11, 2100, seed=70 + index, draft_mode=draft_mode, dtype=dtype, bushy=index == 0)
        seed, offset = random_state(state, 4, "cpu", step=index)
        check_case(case, seed, offset, f"{dtype} draft={draft_mode} state={state}")


@needs_op
@pytest.mark.parametrize("draft_mode", DRAFT_MODES)
def test_host_program_large_vocabulary(draft_mode):
    """V = 128256 (126 chunks): several rejections at a node, then the 128-bit chunk choice."""
    case = aligned_case(4, 12, 128256, seed=5, draft_mode=draft_mode, bushy=True)
    check_case(case, *random_state("per-request-seed", 4, "cpu"), f"V=128256 draft={draft_mode}")


@needs_op
@pytest.mark.parametrize("bushy", [False, True])
def test_host_program_a_tree_of_1024_nodes(bushy):
    """N = 1024: child searches cross many tiles; deep (long paths) and bushy (long runs of rejections)."""
    case = aligned_case(4, 1024, 50, seed=6, bushy=bushy)
    check_case(case, 3, 1, f"N=1024 bushy={bushy}")


@needs_op
@pytest.mark.parametrize("draft_mode", DRAFT_MODES)
def test_host_program_malformed_trees(draft_mode):
    """Parents outside [0, i) (self, forward, negative, huge), num_nodes outside [1, N], junk at parents[:, 0]:
    exactly the reference's outcome, never an out-of-bounds read (the op would fault or read garbage)."""
    case = make_case(8, 9, 6, seed=16, draft_mode=draft_mode, invalid_fraction=0.2)
    parents = case["parents"].clone()
    parents[:, 0] = torch.tensor([-1, 0, 5, -7, 2**31 - 1, 1, -1, 3], dtype=torch.int32)
    parents[0, 3] = 3
    parents[1, 2] = 7
    parents[2, 5] = -1
    parents[3, 4] = -(2**31)
    parents[4, 1] = 2**31 - 1
    parents[5, 8] = 100
    case["parents"] = parents
    case["num_nodes"] = torch.tensor([0, -3, 9, 100, 2**31 - 1, 1, -(2**31), 5], dtype=torch.int32)
    for offset in range(3):
        assert_same(run_op(case, 0, offset), run_reference(case, 0, offset), f"offset {offset}")


def degenerate_case(vocab_size, draft_mode):
    """Probabilities: residual without mass (p = q / 2: the fallback to p), all-zero rows (-1), ties, NaN and
    negative entries (weight 0), entries above 1 (clamped), a NaN row; greedy requests among them."""
    generator = torch.Generator().manual_seed(vocab_size)
    batch_size, tree_size = 12, 8
    parents = torch.tensor([-1, 0, 0, 0, 1, 1, 4, 2], dtype=torch.int32).expand(batch_size, -1).contiguous()
    draft = torch.softmax(torch.randn(batch_size, tree_size, vocab_size, generator=generator), -1)
    target = draft * 0.5
    target[3] = 0.0  # nothing to emit anywhere
    target[4, :, : vocab_size // 2] = 1.0 / vocab_size  # ties
    target[6, :, ::3] = float("nan")
    target[7, :, 1::4] = -0.25
    target[8, :, ::5] = 3.0  # above 1: counts as 1
    target[9] = float("nan")
    parent_rows = draft[torch.arange(batch_size).view(-1, 1), parents.clamp_min(0).long()]
    ids = torch.multinomial(parent_rows.reshape(-1, vocab_size), 1, generator=generator).view(batch_size, tree_size)
    ids[10, 1:4] = ids[10, 1]  # the same token three times among siblings: drawn again after its removal
    temperature = torch.ones(batch_size)
    temperature[4:6] = 0.0
    temperature[9] = 0.0
    return dict(tree_token_ids=ids, parents=parents, target=target, draft=None if draft_mode is None else draft,
                num_nodes=None, temperature=temperature, logits=False,
                draft_sampling=draft_mode or "without_replacement")


@needs_op
@pytest.mark.parametrize("vocab_size", [5, 300, 2100])
@pytest.mark.parametrize("draft_mode", DRAFT_MODES)
def test_host_program_degenerate_rows(vocab_size, draft_mode):
    case = degenerate_case(vocab_size, draft_mode)
    for offset in range(3):
        assert_same(run_op(case, 4, offset), run_reference(case, 4, offset), f"offset {offset}")


@needs_op
@pytest.mark.parametrize("draft_mode", DRAFT_MODES)
def test_host_program_strided_and_mixed_dtype_inputs(draft_mode):
    case = make_case(5, 10, 1500, seed=3, draft_mode=draft_mode)
    case["tree_token_ids"] = case["tree_token_ids"].to(torch.int32).t().contiguous().t()  # stride (1, B)
    case["parents"] = case["parents"].t().contiguous().t()
    case["target"] = case["target"].transpose(0, 1).contiguous().transpose(0, 1)  # stride_b < stride_n
    if case["draft"] is not None:
        case["draft"] = torch.cat([case["draft"], case["draft"]], dim=-1)[..., :1500]  # row stride 2V
    seed, offset = random_state("offset-per-request", 5, "cpu")
    check_case(case, seed, offset, "strided")
    if case["draft"] is not None:
        # float32 target with a bfloat16 draft: both are read as float32 (exact).
        case["draft"] = case["draft"].to(torch.bfloat16)
        check_case(case, seed, offset, "mixed dtypes")


@needs_op
def test_host_program_without_num_nodes_or_temperature():
    case = make_case(4, 9, 700, seed=11, ragged=False, greedy_fraction=0.0)
    assert case["num_nodes"] is None and case["temperature"] is None
    check_case(case, 5, 6, "defaults")


@needs_op
@pytest.mark.parametrize("draft_mode", DRAFT_MODES)
def test_host_program_logits_agree(draft_mode):
    rates = []
    for index, (vocab_size, bushy) in enumerate([(7, True), (111, False), (2100, True)]):
        case = make_case(16, 8, vocab_size, seed=77 + index, draft_mode=draft_mode, logits=True, bushy=bushy)
        rates.append(agreement(run_op(case, 3, index), run_reference(case, 3, index)))
    print(f"host logits agreement with the reference (draft={draft_mode}): {rates}")
    # The softmax sums are gathered per thread and merged, so they round
    # differently from torch's; a test within an ulp of its threshold may go
    # the other way. Anything beyond that is a bug.
    assert min(rates) >= 0.9 and sum(rates) / len(rates) >= 0.95


def workspace_rows(workspace, batch_size, vocab_size):
    """The requests' two float32 workspace rows (base p, base q) as int32 bits, [B, 2, V]; V = 2100."""
    assert vocab_size == 2100
    slot_words, row_floats = 2 * 5, vocab_size  # 3 chunks: 9 words, rounded up to 10; 2100 is a multiple of 4
    rows = workspace.view(batch_size, slot_words + row_floats)[:, slot_words:].contiguous().view(torch.int32)
    return rows.view(batch_size, 2, row_floats)


@needs_op
@pytest.mark.parametrize("draft_mode", DRAFT_MODES)
def test_host_program_residual_rows_are_the_reference_normaliser(draft_mode):
    """A rejection is left pending; only a second one at the node writes the rows, with all rejections
    but the last applied (the base the pending one applies to). After one rejection at the root the
    workspace rows are untouched; after two or three they equal _sampling's residual and normalise of
    the first one or two, bit for bit (outputs alone would rarely show a rounding difference in them).
    q is written without replacement only."""
    batch_size, vocab_size = 3, 2100
    ids, parents, target, draft = rejected_root_case(batch_size, vocab_size)
    draft = None if draft_mode is None else draft
    sampling = draft_mode or "without_replacement"
    words = cuda_workspace_specs(batch_size, 4, vocab_size, None)["tree_verify_cuda.workspace"][0]
    untouched = torch.full((batch_size, vocab_size), -1, dtype=torch.int32)
    for num_children in (1, 2, 3):
        num_nodes = torch.full((batch_size,), num_children + 1, dtype=torch.int32)
        case = dict(tree_token_ids=ids, parents=parents, target=target, draft=draft, num_nodes=num_nodes,
                    temperature=None, logits=False, draft_sampling=sampling)
        workspace = torch.full((words,), -1, dtype=torch.int64)
        outputs = (torch.zeros(batch_size, 4, dtype=torch.int32), torch.zeros(batch_size, 4, dtype=torch.int32),
                   torch.zeros(batch_size, dtype=torch.int32))
        torch.ops.specdec_C.tree_verify(ids, parents, target, draft, num_nodes, None, False, sampling, None, 1,
                                        None, 2, workspace, *outputs)
        assert_same(outputs, run_reference(case, 1, 2), f"outputs, {num_children} children")
        assert int(outputs[2].max()) == 0, "every child is rejected"
        rows = workspace_rows(workspace, batch_size, vocab_size)
        if num_children == 1:
            assert torch.equal(rows[:, 0], untouched), "one rejection writes nothing"
            assert torch.equal(rows[:, 1], untouched)
            continue
        p, q = rows_after_rejections(ids, target, draft, draft_mode, tuple(range(1, num_children)))
        assert torch.equal(rows[:, 0], p.view(torch.int32)), f"p after {num_children - 1} rejections"
        if draft_mode == "without_replacement":
            assert torch.equal(rows[:, 1], q.view(torch.int32)), f"q after {num_children - 1} rejections"
        else:
            assert torch.equal(rows[:, 1], untouched), "q is not rewritten"


def many_rejections_case(batch_size, vocab_size, num_children, draft_mode, seed):
    """A root with ``num_children`` children, each with one child of its own; the root's target and draft
    rows are independent, so most tries at the root are rejected, and an acceptance after rejections walks
    on below. Root candidates: drawn from the draft row (with or without replacement), or the target's
    likeliest tokens with ``draft=None`` (each rejection removes much of p)."""
    generator = torch.Generator().manual_seed(seed)
    tree_size = 2 * num_children + 1
    parents = torch.tensor([-1] + [0] * num_children + list(range(1, num_children + 1)), dtype=torch.int32)
    parents = parents.expand(batch_size, -1).contiguous()
    target = torch.softmax(torch.randn(batch_size, tree_size, vocab_size, generator=generator) * 2, dim=-1)
    draft = torch.softmax(torch.randn(batch_size, tree_size, vocab_size, generator=generator) * 2, dim=-1)
    if draft_mode is None:
        root = target[:, 0].topk(num_children, dim=-1).indices
    else:
        root = torch.multinomial(draft[:, 0], num_children, replacement=draft_mode == "with_replacement",
                                 generator=generator)
    below = torch.multinomial(draft[:, 1:num_children + 1].reshape(-1, vocab_size), 1, generator=generator)
    ids = torch.cat([torch.zeros(batch_size, 1, dtype=torch.int64), root, below.view(batch_size, num_children)], 1)
    return dict(tree_token_ids=ids, parents=parents, target=target, draft=None if draft_mode is None else draft,
                num_nodes=None, temperature=None, logits=False, draft_sampling=draft_mode or "without_replacement")


@needs_op
@pytest.mark.parametrize("vocab_size", [300, 2100])
@pytest.mark.parametrize("num_children", [2, 3, 4])
@pytest.mark.parametrize("draft_mode", DRAFT_MODES)
def test_host_program_pending_rejection_is_applied_exactly_once(draft_mode, num_children, vocab_size):
    """2, 3 and 4 children tried at one node: the acceptance gathers, the writing passes (the second
    rejection writes from the inputs, later ones overwrite the workspace in place) and the final sample
    each see every rejection exactly once, bit for bit with the reference. The case can tell: for some
    request whose root children were all rejected, sampling p with the last rejection not applied, or
    applied twice (with a draft; without one a second application only re-rounds), emits another token."""
    batch_size = 64
    case = many_rejections_case(batch_size, vocab_size, num_children, draft_mode, seed=10 * num_children + vocab_size)
    seed, offset = random_state("per-request-seed", batch_size, "cpu")
    result = run_op(case, seed, offset)
    expected = run_reference(case, seed, offset)
    assert_same(result, expected, f"{num_children} children, draft={draft_mode}")

    accepted_nodes, output, num_accepted = expected
    all_rejected = num_accepted == 0
    assert int(all_rejected.sum()) >= batch_size // 2, "most requests reject every child at the root"
    assert bool((accepted_nodes[:, 1] > 1).any()), "some request accepts a child after rejections"
    ids, target, draft = case["tree_token_ids"], case["target"], case["draft"]
    children = tuple(range(1, num_children + 1))
    keys = rng.RequestKeys(seed, offset, batch_size, torch.device("cpu"))
    root = torch.zeros(batch_size, dtype=torch.int64)
    for wrong in [children[:-1]] + ([children + children[-1:]] if draft is not None else []):
        p, _ = rows_after_rejections(ids, target, draft, draft_mode, wrong)
        tokens = _sampling.sample(keys, root, _sampling.fixed_point(p))
        assert bool((tokens != output[:, 0].long())[all_rejected].any()), f"rejections {wrong} emit the same tokens"


# ---------------------------------------------------------------------------
# top_k / top_p / min_p and bonus_token_ids, the block program on the host.

@needs_op
@pytest.mark.parametrize("parameters", list(PARAMETER_SETS))
@pytest.mark.parametrize("draft_mode", DRAFT_MODES)
def test_host_program_sampling_parameters_match_reference_bitwise(draft_mode, parameters):
    """Greedy requests mixed in, ragged trees, invalid ids, zero entries; V = 111 (one chunk) and 2100 (three,
    the last partial); quantised rows (ties); long accepted paths (aligned drafts); every seed/offset form."""
    cases = [
        make_case(9, 10, 111, seed=31, draft_mode=draft_mode, bushy=True),
        make_case(6, 9, 2100, seed=32, draft_mode=draft_mode),
        quantised(make_case(7, 8, 300, seed=33, draft_mode=draft_mode, zero_fraction=0.0, bushy=True)),
        aligned_case(4, 12, 2100, seed=34, draft_mode=draft_mode, bushy=True),
    ]
    for index, (case, state) in enumerate(zip(cases, RANDOM_STATES)):
        case = with_parameters(case, PARAMETER_SETS[parameters], seed=40 + index)
        seed, offset = random_state(state, case["target"].shape[0], "cpu", step=index)
        check_case(case, seed, offset, f"{parameters} case {index} draft={draft_mode} state={state}")


@needs_op
@pytest.mark.parametrize("draft_mode", DRAFT_MODES)
def test_host_program_sampling_parameters_on_degenerate_rows(draft_mode):
    """NaN, negative, above-1 and all-zero rows: keys and weights of the cleaned values, as the reference."""
    case = with_parameters(degenerate_case(300, draft_mode), PARAMETER_SETS["all+bonus"], seed=5)
    for offset in range(3):
        assert_same(run_op(case, 4, offset), run_reference(case, 4, offset), f"offset {offset}")


@needs_op
def test_host_program_sampling_parameters_large_vocabulary():
    """V = 128256: the radix search's digits spread over many chunks."""
    case = with_parameters(aligned_case(2, 8, 128256, seed=8, bushy=True), PARAMETER_SETS["all"], seed=9)
    check_case(case, *random_state("per-request-seed", 2, "cpu"), "V=128256")


@needs_op
@pytest.mark.parametrize("draft_mode", DRAFT_MODES)
def test_host_program_truncated_residual_rows_are_the_reference(draft_mode):
    """The workspace row after three rejections at the root (written by the third one's pass, the third
    pending) is the residual of the *truncated* root row after the first two, bit for bit: a threshold or
    reciprocal off by anything shows here, where tokens would rarely differ.
    One request per parameter mix; ties (quantised rows) at top-k's and top-p's thresholds."""
    from specdec_kernels.reference import _truncation

    batch_size, vocab_size = 7, 2100
    ids, parents, target, draft = rejected_root_case(batch_size, vocab_size, seed=12)
    target[4:, 0] = torch.round(target[4:, 0] * 500) / 500
    target[torch.arange(batch_size).view(-1, 1), 0, ids[:, 1:]] = 0.0  # every child rejected: p(t) = 0
    #                        k   p     min_p  (neutral: 0, 1, 0; p = 1e-6 keeps the largest and its ties)
    parameters = torch.tensor([[5, 1.0, 0.0], [0, 0.9, 0.0], [0, 1.0, 0.05], [40, 0.8, 0.01], [0, 1e-6, 0.0],
                               [50, 0.95, 0.0], [0, 0.5, 0.2]])
    top_k, top_p, min_p = parameters[:, 0].to(torch.int64), parameters[:, 1].contiguous(), parameters[:, 2].contiguous()
    draft = None if draft_mode is None else draft
    words = cuda_workspace_specs(batch_size, 4, vocab_size, None)["tree_verify_cuda.workspace"][0]
    workspace = torch.full((words,), -1, dtype=torch.int64)
    outputs = (torch.zeros(batch_size, 4, dtype=torch.int32), torch.zeros(batch_size, 4, dtype=torch.int32),
               torch.zeros(batch_size, dtype=torch.int32))
    sampling = draft_mode or "without_replacement"
    torch.ops.specdec_C.tree_verify(ids, parents, target, draft, None, None, False, sampling, None, 1, None, 2,
                                    workspace, *outputs, top_k, top_p, min_p, None)
    case = dict(tree_token_ids=ids, parents=parents, target=target, draft=draft, num_nodes=None, temperature=None,
                logits=False, draft_sampling=sampling, top_k=top_k, top_p=top_p, min_p=min_p)
    assert_same(outputs, run_reference(case, 1, 2), "outputs")
    truncated = _truncation.truncate(target, top_k, top_p, min_p)
    assert bool(((truncated[:, 0] == 0).sum(-1) > (target[:, 0] == 0).sum(-1)).all()), "every request drops tokens"
    p, _ = rows_after_rejections(ids, truncated, draft, draft_mode, (1, 2))  # the third is pending
    assert torch.equal(workspace_rows(workspace, batch_size, vocab_size)[:, 0], p.view(torch.int32))


@needs_op
def test_host_program_sampling_parameters_change_the_outcome():
    """The parameters reach the kernel: top_k = 1 emits each final row's argmax, as greedy decoding would."""
    case = make_case(6, 5, 111, seed=35, greedy_fraction=0.0, invalid_fraction=0.0, ragged=False)
    case = {**case, "tree_token_ids": torch.full_like(case["tree_token_ids"], -1)}  # no child: the root is final
    case["top_k"] = torch.ones(6, dtype=torch.int32)
    _, output, _ = run_op(case, 1, 0)
    assert torch.equal(output[:, 0], case["target"][:, 0].argmax(-1).to(torch.int32))


@needs_op
@pytest.mark.parametrize("draft_mode", DRAFT_MODES)
def test_host_program_sampling_parameters_logits_agree(draft_mode):
    rates = []
    for index, (vocab_size, bushy) in enumerate([(7, True), (111, False), (2100, True)]):
        case = make_case(16, 8, vocab_size, seed=90 + index, draft_mode=draft_mode, logits=True, bushy=bushy)
        case = with_parameters(case, PARAMETER_SETS["all+bonus"], seed=index)
        rates.append(agreement(run_op(case, 3, index), run_reference(case, 3, index)))
    assert_logits_agree(rates, f"draft={draft_mode}")


@needs_op
def test_rejects_bad_sampling_parameters():
    arguments = list(_arguments())
    with pytest.raises(TypeError, match="`top_k` must be Int or Long"):
        torch.ops.specdec_C.tree_verify(*arguments, torch.ones(2))
    with pytest.raises(ValueError, match=r"`bonus_token_ids` must have shape \[B\] = \[2\]"):
        torch.ops.specdec_C.tree_verify(*arguments, None, None, None, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(TypeError, match="`top_p` must be Float"):
        torch.ops.specdec_C.tree_verify(*arguments, None, torch.ones(2, dtype=torch.float64))


@needs_op
def test_launcher_takes_int64_parents():
    """The CUDA launcher narrows int64 parents for the kernel; on CPU tensors it runs the host program."""
    from specdec_kernels.launchers.tree_verify import cuda_tree_verify

    case = make_case(5, 9, 300, seed=12, bushy=True)
    case["parents"] = case["parents"].to(torch.int64)
    case["parents"][0, 3], case["parents"][1, 4] = 2**32, -(2**40)  # 2**32 would wrap to parent 0
    seed, offset = random_state("offset-per-request", 5, "cpu")
    result = cuda_tree_verify(case["tree_token_ids"], case["parents"], case["target"], case["draft"],
                              case["num_nodes"], case["temperature"], False, case["draft_sampling"], seed, 0,
                              offset, 0)
    assert_same(result, run_reference(case, seed, offset), "int64 parents")


def test_workspace_specs():
    # V = 3000: 3 chunks -> 9 words, rounded up to 10; rows of 3000 floats (a multiple of 4) -> 3000 words.
    # Stage records: N + 1 = 7 records of 16 words for each of min(B, 4) requests (the host splits batches of
    # up to 4).
    assert cuda_workspace_specs(5, 6, 3000, None) == {
        "tree_verify_cuda.workspace": (5 * (10 + 3000), torch.int64),
        "tree_verify_cuda.stages": (16 * 4 * 7, torch.int64)}
    # V = 7: 1 chunk -> 3 words -> 4; rows of 8 floats. On a GPU of 132 SMs, batches of up to 66 may split.
    assert cuda_workspace_specs(2, 3, 7, 132) == {
        "tree_verify_cuda.workspace": (2 * (4 + 8), torch.int64),
        "tree_verify_cuda.stages": (16 * 2 * 4, torch.int64)}


@needs_op
def test_host_program_workspace_of_exactly_the_specified_size():
    case = make_case(3, 6, 1111, seed=2)
    words = cuda_workspace_specs(3, 6, 1111, None)["tree_verify_cuda.workspace"][0]
    assert_same(run_op(case, 1, 1, workspace_words=words), run_reference(case, 1, 1), "exact size")
    with pytest.raises(ValueError, match=rf"`workspace` must be a contiguous \[M\] tensor with M >= .* = {words}, "
                                         rf"got \[{words - 1}\]"):
        run_op(case, 1, 1, workspace_words=words - 1)


def test_reserve_workspace_with_trees_includes_the_cuda_tree_verify(monkeypatch):
    from specdec_kernels import _backend, _workspace

    reserved = {}
    monkeypatch.setattr(_backend, "available",
                        lambda op_name, backend, device: (op_name, backend) == ("tree_verify", "cuda"))
    monkeypatch.setattr(_workspace, "reserve", lambda device, specs, **options: reserved.update(specs))
    sk.reserve_workspace("cpu", batch_size=3, max_draft_tokens=7, vocab_size=5000, trees=True, max_tree_nodes=40)
    assert reserved == cuda_workspace_specs(3, 40, 5000, None)
    reserved.clear()
    sk.reserve_workspace("cpu", batch_size=3, max_draft_tokens=7, vocab_size=5000)
    assert reserved == {}


def _arguments(**change):
    arguments = dict(
        tree_token_ids=torch.zeros(2, 3, dtype=torch.int64), parents=torch.tensor([[-1, 0, 0]] * 2, dtype=torch.int32),
        target=torch.full((2, 3, 5), 0.2), draft=None, num_nodes=None, temperature=None, logits=False,
        draft_sampling="without_replacement", seed=None, seed_value=0, offset=None, offset_value=0,
        workspace=torch.zeros(100, dtype=torch.int64), accepted_nodes=torch.zeros(2, 3, dtype=torch.int32),
        output_token_ids=torch.zeros(2, 3, dtype=torch.int32), num_accepted=torch.zeros(2, dtype=torch.int32),
    )
    arguments.update(change)
    return tuple(arguments.values())


@needs_op
@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        (dict(target=torch.zeros(2, 3, 5, dtype=torch.float64)), TypeError, "`target` must be Float, BFloat16 or Half"),
        (dict(target=torch.zeros(2, 0, 5)), ValueError, r"the tree size N must be in \[1, 2\*\*24\)"),
        (dict(tree_token_ids=torch.zeros(2, 4, dtype=torch.int64)), ValueError, r"`tree_token_ids` must have shape"),
        (dict(tree_token_ids=torch.zeros(2, 3)), TypeError, "`tree_token_ids` must be Int or Long"),
        (dict(parents=torch.zeros(2, 3, dtype=torch.int64)), TypeError, "`parents` must be Int"),
        (dict(draft=torch.zeros(2, 3, 4)), ValueError, r"`draft` must have shape \[B, N, V\]"),
        (dict(num_nodes=torch.ones(3, dtype=torch.int32)), ValueError, r"`num_nodes` must have shape \[B\]"),
        (dict(temperature=torch.zeros(2, dtype=torch.float64)), TypeError, "`temperature` must be Float"),
        (dict(seed=torch.zeros(2, dtype=torch.int32)), TypeError, "`seed` must be Long"),
        (dict(offset=torch.zeros(3, dtype=torch.int64)), ValueError, r"`offset` must have shape \[\] or \[B\]"),
        (dict(draft_sampling="replacement"), ValueError, "`draft_sampling` must be"),
        (dict(workspace=torch.zeros(5, dtype=torch.int64)), ValueError, r"`workspace` must be a contiguous \[M\]"),
        (dict(workspace=torch.zeros(100, dtype=torch.int32)), TypeError, "`workspace` must be Long"),
        (dict(accepted_nodes=torch.zeros(2, 2, dtype=torch.int32)), ValueError, "`accepted_nodes` must have shape"),
        (dict(output_token_ids=torch.zeros(3, 2, dtype=torch.int32).t()), ValueError,
         "`output_token_ids` must have shape .* contiguous last dim"),
        (dict(num_accepted=torch.zeros(2, dtype=torch.int64)), TypeError, "`num_accepted` must be Int"),
    ],
)
def test_rejects_bad_arguments(change, error, message):
    with pytest.raises(error, match=message):
        torch.ops.specdec_C.tree_verify(*_arguments(**change))


@needs_op
def test_opcheck():
    """Schema (mutated arguments), Meta kernel and dispatcher registration agree."""
    case = make_case(3, 5, 40, seed=2)
    arguments = (case["tree_token_ids"], case["parents"], case["target"], case["draft"], case["num_nodes"],
                 case["temperature"], False, "with_replacement", None, 4, torch.tensor(2), 0,
                 torch.zeros(cuda_workspace_specs(3, 5, 40, None)["tree_verify_cuda.workspace"][0], dtype=torch.int64),
                 torch.zeros(3, 5, dtype=torch.int32), torch.zeros(3, 5, dtype=torch.int32),
                 torch.zeros(3, dtype=torch.int32))
    torch.library.opcheck(torch.ops.specdec_C.tree_verify.default, arguments)


# ---------------------------------------------------------------------------
# The kernel (GPU).

GPU_VOCABS = [1, 7, 111, 32000, 128256]


@needs_gpu
@pytest.mark.parametrize("vocab_size", GPU_VOCABS)
@pytest.mark.parametrize("dtype", PROB_DTYPES, ids=str)
def test_kernel_matches_reference_bitwise(vocab_size, dtype):
    shapes = [(1, 8), (3, 33), (64, 64)] if vocab_size > 1000 else [(1, 8), (3, 33), (64, 64), (5, 1024)]
    for index, ((batch_size, tree_size), draft_mode) in enumerate(itertools.product(shapes, DRAFT_MODES)):
        state = RANDOM_STATES[index % len(RANDOM_STATES)]
        case = make_case(batch_size, tree_size, vocab_size, seed=vocab_size + index, draft_mode=draft_mode,
                         dtype=dtype, device="cuda", bushy=index % 2 == 0)
        seed, offset = random_state(state, batch_size, "cuda", step=index)
        check_case(case, seed, offset, f"B={batch_size} N={tree_size} V={vocab_size} {dtype} draft={draft_mode} "
                   f"state={state}", runner=run_cuda)


@needs_gpu
@pytest.mark.parametrize("vocab_size", [5, 300, 128256])
@pytest.mark.parametrize("draft_mode", DRAFT_MODES)
def test_kernel_degenerate_rows_and_malformed_trees(vocab_size, draft_mode):
    case = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in degenerate_case(vocab_size,
                                                                                          draft_mode).items()}
    for offset in range(3):
        assert_same(run_cuda(case, 4, offset), run_reference(case, 4, offset), f"offset {offset}")
    case["parents"] = case["parents"].clone()
    case["parents"][:, 3] = torch.tensor([3, 9, -1, -(2**31), 2**31 - 1, 0] * 2, dtype=torch.int32, device="cuda")
    case["num_nodes"] = torch.tensor([0, -3, 8, 100, 2**31 - 1, 1] * 2, dtype=torch.int32, device="cuda")
    assert_same(run_cuda(case, 4, 0), run_reference(case, 4, 0), "malformed")


@needs_gpu
@pytest.mark.parametrize("draft_mode", DRAFT_MODES)
def test_kernel_logits_agree(draft_mode):
    rates = []
    for index, (batch_size, vocab_size) in enumerate([(64, 111), (16, 32000), (8, 128256)]):
        case = make_case(batch_size, 16, vocab_size, seed=500 + index, draft_mode=draft_mode, device="cuda",
                         logits=True, dtype=torch.bfloat16)
        rates.append(agreement(run_cuda(case, 3, index), run_reference(case, 3, index)))
    print(f"CUDA logits agreement with the reference (draft={draft_mode}): {rates}")
    assert min(rates) >= 0.9 and sum(rates) / len(rates) >= 0.95


@needs_gpu
@pytest.mark.parametrize("vocab_size", [111, 32000, 128256])
@pytest.mark.parametrize("draft_mode", DRAFT_MODES)
def test_kernel_sampling_parameters_match_reference_bitwise(vocab_size, draft_mode):
    for index, parameters in enumerate(PARAMETER_SETS):
        case = make_case(8, 16, vocab_size, seed=vocab_size + index, draft_mode=draft_mode, device="cuda",
                         bushy=index % 2 == 0)
        if index % 3 == 2:
            case = quantised(case)
        case = with_parameters(case, PARAMETER_SETS[parameters], seed=index)
        seed, offset = random_state(RANDOM_STATES[index % len(RANDOM_STATES)], 8, "cuda", step=index)
        check_case(case, seed, offset, f"{parameters} V={vocab_size} draft={draft_mode}", runner=run_cuda)


@needs_gpu
def test_cuda_graph_replay_reads_new_offsets():
    batch_size = 8
    case = make_case(batch_size, 64, 32000, seed=31, device="cuda", greedy_fraction=0.2)
    offset = torch.zeros((), dtype=torch.int64, device="cuda")
    seeds = torch.arange(batch_size, dtype=torch.int64, device="cuda") * 1000 + 1

    def call():
        return sk.tree_verify(case["tree_token_ids"], case["parents"], case["target"], case["draft"],
                              num_nodes=case["num_nodes"], temperature=case["temperature"], seed=seeds,
                              offset=offset, backend="cuda")

    # The workspace is allocated before capture, never inside it: reserved
    # here for any capture, so the capture stream needs no warm-up call.
    sk.reserve_workspace("cuda", batch_size=batch_size, max_draft_tokens=63, vocab_size=32000, trees=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        result = call()
    outputs = set()
    for step in range(1, 6):
        offset.add_(1)
        graph.replay()
        torch.cuda.synchronize()
        assert_same(result, run_reference(case, seeds, step), f"replay at offset {step}")
        outputs.add(tuple(result[1].flatten().tolist()))
    assert len(outputs) > 1, "replays at different offsets should draw different tokens"
