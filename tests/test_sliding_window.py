"""Sliding windows end to end: config.json parsed as transformers applies it (or refused), and greedy output past
the window equal to transformers' on tiny Mistral, Qwen2 and Qwen3 window variants, without speculation and with
n-gram and draft-model speculation (the draft windowed too)."""
from __future__ import annotations

import numpy as np
import pytest
from conftest import TINY_COMMON
from tiny_models import with_tokenizer

from specjax import LLM, SamplingParams
from specjax.models.llama import LlamaConfig

BASE = {**TINY_COMMON, "num_hidden_layers": 3}


@pytest.mark.parametrize("fields, windows", [
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 8}, (8, 8, 8)),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": None}, ()),
    # transformers' MistralConfig default when config.json leaves the key out (Mistral-7B-v0.1 spells it)
    ({"architectures": ["MistralForCausalLM"], "max_position_embeddings": 32768}, (4096,) * 3),
    # Mistral ignores layer_types, as transformers' MistralForCausalLM does
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 8, "layer_types": ["full_attention"] * 3},
     (8, 8, 8)),
    # a window no shorter than the positions hides nothing
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 128}, ()),
    ({"architectures": ["Qwen2ForCausalLM"], "sliding_window": 8, "use_sliding_window": False}, ()),
    ({"architectures": ["Qwen2ForCausalLM"], "sliding_window": 8, "use_sliding_window": True,
      "max_window_layers": 1}, (0, 8, 8)),
    ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "max_window_layers": 2,
      "max_position_embeddings": 32768}, (0, 0, 4096)),
    ({"architectures": ["Qwen3ForCausalLM"], "sliding_window": 6, "use_sliding_window": True,
      "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}, (6, 0, 6)),
    ({"architectures": ["Qwen3ForCausalLM"], "sliding_window": 6, "use_sliding_window": False,
      "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}, ()),
    ({"architectures": ["LlamaForCausalLM"], "sliding_window": 8}, ()),   # Llama has no window
])
def test_windows_are_parsed_as_transformers_applies_them(fields, windows):
    assert LlamaConfig.from_hf_dict({**BASE, **fields}).attention_windows == windows


@pytest.mark.parametrize("fields, match", [
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 0}, "sliding_window must be a positive"),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": "8"}, "sliding_window must be a positive"),
    ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "sliding_window": 8,
      "layer_types": ["sliding_attention"]}, "one entry per layer"),
    ({"architectures": ["Qwen3ForCausalLM"], "use_sliding_window": True, "sliding_window": 8,
      "layer_types": ["chunked_attention", "full_attention", "full_attention"]}, "chunked_attention"),
])
def test_windows_specjax_cannot_honour_are_refused(fields, match):
    with pytest.raises(ValueError, match=match):
        LlamaConfig.from_hf_dict({**BASE, **fields})


PROMPTS = [[5, 17, 42, 8, 61, 3, 9, 70, 11, 5, 17, 42, 8, 2, 33, 90, 4, 12, 5, 17, 42], [7, 7, 31], [88, 1, 50, 23,
           19, 64, 5, 17, 42, 8, 61, 3, 9]]
NEW_TOKENS = 40   # prompt + output reach 61 positions: the windows are 6 and 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
# target -> draft model of the same vocabulary, windowed too
DRAFTS = {"mistral_window": "qwen3_layer_types", "qwen2_window": "mistral_window"}


def transformers_greedy(model_dir, prompt: list[int], n: int) -> list[int]:
    """Argmax continuation by full forward passes (transformers' sliding-window mask over the whole sequence,
    no cache involved)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def llm_dirs(tiny_checkpoint_factory, default_model_dir, tmp_path_factory):
    made = {}

    def get(family: str):
        if family not in made:
            made[family] = with_tokenizer(tiny_checkpoint_factory(family), tmp_path_factory.mktemp(family) / "m",
                                          default_model_dir)
        return made[family]

    return get


@pytest.mark.parametrize("family, method", [("mistral_window", None), ("mistral_window", "ngram"),
                                            ("mistral_window", "draft_model"), ("qwen2_window", None),
                                            ("qwen2_window", "ngram"), ("qwen2_window", "draft_model"),
                                            ("qwen3_layer_types", None)])
def test_greedy_output_past_the_window_equals_transformers(llm_dirs, family, method):
    model_dir = llm_dirs(family)
    spec = {None: None, "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 3},
            "draft_model": {"model": str(llm_dirs(DRAFTS.get(family, family))), "num_speculative_tokens": 3}}[method]
    llm = LLM(str(model_dir), max_model_len=96, max_num_seqs=4, speculative_config=spec)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs):
        assert out.outputs[0].token_ids == transformers_greedy(model_dir, prompt, NEW_TOKENS)
    if method is not None:
        assert llm.get_metrics()[1].value > 0   # drafts were verified
    assert np.any(np.asarray(llm.model_config.attention_windows) > 0)
