"""Grouped matmul: reference vs a float64 oracle, the Pallas kernel (interpret mode) vs the reference for plain and
FP8 stacks, the tile table, row independence (what exact speculation needs), rows in any order with their groups,
the dispatcher's choice, bad input."""
from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specjax.kernels import grouped_matmul_triton as grouped_matmul_triton_module
from specjax.kernels.grouped_matmul import ScaledRows, grouped_matmul, prepared_rows
from specjax.kernels.grouped_matmul_reference import grouped_matmul_reference
from specjax.kernels.grouped_matmul_triton import (BLOCK_M, GroupedMatmulConfig, default_k_splits,
                                                   default_pairs, f16_rows, grouped_matmul_triton, max_tiles,
                                                   needs_pairs, planned_tiles, tile_table)
from specjax.kernels.policy import KernelPolicy, has_kernels
from specjax.kernels.projection_reference import rms_norm
from specjax.models.fp8 import dequantize_blocks, quantize_blocks

INTERPRET = KernelPolicy(interpret=True)
# Group sizes with an empty group, one row, and a group over two tiles; the rows sum to 25.
SIZES = (3, 0, 2 * BLOCK_M + 1, 1, 2)


def make_stack(seed, groups, k, n, dtype, block=None):
    """x-independent weights [G, K, N]: plain in `dtype`, or FP8 codes and block scales when `block` is given."""
    rng = np.random.default_rng(seed)
    w = jnp.asarray(rng.standard_normal((groups, k, n)) / np.sqrt(k), jnp.float32)
    if block is None:
        return w.astype(dtype), None
    quantized = [quantize_blocks(w[g], block) for g in range(groups)]
    return jnp.stack([q for q, _ in quantized]), jnp.stack([s for _, s in quantized])


def make_rows(seed, rows, k, dtype):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((rows, k)), dtype)


def oracle(x, w, sizes, scale, block):
    """float64 numpy: each row times its group's (dequantized) matrix; rows past the groups zero."""
    x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    mats = [np.asarray(dequantize_blocks(w[g], scale[g], block) if scale is not None else w[g].astype(jnp.float32),
                       np.float64) for g in range(w.shape[0])]
    out = np.zeros((x.shape[0], w.shape[2]))
    row = 0
    for g, size in enumerate(sizes):
        out[row:row + size] = x[row:row + size] @ mats[g]
        row += size
    return out


def relative_error(out, expected):
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    assert np.isfinite(out).all(), "output has NaN/Inf (an unwritten element)"
    return np.linalg.norm(out - expected) / np.linalg.norm(expected)


CASES = [  # (K, N, block): edge blocks in K and N; a column block over several scale blocks; an odd column
    # count (an FP8 stack loaded as it is; pairs need even ones); plain stacks
    (200, 150, (64, 32)),
    (96, 64, (32, 16)),
    (96, 63, (32, 16)),
    (200, 150, None),
]


@pytest.mark.parametrize("k, n, block, pairs", [case + (None,) for case in CASES] +
                         [case + (True,) for case in CASES if case[2] is not None and case[1] % 2 == 0])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_and_reference_match_the_float64_oracle(k, n, block, pairs, dtype):
    w, scale = make_stack(0, len(SIZES), k, n, dtype, block)
    rows = sum(SIZES) + 2                     # two rows past the groups: zero
    x = make_rows(1, rows, k, dtype)
    sizes = jnp.asarray(SIZES, jnp.int32)
    want = oracle(x, w, SIZES, scale, block)
    tolerance = 1e-5 if dtype == jnp.float32 else 2e-2
    with jax.default_matmul_precision("highest"):
        reference = grouped_matmul_reference(x, w, sizes, scale=scale, block=block)
    kernel = grouped_matmul(x, w, sizes, scale=scale, block=block, kernels=INTERPRET,
                            config=GroupedMatmulConfig(block_n=16, block_k=32, pairs=pairs))
    for got in (reference, kernel):
        assert got.shape == (rows, n) and got.dtype == dtype
        assert relative_error(got, want) < tolerance
        assert not np.asarray(got[-2:]).any()
    if dtype == jnp.float32:
        assert relative_error(kernel, np.asarray(reference, np.float64)) < 1e-6


@pytest.mark.parametrize("k_splits", [1, 2, 3, 4])
def test_any_split_of_k_gives_the_product(k_splits):
    """K in 4 chunks (the last partial) split 1-4 ways (3 ways: runs of 2, 2 and none): the oracle's product."""
    k, n, block = CASES[0]
    w, scale = make_stack(0, len(SIZES), k, n, jnp.float32, block)
    x = make_rows(1, sum(SIZES), k, jnp.float32)
    got = grouped_matmul(x, w, jnp.asarray(SIZES, jnp.int32), scale=scale, block=block, kernels=INTERPRET,
                         config=GroupedMatmulConfig(block_n=16, k_splits=k_splits))
    assert relative_error(got, oracle(x, w, SIZES, scale, block)) < 1e-5


