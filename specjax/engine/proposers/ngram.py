"""N-gram (prompt lookup) drafting, on device: copy what followed an earlier occurrence
of the row's own suffix.

vLLM's rule: take the longest n in [min_n, max_n] whose last-n-token suffix occurs
earlier in the committed tokens (an occurrence may overlap the suffix but must end
before the last token); among occurrences of that n the earliest wins; propose up to
k tokens that followed it, fewer when the committed tokens end first.

Vectorised with static shapes: for each offset s < max_n one [B, S] comparison of the
buffer shifted by s against the suffix token s from the end; a running AND gives, for
every end index e, whether the n tokens ending at e equal the suffix. O(B * S * max_n).

With a draft tree, the earliest `branching` occurrences of that longest suffix each give a continuation, and
their trie is the tree (shared prefixes merged).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.config.draft_tree import TreeShape
from specjax.engine.draft_tree import from_chains
from specjax.engine.proposers.base import Stateless

NO_DRAFT = -1


class NgramProposer(Stateless):
    """Prompt lookup: drafts from the row's own committed tokens (q one-hot)."""

    def __init__(self, k: int, min_n: int, max_n: int, tree: TreeShape | None = None):
        _check_static(k, min_n, max_n)
        self.k, self.min_n, self.max_n, self.tree = k, min_n, max_n, tree

    def propose(self, draft_state, carry, tokens, lengths, rows):
        return propose_ngram(tokens, lengths, self.k, self.min_n, self.max_n), None, carry

    def propose_tree(self, draft_state, carry, tokens, lengths, rows):
        chains = propose_ngram_continuations(tokens, lengths, self.k, self.tree.branching, self.min_n, self.max_n)
        return from_chains(chains, self.tree.nodes), None, carry


def _check_static(k: int, min_n: int, max_n: int) -> None:
    if k < 1:
        raise ValueError(f"ngram proposer: k (num_speculative_tokens) must be >= 1, got {k}")
    if min_n < 1 or max_n < min_n:
        raise ValueError(
            f"ngram proposer: need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
            f"min={min_n}, max={max_n}")


def _suffix_tokens(tokens: jax.Array, lengths: jax.Array, max_n: int) -> jax.Array:
    """[B, max_n]: entry s is the token s places before the end (index length-1-s)."""
    index = jnp.maximum(lengths[:, None] - 1 - jnp.arange(max_n)[None, :], 0)
    return jnp.take_along_axis(tokens, index, axis=1)


def _shifted_right(tokens: jax.Array, shift: int) -> jax.Array:
    """out[:, e] = tokens[:, e - shift]; the first `shift` columns are -1 (never a token)."""
    if shift == 0:
        return tokens
    pad = jnp.full((tokens.shape[0], shift), NO_DRAFT, tokens.dtype)
    return jnp.concatenate([pad, tokens[:, :-shift]], axis=1)


def _longest_suffix_matches(tokens: jax.Array, lengths: jax.Array, min_n: int, max_n: int) -> jax.Array:
    """bool [B, S]: the end indices of the occurrences of the longest suffix (n in [min_n, max_n]) that occurs
    earlier; all False when none does."""
    seq = tokens.shape[1]
    suffix = _suffix_tokens(tokens, lengths, max_n)
    ends = jnp.arange(seq)[None, :]
    # An occurrence must end before the last committed token (that one is the suffix).
    before_last = ends <= lengths[:, None] - 2
    matches_so_far = jnp.ones(tokens.shape, bool)
    longest = jnp.zeros(tokens.shape, bool)
    for n in range(1, max_n + 1):
        shifted = _shifted_right(tokens, n - 1)
        matches_so_far = matches_so_far & (shifted == suffix[:, n - 1:n])
        if n < min_n:
            continue
        candidates = matches_so_far & before_last & (ends >= n - 1)
        # Larger n are visited later, so the longest matching n wins.
        longest = jnp.where(jnp.any(candidates, axis=1, keepdims=True), candidates, longest)
    return longest


def _continuations(tokens: jax.Array, lengths: jax.Array, found: jax.Array, end: jax.Array, k: int) -> jax.Array:
    """[..., k]: the k tokens after each match end [B, ...] that the committed tokens hold, -1 elsewhere."""
    follow = end[..., None] + 1 + jnp.arange(k, dtype=jnp.int32)
    usable = found[..., None] & (follow < lengths.reshape(lengths.shape + (1,) * (follow.ndim - 1)))
    flat = jnp.minimum(follow, tokens.shape[1] - 1).reshape(tokens.shape[0], -1)
    proposed = jnp.take_along_axis(tokens, flat, axis=1).reshape(follow.shape)
    return jnp.where(usable, proposed, NO_DRAFT).astype(jnp.int32)


def propose_ngram(tokens: jax.Array, lengths: jax.Array, k: int, min_n: int,
                  max_n: int) -> jax.Array:
    """Drafts [B, k] int32 (-1 = none) from each row's committed tokens[:length].

    tokens: int32 [B, S] (entries at or beyond a row's length are ignored);
    lengths: int32 [B]; k, min_n, max_n: static Python ints.
    """
    _check_static(k, min_n, max_n)
    tokens = jnp.asarray(tokens, jnp.int32)
    lengths = jnp.asarray(lengths, jnp.int32)
    matches = _longest_suffix_matches(tokens, lengths, min_n, max_n)
    end = jnp.argmax(matches, axis=1).astype(jnp.int32)
    return _continuations(tokens, lengths, jnp.any(matches, axis=1), end, k)


def propose_ngram_continuations(tokens: jax.Array, lengths: jax.Array, k: int, count: int, min_n: int,
                                max_n: int) -> jax.Array:
    """[B, count, k]: what followed each of the `count` earliest occurrences of the longest suffix (the first
    is propose_ngram's drafts); -1 where there are fewer occurrences or tokens."""
    _check_static(k, min_n, max_n)
    tokens = jnp.asarray(tokens, jnp.int32)
    lengths = jnp.asarray(lengths, jnp.int32)
    matches = _longest_suffix_matches(tokens, lengths, min_n, max_n)
    index = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
    score, _ = jax.lax.top_k(jnp.where(matches, -index, -tokens.shape[1]), min(count, tokens.shape[1]))
    found, end = score > -tokens.shape[1], -score
    chains = _continuations(tokens, lengths, found, end, k)
    missing = count - chains.shape[1]
    return jnp.pad(chains, ((0, 0), (0, missing), (0, 0)), constant_values=NO_DRAFT) if missing else chains
