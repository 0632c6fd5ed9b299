"""`LLM`: vLLM's offline interface (generate, chat, get_metrics) over specjax's engine, which runs a batch of
requests in one jitted call (more requests than slots too, admitted into slots as rows finish), and their
streamed forms (generate_stream, chat_stream), which run each wave's loop in chunks.

Requests are checked before any work (tokenization aside): a malformed prompt, sampling_params or conversation
raises a TypeError or ValueError naming the prompt and the field, and the engine stays usable.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Iterator, Mapping
from typing import Any, Sequence

import numpy as np
from tqdm.auto import tqdm

from specjax.parallel.mesh import DATA_AXIS
from specjax.build import build_engine
from specjax.config import EngineConfig
from specjax.default_model import DEFAULT_MODEL
from specjax.engine.runner import QueueTrace, Request, RowResult, WaveChunk, WaveRunner, WaveTrace
from specjax.engine.state import TokenLogprobs
from specjax.engine.stop_strings import FinishedRow, apply_stop_strings, token_finish_reason
from specjax.engine.stream_text import TextStream
from specjax.outputs import (CompletionOutput, Logprob, RequestMetrics, RequestOutput, StreamOutput,
                             adaptive_metrics, spec_decode_metrics)
from specjax.sampling_params import SamplingParams, child_params

# The keys of vLLM's text and token prompts that specjax reads; other keys are ignored, as vLLM does, except those
# vLLM gives a meaning specjax lacks (the output would silently differ): those are refused.
PROMPT_KEYS = ("prompt", "prompt_token_ids")
UNSUPPORTED_PROMPT_KEYS = ("multi_modal_data", "mm_processor_kwargs", "prompt_embeds", "token_type_ids")
# Loop steps between streamed updates: small enough that text flows, large enough that the host's look at the
# state (a device round trip and a decode per chunk) stays a small share of the time (benchmarks/RESULTS.md).
DEFAULT_STREAM_INTERVAL = 8


@dataclasses.dataclass(frozen=True)
class _Finished:
    """A completion's request, the runner's result for it and its wave's (started, returned) times."""
    request: Request
    result: RowResult
    span: tuple[float, float]


