"""Attention of a prompt prefilled from position 0: cuDNN's flash attention where it is faster, else `attention`.

A fresh prompt attends only to itself, so its attention is plain causal self-attention over the K/V it
has just projected ([B, T, Hkv, D]) and needs nothing from the cache. On the H200 (bf16, RESULTS.md) cuDNN's
fused kernel alone beats our Pallas kernel from 512 tokens on (benchmarks/bench_prefill.py; 8B shape: 34 vs
58 us at 1024, 265 vs 445 us at 4096), but a whole-model prefill gains less (`--model`; not profiled, the
layout copies around cuDNN's call are the likely cost): no gain beyond noise at 1024 tokens (SmolLM2) or
2048 (8B), faster from 2048 on for SmolLM2 (-9% at 2048, -18% at 4096, -24% at 8192) and -2% for the 8B
at 4096. So `impl="auto"` takes it for prompts of PREFILL_CUDNN_MIN_TOKENS or more.
Rows past a prompt's length are padding: causal attention keeps them from reaching any real token.
"""
from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from specjax.kernels.attention import attention
from specjax.kernels.platform import Impl, kernel_mode

# Prompt length (tokens per row) from which a prefill through cuDNN's flash attention is faster (H200, bf16).
PREFILL_CUDNN_MIN_TOKENS = 2048
# cuDNN's flash attention handles half-precision inputs and head dims that are multiples of 8 up to this.
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
    impl: Impl = "auto",
) -> jax.Array:
    """Causal attention of q [B,T,Hq,D] at positions 0..T-1, whose K/V are k, v [B,T,Hkv,D] and are also
    already written to layer `layer` of the caches [L,B,Hkv,S,D]. Returns [B,T,Hq,D] in q.dtype."""
    if prefill_path(impl, jax.devices()[0], q.shape, q.dtype) == "cudnn":
        return causal_self_attention(q, k, v, scale=scale, implementation="cudnn")
    start = jnp.zeros((q.shape[0],), jnp.int32)
    return attention(q, k_cache, v_cache, layer, start, scale=scale, impl=impl)


def causal_self_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float,
                          implementation: Literal["cudnn", "xla"] | None) -> jax.Array:
    """jax.nn.dot_product_attention with a causal mask; GQA is native (Hq a multiple of Hkv)."""
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, implementation=implementation)


def prefill_path(impl: Impl, device: jax.Device, q_shape: tuple[int, ...], dtype) -> Literal["cudnn", "cache"]:
    """"cudnn" where `impl="auto"` may and should use cuDNN's fused attention (a single-device NVIDIA sm_80+
    GPU, half precision, a supported head dim, a long enough prompt), else "cache" (the `attention`
    dispatcher over the KV cache). An explicit impl keeps its meaning: "triton" or "reference" everywhere."""
    _, tokens, _, head_dim = q_shape
    usable = (kernel_mode(impl, interpret=False, device=device) == "auto"
              and jnp.dtype(dtype) in _CUDNN_DTYPES
              and head_dim % 8 == 0 and head_dim <= _CUDNN_MAX_HEAD_DIM)
    return "cudnn" if usable and tokens >= PREFILL_CUDNN_MIN_TOKENS else "cache"
