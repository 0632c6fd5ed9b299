"""Speculative decoding through LLM: lossless greedy output for ngram and draft_model, self-drafting acceptance,
seeded sampling, metrics, vLLM's examples, and config errors, on a 4-layer random model with the default model's
vocabulary and tokenizer (its first 2 layers the draft); n-gram acceptance on the real default model. (The
trained heads' lossless test runs the default model too: test_shipped_heads.py.)"""
from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from specjax import LLM, SamplingParams

PROMPTS = [
    "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
    "The capital of France is",
    "1, 2, 3, 4, 5, 6, 7,",
    "Write a short story about a robot who learns to paint.",
    "Q: What is the boiling point of water? A:",
    "Translate to French: Good morning, how are you today?",
    "Here is a list of fruits: apple, banana, cherry, apple, banana,",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)
LEN = dict(max_model_len=384, max_num_seqs=8)


@pytest.fixture(scope="module")
def target_dir(tiny_chat_model):
    return tiny_chat_model


@pytest.fixture(scope="module")
def plain_outputs(target_dir):
    llm = LLM(str(target_dir), **LEN)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def small_draft_dir(target_dir, tmp_path_factory):
    """A draft of the same tokenizer: the target's first 2 layers with its embedding/head and final norm."""
    out = tmp_path_factory.mktemp("draft2")
    config = json.loads((target_dir / "config.json").read_text())
    config["num_hidden_layers"] = 2
    (out / "config.json").write_text(json.dumps(config))
    tensors = load_file(target_dir / "model.safetensors")
    keep = {n: t for n, t in tensors.items()
            if not n.startswith("model.layers.") or int(n.split(".")[2]) < 2}
    save_file(keep, out / "model.safetensors")
    return out


def _spec_run(model_dir, spec, params=GREEDY, prompts=PROMPTS):
    llm = LLM(str(model_dir), speculative_config=spec, **LEN)
    return llm, llm.generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize("k", [1, 5])
def test_ngram_greedy_is_lossless(target_dir, plain_outputs, k):
    llm, outs = _spec_run(target_dir, {"method": "ngram", "num_speculative_tokens": k,
                                       "prompt_lookup_max": 4, "prompt_lookup_min": 1})
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs
    metrics = {m.name: m for m in llm.get_metrics()}
    assert metrics["vllm:spec_decode_num_draft_tokens"].value > 0
    assert len(metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values) == k


def test_draft_model_greedy_is_lossless(target_dir, small_draft_dir, plain_outputs):
    _, outs = _spec_run(target_dir, {"model": str(small_draft_dir), "num_speculative_tokens": 3})
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs


def test_self_drafting_accepts_everything(target_dir, plain_outputs):
    k = 3
    llm, outs = _spec_run(target_dir, {"model": str(target_dir), "num_speculative_tokens": k})
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs
    for out in outs:
        c = out.outputs[0]
        assert c.num_accepted_tokens == c.num_draft_tokens
        # Every step but the last (which the length limit may cut) carries k drafts.
        assert c.num_draft_tokens >= k * (c.num_drafts - 1)
    full = [o.outputs[0] for o in outs if len(o.outputs[0].token_ids) == GREEDY.max_tokens]
    assert full and all(c.mean_acceptance_length == pytest.approx(k + 1, abs=0.1) for c in full)


@pytest.mark.real_model
def test_ngram_acceptance_length_on_a_repetitive_prompt(default_model_dir):
    prompt = "Repeat this list five times: red, green, blue, yellow. red, green, blue, yellow. red, green,"
    llm, outs = _spec_run(default_model_dir, {"method": "ngram", "num_speculative_tokens": 4,
                                              "prompt_lookup_max": 3, "prompt_lookup_min": 2},
                          SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True), [prompt])
    assert outs[0].outputs[0].mean_acceptance_length > 2


def test_seeded_speculative_sampling_is_batch_invariant(target_dir, small_draft_dir):
    llm = LLM(str(target_dir), speculative_config={
        "model": str(small_draft_dir), "num_speculative_tokens": 3, "draft_sample_method": "probabilistic"}, **LEN)
    seeded = SamplingParams(temperature=0.8, top_k=40, max_tokens=24, seed=5)
    alone = llm.generate(PROMPTS[4], seeded, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate(PROMPTS[:3] + [PROMPTS[4]], [SamplingParams(temperature=0.0, max_tokens=16),
                                                      SamplingParams(temperature=1.0, max_tokens=30),
                                                      SamplingParams(temperature=0.5, top_p=0.8, max_tokens=10),
                                                      seeded], use_tqdm=False)
    assert mixed[3].outputs[0].token_ids == alone


def test_vllm_examples_run_with_only_model_names_changed(target_dir, small_draft_dir):
    prompts = ["The future of AI is"]
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95)
    llm = LLM(model=str(target_dir), tensor_parallel_size=1,
              speculative_config={"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4})
    outputs = llm.generate(prompts, sampling_params)
    assert outputs[0].prompt == prompts[0] and outputs[0].outputs[0].text
    llm = LLM(model=str(target_dir), tensor_parallel_size=1,
              speculative_config={"model": str(small_draft_dir), "num_speculative_tokens": 5})
    outputs = llm.generate(prompts, sampling_params)
    assert outputs[0].outputs[0].text


def test_draft_with_another_vocabulary_is_refused(target_dir, tiny_checkpoint_factory):
    with pytest.raises(ValueError, match="vocab_size"):
        LLM(str(target_dir), speculative_config={"model": str(tiny_checkpoint_factory("llama")),
                                                         "num_speculative_tokens": 3}, **LEN)


@pytest.mark.parametrize("spec, error, match", [
    ({"method": "medusa", "num_speculative_tokens": 3}, ValueError, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, ValueError, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 3, "tensor_parallel_size": 2}, ValueError,
     "draft_tensor_parallel_size"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     ValueError, "prompt_lookup"),
    ({"method": "mtp", "num_speculative_tokens": 3}, ValueError, "num_nextn_predict_layers"),
])
def test_bad_speculative_configs_fail_before_loading_the_draft(target_dir, spec, error, match):
    with pytest.raises(error, match=match):
        LLM(str(target_dir), speculative_config=spec, **LEN)


def test_synthetic_acceptance_reaches_the_configured_length(target_dir, small_draft_dir):
    # A draft model drafts at every step (n-gram lookup finds few matches in a random model's output).
    llm, outs = _spec_run(target_dir, {"model": str(small_draft_dir), "num_speculative_tokens": 3,
                                       "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 2.5},
                          SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True), [PROMPTS[3]] * 4)
    drafts = sum(o.outputs[0].num_drafts for o in outs)
    accepted = sum(o.outputs[0].num_accepted_tokens for o in outs)
    assert drafts > 20
    assert 1 + accepted / drafts == pytest.approx(2.5, abs=0.35)
    assert np.all(np.diff([m for m in llm.get_metrics() if m.name.endswith("per_pos")][0].values) <= 0)
