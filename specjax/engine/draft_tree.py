"""Draft trees with a static node budget: how proposers build them and how the target's pass reads them.

A tree of N nodes hangs under the row's last committed token (the root, verify index 0); node j is verify index
j + 1, and its parent's verify index is smaller (nodes come in topological order), so one target pass over the
N + 1 tokens, each seeing its ancestors (kernels/tree_mask.py), scores every node. A token of -1 is no node.
A chain of k drafts is the tree whose node j has parent j.

Two builders: `grow` (EAGLE-2's dynamic tree, for a drafter that scores continuations: expand the best
`branching` nodes of each level by cumulative log-probability with their best `branching` children, then keep the
best N of everything drafted) and `from_chains` (a trie of several continuations, as n-gram lookup finds them).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from specjax.kernels.tree_mask import TreeMask

NO_NODE = -1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftTree:
    tokens: jax.Array    # i32 [B, N], -1 = no node
    parents: jax.Array   # i32 [B, N]: the parent's verify index (0 = the root), below j + 1
    depth: jax.Array     # i32 [B, N]: 1 for the root's children

    def within(self, max_depth: jax.Array) -> DraftTree:
        """The tree without nodes deeper than max_depth [B] (a row's budget); their subtrees go with them."""
        return dataclasses.replace(self, tokens=jnp.where(self.depth <= max_depth[:, None], self.tokens, NO_NODE))

    def ancestry(self, depth: int) -> jax.Array:
        """bool [B, N+1, N+1]: entry [i, j] says verify index j is i or an ancestor of i (the root is everyone's),
        for a tree no deeper than `depth` (static): that many parent hops from every node at once."""
        B, N = self.tokens.shape
        up = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), self.parents], axis=1)   # the root is its own parent
        node = jnp.broadcast_to(jnp.arange(N + 1, dtype=jnp.int32), (B, N + 1))
        anc = jax.nn.one_hot(node, N + 1, dtype=bool)
        for _ in range(depth):
            node = jnp.take_along_axis(up, node, axis=1)
            anc = anc | jax.nn.one_hot(node, N + 1, dtype=bool)
        return anc

    def verify_mask(self, start: jax.Array, depth: int) -> TreeMask:
        """The target pass's mask: root at slot and position start[b], node j at slot start + j + 1 and
        position start + its depth, seeing its ancestors (a tree no deeper than `depth`)."""
        depths = jnp.concatenate([jnp.zeros_like(self.depth[:, :1]), self.depth], axis=1)
        return TreeMask(positions=start[:, None] + depths, region_start=start, visible=self.ancestry(depth))


def chain(drafts: jax.Array) -> DraftTree:
    """k drafts [B, k] as the tree of one child per node."""
    B, k = drafts.shape
    steps = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (B, k))
    return DraftTree(tokens=drafts, parents=steps, depth=steps + 1)


def from_chains(chains: jax.Array, nodes: int) -> DraftTree:
    """The trie of M continuations [B, M, D] (-1 ends one), its first `nodes` nodes in depth-major order: node
    (d, m) is continuation m's token d unless an earlier continuation shares its first d + 1 tokens."""
    B, M, D = chains.shape
    equal = chains[:, :, None, :] == chains[:, None, :, :]                    # [B, m, m', d]
    same_prefix = jnp.cumprod(equal, axis=3).astype(bool)
    first_owner = jnp.argmax(same_prefix, axis=2).astype(jnp.int32)          # [B, m, d]: smallest m' sharing it
    own = (first_owner == jnp.arange(M)[None, :, None]) & (chains >= 0)
    verify_index = jnp.arange(D)[None, None, :] * M + first_owner + 1        # of (d, first_owner)
    parent = jnp.concatenate([jnp.zeros((B, M, 1), jnp.int32), verify_index[:, :, :-1]], axis=2)
    depth = jnp.broadcast_to(jnp.arange(1, D + 1, dtype=jnp.int32)[None, None, :], (B, M, D))

    def depth_major(x):
        return jnp.swapaxes(x, 1, 2).reshape(B, M * D)[:, :nodes]

    return DraftTree(tokens=depth_major(jnp.where(own, chains, NO_NODE)), parents=depth_major(parent),
                     depth=depth_major(depth))


# step(level, carry, tokens [B, b], states [B, b, ...], visible [B, b, R]) -> (logits [B, b, V], the children's
# states, carry): run the frontier of `level` (its nodes at depth level) through the drafter, each node seeing the
# frontier slots of earlier levels its `visible` row marks (level l's nodes at region slots (l-1)*b ..).
GrowStep = Callable[[int, Any, jax.Array, Any, jax.Array], tuple[jax.Array, Any, Any]]


