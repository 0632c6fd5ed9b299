"""Step times of an adaptive loop's tiers, measured on the compiled loop itself and kept on disk.

A tier's step time is the slope of wall time over loop iterations: the loop runs with every row forced to
that tier for CALIBRATION_TOKENS tokens, less a run of one token, whose time is the prefill and the call's fixed
costs. That run is the same for every tier (the forced tier is an input of one compiled program, and one token
is the prefill's), so it is measured once. Rows ignore their stop ids while measuring, so each run's length is
what was asked. The times are stored per model, proposer, tiers, batch shape and device in
$SPECJAX_CACHE/step_costs.json, so a shape is calibrated once per machine; `speculative_config["step_costs"]`
overrides them.
"""
from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from specjax.engine.adaptive import PolicyInputs, policy_inputs
from specjax.engine.state import RowParams

# New tokens per row of a tier's measuring run, and how many times at most each run is timed. Noise on a shared
# machine only ever adds time, and a calibration-sized run varies by 15-25% on a 2-core box, so each time is the
# fastest of its repeats, taken round-robin over the runs so that a slow spell falls on all of them alike
# (benchmarks/RESULTS.md, "Adaptive speculation on CPU"); every other round backwards, so that a disturbance in
# step with the rounds does not always hit the same run. The rounds stop once every run's fastest time is
# confirmed, a second time within STABLE of it (on a quiet machine, after two rounds). Stopping at the first round
# that lowers no fastest time kept slow times on a 2-core box, where plain's is the one a deep tier's cost is
# weighed against (benchmarks/RESULTS.md, "Issue 26's calibration on a noisy machine").
CALIBRATION_TOKENS = 32
REPEATS = 8
STABLE = 0.02


def measure_step_costs(run: Callable[[PolicyInputs, RowParams], Any], rows: RowParams, n_tiers: int,
                       room: int) -> tuple[float, ...]:
    """Seconds per iteration of each tier. run(policy, rows) runs the compiled loop and returns its final
    state (anything with `steps`, the loop iterations it ran); room: new tokens every row has space for in the
    loop's buffers."""
    long = min(CALIBRATION_TOKENS, room)
    if long < 3:
        return (1.0,) * n_tiers   # no room to measure: equal costs, so the most expected tokens wins
    fixed = (0, 1)   # one token: the prefill and the call, whatever the tier
    cases = [fixed] + [(tier, long) for tier in range(n_tiers)]
    measuring = {n: _measuring_rows(rows, n) for n in (1, long)}
    forced = [policy_inputs(np.ones(n_tiers, np.float32), tier) for tier in range(n_tiers)]
    jax.block_until_ready(run(forced[0], measuring[1]))   # compiles
    times, steps = {case: [] for case in cases}, {}
    for repeat in range(REPEATS):
        for case in cases if repeat % 2 == 0 else cases[::-1]:
            seconds, steps[case] = _timed(run, forced[case[0]], measuring[case[1]])
            times[case].append(seconds)
        if repeat and all(_confirmed(seconds) for seconds in times.values()):
            break
    fastest = {case: min(seconds) for case, seconds in times.items()}
    return tuple(max((fastest[tier, long] - fastest[fixed]) / max(steps[tier, long] - steps[fixed], 1), 1e-9)
                 for tier in range(n_tiers))


def _confirmed(seconds: list[float]) -> bool:
    """Whether a run's fastest time was seen twice, within STABLE."""
    first, second = sorted(seconds)[:2]
    return second <= (1 + STABLE) * first


def _measuring_rows(rows: RowParams, new_tokens: int) -> RowParams:
    """The wave's rows generating exactly new_tokens each (padding rows still none), stop ids off."""
    max_tokens = np.where(np.asarray(rows.max_tokens) > 0, new_tokens, 0).astype(np.int32)
    return dataclasses.replace(rows, max_tokens=max_tokens, min_tokens=np.zeros_like(max_tokens),
                               stop_ids=np.full_like(np.asarray(rows.stop_ids), -1))


def _timed(run, inputs: PolicyInputs, rows: RowParams) -> tuple[float, int]:
    """Seconds of one run, and its loop iterations (the same every time: the tokens are greedy or seeded)."""
    begin = time.perf_counter()
    state = jax.block_until_ready(run(inputs, rows))
    seconds = time.perf_counter() - begin
    return seconds, int(jax.device_get(state.steps))


class StepCostStore:
    """Calibrated step times in one JSON file, {key: [seconds per tier]}; written atomically, so processes
    sharing the file at worst calibrate twice."""

    def __init__(self, path: Path):
        self.path = path

    def get(self, key: str) -> tuple[float, ...] | None:
        costs = self._read().get(key)
        return None if costs is None else tuple(float(c) for c in costs)

    def put(self, key: str, costs: tuple[float, ...]) -> None:
        table = self._read()
        table[key] = list(costs)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)
        os.replace(tmp, self.path)

    def _read(self) -> dict:
        try:
            with open(self.path) as f:
                table = json.load(f)
        except (FileNotFoundError, json.JSONDecodeError):
            return {}
        return table if isinstance(table, dict) else {}
