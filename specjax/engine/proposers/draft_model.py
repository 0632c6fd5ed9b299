"""draft_model: a smaller model of the same tokenizer drafts k tokens autoregressively with its own KV cache.

Catch-up needs no extra pass: the draft's KV for accepted drafts was written while drafting them, so each
proposal starts by running the last two committed tokens (re-writing one slot, harmlessly), which covers
the one slot never drafted when every draft was accepted. After plain decode steps (adaptive speculation's
k = 0 tier) the committed tokens run ahead of the draft's KV; catch_up runs them in chunks first.

With a draft tree, `propose_tree` grows EAGLE-2's tree from the draft's distribution at the last committed
token (each level's best `branching` nodes run in one pass, each seeing its ancestors). The accepted nodes'
KV sits at tree slots, not at their positions, so every tree step starts by catching up on what was committed.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.config.draft_tree import TreeShape
from specjax.engine import sampling
from specjax.engine.draft_tree import grow
from specjax.engine.proposers.base import IgnoresTarget
from specjax.engine.state import RowParams
from specjax.kernels.tree_mask import TreeMask

# Tokens per catch-up pass of the draft after plain steps.
CATCH_UP_CHUNK = 8


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DraftCarry:
    cache: Any           # the draft's KV cache
    synced: jax.Array    # i32 [B]: the cache is valid below min(synced, lengths - 2)


class DraftModelProposer(IgnoresTarget):
    def __init__(self, draft_graph: nnx.GraphDef, k: int, probabilistic: bool,
                 cache_bytes: Callable[[int, int], int], tree: TreeShape | None = None):
        """cache_bytes(batch, max_len): what one device holds of the draft's cache (its module's
        cache_bytes at the draft's tensor-parallel size); tree: draft trees of this shape (k its depth)."""
        self.draft_graph = draft_graph
        self.k = k
        self.tree = tree
        self.probabilistic = probabilistic
        self.cache_bytes = cache_bytes

    def init(self, draft_state, prompt_tokens: jax.Array, prompt_lengths: jax.Array, cache_len: int) -> Any:
        draft = nnx.merge(self.draft_graph, draft_state)
        cache = draft.init_cache(prompt_tokens.shape[0], cache_len)
        _, cache, _ = draft(prompt_tokens, jnp.zeros_like(prompt_lengths), cache, fresh=True)
        return DraftCarry(cache, prompt_lengths)

    def catch_up(self, draft_state, carry: DraftCarry, tokens: jax.Array, lengths: jax.Array,
                 rows: RowParams, drafting: jax.Array | bool = True) -> DraftCarry:
        """Run the committed tokens the draft has not seen (below lengths - 2, which propose runs itself), a
        chunk at a time. A chunk starts at the row's first unseen slot, or earlier where it would pass the
        buffer's end (re-running seen tokens writes the same KV); rows already caught up re-run their last
        tokens and write beyond them, where the cache is garbage until drafted over anyway."""
        draft = nnx.merge(self.draft_graph, draft_state)
        goal = lengths - 2
        slots = tokens.shape[1]
        chunk = min(CATCH_UP_CHUNK, slots)

        def behind(c: DraftCarry):
            return jnp.any(c.synced < goal) & drafting

        def run_chunk(c: DraftCarry) -> DraftCarry:
            start = jnp.minimum(jnp.minimum(c.synced, goal), slots - chunk)
            window = jnp.take_along_axis(tokens, start[:, None] + jnp.arange(chunk)[None, :], axis=1)
            _, cache, _ = draft(window, start, c.cache)
            return DraftCarry(cache, jnp.maximum(c.synced, jnp.minimum(start + chunk, goal)))

        return jax.lax.while_loop(behind, run_chunk, carry)

    def propose(self, draft_state, carry: DraftCarry, tokens: jax.Array, lengths: jax.Array, rows: RowParams):
        draft = nnx.merge(self.draft_graph, draft_state)
        cache = carry.cache
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
        # Written: the last two committed tokens and every draft but the last.
        carry = DraftCarry(cache, lengths + self.k - 1)
        if not self.probabilistic:
            return drafts, None, carry
        return drafts, jnp.concatenate([probs[:, None], jnp.swapaxes(rest_probs, 0, 1)], axis=1), carry

    def propose_tree(self, draft_state, carry: DraftCarry, tokens: jax.Array, lengths: jax.Array,
                     rows: RowParams):
        """EAGLE-2's tree from the draft model, greedy (q one-hot). A depth-d node runs at position
        lengths - 1 + d; level l's nodes are written at slots lengths + (l - 1) * branching .., past the
        committed end (the next step's catch-up overwrites what was accepted)."""
        carry = self.catch_up(draft_state, carry, tokens, lengths, rows)
        draft = nnx.merge(self.draft_graph, draft_state)
        B, shape = tokens.shape[0], self.tree
        last_two = jnp.stack([tokens[jnp.arange(B), lengths - 2], tokens[jnp.arange(B), lengths - 1]], axis=1)
        hidden, cache, _ = draft(last_two, lengths - 2, carry.cache)

        def step(level, cache, tokens, states, visible):
            mask = TreeMask(positions=jnp.broadcast_to((lengths - 1 + level)[:, None], tokens.shape),
                            region_start=lengths, visible=visible)
            hidden, cache, _ = draft(tokens, lengths + (level - 1) * shape.branching, cache, tree=mask)
            return draft.logits(hidden), states, cache

        tree, cache = grow(draft.logits(hidden[:, -1]), jnp.zeros((B, 0)), step, cache,
                           depth=shape.depth, branching=shape.branching, nodes=shape.nodes)
        return tree, None, DraftCarry(cache, lengths)

    def _choose(self, logits: jax.Array, rows: RowParams, position: jax.Array, kernels):
        """Greedy drafting takes the argmax (q one-hot, so no probs are kept); probabilistic drafting draws
        from the draft's processed distribution q (its filters by the draft's kernel policy) and keeps
        q for verification."""
        if not self.probabilistic:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32), None
        q = sampling.processed_probs(logits, rows.temperature, rows.top_k, rows.top_p, rows.min_p, kernels)
        token = sampling.sample_from_probs(q, sampling.row_key(rows.seed, position, sampling.DRAFT))
        return token, q
