"""Drawing a token from the scores a service returned, with the request's generator."""

from __future__ import annotations

import torch

from specwire.processing import draw
from specwire.session import ScoreKind, Scores


def choose(scores: Scores, row: int, generator: torch.Generator | None) -> int:
    """Argmax ids as they are; probabilities sampled (dense or sparse) with `generator`."""
    if scores.kind == ScoreKind.ARGMAX:
        assert scores.argmax_ids is not None
        return int(scores.argmax_ids[row])
    if scores.kind != ScoreKind.PROBS:
        raise ValueError(f"cannot draw a token from {scores.kind.name} scores")
    if scores.dense is not None:
        return int(draw(scores.dense[row : row + 1], generator)[0])
    assert scores.sparse_ids is not None and scores.sparse_values is not None
    index = int(torch.multinomial(scores.sparse_values[row].float(), 1, generator=generator))
    return int(scores.sparse_ids[row, index])
