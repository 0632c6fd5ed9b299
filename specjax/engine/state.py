"""The loop's data: per-row request settings (fixed for a wave) and the carry of the one while_loop."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax

from specjax.models.kv_cache import KVCache


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Penalties:
    """vLLM's presence, frequency and repetition penalties per row [B], f32 (neutral: 0, 0, 1)."""
    presence: jax.Array
    frequency: jax.Array
    repetition: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RowParams:
    """Per-row request settings as arrays [B]; padding rows of a wave have max_tokens 0."""
    temperature: jax.Array   # f32, 0 = greedy
    top_k: jax.Array         # i32, 0 = off
    top_p: jax.Array         # f32, 1 = off
    min_p: jax.Array         # f32, 0 = off
    seed: jax.Array          # i32, the request's seed
    max_tokens: jax.Array    # i32, new tokens allowed
    min_tokens: jax.Array    # i32, stop ids are masked until this many were generated
    stop_ids: jax.Array      # i32 [B, M], EOS (unless ignore_eos) and stop_token_ids, -1 padded
    # None when no row of the wave has a penalty: the loop then counts no tokens (a different trace).
    penalties: Penalties | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TokenCounts:
    """What the penalties read, per row: which tokens the prompt holds and how often each was generated."""
    in_prompt: jax.Array     # bool [B, V]
    generated: jax.Array     # i32 [B, V]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TokenLogprobs:
    """vLLM's raw log-probability records (log-softmax of the model's logits, before any processing) of N
    tokens per row: the token's own, its rank (1 + how many tokens score higher, ties counted as higher, as
    vLLM; 0 where ranks were not asked for) and the n_top best."""
    chosen: jax.Array        # f32 [B, N]
    rank: jax.Array          # i32 [B, N]
    top_ids: jax.Array       # i32 [B, N, n_top] (n_top may be 0)
    top_logprobs: jax.Array  # f32 [B, N, n_top]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecCounters:
    """vLLM's speculative-decoding counters, per row so requests can report their own."""
    num_drafts: jax.Array         # i32 [B]
    num_draft_tokens: jax.Array   # i32 [B]
    num_accepted: jax.Array       # i32 [B]
    accepted_per_pos: jax.Array   # i32 [B, k]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LoopState:
    """The while_loop carry. Invariant: row b has committed tokens[b, :lengths[b]]; the target's KV is valid
    for slots < lengths[b] - 1 (the last committed token has not been run yet); everything beyond is garbage.
    """
    tokens: jax.Array        # i32 [B, S]
    lengths: jax.Array       # i32 [B]
    prompt_lengths: jax.Array  # i32 [B]
    logprobs: TokenLogprobs  # [B, S]: slot s holds the record of the token committed there (generated ones)
    # [B, P - 1]: entry t is prompt token t + 1's record given the tokens before it; None unless asked for
    prompt_logprobs: TokenLogprobs | None
    counts: TokenCounts | None   # None when no row has a penalty
    done: jax.Array          # bool [B]
    done_at: jax.Array       # i32 [B]: the loop iteration (`steps`) at which the row finished; 0 while running
    cache: KVCache
    proposer: Any            # the proposer's own pytree (draft KV, ...); None when stateless
    counters: SpecCounters
    steps: jax.Array         # i32 [], loop iterations run
    adapt: Any = None        # engine.adaptive.AdaptState of an adaptive loop; None for a fixed k