@pytest.mark.parametrize("target", [None, 132, 1056])
@pytest.mark.parametrize("groups", [1, 8, 64, 256])
@pytest.mark.parametrize("column_blocks, k_chunks", [(16, 56), (56, 16), (4, 56), (192, 12), (1, 1)])
def test_k_splits_fill_the_target_programs_without_passing_them(groups, column_blocks, k_chunks, target):
    tiles = planned_tiles(groups)
    assert tiles == (1 if groups == 1 else min(groups, grouped_matmul_triton_module.PLANNED_EXPERT_TILES))
    programs = target or grouped_matmul_triton_module._TARGET_PROGRAMS
    splits = default_k_splits(column_blocks, k_chunks, tiles, programs)
    per_split = -(-k_chunks // splits)
    assert 1 <= splits <= k_chunks and -(-k_chunks // per_split) == splits   # whole chunks, none idle
    assert tiles * column_blocks * splits <= max(programs, tiles * column_blocks)
    if splits < k_chunks:   # one more split would not have passed the target by much
        assert tiles * column_blocks * (splits + 1) > programs // 2


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_row_rounds_the_same_whatever_the_row_count_splits_k_into(dtype):
    """K in 32 chunks over a stack of 24 groups: one row alone (a decode step's tile) and the same row among 24
    (a verify pass's 24 tiles) split K alike, so its float32 sum associates alike. A split count that followed the
    busy tiles (32 splits alone, 16 among 24) changed the float32 result in its last bits."""
    groups, k, n, block = 24, 512, 32, (16, 16)
    w, scale = make_stack(11, groups, k, n, jnp.float32, block)
    x = make_rows(12, groups, k, dtype)
    run = jax.jit(lambda x, sizes: grouped_matmul(x, w, sizes, scale=scale, block=block, kernels=INTERPRET))
    batch = run(x, jnp.ones((groups,), jnp.int32))
    for row in (0, 13):
        alone = run(x[row:row + 1], jnp.asarray(np.arange(groups) == row, jnp.int32))
        np.testing.assert_array_equal(np.asarray(alone[0], np.float32), np.asarray(batch[row], np.float32))


_jitted_tile_table = jax.jit(tile_table, static_argnums=1)


# Each example compiles the table for new shapes: 15 of them.
@settings(max_examples=15, deadline=None)
@given(st.lists(st.integers(0, 3 * BLOCK_M), min_size=1, max_size=12), st.integers(0, 5))
def test_the_tile_table_covers_each_row_once_within_its_group(sizes, spare_rows):
    rows = sum(sizes) + spare_rows
    group, first, end, total = map(np.asarray, _jitted_tile_table(jnp.asarray(sizes, jnp.int32), max(rows, 1)))
    assert total == sum(sizes)
    assert len(group) == max_tiles(max(rows, 1), len(sizes))
    owner = np.repeat(np.arange(len(sizes)), sizes)
    covered = np.zeros(rows, int)
    for g, a, b in zip(group, first, end):
        assert 0 <= b - a <= BLOCK_M
        covered[a:b] += 1
        assert (owner[a:b] == g).all()
    assert (covered[:sum(sizes)] == 1).all() and not covered[sum(sizes):].any()


@pytest.mark.parametrize("block, kernels", [((32, 16), INTERPRET), (None, INTERPRET),
                                            ((32, 16), KernelPolicy(interpret=True, fp8_activations=True))])
def test_a_rows_result_does_not_depend_on_the_other_rows(block, kernels):
    """A row rounds the same alone in its group (a decode step) and among other rows of its own and other groups
    (a verify pass): the kernel's tiles never change with the row count, and FP8 rows are scaled by their own
    values alone."""
    k, n = 96, 64
    w, scale = make_stack(2, 4, k, n, jnp.bfloat16, block)
    x = make_rows(3, 20, k, jnp.bfloat16)
    run = jax.jit(lambda x, sizes: grouped_matmul(x, w, sizes, scale=scale, block=block, kernels=kernels))
    batch = run(x, jnp.asarray([5, 7, 0, 8], jnp.int32))
    for row, group in [(0, 0), (6, 1), (11, 1), (19, 3)]:
        alone = run(x[row:row + 1], jnp.asarray([int(g == group) for g in range(4)], jnp.int32))
        np.testing.assert_array_equal(np.asarray(alone[0], np.float32), np.asarray(batch[row], np.float32))


@pytest.mark.parametrize("block", [(32, 16), None])
def test_rows_in_any_order_with_their_groups_equal_the_sorted_rows(block):
    """row_groups (rows in any order, one kernel tile each) gives every row the bits the sorted layout gives it, in
    the kernel (bf16 rows as float16 against the FP8 stack) and in the reference."""
    k, n, sizes = 96, 64, (2, 0, 3, 1)
    w, scale = make_stack(5, len(sizes), k, n, jnp.bfloat16, block)
    x = make_rows(6, sum(sizes), k, jnp.bfloat16)
    order = np.random.default_rng(8).permutation(sum(sizes))
    groups = jnp.asarray(np.repeat(np.arange(len(sizes)), sizes)[order], jnp.int32)
    for kernels in (INTERPRET, KernelPolicy(impl="reference")):
        want = grouped_matmul(x, w, jnp.asarray(sizes, jnp.int32), scale=scale, block=block, kernels=kernels)
        got = grouped_matmul(x[order], w, row_groups=groups, scale=scale, block=block, kernels=kernels)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32)[order])


