"""Statistical exactness of tree verification over whole generation loops.

A target and a draft Markov chain generate 100,000 sequences in parallel.
Each step the test drafts a tree from the draft chain with its own generator
(children i.i.d., or one after another without replacement, or the draft's
top-k tokens as deterministic candidates), the verifier walks it and emits
tokens, and the loop repeats (a new offset each step) until every sequence
has ``LENGTH`` tokens. Tree sizes are ragged (``num_nodes`` drawn per
sequence per step). The joint law of the first ``LENGTH`` tokens must match
the target chain's exact joint (chi-square, bins merged to expected count
>= 5, p >= 1e-4, fixed seeds). The same harness must reject deliberately
wrong verifiers, which shows it has the power to catch the biases they cause.
"""

import numpy as np
import pytest
import torch

import specdec_kernels as sk
from conftest import ALL_BACKENDS, backend_or_skip
from kernel_law import assert_follows_the_law
from markov import SIGNIFICANCE, MarkovModel, append_emitted, joint_pvalue
from specdec_kernels.reference import _sampling

BACKENDS = list(ALL_BACKENDS)

NUM_SEQUENCES = 100_000
# The wrong verifiers below fail with p < 1e-12 on a fifth of the samples.
POWER_SEQUENCES = 20_000
LENGTH = 3
START_TOKEN = 2

# Children per node at each depth: 1 + 3 + 6 = 10 nodes, 1 + 2 + 4 + 8 = 15 nodes.
SHALLOW = (3, 2)
DEEP = (2, 2, 2)


def make_models(vocab_size: int, seed: int):
    """Target without token 0, draft without token 1.

    The draft proposes a token the target never emits, and the target has
    mass the draft never proposes: only the residual can produce token 1.
    """
    generator = np.random.default_rng(seed)
    target = MarkovModel.random(vocab_size, generator, zero_tokens=(0,))
    draft = MarkovModel.random(vocab_size, generator, zero_tokens=(1,), sharpness=0.5)
    return target, draft


def tree_layout(branching):
    """Full tree in breadth-first order: ``(parents, levels)``.

    ``levels`` lists, per depth, the nodes whose children are drafted there
    and how many children each has; those children are the next
    ``len(nodes) * width`` node indices, ``width`` per node in order.
    """
    parents, levels, frontier = [-1], [], [0]
    for width in branching:
        levels.append((frontier, width))
        next_frontier = []
        for node in frontier:
            next_frontier.extend(range(len(parents), len(parents) + width))
            parents.extend([node] * width)
        frontier = next_frontier
    return parents, levels


