"""Per-row sampling: vLLM's logits processors, counter-based keys, draws, logprobs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from chi_square import chi_square_p_value

from specjax.engine import sampling
from specjax.engine.sampling import (ACCEPT, SAMPLE, processed_probs, row_key, sample,
                                     token_logprobs, uniform)

V = 10


def reference_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float,
                    min_p: float) -> np.ndarray:
    """vLLM's sampler written out with numpy in float64, for one row."""
    logits = logits.astype(np.float64)
    if temperature < 1e-5:
        return np.eye(logits.size)[np.argmax(logits)]
    x = logits / temperature
    if min_p > 0:
        probs = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
        x = np.where(probs < min_p * probs.max(), -np.inf, x)
    if 0 < top_k < x.size:
        x = np.where(x < np.sort(x)[x.size - top_k], -np.inf, x)
    if top_p < 1:
        order = np.argsort(x)
        ordered = x[order]
        probs = np.exp(ordered - ordered.max()) / np.exp(ordered - ordered.max()).sum()
        drop = np.cumsum(probs) <= 1 - top_p
        drop[-1] = False
        x[order[drop]] = -np.inf
    return np.exp(x - x.max()) / np.exp(x - x.max()).sum()


# (temperature, top_k, top_p, min_p): every processor alone, combined, greedy, off.
PARAMS = [
    (1.0, 0, 1.0, 0.0),
    (0.7, 3, 1.0, 0.0),
    (1.3, 0, 0.6, 0.0),
    (1.0, 0, 1.0, 0.3),
    (0.8, 5, 0.8, 0.05),
    (0.0, 2, 0.5, 0.1),
    (2.0, -1, 0.9, 0.0),
]


def _param_arrays(params):
    temperature, top_k, top_p, min_p = zip(*params)
    return (jnp.array(temperature, jnp.float32), jnp.array(top_k, jnp.int32),
            jnp.array(top_p, jnp.float32), jnp.array(min_p, jnp.float32))


def _logits(seed: int, shape) -> jax.Array:
    return 2.0 * jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def test_processed_probs_match_vllm_reference():
    logits = _logits(0, (len(PARAMS), 50))
    probs = np.asarray(processed_probs(logits, *_param_arrays(PARAMS)))
    for row, params in enumerate(PARAMS):
        np.testing.assert_allclose(probs[row], reference_probs(np.asarray(logits[row]), *params),
                                   atol=1e-6, err_msg=str(params))


def test_processed_probs_without_sorting_filters():
    off = [(1.0, 0, 1.0, 0.0), (0.5, 0, 1.0, 0.2), (0.0, 0, 1.0, 0.0)]
    logits = _logits(1, (len(off), 50))
    probs = np.asarray(jax.jit(processed_probs)(logits, *_param_arrays(off)))
    for row, params in enumerate(off):
        np.testing.assert_allclose(probs[row], reference_probs(np.asarray(logits[row]), *params),
                                   atol=1e-6)


@pytest.mark.parametrize("top_k", [1, 2, 7, 19, 20, 0])
def test_top_k_keeps_every_token_tied_with_the_kth(top_k):
    """Integer logits (many ties), negative ones, a signed zero and masked (-inf) stop tokens."""
    logits = np.round(np.asarray(_logits(7, (3, 20))))
    logits[0, 3], logits[1, :4], logits[2, 5] = -0.0, -np.inf, -np.inf
    rows = len(logits)
    probs = np.asarray(processed_probs(jnp.asarray(logits, jnp.float32), jnp.ones(rows),
                                       jnp.full(rows, top_k, jnp.int32), jnp.ones(rows), jnp.zeros(rows)))
    for row in range(rows):
        kth = np.sort(logits[row])[::-1][top_k - 1] if top_k else -np.inf
        np.testing.assert_array_equal(probs[row] > 0, (logits[row] >= kth) & np.isfinite(logits[row]))


