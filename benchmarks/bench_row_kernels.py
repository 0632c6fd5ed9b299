"""The row kernels between DeepSeek-V3's FP8 projections (kernels/latent_rows.py, kernels/swiglu_rows.py) at V3's
widths, by warps, against the launches each replaces: device time per call from the profiler (kernels only, so
the graph's per-launch gaps the one launch saves come on top), and the launches per call.

    PYTHONPATH=. python benchmarks/bench_row_kernels.py [--batches 1 8 32] [--warps 4 8 16] [--smoke]

Cases: MLA's latent rows (wqkv_a's 28 K-split partials of 1536 + 512 + 64 columns: q_a's rows for q_b, c_kv
normalised and k_rope rotated into the cache) against their sum, norms, cache write and f16_rows; SwiGLU rows of
an expert (9 slots a token, 2 splits of 2048) and of the dense MLP (3 splits of 18432) against XLA's fusion and
f16_rows. Each call's outputs are all read (a discarded one would be left out of the separate launches).
Writes $OUT/bench_row_kernels.json. --smoke: batch 1, 4 warps, interpreted kernels, no device times (CPU).
"""
from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

from benchmarks.common import print_table, write_json
from benchmarks.device_trace import busy_ns, traced_calls
from specjax.kernels import latent_rows, swiglu_rows
from specjax.kernels.grouped_matmul_triton import f16_rows
from specjax.kernels.projection_reference import rms_norm
from specjax.models import mla
from specjax.models.rope import rotary, unit_rotation

Q_WIDTH, Q_RANK, RANK, ROPE, SPLITS = 1536, 1536, 512, 64, 28   # V3's fused q_a / kv_a product
SLOTS, POSITION, EPS = 1040, 700, 1e-6
MLPS = {"expert": (2, 9, 2048), "dense": (3, 1, 18432)}   # splits, rows per token, width
CALLS = 50


def device_us(step, *args, interpret: bool) -> tuple[float, float]:
    """(device us, launches) per call of step(*args) -> the next value of its first argument (donated and handed
    on: the cache is updated in place, as in the model), CALLS calls traced back to back."""
    calls = 1 if interpret else CALLS
    kernels = traced_calls(step, *args, calls=calls, threaded=True)
    return (busy_ns(kernels) / calls / 1e3, len(kernels) / calls) if kernels else (float("nan"), float("nan"))


def separate_latent_rows(partials, q_norm, kv_norm, q_width: int, rotate, positions, cache, layer, start,
                         interpret: bool = False):
    """The launches the latent rows kernel replaces (the partials' sum, f16_rows' q rows, rms_norm's c_kv, the
    model's own rotation of k_rope and mla.write_latent): (f16 rows, unscale, cache). positions [B, T]."""
    batch, tokens = positions.shape
    q_rank, rank = q_norm[0].shape[0], kv_norm[0].shape[0]
    both = functools.reduce(jnp.add, list(partials)).astype(jnp.bfloat16)
    values, unscale = f16_rows(both[:, :q_rank], interpret, q_norm)
    c_kv = rms_norm(both[:, q_width:q_width + rank], *kv_norm).reshape(batch, tokens, rank)
    k_rope = both[:, q_width + rank:]
    k_rope = rotate(k_rope.reshape(batch, tokens, 1, k_rope.shape[-1]), positions)[:, :, 0]
    return values, unscale, mla.write_latent(cache, layer, jnp.concatenate([c_kv, k_rope], axis=-1), start)


def latent_case(B: int, warps: int | None, interpret: bool) -> dict:
    """The latent rows kernel at `warps` (None: the separate launches) for B one-token rows."""
    keys = jax.random.split(jax.random.key(B), 3)
    partials = jax.random.normal(keys[0], (SPLITS, B, Q_WIDTH + RANK + ROPE), jnp.float32)
    q_norm, kv_norm = (jnp.ones((Q_RANK,), jnp.bfloat16), EPS), (jnp.ones((RANK,), jnp.bfloat16), EPS)
    rotate = rotary(ROPE, 10000.0, None, interleaved=True, max_position_embeddings=163840)
    start = jnp.full((B,), POSITION, jnp.int32)
    rotation = unit_rotation(rotate, start[:, None], ROPE, True)
    cache = jnp.zeros((4, B, SLOTS, RANK + ROPE), jnp.bfloat16)

    def kernel(cache, partials, rotation, start):
        rows, cache = latent_rows.latent_rows(partials, q_norm, kv_norm, Q_WIDTH, rotation, cache, 1, start,
                                              interleaved=True, interpret=interpret)
        return cache.at[0, 0, 0, 0].add(rows.values[0, 0] * rows.unscale[0])

    def separate(cache, partials, rotation, start):
        values, unscale, cache = separate_latent_rows(partials, q_norm, kv_norm, Q_WIDTH, rotate, start[:, None],
                                                      cache, 1, start, interpret)
        return cache.at[0, 0, 0, 0].add(values[0, 0] * unscale[0])

    if warps is not None:
        latent_rows.NUM_WARPS = warps
    us, launches = device_us(separate if warps is None else kernel, cache, partials, rotation, start,
                             interpret=interpret)
    return dict(case="latent rows", batch=B, form="separate" if warps is None else "kernel", warps=warps,
                device_us=us, launches=launches)


def swiglu_case(mlp: str, B: int, warps: int | None, interpret: bool) -> dict:
    """The SwiGLU rows kernel at `warps` (None: XLA's fusion and f16_rows) for one MLP's rows of B tokens."""
    splits, per_token, width = MLPS[mlp]
    keys = jax.random.split(jax.random.key(B), 2)
    gate, up = (jax.random.normal(key, (splits, B * per_token, width), jnp.float32) for key in keys)

    def kernel(total, gate, up):
        rows = swiglu_rows.swiglu_rows(gate, up, interpret)
        return total + rows.values[0, 0] * rows.unscale[0]

    def separate(total, gate, up):
        summed = [functools.reduce(jnp.add, list(p)).astype(jnp.bfloat16) for p in (gate, up)]
        values, unscale = f16_rows(jax.nn.silu(summed[0]) * summed[1], interpret)
        return total + values[0, 0] * unscale[0]

    if warps is not None:
        swiglu_rows.NUM_WARPS = warps
    us, launches = device_us(separate if warps is None else kernel, jnp.float32(0), gate, up, interpret=interpret)
    return dict(case=f"swiglu rows ({mlp})", batch=B, form="separate" if warps is None else "kernel", warps=warps,
                device_us=us, launches=launches)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=(1, 8, 32))
    parser.add_argument("--warps", type=int, nargs="+", default=(4, 8, 16))
    parser.add_argument("--smoke", action="store_true", help="batch 1, 4 warps, interpreted, on CPU")
    args = parser.parse_args(argv)
    interpret = args.smoke or jax.default_backend() != "gpu"
    batches, warps = ((1,), (4,)) if args.smoke else (args.batches, args.warps)
    defaults = latent_rows.NUM_WARPS, swiglu_rows.NUM_WARPS
    rows = []
    for B in batches:
        for form in (None, *warps):
            rows.append(latent_case(B, form, interpret))
            rows += [swiglu_case(mlp, B, form, interpret) for mlp in MLPS]
            print(*rows[-3:], sep="\n", flush=True)
    latent_rows.NUM_WARPS, swiglu_rows.NUM_WARPS = defaults
    rows.sort(key=lambda r: (r["case"], r["batch"]))
    print_table(rows)
    write_json("bench_row_kernels", rows)


if __name__ == "__main__":
    main()
