"""Speculative sampling's acceptance rule: a pure function over tensors.

References: Leviathan, Kalman & Matias 2023, "Fast Inference from Transformers via Speculative
Decoding" (ICML, arXiv:2211.17192), Algorithm 1; Chen et al. 2023, "Accelerating Large Language
Model Decoding with Speculative Sampling" (arXiv:2302.01318), Algorithm 2.

It lives in the shared core because it runs in two places: in the orchestrator (the dense
protocol, where the target's p crosses the wire) and in the target service (`Step.verify`), where
p already is; there it runs on the orchestrator's seed, so the orchestrator still owns every draw.
"""

from __future__ import annotations

import torch

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
    next_dist = residual_distribution(target_probs[rows, accepted_len], q_next)  # [B, V]
    next_token = draw(next_dist, generator)  # [B]
    return accepted_len, next_token


def accept_draft(
    draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor, generator: torch.Generator | None
) -> tuple[int, int]:
    """One round of `accept_drafts`. draft_tokens: [γ]; draft_probs: [γ, V]; target_probs: [γ+1, V]."""
    accepted_len, next_token = accept_drafts(
        draft_tokens.unsqueeze(0), draft_probs.unsqueeze(0), target_probs.unsqueeze(0), generator
    )
    return int(accepted_len[0]), int(next_token[0])
