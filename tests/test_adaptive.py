"""Adaptive speculation: vLLM's per-batch-size table and the automatic policy, parsed with clear errors; the tier
choice on the device; greedy output equal to plain decoding for every drafter while the loop switches between
k tiers (plain steps among them); the k = 0 tier costing a plain step; proposers caught up after plain steps
exactly as if they had drafted; step times measured once and stored; the record reported in the metrics."""
from __future__ import annotations

import collections
import json
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from eagle_heads import write_head
from flax import nnx
from jaxpr_counts import primitive_counts

from checkpoints_conv.eagle_loader import load_eagle_head
from specjax import LLM, SamplingParams
from specjax.config import SpeculativeConfig
from specjax.config.speculation_policy import PROBE_EVERY, PROBE_MAX, SpeculationPolicy, auto_tiers
from specjax.engine import adaptive, calibration, loop
from specjax.engine.proposers.base import NoProposer, TargetPass
from specjax.engine.proposers.draft_model import DraftModelProposer
from specjax.engine.proposers import eagle as eagle_proposer
from specjax.engine.proposers.eagle import HeadProposer
from specjax.engine.state import RowParams
from specjax.models.llama import FAMILY, LlamaConfig

K = 3
MAX_LEN = 64
WAVES, SLOTS = 13, 8


def _spec(**keys) -> SpeculativeConfig:
    return SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": K, **keys},
                                       target_max_model_len=256, target_tensor_parallel_size=1)


# ------------------------------------------------------------------------------------------------------------
# configuration
# ------------------------------------------------------------------------------------------------------------

def test_policies_parse_as_vllm_defines_the_table():
    assert _spec().policy == SpeculationPolicy("fixed", (K,))
    table = _spec(num_speculative_tokens_per_batch_size=[[65, 128, 1], [1, 64, 3], [129, 512, 0]]).policy
    assert (table.mode, table.tiers, table.table) == ("table", (0, 1, 3), ((1, 64, 3), (65, 128, 1), (129, 512, 0)))
    auto = _spec(speculation_policy="auto", step_costs={"0": 1, 1: 1.5, 2: 1.7, 3: 2}).policy
    assert (auto.mode, auto.tiers, auto.step_costs) == ("auto", (0, 1, 2, 3), (1.0, 1.5, 1.7, 2.0))
    assert auto_tiers(1) == (0, 1) and auto_tiers(5) == (0, 1, 2, 4, 5) and auto_tiers(8) == (0, 1, 2, 4, 8)


@pytest.mark.parametrize("keys, match", [
    ({"num_speculative_tokens_per_batch_size": [[1, 8, 4]]}, "K=4 is more than num_speculative_tokens=3"),
    ({"num_speculative_tokens_per_batch_size": [[1, 8, 1], [8, 16, 0]]}, "overlap"),
    ({"num_speculative_tokens_per_batch_size": [[9, 8, 1]]}, "start_bs must be <= end_bs"),
    ({"num_speculative_tokens_per_batch_size": [[1, 8]]}, r"\[start_bs, end_bs, K\]"),
    ({"num_speculative_tokens_per_batch_size": []}, "non-empty list"),
    ({"num_speculative_tokens_per_batch_size": [[0, 8, 1]]}, "start_bs must be >= 1"),
    ({"speculation_policy": "greedy"}, "must be one of"),
    ({"speculation_policy": "table"}, "needs 'num_speculative_tokens_per_batch_size'"),
    ({"speculation_policy": "auto", "num_speculative_tokens_per_batch_size": [[1, 8, 1]]}, "needs speculation_policy"),
    ({"speculation_policy": "auto", "step_costs": {0: 1, 3: 2}}, r"exactly the tiers \[0, 1, 2, 3\]"),
    ({"speculation_policy": "auto", "step_costs": {0: 1, 1: 1, 2: 0, 3: 2}}, "positive number"),
    ({"step_costs": {3: 1.0}}, "'auto' only"),
])
def test_bad_policies_are_refused_naming_the_field(keys, match):
    with pytest.raises((TypeError, ValueError), match=match):
        _spec(**keys)


# ------------------------------------------------------------------------------------------------------------
# the choice on the device
# ------------------------------------------------------------------------------------------------------------

def _adapt(acceptance, costs, plain_run=0, forced=-1, verdicts=1e6):
    """A state at these running rates, with `verdicts` behind each (many by default: the running weight's), all of
    them its support."""
    state = adaptive.init_adapt(K, 8, adaptive.policy_inputs(costs, forced))
    return adaptive.dataclasses.replace(state, acceptance=jnp.asarray(acceptance, jnp.float32),
                                        verdicts=jnp.full((K,), verdicts, jnp.float32),
                                        support=jnp.full((K,), verdicts, jnp.float32),
                                        plain_run=jnp.asarray(plain_run, jnp.int32))


def _choose(adapt, live, policy) -> int:
    return int(jax.jit(adaptive.choose_tier, static_argnums=2)(adapt, live, policy)[0])


def test_auto_weighs_expected_tokens_against_step_times():
    policy = SpeculationPolicy("auto", (0, 1, 2, 3))
    costs = [1.0, 1.3, 1.5, 1.7]
    np.testing.assert_allclose(adaptive.expected_tokens(jnp.asarray([0.5, 0.5, 0.5]), policy.tiers),
                               [1, 1.5, 1.75, 1.875])
    assert _choose(_adapt([0.1, 0.1, 0.1], costs), 4, policy) == 0     # speculation loses
    assert _choose(_adapt([0.9, 0.9, 0.9], costs), 4, policy) == 3
    assert _choose(_adapt([0.6, 0.1, 0.1], costs), 4, policy) == 1     # one draft pays, more do not
    # After PROBE_EVERY plain steps a probe looks again (k = 1 here: test_a_probe_runs_the_tier_that_could_win);
    # a forced tier wins over everything.
    assert _choose(_adapt([0.1] * 3, costs, plain_run=PROBE_EVERY), 4, policy) == 1
    assert _choose(_adapt([0.9] * 3, costs, forced=0), 4, policy) == 0


def test_probes_back_off_while_speculation_loses_and_come_back_when_it_wins():
    policy = SpeculationPolicy("auto", (0, 1, 2, 3))
    costs = [1.0, 1.3, 1.5, 1.7]
    choose = jax.jit(adaptive.choose_tier, static_argnums=2)
    state, gaps = _adapt([0.1] * 3, costs), []
    for _ in range(6):   # each probe loses: the plain run that triggers the next one doubles, up to PROBE_MAX
        state = adaptive.dataclasses.replace(state, plain_run=state.probe_gap)
        tier, _, _, state = choose(state, 4, policy)
        assert int(tier) == 1
        gaps.append(int(state.probe_gap))
        tier, _, _, state = choose(adaptive.dataclasses.replace(state, plain_run=jnp.asarray(0, jnp.int32)), 4,
                                   policy)
        assert int(tier) == 0 and int(state.probe_gap) == gaps[-1]
    assert gaps == [min(PROBE_EVERY * 2 ** i, PROBE_MAX) for i in range(1, 7)]
    assert gaps[-1] == PROBE_MAX
    tier, _, _, state = choose(adaptive.dataclasses.replace(state, acceptance=jnp.full((3,), 0.9, jnp.float32)), 4,
                               policy)
    assert int(tier) == 3 and int(state.probe_gap) == PROBE_EVERY   # speculation won on its merits


@pytest.mark.parametrize("live, steps", [(1, adaptive.PROBE_MAX_STEPS), (4, adaptive.PROBE_MAX_STEPS), (8, 4),
                                         (16, 2), (128, 1)])
