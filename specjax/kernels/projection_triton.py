"""Decoder projections of few rows as one Pallas kernel lowered through Triton (NVIDIA sm_80+).

At decode and verify a small model's step is bound by kernel launches, not bytes (benchmarks/RESULTS.md
counts them for the default model). XLA compiles a projection of a
single row as a multiply kernel that writes x * W out and a reduce kernel that reads it back, and each
RMSNorm as a kernel of its own. This kernel does the norm, the matmul and the epilogue (SwiGLU, or the
residual add) in one launch:
- one program per (tile of BLOCK_M rows, block of output columns), with enough column blocks to spread the
  weight over the SMs;
- the reduction dimension is read in chunks of 256, software-pipelined so that several are in flight;
- with a norm, a first pass over the program's rows sums their squares (the rows are few: reading them
  twice costs nothing);
- SwiGLU reads the gate and up columns (in (gate j, up j) pairs, as the model families fuse them) as one
  contiguous tile and separates the two halves of the product with exact 0/1 selection dots;
- a row's result depends on that row alone and the tile shapes do not depend on the row count, so a token
  rounds the same in a one-token decode step and in a (k+1)-token verify pass (exact greedy speculation).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from specjax.kernels.projection_reference import output_features

# Triton's matrix units need at least 16 rows per dot; the row tile never changes with the row count.
BLOCK_M = 16
_MIN_BLOCK_N, _MAX_BLOCK_N = 16, 64
_DEFAULT_SM_COUNT = 132


@dataclasses.dataclass(frozen=True)
class ProjectionConfig:
    """Static launch parameters (part of the compiled program)."""

    block_n: int = 16       # output columns per program
    block_k: int = 256      # reduction chunk
    num_warps: int = 4
    num_stages: int = 3


def default_config(in_features: int, out_features: int, sm_count: int = _DEFAULT_SM_COUNT) -> ProjectionConfig:
    """About one column block per SM (a few programs cannot pull a weight through memory fast), chunks of
    256 along the reduction, pipelined three deep (the sweep over the default model's projections is in
    benchmarks/RESULTS.md)."""
    per_sm = max(1, out_features // sm_count)
    block_n = min(_MAX_BLOCK_N, max(_MIN_BLOCK_N, 1 << (per_sm.bit_length() - 1)))
    return ProjectionConfig(block_n=block_n, block_k=min(ProjectionConfig.block_k, _next_power_of_two(in_features)))


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def projection_triton(x: jax.Array, w: jax.Array, *, norm: jax.Array | None = None, eps: float = 0.0,
                      activation: str | None = None, residual: jax.Array | None = None,
                      config: ProjectionConfig | None = None, interpret: bool = False) -> jax.Array:
    """residual + act(rms_norm(x) @ w) for x [..., K], w [K, N]: specjax.kernels.projection_reference."""
    lead, in_features = x.shape[:-1], x.shape[-1]
    rows = math.prod(lead)
    out_features = output_features(w, activation)
    config = config or default_config(in_features, out_features)
    args = [x.reshape(rows, in_features)]
    if norm is not None:
        args.append(norm)
    args.append(w)
    if residual is not None:
        args.append(residual.reshape(rows, out_features))
    kernel = functools.partial(
        _projection_kernel, has_norm=norm is not None, has_residual=residual is not None,
        swiglu=activation == "swiglu",
        rows=rows, in_features=in_features, out_features=out_features, eps=eps, block_n=config.block_n,
        block_k=config.block_k,
        precision=lax.Precision.HIGHEST if x.dtype == jnp.float32 else lax.Precision.DEFAULT)
    out = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(rows, BLOCK_M), pl.cdiv(out_features, config.block_n)),
        in_specs=[pl.BlockSpec() for _ in args],   # unblocked: the kernel indexes its rows and columns
        out_specs=pl.BlockSpec(),
        out_shape=jax.ShapeDtypeStruct((rows, out_features), x.dtype),
        compiler_params=plt.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="specjax_projection",
    )(*args)
    return out.reshape(*lead, out_features)


def _projection_kernel(*refs, has_norm: bool, has_residual: bool, swiglu: bool, rows: int, in_features: int,
                       out_features: int, eps: float, block_n: int, block_k: int,
                       precision: lax.Precision) -> None:
    """One (row tile, column block): [norm pass], the K loop of dots, the epilogue, one masked store."""
    refs = list(refs)
    x_ref = refs.pop(0)
    norm_ref = refs.pop(0) if has_norm else None
    w_ref = refs.pop(0)
    residual_ref = refs.pop(0) if has_residual else None
    (out_ref,) = refs
    row = pl.program_id(0) * BLOCK_M + lax.broadcasted_iota(jnp.int32, (BLOCK_M,), 0)
    col = pl.program_id(1) * block_n + lax.broadcasted_iota(jnp.int32, (block_n,), 0)
    row_ok, col_ok = row < rows, col < out_features
    num_chunks = pl.cdiv(in_features, block_k)

    def x_chunk(chunk):
        ks = chunk * block_k + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        k_ok = ks < in_features
        xs = plt.load(x_ref.at[row[:, None], ks[None, :]], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        return ks, k_ok, xs

    if has_norm:
        def square_sum(chunk, total):
            xs = x_chunk(chunk)[2].astype(jnp.float32)
            return total + jnp.sum(xs * xs, axis=1)

        squares = lax.fori_loop(0, num_chunks, square_sum, jnp.zeros((BLOCK_M,), jnp.float32))
        inv_rms = lax.rsqrt(squares / in_features + eps)

    width = 2 * block_n if swiglu else block_n   # weight columns per program (gate/up interleaved)
    w_col = pl.program_id(1) * width + lax.broadcasted_iota(jnp.int32, (width,), 0)
    w_col_ok = w_col < w_ref.shape[1]

    def accumulate(chunk, total):
        ks, k_ok, xs = x_chunk(chunk)
        if has_norm:
            # As rms_norm: normalise in fp32, round to the model dtype, then scale by the weight.
            scale = plt.load(norm_ref.at[ks], mask=k_ok, other=0.0)
            xs = scale[None, :] * (xs.astype(jnp.float32) * inv_rms[:, None]).astype(xs.dtype)
        w = plt.load(w_ref.at[ks[:, None], w_col[None, :]], mask=k_ok[:, None] & w_col_ok[None, :], other=0.0)
        return total + plt.dot(xs, w, precision=precision)

    product = lax.fori_loop(0, num_chunks, accumulate, jnp.zeros((BLOCK_M, width), jnp.float32))
    dtype = out_ref.dtype
    if swiglu:
        # As the reference: gate and up round to the model dtype, then silu(gate) * up. Column 2j of the
        # product is gate j, 2j + 1 is up j; a dot with a 0/1 matrix picks each half exactly.
        rounded = product.astype(dtype)
        pick = lax.broadcasted_iota(jnp.int32, (width, block_n), 0)
        target = 2 * lax.broadcasted_iota(jnp.int32, (width, block_n), 1)
        gate, up = (plt.dot(rounded, (pick == target + half).astype(dtype), precision=precision)
                    for half in (0, 1))
        silu = (gate / (1.0 + jnp.exp(-gate))).astype(dtype).astype(jnp.float32)
        y = (silu * up).astype(dtype)
    else:
        y = product.astype(dtype)
    mask = row_ok[:, None] & col_ok[None, :]
    if has_residual:
        residual = plt.load(residual_ref.at[row[:, None], col[None, :]], mask=mask, other=0.0)
        y = (residual.astype(jnp.float32) + y.astype(jnp.float32)).astype(dtype)
    plt.store(out_ref.at[row[:, None], col[None, :]], y, mask=mask)
