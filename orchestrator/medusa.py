"""Medusa decoding: the target's own heads draft a candidate tree, verified in one forward.

Reference: Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple
Decoding Heads" (arXiv:2401.10774); lossless tree sampling as in SpecInfer (Miao et al. 2023,
"SpecInfer: Accelerating Generative LLM Serving with Tree-based Speculative Inference and
Verification", arXiv:2305.09781), multi-draft speculative sampling with one-hot drafts.

A round is ONE message to the target service: keep the last round's accepted path
(`tree_keep`, its KV compacted), append the new tree — its root is the token the last round
decided, its other nodes the heads' top-k along `medusa_choices` (`tree_topk`), which the
service fills in by applying its heads to the hidden state it kept at the accepted path's end
(one row, not every node) — and score every node. Greedy and lossless rounds are decided in the
service (`Verify` with the tree; the reply carries the tree's ids and the verdict), several to a
message (`tree_rounds`, doubling from 1 like `standard`'s multi-step rounds, so a round trip
buys about `max_tokens_per_round` tokens); typical acceptance needs the distribution at every
node and decides here with the pure functions below. No draft service is involved.

Acceptance rules, all over the same tree (node 0 the root; children tried in node order):
- greedy (`specwire.acceptance.accept_tree_greedy`): follow the child equal to the target's
  argmax; output = target-only greedy, exactly;
- typical (Medusa-2, LOSSY): accept while p(x) > min(ε, δ·exp(−H(p)));
- lossless sampling (`specwire.acceptance.accept_tree_sampled`): the target's distribution
  exactly; decided in the target service (`Verify` with the tree), so p stays there.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

import torch
from specwire.orchestrator.context import DecodeContext
from specwire.orchestrator.params import parse_medusa_choices
from specwire.orchestrator.sampling import choose

from specwire.acceptance import accept_tree_greedy, accept_tree_sampled
from specwire.errors import FailedPrecondition
from specwire.medusa import TreeLayout, build_tree, tree_children, tree_path
from specwire.processing import draw
from specwire.session import OpenRequest, ScoreKind, Scores, Scoring, StepRequest, Verdict, Verification

# The 24 paths of top-k indices with the highest measured match rates for the demo target and its
# shipped heads, on greedy continuations of held-out stdlib files (`tune_medusa_tree`, docs/medusa.md).
DEFAULT_CHOICES: list[list[int]] = [
    [0], [1], [0, 0], [1, 0], [0, 1], [0, 1, 1], [0, 0, 0], [1, 0, 0], [2], [3], [1, 1], [1, 1, 0],
    [0, 0, 1], [0, 2], [0, 5], [4], [2, 0], [0, 0, 2], [5], [1, 3], [0, 1, 0], [0, 4], [2, 5], [0, 2, 0],
]  # fmt: skip


def typical_ok(probs: torch.Tensor, tokens: torch.Tensor, threshold: float, alpha: float) -> torch.Tensor:
    """Medusa-2's typical acceptance (Cai et al. 2024, §2.3.1): p(x) > min(ε, δ·exp(−H(p))).

    probs: [..., V]; tokens: [...] → [...] bool. LOSSY: the output does not follow p exactly.
    """
    entropy = -(probs * probs.clamp_min(1e-30).log()).sum(dim=-1)  # [...]
    bound = torch.minimum(torch.full_like(entropy, threshold), alpha * torch.exp(-entropy))
    return probs.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1) > bound


def accept_tree_typical(
    node_tokens: torch.Tensor,
    parents: list[int],
    node_probs: torch.Tensor,
    threshold: float,
    alpha: float,
    generator: torch.Generator | None,
) -> tuple[list[int], int]:
    """Typical acceptance over the tree (LOSSY): the longest path whose every token passes
    `typical_ok` under its parent's distribution (ties: the earlier node); the next token is drawn
    from the distribution at the path's end. node_tokens: [n]; node_probs: [n, V]."""
    passes = typical_ok(node_probs[parents[1:]], node_tokens[1:], threshold, alpha)  # [n−1] for nodes 1…
    children = tree_children(parents)

    def longest(node: int) -> list[int]:
        best: list[int] = []
        for child in children[node]:
            if passes[child - 1]:
                below = longest(child)
                if len(below) + 1 > len(best):
                    best = [child, *below]
        return best

    path = [0, *longest(0)]
    next_token = int(draw(node_probs[path[-1]][None], generator)[0])
    return path, next_token


def layout_for(choices: list[list[int]], heads: int, max_depth: int) -> TreeLayout:
    """The tree restricted to the heads there are and to paths of at most `max_depth` nodes."""
    return build_tree([c for c in choices if len(c) <= min(heads, max_depth)])


