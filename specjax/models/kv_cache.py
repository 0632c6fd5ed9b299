"""The head-major KV cache of the Llama family (and of the heads built from its decoder layer): one array per
K and V, stacked over layers, slot index = absolute position."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from specjax.parallel.mesh import Layout, current_layout, shards_kv_heads


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k: jax.Array  # [L, B, Hkv, S, D]
    v: jax.Array  # [L, B, Hkv, S, D]

    @classmethod
    def init(cls, num_layers: int, batch: int, num_kv_heads: int, max_len: int, head_dim: int, dtype) -> KVCache:
        shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    @staticmethod
    def bytes(num_layers: int, batch: int, num_kv_heads: int, max_len: int, head_dim: int, dtype,
              tensor_parallel_size: int = 1) -> int:
        """Bytes of `init`'s cache one device holds: split by kv head over tensor_parallel_size devices when
        the kv heads divide, whole otherwise."""
        per_tensor = num_layers * batch * num_kv_heads * max_len * head_dim * jnp.dtype(dtype).itemsize
        shards = tensor_parallel_size if shards_kv_heads(num_kv_heads, tensor_parallel_size) else 1
        return 2 * per_tensor // shards

    def specs(self, layout: Layout) -> KVCache:
        """Split by kv head when the layout splits them, else whole on every device."""
        spec = P(None, None, layout.kv_head_axis(self.k.shape[2]))
        return KVCache(spec, spec)

    def gathered(self, source: jax.Array, first: jax.Array) -> KVCache:
        """Slots first[b] + t of every layer and head hold what slots source[b, t] held (all read before any
        is written, so the ranges may overlap)."""
        return KVCache(move_slots(self.k, source, first), move_slots(self.v, source, first))


def move_slots(cache: jax.Array, source: jax.Array, first: jax.Array) -> jax.Array:
    """cache [L, B, H, S, D] with slots first[b] + t set to slots source[b, t] [B, T], in place."""
    picked = jnp.take_along_axis(cache, source[None, :, None, :, None], axis=3)      # [L, B, H, T, D]
    rows = jnp.arange(cache.shape[1])[:, None]
    slots = first[:, None] + jnp.arange(source.shape[1])[None, :]
    return cache.at[:, rows, :, slots].set(picked.transpose(1, 3, 0, 2, 4), mode="drop")


def write_layer(cache: jax.Array, layer: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """Write new [B, T, Hkv, D] into cache [L, B, Hkv, S, D] at layer `layer`, slots start[b] .. start[b]+T-1.

    Traced under a tensor-parallel layout that splits kv heads, each device writes its own heads under
    shard_map (XLA's partitioner would otherwise gather the scatter's indices and updates to every device).
    """
    layout = current_layout()
    kv_axis = None if layout is None else layout.kv_head_axis(cache.shape[2])
    if kv_axis is None:
        return _scatter_rows(cache, layer, new, start)
    by_head = P(None, None, kv_axis)   # cache [L, B, Hkv, S, D] and new [B, T, Hkv, D] alike
    return jax.shard_map(_scatter_rows, mesh=layout.mesh, in_specs=(by_head, P(), by_head, P()), out_specs=by_head,
                         check_vma=False)(cache, jnp.asarray(layer, jnp.int32), new, start)


def _scatter_rows(cache: jax.Array, layer: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """One scatter of B x Hkv windows [T, D] whose indices run over the cache's leading dims (layer, row, kv
    head, slot) in order: XLA keeps that form and updates the cache in place. A window spanning the kv heads
    (indices over layer, row, slot) is rewritten by XLA into this order with a transpose of the whole cache;
    one dynamic_update_slice per row grew the program (and, on CPU, the run time) with the batch. Slots are
    clamped so a window fits (as dynamic_update_slice does); callers keep start + T <= S.
    """
    B, _, Hkv, _ = new.shape
    shape = (B, Hkv, 1)
    indices = jnp.concatenate([jnp.full(shape, layer, jnp.int32), jax.lax.broadcasted_iota(jnp.int32, shape, 0),
                               jax.lax.broadcasted_iota(jnp.int32, shape, 1),
                               jnp.broadcast_to(start.astype(jnp.int32)[:, None, None], shape)], axis=-1)
    numbers = jax.lax.ScatterDimensionNumbers(update_window_dims=(2, 3), inserted_window_dims=(0, 1, 2),
                                              scatter_dims_to_operand_dims=(0, 1, 2, 3))
    return jax.lax.scatter(cache, indices, jnp.swapaxes(new, 1, 2).astype(cache.dtype), numbers,
                           indices_are_sorted=True, unique_indices=True, mode=jax.lax.GatherScatterMode.CLIP)
