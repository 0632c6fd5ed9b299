"""SamplingParams: vLLM's defaults, normalisation, validation; per-row device arrays."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from specjax.sampling_params import SamplingParams, child_params, to_row_arrays

VLLM_DEFAULTS = dict(n=1, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, temperature=1.0,
                     top_p=1.0, top_k=0, min_p=0.0, seed=None, stop=[], stop_token_ids=[], ignore_eos=False,
                     max_tokens=16, min_tokens=0, logprobs=None, prompt_logprobs=None,
                     include_stop_str_in_output=False, skip_special_tokens=True)


def test_defaults_are_vllms():
    params = SamplingParams()
    assert {name: getattr(params, name) for name in VLLM_DEFAULTS} == VLLM_DEFAULTS
    assert not params.is_greedy


def test_normalisation_of_vllm_spellings():
    params = SamplingParams(stop="###", stop_token_ids=[5, 3, 5, 7, 3], top_k=-1, seed=-1, logprobs=True,
                            prompt_logprobs=True)
    assert params.prompt_logprobs == 1
    assert params.stop == ["###"]
    assert params.stop_token_ids == [5, 3, 7]
    assert params.top_k == 0
    assert params.seed is None
    assert params.logprobs == 1
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(temperature=1).temperature == 1.0


def test_greedy_clears_filters_and_forbids_n_above_one():
    params = SamplingParams(temperature=0.0, top_p=0.5, top_k=7, min_p=0.2)
    assert params.is_greedy
    assert (params.top_p, params.top_k, params.min_p) == (1.0, 0, 0.0)
    with pytest.raises(ValueError, match="n must be 1 when using greedy"):
        SamplingParams(temperature=0.0, n=2)


def test_tiny_temperature_is_raised_with_a_warning():
    with pytest.warns(UserWarning, match="temperature"):
        params = SamplingParams(temperature=1e-3)
    assert params.temperature == pytest.approx(1e-2)
    assert not params.is_greedy


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(n=0), ValueError, "n must be >= 1, got 0"),
    (dict(n=1.5), TypeError, "n must be an int"),
    (dict(temperature=-1), ValueError, "temperature must be >= 0"),
    (dict(temperature=float("nan")), ValueError, "temperature must be a finite number"),
    (dict(temperature="hot"), TypeError, "temperature must be a number"),
    (dict(top_p=0.0), ValueError, r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), ValueError, r"top_p must be in \(0, 1\]"),
    (dict(top_k=-2), ValueError, "top_k must be 0 or -1"),
    (dict(top_k=2.0), TypeError, "top_k must be an int"),
    (dict(min_p=-0.1), ValueError, r"min_p must be in \[0, 1\]"),
    (dict(min_p=1.1), ValueError, r"min_p must be in \[0, 1\]"),
    (dict(seed=1.5), TypeError, "seed must be an int"),
    (dict(max_tokens=0), ValueError, "max_tokens must be >= 1"),
    (dict(max_tokens=True), TypeError, "max_tokens must be an int"),
    (dict(min_tokens=-1), ValueError, "min_tokens must be >= 0"),
    (dict(min_tokens=5, max_tokens=4), ValueError, "min_tokens must be <= max_tokens=4"),
    (dict(logprobs=-2), ValueError, "logprobs must be None, -1"),
    (dict(stop=["ok", ""]), ValueError, "stop cannot contain an empty string"),
    (dict(stop=[3]), TypeError, "stop must be a string or a list of strings"),
    (dict(stop=3), TypeError, "stop must be a string or a list of strings"),
    (dict(stop_token_ids=[1, -4]), ValueError, "stop_token_ids must contain only non-negative integer"),
    (dict(stop_token_ids=["a"]), ValueError, "stop_token_ids must contain only non-negative integer"),
    (dict(stop_token_ids=5), TypeError, "stop_token_ids must be a list of token ids"),
    (dict(ignore_eos=1), TypeError, "ignore_eos must be a bool"),
    (dict(prompt_logprobs=-3), ValueError, "prompt_logprobs must be None, -1"),
    (dict(prompt_logprobs=1.0), TypeError, "prompt_logprobs must be an int"),
    (dict(repetition_penalty=0.0), ValueError, r"repetition_penalty must be > 0 \(1 = off\), got 0.0"),
    (dict(repetition_penalty=-1), ValueError, "repetition_penalty must be > 0"),
    (dict(repetition_penalty="high"), TypeError, "repetition_penalty must be a number"),
    (dict(presence_penalty=2.5), ValueError, r"presence_penalty must be in \[-2, 2\]"),
    (dict(frequency_penalty=-2.01), ValueError, r"frequency_penalty must be in \[-2, 2\]"),
    (dict(frequency_penalty=float("inf")), ValueError, "frequency_penalty must be a finite number"),
    (dict(presence_penalty=None), TypeError, "presence_penalty must be a number"),
])
def test_invalid_values_raise_naming_the_field(kwargs, error, message):
    with pytest.raises(error, match=message):
        SamplingParams(**kwargs)


def test_neutral_penalties_and_open_ended_max_tokens_are_accepted():
    params = SamplingParams(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, max_tokens=None)
    assert params.max_tokens is None and not params.has_penalties


@pytest.mark.parametrize("kwargs", [dict(presence_penalty=-2), dict(frequency_penalty=2), dict(repetition_penalty=1.3),
                                    dict(repetition_penalty=0.5, temperature=0.0)])
def test_penalties_in_vllms_ranges_are_accepted_greedy_included(kwargs):
    params = SamplingParams(**kwargs)
    assert params.has_penalties
    assert all(isinstance(getattr(params, name), float)
               for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"))


def test_child_params_give_each_sample_its_own_seed():
    seeded = child_params(SamplingParams(n=3, seed=10, temperature=0.7))
    assert [(c.n, c.seed, c.temperature) for c in seeded] == [(1, 10, 0.7), (1, 11, 0.7), (1, 12, 0.7)]
    unseeded = child_params(SamplingParams(n=2))
    assert [(c.n, c.seed) for c in unseeded] == [(1, None), (1, None)]


def test_row_arrays_dtypes_and_values():
    params = [SamplingParams(temperature=0.0, top_k=5), SamplingParams(temperature=0.7, top_k=40, top_p=0.9,
                                                                       min_p=0.05, seed=123)]
    rows = to_row_arrays(params, vocab_size=1000)
    assert [a.dtype for a in rows] == [np.float32, np.int32, np.float32, np.float32, np.uint32]
    assert all(a.shape == (2,) for a in rows)
    np.testing.assert_allclose(rows.temperature, [0.0, 0.7])
    np.testing.assert_array_equal(rows.top_k, [0, 40])
    np.testing.assert_allclose(rows.top_p, [1.0, 0.9])
    np.testing.assert_allclose(rows.min_p, [0.0, 0.05])
    assert rows.seed[1] == 123


def test_top_k_at_or_above_the_vocabulary_is_off():
    rows = to_row_arrays([SamplingParams(top_k=50), SamplingParams(top_k=49)], vocab_size=50)
    np.testing.assert_array_equal(rows.top_k, [0, 49])


def test_seeds_wrap_to_uint32_and_do_not_depend_on_batch_position():
    seeded = SamplingParams(seed=2**32 + 7, temperature=0.5)
    alone = to_row_arrays([seeded], 10).seed[0]
    batched = to_row_arrays([SamplingParams(), SamplingParams(), seeded], 10).seed[2]
    assert alone == batched == 7


def test_unseeded_rows_get_distinct_reproducible_seeds():
    params = [SamplingParams()] * 64
    first = to_row_arrays(params, 10, base_seed=0).seed
    assert len(set(first.tolist())) == 64
    np.testing.assert_array_equal(first, to_row_arrays(params, 10, base_seed=0).seed)
    assert not np.array_equal(first, to_row_arrays(params, 10, base_seed=1).seed)


def test_row_arrays_reject_a_bad_vocab_size():
    with pytest.raises(ValueError, match="vocab_size must be >= 1"):
        to_row_arrays([SamplingParams()], 0)


def test_params_stay_a_mutable_dataclass_like_vllms():
    params = SamplingParams()
    params.max_tokens = 64
    assert dataclasses.replace(params, n=2).max_tokens == 64