class LLM:
    """Load a target model (and a draft mechanism) and generate, as `vllm.LLM` does.

    model: a local HF directory, an HF Hub id (resolved through huggingface_hub, offline cache included), a
    converted orbax checkpoint, or None for the embedded default model (SmolLM2-135M-Instruct).
    enforce_eager: compile without CUDA graphs (GPUs; a debugging and profiling mode). trust_remote_code: passed
    to the tokenizer's loader only; no model code from the checkpoint is ever run. max_logprobs: the most
    (prompt_)logprobs a request may ask for (vLLM's default 20; -1: the whole vocabulary).
    Other settings: `specjax.config.EngineConfig`.
    """

    def __init__(self, model: str | None = None, *, tokenizer: str | None = None, dtype: str = "auto",
                 tensor_parallel_size: int = 1, max_model_len: int | None = None, max_num_seqs: int = 16,
                 seed: int | None = 0, gpu_memory_utilization: float = 0.9, enforce_eager: bool = False,
                 trust_remote_code: bool = False, revision: str | None = None,
                 speculative_config: dict | None = None, **kwargs: Any):
        config = EngineConfig.from_kwargs(
            DEFAULT_MODEL if model is None else model, tokenizer=tokenizer, dtype=dtype,
            tensor_parallel_size=tensor_parallel_size, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            seed=seed, gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager,
            trust_remote_code=trust_remote_code, revision=revision, speculative_config=speculative_config,
            **kwargs)
        engine = build_engine(config)
        self.config = engine.config   # resolved: concrete dtype, max_model_len, seed and speculative config
        self.model_config = engine.target.cfg
        self.tokenizer = engine.tokenizer
        self.mesh = engine.target.mesh
        self.target_graph, self.params = engine.target.graph, engine.target.params
        self.proposer, self.draft_params = engine.proposer, engine.draft_params
        self._default_sampling_params = engine.sampling_defaults
        self._runner = WaveRunner(self.target_graph, self.params, self.proposer, self.draft_params, self.config,
                                  eos_token_ids=self.eos_token_ids, vocab_size=self.model_config.vocab_size,
                                  mesh=self.mesh, cost_key=_cost_key(engine.model_dir, self.config))
        self._requests_seen = 0
        self._totals = np.zeros(3, np.int64)
        self._totals_per_pos = np.zeros(max(self.proposer.k, 0), np.int64)

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    @property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends a request unless ignore_eos: the model's EOS ids and the tokenizer's."""
        return sorted(set(self.model_config.eos_token_ids) | {self._primary_eos} - {None})

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate/chat use when given no SamplingParams: vLLM's defaults, overridden by the sampling
        settings of the model's generation_config.json (as vLLM does)."""
        return SamplingParams(**self._default_sampling_params)

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for a prompt or a list of prompts (strings or {"prompt_token_ids": [...]} / {"prompt": ...}),
        one RequestOutput per prompt, in order."""
        arrival = time.time()
        return self._run(*self._checked(prompts, sampling_params), use_tqdm, arrival)

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template: str | None = None) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation (a list of {"role", "content"} dicts) or a
        list of them, then generate."""
        return self.generate(self._chat_prompts(messages, add_generation_prompt, chat_template), sampling_params,
                             use_tqdm)

    def generate_stream(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                        *, stream_interval: int = DEFAULT_STREAM_INTERVAL) -> Iterator[StreamOutput]:
        """generate() streamed: StreamOutputs as tokens come, every `stream_interval` loop steps (a step emits
        1 to k + 1 tokens per row). Each carries one completion's new token ids and text; the deltas of a
        completion concatenate to generate's token_ids and text (stop strings, EOS and max_tokens alike), and
        a request's last update carries the RequestOutput generate returns for it. Requests run in the waves
        generate runs; the input is checked here, before the first update is asked for."""
        arrival = time.time()
        if isinstance(stream_interval, bool) or not isinstance(stream_interval, int) or stream_interval < 1:
            raise ValueError(f"stream_interval must be an int >= 1 (loop steps per update), got "
                             f"{_shown(stream_interval)}")
        return self._stream(*self._checked(prompts, sampling_params), stream_interval, arrival)

    def chat_stream(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                    *, stream_interval: int = DEFAULT_STREAM_INTERVAL, add_generation_prompt: bool = True,
                    chat_template: str | None = None) -> Iterator[StreamOutput]:
        """chat() streamed, as generate_stream streams generate()."""
        return self.generate_stream(self._chat_prompts(messages, add_generation_prompt, chat_template),
                                    sampling_params, stream_interval=stream_interval)

    def get_metrics(self) -> list:
        """vLLM's speculative-decoding counters over every request so far (empty without speculation)."""
        if self.config.speculative is None:
            return []
        metrics = spec_decode_metrics(*(int(x) for x in self._totals), self._totals_per_pos.tolist())
        if self._runner.policy is None:
            return metrics
        traces = self._runner.traces
        per_k = np.bincount([k for t in traces for k in t.k_per_step], minlength=self.proposer.k + 1)
        return metrics + adaptive_metrics(per_k.tolist(), sum(sum(t.live_per_step) for t in traces),
                                          sum(t.slots * len(t.k_per_step) for t in traces),
                                          sum(sum(t.shadow_per_step) for t in traces))

    def admission_trace(self) -> list[QueueTrace]:
        """Continuous admission's record of each call that ran more requests than slots: its slots, requests
        and iterations, each slot's busy iterations (`occupancy`: their share) and the prefill batches."""
        return list(self._runner.queue_traces)

    def speculation_trace(self) -> list[WaveTrace]:
        """Adaptive speculation's record of each wave so far: its slots, and per loop iteration the k drafted
        and the rows running (empty for a fixed k)."""
        return list(self._runner.traces)

    def _checked(self, prompts, sampling_params) -> tuple[list, list[list[int]], list[SamplingParams]]:
        """(prompts, their token ids, their SamplingParams), every request checked before any work."""
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = _params_per_prompt(sampling_params, len(prompt_list))
        token_lists = [self._tokenize(i, p) for i, p in enumerate(prompt_list)]
        for i, (ids, params) in enumerate(zip(token_lists, params_list)):
            self._check_prompt(i, ids)
            self._check_logprobs(i, params)
        return prompt_list, token_lists, params_list

    def _chat_prompts(self, messages, add_generation_prompt: bool, chat_template: str | None) -> list[dict]:
        conversations = _as_conversations(messages)
        prompts = [self.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                      chat_template=chat_template) for c in conversations]
        return [{"prompt_token_ids": self.tokenizer.encode(p, add_special_tokens=False), "prompt": p}
                for p in prompts]

    def _requests(self, token_lists, params_list) -> tuple[list[Request], list[int]]:
        """One single-sample request per completion, and the prompt each belongs to."""
        requests, owners = [], []
        for i, (ids, params) in enumerate(zip(token_lists, params_list)):
            for child in child_params(params):
                requests.append(Request(ids, child, self._requests_seen))
                owners.append(i)
                self._requests_seen += 1
        return requests, owners

    def _run(self, prompt_list, token_lists, params_list, use_tqdm, arrival: float) -> list[RequestOutput]:
        requests, owners = self._requests(token_lists, params_list)
        finished: list[list[_Finished]] = [[] for _ in prompt_list]
        with tqdm(total=len(requests), disable=not use_tqdm, desc="Processed prompts") as bar:
            for indices, batch, results, span in self._calls(requests):
                for i, request, result in zip(indices, batch, results):
                    finished[owners[i]].append(_Finished(request, result, span))
                bar.update(len(batch))
        return [self._request_output(i, p, ids, done, arrival)
                for i, (p, ids, done) in enumerate(zip(prompt_list, token_lists, finished))]

    def _stream(self, prompt_list, token_lists, params_list, stream_interval: int,
                arrival: float) -> Iterator[StreamOutput]:
        requests, owners = self._requests(token_lists, params_list)
        child = _completion_indices(owners)
        finished: list[list[_Finished]] = [[] for _ in prompt_list]
        for start, wave in self._waves(requests):
            started = time.time()
            streams = [TextStream(functools.partial(self._finished_row, r), r.params.stop or [],
                                  r.params.include_stop_str_in_output) for r in wave]
            names = [(str(owners[j]), child[j]) for j in range(start, start + len(wave))]
            for chunk in self._runner.stream_wave(wave, stream_interval):
                yield from _deltas(streams, chunk, names)
            span = (started, time.time())
            for j, request, result in zip(range(start, start + len(wave)), wave, chunk.results):
                owner = owners[j]
                finished[owner].append(_Finished(request, result, span))
                if len(finished[owner]) == params_list[owner].n:
                    yield StreamOutput(str(owner), child[j], [], "", True, self._request_output(
                        owner, prompt_list[owner], token_lists[owner], finished[owner], arrival))

    def _calls(self, requests: list[Request]) -> Iterator[tuple[list[int], list[Request], list, tuple[float, float]]]:
        """(the requests' indices, the requests, their results, (started, returned)) per jitted call: calls under
        continuous admission when the requests outnumber the slots (unless continuous_admission=False), on one
        device or a mesh of one data replica, else a wave each (streaming, and data replicas, run waves)."""
        one_replica = self.mesh is None or self.mesh.shape[DATA_AXIS] == 1
        if self.config.continuous_admission and len(requests) > self.config.max_num_seqs and one_replica:
            calls = [(indices, self._runner.run_queue) for indices in self._runner.queues(requests)]
        else:
            calls = [(list(range(start, start + len(wave))), self._runner.run_wave)
                     for start, wave in self._waves(requests)]
        for indices, run in calls:
            batch = [requests[i] for i in indices]
            started = time.time()
            results = run(batch)
            yield indices, batch, results, (started, time.time())

    def _waves(self, requests: list[Request]) -> Iterator[tuple[int, list[Request]]]:
        """The runner's waves, each with the index of its first request."""
        return _numbered(self._runner.waves(requests))

    def _request_output(self, index: int, prompt, prompt_token_ids: list[int], finished: list[_Finished],
                        arrival: float) -> RequestOutput:
        """A prompt's RequestOutput from its completions' results (counted into get_metrics here)."""
        out = RequestOutput(request_id=str(index), prompt=_prompt_text(prompt), prompt_token_ids=prompt_token_ids,
                            outputs=[self._completion(n, f.request, f.result) for n, f in enumerate(finished)],
                            metrics=_request_metrics(arrival, sorted({f.span for f in finished})))
        asked = [f for f in finished if f.result.prompt_logprobs is not None]
        if asked:
            out.prompt_logprobs = self._prompt_logprobs(prompt_token_ids, asked[0].result)
        for f in finished:
            self._count(f.result)
        return out

    def _finished_row(self, request: Request, token_ids: Sequence[int], done: bool = True) -> FinishedRow:
        """The row's text, kept tokens and finish reason had it ended after token_ids; done: the loop ended it
        (so a stop token there is its finish), else only a stop string can have."""
        p = request.params
        finish_reason, stop_reason = token_finish_reason(
            token_ids, eos_token_id=self._primary_eos, ignore_eos=p.ignore_eos,
            stop_token_ids=list(p.stop_token_ids or []) + self._extra_eos_ids(p)) if done else (None, None)
        return apply_stop_strings(
            token_ids, self.tokenizer, p.stop or [], include_stop_str_in_output=p.include_stop_str_in_output,
            skip_special_tokens=p.skip_special_tokens, finish_reason=finish_reason, stop_reason=stop_reason,
            min_tokens=p.min_tokens, prompt_token_ids=request.prompt_token_ids)

    def _completion(self, index: int, request: Request, r: RowResult) -> CompletionOutput:
        p = request.params
        text, kept, finish_reason, stop_reason = self._finished_row(request, r.token_ids)
        n = len(kept)
        logprobs = [self._logprob_entry(r.logprobs, t, kept[t]) for t in range(n)] if p.logprobs is not None else None
        return CompletionOutput(
            index=index, text=text, token_ids=kept,
            cumulative_logprob=float(np.sum(r.logprobs.chosen[:n])) if p.logprobs is not None else None,
            logprobs=logprobs, finish_reason=finish_reason, stop_reason=stop_reason,
            num_drafts=r.num_drafts, num_draft_tokens=r.num_draft_tokens, num_accepted_tokens=r.num_accepted,
            num_accepted_tokens_per_pos=r.accepted_per_pos)

    def _logprob_entry(self, records: TokenLogprobs, t: int, token: int) -> dict[int, Logprob]:
        """vLLM's {token_id: Logprob} for record t: the token's own (with its rank), then the top entries (ranks
        1..n; the token's own entry, when among them, stays first)."""
        entry = {token: Logprob(float(records.chosen[t]), int(records.rank[t]), self.tokenizer.decode([token]))}
        for rank, (i, value) in enumerate(zip(records.top_ids[t].tolist(), records.top_logprobs[t].tolist())):
            entry[i] = Logprob(value, rank + 1, self.tokenizer.decode([i]))
        return entry

    def _prompt_logprobs(self, prompt_token_ids: list[int], r: RowResult) -> list[dict[int, Logprob] | None]:
        """vLLM's prompt_logprobs: None for the first prompt token, then each one's entry given those before."""
        return [None] + [self._logprob_entry(r.prompt_logprobs, t, token)
                         for t, token in enumerate(prompt_token_ids[1:])]

    def _count(self, r: RowResult) -> None:
        self._totals += (r.num_drafts, r.num_draft_tokens, r.num_accepted)
        if self._totals_per_pos.size:
            self._totals_per_pos += np.asarray(r.accepted_per_pos, np.int64)

    def _tokenize(self, index: int, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, Mapping):
            raise TypeError(f"prompt {index} is {_shown(prompt)}: a prompt is a string, {{'prompt': '<text>'}} or "
                            "{'prompt_token_ids': [<int>, ...]}")
        if not set(prompt) & set(PROMPT_KEYS):
            raise ValueError(f"prompt {index} is a dict with keys {sorted(prompt, key=str)}: a prompt dict needs "
                             "'prompt' (text) or 'prompt_token_ids' (a list of ints)")
        unsupported = [key for key in UNSUPPORTED_PROMPT_KEYS if key in prompt]
        if unsupported:
            raise ValueError(f"prompt {index} has {unsupported}, which specjax does not support (text-only models): "
                             "remove them")
        if "prompt_token_ids" in prompt:
            return _token_ids(index, prompt["prompt_token_ids"])
        if not isinstance(prompt["prompt"], str):
            raise TypeError(f"prompt {index}'s 'prompt' must be a string, got {_shown(prompt['prompt'])}; pass "
                            "token ids as {'prompt_token_ids': [...]}")
        return self.tokenizer.encode(prompt["prompt"])

    def _check_prompt(self, index: int, ids: list[int]) -> None:
        if not ids:
            raise ValueError(f"prompt {index} is empty: give at least one token")
        if len(ids) > self.max_model_len:
            raise ValueError(f"prompt {index} has {len(ids)} tokens, more than max_model_len={self.max_model_len}: "
                             "shorten the prompt or raise max_model_len")
        bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"prompt {index} has token ids outside [0, {self.model_config.vocab_size}): {bad[:5]}")

    def _check_logprobs(self, index: int, params: SamplingParams) -> None:
        """vLLM's limit: at most max_logprobs (prompt_)logprobs per token, -1 meaning the whole vocabulary."""
        vocab = self.model_config.vocab_size
        limit = vocab if self.config.max_logprobs == -1 else self.config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked is not None and (vocab if asked == -1 else asked) > limit:
                raise ValueError(f"prompt {index} asks for {name}={asked}, more than max_logprobs={limit} allows "
                                 f"(as vLLM refuses): ask for fewer, or raise LLM(max_logprobs=...) (at most the "
                                 f"vocabulary, {vocab}; -1 for all of it)")

    @property
    def _primary_eos(self) -> int | None:
        """The tokenizer's EOS (vLLM reports stop_reason None for it); other model EOS ids act as stop ids."""
        if self.tokenizer.eos_token_id is not None:
            return self.tokenizer.eos_token_id
        return self.model_config.eos_token_ids[0] if self.model_config.eos_token_ids else None

    def _extra_eos_ids(self, params: SamplingParams) -> list[int]:
        return [] if params.ignore_eos else [i for i in self.eos_token_ids if i != self._primary_eos]