def test_a_probe_verifies_a_set_number_of_drafts_and_weighs_as_a_segment(live, steps):
    """A probe of many rows is one step, of few PROBE_MAX_STEPS (half a segment); either way its steps move the
    running rates as far as a segment of ordinary steps would. A choice on the merits runs a segment at the
    ordinary weight."""
    policy = SpeculationPolicy("auto", (0, 1, 2, 3))
    state = _adapt([0.22, 1.0, 1.0], [1.0, 1.3, 1.5, 1.7], plain_run=PROBE_EVERY)   # plain wins; k = 3 the nearest
    tier, _, probe_steps, probed = jax.jit(adaptive.choose_tier, static_argnums=2)(state, jnp.asarray(live), policy)
    assert int(tier) == 3 and int(probe_steps) == steps
    for step in range(steps):   # every first draft accepted at each of the probe's steps
        probed = adaptive.record(probed, jnp.asarray(step + 1), 3, jnp.asarray(live),
                                 jnp.full((live,), 3), jnp.full((live,), 3), jnp.ones((live,), bool), probe_steps)
    ordinary = state
    for step in range(adaptive.SEGMENT):
        ordinary = adaptive.record(ordinary, jnp.asarray(step + 1), 3, jnp.asarray(live),
                                   jnp.full((live,), 3), jnp.full((live,), 3), jnp.ones((live,), bool))
    np.testing.assert_allclose(probed.acceptance, ordinary.acceptance, rtol=1e-5)
    tier, _, segment, _ = adaptive.choose_tier(probed, jnp.asarray(live), policy)   # drafts won: a speculative tier,
    assert (int(tier) > 0 if live == 1 else int(tier) == 3) and int(segment) == adaptive.SEGMENT   # one row's less
    assert float(adaptive.step_weight(segment)) == adaptive.EMA_WEIGHT


def test_a_probe_runs_the_tier_that_could_win():
    """A probe runs the speculative tier with the most tokens per step time at rates PLAIN_MARGIN_SE standard
    errors up: k = 1 where the drafts after the first are known to fail (its step the cheapest), the largest where
    they have no verdicts behind them."""
    policy = SpeculationPolicy("auto", (0, 1, 2, 3))
    costs = [1.0, 1.3, 1.5, 1.7]
    known = _adapt([0.2, 0.0, 0.0], costs, plain_run=PROBE_EVERY)
    assert _choose(known, 4, policy) == 1
    unknown = adaptive.dataclasses.replace(known, acceptance=jnp.asarray([0.2, 1.0, 1.0], jnp.float32),
                                           support=jnp.asarray([1e6, 1.0, 1.0], jnp.float32))
    assert _choose(unknown, 4, policy) == 3
    no_probe = adaptive.dataclasses.replace(unknown, plain_run=jnp.asarray(0, jnp.int32))
    assert _choose(no_probe, 4, policy) == 0   # plain wins on the rates themselves


@pytest.mark.parametrize("live, steps", [(1, adaptive.PROBE_MAX_STEPS), (128, 1)])
def test_the_first_choice_is_a_probe(live, steps):
    """A fresh loop runs the largest tier for a probe's steps, not a whole segment: at many rows one step measures
    every position, and a calibration's forced tier still runs from the start."""
    policy = SpeculationPolicy("auto", (0, 1, 2, 3))
    choose = jax.jit(adaptive.choose_tier, static_argnums=2)
    tier, _, segment, state = choose(adaptive.init_adapt(K, 8, adaptive.policy_inputs([1.0, 1.3, 1.5, 1.7])),
                                     jnp.asarray(live), policy)
    assert (int(tier), int(segment), int(state.probe_gap)) == (3, steps, 2 * PROBE_EVERY)
    forced, _, segment, _ = choose(adaptive.init_adapt(K, 8, adaptive.policy_inputs([1.0] * 4, 1)),
                                   jnp.asarray(live), policy)
    assert (int(forced), int(segment)) == (1, adaptive.SEGMENT)


@pytest.mark.parametrize("gap, plain_run, steps", [(PROBE_EVERY, 0, PROBE_EVERY), (PROBE_MAX, 40, PROBE_MAX - 40),
                                                     (PROBE_MAX, PROBE_MAX - 3, adaptive.SEGMENT)])
def test_a_plain_tier_chosen_on_its_merits_runs_until_the_next_probe(gap, plain_run, steps):
    """Plain steps leave the rates as they are, so the choice would stay plain until the probe: one segment runs
    until then (a whole segment at least), and the probe comes right after it. Calibration's forced plain tier
    runs as a plain choice's shortest such segment (PROBE_EVERY), its drafting tiers ordinary ones."""
    policy = SpeculationPolicy("auto", (0, 1, 2, 3))
    costs = [1.0, 1.3, 1.5, 1.7]
    choose = jax.jit(adaptive.choose_tier, static_argnums=2)
    state = adaptive.dataclasses.replace(_adapt([0.1] * 3, costs, plain_run=plain_run),
                                         probe_gap=jnp.asarray(gap, jnp.int32))
    tier, _, segment, state = choose(state, 4, policy)
    assert (int(tier), int(segment), int(state.probe_gap)) == (0, steps, gap)
    for step in range(int(segment)):
        state = adaptive.record(state, jnp.asarray(step + 1), 0, jnp.asarray(4), jnp.zeros((4,), jnp.int32),
                                jnp.zeros((4,), jnp.int32), jnp.ones((4,), bool))
    assert int(choose(state, 4, policy)[0]) == 1   # the probe (k = 1: the drafts after the first fail)
    for forced, segment in ((0, PROBE_EVERY), (1, adaptive.SEGMENT), (3, adaptive.SEGMENT)):
        assert int(choose(_adapt([0.1] * 3, costs, forced=forced), 4, policy)[2]) == segment


def test_a_plain_step_records_its_k_and_rows_and_no_verdicts():
    state = _adapt([0.4] * 3, [1.0] * 4, verdicts=5.0)
    after = adaptive.record(state, jnp.asarray(3), 0, jnp.asarray(3), jnp.zeros((4,), jnp.int32),
                            jnp.zeros((4,), jnp.int32), jnp.asarray([True, True, True, False]))
    np.testing.assert_array_equal(after.acceptance, state.acceptance)
    np.testing.assert_array_equal(after.verdicts, state.verdicts)
    assert int(after.plain_run) == 1 and after.live_per_step[2] == 3 and after.k_per_step[2] == 0
    drafted = adaptive.record(after, jnp.asarray(4), 2, jnp.asarray(3), jnp.full((4,), 2), jnp.ones((4,), jnp.int32),
                              jnp.asarray([True, True, True, False]))
    assert int(drafted.plain_run) == 0 and drafted.k_per_step[:4].tolist() == [0, 0, 0, 2]


def test_the_table_follows_the_live_rows():
    policy = _spec(num_speculative_tokens_per_batch_size=[[1, 2, 3], [3, 5, 0], [8, 8, 1]]).policy
    state = _adapt([1.0] * 3, [1.0] * 3)
    ks = [policy.tiers[int(adaptive.choose_tier(state, jnp.asarray(n), policy)[0])] for n in range(1, 10)]
    assert ks == [3, 3, 0, 0, 0, 3, 3, 1, 3]   # 6, 7 and 9 lie outside every row: num_speculative_tokens


def test_the_sweeps_fixed_engines_are_each_k_or_those_named():
    from benchmarks.bench_sweep import speculative_engines
    names = [name for name, _ in speculative_engines(["fixed", "auto"], 3, 1.2, "ngram", 8)]
    assert names == ["k=1", "k=2", "k=3", "auto k<=3"]
    named = speculative_engines(["fixed", "auto"], 3, 1.2, "ngram", 8, fixed=(2,))
    assert [(name, spec["num_speculative_tokens"]) for name, spec in named] == [("k=2", 2), ("auto k<=3", 3)]
    held = speculative_engines(["fixed", "forced"], 3, 1.2, "ngram", 8, fixed=(0, 1))
    assert [name for name, _ in held] == ["k=1", "k=0 forced", "k=1 forced"]   # k = 0 only as auto's plain tier


