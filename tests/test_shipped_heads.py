"""The heads shipped for the default model (EAGLE-3, and an MTP layer): found by name, in their published layouts,
lossless, and actually trained (they accept drafts on word problems they never saw; questions written for this
test, not taken from GSM8K)."""
from __future__ import annotations

import json

import pytest

from specjax import LLM, SamplingParams
from specjax.config import SpeculativeConfig
from specjax.default_model import DEFAULT_EAGLE3_HEAD, DEFAULT_MTP_HEAD, default_eagle3_head_dir, default_mtp_head_dir
from specjax.hub import resolve_model

pytestmark = pytest.mark.real_model

QUESTIONS = [
    "A baker makes 36 muffins and sells 5 boxes of 6 muffins each. How many muffins are left?",
    "Tom reads 12 pages a day for 9 days, then 20 pages on the tenth day. How many pages did he read?",
    "A farmer has 4 fields with 23 cows each and buys 15 more cows. How many cows does he have now?",
    "Sara saves $8 every week. How many weeks does she need to save $120 for a bike?",
]


def test_shipped_eagle3_head_is_in_the_published_eagle3_layout_for_the_default_model():
    head = default_eagle3_head_dir()
    config = json.loads((head / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["target_hidden_size"] == 576 and config["vocab_size"] == 49152
    assert (head / "model.safetensors").is_file()


def test_shipped_mtp_head_is_one_mimo_layout_layer_for_the_default_model():
    from safetensors import safe_open

    head = default_mtp_head_dir()
    config = json.loads((head / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and config["hidden_size"] == 576 and config["vocab_size"] == 49152
    with safe_open(head / "model.safetensors", "np") as f:
        names = set(f.keys())
    assert all(n.startswith("model.mtp_layers.0.") for n in names) and "model.mtp_layers.0.input_proj.weight" in names
    assert resolve_model(DEFAULT_MTP_HEAD) == head


def test_method_mtp_takes_k_from_the_mtp_head_it_is_given():
    """vLLM's rule (k defaults to the number of MTP layers) read from the head directory: one layer here."""
    llm = LLM(max_num_seqs=1, max_model_len=128, speculative_config={"method": "mtp", "model": DEFAULT_MTP_HEAD})
    assert llm.config.speculative.num_speculative_tokens == 1


def test_shipped_head_name_infers_eagle3():
    spec = SpeculativeConfig.from_dict({"model": DEFAULT_EAGLE3_HEAD, "num_speculative_tokens": 3},
                                       target_max_model_len=1024, target_tensor_parallel_size=1)
    assert spec.method == "eagle3"


CONVERSATIONS = [[{"role": "user", "content": q}] for q in QUESTIONS]
ANSWER = SamplingParams(temperature=0.0, max_tokens=96)


@pytest.fixture(scope="module")
def plain_answers() -> list[list[int]]:
    """The default model's own greedy answers, which both heads' runs must reproduce."""
    llm = LLM(max_num_seqs=4, max_model_len=512)
    return [o.outputs[0].token_ids for o in llm.chat(CONVERSATIONS, ANSWER, use_tqdm=False)]


# A random head scores about 1.0; the EAGLE-3 head's 80-step pilot 1.5, the previous shipped head 2.34, this one
# 2.88; the MTP layer 2.85 on held-out GSM8K questions (its training.json).
@pytest.mark.parametrize("spec,least", [({"model": DEFAULT_EAGLE3_HEAD}, 2.5),
                                        ({"method": "mtp", "model": DEFAULT_MTP_HEAD}, 2.4)], ids=["eagle3", "mtp"])
def test_shipped_head_is_lossless_and_accepts_drafts_on_unseen_questions(plain_answers, spec, least):
    llm = LLM(max_num_seqs=4, max_model_len=512, speculative_config={**spec, "num_speculative_tokens": 3})
    outputs = llm.chat(CONVERSATIONS, ANSWER, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == plain_answers
    metrics = {m.name.removeprefix("vllm:spec_decode_"): m for m in llm.get_metrics()}
    acceptance_length = 1 + metrics["num_accepted_tokens"].value / metrics["num_drafts"].value
    assert acceptance_length >= least, acceptance_length
