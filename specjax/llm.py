"""`LLM`: vLLM's offline interface (generate, chat, get_metrics) over specjax's one-call-per-wave engine."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from tqdm.auto import tqdm

from specjax.build import build_engine
from specjax.config import EngineConfig
from specjax.default_model import DEFAULT_MODEL
from specjax.engine.runner import Request, RowResult, WaveRunner
from specjax.engine.stop_strings import apply_stop_strings, token_finish_reason
from specjax.outputs import CompletionOutput, Logprob, RequestOutput, spec_decode_metrics
from specjax.sampling_params import SamplingParams, child_params


class LLM:
    """Load a target model (and a draft mechanism) and generate, as `vllm.LLM` does.

    model: a local HF directory, an HF Hub id (resolved through huggingface_hub, offline cache included), a
    converted orbax checkpoint, or None for the embedded default model (SmolLM2-135M-Instruct).
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
                                  mesh=self.mesh)
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
        """Generate for a prompt or a list of prompts (strings or {"prompt_token_ids": [...]} / {"prompt": ...})."""
        prompt_list = _as_prompt_list(prompts)
        token_lists = [self._tokenize(p) for p in prompt_list]
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = _params_per_prompt(sampling_params, len(prompt_list))
        for i, ids in enumerate(token_lists):
            self._check_prompt(i, ids)
        return self._run(prompt_list, token_lists, params_list, use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template: str | None = None) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                      chat_template=chat_template) for c in conversations]
        token_lists = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        return self.generate([{"prompt_token_ids": ids, "prompt": p} for ids, p in zip(token_lists, prompts)],
                             sampling_params, use_tqdm)

    def get_metrics(self) -> list:
        """vLLM's speculative-decoding counters over every request so far (empty without speculation)."""
        if self.config.speculative is None:
            return []
        return spec_decode_metrics(*(int(x) for x in self._totals), self._totals_per_pos.tolist())

    def _run(self, prompt_list, token_lists, params_list, use_tqdm) -> list[RequestOutput]:
        requests, owners = [], []
        for i, (ids, params) in enumerate(zip(token_lists, params_list)):
            for child in child_params(params):
                requests.append(Request(ids, child, self._requests_seen))
                owners.append(i)
                self._requests_seen += 1
        results: list[RowResult] = []
        with tqdm(total=len(requests), disable=not use_tqdm, desc="Processed prompts") as bar:
            for wave in self._runner.waves(requests):
                results.extend(self._runner.run_wave(wave))
                bar.update(len(wave))
        outputs = [RequestOutput(request_id=str(i), prompt=_prompt_text(p), prompt_token_ids=ids, outputs=[])
                   for i, (p, ids) in enumerate(zip(prompt_list, token_lists))]
        for owner, request, result in zip(owners, requests, results):
            completion = self._completion(len(outputs[owner].outputs), request, result)
            outputs[owner].outputs.append(completion)
            self._count(result)
        return outputs

    def _completion(self, index: int, request: Request, r: RowResult) -> CompletionOutput:
        p = request.params
        finish_reason, stop_reason = token_finish_reason(
            r.token_ids, eos_token_id=self._primary_eos, ignore_eos=p.ignore_eos,
            stop_token_ids=list(p.stop_token_ids or []) + self._extra_eos_ids(p))
        text, kept, finish_reason, stop_reason = apply_stop_strings(
            r.token_ids, self.tokenizer, p.stop or [], include_stop_str_in_output=p.include_stop_str_in_output,
            skip_special_tokens=p.skip_special_tokens, finish_reason=finish_reason, stop_reason=stop_reason,
            min_tokens=p.min_tokens, prompt_token_ids=request.prompt_token_ids)
        n = len(kept)
        logprobs = self._logprobs(r, n) if p.logprobs is not None else None
        return CompletionOutput(
            index=index, text=text, token_ids=kept,
            cumulative_logprob=float(np.sum(r.logprobs[:n])) if p.logprobs is not None else None,
            logprobs=logprobs, finish_reason=finish_reason, stop_reason=stop_reason,
            num_drafts=r.num_drafts, num_draft_tokens=r.num_draft_tokens, num_accepted_tokens=r.num_accepted,
            num_accepted_tokens_per_pos=r.accepted_per_pos)

    def _logprobs(self, r: RowResult, n: int) -> list[dict[int, Logprob]]:
        out = []
        for t in range(n):
            entry = {int(i): Logprob(float(v), rank + 1, self.tokenizer.decode([int(i)]))
                     for rank, (i, v) in enumerate(zip(r.top_ids[t], r.top_logprobs[t]))}
            token = r.token_ids[t]
            if token not in entry:
                rank = int(np.sum(r.top_logprobs[t] > r.logprobs[t])) + 1 if r.top_ids.shape[1] else None
                entry[token] = Logprob(float(r.logprobs[t]), rank, self.tokenizer.decode([token]))
            out.append(entry)
        return out

    def _count(self, r: RowResult) -> None:
        self._totals += (r.num_drafts, r.num_draft_tokens, r.num_accepted)
        if self._totals_per_pos.size:
            self._totals_per_pos += np.asarray(r.accepted_per_pos, np.int64)

    def _tokenize(self, prompt) -> list[int]:
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return [int(t) for t in prompt["prompt_token_ids"]]
        text = prompt["prompt"] if isinstance(prompt, dict) else prompt
        if not isinstance(text, str):
            raise TypeError(f"a prompt must be a str or a dict with 'prompt' or 'prompt_token_ids', got {type(prompt).__name__}")
        return self.tokenizer.encode(text)

    def _check_prompt(self, index: int, ids: list[int]) -> None:
        if not ids:
            raise ValueError(f"prompt {index} is empty: give at least one token")
        if len(ids) > self.max_model_len:
            raise ValueError(f"prompt {index} has {len(ids)} tokens, more than max_model_len={self.max_model_len}: "
                             "shorten the prompt or raise max_model_len")
        bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"prompt {index} has token ids outside [0, {self.model_config.vocab_size}): {bad[:5]}")

    @property
    def _primary_eos(self) -> int | None:
        """The tokenizer's EOS (vLLM reports stop_reason None for it); other model EOS ids act as stop ids."""
        if self.tokenizer.eos_token_id is not None:
            return self.tokenizer.eos_token_id
        return self.model_config.eos_token_ids[0] if self.model_config.eos_token_ids else None

    def _extra_eos_ids(self, params: SamplingParams) -> list[int]:
        return [] if params.ignore_eos else [i for i in self.eos_token_ids if i != self._primary_eos]


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    prompts = list(prompts)
    if not prompts:
        raise ValueError("prompts is empty: pass a prompt or a non-empty list of prompts")
    return prompts


def _params_per_prompt(sampling_params, n: int) -> list[SamplingParams]:
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    params = list(sampling_params)
    if len(params) != n:
        raise ValueError(f"sampling_params has {len(params)} entries for {n} prompts: pass one, or one per prompt")
    return params


def _prompt_text(prompt) -> str | None:
    if isinstance(prompt, str):
        return prompt
    return prompt.get("prompt") if isinstance(prompt, dict) else None
