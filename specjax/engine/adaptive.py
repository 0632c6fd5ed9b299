"""Adaptive speculation on the device: which compiled k tier the next loop iterations run, and the statistics
that choice reads (running per-position acceptance, and a record of each iteration's k and live rows).

Each tier is a while loop in the loop body (loop.py), a segment of iterations of its k that runs when chosen
(SEGMENT of them; a plain tier chosen on its merits, until the next probe is due); k = 0 is a plain decode
step. "auto" scores a tier k by the tokens a row expects from it, 1 + sum_{i<k} prod_{j<=i} a_j with a_j the
running conditional acceptance at draft position j, over the tier's step time, and takes the best (plain only
when it wins beyond the rates' noise: PLAIN_MARGIN_SE). Dead rows
cost as much as live ones in a compiled batch, so the step times are per compiled shape and the live count
enters through the statistics.
The choice is one k for every row: a tier's verify pass is one static width for the whole batch, so a row that
drafted fewer tokens than its tier would save no work, only lose the chance of its drafts being accepted.
A tier not run stops updating its positions' rates, so after `probe_gap` plain steps in a row the loop probes:
it runs the speculative tier that would win at rates PLAIN_MARGIN_SE standard errors up (the largest while
positions have no verdicts behind them, as at the start; k = 1 where later drafts are known to fail), the cheapest
step that could show speculation winning. The gap starts at PROBE_EVERY and doubles after each probe up to
PROBE_MAX, and a speculative tier chosen on its merits sets it back. A probe runs until about PROBE_SAMPLES first
drafts were verified (PROBE_MAX_STEPS for a few rows, one step for many) and moves the running rates as far as a
segment's steps would: where speculation keeps losing, many rows pay a losing step per probe rather than a losing
segment.
Likewise a speculative tier below k_max does not measure the position above it, so drafts that come good deeper
would go unseen while a shallow tier runs. Every so often its segment is a shadow: it drafts one token more and
verifies that draft at the bonus position, as rejection sampling would, without widening the verify pass. It emits
what the tier emits (the last token, the draft accepted or the residual drawn, is distributed as the bonus is),
at the cost of one draft step; shadows come as often as keeps that extra cost near SHADOW_BUDGET of the step
time. A shadow's verdict only raises the position's rate: below the tier every step measures, but above it a
rate is a hope that the tier cannot re-measure, and a stale high one is what takes auto straight back to deep
drafts when a drafter comes good again (benchmarks/RESULTS.md, "Shadow drafts").
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.config.speculation_policy import PROBE_EVERY, PROBE_MAX, SpeculationPolicy

# Iterations per choice: each choice costs the choice's own work and one predicate per tier (loop.py), an eighth
# of it per step at SEGMENT = 8. PROBE_EVERY is a multiple, so probes fall on segment starts.
SEGMENT = 8
# Weight of the newest step in the running acceptance (about the last 1 / EMA_WEIGHT steps count).
EMA_WEIGHT = 0.25
# First drafts a probe verifies: its steps are PROBE_SAMPLES / live rows, from one to PROBE_MAX_STEPS.
PROBE_SAMPLES = 32
# A probe's most steps (few rows): half a segment. A whole one made the largest tier's probes most of what auto lost
# where plain decoding wins at 1-4 rows (benchmarks/RESULTS.md, "Plain only when speculation loses beyond the
# rates' noise").
PROBE_MAX_STEPS = SEGMENT // 2
# Rows whose verdicts at a position weigh as a whole step; fewer weigh less, each row as much as an eighth of a step
# (compounded), so that one or two rows' luck does not switch tiers (benchmarks/RESULTS.md, "The running
# acceptance weighs rows").
FULL_STEP_ROWS = 8
# Verdicts the optimistic start (every draft accepted) counts as: the first verdicts at a position replace it as an
# average would (a row's verdict weighs 1 / (verdicts so far + 1)) until the running weight above is the larger.
OPTIMISTIC_VERDICTS = 1.0
# Standard errors of a running rate the plain tier must win by: plain steps record no verdicts, so a plain choice
# holds until the next probe (16-128 steps) where a speculative one is looked at again after a segment; plain is
# chosen only when speculation loses even at rates this many standard errors up (benchmarks/RESULTS.md, "Plain only
# when speculation loses beyond the rates' noise").
PLAIN_MARGIN_SE = 1.0
# Share of the step time shadow steps may add. A shadow's extra cost is one draft step, estimated as the next tier's
# step time over this one's per draft: an upper bound, as that increment also pays for a wider verify pass.
SHADOW_BUDGET = 0.005


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PolicyInputs:
    """What the host hands an adaptive loop, traced (changing it does not recompile)."""
    step_costs: jax.Array    # f32 [n_tiers]: each tier's step time, relative units
    forced_tier: jax.Array   # i32 []: run this tier every iteration (calibration); -1 = choose
    # f32 [k_max]: the running rates the loop starts from, weighed as the optimistic start is (an engine passes
    # its last call's: test_an_engines_next_call_starts_from_its_last_calls_rates); None: every draft accepted
    start: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AdaptState:
    """The adaptive loop's carry beside the rows'."""
    acceptance: jax.Array    # f32 [k_max]: running P(draft j accepted | drafts before j accepted)
    verdicts: jax.Array      # f32 [k_max]: verdicts recorded at each position, OPTIMISTIC_VERDICTS at the start
    support: jax.Array       # f32 [k_max]: verdicts each running rate rests on, older ones decayed as it weighs them
    plain_run: jax.Array     # i32 []: plain (k = 0) iterations since the last speculative one; a probe's gap at first
    probe_gap: jax.Array     # i32 []: plain iterations in a row after which a probe runs
    # i32 []: iterations of a speculative tier below k_max in a row since a shadow or a k_max step last measured the
    # position above (a plain step starts it again)
    shallow_run: jax.Array
    # i32 [S + 1, 3]: row i + 1 holds iteration i's k, live rows and whether it was a shadow (row 0 unused), one
    # array so that a step writes once, at the loop's count after it: the count before it, read beside the count's
    # in-place update, made XLA copy it every step.
    per_step: jax.Array
    inputs: PolicyInputs

    @property
    def k_per_step(self) -> jax.Array:
        """i32 [S]: iteration i drafted k_per_step[i] tokens per row."""
        return self.per_step[1:, 0]

    @property
    def live_per_step(self) -> jax.Array:
        """i32 [S]: rows running at iteration i."""
        return self.per_step[1:, 1]

    @property
    def shadow_per_step(self) -> jax.Array:
        """i32 [S]: 1 where iteration i drafted one token more than its k, to measure the next position."""
        return self.per_step[1:, 2]


def policy_inputs(step_costs, forced_tier: int = -1) -> PolicyInputs:
    return PolicyInputs(jnp.asarray(step_costs, jnp.float32), jnp.asarray(forced_tier, jnp.int32))


def init_adapt(k_max: int, max_steps: int, inputs: PolicyInputs) -> AdaptState:
    """Optimistic rates at first (every draft accepted, or inputs.start), counted as OPTIMISTIC_VERDICTS, and a
    probe due, so the loop speculates and measures before it judges, for a probe's steps (one at many rows) rather
    than a segment's: where speculation loses, a whole segment of the largest tier at the start was about half of
    what auto lost to plain decoding at 128 rows (benchmarks/RESULTS.md, "The first choice a probe"). A start from
    the last call's rates weighs no more than the optimistic one, so the first probe's verdicts replace it."""
    start = jnp.ones((k_max,), jnp.float32) if inputs.start is None else jnp.asarray(inputs.start, jnp.float32)
    return AdaptState(acceptance=start,
                      verdicts=jnp.full((k_max,), OPTIMISTIC_VERDICTS, jnp.float32),
                      support=jnp.full((k_max,), OPTIMISTIC_VERDICTS, jnp.float32),
                      plain_run=jnp.asarray(PROBE_EVERY, jnp.int32),
                      probe_gap=jnp.asarray(PROBE_EVERY, jnp.int32), shallow_run=jnp.zeros((), jnp.int32),
                      per_step=jnp.zeros((max_steps + 1, 3), jnp.int32), inputs=inputs)


def expected_tokens(acceptance: jax.Array, tiers: tuple[int, ...]) -> jax.Array:
    """f32 [n_tiers]: tokens a row emits per step of each tier under the running rates."""
    reach = jnp.concatenate([jnp.ones((1,), jnp.float32), jnp.cumprod(acceptance)])  # P(first i drafts accepted)
    return jnp.stack([jnp.sum(reach[:k + 1]) for k in tiers])


def segment_kinds(policy: SpeculationPolicy) -> tuple[tuple[int, bool], ...]:
    """The (k, shadow) segments an adaptive loop compiles: every tier, then (auto) a shadow of each speculative
    tier below k_max."""
    shadows = [(k, True) for k in policy.tiers if 0 < k < policy.tiers[-1]] if policy.mode == "auto" else []
    return tuple((k, False) for k in policy.tiers) + tuple(shadows)


def choose_tier(adapt: AdaptState, live: jax.Array,
                policy: SpeculationPolicy) -> tuple[jax.Array, jax.Array, jax.Array, AdaptState]:
    """The index into policy.tiers of the tier the next segment runs, whether it is a shadow, its length in steps
    (SEGMENT; fewer for a probe or a shadow of many rows, more for a plain tier chosen on its merits), and the
    state with its probe gap moved."""
    tiers = policy.tiers
    steps = jnp.asarray(SEGMENT, jnp.int32)
    shadow = jnp.zeros((), bool)
    if policy.mode == "table":
        chosen = _table_k(live, policy)
        tier = jnp.argmax(jnp.asarray(tiers) == chosen).astype(jnp.int32)
    else:
        tier, speculation_wins, probe_tier = _best_tier(adapt, tiers)
        probing = (adapt.plain_run >= adapt.probe_gap) & (adapt.inputs.forced_tier < 0)
        gap = jnp.where(probing, jnp.minimum(2 * adapt.probe_gap, PROBE_MAX),
                        jnp.where(speculation_wins, PROBE_EVERY, adapt.probe_gap))
        probe_steps = _steps_for_samples(live, PROBE_MAX_STEPS)
        # Plain steps record no verdicts, so a plain tier chosen on its merits stays the choice until a probe is
        # due: one segment runs until then, and its choice's work is paid once for all of those steps.
        until_probe = jnp.maximum(adapt.probe_gap - adapt.plain_run, SEGMENT)
        plain = (jnp.asarray(tiers)[tier] == 0) & (adapt.inputs.forced_tier < 0)
        steps = jnp.where(probing, probe_steps, jnp.where(plain, until_probe, steps)).astype(jnp.int32)
        tier = jnp.where(probing, probe_tier, tier)
        shadow, shadow_steps = _shadow_due(adapt, tier, live, tiers)
        shadow &= ~probing & (adapt.inputs.forced_tier < 0)
        steps = jnp.where(shadow, shadow_steps, steps).astype(jnp.int32)
        adapt = dataclasses.replace(adapt, probe_gap=gap.astype(jnp.int32))
    forced = adapt.inputs.forced_tier
    # Calibration times a forced plain tier as a plain choice runs, in segments until the next probe (PROBE_EVERY
    # at the least): timed in 8-step segments it carried their choices' launches, which a plain choice pays once
    # per probe gap, and so cost more than it does when chosen.
    forced_plain = (forced >= 0) & (jnp.asarray(tiers)[jnp.maximum(forced, 0)] == 0)
    steps = jnp.where(forced_plain, PROBE_EVERY, steps).astype(jnp.int32)
    return jnp.where(forced >= 0, forced, tier), shadow, steps, adapt


def _shadow_due(adapt: AdaptState, tier: jax.Array, live: jax.Array,
                tiers: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """Whether a segment of `tier` should be a shadow, and a shadow's steps: about PROBE_SAMPLES first drafts, one
    step for many rows up to a segment for few; due once the tier has run long enough since the last that the
    shadows' extra draft steps stay within SHADOW_BUDGET of the step time."""
    ks, costs = jnp.asarray(tiers), adapt.inputs.step_costs
    deeper = jnp.minimum(tier + 1, len(tiers) - 1)
    per_draft = jnp.maximum(costs[deeper] - costs[tier], 0.0) / jnp.maximum(ks[deeper] - ks[tier], 1)
    steps = _steps_for_samples(live, SEGMENT)
    gap = steps * per_draft / (SHADOW_BUDGET * costs[tier])
    return (ks[tier] > 0) & (ks[tier] < tiers[-1]) & (adapt.shallow_run >= gap), steps


