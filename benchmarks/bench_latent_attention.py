"""MLA's absorbed decode attention (DeepSeek-V2/V3): multi-query attention over the 576-wide latent cache (values
its first 512 columns), the Pallas kernel against XLA's reference, in GB/s of latent rows read over the copy
bandwidth measured in the same process (FlashMLA's published anchor: ~3000 GB/s on an H800).

Heads: 128 (DeepSeek-V3 on one device) and 16 (V2-Lite, or V3 over 8 devices); context 4k-32k, batch 8-64, T = 1
query tokens per row (`--tokens 4`: a verify pass of k = 3 drafts, as MTP runs it).
Each timed call reads a different layer of a cache of several layers (more bytes than the 50 MB L2), and the device
time comes from a profiler trace. `--sweep` times launch parameters at a few shapes (V3's decode step at context
1024 among them) over every axis of SWEEP or those `--sweep-over` names (the others as the default config has them).

    PYTHONPATH=. python benchmarks/bench_latent_attention.py [--tokens T] [--sweep | --sweep-only]
        [--sweep-over AXES] [--sweep-at HEADSxBATCHxCONTEXT,...] [--smoke]

Writes $OUT/bench_latent_attention.json (and bench_latent_attention_sweep.json) and prints each row as it comes.
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from benchmarks.common import (add_sweep_arguments, copy_bandwidth, interpret_kernels, print_table, relative_error,
                               rotation_copies, swept_axes, swept_configs, write_json)
from benchmarks.device_trace import busy_ns, traced_kernels
from specjax.kernels.attention_reference import attention_reference
from specjax.kernels.attention_triton import KernelConfig, attention_triton, default_config

RANK, ROPE = 512, 64
WIDTH = RANK + ROPE
SHAPES = {128: [(b, c) for b in (8, 16, 32, 64) for c in (4096, 8192, 16384, 32768)],
          16: [(b, c) for b in (8, 64) for c in (4096, 32768)]}
SWEEP_SHAPES = ((128, 1, 1024), (128, 8, 1024), (128, 8, 4096), (128, 64, 16384), (16, 64, 32768))
SWEEP = {"block_k": (16, 32, 64), "rows_per_tile": (16, 32, 64), "num_warps": (4, 8), "num_splits": (1, 4, 8, 16, 32)}
SMOKE_SHAPES = {4: [(2, 64)]}
ROTATION_BYTES = 1 << 30
CALLS = 3


def cache_layers(batch: int, context: int, smoke: bool) -> int:
    """Layers to cycle through so that consecutive calls do not find their rows in L2."""
    return rotation_copies(batch * context * WIDTH * 2, 0 if smoke else ROTATION_BYTES, most=16)


def inputs(heads: int, batch: int, context: int, layers: int, tokens: int):
    """Queries [batch, tokens, heads, 576] whose last sees the whole context, a cache of `layers` layers."""
    key = jax.random.key(batch * 7919 + context + heads)
    q = jax.random.normal(key, (batch, tokens, heads, WIDTH), jnp.bfloat16)
    cache = jax.random.normal(jax.random.fold_in(key, 1), (layers, batch, 1, context, WIDTH), jnp.bfloat16)
    return q, cache, jnp.full((batch,), context - tokens, jnp.int32)


def device_ms(fn, q, cache, start, layers: int) -> float:
    """Device-busy ms per call of fn(q, cache, layer, start), each call on the next layer; NaN off GPUs."""
    call = jax.jit(fn)
    layer_ids = [jnp.int32(i % layers) for i in range(CALLS * layers)]
    jax.block_until_ready([call(q, cache, layer, start) for layer in layer_ids[:layers]])
    kernels = traced_kernels(lambda: [call(q, cache, layer, start) for layer in layer_ids])
    return busy_ns(kernels) / len(layer_ids) / 1e6 if kernels else float("nan")


def kernel_fn(config: KernelConfig | None, interpret: bool):
    scale = (128 + ROPE) ** -0.5
    return lambda q, cache, layer, start: attention_triton(q, cache, None, layer, start, scale=scale, config=config,
                                                           value_dim=RANK, interpret=interpret)


def reference_fn(q, cache, layer, start):
    return attention_reference(q, cache, None, layer, start, scale=(128 + ROPE) ** -0.5, value_dim=RANK)


def form_rows(shapes: dict, bandwidth: float, smoke: bool, tokens: int) -> list[dict]:
    interpret = interpret_kernels()
    rows = []
    for heads, cases in shapes.items():
        for batch, context in cases:
            layers = cache_layers(batch, context, smoke)
            q, cache, start = inputs(heads, batch, context, layers, tokens)
            read_gb = batch * context * WIDTH * 2 / 1e9
            want = jax.jit(reference_fn)(q, cache, 0, start)
            config = default_config(q.shape, cache.shape, value_dim=RANK)
            for form, fn in (("kernel", kernel_fn(None, interpret)), ("xla", reference_fn)):
                ms = device_ms(fn, q, cache, start, layers)
                row = dict(heads=heads, batch=batch, context=context, tokens=tokens, form=form, ms=ms,
                           GBps=read_gb / ms * 1e3,
                           of_copy=read_gb / ms * 1e12 / bandwidth,
                           rel_err=relative_error(jax.jit(fn)(q, cache, 0, start), want))
                if form == "kernel":
                    row.update(block_k=config.block_k, rows_per_tile=config.rows_per_tile,
                               splits=config.num_splits, num_warps=config.num_warps)
                rows.append(row)
                print_table([row])
            del q, cache
    return rows


def sweep_rows(shapes, bandwidth: float, smoke: bool, tokens: int, axes: tuple[str, ...] = tuple(SWEEP)) -> list[dict]:
    interpret = interpret_kernels()
    rows = []
    for heads, batch, context in shapes:
        layers = cache_layers(batch, context, smoke)
        q, cache, start = inputs(heads, batch, context, layers, tokens)
        read_gb = batch * context * WIDTH * 2 / 1e9
        for config in swept_configs(default_config(q.shape, cache.shape, value_dim=RANK), SWEEP, axes):
            try:
                ms = device_ms(kernel_fn(config, interpret), q, cache, start, layers)
            except Exception as error:  # a variant needing more shared memory or registers than the SM has
                print(f"{config}: failed: {str(error)[:160]}", flush=True)
                continue
            row = dict(heads=heads, batch=batch, context=context, tokens=tokens,
                       **{axis: getattr(config, axis) for axis in SWEEP}, ms=ms, GBps=read_gb / ms * 1e3,
                       of_copy=read_gb / ms * 1e12 / bandwidth)
            rows.append(row)
            print_table([row])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_sweep_arguments(parser, SWEEP)
    parser.add_argument("--tokens", type=int, default=1, help="query tokens per row (a verify pass: k + 1)")
    parser.add_argument("--sweep-at", help="the sweep's shapes as HEADSxBATCHxCONTEXT, comma-separated (default: "
                        + ",".join("x".join(map(str, shape)) for shape in SWEEP_SHAPES) + ")")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, to check the script")
    args = parser.parse_args()
    axes = swept_axes(parser, args, SWEEP)
    bandwidth = copy_bandwidth(64 << 20 if args.smoke else 2 << 30)
    print(f"{jax.devices()[0].device_kind}: copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    if not args.sweep_only:
        print("wrote", write_json("bench_latent_attention", form_rows(
            SMOKE_SHAPES if args.smoke else SHAPES, bandwidth, args.smoke, args.tokens)))
    if args.sweep or args.sweep_only:
        shapes = ((4, 2, 64),) if args.smoke else SWEEP_SHAPES if not args.sweep_at else tuple(
            tuple(int(n) for n in shape.split("x")) for shape in args.sweep_at.split(","))
        print("wrote", write_json("bench_latent_attention_sweep", sweep_rows(shapes, bandwidth, args.smoke,
                                                                             args.tokens, axes)))


if __name__ == "__main__":
    main()
