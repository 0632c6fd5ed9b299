"""The LLM API: equality with transformers, EOS and stop strings on the real default model (SmolLM2-135M-Instruct,
fp32); stop ids, seeded sampling, compile caching, waves, the functional core and user errors raised before
compilation on a 4-layer random model with the default model's vocabulary and tokenizer."""
from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from specjax import LLM, SamplingParams, make_generate_fn

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the mountains, there lived an old clockmaker who",
    "List three colors:",
]
CHATS = [[{"role": "user", "content": "What is 2 + 3?"}],
         [{"role": "user", "content": "Name a famous painter and one of their paintings."}],
         [{"role": "user", "content": "Hi"}],
         [{"role": "system", "content": "You are a terse assistant."},
          {"role": "user", "content": "Explain in two sentences why the sky is blue, mentioning Rayleigh scattering."}],
         [{"role": "user", "content": "Write a Python function that reverses a string."}]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32)


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(str(default_model_dir), max_model_len=512, max_num_seqs=8)


@pytest.fixture(scope="module")
def tiny_llm(tiny_chat_model):
    return LLM(str(tiny_chat_model), max_model_len=512, max_num_seqs=8)


@pytest.fixture(scope="module")
def hf_model(default_model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


def _hf_greedy(hf_model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, top_p=None, top_k=None,
                                temperature=None, eos_token_id=2, pad_token_id=2)
    return out[0, len(ids):].tolist()


@pytest.mark.real_model
def test_greedy_generate_equals_transformers(llm, hf_model):
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outputs] == PROMPTS
    for out in outputs:
        completion = out.outputs[0]
        assert completion.token_ids == _hf_greedy(hf_model, out.prompt_token_ids, 32)
        assert completion.text == llm.get_tokenizer().decode(completion.token_ids, skip_special_tokens=True) \
            or completion.finish_reason == "stop"


@pytest.mark.real_model
def test_chat_batch_equals_transformers_with_the_same_template(llm, hf_model):
    """Five chat prompts of different lengths in one batch, 48 greedy tokens each, with the KV cache."""
    tok = llm.get_tokenizer()
    outputs = llm.chat(CHATS, SamplingParams(temperature=0.0, max_tokens=48), use_tqdm=False)
    assert len({len(o.prompt_token_ids) for o in outputs}) >= 4  # rows of different lengths share the batch
    for conv, out in zip(CHATS, outputs):
        ids = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        assert out.prompt_token_ids == list(ids)
        expected = _hf_greedy(hf_model, list(ids), 48)
        assert out.outputs[0].token_ids == expected
        if expected[-1] == 2:
            assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason is None


