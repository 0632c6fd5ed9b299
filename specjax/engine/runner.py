"""Host side of generation: group requests into waves, pad them to shape buckets, run the jitted loop once
per wave, and hand back each row's tokens, logprobs and speculative counters."""
from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from specjax.engine.loop import LoopSpec, build_generate, loop_compiler_options
from specjax.engine.proposers.base import Proposer
from specjax.engine.sampling import GREEDY_TEMPERATURE_EPS
from specjax.engine.shapes import MIN_PROMPT_BUCKET, bucket, buffer_len
from specjax.engine.state import LoopState, RowParams
from specjax.parallel import sharded_generate
from specjax.sampling_params import SamplingParams, to_row_arrays


@dataclasses.dataclass(frozen=True)
class Request:
    prompt_token_ids: list[int]
    params: SamplingParams
    seed_index: int  # mixed with the LLM seed when the request has no seed of its own


@dataclasses.dataclass(frozen=True)
class RowResult:
    token_ids: list[int]
    logprobs: np.ndarray                  # [n] raw logprob of each generated token
    top_ids: np.ndarray                   # [n, n_top]
    top_logprobs: np.ndarray              # [n, n_top]
    num_drafts: int
    num_draft_tokens: int
    num_accepted: int
    accepted_per_pos: list[int]


class WaveRunner:
    def __init__(self, target_graph: nnx.GraphDef, target_state: Any, proposer: Proposer, draft_state: Any,
                 *, max_num_seqs: int, max_model_len: int, eos_token_ids: Sequence[int], vocab_size: int,
                 seed: int, synthetic_rates: tuple[float, ...] | None = None, mesh: Mesh | None = None):
        """mesh: run each wave tensor-parallel over it (the states already placed on it); None: one device."""
        self.target_graph, self.target_state = target_graph, target_state
        self.proposer, self.draft_state = proposer, draft_state
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self.eos_token_ids, self.vocab_size, self.seed = tuple(eos_token_ids), vocab_size, seed
        self.synthetic_rates = None if synthetic_rates is None else np.asarray(synthetic_rates, np.float32)
        self.mesh = mesh
        self._compiled: dict[tuple[int, bool], Any] = {}

    def waves(self, requests: Sequence[Request]) -> Iterator[list[Request]]:
        for i in range(0, len(requests), self.max_num_seqs):
            yield list(requests[i:i + self.max_num_seqs])

    def run_wave(self, wave: Sequence[Request]) -> list[RowResult]:
        n_top = max((_num_top(r.params, self.vocab_size) for r in wave), default=0)
        prompts, lengths, rows, cache_len = self._pack(wave)
        greedy = bool(np.all(rows.temperature < GREEDY_TEMPERATURE_EPS))
        state = self._generate_fn(n_top, greedy)(self.target_state, self.draft_state, prompts, lengths, rows,
                                                 cache_len, self.synthetic_rates)
        # Only what the host reads: the KV caches stay on device (and are not addressable from one process
        # when the mesh spans hosts).
        return _unpack(jax.device_get(dataclasses.replace(state, cache=None, proposer=None)), len(wave))

    def _generate_fn(self, n_top: int, greedy: bool):
        """One jitted function per (n_top, all rows greedy); jit itself caches one executable per shape
        bucket."""
        if (n_top, greedy) not in self._compiled:
            spec = LoopSpec(k=self.proposer.k, n_top=n_top, max_model_len=self.max_model_len, greedy=greedy)
            generate = build_generate(self.target_graph, self.proposer, spec)
            if self.mesh is not None:
                generate = sharded_generate(generate, self.mesh)
            self._compiled[n_top, greedy] = jax.jit(generate, static_argnums=(5,),
                                                    compiler_options=loop_compiler_options())
        return self._compiled[n_top, greedy]

    def _pack(self, wave: Sequence[Request]) -> tuple[np.ndarray, np.ndarray, RowParams, int]:
        B = min(bucket(len(wave)), self.max_num_seqs)
        longest = max(len(r.prompt_token_ids) for r in wave)
        P = min(bucket(longest, MIN_PROMPT_BUCKET), self.max_model_len)
        most_new = max(self._max_new(r) for r in wave)
        cache_len = buffer_len(P, longest, most_new, self.proposer.k, self.max_model_len)
        prompts = np.zeros((B, P), np.int32)
        lengths = np.ones((B,), np.int32)  # padding rows: a one-token prompt that generates nothing
        for i, r in enumerate(wave):
            prompts[i, :len(r.prompt_token_ids)] = r.prompt_token_ids
            lengths[i] = len(r.prompt_token_ids)
        params = [r.params for r in wave] + [SamplingParams(temperature=0.0)] * (B - len(wave))
        arrays = to_row_arrays(params, self.vocab_size, base_seed=self.seed)
        seeds = arrays.seed.copy()
        for i, r in enumerate(wave):  # unseeded requests: distinct per request across waves
            if r.params.seed is None:
                seeds[i] = to_row_arrays([r.params], self.vocab_size, base_seed=self.seed + r.seed_index).seed[0]
        max_tokens = np.zeros((B,), np.int32)
        max_tokens[:len(wave)] = [self._max_new(r) for r in wave]
        min_tokens = np.zeros((B,), np.int32)
        min_tokens[:len(wave)] = [r.params.min_tokens for r in wave]
        rows = RowParams(temperature=arrays.temperature, top_k=arrays.top_k, top_p=arrays.top_p,
                         min_p=arrays.min_p, seed=seeds, max_tokens=max_tokens, min_tokens=min_tokens,
                         stop_ids=self._stop_ids(wave, B))
        # Host arrays: jit places them on the mesh (under jax.distributed every process passes the same).
        return prompts, lengths, jax.tree.map(np.asarray, rows), cache_len

    def _max_new(self, r: Request) -> int:
        room = self.max_model_len - len(r.prompt_token_ids)
        return room if r.params.max_tokens is None else min(r.params.max_tokens, room)

    def _stop_ids(self, wave: Sequence[Request], B: int) -> np.ndarray:
        per_row = [self.row_stop_ids(r.params) for r in wave]
        stop_ids = np.full((B, bucket(max(len(s) for s in per_row))), -1, np.int32)
        for i, ids in enumerate(per_row):
            stop_ids[i, :len(ids)] = ids
        return stop_ids

    def row_stop_ids(self, params: SamplingParams) -> list[int]:
        eos = [] if params.ignore_eos else list(self.eos_token_ids)
        return sorted(set(eos) | set(params.stop_token_ids or []))


def _num_top(params: SamplingParams, vocab_size: int) -> int:
    if params.logprobs is None:
        return 0
    return vocab_size if params.logprobs < 0 else min(params.logprobs, vocab_size)


def _unpack(state: LoopState, n: int) -> list[RowResult]:
    results = []
    for b in range(n):
        start, end = int(state.prompt_lengths[b]), int(state.lengths[b])
        ids = state.tokens[b, start:end].tolist()
        c = state.counters
        results.append(RowResult(
            token_ids=ids, logprobs=state.logprobs[b, start:end], top_ids=state.top_ids[b, start:end],
            top_logprobs=state.top_logprobs[b, start:end],
            num_drafts=int(c.num_drafts[b]), num_draft_tokens=int(c.num_draft_tokens[b]),
            num_accepted=int(c.num_accepted[b]), accepted_per_pos=c.accepted_per_pos[b].tolist()))
    return results