@pytest.mark.parametrize("groups, block", [(3, None), (3, (32, 16)), (1, (32, 16))])
def test_interleaved_rows_equal_their_rows_sorted_by_group(groups, block):
    """interleaved (row r of group r % G: 20 tokens of a row per group, over two tiles of each group; one group:
    the rows in order, fp8.linear's call) gives every row the bits the same rows sorted by group give it, in the
    kernel (bf16 rows, plain or FP8 stacks) and in the reference."""
    k, n, tokens = 64, 64, 2 * BLOCK_M - 12
    w, scale = make_stack(5, groups, k, n, jnp.bfloat16, block)
    x = make_rows(6, tokens * groups, k, jnp.bfloat16)
    by_group = np.arange(tokens * groups).reshape(tokens, groups).T.reshape(-1)
    sizes = jnp.full((groups,), tokens, jnp.int32)
    for kernels in (INTERPRET, KernelPolicy(impl="reference")):
        sorted_out = grouped_matmul(x[by_group], w, sizes, scale=scale, block=block, kernels=kernels)
        got = grouped_matmul(x, w, interleaved=True, scale=scale, block=block, kernels=kernels)
        want = np.empty(got.shape, np.float32)
        want[by_group] = np.asarray(sorted_out, np.float32)
        np.testing.assert_array_equal(np.asarray(got, np.float32), want)


@pytest.mark.parametrize("block", [(32, 16), None])
def test_a_row_with_several_groups_equals_its_copies_one_group_each(block):
    """row_groups [M, R] (one token's experts) gives output row m * R + r the bits of row m copied R times with
    row_groups [M * R], in the kernel (each tile reading the shared row, its float16 scaling included) and in the
    reference."""
    k, n, groups = 96, 64, [[3, 0, 2], [1, 3, 3]]
    w, scale = make_stack(5, 4, k, n, jnp.bfloat16, block)
    x = make_rows(7, len(groups), k, jnp.bfloat16)
    ids = jnp.asarray(groups, jnp.int32)
    for kernels in (INTERPRET, KernelPolicy(impl="reference")):
        want = grouped_matmul(jnp.repeat(x, 3, axis=0), w, row_groups=ids.reshape(-1), scale=scale, block=block,
                              kernels=kernels)
        got = grouped_matmul(x, w, row_groups=ids, scale=scale, block=block, kernels=kernels)
        assert got.shape == (6, n)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("block", [(32, 16), None])
def test_stacks_joined_in_one_call_equal_their_concatenation(block):
    """A tuple of stacks (routed experts and a shared expert) is one numbering of groups: each row gets the bits
    the kernel gives it over the concatenated stack, for rows sorted by group and for one token's groups in slot
    order (the shared expert its last slot), in the kernel and in the reference."""
    k, n = 96, 64
    routed, routed_scale = make_stack(5, 4, k, n, jnp.bfloat16, block)
    shared, shared_scale = make_stack(9, 1, k, n, jnp.bfloat16, block)
    joined = jnp.concatenate([routed, shared])
    joined_scale = None if block is None else jnp.concatenate([routed_scale, shared_scale])
    stacks, scales = (routed, shared), None if block is None else (routed_scale, shared_scale)
    x = make_rows(7, 9, k, jnp.bfloat16)
    sizes = jnp.asarray([2, 0, 3, 1, 3], jnp.int32)
    token = jnp.asarray([[3, 0, 4]], jnp.int32)
    token_outputs = []
    for kernels in (INTERPRET, KernelPolicy(impl="reference")):
        want = grouped_matmul(x, joined, sizes, scale=joined_scale, block=block, kernels=kernels)
        got = grouped_matmul(x, stacks, sizes, scale=scales, block=block, kernels=kernels)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
        want = grouped_matmul(x[:1], joined, row_groups=token, scale=joined_scale, block=block, kernels=kernels)
        got = grouped_matmul(x[:1], stacks, row_groups=token, scale=scales, block=block, kernels=kernels)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
        token_outputs.append(got)
    kernel, reference = token_outputs
    assert relative_error(kernel, np.asarray(jnp.asarray(reference, jnp.float32), np.float64)) < 1e-2


