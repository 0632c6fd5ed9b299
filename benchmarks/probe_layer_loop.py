"""Probe: where does a decode step's time go? Times one decode step of the 8B shape (batch 1, context 1024)
with scanned vs unrolled layers, and the same model's step inside the generate while_loop, and counts the
weight-shaped buffers each compiled program materialises (a slice that feeds a matmul without a copy leaves
none; a copied slice shows up as an instruction of weight shape). `--shape smollm2` probes the default
model's shape instead (context 128), whose step is bound by kernel launches, not bandwidth.

    PYTHONPATH=. python benchmarks/probe_layer_loop.py [scan] [unroll] [loop] [--shape 8b|smollm2]
    [--impl auto|reference] [--xla-projections] [--trace] [--body-graphs] [--smoke]
(run again with XLA_FLAGS to compare flags; --trace profiles the loop: device kernels per iteration, time the
GPU was busy, the costliest ops, and the trace itself in $OUT. The profiler sees no kernel inside a loop run
as one CUDA graph: --body-graphs compiles the loop with XLA's default command buffers, one per body)
"""
from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

import specjax.kernels.projection as projection_module
from benchmarks.bench_engine import generate_fn, rows_params, smoke_configs, step_fn
from benchmarks.common import (
    LLAMA31_8B,
    SMOLLM2_135M,
    copy_bandwidth,
    kv_bytes_per_token,
    median_time,
    print_table,
    weight_bytes,
)
from benchmarks.device_trace import busy_ns, by_kernel, span_ns, traced_kernels
from specjax.engine.proposers.base import NoProposer
from specjax.models.kv_cache import init_cache
from specjax.models.llama import LlamaForCausalLM

NEW_TOKENS = 128
SHAPES = {"8b": (LLAMA31_8B, 1024), "smollm2": (SMOLLM2_135M, 128)}   # (config, context)


def weight_shapes(cfg) -> set[str]:
    H, I, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {f"bf16[{a},{b}]" for a, b in [(H, q + 2 * kv), (q, H), (H, 2 * I), (I, H)]}


def materialised_weights(hlo: str, shapes: set[str]) -> Counter:
    """Instructions (not parameters or tuple plumbing) whose result has a per-layer weight shape (a slice of
    a stacked leaf keeps its unit layer axis: bf16[1,4096,4096])."""
    found = Counter()
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?[\w.-]+ = bf16\[(?:1,)?(\d+,\d+)\]\S* (\w[\w-]*)", line)
        shape = m and f"bf16[{m.group(1)}]"
        if shape in shapes and m.group(2) not in ("parameter", "get-tuple-element", "bitcast", "tuple"):
            found[f"{m.group(2)} {shape}"] += 1
    return found


def kernels_per_iteration(hlo: str) -> int:
    """Kernel-launching instructions (fusions, custom calls, copies) in the generate loop's while body: the
    nodes of the CUDA graph the host submits every iteration (its launch cost grows with them)."""
    body = re.findall(r"while\(.*body=%([\w.-]+)", hlo)[-1]
    text = hlo[hlo.index(f"%{body} ("):]
    text = text[:text.index("\n}\n")]
    return len(re.findall(r" = \S+ (?:fusion|custom-call|copy)\(", text))


def model(cfg, unroll: bool, impl: str = "auto"):
    return nnx.split(LlamaForCausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), unroll_layers=unroll,
                                      attention_impl=impl))


def probe_step(cfg, context: int, unroll: bool, floor: float, shapes: set[str]) -> None:
    graph, state = model(cfg, unroll)
    step = step_fn(graph)
    holder = [init_cache(cfg, 1, context + 16, jnp.bfloat16)]
    tokens, start = jnp.ones((1, 1), jnp.int32), jnp.full((1,), context, jnp.int32)
    hlo = step.lower(state, holder[0], tokens, start).compile().as_text()

    def run():
        logits, holder[0] = step(state, holder[0], tokens, start)
        return logits
    t = median_time(run, repeats=20)
    print(f"step unroll={unroll}: {1e3 * t:.2f} ms, floor {1e3 * floor:.2f} ms, {floor / t:.0%} of roofline; "
          f"weight-shaped results: {dict(materialised_weights(hlo, shapes))}", flush=True)


