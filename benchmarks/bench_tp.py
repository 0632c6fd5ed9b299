"""Tensor parallelism on one host: a Llama-3.1-8B-shaped target (random bf16) at TP=1 and TP=2 (or more,
--tps), decode step time against the per-GPU bytes / copy-bandwidth floor, the all-reduce cost, and
end-to-end tokens/s without and with speculation (a Llama-3.2-1B-shaped draft, draft TP 1, synthetic
acceptance length 2.5 at k=3).

    PYTHONPATH=. python benchmarks/bench_tp.py [--tps 1,2] [--batches 1,8] [--smoke]

Writes $OUT/bench_tp.json and prints a table.
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from benchmarks.bench_engine import (step_time, conditional_rates, generate_fn, model_state, run_generate,
                                     smoke_configs, step_fn)
from benchmarks.common import (LLAMA31_8B, LLAMA32_1B, copy_bandwidth, kv_bytes_per_token, median_time,
                               print_table, weight_bytes, write_json)
from specjax import parallel
from specjax.engine.proposers.base import NoProposer
from specjax.engine.proposers.draft_model import DraftModelProposer


def all_reduce_time(mesh, B: int, hidden: int, n: int = 64) -> float:
    """Seconds per all-reduce of the [B, 1, hidden] f32 activations a decode step reduces after o and down
    (XLA reduces in f32 here: see the compiled HLO in tests/test_parallel.py), inside one program: chains of
    n and 2n dependent all-reduces are timed and the difference divided by n, so launch cost cancels."""
    x = jax.device_put(jnp.ones((mesh.shape[parallel.MODEL_AXIS], B, 1, hidden), jnp.float32),
                       NamedSharding(mesh, P(parallel.MODEL_AXIS)))

    def chain(count):
        body = lambda _, a: jax.lax.psum(a, parallel.MODEL_AXIS) * 0.5
        return jax.jit(jax.shard_map(lambda a: jax.lax.fori_loop(0, count, body, a), mesh=mesh,
                                     in_specs=P(parallel.MODEL_AXIS), out_specs=P(parallel.MODEL_AXIS), check_vma=False))

    short, long = chain(n), chain(2 * n)
    return (median_time(lambda: long(x), repeats=20) - median_time(lambda: short(x), repeats=20)) / n


def tp_rows(tp, cfg, dcfg, batches, bandwidth, context=1024, new_tokens=256, prompt_len=128, k=3, al=2.5):
    mesh = parallel.build_mesh(tp) if tp > 1 else None
    graph, state = model_state(cfg, "auto")
    dgraph, dstate = model_state(dcfg, "auto", seed=1)
    proposer = DraftModelProposer(dgraph, k, probabilistic=False)
    if mesh is not None:
        state = parallel.shard_state(state, cfg, mesh)
        proposer, dstate = parallel.Replicated(proposer), parallel.replicate_onto(dstate, mesh)
    step = step_fn(graph, mesh)
    plain_gen, spec_gen = generate_fn(graph, NoProposer(), mesh), generate_fn(graph, proposer, mesh)
    rows = []
    for B in batches:
        t_step = step_time(step, cfg, state, B, 1, context, mesh)
        t_verify = step_time(step, cfg, state, B, k + 1, context, mesh)
        per_gpu_bytes = (weight_bytes(cfg) + B * (context + 1) * kv_bytes_per_token(cfg)) / tp
        reduce = all_reduce_time(mesh, B, cfg.hidden_size) if mesh is not None else 0.0
        plain = run_generate(graph, state, NoProposer(), None, B, prompt_len, new_tokens, gen=plain_gen)[1]
        _, spec, steps = run_generate(graph, state, proposer, dstate, B, prompt_len, new_tokens,
                                      conditional_rates(al, k), gen=spec_gen)
        rows.append(dict(tp=tp, batch=B, context=context, step_ms=1e3 * t_step,
                         floor_ms=1e3 * per_gpu_bytes / bandwidth, roofline_frac=per_gpu_bytes / bandwidth / t_step,
                         verify_ms=1e3 * t_verify, all_reduce_us=1e6 * reduce,
                         all_reduces_per_step_ms=1e3 * reduce * (2 * cfg.num_layers + 1),
                         plain_tok_s=B * new_tokens / plain, spec_tok_s=B * new_tokens / spec, k=k, al=al,
                         measured_al=(new_tokens - 1) / max(steps, 1), speedup=plain / spec))
        print({key: round(v, 3) if isinstance(v, float) else v for key, v in rows[-1].items()}, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tps", default="1,2")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, to check the script on CPU")
    args = parser.parse_args()
    cfg, dcfg = smoke_configs() if args.smoke else (LLAMA31_8B, LLAMA32_1B)
    bandwidth = copy_bandwidth(1 << 26) if args.smoke else copy_bandwidth()
    print(f"{len(jax.devices())} x {jax.devices()[0].device_kind}: copy {bandwidth / 1e12:.2f} TB/s per device",
          flush=True)
    rows = []
    for tp in (int(t) for t in args.tps.split(",")):
        rows += tp_rows(tp, cfg, dcfg, tuple(int(b) for b in args.batches.split(",")), bandwidth)
    for r in rows:
        r["copy_TBps"] = bandwidth / 1e12
    print_table(rows)
    write_json("bench_tp", rows)


if __name__ == "__main__":
    main()
