"""``python -m specdec_kernels demo|bench``: they run, print their figures, write their files.

Nothing here asserts a timing: the benchmark's numbers depend on the machine.
"""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdec_kernels import demo

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY_DEMO = ["--vocab-size", "16", "--batch-size", "8", "--length", "12", "--draft-length", "2", "--tree", "2,1",
             "--seed", "3"]


def run_module(*arguments, env=None, timeout=120):
    environment = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "specdec_kernels", *arguments], cwd=REPO_ROOT, env=environment,
                          capture_output=True, text=True, timeout=timeout)


def test_demo_cli_prints_its_figures():
    result = run_module("demo", *TINY_DEMO, "--cost-ratio", "0.2")
    assert result.returncode == 0, result.stderr
    for text in ("acceptance rate by position", "mean tokens per target call", "predicted speedup at cost ratio",
                 "best draft length", "acceptance rate by depth", "unigram TV", "bigram TV", "chance",
                 "chi-square test", "power", "verdict", "per generated token", "tokens per sample"):
        assert text in result.stdout, text
    # 8 x 12 tokens over 16 x 16 transitions cannot tell the draft's law from the target's.
    assert "verdict: inconclusive: too few tokens" in result.stdout


@pytest.mark.parametrize("agreement", [1.0, 0.5])
def test_demo_figures(agreement, capsys, device):
    config = demo.DemoConfig(vocab_size=16, batch_size=8, length=12, draft_length=3, tree="2,1",
                             agreement=agreement, device=str(device))
    figures = demo.run(config)
    assert len(figures["acceptance_by_position"]) == 3
    assert all(0.0 <= rate <= 1.0 for rate in figures["acceptance_by_position"])
    assert 1.0 <= figures["tokens_per_call"] <= 4.0
    assert 1.0 <= figures["tree_tokens_per_call"] <= 3.0
    if agreement == 1.0:  # identical models: every draft is accepted
        assert figures["alpha"] == 1.0 and figures["tokens_per_call"] == 4.0
    for unigram, bigram in [*figures["tv"].values(), figures["tv_chance"]]:
        assert 0.0 <= unigram <= 1.0 and 0.0 <= bigram <= 1.0
    assert "verdict" in capsys.readouterr().out
    assert figures["verdict"] in ("consistent", "inconclusive")
    for name in ("chain", "tree", "draft"):
        assert 0.0 <= figures["exactness"][name]["p_value"] <= 1.0
        assert 0.0 <= figures["exactness"][name]["power"] <= 1.0


# 16 x 32 tokens over 16 x 16 transitions: enough to detect the draft-alone law (power ~1 at seed 0).
POWERFUL_DEMO = dict(vocab_size=16, batch_size=16, length=32, draft_length=2, tree="2,1")


def test_demo_verdict_has_power(device):
    figures = demo.run(demo.DemoConfig(**POWERFUL_DEMO, device=str(device)))
    assert figures["verdict"] == "consistent"
    assert min(figures["exactness"][name]["power"] for name in ("chain", "tree")) >= demo.REQUIRED_POWER
    assert figures["exactness"]["draft"]["p_value"] < demo.SIGNIFICANCE  # the biased control is caught


def test_demo_verdict_rejects_a_biased_verifier(monkeypatch, device):
    """A verifier that accepts every draft emits the draft's law: the verdict must say so."""

    def accept_all(draft_token_ids, target, draft, **_):
        batch, drafts = draft_token_ids.shape
        bonus = torch.multinomial(target[:, drafts], 1, generator=torch.Generator(target.device).manual_seed(0))
        tokens = torch.cat([draft_token_ids, bonus.to(torch.int32)], 1)
        return tokens, torch.full((batch,), drafts, dtype=torch.int32, device=target.device)

    monkeypatch.setattr(demo, "chain_verify", accept_all)
    figures = demo.run(demo.DemoConfig(**POWERFUL_DEMO, device=str(device)))
    assert figures["verdict"] == "rejected"
    assert figures["exactness"]["chain"]["p_value"] < demo.SIGNIFICANCE


def test_leviathan_formulas():
    # alpha = 0.8, K = 4: (1 - 0.8^5) / 0.2 = 3.3616 tokens per call.
    assert demo.expected_tokens_per_call(0.8, 4) == pytest.approx(3.3616)
    assert demo.predicted_speedup(0.8, 4, 0.1) == pytest.approx(3.3616 / 1.4)
    assert demo.expected_tokens_per_call(1.0, 4) == 5.0
    best, speedup = demo.best_draft_length(0.8, 0.1)
    assert speedup == max(demo.predicted_speedup(0.8, k, 0.1) for k in range(65))
    assert demo.predicted_speedup(0.8, best, 0.1) == speedup
    assert demo.best_draft_length(0.1, 1.0) == (0, 1.0)  # a poor, costly draft: do not speculate


