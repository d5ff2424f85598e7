"""Entropy-adaptive sampling (entropix): the policy, as pure functions over one position's metrics.

Reference: xjdr-alt/entropix, `entropix/torch_sampler.py` at commit 97a51d3 (2024-10-17), the
version whose `sample` holds the five states below; its JAX `entropix/sampler.py` of the same
commit is the original the torch file ports. The metrics (entropy H and varentropy V of the next
token in bits; attention entropy, attention varentropy, head agreement and interaction strength
of the last layer) are `specwire.entropy_metrics`'. The defaults of `EntropixConfig` are the
reference's constants; every one is a request parameter (`GenerateRequest.entropix`).

States, checked in the reference's order (`classify`):
  argmax    H < 0.1 and V < 0.1: confident;
  clarify   H > 3.0 and V < 0.1: lost, evenly;
  branch    H < 5.0 and V > 5.0: a few strong options;
  resample  H > 5.0 and V > 5.0: lost, unevenly;
  adaptive  otherwise: n candidates at warpers set from the combined uncertainty, best kept.

`choose_column` draws a token the way a state says; `policy_distribution` is the distribution
that draw follows (for speculation verified under the policy, `orchestrator.entropix_strategy`).

Where the reference's code deviates from its stated intent, this implements the intent:
1. Nucleus (top-p): the reference flips the top-k probabilities to ascending order before the
   cumulative sum, so its mask drops the *most* likely tokens; here the kept set is the shortest
   prefix, by descending probability, whose mass reaches top-p (`warp`).
2. Noise: the torch port draws argmax(p / u) with u ~ Uniform(0, 1), which over-favours likely
   tokens; the JAX original uses u ~ Exponential(1), an exact draw from p. Here: an exact draw
   (`torch.multinomial` with the request's generator).
3. min-p: the torch port writes its min-p mask into the logits but samples from the
   probabilities computed before, so min-p does nothing; here it removes every token with
   p < min_p · max p before top-k and top-p.
4. The adaptive score adds log p(x) to a "confidence" term of the metrics alone, the same for
   every candidate; it is kept (reported), so the best candidate is the one of highest log p.
5. The reference computes the attention statistics over its whole preallocated cache; here over
   the real context (see `specwire.entropy_metrics`).
6. The clarifying token (the reference's id 2564, a Llama 3 token) is off by default: few models
   have one. When set, it is inserted unless it is already the last token, as in the reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

STATES = ("argmax", "branch", "clarify", "resample", "adaptive")


@dataclass(frozen=True)
class EntropixConfig:
    """Base warpers, thresholds and coefficients; defaults from the reference's `sample` and
    `adaptive_sample` (torch_sampler.py @ 97a51d3)."""

    temperature: float = 0.666
    top_p: float = 0.90
    top_k: int = 27
    min_p: float = 0.0
    argmax_entropy: float = 0.1  # argmax: H < this and V < argmax_varentropy
    argmax_varentropy: float = 0.1
    clarify_entropy: float = 3.0  # clarify: H > this and V < clarify_varentropy
    clarify_varentropy: float = 0.1
    branch_entropy: float = 5.0  # branch: H < this and V > branch_varentropy
    branch_varentropy: float = 5.0
    resample_entropy: float = 5.0  # resample: H > this and V > resample_varentropy
    resample_varentropy: float = 5.0
    clarifying_token: int = -1  # -1 = off
    clarify_temperature_offset: float = 1.3
    clarify_temperature_coefficient: float = 0.2
    clarify_max_temperature: float = 1.5
    branch_temperature_offset: float = 1.2
    branch_temperature_coefficient: float = 0.3
    branch_max_temperature: float = 1.5
    branch_top_k_coefficient: float = 0.5
    branch_min_top_k: int = 5
    resample_temperature_offset: float = 2.0
    resample_temperature_coefficient: float = 0.5
    resample_min_temperature: float = 2.0
    resample_top_p_coefficient: float = 0.2
    resample_min_top_p: float = 0.5
    adaptive_samples: int = 5
    adaptive_min_p: float = 0.03
    adaptive_temperature_logits: float = 0.3
    adaptive_temperature_attention: float = 0.2
    adaptive_temperature_agreement: float = 0.2
    adaptive_top_p_coefficient: float = 0.1
    adaptive_top_k_interaction: float = 0.3
    adaptive_top_k_agreement: float = 0.2
    adaptive_max_top_k: int = 100
    adaptive_min_p_coefficient: float = 0.5
    score_entropy: float = 0.1
    score_attention_entropy: float = 0.2
    score_varentropy: float = 0.3
    score_attention_varentropy: float = 0.4
    score_agreement: float = 0.5
    score_interaction_strength: float = 0.6

    def columns(self, vocab_size: int) -> int:
        """The most top-ranked logits any state may keep (its top-k): what the target must send."""
        branch = int(bounded_count(self.top_k * (1 + self.branch_top_k_coefficient), vocab_size))
        return min(vocab_size, max(self.top_k, branch, self.branch_min_top_k, self.adaptive_max_top_k))


def bounded_count(k: float, most: int) -> float:
    """A top-k the policy computed, clamped to [1, most] while still a float, NaN to 1: a
    coefficient near float32's largest value makes k ≈ 1e41, which no integer field holds, and
    keeping more tokens than the vocabulary has keeps the vocabulary."""
    return min(float(most), max(1.0, k))


CONFIG_FIELDS = tuple(f.name for f in fields(EntropixConfig))


@dataclass(frozen=True)
class Metrics:
    """One position's metrics (`specwire.entropy_metrics`)."""

    entropy: float
    varentropy: float
    attn_entropy: float
    attn_varentropy: float
    agreement: float
    interaction_strength: float


