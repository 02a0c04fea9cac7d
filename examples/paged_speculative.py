"""Speculative decoding over a paged KV cache: ``transformers`` models, ``specdec_kernels`` for everything else.

Run from the checkout (needs ``pip install transformers``; nothing is downloaded)::

    python examples/paged_speculative.py --mode tree --temperature 0 --check
    python examples/paged_speculative.py --mode chain --temperature 0 --check
    python examples/paged_speculative.py --mode tree --temperature 1 --tree-children sampled
    python examples/paged_speculative.py --benchmark --device cuda --dtype bfloat16 --backend triton

The loop is the one an engine runs, at toy sizes:

* **Cache.** Each layer's K/V lives in blocks of ``block_size`` positions,
  ``[num_blocks, block_size, Hkv, D]``; request ``b``'s position ``s`` is in
  block ``block_tables[b, s // block_size]``. Blocks come from a shuffled
  free list, so no request's blocks are contiguous. The cache holds every
  committed token's K/V except the last token's: that token is the next
  step's tree root, and the step writes it.
* **Attention.** Every forward, the prefill included, is a forward over a
  tree: the prompt is a chain on an empty prefix. ``sk.build_tree`` gives
  the ancestor mask and the positions; the model runs with
  ``position_ids = positions`` (so ``transformers`` applies the rotary
  embedding there) and the attention function registered below. That
  function writes the nodes' K/V into the cache at ``prefix_lens + i`` and
  calls ``sk.tree_attention``: no dense mask, and no prefix recomputed.
* **Draft.** The draft is the target cut after its first layer
  (self-speculative early exit, as in LayerSkip). Its layer is the target's
  layer 0, so it reads the target's layer-0 cache for the prefix; the K/V
  it writes at the tree's positions are overwritten by the target's
  verification forward.
* **Tree mode, a step.** The draft grows a tree level by level (its top-k
  tokens, or tokens sampled without replacement), the target scores every
  node in one forward, ``sk.tree_verify`` keeps one root-to-node path and
  samples one more token, and ``sk.compact_kv`` moves the path's K/V next to
  the prefix.
* **Chain mode, a step.** The draft proposes up to ``K`` tokens per request
  (fewer when a request needs fewer), the target scores them, and
  ``sk.chain_verify_packed`` verifies the ragged batch in vLLM's packed
  layout. The accepted tokens' K/V are already in place: no compaction.
* **Plain mode** is paged decoding without a draft, for comparison: a
  one-node tree per step, whose verification samples the target's row.

Requests have prompts of different lengths and leave the batch when done.
At temperature 0 the tokens are exactly those of ``generate(do_sample=False)``
(``--check``); at temperature > 0 they follow the target's law
(``tests/test_paged_example.py`` checks both, and that the cache holds what a
plain forward over the committed tokens writes).
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
from transformers.masking_utils import AttentionMaskInterface

import specdec_kernels as sk

MODES = ("tree", "chain", "plain")
TREE_CHILDREN = ("topk", "sampled")
PAGED_ATTENTION = "specdec_paged_tree"
LAST_LAYER_SCALE = 0.3
HEAD_DIM = 64  # the kernels' smallest head dimension; the reference takes any


@dataclass
class PagedKVCache:
    """Every layer's K/V in fixed-size blocks, ``[layers, num_blocks, block_size, Hkv, D]``."""

    keys: torch.Tensor
    values: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32

    @classmethod
    def allocate(cls, config: LlamaConfig, batch_size: int, capacity: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, seed: int) -> PagedKVCache:
        """Room for ``capacity`` positions per request, the blocks handed out from a shuffled free list."""
        blocks_per_request = math.ceil(capacity / block_size)
        num_blocks = batch_size * blocks_per_request
        free_list = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
        shape = (config.num_hidden_layers, num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        return cls(
            keys=torch.zeros(shape, dtype=dtype, device=device),
            values=torch.zeros(shape, dtype=dtype, device=device),
            block_tables=free_list.view(batch_size, blocks_per_request).to(device=device, dtype=torch.int32),
        )

    @property
    def block_size(self) -> int:
        return self.keys.shape[2]

    def locate(self, block_tables: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(block ids, slots)`` of ``positions [B, S]``, all inside the table (callers mask what they skip)."""
        columns = (positions // self.block_size).clamp(0, block_tables.shape[1] - 1)
        return block_tables.to(torch.int64).gather(1, columns), positions % self.block_size

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor, block_tables: torch.Tensor,
              start: torch.Tensor, count: torch.Tensor | None) -> None:
        """Store ``keys``/``values [B, S, Hkv, D]`` at positions ``start[b] + i`` for ``i < count[b]``."""
        index = torch.arange(keys.shape[1], device=keys.device)
        blocks, slots = self.locate(block_tables, start.to(torch.int64).view(-1, 1) + index)
        live = (index < count.view(-1, 1)) if count is not None else torch.ones_like(blocks, dtype=torch.bool)
        self.keys[layer, blocks[live], slots[live]] = keys[live]
        self.values[layer, blocks[live], slots[live]] = values[live]

    def read(self, layer: int, request: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Request ``request``'s K/V at positions ``0 .. length-1`` of ``layer``, ``[length, Hkv, D]`` each."""
        positions = torch.arange(length, device=self.keys.device).view(1, -1)
        blocks, slots = self.locate(self.block_tables[request:request + 1], positions)
        return self.keys[layer, blocks[0], slots[0]], self.values[layer, blocks[0], slots[0]]


@dataclass
class TreeForward:
    """What the attention function needs for one tree forward, handed to it through the model's kwargs."""

    cache: PagedKVCache
    block_tables: torch.Tensor  # [B, max_blocks], the batch's rows of the cache's table
    prefix_lens: torch.Tensor  # [B] int32
    tree_mask: torch.Tensor  # [B, N, ceil(N/32)], TreeInfo.mask
    num_nodes: torch.Tensor | None  # [B] int32, None: all N
    backend: str


def paged_tree_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, *,
                         tree_forward: TreeForward, **kwargs):
    """``transformers`` attention function: cache the nodes' K/V, then ``sk.tree_attention`` over the cache.

    ``query [B, Hq, N, D]`` and ``key``/``value [B, Hkv, N, D]`` arrive with
    the rotary embedding applied; the output is ``[B, N, Hq, D]``, the
    layout ``transformers`` expects back.
    """
    step = tree_forward
    layer = module.layer_idx
    step.cache.write(layer, key.transpose(1, 2), value.transpose(1, 2), step.block_tables, step.prefix_lens,
                     step.num_nodes)
    output = sk.tree_attention(query.transpose(1, 2), step.cache.keys[layer], step.cache.values[layer],
                               step.block_tables, step.prefix_lens, step.tree_mask, num_nodes=step.num_nodes,
                               scale=scaling, backend=step.backend)
    return output, None


AttentionInterface.register(PAGED_ATTENTION, paged_tree_attention)
# tree_attention applies the tree mask itself: transformers builds none.
AttentionMaskInterface.register(PAGED_ATTENTION, lambda *args, **kwargs: None)


def make_models(vocab_size: int = 64, seed: int = 0, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """A random 2-layer Llama target and its first layer as the draft, in eval mode, on the paged attention.

    ``initializer_range=0.2`` (HF's default is 0.02) makes the next-token
    distributions peaked instead of nearly uniform, and the second layer's
    output projections are scaled by ``LAST_LAYER_SCALE`` so that it refines
    the first layer's prediction rather than replacing it: the draft is then
    a usable one that still differs enough for a wrong verifier to show. No
    bos/eos/pad ids: ``generate`` never stops early.
    """

    def config(num_layers: int) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
            num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM, max_position_embeddings=512,
            initializer_range=0.2, tie_word_embeddings=False,
            bos_token_id=None, eos_token_id=None, pad_token_id=None,
        )

    torch.manual_seed(seed)
    target = LlamaForCausalLM(config(2)).eval()
    with torch.no_grad():
        last_layer = target.model.layers[1]
        last_layer.self_attn.o_proj.weight.mul_(LAST_LAYER_SCALE)
        last_layer.mlp.down_proj.weight.mul_(LAST_LAYER_SCALE)
    draft = LlamaForCausalLM(config(1)).eval()
    draft.load_state_dict({name: value for name, value in target.state_dict().items() if ".layers.1." not in name})
    for model in (target, draft):
        model.to(device=device, dtype=dtype).set_attn_implementation(PAGED_ATTENTION)
    return target, draft


def with_standard_attention(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """A copy of ``model`` on ``transformers``' own attention and cache (for ``generate`` and the tests)."""
    plain = copy.deepcopy(model)
    plain.set_attn_implementation("sdpa")
    return plain


@torch.inference_mode()
def forward_tree(model, cache: PagedKVCache, block_tables, prefix_lens, node_tokens, parents, num_nodes=None,
                 backend="auto") -> torch.Tensor:
    """Logits of the token after each tree node, ``[B, N, V]``; writes the nodes' K/V into ``cache``.

    Request ``b``'s nodes go to positions ``prefix_lens[b] + i`` and see the
    cached prefix and their ancestors. Padding nodes (``i >= num_nodes[b]``)
    need any valid token id; their rows are garbage.
    """
    tree = sk.build_tree(parents, num_nodes=num_nodes, prefix_lens=prefix_lens, backend=backend)
    step = TreeForward(cache, block_tables, prefix_lens, tree.mask, num_nodes, backend)
    # Padding nodes have depth -1: any position will do, a negative one is avoided.
    output = model(input_ids=node_tokens, position_ids=tree.positions.clamp(min=0), tree_forward=step,
                   use_cache=False)
    return output.logits


def chain_parents(batch_size: int, length: int, device) -> torch.Tensor:
    return torch.arange(-1, length - 1, dtype=torch.int32, device=device).expand(batch_size, -1)


def tree_parents(branching: int, depth: int) -> list[int]:
    """Parents of a full tree in breadth-first order: every node of depth ``< depth`` has ``branching`` children.

    Breadth-first order keeps the nodes of depth ``<= d`` a prefix of the
    list (the draft grows the tree level by level) and the children of a
    node contiguous, in the order they were proposed.
    """
    parents, level = [-1], [0]
    for _ in range(depth):
        children = []
        for node in level:
            for _ in range(branching):
                parents.append(node)
                children.append(len(parents) - 1)
        level = children
    return parents


def verifier_rows(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """What the verifiers take: float32 logits at ``T = 0`` (greedy, decided on the logits), else probabilities."""
    if temperature == 0:
        return logits.to(torch.float32)
    return torch.softmax(logits.to(torch.float32) / temperature, dim=-1)


@dataclass
class Stats:
    steps: int = 0  # target forwards (each over the unfinished requests)
    request_steps: int = 0  # sum over steps of the unfinished requests
    accepted: int = 0  # draft tokens accepted
    emitted: int = 0  # tokens committed: accepted drafts plus one token of the target's per request step

    @property
    def tokens_per_step(self) -> float:
        return self.emitted / max(self.request_steps, 1)

    def __str__(self) -> str:
        return (f"{self.steps} target forwards, {self.accepted / max(self.request_steps, 1):.2f} drafts accepted "
                f"and {self.tokens_per_step:.2f} tokens committed per request and step")


class PagedSpeculativeDecoder:
    """The decoding loop's state: committed tokens, the paged cache, and how each step drafts and verifies.

    Parameters
    ----------
    target, draft : models from :func:`make_models` (on the paged attention)
    prompts : list of 1-D int64 tensors, one per request (any lengths >= 1)
    max_new_tokens : int
    mode : {"tree", "chain", "plain"}
    temperature : float
        ``0``: greedy (the tokens of ``generate(do_sample=False)``); else the
        law of sampling from ``softmax(target_logits / T)``.
    num_draft_tokens : int
        Chain mode: the most draft tokens a request proposes, ``K``.
    branching, depth : int
        Tree mode: ``branching`` children per node down to ``depth``.
    tree_children : {"topk", "sampled"}
        Tree children: the draft's top-k tokens (verified as deterministic
        candidates), or drawn without replacement (verified with the draft's
        rows). At ``T = 0`` both are the top-k.
    seed : int
        Seeds the block shuffle, the draft's sampler and the verifiers; step
        ``s`` verifies with ``offset=s``, so no two steps share random numbers.
    backend : str
        Backend of every package op (``"triton"`` on a CPU needs
        ``TRITON_INTERPRET=1``; its ``tree_attention`` takes float16 or
        bfloat16 models).
    """

    def __init__(self, target, draft, prompts: list[torch.Tensor], max_new_tokens: int, *, mode: str = "tree",
                 temperature: float = 0.0, num_draft_tokens: int = 3, branching: int = 2, depth: int = 2,
                 tree_children: str = "topk", seed: int = 0, backend: str = "auto", block_size: int = 16):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}; got {mode!r}")
        if tree_children not in TREE_CHILDREN:
            raise ValueError(f"tree_children must be one of {TREE_CHILDREN}; got {tree_children!r}")
        self.target, self.draft = target, draft
        self.mode, self.temperature, self.backend, self.seed = mode, temperature, backend, seed
        # Plain decoding is the one-node tree: depth 0, no draft forward.
        self.num_draft_tokens, self.branching = num_draft_tokens, branching
        self.depth = depth if mode == "tree" else 0
        self.sampled = tree_children == "sampled" and temperature > 0
        self.device = target.device
        self.parents = torch.tensor(tree_parents(branching, self.depth), dtype=torch.int32, device=self.device)
        self.draft_generator = torch.Generator(self.device).manual_seed(seed)
        self.stats = Stats()

        self.prompt_lens = torch.tensor([len(p) for p in prompts], device=self.device)
        self.max_new_tokens = max_new_tokens
        nodes_per_step = num_draft_tokens + 1 if mode == "chain" else self.parents.numel()
        width = int(self.prompt_lens.max()) + max_new_tokens + nodes_per_step
        self.sequences = torch.zeros(len(prompts), width, dtype=torch.int64, device=self.device)
        for request, prompt in enumerate(prompts):
            self.sequences[request, :len(prompt)] = prompt
        self.lengths = self.prompt_lens.clone()
        self.cache = PagedKVCache.allocate(target.config, len(prompts), width, block_size, target.dtype,
                                           self.device, seed)
        self._prefill()

    def _prefill(self) -> None:
        """Every prompt as a chain on an empty prefix, in one forward (its logits are not needed)."""
        batch_size, longest = len(self.prompt_lens), int(self.prompt_lens.max())
        forward_tree(self.target, self.cache, self.cache.block_tables,
                     torch.zeros(batch_size, dtype=torch.int32, device=self.device), self.sequences[:, :longest],
                     chain_parents(batch_size, longest, self.device), self.prompt_lens.to(torch.int32),
                     self.backend)

    @property
    def finished(self) -> bool:
        return bool((self.lengths >= self.prompt_lens + self.max_new_tokens).all())

    def generated(self) -> torch.Tensor:
        """``[B, max_new_tokens]``: each request's first ``max_new_tokens`` generated tokens (once finished)."""
        columns = self.prompt_lens.view(-1, 1) + torch.arange(self.max_new_tokens, device=self.device)
        return self.sequences.gather(1, columns)

    def step(self) -> None:
        """One draft-and-verify step of every unfinished request."""
        active = (self.lengths < self.prompt_lens + self.max_new_tokens).nonzero().flatten()
        tables = self.cache.block_tables[active]
        lengths = self.lengths[active]
        prefix_lens = (lengths - 1).to(torch.int32)  # the last committed token is the root, written this step
        roots = self.sequences[active].gather(1, (lengths - 1).view(-1, 1))
        if self.mode == "chain":
            remaining = self.prompt_lens[active] + self.max_new_tokens - lengths
            output, num_accepted = self._chain_step(tables, prefix_lens, roots, remaining)
        else:
            output, num_accepted = self._tree_step(tables, prefix_lens, roots)
        committed = num_accepted.to(torch.int64) + 1
        rows, columns = (torch.arange(output.shape[1], device=self.device) < committed.view(-1, 1)).nonzero(
            as_tuple=True)
        self.sequences[active[rows], lengths[rows] + columns] = output[rows, columns].to(torch.int64)
        self.lengths[active] += committed
        self.stats.steps += 1
        self.stats.request_steps += active.numel()
        self.stats.accepted += int(num_accepted.sum())
        self.stats.emitted += int(committed.sum())

    def _draft_tree(self, tables, prefix_lens, roots):
        """The draft's tree, one draft forward per level: ``(node_tokens [B, N], draft_probs or None)``.

        ``draft_probs [B, N, V]`` holds the distribution each node's children
        were drawn from (zero rows at the leaves) when children are sampled:
        without replacement, by the Gumbel top-k trick, in the order drawn.
        """
        batch_size = roots.shape[0]
        nodes, rows, level_start = roots, [], 0
        for _ in range(self.depth):
            level_end = nodes.shape[1]
            logits = forward_tree(self.draft, self.cache, tables, prefix_lens, nodes,
                                  self.parents[:level_end].expand(batch_size, -1), backend=self.backend)
            logits = logits[:, level_start:].to(torch.float32)
            if self.sampled:
                probs = verifier_rows(logits, self.temperature)
                rows.append(probs)
                exponential = torch.empty(probs.shape, dtype=torch.float64, device=self.device).exponential_(
                    generator=self.draft_generator)
                children = (probs.double().log() - exponential.log()).topk(self.branching, dim=-1).indices
            else:
                children = logits.topk(self.branching, dim=-1).indices
            nodes = torch.cat([nodes, children.flatten(1)], dim=1)
            level_start = level_end
        if not self.sampled or not rows:
            return nodes, None
        leaves = torch.zeros(batch_size, nodes.shape[1] - level_start, rows[0].shape[-1], device=self.device)
        return nodes, torch.cat([*rows, leaves], dim=1)

    def _tree_step(self, tables, prefix_lens, roots):
        nodes, draft_probs = self._draft_tree(tables, prefix_lens, roots)
        parents = self.parents.expand(nodes.shape[0], -1)
        logits = forward_tree(self.target, self.cache, tables, prefix_lens, nodes, parents, backend=self.backend)
        accepted_nodes, output, num_accepted = sk.tree_verify(
            nodes, parents, verifier_rows(logits, self.temperature), draft_probs, temperature=self.temperature,
            logits=self.temperature == 0, draft_sampling="without_replacement", seed=self.seed,
            offset=self.stats.steps, backend=self.backend)
        if self.depth > 0:  # a one-node tree (plain decoding) has nothing to move
            for layer in range(self.cache.keys.shape[0]):
                sk.compact_kv(self.cache.keys[layer], self.cache.values[layer], tables, prefix_lens,
                              accepted_nodes, backend=self.backend)
        return output, num_accepted

    def _chain_step(self, tables, prefix_lens, roots, remaining):
        """Up to ``K`` drafts per request (``remaining - 1`` near the end), verified as one packed batch."""
        batch_size, longest = roots.shape[0], self.num_draft_tokens
        num_drafts = (remaining - 1).clamp(0, longest)
        nodes, rows = roots, []
        for _ in range(longest):
            logits = forward_tree(self.draft, self.cache, tables, prefix_lens, nodes,
                                  chain_parents(batch_size, nodes.shape[1], self.device),
                                  backend=self.backend)[:, -1].to(torch.float32)
            if self.temperature == 0:
                token = logits.argmax(-1, keepdim=True)
            else:
                rows.append(verifier_rows(logits, self.temperature))
                token = torch.multinomial(rows[-1], 1, generator=self.draft_generator)
            nodes = torch.cat([nodes, token], dim=1)
        scored = (num_drafts + 1).to(torch.int32)
        logits = forward_tree(self.target, self.cache, tables, prefix_lens, nodes,
                              chain_parents(batch_size, longest + 1, self.device), scored, backend=self.backend)
        # The packed layout: request b's n_b drafts, and its n_b + 1 target rows (drafts, then bonus).
        position = torch.arange(longest + 1, device=self.device)
        is_draft, is_scored = position[:longest] < num_drafts.view(-1, 1), position < scored.view(-1, 1)
        cu_num_draft_tokens = torch.nn.functional.pad(num_drafts.cumsum(0), (1, 0)).to(torch.int32)
        draft_probs = torch.stack(rows, dim=1)[is_draft] if rows else None
        return sk.chain_verify_packed(
            nodes[:, 1:][is_draft], cu_num_draft_tokens, verifier_rows(logits, self.temperature)[is_scored],
            draft_probs, max_num_draft_tokens=longest, temperature=self.temperature,
            logits=self.temperature == 0, seed=self.seed, offset=self.stats.steps, backend=self.backend)


def speculative_generate(target, draft, prompts: list[torch.Tensor], max_new_tokens: int, **options):
    """Run :class:`PagedSpeculativeDecoder` to the end: ``(tokens [B, max_new_tokens], stats)``."""
    decoder = PagedSpeculativeDecoder(target, draft, prompts, max_new_tokens, **options)
    while not decoder.finished:
        decoder.step()
    return decoder.generated(), decoder.stats


@torch.inference_mode()
def generate_plainly(model, prompts: list[torch.Tensor], max_new_tokens: int) -> torch.Tensor:
    """``generate(do_sample=False)`` of each prompt alone (no padding), ``[B, max_new_tokens]``."""
    plain = with_standard_attention(model)
    return torch.stack([
        plain.generate(prompt.view(1, -1), attention_mask=torch.ones(1, len(prompt), device=prompt.device),
                       do_sample=False, max_new_tokens=max_new_tokens)[0, len(prompt):]
        for prompt in prompts
    ])


def make_prompts(batch_size: int, shortest: int, vocab_size: int, seed: int, device) -> list[torch.Tensor]:
    """``batch_size`` random prompts of lengths ``shortest, shortest + 3, ...``."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(vocab_size, (shortest + 3 * b,), generator=generator).to(device)
            for b in range(batch_size)]


def _timed(function):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = function()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return result, time.perf_counter() - start


def benchmark(target, draft, prompts, max_new_tokens: int, options: dict) -> dict[str, float]:
    """Tokens per second of the chosen mode, of plain paged decoding on the same cache, and of ``generate``.

    Each is run once to warm up (JIT compiles, the allocator) and timed on
    the second run. A toy draft on toy models says little about real ones:
    this shows the loop's overheads, not a speedup to expect.
    """
    total = len(prompts) * max_new_tokens
    runs = {
        f"{options['mode']} speculative": lambda: speculative_generate(target, draft, prompts, max_new_tokens,
                                                                     **options),
        "plain paged decoding": lambda: speculative_generate(target, draft, prompts, max_new_tokens,
                                                             **{**options, "mode": "plain"}),
        "transformers generate": lambda: generate_plainly(target, prompts, max_new_tokens),
    }
    rates = {}
    for name, run in runs.items():
        run()
        _, seconds = _timed(run)
        rates[name] = total / seconds
    return rates


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=MODES, default="tree")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--batch-size", type=int, default=3, help="prompts of lengths 4, 7, 10, ...")
    parser.add_argument("-k", "--num-draft-tokens", type=int, default=3, help="chain: the most drafts a step")
    parser.add_argument("--branching", type=int, default=2, help="tree: children per node")
    parser.add_argument("--depth", type=int, default=2, help="tree: levels below the root")
    parser.add_argument("--tree-children", choices=TREE_CHILDREN, default="topk")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", default="auto", choices=("auto", "reference", "triton", "cuda"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--check", action="store_true",
                        help="temperature 0 only: exit 0 iff the tokens equal generate(do_sample=False)")
    parser.add_argument("--benchmark", action="store_true", help="tokens/s against plain decoding and generate")
    args = parser.parse_args(argv)
    if args.check and args.temperature != 0:
        parser.error("--check compares with greedy generate: it needs --temperature 0")

    target, draft = make_models(seed=args.seed, dtype=getattr(torch, args.dtype), device=args.device)
    prompts = make_prompts(args.batch_size, 4, target.config.vocab_size, args.seed, target.device)
    options = dict(mode=args.mode, temperature=args.temperature, num_draft_tokens=args.num_draft_tokens,
                   branching=args.branching, depth=args.depth, tree_children=args.tree_children, seed=args.seed,
                   backend=args.backend, block_size=args.block_size)
    tokens, stats = speculative_generate(target, draft, prompts, args.max_new_tokens, **options)
    if args.benchmark:
        for name, rate in benchmark(target, draft, prompts, args.max_new_tokens, options).items():
            print(f"benchmark: {name}: {rate:.1f} tokens/s")
    if args.check:
        same = torch.equal(tokens, generate_plainly(target, prompts, args.max_new_tokens))
        print(f"{args.mode}: tokens {'equal' if same else 'DIFFER FROM'} generate(do_sample=False) for "
              f"{len(prompts)} prompts; {stats}")
        return 0 if same else 1
    for request, prompt in enumerate(prompts):
        print(f"request {request}: prompt {prompt.tolist()} -> {tokens[request].tolist()}")
    print(f"{args.mode}, T = {args.temperature}: {stats}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
