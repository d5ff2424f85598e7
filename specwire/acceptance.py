"""Speculative sampling's acceptance rules: pure functions over tensors.

References: Leviathan, Kalman & Matias 2023, "Fast Inference from Transformers via Speculative
Decoding" (ICML, arXiv:2211.17192), Algorithm 1; Chen et al. 2023, "Accelerating Large Language
Model Decoding with Speculative Sampling" (arXiv:2302.01318), Algorithm 2; over a tree of
candidates, Miao et al. 2023, "SpecInfer" (arXiv:2305.09781), multi-draft speculative sampling;
a chain verified as a block, Sun et al. 2024 (arXiv:2403.10444), Algorithm 2.

It lives in the shared core because it runs in two places: in the orchestrator (the dense
protocol, where the target's p crosses the wire) and in the target service (`Step.verify`), where
p already is; there it runs on the orchestrator's seed, so the orchestrator still owns every draw.
"""

from __future__ import annotations

from typing import Any

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


def block_weights(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """w [B, γ+1] float64 of block verification (`accept_drafts`): w_0 = 1 and
    w_i = min(1, w_{i−1} p_i(x_i) / q_i(x_i)). Shapes as `accept_drafts` takes them."""
    batch, gamma = draft_tokens.shape
    index = draft_tokens.long().unsqueeze(-1)  # [B, γ, 1]
    # q(x) > 0 for a drawn x.
    ratio = (target_probs[:, :gamma].gather(-1, index).double() / draft_probs.gather(-1, index).double()).squeeze(-1)
    weights = [ratio.new_ones(batch)]
    for i in range(gamma):
        weights.append((weights[-1] * ratio[:, i]).clamp_max(1.0))
    return torch.stack(weights, dim=1)


def block_end(
    w: torch.Tensor, target_row: torch.Tensor, draft_row: torch.Tensor | None, scalar: float | None = None
) -> tuple[torch.Tensor, Any, Any]:
    """After i drafts (w = w_i [B], target_row p_{i+1} [B, V], draft_row q_{i+1} [B, V], None past
    the last draft): the residual r_i = max(0, w_i p_{i+1} − q_{i+1}) [B, V] in p's dtype, its
    mass ρ_i [B] and h_i = ρ_i / (ρ_i + 1 − w_i) [B] float64 (1 where both are 0). With
    `scalar` (w_i of a batch of one, as a float) ρ_i and h_i come as floats, the same values."""
    residual = w.to(target_row.dtype).unsqueeze(-1) * target_row
    if draft_row is not None:
        residual = (residual - draft_row).clamp_min_(0.0)
    rho = residual.sum(dim=-1, dtype=torch.float64)
    if scalar is not None:
        mass = float(rho[0])
        end = mass + (1.0 - scalar)
        return residual, mass, mass / end if end > 0 else 1.0
    ends = rho + (1.0 - w)
    return residual, rho, torch.where(ends > 0, rho / ends, 1.0)


def block_ends(
    draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """h [B, γ+1] (`block_end` at every i; h_0 unused), and the weights w it came from
    (`block_weights`): draft i ends a block-verified round with probability h_i · Π_{j>i} (1 − h_j)."""
    gamma = draft_tokens.shape[1]
    w = block_weights(draft_tokens, draft_probs, target_probs)
    ends = [block_end(w[:, i], target_probs[:, i], draft_probs[:, i] if i < gamma else None)[2] for i in range(gamma + 1)]
    return torch.stack(ends, dim=1), w


def accept_drafts(
    draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling's decision for a batch of independent rounds, by block verification
    (Sun et al. 2024, "Block Verification Accelerates Speculative Decoding", arXiv:2403.10444,
    Alg. 2): the output follows p exactly, and no rule that reads only the drafted path accepts
    more tokens in expectation (token-by-token acceptance, Leviathan et al. 2023, included).

    With w_0 = 1 and w_i = min(1, w_{i−1} p_i(x_i) / q_i(x_i)), the residual after i drafts is
    r_i = max(0, w_i p_{i+1} − q_{i+1}) (q_{γ+1} = 0), of mass ρ_i; draft i is a possible end
    with probability h_i = ρ_i / (ρ_i + 1 − w_i). The round keeps drafts up to the last i whose
    u_i < h_i (u_i ~ U[0, 1); none: 0) and draws the next token from r_i normalised (p_{i+1}
    where r_i has no mass). At γ = 1 this is token acceptance.

    The rule runs on the columns where some row has mass, and the drafts': the same tensors
    whichever layout the rows came in (`accept_draft_sparse`), so the same decision to the bit,
    and ~40 of Gemma-3's 262,144 ids after top-k.

    draft_tokens: [B, γ] int; draft_probs q: [B, γ, V]; target_probs p: [B, γ+1, V].
    Returns accepted_len [B] int64 in [0, γ] and next_token [B] int64.
    """
    columns, draft_tokens, draft_probs, target_probs = _held_columns(draft_tokens, draft_probs, target_probs)
    accepted_len, next_token = _decide_block(draft_tokens, draft_probs, target_probs, generator)
    return accepted_len, next_token if columns is None else columns[next_token]


def _held_columns(
    draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The columns where some row of p or q has mass, and the drafts' ([n] ascending; None if
    that is all of them), with the drafts as indices into them and p and q narrowed to them."""
    held = target_probs.flatten(0, -2).amax(dim=0) > 0
    if draft_tokens.shape[-1]:
        held |= draft_probs.flatten(0, -2).amax(dim=0) > 0
    held[draft_tokens.long().flatten()] = True
    if bool(held.all()):
        return None, draft_tokens, draft_probs, target_probs
    columns = held.nonzero().squeeze(-1)
    return columns, torch.searchsorted(columns, draft_tokens.long()), draft_probs[..., columns], target_probs[..., columns]


def _decide_block(
    draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`accept_drafts` on the columns given: every end's h, then each round's last hit."""
    batch, gamma = draft_tokens.shape
    h, weights = block_ends(draft_tokens, draft_probs, target_probs)  # [B, γ+1] each
    hit = torch.rand((batch, gamma), generator=generator).double() < h[:, 1:]  # [B, γ]
    # The last i with a hit (its index plus one, at most γ), else 0.
    accepted_len = (hit.long() * torch.arange(1, gamma + 1)).amax(dim=-1) if gamma else hit.new_zeros(batch, dtype=torch.long)
    rows = torch.arange(batch)
    q_next = torch.cat([draft_probs, torch.zeros_like(target_probs[:, :1])], dim=1)  # q_{γ+1} = 0
    residual, rho, _ = block_end(weights[rows, accepted_len], target_probs[rows, accepted_len], q_next[rows, accepted_len])
    # No mass left in r_i: p_{i+1} (as token acceptance's correction falls back to p).
    return accepted_len, draw(torch.where((rho > 0).unsqueeze(-1), residual, target_probs[rows, accepted_len]), generator)


def accept_draft(
    draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor, generator: torch.Generator | None
) -> tuple[int, int]:
    """One round of `accept_drafts`, the same decision from the same draws. draft_tokens: [γ];
    draft_probs: [γ, V]; target_probs: [γ+1, V]. The ends are tried from the last draft back,
    each residual computed when reached: the first hit from the end decides, so a round pays
    for one or two residuals, not γ + 1 (each the whole vocabulary where p is dense)."""
    gamma = int(draft_tokens.shape[0])
    columns, tokens, q, p = _held_columns(draft_tokens.unsqueeze(0), draft_probs.unsqueeze(0), target_probs.unsqueeze(0))
    weights = block_weights(tokens, q, p)  # [1, γ+1]
    w, uniform = weights[0].tolist(), torch.rand((1, gamma), generator=generator).double()[0].tolist()
    for kept in range(gamma, -1, -1):
        residual, rho, h = block_end(weights[:, kept], p[:, kept], q[:, kept] if kept < gamma else None, w[kept])
        if kept == 0 or uniform[kept - 1] < h:
            break
    next_token = int(draw(residual if rho > 0 else p[:, kept], generator)[0])
    return kept, next_token if columns is None else int(columns[next_token])


def accept_draft_sparse(
    draft_tokens: torch.Tensor,
    draft_ids: torch.Tensor,
    draft_values: torch.Tensor,
    target_ids: torch.Tensor,
    target_values: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """`accept_draft` on sparse rows, to the bit: narrowed to the ids they name, the rows reach
    the rule as the dense ones do (`accept_drafts` keeps the columns with mass, and the drafts').
    draft_tokens [γ]; draft_ids/values q [γ, k], target_ids/values p [γ+1, n]: ids distinct in
    a row, −1 where a row is padded."""
    # The ids with mass, and the drafts': the columns `accept_draft` keeps of the dense rows.
    named = torch.cat([draft_ids[draft_values > 0], target_ids[target_values > 0], draft_tokens.flatten()]).long()
    columns = named[named >= 0].unique()  # sorted ascending

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
