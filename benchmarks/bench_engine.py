"""Decode/verify step time against the bandwidth roofline, and end-to-end generation with and without
speculation (synthetic acceptance; a Llama-3.2-1B-shaped draft model, or an EAGLE-3-shaped head), for a
Llama-3.1-8B-shaped model with random bf16 weights; and the plain generate loop per iteration, with what its
compiled while body launches and copies (`loop`, the 8B or the default model's shape).

    PYTHONPATH=. python benchmarks/bench_engine.py [--suites step,e2e,spec,sampled,eagle,loop,tree]
        [--impl auto|reference] [--xla-projections] [--loop-shape 8b|smollm2] [--loop-batches 1,16,64] [--trace]
        [--tree-shape 8b|smollm2] [--tree-nodes 8,16,32,64] [--smoke]

Writes $OUT/bench_engine_<suite>_<impl>.json and prints a table per suite. `--smoke` runs every suite (unless
--suites says otherwise) on tiny shapes, to check the script on a CPU. `tree`: a draft tree's verify pass (N nodes
under the root, tree-masked) against a chain's of as many tokens and a decode step, by wall clock and by the
device's busy time; with --trace, each pass's kernels too.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import re
import time
from collections import Counter
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from benchmarks.common import (LLAMA31_8B, LLAMA32_1B, SMOKE_DRAFT, SMOKE_TARGET, SMOLLM2_135M, copy_bandwidth,
                               draft_proposer, graph_with, kv_bytes_per_token, matmul_flops, median_time, out_dir,
                               print_table, random_model, weight_bytes, write_json)
from benchmarks.device_trace import busy_ns, by_kernel, span_ns, traced_kernels
from benchmarks.hlo_source import launches_per_iteration
from specjax.config import SpeculativeConfig
from specjax.engine.draft_tree import DraftTree
from specjax.engine.loop import LoopSpec, jit_generate
from specjax.engine.proposers.base import NoProposer
from specjax.engine.proposers.eagle import HeadProposer
from specjax.engine.rows import greedy_rows, row_params
from specjax.engine.shapes import buffer_len
from specjax.kernels.policy import KernelPolicy
from specjax.kernels.tree_mask import TreeMask
from specjax.models.eagle import default_aux_layer_ids
from specjax.models.llama import LlamaConfig
from specjax.parallel.mesh import MODEL_AXIS, Layout, gather_vocab, traced_with
from specjax.sampling_params import SamplingParams
from specjax.training.trainer import new_head

SUITES = ("step", "e2e", "spec", "sampled", "eagle", "loop", "tree")
MAX_MODEL_LEN = 8192
# Step timings dispatch this many steps back to back and block once: the host runs ahead of the device, so
# a step's figure is its device time (what the ideal of a loop that hid all host work would pay).
STEPS_PER_TIMING = 8
# The loop and tree suites' model shapes, with the prompt length (loop) and context (tree) each runs at.
SHAPES = {"8b": (LLAMA31_8B, 1024), "smollm2": (SMOLLM2_135M, 128)}


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The shapes the suites run: the standard ones, or --smoke's tiny ones."""
    prompt_len: int = 128            # e2e, spec, sampled and eagle prompts
    new_tokens: int = 256
    context: int = 1024              # the step suite's context
    step_batches: tuple[int, ...] = (1, 8)
    step_tokens: tuple[int, ...] = (1, 4, 8)
    loop_new_tokens: int = 128
    draft_vocab: int = 32000         # the EAGLE-3-shaped head's draft vocabulary
    tree_nodes: tuple[int, ...] = (8, 16, 32, 64)


# One batch, k=3 and contexts that recur across suites, so that suites share compiled programs.
SMOKE_SIZES = Sizes(prompt_len=16, new_tokens=8, context=20, step_batches=(1,), step_tokens=(1, 4),
                    loop_new_tokens=8, draft_vocab=256, tree_nodes=(4,))


@dataclasses.dataclass(frozen=True)
class Subject:
    """The target under test, its one-pass step and its plain generate loop jitted once: each compiled program
    serves every suite that runs its shapes."""
    cfg: LlamaConfig
    graph: nnx.GraphDef
    state: Any
    step: Callable
    plain: Callable
    mesh: Mesh | None   # tensor-parallel over its "model" axis when given (the state placed on it)


