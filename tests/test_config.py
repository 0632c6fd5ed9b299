"""LLM(...) argument validation, the KV-fit error, and speculative_config parsing (vLLM's rules)."""
from __future__ import annotations

import dataclasses
import pathlib
import warnings
from types import SimpleNamespace

import numpy as np
import pytest

from specjax import config as config_lib
from specjax.config import (ACCEPTED_KWARGS, EngineConfig, SpeculativeConfig, check_draft_compatible,
                            check_kv_cache_fits)

# --------------------------------------------------------------------------------------------
# EngineConfig
# --------------------------------------------------------------------------------------------


def test_engine_defaults_and_tokenizer_falls_back_to_model():
    cfg = EngineConfig.from_kwargs("org/model")
    assert cfg.tokenizer == "org/model"
    assert (cfg.dtype, cfg.tensor_parallel_size, cfg.max_model_len, cfg.seed, cfg.gpu_memory_utilization,
            cfg.enforce_eager, cfg.trust_remote_code, cfg.revision, cfg.speculative_config,
            cfg.attention_impl) == ("auto", 1, None, 0, 0.9, False, False, None, None, "auto")
    assert EngineConfig.from_kwargs(pathlib.Path("/tmp/m"), tokenizer=pathlib.Path("/tmp/t")).tokenizer == "/tmp/t"


def test_engine_config_is_frozen_and_keeps_a_copy_of_speculative_config():
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    cfg = EngineConfig.from_kwargs("m", speculative_config=spec)
    spec["num_speculative_tokens"] = 9
    assert cfg.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.dtype = "float32"


@pytest.mark.parametrize("given, canonical", [
    ("auto", "auto"), ("float32", "float32"), ("fp32", "float32"), ("float", "float32"), ("FLOAT32", "float32"),
    ("bfloat16", "bfloat16"), ("bf16", "bfloat16"), ("float16", "float16"), ("half", "float16"),
    ("fp16", "float16"), (np.float32, "float32"), (np.dtype("float16"), "float16"),
    (object(), None), ("int8", None),
])
def test_dtype_names_aliases_and_dtype_objects(given, canonical):
    if canonical is None:
        with pytest.raises(ValueError, match="dtype must be one of"):
            EngineConfig.from_kwargs("m", dtype=given)
    else:
        assert EngineConfig.from_kwargs("m", dtype=given).dtype == canonical


def test_torch_dtype_objects_are_recognised_by_name():
    class FakeTorchDtype:
        def __str__(self):
            return "torch.bfloat16"

    assert config_lib.canonical_dtype(FakeTorchDtype()) == "bfloat16"


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(dtype="int8"), ValueError, "dtype must be one of"),
    (dict(gpu_memory_utilization=0.0), ValueError, r"gpu_memory_utilization must be in \(0, 1\]"),
    (dict(gpu_memory_utilization=1.2), ValueError, r"gpu_memory_utilization must be in \(0, 1\]"),
    (dict(gpu_memory_utilization="90%"), TypeError, "gpu_memory_utilization must be a number"),
    (dict(max_num_seqs=0), ValueError, "max_num_seqs must be >= 1"),
    (dict(tensor_parallel_size=0), ValueError, "tensor_parallel_size must be >= 1"),
    (dict(tensor_parallel_size=2.0), TypeError, "tensor_parallel_size must be an int"),
    (dict(max_model_len=0), ValueError, "max_model_len must be >= 1"),
    (dict(max_model_len="4k"), TypeError, "max_model_len must be an int"),
    (dict(seed="zero"), TypeError, "seed must be an int"),
    (dict(enforce_eager="yes"), TypeError, "enforce_eager must be True or False"),
    (dict(trust_remote_code=1), TypeError, "trust_remote_code must be True or False"),
    (dict(revision=3), TypeError, "revision must be a string"),
    (dict(speculative_config="ngram"), TypeError, "speculative_config must be a dict"),
    (dict(attention_impl="flash"), ValueError, "attention_impl must be one of"),
    (dict(tokenizer=""), TypeError, "tokenizer must be a Hugging Face Hub id"),
])
def test_invalid_engine_values_raise_naming_the_field(kwargs, error, message):
    with pytest.raises(error, match=message):
        EngineConfig.from_kwargs("m", **kwargs)


def test_model_must_be_an_id_or_path():
    with pytest.raises(TypeError, match="model must be a Hugging Face Hub id"):
        EngineConfig.from_kwargs(None)