@pytest.mark.parametrize("k_max", [3, 5])
def test_the_sweeps_forced_engines_compile_autos_tiers_and_hold_their_k(k_max):
    """benchmarks/bench_sweep.py's "forced" engines measure the adaptive loop's machinery apart from its choices:
    auto's very tiers, and their k at every live count the slots allow."""
    from benchmarks.bench_sweep import speculative_engines
    slots = 8
    for name, keys in speculative_engines(["forced"], k_max, 2.0, "ngram", slots):
        policy = SpeculativeConfig.from_dict({k: v for k, v in keys.items() if k != "model"},
                                             target_max_model_len=256, target_tensor_parallel_size=1).policy
        k = int(name.split()[0].removeprefix("k="))
        assert set(auto_tiers(k_max)) <= set(policy.tiers) == set(auto_tiers(k_max)) | {k}
        state = _adapt([1.0] * k_max, [1.0] * len(policy.tiers))
        chosen = {int(adaptive.choose_tier(state, jnp.asarray(live), policy)[0]) for live in range(1, slots + 1)}
        assert {policy.tiers[tier] for tier in chosen} == {k}


def test_running_acceptance_is_conditional_on_the_earlier_drafts():
    state = _adapt([1.0] * 3, [1.0] * 4)
    # Row 0 drafted 3 and had 1 accepted, row 1 drafted 3 with all accepted, row 2 drafted 2 and had none,
    # row 3 was not running.
    state = adaptive.record(state, jnp.asarray(1), 3, jnp.asarray(3), jnp.asarray([3, 3, 2, 3]),
                            jnp.asarray([1, 3, 0, 3]), jnp.asarray([True, True, True, False]))
    rates = np.asarray([2 / 3, 1 / 2, 1.0])   # position 0: 2 of 3, 1: 1 of 2 reached, 2: 1 of 1
    kept = (1 - adaptive.EMA_WEIGHT) ** (np.asarray([3, 2, 1]) / adaptive.FULL_STEP_ROWS)   # fewer rows, less weight
    np.testing.assert_allclose(state.acceptance, kept + (1 - kept) * rates, rtol=1e-6)
    assert state.k_per_step.tolist()[:2] == [3, 0] and state.live_per_step.tolist()[0] == 3


def test_a_rows_verdict_weighs_the_same_in_one_step_or_spread_over_several():
    """FULL_STEP_ROWS one-row steps move the running rates as far as one step of that many rows with the same
    verdicts, and as one step of twice as many: a step weighs a whole step from FULL_STEP_ROWS rows up."""
    state = _adapt([0.5] * 3, [1.0] * 4)

    def step(s, rows):   # every row's first draft accepted, its second rejected
        return adaptive.record(s, jnp.asarray(1), 3, jnp.asarray(rows), jnp.full((rows,), 3),
                               jnp.ones((rows,), jnp.int32), jnp.ones((rows,), bool))

    spread = state
    for _ in range(adaptive.FULL_STEP_ROWS):
        spread = step(spread, 1)
    whole = [0.5 + adaptive.EMA_WEIGHT * 0.5, 0.5 - adaptive.EMA_WEIGHT * 0.5, 0.5]   # position 2 never reached
    for s in (spread, step(state, adaptive.FULL_STEP_ROWS), step(state, 2 * adaptive.FULL_STEP_ROWS)):
        np.testing.assert_allclose(s.acceptance, whole, rtol=1e-5)
    assert 0.5 < float(step(state, 1).acceptance[0]) < whole[0]


