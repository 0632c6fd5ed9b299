"""Probe: where do the decoder layers' weights get copied? Times one decode step of the 8B shape (batch 1,
context 1024) with scanned vs unrolled layers, and the same model's step inside the generate while_loop,
and counts the weight-shaped buffers each compiled program materialises (a slice that feeds a matmul
without a copy leaves none; a copied slice shows up as an instruction of weight shape).

    PYTHONPATH=. python benchmarks/probe_layer_loop.py [scan] [unroll] [loop] [--trace] [--smoke]
    (run again with XLA_FLAGS to compare flags; --trace writes a jax.profiler trace of the loop to $OUT)
"""
from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks.bench_engine import generate_fn, rows_params, smoke_configs, step_fn
from benchmarks.common import LLAMA31_8B, copy_bandwidth, kv_bytes_per_token, median_time, weight_bytes
from specjax.engine.proposers.base import NoProposer
from specjax.models.kv_cache import init_cache
from specjax.models.llama import LlamaForCausalLM

CONTEXT, NEW_TOKENS = 1024, 128


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


def model(cfg, unroll: bool):
    return nnx.split(LlamaForCausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), unroll_layers=unroll))


def probe_step(cfg, unroll: bool, floor: float, shapes: set[str]) -> None:
    graph, state = model(cfg, unroll)
    step = step_fn(graph)
    holder = [init_cache(cfg, 1, CONTEXT + 16, jnp.bfloat16)]
    tokens, start = jnp.ones((1, 1), jnp.int32), jnp.full((1,), CONTEXT, jnp.int32)
    hlo = step.lower(state, holder[0], tokens, start).compile().as_text()

    def run():
        logits, holder[0] = step(state, holder[0], tokens, start)
        return logits
    t = median_time(run, repeats=20)
    print(f"step unroll={unroll}: {1e3 * t:.2f} ms, floor {1e3 * floor:.2f} ms, {floor / t:.0%} of roofline; "
          f"weight-shaped results: {dict(materialised_weights(hlo, shapes))}", flush=True)


def probe_loop(cfg, floor: float, shapes: set[str], trace: bool) -> None:
    """Per-iteration time of the plain generate loop (unrolled layers), prompt CONTEXT tokens."""
    graph, state = model(cfg, True)
    gen = generate_fn(graph, NoProposer())
    prompts = jnp.ones((1, CONTEXT), jnp.int32)
    lengths = jnp.full((1,), CONTEXT, jnp.int32)
    times = {}
    for n in (1, NEW_TOKENS):
        args = (state, None, prompts, lengths, rows_params(1, n), CONTEXT + NEW_TOKENS + 1)
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
        folder = Path(tempfile.mkdtemp())
        with jax.profiler.trace(str(folder)):
            jax.block_until_ready(gen(*args))
        for i, f in enumerate(folder.rglob("*.xplane.pb")):   # $OUT returns files at most 2 folders down
            shutil.copy(f, out / f"loop_trace_{i}.xplane.pb")


def main() -> None:
    modes = [a for a in sys.argv[1:] if not a.startswith("--")] or ["scan", "unroll", "loop"]
    cfg = smoke_configs()[0] if "--smoke" in sys.argv else LLAMA31_8B
    bandwidth = copy_bandwidth(1 << 26 if "--smoke" in sys.argv else 2 << 30)
    floor = (weight_bytes(cfg) + CONTEXT * kv_bytes_per_token(cfg)) / bandwidth
    shapes = weight_shapes(cfg)
    print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}, copy {bandwidth / 1e12:.2f} TB/s", flush=True)
    for mode in modes:
        if mode == "loop":
            probe_loop(cfg, floor, shapes, "--trace" in sys.argv)
        else:
            probe_step(cfg, mode == "unroll", floor, shapes)


if __name__ == "__main__":
    main()
