"""Speculative decoding end to end on built-in synthetic models: ``python -m specdec_kernels demo``.

Two bigram "language models" are generated from a seed, so nothing is
downloaded: the target's next-token logits after token ``x`` are row ``x`` of
a random low-rank table ``sharpness * U W / sqrt(rank)``; the draft's are
``agreement * target + (1 - agreement) * noise``, with ``noise`` an
independent table of the same kind. ``agreement = 1`` makes the draft the
target; lower values make it disagree more.

The demo runs the whole loop on a batch of requests:

* chain: the draft samples ``K`` tokens (its own ``torch.Generator``), the
  target scores the ``K + 1`` positions, ``sk.chain_verify`` decides, the
  accepted tokens and the target's token are committed;
* tree: the draft samples the children of every node without replacement
  (Gumbel top-k, same generator), ``sk.build_tree`` gives depths and rotary
  positions, ``sk.tree_verify`` decides.

Each verification call uses the run's seed and an offset that advances by
one per call, so no two calls share random numbers. It prints the acceptance
rate by position, the mean tokens per target call, the speedup Leviathan et
al. (2023) predict for a draft/target cost ratio ``c``
(``(1 - a^(K+1)) / ((1 - a)(cK + 1))``), the best draft length, the wall
time per generated token, and an exactness check. Since the target is a
bigram model, the exact law of every emitted token given the previous one is
known, so the check is Pearson's chi-square test of the generated transitions
against it (``_chi_square.py``), at significance ``SIGNIFICANCE``, with its
power to detect the deliberately biased sample (tokens drawn from the draft
model alone): when that power is below ``REQUIRED_POWER`` the sample is too
small to tell a biased verifier from an exact one and the verdict says
"inconclusive". The total-variation distances of the unigram and bigram
statistics to plain target sampling are printed too, for scale.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass, fields

import torch

from . import _backend, _chi_square
from .ops.build_tree import build_tree
from .ops.chain_verify import chain_verify
from .ops.tree_verify import tree_verify

SIGNIFICANCE = 0.01  # reject exact sampling when the chi-square p-value is below this
REQUIRED_POWER = 0.9  # "consistent" only when the test would reject the draft-alone sample this often


@dataclass
class DemoConfig:
    vocab_size: int = 128
    rank: int = 16
    sharpness: float = 2.0
    agreement: float = 0.8
    draft_length: int = 4
    tree: str = "3,2,1,1"
    batch_size: int = 256
    length: int = 256
    cost_ratio: float = 0.1
    seed: int = 0
    device: str | None = None
    backend: str = "auto"

    @classmethod
    def from_args(cls, args) -> "DemoConfig":
        return cls(**{field.name: getattr(args, field.name) for field in fields(cls) if hasattr(args, field.name)})

    @property
    def tree_widths(self) -> list[int]:
        widths = [int(width) for width in self.tree.split(",") if width.strip()]
        if not widths or any(width < 1 for width in widths):
            raise SystemExit(f"--tree must be comma-separated widths >= 1, e.g. 3,2,1,1; got {self.tree!r}")
        return widths


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = DemoConfig()
    parser.add_argument("--vocab-size", type=int, default=defaults.vocab_size, help="vocabulary of the models")
    parser.add_argument("--rank", type=int, default=defaults.rank, help="rank of the models' logit tables")
    parser.add_argument("--sharpness", type=float, default=defaults.sharpness,
                        help="scale of the logits (higher: lower entropy)")
    parser.add_argument("--agreement", type=float, default=defaults.agreement,
                        help="draft logits = agreement * target + (1 - agreement) * noise (1: identical models)")
    parser.add_argument("-k", "--draft-length", type=int, default=defaults.draft_length,
                        help="chain draft length K")
    parser.add_argument("--tree", default=defaults.tree,
                        help="children per node at each depth of the draft tree (e.g. 3,2,1,1)")
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size, help="requests decoded together")
    parser.add_argument("--length", type=int, default=defaults.length, help="tokens generated per request")
    parser.add_argument("--cost-ratio", type=float, default=defaults.cost_ratio,
                        help="cost of one draft call over one target call (c in Leviathan et al.)")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="seed of the models and of every sampler")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--backend", default=defaults.backend, choices=_backend.BACKENDS,
                        help="backend of the package's ops (auto: the fused kernels on a GPU)")


# --------------------------------------------------------------------------- models


class BigramModel:
    """Next-token distribution after token ``x``: ``softmax(logits[x])``."""

    def __init__(self, logits: torch.Tensor):
        self.logits = logits
        self.probs = torch.softmax(logits, dim=-1)

    def rows(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.probs[tokens]


def make_models(config: DemoConfig, device: torch.device) -> tuple[BigramModel, BigramModel]:
    generator = torch.Generator().manual_seed(config.seed)

    def low_rank_table():
        left = torch.randn(config.vocab_size, config.rank, generator=generator)
        right = torch.randn(config.rank, config.vocab_size, generator=generator)
        return config.sharpness * (left @ right) / math.sqrt(config.rank)

    target = low_rank_table()
    draft = config.agreement * target + (1.0 - config.agreement) * low_rank_table()
    return BigramModel(target.to(device)), BigramModel(draft.to(device))


# --------------------------------------------------------------------------- decoding loops


@dataclass
class RunStats:
    name: str
    tokens: torch.Tensor  # [B, length] generated tokens
    target_calls: int  # verification calls (steps)
    request_calls: int  # sum over requests of the calls while the request was unfinished
    emitted: int  # tokens committed while unfinished
    reached: torch.Tensor  # [positions]: attempts that got this far
    accepted: torch.Tensor  # [positions]: of those, accepted
    model_alpha_sum: float
    model_alpha_count: int
    seconds: float
    offset_end: int


def _commit(buffer, count, active, tokens, num_accepted):
    """Append ``tokens[b, :num_accepted[b] + 1]`` to the unfinished requests."""
    batch, width = tokens.shape
    slots = torch.arange(width, device=tokens.device).view(1, -1)
    keep = (slots <= num_accepted.view(-1, 1)) & active.view(-1, 1)
    rows = torch.arange(batch, device=tokens.device).view(-1, 1).expand(-1, width)
    columns = (count.view(-1, 1) + slots).clamp_max(buffer.shape[1] - 1)
    buffer[rows[keep], columns[keep]] = tokens.to(torch.int64)[keep]
    return count + torch.where(active, num_accepted + 1, 0)


def run_chain(config, target, draft, prompts, draft_generator, offset, device) -> RunStats:
    batch, length, drafts = config.batch_size, config.length, config.draft_length
    buffer = torch.full((batch, length + drafts + 1), -1, dtype=torch.int64, device=device)
    count = torch.zeros(batch, dtype=torch.int64, device=device)
    last = prompts.clone()
    reached = torch.zeros(drafts, dtype=torch.int64, device=device)
    accepted = torch.zeros(drafts, dtype=torch.int64, device=device)
    alpha_sum = torch.zeros((), dtype=torch.float64, device=device)
    alpha_count = 0
    calls = request_calls = emitted = 0
    positions = torch.arange(drafts, device=device).view(1, -1)
    _synchronize(device)
    start = time.perf_counter()
    while True:
        active = count < length
        active_count = int(active.sum())
        if active_count == 0:
            break
        draft_ids, draft_rows, previous = [], [], last
        for _ in range(drafts):
            row = draft.rows(previous)
            previous = torch.multinomial(row, 1, generator=draft_generator).squeeze(1)
            draft_ids.append(previous)
            draft_rows.append(row)
        draft_ids = torch.stack(draft_ids, 1)
        draft_probs = torch.stack(draft_rows, 1)
        target_probs = target.rows(torch.cat([last.view(-1, 1), draft_ids], 1))
        tokens, num_accepted = chain_verify(draft_ids.to(torch.int32), target_probs, draft_probs,
                                            seed=config.seed, offset=offset, backend=config.backend)
        offset += 1
        num_accepted = num_accepted.to(torch.int64)
        was_reached = (positions <= num_accepted.view(-1, 1)) & active.view(-1, 1)
        reached += was_reached.sum(0)
        accepted += ((positions < num_accepted.view(-1, 1)) & active.view(-1, 1)).sum(0)
        overlap = torch.minimum(target_probs[:, :drafts], draft_probs).sum(-1)
        alpha_sum += overlap[was_reached].double().sum()
        alpha_count += int(was_reached.sum())
        last = torch.where(active, tokens.to(torch.int64)[torch.arange(batch, device=device), num_accepted], last)
        emitted += int(torch.where(active, num_accepted + 1, 0).sum())
        count = _commit(buffer, count, active, tokens, num_accepted)
        calls += 1
        request_calls += active_count
    _synchronize(device)
    return RunStats("chain", buffer[:, :length], calls, request_calls, emitted, reached.cpu(), accepted.cpu(),
                    float(alpha_sum), alpha_count, time.perf_counter() - start, offset)


def tree_shape(widths: list[int]) -> tuple[list[int], list[list[int]]]:
    """Parents (breadth-first) and the nodes of each depth for per-depth widths."""
    parents, levels = [-1], [[0]]
    for width in widths:
        level = []
        for node in levels[-1]:
            for _ in range(width):
                parents.append(node)
                level.append(len(parents) - 1)
        levels.append(level)
    return parents, levels


def run_tree(config, target, draft, prompts, draft_generator, offset, device) -> RunStats:
    batch, length = config.batch_size, config.length
    widths = config.tree_widths
    parent_list, levels = tree_shape(widths)
    nodes, depth_max = len(parent_list), len(widths)
    parents = torch.tensor(parent_list, dtype=torch.int32, device=device).expand(batch, -1).contiguous()
    buffer = torch.full((batch, length + nodes), -1, dtype=torch.int64, device=device)
    count = torch.zeros(batch, dtype=torch.int64, device=device)
    last = prompts.clone()
    reached = torch.zeros(depth_max, dtype=torch.int64, device=device)
    accepted = torch.zeros(depth_max, dtype=torch.int64, device=device)
    depths = torch.arange(1, depth_max + 1, device=device).view(1, -1)
    calls = request_calls = emitted = 0
    _synchronize(device)
    start = time.perf_counter()
    while True:
        active = count < length
        active_count = int(active.sum())
        if active_count == 0:
            break
        tree_tokens = torch.empty((batch, nodes), dtype=torch.int64, device=device)
        tree_tokens[:, 0] = last
        for depth, width in enumerate(widths):
            level = torch.tensor(levels[depth], device=device)
            children = torch.tensor(levels[depth + 1], device=device).view(len(levels[depth]), width)
            log_q = torch.log(draft.rows(tree_tokens[:, level]))  # [B, nodes at depth, V]
            uniform = torch.rand(log_q.shape, generator=draft_generator, device=device).clamp_min_(1e-30)
            # Gumbel top-k: the top `width` keys are `width` draws without replacement, in draw order.
            drawn = torch.topk(log_q - torch.log(-torch.log(uniform)), width, dim=-1).indices
            tree_tokens[:, children.reshape(-1)] = drawn.reshape(batch, -1)
        prefix_lens = (count + 1).to(torch.int32)  # prompt token + committed tokens before the tree
        info = build_tree(parents, prefix_lens=prefix_lens, backend=config.backend)
        accepted_nodes, tokens, num_accepted = tree_verify(
            tree_tokens.to(torch.int32), parents, target.rows(tree_tokens), draft.rows(tree_tokens),
            draft_sampling="without_replacement", seed=config.seed, offset=offset, backend=config.backend)
        offset += 1
        num_accepted = num_accepted.to(torch.int64)
        # The accepted path's depths, read from build_tree, say how far each request went.
        path_depth = info.depth.to(torch.int64).gather(1, accepted_nodes.clamp_min(0).to(torch.int64))
        path_depth = torch.where(accepted_nodes >= 0, path_depth, -1).amax(1)
        # Depth d is tried when the path reached depth d - 1 (every node above the leaves has children).
        reached += ((depths <= path_depth.view(-1, 1) + 1) & active.view(-1, 1)).sum(0)
        accepted += ((depths <= path_depth.view(-1, 1)) & active.view(-1, 1)).sum(0)
        last = torch.where(active, tokens.to(torch.int64)[torch.arange(batch, device=device), num_accepted], last)
        emitted += int(torch.where(active, num_accepted + 1, 0).sum())
        count = _commit(buffer, count, active, tokens, num_accepted)
        calls += 1
        request_calls += active_count
    _synchronize(device)
    return RunStats("tree", buffer[:, :length], calls, request_calls, emitted, reached.cpu(), accepted.cpu(),
                    0.0, 0, time.perf_counter() - start, offset)


def sample_plain(model: BigramModel, prompts, length, generator) -> torch.Tensor:
    """Autoregressive sampling from ``model`` alone: ``[B, length]``."""
    tokens, previous = [], prompts
    for _ in range(length):
        previous = torch.multinomial(model.rows(previous), 1, generator=generator).squeeze(1)
        tokens.append(previous)
    return torch.stack(tokens, 1)


# --------------------------------------------------------------------------- statistics


def token_statistics(prompts: torch.Tensor, tokens: torch.Tensor, vocab_size: int):
    """Normalised unigram ``[V]`` and bigram ``[V*V]`` frequencies (pairs include prompt -> first token)."""
    unigram = torch.bincount(tokens.reshape(-1), minlength=vocab_size).double()
    sequence = torch.cat([prompts.view(-1, 1), tokens], 1)
    pairs = sequence[:, :-1] * vocab_size + sequence[:, 1:]
    bigram = torch.bincount(pairs.reshape(-1), minlength=vocab_size * vocab_size).double()
    return unigram / unigram.sum(), bigram / bigram.sum()


def total_variation(first, second) -> tuple[float, float]:
    return tuple(0.5 * float((a - b).abs().sum()) for a, b in zip(first, second))


def expected_tokens_per_call(alpha: float, draft_length: int) -> float:
    """``(1 - a^(K+1)) / (1 - a)``: Leviathan et al.'s expected tokens per target call."""
    if alpha >= 1.0:
        return draft_length + 1.0
    return (1.0 - alpha ** (draft_length + 1)) / (1.0 - alpha)


