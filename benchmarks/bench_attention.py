"""Verify/decode attention on a GPU: correctness against the reference, then bandwidth.

Run in one device call:  PYTHONPATH=. python benchmarks/bench_attention.py [--sweep] [--smoke]
1. checks the Triton kernel against the reference on several shapes (GQA 1/4/8, mixed lengths,
   NaN garbage past each row's last token, fp32 and bf16, a prefill) and that the compiled
   program never copies a layer's K/V out of the stacked cache;
2. measures the device copy bandwidth (the ceiling);
3. times kernel and reference per layer, rotating through distinct cache layers so the data is
   not served from L2 (device time from a profiler trace; wall-clock figures beside it, see time_case) for the
   Llama-3.1-8B attention shape (Hq=32, Hkv=8, D=128, bf16), T in 1/4/8/16, context
   1024/4096/16384, batch 1 and 8. Bandwidth = K+V bytes of the visible context / time.
`--sweep` then times launch-parameter variants on the key shapes (SWEEP_SHAPES). Prints a table;
writes JSON to $OUT (or benchmarks/results) as bench_attention.json, updated after each shape.
`--smoke` runs the same steps on tiny shapes (the kernels in interpret mode off GPUs, where the profiler sees no
device time and the table shows wall-clock figures): a check of the script, not a measurement.
`--ncu` only launches a few variants once each, for Nsight Compute. Run it with
XLA_PYTHON_CLIENT_PREALLOCATE=false and a --kernel-name filter: with JAX's default
preallocation ncu saves and restores ~100 GB per replay pass (one attempt timed out).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from jax import lax

from benchmarks.common import copy_bandwidths, interpret_kernels, out_dir, relative_error, rotation_copies
from benchmarks.device_trace import median_duration_us, traced_kernels
from specjax.kernels.attention import attention, choose_attention
from specjax.kernels.attention_reference import attention_reference
from specjax.kernels.attention_triton import KernelConfig, attention_triton, default_config
from specjax.kernels.policy import KernelPolicy

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
TOKENS = (1, 4, 8, 16)
CONTEXTS = (1024, 4096, 16384)
BATCHES = (1, 8)
SWEEP_SHAPES = ((8, 1, 4096), (8, 4, 4096), (8, 1, 16384), (1, 1, 16384))
# batch, tokens, q_heads, kv_heads, slots, head_dim, dtype
CASES = (
    (4, 1, 32, 8, 1000, 128, jnp.bfloat16),
    (3, 5, 32, 8, 4096, 128, jnp.bfloat16),
    (2, 16, 64, 8, 2048, 128, jnp.bfloat16),
    (5, 3, 16, 16, 777, 64, jnp.float32),
    (2, 9, 28, 4, 1500, 128, jnp.float32),
    (1, 600, 32, 8, 1024, 128, jnp.bfloat16),   # prefill: row tiles
)


@dataclasses.dataclass(frozen=True)
class Scale:
    """How big a run is: the GPU run, or --smoke's tiny one."""
    cases: tuple = CASES                     # the correctness checks
    compiled_shape: tuple = (8, 4, 4096)     # batch, tokens, context of the compiled-program report
    copy_elements: int = 1 << 28             # float32 elements (1 GiB) of the copy-bandwidth passes
    # Enough distinct layers that one timed pass reads far more than the 60 MB L2.
    rotation_bytes: int = 1 << 30
    repeats: int = 10
    flash_cases: tuple = ((8, 4096), (1, 16384))   # batch, context of JAX's flash decoding
    flash_splits: tuple = (4, 8, 16)
    table_shapes: tuple = tuple((b, t, c) for b in BATCHES for c in CONTEXTS for t in TOKENS)
    key_shapes: tuple = SWEEP_SHAPES         # --quick's table and the sweep's shapes


SMOKE = Scale(cases=((2, 20, 8, 2, 64, 16, jnp.bfloat16),), compiled_shape=(2, 4, 64), copy_elements=1 << 20,
              rotation_bytes=0, repeats=1, flash_cases=((1, 256),), flash_splits=(2,), table_shapes=((2, 4, 64),),
              key_shapes=((2, 1, 64),))


