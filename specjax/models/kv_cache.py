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

    One dynamic_update_slice per row: XLA updates those in place inside the loop, where a vmapped
    update (a scatter) copied the whole cache. Callers keep start + T <= S (dynamic_update_slice clamps).
    """
    blocks = jnp.swapaxes(new, 1, 2).astype(cache.dtype)  # [B, Hkv, T, D]
    for b in range(new.shape[0]):
        cache = jax.lax.dynamic_update_slice(cache, blocks[b][None, None], (layer, b, 0, start[b], 0))
    return cache