def subject(cfg, graph, state, mesh=None) -> Subject:
    return Subject(cfg, graph, state, step_fn(graph, mesh), generate_fn(graph, NoProposer(), mesh), mesh)


def random_subject(cfg, kernels) -> Subject:
    return subject(cfg, *nnx.split(random_model(cfg, kernels)))


def step_fn(graph, mesh=None):
    """One jitted target pass -> whole logits; under `mesh`, tensor-parallel over its "model" axis."""
    layout = None if mesh is None else Layout(mesh, head_axis=MODEL_AXIS)

    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(state, cache, tokens, start, tree=None):
        with traced_with(layout):
            model = nnx.merge(graph, state)
            hidden, cache, _ = model(tokens, start, cache, tree=tree)
            return gather_vocab(model.logits(hidden)), cache
    return step


def step_suite(target: Subject, bandwidth, sizes: Sizes):
    rows = []
    context = sizes.context
    for B in sizes.step_batches:
        for T in sizes.step_tokens:
            t = step_time(target, B, T, context)
            floor = (weight_bytes(target.cfg) + B * (context + T) * kv_bytes_per_token(target.cfg)) / bandwidth
            rows.append(dict(batch=B, T=T, context=context, ms=1e3 * t, floor_ms=1e3 * floor,
                             roofline_frac=floor / t))
    return rows


def generate_fn(graph, proposer, mesh=None, compiler_options=None, greedy=True):
    """The jitted generate loop as the engine runs it (sharded over `mesh` when given); compiler_options: the
    engine's unless given. greedy=False: the sampling loop (distributions, draws)."""
    spec = LoopSpec(k=proposer.k, n_top=0, max_model_len=MAX_MODEL_LEN, greedy=greedy)
    return jit_generate(graph, proposer, spec, mesh=mesh, compiler_options=compiler_options)


def generate_inputs(B, prompt_len, new_tokens, k, rates=None, rows=None):
    """(prompts, lengths, rows, cache_len, rates) of one wave: B random prompts, the buffers of new_tokens tokens
    at draft length k; greedy rows of new_tokens each (no stop ids) when rows is None."""
    prompts = jax.random.randint(jax.random.key(1), (B, prompt_len), 0, 500, jnp.int32)
    lengths = jnp.full((B,), prompt_len, jnp.int32)
    rows = greedy_rows(B, [new_tokens] * B, eos_token_ids=()) if rows is None else rows
    cache_len = buffer_len(prompt_len, prompt_len, new_tokens, k, MAX_MODEL_LEN)
    return prompts, lengths, rows, cache_len, None if rates is None else jnp.asarray(rates, jnp.float32)


def run_generate(graph, state, proposer, draft_state, B, prompt_len, new_tokens, rates=None, gen=None, rows=None):
    """(compile+first-call seconds, steady seconds, steps) for one wave of B prompts. Pass `gen` (from
    generate_fn) to reuse one compilation across calls of the same shapes (rates are a traced argument).
    rows: the wave's RowParams (B rows of new_tokens each, no stop ids); greedy rows when None."""
    gen = gen or generate_fn(graph, proposer)
    args = generate_inputs(B, prompt_len, new_tokens, proposer.k, rates, rows)
    start = time.perf_counter()
    out = jax.block_until_ready(gen(state, draft_state, *args))
    first = time.perf_counter() - start
    steady = median_time(lambda: gen(state, draft_state, *args), repeats=3, warmup=0)
    assert int(np.min(out.lengths - args[1])) == new_tokens
    return first, steady, int(out.steps)


def first_token_time(gen, state, draft_state, B, prompt_len, new_tokens, k, rates=None) -> float:
    """Seconds of the compiled loop `gen` (its buffers sized for new_tokens) run to one token per row: the prefill
    and the first token, which a decode-only rate leaves out."""
    prompts, lengths, _, cache_len, rates = generate_inputs(B, prompt_len, new_tokens, k, rates)
    one = greedy_rows(B, [1] * B, eos_token_ids=())
    return median_time(lambda: gen(state, draft_state, prompts, lengths, one, cache_len, rates), repeats=3)


