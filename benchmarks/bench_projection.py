"""The fused projection kernel on a GPU: correctness against the reference, then device time against XLA's
compilation of the same projection, on the default model's four decoder projections.

    PYTHONPATH=. python benchmarks/bench_projection.py [--rows 1,8,16,33,65,128] [--sweep] [--smoke]

Each timed pass cycles through enough copies of the weight (> the 60 MB L2) that it streams from memory,
as in a decode step. Device time from a profiler trace: every kernel of one call (XLA: the norm, the
multiply and the reduce kernels; the kernel: one). `--rows` says where XLA's GEMM overtakes the kernel
(`KernelPolicy.projection_max_rows`); `--sweep` times launch-parameter variants at one row.
Prints a table; writes $OUT/bench_projection.json. `--smoke`: the projections of a tiny model, few weight
copies, to check the script (off GPUs the kernel in interpret mode and no device time: NaN).
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import (SMOKE_TARGET, SMOLLM2_135M, interpret_kernels, print_table, relative_error,
                               rotation_copies, write_json)
from benchmarks.device_trace import summed_us_per_call, traced_kernels
from specjax.kernels.projection_reference import projection_reference
from specjax.kernels.projection_triton import ProjectionConfig, default_config, projection_triton

ROTATION_BYTES = 96 << 20
ROWS = "1,8,16,33,65,128"   # decode, chain verifies, draft trees of 32 and 64 nodes, many slots


def cases(cfg=SMOLLM2_135M) -> list[dict]:
    """The decoder's projections: (name, K, N, norm, activation, residual)."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    return [dict(name="norm+qkv", k=H, n=qkv, norm=True, activation=None, residual=False),
            dict(name="o+residual", k=cfg.num_heads * cfg.head_dim, n=H, norm=False, activation=None, residual=True),
            dict(name="norm+gate_up+swiglu", k=H, n=2 * I, norm=True, activation="swiglu", residual=False),
            dict(name="down+residual", k=I, n=H, norm=False, activation=None, residual=True)]


def _out(case: dict) -> int:
    return case["n"] // 2 if case["activation"] else case["n"]


def inputs(case: dict, rows: int, dtype, copies: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    out = _out(case)
    x = jnp.asarray(rng.standard_normal((rows, case["k"])), dtype)
    ws = [jnp.asarray(rng.standard_normal((case["k"], case["n"])) / np.sqrt(case["k"]), dtype) for _ in range(copies)]
    norm = jnp.asarray(1 + 0.1 * rng.standard_normal(case["k"]), dtype) if case["norm"] else None
    residual = jnp.asarray(rng.standard_normal((rows, out)), dtype) if case["residual"] else None
    return x, ws, norm, residual


def run_fn(case: dict, kernel: bool, config: ProjectionConfig | None = None):
    """The jitted projection: the kernel (in interpret mode where the device cannot run it) or XLA's."""
    interpret = interpret_kernels()

    def fn(x, w, norm, residual):
        kwargs = dict(norm=norm, eps=1e-5, activation=case["activation"], residual=residual)
        if kernel:
            return projection_triton(x, w, config=config, interpret=interpret, **kwargs)
        return projection_reference(x, w, **kwargs)
    return jax.jit(fn)


def kernel_error(case: dict, rows: int, dtype) -> float:
    x, (w,), norm, residual = inputs(case, rows, dtype, copies=1, seed=rows)
    with jax.default_matmul_precision("highest"):
        out = run_fn(case, True)(x, w, norm, residual)
        ref = run_fn(case, False)(*(None if a is None else a.astype(jnp.float32) for a in (x, w, norm, residual)))
    return relative_error(out, ref)


def device_us(case: dict, rows: int, kernel: bool, config: ProjectionConfig | None = None,
              rotation_bytes: int = ROTATION_BYTES) -> tuple[float, float]:
    """(device us per call, kernels per call), cycling through weight copies."""
    weight_bytes = case["k"] * case["n"] * 2
    copies = rotation_copies(weight_bytes, rotation_bytes)
    x, ws, norm, residual = inputs(case, rows, jnp.bfloat16, copies)
    fn = run_fn(case, kernel, config)
    kernels = traced_kernels(lambda: [fn(x, w, norm, residual) for w in ws])
    return summed_us_per_call(kernels, copies), len(kernels) / copies


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default=ROWS, help="row counts to time, comma-separated")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="a tiny model's projections, to check the script")
    args = parser.parse_args(argv)
    row_counts = [int(r) for r in args.rows.split(",")]
    cfg, rotation_bytes = (SMOKE_TARGET, 0) if args.smoke else (SMOLLM2_135M, ROTATION_BYTES)
    if args.smoke:
        row_counts = row_counts[:1]
    rows_out = []
    for case in cases(cfg):
        for dtype in (jnp.float32, jnp.bfloat16):
            error = kernel_error(case, 8, dtype)
            print(f"check {case['name']} {jnp.dtype(dtype).name}: rel error {error:.2e}", flush=True)
        for rows in row_counts:
            xla_us, xla_kernels = device_us(case, rows, kernel=False, rotation_bytes=rotation_bytes)
            us, _ = device_us(case, rows, kernel=True, rotation_bytes=rotation_bytes)
            gbs = case["k"] * case["n"] * 2 / us / 1e3
            rows_out.append(dict(projection=case["name"], rows=rows, kernel_us=us, kernel_GBps=gbs, xla_us=xla_us,
                                 xla_kernels=xla_kernels, speedup=xla_us / us,
                                 config=str(default_config(case["k"], _out(case)))))
            print(rows_out[-1], flush=True)
    print_table(rows_out)
    sweep = []
    if args.sweep:
        for case in cases(cfg):
            base = default_config(case["k"], _out(case))
            block_ks = [b for b in (256, 512, 1024) if b < 2 * case["k"]]
            for block_n, block_k, warps, stages in itertools.product((16,), block_ks, (4, 8), (2, 3)):
                config = dataclasses.replace(base, block_n=block_n, block_k=block_k, num_warps=warps,
                                             num_stages=stages)
                us, _ = device_us(case, 1, kernel=True, config=config, rotation_bytes=rotation_bytes)
                sweep.append(dict(projection=case["name"], **dataclasses.asdict(config), us=us))
            best = sorted((r for r in sweep if r["projection"] == case["name"]), key=lambda r: r["us"])[:5]
            print(f"sweep {case['name']} (default {base}):")
            print_table(best)
    write_json("bench_projection", rows_out + sweep)


if __name__ == "__main__":
    main()
