"""``examples/hf_speculative.py``: speculative generation with ``transformers`` models is exact.

* ``T = 0``: chain and tree produce exactly the tokens of the target's own
  ``generate(do_sample=False)``, with the reference ops and with the Triton
  kernels (under the interpreter on a CPU).
* ``T = 1``: over ``NUM_SAMPLES`` independent requests (one batch, the int
  seed gives each request its own random numbers, the draft's generator
  draws independently per request) the first two generated tokens follow the
  target's joint law ``p(x1) p(x2 | x1)``, computed exactly with forward
  passes. Chi-square at ``ALPHA = 1e-3`` with fixed seeds, so the outcome
  is the same on every run. Two wrong verifiers (they accept every draft)
  fail the same test, so it can fail.

Power, from the noncentral chi-square: the test rejects a law moved 40% of
the way from the target's joint law to the draft's (total variation 0.08)
with probability 0.95, and one moved 20% (0.04) with probability 0.05. So
it catches a verifier that ignores the target, not a subtle bias: children
drawn without replacement but verified as if drawn with replacement pass
it (p = 0.47 and 0.17 for seeds 1 and 2). Small biases are the job of the
package's exactness tests (``tests/test_*_exactness.py``), whose Markov
targets make the exact law cheap at large sample sizes; this test checks
that the example wires models, masks, positions and verifiers together
right, within the < 60 s CI budget on 2 cores.
"""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the Hugging Face example needs `pip install transformers`")
stats = pytest.importorskip("scipy.stats")

import specdec_kernels as sk  # noqa: E402
from conftest import backend_or_skip  # noqa: E402

EXAMPLE_PATH = Path(__file__).resolve().parents[1] / "examples" / "hf_speculative.py"
ALPHA = 1e-3
NUM_SAMPLES = 4000  # about 3 s per generation run on 2 cores; power as in the module docstring
MIN_EXPECTED = 5  # cells expected fewer times are pooled into one, as the chi-square approximation needs
PROMPT = torch.tensor([44, 47, 53])


def _load_example():
    spec = importlib.util.spec_from_file_location("hf_speculative", EXAMPLE_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


example = _load_example()


@pytest.fixture(scope="module")
def models():
    return example.make_models(seed=0)


@pytest.fixture(scope="module")
def joint_law(models):
    """``p(x1, x2)`` of the first two tokens after ``PROMPT`` at ``T = 1``, float64 ``[V, V]``."""
    target, _ = models
    vocab_size = target.config.vocab_size
    with torch.inference_mode():
        first = torch.softmax(target(PROMPT.view(1, -1)).logits[0, -1], dim=-1)
        continued = torch.cat([PROMPT.expand(vocab_size, -1), torch.arange(vocab_size).view(-1, 1)], dim=1)
        second = torch.softmax(target(continued).logits[:, -1], dim=-1)
    return first.view(-1, 1) * second


def _p_value(tokens: torch.Tensor, law: torch.Tensor) -> float:
    """Chi-square p-value of the observed pairs ``tokens [n, 2]`` against ``law [V, V]``."""
    vocab_size = law.shape[0]
    counts = torch.bincount(tokens[:, 0] * vocab_size + tokens[:, 1], minlength=vocab_size**2).double()
    expected = law.flatten() / law.sum() * tokens.shape[0]
    small = expected < MIN_EXPECTED
    observed = torch.cat([counts[~small], counts[small].sum().view(1)])
    expected = torch.cat([expected[~small], expected[small].sum().view(1)])
    return float(stats.chisquare(observed.numpy(), expected.numpy()).pvalue)


def _sample_pairs(models, mode, tree_children="topk", seed=1):
    target, draft = models
    tokens, _ = example.speculative_generate(
        target, draft, PROMPT.expand(NUM_SAMPLES, -1), 2, mode=mode, temperature=1.0, num_draft_tokens=3,
        branching=2, depth=2, tree_children=tree_children, seed=seed)
    assert tokens.shape == (NUM_SAMPLES, 2)
    return tokens


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_greedy_tokens_equal_generate(models, mode, backend):
    for op_name in ("build_tree", f"{mode}_verify"):
        backend_or_skip(op_name, backend, "cpu")  # the example runs on the CPU whatever the test device
    target, draft = models
    prompts = torch.randint(target.config.vocab_size, (3, 5), generator=torch.Generator().manual_seed(2))
    max_new_tokens = 16
    tokens, run = example.speculative_generate(target, draft, prompts, max_new_tokens, mode=mode, temperature=0.0,
                                               backend=backend)
    with torch.inference_mode():
        expected = target.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                                   max_new_tokens=max_new_tokens)[:, prompts.shape[1]:]
    assert torch.equal(tokens, expected)
    assert run.accepted > 0, "no draft was ever accepted: the loop did not exercise verification"


@pytest.mark.parametrize(("mode", "tree_children"), [("chain", "topk"), ("tree", "topk"), ("tree", "sampled")],
                         ids=["chain", "tree-topk", "tree-sampled"])
def test_sampled_tokens_follow_target(models, joint_law, mode, tree_children):
    p_value = _p_value(_sample_pairs(models, mode, tree_children), joint_law)
    assert p_value > ALPHA, f"{mode}/{tree_children}: chi-square p = {p_value:.2e} <= {ALPHA}"


def test_accept_all_chain_verifier_fails(models, joint_law, monkeypatch):
    """Accepting every draft emits the draft's law: the test above must reject it."""

    def accept_all(draft_token_ids, target, draft, **kwargs):
        bonus = torch.multinomial(target[:, -1], 1, generator=torch.Generator().manual_seed(3))
        num_accepted = torch.full((draft_token_ids.shape[0],), draft_token_ids.shape[1], dtype=torch.int32)
        return torch.cat([draft_token_ids, bonus], dim=1).to(torch.int32), num_accepted

    monkeypatch.setattr(sk, "chain_verify", accept_all)
    assert _p_value(_sample_pairs(models, "chain"), joint_law) < ALPHA


def test_tree_verifier_given_target_as_draft_fails(models, joint_law, monkeypatch):
    """Sampled children verified as if drawn from the target are always accepted: the draft's law, rejected.

    (Verifying them as fixed candidates, ``draft=None``, would not do: that is
    exact for any candidates chosen independently of the verifier's numbers.)
    """
    tree_verify = sk.tree_verify

    def target_as_draft(tree_token_ids, parents, target, draft, **kwargs):
        inner_nodes = draft.sum(dim=-1, keepdim=True) > 0  # leaves have zero rows
        return tree_verify(tree_token_ids, parents, target, torch.where(inner_nodes, target, draft), **kwargs)

    monkeypatch.setattr(sk, "tree_verify", target_as_draft)
    assert _p_value(_sample_pairs(models, "tree", "sampled"), joint_law) < ALPHA
