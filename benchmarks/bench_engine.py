"""Decode/verify step time against the bandwidth roofline, and end-to-end generation with and without
speculation (synthetic acceptance; a Llama-3.2-1B-shaped draft model, or an EAGLE-3-shaped head), for a
Llama-3.1-8B-shaped model with random bf16 weights.

    PYTHONPATH=. python benchmarks/bench_engine.py [--suites step,e2e,spec,sampled,eagle] [--impl auto|reference]

Writes $OUT/bench_engine_<suite>.json and prints a table per suite.
"""
from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from benchmarks.common import (LLAMA31_8B, LLAMA32_1B, copy_bandwidth, kv_bytes_per_token, matmul_flops,
                               median_time, print_table, weight_bytes, write_json)
from specjax.engine.loop import LoopSpec, build_generate, loop_compiler_options
from specjax.engine.proposers.base import NoProposer
from specjax.engine.proposers.draft_model import DraftModelProposer
from specjax.engine.proposers.eagle import EagleProposer
from specjax.engine.state import RowParams
from specjax.models.kv_cache import init_cache
from specjax.models.eagle import default_aux_layer_ids
from specjax.models.registry import random_model
from specjax.parallel import MODEL_AXIS, Layout, gather_vocab, sharded_generate, shards_kv_heads, traced_with
from specjax.training.trainer import new_head


def model_state(cfg, impl, seed=0):
    return nnx.split(random_model(cfg, dtype=jnp.bfloat16, seed=seed, attention_impl=impl))


# Step timings dispatch this many steps back to back and block once: the host runs ahead of the device, so
# a step's figure is its device time (what the ideal of a loop that hid all host work would pay).
STEPS_PER_TIMING = 8


def step_fn(graph, mesh=None):
    """One jitted target pass -> whole logits; under `mesh`, tensor-parallel over its "model" axis."""
    layout = None if mesh is None else Layout(mesh, head_axis=MODEL_AXIS)

    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(state, cache, tokens, start):
        with traced_with(layout):
            model = nnx.merge(graph, state)
            hidden, cache, _ = model(tokens, start, cache)
            return gather_vocab(model.logits(hidden)), cache
    return step


def step_suite(cfg, graph, state, bandwidth, context=1024):
    rows = []
    step = step_fn(graph)
    for B in (1, 8):
        for T in (1, 4, 8):
            t = step_time(step, cfg, state, B, T, context)
            floor = (weight_bytes(cfg) + B * (context + T) * kv_bytes_per_token(cfg)) / bandwidth
            rows.append(dict(batch=B, T=T, context=context, ms=1e3 * t, floor_ms=1e3 * floor,
                             roofline_frac=floor / t))
    return rows


def rows_params(B, max_tokens, seed=0, temperature=0.0, top_p=1.0):
    return RowParams(temperature=jnp.full((B,), temperature, jnp.float32), top_k=jnp.zeros((B,), jnp.int32),
                     top_p=jnp.full((B,), top_p, jnp.float32), min_p=jnp.zeros((B,), jnp.float32),
                     seed=jnp.arange(B, dtype=jnp.uint32) + seed, max_tokens=jnp.full((B,), max_tokens, jnp.int32),
                     min_tokens=jnp.zeros((B,), jnp.int32), stop_ids=jnp.full((B, 1), -1, jnp.int32))


def generate_fn(graph, proposer, mesh=None, compiler_options=None, greedy=True):
    """The jitted generate loop; under `mesh`, sharded as the LLM facade runs it. compiler_options: the
    engine's (loop_compiler_options) unless given. greedy=False: the sampling loop (distributions, draws)."""
    generate = build_generate(graph, proposer, LoopSpec(k=proposer.k, n_top=0, max_model_len=8192, greedy=greedy))
    options = loop_compiler_options() if compiler_options is None else compiler_options
    return jax.jit(generate if mesh is None else sharded_generate(generate, mesh), static_argnums=5,
                   compiler_options=options)


def run_generate(graph, state, proposer, draft_state, B, prompt_len, new_tokens, rates=None, gen=None,
                 sampling=None):
    """(compile+first-call seconds, steady seconds, steps) for one wave of B prompts. Pass `gen` (from
    generate_fn) to reuse one compilation across calls of the same shapes (rates are a traced argument).
    sampling: rows_params keywords (temperature, top_p) for a sampling loop; greedy rows otherwise."""
    gen = gen or generate_fn(graph, proposer)
    prompts = jax.random.randint(jax.random.key(1), (B, prompt_len), 0, 500, jnp.int32)
    lengths = jnp.full((B,), prompt_len, jnp.int32)
    rows = rows_params(B, new_tokens, **(sampling or {}))
    cache_len = prompt_len + new_tokens + proposer.k + 1
    rates = None if rates is None else jnp.asarray(rates, jnp.float32)
    start = time.perf_counter()
    out = jax.block_until_ready(gen(state, draft_state, prompts, lengths, rows, cache_len, rates))
    first = time.perf_counter() - start
    steady = median_time(lambda: gen(state, draft_state, prompts, lengths, rows, cache_len, rates),
                         repeats=3, warmup=0)
    assert int(np.min(out.lengths - lengths)) == new_tokens
    return first, steady, int(out.steps)


