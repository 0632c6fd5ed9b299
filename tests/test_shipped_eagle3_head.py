"""The EAGLE-3 head shipped for the default model: found by name, lossless, and actually trained (it
accepts drafts on word problems it never saw; questions written for this test, not taken from GSM8K)."""
from __future__ import annotations

import json

import pytest

from specjax import LLM, SamplingParams
from specjax.config import SpeculativeConfig
from specjax.default_model import DEFAULT_EAGLE3_HEAD, default_eagle3_head_dir

QUESTIONS = [
    "A baker makes 36 muffins and sells 5 boxes of 6 muffins each. How many muffins are left?",
    "Tom reads 12 pages a day for 9 days, then 20 pages on the tenth day. How many pages did he read?",
    "A farmer has 4 fields with 23 cows each and buys 15 more cows. How many cows does he have now?",
    "Sara saves $8 every week. How many weeks does she need to save $120 for a bike?",
]


def test_shipped_head_is_in_the_published_eagle3_layout_for_the_default_model():
    head = default_eagle3_head_dir()
    config = json.loads((head / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["target_hidden_size"] == 576 and config["vocab_size"] == 49152
    assert (head / "model.safetensors").is_file()


def test_shipped_head_name_infers_eagle3():
    spec = SpeculativeConfig.from_dict({"model": DEFAULT_EAGLE3_HEAD, "num_speculative_tokens": 3},
                                       target_max_model_len=1024, target_tensor_parallel_size=1)
    assert spec.method == "eagle3"


@pytest.mark.slow
def test_shipped_head_is_lossless_and_accepts_drafts_on_unseen_questions():
    params = SamplingParams(temperature=0.0, max_tokens=96)
    prompts = [[{"role": "user", "content": q}] for q in QUESTIONS]
    plain = LLM(max_num_seqs=4, max_model_len=512).chat(prompts, params, use_tqdm=False)
    llm = LLM(max_num_seqs=4, max_model_len=512, speculative_config={
        "model": DEFAULT_EAGLE3_HEAD, "num_speculative_tokens": 3})
    spec = llm.chat(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    metrics = {m.name.removeprefix("vllm:spec_decode_"): m for m in llm.get_metrics()}
    acceptance_length = 1 + metrics["num_accepted_tokens"].value / metrics["num_drafts"].value
    # A random head scores about 1.0, an 80-step pilot 1.5, the previous shipped head 2.34; this one 2.88.
    assert acceptance_length >= 2.5, acceptance_length
