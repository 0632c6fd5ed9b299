"""Attention dispatcher: the Pallas/Triton kernel on NVIDIA sm_80+, the pure-JAX reference elsewhere.

Traced under a tensor-parallel layout (`specjax.parallel.traced_with`), each device runs the chosen
implementation on its own heads under `shard_map`: XLA cannot partition a Pallas kernel, and attention
needs no collective when q is split by heads and the KV cache by kv heads.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from specjax.kernels.attention_reference import attention_reference
from specjax.kernels.attention_triton import KernelConfig, attention_triton, unsupported_reason
from specjax.kernels.policy import KernelPolicy
from specjax.kernels.tree_mask import TreeMask, check_tree
from specjax.parallel.mesh import Layout, current_layout, shards_kv_heads


def attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array | None,
    layer: jax.Array | int,
    start: jax.Array,
    *,
    scale: float,
    window: jax.Array | int = 0,
    kernels: KernelPolicy = KernelPolicy(),
    config: KernelConfig | None = None,
    tree: TreeMask | None = None,
    value_dim: int | None = None,
) -> jax.Array:
    """Causal GQA attention of q [B,T,Hq,D] against layer `layer` of k/v caches [L,B,Hkv,S,D].

    Query t of row b sits at absolute position start[b] + t and sees slots <= start[b] + t
    (its K/V already written), and with a sliding window of `window` > 0 tokens only the last `window` of
    them (its own included; a scalar, traced or not: one layer of a scanned stack may have a window and the
    next none). A draft tree's pass (`tree`, kernels/tree_mask.py) gives each query its own position and the
    tree slots it sees instead. v_cache None: the values are k_cache's first `value_dim` columns (MLA's latent
    cache, one kv head of kv_lora_rank + rope columns). Returns [B,T,Hq,Dv] in q.dtype; softmax in fp32.
    `kernels` chooses the implementation (`choose_attention`); `config` overrides the kernel's launch parameters.
    """
    _check_inputs(q, k_cache, v_cache, layer, start, scale, window, value_dim)
    if tree is not None:
        check_tree(tree, q.shape[0], q.shape[1])
    chosen = choose_attention(kernels, q.shape, k_cache.shape, value_dim)
    run = _runner(chosen, scale, kernels.interpret, config, value_dim)
    layer, window = jnp.asarray(layer, jnp.int32), jnp.asarray(window, jnp.int32)
    layout = current_layout()
    if layout is None or layout.mesh.size == 1:
        return run(q, k_cache, v_cache, layer, window, start, tree)
    return _per_shard(run, layout, q, k_cache, v_cache, layer, window, start, tree)


def _runner(chosen: Literal["reference", "triton"], scale: float, interpret: bool, config: KernelConfig | None,
            value_dim: int | None):
    def run(q, k_cache, v_cache, layer, window, start, tree):
        if chosen == "reference":
            return attention_reference(q, k_cache, v_cache, layer, start, scale=scale, window=window, tree=tree,
                                       value_dim=value_dim)
        return attention_triton(q, k_cache, v_cache, layer, start, scale=scale, window=window, config=config,
                                interpret=interpret, tree=tree, value_dim=value_dim)

    return run


def _per_shard(run, layout: Layout, q, k_cache, v_cache, layer, window, start, tree) -> jax.Array:
    """`run` on each device's heads under shard_map (head_axis None: every device runs every head). With
    fewer kv heads than head shards the cache is replicated and each shard's q heads all belong to one kv
    head, which it slices out of this layer (a [B, S, D] copy per K and V that the split case avoids) unless
    there is only the one (multi-query attention, MLA's latent cache)."""
    mesh, head_axis = layout.mesh, layout.head_axis
    shards = mesh.shape[head_axis] if head_axis else 1
    num_q_heads, num_kv_heads = q.shape[2], k_cache.shape[2]
    kv_split = shards_kv_heads(num_kv_heads, shards)
    if num_q_heads % shards or (not kv_split and shards % num_kv_heads):
        raise ValueError(f"attention under tensor parallelism: Hq={num_q_heads} must be divisible by the "
                         f"{head_axis!r} mesh axis size {shards}, and Hkv={num_kv_heads} divide it or be "
                         "divisible by it")
    q_spec = P(None, None, head_axis, None)
    kv_spec = P(None, None, head_axis if kv_split else None, None, None)

    def local(q, caches, layer, window, start, tree):
        if not kv_split and num_kv_heads > 1:
            caches, layer = _own_kv_head(caches, layer, head_axis, shards // num_kv_heads)
        return run(q, *caches, layer, window, start, tree)

    caches = (k_cache, v_cache)
    return jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, P(), P(), P(), P()),
                         out_specs=q_spec, check_vma=False)(q, caches, layer, window, start, tree)


