"""Rejection sampler: vLLM's greedy table cases, exactness (chi-square), synthetic mode."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from chi_square import chi_square_p_value

from specjax.engine.rejection import rejection_sample
from specjax.engine.sampling import processed_probs, sample

PAD = -1


def _rows(batch: int, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> dict:
    return dict(temperature=jnp.full((batch,), temperature, jnp.float32),
                top_k=jnp.full((batch,), top_k, jnp.int32),
                top_p=jnp.full((batch,), top_p, jnp.float32),
                min_p=jnp.full((batch,), min_p, jnp.float32))


TABLE_K, TABLE_BATCH = 3, 2
verify = jax.jit(rejection_sample)
verify_greedy_only = jax.jit(functools.partial(rejection_sample, greedy_only=True))


def _table_inputs(spec_tokens: list[list[int]], output_tokens: list[list[int]], vocab=100):
    """vLLM's table layout: output_tokens[b][i] is the target argmax at slot i. Every case
    is padded to one shape (so one compilation serves all): missing drafts are -1, which
    emits the target token at that slot just as vLLM's bonus does, and spare rows are
    filled with a dummy row."""
    logits = np.full((TABLE_BATCH, TABLE_K + 1, vocab), -100.0, np.float32)
    drafts = np.full((TABLE_BATCH, TABLE_K), PAD, np.int32)
    for b, (spec, out) in enumerate(zip(spec_tokens, output_tokens)):
        drafts[b, :len(spec)] = spec
        for i, token in enumerate(out):
            logits[b, i, token] = 100.0
    return jnp.asarray(logits), jnp.asarray(drafts)


def _pad_expected(expected: list[list[int]]) -> np.ndarray:
    return np.array([row + [PAD] * (TABLE_K + 1 - len(row)) for row in expected], np.int32)


GREEDY_TABLE = [
    # (spec_tokens, target argmax per slot, expected output) from vLLM's tests.
    ([[1, 2, 3]], [[1, 2, 3, 4]], [[1, 2, 3, 4]]),  # perfect match + bonus
    ([[1, 2, 3]], [[1, 5, 3, 4]], [[1, 5, PAD, PAD]]),  # early mismatch
    ([[1, 2], [3]], [[1, 2, 5], [3, 4]], [[1, 2, 5], [3, 4, PAD]]),  # multiple sequences
    ([[1]], [[1, 2]], [[1, 2]]),  # single token
    ([[]], [[5]], [[5, PAD]]),  # empty (no draft): just the target token
    ([[1, 2, 3], [4, 5, 6]], [[1, 2, 7, 6], [4, 8, 6, 9]],
     [[1, 2, 7, PAD], [4, 8, PAD, PAD]]),  # multiple mismatches
    ([[1, 2]], [[1, 2, 3]], [[1, 2, 3]]),  # parametrised: perfect match
    ([[1]], [[2, 3]], [[2, PAD]]),  # parametrised: first mismatch
    ([[1, 2], [3, 4]], [[1, 5, 6], [3, 4, 7]], [[1, 5, PAD], [3, 4, 7]]),  # mixed
]


@pytest.mark.parametrize("temperature,greedy_only", [(0.0, False), (0.0, True), (1.0, False)],
                         ids=["greedy", "greedy_only", "random"])
@pytest.mark.parametrize("spec_tokens,output_tokens,expected", GREEDY_TABLE)
def test_vllm_table_cases(spec_tokens, output_tokens, expected, temperature, greedy_only):
    """Greedy rows follow the table, also on the all-greedy path (greedy_only, which builds no
    distribution); random rows too, since these targets are one-hot."""
    logits, drafts = _table_inputs(spec_tokens, output_tokens)
    out, num_accepted = (verify_greedy_only if greedy_only else verify)(logits, drafts, None, **_rows(TABLE_BATCH, temperature),
                               seed=jnp.arange(TABLE_BATCH), position=jnp.full((TABLE_BATCH,), 9))
    want = _pad_expected(expected)
    real = len(expected)
    np.testing.assert_array_equal(np.asarray(out)[:real], want)
    np.testing.assert_array_equal(np.asarray(num_accepted)[:real], (want != PAD).sum(axis=1) - 1)


def test_greedy_and_random_rows_in_one_batch():
    logits, drafts = _table_inputs([[1, 2, 3], [1, 2, 3]], [[1, 5, 3, 4], [1, 2, 3, 4]])
    for temperatures, expected in (([0.0, 0.8], [[1, 5, PAD, PAD], [1, 2, 3, 4]]),
                                   ([0.8, 0.0], [[1, 5, PAD, PAD], [1, 2, 3, 4]])):
        rows = _rows(TABLE_BATCH)
        rows["temperature"] = jnp.array(temperatures)
        out, num_accepted = verify(logits, drafts, None, **rows, seed=jnp.arange(TABLE_BATCH),
                                   position=jnp.zeros(TABLE_BATCH, jnp.int32))
        np.testing.assert_array_equal(np.asarray(out), expected)
        np.testing.assert_array_equal(np.asarray(num_accepted), [1, 3])


def test_a_missing_draft_rejects_everything_after_it():
    logits, _ = _table_inputs([[1, 2, 3]], [[1, 2, 3, 4]])
    drafts = jnp.array([[1, PAD, 3], [1, PAD, 3]], jnp.int32)
    rows = _rows(TABLE_BATCH)
    rows["temperature"] = jnp.array([0.0, 1.0])
    out, num_accepted = verify(logits, drafts, None, **rows, seed=jnp.zeros(TABLE_BATCH, jnp.int32),
                               position=jnp.zeros(TABLE_BATCH, jnp.int32))
    np.testing.assert_array_equal(np.asarray(out)[0], [1, 2, PAD, PAD])
    assert int(num_accepted[0]) == 1


V = 10
K = 2
NUM_DRAWS = 100_000


def _distribution(seed: int, shape) -> jax.Array:
    return jax.nn.softmax(1.5 * jax.random.normal(jax.random.key(seed), shape), axis=-1)


@functools.partial(jax.jit, static_argnames=("with_draft_probs",))
def _many_verifications(target_logits, draft_probs, rows, with_draft_probs: bool):
    """NUM_DRAWS independent verifications of the same p (per slot) and q, seeds 0..N-1.

    Drafts are drawn from q (what a probabilistic drafter does); for the one-hot case
    (with_draft_probs False) they are drawn from q too but q is not handed over.
    """
    seeds = jnp.arange(NUM_DRAWS, dtype=jnp.uint32)
    draft_keys = jax.random.split(jax.random.key(1234), NUM_DRAWS)
    drafts = jax.vmap(lambda key: jax.random.categorical(key, jnp.log(draft_probs)))(draft_keys)
    logits = jnp.broadcast_to(target_logits, (NUM_DRAWS,) + target_logits.shape)
    probs = jnp.broadcast_to(draft_probs, (NUM_DRAWS,) + draft_probs.shape)
    row_params = {name: jnp.broadcast_to(value, (NUM_DRAWS,)) for name, value in rows.items()}
    out, num_accepted = rejection_sample(logits, drafts.astype(jnp.int32),
                                         probs if with_draft_probs else None, **row_params,
                                         seed=seeds, position=jnp.full((NUM_DRAWS,), 17))
    return out, num_accepted, drafts


PROCESSORS = [
    dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    dict(temperature=0.7, top_k=4, top_p=1.0, min_p=0.0),
    dict(temperature=1.0, top_k=0, top_p=0.7, min_p=0.0),
    dict(temperature=1.2, top_k=0, top_p=1.0, min_p=0.15),
    dict(temperature=0.9, top_k=6, top_p=0.85, min_p=0.05),
]


@pytest.mark.parametrize("with_draft_probs", [True, False], ids=["q", "one-hot"])
@pytest.mark.parametrize("processors", PROCESSORS, ids=lambda p: "-".join(map(str, p.values())))
def test_outputs_follow_target_distribution(processors, with_draft_probs):
    target_logits = jnp.log(_distribution(1, (K + 1, V)))
    draft_probs = _distribution(2, (K, V))
    rows = {name: jnp.asarray(value) for name, value in processors.items()}
    out, num_accepted, drafts = map(np.asarray, _many_verifications(
        target_logits, draft_probs, rows, with_draft_probs))
    p = np.asarray(processed_probs(target_logits[None], *(rows[n][None] for n in
                                                          ("temperature", "top_k", "top_p",
                                                           "min_p"))))[0]
    for slot in range(K + 1):
        emitted = out[num_accepted >= slot, slot]
        assert emitted.size > 500
        assert np.all((emitted >= 0) & (emitted < V))
        assert np.all(p[slot][emitted] > 0), "emitted a token outside the target's support"
        assert chi_square_p_value(emitted, p[slot]) > 1e-3, f"slot {slot}"
    # Acceptance at slot 0 has the known rate: sum_x min(p, q) with q, E_q[p(x)] one-hot.
    q = np.asarray(draft_probs[0], np.float64)
    rate = np.minimum(p[0], q).sum() if with_draft_probs else (q * p[0]).sum()
    observed = np.mean(num_accepted >= 1)
    assert abs(observed - rate) < 5 * np.sqrt(rate * (1 - rate) / NUM_DRAWS) + 1e-6
    # The drafts themselves do not follow p: the chi-square check has power here.
    assert chi_square_p_value(drafts[:, 0], p[0]) < 1e-6


def test_recovered_token_never_repeats_a_rejected_one_hot_draft():
    target_logits = 2.0 * jax.random.normal(jax.random.key(5), (4000, K + 1, V))
    drafts = jax.random.randint(jax.random.key(6), (4000, K), 0, V)
    out, num_accepted = verify(
        target_logits, drafts, None, **_rows(4000), seed=jnp.arange(4000),
        position=jnp.arange(4000))
    out, num_accepted, drafts = map(np.asarray, (out, num_accepted, drafts))
    rejected = num_accepted < K
    assert rejected.sum() > 1000
    rows = np.nonzero(rejected)[0]
    assert np.all(out[rows, num_accepted[rows]] != drafts[rows, num_accepted[rows]])
    filled = np.arange(K + 1)[None, :] <= num_accepted[:, None]
    assert np.all((out[filled] >= 0) & (out[filled] < V))
    assert np.all(out[~filled] == PAD)


def test_no_leftover_mass_falls_back_to_target():
    """q(x) = 0 for the draft (rejected, as vLLM) and p == q: max(p - q, 0) is all zero."""
    p = jnp.zeros((1, K + 1, V)).at[:, :, 3].set(0.5).at[:, :, 7].set(0.5)
    drafts = jnp.array([[0, 0]], jnp.int32)
    out, num_accepted = verify(jnp.log(p), drafts, p[:, :K], **_rows(1),
                                         seed=jnp.array([4]), position=jnp.array([2]))
    assert int(num_accepted[0]) == 0
    assert int(out[0, 0]) in (3, 7)


def test_no_drafts_equal_plain_sampling():
    """With every draft missing, slot 0 is the token plain decoding draws at that position."""
    batch = 64
    logits = 2.0 * jax.random.normal(jax.random.key(7), (batch, K + 1, V))
    rows = _rows(batch, 0.9, top_k=5, top_p=0.9)
    rows["temperature"] = rows["temperature"].at[::4].set(0.0)
    seeds, positions = jnp.arange(batch) + 100, jnp.arange(batch) * 3
    out, num_accepted = verify(logits, jnp.full((batch, K), PAD, jnp.int32), None,
                               **rows, seed=seeds, position=positions)
    plain = jax.jit(sample)(logits[:, 0], **rows, seed=seeds, position=positions)
    np.testing.assert_array_equal(np.asarray(out[:, 0]), np.asarray(plain))
    assert np.all(np.asarray(num_accepted) == 0)


def test_seeded_rows_are_reproducible_and_batch_invariant():
    batch = 8
    logits = 1.5 * jax.random.normal(jax.random.key(8), (batch, K + 1, V))
    drafts = jax.random.randint(jax.random.key(9), (batch, K), 0, V)
    q = _distribution(10, (batch, K, V))
    rows = _rows(batch, 1.0, top_p=0.95)
    seeds, positions = jnp.arange(batch) * 7, jnp.arange(batch) + 30
    run = verify
    together = np.asarray(run(logits, drafts, q, **rows, seed=seeds, position=positions)[0])
    again = np.asarray(run(logits, drafts, q, **rows, seed=seeds, position=positions)[0])
    np.testing.assert_array_equal(together, again)
    for row in range(batch):
        one = {name: value[row:row + 1] for name, value in rows.items()}
        alone = run(logits[row:row + 1], drafts[row:row + 1], q[row:row + 1], **one,
                    seed=seeds[row:row + 1], position=positions[row:row + 1])[0]
        np.testing.assert_array_equal(np.asarray(alone)[0], together[row])


@functools.partial(jax.jit, static_argnames=("batch",))
def _synthetic_runs(target_logits, drafts, rates, temperature, batch: int):
    logits = jnp.broadcast_to(target_logits, (batch,) + target_logits.shape)
    draft_rows = jnp.broadcast_to(drafts, (batch,) + drafts.shape)
    rows = _rows(batch)
    rows["temperature"] = jnp.full((batch,), temperature)
    return rejection_sample(logits, draft_rows, None, **rows, seed=jnp.arange(batch),
                            position=jnp.full((batch,), 5), synthetic_rates=rates)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "random"])
def test_synthetic_acceptance_frequencies_match_rates(temperature):
    batch, rates = 40_000, jnp.array([0.9, 0.5, 0.25])
    target_logits = 2.0 * jax.random.normal(jax.random.key(11), (4, V))
    drafts = jnp.array([1, 2, 3], jnp.int32)
    out, num_accepted = map(np.asarray, _synthetic_runs(target_logits, drafts, rates,
                                                        temperature, batch))
    for i, rate in enumerate(np.asarray(rates)):
        reached = num_accepted >= i
        observed = np.mean(num_accepted[reached] >= i + 1)
        assert abs(observed - rate) < 5 * np.sqrt(rate * (1 - rate) / reached.sum())
    accepted = np.arange(4)[None, :] < num_accepted[:, None]
    np.testing.assert_array_equal(out[:, :3][accepted[:, :3]],
                                  np.broadcast_to(np.asarray(drafts), (batch, 3))[accepted[:, :3]])
    if temperature == 0.0:
        argmax = np.asarray(jnp.argmax(target_logits, axis=-1))
        np.testing.assert_array_equal(out[np.arange(batch), num_accepted], argmax[num_accepted])


def test_greedy_only_path_equals_the_general_one_on_greedy_rows():
    """Random logits and drafts, every row greedy: the all-greedy path (no distribution) gives the general
    path's tokens and counts, in standard and synthetic mode."""
    logits = 3.0 * jax.random.normal(jax.random.key(13), (64, 4, V))
    drafts = jnp.where(jax.random.uniform(jax.random.key(14), (64, 3)) < 0.1, PAD,
                       jnp.argmax(logits[:, :3] + jax.random.normal(jax.random.key(15), (64, 3, V)), -1))
    for rates in (None, jnp.array([0.9, 0.5, 0.25])):
        kwargs = dict(**_rows(64, 0.0), seed=jnp.arange(64), position=jnp.arange(64), synthetic_rates=rates)
        general, fast = verify(logits, drafts, None, **kwargs), verify_greedy_only(logits, drafts, None, **kwargs)
        np.testing.assert_array_equal(np.asarray(fast[0]), np.asarray(general[0]))
        np.testing.assert_array_equal(np.asarray(fast[1]), np.asarray(general[1]))
        assert 0 < int(np.sum(general[1])) < 64 * 3   # some accepted, some rejected


