"""Attention of a prompt prefilled from position 0: cuDNN's flash attention where it is faster, else `attention`.

A fresh prompt attends only to itself, so its attention is plain causal self-attention over the K/V it
has just projected ([B, T, Hkv, D]) and needs nothing from the cache. A whole-model prefill through cuDNN
measured faster from 2048 tokens per row (benchmarks/RESULTS.md), so `impl="auto"` takes it from the
policy's `prefill_fused_min_tokens`. Rows past a prompt's length are padding: causal attention keeps them
from reaching any real token.
"""
from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from specjax.kernels.attention import attention
from specjax.kernels.policy import KernelPolicy

# cuDNN's fused attention handles half-precision inputs and head dims that are multiples of 8 up to this.
_CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
_CUDNN_MAX_HEAD_DIM = 128


def prefill_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array | int,
    *,
    scale: float,
    kernels: KernelPolicy = KernelPolicy(),
) -> jax.Array:
    """Causal attention of q [B,T,Hq,D] at positions 0..T-1, whose K/V are k, v [B,T,Hkv,D] and are also
    already written to layer `layer` of the caches [L,B,Hkv,S,D]. Returns [B,T,Hq,D] in q.dtype."""
    if prefill_path(kernels, q.shape, q.dtype) == "fused":
        return causal_self_attention(q, k, v, scale=scale, implementation=kernels.prefill_fused_impl)
    start = jnp.zeros((q.shape[0],), jnp.int32)
    return attention(q, k_cache, v_cache, layer, start, scale=scale, kernels=kernels)


def causal_self_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float,
                          implementation: Literal["cudnn", "xla"] | None) -> jax.Array:
    """jax.nn.dot_product_attention with a causal mask; GQA is native (Hq a multiple of Hkv)."""
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, implementation=implementation)


def prefill_path(kernels: KernelPolicy, q_shape: tuple[int, ...], dtype) -> Literal["fused", "cache"]:
    """"fused" where `impl="auto"` may and should use the fused attention (cuDNN's on a single-device NVIDIA
    sm_80+ GPU; half precision and a head dim it supports; a long enough prompt), else "cache" (the
    `attention` dispatcher over the KV cache). An explicit impl keeps its meaning: "triton" or "reference"
    everywhere."""
    _, tokens, _, head_dim = q_shape
    supported = (kernels.prefill_fused_impl == "xla"
                 or (jnp.dtype(dtype) in _CUDNN_DTYPES and head_dim % 8 == 0 and head_dim <= _CUDNN_MAX_HEAD_DIM))
    return "fused" if supported and kernels.use_fused_prefill(tokens) else "cache"
