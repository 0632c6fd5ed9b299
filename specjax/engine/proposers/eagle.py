"""eagle / eagle3 / mtp: a small head drafts k tokens from the target's hidden states, with its own cache (an
EAGLE head, models/eagle.py; the target's MTP layers, models/mtp.py; anything offering `DraftHead`).

At position p the head reads the token at p+1 (input ids shifted left by one, as in vLLM) with the target's
hidden state at p. `observe` runs after each target pass over the T positions it covered: the committed
ones write valid head KV (the rest is garbage beyond the committed length, overwritten later, as in the
target's cache) and the last committed one yields the first draft and the head's hidden state. `propose`
then runs k - 1 single-token steps, each fed the previous draft and the head's own hidden state. With a draft
tree, `propose_tree` grows EAGLE-2's dynamic tree instead (engine/draft_tree.py): from the head's output at the
last committed position, one head pass per level over that level's best `branching` nodes, each seeing its
ancestors' slots, the head's hidden states fed along each branch.

Adaptive speculation's plain steps (k = 0) run no head: `skipped` keeps each such pass's target features in a
ring of the last `catch_up_window` positions, and `catch_up` observes them in one pass before the next draft.
After more plain steps in a row than the ring holds (the auto policy probes sooner), the oldest are never
observed: their head KV stays stale, which costs draft quality only, never exactness.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.config.draft_tree import TreeShape
from specjax.engine import sampling
from specjax.engine.draft_tree import grow
from specjax.engine.proposers.base import Drafting, TargetPass
from specjax.engine.state import RowParams
from specjax.kernels.policy import KernelPolicy
from specjax.kernels.tree_mask import TreeMask


class DraftHead(Protocol):
    """What the proposer asks of a head (its module, merged from the draft state inside the loop)."""
    kernels: KernelPolicy
    capture_layers: tuple[int, ...]   # target layers whose entering residual stream `combine` reads; () = final

    @property
    def dtype(self) -> Any: ...
    def combine(self, target_features: jax.Array) -> jax.Array: ...
    def init_cache(self, batch: int, max_len: int) -> Any: ...
    def cache_bytes(self, batch: int, max_len: int) -> int: ...
    def __call__(self, tokens: jax.Array, hidden: jax.Array, start: jax.Array,
                 cache: Any, tree: TreeMask | None = None) -> tuple[jax.Array, jax.Array, Any]: ...
    def logits(self, out: jax.Array) -> jax.Array: ...           # over the head's (draft) vocabulary
    def target_logits(self, out: jax.Array) -> jax.Array: ...    # over the target's vocabulary
    def to_target_ids(self, draft_ids: jax.Array) -> jax.Array: ...


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class EagleCarry:
    cache: Any                   # the head's cache, valid for positions < lengths - 1
    first: jax.Array             # i32 [B] the first draft of the next step
    first_probs: jax.Array       # f32 [B, V] its draft distribution ([B, 0] when drafting greedily)
    hidden: jax.Array            # [B, H] the head's hidden state at position lengths - 2, fed back with `first`
    root: jax.Array              # [B, H] the head's output there, whose logits a draft tree grows from
    # Target features of passes not yet observed (plain steps), position p at index p % window: [B, window, F].
    pending: jax.Array
    pending_from: jax.Array      # i32 [B]: the first position not yet observed (lengths - 1 once caught up)


# catch_up runs once per segment of the adaptive loop, mostly with nothing to do. Untaken, a conditional copies
# the head's cache, while a loop of at most one trip keeps it in place but cost ~150 us per run where steps are
# launch-bound (few slots, small caches; benchmarks/RESULTS.md, "Adaptive k at 8 slots: the catch-up"). So caches up
# to this size (a few us per iteration to copy) take the conditional, larger ones the loop.
CATCH_UP_COPY_BYTES = 64 << 20


def _nbytes(tree) -> int:
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


class HeadProposer(Drafting):
    def __init__(self, head_graph: nnx.GraphDef, head: DraftHead, k: int, probabilistic: bool,
                 feature_size: int = 0, catch_up_window: int = 0, tree: TreeShape | None = None):
        """feature_size: width of the target features the head reads (its capture layers' residual streams,
        or the final hidden state); catch_up_window: plain steps' passes kept for catch_up (0: a loop of
        fixed k, which has none); tree: draft trees of this shape (k its depth) rather than chains."""
        if tree is not None and not head.supports_trees:
            raise ValueError("this draft head's layers cannot draft a tree yet: drop tree_nodes from "
                             "speculative_config")
        self.head_graph = head_graph
        self.cfg = head.cfg
        self.k = k
        self.probabilistic = probabilistic
        self.tree = tree
        self.capture_layers = head.capture_layers
        self.head_cache_bytes = head.cache_bytes
        self.feature_size = feature_size
        self.catch_up_slots = catch_up_window
        self.pending_row_bytes = catch_up_window * feature_size * jnp.dtype(head.dtype).itemsize

    def cache_bytes(self, batch: int, max_len: int) -> int:
        return self.head_cache_bytes(batch, max_len) + batch * self.pending_row_bytes

    def init(self, draft_state, prompt_tokens: jax.Array, prompt_lengths: jax.Array, cache_len: int) -> EagleCarry:
        head = nnx.merge(self.head_graph, draft_state)
        B = prompt_tokens.shape[0]
        vocab = self.cfg.vocab_size if self.probabilistic else 0
        return EagleCarry(cache=head.init_cache(B, cache_len),
                          first=jnp.zeros((B,), jnp.int32), first_probs=jnp.zeros((B, vocab), jnp.float32),
                          hidden=jnp.zeros((B, self.cfg.hidden_size), head.dtype),
                          root=jnp.zeros((B, self.cfg.hidden_size), head.dtype),
                          pending=jnp.zeros((B, self.catch_up_slots, self.feature_size), head.dtype),
                          pending_from=prompt_lengths)

    def observe(self, draft_state, carry: EagleCarry, target: TargetPass, tokens: jax.Array, lengths: jax.Array,
                rows: RowParams) -> EagleCarry:
        head = nnx.merge(self.head_graph, draft_state)
        features = head.combine(target.captured if self.capture_layers else target.hidden)
        B, T = features.shape[:2]
        # The token after each position (input ids shifted left by one); past the committed end it is garbage.
        after = jnp.minimum(target.start[:, None] + 1 + jnp.arange(T)[None, :], tokens.shape[1] - 1)
        next_tokens = jnp.take_along_axis(tokens, after, axis=1)
        out, feed, cache = head(next_tokens, features.astype(carry.hidden.dtype), target.start, carry.cache)
        last = jnp.clip(lengths - target.start - 2, 0, T - 1)  # the last committed position of this pass
        rows_idx = jnp.arange(B)
        first, probs = self._choose(head, out[rows_idx, last], rows, lengths)
        return dataclasses.replace(carry, cache=cache, first=first, first_probs=probs, hidden=feed[rows_idx, last],
                                   root=out[rows_idx, last].astype(carry.root.dtype), pending_from=lengths - 1)

    def skipped(self, draft_state, carry: EagleCarry, target: TargetPass, tokens: jax.Array, lengths: jax.Array,
                rows: RowParams) -> EagleCarry:
        """Keep a plain step's one-token pass for catch_up."""
        features = (target.captured if self.capture_layers else target.hidden)[:, 0]
        index = target.start % self.catch_up_slots
        pending = carry.pending.at[jnp.arange(features.shape[0]), index].set(features.astype(carry.pending.dtype))
        return dataclasses.replace(carry, pending=pending)

    def catch_up(self, draft_state, carry: EagleCarry, tokens: jax.Array, lengths: jax.Array,
                 rows: RowParams, drafting: jax.Array | bool = True) -> EagleCarry:
        """Observe the kept passes (positions pending_from .. lengths - 2, the last `window` of them) as one
        pass, when any row has some. A row with none runs from lengths - 1, writing only beyond its valid KV,
        and keeps its draft."""
        window = self.catch_up_slots
        behind = carry.pending_from < lengths - 1

        def observe_pending(c: EagleCarry) -> EagleCarry:
            start = jnp.where(behind, jnp.maximum(c.pending_from, lengths - 1 - window), lengths - 1)
            index = (start[:, None] + jnp.arange(window)[None, :]) % window
            features = jnp.take_along_axis(c.pending, index[:, :, None], axis=1)
            passed = TargetPass(hidden=features, captured=features if self.capture_layers else None, start=start)
            new = self.observe(draft_state, c, passed, tokens, lengths, rows)

            def keep(fresh, old):
                return jnp.where(behind.reshape((-1,) + (1,) * (old.ndim - 1)), fresh, old)

            return dataclasses.replace(new, first=keep(new.first, c.first), hidden=keep(new.hidden, c.hidden),
                                       root=keep(new.root, c.root), first_probs=keep(new.first_probs, c.first_probs))

        needed = jnp.any(behind) & drafting
        if _nbytes(carry.cache) <= CATCH_UP_COPY_BYTES:
            return jax.lax.cond(needed, observe_pending, lambda c: c, carry)
        _, carry = jax.lax.while_loop(lambda s: s[0], lambda s: (jnp.zeros((), bool), observe_pending(s[1])),
                                      (needed, carry))
        return carry

    def propose(self, draft_state, carry: EagleCarry, tokens: jax.Array, lengths: jax.Array, rows: RowParams):
        head = nnx.merge(self.head_graph, draft_state)

        def draft_step(state, i):
            token, hidden, cache = state
            # The head at position lengths-1+i reads the draft at lengths+i and predicts lengths+i+1.
            out, feed, cache = head(token[:, None], hidden[:, None], lengths - 1 + i, cache)
            nxt, probs = self._choose(head, out[:, 0], rows, lengths + i + 1)
            return (nxt, feed[:, 0], cache), (nxt, probs)

        (_, _, cache), (rest, rest_probs) = jax.lax.scan(
            draft_step, (carry.first, carry.hidden, carry.cache), jnp.arange(self.k - 1, dtype=jnp.int32))
        drafts = jnp.concatenate([carry.first[:, None], rest.T], axis=1)
        carry = dataclasses.replace(carry, cache=cache)
        if not self.probabilistic:
            return drafts, None, carry
        probs = jnp.concatenate([carry.first_probs[:, None], jnp.swapaxes(rest_probs, 0, 1)], axis=1)
        return drafts, probs, carry

    def propose_tree(self, draft_state, carry: EagleCarry, tokens: jax.Array, lengths: jax.Array, rows: RowParams):
        """EAGLE-2's tree over the head's (draft) vocabulary, greedy: its nodes are each parent's most probable
        children (q one-hot). A depth-d node runs at head position lengths - 2 + d (as the chain's d-th draft);
        level l's nodes are written at slots lengths - 1 + (l - 1) * branching .., garbage past the committed
        end that `observe` overwrites along the accepted path."""
        head = nnx.merge(self.head_graph, draft_state)
        shape = self.tree
        region = lengths - 1

        def step(level, cache, tokens, hidden, visible):
            mask = TreeMask(positions=jnp.broadcast_to((lengths - 2 + level)[:, None], tokens.shape),
                            region_start=region, visible=visible)
            out, feed, cache = head(tokens, hidden, region + (level - 1) * shape.branching, cache, tree=mask)
            return head.logits(out), feed, cache

        tree, cache = grow(head.logits(carry.root), carry.hidden, step, carry.cache,
                           depth=shape.depth, branching=shape.branching, nodes=shape.nodes,
                           token_ids=head.to_target_ids)
        return tree, None, dataclasses.replace(carry, cache=cache)

    def _choose(self, head: DraftHead, out: jax.Array, rows: RowParams, position: jax.Array):
        """Greedy drafting: the argmax of the draft vocabulary mapped to a target id (q one-hot, no probs
        kept). Probabilistic: a draw from the head's processed distribution q over the target vocabulary."""
        if not self.probabilistic:
            token = head.to_target_ids(jnp.argmax(head.logits(out), axis=-1).astype(jnp.int32))
            return token, jnp.zeros((out.shape[0], 0), jnp.float32)
        q = sampling.processed_probs(head.target_logits(out), rows.temperature, rows.top_k, rows.top_p,
                                     rows.min_p, head.kernels)
        token = sampling.sample_from_probs(q, sampling.row_key(rows.seed, position, sampling.DRAFT))
        return token, q