def _shown(value: Any) -> str:
    """A value for an error message: its type and a short repr."""
    text, name = repr(value), type(value).__name__
    article = "an" if name[0] in "aeiou" else "a"
    return f"{article} {name} ({text if len(text) <= 40 else text[:37] + '...'})"


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a prompt (a string, {{'prompt': ...}} or {{'prompt_token_ids': [...]}}) or "
                        f"a list of them, got {_shown(prompts)}")
    if not prompts:
        raise ValueError("prompts is empty: pass a prompt or a non-empty list of prompts")
    return list(prompts)


def _token_ids(index: int, ids: Any) -> list[int]:
    """A prompt's token ids as ints, or a TypeError: never a string split into digits or floats truncated."""
    if isinstance(ids, np.ndarray) and ids.ndim == 1 and np.issubdtype(ids.dtype, np.integer):
        return ids.tolist()
    if not isinstance(ids, (list, tuple)):
        raise TypeError(f"prompt {index}'s prompt_token_ids must be a list of int token ids, got {_shown(ids)}"
                        + ("; pass text as {'prompt': ...}" if isinstance(ids, str) else ""))
    bad = [(i, t) for i, t in enumerate(ids) if isinstance(t, bool) or not isinstance(t, (int, np.integer))]
    if bad:
        i, t = bad[0]
        raise TypeError(f"prompt {index}'s prompt_token_ids must hold int token ids; entry {i} is {_shown(t)}")
    return [int(t) for t in ids]


