"""The head-major KV cache: one array per K and V, stacked over layers, slot index = absolute position."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.models.model_config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k: jax.Array  # [L, B, Hkv, S, D]
    v: jax.Array  # [L, B, Hkv, S, D]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype) -> KVCache:
    shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def cache_bytes(cfg: ModelConfig, batch: int, max_len: int, dtype) -> int:
    """Bytes init_cache would allocate, for the memory check made before allocating."""
    per_tensor = cfg.num_layers * batch * cfg.num_kv_heads * max_len * cfg.head_dim
    return 2 * per_tensor * jnp.dtype(dtype).itemsize


def write_layer(cache: jax.Array, layer: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """Write new [B, T, Hkv, D] into cache [L, B, Hkv, S, D] at layer `layer`, slots start[b] .. start[b]+T-1.

    Callers keep start + T <= S (the engine allocates slack), since dynamic_update_slice would clamp.
    """
    def write_row(rows: jax.Array, row_new: jax.Array, row_start: jax.Array) -> jax.Array:
        block = jnp.swapaxes(row_new, 0, 1)[None].astype(rows.dtype)  # [1, Hkv, T, D]
        return jax.lax.dynamic_update_slice(rows, block, (layer, 0, row_start, 0))

    return jax.vmap(write_row, in_axes=(1, 0, 0), out_axes=1)(cache, new, start)
