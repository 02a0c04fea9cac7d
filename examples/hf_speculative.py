"""Speculative generation with Hugging Face ``transformers`` models, verified by ``specdec_kernels``.

Run from the checkout (needs ``pip install transformers``; nothing is downloaded)::

    python examples/hf_speculative.py --mode chain --temperature 0
    python examples/hf_speculative.py --mode tree --temperature 1 --tree-children sampled

The models are built from small configs with random weights: the target is
a 2-layer Llama; the draft is the same model cut after its first layer
(self-speculative "early exit" drafting, as in LayerSkip), so the two agree
often enough for drafts to be accepted. Both run in float64: a forward
over a draft tree and ``generate``'s cached decoding add up the same terms
in different orders; their logits differed by up to 2.4e-6 in float32
and not at all in float64 (4 requests, 5 positions), so in float64 no
near-tie can give them different argmaxes at temperature 0.

A step of generation:

* chain: the draft proposes ``K`` tokens one after another (sampled from
  ``softmax(logits / T)``, the argmax at ``T = 0``), the target scores the
  last committed token and the ``K`` drafts in one forward, and
  ``sk.chain_verify`` keeps a prefix of the drafts and adds one token of the
  target's;
* tree: the draft grows a tree level by level, each node getting
  ``branching`` children (its top-k tokens, or tokens sampled without
  replacement), ``sk.build_tree`` gives the ancestor mask and positions,
  the target scores every node in one forward, and ``sk.tree_verify``
  keeps one root-to-node path and adds one token of the target's.

The output has exactly the law of sampling from the target token by token
(``tests/test_hf_example.py`` checks it, and that at ``T = 0`` the tokens are
those of ``target.generate``). Every model call recomputes the whole
sequence without a KV cache: the models are tiny and the code stays short.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import specdec_kernels as sk

TREE_CHILDREN = ("topk", "sampled")
LAST_LAYER_SCALE = 0.3


def make_models(vocab_size: int = 64, seed: int = 0) -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """A random 2-layer Llama target and its first layer as the draft, float64, in eval mode.

    ``initializer_range=0.2`` (HF's default is 0.02) makes the next-token
    distributions peaked (entropy about 3 nats, of ln 64 = 4.2 at V = 64)
    instead of nearly uniform. The second layer's output projections are
    scaled by ``LAST_LAYER_SCALE`` so that it refines the first layer's
    prediction rather than replacing it: the draft's distribution then
    overlaps the target's by ``sum(min(p, q))`` = 0.83 on average and
    their argmaxes agree 65% of the time (0.57 and 28% unscaled), a usable
    draft that still differs enough for a wrong verifier to be visible.
    No bos/eos/pad ids: ``generate`` then never stops early.
    """

    def config(num_layers: int) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            initializer_range=0.2, tie_word_embeddings=False,
            bos_token_id=None, eos_token_id=None, pad_token_id=None,
        )

    torch.manual_seed(seed)
    target = LlamaForCausalLM(config(2)).double().eval()
    with torch.no_grad():
        last_layer = target.model.layers[1]
        last_layer.self_attn.o_proj.weight.mul_(LAST_LAYER_SCALE)
        last_layer.mlp.down_proj.weight.mul_(LAST_LAYER_SCALE)
    draft = LlamaForCausalLM(config(1)).double().eval()
    draft.load_state_dict({name: value for name, value in target.state_dict().items() if ".layers.1." not in name})
    return target, draft


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


@torch.inference_mode()
def score(model, sequences: torch.Tensor, lengths: torch.Tensor, node_tokens: torch.Tensor,
          parents: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """Logits of the token after each tree node, in one forward over prefix and tree.

    Request ``b``'s committed tokens are ``sequences[b, :lengths[b]]``; the
    last of them is the tree's root (node 0), so ``node_tokens[:, 0]`` must
    equal it. A chain is the tree whose parents are ``-1, 0, 1, ...``.

    The input is each request's prefix (all but the last committed token),
    right-padded to the longest, then its tree nodes. The 4D additive mask
    lets a prefix token see the prefix tokens up to itself and a node see
    the whole prefix and its ancestors in the tree (``sk.build_tree``'s
    mask); padding slots see only themselves, so no row is fully masked.
    Positions (for the rotary embedding) are ``prefix_len + depth`` for the
    nodes. ``transformers`` passes a 4D ``attention_mask`` to the attention
    as it is, together with explicit ``position_ids``. ``backend`` is that
    of ``sk.build_tree``.

    Shape
    -----
    ``sequences [B, S]``, ``lengths [B]``, ``node_tokens [B, N]``,
    ``parents [B, N]`` -> ``[B, N, V]``.
    """
    batch_size, num_nodes = node_tokens.shape
    prefix_lens = lengths - 1
    width = int(prefix_lens.max())
    slot = torch.arange(width)
    prefix_valid = slot.view(1, -1) < prefix_lens.view(-1, 1)  # [B, W]
    prefix_rows = (slot.view(-1, 1) >= slot.view(1, -1)) & prefix_valid.view(batch_size, 1, width)
    prefix_rows |= torch.eye(width, dtype=torch.bool)
    info = sk.build_tree(parents, prefix_lens=prefix_lens, backend=backend)
    node_rows = torch.cat([prefix_valid.view(batch_size, 1, width).expand(-1, num_nodes, -1),
                           sk.tree_mask_dense(info.mask)], dim=2)
    prefix_rows = torch.cat([prefix_rows, torch.zeros(batch_size, width, num_nodes, dtype=torch.bool)], dim=2)
    allowed = torch.cat([prefix_rows, node_rows], dim=1)  # [B, W + N, W + N]
    # Additive (0 / most negative), not boolean: Llama's eager attention adds the mask to the scores.
    mask = torch.zeros(allowed.shape, dtype=model.dtype).masked_fill_(~allowed, torch.finfo(model.dtype).min)
    output = model(
        input_ids=torch.cat([sequences[:, :width], node_tokens], dim=1),
        attention_mask=mask.unsqueeze(1),
        position_ids=torch.cat([slot.expand(batch_size, -1), info.positions], dim=1),
        use_cache=False,
    )
    return output.logits[:, width:]


def _distribution(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """What the verifiers take: float32 logits at ``T = 0`` (greedy, decided on the logits), else probabilities."""
    if temperature == 0:
        return logits.to(torch.float32)
    return torch.softmax(logits / temperature, dim=-1).to(torch.float32)


def draft_chain(draft, sequences, lengths, num_draft_tokens: int, temperature: float, generator, backend: str):
    """``K`` draft tokens per request, proposed one after another.

    Returns ``(nodes [B, K+1], draft_probs [B, K, V])``: the last committed
    token then the drafts (the chain the target scores), and the
    distributions the drafts were sampled from (``None`` at ``T = 0``:
    argmax proposals are deterministic).
    """
    nodes, rows = sequences.gather(1, (lengths - 1).view(-1, 1)), []
    for _ in range(num_draft_tokens):
        parents = torch.arange(-1, nodes.shape[1] - 1).expand(nodes.shape[0], -1)
        logits = score(draft, sequences, lengths, nodes, parents, backend)[:, -1]
        if temperature == 0:
            token = logits.argmax(-1, keepdim=True)
        else:
            rows.append(_distribution(logits, temperature))
            token = torch.multinomial(rows[-1], 1, generator=generator)
        nodes = torch.cat([nodes, token], dim=1)
    return nodes, (torch.stack(rows, dim=1) if rows else None)


def draft_tree(draft, sequences, lengths, branching: int, depth: int, temperature: float, sampled: bool,
               generator, backend: str):
    """A full draft tree, grown level by level with one draft forward per level.

    Each node's children are its ``branching`` most likely tokens, or with
    ``sampled`` (``T > 0``) tokens drawn without replacement from
    ``softmax(logits / T)`` by the Gumbel top-k trick, in the order drawn.

    Returns ``(node_tokens [B, N], parents [B, N], draft_probs)``;
    ``draft_probs [B, N, V]`` holds the distribution each node's children
    were drawn from (zero rows at the leaves) when ``sampled``, else
    ``None`` (deterministic candidates).
    """
    batch_size = sequences.shape[0]
    all_parents = torch.tensor(tree_parents(branching, depth)).expand(batch_size, -1)
    nodes = sequences.gather(1, (lengths - 1).view(-1, 1))
    rows, level_start = [], 0
    for _ in range(depth):
        level_end = nodes.shape[1]
        logits = score(draft, sequences, lengths, nodes, all_parents[:, :level_end], backend)[:, level_start:]
        if sampled:
            probs = _distribution(logits, temperature)
            rows.append(probs)
            gumbel = -torch.empty(probs.shape, dtype=torch.float64).exponential_(generator=generator).log()
            children = (probs.double().log() + gumbel).topk(branching, dim=-1).indices
        else:
            children = logits.topk(branching, dim=-1).indices
        nodes = torch.cat([nodes, children.flatten(1)], dim=1)
        level_start = level_end
    draft_probs = None
    if sampled:
        leaves = torch.zeros(batch_size, nodes.shape[1] - level_start, rows[0].shape[-1])
        draft_probs = torch.cat([*rows, leaves], dim=1)
    return nodes, all_parents, draft_probs


@dataclass
class Stats:
    steps: int = 0  # target forwards (each over the unfinished requests)
    request_steps: int = 0  # sum over steps of the unfinished requests
    accepted: int = 0  # draft tokens accepted in unfinished requests
    emitted: int = 0  # tokens committed: accepted drafts plus one token of the target's per request step

    def __str__(self) -> str:
        return (f"{self.steps} target forwards, {self.accepted / self.request_steps:.2f} drafts accepted and "
                f"{self.emitted / self.request_steps:.2f} tokens committed per request and forward")


def speculative_generate(target, draft, prompts: torch.Tensor, max_new_tokens: int, *, mode: str = "chain",
                         temperature: float = 0.0, num_draft_tokens: int = 3, branching: int = 2, depth: int = 2,
                         tree_children: str = "topk", seed: int = 0, backend: str = "auto"):
    """Generate ``max_new_tokens`` tokens after each prompt by speculative decoding.

    Parameters
    ----------
    target, draft : transformers causal LMs with the same vocabulary
    prompts : Tensor, int64
        One prompt per request (the same length for all).
    max_new_tokens : int
    mode : {"chain", "tree"}
    temperature : float
        ``0``: greedy (the tokens of ``target.generate(do_sample=False)``);
        else the law of sampling from ``softmax(target_logits / T)``.
    num_draft_tokens : int
        Chain draft length ``K``.
    branching, depth : int
        Tree shape: ``branching`` children per node down to ``depth``.
    tree_children : {"topk", "sampled"}
        Tree children: the draft's top-k tokens (verified as deterministic
        candidates), or drawn without replacement (verified with the draft's
        rows). At ``T = 0`` both are the top-k.
    seed : int
        Seeds the draft's sampler and the verifiers; step ``s`` of the loop
        uses ``offset=s``, so no two verifications share random numbers.
    backend : str
        Backend of every package op called (``"auto"``: the reference on
        CPU; ``"triton"`` on CPU needs ``TRITON_INTERPRET=1``).

    Returns
    -------
    tokens : Tensor, int64 ``[B, max_new_tokens]``
    stats : Stats

    Shape
    -----
    ``prompts [B, P]`` -> ``tokens [B, max_new_tokens]``.
    """
    if mode not in ("chain", "tree"):
        raise ValueError(f"mode must be 'chain' or 'tree'; got {mode!r}")
    if tree_children not in TREE_CHILDREN:
        raise ValueError(f"tree_children must be one of {TREE_CHILDREN}; got {tree_children!r}")
    batch_size, prompt_len = prompts.shape
    tokens_per_step = num_draft_tokens + 1 if mode == "chain" else depth + 1
    sequences = torch.zeros(batch_size, prompt_len + max_new_tokens + tokens_per_step, dtype=torch.int64)
    sequences[:, :prompt_len] = prompts
    lengths = torch.full((batch_size,), prompt_len)
    generator = torch.Generator().manual_seed(seed)
    sampled = tree_children == "sampled" and temperature > 0
    stats = Stats()
    # Each step runs on the unfinished requests only. Their index in the
    # verifier's batch changes from step to step; with one int seed every
    # request still gets its own random numbers, and `offset` differs per step.
    while (active := (lengths < prompt_len + max_new_tokens).nonzero().flatten()).numel():
        step_sequences, step_lengths = sequences[active], lengths[active]
        if mode == "chain":
            nodes, draft_probs = draft_chain(draft, step_sequences, step_lengths, num_draft_tokens, temperature,
                                             generator, backend)
            parents = torch.arange(-1, num_draft_tokens).expand(active.numel(), -1)
            target_rows = _distribution(score(target, step_sequences, step_lengths, nodes, parents, backend),
                                        temperature)
            output, num_accepted = sk.chain_verify(
                nodes[:, 1:], target_rows, draft_probs, temperature=temperature, logits=temperature == 0,
                seed=seed, offset=stats.steps, backend=backend)
        else:
            nodes, parents, draft_probs = draft_tree(draft, step_sequences, step_lengths, branching, depth,
                                                     temperature, sampled, generator, backend)
            target_rows = _distribution(score(target, step_sequences, step_lengths, nodes, parents, backend),
                                        temperature)
            _, output, num_accepted = sk.tree_verify(
                nodes, parents, target_rows, draft_probs, temperature=temperature, logits=temperature == 0,
                draft_sampling="without_replacement", seed=seed, offset=stats.steps, backend=backend)
        committed = num_accepted.to(torch.int64) + 1
        rows, columns = (torch.arange(output.shape[1]).view(1, -1) < committed.view(-1, 1)).nonzero(as_tuple=True)
        sequences[active[rows], step_lengths[rows] + columns] = output[rows, columns].to(torch.int64)
        lengths[active] += committed
        stats.steps += 1
        stats.request_steps += active.numel()
        stats.accepted += int(num_accepted.sum())
        stats.emitted += int(committed.sum())
    return sequences[:, prompt_len:prompt_len + max_new_tokens], stats


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("chain", "tree"), default="chain")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=5)
    parser.add_argument("-k", "--num-draft-tokens", type=int, default=3, help="chain draft length")
    parser.add_argument("--branching", type=int, default=2, help="tree: children per node")
    parser.add_argument("--depth", type=int, default=2, help="tree: levels below the root")
    parser.add_argument("--tree-children", choices=TREE_CHILDREN, default="topk")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", default="auto", choices=("auto", "reference", "triton", "cuda"))
    args = parser.parse_args(argv)

    target, draft = make_models(seed=args.seed)
    prompts = torch.randint(target.config.vocab_size, (args.batch_size, args.prompt_len),
                            generator=torch.Generator().manual_seed(args.seed))
    tokens, stats = speculative_generate(
        target, draft, prompts, args.max_new_tokens, mode=args.mode, temperature=args.temperature,
        num_draft_tokens=args.num_draft_tokens, branching=args.branching, depth=args.depth,
        tree_children=args.tree_children, seed=args.seed, backend=args.backend)
    for request in range(args.batch_size):
        print(f"request {request}: prompt {prompts[request].tolist()} -> {tokens[request].tolist()}")
    print(f"{args.mode}, T = {args.temperature}: {stats}")
    if args.temperature == 0:
        with torch.inference_mode():
            plain = target.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                                    max_new_tokens=args.max_new_tokens)[:, args.prompt_len:]
        print("same tokens as target.generate(do_sample=False):", bool(torch.equal(plain, tokens)))


if __name__ == "__main__":
    main()
