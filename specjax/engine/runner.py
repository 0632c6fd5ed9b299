"""Host side of generation: group requests into waves, pad them to shape buckets, run the jitted loop once
per wave, and hand back each row's tokens, logprobs and speculative counters."""
from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from specjax.config import EngineConfig, SpeculativeConfig
from specjax.engine.loop import LoopSpec, jit_generate
from specjax.engine.proposers.base import Proposer
from specjax.engine.rows import row_params
from specjax.engine.shapes import MIN_PROMPT_BUCKET, bucket, buffer_len
from specjax.engine.state import LoopState, RowParams
from specjax.sampling_params import GREEDY_TEMPERATURE_EPS, SamplingParams, to_row_arrays


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
                 config: EngineConfig, *, eos_token_ids: Sequence[int], vocab_size: int, mesh: Mesh | None = None):
        """config: the resolved engine config (max_num_seqs, max_model_len, seed, speculative). mesh: run each
        wave tensor-parallel over it (the states already placed on it); None: one device."""
        self.target_graph, self.target_state = target_graph, target_state
        self.proposer, self.draft_state = proposer, draft_state
        self.config = config
        self.eos_token_ids, self.vocab_size = tuple(eos_token_ids), vocab_size
        self.synthetic_rates = synthetic_rates(config.speculative)
        self.mesh = mesh
        self._compiled: dict[tuple[int, bool], Any] = {}

    def waves(self, requests: Sequence[Request]) -> Iterator[list[Request]]:
        step = self.config.max_num_seqs
        for i in range(0, len(requests), step):
            yield list(requests[i:i + step])

    def run_wave(self, wave: Sequence[Request]) -> list[RowResult]:
        n_top = max((_num_top(r.params, self.vocab_size) for r in wave), default=0)
        prompts, lengths, rows, cache_len = self._pack(wave)
        greedy = bool(np.all(rows.temperature < GREEDY_TEMPERATURE_EPS))
        state = self.generate_fn(n_top, greedy)(self.target_state, self.draft_state, prompts, lengths, rows,
                                                cache_len, self.synthetic_rates)
        # Only what the host reads: the KV caches stay on device (and are not addressable from one process
        # when the mesh spans hosts).
        return _unpack(jax.device_get(dataclasses.replace(state, cache=None, proposer=None)), len(wave))

    def generate_fn(self, n_top: int, greedy: bool):
        """One jitted function per (n_top, all rows greedy); jit itself caches one executable per shape
        bucket."""
        if (n_top, greedy) not in self._compiled:
            spec = LoopSpec(k=self.proposer.k, n_top=n_top, max_model_len=self.config.max_model_len, greedy=greedy)
            self._compiled[n_top, greedy] = jit_generate(self.target_graph, self.proposer, spec, mesh=self.mesh)
        return self._compiled[n_top, greedy]

    def _pack(self, wave: Sequence[Request]) -> tuple[np.ndarray, np.ndarray, RowParams, int]:
        max_len = self.config.max_model_len
        B = min(bucket(len(wave)), self.config.max_num_seqs)
        longest = max(len(r.prompt_token_ids) for r in wave)
        P = min(bucket(longest, MIN_PROMPT_BUCKET), max_len)
        most_new = max(self._max_new(r) for r in wave)
        cache_len = buffer_len(P, longest, most_new, self.proposer.k, max_len)
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


def synthetic_rates(spec: SpeculativeConfig | None) -> np.ndarray | None:
    """The conditional acceptance rates of synthetic rejection (benchmarks), as the loop takes them."""
    rates = None if spec is None else spec.synthetic_rates()
    return None if rates is None else np.asarray(rates, np.float32)


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
