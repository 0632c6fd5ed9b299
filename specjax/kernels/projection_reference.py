"""Pure-JAX decoder projections: an optional RMSNorm before, the matmul, an optional SwiGLU or residual after.

Ground truth for the fused Pallas kernel, and the projection XLA compiles everywhere the kernel is not used
(CPUs, large weights, prefill, tensor parallelism).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp



def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in fp32 and cast back, as transformers does."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def swiglu(gate_up: jax.Array) -> jax.Array:
    """silu(gate) * up of a fused gate/up product [..., 2I] whose columns come in (gate j, up j) pairs, the
    order the model families fuse them in."""
    pairs = gate_up.reshape(*gate_up.shape[:-1], gate_up.shape[-1] // 2, 2)
    return jax.nn.silu(pairs[..., 0]) * pairs[..., 1]


def output_features(w: jax.Array, activation: str | None) -> int:
    """Width of the projection's output: w's columns, half of them after SwiGLU (gate and up fused)."""
    return w.shape[1] // 2 if activation == "swiglu" else w.shape[1]


def projection_reference(x: jax.Array, w: jax.Array, *, norm: jax.Array | None = None, eps: float = 0.0,
                         activation: str | None = None, residual: jax.Array | None = None) -> jax.Array:
    """residual + act(rms_norm(x) @ w): x [..., K], w [K, N] -> [..., N] (N/2 with activation="swiglu")."""
    if norm is not None:
        x = rms_norm(x, norm, eps)
    y = x @ w
    if activation == "swiglu":
        y = swiglu(y)
    return y if residual is None else residual + y