@pytest.mark.parametrize("rows", [1, 8])
def test_the_first_verdicts_replace_the_optimistic_start_as_an_average(rows):
    """Fresh rates (1.0, counted as OPTIMISTIC_VERDICTS) move as an average of every verdict so far would, not
    by the running weight alone: eight rejections of the first draft leave it at 1 / 9, one row at a time or in
    one step, and a short call does not spend its first segments on drafts it has already seen fail."""
    state = adaptive.init_adapt(K, 8, adaptive.policy_inputs([1.0] * 4))
    for _ in range(8 // rows):
        state = adaptive.record(state, jnp.asarray(1), 3, jnp.asarray(rows), jnp.full((rows,), 3),
                                jnp.zeros((rows,), jnp.int32), jnp.ones((rows,), bool))
    average = adaptive.OPTIMISTIC_VERDICTS / (adaptive.OPTIMISTIC_VERDICTS + 8)
    np.testing.assert_allclose(state.acceptance, [average, 1.0, 1.0], rtol=1e-6)
    np.testing.assert_allclose(state.verdicts, [adaptive.OPTIMISTIC_VERDICTS + 8] + [adaptive.OPTIMISTIC_VERDICTS] * 2)


def test_plain_must_win_beyond_the_rates_noise():
    """A plain choice holds until the next probe, so plain is chosen only where it also beats speculation at rates
    PLAIN_MARGIN_SE standard errors up: at a running rate a little under k = 1's break-even (0.173 here), few
    verdicts behind it keep k = 1, many send the loop to plain; a rate far under it is plain on few verdicts."""
    policy = SpeculationPolicy("auto", (0, 1, 2, 3))
    costs = [1.0, 1.173, 1.253, 1.386]
    assert _choose(_adapt([0.15, 0.0, 0.0], costs, verdicts=40.0), 32, policy) == 1
    assert _choose(_adapt([0.15, 0.0, 0.0], costs, verdicts=1e4), 32, policy) == 0
    assert _choose(_adapt([0.02, 0.0, 0.0], costs, verdicts=40.0), 32, policy) == 0
    assert _choose(_adapt([0.6, 0.0, 0.0], costs, verdicts=40.0), 32, policy) == 1


def test_the_upper_rates_are_wilsons_bound():
    """Wilson's upper bound: 0.5 on 100 verdicts at one standard error 0.54975 (by hand), never under the rate,
    above 0 at a rate of 0, the rate itself on unbounded support."""
    upper = adaptive.upper_rates(jnp.asarray([0.5, 0.0, 0.2, 1.0]), jnp.asarray([100.0, 16.0, 1e9, 3.0]), 1.0)
    np.testing.assert_allclose(upper, [0.54975, 1 / 17, 0.2, 1.0], rtol=1e-4)


def test_a_rates_support_decays_as_the_rate_weighs_its_verdicts():
    """support' = (1 - w) support + tries at each position some row reached (w the step's weight), else as it was."""
    state = _adapt([0.5] * 3, [1.0] * 4, verdicts=100.0)
    after = adaptive.record(state, jnp.asarray(1), 3, jnp.asarray(8), jnp.full((8,), 3), jnp.zeros((8,), jnp.int32),
                            jnp.ones((8,), bool))
    np.testing.assert_allclose(after.support, [(1 - adaptive.EMA_WEIGHT) * 100 + 8, 100, 100], rtol=1e-6)


@pytest.mark.parametrize("live, steps", [(4, adaptive.SEGMENT), (128, 1)])
def test_a_shallow_tier_runs_a_shadow_once_its_extra_drafts_fit_the_budget(live, steps):
    """k = 1 wins where later drafts fail; after enough k = 1 steps that a shadow's extra draft steps (0.2 per step
    by the step times: k = 2's increment) stay within SHADOW_BUDGET, its next segment is a shadow: a segment's
    steps at few rows, one at many. Never at k_max (nothing deeper), for a forced tier or a probe."""
    policy = SpeculationPolicy("auto", (0, 1, 2, 3))
    costs = [1.0, 1.3, 1.5, 1.7]
    gap = steps * 0.2 / (adaptive.SHADOW_BUDGET * 1.3)
    choose = jax.jit(adaptive.choose_tier, static_argnums=2)
    for shallow_run, due in ((int(gap) - 1, False), (int(gap) + 1, True)):
        state = adaptive.dataclasses.replace(_adapt([0.9, 0.0, 0.0], costs),
                                             shallow_run=jnp.asarray(shallow_run, jnp.int32))
        tier, shadow, segment, _ = choose(state, jnp.asarray(live), policy)
        assert (int(tier), bool(shadow), int(segment)) == (1, due, steps if due else adaptive.SEGMENT)
    late = jnp.asarray(10 ** 6, jnp.int32)
    for state in (_adapt([0.9] * 3, costs), _adapt([0.9, 0.0, 0.0], costs, forced=1),
                  _adapt([0.1, 0.0, 0.0], costs, plain_run=PROBE_EVERY)):
        tier, shadow, _, _ = choose(adaptive.dataclasses.replace(state, shallow_run=late), jnp.asarray(live), policy)
        assert not bool(shadow) and int(tier) > 0
    assert adaptive.segment_kinds(policy) == ((0, False), (1, False), (2, False), (3, False), (1, True), (2, True))
    assert adaptive.segment_kinds(_spec(num_speculative_tokens_per_batch_size=[[1, 8, 1]]).policy) == (
        (0, False), (1, False), (3, False))


def test_a_shadows_verdicts_only_raise_the_position_above_its_tier():
    """A shadow of k = 1 records its first drafts as any k = 1 step would and its second drafts' verdicts only where
    they raise position 2's rate (a stale high rate is the hope a shallow tier cannot re-measure). Shadows, k_max
    and plain steps start the run towards the next shadow again; other steps of a shallow tier add to it."""
    state = _adapt([0.5, 0.3, 0.3], [1.0] * 4)
    offered, active = jnp.full((8,), 2), jnp.ones((8,), bool)

    def shadow(verdicts):
        return adaptive.record(state, jnp.asarray(1), 1, jnp.asarray(8), offered, jnp.asarray(verdicts, jnp.int32),
                               active, adaptive.SEGMENT, True)

    good, bad = shadow([2] * 8), shadow([1] * 8)
    ordinary = adaptive.record(state, jnp.asarray(1), 1, jnp.asarray(8), jnp.full((8,), 1), jnp.ones((8,), jnp.int32),
                               active)
    for after in (good, bad):
        np.testing.assert_allclose(after.acceptance[0], ordinary.acceptance[0], rtol=1e-6)
        assert after.shadow_per_step[0] == 1 and after.k_per_step[0] == 1 and int(after.shallow_run) == 0
    assert float(good.acceptance[1]) > 0.3 and float(good.verdicts[1]) == float(state.verdicts[1]) + 8
    np.testing.assert_array_equal([bad.acceptance[1:], bad.verdicts[1:], bad.support[1:]],
                                  [state.acceptance[1:], state.verdicts[1:], state.support[1:]])
    assert int(ordinary.shallow_run) == 1 and ordinary.shadow_per_step[0] == 0
    deepest = adaptive.record(ordinary, jnp.asarray(2), 3, jnp.asarray(8), jnp.full((8,), 3),
                              jnp.zeros((8,), jnp.int32), active)
    assert int(deepest.shallow_run) == 0
    # A shadow of one step (many rows) weighs as a whole segment, as the tier's own steps do.
    one_step = adaptive.record(state, jnp.asarray(1), 1, jnp.asarray(8), offered, jnp.full((8,), 2, jnp.int32),
                               active, 1, True)
    np.testing.assert_allclose(one_step.acceptance, good.acceptance, rtol=1e-6)


def test_drafts_that_come_good_deeper_are_followed_there():
    """A drafter whose later drafts fail for a while and then come good: k = 1 wins at first, k = 3 later, and
    k = 1 never measures positions 2 and 3. Without shadows auto stayed at k = 1 for good, 0.81 of the best fixed
    k (benchmarks/RESULTS.md, "Shadow drafts")."""
    from benchmarks.bench_policy import RIGHT, SHALLOW, simulate, tokens_per_step
    costs = np.asarray([0.899, 0.971, 1.027, 1.120])
    rate, ran = simulate(rows=8, phases=[SHALLOW, RIGHT], period=512, costs=costs, steps=1024, seed=0)
    best = 8 * np.mean([tokens_per_step(p) for p in (SHALLOW, RIGHT)], axis=0) / costs
    assert rate >= 0.95 * best.max() and ran[3] > 256 and 0 < ran[-1] < 0.1 * ran.sum(), ran


def test_many_rows_at_a_low_but_winning_acceptance_keep_drafting():
    """32 rows whose first draft is accepted 20% of the time, at the 8B shape's 32-slot step costs on the H200
    (k = 1 2% over plain): noise in the running rate must not send the loop to plain stretches. On the rates
    alone it spent about half its steps plain (RESULTS.md, "Plain only when speculation loses beyond the rates'
    noise")."""
    from benchmarks.bench_policy import simulate
    _, ran = simulate(rows=32, phases=[(0.2, 0.0, 0.0)], period=384, costs=np.asarray([1.0, 1.173, 1.253, 1.386]),
                      steps=384, seed=0)
    ran = dict(enumerate(ran))
    assert ran[0] <= 0.15 * sum(ran.values()), ran


def test_one_row_at_a_low_but_winning_acceptance_keeps_drafting():
    """One row whose first draft is accepted 20% of the time, at step costs where k = 1 gains 11% over plain
    decoding (the H100's measured 1-slot costs): a run of rejections must not send the loop to plain steps.
    Weighted per step rather than per row, four rejections in a row did, and the loop spent about 45% of its steps
    plain and 14% probing k = 3 (RESULTS.md, "The running acceptance weighs rows")."""
    from benchmarks.bench_policy import simulate
    _, ran = simulate(rows=1, phases=[(0.2, 0.0, 0.0)], period=384, costs=np.asarray([0.899, 0.971, 1.027, 1.120]),
                      steps=384, seed=0)
    ran = dict(enumerate(ran))
    assert ran[0] <= 0.05 * sum(ran.values()), ran


# ------------------------------------------------------------------------------------------------------------
# exactness while switching tiers, every drafter
# ------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_dir(tiny_checkpoint_factory):
    return tiny_checkpoint_factory("llama")


@pytest.fixture(scope="module")
def workload(tiny_dir):
    """WAVES x SLOTS prompts of 2 to 16 tokens (repetitive, so n-gram finds matches) with max_tokens 1 to 48,
    each wave led by a 48-token request so every wave has one shape (one compilation)."""
    vocab = json.loads((tiny_dir / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(0)
    prompts, params = [], []
    for i in range(WAVES * SLOTS):
        motif = rng.integers(3, vocab, size=int(rng.integers(1, 5))).tolist()
        prompts.append({"prompt_token_ids": (motif * 16)[:int(rng.integers(2, 17))]})
        params.append(SamplingParams(temperature=0.0, ignore_eos=True,
                                     max_tokens=48 if i % SLOTS == 0 else int(rng.integers(1, 49))))
    return prompts, params


def _llm(model_dir, default_model_dir, spec=None) -> LLM:
    # Waves: their records are checked per wave here (test_admission.py runs the policies under admission).
    return LLM(str(model_dir), tokenizer=str(default_model_dir), max_model_len=MAX_LEN, max_num_seqs=SLOTS,
               speculative_config=spec, continuous_admission=False)


@pytest.fixture(scope="module")
def plain_tokens(tiny_dir, default_model_dir, workload):
    outs = _llm(tiny_dir, default_model_dir).generate(*workload, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def eagle3_head(tiny_dir, tmp_path_factory):
    config = json.loads((tiny_dir / "config.json").read_text())
    return write_head(tmp_path_factory.mktemp("EAGLE3-tiny"), config, "eagle3_yuhuili", scale=0.3)


# Live rows fall from 8 as rows finish: the table walks k = 1 -> 0 (long runs of plain steps, past the ring a
# head keeps) -> 3. The auto costs make plain steps cheap enough that a poor drafter drops to k = 0 and probes.
TABLE = {"num_speculative_tokens_per_batch_size": [[1, 2, 3], [3, 5, 0], [6, 8, 1]]}
AUTO = {"speculation_policy": "auto", "step_costs": {0: 1.0, 1: 1.6, 2: 1.8, 3: 2.0}}


@pytest.mark.parametrize("method, policy", [("ngram", TABLE), ("draft_model", TABLE), ("eagle3", TABLE),
                                            ("eagle3", AUTO)], ids=["ngram-table", "draft-table", "eagle3-table",
                                                                    "eagle3-auto"])
def test_greedy_output_equals_plain_decoding_while_tiers_switch(tiny_dir, default_model_dir, workload, plain_tokens,
                                                                eagle3_head, method, policy):
    drafter = {"ngram": {"prompt_lookup_min": 1, "prompt_lookup_max": 3},
               "draft_model": {"model": str(tiny_dir)},   # the target drafting for itself: every draft accepted
               "eagle3": {"model": str(eagle3_head)}}[method]
    llm = _llm(tiny_dir, default_model_dir, {"method": method, "num_speculative_tokens": K, **drafter, **policy})
    outs = llm.generate(*workload, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain_tokens
    trace = llm.speculation_trace()
    assert len(trace) == WAVES and all(t.slots == SLOTS for t in trace)
    ran = collections.Counter(k for t in trace for k in t.k_per_step)
    metrics = {m.name: m for m in llm.get_metrics()}
    assert metrics["specjax:spec_decode_iterations_per_k"].values == [ran[k] for k in range(K + 1)]
    live = sum(sum(t.live_per_step) for t in trace)
    assert metrics["specjax:spec_decode_live_row_iterations"].value == live
    assert 0 < live < metrics["specjax:spec_decode_slot_iterations"].value
    if policy is TABLE:
        assert ran[0] and ran[1] and ran[K]
        for t in trace:   # the tier is chosen at each segment's start, by the rows live then
            starts = range(0, len(t.k_per_step), adaptive.SEGMENT)
            assert all(t.k_per_step[i] == {1: 3, 2: 3, 3: 0, 4: 0, 5: 0}.get(t.live_per_step[i], 1) for i in starts)
            assert all(len(set(t.k_per_step[i:i + adaptive.SEGMENT])) == 1 for i in starts)
    if method == "draft_model":
        # Self-drafting accepts every draft, however many plain steps the drafter had to catch up on.
        assert metrics["vllm:spec_decode_num_accepted_tokens"].value == \
            metrics["vllm:spec_decode_num_draft_tokens"].value > 0
    if method == "eagle3" and policy is AUTO:
        assert ran[0] > ran[K] > 0    # a random head loses: mostly plain steps, with probes


def test_positions_without_a_draft_count_against_speculating(tiny_dir, default_model_dir, workload, plain_tokens,
                                                             monkeypatch):
    """An n-gram proposer that finds no match drafts nothing, yet its tier still pays for a k + 1 verify pass:
    auto must read that as rejection and fall back to plain steps with probes (when only drafted positions
    counted, the rates never moved from their optimistic start and every step ran k_max)."""
    from specjax.engine.proposers import ngram

    def no_match(self, draft_state, carry, tokens, lengths, rows):
        return jnp.full((tokens.shape[0], self.k), ngram.NO_DRAFT, jnp.int32), None, carry

    monkeypatch.setattr(ngram.NgramProposer, "propose", no_match)
    spec = {"method": "ngram", "num_speculative_tokens": K, "speculation_policy": "auto",
            "step_costs": {0: 1.0, 1: 1.2, 2: 1.4, 3: 1.6}}
    llm = _llm(tiny_dir, default_model_dir, spec)
    outs = llm.generate(*workload, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain_tokens
    ran = collections.Counter(k for t in llm.speculation_trace() for k in t.k_per_step)
    assert ran[0] > ran[1] + ran[2] + ran[K] > 0, ran   # plain steps, and probes (at raised rates: k = 1 or K)


def test_shadows_emit_what_their_tier_would(tiny_dir, default_model_dir, workload, plain_tokens, monkeypatch):
    """An n-gram proposer whose drafts after the first are wrong, with shadows due at every k = 1 choice (a budget
    any draft cost fits): auto runs k = 1 and its shadows, and the output is plain decoding's. (A shadow's last
    token is rejection sampling's token after one more draft: test_rejection.py checks that every slot's token
    follows the target's distribution.)"""
    from specjax.engine.proposers import ngram
    found, vocab = ngram.NgramProposer.propose, json.loads((tiny_dir / "config.json").read_text())["vocab_size"]

    def first_right(self, draft_state, carry, tokens, lengths, rows):
        drafts, probs, carry = found(self, draft_state, carry, tokens, lengths, rows)
        wrong = jnp.where(drafts[:, 1:] >= 0, (drafts[:, 1:] + 1) % vocab, drafts[:, 1:])
        return drafts.at[:, 1:].set(wrong), probs, carry

    monkeypatch.setattr(ngram.NgramProposer, "propose", first_right)
    monkeypatch.setattr(adaptive, "SHADOW_BUDGET", 1e6)
    spec = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
            "speculation_policy": "auto", "step_costs": {0: 1.0, 1: 1.2, 2: 1.4, 3: 1.6}}
    llm = _llm(tiny_dir, default_model_dir, spec)
    outs = llm.generate(*workload, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain_tokens
    steps = [(k, shadow) for t in llm.speculation_trace() for k, shadow in zip(t.k_per_step, t.shadow_per_step)]
    shadows = collections.Counter(k for k, shadow in steps if shadow)
    assert set(shadows) == {1} and shadows[1] > 0, collections.Counter(steps)
    metrics = {m.name: m for m in llm.get_metrics()}
    assert metrics["specjax:spec_decode_shadow_iterations"].value == shadows[1]


TREE = {"tree_nodes": 6, "tree_branching": 2}


@pytest.mark.parametrize("method, policy", [
    ("ngram", {"num_speculative_tokens_per_batch_size": [[1, 2, K], [3, 5, 0], [6, 8, K]]}), ("eagle3", AUTO),
    ("draft_model", {"num_speculative_tokens_per_batch_size": [[1, 4, 0], [5, 8, K]]})],
    ids=["ngram-table", "eagle3-auto", "draft-table"])
def test_draft_trees_switch_with_plain_steps_and_stay_exact(tiny_dir, default_model_dir, workload, plain_tokens,
                                                            eagle3_head, method, policy):
    """Under an adaptive policy a tree drafter's tiers are plain steps and its tree; it catches up after the
    plain ones (a head from its ring, a draft model from the committed tokens)."""
    drafter = {"ngram": {"prompt_lookup_min": 1, "prompt_lookup_max": 3}, "draft_model": {"model": str(tiny_dir)},
               "eagle3": {"model": str(eagle3_head)}}[method]
    spec = {"method": method, "num_speculative_tokens": K, **drafter, **TREE, **policy}
    if method == "eagle3":
        spec["step_costs"] = {0: 1.0, K: 2.0}
    llm = _llm(tiny_dir, default_model_dir, spec)
    outs = llm.generate(*workload, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain_tokens
    ran = collections.Counter(k for t in llm.speculation_trace() for k in t.k_per_step)
    assert set(ran) == {0, K}


def test_a_trees_table_takes_only_plain_steps_and_the_tree():
    with pytest.raises(ValueError, match="K is 0 .* or num_speculative_tokens"):
        _spec(num_speculative_tokens_per_batch_size=[[1, 8, 1]], **TREE)
    assert _spec(speculation_policy="auto", **TREE).policy.tiers == (0, K)


def test_seeded_sampling_is_reproducible_under_the_auto_policy(tiny_dir, default_model_dir, workload):
    prompts, _ = workload
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=12, ignore_eos=True) for i in range(SLOTS)]
    spec = {"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_min": 1, "speculation_policy": "auto",
            "step_costs": {0: 1.0, 1: 1.2}}
    llm = _llm(tiny_dir, default_model_dir, spec)
    runs = [[o.outputs[0].token_ids for o in llm.generate(prompts[:SLOTS], params, use_tqdm=False)]
            for _ in range(2)]
    assert runs[0] == runs[1] and all(len(t) == 12 for t in runs[0])


# ------------------------------------------------------------------------------------------------------------
# the k = 0 tier is a plain step
# ------------------------------------------------------------------------------------------------------------

ROWS = RowParams(temperature=jnp.zeros((2,)), top_k=jnp.zeros((2,), jnp.int32), top_p=jnp.ones((2,)),
                 min_p=jnp.zeros((2,)), seed=jnp.arange(2, dtype=jnp.uint32), max_tokens=jnp.full((2,), 8, jnp.int32),
                 min_tokens=jnp.zeros((2,), jnp.int32), stop_ids=jnp.full((2, 1), -1, jnp.int32))


def _prefilled(runner, adaptive_loop: bool):
    """The runner's loop spec, a prefilled state of two rows and the target module, to trace loop parts over."""
    prompts = np.asarray([[5, 6, 7, 5, 6, 7, 5, 6] * 2] * 2, np.int32)
    lengths = np.asarray([16, 9], np.int32)
    spec = runner._spec(0, True, False, None)
    prefill, _ = loop.build_stream(runner.target_graph, runner.proposer, spec)
    inputs = adaptive.policy_inputs(np.ones(len(spec.policy.tiers), np.float32)) if adaptive_loop else None
    state = prefill(runner.target_state, runner.draft_state, prompts, lengths, ROWS, 48, inputs)
    return spec, state, nnx.merge(runner.target_graph, runner.target_state)


def _step_counts(runner, k: int, adaptive_loop: bool) -> collections.Counter:
    """Primitives of one loop step of k drafts, as an adaptive loop's tier or a fixed loop's step."""
    spec, state, target = _prefilled(runner, adaptive_loop)
    step = loop._tier_step(target, runner.proposer, runner.draft_state, ROWS, spec, None, k, adaptive=adaptive_loop)
    return primitive_counts(step, state)


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle3"])
def test_the_plain_tier_runs_no_proposer_and_no_verification(tiny_dir, default_model_dir, eagle3_head, method):
    """The adaptive loop's k = 0 branch traces to the plain loop's step: the same matmuls, no draft weights
    read, no while or cond of a proposer; an EAGLE head's branch adds only the scatter keeping the pass."""
    drafter = {"ngram": {}, "draft_model": {"model": str(tiny_dir)}, "eagle3": {"model": str(eagle3_head)}}[method]
    llm = _llm(tiny_dir, default_model_dir, {"method": method, "num_speculative_tokens": K, **drafter, **TABLE})
    plain = _llm(tiny_dir, default_model_dir)
    tier0, plain_step = _step_counts(llm._runner, 0, True), _step_counts(plain._runner, 0, False)
    assert isinstance(plain._runner.proposer, NoProposer)
    assert tier0["dot_general"] == plain_step["dot_general"] > 0
    assert tier0["while"] == plain_step["while"] and tier0["cond"] == plain_step["cond"]
    extra = {name: n - plain_step[name] for name, n in tier0.items() if n != plain_step[name]}
    if method != "eagle3":
        assert extra == {}
        return
    assert extra.pop("scatter") == 1
    assert not set(extra) & {"dot_general", "while", "cond", "exp", "log", "argmax", "reduce_max", "sort"}


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_a_drafting_tier_is_the_fixed_loops_step_and_a_segment_catches_up_once(tiny_dir, default_model_dir,
                                                                              eagle3_head, method):
    """The adaptive loop's k = K tier traces to the fixed loop's step, primitive for primitive: its proposer
    catches up once per segment, ahead of the tiers, not in every step (a loop of no trips in each step cost
    ~90 us per iteration at 8 slots on an H100; benchmarks/RESULTS.md, "Adaptive k at 8 slots: the catch-up")."""
    drafter = {"draft_model": {"model": str(tiny_dir)}, "eagle3": {"model": str(eagle3_head)}}[method]
    spec = {"method": method, "num_speculative_tokens": K, **drafter}
    adaptive_llm = _llm(tiny_dir, default_model_dir, {**spec, **TABLE})
    fixed = _llm(tiny_dir, default_model_dir, spec)
    assert _step_counts(adaptive_llm._runner, K, True) == _step_counts(fixed._runner, K, False)
    runner = adaptive_llm._runner
    spec, state, target = _prefilled(runner, True)
    calls = []
    catch_up = runner.proposer.catch_up
    with mock.patch.object(runner.proposer, "catch_up", lambda *a: calls.append(a[-1]) or catch_up(*a)):
        jax.make_jaxpr(loop._body_fn(target, runner.proposer, runner.draft_state, ROWS, spec, None,
                                     lambda s: jnp.any(~s.done)))(state)
    assert len(calls) == 1 and calls[0].dtype == jnp.bool_   # once, told whether the chosen tier drafts


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_a_shadow_step_commits_its_tiers_tokens_and_counts_its_own_draft(tiny_dir, default_model_dir, eagle3_head,
                                                                         method):
    """Tier 1 and its shadow commit the same tokens, lengths and counters, and leave the proposer drafting the
    same next step; the shadow's second draft (verified at the bonus position) counts only in its verdicts. A draft
    model drafting for itself has every draft accepted, the shadow's too."""
    drafter = {"draft_model": {"model": str(tiny_dir)}, "eagle3": {"model": str(eagle3_head)}}[method]
    spec = {"method": method, "num_speculative_tokens": K, **drafter, **AUTO}
    runner = _llm(tiny_dir, default_model_dir, spec)._runner
    loop_spec, state, target = _prefilled(runner, True)

    def tier_1(shadow: bool):
        return jax.jit(loop._tier_step(target, runner.proposer, runner.draft_state, ROWS, loop_spec, None, 1,
                                       adaptive=True, shadow=shadow))

    (tier, tier_verdicts), (shadowed, shadow_verdicts) = tier_1(False)(state), tier_1(True)(state)
    (tier, _), (shadowed, _) = tier_1(False)(tier), tier_1(False)(shadowed)   # the next step, from either
    for field in ("tokens", "lengths"):
        np.testing.assert_array_equal(getattr(tier, field), getattr(shadowed, field))
    jax.tree.map(np.testing.assert_array_equal, tier.counters, shadowed.counters)
    tier_verdicts, shadow_verdicts = np.asarray(tier_verdicts), np.asarray(shadow_verdicts)
    np.testing.assert_array_equal(np.minimum(shadow_verdicts, 1), tier_verdicts)
    if method == "draft_model":
        assert shadow_verdicts.tolist() == [2, 2]


# ------------------------------------------------------------------------------------------------------------
# catching up after plain steps == having drafted all along
# ------------------------------------------------------------------------------------------------------------

TINY = dict(architectures=["LlamaForCausalLM"], vocab_size=61, hidden_size=32, intermediate_size=48,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5,
            rope_theta=1e4, tie_word_embeddings=True, max_position_embeddings=256)


def _rows(B: int) -> RowParams:
    return RowParams(temperature=jnp.zeros((B,)), top_k=jnp.zeros((B,), jnp.int32), top_p=jnp.ones((B,)),
                     min_p=jnp.zeros((B,)), seed=jnp.arange(B, dtype=jnp.uint32),
                     max_tokens=jnp.full((B,), 50, jnp.int32), min_tokens=jnp.zeros((B,), jnp.int32),
                     stop_ids=jnp.full((B, 1), -1, jnp.int32))


@pytest.mark.parametrize("plain_steps", [1, 5, 20])
def test_a_draft_model_caught_up_drafts_as_if_it_never_paused(plain_steps):
    """Draft KV after catch_up over plain_steps committed tokens (a row that paused) equals the KV of a
    prefill over every committed token, and so do the drafts; a row that did not pause is left as it was."""
    cfg = LlamaConfig.from_hf_dict(TINY)
    graph, state = nnx.split(FAMILY.random(cfg, seed=3))
    S, k = 48, 2
    proposer = DraftModelProposer(graph, k, probabilistic=False, cache_bytes=lambda b, n: 0)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 61, (2, S)), jnp.int32)
    prompt = jnp.asarray([6, 9], jnp.int32)
    prompt_tokens = jnp.where(jnp.arange(16)[None, :] < prompt[:, None], tokens[:, :16], 0)
    init, propose = jax.jit(proposer.init, static_argnums=3), jax.jit(proposer.propose)
    carry = init(state, prompt_tokens, prompt, S)
    lengths = prompt + jnp.asarray([1 + plain_steps, 1])   # row 0 paused for plain_steps, row 1 did not
    caught = jax.jit(proposer.catch_up)(state, carry, tokens, lengths, _rows(2))
    _assert_same(jax.jit(proposer.catch_up)(state, carry, tokens, lengths, _rows(2), False), carry)  # a plain tier
    fresh = init(state, tokens, jnp.full((2,), S, jnp.int32), S)
    valid = int(lengths[0]) - 2
    np.testing.assert_allclose(caught.cache.k[:, 0, :, :valid], fresh.cache.k[:, 0, :, :valid], atol=1e-5)
    np.testing.assert_allclose(caught.cache.v[:, 0, :, :valid], fresh.cache.v[:, 0, :, :valid], atol=1e-5)
    np.testing.assert_allclose(caught.cache.k[:, 1, :, :int(prompt[1])], carry.cache.k[:, 1, :, :int(prompt[1])],
                               atol=1e-5)
    drafts, _, _ = propose(state, caught, tokens, lengths, _rows(2))
    reference, _, _ = propose(state, fresh, tokens, lengths, _rows(2))
    assert drafts[0].tolist() == reference[0].tolist()


# catch_up's two forms: a conditional (caches up to CATCH_UP_COPY_BYTES) and a loop of at most one trip.
CATCH_UP_FORMS = {"conditional": eagle_proposer.CATCH_UP_COPY_BYTES, "loop": 0}


@pytest.mark.parametrize("form", CATCH_UP_FORMS)
@pytest.mark.parametrize("layout", ["eagle1_yuhuili", "eagle3_yuhuili"])
@pytest.mark.parametrize("plain_steps", [1, 4, PROBE_EVERY])
def test_a_head_caught_up_after_plain_steps_equals_one_that_observed_each(tmp_path, monkeypatch, layout,
                                                                          plain_steps, form):
    """A head that skipped plain_steps one-token passes, then caught up, holds the carry (first draft, fed-back
    hidden state, valid KV) of a head that observed each pass; in a batch with a row that kept observing."""
    monkeypatch.setattr(eagle_proposer, "CATCH_UP_COPY_BYTES", CATCH_UP_FORMS[form])
    cfg = LlamaConfig.from_hf_dict(TINY)
    graph, target_state = nnx.split(FAMILY.random(cfg, seed=0))
    target_state = jax.tree.map(lambda x: x * 3, target_state)
    target = nnx.merge(graph, target_state)
    method = "eagle" if layout.startswith("eagle1") else "eagle3"
    head = load_eagle_head(write_head(tmp_path / layout, TINY, layout, scale=0.3), method, cfg, target_state,
                           np.float32)
    head_graph, head_state = nnx.split(head)
    features = cfg.hidden_size * max(1, len(head.capture_layers))
    proposer = HeadProposer(head_graph, head, 3, probabilistic=False, feature_size=features,
                            catch_up_window=PROBE_EVERY)
    S, B = 64, 2
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, 61, (B, S)), jnp.int32)
    rows = _rows(B)
    observe, skipped = jax.jit(proposer.observe), jax.jit(proposer.skipped)

    def target_pass(start, T, cache):
        window = jnp.take_along_axis(tokens, start[:, None] + jnp.arange(T)[None, :], axis=1)
        hidden, cache, aux = target(window, start, cache, capture_layers=proposer.capture_layers)
        return TargetPass(hidden, aux.captured, start), cache

    lengths = jnp.asarray([8, 8], jnp.int32)
    passed, cache = target_pass(jnp.zeros((B,), jnp.int32), 8, target.init_cache(B, S))
    start_carry = observe(head_state, proposer.init(head_state, tokens[:, :8], lengths - 1, S), passed, tokens,
                          lengths, rows)
    observed, paused = start_carry, start_carry
    for _ in range(plain_steps):
        passed, cache = target_pass(lengths - 1, 1, cache)
        lengths = lengths + 1
        observed = observe(head_state, observed, passed, tokens, lengths, rows)
        # Row 1 kept observing, row 0 paused.
        skip = skipped(head_state, paused, passed, tokens, lengths, rows)
        both = observe(head_state, paused, passed, tokens, lengths, rows)
        paused = _row0_from(skip, both, B)
    caught = jax.jit(proposer.catch_up)(head_state, paused, tokens, lengths, rows)
    _assert_same(jax.jit(proposer.catch_up)(head_state, paused, tokens, lengths, rows, False), paused)
    valid = int(lengths[0]) - 1
    # One pass over the kept positions against one pass per position: fp32 rounding, on hidden states up to 40.
    np.testing.assert_allclose(caught.hidden, observed.hidden, atol=1e-4)
    assert caught.first.tolist() == observed.first.tolist()
    np.testing.assert_allclose(caught.cache.k[:, :, :, :valid], observed.cache.k[:, :, :, :valid], atol=1e-5)
    np.testing.assert_allclose(caught.cache.v[:, :, :, :valid], observed.cache.v[:, :, :, :valid], atol=1e-5)


@pytest.mark.parametrize("form", CATCH_UP_FORMS)
def test_a_head_with_nothing_to_catch_up_is_left_as_it_was(tmp_path, monkeypatch, form):
    """catch_up where no row skipped a pass returns the carry bit for bit, as a conditional for a small cache and
    as a loop (no conditional, which would copy the cache) for a large one."""
    monkeypatch.setattr(eagle_proposer, "CATCH_UP_COPY_BYTES", CATCH_UP_FORMS[form])
    cfg = LlamaConfig.from_hf_dict(TINY)
    graph, target_state = nnx.split(FAMILY.random(cfg, seed=0))
    head = load_eagle_head(write_head(tmp_path / "head", TINY, "eagle3_yuhuili", scale=0.3), "eagle3", cfg,
                           target_state, np.float32)
    head_graph, head_state = nnx.split(head)
    proposer = HeadProposer(head_graph, head, 3, probabilistic=False,
                            feature_size=cfg.hidden_size * len(head.capture_layers), catch_up_window=PROBE_EVERY)
    S, B = 64, 2
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 61, (B, S)), jnp.int32)
    lengths = jnp.asarray([9, 12], jnp.int32)
    carry = proposer.init(head_state, tokens[:, :12], lengths - 1, S)
    carry = jax.tree.map(lambda x: x + 1 if x.dtype == jnp.float32 else x, carry)   # not the zeros init writes
    _assert_same(jax.jit(proposer.catch_up)(head_state, carry, tokens, lengths, _rows(B)), carry)
    counts = primitive_counts(proposer.catch_up, head_state, carry, tokens, lengths, _rows(B))
    assert (counts["cond"], counts["while"]) == ((1, 0) if form == "conditional" else (0, 1))


