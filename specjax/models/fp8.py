"""FP8 (e4m3) block-quantized weights, DeepSeek-V3's checkpoint format: a float8_e4m3fn matrix and a float32
`weight_scale_inv` with one entry per block (128 x 128 in real checkpoints), so that
    W[block] = W_fp8[block] * scale_inv[block]
and scale_inv = amax(|W[block]|) / 448 (448: e4m3's largest finite value). Edge blocks (a dim not a multiple of
the block) cover what is left; scale_inv has shape [ceil(rows / block_rows), ceil(cols / block_cols)].

`quantize_blocks` and `dequantize_blocks` work on any 2-D orientation: HF stores [out, in] with a scale grid
[ceil(out/128), ceil(in/128)]. `fp8_matmul` takes the weight in specjax's [in, out] orientation, i.e. the HF matrix
and its scale grid both transposed (as loaders transpose every matrix).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import jax
import jax.numpy as jnp
from jax import lax

from specjax.kernels.grouped_matmul import grouped_matmul
from specjax.kernels.grouped_matmul_triton import GroupedMatmulConfig, ScaledRows, default_config
from specjax.kernels.policy import KernelPolicy
from specjax.kernels.projection_reference import rms_norm

FP8_BLOCK = (128, 128)
E4M3_MAX = 448.0


def quantize_blocks(w: jax.Array, block: tuple[int, int] = FP8_BLOCK) -> tuple[jax.Array, jax.Array]:
    """(w_fp8 [R, C] float8_e4m3fn, scale_inv [ceil(R/br), ceil(C/bc)] float32) of a 2-D weight; an all-zero block
    gets scale 1. XLA divides by multiplying with a rounded reciprocal, so a scale may be an ulp off an IEEE
    division's (and, rarely, a code one e4m3 step off); checkpoints to be compared bit for bit are made on host."""
    blocks = _blocks(w.astype(jnp.float32), block)                       # [Rb, br, Cb, bc]
    amax = jnp.abs(blocks).max(axis=(1, 3))
    scale_inv = jnp.where(amax > 0, amax / E4M3_MAX, 1.0).astype(jnp.float32)
    scaled = jnp.clip(blocks / scale_inv[:, None, :, None], -E4M3_MAX, E4M3_MAX)
    return _unblock(scaled, w.shape).astype(jnp.float8_e4m3fn), scale_inv


def dequantize_blocks(w_fp8: jax.Array, scale_inv: jax.Array, block: tuple[int, int] = FP8_BLOCK,
                      dtype=jnp.float32) -> jax.Array:
    """W_fp8 * scale_inv per block, as `dtype`, for either orientation (the scale grid matching the matrix)."""
    blocks = _blocks(w_fp8, block).astype(jnp.float32) * scale_inv[:, None, :, None]
    return _unblock(blocks, w_fp8.shape).astype(dtype)


