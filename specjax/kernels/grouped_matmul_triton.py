"""Grouped matmul over a stack of matrices as one Pallas kernel lowered through Triton (NVIDIA sm_89+ for FP8).

MoE experts at decode and verify: a few rows per selected expert, most experts selected by no row. The rows come
sorted by group; a table (computed beside the call) cuts each group's rows into tiles of BLOCK_M, and one program
per (tile, block of output columns, split of K) streams its part of its group's matrix through a K loop. So each
selected matrix is read once per tile of its rows, and an unselected one never (XLA's ragged_dot on GPU reads every
group).
- Up to MAX_SPLIT_ROWS rows (decode and verify passes: 512 tokens of top-8 routing), K is split so that the tiles
  of a decode step (a token's experts, or one dense matrix's one tile) already make enough programs to keep every
  SM pulling from memory; the fp32 partial products are summed in split order beside the call. Below that bound
  the split count depends on the stack's shape alone, never on the row count: splits change how a row's sum
  associates, so a count that followed the rows would round a token differently in a decode step and in a
  verify pass.
- FP8 matrices stay FP8 in memory: a K chunk is one 128-row scale block, converted to the activations' dtype in
  registers; its fp32 partial product is multiplied by the block's column scales and added.
- A 1-byte stack with an even column count is read as uint16 pairs of adjacent columns: the low byte is the even
  column, the high byte the odd one, each half its own dot. Pairs are copied in 16-byte pieces where 1-byte
  elements get 8-byte ones, which outweighs the unpacking (25-40% faster on the H200: benchmarks/RESULTS.md).
  A stack of 2 to 4 GiB must be read so: Pallas computes element offsets in int32 up to 4 GiB of array (64-bit
  past it), and those of a 1-byte array overflow from 2 GiB. Odd column counts are loaded as they are.
- bf16 rows meet an FP8 stack as float16 rows (`f16_rows`), each scaled by the power of two that puts its largest
  value in [2^14, 2^15), undone on the results: e4m3 codes become float16 in one packed conversion per two, where
  bfloat16 takes a second conversion per element, and conversions run on a narrow pipe (compiled for the H200, the
  K loop's conversions go from 96 to 32 per chunk and thread: benchmarks/RESULTS.md, "float16 rows for FP8
  stacks"). The products are the bf16 row's exactly, except for elements below 2^-28 of the row's largest, which
  round by at most 2^-39 of it.
- `fp8_rows`: an FP8 stack multiplies FP8 rows instead, each row's K chunk (a scale block's rows, 128 in
  DeepSeek's checkpoints) quantized to e4m3 with its own scale (amax / 448: DeepSeek-V3's activation scheme, as
  vLLM runs block-FP8 checkpoints): an FP8 x FP8 dot and no conversion of the weights in the loop, at the cost
  of the rows' precision.
- A row's result depends on its own row alone and the tile shapes never change with the row count, so a token
  rounds the same in a decode step and in a verify pass (exact greedy speculation) while both stay within
  MAX_SPLIT_ROWS rows.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from specjax.kernels.grouped_matmul_reference import product_dtype
from specjax.kernels.projection_reference import rms_norm

# Triton's matrix units need at least 16 rows per dot.
BLOCK_M = 16
# Programs one tile's K splits aim for (about four per SM of an H100 / H200); past MAX_SPLIT_ROWS rows (prefill)
# the tiles themselves are enough and K is not split (its partial products would outgrow the output).
_TARGET_PROGRAMS = 4 * 132
MAX_SPLIT_ROWS = 4096
# The row tiles K's split is planned for in a stack of experts: about a decode step's (one token's top-8 slots
# to a few tokens'). The H100 sweep's best splits for DeepSeek-V3's experts at 8 and 64 slots follow from it
# (routed gate / up 2, down 1: benchmarks/RESULTS.md, "The grouped kernel's launch parameters with float16 rows").
PLANNED_EXPERT_TILES = 16
# The widest block of a row f16_rows loads at once.
F16_ROWS_BLOCK = 32768


class ScaledRows(NamedTuple):
    """bf16 rows as the kernel multiplies them against a 1-byte stack (`f16_rows`): float16 values [M, K], each row
    scaled by a power of two, and the powers of two that undo it [M] (float32). Made once (with a norm: beside the
    normalised rows themselves) for several calls on the same rows; the products are the bf16 rows'."""

    values: jax.Array
    unscale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    def bf16(self) -> jax.Array:
        """The bf16 rows back (exact but for elements below 2^-28 of their row's largest)."""
        return (self.values.astype(jnp.float32) * self.unscale[:, None]).astype(jnp.bfloat16)


