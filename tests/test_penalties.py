"""Presence, frequency and repetition penalties: the penalised logits against a numpy transcription of vLLM's
definitions, each verify position against the counts a plain step would see there, and through LLM on a tiny
model whose sharp, repetitive distributions the penalties change: greedy speculation (n-gram and a draft model)
equals plain decoding token for token, and sampled speculation draws what plain sampling draws."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from jax.scipy.special import gammaincc
from tiny_models import tiny_llm_dir

from specjax import LLM, SamplingParams
from specjax.engine.sampling import apply_penalties, counts_through

V = 97
PROMPT = {"prompt_token_ids": [5, 17, 42, 8, 5, 17, 42, 9, 3]}
PENALTY_SETS = [dict(repetition_penalty=1.8), dict(frequency_penalty=1.5), dict(presence_penalty=2.0),
                dict(repetition_penalty=0.7, frequency_penalty=-0.5, presence_penalty=0.5)]


def numpy_penalties(logits, prompt, generated, presence, frequency, repetition):
    """vLLM's penalties, one logit at a time, from the token lists: repetition for tokens of the prompt or the
    output (divide positive logits, multiply the rest), then minus frequency x count and presence x seen."""
    out = np.array(logits, np.float32)
    for v in range(out.shape[-1]):
        count = generated.count(v)
        if v in prompt or count:
            out[v] = out[v] / np.float32(repetition) if out[v] > 0 else out[v] * np.float32(repetition)
        out[v] -= np.float32(frequency) * count
        out[v] -= np.float32(presence) * (count > 0)
    return out


def test_penalised_logits_equal_a_numpy_transcription_of_vllms_definitions():
    rng = np.random.default_rng(0)
    B, T = 3, 4
    logits = rng.normal(size=(B, T, V)).astype(np.float32) * 3
    prompts = [rng.integers(0, V, 6).tolist() for _ in range(B)]
    histories = [[rng.integers(0, 12, n).tolist() for _ in range(T)] for n in (0, 5, 20)]
    presence, frequency, repetition = (np.float32([0.0, 1.5, -0.7]), np.float32([0.3, 0.0, 2.0]),
                                       np.float32([1.0, 1.9, 0.6]))
    in_prompt = np.zeros((B, V), bool)
    generated = np.zeros((B, T, V), np.int32)
    for b in range(B):
        in_prompt[b, prompts[b]] = True
        for t in range(T):
            np.add.at(generated[b, t], histories[b][t], 1)
    got = np.asarray(apply_penalties(jnp.asarray(logits), jnp.asarray(in_prompt), jnp.asarray(generated),
                                     presence, frequency, repetition))
    for b in range(B):
        for t in range(T):
            want = numpy_penalties(logits[b, t], prompts[b], histories[b][t], presence[b], frequency[b], repetition[b])
            # XLA may divide by multiplying with the reciprocal (as vLLM's torch path does): 1 ulp apart.
            np.testing.assert_allclose(got[b, t], want, rtol=1e-6, atol=1e-6)
    assert not np.array_equal(got[1:], logits[1:])


def test_each_verify_position_counts_the_drafts_before_it():
    """Position t of a verify pass sees what a plain step after committing drafts[:t] would count; a missing
    draft (-1) and everything after it counts nothing."""
    generated = np.zeros((2, V), np.int32)
    generated[0, [4, 9]] = [2, 1]
    drafts = np.array([[9, 9, 11], [7, -1, -1]], np.int32)
    got = np.asarray(counts_through(jnp.asarray(generated), jnp.asarray(drafts)))
    assert got.shape == (2, 4, V)
    for b in range(2):
        for t in range(4):
            history = [v for v in range(V) for _ in range(generated[b, v])] + [d for d in drafts[b, :t] if d >= 0]
            np.testing.assert_array_equal(got[b, t], np.bincount(history, minlength=V))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, default_model_dir):
    """Weights 5x transformers' init scale: greedy decoding falls into repeats (81 81 81 ...), as the penalties
    are meant to break."""
    return tiny_llm_dir(tmp_path_factory.mktemp("sharp"), default_model_dir, initializer_range=0.1)


@pytest.fixture(scope="module")
def engines(model_dir):
    spec = {"plain": None,
            "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
            "draft": {"model": str(model_dir), "num_speculative_tokens": 3, "draft_sample_method": "probabilistic"}}
    made: dict[str, LLM] = {}

    def engine(name: str) -> LLM:
        if name not in made:
            made[name] = LLM(str(model_dir), max_model_len=96, max_num_seqs=512, speculative_config=spec[name])
        return made[name]

    return engine


def _tokens(llm: LLM, params: list[SamplingParams]) -> list[list[int]]:
    return [c.token_ids for o in llm.generate([PROMPT] * len(params), params, use_tqdm=False) for c in o.outputs]


GREEDY = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, **p) for p in [{}] + PENALTY_SETS]
# Sampled rows with top_k=1 are deterministic: the sampling path, token for token.
TOP_1 = [SamplingParams(temperature=0.8, top_k=1, seed=3, max_tokens=40, ignore_eos=True, **p) for p in PENALTY_SETS]


def test_the_penalties_change_this_models_greedy_output(engines):
    plain = _tokens(engines("plain"), GREEDY)
    assert all(tokens != plain[0] for tokens in plain[1:])
    assert len(set(plain[0])) < 10 < min(len(set(tokens)) for tokens in plain[2:4])   # repeats, then fewer


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_speculation_with_penalties_equals_plain_decoding(engines, method):
    """Drafts the target accepts early in a step are counted at the later positions of that step: a draft
    model drafting without penalties proposes the repeats the penalties forbid, which must be rejected there."""
    spec = engines(method)
    assert _tokens(spec, GREEDY + TOP_1) == _tokens(engines("plain"), GREEDY + TOP_1)
    assert spec.get_metrics()[2].value > 0   # drafts were accepted


def homogeneity_p_value(a: np.ndarray, b: np.ndarray) -> float:
    """Chi-square test that two samples of tokens come from one distribution (bins expecting < 5 pooled)."""
    counts = np.stack([np.bincount(a, minlength=V), np.bincount(b, minlength=V)]).astype(np.float64)
    expected = counts.sum(0) * (counts.sum(1, keepdims=True) / counts.sum())
    small = expected.min(0) < 5
    counts = np.concatenate([counts[:, ~small], counts[:, small].sum(1, keepdims=True)], axis=1)
    expected = np.concatenate([expected[:, ~small], expected[:, small].sum(1, keepdims=True)], axis=1)
    keep = expected.min(0) > 0
    stat = np.sum((counts[:, keep] - expected[:, keep]) ** 2 / expected[:, keep])
    return float(gammaincc((keep.sum() - 1) / 2.0, stat / 2.0))


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_sampled_speculation_with_penalties_draws_what_plain_sampling_draws(engines, method):
    """500 seeded samples of 4 tokens: each position's tokens follow one distribution with and without
    speculation (the draft model's q, unpenalised, differs from the penalised p, so rejections and recovery
    draws happen). At temperature 0.1 the unpenalised model repeats itself; a verify pass blind to the step's
    earlier drafts would accept their repeats and fail this."""
    params = SamplingParams(n=500, seed=0, temperature=0.1, max_tokens=4, ignore_eos=True, frequency_penalty=0.5,
                            repetition_penalty=1.5)
    plain = np.array(_tokens(engines("plain"), [params]))
    spec = np.array(_tokens(engines(method), [params]))
    for position in range(4):
        assert homogeneity_p_value(plain[:, position], spec[:, position]) > 1e-3, position
    repeats = np.mean([len(set(row)) < 4 for row in plain])
    assert abs(np.mean([len(set(row)) < 4 for row in spec]) - repeats) < 0.08