def _assert_same(carry, expected):
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), carry, expected)


def _row0_from(skipped_carry, observed_carry, B: int):
    """A carry whose row 0 skipped the pass and whose row 1 observed it (the head's cache keeps the batch on
    axis 1; the other leaves on axis 0)."""
    def pick(skip, seen, axis):
        mask = (jnp.arange(B) == 0).reshape((1,) * axis + (B,) + (1,) * (skip.ndim - axis - 1))
        return jnp.where(mask, skip, seen)

    cache = jax.tree.map(lambda s, o: pick(s, o, 1), skipped_carry.cache, observed_carry.cache)
    rest = {name: pick(getattr(skipped_carry, name), getattr(observed_carry, name), 0)
            for name in ("first", "first_probs", "hidden", "pending", "pending_from")}
    return adaptive.dataclasses.replace(observed_carry, cache=cache, **rest)


# ------------------------------------------------------------------------------------------------------------
# step times: measured once per shape and stored
# ------------------------------------------------------------------------------------------------------------

def test_step_times_are_the_slope_over_iterations():
    """A fake loop whose iterations cost tier+1 ms plus a fixed 5 ms, and every fourth call 40 ms more (another
    job on the machine): the measured costs are the slopes, the slow calls ignored."""
    import itertools
    import time

    class State:
        def __init__(self, steps):
            self.steps = np.int32(steps)

    calls = itertools.count()

    def run(inputs, rows):
        steps = int(np.max(rows.max_tokens))
        spike = 0.04 if next(calls) % 4 == 3 else 0.0
        time.sleep(0.005 + spike + steps * (int(inputs.forced_tier) + 1) * 1e-3)
        return State(steps)

    costs = calibration.measure_step_costs(run, _rows(2), 3, room=32)
    np.testing.assert_allclose(costs, [1e-3, 2e-3, 3e-3], rtol=0.15)
    assert calibration.measure_step_costs(run, _rows(2), 3, room=2) == (1.0, 1.0, 1.0)