def _params_per_prompt(sampling_params, n: int) -> list[SamplingParams]:
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    if not isinstance(sampling_params, (list, tuple)):
        hint = " (build one: SamplingParams(**your_dict))" if isinstance(sampling_params, Mapping) else ""
        raise TypeError(f"sampling_params must be a SamplingParams or a list of them, one per prompt; got "
                        f"{_shown(sampling_params)}{hint}")
    for i, params in enumerate(sampling_params):
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params[{i}] must be a SamplingParams, got {_shown(params)}")
    if len(sampling_params) != n:
        raise ValueError(f"sampling_params has {len(sampling_params)} entries for {n} prompts: pass one, or one per "
                         "prompt")
    return list(sampling_params)


def _as_conversations(messages) -> list[list[Mapping]]:
    """chat()'s messages as a list of conversations, each a non-empty list of {"role", "content"} dicts."""
    example = "[{'role': 'user', 'content': 'Hi'}]"
    if not isinstance(messages, (list, tuple)) or not messages:
        raise TypeError(f"chat() takes a conversation, a non-empty list of {{'role': ..., 'content': ...}} dicts "
                        f"(e.g. {example}), or a list of conversations; got {_shown(messages)}")
    conversations = [messages] if isinstance(messages[0], Mapping) else list(messages)
    for i, conversation in enumerate(conversations):
        if not isinstance(conversation, (list, tuple)) or not conversation:
            raise TypeError(f"conversation {i} must be a non-empty list of {{'role': ..., 'content': ...}} dicts "
                            f"(e.g. {example}), got {_shown(conversation)}")
        for j, message in enumerate(conversation):
            if not isinstance(message, Mapping) or not isinstance(message.get("role"), str) or "content" not in message:
                raise TypeError(f"conversation {i}, message {j} must be a dict with a string 'role' and a "
                                f"'content' (e.g. {example[1:-1]}), got {_shown(message)}")
    return conversations


