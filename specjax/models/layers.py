"""Building blocks shared by the Llama family and the heads built from its decoder layer (EAGLE, MTP): the fused
q/k/v projection, the SwiGLU MLP and the one decoder-layer function; rotary embeddings are models/rope.py's,
RMSNorm and the projections themselves specjax.kernels' (a fused Pallas kernel on GPUs where launches bound
them)."""
from __future__ import annotations

from typing import Any, Callable

import jax

from specjax.kernels.policy import KernelPolicy
from specjax.kernels.projection import projection
from specjax.kernels.projection_reference import rms_norm
from specjax.models.rope import Rotate
from specjax.models.weight_map import split_columns
from specjax.parallel.mesh import pin_heads

# attend(q [B,T,Hq,D], k [B,T,Hkv,D], v [B,T,Hkv,D]) -> [B,T,Hq,D], q and k rotated: a cache's attention
# (writing k and v first) or training's masked attention.
Attend = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]
# attend(layer_index, q [B,T,Hq,D], k [B,T,Hkv,D], v [B,T,Hkv,D]) -> [B,T,Hq,D] for a head's layers (q, k rotated).
LayerAttend = Callable[[int, jax.Array, jax.Array, jax.Array], jax.Array]

__all__ = ["Attend", "LayerAttend", "decoder_layer", "qkv_projection", "rms_norm", "swiglu_mlp"]


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
                  rotate: Rotate, attend: Attend, kernels: KernelPolicy, *,
                  input_norm: jax.Array | None = None) -> jax.Array:
    """One pre-norm Llama decoder layer: h = residual + o(attend(q, k, v)), then h + SwiGLU(mlp_norm(h)).

    q, k, v come from x, normed by `input_norm` inside the q/k/v projection when given (a Llama layer passes
    its input and its input norm; an EAGLE head passes inputs it normed itself). w holds w_qkv (b_qkv), wo,
    mlp_norm, w_gate_up, w_down, and q_norm / k_norm when cfg.qk_norm. positions [B, T] are absolute;
    rotate is the model's rope (models/rope.py).
    """
    eps = cfg.rms_norm_eps
    q, k, v = pin_heads(*qkv_projection(x, w["w_qkv"], w.get("b_qkv"), cfg.num_heads, cfg.num_kv_heads,
                                        cfg.head_dim, norm=input_norm, eps=eps, kernels=kernels))
    if cfg.qk_norm:
        q, k = rms_norm(q, w["q_norm"], eps), rms_norm(k, w["k_norm"], eps)
    q, k = rotate(q, positions), rotate(k, positions)
    B, T = positions.shape
    h = projection(attend(q, k, v).reshape(B, T, -1), w["wo"], residual=residual, kernels=kernels)
    return swiglu_mlp(h, w["w_gate_up"], w["w_down"], norm=w["mlp_norm"], eps=eps, residual=h, kernels=kernels)