def _clocked_loop(monkeypatch, slow: dict | None = None):
    """A fake compiled loop on calibration's clock: a run of tier t for n tokens takes 5 ms + n (t + 1) ms, times
    slow[(t, n)][i] on its i-th call where given. Returns run(inputs, rows) and the (tier, tokens) of each call."""
    import types

    now, calls, slow = [0.0], [], slow or {}

    class State:
        def __init__(self, steps):
            self.steps = np.int32(steps)

    def run(inputs, rows):
        case = (int(inputs.forced_tier), int(np.max(rows.max_tokens)))
        spell, seen = slow.get(case, ()), calls.count(case)
        now[0] += (0.005 + case[1] * (case[0] + 1) * 1e-3) * (spell[seen] if seen < len(spell) else 1.0)
        calls.append(case)
        return State(case[1])

    monkeypatch.setattr(calibration, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    return run, calls


def test_calibration_on_a_quiet_machine_runs_each_tier_twice(monkeypatch):
    """A compiling run, then two timed rounds of the one-token run (the fixed costs, shared by every tier) and
    one run per tier, when the second round leaves every time where the first put it."""
    run, calls = _clocked_loop(monkeypatch)
    costs = calibration.measure_step_costs(run, _rows(2), 3, room=32)
    np.testing.assert_allclose(costs, [1e-3, 2e-3, 3e-3], rtol=0.05)
    assert sorted(set(calls)) == [(0, 1), (0, 32), (1, 32), (2, 32)]
    assert len(calls) == 1 + 2 * 4


def test_calibration_goes_on_until_each_fastest_time_is_seen_twice(monkeypatch):
    """Plain decoding's run is 5% slow in the first round and 10% in the second, every other run quiet: the second
    round lowers no fastest time, but plain's is not yet seen twice, so the rounds go on until its quiet time is,
    and plain's cost is its quiet slope (plain's step rounded up is what made deeper tiers look cheap)."""
    run, calls = _clocked_loop(monkeypatch, {(0, 32): (1.05, 1.1)})
    costs = calibration.measure_step_costs(run, _rows(2), 3, room=32)
    np.testing.assert_allclose(costs, [(32 * (tier + 1) - 1) * 1e-3 / 31 for tier in range(3)], rtol=1e-9)
    assert calls.count((0, 32)) == 4   # the compiling run is (0, 1): rounds 3 and 4 confirm plain's quiet time


def test_auto_calibrates_a_shape_once_and_stores_it(tiny_dir, default_model_dir, workload, monkeypatch, tmp_path):
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
    spec = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "speculation_policy": "auto"}
    prompts, params = workload[0][:SLOTS], workload[1][:SLOTS]
    _llm(tiny_dir, default_model_dir, spec).generate(prompts, params, use_tqdm=False)
    stored = json.loads((tmp_path / "step_costs.json").read_text())
    assert len(stored) == 1 and all(c > 0 for c in next(iter(stored.values())))
    assert len(next(iter(stored.values()))) == len(auto_tiers(K))

    def refuse(*args, **kwargs):
        raise AssertionError("calibrated again")

    monkeypatch.setattr("specjax.engine.runner.measure_step_costs", refuse)
    again = _llm(tiny_dir, default_model_dir, spec)
    again.generate(prompts, params, use_tqdm=False)
    np.testing.assert_allclose(again._runner.step_costs(), list(stored.values()), rtol=1e-6)   # what it weighed


