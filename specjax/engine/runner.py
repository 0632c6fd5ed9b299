"""Host side of generation: group requests into waves, pad them to shape buckets, run the jitted loop once
per wave (or, streaming, in chunks; or, for more requests than slots, once for all under continuous
admission), and hand back each row's tokens, logprobs (generated and prompt) and
speculative counters. An adaptive loop gets its tiers' step times here (given, stored or measured) and hands
back its record of each iteration's k and live rows."""
from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from specjax.config import EngineConfig, SpeculativeConfig
from specjax.default_model import cache_root
from specjax.engine.adaptive import PolicyInputs, policy_inputs
from specjax.engine.admission import Queue, admit_batch, build_admitting
from specjax.engine.calibration import StepCostStore, measure_step_costs
from specjax.engine.loop import (LoopSpec, eager_compiler_options, jit_generate, jit_stream,
                                 loop_compiler_options)
from specjax.engine.proposers.base import Proposer, spare_slots
from specjax.engine.rows import row_params
from specjax.engine.shapes import MIN_PROMPT_BUCKET, bucket, buffer_len
from specjax.engine.state import LoopState, RowParams, TokenLogprobs
from specjax.parallel.sharded_loop import sharded_admitting
from specjax.sampling_params import GREEDY_TEMPERATURE_EPS, SamplingParams, to_row_arrays


# A call under continuous admission holds at most this many bytes of its requests' results, RECORD_BYTES per
# slot of a row's buffer and top entry (a token and its logprob, rank and top ids and logprobs, rounded up).
QUEUE_RESULT_BYTES = 1 << 30
RECORD_BYTES = 24


@dataclasses.dataclass(frozen=True)
class Request:
    prompt_token_ids: list[int]
    params: SamplingParams
    seed_index: int  # mixed with the LLM seed when the request has no seed of its own


@dataclasses.dataclass(frozen=True)
class RowResult:
    token_ids: list[int]
    logprobs: TokenLogprobs               # numpy, [n] per generated token, the top entries the request asked for
    prompt_logprobs: TokenLogprobs | None   # numpy, [prompt length - 1], when the request asked for them
    num_drafts: int
    num_draft_tokens: int
    num_accepted: int
    accepted_per_pos: list[int]


@dataclasses.dataclass(frozen=True)
class WaveTrace:
    """An adaptive wave's record: its slots (compiled rows), and per loop iteration the k every row drafted, how
    many rows were running, and whether it was a shadow (one draft more, to measure position k + 1)."""
    slots: int
    k_per_step: list[int]
    live_per_step: list[int]
    shadow_per_step: list[int]


@dataclasses.dataclass(frozen=True)
class QueueTrace:
    """A run of more requests than slots under continuous admission: its slots, requests and loop
    iterations, the iterations each slot ran a request, and the prefill batches admitted after the first."""
    slots: int
    requests: int
    steps: int
    busy_per_slot: list[int]
    admissions: int

    @property
    def occupancy(self) -> list[float]:
        """Per slot, the share of the run's iterations it held a running request."""
        return [b / max(self.steps, 1) for b in self.busy_per_slot]


@dataclasses.dataclass(frozen=True)
class WaveChunk:
    """What the host sees of a wave after one streamed chunk: each request's generated tokens so far and
    whether the loop has finished it; `results` (what run_wave returns) on the wave's last chunk only."""
    token_ids: list[list[int]]
    done: list[bool]
    results: list[RowResult] | None = None


