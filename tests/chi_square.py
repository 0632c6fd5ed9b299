"""A chi-square goodness-of-fit p-value for the sampling tests (no scipy needed)."""
from __future__ import annotations

import numpy as np
from jax.scipy.special import gammaincc


def chi_square_p_value(tokens: np.ndarray, probs: np.ndarray) -> float:
    """Goodness of fit of drawn tokens to probs (0 if an impossible token was drawn);
    bins expecting < 5 draws are pooled."""
    counts = np.bincount(tokens, minlength=probs.size).astype(np.float64)
    if np.any(counts[probs == 0] > 0):
        return 0.0
    expected = probs.astype(np.float64) * tokens.size
    small = expected < 5
    counts = np.append(counts[~small], counts[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    keep = expected > 0
    stat = np.sum((counts[keep] - expected[keep]) ** 2 / expected[keep])
    dof = keep.sum() - 1
    return float(gammaincc(dof / 2.0, stat / 2.0))
