"""What the loop asks of a draft mechanism. Proposers know the model interface, not each other."""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from specjax.config.draft_tree import TreeShape
from specjax.engine.draft_tree import DraftTree
from specjax.engine.state import RowParams


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TargetPass:
    """What one target pass (prefill or verify) computed, for proposers that read the target's hidden states:
    T tokens per row at positions start[b] .. start[b]+T-1, of which the committed ones are valid."""
    hidden: jax.Array            # [B, T, H] final-normed hidden states
    captured: jax.Array | None   # [B, T, n*H] residual stream entering each of the proposer's capture_layers
    start: jax.Array             # i32 [B]


class Proposer(Protocol):
    k: int
    catch_up_slots: int   # slots past the committed end catch_up may write (spare_slots)
    # Target layers whose entering residual stream `observe` needs (EAGLE-3); () for none.
    capture_layers: tuple[int, ...]
    tree: TreeShape | None   # a draft tree's shape (k its depth): the loop then calls propose_tree

    def cache_bytes(self, batch: int, max_len: int) -> int:
        """Bytes one device holds of the proposer's own caches for `batch` rows of `max_len` slots (the
        memory check counts them with the target's)."""

    def init(self, draft_state: Any, prompt_tokens: jax.Array, prompt_lengths: jax.Array, cache_len: int) -> Any:
        """The proposer's carry after the prompt (e.g. the draft model's prefilled KV cache)."""

    def propose(self, draft_state: Any, carry: Any, tokens: jax.Array, lengths: jax.Array,
                rows: RowParams) -> tuple[jax.Array, jax.Array | None, Any]:
        """Drafts [B, k] (-1 = none) following tokens[b, :lengths[b]], their probs [B, k, V] or None when
        the drafts are deterministic, and the new carry."""

    def propose_tree(self, draft_state: Any, carry: Any, tokens: jax.Array, lengths: jax.Array,
                     rows: RowParams) -> tuple[DraftTree, jax.Array | None, Any]:
        """A draft tree of tree.nodes nodes following tokens[b, :lengths[b]], each node's draft distribution
        [B, N, V] (None: deterministic drafts) and the new carry (proposers with a `tree` only)."""

    def observe(self, draft_state: Any, carry: Any, target: TargetPass, tokens: jax.Array, lengths: jax.Array,
                rows: RowParams) -> Any:
        """The carry after a target pass whose tokens were committed up to lengths[b] (called after prefill
        and after each verify)."""

    # Adaptive speculation (engine/adaptive.py) runs tiers of fewer drafts, down to plain decode steps.
    def with_k(self, k: int) -> Proposer:
        """The same proposer drafting k tokens (1 <= k <= self.k) over the same carry."""

    def skipped(self, draft_state: Any, carry: Any, target: TargetPass, tokens: jax.Array, lengths: jax.Array,
                rows: RowParams) -> Any:
        """The carry after a plain decode step that ran no proposer: only what must be kept for catch_up,
        no drafting work."""

    def catch_up(self, draft_state: Any, carry: Any, tokens: jax.Array, lengths: jax.Array,
                 rows: RowParams, drafting: jax.Array | bool = True) -> Any:
        """The carry brought up to the committed tokens after plain steps, before a propose; left as it is
        where `drafting` is false (the tier about to run drafts nothing)."""


def spare_slots(proposer: Proposer) -> int:
    """Slots a wave's buffers keep past the longest row's committed end: a verify pass's drafts (a tree's
    nodes), or what a catch-up pass or a tree's drafting writes, whichever is more."""
    tree = proposer.tree
    return max(proposer.k, proposer.catch_up_slots, 0 if tree is None else max(tree.nodes, tree.drafting_slots))


class Drafting:
    """What most proposers share of the adaptive protocol: k is an attribute, and the carry needs nothing kept
    across plain steps (n-gram reads the committed tokens; a draft model overrides catch_up)."""
    # Slots past a row's committed end that catch_up may write (the buffer keeps that many spare).
    catch_up_slots = 0
    tree: TreeShape | None = None

    def with_k(self, k: int):
        clone = copy.copy(self)
        clone.k = k
        return clone

    def skipped(self, draft_state, carry, target, tokens, lengths, rows):
        return carry

    def catch_up(self, draft_state, carry, tokens, lengths, rows, drafting=True):
        return carry


class IgnoresTarget(Drafting):
    """For proposers that draft without the target's hidden states."""
    capture_layers: tuple[int, ...] = ()

    def observe(self, draft_state, carry, target, tokens, lengths, rows):
        return carry


class Stateless(IgnoresTarget):
    """For proposers that keep no carry and no cache."""

    def init(self, draft_state, prompt_tokens, prompt_lengths, cache_len):
        return None

    def cache_bytes(self, batch: int, max_len: int) -> int:
        return 0


class NoProposer(Stateless):
    """k = 0: the loop is plain autoregressive decoding."""
    k = 0

    def propose(self, draft_state, carry, tokens, lengths, rows):
        return jnp.zeros((tokens.shape[0], 0), jnp.int32), None, carry