def test_an_engines_next_call_starts_from_its_last_calls_rates(tiny_dir, default_model_dir, workload, monkeypatch,
                                                              tmp_path):
    """A call's loop starts from the running rates the engine's last call ended with, counted as the optimistic
    start is (so its first probe's verdicts replace them); calibration, the first call and the next share one
    executable."""
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
    spec = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "speculation_policy": "auto"}
    prompts, params = workload[0][:SLOTS], workload[1][:SLOTS]
    llm = _llm(tiny_dir, default_model_dir, spec)
    runner, passed = llm._runner, []
    generate_fn = runner.generate_fn

    def recording(*key):
        fn = generate_fn(*key)
        return mock.Mock(side_effect=lambda *args: passed.append(args[-1]) or fn(*args))

    monkeypatch.setattr(runner, "generate_fn", recording)
    llm.generate(prompts, params, use_tqdm=False)   # calibrates, then runs
    first = runner.start_rates
    assert first.shape == (K,) and np.any(first < 1)
    assert all(np.array_equal(p.start, np.ones(K)) for p in passed)
    llm.generate(prompts, params, use_tqdm=False)
    np.testing.assert_array_equal(passed[-1].start, first)
    assert runner._compiled[next(iter(runner._compiled))]._cache_size() == 1
    state = adaptive.init_adapt(K, 8, passed[-1])
    np.testing.assert_array_equal(state.acceptance, first)
    np.testing.assert_array_equal(state.verdicts, np.full(K, adaptive.OPTIMISTIC_VERDICTS))


