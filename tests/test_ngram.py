"""N-gram proposer: vLLM's cases, batches of mixed lengths, and a brute-force reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.engine.proposers.ngram import propose_ngram

BUFFER = 32
GARBAGE = 99


def _propose_one(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Drafts for one row, padded in the buffer with garbage that must be ignored."""
    buffer = np.full((1, BUFFER), GARBAGE, np.int32)
    buffer[0, :len(tokens)] = tokens
    drafts = propose_ngram(jnp.asarray(buffer), jnp.array([len(tokens)], jnp.int32), k, min_n, max_n)
    return [t for t in np.asarray(drafts)[0].tolist() if t != -1]


def reference(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """vLLM's rule by brute force: longest n first, earliest occurrence ending before the
    last token, up to k following tokens that are committed."""
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= length:
            continue
        suffix = tokens[length - n:]
        for start in range(0, length - n):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


VLLM_CASES = [
    # (tokens, min_n, max_n, k, expected) from vLLM's test_ngram.py
    ([1, 2, 3, 4, 1, 2, 3, 5, 6], 2, 2, 2, []),
    ([1, 2, 3, 4, 1, 2, 3], 2, 2, 3, [4, 1, 2]),
    ([1, 2, 3, 4, 1, 2, 3], 2, 2, 2, [4, 1]),
    ([1, 2, 3, 4, 1, 2, 3], 1, 1, 3, [4, 1, 2]),
    ([1, 2, 3, 4, 1, 2, 3], 1, 1, 2, [4, 1]),
    ([1, 3, 6, 2, 3, 4, 1, 2, 3], 2, 2, 3, [4, 1, 2]),
    ([1, 3, 6, 2, 3, 4, 1, 2, 3], 1, 1, 2, [6, 2]),  # the first match wins
    ([1, 2, 3, 4, 5], 2, 2, 2, []),  # no match
    ([1, 2, 3, 4, 1, 2, 3], 4, 4, 2, []),  # no 4-gram
    ([1, 2, 3, 4, 1, 2, 3], 3, 4, 2, [4, 1]),  # 3-gram when no 4-gram
    ([2, 3, 4, 5, 1, 2, 3, 4, 1, 2, 3, 4], 3, 4, 2, [1, 2]),  # the 4-gram, not [5, 1]
    ([3, 4, 5, 2, 3, 4, 1, 2, 3, 4], 2, 4, 2, [1, 2]),  # the 3-gram, not [5, 2]
    ([1, 2, 3, 100, 1, 2, 3, 200, 1, 2, 3, 300, 1, 2, 3], 3, 3, 2, [100, 1]),  # earliest
    ([1, 2, 3, 4, 2, 3], 2, 3, 4, [4, 2, 3]),  # vLLM docstring: only 3 tokens follow
]


@pytest.mark.parametrize("tokens,min_n,max_n,k,expected", VLLM_CASES)
def test_vllm_cases(tokens, min_n, max_n, k, expected):
    assert _propose_one(tokens, min_n, max_n, k) == expected
    assert reference(tokens, min_n, max_n, k) == expected


def test_continuation_is_cut_at_the_committed_end():
    drafts = propose_ngram(jnp.array([[7, 7, 7, 7, 5, 5, 5]], jnp.int32), jnp.array([3]), 4, 1, 2)
    # suffix [7, 7] first occurs at 0 (overlapping the suffix), followed by one committed 7.
    np.testing.assert_array_equal(np.asarray(drafts), [[7, -1, -1, -1]])


def test_short_rows_propose_nothing():
    tokens = jnp.array([[4, 4, 4], [4, 4, 4], [4, 4, 4]], jnp.int32)
    drafts = propose_ngram(tokens, jnp.array([0, 1, 2]), 2, 1, 3)
    np.testing.assert_array_equal(np.asarray(drafts), [[-1, -1], [-1, -1], [4, -1]])


def test_batch_rows_with_different_lengths_match_reference():
    rng = np.random.default_rng(0)
    batch, seq = 64, 48
    lengths = rng.integers(0, seq + 1, size=batch)
    tokens = rng.integers(0, 4, size=(batch, seq)).astype(np.int32)
    # Beyond each row's length: a copy of its suffix, which would match if it were read.
    for b in range(batch):
        tail = tokens[b, max(lengths[b] - 3, 0):lengths[b]]
        tokens[b, lengths[b]:lengths[b] + tail.size] = tail[:seq - lengths[b]]
    for min_n, max_n, k in ((1, 1, 3), (2, 4, 5), (3, 5, 2)):
        drafts = np.asarray(jax.jit(propose_ngram, static_argnums=(2, 3, 4))(
            jnp.asarray(tokens), jnp.asarray(lengths, jnp.int32), k, min_n, max_n))
        for b in range(batch):
            want = reference(tokens[b, :lengths[b]].tolist(), min_n, max_n, k)
            assert drafts[b].tolist() == want + [-1] * (k - len(want)), (b, min_n, max_n)
        assert np.any(drafts >= 0) and np.any(drafts[:, 0] == -1)


@pytest.mark.parametrize("k,min_n,max_n", [(0, 1, 2), (2, 0, 2), (2, 3, 2)])
def test_bad_static_arguments_raise(k, min_n, max_n):
    with pytest.raises(ValueError):
        propose_ngram(jnp.zeros((1, 8), jnp.int32), jnp.array([4]), k, min_n, max_n)