def sample_rows(rows: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per distribution in ``rows [..., V]`` (float64, unnormalised) by inverse CDF."""
    cdf = rows.cumsum(dim=-1)
    threshold = torch.rand(rows.shape[:-1] + (1,), generator=generator, dtype=torch.float64) * cdf[..., -1:]
    return (cdf <= threshold).sum(dim=-1).clamp_max(rows.shape[-1] - 1)


def draft_children(rows: torch.Tensor, width: int, mode: str, generator: torch.Generator) -> torch.Tensor:
    """``width`` children ``[..., width]`` per draft distribution in ``rows [..., V]`` (float64)."""
    if mode == "with_replacement":
        return torch.stack([sample_rows(rows, generator) for _ in range(width)], dim=-1)
    if mode == "without_replacement":
        drawn, remaining = [], rows.clone()
        for _ in range(width):
            token = sample_rows(remaining, generator)
            remaining.scatter_(-1, token.unsqueeze(-1), 0.0)
            drawn.append(token)
        return torch.stack(drawn, dim=-1)
    order = rows.argsort(dim=-1, descending=True, stable=True)
    if mode == "top_k":
        return order[..., :width]
    if mode == "duplicates":  # top-1 twice, then top-2 twice, ...
        return order[..., [j // 2 for j in range(width)]]
    raise ValueError(mode)


def draft_tree(roots, layout, draft_model, mode, generator):
    """Token ids ``[B, N]`` of a full tree drafted from ``draft_model`` below ``roots``."""
    parents, levels = layout
    table = torch.as_tensor(draft_model.transition, dtype=torch.float64)
    tokens = torch.empty((roots.shape[0], len(parents)), dtype=torch.int64)
    tokens[:, 0] = roots
    first_child = 1
    for nodes, width in levels:  # a depth's tokens are drawn before their children
        children = draft_children(table[tokens[:, nodes]], width, mode, generator)
        tokens[:, first_child:first_child + len(nodes) * width] = children.flatten(start_dim=1)
        first_child += len(nodes) * width
    return tokens


def generate(target_model, draft_model, *, branching, mode, backend, device, temperature=None,
             seed=1234, test_seed=0, verify=None, num_sequences=NUM_SEQUENCES):
    """Run the speculative loop; returns the first ``LENGTH`` tokens of every sequence.

    ``mode``: how children are drafted; ``"with_replacement"`` and
    ``"without_replacement"`` pass the draft rows (and that mode) to the
    verifier, ``"top_k"`` and ``"duplicates"`` verify with ``draft=None``.
    ``temperature``: per-sequence temperatures, which switch the inputs to
    logits. ``verify``: the verifier to call instead of ``sk.tree_verify``.
    """
    verify = verify or sk.tree_verify
    generator = torch.Generator().manual_seed(test_seed)
    layout = tree_layout(branching)
    tree_size, vocab_size = len(layout[0]), target_model.vocab_size
    with_draft = mode in ("with_replacement", "without_replacement")
    slots = torch.arange(tree_size).view(1, -1)
    prev = torch.full((num_sequences,), START_TOKEN, dtype=torch.int64)
    tokens = torch.full((num_sequences, LENGTH), -1, dtype=torch.int64)
    produced = torch.zeros(num_sequences, dtype=torch.int64)
    step = 0
    while bool((produced < LENGTH).any()):
        # Only the sequences still short of LENGTH tokens take another step.
        active = (produced < LENGTH).nonzero().squeeze(-1)
        batch_size = active.shape[0]
        tree_ids = draft_tree(prev[active], layout, draft_model, mode, generator)
        parents = torch.tensor(layout[0], dtype=torch.int32).expand(batch_size, -1).contiguous()
        num_nodes = torch.randint(1, tree_size + 1, (batch_size,), generator=generator, dtype=torch.int32)
        # Nodes past num_nodes hold garbage, invalid ids included: they must be ignored.
        garbage = torch.randint(-1, vocab_size + 1, tree_ids.shape, generator=generator)
        tree_ids = torch.where(slots < num_nodes.view(-1, 1), tree_ids, garbage)
        contexts = tree_ids.clamp(0, vocab_size - 1)
        if temperature is None:
            target = target_model.rows(contexts)
            draft = draft_model.rows(contexts) if with_draft else None
        else:
            per_row = torch.where(temperature[active] > 0, temperature[active], 1.0).view(-1, 1, 1)
            target = target_model.logits(contexts, 1.0) * per_row
            # `logits` covers the target only (v1.3): the draft is the distribution the children were drawn from.
            draft = draft_model.rows(contexts) if with_draft else None
        if isinstance(seed, torch.Tensor):
            # Per-request seeds follow their sequence; the offset is a 0-dim tensor.
            step_seed, step_offset = seed[active].to(device), torch.tensor(step, device=device)
        else:
            step_seed, step_offset = seed, step
        _, output, num_accepted = verify(
            tree_ids.to(device), parents.to(device), target.to(device), None if draft is None else draft.to(device),
            num_nodes=num_nodes.to(device),
            temperature=None if temperature is None else temperature[active].to(device),
            logits=temperature is not None,
            draft_sampling=mode if with_draft else "without_replacement",
            seed=step_seed,
            offset=step_offset,
            backend=backend,
        )
        prev[active] = append_emitted(tokens, produced, active, output, num_accepted)
        step += 1
    return tokens


def exactness_pvalue(tokens, target_model):
    return joint_pvalue(tokens, target_model, START_TOKEN)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "vocab_size, branching, mode",
    [
        (6, SHALLOW, "with_replacement"),
        (6, SHALLOW, "without_replacement"),
        (5, DEEP, "without_replacement"),
        (7, DEEP, "top_k"),
        (6, SHALLOW, "duplicates"),
    ],
    ids=["with_replacement-3x2-V6", "without_replacement-3x2-V6", "without_replacement-2x2x2-V5",
         "top_k-2x2x2-V7", "duplicates-3x2-V6"],
)
def test_emitted_tokens_follow_the_target(backend, vocab_size, branching, mode, device):
    backend_or_skip("tree_verify", backend)
    target_model, draft_model = make_models(vocab_size, seed=vocab_size)
    assert_follows_the_law(
        lambda on, sequences: generate(target_model, draft_model, branching=branching, mode=mode, backend=on,
                                       device=device, num_sequences=sequences),
        backend, device, lambda tokens: exactness_pvalue(tokens, target_model), NUM_SEQUENCES)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "branching, mode", [(DEEP, "with_replacement"), (SHALLOW, "top_k")], ids=["with_replacement-2x2x2", "top_k-3x2"]
)
def test_logits_with_per_request_temperature_and_greedy(backend, branching, mode, device):
    """Logits at temperatures 0.5, 1 and 2 (one exact joint: the rows are
    ``softmax(logits * T / T)``), with every tenth request greedy; per-request
    seeds and a tensor offset."""
    backend_or_skip("tree_verify", backend)
    target_model, draft_model = make_models(6, seed=11)
    temperature = torch.tensor([0.5, 1.0, 2.0, 0.5, 1.0, 2.0, 0.5, 1.0, 2.0, 0.0]).repeat(NUM_SEQUENCES // 10)
    seed = torch.randint(-(2**62), 2**62, (NUM_SEQUENCES,), generator=torch.Generator().manual_seed(5))
    greedy = temperature == 0
    tokens = assert_follows_the_law(
        lambda on, sequences: generate(target_model, draft_model, branching=branching, mode=mode, backend=on,
                                       device=device, temperature=temperature, seed=seed, num_sequences=sequences),
        backend, device, lambda tokens: exactness_pvalue(tokens[~greedy], target_model), NUM_SEQUENCES)
    greedy = greedy[:tokens.shape[0]]
    argmax = torch.as_tensor(target_model.transition).argmax(-1)
    expected, prev = [], START_TOKEN
    for _ in range(LENGTH):
        prev = int(argmax[prev])
        expected.append(prev)
    assert bool((tokens[greedy] == torch.tensor(expected)).all())


def _accept_with_target_probability(uniform, target_prob, draft_prob):
    return uniform < target_prob


def _resample_from_target(target_row, draft_row):
    return target_row


def _verify_as_with_replacement(*args, **kwargs):
    return sk.tree_verify(*args, **{**kwargs, "draft_sampling": "with_replacement"})


@pytest.mark.parametrize(
    "mode, patch, verify",
    [
        ("with_replacement", ("accept", _accept_with_target_probability), None),
        ("without_replacement", ("accept", _accept_with_target_probability), None),
        ("without_replacement", ("residual", _resample_from_target), None),
        ("top_k", ("residual", _resample_from_target), None),
        ("without_replacement", None, _verify_as_with_replacement),
    ],
    ids=[
        "accept-with-p-instead-of-min(1,p/q)-with-replacement",
        "accept-with-p-instead-of-min(1,p/q)-without-replacement",
        "keep-p-instead-of-residual-without-replacement",
        "keep-p-instead-of-residual-top-k",
        "drawn-without-replacement-verified-with-replacement",
    ],
)
def test_harness_rejects_wrong_verifiers(mode, patch, verify, monkeypatch, device):
    """The chi-square harness must fail biased verifiers, or it proves nothing."""
    target_model, draft_model = make_models(6, seed=6)
    if patch is not None:
        monkeypatch.setattr(_sampling, *patch)
    tokens = generate(target_model, draft_model, branching=SHALLOW, mode=mode, backend="reference", device=device,
                      verify=verify, num_sequences=POWER_SEQUENCES)
    assert exactness_pvalue(tokens, target_model) < SIGNIFICANCE
