"""`LLM(...)` / vLLM `EngineArgs` settings: parsed and validated before anything loads (`from_kwargs`), then
made concrete once the model's config.json is read (`resolve`). Settings that only steer vLLM's CUDA engine
are accepted with a warning that they have no effect; unknown names raise a TypeError listing the accepted
ones."""

from __future__ import annotations

import dataclasses
import os
import secrets
import warnings
from collections.abc import Mapping
from typing import Any

import jax

from specjax.config.dtypes import canonical_dtype
from specjax.config.speculative import SpeculativeConfig
from specjax.config.validators import (ANY, check_bool, check_int, check_memory_fraction, check_optional_str,
                                       path_or_id)
from specjax.kernels.policy import IMPLS

# vLLM's offline LLM default; the engine may run fewer rows when fewer prompts are given.
DEFAULT_MAX_NUM_SEQS = 256
# vLLM's default bound on logprobs and prompt_logprobs per token (-1: the whole vocabulary).
DEFAULT_MAX_LOGPROBS = 20

# vLLM EngineArgs that tune its CUDA engine (memory manager, scheduler, CUDA graphs, ...):
# accepted and ignored. Where a non-default value would change the results (quantized
# weights, a different KV dtype, pipeline stages, LoRA, ...), only the default is accepted.
NO_EFFECT_KWARGS: dict[str, Any] = {
    "swap_space": ANY,
    "cpu_offload_gb": ANY,
    "disable_custom_all_reduce": ANY,
    "enable_prefix_caching": ANY,
    "enable_chunked_prefill": ANY,
    "block_size": ANY,
    "max_num_batched_tokens": ANY,
    "max_seq_len_to_capture": ANY,
    "max_cudagraph_capture_size": ANY,
    "cuda_graph_sizes": ANY,
    "compilation_config": ANY,
    "disable_log_stats": ANY,
    "disable_async_output_proc": ANY,
    "async_scheduling": ANY,
    "tokenizer_mode": ANY,
    "tokenizer_revision": ANY,
    "load_format": ANY,
    "download_dir": ANY,
    "distributed_executor_backend": ANY,
    "enable_sleep_mode": ANY,
    "kv_cache_memory_bytes": ANY,
    "served_model_name": ANY,
    "quantization": None,
    "kv_cache_dtype": "auto",
    "pipeline_parallel_size": 1,
    "data_parallel_size": 1,
    "enable_lora": False,
    "skip_tokenizer_init": False,
    "hf_overrides": None,
    "scheduling_policy": "fcfs",
}
ACCEPTED_KWARGS = (
    "model", "tokenizer", "dtype", "tensor_parallel_size", "max_model_len", "max_num_seqs", "seed",
    "gpu_memory_utilization", "enforce_eager", "trust_remote_code", "revision", "speculative_config",
    "max_logprobs", "attention_impl", "unroll_layers", "continuous_admission",
)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """`LLM(...)` settings, validated (`from_kwargs`) and then resolved against the model (`resolve`); the
    resolved config is the one every later stage reads.

    tokenizer: defaults to `model`. dtype: "auto", "float32", "bfloat16" or "float16" ("auto": config.json's
    torch_dtype, made concrete by `resolve`). max_model_len: None means the model's own limit (made concrete
    by `resolve`). seed: None draws a random one at `resolve` (unseeded requests then differ between engines,
    as in vLLM). enforce_eager: as vLLM's, no CUDA graphs: the generate loop is compiled without XLA's command
    buffers, so each kernel launches from the host (slower; for profiling and debugging); nothing changes off
    GPUs, which warn so. trust_remote_code: passed to the tokenizer's loader (a tokenizer class shipped with the
    model may run); model code from a checkpoint is never run, the families in specjax/models/ implement every
    architecture. speculative_config: the dict as given; `speculative` is its parsed form (None until
    `resolve`, and without speculation). max_logprobs: the most logprobs / prompt_logprobs a request may ask
    for (vLLM's default 20; -1: the whole vocabulary). attention_impl: "auto" (the Pallas kernels where they
    run: attention, the fused projections, the top-k/top-p search), "reference" (pure JAX everywhere) or
    "triton" (the kernels forced). continuous_admission: more requests than max_num_seqs run as one jitted
    call, each slot taking the next request when its row finishes (the default); False runs them in waves of
    max_num_seqs, one call each (a wave ends with its longest request). A tensor-parallel mesh admits too;
    streaming and data replicas run waves.
    """

    model: str
    tokenizer: str
    dtype: str = "auto"
    tensor_parallel_size: int = 1
    max_model_len: int | None = None
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    seed: int | None = 0
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    trust_remote_code: bool = False
    revision: str | None = None
    speculative_config: Mapping[str, Any] | None = None
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    attention_impl: str = "auto"
    unroll_layers: bool | None = None
    continuous_admission: bool = True
    speculative: SpeculativeConfig | None = None

    @classmethod
    def from_kwargs(cls, model: str | os.PathLike, **kwargs: Any) -> EngineConfig:
        """Validate `LLM(model, **kwargs)`; warn about vLLM settings that have no effect here."""
        unknown = sorted(set(kwargs) - set(ACCEPTED_KWARGS) - set(NO_EFFECT_KWARGS))
        if unknown:
            raise TypeError(f"LLM() got unexpected keyword argument(s) {unknown}. Accepted: "
                            f"{', '.join(ACCEPTED_KWARGS)}; also accepted and ignored (vLLM CUDA-engine "
                            f"settings): {', '.join(NO_EFFECT_KWARGS)}")
        for name in set(kwargs) & set(NO_EFFECT_KWARGS):
            _check_no_effect(name, kwargs.pop(name))
        model = path_or_id(model, "model")
        tokenizer = kwargs.pop("tokenizer", None)
        tokenizer = model if tokenizer is None else path_or_id(tokenizer, "tokenizer")
        config = cls(model=model, tokenizer=tokenizer, **kwargs)._validated()
        if config.enforce_eager and jax.default_backend() != "gpu":
            warnings.warn(f"LLM(): enforce_eager=True has no effect on {jax.default_backend()}: only GPUs run the "
                          "loop as CUDA graphs", stacklevel=3)
        return config

    def resolve(self, model_config: Any, num_mtp_layers: int = 0) -> EngineConfig:
        """These settings with what the model decides made concrete: max_model_len (checked against the
        model's max_position_embeddings), dtype, seed and the parsed speculative config (num_mtp_layers: the
        MTP layers the target's checkpoint carries)."""
        max_model_len = _max_model_len(self.max_model_len, model_config.max_position_embeddings)
        dtype = self.dtype if self.dtype != "auto" else _checkpoint_dtype(model_config.torch_dtype)
        return dataclasses.replace(
            self, max_model_len=max_model_len, dtype=dtype,
            seed=secrets.randbelow(2**31) if self.seed is None else self.seed,
            speculative=SpeculativeConfig.from_dict(self.speculative_config, target_max_model_len=max_model_len,
                                                    target_tensor_parallel_size=self.tensor_parallel_size,
                                                    target_mtp_layers=num_mtp_layers))

    def _validated(self) -> EngineConfig:
        check_int(self.tensor_parallel_size, "tensor_parallel_size", minimum=1)
        if self.max_model_len is not None:
            check_int(self.max_model_len, "max_model_len", minimum=1)
        check_int(self.max_num_seqs, "max_num_seqs", minimum=1)
        if self.seed is not None:
            check_int(self.seed, "seed")
        check_memory_fraction(self.gpu_memory_utilization)
        for name in ("enforce_eager", "trust_remote_code", "continuous_admission"):
            check_bool(getattr(self, name), name)
        if self.unroll_layers is not None:
            check_bool(self.unroll_layers, "unroll_layers")
        check_int(self.max_logprobs, "max_logprobs", minimum=-1)
        check_optional_str(self.revision, "revision")
        if self.speculative_config is not None and not isinstance(self.speculative_config, Mapping):
            raise TypeError(f"speculative_config must be a dict (e.g. {{'method': 'ngram', "
                            f"'num_speculative_tokens': 4}}) or None, got {self.speculative_config!r}")
        if self.attention_impl not in IMPLS:
            raise ValueError(f"attention_impl must be one of {IMPLS}, got {self.attention_impl!r}")
        spec = None if self.speculative_config is None else dict(self.speculative_config)
        return dataclasses.replace(self, dtype=canonical_dtype(self.dtype), speculative_config=spec)


def _check_no_effect(name: str, value: Any) -> None:
    required = NO_EFFECT_KWARGS[name]
    if required is not ANY and value != required:
        raise ValueError(f"{name}={value!r} is not supported by specjax; remove it or pass {name}={required!r}")
    warnings.warn(f"LLM(): {name}={value!r} has no effect in specjax (a vLLM CUDA-engine setting); ignored",
                  stacklevel=4)


def _max_model_len(requested: int | None, model_limit: int) -> int:
    if requested is None:
        return model_limit
    if requested > model_limit:
        raise ValueError(f"max_model_len={requested} is larger than the model's max_position_embeddings="
                         f"{model_limit}: lower max_model_len")
    return requested


def _checkpoint_dtype(torch_dtype: str) -> str:
    try:
        name = canonical_dtype(torch_dtype)
    except ValueError:
        name = "auto"
    if name == "auto":
        raise ValueError(f"config.json's torch_dtype {torch_dtype!r} is not one of float32, bfloat16, float16: "
                         "pass dtype= to LLM()")
    return name
