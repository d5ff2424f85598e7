"""Logits processors and warpers: pure functions over tensors.

Semantics follow Hugging Face transformers' `generate` (`generation/logits_process.py`), in its
order: repetition penalty → no-repeat-n-gram → temperature → top-k → top-p → min-p. The same
functions run in the model services (before anything is sent) and in tests against
transformers' own processors, so the distribution a strategy decides on is the one the model
produced, warped once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

NEG_INF = float("-inf")


def overflow_limit(scores: torch.Tensor) -> torch.Tensor:
    """Scores whose float32 arithmetic overflowed, taken to the limit they were heading for.

    A row holding +inf (T → 0, a penalty → 0, a weight → ∞) is dominated by those entries:
    they become 0, every other entry −inf, so softmax is uniform over them and argmax picks one
    (greedy). NaN (∞ − ∞) becomes −inf; a row left with no finite entry becomes all 0 (uniform).
    Rows that did not overflow are returned as they are. scores: [rows, vocab].
    """
    scores = scores.nan_to_num(nan=NEG_INF, posinf=float("inf"), neginf=NEG_INF)
    top = scores == float("inf")  # [rows, vocab]
    dominated = top.any(dim=-1, keepdim=True)  # [rows, 1]
    scores = torch.where(dominated, torch.where(top, 0.0, NEG_INF), scores)
    empty = ~torch.isfinite(scores).any(dim=-1, keepdim=True)  # [rows, 1]
    return torch.where(empty, torch.zeros_like(scores), scores)


def _overflowed(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """The rows in which an operation turned a finite score infinite or NaN: [rows, 1] bool."""
    return (torch.isfinite(before) & ~torch.isfinite(after)).any(dim=-1, keepdim=True)


@dataclass(frozen=True)
class ProcessingConfig:
    """How to turn a model's logits into the scores or distribution a strategy decides on."""

    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    min_tokens_to_keep: int = 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.no_repeat_ngram_size > 0

    @property
    def truncates(self) -> bool:
        """Whether warping zeroes part of the vocabulary (so the result may travel sparse)."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


def repetition_penalty(scores: torch.Tensor, history: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's penalty (Keskar et al. 2019) on every id already in the history.

    s'(x) = s(x) / penalty if s(x) > 0 else s(x) · penalty, for x in history.
    scores: [rows, vocab]; history: [rows, length] int64.
    A tiny penalty can overflow float32 upward: `overflow_limit` then keeps the limit (greedy
    over the overflowed ids).
    """
    if penalty == 1.0 or history.shape[-1] == 0:
        return scores
    seen = torch.gather(scores, 1, history)  # [rows, length]
    penalized = torch.where(seen < 0, seen * penalty, seen / penalty)
    out = scores.scatter(1, history, penalized)
    # Only the history's entries change (`isfinite` over a 262k vocabulary costs ~4 ms a row set).
    return overflow_limit(out) if bool(_overflowed(seen, penalized).any()) else out


def banned_ngram_tokens(history: Sequence[int], ngram_size: int) -> list[int]:
    """Tokens that would repeat an n-gram already present in `history`."""
    if ngram_size <= 0 or len(history) < ngram_size:
        return []
    prefix = tuple(history[len(history) - ngram_size + 1 :])
    banned = []
    for start in range(len(history) - ngram_size + 1):
        if tuple(history[start : start + ngram_size - 1]) == prefix:
            banned.append(history[start + ngram_size - 1])
    return banned


def no_repeat_ngram(scores: torch.Tensor, history: torch.Tensor, ngram_size: int) -> torch.Tensor:
    """Set to -inf every token that would complete an n-gram seen before (Paulus et al. 2017).

    scores: [rows, vocab]; history: [rows, length].
    """
    if ngram_size <= 0 or history.shape[-1] < ngram_size:
        return scores
    out = scores.clone()
    for row, tokens in enumerate(history.tolist()):
        banned = banned_ngram_tokens(tokens, ngram_size)
        if not banned:
            continue
        allowed = torch.isfinite(out[row])  # [vocab]
        allowed[banned] = False
        # A ban that would leave nothing to choose lapses for that row.
        if bool(allowed.any()):
            out[row, banned] = NEG_INF
    return out


