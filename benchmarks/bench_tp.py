"""Tensor parallelism on one host: a Llama-3.1-8B-shaped target (random bf16) at TP=1 and TP=2 (or more,
--tps), decode step time against the per-GPU bytes / copy-bandwidth floor, the all-reduce cost, and
end-to-end tokens/s without and with speculation (a Llama-3.2-1B-shaped draft, draft TP 1, synthetic
acceptance length 2.5 at k=3).

    PYTHONPATH=. python benchmarks/bench_tp.py [--tps 1,2] [--batches 1,8] [--smoke]

Writes $OUT/bench_tp.json and prints a table. On CPU, simulate the devices:
XLA_FLAGS=--xla_force_host_platform_device_count=2 python benchmarks/bench_tp.py --smoke
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from benchmarks.bench_engine import (SMOKE_SIZES, Sizes, conditional_rates, generate_fn, run_generate, run_plain,
                                     step_time, subject)
from benchmarks.common import (LLAMA31_8B, LLAMA32_1B, SMOKE_DRAFT, SMOKE_TARGET, copy_bandwidth, draft_proposer,
                               kv_bytes_per_token, median_time, print_table, random_model, weight_bytes, write_json)
from specjax.models.llama import FAMILY
from specjax.parallel.mesh import MODEL_AXIS, build_mesh
from specjax.parallel.plan import replicate_onto, shard_state
from specjax.parallel.sharded_loop import Replicated


def all_reduce_time(mesh, B: int, hidden: int, n: int = 64) -> float:
    """Seconds per all-reduce of the [B, 1, hidden] f32 activations a decode step reduces after o and down
    (XLA reduces in f32 here: see the compiled HLO in tests/test_parallel.py), inside one program: chains of
    n and 2n dependent all-reduces are timed and the difference divided by n, so launch cost cancels."""
    x = jax.device_put(jnp.ones((mesh.shape[MODEL_AXIS], B, 1, hidden), jnp.float32),
                       NamedSharding(mesh, P(MODEL_AXIS)))

    def body(_, a):
        return jax.lax.psum(a, MODEL_AXIS) * 0.5

    def chain(count):
        return jax.jit(jax.shard_map(lambda a: jax.lax.fori_loop(0, count, body, a), mesh=mesh,
                                     in_specs=P(MODEL_AXIS), out_specs=P(MODEL_AXIS), check_vma=False))

    short, long = chain(n), chain(2 * n)
    return (median_time(lambda: long(x), repeats=20) - median_time(lambda: short(x), repeats=20)) / n


def tp_rows(tp, cfg, dcfg, batches, bandwidth, sizes: Sizes, k=3, al=2.5):
    """sizes.context: the step's context; sizes.prompt_len / new_tokens: the generate runs."""
    mesh = build_mesh(tp) if tp > 1 else None
    graph, state = nnx.split(random_model(cfg))
    draft = random_model(dcfg, seed=1)
    proposer, dstate = draft_proposer(draft, k), nnx.state(draft)
    if mesh is not None:
        state = shard_state(state, FAMILY.partition_rules(cfg, tp), mesh)
        proposer, dstate = Replicated(proposer), replicate_onto(dstate, mesh)
    target = subject(cfg, graph, state, mesh)
    spec_gen = generate_fn(graph, proposer, mesh)
    context, new_tokens = sizes.context, sizes.new_tokens
    rows = []
    for B in batches:
        t_step = step_time(target, B, 1, context)
        t_verify = step_time(target, B, k + 1, context)
        per_gpu_bytes = (weight_bytes(cfg) + B * (context + 1) * kv_bytes_per_token(cfg)) / tp
        reduce = all_reduce_time(mesh, B, cfg.hidden_size) if mesh is not None else 0.0
        plain = run_plain(target, B, sizes.prompt_len, new_tokens)[1]
        _, spec, steps = run_generate(graph, state, proposer, dstate, B, sizes.prompt_len, new_tokens,
                                      conditional_rates(al, k), gen=spec_gen)
        rows.append(dict(tp=tp, batch=B, context=context, step_ms=1e3 * t_step,
                         floor_ms=1e3 * per_gpu_bytes / bandwidth, roofline_frac=per_gpu_bytes / bandwidth / t_step,
                         verify_ms=1e3 * t_verify, all_reduce_us=1e6 * reduce,
                         all_reduces_per_step_ms=1e3 * reduce * (2 * cfg.num_layers + 1),
                         plain_tok_s=B * new_tokens / plain, spec_tok_s=B * new_tokens / spec, k=k, al=al,
                         measured_al=(new_tokens - 1) / max(steps, 1), speedup=plain / spec))
        print({key: round(v, 3) if isinstance(v, float) else v for key, v in rows[-1].items()}, flush=True)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tps", default="1,2")
    parser.add_argument("--batches", help="default 1,8 (--smoke: 1)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, batch 1, to check the script on CPU")
    args = parser.parse_args(argv)
    cfg, dcfg = (SMOKE_TARGET, SMOKE_DRAFT) if args.smoke else (LLAMA31_8B, LLAMA32_1B)
    sizes = SMOKE_SIZES if args.smoke else Sizes()
    batches = tuple(int(b) for b in (args.batches or ("1" if args.smoke else "1,8")).split(","))
    bandwidth = copy_bandwidth(1 << 26) if args.smoke else copy_bandwidth()
    print(f"{len(jax.devices())} x {jax.devices()[0].device_kind}: copy {bandwidth / 1e12:.2f} TB/s per device",
          flush=True)
    rows = []
    for tp in (int(t) for t in args.tps.split(",")):
        rows += tp_rows(tp, cfg, dcfg, batches, bandwidth, sizes)
    for r in rows:
        r["copy_TBps"] = bandwidth / 1e12
    print_table(rows)
    write_json("bench_tp", rows)


if __name__ == "__main__":
    main()