def test_second_generate_in_the_same_bucket_does_not_compile(tiny_llm):
    tiny_llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    fn = tiny_llm._runner.generate_fn(0, True)   # (n_top, all rows greedy)
    before = fn._cache_size()
    tiny_llm.generate(["Another prompt of similar size", "and one more"],
                      SamplingParams(temperature=0.0, max_tokens=30), use_tqdm=False)
    assert fn._cache_size() == before


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 4}])
def test_a_request_shorter_than_the_prompt_bucket_generates(tiny_chat_model, tiny_llm, spec):
    """The README's first prompt with max_tokens=3 (prompt + max_tokens <= 8) once crashed inside XLA."""
    short = SamplingParams(temperature=0.0, max_tokens=3)
    engine = tiny_llm if spec is None else LLM(str(tiny_chat_model), max_model_len=512, max_num_seqs=8,
                                          speculative_config=spec)
    out = engine.generate("The capital of France is", short, use_tqdm=False)[0].outputs[0]
    longer = tiny_llm.generate("The capital of France is", GREEDY, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == longer.token_ids[:3] and out.finish_reason == "length"


def test_stop_token_ids_max_tokens_and_min_tokens(tiny_llm):
    base = tiny_llm.generate(PROMPTS[3], GREEDY, use_tqdm=False)[0].outputs[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 32
    stop_id = base.token_ids[5]
    first = base.token_ids.index(stop_id)
    out = tiny_llm.generate(PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=32, stop_token_ids=[stop_id]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base.token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    out = tiny_llm.generate(PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=32, stop_token_ids=[stop_id],
                                                  min_tokens=first + 3), use_tqdm=False)[0].outputs[0]
    assert stop_id not in out.token_ids[:first + 3]


@pytest.mark.real_model
def test_eos_stops_with_reason_stop(llm):
    out = llm.chat(CHATS[0], SamplingParams(temperature=0.0, max_tokens=64), use_tqdm=False)[0].outputs[0]
    assert out.token_ids[-1] == 2 and out.finish_reason == "stop" and out.stop_reason is None
    assert "<|im_end|>" not in out.text
    ignored = llm.chat(CHATS[0], SamplingParams(temperature=0.0, max_tokens=len(out.token_ids) + 3, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == len(out.token_ids) + 3


@pytest.mark.real_model
def test_stop_string_across_tokens_is_trimmed(llm):
    base = llm.generate(PROMPTS[3], GREEDY, use_tqdm=False)[0].outputs[0]
    words = base.text.split()
    stop = f"{words[2]} {words[3]}"  # spans several tokens
    out = llm.generate(PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=32, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[:base.text.index(stop)]
    kept = llm.generate(PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=32, stop=[stop],
                                                   include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == base.text[:base.text.index(stop) + len(stop)]


def test_max_model_len_ends_with_length(tiny_chat_model):
    small = LLM(str(tiny_chat_model), max_model_len=24, max_num_seqs=2)
    out = small.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True),
                         use_tqdm=False)[0]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 24
    assert out.outputs[0].finish_reason == "length"


def test_seeded_sampling_same_alone_and_in_a_mixed_batch(tiny_llm):
    seeded = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=24, seed=1234)
    alone = tiny_llm.generate(PROMPTS[1], seeded, use_tqdm=False)[0].outputs[0].token_ids
    again = tiny_llm.generate(PROMPTS[1], seeded, use_tqdm=False)[0].outputs[0].token_ids
    mixed_params = [SamplingParams(temperature=t, top_k=k, max_tokens=24) for t, k in
                    [(0.0, 0), (1.0, 5), (0.7, 0), (1.2, 50)]] + [seeded] + [
        SamplingParams(temperature=0.5, min_p=0.1, max_tokens=24, seed=s) for s in (1, 2, 3)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(4)] + [PROMPTS[1]] + PROMPTS[:3]
    mixed = tiny_llm.generate(prompts, mixed_params, use_tqdm=False)
    assert alone == again == mixed[4].outputs[0].token_ids
    other = tiny_llm.generate(PROMPTS[1], SamplingParams(temperature=0.9, top_p=0.9, max_tokens=24, seed=99),
                         use_tqdm=False)[0].outputs[0].token_ids
    assert other != alone


def test_n_samples_and_logprobs(tiny_llm):
    out = tiny_llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, n=3, max_tokens=8, seed=7, logprobs=2),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    c = out.outputs[0]
    assert len(c.logprobs) == len(c.token_ids)
    for token, entry in zip(c.token_ids, c.logprobs):
        assert token in entry and all(lp.logprob <= 0 for lp in entry.values())
    assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)),
                                                 rel=1e-5)


def test_more_prompts_than_max_num_seqs_run_in_waves(tiny_chat_model):
    small = LLM(str(tiny_chat_model), max_model_len=128, max_num_seqs=2)
    outputs = small.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=True)
    assert len(outputs) == 5 and all(len(o.outputs[0].token_ids) == 6 for o in outputs)
    single = small.generate(PROMPTS[4], SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
    assert single[0].outputs[0].token_ids == outputs[4].outputs[0].token_ids


def test_functional_core_inside_user_jit_and_vmap(tiny_llm):
    fn = make_generate_fn(tiny_llm, SamplingParams(temperature=1.0, max_tokens=8))
    tok = tiny_llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS[:2]]
    P = max(map(len, ids))
    prompt_tokens = jnp.asarray([i + [0] * (P - len(i)) for i in ids], jnp.int32)
    prompt_lengths = jnp.asarray([len(i) for i in ids], jnp.int32)

    @jax.jit
    def harness(params, rng):  # the user's own jit around the core
        tokens, lengths, stats = fn(params, None, prompt_tokens, prompt_lengths, rng)
        return tokens, lengths

    tokens, lengths = harness(tiny_llm.params, jax.random.key(0))
    np.testing.assert_array_equal(lengths, prompt_lengths + 8)
    seeds = jax.random.split(jax.random.key(1), 3)
    many_tokens, many_lengths = jax.jit(jax.vmap(harness, in_axes=(None, 0)))(tiny_llm.params, seeds)
    assert many_tokens.shape[0] == 3
    assert len({tuple(np.asarray(many_tokens[i, 0, :int(many_lengths[i, 0])])) for i in range(3)}) > 1