@pytest.mark.parametrize("block", [(32, 16), None])
@pytest.mark.parametrize("tiling", ["table", "indexed", "rows", "token", "interleaved"])
def test_products_in_one_call_equal_their_own_calls(tiling, block):
    """A list of stacks (an MLP's gate and up, each a tuple of routed and shared stacks) gives each product the
    bits its own call gives it (the same K split), in every tiling of the kernel and in the reference; one
    launch where the kernel runs."""
    k, n = 96, 64
    products = [make_stack(seed, 4, k, n, jnp.bfloat16, block) for seed in (5, 9)]
    shared = [make_stack(seed, 1, k, n, jnp.bfloat16, block) for seed in (11, 13)]
    ws = [(w, w_shared) for (w, _), (w_shared, _) in zip(products, shared)]
    scales = None if block is None else [(s, s_shared) for (_, s), (_, s_shared) in zip(products, shared)]
    x = make_rows(7, 10, k, jnp.bfloat16)
    calls = dict(table=(x, dict(group_sizes=jnp.asarray([2, 0, 3, 1, 3], jnp.int32))),
                 indexed=(x[:3], dict(group_sizes=jnp.asarray([2, 0, 3, 1, 3], jnp.int32),
                                      row_index=jnp.asarray([0, 4, 8, 1, 2, 5, 7, 6, 3], jnp.int32))),
                 rows=(x[:3], dict(row_groups=jnp.asarray([3, 0, 4], jnp.int32))),
                 token=(x[:1], dict(row_groups=jnp.asarray([[3, 0, 4]], jnp.int32))),
                 interleaved=(x, dict(interleaved=True)))
    rows, groups = calls[tiling]
    if tiling == "interleaved":   # five groups, two tokens each
        ws = [jnp.concatenate(w) for w in ws]
        scales = None if block is None else [jnp.concatenate(s) for s in scales]
    for kernels in (INTERPRET, KernelPolicy(impl="reference")):
        got = grouped_matmul(rows, ws, **groups, scale=scales, block=block, kernels=kernels)
        assert isinstance(got, list) and len(got) == 2
        for p, out in enumerate(got):
            want = grouped_matmul(rows, ws[p], **groups, scale=None if scales is None else scales[p], block=block,
                                  kernels=kernels)
            np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))


def test_bf16_rows_times_an_fp32_stack_multiply_in_fp32():
    """A plain stack wider than the rows (a router's fp32 matrix, bf16 rows): the product in fp32, the rows
    widened exactly, in the kernel and in the reference, within fp32 rounding of the float64 product; the split
    partials sum to the product in split order, bit for bit."""
    w, _ = make_stack(5, 1, 256, 48, jnp.float32)
    x = make_rows(6, 3, 256, jnp.bfloat16)
    want = np.asarray(x, np.float64) @ np.asarray(w[0], np.float64)
    for kernels in (INTERPRET, KernelPolicy(impl="reference")):
        got = grouped_matmul(x, w, interleaved=True, kernels=kernels)
        assert got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-5)
    partials = grouped_matmul_triton(x, w, interleaved=True, split_partials=True, interpret=True,
                                     config=GroupedMatmulConfig(k_splits=2))
    assert partials.shape == (2, 3, 48)
    np.testing.assert_array_equal(np.asarray(partials[0] + partials[1]),
                                  np.asarray(grouped_matmul_triton(x, w, interleaved=True, interpret=True,
                                                                   config=GroupedMatmulConfig(k_splits=2))))


@pytest.mark.parametrize("pairs", [True, False])
def test_an_fp8_stack_reads_back_column_by_column(pairs):
    """Read as uint16 pairs or as it is, a 1-byte stack keeps every column in place: a single-expert, single-block
    matmul with an identity input reads the codes back column by column (scale 1)."""
    k, n = 16, 32
    codes = jnp.asarray(np.random.default_rng(4).uniform(-4, 4, (1, k, n)), jnp.float8_e4m3fn)
    ones = jnp.ones((1, 1, 1), jnp.float32)
    got = grouped_matmul_triton(jnp.eye(k, dtype=jnp.float32), codes, jnp.asarray([k], jnp.int32), scale=ones,
                                block=(k, n), config=GroupedMatmulConfig(block_n=8, pairs=pairs), interpret=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(codes[0], np.float32))


