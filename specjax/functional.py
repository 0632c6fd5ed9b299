"""The functional core for jitted harnesses: one pure generate function, built once from an `LLM`.

    fn = make_generate_fn(llm, SamplingParams(temperature=0.8, max_tokens=64))
    tokens, lengths, stats = jax.jit(fn)(llm.params, llm.draft_params, prompt_tokens, prompt_lengths, rng)
    # on GPUs, jit it with specjax.engine.loop.loop_compiler_options() to run the loop as one CUDA graph
    jax.vmap(fn, in_axes=(None, None, None, None, 0))(..., jax.random.split(rng, 8))   # over seeds

prompt_tokens [B, P] int32 right-padded, prompt_lengths [B] int32 (1 <= length <= P). Returns tokens [B, S]
(prompt then generated tokens; slots at or beyond lengths[b] are garbage), lengths [B] and a dict of
per-row speculative counters (with an adaptive speculation_policy, also "k_per_step", "live_per_step" and
"shadow_per_step", one entry per loop iteration, zero past the last). Every row uses `sampling_params`; each
row's seed is drawn from `rng`. Stop strings are matched on text and so are the host's job: only token-level
stops apply here. `slots`: decode at most that many rows at once, the next rows admitted as rows finish
(engine/admission.py); the outputs are the same, row for row.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config.validators import check_int
from specjax.engine.adaptive import policy_inputs
from specjax.engine.admission import Queue, admit_batch, build_admitting
from specjax.engine.loop import LoopSpec, build_generate
from specjax.engine.proposers.base import spare_slots
from specjax.engine.rows import row_params
from specjax.engine.runner import synthetic_rates
from specjax.engine.shapes import buffer_len
from specjax.sampling_params import SamplingParams


def make_generate_fn(llm: Any, sampling_params: SamplingParams, slots: int | None = None) -> Callable:
    """The pure generate function of `llm` (an LLM) for rows that all use `sampling_params`; slots: at most
    that many rows decoded at once (None: every row)."""
    if sampling_params.n != 1:
        raise ValueError("make_generate_fn takes n=1: vmap the function over rng for several samples")
    if slots is not None:
        check_int(slots, "slots", minimum=1)
        if llm.mesh is not None:
            raise ValueError("make_generate_fn(slots=...) runs on one device: leave slots out on a tensor-parallel "
                             "LLM (every row then decodes at once)")
    config, k = llm.config, llm.proposer.k
    policy = None if config.speculative is None or not config.speculative.policy.adaptive else config.speculative.policy
    if policy is not None and policy.mode == "auto" and policy.step_costs is None:
        raise ValueError("make_generate_fn cannot measure step times inside your jit: give speculative_config "
                         "'step_costs' ({k: seconds per iteration} for the tiers "
                         f"{list(policy.tiers)}) with speculation_policy 'auto', or use the 'table' policy")
    spec = LoopSpec(k=k, n_top=0, max_model_len=config.max_model_len, greedy=sampling_params.is_greedy,
                    policy=policy)
    generate = build_generate(llm.target_graph, llm.proposer, spec, mesh=llm.mesh)
    admitting = None if slots is None else build_admitting(llm.target_graph, llm.proposer, spec,
                                                           admit_batch=admit_batch(slots))
    rates = synthetic_rates(config.speculative)
    inputs = None if policy is None else policy_inputs(np.asarray(policy.step_costs or [1.0] * len(policy.tiers)))

    def generate_fn(params, draft_params, prompt_tokens: jax.Array, prompt_lengths: jax.Array, rng: jax.Array):
        B, P = prompt_tokens.shape
        max_new = config.max_model_len - P if sampling_params.max_tokens is None else sampling_params.max_tokens
        host_rows = row_params([sampling_params] * B, vocab_size=llm.model_config.vocab_size,
                               max_tokens=[max_new] * B, eos_token_ids=llm.eos_token_ids)
        seeds = jax.random.randint(rng, (B,), 0, jnp.iinfo(jnp.int32).max).astype(jnp.uint32)
        rows = dataclasses.replace(jax.tree.map(jnp.asarray, host_rows), seed=seeds)
        prompt_tokens, prompt_lengths = prompt_tokens.astype(jnp.int32), prompt_lengths.astype(jnp.int32)
        cache_len = buffer_len(P, P, max_new, spare_slots(llm.proposer), config.max_model_len)
        if admitting is None or slots >= B:
            state = generate(params, draft_params, prompt_tokens, prompt_lengths, rows, cache_len, rates, inputs)
            adapt = state.adapt
        else:
            # Each iteration commits a token for some row, so B * max_new bounds an adaptive record.
            out = admitting(params, draft_params, Queue(prompt_tokens, prompt_lengths, rows, jnp.int32(B)), slots,
                            cache_len, B * max(max_new, 1) if policy is not None else 1, rates, inputs)
            state, adapt = out.results, out.adapt
        c = state.counters
        stats = {"num_drafts": c.num_drafts, "num_draft_tokens": c.num_draft_tokens,
                 "num_accepted_tokens": c.num_accepted, "num_accepted_tokens_per_pos": c.accepted_per_pos}
        if adapt is not None:
            stats.update(k_per_step=adapt.k_per_step, live_per_step=adapt.live_per_step,
                         shadow_per_step=adapt.shadow_per_step)
        return state.tokens, state.lengths, stats

    return generate_fn
