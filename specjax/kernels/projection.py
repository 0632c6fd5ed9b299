"""Projection dispatcher: the fused Pallas/Triton kernel where launches, not bytes, bound a projection; the
pure-JAX reference (one XLA matmul and its fusions) everywhere else.

`impl="auto"` runs the kernel on NVIDIA sm_80+ for a weight of at most SMALL_WEIGHT_BYTES and at most
MAX_KERNEL_ROWS rows (decode and verify passes; a prefill's many rows are a real GEMM for XLA), outside
tensor parallelism (the partitioner splits the reference's matmul; a Pallas call it cannot). A weight that
big streams at full bandwidth through XLA's GEMM, which then costs what its bytes cost.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from specjax.kernels.platform import IMPLS, Impl, kernel_mode
from specjax.kernels.projection_reference import output_features, projection_reference
from specjax.kernels.projection_triton import ProjectionConfig, projection_triton

# At ~3.5 TB/s 4 MiB take ~1.2 us, under one kernel launch: below this, launches are the cost.
SMALL_WEIGHT_BYTES = 4 << 20
# Rows up to a verify pass of a large batch (64 x (k + 1)); each row tile re-reads the weight from L2.
MAX_KERNEL_ROWS = 512
_ACTIVATIONS = (None, "swiglu")


def projection(x: jax.Array, w: jax.Array, *, norm: jax.Array | None = None, eps: float = 0.0,
               activation: str | None = None, residual: jax.Array | None = None, impl: Impl = "auto",
               interpret: bool = False, config: ProjectionConfig | None = None) -> jax.Array:
    """residual + act(rms_norm(x) @ w) for x [..., K] and w [K, N]; the output is [..., N], or [..., N/2]
    with activation="swiglu" (gate and up columns interleaved). `interpret=True` runs the kernel in Pallas
    interpret mode (CPU tests)."""
    _check_inputs(x, w, norm, activation, residual, impl)
    if _use_kernel(impl, interpret, x, w):
        return projection_triton(x, w, norm=norm, eps=eps, activation=activation, residual=residual,
                                 config=config, interpret=interpret)
    return projection_reference(x, w, norm=norm, eps=eps, activation=activation, residual=residual)


def _use_kernel(impl: Impl, interpret: bool, x: jax.Array, w: jax.Array) -> bool:
    mode = kernel_mode(impl, interpret)
    rows = math.prod(x.shape[:-1])
    small = rows <= MAX_KERNEL_ROWS and w.size * w.dtype.itemsize <= SMALL_WEIGHT_BYTES
    return mode == "triton" or (mode == "auto" and small)


def _check_inputs(x, w, norm, activation, residual, impl) -> None:
    """Raise a clear error for inconsistent inputs before anything is compiled."""
    if impl not in IMPLS:
        raise ValueError(f"projection: impl={impl!r} is not one of {IMPLS}")
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
