"""``examples/paged_speculative.py``: the paged decoding loop is exact, and its cache is what a plain forward writes.

* ``T = 0``: tree, chain and plain modes produce exactly the tokens of the
  target's own ``generate(do_sample=False)`` for prompts of different
  lengths, with the reference ops (float32 models) and with the Triton
  kernels under the interpreter (float16 models: the Triton attention takes
  16-bit tensors; in bfloat16 its last-bit differences from the reference
  are enough to flip near-ties of the logits, so equality is not a fair test
  there). ``--check`` exits 0 on equality and 1 otherwise.
* ``T = 1``: over ``NUM_SAMPLES`` requests on one prompt (one batch; the int
  seed gives each request its own numbers, the draft's generator draws
  independently per request) the first two tokens follow the target's joint
  law ``p(x1) p(x2 | x1)``, computed with a plain forward. Pearson's
  chi-square at ``ALPHA = 1e-3``, fixed seeds. Power: the test's design is
  checked to reject the draft's joint law with probability > 0.99 (the law a
  verifier that accepts every draft would emit; total variation 0.29 from
  the target's), and two such wrong verifiers do fail it. From the
  noncentral chi-square, a law moved 40% of the way to the draft's is
  rejected with probability 1.00 and one moved 20% with 0.50: this checks
  the wiring of models, cache, masks, positions and verifiers, not small
  biases (``tests/test_*_exactness.py`` do that, on Markov targets).
* After every step, the paged cache holds, at each request's positions
  ``0 .. L-2``, the K/V that ``transformers``' own forward over the committed
  tokens writes, to float32 rounding (``KV_TOLERANCE``); a loop that skips
  ``compact_kv`` fails this check.
"""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the paged example needs `pip install transformers`")

import specdec_kernels as sk  # noqa: E402
from conftest import backend_or_skip  # noqa: E402
from specdec_kernels import _chi_square  # noqa: E402

EXAMPLE_PATH = Path(__file__).resolve().parents[1] / "examples" / "paged_speculative.py"
ALPHA = 1e-3
NUM_SAMPLES = 4000
PROMPT = torch.tensor([44, 47, 53])
KV_TOLERANCE = 1e-4  # float32 K/V of two attention implementations; a misplaced position differs by O(1)


