"""RequestOutput / CompletionOutput fields and vLLM's speculative-decoding metric definitions."""
from __future__ import annotations

import math

import pytest

from specjax.outputs import (NUM_ACCEPTED_TOKENS, NUM_ACCEPTED_TOKENS_PER_POS, NUM_DRAFT_TOKENS, NUM_DRAFTS,
                             CompletionOutput, Counter, Logprob, RequestOutput, Vector, spec_decode_metrics)


def test_completion_defaults_and_finished():
    out = CompletionOutput(index=0, text="hi", token_ids=[1, 2])
    assert (out.cumulative_logprob, out.logprobs, out.finish_reason, out.stop_reason) == (None, None, None, None)
    assert not out.finished()
    assert CompletionOutput(0, "hi", [1, 2], -1.5, None, "length").finished()


def test_acceptance_properties_follow_vllms_definitions():
    # 4 drafts of k=3 tokens; accepted prefixes of length 3, 1, 0, 2.
    out = CompletionOutput(0, "", [], num_drafts=4, num_draft_tokens=12, num_accepted_tokens=6,
                           num_accepted_tokens_per_pos=[3, 2, 1])
    assert out.mean_acceptance_length == pytest.approx(1 + 6 / 4)
    assert out.acceptance_rate == pytest.approx(6 / 12)
    assert out.acceptance_rate_per_pos == pytest.approx([3 / 4, 2 / 4, 1 / 4])


def test_acceptance_properties_without_drafts():
    out = CompletionOutput(0, "", [], num_accepted_tokens_per_pos=[0, 0])
    assert out.mean_acceptance_length == 1.0
    assert math.isnan(out.acceptance_rate)
    assert out.acceptance_rate_per_pos == [0.0, 0.0]


def test_request_output_fields_are_keyword_only():
    completion = CompletionOutput(0, "x", [5], logprobs=[{5: Logprob(-0.1, rank=1, decoded_token="x")}])
    req = RequestOutput(request_id="0", prompt="p", prompt_token_ids=[1], outputs=[completion])
    assert req.finished and req.prompt_logprobs is None
    assert req.outputs[0].logprobs[0][5].logprob == -0.1
    with pytest.raises(TypeError):
        RequestOutput("0", "p", [1], [completion])


def _vllm_example_summary(metrics):
    """How vLLM's examples/offline_inference/spec_decode.py reads llm.get_metrics()."""
    num_drafts = num_accepted = 0
    per_pos = [0] * 3
    for metric in metrics:
        if metric.name == "vllm:spec_decode_num_drafts":
            assert isinstance(metric, Counter)
            num_drafts += metric.value
        elif metric.name == "vllm:spec_decode_num_accepted_tokens":
            assert isinstance(metric, Counter)
            num_accepted += metric.value
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            assert isinstance(metric, Vector)
            for pos in range(len(metric.values)):
                per_pos[pos] += metric.values[pos]
    length = 1 + (num_accepted / num_drafts) if num_drafts > 0 else 1
    return length, [a / num_drafts for a in per_pos]


def test_spec_decode_metrics_read_like_vllms():
    metrics = spec_decode_metrics(4, 12, 6, [3, 2, 1], labels={"engine": "0"})
    assert [m.name for m in metrics] == [NUM_DRAFTS, NUM_DRAFT_TOKENS, NUM_ACCEPTED_TOKENS,
                                         NUM_ACCEPTED_TOKENS_PER_POS]
    assert [type(m) for m in metrics] == [Counter, Counter, Counter, Vector]
    assert [m.value for m in metrics[:3]] == [4, 12, 6]
    assert metrics[3].values == [3, 2, 1]
    assert all(m.labels == {"engine": "0"} for m in metrics)
    length, per_pos = _vllm_example_summary(metrics)
    same = CompletionOutput(0, "", [], num_drafts=4, num_draft_tokens=12, num_accepted_tokens=6,
                            num_accepted_tokens_per_pos=[3, 2, 1])
    assert length == pytest.approx(same.mean_acceptance_length)
    assert per_pos == pytest.approx(same.acceptance_rate_per_pos)


@pytest.mark.parametrize("args, message", [
    ((2, 6, 3, [1, 1, 0]), "must sum to num_accepted=3"),
    ((2, 2, 3, [2, 1]), "cannot exceed num_draft_tokens"),
    ((-1, 0, 0, []), "num_drafts must be >= 0"),
])
def test_inconsistent_counters_are_rejected(args, message):
    with pytest.raises(ValueError, match=message):
        spec_decode_metrics(*args)