_BEGIN = time.perf_counter()


def log(*parts) -> None:
    print(f"[{time.perf_counter() - _BEGIN:6.1f}s]", *parts, flush=True)


def median_seconds(run, repeats: int) -> float:
    """Median wall time of run() (which blocks until the device is done), after two warm-ups."""
    run()
    run()
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        run()
        times.append(time.perf_counter() - begin)
    return statistics.median(times)


def copy_bandwidth(scale: Scale) -> dict:
    """Device copy bandwidth in GB/s (read + write) by each way common.copy_bandwidths measures, and the fastest."""
    results = {name: rate / 1e9 for name, rate in copy_bandwidths(4 * scale.copy_elements).items()}
    results["ceiling_gbs"] = max(results.values())
    return results


def random_cache(key, layers, batch, slots, starts, tokens, dtype, poison=True):
    """Random q-compatible K/V caches; slots past each row's last written token are NaN."""
    k_key, v_key = jax.random.split(key)
    shape = (layers, batch, KV_HEADS, slots, HEAD_DIM)
    k = jax.random.normal(k_key, shape, dtype)
    v = jax.random.normal(v_key, shape, dtype)
    if poison:
        written = jnp.arange(slots)[None, :] < (starts + tokens)[:, None]
        mask = written[None, :, None, :, None]
        k = jnp.where(mask, k, jnp.nan)
        v = jnp.where(mask, v, jnp.nan)
    return k, v


def check_correctness(cases, kernels: KernelPolicy) -> list[dict]:
    """Kernel vs reference (fp32 reference at highest matmul precision) on varied shapes."""
    results = []
    key = jax.random.key(1)
    for batch, tokens, q_heads, kv_heads, slots, head_dim, dtype in cases:
        key, q_key, s_key, c_key = jax.random.split(key, 4)
        starts = jax.random.randint(s_key, (batch,), 0, slots - tokens + 1).at[0].set(0)
        q = jax.random.normal(q_key, (batch, tokens, q_heads, head_dim), dtype)
        k_key, v_key = jax.random.split(c_key)
        shape = (2, batch, kv_heads, slots, head_dim)
        written = (jnp.arange(slots)[None, :] < (starts + tokens)[:, None])[None, :, None, :, None]
        k = jnp.where(written, jax.random.normal(k_key, shape, dtype), jnp.nan)
        v = jnp.where(written, jax.random.normal(v_key, shape, dtype), jnp.nan)
        scale = head_dim ** -0.5
        try:
            out = jax.jit(lambda q, k, v, s: attention(q, k, v, jnp.int32(1), s, scale=scale,
                                                       kernels=kernels))(q, k, v, starts)
        except Exception as error:  # record and go on: the other cases still tell something
            log(f"check failed to run: {str(error)[:300]}")
            out = jnp.full(q.shape, jnp.nan, q.dtype)
        with jax.default_matmul_precision("highest"):
            expected = jax.jit(lambda q, k, v, s: attention_reference(
                q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                jnp.int32(1), s, scale=scale))(q, k, v, starts)
        error = relative_error(out, expected)
        tolerance = 1e-4 if dtype == jnp.float32 else 1e-2
        config = default_config(q.shape, k.shape)
        results.append(dict(shape=[batch, tokens, q_heads, kv_heads, slots, head_dim],
                            dtype=jnp.dtype(dtype).name, rel_error=error, tolerance=tolerance,
                            ok=bool(error < tolerance), config=dataclasses.asdict(config)))
        log(f"check B={batch} T={tokens} Hq={q_heads} Hkv={kv_heads} S={slots} D={head_dim} "
            f"{jnp.dtype(dtype).name}: rel_error={error:.2e} "
            f"{'OK' if error < tolerance else 'FAIL'} {config}")
    return results


def layer_scan(fn):
    """Jitted: fn applied to every layer of the stacked cache inside lax.scan (like the model)."""

    @jax.jit
    def run(q, k, v, start):
        def step(carry, layer):
            return carry, fn(q, k, v, layer, start)
        return lax.scan(step, None, jnp.arange(k.shape[0], dtype=jnp.int32))[1]

    return run