def test_bench_writes_json_csv_png(tmp_path):
    result = run_module("bench", "--quick", "--output", str(tmp_path), "--op", "chain_verify",
                        env={"SPECDEC_BENCH_TINY": "1"})
    assert result.returncode == 0, result.stderr
    for name in ("results.json", "results.csv", "time_vs_batch.png", "roofline.png", "history.jsonl"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert (tmp_path / "time_vs_batch.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    results = json.loads((tmp_path / "results.json").read_text())
    environment = results["environment"]
    for key in ("device_name", "package_version", "commit", "date", "copy_bandwidth"):
        assert environment[key], key
    assert environment["copy_bandwidth"]["gbps"] > 0
    rows = results["rows"]
    assert rows and all(row["op"] == "chain_verify" for row in rows)
    assert {"reference"} <= {row["provider"] for row in rows}
    for row in rows:
        assert "error" not in row, row
        assert row["min_bytes"] > 0 and row["time_us"] > 0 and row["gbps"] > 0 and row["copy_fraction"] > 0
        assert 0 <= row["mean_accepted"] <= row["K"]
    assert "measured num_accepted" in " ".join(results["ops"]["chain_verify"]["notes"])
    with (tmp_path / "results.csv").open() as handle:
        csv_rows = list(csv.DictReader(handle))
    assert len(csv_rows) == len(rows)
    assert {"device_name", "package_version", "commit", "date", "min_bytes", "gbps", "copy_fraction"} <= set(
        csv_rows[0])
    assert "copy bandwidth" in result.stdout and "chain_verify" in result.stdout
    if not torch.cuda.is_available():
        assert "reference backend only" in result.stdout


def test_bench_says_why_a_provider_gives_no_rows(tmp_path):
    result = run_module("bench", "--op", "chain_verify", "--providers", "flashinfer,cuda,nonsense", "--output",
                        str(tmp_path), env={"SPECDEC_BENCH_TINY": "1"})
    assert result.returncode == 0, result.stderr
    no_rows = json.loads((tmp_path / "results.json").read_text())["ops"]["chain_verify"]["no_rows"]
    assert no_rows["nonsense"] == "chain_verify has no such provider"
    for provider in ("flashinfer", "cuda", "nonsense"):
        assert f"[chain_verify] no rows for {provider}: {no_rows[provider]}" in result.stdout
    if not torch.cuda.is_available():
        assert no_rows["flashinfer"] in ("not installed", "needs a GPU (the device is cpu)")
        assert no_rows["cuda"] == "not timed on a CPU"


def test_chain_verify_minimum_bytes():
    """Two requests, K = 3, V = 10, float32: one rejects at position 0, one accepts all three."""
    sys.path.insert(0, str(REPO_ROOT / "bench"))
    try:
        import bench_chain_verify
        import harness
    finally:
        sys.path.remove(str(REPO_ROOT / "bench"))
    settings = harness.make_settings("cpu", quick=True, tiny=True)
    case = bench_chain_verify.Case(dict(B=2, K=3, V=10, inputs="probs-fp32"), settings)
    inputs = case.make_inputs(0)
    outputs = (torch.zeros(2, 4, dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32))
    total, detail = case.min_bytes(inputs, outputs)
    # request 0: 1 id + full p and q rows; request 1: 3 ids + 3 (p, q) gathers + the bonus p row;
    # outputs: [2, 4] + [2] int32.
    assert total == (4 + 2 * 40) + (3 * 4 + 3 * 8 + 40) + (2 * 4 * 4 + 2 * 4)
    assert detail["mean_accepted"] == 1.5
    logits_case = bench_chain_verify.Case(dict(B=2, K=3, V=10, inputs="logits-bf16"), settings)
    total, _ = logits_case.min_bytes(logits_case.make_inputs(0), outputs)
    # logits: full target rows 0..a (bfloat16, a softmax reads its row), the draft probabilities as above:
    # request 0 its q row after the rejection, request 1 three q(t) gathers.
    assert total == (4 + 2 * 20) + (3 * 4 + 4 * 20 + 3 * 2) + (2 * 4 * 4 + 2 * 4)


def test_tree_verify_minimum_bytes():
    """Tree of 8 nodes (root: 1-4; node 1: 5, 6; node 2: 7), accepted path 0 -> 2 -> 7, V = 10."""
    sys.path.insert(0, str(REPO_ROOT / "bench"))
    try:
        import bench_tree_verify
        import harness
    finally:
        sys.path.remove(str(REPO_ROOT / "bench"))
    assert harness.branching_tree(8) == [-1, 0, 0, 0, 0, 1, 1, 2]
    settings = harness.make_settings("cpu", quick=True, tiny=True)
    outputs = (torch.tensor([[0, 2, 7, -1, -1, -1, -1, -1]], dtype=torch.int32), None,
               torch.tensor([2], dtype=torch.int32))
    fixed = 8 * 4 + 2 * 8 * 4 + 4  # parents read, two [1, 8] outputs and one [1] written
    case = bench_tree_verify.Case(dict(B=1, N=8, V=10, inputs="probs-fp32"), settings)
    total, detail = case.min_bytes(case.make_inputs(0), outputs)
    # root: children 1 (rejected) and 2 (accepted) tried: 2 ids + full p and q rows;
    # node 2: child 7 accepted at once: 1 id + p(t), q(t); node 7: a leaf, the sample reads its p row.
    assert total == (2 * 4 + 2 * 40) + (4 + 2 * 4) + 40 + fixed
    assert detail["mean_accepted"] == 2
    case = bench_tree_verify.Case(dict(B=1, N=8, V=10, inputs="logits-bf16"), settings)
    total, _ = case.min_bytes(case.make_inputs(0), outputs)
    # logits: every node on the path reads its whole target row; the draft probabilities as above: the root's
    # q row (a child was rejected), node 2's q(t) gather.
    assert total == (2 * 4 + 2 * 20) + (4 + 20 + 2) + 20 + fixed