def test_fp8_stacks_are_read_as_pairs_and_must_be_where_offsets_overflow():
    """Pairs for every 1-byte stack with even columns; they are required for one of 2 to 4 GiB (V3's 256 experts
    of one projection on one device), not below (a device's share under expert parallelism) or above (Pallas's
    64-bit offsets); forcing direct loads where offsets overflow is refused before tracing."""
    def stack(experts, columns=7168):
        return jax.ShapeDtypeStruct((experts, 2048, columns), jnp.float8_e4m3fn)
    assert [needs_pairs(stack(e)) for e in (64, 128, 256, 512)] == [False, False, True, False]
    assert [default_pairs(stack(e)) for e in (64, 256, 512)] == [True, True, True]
    assert not default_pairs(stack(64, 7167))
    assert not needs_pairs(jax.ShapeDtypeStruct((256, 2048, 7168), jnp.bfloat16))
    assert not default_pairs(jax.ShapeDtypeStruct((256, 2048, 7168), jnp.bfloat16))
    x, sizes = jax.ShapeDtypeStruct((8, 2048), jnp.bfloat16), jax.ShapeDtypeStruct((256,), jnp.int32)
    scale = jax.ShapeDtypeStruct((256, 16, 56), jnp.float32)
    with pytest.raises(ValueError, match="pairs=False.*overflows"):
        jax.eval_shape(lambda x, w, g, s: grouped_matmul_triton(
            x, w, g, scale=s, block=(128, 128), config=GroupedMatmulConfig(pairs=False)), x, stack(256), sizes, scale)
    odd = jax.ShapeDtypeStruct((256, 2048, 7167), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="read as column pairs, so it needs an even number of columns, got 7167"):
        jax.eval_shape(lambda x, w, g, s: grouped_matmul_triton(x, w, g, scale=s, block=(128, 128)), x, odd, sizes,
                       scale)
    with pytest.raises(ValueError, match="pairs=True needs a 1-byte stack"):
        grouped_matmul_triton(jnp.ones((2, 16)), jnp.ones((1, 16, 8)), jnp.asarray([2], jnp.int32),
                              config=GroupedMatmulConfig(pairs=True), interpret=True)