def e2e_suite(graph, state, batches=(1, 8, 32), new_tokens=256, prompt_len=128):
    rows = []
    for B in batches:
        first, steady, steps = run_generate(graph, state, NoProposer(), None, B, prompt_len, new_tokens)
        ttft = run_generate(graph, state, NoProposer(), None, B, prompt_len, 1)[1]
        rows.append(dict(batch=B, new_tokens=new_tokens, tok_s=B * new_tokens / steady,
                         ms_per_step=1e3 * (steady - ttft) / max(steps, 1), ttft_ms=1e3 * ttft,
                         compile_s=first - steady))
    return rows


def conditional_rates(al, k):
    """vLLM's synthetic_acceptance_length -> conditional per-position rates (see SpeculativeConfig)."""
    from specjax.config import SpeculativeConfig
    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": k,
                                        "rejection_sample_method": "synthetic",
                                        "synthetic_acceptance_length": al},
                                       target_max_model_len=8192, target_tensor_parallel_size=1)
    return spec.synthetic_rates()


def spec_suite(cfg, dcfg, graph, state, dgraph, dstate, batches=(1, 8), ks=(3, 5), new_tokens=256,
               prompt_len=128):
    rows = []
    tstep, dstep = step_fn(graph), step_fn(dgraph)
    context = prompt_len + new_tokens // 2
    for B in batches:
        plain = run_generate(graph, state, NoProposer(), None, B, prompt_len, new_tokens)[1]
        for k in ks:
            t_verify = step_time(tstep, cfg, state, B, k + 1, context)
            t_draft = step_time(dstep, dcfg, dstate, B, 1, context)
            rows += acceptance_sweep(graph, state, DraftModelProposer(dgraph, k, probabilistic=False), dstate, B,
                                     plain, t_verify, t_draft, new_tokens, prompt_len)
    return rows


# Top-p sampling rows (vLLM-style settings) for the sampled suite.
SAMPLED = dict(temperature=0.8, top_p=0.9)


def sampled_suite(graph, state, dgraph, dstate, batches=(8,), k=4, al=2.5, new_tokens=256, prompt_len=128):
    """The speculative loop (draft model, synthetic acceptance) with top-p 0.9 rows: its verify steps filter
    B x (k+1) rows. Once with top-k/top-p by the dispatcher (the radix search from batch 2 of a 128k
    vocabulary), once by the sort (the dispatcher's threshold raised past any batch)."""
    from specjax.kernels import top_k_top_p
    rows, default = [], top_k_top_p.MIN_SEARCH_ELEMENTS
    for B in batches:
        for filt, threshold in (("search", default), ("sort", 1 << 62)):
            top_k_top_p.MIN_SEARCH_ELEMENTS = threshold
            proposer = DraftModelProposer(dgraph, k, probabilistic=False)
            gen = generate_fn(graph, proposer, greedy=False)
            first, t, steps = run_generate(graph, state, proposer, dstate, B, prompt_len, new_tokens,
                                           conditional_rates(al, k), gen, sampling=SAMPLED)
            rows.append(dict(batch=B, k=k, al=al, filter=filt, tok_s=B * new_tokens / t,
                             ms_per_step=1e3 * t / max(steps, 1), steps=steps, compile_s=first - t))
            print(rows[-1], flush=True)
    top_k_top_p.MIN_SEARCH_ELEMENTS = default
    return rows


def eagle_suite(cfg, graph, state, batches=(1, 8), ks=(3, 5), new_tokens=256, prompt_len=128,
                draft_vocab=32000):
    """The loop with an EAGLE-3 head shaped for the target (one decoder layer, fc over three captured
    layers, a draft vocabulary of draft_vocab target ids, the target's embedding shared), random weights,
    synthetic acceptance: draft step time against a target step, and tokens/s against the ideal."""
    head = new_head(cfg, state, np.arange(draft_vocab), default_aux_layer_ids(cfg.num_layers))
    hgraph, hstate = nnx.split(head)
    tstep = step_fn(graph)
    context = prompt_len + new_tokens // 2
    rows = []
    for B in batches:
        plain = run_generate(graph, state, NoProposer(), None, B, prompt_len, new_tokens)[1]
        t_target = step_time(tstep, cfg, state, B, 1, context)
        t_draft = head_step_time(hgraph, hstate, head, B, context)
        for k in ks:
            t_verify = step_time(tstep, cfg, state, B, k + 1, context)
            rows += acceptance_sweep(graph, state, EagleProposer(hgraph, head, k, probabilistic=False), hstate, B,
                                     plain, t_verify, t_draft, new_tokens, prompt_len, target_ms=1e3 * t_target,
                                     draft_frac_of_target=t_draft / t_target)
    return rows


