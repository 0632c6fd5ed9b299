"""Pure-JAX verify/decode attention over a stacked head-major KV cache.

Ground truth for the Pallas kernel and the attention used on CPUs and older GPUs.
Query t of row b sits at absolute position start[b] + t and sees cache slots
s <= start[b] + t of the selected layer (bottom-right causal), so one function
covers decode (T = 1), verify (T = k + 1) and prefill (T = prompt bucket).
A sliding window of W > 0 tokens (Mistral, Qwen2) further hides slots s <= position - W:
each query sees its own token and the W - 1 before it, as transformers' sliding mask.
A draft tree's pass (kernels/tree_mask.py) gives each query its own position and the tree slots it sees.
Without a value cache the values are the keys' first value_dim columns (MLA's latent cache, models/mla.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from specjax.kernels.tree_mask import TreeMask, tree_visible_slots

# Prefill with thousands of queries would build a [B, Hq, T, S] fp32 logits
# tensor; queries are processed in chunks of this many tokens to bound memory.
QUERY_CHUNK = 512


def attention_reference(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array | None,
    layer: jax.Array | int,
    start: jax.Array,
    *,
    scale: float,
    window: jax.Array | int = 0,
    query_chunk: int | None = None,
    tree: TreeMask | None = None,
    value_dim: int | None = None,
) -> jax.Array:
    """Causal GQA attention of q [B,T,Hq,D] against layer `layer` of a [L,B,Hkv,S,D] cache, queries taken
    `query_chunk` (default QUERY_CHUNK) at a time. window: the sliding window in tokens (a scalar, traced or
    not; 0 = none). tree: a draft tree's mask (one chunk: trees are small). v_cache None: the values are
    k_cache's first value_dim columns. Returns [B,T,Hq,Dv]."""
    k = lax.dynamic_index_in_dim(k_cache, layer, axis=0, keepdims=False)
    v = (k[..., :value_dim] if v_cache is None
         else lax.dynamic_index_in_dim(v_cache, layer, axis=0, keepdims=False))
    num_tokens = q.shape[1]
    start = start.astype(jnp.int32)
    # Slots past the last token written by this call are garbage (possibly NaN);
    # zero them so that a zero probability times garbage cannot poison the sum.
    written = jnp.arange(k.shape[2], dtype=jnp.int32)[None, :] < (start + num_tokens)[:, None]
    v = jnp.where(written[:, None, :, None], v, jnp.zeros((), v.dtype))
    window = jnp.asarray(window, jnp.int32)
    if tree is not None:
        return _attend(q, k, v, tree_visible_slots(tree, k.shape[2], window), scale)
    query_chunk = query_chunk or QUERY_CHUNK
    if num_tokens <= query_chunk:
        return _causal(q, k, v, start, scale, window)
    return _attend_in_chunks(q, k, v, start, scale, window, query_chunk)


def visible_slots(positions: jax.Array, num_slots: int, window: jax.Array) -> jax.Array:
    """bool [..., S]: which cache slots a query at each of `positions` [...] sees: every slot up to its own
    position, and within the last `window` positions when window > 0."""
    slots = jnp.arange(num_slots, dtype=jnp.int32)
    positions = positions[..., None]
    in_window = (window <= 0) | (slots > positions - window)
    return (slots <= positions) & in_window


def _causal(q: jax.Array, k: jax.Array, v: jax.Array, first_position: jax.Array,
            scale: float, window: jax.Array) -> jax.Array:
    """Attention of queries at positions first_position[b] + t against one layer's k, v [B,Hkv,S,D]."""
    positions = first_position[:, None] + jnp.arange(q.shape[1], dtype=jnp.int32)[None, :]
    return _attend(q, k, v, visible_slots(positions, k.shape[2], window), scale)


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array, scale: float) -> jax.Array:
    """Attention of queries q [B,T,Hq,D] against one layer's k, v [B,Hkv,S,D] where visible [B,T,S]."""
    batch, num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, value_dim = k.shape[1], v.shape[-1]
    group = num_q_heads // num_kv_heads
    # Group the q heads of one kv head instead of repeating K/V (no copy of the cache).
    grouped_q = q.reshape(batch, num_tokens, num_kv_heads, group, head_dim)
    logits = jnp.einsum("bthgd,bhsd->bhgts", grouped_q, k,
                        preferred_element_type=jnp.float32) * scale
    logits = jnp.where(visible[:, None, None, :, :], logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bhgts,bhsd->bthgd", probs, v.astype(jnp.float32))
    return out.reshape(batch, num_tokens, num_q_heads, value_dim).astype(q.dtype)


def _attend_in_chunks(q: jax.Array, k: jax.Array, v: jax.Array, start: jax.Array,
                      scale: float, window: jax.Array, query_chunk: int) -> jax.Array:
    """_attend over consecutive query chunks of query_chunk tokens (long prefill)."""
    batch, num_tokens, num_q_heads, head_dim = q.shape
    num_chunks = -(-num_tokens // query_chunk)
    padded = jnp.pad(q, ((0, 0), (0, num_chunks * query_chunk - num_tokens), (0, 0), (0, 0)))
    chunks = padded.reshape(batch, num_chunks, query_chunk, num_q_heads, head_dim).swapaxes(0, 1)
    offsets = jnp.arange(num_chunks, dtype=jnp.int32) * query_chunk

    def attend_chunk(chunk_and_offset):
        chunk, offset = chunk_and_offset
        return _causal(chunk, k, v, start + offset, scale, window)

    out = lax.map(attend_chunk, (chunks, offsets))
    out = out.swapaxes(0, 1).reshape(batch, num_chunks * query_chunk, num_q_heads, -1)
    return out[:, :num_tokens]