def _steps_for_samples(live: jax.Array, most: int) -> jax.Array:
    """Steps of `live` rows that verify about PROBE_SAMPLES first drafts: one at many rows, at most `most`."""
    return jnp.clip(-(-PROBE_SAMPLES // jnp.maximum(live, 1)), 1, most).astype(jnp.int32)


def _best_tier(adapt: AdaptState, tiers: tuple[int, ...]) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The index of the tier with the most expected tokens per step time, but plain only where it also beats every
    speculative tier at rates PLAIN_MARGIN_SE standard errors up (else the best speculative tier); whether a
    speculative tier won on the running rates themselves (only that sets the probes' gap back: one kept on the
    benefit of the doubt would bring probes every PROBE_EVERY steps where speculation loses); and the index of the
    tier a probe runs, the best speculative one at those raised rates."""
    costs = adapt.inputs.step_costs
    score = expected_tokens(adapt.acceptance, tiers) / costs
    best = jnp.argmax(score).astype(jnp.int32)
    wins = jnp.asarray(tiers)[best] > 0
    if tiers[0] != 0:
        return best, wins, jnp.asarray(len(tiers) - 1, jnp.int32)
    hopeful = expected_tokens(upper_rates(adapt.acceptance, adapt.support, PLAIN_MARGIN_SE), tiers) / costs
    probe = (jnp.argmax(hopeful[1:]) + 1).astype(jnp.int32)
    speculation_may_win = hopeful[probe] > score[0]
    return jnp.where((best == 0) & speculation_may_win, jnp.argmax(score[1:]) + 1, best).astype(jnp.int32), wins, probe


def upper_rates(rate: jax.Array, support: jax.Array, z: float) -> jax.Array:
    """Wilson's upper bound of each rate at z standard errors, from the verdicts it rests on (sound near 0 and 1,
    where the normal approximation's error vanishes)."""
    n = jnp.maximum(support, 1e-6)
    spread = z * jnp.sqrt(rate * (1 - rate) / n + z * z / (4 * n * n))
    return jnp.clip((rate + z * z / (2 * n) + spread) / (1 + z * z / n), 0.0, 1.0)


def _table_k(live: jax.Array, policy: SpeculationPolicy) -> jax.Array:
    """vLLM's rows: K of the row whose [start_bs, end_bs] holds the live count; k_max outside every row."""
    k = jnp.asarray(policy.tiers[-1], jnp.int32)
    for start, end, row_k in policy.table:
        k = jnp.where((live >= start) & (live <= end), row_k, k)
    return k


def step_weight(segment_steps: jax.Array) -> jax.Array:
    """The newest step's weight in the running acceptance, for a segment of this many steps: EMA_WEIGHT for a
    whole segment, more for each step of a shorter probe, so that its steps move the rates as far."""
    return 1 - (1 - EMA_WEIGHT) ** (SEGMENT / segment_steps)


def record(adapt: AdaptState, steps_run: jax.Array, k: int, live: jax.Array, offered: jax.Array,
           accepted: jax.Array, active: jax.Array, segment_steps: jax.Array | int = SEGMENT,
           shadow: bool = False) -> AdaptState:
    """The statistics after an iteration ran tier k (static: a plain step has no verdicts to record): steps_run
    the iterations run so far, this one included, offered [B] the positions each row's verify pass had room for
    (a position without a draft counts as rejected), accepted [B] the drafts it accepted (a shadow's own
    included), active [B] the rows that were running, segment_steps the length of the segment it belongs to
    (step_weight), shadow (static) whether it drafted k + 1 to measure position k + 1: its steps weigh as a whole
    segment's, the tier's own (its verdicts below the shadow position are ordinary ones), however few it ran."""
    if k > 0:
        weighed_as = SEGMENT if shadow else segment_steps
        adapt = _with_verdicts(adapt, offered, accepted, active, weighed_as, k if shadow else None)
    slot = jnp.minimum(steps_run, adapt.per_step.shape[0] - 1)
    shallow = 0 < k < adapt.acceptance.shape[0] and not shadow
    row = jnp.stack([jnp.asarray(k, jnp.int32), live, jnp.asarray(shadow, jnp.int32)])
    return dataclasses.replace(
        adapt, plain_run=adapt.plain_run + 1 if k == 0 else jnp.zeros_like(adapt.plain_run),
        shallow_run=adapt.shallow_run + 1 if shallow else jnp.zeros_like(adapt.shallow_run),
        per_step=jax.lax.dynamic_update_slice(adapt.per_step, row[None], (slot, jnp.zeros_like(slot))))


def _with_verdicts(adapt: AdaptState, offered: jax.Array, accepted: jax.Array, active: jax.Array,
                   segment_steps: jax.Array | int, raise_only: int | None = None) -> AdaptState:
    """The running rates after one step's verdicts. A position's rate moves only when some row reached it with
    every earlier draft accepted (the condition of the conditional rate); n rows that reached it keep
    (1 - step weight) ** min(n / FULL_STEP_ROWS, 1) of the old rate, so eight one-row steps move it as far as
    one step of eight rows, or (early on, when more) keep v / (v + n) of it after v verdicts, as an average of
    every verdict so far would. At position index `raise_only` (a shadow's) the rate only rises."""
    j = jnp.arange(adapt.acceptance.shape[0])[None, :]
    reached = active[:, None] & (offered[:, None] > j) & (accepted[:, None] >= j)
    hits = jnp.sum(reached & (accepted[:, None] > j), axis=0)
    tries = jnp.sum(reached, axis=0)
    rate = hits / jnp.maximum(tries, 1)
    running = 1 - (1 - step_weight(segment_steps)) ** (jnp.minimum(tries, FULL_STEP_ROWS) / FULL_STEP_ROWS)
    weight = jnp.maximum(running, tries / (adapt.verdicts + tries))
    acceptance = jnp.where(tries > 0, (1 - weight) * adapt.acceptance + weight * rate, adapt.acceptance)
    support = jnp.where(tries > 0, (1 - weight) * adapt.support + tries, adapt.support)
    verdicts = adapt.verdicts + tries
    if raise_only is not None:
        kept = (j[0] == raise_only) & (acceptance < adapt.acceptance)
        acceptance, support, verdicts = (jnp.where(kept, old, new) for old, new in (
            (adapt.acceptance, acceptance), (adapt.support, support), (adapt.verdicts, verdicts)))
    return dataclasses.replace(adapt, acceptance=acceptance, verdicts=verdicts, support=support)
