"""Issue 26's sweep on random weights: plain decoding, each fixed k and the adaptive policy ("auto"), through
continuous admission and through waves, at several slot counts, the drafts accepted at synthetic rates (vLLM's
synthetic_acceptance_length) so that the speed of each choice shows without a trained drafter.

    PYTHONPATH=. python benchmarks/bench_sweep.py [--shape 8b|smollm2] [--drafter draft|eagle3] [--al 1.2,2.0,3.0]
        [--num 512] [--per-slot N] [--prompt-len 64:256] [--max-tokens 32:512] [--slots 8,32,128,256] [--k 3]
        [--fixed K,...] [--modes plain,fixed,forced,auto] [--runners admission,waves] [--repeats 3] [--deadline S]
        [--profile] [--smoke]

Target: the Llama-3.1-8B shape or the default model's (SmolLM2-135M), bf16. Drafter: the Llama-3.2-1B shape
(8b only) or an EAGLE-3-shaped head for the target (one layer, three captured layers, a 32k draft vocabulary).
Modes: "plain", "fixed" (every k from 1 to --k, or those --fixed names), "forced" (the adaptive loop held at each k
from 0 to --k, or those --fixed names, by a table, with auto's tiers: its machinery's cost per step), "auto" (k
chosen each iteration between 0 and --k from step times the engine measures on its first call). Each engine runs
the requests untimed until its CUDA graph is recorded (compilation, calibration); then a slot count's engines are
timed in --repeats rounds, one run each per round in alternating order, and each row gives the median (and every
run); plain decoding once per slot count, whatever the acceptance lengths. Prints a table (tokens/s, against plain
and against the best fixed k, slot occupancy, iterations at each k, the step times auto weighed its tiers by) and
writes $OUT/bench_sweep.json after each round. Synthetic acceptance takes drafts whether or not the target agrees,
so the tokens are not plain decoding's: this measures speed only.
`--per-slot N` runs the first min(num, N x slots) requests at each slot count, so that small slot counts take
about as long as large ones (one slot would take 512 requests one at a time). Engines that differ only in their
acceptance rate run the same programs: the process's compilation cache (common.reuse_compilations) loads them.
`--profile`: every engine compiled without CUDA graphs (enforce_eager, so the profiler sees each kernel) and its
timed admission run traced: device busy time and kernels per loop iteration in the row, the costliest kernel kinds
in $OUT/bench_sweep_profile_<slots>_<al>_<engine>.json (eager tokens/s: compare engines with each other).
`--deadline S`: engines are prepared in order (plain, then each acceptance length's) only while the rest of the
run should still end S seconds after the start (a device call's limit); the rest are skipped, and said so.
`--smoke`: tiny shapes, 6 requests, 2 slots, a few tokens (checks the script).
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any, Callable

import jax
import numpy as np
from flax import nnx

from benchmarks.common import (LLAMA31_8B, LLAMA32_1B, SMOKE_DRAFT, SMOKE_TARGET, SMOLLM2_135M, print_table,
                               random_model, reuse_compilations, write_json)
from benchmarks.device_trace import busy_ns, by_kernel, traced_kernels
from specjax.config import EngineConfig
from specjax.config.speculation_policy import PROBE_EVERY, auto_tiers
from specjax.engine.proposers.base import NoProposer
from specjax.engine.proposers.draft_model import DraftModelProposer
from specjax.engine.proposers.eagle import HeadProposer
from specjax.engine.runner import Request, WaveRunner
from specjax.kernels.policy import KernelPolicy
from specjax.models.eagle import default_aux_layer_ids
from specjax.sampling_params import SamplingParams
from specjax.training.trainer import new_head

SHAPES = {"8b": (LLAMA31_8B, LLAMA32_1B), "smollm2": (SMOLLM2_135M, None), "smoke": (SMOKE_TARGET, SMOKE_DRAFT)}
DRAFT_VOCAB = 32000
MAX_MODEL_LEN = 1024
# Seconds --deadline keeps for the timed rounds of the engines already prepared.
ROUNDS_RESERVE = 60


@dataclasses.dataclass(frozen=True)
class Drafter:
    """What a speculative engine drafts with: a name for the step-time store, the speculative method, and how to
    make its proposer (k, adaptive) with the state it reads."""
    name: str
    method: str
    make: Callable[[int, bool], tuple[Any, Any]]   # (k, adaptive) -> (proposer, draft state)


def drafter(kind: str, target_cfg, target_state, draft_cfg, smoke: bool) -> Drafter:
    if kind == "draft":
        if draft_cfg is None:
            raise SystemExit("--drafter draft: this shape has no smaller draft shape; use --drafter eagle3")
        draft = random_model(draft_cfg, seed=1)
        graph, state = nnx.split(draft)
        return Drafter("1b-draft", "draft_model", lambda k, adaptive: (
            DraftModelProposer(graph, k, probabilistic=False, cache_bytes=draft.cache_bytes), state))
    vocab = min(DRAFT_VOCAB, target_cfg.vocab_size // 2) if smoke else DRAFT_VOCAB
    head = new_head(target_cfg, target_state, np.arange(vocab), default_aux_layer_ids(target_cfg.num_layers),
                    kernels=KernelPolicy())   # the engine's kernels, as a loaded head runs them
    graph, state = nnx.split(head)
    features = target_cfg.hidden_size * max(1, len(head.capture_layers))
    return Drafter("eagle3-head", "eagle3", lambda k, adaptive: (
        HeadProposer(graph, head, k, probabilistic=False, feature_size=features,
                     catch_up_window=PROBE_EVERY if adaptive else 0), state))


def speculative_engines(modes: list[str], k_max: int, al: float, method: str, slots: int,
                        fixed: tuple[int, ...] | None = None) -> list[tuple[str, dict]]:
    """(name, speculative_config) of each speculative engine the modes ask for at acceptance length `al`
    ("fixed": each k of `fixed` above 0, by default every k from 1 to k_max).
    "forced": the adaptive loop held at each k of `fixed` (by default every k from 0 to k_max) by a table, k = 0
    its plain tier, so that its machinery's cost shows apart from the policy's choices. Its first row covers every
    live count; rows beyond the slots (never matched) give it auto's tiers, so that it compiles auto's loop and
    differs from it only in the choice and in auto's shadow segments (adaptive.segment_kinds), two more loops of
    k <= 3 that cost a predicate each where they do not run."""
    def spec(k: int, policy: str, **extra) -> dict:
        return {"method": method, "model": "random", "num_speculative_tokens": k, "speculation_policy": policy,
                "rejection_sample_method": "synthetic", "synthetic_acceptance_length": min(al, k + 1), **extra}
    held = range(k_max + 1) if fixed is None else fixed
    out = [(f"k={k}", spec(k, "fixed")) for k in held if k > 0] if "fixed" in modes else []
    if "forced" in modes:
        unmatched = [[slots + 1 + i, slots + 1 + i, t] for i, t in enumerate(auto_tiers(k_max)) if 0 < t < k_max]
        out += [(f"k={k} forced", spec(k_max, "table",
                                       num_speculative_tokens_per_batch_size=[[1, slots, k]] + unmatched))
                for k in held]
    if "auto" in modes:
        out.append((f"auto k<={k_max}", spec(k_max, "auto")))
    return out


def requests(n: int, prompt_len: tuple[int, int], max_tokens: tuple[int, int], vocab: int) -> list[Request]:
    rng = np.random.default_rng(0)
    lengths = rng.integers(prompt_len[0], prompt_len[1] + 1, size=n)
    budgets = rng.integers(max_tokens[0], max_tokens[1] + 1, size=n)
    return [Request(rng.integers(3, vocab, size=int(p)).tolist(),
                    SamplingParams(temperature=0.0, max_tokens=int(m), ignore_eos=True), seed_index=i)
            for i, (p, m) in enumerate(zip(lengths, budgets))]


def run(runner: WaveRunner, reqs: list[Request], admission: bool) -> float:
    """Seconds to run every request through `runner` once (continuous admission, or waves of max_num_seqs)."""
    start = time.perf_counter()
    if admission:
        for indices in runner.queues(reqs):
            runner.run_queue([reqs[i] for i in indices])
    else:
        for wave in runner.waves(reqs):
            runner.run_wave(wave)
    return time.perf_counter() - start


@dataclasses.dataclass
class Engine:
    """One engine of a slot count under one runner, compiled and warm; its timed runs so far."""
    name: str
    al: float | None
    slots: int
    mode: str                   # "admission" or "waves"
    adaptive: bool
    fixed: bool                 # a fixed k (what auto is held against)
    runner: WaveRunner
    reqs: list[Request]
    seconds: list[float] = dataclasses.field(default_factory=list)
    iterations_per_k: list[int] | None = None   # an adaptive engine's choices in its last timed run

    def timed(self, k_max: int) -> None:
        before = _iterations_per_k(self.runner, k_max)
        self.seconds.append(run(self.runner, self.reqs, self.mode == "admission"))
        if self.adaptive:
            self.iterations_per_k = [a - b for a, b in zip(_iterations_per_k(self.runner, k_max), before)]

    @property
    def tokens(self) -> int:
        return sum(r.params.max_tokens for r in self.reqs)

    @property
    def tok_s(self) -> float:
        return self.tokens / statistics.median(self.seconds)


@dataclasses.dataclass
class Sweep:
    """The sweep's fixed parts and its rows so far. A slot count's engines are each compiled and run once
    (prepare), then timed in rounds, every engine once per round, in alternating order (time_rounds): runs of
    one engine drift by a few percent within a process, as much as the 3% the goals turn on."""
    target_cfg: Any
    graph: Any
    state: Any
    draft: Drafter
    reqs: list[Request]
    per_slot: int | None
    shape: str
    k_max: int
    runners: list[str]
    profile: bool = False
    deadline: float | None = None   # seconds after `began` by which every timed round should be done
    rows: list[dict] = dataclasses.field(default_factory=list)
    began: float = dataclasses.field(default_factory=time.perf_counter)
    longest_prepare: float = 0.0

    def room_for_another(self) -> bool:
        """Whether one more engine can be prepared (half again the longest preparation so far) and every
        prepared one still timed (ROUNDS_RESERVE) before the deadline."""
        if self.deadline is None:
            return True
        return time.perf_counter() - self.began + 1.5 * self.longest_prepare + ROUNDS_RESERVE < self.deadline

    def prepare(self, name: str, spec: dict | None, slots: int, al: float | None) -> list[Engine]:
        """The engine under each runner, compiled and run until its CUDA graph exists (auto measures its step times
        then)."""
        adaptive = spec is not None and spec["speculation_policy"] != "fixed"
        proposer, draft_state = (NoProposer(), None) if spec is None else self.draft.make(
            spec["num_speculative_tokens"], adaptive)
        config = EngineConfig(model="random", tokenizer="random", max_num_seqs=slots, max_model_len=MAX_MODEL_LEN,
                              speculative_config=spec, enforce_eager=self.profile).resolve(self.target_cfg)
        runner = WaveRunner(self.graph, self.state, proposer, draft_state, config, eos_token_ids=(),
                            vocab_size=self.target_cfg.vocab_size, cost_key=f"{self.shape}+{self.draft.name}")
        reqs = self.reqs if self.per_slot is None else self.reqs[:self.per_slot * slots]
        engines = []
        for mode in self.runners:
            start = time.perf_counter()
            # XLA records a loop's CUDA graph over its first executions (at 128 slots fixed k=2's first timed run,
            # its second execution, was 1.6% slower than the next: RESULTS.md); auto's calibration has run it many
            # times by then, so only the others run twice.
            for _ in range(1 if adaptive else 2):
                run(runner, reqs, mode == "admission")
            seconds = time.perf_counter() - start
            self.longest_prepare = max(self.longest_prepare, seconds)
            print(f"{slots} slots, AL {al}, {name}, {mode}: compiled and run untimed in {seconds:.1f} s", flush=True)
            engines.append(Engine(name, al, slots, mode, adaptive, spec is not None and not adaptive, runner, reqs))
        return engines

    def time_rounds(self, engines: list[Engine], repeats: int) -> None:
        """`repeats` rounds of one timed run per engine, the rows rewritten after each round; then (profile) each
        admission run traced."""
        done = list(self.rows)
        for round_ in range(repeats):
            for engine in engines if round_ % 2 == 0 else engines[::-1]:
                engine.timed(self.k_max)
            self.rows = done + [self._row(e, engines) for e in engines]
            write_json("bench_sweep", self.rows)
        for engine, row in zip(engines, self.rows[len(done):]):
            if self.profile and engine.mode == "admission":
                row.update(self._profiled(engine.runner, engine.reqs, f"{engine.slots}_{engine.al}_{engine.name}"))
            print(row, flush=True)
        write_json("bench_sweep", self.rows)

    def _row(self, e: Engine, engines: list[Engine]) -> dict:
        best = max((o.tok_s for o in engines if o.fixed and o.al == e.al and o.mode == e.mode), default=None)
        occupancy = e.runner.queue_traces[-1].occupancy if e.mode == "admission" else None
        return dict(shape=self.shape, drafter=self.draft.name, al=e.al, slots=e.slots, requests=len(e.reqs),
                    engine=e.name, runner=e.mode, tok_s=round(e.tok_s, 1),
                    runs=[round(e.tokens / s, 1) for s in e.seconds],
                    over_best_fixed=round(e.tok_s / best, 3) if e.adaptive and best else None,
                    occupancy=occupancy and round(sum(occupancy) / e.slots, 3), iterations_per_k=e.iterations_per_k,
                    step_costs=[[float(f"{c:.4g}") for c in costs] for costs in e.runner.step_costs()] or None)

    def _profiled(self, runner: WaveRunner, reqs: list[Request], label: str) -> dict:
        """The admission run again under the profiler: busy time and kernels per loop iteration (NaN off GPUs),
        the costliest kinds written to $OUT."""
        kernels = traced_kernels(lambda: run(runner, reqs, True))
        iterations = runner.queue_traces[-1].steps
        write_json(f"bench_sweep_profile_{label.replace(' ', '').replace('<=', 'le')}",
                   by_kernel(kernels, per=iterations, top=40))
        return dict(busy_us_per_iteration=round(busy_ns(kernels) / iterations / 1e3, 1) if kernels else float("nan"),
                    kernels_per_iteration=round(len(kernels) / iterations, 1) if kernels else float("nan"))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="8b", choices=("8b", "smollm2"))
    parser.add_argument("--drafter", default="eagle3", choices=("draft", "eagle3"))
    parser.add_argument("--al", default="1.2,2.0,3.0", help="synthetic acceptance lengths")
    parser.add_argument("--num", type=int, default=512)
    parser.add_argument("--per-slot", type=int, default=None, help="at most this many requests per slot")
    parser.add_argument("--prompt-len", default="64:256", help="LOW:HIGH, each request's drawn uniformly")
    parser.add_argument("--max-tokens", default="32:512", help="LOW:HIGH, each request's drawn uniformly")
    parser.add_argument("--slots", default="8,32,128,256")
    parser.add_argument("--k", type=int, default=3, help="the largest k (fixed runs each k from 1)")
    parser.add_argument("--fixed", default=None,
                        help="K1,K2,...: the fixed (and forced) k to run (default: from 1, forced from 0, to --k)")
    parser.add_argument("--modes", default="plain,fixed,auto")
    parser.add_argument("--runners", default="admission,waves")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds over a slot count's engines")
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds: prepare no more engines once the rest might not be timed by then")
    parser.add_argument("--profile", action="store_true", help="eager engines, their admission runs traced")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, 6 requests, 2 slots, a few tokens")
    args = parser.parse_args(argv)
    reuse_compilations()
    if args.smoke:
        args.shape, args.al, args.num, args.prompt_len, args.max_tokens = "smoke", "2.0", 6, "4:8", "2:6"
        args.slots, args.k, args.modes, args.runners, args.repeats = "2", 2, "plain,forced,auto", "admission", 2
    target_cfg, draft_cfg = SHAPES[args.shape]
    target = random_model(target_cfg)
    graph, state = nnx.split(target)
    draft = drafter(args.drafter, target_cfg, state, draft_cfg, args.smoke)
    reqs = requests(args.num, tuple(int(x) for x in args.prompt_len.split(":")),
                    tuple(int(x) for x in args.max_tokens.split(":")), target_cfg.vocab_size)
    limit = "" if args.per_slot is None else f" (at most {args.per_slot} per slot: the first {args.per_slot} x slots)"
    print(f"{jax.devices()[0].device_kind}: {args.shape} + {draft.name}, {len(reqs)} requests, "
          f"{sum(r.params.max_tokens for r in reqs)} tokens{limit}", flush=True)
    modes, runners = args.modes.split(","), args.runners.split(",")
    fixed = None if args.fixed is None else tuple(int(k) for k in args.fixed.split(","))
    if fixed is not None and not all(0 <= k <= args.k for k in fixed):
        parser.error(f"--fixed {args.fixed}: each k must be in 0..--k ({args.k}; 0 for the forced engines)")
    sweep = Sweep(target_cfg, graph, state, draft, reqs, args.per_slot, args.shape, args.k, runners, args.profile,
                  args.deadline)
    for slots in (int(s) for s in args.slots.split(",")):
        engines = []
        planned = [("plain", None, None)] if "plain" in modes else []   # no drafts: one run for every AL
        for al in (float(a) for a in args.al.split(",")):
            planned += [(name, spec, al) for name, spec in speculative_engines(modes, args.k, al, draft.method, slots,
                                                                                 fixed)]
        for name, spec, al in planned:
            if sweep.room_for_another():
                engines += sweep.prepare(name, spec, slots, al)
            else:
                print(f"{slots} slots, AL {al}, {name}: skipped (--deadline)", flush=True)
        sweep.time_rounds(engines, args.repeats)
    rows = sweep.rows
    _add_over_plain(rows)
    print_table(rows)
    write_json("bench_sweep", rows)


def _iterations_per_k(runner: WaveRunner, k_max: int) -> list[int]:
    """Loop iterations at each k over every adaptive call the runner has made."""
    counts = np.zeros(k_max + 1, np.int64)
    for trace in runner.traces:
        counts += np.bincount(np.asarray(trace.k_per_step, np.int64), minlength=k_max + 1)[:k_max + 1]
    return counts.tolist()


def _add_over_plain(rows: list[dict]) -> None:
    """Each row's tokens/s over plain decoding's (one run for every acceptance length) at the same slots and
    runner."""
    plain = {(r["slots"], r["runner"]): r["tok_s"] for r in rows if r["engine"] == "plain"}
    for r in rows:
        base = plain.get((r["slots"], r["runner"]))
        r["over_plain"] = base and round(r["tok_s"] / base, 3)


if __name__ == "__main__":
    main()