def test_unknown_kwarg_lists_the_accepted_names():
    with pytest.raises(TypeError, match="unexpected keyword argument") as info:
        EngineConfig.from_kwargs("m", max_batch_size=4)
    assert "max_batch_size" in str(info.value)
    assert all(name in str(info.value) for name in ACCEPTED_KWARGS)


@pytest.mark.parametrize("name, value", [
    ("swap_space", 4), ("enable_prefix_caching", True), ("block_size", 16), ("quantization", None),
    ("kv_cache_dtype", "auto"), ("pipeline_parallel_size", 1), ("disable_log_stats", False),
    ("enable_chunked_prefill", True), ("max_num_batched_tokens", 8192),
])
def test_cuda_only_kwargs_warn_that_they_have_no_effect(name, value):
    with pytest.warns(UserWarning, match=f"{name}=.*has no effect"):
        cfg = EngineConfig.from_kwargs("m", **{name: value})
    assert not hasattr(cfg, name)


@pytest.mark.parametrize("name, value", [
    ("quantization", "fp8"), ("kv_cache_dtype", "fp8"), ("pipeline_parallel_size", 2), ("enable_lora", True),
])
def test_cuda_only_kwargs_that_would_change_results_only_take_their_default(name, value):
    with pytest.raises(ValueError, match=f"{name}=.*is not supported by specjax"):
        EngineConfig.from_kwargs("m", **{name: value})


def test_accepted_kwargs_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        EngineConfig.from_kwargs("m", dtype="bf16", max_model_len=128, max_num_seqs=4, seed=None,
                                 gpu_memory_utilization=1.0, attention_impl="reference")


# --------------------------------------------------------------------------------------------
# check_kv_cache_fits
# --------------------------------------------------------------------------------------------


def test_kv_cache_that_fits_passes():
    check_kv_cache_fits(900, 1000, 0.9)


def test_kv_cache_too_big_names_the_settings_and_values_that_fit():
    per_slot, seqs, length, free = 1024, 8, 4096, 2**30
    need = per_slot * seqs * length * 64
    with pytest.raises(ValueError) as info:
        check_kv_cache_fits(need, free, 0.5, max_model_len=length, max_num_seqs=seqs)
    message = str(info.value)
    assert "max_model_len" in message and "max_num_seqs" in message and "gpu_memory_utilization" in message
    assert "2.00 GiB" in message and "0.50 GiB" in message
    fitting_len = int(message.split("at most ")[1].split(" fits")[0])
    assert need * fitting_len / length <= free * 0.5 < need * (fitting_len + 1) / length


def test_kv_check_rejects_bad_inputs():
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        check_kv_cache_fits(1, 10, 0.0)
    with pytest.raises(ValueError, match="kv_bytes must be >= 0"):
        check_kv_cache_fits(-1, 10, 0.5)


# --------------------------------------------------------------------------------------------
# SpeculativeConfig
# --------------------------------------------------------------------------------------------


def spec(d, max_len=2048, tp=1):
    return SpeculativeConfig.from_dict(d, target_max_model_len=max_len, target_tensor_parallel_size=tp)


def test_no_speculative_config_is_none():
    assert spec(None) is None


@pytest.mark.parametrize("d", [
    {"method": "ngram", "num_speculative_tokens": 4},
    {"model": "ngram", "num_speculative_tokens": 4},
    {"model": "[ngram]", "num_speculative_tokens": 4},
    {"method": "[ngram]", "num_speculative_tokens": 4},
])
def test_ngram_spellings_and_vllm_defaults(d):
    cfg = spec(d, max_len=512, tp=2)
    assert (cfg.method, cfg.model, cfg.num_speculative_tokens) == ("ngram", None, 4)
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (5, 5)
    assert (cfg.draft_tensor_parallel_size, cfg.max_model_len) == (2, 512)
    assert (cfg.draft_sample_method, cfg.rejection_sample_method) == ("greedy", "standard")
    assert cfg.synthetic_acceptance_rates is None and cfg.synthetic_rates() is None
    assert cfg.enforce_eager is None and cfg.revision is None


@pytest.mark.parametrize("given, expected", [
    (dict(prompt_lookup_max=3), (3, 3)),
    (dict(prompt_lookup_min=2), (2, 2)),
    (dict(prompt_lookup_min=2, prompt_lookup_max=4), (2, 4)),
])
def test_prompt_lookup_bounds_mirror_each_other(given, expected):
    cfg = spec({"method": "ngram", "num_speculative_tokens": 2, **given})
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == expected


