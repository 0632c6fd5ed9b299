"""N-gram (prompt lookup) drafting, on device: copy what followed an earlier occurrence
of the row's own suffix.

vLLM's rule: take the longest n in [min_n, max_n] whose last-n-token suffix occurs
earlier in the committed tokens (an occurrence may overlap the suffix but must end
before the last token); among occurrences of that n the earliest wins; propose up to
k tokens that followed it, fewer when the committed tokens end first.

Vectorised with static shapes: for each offset s < max_n one [B, S] comparison of the
buffer shifted by s against the suffix token s from the end; a running AND gives, for
every end index e, whether the n tokens ending at e equal the suffix. O(B * S * max_n).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.engine.proposers.base import Stateless

NO_DRAFT = -1


class NgramProposer(Stateless):
    """Prompt lookup: drafts from the row's own committed tokens (q one-hot)."""

    def __init__(self, k: int, min_n: int, max_n: int):
        _check_static(k, min_n, max_n)
        self.k, self.min_n, self.max_n = k, min_n, max_n

    def propose(self, draft_state, carry, tokens, lengths, rows):
        return propose_ngram(tokens, lengths, self.k, self.min_n, self.max_n), None, carry


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


def _earliest_match_end(tokens: jax.Array, lengths: jax.Array, min_n: int,
                        max_n: int) -> tuple[jax.Array, jax.Array]:
    """(found [B], end [B]): end index of the earliest occurrence of the longest suffix."""
    seq = tokens.shape[1]
    suffix = _suffix_tokens(tokens, lengths, max_n)
    ends = jnp.arange(seq)[None, :]
    # An occurrence must end before the last committed token (that one is the suffix).
    before_last = ends <= lengths[:, None] - 2
    matches_so_far = jnp.ones(tokens.shape, bool)
    found = jnp.zeros(tokens.shape[0], bool)
    end = jnp.zeros(tokens.shape[0], jnp.int32)
    for n in range(1, max_n + 1):
        shifted = _shifted_right(tokens, n - 1)
        matches_so_far = matches_so_far & (shifted == suffix[:, n - 1:n])
        if n < min_n:
            continue
        candidates = matches_so_far & before_last & (ends >= n - 1)
        has_n = jnp.any(candidates, axis=1)
        # Larger n are visited later, so the longest matching n wins.
        end = jnp.where(has_n, jnp.argmax(candidates, axis=1).astype(jnp.int32), end)
        found = found | has_n
    return found, end


def propose_ngram(tokens: jax.Array, lengths: jax.Array, k: int, min_n: int,
                  max_n: int) -> jax.Array:
    """Drafts [B, k] int32 (-1 = none) from each row's committed tokens[:length].

    tokens: int32 [B, S] (entries at or beyond a row's length are ignored);
    lengths: int32 [B]; k, min_n, max_n: static Python ints.
    """
    _check_static(k, min_n, max_n)
    tokens = jnp.asarray(tokens, jnp.int32)
    lengths = jnp.asarray(lengths, jnp.int32)
    found, end = _earliest_match_end(tokens, lengths, min_n, max_n)
    follow = end[:, None] + 1 + jnp.arange(k, dtype=jnp.int32)[None, :]
    usable = found[:, None] & (follow < lengths[:, None])
    proposed = jnp.take_along_axis(tokens, jnp.minimum(follow, tokens.shape[1] - 1), axis=1)
    return jnp.where(usable, proposed, NO_DRAFT).astype(jnp.int32)
