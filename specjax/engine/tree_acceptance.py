"""Verification of a draft tree against the target: the longest accepted root-to-node path, exact.

- greedy rows accept the longest path whose every token is the target's argmax at its parent, found at once for
  every node (its ancestors all correct) and then the deepest such node (siblings are distinct, so the correct
  nodes form one path), emitting the argmax there;
- random rows walk from the root, vectorised over rows: at the current node its children are tried in order
  (verify index); a child accepted becomes the current node, a child rejected hands the test to its next sibling,
  and when no child is left the walk ends and emits the target's own token there. The test is recursive
  rejection sampling over the siblings (SpecInfer; Jeon et al. 2024 for drafts
  drawn without replacement): child x, drawn from q, is accepted with probability min(1, p(x) / q(x)); a
  rejection replaces p by max(p - q, 0) renormalised and removes x from q (q renormalised) for the next
  sibling; when the children run out, the token is drawn from what is left of p. A deterministic drafter's q is
  one-hot (its distinct children are drafts without replacement): a rejected child's token is just taken out of
  p. Each step preserves the target distribution, so the emitted tokens follow p exactly.
Each node is tested at most once, so the walk has N steps (a loop of greedy rows runs none).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.engine.draft_tree import NO_NODE, DraftTree
from specjax.engine.sampling import (RECOVER, SAMPLE, TREE_ACCEPT, is_greedy, processed_probs, row_key,
                                     sample_from_probs, uniform)
from specjax.kernels.policy import KernelPolicy


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _Walk:
    current: jax.Array    # i32 [B]: verify index of the deepest accepted node (0 = root)
    candidate: jax.Array  # i32 [B]: the node (0-based) tested next, -1 when the current node has none left
    accepted: jax.Array   # i32 [B]
    path: jax.Array       # i32 [B, D]: verify indices of the accepted nodes, by depth (0 past `accepted`)
    rejected: jax.Array   # bool [B]: a child of the current node was rejected
    p: jax.Array          # f32 [B, V]: the target distribution left at the current node
    q: jax.Array | None   # f32 [B, V]: the draft distribution left for the candidate (probabilistic drafts)


def accept_tree(target_logits: jax.Array, tree: DraftTree, draft_probs: jax.Array | None, max_depth: int,
                temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array, seed: jax.Array,
                position: jax.Array, greedy_only: bool = False,
                kernels: KernelPolicy = KernelPolicy()) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Verify a tree of N nodes; return (out tokens [B, max_depth + 1], accepted counts [B], path [B, max_depth]).

    target_logits [B, N+1, V]: the target's logits at the root and at each node. draft_probs [B, N, V]: the q
    node j was drawn from (its parent's, shared by its siblings), or None for deterministic drafts. max_depth
    (static) bounds the tree's depth. position [B]: the absolute position of the first emitted token.
    out holds the accepted path's tokens, then the target's token, then -1; path the accepted nodes' verify
    indices (the target's KV and hidden states to keep), 0 past the accepted count.
    """
    B, N = tree.tokens.shape
    vocab = target_logits.shape[-1]
    valid = (tree.tokens >= 0) & (tree.tokens < vocab)
    tokens = jnp.where(valid, tree.tokens, 0)
    argmax = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)                  # [B, N+1]
    path, accepted = _argmax_path(tree, valid, tokens, argmax, max_depth)
    last = jnp.take_along_axis(argmax, _deepest(path, accepted)[:, None], axis=1)[:, 0]
    if not greedy_only:
        greedy = is_greedy(temperature)
        target_probs = processed_probs(target_logits, temperature, top_k, top_p, min_p, kernels)
        walk = _walk(tree, valid, tokens, target_probs, draft_probs, max_depth, seed, position)
        keys = row_key(seed, position + walk.accepted, jnp.where(walk.rejected, RECOVER, SAMPLE))
        path = jnp.where(greedy[:, None], path, walk.path)
        accepted = jnp.where(greedy, accepted, walk.accepted)
        last = jnp.where(greedy, last, sample_from_probs(walk.p, keys))
    return _emit(tokens, path, accepted, last, max_depth), accepted, path


def _argmax_path(tree: DraftTree, valid: jax.Array, tokens: jax.Array, argmax: jax.Array,
                 max_depth: int) -> tuple[jax.Array, jax.Array]:
    """(path [B, max_depth], accepted [B]) of greedy verification: the deepest node whose ancestors and itself
    are each the argmax at their parent (the first such by index, should siblings repeat a token)."""
    correct = valid & (tokens == jnp.take_along_axis(argmax, tree.parents, axis=1))
    ok = jnp.concatenate([jnp.ones_like(correct[:, :1]), correct], axis=1)             # the root is
    anc = tree.ancestry(max_depth)
    on_path = ~jnp.any(anc & ~ok[:, None, :], axis=-1)                                  # [B, N+1]
    depth = jnp.concatenate([jnp.zeros_like(tree.depth[:, :1]), tree.depth], axis=1)
    reach = jnp.where(on_path, depth, -1)
    accepted = jnp.max(reach, axis=1).astype(jnp.int32)
    best = jnp.argmax(reach == accepted[:, None], axis=1)
    best_anc = jnp.take_along_axis(anc, best[:, None, None], axis=1)[:, 0]               # [B, N+1]
    at_depth = best_anc[:, None, :] & (depth[:, None, :] == jnp.arange(1, max_depth + 1)[None, :, None])
    path = jnp.where(jnp.any(at_depth, axis=-1), jnp.argmax(at_depth, axis=-1), 0).astype(jnp.int32)
    return path, accepted