@dataclasses.dataclass(frozen=True)
class GroupedMatmulConfig:
    """Static launch parameters (part of the compiled program). block_n counts output columns (even for a stack
    read as pairs: block_n / 2 of them per program)."""

    block_n: int = 32
    block_k: int = 128      # a scaled stack's K chunk is its scale block, whatever this says
    num_warps: int = 4
    num_stages: int = 3
    k_splits: int | None = None   # None: default_k_splits, aiming at target_programs
    target_programs: int = _TARGET_PROGRAMS
    pairs: bool | None = None     # a 1-byte stack read as uint16 column pairs; None: wherever columns are even
    f16_rows: bool | None = None  # bf16 rows as scaled float16 against a 1-byte stack; None: wherever they meet


def default_config(groups: int, itemsize: int) -> GroupedMatmulConfig:
    """Launch parameters for a stack of `groups` matrices of `itemsize`-byte elements: for 1-byte (FP8) stacks
    128 columns and 4 warps, experts and single matrices alike; for 2-byte ones narrow column blocks for MoE
    experts (a few rows each) and wide ones with 8 warps for one dense matrix (sweeps in benchmarks/RESULTS.md,
    "The grouped kernel's launch parameters with float16 rows")."""
    if itemsize == 1:
        return GroupedMatmulConfig(block_n=128)
    if groups == 1:
        return GroupedMatmulConfig(block_n=64, num_warps=8)
    return GroupedMatmulConfig(block_n=32)


def default_pairs(w: jax.Array) -> bool:
    """Whether a stack is read as column pairs unless the config says otherwise: 1-byte, even column count."""
    return w.dtype.itemsize == 1 and w.shape[2] % 2 == 0


def needs_pairs(w: jax.Array) -> bool:
    """Whether a stack must be read as column pairs: 1-byte elements, 2 to 4 GiB (see the module's notes)."""
    return w.dtype.itemsize == 1 and 2 ** 31 <= w.size <= 2 ** 32


