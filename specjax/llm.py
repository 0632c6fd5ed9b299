"""`LLM`: vLLM's offline interface (generate, chat, get_metrics) over specjax's one-call-per-wave engine."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm
from transformers import GenerationConfig

from checkpoints_conv import load_checkpoint
from checkpoints_conv.safetensors_loader import resolve_dtype
from specjax import config as config_lib
from specjax import parallel
from specjax.engine.proposers.build import build_proposer
from specjax.engine.runner import Request, RowResult, WaveRunner
from specjax.engine.stop_strings import apply_stop_strings, token_finish_reason
from specjax.default_model import DEFAULT_MODEL
from specjax.hub import load_tokenizer, resolve_model
from specjax.models.kv_cache import cache_bytes
from specjax.models.model_config import ModelConfig
from specjax.models.registry import build_model
from specjax.outputs import CompletionOutput, Logprob, RequestOutput, spec_decode_metrics
from specjax.sampling_params import SamplingParams, child_params


class LLM:
    """Load a target model (and a draft mechanism) and generate, as `vllm.LLM` does.

    model: a local HF directory, an HF Hub id (resolved through huggingface_hub, offline cache included), a
    converted orbax checkpoint, or None for the embedded default model (SmolLM2-135M-Instruct).
    """

    def __init__(self, model: str | None = None, *, tokenizer: str | None = None, dtype: str = "auto",
                 tensor_parallel_size: int = 1, max_model_len: int | None = None, max_num_seqs: int = 16,
                 seed: int = 0, gpu_memory_utilization: float = 0.9, enforce_eager: bool = False,
                 trust_remote_code: bool = False, revision: str | None = None,
                 speculative_config: dict | None = None, **kwargs: Any):
        model = DEFAULT_MODEL if model is None else model
        self.config = config_lib.EngineConfig.from_kwargs(
            model, tokenizer=tokenizer, dtype=dtype, tensor_parallel_size=tensor_parallel_size,
            max_model_len=max_model_len, max_num_seqs=max_num_seqs, seed=seed,
            gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager,
            trust_remote_code=trust_remote_code, revision=revision, speculative_config=speculative_config,
            **kwargs)
        path = resolve_model(model, revision=revision)
        self.model_config = ModelConfig.from_dir(path)
        self.tokenizer = load_tokenizer(tokenizer or path, trust_remote_code=trust_remote_code)
        self._default_sampling_params = _generation_config_defaults(path)
        self.max_model_len = _max_model_len(max_model_len, self.model_config)
        self.speculative_config = config_lib.SpeculativeConfig.from_dict(
            speculative_config, target_max_model_len=self.max_model_len,
            target_tensor_parallel_size=tensor_parallel_size)
        self.dtype = jnp.dtype(resolve_dtype(self.config.dtype, self.model_config))
        self.mesh, shardings = parallel.plan(self.model_config, tensor_parallel_size)
        params = load_checkpoint(path, self.model_config, self.dtype, shardings)
        target = build_model(self.model_config, params, attention_impl=self.config.attention_impl,
                             unroll_layers=self.config.unroll_layers)
        self.target_graph, self.params = nnx.split(target)
        self.proposer, self.draft_params = build_proposer(self.speculative_config, self.model_config, self.dtype,
                                                          attention_impl=self.config.attention_impl,
                                                          unroll_layers=self.config.unroll_layers, mesh=self.mesh,
                                                          target_params=self.params)
        self._check_kv_cache_fits()
        self._runner = WaveRunner(
            self.target_graph, self.params, self.proposer, self.draft_params,
            max_num_seqs=max_num_seqs, max_model_len=self.max_model_len, eos_token_ids=self._eos_token_ids(),
            vocab_size=self.model_config.vocab_size, seed=seed,
            synthetic_rates=self.speculative_config.synthetic_rates() if self.speculative_config else None,
            mesh=self.mesh)
        self._requests_seen = 0
        self._totals = np.zeros(3, np.int64)
        self._totals_per_pos = np.zeros(max(self.proposer.k, 0), np.int64)

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
        if self.speculative_config is None:
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

    def _eos_token_ids(self) -> list[int]:
        ids = set(self.model_config.eos_token_ids) | {self._primary_eos} - {None}
        return sorted(ids)

    def _extra_eos_ids(self, params: SamplingParams) -> list[int]:
        return [] if params.ignore_eos else [i for i in self._eos_token_ids() if i != self._primary_eos]

    def _check_kv_cache_fits(self) -> None:
        slots = self.max_model_len + self.proposer.k + 1
        need = cache_bytes(self.model_config, self.config.max_num_seqs, slots, self.dtype)
        need //= parallel.cache_shards(self.model_config, self.config.tensor_parallel_size)  # per device
        need += self.proposer.cache_bytes(self.config.max_num_seqs, slots) if hasattr(self.proposer, "cache_bytes") else 0
        config_lib.check_kv_cache_fits(need, _free_device_bytes(), self.config.gpu_memory_utilization,
                                       max_model_len=self.max_model_len, max_num_seqs=self.config.max_num_seqs)


def _max_model_len(requested: int | None, cfg: ModelConfig) -> int:
    if requested is None:
        return cfg.max_position_embeddings
    if requested > cfg.max_position_embeddings:
        raise ValueError(f"max_model_len={requested} is larger than the model's max_position_embeddings="
                         f"{cfg.max_position_embeddings}: lower max_model_len")
    return requested


def _free_device_bytes() -> int:
    """Device memory this process has not used yet. Like vLLM, this counts the device's total memory, not what
    other processes happen to leave free; on CPU the device is host RAM, so that is RAM minus this process's
    resident size."""
    stats = jax.local_devices()[0].memory_stats() or {}  # this process's own device (jax.distributed)
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    page = os.sysconf("SC_PAGE_SIZE")
    resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
    return os.sysconf("SC_PHYS_PAGES") * page - resident_pages * page


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


# generation_config.json field -> SamplingParams field, the ones vLLM takes over as defaults.
_GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                        "max_new_tokens": "max_tokens"}


def _generation_config_defaults(model_dir) -> dict:
    """The sampling settings a model's generation_config.json sets explicitly (none when it has no file)."""
    try:
        explicit = GenerationConfig.from_pretrained(model_dir).to_diff_dict()
    except OSError:
        return {}
    return {ours: explicit[theirs] for theirs, ours in _GENERATION_DEFAULTS.items() if theirs in explicit}


def _prompt_text(prompt) -> str | None:
    if isinstance(prompt, str):
        return prompt
    return prompt.get("prompt") if isinstance(prompt, dict) else None
