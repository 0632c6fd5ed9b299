"""Grouped matmul (each row times its group's matrix of a stack, plain or FP8 block-scaled; rows sorted by group or
each row's group given): the Pallas kernel where the policy runs kernels, the pure-JAX reference elsewhere."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.kernels.grouped_matmul_reference import grouped_matmul_reference
from specjax.kernels.grouped_matmul_triton import (GroupedMatmulConfig, ScaledRows, as_products, as_stacks,
                                                   f16_rows, group_count, grouped_matmul_triton, takes_f16_rows)
from specjax.kernels.policy import KernelPolicy
from specjax.kernels.projection_reference import rms_norm


def grouped_matmul(x: jax.Array | ScaledRows, w: jax.Array | tuple[jax.Array, ...],
                   group_sizes: jax.Array | None = None, *,
                   row_groups: jax.Array | None = None, row_index: jax.Array | None = None,
                   scale: jax.Array | tuple[jax.Array, ...] | None = None,
                   block: tuple[int, int] | None = None, kernels: KernelPolicy = KernelPolicy(),
                   config: GroupedMatmulConfig | None = None,
                   norm: tuple[jax.Array, float] | None = None, interleaved: bool = False,
                   leading_columns: bool = False, split_partials: bool = False) -> jax.Array | list[jax.Array]:
    """x [M, K] @ w[g] row by row for w [G, K, N]: the rows sorted by group with group_sizes [G] rows in each
    (rows past sum(group_sizes) are zero), or in any order with row_groups [M] naming each row's group (one
    kernel tile per row: for rows of distinct groups), or row_groups [M, R] naming R groups for each row (out
    [M * R, N], its row m * R + r x[m] @ w[row_groups[m, r]]: one token's experts from its one row), or
    `interleaved`: row r times w[r % G] (T tokens of a row per group, token-major: MLA's per-head products, or a
    single matrix's rows in order; no table, sort or transpose to launch); group_sizes with row_index [R] (R a
    multiple of M): the sorted rows are x[row_index // (R / M)] (slots of x's rows, R / M of each: read through
    the index, not copied); with `scale`
    [G, ceil(K/b0), ceil(N/b1)] (block b = `block`) w holds FP8 codes and each block's partial product is scaled.
    w (and scale) may be a tuple of stacks alike but for their group counts, numbered on as one concatenation
    (the kernel reads each where it lies; elsewhere they are concatenated). norm (weight [K], eps):
    rms_norm(x, weight, eps) multiplied instead (inside the kernel's row scaling where it runs). x may be
    ScaledRows (`prepared_rows`: bf16 rows already as the kernel takes them). leading_columns: x [M, K'] with K' >=
    K, its first K columns the rows (read in place where the kernel runs: a slice of them would be a copy). Output
    in the (normalised) rows' dtype, or a plain stack's where that is wider (jnp's promotion). w (and scale) a
    list of such, alike in every shape and dtype: their products of the same rows, as a list (in one launch where
    the kernel runs: sorted expert slots' gate and up). split_partials: the fp32 partial products [S, M, N] of the
    kernel's S splits of K instead, for a reader that sums them in split order (one split [1, M, N] elsewhere)."""
    products, product_scales = as_products(w, scale)
    stacks, scales = as_stacks(products[0], product_scales[0])
    rows_in = x.values if isinstance(x, ScaledRows) else x
    _check_inputs(rows_in[:, :stacks[0].shape[1]] if leading_columns and rows_in.ndim == 2 else rows_in, stacks,
                  group_sizes, row_groups, scales, block, norm, interleaved)
    _check_products(products, product_scales)
    _check_row_index(row_index, group_sizes, x.shape[0])
    if kernels.use_grouped_matmul_kernel(fp8=stacks[0].dtype.itemsize == 1, rows=x.shape[0],
                                         groups=group_count(stacks)):
        return grouped_matmul_triton(x, w, group_sizes, row_groups=row_groups, row_index=row_index, scale=scale,
                                     block=block, config=config, fp8_rows=kernels.fp8_activations, norm=norm,
                                     interleaved=interleaved, interpret=kernels.interpret,
                                     split_partials=split_partials)
    x = x.bf16() if isinstance(x, ScaledRows) else x
    x = x[:, :stacks[0].shape[1]] if leading_columns else x
    x = x if row_index is None else x[row_index // (row_index.shape[0] // x.shape[0])]
    x = x if norm is None else rms_norm(x, *norm)
    outs = [_reference(x, *as_stacks(w_p, scale_p), group_sizes, row_groups, block, interleaved)
            for w_p, scale_p in zip(products, product_scales)]
    outs = [out.astype(jnp.float32)[None] for out in outs] if split_partials else outs
    return outs if isinstance(w, list) else outs[0]


def _reference(x, stacks, scales, group_sizes, row_groups, block, interleaved) -> jax.Array:
    """One product off the kernel: the stacks concatenated, grouped_matmul_reference on them."""
    joined = jnp.concatenate(stacks) if len(stacks) > 1 else stacks[0]
    joined_scale = jnp.concatenate(scales) if len(stacks) > 1 and scales[0] is not None else scales[0]
    if interleaved:   # the same rows sorted by group, and back
        groups = joined.shape[0]
        by_group = np.arange(x.shape[0]).reshape(-1, groups).T.reshape(-1)
        sizes = jnp.full((groups,), x.shape[0] // groups, jnp.int32)
        out = grouped_matmul_reference(x[by_group], joined, sizes, scale=joined_scale, block=block)
        return out[np.argsort(by_group)]
    return grouped_matmul_reference(x, joined, group_sizes, row_groups=row_groups, scale=joined_scale, block=block)


def prepared_rows(x: jax.Array, norm: tuple[jax.Array, float], w: jax.Array, *, rows: int, groups: int,
                  kernels: KernelPolicy = KernelPolicy()) -> tuple[jax.Array, jax.Array | ScaledRows]:
    """rms_norm(x, *norm) for several grouped_matmul calls on stacks like `w` (of `groups` groups, over `rows`
    rows) and another reader: (the normalised rows in x's dtype, the rows to pass those calls). Where the calls'
    kernel takes bf16 rows as scaled float16, both come from one launch (the second as ScaledRows); elsewhere
    both are the normalised rows."""
    if (kernels.use_grouped_matmul_kernel(fp8=w.dtype.itemsize == 1, rows=rows, groups=groups)
            and takes_f16_rows(x.dtype, w, kernels.fp8_activations)):
        values, unscale, normalised = f16_rows(x, kernels.interpret, norm, keep_normalised=True)
        return normalised, ScaledRows(values, unscale)
    normalised = rms_norm(x, *norm)
    return normalised, normalised


def _check_inputs(x, stacks, group_sizes, row_groups, scales, block, norm, interleaved) -> None:
    """Raise a clear error for inconsistent inputs before anything is compiled."""
    w = stacks[0]
    if x.ndim != 2 or any(stack.ndim != 3 for stack in stacks) or x.shape[1] != w.shape[1]:
        raise ValueError(f"grouped_matmul: x must be [M, K] and w [G, K, N], got x {x.shape} and w "
                         f"{[stack.shape for stack in stacks] if len(stacks) > 1 else w.shape}")
    for stack in stacks[1:]:
        if stack.shape[1:] != w.shape[1:] or stack.dtype != w.dtype:
            raise ValueError(f"grouped_matmul: stacks joined in one call must share their [K, N] and dtype, got "
                             f"{w.dtype}{list(w.shape)} and {stack.dtype}{list(stack.shape)}")
    if len(scales) != len(stacks) or len({s is None for s in scales}) > 1:
        raise ValueError("grouped_matmul: pass one scale per stack (a tuple as long as w's), or none")
    if norm is not None and norm[0].shape != (x.shape[1],):
        raise ValueError(f"grouped_matmul: norm's weight must be [K={x.shape[1]}], got {list(norm[0].shape)}")
    if interleaved:
        if group_sizes is not None or row_groups is not None:
            raise ValueError("grouped_matmul: interleaved rows name their groups themselves (row r: group r % G): "
                             "pass no group_sizes or row_groups with it")
        if x.shape[0] % group_count(stacks):
            raise ValueError(f"grouped_matmul: interleaved rows come a row per group, so x's {x.shape[0]} rows must "
                             f"be a multiple of the {group_count(stacks)} groups")
    else:
        _check_groups(x, stacks, group_sizes, row_groups)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"grouped_matmul: x must be floating point, got {x.dtype}")
    if (scales[0] is None) != (block is None):
        raise ValueError("grouped_matmul: pass scale= and block= together (an FP8 stack's block scales and shape)")
    if w.dtype.itemsize == 1:
        if scales[0] is None:
            raise ValueError("grouped_matmul: a 1-byte (FP8) stack needs its block scales: pass scale= and block=")
    for stack, scale in zip(stacks, scales):
        if scale is not None:
            expected = (stack.shape[0], -(-stack.shape[1] // block[0]), -(-stack.shape[2] // block[1]))
            if scale.shape != expected:
                raise ValueError(f"grouped_matmul: scale must be {list(expected)} for w {list(stack.shape)} in "
                                 f"blocks of {list(block)}, got {list(scale.shape)}")


def _check_products(products: list, scales: list) -> None:
    """Several products (a list w) of one launch: stacks alike in every shape and dtype, scaled alike."""
    if len(scales) != len(products):
        raise ValueError(f"grouped_matmul: a list of {len(products)} products takes a list of as many scales (or "
                         f"none), got {len(scales)}")
    first, first_scales = as_stacks(products[0], scales[0])
    for w_p, scale_p in zip(products[1:], scales[1:]):
        stacks, stack_scales = as_stacks(w_p, scale_p)
        scale_shapes = [None if s is None else s.shape for s in stack_scales]
        if ([(s.shape, s.dtype) for s in stacks] != [(s.shape, s.dtype) for s in first]
                or scale_shapes != [None if s is None else s.shape for s in first_scales]):
            raise ValueError(f"grouped_matmul: the products of one call must be alike in every stack's shape, dtype "
                             f"and scale, got {[list(s.shape) for s in first]} and {[list(s.shape) for s in stacks]}")


def _check_row_index(row_index, group_sizes, rows: int) -> None:
    if row_index is None:
        return
    if group_sizes is None:
        raise ValueError("grouped_matmul: row_index reads rows sorted by group: pass it with group_sizes")
    if row_index.ndim != 1 or not jnp.issubdtype(row_index.dtype, jnp.integer) or row_index.shape[0] % rows:
        raise ValueError(f"grouped_matmul: row_index must be integers [R], R a multiple of x's {rows} rows, got "
                         f"{row_index.dtype}{list(row_index.shape)}")


def _check_groups(x, stacks, group_sizes, row_groups) -> None:
    """Exactly one of group_sizes [G] and row_groups [M] or [M, R], integers."""
    if (group_sizes is None) == (row_groups is None):
        raise ValueError("grouped_matmul: pass exactly one of group_sizes (rows sorted by group), row_groups "
                         "(each row's group) and interleaved=True")
    groups, name, (axis, length) = ((group_sizes, "group_sizes", ("G", group_count(stacks))) if row_groups is None
                                    else (row_groups, "row_groups", ("M", x.shape[0])))
    ranks = (1,) if row_groups is None else (1, 2)
    if groups.shape[:1] != (length,) or groups.ndim not in ranks or not jnp.issubdtype(groups.dtype, jnp.integer):
        shapes = f"[{axis}={length}]" + ("" if row_groups is None else f" or [{axis}={length}, R]")
        raise ValueError(f"grouped_matmul: {name} must be integers {shapes}, got {groups.dtype}{list(groups.shape)}")
