"""The vLLM surface on sloppy input and the fields vLLM reports: every malformed prompt, sampling_params, chat
message, config.json and setting raises a clear error naming the field (and the engine keeps working);
prompt_logprobs and logprob ranks against transformers; RequestOutput.metrics; enforce_eager. A tiny random
Llama with the default model's tokenizer and vocabulary runs every request in seconds."""
from __future__ import annotations

import dataclasses
import json
import shutil
import warnings

import jax
import numpy as np
import pytest
from tiny_models import DEFAULT_VOCAB, tiny_llm_dir

from specjax import LLM, SamplingParams
from specjax.engine import loop

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, default_model_dir):
    return tiny_llm_dir(tmp_path_factory.mktemp("tiny_vocab"), default_model_dir, vocab_size=DEFAULT_VOCAB,
                        max_position_embeddings=256)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), max_model_len=MAX_MODEL_LEN, max_num_seqs=2)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


SLOPPY_CALLS = [
    (lambda llm: llm.generate({"prompt_token_ids": "123"}, GREEDY), TypeError,
     r"prompt 0's prompt_token_ids must be a list of int token ids, got a str .*pass text as \{'prompt'"),
    (lambda llm: llm.generate({"prompt_token_ids": [12.0, 7]}, GREEDY), TypeError,
     r"prompt_token_ids must hold int token ids; entry 0 is a float"),
    (lambda llm: llm.generate(["ok", {"prompt_token_ids": [5, True]}], GREEDY), TypeError,
     r"prompt 1's prompt_token_ids .* entry 1 is a bool"),
    (lambda llm: llm.generate({"prompt_token_ids": 17}, GREEDY), TypeError, "got an int"),
    (lambda llm: llm.generate({"text": "hi"}, GREEDY), ValueError,
     r"prompt 0 is a dict with keys \['text'\]: a prompt dict needs 'prompt' .* or 'prompt_token_ids'"),
    (lambda llm: llm.generate({"prompt": "hi", "multi_modal_data": {}}, GREEDY), ValueError,
     r"prompt 0 has \['multi_modal_data'\], which specjax does not support"),
    (lambda llm: llm.generate({"prompt": 42}, GREEDY), TypeError, r"prompt 0's 'prompt' must be a string"),
    (lambda llm: llm.generate(None, GREEDY), TypeError, "prompts must be a prompt .* got a NoneType"),
    (lambda llm: llm.generate(17, GREEDY), TypeError, "prompts must be a prompt"),
    (lambda llm: llm.generate([1, 2, 3], GREEDY), TypeError, r"prompt 0 is an int .*'prompt_token_ids'"),
    (lambda llm: llm.generate([], GREEDY), ValueError, "prompts is empty"),
    (lambda llm: llm.generate("", GREEDY), ValueError, "prompt 0 is empty"),
    (lambda llm: llm.generate("hi", {"temperature": 0.0}), TypeError,
     r"sampling_params must be a SamplingParams .* got a dict .*SamplingParams\(\*\*your_dict\)"),
    (lambda llm: llm.generate(["a", "b"], [GREEDY, {"temperature": 0.0}]), TypeError,
     r"sampling_params\[1\] must be a SamplingParams"),
    (lambda llm: llm.generate(["a", "b", "c"], [GREEDY, GREEDY]), ValueError, "2 entries for 3 prompts"),
    (lambda llm: llm.generate({"prompt_token_ids": [1, DEFAULT_VOCAB]}, GREEDY), ValueError, "outside"),
    (lambda llm: llm.generate({"prompt_token_ids": [-1]}, GREEDY), ValueError, "outside"),
    (lambda llm: llm.generate({"prompt_token_ids": [3] * (MAX_MODEL_LEN + 1)}, GREEDY), ValueError,
     "more than max_model_len"),
    (lambda llm: llm.chat("Hi", GREEDY), TypeError,
     r"chat\(\) takes a conversation.*\[\{'role': 'user', 'content': 'Hi'\}\].* got a str"),
    (lambda llm: llm.chat([], GREEDY), TypeError, "non-empty list"),
    (lambda llm: llm.chat([{"content": "Hi"}], GREEDY), TypeError, "message 0 must be a dict with a string 'role'"),
    (lambda llm: llm.chat([[{"role": "user", "content": "Hi"}], "Hello"], GREEDY), TypeError,
     "conversation 1 must be a non-empty list"),
    (lambda llm: llm.generate("hi", SamplingParams(logprobs=100000)), ValueError,
     r"logprobs=100000, more than max_logprobs=20 .*as vLLM refuses.*LLM\(max_logprobs=...\)"),
    (lambda llm: llm.generate("hi", SamplingParams(prompt_logprobs=21)), ValueError, "prompt_logprobs=21"),
    (lambda llm: llm.generate("hi", SamplingParams(logprobs=-1)), ValueError, "logprobs=-1, more than"),
]


