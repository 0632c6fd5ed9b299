"""How many tokens to draft each iteration: `speculation_policy` and vLLM's `num_speculative_tokens_per_batch_size`.

"fixed" drafts num_speculative_tokens every step (vLLM's behaviour without a table). "table" takes vLLM's rows
[start_bs, end_bs, K]: while the number of live rows lies in [start_bs, end_bs] the loop drafts K (0 = a plain
decode step); batch sizes no row covers draft num_speculative_tokens. "auto" chooses, each iteration on the
device, the tier that maximises expected tokens per second from the running per-position acceptance and each
tier's measured step time (`step_costs`, or calibrated once per model and batch shape).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from specjax.config.validators import check_int, is_number

POLICIES = ("fixed", "table", "auto")
# "auto" runs a speculative step after this many plain ones in a row (to measure acceptance again), a gap that
# doubles with each probe up to PROBE_MAX until speculation wins again. Proposers that read the target's features
# keep PROBE_EVERY plain passes for their catch-up (older ones go unobserved: draft quality only, not exactness).
PROBE_EVERY = 16
PROBE_MAX = 128


@dataclasses.dataclass(frozen=True)
class SpeculationPolicy:
    """mode: "fixed", "table" or "auto". tiers: the k values the loop compiles (0 and k_max among them; just
    (k_max,) when fixed). table: vLLM's rows (start_bs, end_bs, K). step_costs: seconds (or any common unit) per
    iteration of each tier, in tier order, when given by the user; None: calibrated."""
    mode: str
    tiers: tuple[int, ...]
    table: tuple[tuple[int, int, int], ...] = ()
    step_costs: tuple[float, ...] | None = None

    @property
    def adaptive(self) -> bool:
        return self.mode != "fixed"


def parse_policy(mode: Any, table: Any, step_costs: Any, k_max: int, tree: bool = False) -> SpeculationPolicy:
    """The policy from speculative_config's keys. mode defaults to "table" when a table is given, else "fixed".
    With a draft tree (`tree`) the tiers are plain steps and the tree: a table's K is 0 or k_max."""
    rows = _table(table, k_max, tree) if table is not None else ()
    if mode is None:
        mode = "table" if rows else "fixed"
    if mode not in POLICIES:
        raise ValueError(f"speculative_config['speculation_policy'] must be one of {POLICIES}, got {mode!r}")
    if mode == "table" and not rows:
        raise ValueError("speculative_config speculation_policy='table' needs 'num_speculative_tokens_per_batch_size'"
                         ": rows [start_bs, end_bs, K], e.g. [[1, 16, 3], [17, 256, 0]]")
    if rows and mode != "table":
        raise ValueError(f"speculative_config['num_speculative_tokens_per_batch_size'] is a table: it needs "
                         f"speculation_policy 'table' (or unset), not {mode!r}")
    if mode == "fixed":
        if step_costs is not None:
            raise ValueError("speculative_config['step_costs'] is read by speculation_policy 'auto' only")
        return SpeculationPolicy("fixed", (k_max,))
    tiers = tuple(sorted({0, k_max, *(k for _, _, k in rows)})) if rows else (0, k_max) if tree else auto_tiers(k_max)
    costs = None if step_costs is None else _step_costs(step_costs, tiers)
    if costs is not None and mode != "auto":
        raise ValueError("speculative_config['step_costs'] is read by speculation_policy 'auto' only")
    return SpeculationPolicy(mode, tiers, rows, costs)


def auto_tiers(k_max: int) -> tuple[int, ...]:
    """0, 1, the powers of two below k_max, and k_max: every tier is one more compiled step, so not every k."""
    powers = {2 ** i for i in range(k_max.bit_length()) if 2 ** i < k_max}
    return tuple(sorted({0, 1, k_max} | powers))


def _table(table: Any, k_max: int, tree: bool) -> tuple[tuple[int, int, int], ...]:
    name = "speculative_config['num_speculative_tokens_per_batch_size']"
    if not isinstance(table, (list, tuple)) or not table:
        raise TypeError(f"{name} must be a non-empty list of [start_bs, end_bs, K] rows, got {table!r}")
    rows = []
    for row in table:
        if not isinstance(row, (list, tuple)) or len(row) != 3:
            raise ValueError(f"{name}: each row is [start_bs, end_bs, K] (three ints), got {row!r}")
        start, end, k = row
        for field, value, minimum in (("start_bs", start, 1), ("end_bs", end, 1), ("K", k, 0)):
            check_int(value, f"{name} row {list(row)} {field}", minimum=minimum)
        if start > end:
            raise ValueError(f"{name} row {list(row)}: start_bs must be <= end_bs")
        if k > k_max:
            raise ValueError(f"{name} row {list(row)}: K={k} is more than num_speculative_tokens={k_max}, the "
                             "most the loop drafts; raise num_speculative_tokens or lower K")
        if tree and k not in (0, k_max):
            raise ValueError(f"{name} row {list(row)}: with a draft tree (tree_nodes) K is 0 (plain steps) or "
                             f"num_speculative_tokens={k_max} (the tree)")
        rows.append((int(start), int(end), int(k)))
    rows.sort()
    for (s0, e0, _), (s1, _, _) in zip(rows, rows[1:]):
        if s1 <= e0:
            raise ValueError(f"{name}: rows starting at {s0} and {s1} overlap; each batch size needs one K")
    return tuple(rows)


def _step_costs(costs: Any, tiers: tuple[int, ...]) -> tuple[float, ...]:
    name = "speculative_config['step_costs']"
    if not isinstance(costs, Mapping):
        raise TypeError(f"{name} must map each k of the tiers {list(tiers)} to its step time, got {costs!r}")
    given = {int(k) if isinstance(k, str) and k.isdigit() else k: v for k, v in costs.items()}
    if sorted(given, key=str) != sorted(tiers, key=str):
        raise ValueError(f"{name} must give a time for exactly the tiers {list(tiers)} (k values), got "
                         f"{sorted(given, key=str)}")
    for k, v in given.items():
        if not is_number(v) or not v > 0:
            raise ValueError(f"{name}[{k}] must be a positive number (a step's time), got {v!r}")
    return tuple(float(given[k]) for k in tiers)
