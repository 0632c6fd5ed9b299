"""Property-based tests (hypothesis) of the vLLM surface: SamplingParams x speculative method x prompts (lengths 0
to beyond max_model_len, odd types, token ids out of range) x generate / chat, on one tiny model (built once for the
module, with the default model's tokenizer and vocabulary) and one LLM per method. Every call either returns one
RequestOutput per prompt, in order, each with its n completions within its limits, or raises a TypeError /
ValueError before any wave runs; the same LLM keeps working after any error.

Bounded for CI: MAX_EXAMPLES = 50 examples (about a minute on a 2-core CPU), derandomized (the same examples
every run), no example database; SPECJAX_FUZZ_EXAMPLES=N runs N instead (a deeper search by hand).
"""
from __future__ import annotations

import os
import warnings

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from tiny_models import DEFAULT_VOCAB, tiny_llm_dir

from specjax import LLM, SamplingParams
from specjax.outputs import RequestOutput

MAX_EXAMPLES = int(os.environ.get("SPECJAX_FUZZ_EXAMPLES", 50))
MAX_MODEL_LEN = 96
METHODS = {"plain": None,
           "ngram": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 2},
           "draft_model": "draft"}
CANARY = ({"prompt_token_ids": [5, 17, 42, 8]}, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))


@pytest.fixture(scope="module")
def engines(tmp_path_factory, default_model_dir):
    """method -> (LLM, waves run so far [a one-entry list], the canary's output when the LLM was new)."""
    model_dir = tiny_llm_dir(tmp_path_factory.mktemp("fuzz_target"), default_model_dir, vocab_size=DEFAULT_VOCAB,
                             max_position_embeddings=128)
    draft_dir = tiny_llm_dir(tmp_path_factory.mktemp("fuzz_draft"), default_model_dir, vocab_size=DEFAULT_VOCAB,
                             max_position_embeddings=128, num_hidden_layers=1, seed=1)
    made = {}
    for name, spec in METHODS.items():
        spec = {"model": str(draft_dir), "num_speculative_tokens": 2} if spec == "draft" else spec
        llm = LLM(str(model_dir), max_model_len=MAX_MODEL_LEN, max_num_seqs=2, speculative_config=spec)
        waves = [0]
        run_wave = llm._runner.run_wave

        def counted(wave, run_wave=run_wave, waves=waves):
            waves[0] += 1
            return run_wave(wave)

        llm._runner.run_wave = counted
        made[name] = (llm, waves, llm.generate(*CANARY, use_tqdm=False)[0].outputs[0].token_ids)
    return made


text = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)
in_range_ids = st.lists(st.integers(0, 300) | st.integers(0, DEFAULT_VOCAB - 1), min_size=1, max_size=40)
# Lengths at and past the limits, ids just outside the vocabulary.
edge_ids = st.one_of(st.sampled_from([[], [3] * MAX_MODEL_LEN, [3] * (MAX_MODEL_LEN + 1), [DEFAULT_VOCAB], [-1, 4]]),
                     st.lists(st.integers(-2, DEFAULT_VOCAB + 2), max_size=MAX_MODEL_LEN + 8))
odd = st.sampled_from([None, 1.5, 7, b"bytes", ["nested"], {"text": "hi"}, {"prompt_token_ids": "123"},
                       {"prompt_token_ids": [1.0, 2.0]}, {"prompt": 3}, {"prompt": "x", "multi_modal_data": {}}, ""])
# Mostly well-formed prompts (so most calls run), sometimes edge cases and odd types.
prompt = st.one_of(st.builds(lambda ids: {"prompt_token_ids": ids}, in_range_ids), text.filter(bool),
                   st.builds(lambda t: {"prompt": t}, text.filter(bool)),
                   st.builds(lambda ids: {"prompt_token_ids": ids}, in_range_ids),
                   st.builds(lambda ids: {"prompt_token_ids": ids}, edge_ids), odd)
prompts = st.one_of(st.lists(prompt, min_size=1, max_size=3), st.lists(prompt, min_size=1, max_size=3), prompt,
                    st.sampled_from([[], None, (), "lone text"]))

message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]), "content": text})
conversation = st.lists(message, min_size=1, max_size=2)
conversations = st.one_of(conversation, st.lists(conversation, min_size=1, max_size=2),
                          st.sampled_from(["Hi", None, [], [{"content": "no role"}], [[{"role": "user", "content": 1}]]]))

