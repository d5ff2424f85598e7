"""Medusa decoding: the target's own heads draft a candidate tree, verified in one forward.

Reference: Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple
Decoding Heads" (arXiv:2401.10774); lossless tree sampling as in SpecInfer (Miao et al. 2023,
"SpecInfer: Accelerating Generative LLM Serving with Tree-based Speculative Inference and
Verification", arXiv:2305.09781), multi-draft speculative sampling with one-hot drafts.

A round is ONE message to the target service: keep the last round's accepted path
(`tree_keep`, its KV compacted), append the new tree — its root is the token the last round
decided, its other nodes the heads' top-k along `medusa_choices` (`tree_topk`), which the
service fills in by applying its heads to the hidden state it kept at the accepted path's end
(one row, not every node) — and score every node. The reply carries the tree's ids and the
base distribution at every node (argmax ids when greedy); the orchestrator decides with the
pure functions below. No draft service is involved.

Acceptance rules, all over the same tree (node 0 the root; children tried in node order):
- greedy: follow the child equal to the target's argmax; output = target-only greedy, exactly;
- typical (Medusa-2, LOSSY): accept while p(x) > min(ε, δ·exp(−H(p)));
- lossless sampling (`accept_tree_sampled`): the target's distribution exactly.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

import torch
from specwire.orchestrator.context import DecodeContext
from specwire.orchestrator.params import parse_medusa_choices
from specwire.orchestrator.sampling import choose

from specwire.errors import FailedPrecondition
from specwire.medusa import TreeLayout, build_tree, tree_children, tree_path
from specwire.processing import draw
from specwire.session import OpenRequest, ScoreKind, Scores, Scoring, StepRequest

# The 24 paths of top-k indices with the highest measured match rates for the demo target and its
# shipped heads, on greedy continuations of held-out stdlib files (`tune_medusa_tree`, docs/medusa.md).
DEFAULT_CHOICES: list[list[int]] = [
    [0], [1], [0, 0], [1, 0], [0, 1], [0, 1, 1], [0, 0, 0], [1, 0, 0], [2], [3], [1, 1], [1, 1, 0],
    [0, 0, 1], [0, 2], [0, 5], [4], [2, 0], [0, 0, 2], [5], [1, 3], [0, 1, 0], [0, 4], [2, 5], [0, 2, 0],
]  # fmt: skip


def accept_tree_greedy(
    node_tokens: torch.Tensor, parents: list[int], target_argmax: torch.Tensor, start: int = 0
) -> tuple[list[int], int]:
    """The longest path whose every token equals the target's argmax at its parent.

    node_tokens: [n]; target_argmax: [n] (the argmax of the distribution after each node).
    `start`: the node the rule starts at (its ancestors are decided tokens, kept as they are).
    Returns (accepted path of node indices from the root, next token = argmax at its end).
    """
    children = tree_children(parents)
    node = start
    while True:
        wanted = int(target_argmax[node])
        match = next((c for c in children[node] if int(node_tokens[c]) == wanted), None)
        if match is None:
            return tree_path(parents, node), wanted
        node = match


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


def accept_tree_sampled(
    node_tokens: torch.Tensor, parents: list[int], node_probs: torch.Tensor, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless sampling over a tree of deterministic candidates, for B independent draws.

    At node v with target distribution p = p_v, try v's children c₁…c_m in order: accept c_j with
    probability p(c_j) / Σp (u·Σp < p(c_j)); on rejection set p(c_j) = 0 and go on (Σp shrinks);
    if every child is rejected, draw the next token from what is left of p; if a child is
    accepted, continue from it with p_{c_j}; at a leaf, draw the bonus token from p_leaf.

    Proof that every emitted token follows the target. Let T(p, c₁…c_m) be the token a node
    emits. Claim: P(T = x) = p(x). For m = 0, T ~ p. For m ≥ 1: P(T = c₁) = p(c₁); if c₁ is
    rejected (probability 1 − p(c₁)) the rest is T(p', c₂…c_m) with p' = p(·)·1[· ≠ c₁] /
    (1 − p(c₁)), which by induction emits x ~ p', so P(T = x) = (1 − p(c₁))·p(x)/(1 − p(c₁)) =
    p(x) for x ≠ c₁. When a child c is emitted the walk continues at c, whose p_c is the target's
    distribution given the path so far, so by the chain rule every prefix of the output follows
    the target (SpecInfer, Miao et al. 2023, Thm. 4.2, with one-hot draft distributions).

    node_tokens: [n]; node_probs: [B, n, V] (an expanded view is fine). Returns last_node [B] (the end of
    the accepted path; `tree_path` gives the path) and next_token [B].
    """
    children_lists = tree_children(parents)
    width = max(len(c) for c in children_lists)
    children = torch.full((len(parents), max(width, 1)), -1, dtype=torch.long)  # [n, max children]
    for node, kids in enumerate(children_lists):
        children[node, : len(kids)] = torch.tensor(kids, dtype=torch.long)
    draws = node_probs.shape[0]
    rows = torch.arange(draws)
    at = torch.zeros(draws, dtype=torch.long)  # [B] the node each draw is at
    probs = node_probs[rows, at].clone()  # [B, V], unnormalised as children are rejected
    walking = torch.ones(draws, dtype=torch.bool)  # still at a node whose children are being tried
    while bool(walking.any()):
        moved = torch.zeros(draws, dtype=torch.bool)
        for slot in range(width):
            child = children[at, slot]  # [B]
            trying = walking & ~moved & (child >= 0)
            token = node_tokens[child.clamp_min(0)].long()  # [B]
            p_child = probs.gather(1, token.unsqueeze(1)).squeeze(1)  # [B]
            uniform = torch.rand(draws, generator=generator)
            accept = trying & (uniform * probs.sum(dim=-1) < p_child)
            reject = trying & ~accept
            probs[reject, token[reject]] = 0.0
            at = torch.where(accept, child, at)
            if bool(accept.any()):
                probs[accept] = node_probs[rows[accept], at[accept]]
            moved |= accept
        walking = moved
    next_token = draw(probs, generator)  # [B]
    return at, next_token


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
    target = ctx.target_session()
    with ctx.round(tree_size=1):
        opening = Scoring(kind, positions=1)
        result = await target.open(OpenRequest(ctx.prompt_ids, params.processing, 1, opening, ctx.trace()))
        assert result.scores is not None
        root = choose(result.scores, 0, ctx.generator)
    history_len, produced = len(ctx.prompt_ids) + 1, 1
    decided, kept = [root], list[int]()  # kept: the last tree's accepted path, for `tree_keep`
    while True:
        yield decided
        remaining = params.max_new_tokens - produced
        if remaining <= 0:
            return
        # Never verify more tokens than the output can take, nor past the context.
        depth = min(remaining - 1, info.max_context - history_len)
        layout = full if depth >= full.num_heads else layout_for(choices, info.medusa_heads, depth)
        with ctx.round(tree_size=layout.size) as current:
            result = await target.step(
                StepRequest(
                    tree_keep=kept,
                    append_ids=[root],  # the service fills the other nodes from its heads
                    tree_parents=layout.parents,
                    tree_topk=layout.topk_index.tolist(),
                    scoring=Scoring(kind, positions=layout.size),
                    trace=ctx.trace(),
                )
            )
            assert result.scores is not None and result.tree_ids is not None
            tokens = result.tree_ids.tolist()  # [n] the root, then the heads' candidates
            path, root = _decide(ctx, torch.tensor(tokens), layout.parents, result.scores)
            accepted = len(path) - 1
            current.set(drafted=layout.size - 1, accepted=accepted)
        _count(ctx, layout, path)
        kept = path
        decided = [tokens[i] for i in path[1:]] + [root]
        history_len += len(decided)
        produced += len(decided)


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