@pytest.mark.parametrize("call, error, match", SLOPPY_CALLS)
def test_sloppy_input_is_refused_clearly_before_any_work(llm, monkeypatch, call, error, match):
    waves = []
    monkeypatch.setattr(llm._runner, "run_wave", lambda wave: waves.append(wave))
    with pytest.raises(error, match=match):
        call(llm)
    assert not waves


def test_the_engine_keeps_working_after_refusals(llm):
    for call, error, _ in SLOPPY_CALLS[:5]:
        with pytest.raises(error):
            call(llm)
    outputs = llm.generate(["The capital of France is", {"prompt_token_ids": np.arange(5, 9), "cache_salt": "x"}],
                           GREEDY, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [6, 6]
    # A 1-D integer array is taken as token ids; keys vLLM gives no meaning to results (cache_salt) are ignored.
    assert outputs[1].prompt_token_ids == [5, 6, 7, 8]


def test_max_logprobs_raises_vllms_limit(model_dir):
    wide = LLM(str(model_dir), max_model_len=MAX_MODEL_LEN, max_num_seqs=1, max_logprobs=-1)
    out = wide.generate("hi", SamplingParams(temperature=0.0, max_tokens=2, logprobs=-1), use_tqdm=False)[0]
    assert all(len(entry) == DEFAULT_VOCAB for entry in out.outputs[0].logprobs)
    with pytest.raises(ValueError, match=f"more than max_logprobs={DEFAULT_VOCAB}"):
        wide.generate("hi", SamplingParams(logprobs=DEFAULT_VOCAB + 1))
    with pytest.raises(ValueError, match="max_logprobs must be >= -1"):
        LLM(str(model_dir), max_logprobs=-2)


def test_malformed_config_json_names_the_file(model_dir, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(model_dir, bad)
    (bad / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "vocab_size": ')
    with pytest.raises(ValueError, match=f"{bad / 'config.json'} is not valid JSON"):
        LLM(str(bad))
    (bad / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="holds a JSON list, not an object"):
        LLM(str(bad))


def test_a_config_without_architectures_is_known_by_its_model_type(model_dir, llm, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(model_dir, bare)
    config = json.loads((bare / "config.json").read_text())
    del config["architectures"]
    (bare / "config.json").write_text(json.dumps(config))
    prompt = {"prompt_token_ids": [5, 17, 42]}
    got = LLM(str(bare), max_model_len=MAX_MODEL_LEN, max_num_seqs=2).generate(prompt, GREEDY, use_tqdm=False)
    assert got[0].outputs[0].token_ids == llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    (bare / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match=r"names no `architectures` and its model_type 'gpt2'.*add \"architectures\""):
        LLM(str(bare))


def test_num_speculative_tokens_must_leave_room_in_max_model_len(model_dir):
    with pytest.raises(ValueError, match="num_speculative_tokens=500 leaves no room within max_model_len=128"):
        LLM(str(model_dir), max_model_len=128, speculative_config={"method": "ngram", "num_speculative_tokens": 500})


def _transformers_logprobs(hf_model, ids: list[int]) -> np.ndarray:
    """log-softmax [len(ids), V] of transformers' logits over ids (row t predicts token t + 1)."""
    import torch

    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].double(), -1).numpy()


def _assert_rank(rank: int, logprobs: np.ndarray, own: float, tol: float = 1e-5) -> None:
    """vLLM's rank (tokens whose logprob >= the token's own), up to near-ties that float rounding may order
    either way."""
    assert int(np.sum(logprobs > own + tol)) + 1 <= rank <= int(np.sum(logprobs >= own - tol))


def test_prompt_logprobs_follow_vllm_and_match_transformers(llm, hf_model):
    ids = llm.get_tokenizer().encode("The capital of France is Paris, and the capital of Spain is")
    outs = llm.generate([{"prompt_token_ids": ids}] * 2, [SamplingParams(max_tokens=2, prompt_logprobs=3),
                                                          SamplingParams(max_tokens=2, prompt_logprobs=0)],
                        use_tqdm=False)
    want = _transformers_logprobs(hf_model, ids)
    for out, n in zip(outs, (3, 0)):
        prompt_logprobs = out.prompt_logprobs
        assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
        for t in range(1, len(ids)):
            entry, row = prompt_logprobs[t], want[t - 1]
            assert next(iter(entry)) == ids[t]   # the prompt token's own entry first, as vLLM
            assert entry[ids[t]].logprob == pytest.approx(row[ids[t]], abs=1e-4)
            _assert_rank(entry[ids[t]].rank, row, row[ids[t]])
            top = [token for token in entry if token != ids[t] or entry[token].rank <= n]
            assert len(top) == n and [entry[token].rank for token in top] == list(range(1, n + 1))
            np.testing.assert_allclose([entry[token].logprob for token in top], np.sort(row)[::-1][:n], atol=1e-4)
    assert outs[0].outputs[0].logprobs is None   # prompt_logprobs alone asks for no sample logprobs


def test_logprobs_zero_gives_the_sampled_tokens_rank(llm, hf_model):
    ids = [5, 17, 42, 8]
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=1.5, seed=4, max_tokens=12, logprobs=0,
                                                                 ignore_eos=True), use_tqdm=False)[0].outputs[0]
    want = _transformers_logprobs(hf_model, ids + out.token_ids)[len(ids) - 1:]
    ranks = []
    for t, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert list(entry) == [token]
        assert entry[token].logprob == pytest.approx(want[t, token], abs=1e-4)
        _assert_rank(entry[token].rank, want[t], want[t, token])
        ranks.append(entry[token].rank)
    assert max(ranks) > 1   # sampled at temperature 1.5: not only the top tokens
    greedy = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=4, logprobs=2),
                          use_tqdm=False)[0].outputs[0]
    for token, entry in zip(greedy.token_ids, greedy.logprobs):
        assert entry[token].rank == 1 and len(entry) == 2


