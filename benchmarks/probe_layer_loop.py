"""Probe: does the scan over stacked layers copy each layer's weights (dynamic-slice) before its matmuls?
Times one decode step of the 8B shape, batch 1, context 1024, scanned vs unrolled layers.

    PYTHONPATH=. python benchmarks/probe_layer_loop.py   (run again with XLA_FLAGS to compare flags)
"""
from __future__ import annotations

import os

import sys

import jax.numpy as jnp
from flax import nnx

from benchmarks.bench_engine import step_fn
from benchmarks.common import LLAMA31_8B, copy_bandwidth, kv_bytes_per_token, median_time, weight_bytes
from specjax.models.kv_cache import init_cache
from specjax.models.llama import LlamaForCausalLM


def main() -> None:
    bandwidth = copy_bandwidth()
    context = 1024
    floor = (weight_bytes(LLAMA31_8B) + context * kv_bytes_per_token(LLAMA31_8B)) / bandwidth
    for unroll in [arg == "unroll" for arg in sys.argv[1:]] or [False]:
        graph, state = nnx.split(LlamaForCausalLM(LLAMA31_8B, dtype=jnp.bfloat16, rngs=nnx.Rngs(0),
                                                  unroll_layers=unroll))
        step = step_fn(graph)
        holder = [init_cache(LLAMA31_8B, 1, context + 16, jnp.bfloat16)]
        tokens, start = jnp.ones((1, 1), jnp.int32), jnp.full((1,), context, jnp.int32)

        def run():
            logits, holder[0] = step(state, holder[0], tokens, start)
            return logits
        t = median_time(run, repeats=20)
        print(f"unroll={unroll} XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}: {1e3 * t:.2f} ms, "
              f"floor {1e3 * floor:.2f} ms, {floor / t:.0%} of roofline", flush=True)
        del state


if __name__ == "__main__":
    main()
