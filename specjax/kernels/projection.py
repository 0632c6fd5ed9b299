"""Projection dispatcher: the fused Pallas/Triton kernel where launches, not bytes, bound a projection; the
pure-JAX reference (one XLA matmul and its fusions) everywhere else.

`impl="auto"` runs the kernel on NVIDIA sm_80+ for small weights at few rows (decode and verify passes; a
prefill's many rows are a real GEMM for XLA), by the policy's thresholds, outside tensor parallelism (the
partitioner splits the reference's matmul; a Pallas call it cannot). A big weight streams at full
bandwidth through XLA's GEMM, which then costs what its bytes cost.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from specjax.kernels.policy import KernelPolicy
from specjax.kernels.projection_reference import output_features, projection_reference
from specjax.kernels.projection_triton import ProjectionConfig, projection_triton

_ACTIVATIONS = (None, "swiglu")


def projection(x: jax.Array, w: jax.Array, *, norm: jax.Array | None = None, eps: float = 0.0,
               activation: str | None = None, residual: jax.Array | None = None,
               kernels: KernelPolicy = KernelPolicy(), config: ProjectionConfig | None = None) -> jax.Array:
    """residual + act(rms_norm(x) @ w) for x [..., K] and w [K, N]; the output is [..., N], or [..., N/2]
    with activation="swiglu" (gate and up columns interleaved). `kernels` chooses the implementation;
    `config` overrides the kernel's launch parameters."""
    _check_inputs(x, w, norm, activation, residual)
    if kernels.use_projection_kernel(math.prod(x.shape[:-1]), w.size * w.dtype.itemsize):
        return projection_triton(x, w, norm=norm, eps=eps, activation=activation, residual=residual,
                                 config=config, interpret=kernels.interpret)
    return projection_reference(x, w, norm=norm, eps=eps, activation=activation, residual=residual)


def _check_inputs(x, w, norm, activation, residual) -> None:
    """Raise a clear error for inconsistent inputs before anything is compiled."""
    if activation not in _ACTIVATIONS:
        raise ValueError(f"projection: activation={activation!r} is not one of {_ACTIVATIONS}")
    if w.ndim != 2 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"projection: w must be [K, N] with K = x.shape[-1], got x {x.shape} and w {w.shape}")
    if x.dtype != w.dtype or not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"projection: x and w must share one float dtype, got {x.dtype} and {w.dtype}")
    if norm is not None and norm.shape != (w.shape[0],):
        raise ValueError(f"projection: norm must be [K={w.shape[0]}], got {norm.shape}")
    if activation == "swiglu" and w.shape[1] % 2:
        raise ValueError(f"projection: swiglu needs an even number of fused gate/up columns, got {w.shape[1]}")
    out_features = output_features(w, activation)
    if residual is not None and residual.shape != x.shape[:-1] + (out_features,):
        raise ValueError(f"projection: residual must be {x.shape[:-1] + (out_features,)}, got {residual.shape}")
