"""Building blocks shared by the Llama family: rotary embeddings (with llama3 scaling), the fused q/k/v
projection, the SwiGLU MLP; RMSNorm and the projections themselves are specjax.kernels' (a fused Pallas
kernel on GPUs where launches bound them)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from checkpoints_conv.fused_columns import split_columns
from specjax.kernels.projection import projection
from specjax.kernels.projection_reference import rms_norm  # noqa: F401  (the models' RMSNorm)

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> np.ndarray:
    """Inverse frequencies [head_dim // 2] in fp32, following transformers' rope initialisers."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim))
    inv_freq = inv_freq.astype(np.float32)
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return (inv_freq / scaling["factor"]).astype(np.float32)
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"rope_scaling type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")


def _llama3_inv_freq(inv_freq: np.ndarray, s: dict) -> np.ndarray:
    """Llama 3.1's scaling: long wavelengths divided by `factor`, short ones kept, a smooth blend between."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return np.where(medium, blended, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate x [B, T, H, D] by its absolute positions [B, T] (rotate-half layout, as HF checkpoints use)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin).astype(x.dtype)


def qkv_projection(x: jax.Array, w_qkv: jax.Array, b_qkv: jax.Array | None, num_heads: int, num_kv_heads: int,
                   head_dim: int, *, norm: jax.Array | None = None, eps: float = 0.0,
                   impl: str = "auto") -> tuple[jax.Array, jax.Array, jax.Array]:
    """q [..., Hq, D], k and v [..., Hkv, D] from one matmul with the fused q/k/v weights (one group per kv
    head, checkpoints_conv.fused_columns), of rms_norm(x, norm) when a norm weight is given."""
    qkv = projection(x, w_qkv, norm=norm, eps=eps, impl=impl)
    if b_qkv is not None:
        qkv = qkv + b_qkv
    q, k, v = split_columns(qkv, (num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim),
                            num_kv_heads)
    lead = x.shape[:-1]
    return (q.reshape(*lead, num_heads, head_dim), k.reshape(*lead, num_kv_heads, head_dim),
            v.reshape(*lead, num_kv_heads, head_dim))


def swiglu_mlp(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, *, norm: jax.Array | None = None,
               eps: float = 0.0, residual: jax.Array | None = None, impl: str = "auto") -> jax.Array:
    """residual + SwiGLU(rms_norm(x, norm)), gate and up fused column by column ([H, 2I],
    checkpoints_conv.fused_columns)."""
    hidden = projection(x, w_gate_up, norm=norm, eps=eps, activation="swiglu", impl=impl)
    return projection(hidden, w_down, residual=residual, impl=impl)