def no_layer_copy(compiled_text: str, k) -> bool:
    """True when no buffer of one layer's K/V shape appears in the optimized HLO."""
    layer_shape = ",".join(str(d) for d in k.shape[1:])
    dtype = jnp.dtype(k.dtype).name
    return (f"{dtype}[{layer_shape}]" not in compiled_text
            and f"{dtype}[1,{layer_shape}]" not in compiled_text)


def rotation_layers(batch: int, context: int, scale: Scale) -> int:
    """Distinct cache layers to cycle through so that a timed pass is not served from L2."""
    layer_bytes = 2 * batch * KV_HEADS * context * HEAD_DIM * 2
    return rotation_copies(layer_bytes, scale.rotation_bytes, most=64)


def time_case(batch, tokens, context, configs, scale: Scale, interpret: bool, with_scan: bool = True) -> dict:
    """Per-layer times of the kernel (each config) and the reference at one shape.

    Rotating through `layers` cache slabs: `us` is the device time per call from a profiler trace
    of back-to-back jitted calls (one per layer): every kernel of the call (the attention kernel, the
    split merge), `kernel_us` the attention kernel alone. Wall-clock figures beside it (back-to-back
    calls, and a jitted lax.scan over the layers, the model's form) include dispatch and loop costs;
    sweeps (with_scan=False) rank variants by the device time alone (by calls_us off GPUs, where the trace
    has none). interpret: the kernel in Pallas interpret mode.
    """
    dtype = jnp.bfloat16
    layers = rotation_layers(batch, context, scale)
    start = jnp.full((batch,), context - tokens, jnp.int32)
    key = jax.random.key(batch * 100003 + tokens * 101 + context)
    q = jax.random.normal(key, (batch, tokens, HEADS, HEAD_DIM), dtype)
    k, v = random_cache(jax.random.fold_in(key, 1), layers, batch, context, start, tokens, dtype,
                        poison=False)
    layer_ids = [jnp.int32(i) for i in range(layers)]
    read_bytes = 2 * batch * KV_HEADS * context * HEAD_DIM * jnp.dtype(dtype).itemsize
    softmax_scale = HEAD_DIM ** -0.5

    def measure(fn, scan_too, wall_too=True):
        call = jax.jit(fn)

        def calls():
            return [call(q, k, v, layer, start) for layer in layer_ids]

        timing = device_timing(calls, layers)
        if wall_too or not timing:
            timing["calls_us"] = median_seconds(lambda: jax.block_until_ready(calls()), scale.repeats) / layers * 1e6
        if scan_too:
            scan = layer_scan(fn)
            timing["scan_us"] = median_seconds(
                lambda: scan(q, k, v, start).block_until_ready(), scale.repeats) / layers * 1e6
        timing["us"] = timing.get("device_us") or min(timing.values())
        timing["gbs"] = read_bytes / timing["us"] / 1e3
        timing["kernel_gbs"] = read_bytes / timing["kernel_us"] / 1e3 if "kernel_us" in timing else None
        return timing

    row = dict(batch=batch, tokens=tokens, context=context, layers=layers, kv_bytes=read_bytes,
               kernel=[])
    for index, config in enumerate(configs):
        try:
            timing = measure(lambda q, k, v, l, s, c=config: attention_triton(
                q, k, v, l, s, scale=softmax_scale, config=c, interpret=interpret),
                scan_too=with_scan and index == 0, wall_too=with_scan)
        except Exception as error:  # e.g. a variant needing more shared memory than the SM has
            log(f"  {config}: failed: {str(error)[:200]}")
            continue
        row["kernel"].append(dict(config=dataclasses.asdict(config), **timing))
    row["reference"] = measure(
        lambda q, k, v, l, s: attention_reference(q, k, v, l, s, scale=softmax_scale), scan_too=with_scan,
        wall_too=with_scan)
    return row


