"""MLA's input rows after the fused q_a / kv_a product, in one launch: the product's K-split partial sums added
up, the latent row [c_kv ; k_rope] (c_kv RMS-normalised, k_rope rotated) written into its cache slot, and q_a's
part RMS-normalised as the scaled float16 rows an FP8 q_b takes (grouped_matmul_triton.f16_rows). XLA launched
the partials' sum, the kv norm's reduction, the cache write and the q rows' own kernel: four launches a layer at a
decode step, three of them only a few microseconds of work.

The arithmetic is the separate launches': the partials added in split order and rounded to bf16, each norm as
rms_norm rounds it (the q rows as f16_rows computes them, bit for bit), the rotation in fp32 from the cos and sin
the caller's rotation gives (models/rope.py `unit_rotation`; a cos - b sin may land a bf16 ulp apart where a
compiler fuses it into one multiply-add). A row's result depends on that row alone, so it rounds the same in a
decode step and in a verify pass.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from specjax.kernels.grouped_matmul_triton import ScaledRows, store_scaled_f16

# Warps of a row's one program: its loads of every split's partials are in flight together only as far as the
# registers of its threads hold them.
NUM_WARPS = 16


def latent_rows(partials: jax.Array, q_norm: tuple[jax.Array, float], kv_norm: tuple[jax.Array, float],
                q_width: int, rotation: jax.Array, cache: jax.Array, layer: jax.Array | int, start: jax.Array, *,
                interleaved: bool, interpret: bool = False) -> tuple[ScaledRows, jax.Array]:
    """partials [S, M, W] (fp32 partial products of wqkv_a over S splits of K; M = B * T rows, token-major per
    row of the cache) -> (q_a's rows rms-normalised by q_norm as ScaledRows [M, q_lora_rank], the cache [L, B,
    slots, R + rope] with row m's latent written at layer `layer`, row m // T, slot start[m // T] + m % T).
    Columns of W: q_a's first q_lora_rank (= q_norm's width) of q_width, then c_kv (R = kv_norm's width), then
    k_rope. rotation [M, rope] fp32: each row's cos and sin where the rotation puts a pair's first and second
    value (models/rope.py `unit_rotation`); interleaved: pairs (2i, 2i + 1), else (i, i + rope / 2)."""
    splits, rows, width = partials.shape
    q_rank, rank = q_norm[0].shape[0], kv_norm[0].shape[0]
    rope = width - q_width - rank
    tokens = rows // start.shape[0]
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    out_shape = [jax.ShapeDtypeStruct((rows, q_rank), jnp.float16), jax.ShapeDtypeStruct((rows,), jnp.float32),
                 jax.ShapeDtypeStruct(cache.shape, cache.dtype)]
    args = (partials, q_norm[0], kv_norm[0], rotation, start.astype(jnp.int32), layer, cache)
    values, unscale, cache = pl.pallas_call(
        functools.partial(_latent_rows_kernel, splits=splits, q_rank=q_rank, q_width=q_width, rank=rank, rope=rope,
                          tokens=tokens, q_eps=float(q_norm[1]), kv_eps=float(kv_norm[1]), interleaved=interleaved),
        grid=(rows,),
        in_specs=[pl.BlockSpec() for _ in args],
        out_specs=[pl.BlockSpec() for _ in out_shape],
        out_shape=out_shape,
        input_output_aliases={len(args) - 1: 2},   # the cache is updated where it lies
        compiler_params=plt.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret,
        name="specjax_latent_rows",
    )(*args)
    return ScaledRows(values, unscale), cache


def _latent_rows_kernel(partials_ref, q_weight_ref, kv_weight_ref, rotation_ref, start_ref, layer_ref, _,
                        values_ref, unscale_ref, cache_ref, *, splits: int, q_rank: int, q_width: int, rank: int,
                        rope: int, tokens: int, q_eps: float, kv_eps: float, interleaved: bool) -> None:
    """One row m: each part of the product summed over the splits and rounded as the sum of the separate launch,
    then the q rows (f16_rows' arithmetic), c_kv normalised and k_rope rotated into the cache slot."""
    m = pl.program_id(0)
    row, slot = lax.div(m, tokens), start_ref[lax.div(m, tokens)] + lax.rem(m, tokens)
    layer = layer_ref[0]

    def summed(columns, ok):
        # Unrolled, so that the splits' loads are independent and in flight together (a loop's would wait on
        # each other: one program reads a row's every partial); added in split order all the same.
        parts = [plt.load(partials_ref.at[s, m, columns], mask=ok, other=0.0) for s in range(splits)]
        return functools.reduce(jnp.add, parts).astype(jnp.bfloat16).astype(jnp.float32)

    def block(offset, width):
        columns = lax.broadcasted_iota(jnp.int32, (pl.next_power_of_2(width),), 0)
        return columns, columns < width, offset + columns

    # q_a's rows, normalised and scaled to float16 as f16_rows does (one block: its squares' sum, then amax).
    q_cols, q_ok, q_src = block(0, q_rank)
    q = summed(q_src, q_ok)
    inverse = lax.rsqrt(jnp.sum(q ** 2) / q_rank + q_eps)
    normalised = (q * inverse).astype(jnp.bfloat16).astype(jnp.float32)
    q_weight = plt.load(q_weight_ref.at[q_cols], mask=q_ok, other=0.0).astype(jnp.float32)
    q = (q_weight * normalised).astype(jnp.bfloat16).astype(jnp.float32)
    store_scaled_f16(lambda c: (q_cols, q_ok, q), 1, values_ref, unscale_ref, m)

    # c_kv as rms_norm rounds it: fp32 normalised, rounded, times the weight in bf16.
    kv_cols, kv_ok, kv_src = block(q_width, rank)
    kv = summed(kv_src, kv_ok)
    kv = (kv * lax.rsqrt(jnp.sum(kv * kv) / rank + kv_eps)).astype(jnp.bfloat16).astype(jnp.float32)
    kv_weight = plt.load(kv_weight_ref.at[kv_cols], mask=kv_ok, other=0.0).astype(jnp.float32)
    plt.store(cache_ref.at[layer, row, slot, kv_cols], (kv_weight * kv).astype(cache_ref.dtype), mask=kv_ok)

    # k_rope turned pair by pair: (a cos - b sin, b cos + a sin), a pair's first value a, its second b.
    half = rope // 2
    pair = lax.broadcasted_iota(jnp.int32, (half,), 0)
    first, second = (2 * pair, 2 * pair + 1) if interleaved else (pair, pair + half)
    base = q_width + rank
    a, b = summed(base + first, first < rope), summed(base + second, second < rope)
    cos = plt.load(rotation_ref.at[m, first])
    sin = plt.load(rotation_ref.at[m, second])
    plt.store(cache_ref.at[layer, row, slot, rank + first], (a * cos - b * sin).astype(cache_ref.dtype))
    plt.store(cache_ref.at[layer, row, slot, rank + second], (b * cos + a * sin).astype(cache_ref.dtype))