def temperature(scores: torch.Tensor, value: float) -> torch.Tensor:
    """s / T. T = 1 is the identity.

    As T → 0 (0 included) softmax(s / T) tends to uniform over the row's maxima, i.e. greedy.
    Where s / T would overflow, the row is shifted by its maximum first, (s − max s) / T ≤ 0,
    which leaves softmax unchanged, and a 0/0 at the maximum is its limit, 0.
    """
    if value == 1.0:
        return scores
    if value > 0 and _divides_finitely(scores, value):  # two reductions, not a test per score
        return scores / value
    overflowed = None
    if value > 0:
        scaled = scores / value
        overflowed = _overflowed(scores, scaled)  # [rows, 1]: each row on its own, in any batch
        if not bool(overflowed.any()):
            return scaled
    top = scores.amax(dim=-1, keepdim=True)  # [rows, 1]
    shifted = ((scores - top) / value).nan_to_num(nan=NEG_INF)  # [rows, vocab], ≤ 0 or −inf
    limit = overflow_limit(torch.where(scores >= top, 0.0, shifted))
    return limit if overflowed is None else torch.where(overflowed, limit, scaled)


def top_k(scores: torch.Tensor, k: int, min_tokens_to_keep: int = 1) -> torch.Tensor:
    """Keep the k highest scores (ties with the k-th included), -inf elsewhere."""
    if k <= 0:
        return scores
    k = min(max(k, min_tokens_to_keep), scores.shape[-1])
    kth = torch.topk(scores, k).values[..., -1:]  # [rows, 1]
    return scores.masked_fill(scores < kth, NEG_INF)


# Rows with at most this share of finite scores (after top-k) sort only those (`top_p`).
_FEW_FINITE = 1 / 8
# Sorted survivors sit after −inf padding that keeps their offsets modulo this, so that softmax's
# vectorised sum adds them in the lanes and order it would in the full row, to the bit.
_LANE_ALIGN = 256


def top_p(scores: torch.Tensor, p: float, min_tokens_to_keep: int = 1) -> torch.Tensor:
    """Nucleus sampling (Holtzman et al. 2020): the smallest set whose probability reaches p.

    Sorted ascending, a token goes when the cumulative probability up to it is ≤ 1 − p. After
    top-k few scores are finite: only they are sorted (a 262,144-id row costs 5 ms to sort here),
    with the result of sorting the whole row.
    """
    if p >= 1.0:
        return scores
    vocab = scores.shape[-1]
    count = int((scores > NEG_INF).sum(dim=-1).max())  # NaN is not counted: such rows sort whole
    if min_tokens_to_keep <= count <= vocab * _FEW_FINITE and vocab % _LANE_ALIGN == 0 and not scores.isnan().any():
        few = _top_p_of_few(scores, count, p, min_tokens_to_keep)
        if few is not None:
            return few
    sorted_scores, order = torch.sort(scores, descending=False)
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= (1 - p)
    remove_sorted[..., -min_tokens_to_keep:] = False
    remove = remove_sorted.scatter(1, order, remove_sorted)
    return scores.masked_fill(remove, NEG_INF)


def _top_p_of_few(scores: torch.Tensor, count: int, p: float, keep: int) -> torch.Tensor | None:
    """`top_p` over rows with at most `count` scores above −inf, or None where the cut falls
    inside a tie (`_nucleus`). The ascending sort of a whole row ends with its `count` largest
    scores; before them only −inf, which softmax and the cumulative sum pass over as exact zeros."""
    values, ids = torch.topk(scores, count, dim=-1, largest=True, sorted=True)  # [rows, count]
    remove = _nucleus(values, scores.shape[-1], p, keep)
    if remove is None:
        return None
    return scores.scatter(-1, ids, values.masked_fill(remove, NEG_INF))


def _nucleus(values: torch.Tensor, vocab: int, p: float, keep: int) -> torch.Tensor | None:
    """Which of each row's `count` largest scores (descending, the row's others −inf) `top_p`
    removes: [rows, count] bool. None where the cut separates two equal scores: which of them
    goes is then the whole row's unstable sort's choice. Equal scores on one side of it are
    removed or kept together, in any order."""
    rows, count = values.shape
    ascending = values.flip(-1)
    pad = (vocab - count) % _LANE_ALIGN
    tail = torch.cat([ascending.new_full((rows, pad), NEG_INF), ascending], dim=-1)
    remove = tail.softmax(dim=-1).cumsum(dim=-1)[:, pad:] <= (1 - p)
    remove[..., -keep:] = False
    tied = (ascending[:, 1:] == ascending[:, :-1]) & (ascending[:, 1:] > NEG_INF)  # [rows, count − 1]
    if bool((tied & (remove[:, 1:] != remove[:, :-1])).any()):
        return None
    return remove.flip(-1)