def _load_example():
    spec = importlib.util.spec_from_file_location("paged_speculative", EXAMPLE_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


example = _load_example()


@pytest.fixture(scope="module")
def models():
    return example.make_models(seed=0)


@pytest.fixture(scope="module")
def plain_target(models):
    return example.with_standard_attention(models[0])


def _joint_law(model) -> torch.Tensor:
    """``p(x1, x2)`` of the first two tokens after ``PROMPT`` at ``T = 1`` under ``model``, float64 ``[V * V]``."""
    vocab_size = model.config.vocab_size
    with torch.inference_mode():
        first = torch.softmax(model(PROMPT.view(1, -1)).logits[0, -1].double(), dim=-1)
        continued = torch.cat([PROMPT.expand(vocab_size, -1), torch.arange(vocab_size).view(-1, 1)], dim=1)
        second = torch.softmax(model(continued).logits[:, -1].double(), dim=-1)
    return (first.view(-1, 1) * second).flatten()


@pytest.fixture(scope="module")
def target_law(plain_target):
    return _joint_law(plain_target)


def _pair_counts(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return torch.bincount(tokens[:, 0] * vocab_size + tokens[:, 1], minlength=vocab_size**2).double().view(1, -1)


def _sample_pairs(models, mode, tree_children="topk", seed=1):
    target, draft = models
    tokens, _ = example.speculative_generate(
        target, draft, [PROMPT] * NUM_SAMPLES, 2, mode=mode, temperature=1.0, num_draft_tokens=3,
        branching=2, depth=2, tree_children=tree_children, seed=seed)
    assert tokens.shape == (NUM_SAMPLES, 2)
    return tokens


def _p_value(tokens, law) -> float:
    vocab_size = round(law.numel() ** 0.5)
    result, _ = _chi_square.chi_square_test(_pair_counts(tokens, vocab_size), law.view(1, -1))
    return result.p_value


@pytest.mark.parametrize("mode", example.MODES)
def test_greedy_tokens_equal_generate(models, mode):
    target, draft = models
    prompts = example.make_prompts(3, 4, target.config.vocab_size, seed=2, device="cpu")
    tokens, stats = example.speculative_generate(target, draft, prompts, 16, mode=mode, temperature=0.0,
                                                 backend="reference")
    assert torch.equal(tokens, example.generate_plainly(target, prompts, 16))
    if mode != "plain":
        assert stats.accepted > 0, "no draft was ever accepted: the loop did not exercise verification"


@pytest.mark.parametrize("mode", ["tree", "chain"])
def test_greedy_tokens_equal_generate_triton(mode):
    for op_name in ("build_tree", "tree_attention", "tree_verify", "compact_kv", "chain_verify_packed"):
        backend_or_skip(op_name, "triton", "cpu")  # the example runs on the CPU whatever the test device
    assert example.main(["--mode", mode, "--temperature", "0", "--check", "--backend", "triton",
                         "--dtype", "float16", "--max-new-tokens", "12"]) == 0


def test_check_exit_status(monkeypatch, capsys):
    assert example.main(["--mode", "tree", "--temperature", "0", "--check", "--max-new-tokens", "8"]) == 0
    assert "tokens equal generate" in capsys.readouterr().out
    monkeypatch.setattr(example, "generate_plainly", lambda model, prompts, n: torch.zeros(len(prompts), n,
                                                                                          dtype=torch.int64))
    assert example.main(["--mode", "tree", "--temperature", "0", "--check", "--max-new-tokens", "8"]) == 1
    assert "DIFFER" in capsys.readouterr().out


def test_law_test_has_power(models, target_law):
    """The draft's joint law (what an accept-everything verifier emits) is rejected with probability > 0.99."""
    _, draft = models
    draft_law = _joint_law(example.with_standard_attention(draft))
    expected_counts = (target_law * NUM_SAMPLES).view(1, -1)
    _, bins = _chi_square.chi_square_test(expected_counts, target_law.view(1, -1))
    power = _chi_square.power_against(expected_counts, target_law.view(1, -1), draft_law.view(1, -1), bins, ALPHA)
    assert power > 0.99, f"power against the draft's law {power:.3f}"


@pytest.mark.parametrize(("mode", "tree_children"), [("chain", "topk"), ("tree", "topk"), ("tree", "sampled")],
                         ids=["chain", "tree-topk", "tree-sampled"])
def test_sampled_tokens_follow_target(models, target_law, mode, tree_children):
    p_value = _p_value(_sample_pairs(models, mode, tree_children), target_law)
    assert p_value > ALPHA, f"{mode}/{tree_children}: chi-square p = {p_value:.2e} <= {ALPHA}"


def test_accept_all_chain_verifier_fails(models, target_law, monkeypatch):
    """Accepting every draft emits the draft's law: the law test must reject it."""

    def accept_all(draft_token_ids, cu_num_draft_tokens, target, draft, *, max_num_draft_tokens, **kwargs):
        counts = (cu_num_draft_tokens[1:] - cu_num_draft_tokens[:-1]).to(torch.int64)
        output = torch.full((counts.numel(), max_num_draft_tokens + 1), -1, dtype=torch.int32)
        columns = torch.arange(max_num_draft_tokens + 1).view(1, -1)
        output[columns < counts.view(-1, 1)] = draft_token_ids.to(torch.int32)
        bonus_rows = cu_num_draft_tokens[1:].to(torch.int64) + torch.arange(counts.numel())
        bonus = torch.multinomial(target[bonus_rows], 1, generator=torch.Generator().manual_seed(3))
        output[torch.arange(counts.numel()), counts] = bonus.view(-1).to(torch.int32)
        return output, counts.to(torch.int32)

    monkeypatch.setattr(sk, "chain_verify_packed", accept_all)
    assert _p_value(_sample_pairs(models, "chain"), target_law) < ALPHA


def test_tree_verifier_given_target_as_draft_fails(models, target_law, monkeypatch):
    """Sampled children verified as if drawn from the target are always accepted: the draft's law, rejected."""
    tree_verify = sk.tree_verify

    def target_as_draft(tree_token_ids, parents, target, draft, **kwargs):
        inner_nodes = draft.sum(dim=-1, keepdim=True) > 0  # leaves have zero rows
        return tree_verify(tree_token_ids, parents, target, torch.where(inner_nodes, target, draft), **kwargs)

    monkeypatch.setattr(sk, "tree_verify", target_as_draft)
    assert _p_value(_sample_pairs(models, "tree", "sampled"), target_law) < ALPHA


def _cache_error(decoder, plain_target) -> float:
    """Largest |paged cache - transformers' K/V| over requests, layers and positions ``0 .. L-2``."""
    worst = 0.0
    for request, length in enumerate(decoder.lengths.tolist()):
        with torch.inference_mode():
            plain = plain_target(decoder.sequences[request, :length - 1].view(1, -1), use_cache=True).cache
        for layer, stored in enumerate(plain.layers):
            keys, values = decoder.cache.read(layer, request, length - 1)
            worst = max(worst, float((keys - stored.keys[0].transpose(0, 1)).abs().max()),
                        float((values - stored.values[0].transpose(0, 1)).abs().max()))
    return worst


def _run_checking_cache(models, plain_target, **options) -> list[float]:
    target, draft = models
    prompts = example.make_prompts(3, 4, target.config.vocab_size, seed=3, device="cpu")
    decoder = example.PagedSpeculativeDecoder(target, draft, prompts, 12, backend="reference", **options)
    errors = [_cache_error(decoder, plain_target)]
    while not decoder.finished:
        decoder.step()
        errors.append(_cache_error(decoder, plain_target))
    return errors


@pytest.mark.parametrize("options", [
    dict(mode="tree", temperature=0.0),
    dict(mode="tree", temperature=1.0, tree_children="sampled", branching=3),
    dict(mode="chain", temperature=1.0),
], ids=["tree-greedy", "tree-sampled", "chain-sampled"])
def test_cache_holds_plain_forward_kv(models, plain_target, options):
    errors = _run_checking_cache(models, plain_target, **options)
    assert max(errors) < KV_TOLERANCE, f"cache error after each step: {errors}"


def test_skipping_compaction_is_caught(models, plain_target, monkeypatch):
    """Without ``compact_kv`` an accepted path off the first branch leaves its K/V in the wrong slots."""
    monkeypatch.setattr(sk, "compact_kv", lambda *args, **kwargs: None)
    errors = _run_checking_cache(models, plain_target, mode="tree", temperature=1.0, tree_children="sampled",
                                 branching=3)
    assert max(errors) > 100 * KV_TOLERANCE, f"cache error after each step: {errors}"