def run_plain(target: Subject, B, prompt_len, new_tokens):
    return run_generate(target.graph, target.state, NoProposer(), None, B, prompt_len, new_tokens, gen=target.plain)


def plain_times(target: Subject, B, sizes: Sizes) -> tuple[float, float]:
    """Plain decoding's seconds for sizes.new_tokens tokens per row and, by the same program, for the first."""
    seconds = run_plain(target, B, sizes.prompt_len, sizes.new_tokens)[1]
    return seconds, first_token_time(target.plain, target.state, None, B, sizes.prompt_len, sizes.new_tokens, 0)


def e2e_suite(target: Subject, batches, sizes: Sizes):
    rows = []
    for B in batches:
        first, steady, steps = run_plain(target, B, sizes.prompt_len, sizes.new_tokens)
        ttft = first_token_time(target.plain, target.state, None, B, sizes.prompt_len, sizes.new_tokens, 0)
        rows.append(dict(batch=B, new_tokens=sizes.new_tokens, tok_s=B * sizes.new_tokens / steady,
                         ms_per_step=1e3 * (steady - ttft) / max(steps, 1), ttft_ms=1e3 * ttft,
                         compile_s=first - steady))
    return rows


def conditional_rates(al, k):
    """vLLM's synthetic_acceptance_length -> conditional per-position rates (see SpeculativeConfig)."""
    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": k,
                                        "rejection_sample_method": "synthetic",
                                        "synthetic_acceptance_length": al},
                                       target_max_model_len=MAX_MODEL_LEN, target_tensor_parallel_size=1)
    return spec.synthetic_rates()


def spec_suite(target: Subject, draft, batches, ks, sizes: Sizes):
    rows = []
    dgraph, dstate = nnx.split(draft)
    draft_subject = subject(draft.cfg, dgraph, dstate)
    context = sizes.prompt_len + sizes.new_tokens // 2
    for B in batches:
        plain = plain_times(target, B, sizes)
        for k in ks:
            t_verify = step_time(target, B, k + 1, context)
            t_draft = step_time(draft_subject, B, 1, context)
            rows += acceptance_sweep(target, draft_proposer(draft, k), dstate, B, plain, t_verify, t_draft, sizes)
    return rows


# Top-p sampling rows (vLLM-style settings) for the sampled suite.
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9)


def sampled_suite(target: Subject, kernels, draft, batches, sizes: Sizes, k=4, al=2.5):
    """The speculative loop (draft model, synthetic acceptance) with top-p 0.9 rows: its verify steps filter
    B x (k+1) rows. Once with top-k/top-p by the dispatcher (the radix search from batch 2 of a 128k
    vocabulary), once by the sort (the dispatcher's threshold raised past any batch). Where the kernels do not
    run the dispatcher sorts too, so only the sort is timed."""
    dstate = nnx.state(draft)
    filters = {"search": kernels, "sort": dataclasses.replace(kernels, search_min_elements=1 << 62)}
    if kernels.mode() == "reference":
        print("sampled: no radix search here (it needs the Pallas kernels: NVIDIA sm_80+); the sort only", flush=True)
        del filters["search"]
    rows = []
    for B in batches:
        wave = row_params([SAMPLED] * B, vocab_size=target.cfg.vocab_size, max_tokens=[sizes.new_tokens] * B,
                          eos_token_ids=())
        for filt, policy in filters.items():
            graph, proposer = graph_with(target.cfg, policy), draft_proposer(draft, k)
            gen = generate_fn(graph, proposer, greedy=False)
            first, t, steps = run_generate(graph, target.state, proposer, dstate, B, sizes.prompt_len,
                                           sizes.new_tokens, conditional_rates(al, k), gen, rows=wave)
            rows.append(dict(batch=B, k=k, al=al, filter=filt, tok_s=B * sizes.new_tokens / t,
                             ms_per_step=1e3 * t / max(steps, 1), steps=steps, compile_s=first - t))
            print(rows[-1], flush=True)
    return rows