def min_p(scores: torch.Tensor, p: float, min_tokens_to_keep: int = 1) -> torch.Tensor:
    """Min-p sampling (Nguyen et al. 2024): drop tokens with prob < p · max prob."""
    if p <= 0.0:
        return scores
    probs = scores.softmax(dim=-1)
    remove = probs < p * probs.amax(dim=-1, keepdim=True)
    keep = torch.topk(probs, min(min_tokens_to_keep, probs.shape[-1]), dim=-1).indices
    remove.scatter_(-1, keep, False)
    return scores.masked_fill(remove, NEG_INF)


def apply_penalties(scores: torch.Tensor, history: torch.Tensor, config: ProcessingConfig) -> torch.Tensor:
    """Repetition penalty then no-repeat-n-gram: the processors every strategy uses."""
    scores = repetition_penalty(scores, history, config.repetition_penalty)
    return no_repeat_ngram(scores, history, config.no_repeat_ngram_size)


def apply_warpers(scores: torch.Tensor, config: ProcessingConfig) -> torch.Tensor:
    """Temperature → top-k → top-p → min-p: the warpers only sampling uses."""
    scores = temperature(scores, config.temperature)
    scores = top_k(scores, config.top_k, config.min_tokens_to_keep)
    scores = top_p(scores, config.top_p, config.min_tokens_to_keep)
    return min_p(scores, config.min_p, config.min_tokens_to_keep)


def greedy_scores(logits: torch.Tensor, history: torch.Tensor, config: ProcessingConfig) -> torch.Tensor:
    """What greedy decoding takes the argmax of: penalties on the raw float32 logits."""
    return apply_penalties(logits.float(), history, config)


def draw(probs: torch.Tensor, generator: torch.Generator | None = None, uniform: torch.Tensor | None = None) -> torch.Tensor:
    """One id per row of probs [rows, vocab] (≥ 0, positive sums) by inverse transform: the
    first id whose cumulative mass exceeds u · total, u ~ U[0, 1) (drawn from `generator`, or
    `uniform` [rows] float64 drawn before). `torch.multinomial`'s distribution at a fraction of
    its cost; the float64 cumulative sum runs over the chunks that hold mass alone
    (`_cumulative_of_mass`). [rows] int64."""
    cumulative, ids = _cumulative_of_mass(probs)  # [rows, n] each
    total = cumulative[:, -1:]
    if uniform is None:
        uniform = torch.rand(total.shape, generator=generator, dtype=torch.float64, device=probs.device)
    else:
        uniform = uniform.to(device=probs.device, dtype=torch.float64).reshape(total.shape)
    where = torch.searchsorted(cumulative, uniform * total, right=True)  # [rows, 1]
    over = (where >= cumulative.shape[-1]).squeeze(-1)  # u · total rounded up to total: the last id with mass
    chosen = where.clamp(max=cumulative.shape[-1] - 1)
    chosen = chosen.squeeze(-1) if ids is None else ids.gather(-1, chosen).squeeze(-1)
    if bool(over.any()):
        last = probs.shape[-1] - 1 - (probs.flip(-1) > 0).long().argmax(dim=-1)
        chosen = torch.where(over, last, chosen)
    return chosen


_CHUNK = 256  # ids a chunk in `_cumulative_of_mass` and `largest`