@dataclass(frozen=True)
class Decision:
    """How to choose one token: a state and its warpers; `clarify` inserts the clarifying token."""

    state: str
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    samples: int = 1
    clarify: bool = False


@dataclass(frozen=True)
class DecisionRecord:
    """One token's entry in the decision trace (`EntropixDecision` on the wire)."""

    state: str
    entropy: float
    varentropy: float
    attn_entropy: float
    attn_varentropy: float
    agreement: float
    interaction_strength: float
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    clarified: bool = False

    @classmethod
    def of(cls, m: Metrics, d: Decision) -> DecisionRecord:
        return cls(d.state, m.entropy, m.varentropy, m.attn_entropy, m.attn_varentropy, m.agreement,
                   m.interaction_strength, d.temperature, d.top_p, d.top_k, d.min_p, d.clarify)


def classify(m: Metrics, c: EntropixConfig) -> str:
    """The state, tested in the reference's order: argmax, clarify, branch, resample, adaptive."""
    if m.entropy < c.argmax_entropy and m.varentropy < c.argmax_varentropy:
        return "argmax"
    if m.entropy > c.clarify_entropy and m.varentropy < c.clarify_varentropy:
        return "clarify"
    if m.entropy < c.branch_entropy and m.varentropy > c.branch_varentropy:
        return "branch"
    if m.entropy > c.resample_entropy and m.varentropy > c.resample_varentropy:
        return "resample"
    return "adaptive"


def argmax_decision(c: EntropixConfig) -> Decision:
    """Low H, low V: the argmax (temperature 0 in the trace)."""
    return Decision("argmax", 0.0, 1.0, 1, 0.0)


def branch_decision(m: Metrics, c: EntropixConfig, vocab_size: int) -> Decision:
    """Low H, high V: T = min(1.5, T₀ · (1.2 + 0.3 · interaction)); top-k widened as agreement
    falls, k = max(5, ⌊k₀ · (1 + 0.5 · (1 − agreement))⌋), at most the vocabulary."""
    raise_by = c.branch_temperature_offset + c.branch_temperature_coefficient * m.interaction_strength
    temperature = min(c.branch_max_temperature, c.temperature * raise_by)
    widened = int(bounded_count(c.top_k * (1 + c.branch_top_k_coefficient * (1 - m.agreement)), vocab_size))
    top_k = min(vocab_size, max(c.branch_min_top_k, widened))
    return Decision("branch", temperature, c.top_p, top_k, c.min_p)


