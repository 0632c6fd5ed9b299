"""A check both head trainers' tests make: training-time test computes what drafting computes."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from specjax.training.trainer import ttt_forward


def assert_ttt_drafts_as_inference(head, tokens: jnp.ndarray, features: jnp.ndarray, steps: int) -> None:
    """TTT step j at index t equals drafting step j after the committed tokens up to t+1: the head's KV cache
    holds keys from the target's features up to t and the head's own keys after, each step reading the last
    step's hidden state."""
    outputs = ttt_forward(head, tokens, features, steps)
    combined = head.combine(features)
    for t in (0, 3, 8):
        cache = head.init_cache(1, 64)
        out, feed, cache = head(tokens[:, 1:t + 2], combined[:, :t + 1], jnp.zeros((1,), jnp.int32), cache)
        np.testing.assert_allclose(out[0, t], outputs[0][0, t], rtol=1e-4, atol=1e-4)
        hidden = feed[:, t:t + 1]
        for j in range(1, steps):
            out, hidden, cache = head(tokens[:, t + j + 1:t + j + 2], hidden, jnp.asarray([t + j]), cache)
            np.testing.assert_allclose(out[0, 0], outputs[j][0, t], rtol=1e-4, atol=1e-4)