def _cumulative_of_mass(probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The float64 cumulative sum of each row, in id order, over the chunks of _CHUNK ids
    that hold mass (then all-zero chunks, to one width), with each column's id; (the whole
    row's, None) where most chunks hold mass. A sequential sum that skips zeros adds the rest
    in the same order, so every id with mass gets the whole row's figure to the bit: after
    top-k, ~40 ids of Gemma's 262,144 take 43 chunks' sum, not the row's (2 ms here)."""
    rows, vocab = probs.shape
    chunks = vocab // _CHUNK
    if vocab % _CHUNK or chunks < 8 or rows == 0:
        return probs.double().cumsum(dim=-1), None
    blocks = probs.reshape(rows, chunks, _CHUNK)
    held = blocks.amax(dim=-1) > 0  # [rows, chunks]
    count = int(held.sum(dim=-1).max())
    if count > chunks // 4:
        return probs.double().cumsum(dim=-1), None
    index = torch.arange(chunks, device=probs.device)
    # Chunks with mass first, each part in id order (keys are distinct: a stable order).
    kept = torch.where(held, index, index + chunks).topk(max(count, 1), dim=-1, largest=False).indices  # [rows, count]
    picked = blocks.gather(1, kept.unsqueeze(-1).expand(-1, -1, _CHUNK)).flatten(1)  # [rows, count·chunk]
    ids = (kept.unsqueeze(-1) * _CHUNK + torch.arange(_CHUNK, device=probs.device)).flatten(1)
    return picked.double().cumsum(dim=-1), ids


def sampling_probs(logits: torch.Tensor, history: torch.Tensor, config: ProcessingConfig) -> torch.Tensor:
    """The distribution sampling draws from: softmax(warp(penalize(logits))). [rows, vocab]."""
    probs = sampling_distribution(logits, history, config)
    return probs if isinstance(probs, torch.Tensor) else scatter_probs(*probs, int(logits.shape[-1]))


def sampling_distribution(
    logits: torch.Tensor, history: torch.Tensor, config: ProcessingConfig
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`sampling_probs` as each row's candidate ids (ascending) and their probabilities, both
    [rows, n], every other id 0, to the bit, where top-k leaves few (`_top_k_sampling_probs`);
    else the dense rows [rows, vocab]."""
    scores = apply_penalties(logits.float(), history, config)
    few = _top_k_sampling_probs(scores, config)
    return few if few is not None else apply_warpers(scores, config).softmax(dim=-1)


def scatter_probs(ids: torch.Tensor, probs: torch.Tensor, vocab: int) -> torch.Tensor:
    """Candidates' probabilities ([rows, n] ids and values) as dense rows [rows, vocab], 0 elsewhere."""
    return probs.new_zeros((ids.shape[0], vocab)).scatter_(-1, ids, probs)


def sample_rows(
    logits: torch.Tensor, history: torch.Tensor, config: ProcessingConfig, uniform: torch.Tensor, dense: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """`draw(sampling_probs(...), uniform=uniform)` to the bit, from each row's candidates alone
    where top-k leaves few (`sampling_distribution`): the draw's float64 running sums meet the
    same non-zero entries in the same id order. Returns the ids [rows], the probabilities
    [rows, vocab] (with `dense`, else None) and each row's largest probability [rows]. One row of
    262,144 ids: no dense row to fill, nor 1,024 chunks to search for mass."""
    probs = sampling_distribution(logits, history, config)
    if isinstance(probs, torch.Tensor):
        return draw(probs, uniform=uniform), probs if dense else None, probs.amax(dim=-1)
    ids, few = probs
    chosen = ids.gather(-1, draw(few, uniform=uniform).unsqueeze(-1)).squeeze(-1)
    return chosen, scatter_probs(ids, few, int(logits.shape[-1])) if dense else None, few.amax(dim=-1)


# Ids `_top_k_sampling_probs` takes beyond top-k's k: room for scores tied with the k-th, and
# for neighbours that dividing by T rounds together.
_CANDIDATE_MARGIN = 16


def _top_k_sampling_probs(
    scores: torch.Tensor, config: ProcessingConfig
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
    """`softmax(apply_warpers(scores))` to the bit from each row's k + _CANDIDATE_MARGIN largest
    scores alone, or None where that is not certain: a score NaN or +inf, T ≤ 0 or one that
    overflows a score, a tie reaching the last candidate, a top-p cut inside a tie. s → s / T is
    monotone, so top-k of the raw scores picks the ids top-k of the warped picks. Warping a whole
    262,144-id row costs 2.8 ms here; this, 0.46 ms (`largest`, then one softmax), and with the
    softmax over the candidates' blocks alone (`_softmax_of_few`), less. Without min-p, the
    candidates' ids (ascending) and probabilities [rows, n]; with it, the dense rows."""
    rows, vocab = scores.shape
    t = config.temperature
    k = min(max(config.top_k, config.min_tokens_to_keep), vocab)
    width = k + _CANDIDATE_MARGIN
    if config.top_k <= 0 or t <= 0 or width > vocab * _FEW_FINITE or vocab % _LANE_ALIGN or rows == 0:
        return None
    if not _divides_finitely(scores, t):
        return None
    raw, ids = largest(scores, width)  # [rows, width], descending
    values = raw / t if t != 1.0 else raw
    kth = values[:, k - 1 : k]  # [rows, 1]
    if not bool((values[:, -1:] < kth).all()):  # a k-th tied to the last candidate, or −inf
        return None
    values = values.masked_fill(values < kth, NEG_INF)
    if config.top_p < 1.0:
        count = int((values > NEG_INF).sum(dim=-1).max())
        if count < config.min_tokens_to_keep:
            return None
        values, ids = values[:, :count], ids[:, :count]  # the survivors lead each row
        remove = _nucleus(values, vocab, config.top_p, config.min_tokens_to_keep)
        if remove is None:
            return None
        values = values.masked_fill(remove, NEG_INF)
    if config.min_p > 0.0:
        warped = scores.new_full(scores.shape, NEG_INF).scatter_(-1, ids, values)
        return min_p(warped, config.min_p, config.min_tokens_to_keep).softmax(dim=-1)
    return _softmax_of_few(ids, values, vocab)


def _softmax_of_few(ids: torch.Tensor, values: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The softmax of [rows, vocab] rows that are −inf but at `ids` ([rows, n], distinct in a
    row), to the bit, as those ids sorted and their probabilities [rows, n]; from n blocks of
    _LANE_ALIGN: the row's i-th smallest id sits in block i at its own offset modulo _LANE_ALIGN,
    so the vectorised sum adds every value in the lane and order the whole row would (the rest
    are exact zeros). 11,008 columns for 43 ids, not 262,144."""
    rows, count = ids.shape
    ids, order = ids.sort(dim=-1)
    values = values.gather(-1, order)
    columns = torch.arange(count, device=ids.device) * _LANE_ALIGN + ids % _LANE_ALIGN  # [rows, n]
    blocks = values.new_full((rows, count * _LANE_ALIGN), NEG_INF).scatter_(-1, columns, values)
    return ids, blocks.softmax(dim=-1).gather(-1, columns)  # [rows, n] each


def largest(scores: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch.topk(scores, width)` (equal scores perhaps in another order) from the `width` chunks
    of _CHUNK ids with the largest maxima: any chunk left out has a maximum ≤ theirs, so it holds
    nothing above the width-th. 5 rows of 262,144 scores: 0.2 ms against topk's 0.9 here."""
    rows, vocab = scores.shape
    if vocab % _CHUNK or vocab // _CHUNK < 8 * width:
        return torch.topk(scores, width, dim=-1)
    chunks = scores.reshape(rows, vocab // _CHUNK, _CHUNK)
    best = torch.topk(chunks.amax(dim=-1), width, dim=-1).indices  # [rows, width]
    picked = chunks.gather(1, best.unsqueeze(-1).expand(-1, -1, _CHUNK))  # [rows, width, _CHUNK]
    values, where = torch.topk(picked.flatten(1), width, dim=-1)  # [rows, width]
    return values, best.gather(1, where // _CHUNK) * _CHUNK + where % _CHUNK


def _divides_finitely(scores: torch.Tensor, t: float) -> bool:
    """Whether `temperature` takes its plain s / t on `scores`: no NaN or +inf, and no finite
    score that s / t turns infinite (division by t > 0 keeps the order, so the extremes decide)."""
    low, high = torch.aminmax(scores)
    if not bool(high < float("inf")):  # NaN or +inf
        return False
    if t >= 1.0:
        return True
    if bool(low == NEG_INF):
        low = scores.masked_fill(scores == NEG_INF, 0.0).amin()
    return bool(torch.isfinite(torch.stack([low, high]) / t).all())


def beam_logprobs(logits: torch.Tensor, history: torch.Tensor, config: ProcessingConfig) -> torch.Tensor:
    """Beam search scores: the penalties applied to log-softmax, as transformers does."""
    return apply_penalties(torch.log_softmax(logits.float(), dim=-1), history, config)