def fp8_matmul(x: jax.Array, w_fp8: jax.Array, scale_inv: jax.Array,
               block: tuple[int, int] = FP8_BLOCK) -> jax.Array:
    """x [..., in] @ W for W [in, out] stored as float8 with scale_inv [ceil(in/b_in), ceil(out/b_out)], in x's dtype.

    Fewer tokens than b_in: the scales go on the partial products, not on the weight. The fp8 weight, viewed as
    blocks, is converted to x's dtype inside the contraction (the only weight-sized operation, one XLA may fuse
    into the matmul), each block's fp32 partial product is multiplied by that block's scale and the partials are
    summed. The partials hold tokens x in/b_in x out values; from b_in tokens on they would outgrow a dequantized
    weight (in x out), so there the weight is dequantized to x's dtype and one matmul follows."""
    tokens = math.prod(x.shape[:-1])
    if tokens >= block[0]:
        return jnp.matmul(x, dequantize_blocks(w_fp8, scale_inv, block, x.dtype),
                          preferred_element_type=jnp.float32).astype(x.dtype)
    (rows, cols), block_in = w_fp8.shape, block[0]
    padded_in = -(-rows // block_in) * block_in
    x_blocks = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, padded_in - rows)])
    x_blocks = x_blocks.reshape(*x.shape[:-1], padded_in // block_in, block_in)      # [..., Ib, bi]
    w_blocks = _blocks(w_fp8, block).astype(x.dtype)                                   # [Ib, bi, Ob, bo]
    partial = jnp.einsum("...ic,icoj->...ioj", x_blocks, w_blocks, preferred_element_type=jnp.float32)
    out = jnp.einsum("...ioj,io->...oj", partial, scale_inv)
    return out.reshape(*x.shape[:-1], -1)[..., :cols].astype(x.dtype)


def linear(x: jax.Array | ScaledRows, weights: Mapping[str, jax.Array], name: str, block: tuple[int, int] | None,
           kernels: KernelPolicy = KernelPolicy(), norm: tuple[jax.Array, float] | None = None,
           leading_columns: bool = False, split_partials: bool = False) -> jax.Array:
    """x @ weights[name]: through its block scales `weights[name + "_scale"]` (shape `block`, [in, out]
    orientation) when the weight is FP8, a plain matmul otherwise. At decode and verify sizes, where kernels run
    (KernelPolicy.use_grouped_matmul_kernel), the product is the grouped matmul kernel's with one group: FP8 codes
    read as stored, with the same per-block scaling as fp8_matmul's, below a block's rows of tokens; a plain
    weight at the policy's few rows. norm (weight, eps): rms_norm(x, weight, eps) multiplied instead, inside the
    kernel's row scaling where that runs (an FP8 weight's bf16 rows). leading_columns: x may be wider than the
    weight's rows, its leading columns the input (read in place by the kernel: no sliced copy). x may be
    ScaledRows [M, K] (rows already as the kernel takes them against an FP8 weight). split_partials: the fp32
    partial products [S, M, N] of the kernel's splits of K, for a reader that sums them (one [1, M, N] off it)."""
    scale = weights.get(name + "_scale")
    tokens = math.prod(x.shape[:-1])
    fp8 = scale is not None
    if in_kernel(tokens, fp8, block, kernels):
        out = grouped_matmul(x if isinstance(x, ScaledRows) else x.reshape(tokens, -1), weights[name][None],
                             interleaved=True,   # one group: no table
                             scale=scale[None] if fp8 else None, block=block if fp8 else None, kernels=kernels,
                             norm=norm, config=_projection_config(weights[name], kernels),
                             leading_columns=leading_columns, split_partials=split_partials)
        return out if split_partials else out.reshape(*x.shape[:-1], -1)
    x = x.bf16() if isinstance(x, ScaledRows) else x
    if split_partials:
        out = linear(x, weights, name, block, kernels, norm, leading_columns)
        return out.reshape(1, tokens, -1).astype(jnp.float32)
    x = x[..., :weights[name].shape[0]] if leading_columns else x
    x = x if norm is None else rms_norm(x, *norm)
    if not fp8:
        return x @ weights[name]
    return fp8_matmul(x, weights[name], scale, block)


def _projection_config(w: jax.Array, kernels: KernelPolicy) -> GroupedMatmulConfig | None:
    """The kernel's launch parameters for one FP8 matrix under `kernels` (None: the kernel's defaults)."""
    if kernels.projection_programs is None or w.dtype.itemsize != 1:
        return None
    return dataclasses.replace(default_config(1, 1), target_programs=kernels.projection_programs)


def in_kernel(tokens: int, fp8: bool, block: tuple[int, int] | None, kernels: KernelPolicy) -> bool:
    """Whether `linear` runs a weight (FP8 or not) at `tokens` rows in the grouped matmul kernel: FP8 below its
    block's rows of tokens (beyond, a dequantized GEMM reads it once), a plain one at the policy's few rows."""
    return (not fp8 or tokens < block[0]) and kernels.use_grouped_matmul_kernel(fp8=fp8, rows=tokens, groups=1)


def dequantize_stack(weights: Mapping[str, jax.Array], name: str, block: tuple[int, int] | None, dtype,
                     ids: jax.Array | None = None) -> jax.Array:
    """A stack of matrices weights[name] [..., R, C] (experts), taken at `ids` on the leading axis when given,
    dequantized to `dtype` through `weights[name + "_scale"]` [..., R/b, C/b] when it is FP8 (only the taken
    slices are read)."""
    w, scale = weights[name], weights.get(name + "_scale")
    if ids is not None:
        w, scale = take(w, ids), None if scale is None else scale[ids]
    if scale is None:
        return w
    lead = w.shape[:-2]
    flat = jax.vmap(lambda m, s: dequantize_blocks(m, s, block, dtype))(w.reshape(-1, *w.shape[-2:]),
                                                                        scale.reshape(-1, *scale.shape[-2:]))
    return flat.reshape(*lead, *w.shape[-2:])


def take(w: jax.Array, ids: jax.Array) -> jax.Array:
    """w[ids] on the leading axis, reading only those slices. A float8 gather goes through its bytes: XLA's CPU
    backend converts a float8 gather's whole operand to float16 first (the GPU's did not, compiled for
    DeepSeek-V3's expert stacks)."""
    if not (jnp.issubdtype(w.dtype, jnp.floating) and w.dtype.itemsize == 1):   # any float8 format
        return w[ids]
    return lax.bitcast_convert_type(lax.bitcast_convert_type(w, jnp.uint8)[ids], w.dtype)


def _blocks(w: jax.Array, block: tuple[int, int]) -> jax.Array:
    """w [R, C] zero-padded to whole blocks and viewed as [R/br, br, C/bc, bc]."""
    (rows, cols), (block_rows, block_cols) = w.shape, block
    padded = jnp.pad(w, ((0, -rows % block_rows), (0, -cols % block_cols)))
    return padded.reshape(padded.shape[0] // block_rows, block_rows, padded.shape[1] // block_cols, block_cols)


def _unblock(blocks: jax.Array, shape: tuple[int, int]) -> jax.Array:
    """The [R, C] matrix back out of `_blocks`' view, padding dropped."""
    rows_blocks, block_rows, cols_blocks, block_cols = blocks.shape
    return blocks.reshape(rows_blocks * block_rows, cols_blocks * block_cols)[:shape[0], :shape[1]]
