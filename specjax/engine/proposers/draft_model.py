"""draft_model: a smaller model of the same tokenizer drafts k tokens autoregressively with its own KV cache.

Catch-up needs no extra pass: the draft's KV for accepted drafts was written while drafting them, so each
proposal starts by running the last two committed tokens (re-writing one slot, harmlessly), which covers
the one slot never drafted when every draft was accepted.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.engine import sampling
from specjax.engine.proposers.base import IgnoresTarget
from specjax.engine.state import RowParams


class DraftModelProposer(IgnoresTarget):
    def __init__(self, draft_graph: nnx.GraphDef, k: int, probabilistic: bool,
                 cache_bytes: Callable[[int, int], int]):
        """cache_bytes(batch, max_len): what one device holds of the draft's cache (its module's
        cache_bytes at the draft's tensor-parallel size)."""
        self.draft_graph = draft_graph
        self.k = k
        self.probabilistic = probabilistic
        self.cache_bytes = cache_bytes

    def init(self, draft_state, prompt_tokens: jax.Array, prompt_lengths: jax.Array, cache_len: int) -> Any:
        draft = nnx.merge(self.draft_graph, draft_state)
        cache = draft.init_cache(prompt_tokens.shape[0], cache_len)
        _, cache, _ = draft(prompt_tokens, jnp.zeros_like(prompt_lengths), cache, fresh=True)
        return cache

    def propose(self, draft_state, cache: Any, tokens: jax.Array, lengths: jax.Array, rows: RowParams):
        draft = nnx.merge(self.draft_graph, draft_state)
        B = tokens.shape[0]
        last_two = jnp.stack([tokens[jnp.arange(B), lengths - 2], tokens[jnp.arange(B), lengths - 1]], axis=1)
        hidden, cache, _ = draft(last_two, lengths - 2, cache)
        token, probs = self._choose(draft.logits(hidden[:, -1]), rows, lengths, draft.kernels)

        def draft_step(carry, i):
            token, cache = carry
            hidden, cache, _ = draft(token[:, None], lengths + i, cache)
            nxt, probs = self._choose(draft.logits(hidden[:, 0]), rows, lengths + i + 1, draft.kernels)
            return (nxt, cache), (nxt, probs)

        (_, cache), (rest, rest_probs) = jax.lax.scan(draft_step, (token, cache),
                                                      jnp.arange(self.k - 1, dtype=jnp.int32))
        drafts = jnp.concatenate([token[:, None], rest.T], axis=1)
        if not self.probabilistic:
            return drafts, None, cache
        return drafts, jnp.concatenate([probs[:, None], jnp.swapaxes(rest_probs, 0, 1)], axis=1), cache

    def _choose(self, logits: jax.Array, rows: RowParams, position: jax.Array, kernels):
        """Greedy drafting takes the argmax (q one-hot, so no probs are kept); probabilistic drafting draws
        from the draft's processed distribution q (its filters by the draft's kernel policy) and keeps
        q for verification."""
        if not self.probabilistic:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32), None
        q = sampling.processed_probs(logits, rows.temperature, rows.top_k, rows.top_p, rows.min_p, kernels)
        token = sampling.sample_from_probs(q, sampling.row_key(rows.seed, position, sampling.DRAFT))
        return token, q