def predicted_speedup(alpha: float, draft_length: int, cost_ratio: float) -> float:
    """``(1 - a^(K+1)) / ((1 - a)(cK + 1))`` (Leviathan et al. 2023, Theorem 3.8)."""
    return expected_tokens_per_call(alpha, draft_length) / (cost_ratio * draft_length + 1.0)


def best_draft_length(alpha: float, cost_ratio: float, longest: int = 64) -> tuple[int, float]:
    """The ``K`` in ``0..longest`` with the highest predicted speedup (``K = 0``: no speculation)."""
    scores = [(predicted_speedup(alpha, k, cost_ratio), -k) for k in range(longest + 1)]
    speedup, negative_k = max(scores)
    return -negative_k, speedup


def exactness_check(prompts, samples: dict, target: BigramModel, draft: BigramModel, vocab_size: int):
    """Chi-square test of each sample's transitions against the target; ``({name: figures}, verdict, message)``.

    The verdict covers ``"chain"`` and ``"tree"``: ``"rejected"`` when a
    p-value is below ``SIGNIFICANCE``, else ``"consistent"`` when each test
    detects the draft-alone law with power at least ``REQUIRED_POWER``, else
    ``"inconclusive"``.
    """
    law, alternative = target.probs.double().cpu(), draft.probs.double().cpu()
    figures = {}
    for name, tokens in samples.items():
        counts = _chi_square.transition_counts(prompts, tokens, vocab_size)
        result, bins = _chi_square.chi_square_test(counts, law)
        figures[name] = {"statistic": result.statistic, "degrees_of_freedom": result.degrees_of_freedom,
                         "p_value": result.p_value,
                         "power": _chi_square.power_against(counts, law, alternative, bins, SIGNIFICANCE)}
    tested = [figures[name] for name in ("chain", "tree")]
    smallest_p, weakest = min(f["p_value"] for f in tested), min(f["power"] for f in tested)
    if smallest_p < SIGNIFICANCE:
        return figures, "rejected", f"NOT consistent with exact sampling (p = {smallest_p:.3g} < {SIGNIFICANCE})"
    if weakest >= REQUIRED_POWER:
        return figures, "consistent", (f"consistent with exact sampling (p >= {SIGNIFICANCE}; the test detects "
                                       f"sampling from the draft alone with power {weakest:.3f})")
    return figures, "inconclusive", (f"inconclusive: too few tokens to tell exact sampling from sampling the draft "
                                     f"alone (power {weakest:.3f} < {REQUIRED_POWER} at significance {SIGNIFICANCE}; "
                                     f"raise --batch-size or --length)")


