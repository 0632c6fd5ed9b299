"""Building blocks shared by the Llama family and the heads built from its decoder layer (EAGLE, MTP): rotary
embeddings (with llama3 scaling), the fused q/k/v projection, the SwiGLU MLP and the one decoder-layer
function; RMSNorm and the projections themselves are specjax.kernels' (a fused Pallas kernel on GPUs where
launches bound them)."""
from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from specjax.kernels.policy import KernelPolicy
from specjax.kernels.projection import projection
from specjax.kernels.projection_reference import rms_norm
from specjax.models.weight_map import split_columns
from specjax.parallel.mesh import pin_heads

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# attend(q [B,T,Hq,D], k [B,T,Hkv,D], v [B,T,Hkv,D]) -> [B,T,Hq,D], q and k rotated: a cache's attention
# (writing k and v first) or training's masked attention.
Attend = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]

__all__ = ["Attend", "apply_rope", "decoder_layer", "qkv_projection", "rms_norm", "rope_inv_freq", "swiglu_mlp"]


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
                   kernels: KernelPolicy = KernelPolicy()) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q [..., Hq, D], k and v [..., Hkv, D] from one matmul with the fused q/k/v weights (one group per kv
    head, weight_map.interleave_columns), of rms_norm(x, norm) when a norm weight is given."""
    qkv = projection(x, w_qkv, norm=norm, eps=eps, kernels=kernels)
    if b_qkv is not None:
        qkv = qkv + b_qkv
    q, k, v = split_columns(qkv, (num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim),
                            num_kv_heads)
    lead = x.shape[:-1]
    return (q.reshape(*lead, num_heads, head_dim), k.reshape(*lead, num_kv_heads, head_dim),
            v.reshape(*lead, num_kv_heads, head_dim))


def swiglu_mlp(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, *, norm: jax.Array | None = None,
               eps: float = 0.0, residual: jax.Array | None = None,
               kernels: KernelPolicy = KernelPolicy()) -> jax.Array:
    """residual + SwiGLU(rms_norm(x, norm)), gate and up fused column by column ([H, 2I])."""
    hidden = projection(x, w_gate_up, norm=norm, eps=eps, activation="swiglu", kernels=kernels)
    return projection(hidden, w_down, residual=residual, kernels=kernels)


def decoder_layer(x: jax.Array, residual: jax.Array, w: dict[str, jax.Array], cfg: Any, positions: jax.Array,
                  inv_freq: np.ndarray, attend: Attend, kernels: KernelPolicy, *,
                  input_norm: jax.Array | None = None) -> jax.Array:
    """One pre-norm Llama decoder layer: h = residual + o(attend(q, k, v)), then h + SwiGLU(mlp_norm(h)).

    q, k, v come from x, normed by `input_norm` inside the q/k/v projection when given (a Llama layer passes
    its input and its input norm; an EAGLE head passes inputs it normed itself). w holds w_qkv (b_qkv), wo,
    mlp_norm, w_gate_up, w_down, and q_norm / k_norm when cfg.qk_norm. positions [B, T] are absolute.
    """
    eps = cfg.rms_norm_eps
    q, k, v = pin_heads(*qkv_projection(x, w["w_qkv"], w.get("b_qkv"), cfg.num_heads, cfg.num_kv_heads,
                                        cfg.head_dim, norm=input_norm, eps=eps, kernels=kernels))
    if cfg.qk_norm:
        q, k = rms_norm(q, w["q_norm"], eps), rms_norm(k, w["k_norm"], eps)
    q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
    B, T = positions.shape
    h = projection(attend(q, k, v).reshape(B, T, -1), w["wo"], residual=residual, kernels=kernels)
    return swiglu_mlp(h, w["w_gate_up"], w["w_down"], norm=w["mlp_norm"], eps=eps, residual=h, kernels=kernels)