def test_draft_model_inferred_from_a_model_and_lookup_zeroed():
    cfg = spec({"model": "org/tiny-draft", "num_speculative_tokens": 3, "revision": "main", "enforce_eager": True})
    assert (cfg.method, cfg.model, cfg.revision, cfg.enforce_eager) == ("draft_model", "org/tiny-draft", "main", True)
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (0, 0)


@pytest.mark.parametrize("d, method", [
    ({"model": "yuhuili/EAGLE-LLaMA3-Instruct-8B"}, "eagle"),
    ({"model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"}, "eagle3"),
    ({"model": "AngelSlim/Qwen3-8B_eagle3"}, "eagle3"),
    ({"method": "draft_model", "model": "yuhuili/EAGLE-LLaMA3-Instruct-8B"}, "eagle"),
    ({"method": "eagle", "model": "some/head"}, "eagle"),
])
def test_eagle_methods_inferred_from_the_head_name_as_vllm_does(d, method):
    assert spec({**d, "num_speculative_tokens": 2}).method == method


def test_eagle_needs_a_head():
    with pytest.raises(ValueError, match="'eagle3' needs 'model'"):
        spec({"method": "eagle3", "num_speculative_tokens": 2})


@pytest.mark.parametrize("d, error, message", [
    ({"method": "ngram"}, ValueError, "needs 'num_speculative_tokens'"),
    ({"method": "ngram", "num_speculative_tokens": 0}, ValueError, "num_speculative_tokens'\\] must be >= 1"),
    ({"method": "ngram", "num_speculative_tokens": -2}, ValueError, "must be >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2.0}, TypeError, "must be an int"),
    ({"method": "ngram", "num_speculative_tokens": True}, TypeError, "must be an int"),
    ({"num_speculative_tokens": 2}, ValueError, "needs 'method' or 'model'"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, ValueError, "'draft_model' needs 'model'"),
    ({"method": "medusa", "model": "x", "num_speculative_tokens": 2}, ValueError, "method'\\] must be one of"),
    ({"method": 3, "num_speculative_tokens": 2}, TypeError, "method'\\] must be a string"),
    ({"method": "ngram", "num_speculative_tokens": 2, "tensor_parallel_size": 1}, ValueError,
     "use 'draft_tensor_parallel_size'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "num_spec_tokens": 2}, ValueError,
     "unknown key.*num_spec_tokens.*accepted keys: method, model, num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 3}, ValueError,
     "prompt_lookup_min=4 must be <= prompt_lookup_max=3"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}, ValueError, "must be >= 1"),
    ({"model": "d", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, ValueError, "must be >= 1"),
    ({"model": "d", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 3}, ValueError,
     "must be 1 or the target's tensor_parallel_size=2"),
    ({"model": "d", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 0}, ValueError, "must be >= 1"),
    ({"model": "d", "num_speculative_tokens": 2, "max_model_len": 4096}, ValueError,
     "cannot be larger than the target's max_model_len=2048"),
    ({"model": "d", "num_speculative_tokens": 2, "max_model_len": 0}, ValueError, "must be >= 1"),
    ({"model": "d", "num_speculative_tokens": 2, "draft_sample_method": "nucleus"}, ValueError,
     "draft_sample_method'\\] must be one of"),
    ({"model": "d", "num_speculative_tokens": 2, "rejection_sample_method": "fast"}, ValueError,
     "rejection_sample_method'\\] must be one of"),
    ({"model": "d", "num_speculative_tokens": 2, "rejection_sample_method": "block"}, NotImplementedError,
     "'block' is not implemented"),
    ({"model": "d", "num_speculative_tokens": 2, "enforce_eager": "no"}, TypeError, "must be True or False"),
    ({"model": "d", "num_speculative_tokens": 2, "quantization": "fp8"}, ValueError, "is not supported"),
])
def test_invalid_speculative_configs_raise_naming_the_key(d, error, message):
    with pytest.raises(error, match=message):
        spec(d, tp=2)


def test_draft_tensor_parallel_size_one_or_the_targets():
    assert spec({"model": "d", "num_speculative_tokens": 2}, tp=4).draft_tensor_parallel_size == 4
    assert spec({"model": "d", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1},
                tp=4).draft_tensor_parallel_size == 1
    assert spec({"model": "d", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 4},
                tp=4).draft_tensor_parallel_size == 4


def test_probabilistic_drafting_and_shorter_draft_length_are_kept():
    cfg = spec({"model": "d", "num_speculative_tokens": 2, "draft_sample_method": "probabilistic",
                "max_model_len": 1000})
    assert (cfg.draft_sample_method, cfg.max_model_len) == ("probabilistic", 1000)


def test_cuda_only_speculative_keys_warn():
    with pytest.warns(UserWarning, match="disable_padded_drafter_batch"):
        cfg = spec({"model": "d", "num_speculative_tokens": 2, "disable_padded_drafter_batch": True})
    assert cfg.method == "draft_model"


# Synthetic rejection sampling ---------------------------------------------------------------

SYNTH = {"method": "ngram", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic"}


@pytest.mark.parametrize("length, k, expected", [
    (2.6, 3, [1.0, 0.6, 0.0]), (1.0, 3, [0.0, 0.0, 0.0]), (4.0, 3, [1.0, 1.0, 1.0]),
    (2.0, 3, [1.0, 0.0, 0.0]), (3.5, 4, [1.0, 1.0, 0.5, 0.0]),
])
def test_acceptance_length_resolves_to_vllms_min_variance_rates(length, k, expected):
    cfg = spec({**SYNTH, "num_speculative_tokens": k, "synthetic_acceptance_length": length})
    assert cfg.synthetic_acceptance_rates == pytest.approx(expected)


def test_explicit_rates_are_kept_and_converted_to_conditional():
    cfg = spec({**SYNTH, "synthetic_acceptance_rates": [0.9, 0.5, 0.2]})
    assert cfg.synthetic_acceptance_rates == (0.9, 0.5, 0.2)
    assert cfg.synthetic_rates() == pytest.approx([0.9, 0.5 / 0.9, 0.2 / 0.5])
    zero_tail = spec({**SYNTH, "synthetic_acceptance_rates": [0.6, 0.0, 0.0]})
    assert zero_tail.synthetic_rates() == pytest.approx([0.6, 0.0, 0.0])


@pytest.mark.parametrize("rates, length", [([0.95, 0.8, 0.4], None), (None, 2.3), (None, 3.7)])
def test_conditional_rates_reproduce_the_target_acceptance(rates, length):
    d = {**SYNTH, "synthetic_acceptance_rates": rates} if rates else {**SYNTH, "synthetic_acceptance_length": length}
    cfg = spec(d)
    conditional = np.asarray(cfg.synthetic_rates())
    rng = np.random.default_rng(0)
    accepted_each = rng.random((200_000, 3)) < conditional  # the sampler's per-position coin flips
    accepted = np.cumprod(accepted_each, axis=1)  # stop at the first rejection
    np.testing.assert_allclose(accepted.mean(axis=0), cfg.synthetic_acceptance_rates, atol=5e-3)
    if length is not None:
        assert 1 + accepted.sum(axis=1).mean() == pytest.approx(length, abs=1e-2)


@pytest.mark.parametrize("extra, error, message", [
    ({}, ValueError, "exactly one of synthetic_acceptance_rates"),
    ({"synthetic_acceptance_rates": [0.5, 0.4, 0.3], "synthetic_acceptance_length": 2.0}, ValueError,
     "exactly one of"),
    ({"synthetic_acceptance_rates": [0.5, 0.4]}, ValueError, "must have num_speculative_tokens=3 entries"),
    ({"synthetic_acceptance_rates": [0.5, 0.6, 0.1]}, ValueError, "must be non-increasing"),
    ({"synthetic_acceptance_rates": [1.2, 0.6, 0.1]}, ValueError, r"entries must be in \[0, 1\]"),
    ({"synthetic_acceptance_rates": "high"}, TypeError, "must be a list of numbers"),
    ({"synthetic_acceptance_length": 0.5}, ValueError, r"must be in \[1, 4\]"),
    ({"synthetic_acceptance_length": 4.5}, ValueError, r"must be in \[1, 4\]"),
    ({"synthetic_acceptance_length": "2"}, TypeError, "must be a number"),
])
def test_invalid_synthetic_settings(extra, error, message):
    with pytest.raises(error, match=message):
        spec({**SYNTH, **extra})


def test_synthetic_settings_need_the_synthetic_method():
    with pytest.raises(ValueError, match="only valid with rejection_sample_method='synthetic'"):
        spec({"method": "ngram", "num_speculative_tokens": 3, "synthetic_acceptance_length": 2.0})


# Draft compatibility --------------------------------------------------------------------------


def test_draft_must_share_the_target_vocabulary():
    check_draft_compatible(SimpleNamespace(vocab_size=49152), SimpleNamespace(vocab_size=49152))
    with pytest.raises(ValueError, match="vocab_size=32000 differs from the target's vocab_size=49152"):
        check_draft_compatible(SimpleNamespace(vocab_size=49152), SimpleNamespace(vocab_size=32000))
