"""The adaptive policy's choices without a model: engine/adaptive.py's own choose_tier and record, driven by
Bernoulli acceptance at given conditional rates and per-tier step times, so that what the policy loses to the
best fixed k shows apart from what the GPU does (issue 26).

    PYTHONPATH=. python benchmarks/bench_policy.py [--costs 0.899,0.971,1.027,1.120] [--draft-cost 0.04]
        [--rows 1,2,4,8,32] [--steps 2000] [--calls 1] [--seeds 3] [--switch 32,128,512] [--deepen 128,512]
        [--full-step-rows N] [--optimistic-verdicts V] [--plain-margin-se Z] [--smoke]

Every row is live for the whole run and has room for every draft. Stationary cases: the synthetic acceptance
lengths of bench_sweep.py (vLLM's schedule: AL 1.2 = rates 0.2, 0, 0; AL 1.1 and 1.15, where plain decoding wins
at the default step times) and a geometric 0.6. `--switch P`: the
rates alternate every P steps between 0.9 at every position and 0.1 then 0 (a drafter that is right, then
wrong), against the best single fixed k and against the oracle that takes each phase's best k. `--deepen P`:
every P steps between first drafts right and later ones wrong (0.9, 0.1, 0) and every draft right (0.9 each): a
drafter whose deeper drafts come good while k = 1 runs, positions the loop only measures when a deeper tier runs.
`--calls N`: N calls of `--steps` steps each, each from the last one's rates as an engine's calls run
(adaptive.PolicyInputs.start; the first from the optimistic start).
`--full-step-rows N` / `--optimistic-verdicts V` override adaptive.FULL_STEP_ROWS / OPTIMISTIC_VERDICTS (1 and
1e9: every step weighs alike from the start, the rule before either existed); `--plain-margin-se Z`
adaptive.PLAIN_MARGIN_SE (0: plain on the running rates alone, the rule before it).
A shadow step (adaptive.py) costs its tier's step time and `--draft-cost` (one draft step; assumed, not measured).
Prints auto's tokens per unit time over the best fixed k's expectation (mean, min-max over seeds) and the steps
it ran at each k, then its shadow steps (first seed), and writes them to $OUT/bench_policy.json. `--smoke`: one
row, 16 steps, one seed.
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import write_json
from specjax.config.speculation_policy import SpeculationPolicy, auto_tiers
from specjax.engine import adaptive

STATIONARY = {"AL 1.1": (0.1, 0.0, 0.0), "AL 1.15": (0.15, 0.0, 0.0), "AL 1.2": (0.2, 0.0, 0.0),
              "AL 1.5": (0.5, 0.0, 0.0), "AL 2.0": (1.0, 0.0, 0.0),
              "AL 3.0": (1.0, 1.0, 0.0), "geometric 0.6": (0.6, 0.6, 0.6)}
RIGHT, WRONG, SHALLOW = (0.9, 0.9, 0.9), (0.1, 0.0, 0.0), (0.9, 0.1, 0.0)
TIERS = auto_tiers(3)   # (0, 1, 2, 3): a tier's index is its k


def tokens_per_step(rates) -> np.ndarray:
    """A row's expected tokens from a step of each tier (indexed by k) at these conditional rates."""
    return np.asarray(adaptive.expected_tokens(jnp.asarray(rates, jnp.float32), TIERS))