def _deltas(streams: list[TextStream], chunk: WaveChunk, names: list[tuple[str, int]]) -> Iterator[StreamOutput]:
    """What one chunk brings each row's completion (named (request_id, index)) that was not finished before."""
    for stream, tokens, done, (request_id, index) in zip(streams, chunk.token_ids, chunk.done, names):
        if stream.finished:
            continue
        delta = stream.update(tokens, done)
        if delta.token_ids or delta.text or delta.finished:
            yield StreamOutput(request_id, index, *delta)


def _completion_indices(owners: list[int]) -> list[int]:
    """Each request's index among its prompt's completions (a prompt's requests are consecutive)."""
    indices: list[int] = []
    for j, owner in enumerate(owners):
        indices.append(indices[-1] + 1 if j and owners[j - 1] == owner else 0)
    return indices


def _cost_key(model_dir, config) -> str:
    """What names this engine's model and proposer among stored step times."""
    spec = config.speculative
    if spec is None:
        return str(model_dir)
    return "|".join(map(str, (model_dir, config.dtype, config.tensor_parallel_size, spec.method, spec.model,
                              spec.num_speculative_tokens, spec.draft_sample_method)))


def _request_metrics(arrival: float, waves: list[tuple[float, float]]) -> RequestMetrics:
    """A request's timing from the (started, returned) times of the waves that ran its samples, in order."""
    first_started, first_returned = waves[0]
    last_returned = max(end for _, end in waves)
    return RequestMetrics(arrival_time=arrival, last_token_time=last_returned, first_scheduled_time=first_started,
                          first_token_time=first_returned, time_in_queue=first_started - arrival,
                          finished_time=last_returned, model_execute_time=sum(end - start for start, end in waves))


def _prompt_text(prompt) -> str | None:
    if isinstance(prompt, str):
        return prompt
    return prompt.get("prompt") if isinstance(prompt, dict) else None


def _numbered(groups: Iterator[list[Request]]) -> Iterator[tuple[int, list[Request]]]:
    """Consecutive groups of requests, each with the index of its first request."""
    start = 0
    for group in groups:
        yield start, group
        start += len(group)