@pytest.mark.parametrize("call, match", [
    (lambda llm: llm.generate([], GREEDY), "prompts is empty"),
    (lambda llm: llm.generate({"prompt_token_ids": []}, GREEDY), "empty"),
    (lambda llm: llm.generate("word " * 600, GREEDY), "max_model_len"),
    (lambda llm: llm.generate(["a", "b"], [GREEDY]), "one per prompt"),
    (lambda llm: llm.generate({"prompt_token_ids": [1, 10**6]}, GREEDY), "outside"),
])
def test_bad_requests_raise_clear_errors(tiny_llm, call, match):
    with pytest.raises(ValueError, match=match):
        call(tiny_llm)


def test_bad_engine_arguments_raise_before_loading(tiny_chat_model):
    with pytest.raises(TypeError, match="Accepted"):
        LLM(str(tiny_chat_model), no_such_option=1)
    with pytest.raises(ValueError, match="max_num_seqs"):
        LLM(str(tiny_chat_model), max_num_seqs=10**7)  # the KV cache cannot fit
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.warns(UserWarning, match="swap_space"):
        LLM(str(tiny_chat_model), max_model_len=64, max_num_seqs=1, swap_space=4)


def test_unknown_architecture_is_refused(tiny_chat_model, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_chat_model, bad)
    config = json.loads((bad / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        LLM(str(bad))


def test_a_converted_orbax_checkpoint_generates_like_its_source(default_model_dir, tiny_checkpoint_factory, tmp_path):
    from checkpoints_conv import convert_hf_to_orbax

    hf_dir = tmp_path / "hf"
    shutil.copytree(tiny_checkpoint_factory("llama"), hf_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, hf_dir / name)
    orbax_dir = convert_hf_to_orbax(hf_dir, tmp_path / "orbax")
    prompt = {"prompt_token_ids": [5, 17, 42, 8]}
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = LLM(str(hf_dir), max_num_seqs=1).generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    got = LLM(str(orbax_dir), max_num_seqs=1).generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == expected and len(got) == 12


def test_unrolled_layers_generate_like_scanned_ones(default_model_dir, tiny_checkpoint_factory, tmp_path):
    """The per-layer unrolled layout (the GPU default) forced on CPU, for the target and a draft model:
    the same greedy tokens as the stacked, scanned layout."""
    dirs = {}
    for family in ("llama", "qwen3"):
        dirs[family] = tmp_path / family
        shutil.copytree(tiny_checkpoint_factory(family), dirs[family])
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(default_model_dir / name, dirs[family] / name)
    prompts = [{"prompt_token_ids": p} for p in ([5, 17, 42, 8], [9] * 11, [3])]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    draft = {"model": str(dirs["qwen3"]), "num_speculative_tokens": 3}

    def tokens(unroll: bool, spec):
        llm = LLM(str(dirs["llama"]), max_num_seqs=4, unroll_layers=unroll, speculative_config=spec)
        assert llm.params["layers"].keys() == ({0, 1} if unroll else {"attn_norm", "mlp_norm", "w_down", "w_gate_up",
                                                                    "w_qkv", "wo"})
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    for spec in (None, draft):
        assert tokens(True, spec) == tokens(False, spec)
    with pytest.raises(TypeError, match="unroll_layers"):
        LLM(str(dirs["llama"]), unroll_layers="yes")


def test_generation_config_sampling_defaults_apply_without_sampling_params(tiny_chat_model, tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_chat_model, model_dir)
    config = json.loads((model_dir / "generation_config.json").read_text())
    (model_dir / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.0, "max_new_tokens": 5}))
    llm = LLM(str(model_dir), max_model_len=128, max_num_seqs=1)
    assert llm.get_default_sampling_params().temperature == 0.0
    out = llm.generate(PROMPTS[0], use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5
    assert out.token_ids == llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=5),
                                         use_tqdm=False)[0].outputs[0].token_ids
