"""Pure-JAX grouped matmul: each row times its group's matrix of a stack (rows sorted by group, or in any order
with each row's group given), the stack plain or FP8 with block scales. Ground truth for the Pallas kernel; it
reads each row's whole matrix (tests only).

With block scales the scale goes on each block's fp32 partial product, as the kernel applies it, not on the
weight: out[m, n] = sum_b scale[g, b, n // bn] * sum_{k in block b} x[m, k] w[g, k, n].
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def product_dtype(rows_dtype, weight_dtype):
    """The dtype of rows times a stack: the rows' for a 1-byte (FP8) stack, else the wider of the two (jnp's
    promotion: bf16 rows times an fp32 matrix, a router's, multiply in fp32)."""
    weight_dtype = jnp.dtype(weight_dtype)
    return rows_dtype if weight_dtype.itemsize == 1 else jnp.promote_types(rows_dtype, weight_dtype)


def sorted_row_groups(group_sizes: jax.Array, rows: int) -> jax.Array:
    """The group of each of `rows` rows sorted by group (rows past sum(group_sizes): the last group)."""
    return jnp.repeat(jnp.arange(group_sizes.shape[0]), group_sizes, total_repeat_length=rows)


def grouped_matmul_reference(x: jax.Array, w: jax.Array, group_sizes: jax.Array | None = None, *,
                             row_groups: jax.Array | None = None, scale: jax.Array | None = None,
                             block: tuple[int, int] | None = None) -> jax.Array:
    """x [M, K] @ w[group of the row] for w [G, K, N], in x's dtype (a plain stack of a wider dtype: in its). The
    rows' groups: group_sizes [G] for rows sorted by group (rows past sum(group_sizes) are zero, as
    lax.ragged_dot), or row_groups [M] for rows in any order, or row_groups [M, R] for R groups per row (out
    [M * R, N]: each row repeated R times)."""
    if row_groups is not None and row_groups.ndim == 2:
        x, row_groups = jnp.repeat(x, row_groups.shape[1], axis=0), row_groups.reshape(-1)
    rows, in_features = x.shape
    groups = sorted_row_groups(group_sizes, rows) if row_groups is None else row_groups
    dtype = product_dtype(x.dtype, w.dtype)
    x, weights = x.astype(dtype), w[groups].astype(dtype)                             # [M, K, N]
    if scale is None:
        out = jnp.einsum("mk,mkn->mn", x, weights, preferred_element_type=jnp.float32)
    else:
        block_in, block_out = block
        padded_in = -(-in_features // block_in) * block_in
        x_blocks = jnp.pad(x, ((0, 0), (0, padded_in - in_features))).reshape(rows, -1, block_in)
        w_blocks = jnp.pad(weights, ((0, 0), (0, padded_in - in_features), (0, 0)))
        w_blocks = w_blocks.reshape(rows, -1, block_in, w.shape[2])
        partial = jnp.einsum("mbc,mbcn->mbn", x_blocks, w_blocks, preferred_element_type=jnp.float32)
        column_scale = jnp.repeat(scale[groups], block_out, axis=2)[:, :, :w.shape[2]]   # [M, Kb, N]
        out = (partial * column_scale).sum(axis=1)
    if row_groups is None:
        out = jnp.where((jnp.arange(rows) < group_sizes.sum())[:, None], out, 0)
    return out.astype(dtype)