def _own_kv_head(caches, layer, head_axis: str, shards_per_kv_head: int):
    """This shard's layer and kv head of replicated caches, as one-layer, one-head caches [1,B,1,S,D]."""
    head = jax.lax.axis_index(head_axis) // shards_per_kv_head

    def take(cache):
        if cache is None:
            return None
        _, batch, _, slots, head_dim = cache.shape
        return jax.lax.dynamic_slice(cache, (layer, 0, head, 0, 0), (1, batch, 1, slots, head_dim))

    return tuple(take(cache) for cache in caches), jnp.zeros((), jnp.int32)


def choose_attention(kernels: KernelPolicy, q_shape: tuple[int, ...], cache_shape: tuple[int, ...],
                     value_dim: int | None = None) -> Literal["reference", "triton"]:
    """The implementation to run: the policy's explicit choice, else the kernel where it runs and fits.
    Unlike the single-device kernels, attention keeps the kernel under tensor parallelism (per shard)."""
    reason = unsupported_reason(q_shape, cache_shape, value_dim)
    if kernels.impl == "triton":
        if reason is not None:
            raise ValueError(f"attention with impl='triton': {reason}; use impl='auto' or 'reference'")
        return "triton"
    if kernels.impl == "reference" or reason is not None:
        return "reference"
    return "triton" if kernels.interpret or kernels.device_has_kernels() else "reference"


def _check_inputs(q, k_cache, v_cache, layer, start, scale, window, value_dim) -> None:
    """Raise a clear error for inconsistent inputs before anything is compiled."""
    if not isinstance(scale, (int, float)):
        raise TypeError(f"attention: scale must be a Python float (static), got {type(scale).__name__}")
    if q.ndim != 4:
        raise ValueError(f"attention: q must be [B, T, Hq, D], got shape {q.shape}")
    if v_cache is None:
        if not isinstance(value_dim, int) or not 0 < value_dim <= k_cache.shape[-1]:
            raise ValueError("attention: without v_cache pass value_dim, the number of k_cache's leading columns "
                             f"that are the values (1 to {k_cache.shape[-1]}), got {value_dim!r}")
        v_cache = k_cache
    elif value_dim is not None:
        raise ValueError("attention: value_dim is for a cache whose keys hold the values; pass v_cache=None")
    if k_cache.ndim != 5 or k_cache.shape != v_cache.shape:
        raise ValueError("attention: k_cache and v_cache must both be [L, B, Hkv, S, D], got "
                         f"{k_cache.shape} and {v_cache.shape}")
    batch, _, num_q_heads, head_dim = q.shape
    _, cache_batch, num_kv_heads, _, cache_head_dim = k_cache.shape
    if cache_batch != batch or cache_head_dim != head_dim:
        raise ValueError(f"attention: cache {k_cache.shape} does not match q {q.shape} in batch "
                         "(axis 1 vs 0) or head_dim (last axis)")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"attention: Hq={num_q_heads} must be a multiple of Hkv={num_kv_heads}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype) or not jnp.issubdtype(q.dtype, jnp.floating):
        raise TypeError("attention: q, k_cache and v_cache must share one float dtype, got "
                        f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if start.shape != (batch,) or not jnp.issubdtype(start.dtype, jnp.integer):
        raise ValueError(f"attention: start must be int [B={batch}], got {start.dtype} {start.shape}")
    for name, value in (("layer", layer), ("window", window)):
        if jnp.ndim(value) != 0 or not jnp.issubdtype(jnp.result_type(value), jnp.integer):
            raise ValueError(f"attention: {name} must be a scalar int, got {jnp.result_type(value)} "
                             f"shape {jnp.shape(value)}")