def test_each_request_gets_only_the_top_logprobs_it_asked_for(llm):
    outs = llm.generate(["a", "b"], [SamplingParams(max_tokens=3, logprobs=1), SamplingParams(max_tokens=3, logprobs=5)],
                        use_tqdm=False)
    assert {len(e) for e in outs[0].outputs[0].logprobs} <= {1, 2}
    assert {len(e) for e in outs[1].outputs[0].logprobs} <= {5, 6}


@pytest.fixture
def waves_llm(llm, monkeypatch):
    """The module's engine running more requests than slots in waves."""
    monkeypatch.setattr(llm, "config", dataclasses.replace(llm.config, continuous_admission=False))
    return llm


def test_request_metrics_time_the_waves(waves_llm):
    """max_num_seqs=2: three requests run in two waves, the third waiting for the first."""
    outs = waves_llm.generate(["one", "two", "three"], GREEDY, use_tqdm=False)
    for out in outs:
        m = out.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time == m.finished_time
        assert m.time_in_queue == pytest.approx(m.first_scheduled_time - m.arrival_time)
        assert 0 < m.model_execute_time <= m.finished_time - m.first_scheduled_time + 1e-6
    assert len({o.metrics.arrival_time for o in outs}) == 1
    assert outs[2].metrics.first_scheduled_time >= outs[0].metrics.finished_time
    assert outs[0].metrics.finished_time == outs[1].metrics.finished_time


def test_request_metrics_of_samples_in_several_waves(waves_llm):
    out = waves_llm.generate("one", SamplingParams(n=3, max_tokens=2), use_tqdm=False)[0]
    m = out.metrics
    assert m.first_token_time < m.finished_time   # the third sample ran in a second wave
    assert m.model_execute_time <= m.finished_time - m.first_scheduled_time + 1e-6


def test_request_metrics_under_admission_time_the_one_call(llm):
    """Three requests through two slots admitted in one call: each is timed by that call."""
    outs = llm.generate(["one", "two", "three"], GREEDY, use_tqdm=False)
    assert llm.admission_trace()[-1].requests == 3
    spans = {(o.metrics.first_scheduled_time, o.metrics.first_token_time, o.metrics.finished_time) for o in outs}
    assert len(spans) == 1
    m = outs[0].metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time == m.finished_time
    assert 0 < m.model_execute_time <= m.finished_time - m.first_scheduled_time + 1e-6


def test_enforce_eager_reaches_the_loops_compilation(model_dir, llm, monkeypatch):
    from specjax.engine import runner

    compiled_with = []
    monkeypatch.setattr(runner, "jit_generate", lambda *args, compiler_options, **kwargs: compiled_with.append(
        compiler_options))
    monkeypatch.setattr(runner, "eager_compiler_options", lambda: {"xla_gpu_enable_command_buffer": ""})
    with pytest.warns(UserWarning) if jax.default_backend() != "gpu" else warnings.catch_warnings():
        eager = LLM(str(model_dir), max_model_len=MAX_MODEL_LEN, max_num_seqs=1, enforce_eager=True)
    eager._runner.generate_fn(3, False)
    llm._runner.generate_fn(3, False)
    del llm._runner._compiled[3, False, False, None]   # the stand-in, out of the shared engine's cache
    assert compiled_with == [{"xla_gpu_enable_command_buffer": ""}, None]   # None: loop_compiler_options()


def test_enforce_eager_compiles_without_cuda_graphs(model_dir, monkeypatch):
    if jax.default_backend() != "gpu":
        with pytest.warns(UserWarning, match="enforce_eager=True has no effect on cpu"):
            LLM(str(model_dir), max_model_len=MAX_MODEL_LEN, max_num_seqs=1, enforce_eager=True)
        assert loop.eager_compiler_options() == {}
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    options = loop.eager_compiler_options()
    assert options == {"xla_gpu_enable_command_buffer": ""}
    monkeypatch.undo()
    assert float(jax.jit(lambda x: x + 1, compiler_options=options)(1.0)) == 2.0   # XLA parses them