async def medusa(ctx: DecodeContext) -> AsyncGenerator[list[int], None]:
    params = ctx.params
    info = ctx.target.info
    if "medusa" not in info.capabilities or info.medusa_heads < 1:
        raise FailedPrecondition("strategy 'medusa' needs a target service with Medusa heads (--medusa DIR)")
    tuned = parse_medusa_choices(info.medusa_choices) if info.medusa_choices else []
    choices = params.medusa_choices or tuned or DEFAULT_CHOICES
    full = layout_for(choices, info.medusa_heads, info.medusa_heads)
    kind = ScoreKind.PROBS if params.do_sample else ScoreKind.ARGMAX
    # Greedy and lossless rounds are decided in the target when it can (`Verify` with the tree):
    # p stays there instead of crossing the wire dense, a row of the vocabulary a node; and with
    # "tree_rounds" several rounds run in one message, as `standard`'s multi-step rounds do.
    multi = "tree_rounds" in info.capabilities and params.medusa_acceptance != "typical"
    remote = multi or (params.do_sample and params.medusa_acceptance == "lossless" and "verify_tree" in info.capabilities)
    target = ctx.target_session()
    with ctx.round(tree_size=1):
        opening = Scoring(kind, positions=1)
        result = await target.open(OpenRequest(ctx.prompt_ids, params.processing, 1, opening, ctx.trace()))
        assert result.scores is not None
        root = choose(result.scores, 0, ctx.generator)
    history_len, produced = len(ctx.prompt_ids) + 1, 1
    decided, kept = [root], list[int]()  # kept: the last tree's accepted path, for `tree_keep`
    rounds = 0  # tree rounds a message: doubling from 1 while a message decides < max_tokens_per_round
    while True:
        yield decided
        remaining = params.max_new_tokens - produced
        if remaining <= 0:
            return
        if multi:
            rounds = min(2 * rounds or 1, _rounds_cap(ctx))
        layout = _layout(choices, info.medusa_heads, full, remaining, info.max_context - history_len)
        with ctx.round(tree_size=layout.size) as current:
            result = await target.step(
                StepRequest(
                    tree_keep=kept,
                    append_ids=[root],  # the service fills the other nodes from its heads
                    tree_parents=layout.parents,
                    tree_topk=layout.topk_index.tolist(),
                    scoring=Scoring(kind, positions=layout.size),
                    verify=Verification(Scores(ScoreKind.PROBS), ctx.draw_seed() if params.do_sample else 0) if remote else None,
                    tree_rounds=rounds if layout.size > 1 else 0,  # a root alone has no heads' nodes to fill
                    tree_max_tokens=remaining if multi else 0,
                    trace=ctx.trace(),
                )
            )
            assert result.tree_ids is not None
            node_ids = result.tree_ids.tolist()  # every round's nodes: its root, then the heads' candidates
            verdicts = result.round_verdicts or ([result.verdict] if result.verdict is not None else [])
            if not verdicts:
                assert result.scores is not None
                path, root = _decide(ctx, torch.tensor(node_ids), layout.parents, result.scores)
                verdicts = [Verdict(len(path) - 1, root, tuple(path), layout.size)]
            decided, offset, drafted, accepted = [], 0, 0, 0
            for verdict in verdicts:
                if offset:  # a later round in the service: its tree is cut by the same rule
                    layout = _layout(choices, info.medusa_heads, full, remaining, info.max_context - history_len)
                nodes = node_ids[offset : offset + layout.size]
                offset += layout.size
                path, root = list(verdict.tree_path), verdict.next_token
                if len(nodes) != layout.size or verdict.tree_nodes not in (0, layout.size):
                    raise RuntimeError(f"the target's tree round has {verdict.tree_nodes} nodes, {layout.size} expected")
                _count(ctx, layout, path)
                drafted, accepted = drafted + layout.size - 1, accepted + len(path) - 1
                tokens = [nodes[i] for i in path[1:]] + [root]
                decided += tokens
                history_len += len(tokens)
                remaining -= len(tokens)
                kept = path
            current.set(drafted=drafted, accepted=accepted, tree_rounds=len(verdicts))
        produced += len(decided)


def _layout(choices: list[list[int]], heads: int, full: TreeLayout, remaining: int, room: int) -> TreeLayout:
    """A round's tree: never more tokens than the output can take, nor past the context."""
    depth = min(remaining - 1, room)
    return full if depth >= full.num_heads else layout_for(choices, heads, depth)


def _rounds_cap(ctx: DecodeContext) -> int:
    """Rounds a message at most: about `max_tokens_per_round` tokens at the rounds' mean so far."""
    stats = ctx.stats
    per_round = (stats.accepted_tokens + stats.tree_rounds) / stats.tree_rounds if stats.tree_rounds else 1.0
    return max(1, round(ctx.max_tokens_per_round / per_round))


def _decide(ctx: DecodeContext, tokens: torch.Tensor, parents: list[int], scores: Scores) -> tuple[list[int], int]:
    """The accepted path and next token under the request's acceptance rule."""
    params = ctx.params
    if not params.do_sample:
        assert scores.argmax_ids is not None
        return accept_tree_greedy(tokens, parents, scores.argmax_ids)
    probs = scores.to_dense(ctx.target.info.vocab_size, 0.0)  # [n, V]
    if params.medusa_acceptance == "typical":
        return accept_tree_typical(
            tokens, parents, probs, params.posterior_threshold, params.posterior_alpha, ctx.generator
        )
    last, next_token = accept_tree_sampled(tokens, parents, probs.unsqueeze(0), ctx.generator)
    return tree_path(parents, int(last[0])), int(next_token[0])


def _count(ctx: DecodeContext, layout: TreeLayout, path: list[int]) -> None:
    """A tree round's statistics: drafted nodes, accepted depth, per-head acceptance."""
    stats = ctx.stats
    accepted = len(path) - 1
    stats.drafted_tokens += layout.size - 1
    stats.accepted_tokens += accepted
    stats.record_accepted(accepted)
    stats.tree_rounds += 1
    stats.tree_nodes += layout.size
    if len(stats.head_accepted) < layout.num_heads:
        stats.head_accepted.extend([0] * (layout.num_heads - len(stats.head_accepted)))
    for head in range(accepted):
        stats.head_accepted[head] += 1  # the node at depth head+1 came from head `head`
    if tree_children(layout.parents)[path[-1]]:
        stats.corrections += 1  # every child of the path's end was rejected
    else:
        stats.bonus_tokens += 1  # a leaf: the whole path was accepted