def _deepest(path: jax.Array, accepted: jax.Array) -> jax.Array:
    """The verify index the accepted path ends at (0: the root)."""
    return jnp.where(accepted > 0, jnp.take_along_axis(path, jnp.maximum(accepted - 1, 0)[:, None], axis=1)[:, 0], 0)


def _walk(tree: DraftTree, valid: jax.Array, tokens: jax.Array, target_probs: jax.Array,
          draft_probs: jax.Array | None, max_depth: int, seed: jax.Array, position: jax.Array) -> _Walk:
    """Recursive rejection sampling down the tree (the module docstring), every row as a random one."""
    B, N = tree.tokens.shape
    vocab = target_probs.shape[-1]
    first_child, next_sibling = _links(tree.parents, valid)
    rows = jnp.arange(B)
    u = uniform(row_key(seed, position[:, None] + tree.depth - 1, TREE_ACCEPT + jnp.arange(N)[None, :]))

    def draft_q(node):
        return None if draft_probs is None else draft_probs[rows, jnp.maximum(node, 0)].astype(jnp.float32)

    def test(walk: _Walk, _) -> tuple[_Walk, None]:
        live = walk.candidate >= 0
        node = jnp.maximum(walk.candidate, 0)
        x = tokens[rows, node]
        p_x = walk.p[rows, x]
        q_x = jnp.ones_like(p_x) if walk.q is None else walk.q[rows, x]
        ok = (q_x > 0) & ((1.0 - u[rows, node]) * q_x <= p_x)
        accept, reject = live & ok, live & ~ok
        moved = jnp.where(accept, node + 1, walk.current)
        nxt = jnp.where(accept, first_child[rows, moved], jnp.where(reject, next_sibling[rows, node], walk.candidate))
        depth_slot = jax.nn.one_hot(walk.accepted, max_depth, dtype=bool) & accept[:, None]
        q_old = jax.nn.one_hot(x, vocab, dtype=jnp.float32) if walk.q is None else walk.q
        p = jnp.where(accept[:, None], target_probs[rows, moved],
                      jnp.where(reject[:, None], _residual(walk.p, q_old), walk.p))
        q = walk.q
        if q is not None:
            without_x = _renormalised(q.at[rows, x].set(0.0))
            q = jnp.where(accept[:, None], draft_q(nxt), jnp.where(reject[:, None], without_x, q))
        return _Walk(current=moved, candidate=nxt, accepted=walk.accepted + accept,
                     path=jnp.where(depth_slot, node[:, None] + 1, walk.path),
                     rejected=jnp.where(accept, False, walk.rejected | reject), p=p, q=q), None

    start = first_child[:, 0]
    walk = _Walk(current=jnp.zeros((B,), jnp.int32), candidate=start, accepted=jnp.zeros((B,), jnp.int32),
                 path=jnp.zeros((B, max_depth), jnp.int32), rejected=jnp.zeros((B,), bool),
                 p=target_probs[:, 0], q=draft_q(start))
    walk, _ = jax.lax.scan(test, walk, None, length=N)
    return walk


def _links(parents: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(first_child [B, N+1]: each verify index's first valid child node, next_sibling [B, N]: each node's next
    valid sibling node), -1 where there is none."""
    N = parents.shape[1]
    nodes = jnp.arange(N)
    is_child = (parents[:, None, :] == jnp.arange(N + 1)[None, :, None]) & valid[:, None, :]       # [B, N+1, N]
    later_sibling = ((parents[:, None, :] == parents[:, :, None]) & valid[:, None, :]
                     & (nodes[None, None, :] > nodes[None, :, None]))                               # [B, N, N]

    def first(mask):
        return jnp.where(jnp.any(mask, axis=-1), jnp.argmax(mask, axis=-1), NO_NODE).astype(jnp.int32)

    return first(is_child), first(later_sibling)


def _renormalised(p: jax.Array) -> jax.Array:
    total = jnp.sum(p, axis=-1, keepdims=True)
    return jnp.where(total > 0, p / jnp.where(total > 0, total, 1.0), p)


def _residual(p: jax.Array, q: jax.Array) -> jax.Array:
    """max(p - q, 0) renormalised; p itself where nothing is left."""
    left = jnp.maximum(p - q, 0.0)
    return jnp.where(jnp.sum(left, axis=-1, keepdims=True) > 0, _renormalised(left), p)


def _emit(tokens: jax.Array, path: jax.Array, accepted: jax.Array, last: jax.Array, max_depth: int) -> jax.Array:
    """[B, max_depth + 1]: the accepted nodes' tokens, the target's token at slot `accepted`, then -1."""
    path_tokens = jnp.take_along_axis(tokens, jnp.maximum(path - 1, 0), axis=1)
    slots = jnp.arange(max_depth + 1)[None, :]
    padded = jnp.concatenate([path_tokens, jnp.zeros_like(path_tokens[:, :1])], axis=1)
    out = jnp.where(slots < accepted[:, None], padded, NO_NODE)
    return jnp.where(slots == accepted[:, None], last[:, None], out).astype(jnp.int32)