def test_top_p_on_negative_logits_matches_the_reference():
    logits = _logits(8, (4, 64)) - 30.0
    params = [(1.0, 0, 0.5, 0.0), (0.9, 0, 0.95, 0.0), (1.0, 10, 0.7, 0.0), (1.1, 0, 0.05, 0.0)]
    probs = np.asarray(processed_probs(logits, *_param_arrays(params)))
    for row, row_params in enumerate(params):
        np.testing.assert_allclose(probs[row], reference_probs(np.asarray(logits[row]), *row_params), atol=1e-6)


def test_processed_probs_broadcast_over_time_axis():
    logits = _logits(2, (len(PARAMS), 3, 20))
    probs = np.asarray(processed_probs(logits, *_param_arrays(PARAMS)))
    for row, params in enumerate(PARAMS):
        for t in range(3):
            np.testing.assert_allclose(
                probs[row, t], reference_probs(np.asarray(logits[row, t]), *params), atol=1e-6)


def test_greedy_takes_first_maximal_logit():
    logits = jnp.array([[0.0, 3.0, 1.0, 3.0], [5.0, 5.0, 5.0, 5.0]])
    params = _param_arrays([(0.0, 1, 0.1, 0.5), (0.0, 0, 1.0, 0.0)])
    tokens = sample(logits, *params, seed=jnp.array([3, 4]), position=jnp.array([0, 9]))
    np.testing.assert_array_equal(np.asarray(tokens), [1, 0])
    fast = sample(logits, *params, seed=jnp.array([3, 4]), position=jnp.array([0, 9]), greedy_only=True)
    np.testing.assert_array_equal(np.asarray(fast), [1, 0])
    probs = processed_probs(logits, *params)
    np.testing.assert_array_equal(np.asarray(probs), [[0, 1, 0, 0], [1, 0, 0, 0]])


def _draws(logits_row: jax.Array, params, num: int, position: int = 7) -> np.ndarray:
    """num draws of one row: the row repeated num times, seeds 0..num-1."""
    logits = jnp.broadcast_to(logits_row, (num,) + logits_row.shape)
    arrays = [jnp.full((num,), value) for value in _param_arrays([params])]
    seeds = jnp.arange(num, dtype=jnp.uint32)
    positions = jnp.full((num,), position, jnp.int32)
    return np.asarray(jax.jit(sample)(logits, *arrays, seeds, positions))


@pytest.mark.parametrize("params", [p for p in PARAMS if p[0] > 0], ids=str)
def test_draws_follow_processed_probs(params):
    logits_row = _logits(3, (V,))
    tokens = _draws(logits_row, params, 100_000)
    expected = reference_probs(np.asarray(logits_row), *params)
    assert np.all(expected[tokens] > 0), "a token excluded by the processors was drawn"
    assert chi_square_p_value(tokens, expected) > 1e-3


def test_chi_square_rejects_the_unprocessed_distribution():
    """The goodness-of-fit check has power: top-k draws do not fit the plain softmax."""
    logits_row = _logits(3, (V,))
    tokens = _draws(logits_row, (1.0, 4, 1.0, 0.0), 100_000)
    plain = reference_probs(np.asarray(logits_row), 1.0, 0, 1.0, 0.0)
    assert chi_square_p_value(tokens, plain) < 1e-6


@pytest.mark.parametrize("params", [(1.0, 2, 1.0, 0.0), (1.0, 0, 0.3, 0.0),
                                    (1.0, 0, 1.0, 0.5)], ids=str)
def test_filters_never_emit_excluded_tokens(params):
    logits_row = _logits(4, (100,))
    tokens = _draws(logits_row, params, 20_000)
    allowed = reference_probs(np.asarray(logits_row), *params) > 0
    assert allowed.sum() < 100
    assert np.all(allowed[tokens])