def probe_loop(cfg, context: int, floor: float, shapes: set[str], trace: bool, impl: str, whole_graph: bool) -> None:
    """Per-iteration time of the plain generate loop (unrolled layers), prompt `context` tokens. whole_graph:
    the engine's compiler options (the loop as one CUDA graph, whose kernels the profiler does not see);
    else XLA's defaults (one graph per body, each kernel traced)."""
    graph, state = model(cfg, True, impl)
    gen = generate_fn(graph, NoProposer(), compiler_options=None if whole_graph else {})
    prompts = jnp.ones((1, context), jnp.int32)
    lengths = jnp.full((1,), context, jnp.int32)
    times = {}
    for n in (1, NEW_TOKENS):
        args = (state, None, prompts, lengths, rows_params(1, n), context + NEW_TOKENS + 1)
        jax.block_until_ready(gen(*args))
        times[n] = median_time(lambda: gen(*args), repeats=3, warmup=0)
    per_iteration = (times[NEW_TOKENS] - times[1]) / (NEW_TOKENS - 1)
    hlo = gen.lower(*args).compile().as_text()
    out = Path(os.environ.get("OUT") or tempfile.mkdtemp())
    (out / "loop_hlo.txt").write_text(hlo)
    print(f"loop: {1e3 * per_iteration:.2f} ms per iteration, floor {1e3 * floor:.2f} ms, "
          f"{floor / per_iteration:.0%} of roofline; {kernels_per_iteration(hlo)} kernels per iteration; "
          f"weight-shaped results: {dict(materialised_weights(hlo, shapes))}; HLO in {out / 'loop_hlo.txt'}",
          flush=True)
    if trace:
        profile_loop(lambda: gen(*args), per_iteration, out)


def profile_loop(run, per_iteration: float, out: Path) -> None:
    """Where an iteration's time goes on the device: kernels, busy time, the costliest ops."""
    kernels = traced_kernels(run, keep_trace=out / "loop_trace.xplane.pb")
    n = NEW_TOKENS
    summary = dict(kernels_per_iteration=len(kernels) / n, busy_us_per_iteration=busy_ns(kernels) / n / 1e3,
                   span_us_per_iteration=span_ns(kernels) / n / 1e3, wall_us_per_iteration=1e6 * per_iteration,
                   kernels=by_kernel(kernels, per=n))
    (out / "loop_profile.json").write_text(json.dumps(summary, indent=1))
    print(f"profile: {summary['kernels_per_iteration']:.1f} device kernels per iteration, GPU busy "
          f"{summary['busy_us_per_iteration']:.0f} us of {summary['span_us_per_iteration']:.0f} us traced per "
          f"iteration ({1e6 * per_iteration:.0f} us untraced); costliest ops per iteration:", flush=True)
    print_table(summary["kernels"])


def main() -> None:
    args = sys.argv[1:]
    shape = args[args.index("--shape") + 1] if "--shape" in args else "8b"
    impl = args[args.index("--impl") + 1] if "--impl" in args else "auto"
    if "--xla-projections" in args:   # the projection kernel off, the attention kernel on
        projection_module.SMALL_WEIGHT_BYTES = 0
    modes = [a for a in args if not a.startswith("--") and a not in (shape, impl)] or ["scan", "unroll", "loop"]
    cfg, context = SHAPES[shape]
    if "--smoke" in args:
        cfg = smoke_configs()[0]
    bandwidth = copy_bandwidth(1 << 26 if "--smoke" in args else 2 << 30)
    floor = (weight_bytes(cfg) + context * kv_bytes_per_token(cfg)) / bandwidth
    shapes = weight_shapes(cfg)
    print(f"shape {shape}, impl {impl}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}, copy {bandwidth / 1e12:.2f} TB/s",
          flush=True)
    for mode in modes:
        if mode == "loop":
            probe_loop(cfg, context, floor, shapes, "--trace" in args, impl, "--body-graphs" not in args)
        else:
            probe_step(cfg, context, mode == "unroll", floor, shapes)


if __name__ == "__main__":
    main()