def eagle_suite(target: Subject, batches, ks, sizes: Sizes):
    """The loop with an EAGLE-3 head shaped for the target (one decoder layer, fc over three captured
    layers, a draft vocabulary of sizes.draft_vocab target ids, the target's embedding shared), random
    weights, synthetic acceptance: draft step time against a target step, and tokens/s against the ideal."""
    cfg = target.cfg
    head = new_head(cfg, target.state, np.arange(sizes.draft_vocab), default_aux_layer_ids(cfg.num_layers),
                    kernels=nnx.merge(target.graph, target.state).kernels)   # the target's, as a loaded head
    hgraph, hstate = nnx.split(head)
    context = sizes.prompt_len + sizes.new_tokens // 2
    rows = []
    for B in batches:
        plain = plain_times(target, B, sizes)
        t_target = step_time(target, B, 1, context)
        t_draft = head_step_time(hgraph, hstate, head, B, context)
        for k in ks:
            t_verify = step_time(target, B, k + 1, context)
            rows += acceptance_sweep(target, HeadProposer(hgraph, head, k, probabilistic=False), hstate, B, plain,
                                     t_verify, t_draft, sizes, target_ms=1e3 * t_target,
                                     draft_frac_of_target=t_draft / t_target)
    return rows


def acceptance_sweep(target: Subject, proposer, draft_state, B, plain, t_verify, t_draft, sizes: Sizes,
                     lengths=(1.5, 2.5, 3.5), **extra) -> list[dict]:
    """One compiled speculative loop run at synthetic acceptance `lengths`: tokens/s against plain decoding
    (`plain`: plain_times' seconds) and against the ideal B x AL / (t_verify + k t_draft). The ideal is a rate of
    verify iterations, so it is compared with the decode rate: the tokens after the first over the seconds after
    it (the same program run to one token, the prefill and the draft's first pass, subtracted). Rows printed as
    they come; `extra` is added to each."""
    k, rows, new_tokens = proposer.k, [], sizes.new_tokens
    gen = generate_fn(target.graph, proposer)
    plain_s, plain_first = plain
    first_s = first_token_time(gen, target.state, draft_state, B, sizes.prompt_len, new_tokens, k,
                               conditional_rates(lengths[0], k))   # compiles the loop too
    for al in lengths:
        _, t, steps = run_generate(target.graph, target.state, proposer, draft_state, B, sizes.prompt_len,
                                   new_tokens, conditional_rates(al, k), gen)
        measured_al = (new_tokens - 1) / max(steps, 1)
        ideal = B * measured_al / (t_verify + k * t_draft)
        decode = B * (new_tokens - 1) / (t - first_s)
        rows.append(dict(batch=B, k=k, al=al, measured_al=measured_al, tok_s=B * new_tokens / t,
                         plain_tok_s=B * new_tokens / plain_s, speedup=plain_s / t, decode_tok_s=decode,
                         decode_speedup=(plain_s - plain_first) / (t - first_s), ideal_tok_s=ideal,
                         frac_of_ideal=decode / ideal, first_token_ms=1e3 * first_s,
                         plain_first_token_ms=1e3 * plain_first, verify_ms=1e3 * t_verify, draft_ms=1e3 * t_draft,
                         **extra))
        print({key: round(v, 3) if isinstance(v, float) else v for key, v in rows[-1].items()}, flush=True)
    return rows


def head_step_time(hgraph, hstate, head, B, context, distinct_tokens: bool = False):
    """One EAGLE head draft step: a token and the head's own hidden state in, the next draft (target id) out; the
    tokens all 1 and the states 0, or both drawn at random (`distinct_tokens`: rows route to different experts of
    an MoE block)."""
    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(hstate, cache, token, hidden, start):
        h = nnx.merge(hgraph, hstate)
        out, feed, cache = h(token[:, None], hidden[:, None], start, cache)
        return h.to_target_ids(jnp.argmax(h.logits(out[:, 0]), axis=-1)), feed, cache

    holder = [head.init_cache(B, context + 16)]
    token = (jax.random.randint(jax.random.key(B), (B,), 0, head.cfg.vocab_size, jnp.int32) if distinct_tokens
             else jnp.ones((B,), jnp.int32))
    start = jnp.full((B,), context, jnp.int32)
    hidden = (jax.random.normal(jax.random.key(B + 1), (B, head.cfg.hidden_size), jnp.bfloat16) if distinct_tokens
              else jnp.zeros((B, head.cfg.hidden_size), jnp.bfloat16))

    def run():
        for _ in range(STEPS_PER_TIMING):
            nxt, feed, holder[0] = step(hstate, holder[0], token, hidden, start)
        return nxt
    return median_time(run, repeats=10) / STEPS_PER_TIMING