def test_same_seed_and_position_give_same_token():
    logits_row = _logits(5, (V,))
    first = _draws(logits_row, (1.0, 0, 1.0, 0.0), 2_000)
    again = _draws(logits_row, (1.0, 0, 1.0, 0.0), 2_000)
    elsewhere = _draws(logits_row, (1.0, 0, 1.0, 0.0), 2_000, position=8)
    np.testing.assert_array_equal(first, again)
    assert np.mean(first != elsewhere) > 0.2
    assert len(np.unique(first)) > 1


def test_row_draws_do_not_depend_on_batch_neighbours():
    logits = _logits(6, (4, V))
    params = _param_arrays([(1.0, 0, 1.0, 0.0), (0.5, 3, 0.9, 0.0), (0.0, 0, 1.0, 0.0),
                            (1.5, 0, 0.7, 0.1)])
    seeds = jnp.array([11, 12, 13, 14], jnp.uint32)
    positions = jnp.array([3, 40, 5, 77], jnp.int32)

    def batch(seed_offset):
        return sample(logits, *params, seeds + seed_offset, positions)

    def alone(seed_offset, row):
        picked = [jax.lax.dynamic_slice_in_dim(p, row, 1) for p in params]
        return sample(jax.lax.dynamic_slice_in_dim(logits, row, 1), *picked,
                      jax.lax.dynamic_slice_in_dim(seeds, row, 1) + seed_offset,
                      jax.lax.dynamic_slice_in_dim(positions, row, 1))[0]

    offsets = jnp.arange(200, dtype=jnp.uint32)
    together = np.asarray(jax.jit(jax.vmap(batch))(offsets))
    alone_all = jax.jit(jax.vmap(alone, in_axes=(0, None)))
    for row in range(4):
        np.testing.assert_array_equal(together[:, row], np.asarray(alone_all(offsets, row)))


def test_row_key_depends_only_on_seed_position_purpose():
    seeds = jnp.array([1, 2, 1], jnp.uint32)
    positions = jnp.array([5, 5, 6], jnp.int32)
    batched = np.asarray(uniform(row_key(seeds, positions, SAMPLE)))
    for row in range(3):
        single = uniform(row_key(seeds[row:row + 1], positions[row:row + 1], SAMPLE))
        assert batched[row] == float(single[0])
    assert len(set(batched.tolist())) == 3
    other_purpose = np.asarray(uniform(row_key(seeds, positions, ACCEPT)))
    assert np.all(other_purpose != batched)
    grid = np.asarray(uniform(row_key(seeds, jnp.stack([positions, positions + 1], axis=1),
                                      SAMPLE)))
    assert grid.shape == (3, 2)
    np.testing.assert_array_equal(grid[:, 0], batched)
    np.testing.assert_array_equal(grid[0, 1], batched[2])


def test_purpose_constants_are_distinct():
    purposes = [sampling.SAMPLE, sampling.ACCEPT, sampling.RECOVER, sampling.DRAFT]
    assert len(set(purposes)) == len(purposes)


def test_token_logprobs_equal_log_softmax():
    logits = _logits(7, (2, 3, 30))
    tokens = jax.random.randint(jax.random.key(8), (2, 3), 0, 30)
    chosen, top_ids, top_values = token_logprobs(logits, tokens, 4)
    reference = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    np.testing.assert_allclose(
        np.asarray(chosen), np.take_along_axis(reference, np.asarray(tokens)[..., None], -1)[..., 0],
        rtol=1e-6)
    expected_ids = np.argsort(-reference, axis=-1)[..., :4]
    np.testing.assert_array_equal(np.asarray(top_ids), expected_ids)
    np.testing.assert_allclose(np.asarray(top_values),
                               np.take_along_axis(reference, expected_ids, -1), rtol=1e-6)
    _, no_ids, no_values = token_logprobs(logits, tokens, 0)
    assert no_ids.shape == (2, 3, 0) and no_values.shape == (2, 3, 0)
