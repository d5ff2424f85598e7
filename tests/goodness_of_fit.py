"""Pearson's chi-square goodness of fit for sampled token histograms (scipy.stats.chisquare)."""

from __future__ import annotations

import numpy as np
from scipy.stats import chisquare


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> float:
    """Pearson's goodness of fit of `counts` to `probs`; bins expecting < `min_expected` are pooled.

    A count in a bin of probability 0 is an outright failure (p-value 0).
    """
    counts, probs = np.asarray(counts, dtype=np.float64).ravel(), np.asarray(probs, dtype=np.float64).ravel()
    if counts[probs <= 0].sum() > 0:
        return 0.0
    expected = probs / probs.sum() * counts.sum()
    big = expected >= min_expected
    observed_bins, expected_bins = list(counts[big]), list(expected[big])
    if expected[~big].sum() > 0:
        observed_bins.append(counts[~big].sum())
        expected_bins.append(expected[~big].sum())
    return float(chisquare(observed_bins, expected_bins).pvalue)