def test_synthetic_extremes_and_missing_drafts():
    target_logits = 2.0 * jax.random.normal(jax.random.key(12), (3, V))
    argmax = np.asarray(jnp.argmax(target_logits, axis=-1))
    drafts = jnp.array([4, 5], jnp.int32)
    out, num_accepted = _synthetic_runs(target_logits, drafts, jnp.array([1.0, 1.0]), 0.0, 16)
    np.testing.assert_array_equal(np.asarray(out), np.tile([4, 5, argmax[2]], (16, 1)))
    out, num_accepted = _synthetic_runs(target_logits, drafts, jnp.array([0.0, 0.0]), 1.0, 16)
    assert np.all(np.asarray(num_accepted) == 0)
    assert np.all(np.asarray(out[:, 1:]) == PAD) and np.all(np.asarray(out[:, 0]) >= 0)
    missing = jnp.array([4, PAD], jnp.int32)
    out, num_accepted = _synthetic_runs(target_logits, missing, jnp.array([1.0, 1.0]), 0.0, 16)
    np.testing.assert_array_equal(np.asarray(out), np.tile([4, argmax[1], PAD], (16, 1)))


def test_shape_errors_name_the_argument():
    logits = jnp.zeros((2, 4, V))
    drafts = jnp.zeros((2, 3), jnp.int32)
    rows = _rows(2)
    common = dict(**rows, seed=jnp.zeros(2, jnp.int32), position=jnp.zeros(2, jnp.int32))
    with pytest.raises(ValueError, match="target_logits"):
        rejection_sample(logits[:, :3], drafts, None, **common)
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(logits, drafts, jnp.zeros((2, 3, V + 1)), **common)
    with pytest.raises(ValueError, match="synthetic_rates"):
        rejection_sample(logits, drafts, None, **common, synthetic_rates=jnp.ones(2))