def grow(root_logits: jax.Array, root_state: Any, step: GrowStep, carry: Any, *, depth: int, branching: int,
         nodes: int, token_ids: Callable[[jax.Array], jax.Array] = lambda ids: ids) -> tuple[DraftTree, Any]:
    """EAGLE-2's tree from the drafter's logits at the root [B, V] and its state there ([B, ...], what the root's
    children are run with). `token_ids` maps the drafter's vocabulary to the target's. Returns the best `nodes`
    of the b + (depth - 1) * b * b drafted nodes (config/draft_tree.py TreeShape.drafted) and the step's final
    carry."""
    b = branching
    B = root_logits.shape[0]
    region = (depth - 1) * b
    score, token = _best_children(root_logits, b)
    pool = _Pool(tokens=[token], scores=[score], parents=[jnp.full((B, b), -1, jnp.int32)],
                 depths=[jnp.ones((B, b), jnp.int32)])
    frontier = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32), (B, b))     # pool indices
    states = jax.tree.map(lambda s: jnp.repeat(s[:, None], b, axis=1), root_state)
    visible = jax.nn.one_hot(jnp.arange(b), region, dtype=bool)[None].repeat(B, 0) if region else None
    size = b
    for level in range(1, depth):
        logits, child_states, carry = step(level, carry, token_ids(token), states, visible)
        child_score, child_token = _best_children(logits, b)                # [B, b, b]
        child_score = child_score + score[:, :, None]
        pool.add(child_token.reshape(B, b * b), child_score.reshape(B, b * b),
                 jnp.repeat(frontier, b, axis=1), level + 1)
        score, best = jax.lax.top_k(child_score.reshape(B, b * b), b)
        parent = best // b
        token = jnp.take_along_axis(child_token.reshape(B, b * b), best, axis=1)
        frontier = size + best
        size += b * b
        if level + 1 < depth:
            states = jax.tree.map(lambda s: jnp.take_along_axis(s, parent.reshape(parent.shape + (1,) * (s.ndim - 2)),
                                                                axis=1), child_states)
            own_slot = jax.nn.one_hot(level * b + jnp.arange(b), region, dtype=bool)[None]
            visible = jnp.take_along_axis(visible, parent[:, :, None], axis=1) | own_slot
    return pool.best(nodes, token_ids), carry


def _best_children(logits: jax.Array, b: int) -> tuple[jax.Array, jax.Array]:
    """The b most probable tokens of logits [..., V] and their log-probabilities (top-k of the logits less their
    log-sum-exp: no V-sized log-softmax is written)."""
    best, token = jax.lax.top_k(logits.astype(jnp.float32), b)
    return best - jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1, keepdims=True), token


@dataclasses.dataclass
class _Pool:
    """Every node `grow` drafted, in creation order (a parent before its children)."""
    tokens: list
    scores: list
    parents: list      # pool index, -1 = the root
    depths: list

    def add(self, tokens, scores, parents, depth: int):
        self.tokens.append(tokens)
        self.scores.append(scores)
        self.parents.append(parents)
        self.depths.append(jnp.full(tokens.shape, depth, jnp.int32))

    def best(self, nodes: int, token_ids) -> DraftTree:
        """The `nodes` best by cumulative log-probability, in creation order. A child scores no higher than its
        parent and top_k prefers the lower index on ties, so a kept node's parent is kept."""
        tokens, scores, parents, depths = (jnp.concatenate(x, axis=1) for x in
                                           (self.tokens, self.scores, self.parents, self.depths))
        B, size = tokens.shape
        _, kept = jax.lax.top_k(scores, nodes)
        kept = jnp.sort(kept, axis=1)
        rank = jnp.zeros((B, size), jnp.int32).at[jnp.arange(B)[:, None], kept].set(jnp.arange(nodes, dtype=jnp.int32))
        parent = jnp.take_along_axis(parents, kept, axis=1)
        parent_index = jnp.where(parent < 0, 0, jnp.take_along_axis(rank, jnp.maximum(parent, 0), axis=1) + 1)
        return DraftTree(tokens=token_ids(jnp.take_along_axis(tokens, kept, axis=1)).astype(jnp.int32),
                         parents=parent_index.astype(jnp.int32), depth=jnp.take_along_axis(depths, kept, axis=1))
