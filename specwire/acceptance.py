"""Speculative sampling's acceptance rules: pure functions over tensors.

References: Leviathan, Kalman & Matias 2023, "Fast Inference from Transformers via Speculative
Decoding" (ICML, arXiv:2211.17192), Algorithm 1; Chen et al. 2023, "Accelerating Large Language
Model Decoding with Speculative Sampling" (arXiv:2302.01318), Algorithm 2; over a tree of
candidates, Miao et al. 2023, "SpecInfer" (arXiv:2305.09781), multi-draft speculative sampling.

It lives in the shared core because it runs in two places: in the orchestrator (the dense
protocol, where the target's p crosses the wire) and in the target service (`Step.verify`), where
p already is; there it runs on the orchestrator's seed, so the orchestrator still owns every draw.
"""

from __future__ import annotations

import torch

from specwire.medusa import tree_children, tree_path
from specwire.processing import draw


def residual_distribution(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """p'(x) = norm(max(0, p(x) − q(x))) (Leviathan et al. 2023, §2.3); p itself where that is all 0.

    The residual is all zeros only when p ≤ q everywhere, i.e. p = q, where no rejection can
    happen in exact arithmetic; falling back to p keeps the function total.
    target_probs, draft_probs: [..., vocab] → [..., vocab], rows summing to 1.
    """
    residual = (target_probs - draft_probs).clamp_min(0.0)  # [..., vocab]
    mass = residual.sum(dim=-1, keepdim=True)  # [..., 1]
    return torch.where(mass > 0, residual / torch.where(mass > 0, mass, 1.0), target_probs)


def accept_drafts(
    draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling's decision for a batch of independent rounds.

    Accept x_i while u_i < min(1, p_i(x_i) / q_i(x_i)), u_i ~ U[0, 1); at the first rejection
    draw the correction from norm(max(0, p_i − q_i)); if all γ are accepted, draw the bonus token
    from p_{γ+1}. The tokens out are then distributed exactly as p (Leviathan et al. 2023, Thm. 1).

    draft_tokens: [B, γ] int; draft_probs q: [B, γ, V]; target_probs p: [B, γ+1, V].
    Returns accepted_len [B] int64 in [0, γ] and next_token [B] int64.
    """
    batch, gamma = draft_tokens.shape
    index = draft_tokens.long().unsqueeze(-1)  # [B, γ, 1]
    p_drafted = target_probs[:, :gamma].gather(-1, index).squeeze(-1)  # [B, γ]
    q_drafted = draft_probs.gather(-1, index).squeeze(-1)  # [B, γ]
    uniform = torch.rand((batch, gamma), generator=generator)  # [B, γ]
    accepted = uniform * q_drafted < p_drafted  # u < p/q without dividing; q(x) > 0 for a drawn x
    accepted_len = accepted.long().cumprod(dim=-1).sum(dim=-1)  # [B]
    rows = torch.arange(batch)
    # q = 0 after the last draft makes the residual there p_{γ+1}: the bonus distribution.
    q_next = torch.zeros_like(target_probs[:, 0])  # [B, V]
    if gamma:
        drafted = (accepted_len < gamma).unsqueeze(-1)  # [B, 1]
        q_next = torch.where(drafted, draft_probs[rows, accepted_len.clamp_max(gamma - 1)], q_next)
    next_token = draw(_residual_mass(target_probs[rows, accepted_len], q_next), generator)  # [B]
    return accepted_len, next_token


def _residual_mass(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """`residual_distribution` before its division: `draw` scales its uniform by each row's
    total, so the draw follows the same distribution, and every entry is p − q itself, equal on
    any set of columns that holds the mass (`accept_draft_sparse`). [..., vocab]."""
    residual = (target_probs - draft_probs).clamp_min(0.0)
    return torch.where((residual > 0).any(dim=-1, keepdim=True), residual, target_probs)


def accept_draft(
    draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor, generator: torch.Generator | None
) -> tuple[int, int]:
    """One round of `accept_drafts`. draft_tokens: [γ]; draft_probs: [γ, V]; target_probs: [γ+1, V]."""
    accepted_len, next_token = accept_drafts(
        draft_tokens.unsqueeze(0), draft_probs.unsqueeze(0), target_probs.unsqueeze(0), generator
    )
    return int(accepted_len[0]), int(next_token[0])


def accept_draft_sparse(
    draft_tokens: torch.Tensor,
    draft_ids: torch.Tensor,
    draft_values: torch.Tensor,
    target_ids: torch.Tensor,
    target_values: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """`accept_draft` on sparse rows, to the bit: the same rule on the columns where p or q has
    mass alone. Every comparison reads the same entries, and the draw's float64 running sums
    meet the same non-zero entries in the same id order (a zero adds exactly nothing).
    draft_tokens [γ]; draft_ids/values q [γ, k], target_ids/values p [γ+1, n]: ids distinct in
    a row, −1 where a row is padded."""
    columns = torch.cat([draft_ids.flatten(), target_ids.flatten(), draft_tokens.flatten()]).long()
    columns = columns[columns >= 0].unique()  # sorted ascending

    def narrow(ids: torch.Tensor, values: torch.Tensor) -> torch.Tensor:  # [rows, len(columns)]
        ids = ids.long()
        at = torch.where(ids >= 0, torch.searchsorted(columns, ids.clamp_min(0)), len(columns))  # padding: a spare column
        out = values.new_zeros((ids.shape[0], len(columns) + 1)).float()
        return out.scatter_(-1, at, values.float())[:, :-1]

    drafted = torch.searchsorted(columns, draft_tokens.long())
    accepted_len, next_column = accept_draft(drafted, narrow(draft_ids, draft_values), narrow(target_ids, target_values),
                                             generator)
    return accepted_len, int(columns[next_column])


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
