"""The functional core for jitted harnesses: one pure generate function, built once from an `LLM`.

    fn = make_generate_fn(llm, SamplingParams(temperature=0.8, max_tokens=64))
    tokens, lengths, stats = jax.jit(fn)(llm.params, llm.draft_params, prompt_tokens, prompt_lengths, rng)
    # on GPUs, jit it with specjax.engine.loop.loop_compiler_options() to run the loop as one CUDA graph
    jax.vmap(fn, in_axes=(None, None, None, None, 0))(..., jax.random.split(rng, 8))   # over seeds

prompt_tokens [B, P] int32 right-padded, prompt_lengths [B] int32 (1 <= length <= P). Returns tokens [B, S]
(prompt then generated tokens; slots at or beyond lengths[b] are garbage), lengths [B] and a dict of
per-row speculative counters. Every row uses `sampling_params`; each row's seed is drawn from `rng`.
Stop strings are matched on text and so are the host's job: only token-level stops apply here.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from specjax.engine.loop import LoopSpec, build_generate
from specjax.engine.sampling import GREEDY_TEMPERATURE_EPS
from specjax.engine.shapes import buffer_len
from specjax.engine.state import RowParams
from specjax.parallel import sharded_generate
from specjax.sampling_params import SamplingParams, to_row_arrays


def make_generate_fn(llm, sampling_params: SamplingParams) -> Callable:
    if sampling_params.n != 1:
        raise ValueError("make_generate_fn takes n=1: vmap the function over rng for several samples")
    k = llm.proposer.k
    spec = LoopSpec(k=k, n_top=0, max_model_len=llm.max_model_len,
                    greedy=sampling_params.temperature < GREEDY_TEMPERATURE_EPS)
    generate = build_generate(llm.target_graph, llm.proposer, spec)
    if llm.mesh is not None:
        generate = sharded_generate(generate, llm.mesh)
    arrays = to_row_arrays([sampling_params], llm.model_config.vocab_size)
    stop_ids = llm._runner.row_stop_ids(sampling_params) or [-1]

    def generate_fn(params, draft_params, prompt_tokens: jax.Array, prompt_lengths: jax.Array, rng: jax.Array):
        B, P = prompt_tokens.shape
        max_new = llm.max_model_len - P if sampling_params.max_tokens is None else sampling_params.max_tokens
        cache_len = buffer_len(P, P, max_new, k, llm.max_model_len)

        def per_row(x):
            return jnp.broadcast_to(jnp.asarray(x), (B,) + jnp.shape(x)[1:])

        rows = RowParams(
            temperature=per_row(arrays.temperature), top_k=per_row(arrays.top_k), top_p=per_row(arrays.top_p),
            min_p=per_row(arrays.min_p),
            seed=jax.random.randint(rng, (B,), 0, jnp.iinfo(jnp.int32).max).astype(jnp.uint32),
            max_tokens=jnp.full((B,), max_new, jnp.int32),
            min_tokens=jnp.full((B,), sampling_params.min_tokens, jnp.int32),
            stop_ids=jnp.broadcast_to(jnp.asarray(stop_ids, jnp.int32), (B, len(stop_ids))))
        state = generate(params, draft_params, prompt_tokens.astype(jnp.int32),
                         prompt_lengths.astype(jnp.int32), rows, cache_len, llm._runner.synthetic_rates)
        c = state.counters
        stats = {"num_drafts": c.num_drafts, "num_draft_tokens": c.num_draft_tokens,
                 "num_accepted_tokens": c.num_accepted, "num_accepted_tokens_per_pos": c.accepted_per_pos}
        return state.tokens, state.lengths, stats

    return generate_fn
