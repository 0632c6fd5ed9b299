"""Verify/decode attention as a Pallas kernel lowered through Triton (NVIDIA sm_80+).

Flash-decoding structure (after the facts of JAX's `pallas/ops/gpu/decode_attention.py`,
written anew for a stacked head-major cache):
- one program per (row tile, batch row b, kv head h, KV split), the row tile varying fastest in the launch so that
  the tiles reading one KV block run side by side and share it through L2; the G = Hq / Hkv query
  heads of kv head h and the T tokens are folded into the rows of one [T*G, D] matrix
  (row r = t * G + g), so one K/V block read from memory serves every query that needs it;
- each program walks KV blocks only over the slots its rows can see: up to start + t, and from the
  first slot inside the sliding window of its earliest row when the layer has one (a traced scalar,
  so every layer of a scanned stack shares one compiled kernel whatever its window);
- when B * Hkv gives too few programs to fill the GPU, the visible range is split
  across the grid and the partial results are merged with a log-sum-exp weighting;
- K and V are read straight out of the full [L, B, Hkv, S, D] cache, indexed by the
  layer scalar inside the kernel, so the layer's K/V is never sliced out (no copy);
- loads past the last written slot are masked with a zero fill: garbage slots are
  never read, and interpret mode (which pads refs with NaN) stays exact;
- a draft tree's pass (kernels/tree_mask.py) adds three inputs: each query's position (its window), the first
  slot of the tree's nodes and, per query, the node slots it sees as a few words of bits, loaded once per program
  and tested in every block by shifts (a gathered [rows, block] mask per block, and a second loop for the blocks
  that reach the tree, had doubled the kernel's code and filled its registers: compiled for an H200, 255
  registers with spills against the causal pass's 164-222, benchmarks/RESULTS.md);
- a latent cache (MLA's absorbed form: one kv head whose first value_dim columns are also the values, v_cache None)
  is read once per block: the key columns in two power-of-two pieces ([0, value_dim) and the rest, 512 + 64 for
  DeepSeek), the first piece serving as the values.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from specjax.kernels.tree_mask import TreeMask

# Running-max start value: finite, so a row with nothing visible yet keeps
# exp(m_old - m_new) = 1 and exp(-inf - m) = 0 instead of NaN from -inf - -inf.
_MAX_INIT = -1e30
_LOG2_E = 1.4426950408889634
# Triton's matrix units need at least 16 rows per dot.
_MIN_ROWS = 16
# Rows per program beyond which a tile's fp32 accumulators crowd the registers.
_MAX_ROWS_PER_TILE = 128
# A merge program's tile of the split outputs: V3's batch-1 step (128 rows of 512 values) in 64 programs.
_MERGE_ROWS, _MERGE_COLUMNS = 16, 64
# SM count of an H100/H200, used when the device does not report one.
_DEFAULT_SM_COUNT = 132


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Static launch parameters of the kernel (all part of the compiled program)."""

    block_k: int = 64           # cache slots per K/V block
    rows_per_tile: int = 16     # query rows (tokens x grouped heads) per program
    num_splits: int = 1         # programs sharing one (b, kv head, tile) along the KV axis
    num_warps: int = 4
    num_stages: int = 2


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _previous_power_of_two(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def key_pieces(head_dim: int, value_dim: int | None) -> tuple[tuple[int, int], ...]:
    """(first column, width) of the pieces the key columns are read in: the whole head, or with values inside the
    keys (value_dim) the value columns and the rest."""
    if value_dim is None or value_dim == head_dim:
        return ((0, head_dim),)
    return ((0, value_dim), (value_dim, head_dim - value_dim))


def unsupported_reason(q_shape: tuple[int, ...], cache_shape: tuple[int, ...],
                       value_dim: int | None = None) -> str | None:
    """Why the kernel cannot run these shapes (value_dim: values are the keys' first columns), or None when it
    can."""
    for _, width in key_pieces(q_shape[-1], value_dim):
        if width < 16 or width != _next_power_of_two(width):
            what = "head_dim" if value_dim is None else "value_dim and head_dim - value_dim"
            return f"{what} ({width}) must be powers of two >= 16 for the Triton kernel"
    if cache_shape[3] < 16:
        return f"cache length S={cache_shape[3]} must be >= 16 for the Triton kernel"
    return None


def default_config(q_shape: tuple[int, ...], cache_shape: tuple[int, ...],
                   sm_count: int = _DEFAULT_SM_COUNT, value_dim: int | None = None) -> KernelConfig:
    """Launch parameters for these shapes: enough programs to fill `sm_count` SMs."""
    batch, num_tokens, num_q_heads, head_dim = q_shape
    num_kv_heads, num_slots = cache_shape[2], cache_shape[3]
    value_dim = value_dim or head_dim
    rows = num_tokens * (num_q_heads // num_kv_heads)
    # At most 128 x 128 fp32 accumulators per program (32 rows of a 512-wide latent).
    max_rows = max(_MIN_ROWS, _MAX_ROWS_PER_TILE * 128 // value_dim)
    rows_per_tile = min(max(_MIN_ROWS, _next_power_of_two(rows)), max_rows)
    num_tiles = -(-rows // rows_per_tile)
    # 128-slot K/V blocks; 64 when a full 128-row tile would crowd the registers or the head is wide (a
    # 576-wide latent: the H200 sweep's best, RESULTS.md).
    block_k = min(64 if rows_per_tile * value_dim >= _MAX_ROWS_PER_TILE * 128 else 128,
                  _previous_power_of_two(65536 // head_dim), max(16, _next_power_of_two(num_slots)))
    programs = batch * num_kv_heads * num_tiles
    # About two programs per SM (rounded down to a power of two: H200 sweep, RESULTS.md), each split at least
    # four blocks of a full cache; of a latent (keys and values one 576-wide row, a 64-slot block 2.25x a 128-wide
    # head's keys and values) one block: V3's batch-1 step at context 1024 ran only 16 programs (RESULTS.md).
    wanted = _previous_power_of_two(-(-2 * sm_count // programs))
    min_blocks = 4 if value_dim == head_dim else 1
    num_splits = min(wanted, _previous_power_of_two(num_slots // (min_blocks * block_k)), 64)
    num_warps = 8 if rows_per_tile >= _MAX_ROWS_PER_TILE else 4
    return KernelConfig(block_k=block_k, rows_per_tile=rows_per_tile, num_splits=num_splits,
                        num_warps=num_warps, num_stages=2)


def attention_triton(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array | int,
    start: jax.Array,
    *,
    scale: float,
    window: jax.Array | int = 0,
    config: KernelConfig | None = None,
    interpret: bool = False,
    tree: TreeMask | None = None,
    value_dim: int | None = None,
) -> jax.Array:
    """Causal GQA attention of q [B,T,Hq,D] against layer `layer` of a [L,B,Hkv,S,D] cache; `window`: the
    sliding window in tokens (0 = none), `tree` a draft tree's mask, v_cache None: the values are the keys'
    first value_dim columns, as in attention_reference. Returns [B,T,Hq,Dv]."""
    batch, num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    pieces = key_pieces(head_dim, value_dim if v_cache is None else None)
    out_dim = pieces[0][1] if v_cache is None else head_dim
    if config is None:
        config = default_config(q.shape, k_cache.shape, value_dim=out_dim)
    group = num_q_heads // num_kv_heads
    num_tiles = -(-(num_tokens * group) // config.rows_per_tile)
    splits = config.num_splits
    # q and the output keep their [B,T,Hq,D] layout (flattened to rows, a free reshape):
    # the kernel gathers and scatters the rows of its (b, kv head) itself, so no
    # transpose or padding copies surround the kernel.
    flat_rows = batch * num_tokens * num_q_heads
    kernel = functools.partial(
        _attention_kernel, scale=scale, group=group, num_tokens=num_tokens,
        num_q_heads=num_q_heads, rows_per_tile=config.rows_per_tile, block_k=config.block_k,
        num_splits=splits, tree_region=0 if tree is None else tree.region, pieces=pieces,
        values_in_keys=v_cache is None,
        precision=lax.Precision.HIGHEST if q.dtype == jnp.float32 else lax.Precision.DEFAULT)
    in_specs = [
        pl.BlockSpec(),  # layer: a 0-d int32, passed as is (no reshape op around the call)
        pl.BlockSpec(),  # window: likewise
        pl.BlockSpec((1,), lambda i, b, h, j: (b,)),
        # Unblocked: the kernel indexes rows of q and the layer of the cache itself,
        # so neither q nor the layer's K/V is ever copied.
        pl.BlockSpec(),
        pl.BlockSpec(),
    ] + ([] if v_cache is None else [pl.BlockSpec()])
    caches = (k_cache,) if v_cache is None else (k_cache, v_cache)
    tree_inputs = ()
    if tree is not None:
        in_specs += [pl.BlockSpec(), pl.BlockSpec(), pl.BlockSpec()]
        tree_inputs = (tree.positions.astype(jnp.int32), tree.region_start.astype(jnp.int32),
                       visible_words(tree.visible).reshape(batch * num_tokens, -1))
    if splits == 1:
        out_shape = jax.ShapeDtypeStruct((flat_rows, out_dim), q.dtype)
        out_specs = pl.BlockSpec()
    else:
        out_shape = (jax.ShapeDtypeStruct((splits, flat_rows, out_dim), jnp.float32),
                     jax.ShapeDtypeStruct((splits, flat_rows), jnp.float32))
        out_specs = (pl.BlockSpec(), pl.BlockSpec())
    result = pl.pallas_call(
        kernel,
        grid=(num_tiles, batch, num_kv_heads, splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plt.CompilerParams(num_warps=config.num_warps,
                                           num_stages=config.num_stages),
        interpret=interpret,
        name="specjax_decode_attention",
    )(jnp.asarray(layer, jnp.int32), jnp.asarray(window, jnp.int32), start.astype(jnp.int32),
      q.reshape(flat_rows, head_dim), *caches, *tree_inputs)
    if splits > 1:
        result = merge_splits(*result, q.dtype, interpret=interpret)
    return result.reshape(*q.shape[:-1], out_dim)


def visible_words(visible: jax.Array) -> jax.Array:
    """A tree's visible rows [..., R] as bit sets: int32 [..., W], bit j of word w set where node 32 w + j is
    visible, W a power of two (a Triton tensor's length) of at least R / 32 words."""
    words = _next_power_of_two(-(-visible.shape[-1] // 32))
    padded = jnp.pad(visible, [(0, 0)] * (visible.ndim - 1) + [(0, 32 * words - visible.shape[-1])])
    bits = padded.reshape(*visible.shape[:-1], words, 32).astype(jnp.uint32) << jnp.arange(32, dtype=jnp.uint32)
    return lax.bitcast_convert_type(bits.sum(axis=-1, dtype=jnp.uint32), jnp.int32)


def merge_splits(partial_out: jax.Array, partial_lse2: jax.Array, dtype, *, interpret: bool = False) -> jax.Array:
    """The splits' normalized outputs [P, N, D] combined by their base-2 log-sum-exp [P, N] into [N, D] of
    `dtype`, in one launch (XLA's merge took up to three: V3's 16 splits a layer)."""
    splits, rows, width = partial_out.shape
    return pl.pallas_call(
        functools.partial(_merge_kernel, splits=splits),
        grid=(pl.cdiv(rows, _MERGE_ROWS), pl.cdiv(width, _MERGE_COLUMNS)),
        in_specs=[pl.BlockSpec(), pl.BlockSpec()],
        out_specs=pl.BlockSpec(),
        out_shape=jax.ShapeDtypeStruct((rows, width), dtype),
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="specjax_merge_splits",
    )(partial_out, partial_lse2)


def _merge_kernel(out_ref, lse_ref, merged_ref, *, splits: int) -> None:
    """One [_MERGE_ROWS, _MERGE_COLUMNS] tile of the merge: each split's output weighted by 2^(lse - max lse)."""
    rows, width = merged_ref.shape
    row = pl.program_id(0) * _MERGE_ROWS + lax.broadcasted_iota(jnp.int32, (_MERGE_ROWS,), 0)
    column = pl.program_id(1) * _MERGE_COLUMNS + lax.broadcasted_iota(jnp.int32, (_MERGE_COLUMNS,), 0)
    real_row = row < rows
    mask = real_row[:, None] & (column < width)[None, :]
    lse = [plt.load(lse_ref.at[split, row], mask=real_row, other=-jnp.inf) for split in range(splits)]
    # Every real row sees its own slot, which one split holds, so its largest lse is finite.
    top = jnp.where(real_row, functools.reduce(jnp.maximum, lse), 0.0)
    acc = jnp.zeros((_MERGE_ROWS, _MERGE_COLUMNS), jnp.float32)
    total = jnp.zeros((_MERGE_ROWS,), jnp.float32)
    for split in range(splits):
        weight = jnp.exp2(lse[split] - top)
        part = plt.load(out_ref.at[split, row[:, None], column[None, :]], mask=mask, other=0.0)
        acc, total = acc + weight[:, None] * part, total + weight
    merged = acc / jnp.where(total > 0, total, 1.0)[:, None]
    plt.store(merged_ref.at[row[:, None], column[None, :]], merged.astype(merged_ref.dtype), mask=mask)


def _attention_kernel(layer_ref, window_ref, start_ref, q_ref, k_ref, *refs,
                      scale: float, group: int, num_tokens: int, num_q_heads: int,
                      rows_per_tile: int, block_k: int, num_splits: int, tree_region: int,
                      pieces: tuple[tuple[int, int], ...], values_in_keys: bool,
                      precision: lax.Precision) -> None:
    """One (b, kv head, split, row tile): online softmax over this split's visible KV blocks. `refs` starts with
    the values' cache unless values_in_keys (then the first key piece's block is the values), then with a tree
    (tree_region > 0) its positions, region start and visible words."""
    v_ref = None
    if not values_in_keys:
        v_ref, *refs = refs
    if tree_region:
        positions_ref, region_ref, tree_words_ref, *refs = refs
    out_ref, lse_ref = refs if len(refs) == 2 else (refs[0], None)
    tile, b, h, split = (pl.program_id(axis) for axis in range(4))
    layer = layer_ref[...]
    window = window_ref[...]
    start = start_ref[0]
    row = tile * rows_per_tile + lax.broadcasted_iota(jnp.int32, (rows_per_tile,), 0)
    real_row = row < num_tokens * group
    token = lax.div(row, group)
    # Row (t, g) of kv head h is q head h * G + g of token t; rows past the last token
    # point one past the end of the array, where a masked access never lands.
    flat_row = jnp.where(real_row, (b * num_tokens + token) * num_q_heads + h * group + lax.rem(row, group),
                         q_ref.shape[0])[:, None]
    piece_columns = [first + lax.broadcasted_iota(jnp.int32, (1, width), 1) for first, width in pieces]
    columns = piece_columns[0] if values_in_keys else lax.broadcasted_iota(jnp.int32, (1, q_ref.shape[1]), 1)
    # The slots each row sees: [row_first, row_end), its token's slot + 1 being the end (a tree's rows see no
    # later slot either, and their prefix from their own position's window).
    row_end = start + token + 1
    last_token = jnp.minimum(lax.div(tile * rows_per_tile + rows_per_tile - 1, group), num_tokens - 1)
    tile_end = start + last_token + 1
    if tree_region:
        safe_token = jnp.minimum(token, num_tokens - 1)
        position = plt.load(positions_ref.at[b, safe_token], mask=real_row, other=0)
        row_first = _window_first(position + 1, window)
        region = region_ref[b]
        tile_first = jnp.min(jnp.where(real_row, row_first, tile_end))
        # Each row's visible nodes as a few words of bits, loaded once: the blocks test bits, no loads.
        words = [plt.load(tree_words_ref.at[b * num_tokens + safe_token, w], mask=real_row, other=0)
                 for w in range(tree_words_ref.shape[1])]
    else:
        row_first = _window_first(row_end, window)
        # The tile's earliest row sees the earliest slots.
        tile_first = _window_first(start + lax.div(tile * rows_per_tile, group) + 1, window)
    # Its block holds the tile's first visible slot.
    tile_lo = lax.div(tile_first, block_k) * block_k
    # Split [tile_lo, tile_end) into num_splits block-aligned ranges of the live length.
    per_split = pl.cdiv(pl.cdiv(tile_end - tile_lo, num_splits), block_k) * block_k
    lo = tile_lo + split * per_split
    hi = jnp.minimum(lo + per_split, tile_end)
    num_blocks = jnp.maximum(pl.cdiv(hi - lo, block_k), 0)

    q = [plt.load(q_ref.at[flat_row, cols], mask=real_row[:, None], other=0.0) for cols in piece_columns]
    # Softmax in base 2: fold log2(e) into the scale so exp2 replaces exp.
    scale2 = scale * _LOG2_E
    offsets = lax.broadcasted_iota(jnp.int32, (block_k,), 0)

    def visit_block(index, carry):
        acc, row_max, row_sum = carry
        first = lo + index * block_k
        slots = first + offsets
        # Zero-fill past `hi` (<= last written slot + 1 <= S): never reads garbage or out of bounds.
        loadable = (slots < hi)[:, None]
        block = pl.ds(pl.multiple_of(first, block_k), block_k)
        k = [plt.load(k_ref.at[layer, b, h, block, pl.ds(start_col, width)], mask=loadable, other=0.0)
             for start_col, width in pieces]
        logits = sum(plt.dot(q_piece, k_piece, trans_b=True, precision=precision)
                     for q_piece, k_piece in zip(q, k)) * scale2
        visible = (slots[None, :] < row_end[:, None]) & (slots[None, :] >= row_first[:, None])
        if tree_region:
            offset = slots - region
            in_region = (offset >= 0) & (offset < tree_region)
            node = jnp.clip(offset, 0, tree_region - 1)
            word = words[0][:, None]
            for w in range(1, len(words)):
                word = jnp.where(lax.shift_right_logical(node, 5)[None, :] == w, words[w][:, None], word)
            seen = (lax.shift_right_logical(word, (node & 31)[None, :]) & 1) != 0
            visible = (slots[None, :] < row_end[:, None]) & jnp.where(in_region[None, :], seen, visible)
        logits = jnp.where(visible, logits, -jnp.inf)
        new_max = jnp.maximum(row_max, logits.max(axis=1))
        rescale = jnp.exp2(row_max - new_max)
        probs = jnp.exp2(logits - new_max[:, None])
        v = k[0] if values_in_keys else plt.load(v_ref.at[layer, b, h, block, :], mask=loadable, other=0.0)
        acc = acc * rescale[:, None] + plt.dot(probs.astype(v.dtype), v, precision=precision)
        return acc, new_max, row_sum * rescale + probs.sum(axis=1)

    carry = (jnp.zeros((rows_per_tile, columns.shape[1]), jnp.float32),
             jnp.full((rows_per_tile,), _MAX_INIT, jnp.float32),
             jnp.zeros((rows_per_tile,), jnp.float32))
    carry = lax.fori_loop(0, num_blocks, visit_block, carry)
    acc, row_max, row_sum = carry
    has_mass = row_sum > 0
    safe_sum = jnp.where(has_mass, row_sum, 1.0)
    normalized = acc / safe_sum[:, None]
    if lse_ref is None:
        plt.store(out_ref.at[flat_row, columns], normalized.astype(out_ref.dtype),
                  mask=real_row[:, None])
        return
    plt.store(out_ref.at[split, flat_row, columns], normalized, mask=real_row[:, None])
    lse2 = jnp.where(has_mass, row_max + jnp.log2(safe_sum), -jnp.inf)
    plt.store(lse_ref.at[split, flat_row[:, 0]], lse2, mask=real_row)


def _window_first(end: jax.Array, window: jax.Array) -> jax.Array:
    """The first slot a query whose visible slots end (exclusive) at `end` sees: 0 without a window (0), else
    the window's first slot, end - window (never below 0)."""
    return jnp.where(window > 0, jnp.maximum(end - window, 0), 0)
