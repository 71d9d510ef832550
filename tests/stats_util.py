"""Chi-square goodness of fit with small cells merged, shared by the losslessness tests."""

from __future__ import annotations

import numpy as np
from scipy.stats import chisquare

ALPHA = 0.001  # significance of every goodness-of-fit test in this suite


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """p-value of `counts` (observed) against `probs` (exact), merging cells whose
    expected count is below 5 into one cell (the textbook validity condition)."""
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    probs = probs / probs.sum()
    expected = probs * counts.sum()
    big = expected >= 5
    obs = list(counts[big])
    exp = list(expected[big])
    if (~big).any():
        obs.append(counts[~big].sum())
        exp.append(expected[~big].sum())
    if exp[-1] < 5 and len(exp) > 2:  # a too-small merged cell joins the smallest big one
        i = int(np.argmin(exp[:-1]))
        obs[i] += obs.pop()
        exp[i] += exp.pop()
    exp = np.array(exp)
    return float(chisquare(np.array(obs), exp * (sum(obs) / exp.sum())).pvalue)