def simulate(rows: int, phases: list, period: int, costs: np.ndarray, steps: int, seed: int, calls: int = 1,
             draft_cost: float = 0.04):
    """Tokens per unit time of auto over `calls` calls of `steps` steps, each starting from the last one's rates
    (rates phases[(step // period) % len], the step counted over the whole run), and steps per k, shadows last."""
    policy = SpeculationPolicy("auto", TIERS)
    choose = jax.jit(adaptive.choose_tier, static_argnums=2)
    record = jax.jit(adaptive.record, static_argnums=(2, 8))
    rng = np.random.default_rng(seed)
    tokens = seconds = 0.0
    ran = np.zeros(len(TIERS) + 1, int)
    done, start = 0, None
    for call in range(calls):
        state = adaptive.init_adapt(TIERS[-1], 1, adaptive.PolicyInputs(jnp.asarray(costs), jnp.asarray(-1), start))
        end = (call + 1) * steps
        while done < end:
            tier, shadow, segment, state = choose(state, jnp.asarray(rows), policy)
            k, shadow = policy.tiers[int(tier)], bool(shadow)
            for _ in range(min(int(segment), end - done)):
                accepted = _accepted(rng, rows, k + shadow, phases[(done // period) % len(phases)])
                tokens += rows + np.minimum(accepted, k).sum()
                seconds += costs[k] + shadow * draft_cost
                state = record(state, jnp.asarray(1), k, jnp.asarray(rows), jnp.full((rows,), k + shadow),
                               jnp.asarray(accepted, jnp.int32), jnp.ones((rows,), bool),
                               segment, shadow)
                ran[-1 if shadow else k] += 1
                done += 1
        start = state.acceptance
    return tokens / seconds, ran


def _accepted(rng: np.random.Generator, rows: int, k: int, rates) -> np.ndarray:
    """Each row's accepted drafts of k, position j passing at rates[j] once every draft before it passed."""
    if not k:
        return np.zeros(rows, int)
    passed = rng.random((rows, k)) < np.asarray(rates)[None, :k]
    return np.where(passed.all(1), k, passed.argmin(1))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--costs", default="0.899,0.971,1.027,1.120", help="step times of k = 0, 1, 2, 3")
    parser.add_argument("--draft-cost", type=float, default=0.04, help="a shadow's extra time: one draft step")
    parser.add_argument("--rows", default="1,2,4,8,32")
    parser.add_argument("--steps", type=int, default=2000, help="steps per call")
    parser.add_argument("--calls", type=int, default=1)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--switch", default=None, help="periods (steps) of right / wrong drafting phases")
    parser.add_argument("--deepen", default=None, help="periods (steps) of shallow / deep drafting phases")
    parser.add_argument("--full-step-rows", type=int, default=None)
    parser.add_argument("--optimistic-verdicts", type=float, default=None)
    parser.add_argument("--plain-margin-se", type=float, default=None)
    parser.add_argument("--smoke", action="store_true", help="one row, 16 steps, one seed")
    args = parser.parse_args(argv)
    if args.smoke:
        args.rows, args.steps, args.seeds = "1", 16, 1
    if args.full_step_rows is not None:
        adaptive.FULL_STEP_ROWS = args.full_step_rows
    if args.optimistic_verdicts is not None:
        adaptive.OPTIMISTIC_VERDICTS = args.optimistic_verdicts
    if args.plain_margin_se is not None:
        adaptive.PLAIN_MARGIN_SE = args.plain_margin_se
    costs = np.asarray([float(c) for c in args.costs.split(",")], np.float32)
    if len(costs) != len(TIERS):
        parser.error(f"--costs needs one step time per tier of auto at k <= 3 {TIERS}, got {args.costs}")
    cases = [(f"switch every {p}", [RIGHT, WRONG], int(p)) for p in (args.switch or "").split(",") if p]
    cases += [(f"deepen every {p}", [SHALLOW, RIGHT], int(p)) for p in (args.deepen or "").split(",") if p]
    if not cases:
        cases = [(name, [rates], args.steps) for name, rates in STATIONARY.items()]
    print(f"FULL_STEP_ROWS {adaptive.FULL_STEP_ROWS}, OPTIMISTIC_VERDICTS {adaptive.OPTIMISTIC_VERDICTS}, "
          f"PLAIN_MARGIN_SE {adaptive.PLAIN_MARGIN_SE}, "
          f"step times {args.costs} for k = {TIERS}, {args.calls} call(s) of {args.steps} steps")
    table = []
    for rows in (int(r) for r in args.rows.split(",")):
        for name, phases, period in cases:
            per_phase = rows * np.stack([tokens_per_step(p) for p in phases]) / costs   # [phases, tiers]
            best = per_phase.mean(0).max()   # one fixed k over the phases (equal steps each)
            oracle = per_phase.max(1).mean()
            runs = [simulate(rows, phases, period, costs, args.steps, seed, args.calls, args.draft_cost)
                    for seed in range(args.seeds)]
            ratio = [r / best for r, _ in runs]
            line = (f"rows {rows:3d}  {name:16s} auto / best fixed {np.mean(ratio):.3f} "
                    f"({min(ratio):.3f}-{max(ratio):.3f})")
            if len(phases) > 1:
                line += f"  / oracle {np.mean([r for r, _ in runs]) / oracle:.3f}"
            print(f"{line}  steps per k {runs[0][1][:-1].tolist()}, shadows {runs[0][1][-1]}", flush=True)
            table.append(dict(rows=rows, case=name, full_step_rows=adaptive.FULL_STEP_ROWS,
                              optimistic_verdicts=adaptive.OPTIMISTIC_VERDICTS,
                              plain_margin_se=adaptive.PLAIN_MARGIN_SE, steps=args.steps, calls=args.calls,
                              over_best_fixed=round(float(np.mean(ratio)), 4),
                              over_oracle=round(float(np.mean([r for r, _ in runs]) / oracle), 4),
                              steps_per_k=runs[0][1][:-1].tolist(), shadow_steps=int(runs[0][1][-1])))
            write_json("bench_policy", table)


if __name__ == "__main__":
    main()