def empty_cache(model: Subject, B, slots):
    """The model's empty cache for B rows of `slots`, under a mesh laid out as the sharded loop carries it."""
    cache = nnx.merge(model.graph, model.state).init_cache(B, slots)
    if model.mesh is None:
        return cache
    specs = cache.specs(Layout(model.mesh, head_axis=MODEL_AXIS))
    return jax.tree.map(lambda leaf, spec: jax.device_put(leaf, NamedSharding(model.mesh, spec)), cache, specs)


def step_time(model: Subject, B, T, context, tree: TreeMask | None = None, distinct_tokens: bool = False):
    """Seconds of one pass of model.step over T tokens per row at `context` (a draft tree's, given its mask); the
    tokens all 1, or drawn at random (`distinct_tokens`: rows route to different MoE experts)."""
    run = stepper(model, B, T, context, tree, distinct_tokens, STEPS_PER_TIMING)
    return median_time(run, repeats=10) / STEPS_PER_TIMING


def stepper(model: Subject, B, T, context, tree: TreeMask | None = None, distinct_tokens: bool = False,
            steps: int = 1):
    """A function that runs `steps` passes of model.step as step_time describes them and returns the last logits."""
    holder = [empty_cache(model, B, context + T + 16)]
    tokens = (jax.random.randint(jax.random.key(B * T), (B, T), 0, model.cfg.vocab_size, jnp.int32)
              if distinct_tokens else jnp.ones((B, T), jnp.int32))
    start = jnp.full((B,), context, jnp.int32)

    def run():
        for _ in range(steps):
            logits, holder[0] = model.step(model.state, holder[0], tokens, start, tree)
        return logits
    return run


