"""LLM.generate_stream / chat_stream: the streamed tokens and text are generate's (plain and ngram, greedy and
seeded sampling with n=2, stop strings, stop ids, max_tokens, several waves), chunk sizes share one executable,
bad input fails before any work, and streamed text never splits a character nor shows what a stop string will
cut. On a tiny random Llama with the default model's tokenizer: its random tokens are often pieces of
multi-byte characters."""
from __future__ import annotations

import pytest
import transformers

from specjax import LLM, SamplingParams
from specjax.engine.stop_strings import apply_stop_strings
from specjax.engine.stream_text import TextStream

PROMPTS = ["The capital of France is", "One two three", "def f(n):", "Paris is", "Hello there"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
NEVER = 48999   # a stop id on every row, so that every wave's stop ids have one shape


@pytest.fixture(scope="module", params=[None, NGRAM], ids=["plain", "ngram"])
def llm(request, tiny_chat_model):
    # max_num_seqs=2: the six requests run in three waves, each with a sampled row (one compiled loop).
    return LLM(str(tiny_chat_model), max_model_len=128, max_num_seqs=2, speculative_config=request.param)


@pytest.fixture(scope="module")
def params(llm) -> list[SamplingParams]:
    """Per prompt: greedy; seeded sampling with n=2; a stop string; a stop id; a stop string kept in the
    output (the strings and the id taken from what the prompts generate without them)."""
    def settings(**extra):
        return [SamplingParams(**{"temperature": 0.0, "max_tokens": 10, "stop_token_ids": [NEVER], **more})
                for more in extra.get("each", [{}] * len(PROMPTS))]

    sampled = [{}, {"temperature": 1.0, "top_p": 0.9, "seed": 5, "n": 2}, {}, {"temperature": 1.0, "seed": 9}, {}]
    base = [o.outputs[0] for o in llm.generate(PROMPTS, settings(each=sampled), use_tqdm=False)]
    text = base[2].text
    stops = [{}, {}, {"stop": [text[len(text) // 2:][:2], "zz"]}, {"stop_token_ids": [base[3].token_ids[4]]},
             {"stop": [base[4].text[-3:]], "include_stop_str_in_output": True}]
    return settings(each=[{**a, **b} for a, b in zip(sampled, stops)])


def collect(llm, prompts, params, interval: int = 2):
    """generate_stream's updates per completion {(request_id, index): [StreamOutput]}, and the RequestOutputs
    its last updates carry, in prompt order."""
    updates, outputs = {}, {}
    for update in llm.generate_stream(prompts, params, stream_interval=interval):
        if update.output is None:
            updates.setdefault((update.request_id, update.index), []).append(update)
        else:
            assert update.finished and not update.token_ids and not update.text
            outputs[update.request_id] = update.output
    return updates, [outputs[str(i)] for i in range(len(prompts))]


def test_streamed_tokens_and_text_are_generates(llm, params):
    expected = llm.generate(PROMPTS, params, use_tqdm=False)
    updates, outputs = collect(llm, PROMPTS, params)
    assert len(updates) == 6 and max(len(pieces) for pieces in updates.values()) > 2   # several chunks
    for want, got in zip(expected, outputs):
        assert (got.request_id, got.prompt_token_ids, got.outputs) == (want.request_id, want.prompt_token_ids,
                                                                       want.outputs)
        for completion in want.outputs:
            pieces = updates[want.request_id, completion.index]
            assert sum((u.token_ids for u in pieces), []) == completion.token_ids
            assert "".join(u.text for u in pieces) == completion.text
            assert [u.finished for u in pieces] == [False] * (len(pieces) - 1) + [True]
    reasons = [o.outputs[0].stop_reason for o in expected]
    assert isinstance(reasons[2], str) and isinstance(reasons[3], int) and isinstance(reasons[4], str)


def test_chunk_sizes_share_one_executable(llm, params):
    base, _ = collect(llm, PROMPTS, params, 1)
    prefill, advance = llm._runner.stream_fns(0, False)   # (n_top, all rows greedy)
    sizes = prefill._cache_size(), advance._cache_size()
    for interval in (3, 64):
        updates, _ = collect(llm, PROMPTS, params, interval)
        assert {key: sum((u.token_ids for u in pieces), []) for key, pieces in updates.items()} == \
            {key: sum((u.token_ids for u in pieces), []) for key, pieces in base.items()}
    assert (prefill._cache_size(), advance._cache_size()) == sizes == (1, 1)


def test_bad_input_fails_before_any_work(llm):
    compiled = dict(llm._runner._compiled), dict(llm._runner._streamed)
    with pytest.raises(ValueError, match="prompts is empty"):
        llm.generate_stream([])
    with pytest.raises(ValueError, match="stream_interval"):
        llm.generate_stream(PROMPTS, stream_interval=0)
    with pytest.raises(ValueError, match="outside"):
        llm.generate_stream([{"prompt_token_ids": [10 ** 6]}])
    with pytest.raises(TypeError, match="sampling_params"):
        llm.chat_stream([{"role": "user", "content": "Hi"}], {"temperature": 0})
    with pytest.raises(TypeError, match="conversation"):
        llm.chat_stream("Hi")
    assert (llm._runner._compiled, llm._runner._streamed) == compiled


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return transformers.AutoTokenizer.from_pretrained(default_model_dir)


@pytest.mark.parametrize("stop, include", [([], False), (["日本", "🙂 w"], False), (["日本"], True)])
def test_streamed_text_never_splits_a_character_nor_shows_a_cut(tokenizer, stop, include):
    """Token by token through multi-byte characters (byte-level pieces): every delta is whole characters, what
    was shown is always a prefix of the final text, and the deltas add up to it."""
    ids = tokenizer.encode("naïve café 🙂 wörld, 日本語のテキスト", add_special_tokens=False)

    def finish(token_ids, done):
        return apply_stop_strings(token_ids, tokenizer, stop, include_stop_str_in_output=include,
                                  finish_reason="length" if done else None)

    final = finish(ids, True)
    stream = TextStream(finish, stop, include)
    for n in range(1, len(ids) + 1):
        delta = stream.update(ids[:n], n == len(ids))
        assert "\ufffd" not in delta.text and final.text.startswith(stream.text)
        if stream.finished:
            break
    assert (stream.text, stream.token_ids) == (final.text, final.token_ids)
    assert stream.finished and (n < len(ids)) == bool(stop)