def clarify_decision(m: Metrics, c: EntropixConfig, last_token: int) -> Decision:
    """High H, low V: insert the clarifying token once (when configured and not just inserted);
    otherwise T = min(1.5, T₀ · (1.3 + 0.2 · attention entropy))."""
    raise_by = c.clarify_temperature_offset + c.clarify_temperature_coefficient * m.attn_entropy
    temperature = min(c.clarify_max_temperature, c.temperature * raise_by)
    insert = c.clarifying_token >= 0 and last_token != c.clarifying_token
    return Decision("clarify", temperature, c.top_p, c.top_k, c.min_p, clarify=insert)


def resample_decision(m: Metrics, c: EntropixConfig) -> Decision:
    """High H, high V: T = max(2, T₀ · (2 + 0.5 · attention varentropy)); top-p lowered by
    attention entropy, p = max(0.5, p₀ − 0.2 · attention entropy)."""
    raise_by = c.resample_temperature_offset + c.resample_temperature_coefficient * m.attn_varentropy
    temperature = max(c.resample_min_temperature, c.temperature * raise_by)
    top_p = max(c.resample_min_top_p, c.top_p - c.resample_top_p_coefficient * m.attn_entropy)
    return Decision("resample", temperature, top_p, c.top_k, c.min_p)


def adaptive_decision(m: Metrics, c: EntropixConfig) -> Decision:
    """Otherwise, with U_logits = H + V and U_attn = attention entropy + attention varentropy:
    T = T₀ (1 + 0.3 U_logits + 0.2 U_attn − 0.2 agreement), floored at 0.001;
    p = clip(p₀ (1 + 0.1 attention varentropy), 0.1, 1);
    k = clip(round(k₀ (1 + 0.3 interaction − 0.2 agreement)), 1, 100);
    min-p = clip(0.03 (1 − 0.5 U_logits), 0.01, 0.5);
    draw `adaptive_samples` candidates (`choose_column` keeps the best)."""
    logits_u = m.entropy + m.varentropy
    attn_u = m.attn_entropy + m.attn_varentropy
    raise_by = (
        1
        + c.adaptive_temperature_logits * logits_u
        + c.adaptive_temperature_attention * attn_u
        - c.adaptive_temperature_agreement * m.agreement
    )
    top_p = min(1.0, max(0.1, c.top_p * (1 + c.adaptive_top_p_coefficient * m.attn_varentropy)))
    widen = 1 + c.adaptive_top_k_interaction * m.interaction_strength - c.adaptive_top_k_agreement * m.agreement
    top_k = round(bounded_count(c.top_k * widen, c.adaptive_max_top_k))
    min_p = min(0.5, max(0.01, c.adaptive_min_p * (1 - c.adaptive_min_p_coefficient * logits_u)))
    return Decision("adaptive", max(c.temperature * raise_by, 1e-3), top_p, top_k, min_p, samples=c.adaptive_samples)


def decide(m: Metrics, c: EntropixConfig, last_token: int, vocab_size: int) -> Decision:
    """The policy: `classify`, then that state's warpers."""
    state = classify(m, c)
    if state == "argmax":
        return argmax_decision(c)
    if state == "clarify":
        return clarify_decision(m, c, last_token)
    if state == "branch":
        return branch_decision(m, c, vocab_size)
    if state == "resample":
        return resample_decision(m, c)
    return adaptive_decision(m, c)


def warp(logits: torch.Tensor, d: Decision) -> torch.Tensor:
    """The decision's distribution over columns: softmax(logits / T), then min-p (p ≥ min_p · max p),
    top-k, top-p (shortest descending prefix with mass ≥ top_p), renormalised.

    logits: [n] sorted descending (−inf = absent) → [n] probabilities. Shifted so the top logit
    is 0 first: T → 0 gives the argmax and T → ∞ the uniform over present tokens, never NaN."""
    shifted = logits.float() - logits.float().max()  # [n], ≤ 0
    scaled = torch.where(torch.isneginf(shifted), shifted, shifted / d.temperature)  # absent stay −inf
    probs = torch.softmax(scaled, dim=-1)  # [n]
    keep = probs >= d.min_p * probs.max()
    keep[d.top_k :] = False
    kept = probs * keep
    mass_before = torch.cumsum(kept, dim=-1) - kept  # mass of strictly more likely kept tokens
    keep &= mass_before < d.top_p * kept.sum()
    keep[0] = True
    kept = probs * keep
    return kept / kept.sum()