def tree_suite(target: Subject, sizes: Sizes, context: int, trace: bool = False) -> list[dict]:
    """A tree's verify pass (each node's children: up to 4, breadth first) against a chain pass of as many
    tokens and a decode step, at `context`: wall-clock per pass (each a jitted call: dispatch included) and the
    device's busy time per pass from a profiler trace (NaN off GPUs). trace: also each pass's kernels by kind
    (printed, and written to $OUT as bench_engine_tree_profile_b{B}_n{nodes}.json)."""
    rows = []
    for B in sizes.step_batches:
        decode = step_time(target, B, 1, context)
        decode_us, _ = pass_profile(target, B, 1, context)
        for nodes in sizes.tree_nodes:
            parents = jnp.broadcast_to(jnp.arange(nodes, dtype=jnp.int32) // 4, (B, nodes))
            depth = jnp.ones((B, nodes), jnp.int32)
            for j in range(4, nodes):
                depth = depth.at[:, j].set(depth[:, j // 4 - 1] + 1)
            mask = DraftTree(jnp.ones((B, nodes), jnp.int32), parents, depth).verify_mask(
                jnp.full((B,), context, jnp.int32), nodes)
            t_tree = step_time(target, B, nodes + 1, context, mask)
            t_chain = step_time(target, B, nodes + 1, context)
            tree_us, tree_kinds = pass_profile(target, B, nodes + 1, context, mask)
            chain_us, chain_kinds = pass_profile(target, B, nodes + 1, context)
            rows.append(dict(batch=B, nodes=nodes, context=context, tree_ms=1e3 * t_tree, chain_ms=1e3 * t_chain,
                             decode_ms=1e3 * decode, tree_over_decode=t_tree / decode, tree_device_us=tree_us,
                             chain_device_us=chain_us, decode_device_us=decode_us))
            if trace:
                print(f"tree pass, batch {B}, {nodes} nodes: device time per pass by kernel (tree, then chain)")
                print_table(tree_kinds)
                print_table(chain_kinds)
                write_json(f"bench_engine_tree_profile_b{B}_n{nodes}", dict(tree=tree_kinds, chain=chain_kinds))
    return rows


def pass_profile(model: Subject, B, T, context, tree: TreeMask | None = None, steps: int = 5
                 ) -> tuple[float, list[dict]]:
    """Device busy time of one pass of model.step (us; NaN off GPUs) and its kernels by kind, per pass, from a
    profiler trace of `steps` passes."""
    kernels = traced_kernels(stepper(model, B, T, context, tree, steps=steps))
    return (busy_ns(kernels) / steps / 1e3 if kernels else float("nan")), by_kernel(kernels, per=steps)


def loop_suite(target: Subject, bandwidth, context, new_tokens, batches=(1,), trace=False) -> list[dict]:
    """Plain decoding in the generate loop, B rows of a `context`-token prompt for each B of `batches`: time per
    loop iteration ((t(new_tokens) - t(1)) / (new_tokens - 1), one compiled program) against the roofline floor,
    the kernels the compiled while body launches per iteration (the CUDA graph's nodes, whose launch cost grows
    with them) and the weight-shaped buffers it materialises (a layer's weight sliced out of a stacked array
    and copied shows up as one). The programs go to $OUT. trace: the device's time per iteration by kernel, from
    the loop compiled with one CUDA graph per body (the profiler sees no kernel inside a loop that is one graph
    whole)."""
    return [_loop_row(target, bandwidth, context, new_tokens, B, trace) for B in batches]


def _loop_row(target: Subject, bandwidth, context, new_tokens, B, trace) -> dict:
    cfg = target.cfg
    floor = (weight_bytes(cfg) + B * context * kv_bytes_per_token(cfg)) / bandwidth
    prompts, lengths = jnp.ones((B, context), jnp.int32), jnp.full((B,), context, jnp.int32)
    cache_len = buffer_len(context, context, new_tokens, 0, MAX_MODEL_LEN)

    calls = {n: (target.state, None, prompts, lengths, greedy_rows(B, [n] * B, eos_token_ids=()), cache_len)
             for n in (1, new_tokens)}
    gen = target.plain
    times = {n: median_time(lambda args=args: gen(*args), repeats=3, warmup=1) for n, args in calls.items()}
    per_iteration = (times[new_tokens] - times[1]) / (new_tokens - 1)
    hlo = gen.lower(*calls[new_tokens]).compile().as_text()
    (out_dir() / f"bench_engine_loop_hlo_b{B}.txt").write_text(hlo)
    row = dict(model=f"{cfg.num_layers}L-{cfg.hidden_size}", batch=B, context=context, new_tokens=new_tokens,
               ms_per_iteration=1e3 * per_iteration, floor_ms=1e3 * floor, roofline_frac=floor / per_iteration,
               kernels_per_iteration=sum(launches_per_iteration(hlo).values()),
               weight_shaped=dict(materialised_weights(hlo, weight_shapes(cfg))))
    if trace:
        row.update(profile_loop(generate_fn(target.graph, NoProposer(), compiler_options={}), calls[new_tokens],
                                new_tokens, name=f"b{B}"))
    return row


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


def profile_loop(gen, args, iterations: int, name: str) -> dict:
    """Where an iteration's device time goes: kernels, busy time, the costliest kinds (printed, and written to
    $OUT with the trace itself, both named by `name`)."""
    kernels = traced_kernels(lambda: gen(*args), keep_trace=out_dir() / f"bench_engine_loop_trace_{name}.xplane.pb")
    costliest = by_kernel(kernels, per=iterations)
    print(f"profile {name}: device time per iteration by kernel ({len(kernels) / iterations:.1f} kernels):",
          flush=True)
    print_table(costliest)
    write_json(f"bench_engine_loop_profile_{name}", costliest)
    return dict(device_kernels_per_iteration=len(kernels) / iterations,
                busy_us_per_iteration=busy_ns(kernels) / iterations / 1e3,
                span_us_per_iteration=span_ns(kernels) / iterations / 1e3)


def parse_args(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--suites", help=f"comma-separated, of {', '.join(SUITES)} (default step,e2e,spec)")
    parser.add_argument("--impl", default="auto")
    parser.add_argument("--xla-projections", action="store_true",
                        help="the projection kernel off (XLA's projections), the other kernels as --impl says")
    parser.add_argument("--batches", help="default 1,8,32 (spec, sampled and eagle take those up to 8)")
    parser.add_argument("--ks", help="default 3,5")
    parser.add_argument("--loop-shape", default="8b", choices=SHAPES, help="the loop suite's model shape")
    parser.add_argument("--tree-shape", default="8b", choices=SHAPES, help="the tree suite's model shape")
    parser.add_argument("--loop-batches", default="1", help="the loop suite's row counts (default 1)")
    parser.add_argument("--trace", action="store_true", help="profile the loop suite's loop and the tree "
                        "suite's passes")
    parser.add_argument("--tree-nodes", help="the tree suite's node counts (default 8,16,32,64)")
    parser.add_argument("--smoke", action="store_true", help="every suite on tiny shapes, to check the script on CPU")
    args = parser.parse_args(argv)
    args.suites = (args.suites or (",".join(SUITES) if args.smoke else "step,e2e,spec")).split(",")
    args.batches = tuple(int(b) for b in (args.batches or ("1" if args.smoke else "1,8,32")).split(","))
    args.ks = tuple(int(k) for k in (args.ks or ("3" if args.smoke else "3,5")).split(","))
    args.loop_batches = tuple(int(b) for b in args.loop_batches.split(","))
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    target_cfg, draft_cfg = (SMOKE_TARGET, SMOKE_DRAFT) if args.smoke else (LLAMA31_8B, LLAMA32_1B)
    sizes = SMOKE_SIZES if args.smoke else Sizes()
    if args.tree_nodes:
        sizes = dataclasses.replace(sizes, tree_nodes=tuple(int(n) for n in args.tree_nodes.split(",")))
    suites, batches, ks = args.suites, args.batches, args.ks
    small_batches = tuple(b for b in batches if b <= 8)
    kernels = KernelPolicy(impl=args.impl)
    if args.xla_projections:
        kernels = dataclasses.replace(kernels, projection_max_weight_bytes=0)
    impl = args.impl + ("-xla-projections" if args.xla_projections else "")
    bandwidth, flops = (copy_bandwidth(1 << 26), matmul_flops(512)) if args.smoke else (copy_bandwidth(), matmul_flops())
    print(f"device {jax.devices()[0]}: copy {bandwidth / 1e12:.2f} TB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s")
    built: dict[str, Subject] = {}

    def shaped(cfg: LlamaConfig) -> Subject:
        """The random model of cfg, built when a suite first asks for it (the 8B shape takes 16 GB)."""
        if repr(cfg) not in built:
            built[repr(cfg)] = random_subject(cfg, kernels)
        return built[repr(cfg)]

    target = shaped(target_cfg) if {"step", "e2e", "spec", "sampled", "eagle"} & set(suites) else None
    draft = random_model(draft_cfg, kernels, seed=1) if {"spec", "sampled"} & set(suites) else None
    results = {}
    if "step" in suites:
        results["step"] = step_suite(target, bandwidth, sizes)
    if "e2e" in suites:
        results["e2e"] = e2e_suite(target, batches, sizes)
    if "spec" in suites:
        results["spec"] = spec_suite(target, draft, small_batches, ks, sizes)
    if "sampled" in suites:
        results["sampled"] = sampled_suite(target, kernels, draft, small_batches, sizes)
    if "eagle" in suites:
        results["eagle"] = eagle_suite(target, small_batches, ks, sizes)
    if "tree" in suites:
        tree_cfg, context = (target_cfg, sizes.context) if args.smoke else SHAPES[args.tree_shape]
        results["tree"] = tree_suite(shaped(tree_cfg), sizes, context, args.trace)
    if "loop" in suites:
        loop_cfg, context = (target_cfg, sizes.prompt_len) if args.smoke else SHAPES[args.loop_shape]
        results["loop"] = loop_suite(shaped(loop_cfg), bandwidth, context, sizes.loop_new_tokens, args.loop_batches,
                                     args.trace)
    for name, rows in results.items():
        for r in rows:
            r.update(impl=impl, copy_TBps=bandwidth / 1e12)
        print(f"\n== {name} ({impl})", flush=True)
        print_table(rows)
        write_json(f"bench_engine_{name}_{impl}", rows)


if __name__ == "__main__":
    main()