# --------------------------------------------------------------------------- the demo


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _resolved(op_name: str, backend: str, device: torch.device) -> str:
    try:
        return _backend.resolve(op_name, backend, device)
    except RuntimeError as error:
        raise SystemExit(str(error)) from None


def run(config: DemoConfig) -> dict:
    """Run the demo, print its figures, return them as a dict."""
    device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    threads = torch.get_num_threads()
    if device.type == "cpu":
        # The demo's tensors are small ([B, V] with V ~ 100): waking OpenMP workers costs more than the
        # work (indexing a [128, 128] table: 2.6 ms with 2 threads on a busy 2-core machine, 18 us with 1).
        torch.set_num_threads(1)
    try:
        return _run(config, device)
    finally:
        torch.set_num_threads(threads)


def _run(config: DemoConfig, device: torch.device) -> dict:
    started = time.perf_counter()
    if config.vocab_size < 2 or config.batch_size < 1 or config.length < 1 or config.draft_length < 1:
        raise SystemExit("demo: need --vocab-size >= 2, --batch-size >= 1, --length >= 1, --draft-length >= 1")
    target, draft = make_models(config, device)
    backends = {op: _resolved(op, config.backend, device) for op in ("chain_verify", "build_tree", "tree_verify")}
    prompt_generator = torch.Generator(device).manual_seed(config.seed + 1)
    prompts = torch.randint(0, config.vocab_size, (config.batch_size,), generator=prompt_generator, device=device)
    draft_generator = torch.Generator(device).manual_seed(config.seed + 2)  # the draft's own sampling

    print(f"specdec_kernels demo: synthetic bigram models, V={config.vocab_size}, rank {config.rank}, "
          f"sharpness {config.sharpness}, agreement {config.agreement}, seed {config.seed}, device {device}")
    print("backends: " + ", ".join(f"{op} -> {name}" for op, name in backends.items()))

    # One offset counter for the whole run: every verification call gets fresh random numbers.
    chain = run_chain(config, target, draft, prompts, draft_generator, 0, device)
    tree = run_tree(config, target, draft, prompts, draft_generator, chain.offset_end, device)

    plain_generators = [torch.Generator(device).manual_seed(config.seed + 10 + index) for index in range(4)]
    plain = [sample_plain(target, prompts, config.length, generator) for generator in plain_generators[:3]]
    draft_only = sample_plain(draft, prompts, config.length, plain_generators[3])
    statistics_of = {name: token_statistics(prompts, tokens, config.vocab_size) for name, tokens in (
        ("chain", chain.tokens), ("tree", tree.tokens), ("plain", plain[0]), ("plain2", plain[1]),
        ("plain3", plain[2]), ("draft", draft_only))}
    reference = statistics_of["plain"]
    distances = {name: total_variation(statistics_of[name], reference)
                 for name in ("chain", "tree", "plain2", "plain3", "draft")}
    chance = tuple((a + b) / 2 for a, b in zip(distances["plain2"], distances["plain3"]))

    # ---- chain figures
    drafts = config.draft_length
    rates = (chain.accepted.double() / chain.reached.clamp_min(1).double()).tolist()
    alpha = float(chain.accepted.sum()) / max(int(chain.reached.sum()), 1)
    model_alpha = chain.model_alpha_sum / max(chain.model_alpha_count, 1)
    tokens_per_call = chain.emitted / max(chain.request_calls, 1)
    speedup = predicted_speedup(alpha, drafts, config.cost_ratio)
    best_k, best_speedup = best_draft_length(alpha, config.cost_ratio)
    generated = config.batch_size * config.length
    print(f"\nchain drafts, K = {drafts}: {config.batch_size} requests x {config.length} tokens, "
          f"{chain.target_calls} verification calls")
    print("  acceptance rate by position: " + "  ".join(f"{i + 1}: {rate:.3f}" for i, rate in enumerate(rates)))
    print(f"  acceptance rate alpha = {alpha:.3f} (the models' E[sum_v min(p, q)] over the contexts reached: "
          f"{model_alpha:.3f})")
    print(f"  mean tokens per target call: {tokens_per_call:.3f} (Leviathan et al. (1 - a^(K+1)) / (1 - a) = "
          f"{expected_tokens_per_call(alpha, drafts):.3f})")
    print(f"  predicted speedup at cost ratio c = {config.cost_ratio}: {speedup:.2f}x at K = {drafts}; "
          f"best draft length K = {best_k} ({best_speedup:.2f}x)")
    print(f"  wall time {chain.seconds:.2f} s: {1e6 * chain.seconds / generated:.1f} us per generated token "
          f"({backends['chain_verify']} backend, {device.type})")

    # ---- tree figures
    widths = config.tree_widths
    nodes = len(tree_shape(widths)[0])
    depth_rates = (tree.accepted.double() / tree.reached.clamp_min(1).double()).tolist()
    tree_tokens_per_call = tree.emitted / max(tree.request_calls, 1)
    tree_speedup = tree_tokens_per_call / (config.cost_ratio * len(widths) + 1.0)
    print(f"\ntree drafts, widths {config.tree} ({nodes} nodes, depth {len(widths)}, drawn without replacement): "
          f"{tree.target_calls} verification calls")
    print("  acceptance rate by depth: " + "  ".join(f"{i + 1}: {rate:.3f}" for i, rate in enumerate(depth_rates)))
    print(f"  mean tokens per target call: {tree_tokens_per_call:.3f}; speedup at c = {config.cost_ratio} with one "
          f"draft call per depth: {tree_speedup:.2f}x")
    print(f"  wall time {tree.seconds:.2f} s: {1e6 * tree.seconds / generated:.1f} us per generated token "
          f"({backends['tree_verify']} backend, {device.type})")

    # ---- exactness
    print(f"\nexactness: total-variation distance to plain target sampling ({generated} tokens per sample; "
          f"{config.vocab_size} unigram and {config.vocab_size ** 2} bigram cells)")
    print(f"  {'':34s} {'unigram TV':>10s} {'bigram TV':>10s}")
    for label, key in (("chain speculative vs plain", "chain"), ("tree speculative vs plain", "tree"),
                       ("plain vs plain (chance, mean of 2)", None), ("draft alone vs plain (biased)", "draft")):
        values = chance if key is None else distances[key]
        print(f"  {label:34s} {values[0]:10.4f} {values[1]:10.4f}")
    samples = {"chain": chain.tokens, "tree": tree.tokens, "draft": draft_only}
    exactness, verdict, message = exactness_check(prompts, samples, target, draft, config.vocab_size)
    print(f"  chi-square test of the transitions against the target's exact law (significance {SIGNIFICANCE}; "
          f"power: against tokens from the draft alone)")
    for label, key in (("chain speculative", "chain"), ("tree speculative", "tree"),
                       ("draft alone (biased control)", "draft")):
        result = exactness[key]
        print(f"  {label:34s} chi2 = {result['statistic']:.1f}, df = {result['degrees_of_freedom']}, "
              f"p = {result['p_value']:.3g}, power = {result['power']:.3f}")
    print(f"  verdict: {message}")
    elapsed = time.perf_counter() - started
    print(f"\ndemo finished in {elapsed:.1f} s")
    return {
        "alpha": alpha, "model_alpha": model_alpha, "acceptance_by_position": rates,
        "tokens_per_call": tokens_per_call, "predicted_speedup": speedup, "best_draft_length": best_k,
        "tree_tokens_per_call": tree_tokens_per_call, "tree_acceptance_by_depth": depth_rates,
        "tv": distances, "tv_chance": chance, "exactness": exactness, "verdict": verdict,
        "seconds": elapsed,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdec_kernels demo", description=__doc__.splitlines()[0])
    add_arguments(parser)
    run(DemoConfig.from_args(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
