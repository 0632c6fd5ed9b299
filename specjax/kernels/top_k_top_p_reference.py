"""Which tokens top-k and top-p keep, by one descending sort of each row (the reference; vLLM's rules).

A row keeps the tokens whose ordered key (`ordered_keys`: int32 with the floats' order) is at least a
threshold. Top-k's threshold is the k-th largest key: tokens tied with it are kept, as in vLLM's top-k.
Top-p keeps a token unless the mass of the tokens strictly above it (within the top-k set) already reaches
top_p, a rule that does not depend on how ties are ordered: its threshold is the largest key c such that
the tokens with keys >= c hold at least top_p of the mass (top_k_top_p_triton.py finds the same c without
sorting).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def _flip_negatives(bits: jax.Array) -> jax.Array:
    """Sign-magnitude int32 <-> two's complement order: flip the magnitude bits of negative words. Its own
    inverse (the sign bit is kept)."""
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def ordered_keys(x: jax.Array) -> jax.Array:
    """int32 keys of float32 values in the same order (-0.0 and 0.0 share one key)."""
    return _flip_negatives(lax.bitcast_convert_type(jnp.where(x == 0, jnp.zeros_like(x), x), jnp.int32))


def from_ordered_keys(keys: jax.Array) -> jax.Array:
    """The float32 values of ordered_keys (its inverse)."""
    return lax.bitcast_convert_type(_flip_negatives(keys), jnp.float32)


def keep_mask_reference(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Tokens kept by top-k then top-p, a bool mask like logits [..., V] f32; top_k, top_p [..., 1].

    top_k <= 0 or >= V and top_p >= 1 switch a filter off. One descending sort serves both, of int32 keys
    rather than the floats, which XLA sorts faster (benchmarks/RESULTS.md).
    """
    vocab = logits.shape[-1]
    keys = ordered_keys(logits)
    sorted_keys = ~lax.sort(~keys, dimension=keys.ndim - 1, is_stable=False)   # descending
    k = jnp.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    k_threshold = jnp.take_along_axis(sorted_keys, k - 1, axis=-1)
    ordered = jnp.where(sorted_keys >= k_threshold, from_ordered_keys(sorted_keys), -jnp.inf)
    probs = jax.nn.softmax(ordered, axis=-1)
    mass_above = jnp.cumsum(probs, axis=-1) - probs
    p = jnp.where(top_p < 1.0, top_p, jnp.inf)
    keep_count = jnp.maximum(jnp.sum(mass_above < p, axis=-1, keepdims=True), 1)
    p_threshold = jnp.take_along_axis(sorted_keys, keep_count - 1, axis=-1)
    return keys >= jnp.maximum(k_threshold, p_threshold)