def default_k_splits(column_blocks: int, k_chunks: int, tiles: int = 1, target: int = _TARGET_PROGRAMS) -> int:
    """Splits of K for `tiles` row tiles' programs to come near `target` programs without passing it (more,
    shorter programs lost on an H100: RESULTS.md, "The grouped kernel's launch parameters with float16 rows"),
    whole chunks each, at most one split per chunk."""
    wanted = min(k_chunks, max(1, target // (tiles * column_blocks)))
    return -(-k_chunks // -(-k_chunks // wanted))


def planned_tiles(groups: int) -> int:
    """The row tiles K's split is planned for, from the stack alone (see the module's notes): one for a single
    matrix (a decode step's rows fit one tile), PLANNED_EXPERT_TILES for a stack of experts (or its group count,
    when smaller)."""
    return 1 if groups == 1 else min(groups, PLANNED_EXPERT_TILES)


def tile_table(group_sizes: jax.Array, rows: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(group, first row, end row) of each of `max_tiles(rows, groups)` tiles: each group's rows cut into runs of
    BLOCK_M; the tiles past the last one are empty (end == first); and the rows the tiles cover (sum of the sizes,
    from the same sums: no reduction of its own to launch).
    Broadcast compares and sums only: searchsorted's default method is a while loop (in a V3 decode step, 54
    device-to-device copies of its loop state) and cumsum a sequential reduce_window on GPUs
    (benchmarks/RESULTS.md, "V3's FP8 step with fewer launches")."""
    groups = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    tiles_per_group = -(-sizes // BLOCK_M)
    tile_end = _inclusive_sums(tiles_per_group)
    row_end = _inclusive_sums(sizes)
    tile = jnp.arange(max_tiles(rows, groups), dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(tile_end, tile, side="right", method="compare_all"),
                        groups - 1).astype(jnp.int32)
    first = row_end[group] - sizes[group] + (tile - tile_end[group] + tiles_per_group[group]) * BLOCK_M
    end = jnp.where(tile < tile_end[-1], jnp.minimum(row_end[group], first + BLOCK_M), first)
    return group, first, end, row_end[-1]


def _inclusive_sums(values: jax.Array) -> jax.Array:
    """cumsum of a short vector as one masked [n, n] row sum (one parallel reduction)."""
    index = jnp.arange(values.shape[0])
    return jnp.where(index[None, :] <= index[:, None], values[None, :], 0).sum(axis=1, dtype=values.dtype)


def max_tiles(rows: int, groups: int) -> int:
    """An upper bound on the tiles of `rows` rows in `groups` groups: sum ceil(n_g / BLOCK_M) over the non-empty
    groups, at most rows / BLOCK_M rounded up plus one partial tile per non-empty group."""
    return -(-rows // BLOCK_M) + min(groups, rows)


def as_stacks(w, scale=None) -> tuple[tuple[jax.Array, ...], tuple]:
    """(stacks, scales) of a stack or a tuple of stacks numbered on as one concatenation, and their scales (one
    per stack, or None for each)."""
    stacks = w if isinstance(w, tuple) else (w,)
    return stacks, scale if isinstance(scale, tuple) else (scale,) * len(stacks)


def as_products(w, scale=None) -> tuple[list, list]:
    """(products, their scales) of grouped_matmul's w: a list of products' stacks as it is, else w as the one
    product (scale None: None for each)."""
    products = w if isinstance(w, list) else [w]
    return products, scale if isinstance(scale, list) else [scale] * len(products)


def group_count(w) -> int:
    """The groups of a stack or of a tuple of stacks together."""
    return sum(stack.shape[0] for stack in as_stacks(w)[0])


def grouped_matmul_triton(x: jax.Array | ScaledRows, w: jax.Array | tuple[jax.Array, ...],
                          group_sizes: jax.Array | None = None,
                          *, row_groups: jax.Array | None = None, row_index: jax.Array | None = None,
                          scale: jax.Array | tuple[jax.Array, ...] | None = None,
                          block: tuple[int, int] | None = None, config: GroupedMatmulConfig | None = None,
                          fp8_rows: bool = False, norm: tuple[jax.Array, float] | None = None,
                          interleaved: bool = False, interpret: bool = False,
                          split_partials: bool = False) -> jax.Array | list[jax.Array]:
    """specjax.kernels.grouped_matmul_reference, as one kernel (rows past sum(group_sizes) zero). row_groups
    instead of group_sizes: one tile per row, no table to compute, each row's matrix read once per row (for rows
    of distinct groups, such as one token's experts, the same bytes);
    row_groups [M, R]: R output rows (tiles) per row of x, which each tile reads itself (no repeated copy of x).
    row_index [R] (with group_sizes): output row r multiplies x's row row_index[r] // (R / M), R a multiple of x's
    M rows: slots sorted by group through their index (R / M slots per row of x: a token's top-k), where a sorted
    copy of x, and of its float16 scales, would take launches of their own.
    interleaved instead: row r of group r % G (T tokens of one row per group, token-major; one group: the rows in
    order); a tile holds up to BLOCK_M of one group's rows, G apart, so each matrix is read once per BLOCK_M
    tokens, with no table and no transposes around the call.
    w (and scale) a tuple of stacks of one shape but the group count: their groups numbered on as if they were
    concatenated (a MoE layer's routed experts and its shared expert in one launch), each read where it lies.
    fp8_rows: a 1-byte stack multiplies rows quantized to e4m3 per K chunk.
    norm (weight [K], eps): the rows RMS-normalised first (projection_reference.rms_norm), inside f16_rows'
    launch where the rows go as float16. x as ScaledRows: bf16 rows already so (a 1-byte stack; no norm).
    x may be wider than K (grouped_matmul's leading_columns): its first K columns are the rows, read in place.
    w (and scale) a list of such, alike in every shape: their products of the same rows in one launch, returned
    as a list (an MLP's gate and up); each product's K split is its own launch's, so each is that launch's bit
    for bit. split_partials: the fp32 partial products [S, rows, N] of the S splits of K instead, for a reader
    that sums them in split order itself (the routing kernel: no launch of the sum's own)."""
    listed = isinstance(w, list)
    products = [as_stacks(w_p, s_p) for w_p, s_p in zip(*as_products(w, scale))]
    stacks, scales = products[0]
    w, scale = stacks[0], scales[0]
    starts = tuple(int(start) for start in np.cumsum([0] + [stack.shape[0] for stack in stacks[:-1]]))
    groups, out_features = group_count(stacks), w.shape[2]
    config = config or default_config(groups, w.dtype.itemsize)
    fp8_rows = fp8_rows and w.dtype.itemsize == 1
    scaled = isinstance(x, ScaledRows)
    out_dtype = product_dtype(jnp.bfloat16 if scaled else x.dtype if norm is None
                              else jnp.result_type(x.dtype, norm[0].dtype), w.dtype)   # the multiplied rows'
    as_f16 = _as_f16(out_dtype, w, config, fp8_rows)
    if scaled and (not as_f16 or norm is not None):
        raise ValueError("grouped_matmul: ScaledRows are rows the kernel takes as float16 against a 1-byte stack "
                         "(config.f16_rows not False, no fp8_rows) with no norm left to apply")
    in_features = w.shape[1]
    if norm is not None and not as_f16:   # no launch of the rows' own to normalise them in
        x, norm = rms_norm(x[:, :in_features], *norm), None
    repeat = (row_index.shape[0] // x.shape[0] if row_index is not None
              else 1 if row_groups is None or row_groups.ndim == 1 else row_groups.shape[1])
    rows = x.shape[0] * repeat
    precision = lax.Precision.HIGHEST if out_dtype == jnp.float32 else lax.Precision.DEFAULT
    unscale = None
    if as_f16:
        x, unscale = x if scaled else f16_rows(x, interpret, norm, width=in_features)
    pairs = all(_read_as_pairs(stack, config) for stacks_p, _ in products for stack in stacks_p)
    stored = tuple(_as_pairs(stack) if pairs else stack for stacks_p, _ in products for stack in stacks_p)
    block_n = config.block_n // 2 if pairs else config.block_n
    block_k = block[0] if scale is not None else config.block_k
    column_blocks, k_chunks = pl.cdiv(stored[0].shape[2], block_n), pl.cdiv(in_features, block_k)
    splits = 1 if rows > MAX_SPLIT_ROWS else config.k_splits or default_k_splits(
        column_blocks, k_chunks, groups if interleaved else planned_tiles(groups),   # interleaved: a tile per group
        config.target_programs)
    chunks_per_split = pl.cdiv(k_chunks, splits)
    splits = pl.cdiv(k_chunks, chunks_per_split)
    if interleaved:
        tiling, tiles, tile_count = ("interleaved", groups, rows), (), groups * pl.cdiv(rows // groups, BLOCK_M)
    elif row_groups is not None:   # tile t: row t (an index array built beside the call is a launch on GPUs)
        tiling, tiles, tile_count = ("rows",), (row_groups.reshape(-1).astype(jnp.int32),), rows
    else:
        tiling, (*tiles, covered) = ("table",), tile_table(group_sizes, rows)
        tile_count = tiles[0].shape[0]
    indices = () if row_index is None else (row_index.astype(jnp.int32),)
    all_scales = [scale_p for _, scales_p in products for scale_p in scales_p]
    args = [*tiles, *indices, x, *stored] + [a for a in (*all_scales, unscale) if a is not None]
    kernel = functools.partial(
        _grouped_kernel, starts=starts, products=len(products), column_blocks=column_blocks, pairs=pairs,
        weight_dtype=w.dtype, has_scale=scale is not None, has_unscale=unscale is not None, in_features=in_features,
        out_features=out_features, block_k=block_k, block_n=block_n, chunks_per_split=chunks_per_split,
        repeat=repeat, indexed=row_index is not None, fp8_rows=fp8_rows,
        whole_tiles=in_features % block_k == 0 and stored[0].shape[2] % block_n == 0,
        scale_block_n=block[1] if scale is not None else 1, precision=precision, tiling=tiling)
    partials = pl.pallas_call(
        kernel,
        grid=(tile_count, len(products) * column_blocks, splits),
        in_specs=[pl.BlockSpec() for _ in args],   # unblocked: the kernel indexes its rows, group and columns
        out_specs=pl.BlockSpec(),
        out_shape=jax.ShapeDtypeStruct((splits, rows, len(products) * out_features),
                                       out_dtype if splits == 1 else jnp.float32),
        compiler_params=plt.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="specjax_grouped_matmul",
    )(*args)
    if split_partials:
        out = partials.astype(jnp.float32)
    else:
        out = functools.reduce(jnp.add, list(partials)).astype(out_dtype)   # in split order: one rounding, always
    out = jnp.where((jnp.arange(rows) < covered)[:, None], out, 0) if tiling[0] == "table" else out
    if not listed:
        return out
    return [out[..., p * out_features:(p + 1) * out_features] for p in range(len(products))]


def f16_rows(x: jax.Array, interpret: bool = False, norm: tuple[jax.Array, float] | None = None,
             keep_normalised: bool = False, width: int | None = None) -> tuple[jax.Array, ...]:
    """Rows [M, K] as float16, each times the power of two that puts its largest magnitude in [2^14, 2^15), and
    the powers of two that undo it [M] (float32), in one launch (a program per row: its largest magnitude, then
    the scaled copy; XLA's fusions made three). Rows below 2^-112 keep a smaller largest value, so that both
    factors stay normal float32. norm (weight [K] of x's dtype, eps): the rows of rms_norm(x, weight, eps)
    instead, normalised in the same launch (the norm's own two launches saved); keep_normalised: those rows in
    x's dtype too, a third output (for another reader of them, such as a MoE router). width: the rows are x's
    first `width` columns (read in place)."""
    if norm is not None and jnp.result_type(x.dtype, norm[0].dtype) != x.dtype:
        raise ValueError(f"f16_rows: the norm weight's dtype {norm[0].dtype} must not widen the rows' {x.dtype}")
    if keep_normalised and norm is None:
        raise ValueError("f16_rows: keep_normalised needs a norm (without one the rows are x itself)")
    rows, in_features = x.shape[0], width or x.shape[1]
    # A row of up to 32768 values is one block, loaded at once: a chunk loop's loads wait on each other, and
    # at one row (a decode step) the launch is that one program.
    block_k = min(F16_ROWS_BLOCK, pl.next_power_of_2(in_features))
    args = (x,) if norm is None else (x, norm[0])
    out_shape = [jax.ShapeDtypeStruct((rows, in_features), jnp.float16), jax.ShapeDtypeStruct((rows,), jnp.float32)]
    out_shape += [jax.ShapeDtypeStruct((rows, in_features), x.dtype)] if keep_normalised else []
    return pl.pallas_call(
        functools.partial(_f16_rows_kernel, block_k=block_k, eps=None if norm is None else float(norm[1]),
                          keep_normalised=keep_normalised, in_features=in_features),
        grid=(rows,),
        in_specs=[pl.BlockSpec() for _ in args],
        out_specs=[pl.BlockSpec() for _ in out_shape],
        out_shape=out_shape,
        compiler_params=plt.CompilerParams(num_warps=min(16, max(4, block_k // 1024)), num_stages=1),
        interpret=interpret,
        name="specjax_f16_rows",
    )(*args)


def _f16_rows_kernel(x_ref, *refs, block_k: int, eps: float | None, keep_normalised: bool,
                     in_features: int) -> None:
    """One row (normalised first when eps is given: its mean square over K, then each value as rms_norm rounds
    it): the largest magnitude over K in chunks, its float32 exponent field E (largest < 2^(E-126)), then the
    row times 2^(141-E) as float16 and 2^(E-141) stored to undo it, both built from their bits (and the
    normalised row itself where kept)."""
    norm_ref = refs[0] if eps is not None else None
    normalised_ref = refs[-1] if keep_normalised else None
    out_ref, unscale_ref = refs[-3:-1] if keep_normalised else refs[-2:]
    row = pl.program_id(0)
    chunks = pl.cdiv(in_features, block_k)

    def chunk(c):
        ks = c * block_k + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        return ks, ks < in_features

    def loaded(c):
        ks, ok = chunk(c)
        return ks, ok, plt.load(x_ref.at[row, ks], mask=ok, other=0.0).astype(jnp.float32)

    inverse_rms = None
    if eps is not None:
        squares = lax.fori_loop(0, chunks, lambda c, total: total + jnp.sum(loaded(c)[2] ** 2), jnp.float32(0))
        inverse_rms = lax.rsqrt(squares / in_features + eps)

    def row_values(c):
        ks, ok, values = loaded(c)
        if inverse_rms is None:
            return ks, ok, values
        normalised = (values * inverse_rms).astype(x_ref.dtype).astype(jnp.float32)
        weight = plt.load(norm_ref.at[ks], mask=ok, other=0.0).astype(jnp.float32)
        return ks, ok, (weight * normalised).astype(x_ref.dtype).astype(jnp.float32)

    def keep(ks, ok, values):
        plt.store(normalised_ref.at[row, ks], values.astype(normalised_ref.dtype), mask=ok)

    store_scaled_f16(row_values, chunks, out_ref, unscale_ref, row, keep if normalised_ref is not None else None)


def store_scaled_f16(chunk_values, chunks: int, out_ref, unscale_ref, row, also=None) -> None:
    """Inside a kernel: row `row`, whose chunk c is chunk_values(c) -> (columns, mask, fp32 values), stored into
    out_ref as float16 times the power of two that puts its largest magnitude in [2^14, 2^15) (f16_scale), and
    that power's inverse into unscale_ref[row]; each chunk computed twice (its largest first), not held.
    also(columns, mask, values): another store of each chunk."""
    def largest(c, amax):
        return jnp.maximum(amax, jnp.max(jnp.abs(chunk_values(c)[2])))

    scale, unscale = f16_scale(lax.fori_loop(0, chunks, largest, jnp.float32(0)))

    def store(c, carry):
        columns, ok, values = chunk_values(c)
        plt.store(out_ref.at[row, columns], (values * scale).astype(jnp.float16), mask=ok)
        if also is not None:
            also(columns, ok, values)
        return carry

    lax.fori_loop(0, chunks, store, 0)
    unscale_ref[row] = unscale


def f16_scale(amax: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(the power of two that puts a row of largest magnitude `amax` in [2^14, 2^15) of float16, its inverse),
    both built from float32 exponent bits (the field E of amax: amax < 2^(E-126))."""
    field = jnp.clip(lax.bitcast_convert_type(amax, jnp.int32) >> 23, 15, 254)
    return (lax.bitcast_convert_type((268 - field) << 23, jnp.float32),
            lax.bitcast_convert_type((field - 14) << 23, jnp.float32))


def takes_f16_rows(dtype, w: jax.Array, fp8_rows: bool) -> bool:
    """Whether the kernel's default takes rows of `dtype` against `w` as scaled float16: bf16 rows and a 1-byte
    stack (not under fp8_rows, which quantizes them instead)."""
    return dtype == jnp.bfloat16 and w.dtype.itemsize == 1 and not fp8_rows


def _as_f16(dtype, w: jax.Array, config: GroupedMatmulConfig, fp8_rows: bool) -> bool:
    """Whether rows of `dtype` go to the kernel as scaled float16: config.f16_rows, or by default
    (takes_f16_rows)."""
    meets = takes_f16_rows(dtype, w, fp8_rows)
    if config.f16_rows and not meets:
        raise ValueError(f"GroupedMatmulConfig.f16_rows=True needs bfloat16 rows and a 1-byte stack (fp8_rows off), "
                         f"got {jnp.dtype(dtype)} rows and a {w.dtype} stack")
    return meets if config.f16_rows is None else config.f16_rows


def _read_as_pairs(w: jax.Array, config: GroupedMatmulConfig) -> bool:
    """config.pairs, or default_pairs; a clear error where the choice cannot hold."""
    if config.pairs is None:
        if needs_pairs(w) and w.shape[2] % 2:
            raise ValueError(f"grouped_matmul: an FP8 stack of 2-4 GiB is read as column pairs, so it needs an even "
                             f"number of columns, got {w.shape[2]}: split it into stacks of under 2 GiB")
        return default_pairs(w)
    if config.pairs and (w.dtype.itemsize != 1 or w.shape[2] % 2 or config.block_n % 2):
        raise ValueError(f"GroupedMatmulConfig.pairs=True needs a 1-byte stack with an even number of columns and "
                         f"an even block_n, got {w.dtype} {list(w.shape)}, block_n={config.block_n}")
    if not config.pairs and needs_pairs(w):
        raise ValueError(f"GroupedMatmulConfig.pairs=False: a 1-byte stack of {w.size / 2 ** 30:.2f} GiB overflows "
                         "the kernel's 32-bit offsets; leave pairs unset (None) or True")
    return config.pairs


def _as_pairs(w: jax.Array) -> jax.Array:
    """A 1-byte stack [G, K, N] (N even) viewed as uint16 [G, K, N/2]: adjacent columns in one element."""
    as_bytes = lax.bitcast_convert_type(w, jnp.uint8)
    return lax.bitcast_convert_type(as_bytes.reshape(*w.shape[:2], -1, 2), jnp.uint16)


def _grouped_kernel(*refs, starts: tuple[int, ...], products: int, column_blocks: int, pairs: bool, weight_dtype,
                    has_scale: bool, has_unscale: bool, in_features: int, out_features: int, block_k: int,
                    block_n: int, chunks_per_split: int, repeat: int, indexed: bool, whole_tiles: bool, fp8_rows: bool,
                    scale_block_n: int, precision: lax.Precision, tiling: tuple) -> None:
    """One (tile, column block, K split): nothing for an empty tile; else the K loop over the split's chunks of
    dots (one per column phase: even and odd columns of a pair view), scaled per block, and one masked store per
    phase into the split's partial output (times each row's unscale where the rows came as scaled float16).
    `refs`: the stacks (the first group of each at `starts`; for each of `products` products in turn), their
    scales (has_scale), the unscale (has_unscale), the output; a tile's group picks its stack, whose loop alone
    runs, and the column block (of `column_blocks` per product) its product, whose columns it stores.
    Where the blocks tile the stack whole (`whole_tiles`, every DeepSeek shape), weight and scale loads go
    unmasked: no per-element predicates in the loop that streams the bytes. Output row r reads x's row
    r // repeat (row_groups [M, R]: each of x's rows serves R output rows), where `indexed` the index array's
    (before x among `refs`) entry r // repeat. `tiling`: ("table",) a tile's group,
    first and end row from the table's three arrays; ("rows",) tile t is row t, of the group its one array names;
    ("interleaved", G, rows) no array: tile t holds group t % G's rows from token BLOCK_M * (t // G) on, G apart."""
    tile, split = pl.program_id(0), pl.program_id(2)
    stride = 1
    index_ref = None
    if tiling[0] == "table":
        group_ref, first_ref, end_ref, *refs = refs
        group, first, end = group_ref[tile], first_ref[tile], end_ref[tile]
        index_ref, x_ref, *refs = refs if indexed else (None, *refs)
    elif tiling[0] == "rows":
        group_ref, x_ref, *refs = refs
        group, first, end = group_ref[tile], tile, tile + 1
    else:
        x_ref, *refs = refs
        _, stride, rows = tiling
        group = tile % stride
        first = group + (tile // stride) * BLOCK_M * stride
        end = jnp.minimum(first + BLOCK_M * stride, rows)
    stacks = len(starts) * products
    w_refs = refs[:stacks]
    scale_refs = refs[stacks:2 * stacks] if has_scale else (None,) * stacks
    unscale_ref = refs[-2] if has_unscale else None
    out_ref = refs[-1]
    product, column_block = ((0, pl.program_id(1)) if products == 1
                             else (lax.div(pl.program_id(1), column_blocks), lax.rem(pl.program_id(1), column_blocks)))
    stored_col = column_block * block_n + lax.broadcasted_iota(jnp.int32, (block_n,), 0)
    stored_ok = stored_col < w_refs[0].shape[2]
    phases = 2 if pairs else 1
    out_cols = [stored_col * phases + phase for phase in range(phases)]
    row = first + lax.broadcasted_iota(jnp.int32, (BLOCK_M,), 0) * stride
    row_ok = row < end
    source = plt.load(index_ref.at[row], mask=row_ok, other=0) if index_ref is not None else row
    x_row = source if repeat == 1 else lax.div(source, repeat)

    compute_dtype = product_dtype(x_ref.dtype, weight_dtype)

    def run(w_ref, scale_ref, local, offset):
        def accumulate(chunk, totals):
            ks = chunk * block_k + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
            k_ok = ks < in_features
            xs = plt.load(x_ref.at[x_row[:, None], ks[None, :]], mask=row_ok[:, None] & k_ok[None, :],
                          other=0.0)
            raw = plt.load(w_ref.at[local, ks[:, None], stored_col[None, :]],
                           **_bounds(whole_tiles, k_ok[:, None] & stored_ok[None, :], 0 if pairs else 0.0))
            tiles = _unpair(raw, weight_dtype) if pairs else (raw,)
            lhs, row_scale = _quantized(xs, weight_dtype) if fp8_rows else (xs.astype(compute_dtype), None)
            updated = []
            for total, weights, cols in zip(totals, tiles, out_cols):
                part = plt.dot(lhs, weights.astype(lhs.dtype), precision=precision)
                if row_scale is not None:
                    part = part * row_scale[:, None]
                if has_scale:
                    part = part * plt.load(scale_ref.at[local, chunk, cols // scale_block_n],
                                           **_bounds(whole_tiles, stored_ok, 0.0))[None, :]
                updated.append(total + part)
            return tuple(updated)

        zero = jnp.zeros((BLOCK_M, block_n), jnp.float32)
        first_chunk = split * chunks_per_split
        last_chunk = jnp.minimum(first_chunk + chunks_per_split, pl.cdiv(in_features, block_k))
        totals = lax.fori_loop(first_chunk, last_chunk, accumulate, (zero,) * phases)
        if unscale_ref is not None:
            row_unscale = plt.load(unscale_ref.at[x_row], mask=row_ok, other=0.0)[:, None]
            totals = tuple(total * row_unscale for total in totals)
        for total, cols in zip(totals, out_cols):
            plt.store(out_ref.at[split, row[:, None], offset + cols[None, :]], total.astype(out_ref.dtype),
                      mask=row_ok[:, None] & (cols < out_features)[None, :])

    bounds = list(zip(starts, [*starts[1:], None]))
    for index, (w_ref, scale_ref) in enumerate(zip(w_refs, scale_refs)):
        p, (lo, hi) = index // len(starts), bounds[index % len(starts)]
        mine = first < end   # a stack's bounds (a product) tested only where another stack (product) lies beside
        mine = mine if lo == 0 else mine & (group >= lo)
        mine = mine if hi is None else mine & (group < hi)
        mine = mine if products == 1 else mine & (product == p)
        pl.when(mine)(functools.partial(run, w_ref, scale_ref, group - lo, p * out_features))


def _bounds(whole_tiles: bool, mask: jax.Array, other) -> dict:
    """plt.load's masking arguments: none where every block lies inside the array."""
    return {} if whole_tiles else dict(mask=mask, other=other)


def _quantized(xs: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """Rows [M, K] as `dtype` (a 1-byte float) scaled to its largest value, and each row's scale (amax / max)."""
    rows = xs.astype(jnp.float32)
    amax = jnp.maximum(jnp.max(jnp.abs(rows), axis=1), jnp.finfo(jnp.float32).tiny)
    row_scale = amax / float(jnp.finfo(dtype).max)
    return (rows / row_scale[:, None]).astype(dtype), row_scale


def _unpair(raw: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """The even (low byte) and odd (high byte) columns of uint16 pairs, as `dtype` (a 1-byte float)."""
    low = (raw & 0xFF).astype(jnp.uint8)
    high = (raw >> 8).astype(jnp.uint8)
    return tuple(lax.bitcast_convert_type(half, dtype) for half in (low, high))