def device_timing(calls, num_calls: int) -> dict:
    """Per-call device time of calls() from a profiler trace: all its kernels (the attention kernel, the
    split merge, any copy) and the costliest kernel alone. Empty where the trace shows no GPU kernels."""
    kernels = traced_kernels(calls)
    if not kernels:
        return {}
    totals: dict[str, float] = {}
    for kernel in kernels:
        totals[kernel.name] = totals.get(kernel.name, 0.0) + kernel.duration_ns
    main = max(totals, key=totals.get)
    return dict(device_us=sum(totals.values()) / num_calls / 1e3, kernel_us=median_duration_us(kernels, main),
                kernels_per_call=len(kernels) / num_calls, main_kernel=main[:60])


def sweep_configs(batch, tokens, context) -> list[KernelConfig]:
    """Variants of block_k x pipeline stages x KV splits (x warps for many rows), then the default
    again: the spread between its two timings is the noise."""
    base = default_config((batch, tokens, HEADS, HEAD_DIM), (1, batch, KV_HEADS, context, HEAD_DIM))
    many_rows = base.rows_per_tile >= 64
    splits = sorted({max(1, base.num_splits // 2), base.num_splits, 2 * base.num_splits, 4 * base.num_splits})
    variants = [dataclasses.replace(base, block_k=block_k, num_stages=stages, num_warps=warps, num_splits=n)
                for block_k in (64, 128)
                for stages in ((2, 3) if many_rows else (2, 3, 4))
                for warps in ((4, 8) if many_rows else (base.num_warps,))
                for n in splits]
    return [config for config in dict.fromkeys(variants) if config != base] + [base]


def jax_flash_decoding(batch, context, k_splits, scale: Scale, interpret: bool) -> dict:
    """JAX's own Pallas flash decoding (T=1) on per-layer [B,Hkv,S,D] caches, its per-call
    K/V transpose left out (its kernel on our layout), for comparison."""
    # An internal JAX API, imported here so that a JAX without it costs this comparison only.
    from jax.experimental.pallas.ops.gpu import decode_attention

    dtype = jnp.bfloat16
    layers = rotation_layers(batch, context, scale)
    group = HEADS // KV_HEADS
    key = jax.random.key(7)
    q = jax.random.normal(key, (batch, KV_HEADS, group, HEAD_DIM), dtype)
    caches = [jax.random.normal(jax.random.fold_in(key, i), (batch, KV_HEADS, context, HEAD_DIM),
                                dtype) for i in range(2 * layers)]
    inner = functools.partial(
        decode_attention.decode_attn_unbatched, sm_scale=HEAD_DIM ** -0.5, block_h=16,
        block_k=128, k_splits=k_splits, num_warps=None, num_stages=2, grid=None, interpret=interpret,
        debug=False, return_residuals=False, normalize_output=True)
    per_head = jax.vmap(jax.vmap(inner, in_axes=(0, 0, 0, None, None)),
                        in_axes=(0, 0, 0, None, None))

    call = jax.jit(lambda q, k, v: per_head(q, k, v, None, None))
    timing = device_timing(lambda: [call(q, caches[2 * i], caches[2 * i + 1]) for i in range(layers)], layers)
    read_bytes = 2 * batch * KV_HEADS * context * HEAD_DIM * 2
    return dict(batch=batch, context=context, k_splits=k_splits, **timing,
                gbs=read_bytes / timing["device_us"] / 1e3 if timing else None)


def compiled_program_report(batch, tokens, context) -> dict:
    """Check the optimized HLO of the scan: the triton call is there (on GPUs) and no layer copy is."""
    dtype = jnp.bfloat16
    start = jnp.full((batch,), context - tokens, jnp.int32)
    q = jnp.zeros((batch, tokens, HEADS, HEAD_DIM), dtype)
    k = jnp.zeros((4, batch, KV_HEADS, context, HEAD_DIM), dtype)
    scale = HEAD_DIM ** -0.5
    report = {}
    for name, fn in (("auto", lambda q, k, v, l, s: attention(q, k, v, l, s, scale=scale)),
                     ("reference", lambda q, k, v, l, s: attention_reference(q, k, v, l, s,
                                                                             scale=scale))):
        compiled = layer_scan(fn).lower(q, k, k, start).compile()
        text = compiled.as_text()
        memory = compiled.memory_analysis()
        report[name] = dict(
            triton_call=("triton" in text.lower()),
            no_layer_copy=no_layer_copy(text, k),
            temp_bytes=getattr(memory, "temp_size_in_bytes", None))
        if name == "auto":
            (out_dir() / "bench_attention_hlo.txt").write_text(text)
    # A per-layer copy would need temp space of about one layer's K and V; the string
    # check above misses copies XLA gives another shape, the temp size does not.
    report["layer_kv_bytes"] = 2 * k.nbytes // k.shape[0]
    log("compiled program:", report)
    return report


NCU_CASES = (
    (8, 1, 16384, KernelConfig(block_k=128, num_splits=8, num_stages=2)),
    (8, 1, 16384, KernelConfig(block_k=128, num_splits=4, num_stages=3)),
    (8, 1, 16384, KernelConfig(block_k=64, num_splits=4, num_stages=3)),
    (8, 1, 16384, KernelConfig(block_k=64, num_splits=8, num_stages=4)),
    (8, 1, 4096, KernelConfig(block_k=128, num_splits=4, num_stages=2)),
    (8, 1, 4096, KernelConfig(block_k=128, num_splits=4, num_stages=3)),
    (8, 16, 4096, KernelConfig(block_k=128, rows_per_tile=64, num_splits=4, num_warps=8)),
)


def run_once_for_ncu() -> int:
    """One launch per case (compiled first), in NCU_CASES order, for `ncu` to profile."""
    for batch, tokens, context, config in NCU_CASES:
        start = jnp.full((batch,), context - tokens, jnp.int32)
        key = jax.random.key(tokens)
        q = jax.random.normal(key, (batch, tokens, HEADS, HEAD_DIM), jnp.bfloat16)
        k, v = random_cache(key, 1, batch, context, start, tokens, jnp.bfloat16, poison=False)
        fn = jax.jit(lambda q, k, v, s, c=config: attention_triton(
            q, k, v, jnp.int32(0), s, scale=HEAD_DIM ** -0.5, config=c))
        compiled = fn.lower(q, k, v, start).compile()
        jax.block_until_ready((q, k, v))
        log(f"ncu case B={batch} T={tokens} ctx={context} {config}")
        try:
            compiled(q, k, v, start).block_until_ready()
        except Exception as error:
            log(f"  failed: {str(error)[:200]}")
    return 0


def print_table(rows, ceiling) -> None:
    log(f"\nceiling (device copy, read+write): {ceiling:.0f} GB/s; device us = every kernel of a call (trace)")
    log(f"{'B':>2} {'T':>3} {'ctx':>6} | {'device us':>9} {'GB/s':>6} {'%copy':>6} | {'kernel us':>9} "
        f"{'GB/s':>6} | {'calls us':>8} {'in scan':>7} | {'ref us':>8} {'GB/s':>6} | {'speedup':>7} | config")
    for row in rows:
        kernel, ref = row["kernel"][0], row["reference"]
        cfg = kernel["config"]
        log(f"{row['batch']:>2} {row['tokens']:>3} {row['context']:>6} | {kernel['us']:9.1f} "
            f"{kernel['gbs']:6.0f} {100 * kernel['gbs'] / ceiling:5.1f}% | "
            f"{kernel.get('kernel_us', float('nan')):9.1f} {kernel.get('kernel_gbs') or float('nan'):6.0f} | "
            f"{kernel.get('calls_us', float('nan')):8.1f} {kernel.get('scan_us', float('nan')):7.1f} | "
            f"{ref['us']:8.1f} {ref['gbs']:6.0f} | "
            f"{ref['us'] / kernel['us']:6.1f}x | bk={cfg['block_k']} stages={cfg['num_stages']} "
            f"splits={cfg['num_splits']} warps={cfg['num_warps']} rows={cfg['rows_per_tile']}")


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    return [tuple(int(n) for n in shape.split("x")) for shape in text.split(",")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="time launch-parameter variants")
    parser.add_argument("--skip-jax", action="store_true", help="skip JAX's flash decoding")
    parser.add_argument("--quick", action="store_true",
                        help="table of the key shapes (SWEEP_SHAPES) only, when device time is short")
    parser.add_argument("--shapes", type=parse_shapes, default=None,
                        help="BxTxCTX,... : the shapes of the table and the sweep (overrides --quick)")
    parser.add_argument("--ncu", action="store_true",
                        help="run a few configs once each, for Nsight Compute; no timing")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, to check the script (on CPU too)")
    args = parser.parse_args(argv)
    if args.ncu:
        return run_once_for_ncu()
    scale = SMOKE if args.smoke else Scale()
    interpret = interpret_kernels()
    device = jax.devices()[0]
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                device=device.device_kind, jax=jax.__version__, command=" ".join(sys.argv),
                choose_impl=choose_attention(KernelPolicy(device=device), (1, 1, HEADS, HEAD_DIM),
                                             (1, 1, KV_HEADS, CONTEXTS[0], HEAD_DIM)))
    log(meta)
    results = dict(meta=meta)
    results["correctness"] = check_correctness(scale.cases, KernelPolicy(impl="triton", interpret=interpret))
    results["compiled"] = compiled_program_report(*scale.compiled_shape)
    results["copy"] = copy_bandwidth(scale)
    ceiling = results["copy"]["ceiling_gbs"]
    log("copy bandwidth:", results["copy"])
    if not args.skip_jax:
        try:
            results["jax_flash_decoding"] = [jax_flash_decoding(batch, context, splits, scale, interpret)
                                             for batch, context in scale.flash_cases
                                             for splits in scale.flash_splits]
        except Exception as error:  # an internal JAX API: report, keep benchmarking
            results["jax_flash_decoding"] = repr(error)
        log("jax flash decoding (T=1):", results["jax_flash_decoding"])
    shapes = args.shapes or (scale.key_shapes if args.quick else scale.table_shapes)
    results["timings"] = []
    for batch, tokens, context in shapes:
        config = default_config((batch, tokens, HEADS, HEAD_DIM), (1, batch, KV_HEADS, context, HEAD_DIM))
        row = time_case(batch, tokens, context, [config], scale, interpret)
        if row["kernel"]:
            results["timings"].append(row)
            log(f"B={batch} T={tokens} ctx={context}: kernel {row['kernel'][0]['gbs']:.0f} GB/s, "
                f"reference {row['reference']['gbs']:.0f} GB/s")
        save(results)
    print_table(results["timings"], ceiling)
    if args.sweep:
        results["sweep"] = [sweep_case(*shape, scale, interpret) for shape in args.shapes or scale.key_shapes]
        save(results)
    return 0 if all(c["ok"] for c in results["correctness"]) else 1


def sweep_case(batch, tokens, context, scale: Scale, interpret: bool) -> dict:
    """Time the sweep variants at one shape (after the table, so a variant that breaks
    the process cannot cost the table) and log them fastest first."""
    row = time_case(batch, tokens, context, sweep_configs(batch, tokens, context), scale, interpret,
                    with_scan=False)
    log(f"sweep B={batch} T={tokens} ctx={context} (reference {row['reference']['gbs']:.0f} GB/s):")
    for entry in sorted(row["kernel"], key=lambda r: r["us"]):
        c = entry["config"]
        log(f"    bk={c['block_k']:3d} stages={c['num_stages']} splits={c['num_splits']:2d} "
            f"warps={c['num_warps']} rows={c['rows_per_tile']:3d}: {entry['us']:7.1f} us "
            f"{entry['gbs']:6.0f} GB/s (kernel alone {entry.get('kernel_us', float('nan')):.1f} us)")
    return row


def save(results: dict) -> None:
    """Write the results so far (a later crash keeps them)."""
    (out_dir() / "bench_attention.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    sys.exit(main())