def candidate_score(log_p: float, m: Metrics, c: EntropixConfig) -> float:
    """The reference's adaptive score: log p(x) + a confidence term of the metrics alone."""
    confidence = (
        (1 - m.entropy) * c.score_entropy
        + (1 - m.attn_entropy) * c.score_attention_entropy
        + (1 - m.varentropy) * c.score_varentropy
        + (1 - m.attn_varentropy) * c.score_attention_varentropy
        + m.agreement * c.score_agreement
        + m.interaction_strength * c.score_interaction_strength
    )
    return log_p + confidence


def choose_column(logits: torch.Tensor, d: Decision, m: Metrics, c: EntropixConfig, generator: torch.Generator) -> int:
    """A column of `logits` ([n], descending) under decision `d`: the argmax, one draw, or the
    best-scored of `d.samples` independent draws (score: `candidate_score` on log p; the score
    falls with the column, so ties go to the lower column)."""
    if d.state == "argmax":
        return 0
    probs = warp(logits, d)
    draws = torch.multinomial(probs, d.samples, replacement=True, generator=generator).tolist()
    if d.samples == 1:
        return int(draws[0])
    log_p = torch.log_softmax(logits.float(), dim=-1)  # the shift from absent columns is shared
    return int(max(draws, key=lambda column: (candidate_score(float(log_p[column]), m, c), -column)))


def policy_distribution(logits: torch.Tensor, d: Decision) -> torch.Tensor:
    """The distribution `choose_column` draws from, over the columns: one-hot on column 0 for
    argmax; W = `warp` for one draw; for the best of n draws from W (the lowest column drawn),
    P(j) = T(j)ⁿ − T(j+1)ⁿ with T(j) = Σ_{i ≥ j} W(i), the chance that no draw lands before j
    less the chance that none lands on or before j. logits: [n] descending → [n]."""
    if d.state == "argmax":
        return torch.nn.functional.one_hot(torch.tensor(0), logits.shape[0]).float()
    probs = warp(logits, d)  # [n]
    if d.samples == 1:
        return probs
    tail = probs.flip(0).cumsum(0).flip(0).clamp(max=1.0)  # [n], T(j)
    after = torch.cat([tail[1:], tail.new_zeros(1)])  # T(j+1)
    return (tail.double() ** d.samples - after.double() ** d.samples).float()


# Bounds per field: (low, high, low inclusive, high inclusive); integers where the default is one.
_BOUNDS: dict[str, tuple[float, float, bool, bool]] = {
    "temperature": (0.0, math.inf, False, False),
    "top_p": (0.0, 1.0, False, True),
    "top_k": (1, 1024, True, True),
    "min_p": (0.0, 1.0, True, True),
    "clarifying_token": (-1, math.inf, True, False),
    "clarify_max_temperature": (0.0, math.inf, False, False),
    "branch_max_temperature": (0.0, math.inf, False, False),
    "branch_min_top_k": (1, 1024, True, True),
    "resample_min_temperature": (0.0, math.inf, False, False),
    "resample_min_top_p": (0.0, 1.0, False, True),
    "adaptive_samples": (1, 64, True, True),
    "adaptive_max_top_k": (1, 1024, True, True),
    "adaptive_min_p": (0.0, 1.0, True, True),
}


def check_config(c: EntropixConfig, vocab_size: int) -> list[tuple[str, str]]:
    """(field, problem) for each out-of-bounds field; thresholds and coefficients must be finite, ≥ 0."""
    problems = []
    for name in CONFIG_FIELDS:
        value = getattr(c, name)
        low, high, low_in, high_in = _BOUNDS.get(name, (0.0, math.inf, True, False))
        if not math.isfinite(value):
            problems.append((name, f"must be a finite number, got {value}"))
        elif (value < low or (value == low and not low_in)) or (value > high or (value == high and not high_in)):
            interval = f"{'[' if low_in else '('}{low}, {high}{']' if high_in else ')'}"
            problems.append((name, f"must be in {interval}, got {value}"))
    if c.clarifying_token >= vocab_size:
        bound = f"must be -1 (off) or an id below the vocabulary size {vocab_size}"
        problems.append(("clarifying_token", f"{bound}, got {c.clarifying_token}"))
    return problems