def test_admission_calibrates_on_its_own_program(tiny_dir, default_model_dir, workload, plain_tokens, monkeypatch,
                                                tmp_path):
    """Under continuous admission the step times are measured on the admitting loop itself (a queue of only the
    first slots' requests): no wave program is compiled beside it, and the outputs stay plain decoding's."""
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
    spec = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "speculation_policy": "auto"}
    llm = LLM(str(tiny_dir), tokenizer=str(default_model_dir), max_model_len=MAX_LEN, max_num_seqs=SLOTS,
              speculative_config=spec)
    n = 2 * SLOTS + 3
    outs = llm.generate(workload[0][:n], workload[1][:n], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain_tokens[:n]
    stored = json.loads((tmp_path / "step_costs.json").read_text())
    assert len(stored) == 1 and f"rows={SLOTS}" in next(iter(stored))
    assert llm._runner._compiled == {} and len(llm._runner._admitting) == 1


def test_the_functional_core_runs_the_table_policy(tiny_dir, default_model_dir, workload, plain_tokens):
    from specjax.functional import make_generate_fn

    prompts, params = workload
    spec = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, **TABLE}
    llm = _llm(tiny_dir, default_model_dir, spec)
    new = 12
    fn = jax.jit(make_generate_fn(llm, SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)))
    ids = [p["prompt_token_ids"] for p in prompts[:SLOTS]]
    lengths = np.asarray([len(t) for t in ids], np.int32)
    padded = np.zeros((SLOTS, 16), np.int32)
    for b, t in enumerate(ids):
        padded[b, :len(t)] = t
    tokens, ends, stats = fn(llm.params, llm.draft_params, padded, lengths, jax.random.key(0))
    for b in range(SLOTS):
        got = np.asarray(tokens[b, lengths[b]:ends[b]]).tolist()
        assert got[:params[b].max_tokens] == plain_tokens[b][:new]
    steps = int(np.sum(np.asarray(stats["live_per_step"]) > 0))
    assert set(np.asarray(stats["k_per_step"])[:steps].tolist()) <= {0, 1, 3}

    auto = _llm(tiny_dir, default_model_dir, {**spec, "num_speculative_tokens_per_batch_size": None,
                                              "speculation_policy": "auto"})
    with pytest.raises(ValueError, match="step_costs"):
        make_generate_fn(auto, SamplingParams(max_tokens=4))