def rows_across_magnitudes(seed: int, rows: int, k: int) -> jax.Array:
    """bf16 rows each scaled by its own power of two from 2^-100 to 2^100 (float16's range is 2^-24 to 2^16), one
    of them spanning 2^-60 to 2^10 within itself, one zero."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, k)) * np.exp2(rng.integers(-100, 101, (rows, 1)))
    x[0] = rng.choice([-1, 1], k) * np.exp2(rng.uniform(-60, 10, k))
    x[1] = 0
    return jnp.asarray(x, jnp.bfloat16)


@pytest.mark.parametrize("block", [None, 64])
def test_f16_rows_hold_each_bf16_row_exactly_once_scaled(block, monkeypatch):
    """f16_rows: each row's largest magnitude lands in [2^14, 2^15) and scaling back returns every element of at
    least 2^-28 of it exactly; smaller ones within 2^-39 of it. A row is one block, or (block 64) a loop over
    blocks, the last one partly past the row."""
    if block:
        monkeypatch.setattr(grouped_matmul_triton_module, "F16_ROWS_BLOCK", block)
    x = rows_across_magnitudes(7, 12, 300)
    x16, unscale = f16_rows(x, interpret=True)
    assert x16.dtype == jnp.float16 and unscale.shape == (12,)
    exact = np.asarray(x, np.float64)
    back = np.asarray(x16, np.float64) * np.asarray(unscale, np.float64)[:, None]
    amax = np.abs(exact).max(axis=1, keepdims=True)
    live = amax[:, 0] > 0
    assert (np.abs(np.asarray(x16, np.float64)).max(axis=1)[live] >= 2 ** 14).all()
    assert (np.abs(np.asarray(x16, np.float64)).max(axis=1) < 2 ** 15).all()
    large = np.abs(exact) >= 2.0 ** -28 * amax
    np.testing.assert_array_equal(back[large], exact[large])
    assert (np.abs(back - exact) <= 2.0 ** -39 * amax).all()


@pytest.mark.parametrize("block", [None, 64])
def test_f16_rows_normalise_the_rows_as_rms_norm_does(block, monkeypatch):
    """f16_rows with a norm: the rows of rms_norm(x, weight, eps), scaled; its mean square is summed in the
    kernel's order, so a value may round one bf16 step apart from XLA's norm, and almost none does."""
    if block:
        monkeypatch.setattr(grouped_matmul_triton_module, "F16_ROWS_BLOCK", block)
    x = rows_across_magnitudes(10, 12, 300)
    weight = jnp.asarray(np.random.default_rng(11).uniform(0.5, 2.0, 300), jnp.bfloat16)
    x16, unscale = f16_rows(x, interpret=True, norm=(weight, 1e-6))
    got = np.asarray(x16, np.float64) * np.asarray(unscale, np.float64)[:, None]
    want = np.asarray(rms_norm(x, weight, 1e-6), np.float64)
    amax = np.abs(want).max(axis=1, keepdims=True)
    assert np.isfinite(got).all()
    # one bf16 step of the norm's rounding, or float16's rounding of values below 2^-28 of the row's largest
    assert (np.abs(got - want) <= 2.0 ** -7 * np.abs(want) + 2.0 ** -39 * amax).all()
    assert (got == want)[np.abs(want) >= 2.0 ** -28 * amax].mean() > 0.99
    with pytest.raises(ValueError, match="must not widen"):
        f16_rows(x, interpret=True, norm=(weight.astype(jnp.float32), 1e-6))


def test_f16_rows_keep_the_normalised_rows_they_scale():
    """keep_normalised: the normalised rows in x's dtype as a third output, the very values the float16 rows hold
    scaled (exactly, but for elements below 2^-28 of the row's largest); a norm is needed for it."""
    x = rows_across_magnitudes(12, 6, 300)
    weight = jnp.asarray(np.random.default_rng(13).uniform(0.5, 2.0, 300), jnp.bfloat16)
    x16, unscale, normalised = f16_rows(x, interpret=True, norm=(weight, 1e-6), keep_normalised=True)
    assert normalised.dtype == jnp.bfloat16 and normalised.shape == x.shape
    kept = np.asarray(normalised, np.float64)
    back = np.asarray(x16, np.float64) * np.asarray(unscale, np.float64)[:, None]
    large = np.abs(kept) >= 2.0 ** -28 * np.abs(kept).max(axis=1, keepdims=True)
    np.testing.assert_array_equal(back[large], kept[large])
    np.testing.assert_array_equal(np.asarray(x16), np.asarray(f16_rows(x, interpret=True, norm=(weight, 1e-6))[0]))
    with pytest.raises(ValueError, match="keep_normalised needs a norm"):
        f16_rows(x, interpret=True, keep_normalised=True)


@pytest.mark.parametrize("policy", [INTERPRET, KernelPolicy(impl="reference")])
def test_prepared_rows_give_what_the_rows_and_their_norm_give(policy):
    """prepared_rows: the normalised rows and, where the kernel takes bf16 rows as float16, the same as ScaledRows
    from one launch; grouped_matmul on them equals grouped_matmul on the rows with the norm, bit for bit, and
    the ScaledRows refuse a norm of their own."""
    k, n, block = 256, 64, (128, 32)
    w, scale = make_stack(14, len(SIZES), k, n, jnp.bfloat16, block)
    x = make_rows(15, sum(SIZES), k, jnp.bfloat16)
    norm = (jnp.asarray(np.random.default_rng(16).uniform(0.5, 2.0, k), jnp.bfloat16), 1e-6)
    sizes = jnp.asarray(SIZES, jnp.int32)
    normalised, rows = prepared_rows(x, norm, w, rows=x.shape[0], groups=w.shape[0], kernels=policy)
    assert isinstance(rows, ScaledRows) == (policy is INTERPRET)
    run = functools.partial(grouped_matmul, w=w, group_sizes=sizes, scale=scale, block=block, kernels=policy)
    np.testing.assert_array_equal(np.asarray(run(rows), np.float32), np.asarray(run(x, norm=norm), np.float32))
    if policy is INTERPRET:
        np.testing.assert_array_equal(np.asarray(run(rows), np.float32), np.asarray(run(normalised), np.float32))
        with pytest.raises(ValueError, match="no norm left to apply"):
            run(rows, norm=norm)


@pytest.mark.parametrize("policy", [INTERPRET, KernelPolicy(impl="reference")])
def test_leading_columns_are_the_rows_of_a_wider_array(policy):
    """leading_columns: x wider than K multiplies its first K columns (read in place by the kernel, with a norm
    over them alone): bit for bit the product of the slice; an x narrower than K is still refused."""
    k, n, block = 256, 64, (128, 32)
    w, scale = make_stack(20, 1, k, n, jnp.bfloat16, block)
    wide = make_rows(21, 3, k + 72, jnp.bfloat16)
    norm = (jnp.asarray(np.random.default_rng(22).uniform(0.5, 2.0, k), jnp.bfloat16), 1e-6)
    run = functools.partial(grouped_matmul, w=w, scale=scale, block=block, kernels=policy, interleaved=True,
                            norm=norm)
    np.testing.assert_array_equal(np.asarray(run(wide, leading_columns=True), np.float32),
                                  np.asarray(run(wide[:, :k]), np.float32))
    with pytest.raises(ValueError, match="x must be"):
        run(wide[:, :k - 8], leading_columns=True)


@pytest.mark.parametrize("per_row", [1, 3])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rows_read_through_an_index_equal_the_sorted_copy(per_row, dtype):
    """row_index (with group_sizes): sorted row r is x[row_index[r] // per_row] read in the kernel, bit for bit
    the product of the gathered copy; an index that is not a multiple of x's rows long is refused."""
    k, n, block = CASES[0]
    w, scale = make_stack(17, len(SIZES), k, n, dtype, block)
    x = make_rows(18, sum(SIZES) // per_row, k, dtype)   # 39 slots: 39 rows of one, 13 of three
    index = jnp.asarray(np.random.default_rng(19).permutation(sum(SIZES)), jnp.int32)
    sizes = jnp.asarray(SIZES, jnp.int32)
    got = grouped_matmul(x, w, sizes, row_index=index, scale=scale, block=block, kernels=INTERPRET)
    want = grouped_matmul(x[index // per_row], w, sizes, scale=scale, block=block, kernels=INTERPRET)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    with pytest.raises(ValueError, match="row_index must be integers"):
        grouped_matmul(x, w, sizes, row_index=index[:-1], scale=scale, block=block, kernels=INTERPRET)


@pytest.mark.parametrize("pairs", [True, False])
def test_bf16_rows_meet_an_fp8_stack_as_float16_with_the_same_products(pairs):
    """bf16 rows against an FP8 stack go to the kernel as scaled float16 (the default) and give what the bf16 rows
    give, at magnitudes float16 alone could not hold (2^-100 to 2^100): the same outputs in interpret mode, finite,
    each within a bf16 rounding of the float64 oracle's."""
    k, n, block = 200, 150, (64, 32)
    w, scale = make_stack(8, len(SIZES), k, n, jnp.bfloat16, block)
    x = rows_across_magnitudes(9, sum(SIZES), k)
    sizes = jnp.asarray(SIZES, jnp.int32)
    run = {f16: grouped_matmul_triton(x, w, sizes, scale=scale, block=block, interpret=True,
                                      config=GroupedMatmulConfig(block_n=16, pairs=pairs, f16_rows=f16))
           for f16 in (None, False)}
    got = np.asarray(run[None].astype(jnp.float32), np.float64)
    np.testing.assert_array_equal(got, np.asarray(run[False].astype(jnp.float32), np.float64))
    want = oracle(x, w, SIZES, scale, block)
    magnitude = oracle(jnp.abs(x.astype(jnp.float32)), jnp.abs(dequantize_stack_f32(w, scale, block)), SIZES,
                       None, None)   # sum |x w| per output: the scale of fp32 accumulation's rounding
    assert np.isfinite(got).all()
    assert (np.abs(got - want) <= 2.0 ** -8 * np.abs(want) + 1e-5 * magnitude).all()
    with pytest.raises(ValueError, match="f16_rows=True needs bfloat16 rows and a 1-byte stack"):
        grouped_matmul_triton(x.astype(jnp.float32), w, sizes, scale=scale, block=block, interpret=True,
                              config=GroupedMatmulConfig(f16_rows=True))


def dequantize_stack_f32(w, scale, block):
    """The stack's matrices dequantized to float32, [G, K, N]."""
    return jnp.stack([dequantize_blocks(w[g], scale[g], block) for g in range(w.shape[0])])


def fake_device(platform, capability=None):
    return types.SimpleNamespace(platform=platform, compute_capability=capability)


@pytest.mark.parametrize("device, plain, fp8", [
    (fake_device("cpu"), False, False),
    (fake_device("gpu", "8.0"), True, False),    # A100: no float8 conversions in Triton
    (fake_device("gpu", "8.9"), True, True),     # L4 / L40
    (fake_device("gpu", "9.0"), True, True),     # H100 / H200
    (fake_device("gpu", "gfx90a"), False, False),
])
def test_the_kernel_runs_where_triton_converts_the_stacks_dtype(device, plain, fp8):
    policy = KernelPolicy(device=device)
    assert policy.use_grouped_matmul_kernel(fp8=False, rows=16, groups=8) == plain
    assert not policy.use_grouped_matmul_kernel(fp8=False, rows=15, groups=8)      # experts: from 16 slots
    assert policy.use_grouped_matmul_kernel(fp8=False, rows=1, groups=1) == plain  # one dense matrix: few rows
    assert not policy.use_grouped_matmul_kernel(fp8=False, rows=17, groups=1)
    assert policy.use_grouped_matmul_kernel(fp8=True, rows=1, groups=8) == fp8
    assert not KernelPolicy(impl="reference", device=device).use_grouped_matmul_kernel(fp8=False, rows=64, groups=8)
    assert INTERPRET.use_grouped_matmul_kernel(fp8=True, rows=1, groups=8)


@pytest.mark.parametrize("change, match", [
    (dict(x=jnp.ones((4, 8))), r"x must be \[M, K\] and w \[G, K, N\]"),
    (dict(group_sizes=jnp.ones((3,), jnp.int32)), r"group_sizes must be integers \[G=2\]"),
    (dict(group_sizes=jnp.ones((2,), jnp.float32)), r"group_sizes must be integers"),
    (dict(group_sizes=None), "pass exactly one of group_sizes .*, row_groups"),
    (dict(row_groups=jnp.zeros((4,), jnp.int32)), "pass exactly one of group_sizes .*, row_groups"),
    (dict(group_sizes=None, row_groups=jnp.zeros((3,), jnp.int32)), r"row_groups must be integers \[M=4\]"),
    (dict(group_sizes=None, row_groups=jnp.zeros((4, 2, 1), jnp.int32)), r"or \[M=4, R\], got int32\[4, 2, 1\]"),
    (dict(scale=None, block=None), "a 1-byte \\(FP8\\) stack needs its block scales"),
    (dict(block=None), "pass scale= and block= together"),
    (dict(scale=jnp.ones((2, 1, 1), jnp.float32)), r"scale must be \[2, 1, 2\] for w \[2, 16, 32\]"),
    (dict(interleaved=True), "interleaved rows name their groups themselves"),
    (dict(w=[jnp.zeros((2, 16, 32), jnp.float8_e4m3fn)] * 2, scale=[jnp.ones((2, 1, 2), jnp.float32)]),
     "a list of 2 products takes a list of as many scales"),
    (dict(w=[jnp.zeros((2, 16, 32), jnp.float8_e4m3fn), jnp.zeros((2, 16, 64), jnp.float8_e4m3fn)],
          scale=[jnp.ones((2, 1, 2), jnp.float32), jnp.ones((2, 1, 4), jnp.float32)]),
     "products of one call must be alike"),
    (dict(group_sizes=None, scale=None, block=None, x=jnp.ones((3, 16)), w=jnp.zeros((2, 16, 32)),
          interleaved=True), "x's 3 rows must be a multiple of the 2 groups"),
])
def test_bad_input_is_refused_naming_the_argument(change, match):
    args = dict(x=jnp.ones((4, 16)), w=jnp.zeros((2, 16, 32), jnp.float8_e4m3fn),
                group_sizes=jnp.asarray([2, 2], jnp.int32), scale=jnp.ones((2, 1, 2), jnp.float32), block=(16, 16))
    args.update(change)
    with pytest.raises((ValueError, TypeError), match=match):
        grouped_matmul(args.pop("x"), args.pop("w"), args.pop("group_sizes"), **args)


@pytest.mark.skipif(not has_kernels(jax.devices()[0], (8, 9)), reason="compiles the FP8 Triton kernel (sm_89+)")
def test_the_compiled_kernel_matches_the_reference_on_the_gpu():
    k, n = 7168 // 4, 2048 // 4
    w, scale = make_stack(5, 8, k, n, jnp.bfloat16, (128, 128))
    x = make_rows(6, sum(SIZES) + 7, k, jnp.bfloat16)
    sizes = jnp.asarray(SIZES + (0, 0, 7), jnp.int32)
    got = jax.jit(lambda x: grouped_matmul(x, w, sizes, scale=scale, block=(128, 128)))(x)
    want = grouped_matmul_reference(x, w, sizes, scale=scale, block=(128, 128))
    assert relative_error(got, np.asarray(want, np.float64)) < 1e-2


def quantized_rows(x, chunk: int) -> np.ndarray:
    """x [M, K] as the kernel's fp8_rows multiplies it, in float64: each row's chunk of K rounded to e4m3 at the
    scale amax / 448, then scaled back."""
    x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    out = np.zeros_like(x)
    for start in range(0, x.shape[1], chunk):
        part = x[:, start:start + chunk]
        row_scale = np.maximum(np.abs(part).max(axis=1, keepdims=True), np.finfo(np.float32).tiny) / 448.0
        codes = jnp.asarray(part / row_scale, jnp.float32).astype(jnp.float8_e4m3fn).astype(jnp.float32)
        out[:, start:start + chunk] = np.asarray(codes, np.float64) * row_scale
    return out


@pytest.mark.parametrize("k, n, block", [case for case in CASES if case[2] is not None])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fp8_rows_multiply_the_rows_quantized_per_chunk(k, n, block, dtype):
    """fp8_activations: the kernel's FP8 x FP8 product equals the oracle's on the rows quantized per scale block
    of K (their own amax scale), and differs from the exact rows' product by the quantization alone."""
    w, scale = make_stack(0, len(SIZES), k, n, dtype, block)
    x = make_rows(1, sum(SIZES), k, dtype)
    got = grouped_matmul(x, w, jnp.asarray(SIZES, jnp.int32), scale=scale, block=block,
                         kernels=KernelPolicy(interpret=True, fp8_activations=True),
                         config=GroupedMatmulConfig(block_n=16))
    assert relative_error(got, oracle(quantized_rows(x, block[0]), w, SIZES, scale, block)) < (
        1e-5 if dtype == jnp.float32 else 2e-2)
    assert 1e-3 < relative_error(got, oracle(x, w, SIZES, scale, block)) < 0.1
