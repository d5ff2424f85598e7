"""The latency model of speculative decoding: expected tokens per round, predicted speedup, best γ.

Leviathan, Kalman & Matias 2023, "Fast Inference from Transformers via Speculative Decoding"
(arXiv:2211.17192), §3: with per-token acceptance probability α and γ drafted tokens per round,
a round yields E = (1 − α^(γ+1)) / (1 − α) tokens (Eq. 1) and costs γ·c + 1 target-forward
times, c = draft forward time / target forward time; the expected speedup over target-only
decoding is E / (γ·c + 1) (Theorem 3.8).

Across hosts a round also pays the network: in wall time a round takes γ·t_d + t_v + RTT, so
the time per token is (γ·t_d + t_v + RTT) · (1 − α) / (1 − α^(γ+1)), and the best γ minimises
it. Pure functions, no I/O: `bench` and `experiment` feed them measured figures.
"""

from __future__ import annotations


def expected_tokens_per_round(alpha: float, gamma: float) -> float:
    """E[tokens per round] = (1 − α^(γ+1)) / (1 − α); γ + 1 when α = 1, 1 when α = 0."""
    _check_alpha(alpha)
    if gamma < 0:
        raise ValueError(f"gamma must be ≥ 0, got {gamma}")
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1.0)) / (1.0 - alpha)


def predicted_speedup(alpha: float, gamma: float, cost_ratio: float) -> float:
    """Leviathan et al. Thm. 3.8: E[tokens per round] / (γ·c + 1), against target-only decoding."""
    if cost_ratio < 0:
        raise ValueError(f"cost ratio c must be ≥ 0, got {cost_ratio}")
    return expected_tokens_per_round(alpha, gamma) / (gamma * cost_ratio + 1.0)


def time_per_token_ms(gamma: float, alpha: float, draft_ms_per_token: float, verify_ms: float, rtt_ms: float) -> float:
    """(γ·t_d + t_v + RTT) · (1 − α) / (1 − α^(γ+1)): wall time per generated token.

    `rtt_ms` is everything a round pays regardless of γ besides the verify forward: network
    round trips and fixed per-round overhead.
    """
    return (gamma * draft_ms_per_token + verify_ms + rtt_ms) / expected_tokens_per_round(alpha, gamma)


def best_gamma(
    alpha: float, draft_ms_per_token: float, verify_ms: float, rtt_ms: float, max_gamma: int = 32
) -> int:
    """argmin over γ ∈ [1, max_gamma] of `time_per_token_ms` (the smallest γ on ties)."""
    if max_gamma < 1:
        raise ValueError(f"max_gamma must be ≥ 1, got {max_gamma}")
    return min(
        range(1, max_gamma + 1),
        key=lambda gamma: time_per_token_ms(gamma, alpha, draft_ms_per_token, verify_ms, rtt_ms),
    )


def alpha_estimate(accepted: int, rejected: int) -> float:
    """Maximum-likelihood α under the i.i.d. model: accepted / (accepted + rejected).

    Each compared draft token is a Bernoulli(α) trial until the first rejection, so rounds cut
    short by γ (all accepted) contribute only successes. This differs from accepted / drafted,
    which also counts the tokens after a rejection that were never compared.
    """
    trials = accepted + rejected
    if accepted < 0 or rejected < 0:
        raise ValueError(f"counts must be ≥ 0, got {accepted}, {rejected}")
    return accepted / trials if trials else 0.0


def _check_alpha(alpha: float) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
