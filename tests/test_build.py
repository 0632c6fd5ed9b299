"""The build layer: every cache counts in the memory check, seed=None, and the proposer table."""
from __future__ import annotations

import pytest

from specjax import LLM, SamplingParams
from specjax.build import PROPOSER_BUILDERS, build_engine, check_caches_fit
from specjax.config import KNOWN_METHODS, EngineConfig
from specjax.engine.shapes import buffer_len

LIMITS = dict(max_model_len=64, max_num_seqs=4)


@pytest.fixture(scope="module")
def draft_engine(tiny_checkpoint_factory, default_model_dir):
    """A tiny target with a tiny draft model of the same vocabulary."""
    target, draft = tiny_checkpoint_factory("llama"), tiny_checkpoint_factory("qwen2")
    config = EngineConfig.from_kwargs(str(target), tokenizer=str(default_model_dir), **LIMITS,
                                      speculative_config={"model": str(draft), "num_speculative_tokens": 3})
    return build_engine(config)


def test_a_draft_whose_cache_does_not_fit_is_refused(draft_engine):
    config, target, proposer = draft_engine.config, draft_engine.target, draft_engine.proposer
    slots = buffer_len(64, 64, 0, 3, 64)
    target_bytes = target.module.cache_bytes(4, slots)
    draft_bytes = proposer.cache_bytes(4, slots)
    assert target_bytes > 0 and draft_bytes > 0
    check_caches_fit(config, target, proposer, free_bytes=int((target_bytes + draft_bytes) / 0.9) + 1)
    with pytest.raises(ValueError, match="KV cache needs .* Lower max_model_len"):
        check_caches_fit(config, target, proposer, free_bytes=int((target_bytes + draft_bytes // 2) / 0.9))


def test_seed_none_draws_a_seed_and_generates(tiny_checkpoint_factory, default_model_dir):
    llm = LLM(str(tiny_checkpoint_factory("llama")), tokenizer=str(default_model_dir), seed=None, **LIMITS)
    assert isinstance(llm.config.seed, int)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=1.0, max_tokens=5,
                                                                      ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5


def test_every_implemented_method_has_a_builder():
    assert set(PROPOSER_BUILDERS) == set(KNOWN_METHODS)