class WaveRunner:
    def __init__(self, target_graph: nnx.GraphDef, target_state: Any, proposer: Proposer, draft_state: Any,
                 config: EngineConfig, *, eos_token_ids: Sequence[int], vocab_size: int, mesh: Mesh | None = None,
                 cost_key: str = ""):
        """config: the resolved engine config (max_num_seqs, max_model_len, seed, speculative). mesh: run each
        wave tensor-parallel over it (the states already placed on it); None: one device. cost_key: names the
        model and proposer in the stored step times of an adaptive loop."""
        self.target_graph, self.target_state = target_graph, target_state
        self.proposer, self.draft_state = proposer, draft_state
        self.config = config
        self.eos_token_ids, self.vocab_size = tuple(eos_token_ids), vocab_size
        self.synthetic_rates = synthetic_rates(config.speculative)
        self.mesh = mesh
        self._compiled: dict[tuple, Any] = {}   # LoopSpec fields -> jitted generate
        self._streamed: dict[tuple, Any] = {}   # LoopSpec fields -> jitted (prefill, advance)
        spec = config.speculative
        self.policy = None if spec is None or not spec.policy.adaptive else spec.policy
        self.cost_key = cost_key
        self.step_cost_store = StepCostStore(cache_root() / "step_costs.json")
        self._step_costs: dict[str, PolicyInputs] = {}   # this engine's, by shape: the file is read once each
        # The running acceptance the last adaptive call ended with, where the next one starts (PolicyInputs.start).
        self.start_rates: np.ndarray | None = None
        self.traces: list[WaveTrace] = []       # adaptive waves' records, in the order they ran
        self.queue_traces: list[QueueTrace] = []   # continuous admission's runs, in the order they ran
        self._admitting: dict[tuple, Any] = {}   # LoopSpec fields -> jitted admitting generate

    def waves(self, requests: Sequence[Request]) -> Iterator[list[Request]]:
        step = self.config.max_num_seqs
        for i in range(0, len(requests), step):
            yield list(requests[i:i + step])

    def run_wave(self, wave: Sequence[Request]) -> list[RowResult]:
        prompts, lengths, rows, cache_len = self._pack(wave)
        key = _spec_key(wave, rows, self.vocab_size)
        fn = self.generate_fn(*key)

        def run(policy, rows):
            return fn(self.target_state, self.draft_state, prompts, lengths, rows, cache_len, self.synthetic_rates,
                      self._started(policy))

        state = run(self._policy_inputs(run, key, rows, lengths, cache_len), rows)
        return self._results(state, wave)

    def queues(self, requests: Sequence[Request]) -> Iterator[list[int]]:
        """The requests (their indices) in calls of continuous admission: grouped by prompt length
        (length_groups), then as many per call as QUEUE_RESULT_BYTES of results hold at max_model_len (a call
        keeps every request's tokens and records on the device until it returns), and more than the slots.
        Within a call the largest token budgets go first (ties in request order): the call lasts until its last
        admitted request ends, so a long request admitted last would run on with most slots empty (longest
        first, a classic makespan rule). Results come back in request order whatever the admission order."""
        n_top = max(_num_top(r.params.logprobs, self.vocab_size) + _num_top(r.params.prompt_logprobs,
                                                                             self.vocab_size) for r in requests)
        per_request = (self.config.max_model_len + spare_slots(self.proposer) + 1) * RECORD_BYTES * (1 + n_top)
        step = max(self.config.max_num_seqs + 1, QUEUE_RESULT_BYTES // per_request)
        for group in length_groups([len(r.prompt_token_ids) for r in requests], self.config.max_num_seqs):
            for i in range(0, len(group), step):
                yield sorted(group[i:i + step], key=lambda j: -self._max_new(requests[j]))

    def run_queue(self, requests: Sequence[Request]) -> list[RowResult]:
        """More requests than slots in one jitted call: each slot takes the next request when its row is done
        (engine/admission.py). The results are in request order, token for token what waves would give."""
        slots = self.config.max_num_seqs
        prompts, lengths, rows, cache_len = self._pack(requests, num_rows=max(bucket(len(requests)), slots))
        key = _spec_key(requests, rows, self.vocab_size)
        record_len = bucket(sum(self._max_new(r) for r in requests)) if self.policy is not None else 1
        admitting = self.admitting_fn(*key)

        def run(policy, r, size):
            return admitting(self.target_state, self.draft_state, Queue(prompts, lengths, r, np.int32(size)), slots,
                             cache_len, record_len, self.synthetic_rates, self._started(policy))

        # Calibration times this very program over the first `slots` requests alone (a queue that admits no
        # more), so it compiles nothing else.
        policy = self._policy_inputs(lambda p, r: run(p, r, min(slots, len(requests))), key, rows,
                                     lengths[:slots], cache_len)
        out = run(policy, rows, len(requests))
        out = jax.device_get(out)
        steps = int(out.steps)
        self.queue_traces.append(QueueTrace(slots, len(requests), steps, out.busy.tolist(), int(out.admissions)))
        if out.adapt is not None:
            self._keep_adaptive_record(slots, out.adapt, steps)
        return _unpack(out.results, requests, self.vocab_size)

    def stream_wave(self, wave: Sequence[Request], stream_interval: int) -> Iterator[WaveChunk]:
        """The wave run in chunks of at most `stream_interval` loop iterations: a WaveChunk after the prefill
        and after each chunk, the last one with the results. The same steps as run_wave, hence the same tokens.
        Over a mesh the wave runs in one call (one chunk): the sharded loop keeps the proposer's carry inside."""
        if self.mesh is not None:
            results = self.run_wave(wave)
            yield WaveChunk([r.token_ids for r in results], [True] * len(wave), results)
            return
        prompts, lengths, rows, cache_len = self._pack(wave)
        key = _spec_key(wave, rows, self.vocab_size)
        prefill, advance = self.stream_fns(*key)
        policy = self._policy_inputs(lambda p, r: self._run_streamed(prefill, advance, prompts, lengths, r,
                                                                     cache_len, p), key, rows, lengths, cache_len)
        state = prefill(self.target_state, self.draft_state, prompts, lengths, rows, cache_len,
                        self._started(policy))
        interval = np.int32(stream_interval)
        while True:
            chunk = _progress(state, len(wave))
            if all(chunk.done):
                yield dataclasses.replace(chunk, results=self._results(state, wave))
                return
            yield chunk
            state = advance(self.target_state, self.draft_state, state, rows, interval, self.synthetic_rates)

    def _run_streamed(self, prefill, advance, prompts, lengths, rows, cache_len, policy) -> LoopState:
        """The stream functions run to the end in one chunk (what calibrating a streamed loop times)."""
        state = prefill(self.target_state, self.draft_state, prompts, lengths, rows, cache_len,
                        self._started(policy))
        return advance(self.target_state, self.draft_state, state, rows, np.int32(cache_len), self.synthetic_rates)

    def _policy_inputs(self, run, key: tuple, rows: RowParams, lengths: np.ndarray,
                       cache_len: int) -> PolicyInputs | None:
        """An adaptive loop's step costs: the user's, else stored for this shape, else measured now on the
        compiled loop (run(policy, rows)) and stored. None for a fixed k."""
        policy = self.policy
        if policy is None:
            return None
        if policy.mode != "auto":
            return policy_inputs(np.ones(len(policy.tiers), np.float32))
        if policy.step_costs is not None:
            return policy_inputs(np.asarray(policy.step_costs, np.float32))
        store_key = "|".join(map(str, (self.cost_key, f"tiers={policy.tiers}", f"rows={len(lengths)}",
                                       f"slots={cache_len}", f"loop={key}", jax.devices()[0].device_kind,
                                       f"jax={jax.__version__}")))
        if store_key not in self._step_costs:
            costs = self.step_cost_store.get(store_key)
            if costs is None or len(costs) != len(policy.tiers):
                room = cache_len - spare_slots(self.proposer) - 1 - int(np.max(lengths))
                costs = measure_step_costs(run, rows, len(policy.tiers), room)
                self.step_cost_store.put(store_key, costs)
            self._step_costs[store_key] = policy_inputs(np.asarray(costs, np.float32))
        return self._step_costs[store_key]

    def _started(self, policy: PolicyInputs | None) -> PolicyInputs | None:
        """policy starting from the last adaptive call's running rates (every draft accepted before the first),
        always as an array, so that the first call, later ones and calibration's runs share one executable
        (benchmarks/RESULTS.md, "Shadow drafts": "A call starts from the last one's rates")."""
        if policy is None:
            return None
        start = np.ones(self.proposer.k, np.float32) if self.start_rates is None else self.start_rates
        return dataclasses.replace(policy, start=start)

    def _keep_adaptive_record(self, slots: int, adapt, steps: int) -> None:
        """After an adaptive run of `steps` iterations: its trace, and its final rates for the next call."""
        self.traces.append(WaveTrace(slots, adapt.k_per_step[:steps].tolist(), adapt.live_per_step[:steps].tolist(),
                                     adapt.shadow_per_step[:steps].tolist()))
        self.start_rates = np.asarray(adapt.acceptance)

    def step_costs(self) -> list[list[float]]:
        """The step times auto has weighed tiers by so far, one list (a time per tier) for each batch shape."""
        return [np.asarray(inputs.step_costs).tolist() for inputs in self._step_costs.values()]

    def generate_fn(self, n_top: int, greedy: bool, ranks: bool = False, prompt_top: int | None = None):
        """One jitted function per LoopSpec (top logprobs, all rows greedy, ranks, prompt logprobs); jit itself
        caches one executable per shape bucket. enforce_eager compiles it without CUDA graphs."""
        key = (n_top, greedy, ranks, prompt_top)
        if key not in self._compiled:
            self._compiled[key] = jit_generate(self.target_graph, self.proposer, self._spec(*key), mesh=self.mesh,
                                               compiler_options=self._options())
        return self._compiled[key]

    def admitting_fn(self, n_top: int, greedy: bool, ranks: bool = False, prompt_top: int | None = None):
        """generate_fn's loop under continuous admission (engine/admission.py), cached and compiled the same
        way; slots, cache_len and record_len static."""
        key = (n_top, greedy, ranks, prompt_top)
        if key not in self._admitting:
            fn = build_admitting(self.target_graph, self.proposer, self._spec(*key),
                                 admit_batch=admit_batch(self.config.max_num_seqs))
            replicated = None
            if self.mesh is not None:   # results whole on every device: each process of a multi-host mesh reads them
                fn, replicated = sharded_admitting(fn, self.mesh), NamedSharding(self.mesh, P())
            options = loop_compiler_options() if self._options() is None else self._options()
            self._admitting[key] = jax.jit(fn, static_argnums=(3, 4, 5), compiler_options=options,
                                           out_shardings=replicated)
        return self._admitting[key]

    def stream_fns(self, n_top: int, greedy: bool, ranks: bool = False, prompt_top: int | None = None):
        """generate_fn's (prefill, advance) pair for streaming, cached and compiled the same way."""
        key = (n_top, greedy, ranks, prompt_top)
        if key not in self._streamed:
            self._streamed[key] = jit_stream(self.target_graph, self.proposer, self._spec(*key),
                                             compiler_options=self._options())
        return self._streamed[key]

    def _spec(self, n_top: int, greedy: bool, ranks: bool, prompt_top: int | None) -> LoopSpec:
        return LoopSpec(k=self.proposer.k, n_top=n_top, max_model_len=self.config.max_model_len, greedy=greedy,
                        ranks=ranks, prompt_top=prompt_top, policy=self.policy)

    def _options(self) -> dict[str, str] | None:
        return eager_compiler_options() if self.config.enforce_eager else None

    def _results(self, state: LoopState, wave: Sequence[Request]) -> list[RowResult]:
        # Only what the host reads: the KV caches and token counts stay on device (and are not addressable from
        # one process when the mesh spans hosts).
        state = jax.device_get(dataclasses.replace(state, cache=None, proposer=None, counts=None))
        if state.adapt is not None:
            self._keep_adaptive_record(len(state.lengths), state.adapt, int(state.steps))
        return _unpack(state, wave, self.vocab_size)

    def _pack(self, wave: Sequence[Request],
              num_rows: int | None = None) -> tuple[np.ndarray, np.ndarray, RowParams, int]:
        """The requests as padded host arrays of num_rows rows (by default the wave's bucket, at most the
        slots), and the buffer length they all fit."""
        max_len = self.config.max_model_len
        B = min(bucket(len(wave)), self.config.max_num_seqs) if num_rows is None else num_rows
        longest = max(len(r.prompt_token_ids) for r in wave)
        P = min(bucket(longest, MIN_PROMPT_BUCKET), max_len)
        most_new = max(self._max_new(r) for r in wave)
        cache_len = buffer_len(P, longest, most_new, spare_slots(self.proposer), max_len)
        prompts = np.zeros((B, P), np.int32)
        lengths = np.ones((B,), np.int32)  # padding rows: a one-token prompt that generates nothing
        for i, r in enumerate(wave):
            prompts[i, :len(r.prompt_token_ids)] = r.prompt_token_ids
            lengths[i] = len(r.prompt_token_ids)
        params = [r.params for r in wave] + [SamplingParams(temperature=0.0)] * (B - len(wave))
        max_tokens = [self._max_new(r) for r in wave] + [0] * (B - len(wave))
        rows = row_params(params, vocab_size=self.vocab_size, max_tokens=max_tokens,
                          eos_token_ids=self.eos_token_ids, seeds=self._seeds(wave, params))
        # Host arrays: jit places them on the mesh (under jax.distributed every process passes the same).
        return prompts, lengths, rows, cache_len

    def _seeds(self, wave: Sequence[Request], params: Sequence[SamplingParams]) -> np.ndarray:
        """Each row's seed: the request's own, else one mixed from the engine seed and the request's index,
        so unseeded requests differ across waves."""
        seeds = to_row_arrays(params, self.vocab_size, base_seed=self.config.seed).seed.copy()
        for i, r in enumerate(wave):
            if r.params.seed is None:
                seeds[i] = to_row_arrays([r.params], self.vocab_size, base_seed=self.config.seed + r.seed_index).seed[0]
        return seeds

    def _max_new(self, r: Request) -> int:
        room = self.config.max_model_len - len(r.prompt_token_ids)
        return room if r.params.max_tokens is None else min(r.params.max_tokens, room)


# A call's prompts share its longest one's padded width, so every admitted prefill runs at that width. Where that
# would pad short prompts to over PADDING_LIMIT times their own bucket, short and long prompts go in calls of their
# own when each group fills the slots (a smaller group would run with slots empty: it joins its neighbour).
PADDING_LIMIT = 4


def length_groups(prompt_lengths: Sequence[int], slots: int) -> list[list[int]]:
    """Request indices in groups of similar prompt length (each group in request order): shortest first, a
    group closed before a prompt that would widen it to over PADDING_LIMIT times its first prompt's bucket, once
    it fills the slots; a last group smaller than the slots joins the one before."""
    def width(i: int) -> int:
        return bucket(prompt_lengths[i], MIN_PROMPT_BUCKET)

    groups: list[list[int]] = []
    for i in sorted(range(len(prompt_lengths)), key=lambda i: prompt_lengths[i]):   # stable: ties keep order
        group = groups[-1] if groups else []
        if not groups or (width(i) > max(width(group[-1]), PADDING_LIMIT * width(group[0])) and len(group) >= slots):
            groups.append([])
        groups[-1].append(i)
    if len(groups) > 1 and len(groups[-1]) < slots:
        groups[-2].extend(groups.pop())
    return [sorted(group) for group in groups]


def _spec_key(wave: Sequence[Request], rows: RowParams, vocab_size: int) -> tuple[int, bool, bool, int | None]:
    """What the wave's loop is specialised on: (top logprobs, all rows greedy, ranks, prompt logprobs' top)."""
    n_top = max((_num_top(r.params.logprobs, vocab_size) for r in wave), default=0)
    ranks = any(r.params.logprobs is not None for r in wave)
    asked = [_num_top(r.params.prompt_logprobs, vocab_size) for r in wave if r.params.prompt_logprobs is not None]
    greedy = bool(np.all(rows.temperature < GREEDY_TEMPERATURE_EPS))
    return n_top, greedy, ranks, max(asked) if asked else None


def _progress(state: LoopState, n_rows: int) -> WaveChunk:
    """The wave's requests' tokens so far, copied to host lists (the next chunk donates the state's buffers)."""
    tokens, lengths, prompt_lengths, done = jax.device_get((state.tokens, state.lengths, state.prompt_lengths,
                                                            state.done))
    return WaveChunk([tokens[b, prompt_lengths[b]:lengths[b]].tolist() for b in range(n_rows)],
                     [bool(d) for d in done[:n_rows]])


def synthetic_rates(spec: SpeculativeConfig | None) -> np.ndarray | None:
    """The conditional acceptance rates of synthetic rejection (benchmarks), as the loop takes them."""
    rates = None if spec is None else spec.synthetic_rates()
    return None if rates is None else np.asarray(rates, np.float32)


def _num_top(logprobs: int | None, vocab_size: int) -> int:
    """Top entries a logprobs setting asks for (None: none; -1: the whole vocabulary)."""
    if logprobs is None:
        return 0
    return vocab_size if logprobs < 0 else min(logprobs, vocab_size)


def _unpack(state: LoopState, wave: Sequence[Request], vocab_size: int) -> list[RowResult]:
    """Each request's slice of the wave's state: its generated tokens and their records, its prompt records,
    each cut to the top entries the request asked for (the wave keeps the most any of its rows asked)."""
    results = []
    for b, request in enumerate(wave):
        start, end = int(state.prompt_lengths[b]), int(state.lengths[b])
        p = request.params
        c = state.counters
        prompt = None
        if p.prompt_logprobs is not None:
            prompt = _row_records(state.prompt_logprobs, b, slice(0, start - 1),
                                  _num_top(p.prompt_logprobs, vocab_size))
        results.append(RowResult(
            token_ids=state.tokens[b, start:end].tolist(),
            logprobs=_row_records(state.logprobs, b, slice(start, end), _num_top(p.logprobs, vocab_size)),
            prompt_logprobs=prompt,
            num_drafts=int(c.num_drafts[b]), num_draft_tokens=int(c.num_draft_tokens[b]),
            num_accepted=int(c.num_accepted[b]), accepted_per_pos=c.accepted_per_pos[b].tolist()))
    return results


def _row_records(records: TokenLogprobs, row: int, span: slice, n_top: int) -> TokenLogprobs:
    return TokenLogprobs(records.chosen[row, span], records.rank[row, span], records.top_ids[row, span, :n_top],
                         records.top_logprobs[row, span, :n_top])