def acceptance_sweep(graph, state, proposer, draft_state, B, plain, t_verify, t_draft, new_tokens, prompt_len,
                     **extra) -> list[dict]:
    """One compiled speculative loop run at synthetic acceptance lengths 1.5 / 2.5 / 3.5: tokens/s against
    plain decoding (`plain` seconds) and against the ideal B x AL / (t_verify + k t_draft). Rows printed as
    they come; `extra` is added to each."""
    k, rows = proposer.k, []
    gen = generate_fn(graph, proposer)
    for al in (1.5, 2.5, 3.5):
        _, t, steps = run_generate(graph, state, proposer, draft_state, B, prompt_len, new_tokens,
                                   conditional_rates(al, k), gen)
        measured_al = (new_tokens - 1) / max(steps, 1)
        ideal = B * measured_al / (t_verify + k * t_draft)
        rows.append(dict(batch=B, k=k, al=al, measured_al=measured_al, tok_s=B * new_tokens / t,
                         plain_tok_s=B * new_tokens / plain, speedup=plain / t, ideal_tok_s=ideal,
                         frac_of_ideal=(B * new_tokens / t) / ideal, verify_ms=1e3 * t_verify,
                         draft_ms=1e3 * t_draft, **extra))
        print({key: round(v, 3) if isinstance(v, float) else v for key, v in rows[-1].items()}, flush=True)
    return rows


def head_step_time(hgraph, hstate, head, B, context):
    """One EAGLE head draft step: a token and the head's own hidden state in, the next draft (target id) out."""
    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(hstate, cache, token, hidden, start):
        h = nnx.merge(hgraph, hstate)
        out, feed, cache = h(token[:, None], hidden[:, None], start, cache)
        return h.to_target_ids(jnp.argmax(h.logits(out[:, 0]), axis=-1)), feed, cache

    holder = [init_cache(head.cfg.layers, B, context + 16, jnp.bfloat16)]
    token, start = jnp.ones((B,), jnp.int32), jnp.full((B,), context, jnp.int32)
    hidden = jnp.zeros((B, head.cfg.hidden_size), jnp.bfloat16)

    def run():
        for _ in range(STEPS_PER_TIMING):
            nxt, feed, holder[0] = step(hstate, holder[0], token, hidden, start)
        return nxt
    return median_time(run, repeats=10) / STEPS_PER_TIMING


def step_time(step, cfg, state, B, T, context, mesh=None):
    cache = init_cache(cfg, B, context + 16, jnp.bfloat16)
    if mesh is not None:
        heads = MODEL_AXIS if shards_kv_heads(cfg.num_kv_heads, mesh.shape[MODEL_AXIS]) else None
        cache = jax.device_put(cache, NamedSharding(mesh, P(None, None, heads)))
    holder = [cache]
    tokens, start = jnp.ones((B, T), jnp.int32), jnp.full((B,), context, jnp.int32)

    def run():
        for _ in range(STEPS_PER_TIMING):
            logits, holder[0] = step(state, holder[0], tokens, start)
        return logits
    return median_time(run, repeats=10) / STEPS_PER_TIMING


def smoke_configs():
    import dataclasses
    small = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=16)
    return dataclasses.replace(LLAMA31_8B, **small), dataclasses.replace(LLAMA32_1B, **{**small, "num_layers": 1})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--suites", default="step,e2e,spec")
    parser.add_argument("--impl", default="auto")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--ks", default="3,5")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, to check the script on CPU")
    args = parser.parse_args()
    target_cfg, draft_cfg = (smoke_configs() if args.smoke else (LLAMA31_8B, LLAMA32_1B))
    suites = args.suites.split(",")
    batches = tuple(int(b) for b in args.batches.split(","))
    ks = tuple(int(k) for k in args.ks.split(","))
    bandwidth, flops = (copy_bandwidth(1 << 26), matmul_flops(512)) if args.smoke else (copy_bandwidth(), matmul_flops())
    print(f"device {jax.devices()[0]}: copy {bandwidth / 1e12:.2f} TB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s")
    graph, state = model_state(target_cfg, args.impl)
    results = {}
    if "step" in suites:
        results["step"] = step_suite(target_cfg, graph, state, bandwidth)
    if "e2e" in suites:
        results["e2e"] = e2e_suite(graph, state, batches)
    if "spec" in suites:
        dgraph, dstate = model_state(draft_cfg, args.impl, seed=1)
        results["spec"] = spec_suite(target_cfg, draft_cfg, graph, state, dgraph, dstate,
                                     tuple(b for b in batches if b <= 8), ks)
    if "sampled" in suites:
        dgraph, dstate = model_state(draft_cfg, args.impl, seed=1)
        results["sampled"] = sampled_suite(graph, state, dgraph, dstate, tuple(b for b in batches if b <= 8))
    if "eagle" in suites:
        results["eagle"] = eagle_suite(target_cfg, graph, state, tuple(b for b in batches if b <= 8), ks,
                                       draft_vocab=256 if args.smoke else 32000)
    for name, rows in results.items():
        for r in rows:
            r.update(impl=args.impl, copy_TBps=bandwidth / 1e12)
        print(f"\n== {name} ({args.impl})", flush=True)
        print_table(rows)
        write_json(f"bench_engine_{name}_{args.impl}", rows)


if __name__ == "__main__":
    main()