# Valid SamplingParams settings (each key optional), and one out-of-range or mistyped value to add sometimes.
valid_kwargs = st.fixed_dictionaries({}, optional={
    "temperature": st.sampled_from([0.0, 0.7, 1.0, 1e-3]),
    "top_p": st.sampled_from([1.0, 0.9]),
    "top_k": st.sampled_from([0, -1, 5, 10**6]),
    "min_p": st.sampled_from([0.0, 0.2]),
    "max_tokens": st.sampled_from([None, 1, 3, 9]),
    "min_tokens": st.sampled_from([0, 1]),
    "n": st.sampled_from([1, 2]),
    "seed": st.sampled_from([None, 0, 1234]),
    "stop": st.sampled_from([None, "e", ["\n", "the"]]),
    "stop_token_ids": st.sampled_from([None, [2], [10**7]]),
    "ignore_eos": st.booleans(),
    "logprobs": st.sampled_from([None, 0, 2]),
    "prompt_logprobs": st.sampled_from([None, 0, 1]),
    "presence_penalty": st.sampled_from([0.0, 1.0]),
    "frequency_penalty": st.sampled_from([0.0, -0.5]),
    "repetition_penalty": st.sampled_from([1.0, 1.3]),
})
bad_value = st.sampled_from([("temperature", -1.0), ("top_p", 0.0), ("top_k", -3), ("max_tokens", 0),
                             ("min_tokens", 50), ("stop", [""]), ("stop_token_ids", [-1]), ("logprobs", 25),
                             ("logprobs", -1), ("presence_penalty", 2.5), ("repetition_penalty", 0.0),
                             ("temperature", "hot"), ("n", 1.0), ("seed", 0.5)])
sampling_kwargs = st.one_of(valid_kwargs, valid_kwargs, valid_kwargs,
                            st.builds(lambda kw, bad: {**kw, bad[0]: bad[1]}, valid_kwargs, bad_value))
# None, one SamplingParams's kwargs, a list of them (maybe not one per prompt), or a dict in its place.
sampling = st.one_of(st.none(), sampling_kwargs, sampling_kwargs, st.lists(sampling_kwargs, min_size=1, max_size=3),
                     st.builds(lambda kw: ("dict", kw), sampling_kwargs))


def _build(spec):
    """The sampling_params argument a drawn spec stands for; SamplingParams' own checks may refuse it."""
    if isinstance(spec, tuple):
        return spec[1]   # the raw dict, as a sloppy caller passes it
    if isinstance(spec, list):
        return [SamplingParams(**kw) for kw in spec]
    return None if spec is None else SamplingParams(**spec)


def _check_outputs(llm: LLM, outputs, n_prompts: int, params) -> None:
    assert isinstance(outputs, list) and len(outputs) == n_prompts
    params_list = params if isinstance(params, list) else [params or llm.get_default_sampling_params()] * n_prompts
    for i, (out, p) in enumerate(zip(outputs, params_list)):
        assert isinstance(out, RequestOutput) and out.request_id == str(i)
        prompt_len = len(out.prompt_token_ids)
        assert 1 <= prompt_len <= MAX_MODEL_LEN
        assert [c.index for c in out.outputs] == list(range(p.n))
        for c in out.outputs:
            assert c.finish_reason in ("stop", "length")
            assert prompt_len + len(c.token_ids) <= MAX_MODEL_LEN
            assert p.max_tokens is None or len(c.token_ids) <= p.max_tokens
            assert all(0 <= t < DEFAULT_VOCAB for t in c.token_ids)
            assert (c.logprobs is None) == (p.logprobs is None)
            assert c.logprobs is None or len(c.logprobs) == len(c.token_ids)
        assert (out.prompt_logprobs is None) == (p.prompt_logprobs is None)
        assert out.prompt_logprobs is None or len(out.prompt_logprobs) == prompt_len
        assert out.metrics.arrival_time <= out.metrics.finished_time


def _expected_prompt_ids(llm: LLM, prompt) -> list[int]:
    if isinstance(prompt, str):
        return llm.get_tokenizer().encode(prompt)
    return prompt["prompt_token_ids"] if "prompt_token_ids" in prompt else llm.get_tokenizer().encode(prompt["prompt"])


@settings(max_examples=MAX_EXAMPLES, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(method=st.sampled_from(sorted(METHODS)), api=st.sampled_from(["generate", "generate", "chat"]),
       prompts=prompts, conversations=conversations, sampling=sampling)
def test_every_call_returns_an_output_per_prompt_or_refuses_before_any_work(engines, method, api, prompts,
                                                                            conversations, sampling):
    llm, waves, canary = engines[method]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)   # temperature 1e-3 is raised to 1e-2 with a warning
        try:
            params = _build(sampling)
        except (TypeError, ValueError) as refused:
            assert str(refused)
            event("refused by SamplingParams")
            return
        before = waves[0]
        try:
            if api == "chat":
                outputs = llm.chat(conversations, params, use_tqdm=False)
            else:
                outputs = llm.generate(prompts, params, use_tqdm=False)
        except (TypeError, ValueError) as refused:
            assert str(refused) and waves[0] == before, f"refused after {waves[0] - before} wave(s) ran: {refused}"
            assert llm.generate(*CANARY, use_tqdm=False)[0].outputs[0].token_ids == canary
            event(f"refused by {api}")
            return
    event(f"{api} returned")
    n_prompts = len(outputs) if api == "chat" else (len(prompts) if isinstance(prompts, list) else 1)
    _check_outputs(llm, outputs, n_prompts, params)
    if api == "generate":
        listed = prompts if isinstance(prompts, list) else [prompts]
        assert [o.prompt_token_ids for o in outputs] == [_expected_prompt_ids(llm, p) for p in listed]
