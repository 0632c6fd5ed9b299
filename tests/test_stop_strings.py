"""Stop strings, stop-token text and finish reasons, on real (in-test, offline) HF tokenizers."""
from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from specjax.engine.stop_strings import FinishedRow, apply_stop_strings, token_finish_reason

CORPUS = ["hello world, the quick brown fox jumps over the lazy dog.",
          "Hello there world wide web; héllo wörld 😀 emoji text.",
          "the end. The END! stop here, stop there"] * 10


@pytest.fixture(scope="module")
def byte_tok() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer with no merges: one token per UTF-8 byte, so positions are exact."""
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<eos>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


@pytest.fixture(scope="module")
def bpe_tok() -> PreTrainedTokenizerFast:
    """Byte-level BPE with merges (GPT-2 / Llama-3 style): tokens span several characters."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


@pytest.fixture(scope="module")
def spm_tok() -> PreTrainedTokenizerFast:
    """SentencePiece-style (Metaspace) BPE: a word's leading space lives in its token."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<eos>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")


def enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def test_stop_string_spanning_tokens_cuts_text_before_and_ids_after_completing_token(byte_tok):
    ids = enc(byte_tok, "hello world")
    out = apply_stop_strings(ids, byte_tok, ["o w"], finish_reason="length")
    # "o w" is completed by the 7th byte-token ("w").
    assert out == FinishedRow("hell", ids[:7], "stop", "o w")


def test_include_stop_str_in_output_keeps_the_stop_string(byte_tok):
    ids = enc(byte_tok, "hello world")
    out = apply_stop_strings(ids, byte_tok, ["o w"], include_stop_str_in_output=True, finish_reason="length")
    assert out == FinishedRow("hello w", ids[:7], "stop", "o w")


def test_include_drops_text_after_the_stop_string_within_the_same_token(bpe_tok):
    ids = enc(bpe_tok, "hello world, the quick")
    out = apply_stop_strings(ids, bpe_tok, ["wor"], include_stop_str_in_output=True)
    completing = next(n for n in range(1, len(ids) + 1) if "wor" in bpe_tok.decode(ids[:n]))
    assert bpe_tok.decode(ids[:completing]).endswith("world")  # the stop ends inside a longer token
    assert out == FinishedRow("hello wor", ids[:completing], "stop", "wor")


def test_earliest_completed_stop_string_wins(byte_tok):
    ids = enc(byte_tok, "hello world")
    out = apply_stop_strings(ids, byte_tok, ["world", "lo"])
    assert out == FinishedRow("hel", ids[:5], "stop", "lo")


def test_matches_ending_at_the_same_character_go_by_list_order(byte_tok):
    ids = enc(byte_tok, "zxab!")
    assert apply_stop_strings(ids, byte_tok, ["xab", "ab"]) == FinishedRow("z", ids[:4], "stop", "xab")
    assert apply_stop_strings(ids, byte_tok, ["ab", "xab"]) == FinishedRow("zx", ids[:4], "stop", "ab")


def test_no_match_passes_the_device_result_through(byte_tok):
    ids = enc(byte_tok, "hello world")
    out = apply_stop_strings(ids, byte_tok, ["xyz"], finish_reason="length", stop_reason=None)
    assert out == FinishedRow("hello world", ids, "length", None)
    assert apply_stop_strings(ids, byte_tok, [], finish_reason="length") == out


def test_stop_string_found_in_multi_byte_characters(byte_tok):
    ids = enc(byte_tok, "x😀y")
    out = apply_stop_strings(ids, byte_tok, ["😀"])
    # The emoji is four byte-tokens; the fourth completes it.
    assert out == FinishedRow("x", ids[:5], "stop", "😀")


def test_incomplete_trailing_character_is_held_back(byte_tok):
    ids = enc(byte_tok, "ab😀")[:-1]  # cut inside the emoji's bytes
    out = apply_stop_strings(ids, byte_tok, [], finish_reason="length")
    assert out == FinishedRow("ab", ids, "length", None)


def test_min_tokens_ignores_matches_ending_in_the_first_tokens(byte_tok):
    ids = enc(byte_tok, "hello")
    assert apply_stop_strings(ids, byte_tok, ["l"]) == FinishedRow("he", ids[:3], "stop", "l")
    # The first "l" ends within the first 3 tokens; the second one counts.
    assert apply_stop_strings(ids, byte_tok, ["l"], min_tokens=3) == FinishedRow("hel", ids[:4], "stop", "l")
    # A match may straddle the min_tokens boundary as long as it ends after it.
    assert apply_stop_strings(ids, byte_tok, ["ll"], min_tokens=3) == FinishedRow("he", ids[:4], "stop", "ll")


def test_stop_token_text_is_left_out_unless_include(byte_tok):
    ids = enc(byte_tok, "hi.")
    dot = ids[-1]
    assert apply_stop_strings(ids, byte_tok, finish_reason="stop", stop_reason=dot) == FinishedRow(
        "hi", ids, "stop", dot)
    assert apply_stop_strings(ids, byte_tok, include_stop_str_in_output=True, finish_reason="stop",
                              stop_reason=dot) == FinishedRow("hi.", ids, "stop", dot)


def test_stop_string_is_not_searched_in_an_excluded_stop_token(byte_tok):
    ids = enc(byte_tok, "hi.")
    out = apply_stop_strings(ids, byte_tok, ["."], finish_reason="stop", stop_reason=ids[-1])
    assert out == FinishedRow("hi", ids, "stop", ids[-1])
    # With include, the token's text is there and the stop string takes over the reason.
    out = apply_stop_strings(ids, byte_tok, ["."], include_stop_str_in_output=True, finish_reason="stop",
                             stop_reason=ids[-1])
    assert out == FinishedRow("hi.", ids, "stop", ".")


def test_special_eos_text_follows_skip_special_tokens(byte_tok):
    ids = enc(byte_tok, "ok") + [byte_tok.eos_token_id]
    kept = apply_stop_strings(ids, byte_tok, include_stop_str_in_output=True, skip_special_tokens=False,
                              finish_reason="stop")
    assert kept.text == "ok<eos>"
    skipped = apply_stop_strings(ids, byte_tok, include_stop_str_in_output=True, finish_reason="stop")
    assert skipped.text == "ok"
    assert skipped.token_ids == ids


def test_prompt_context_keeps_sentencepiece_leading_space(spm_tok):
    prompt = enc(spm_tok, "Hello")
    full = enc(spm_tok, "Hello world")
    generated = full[len(prompt):]
    assert spm_tok.convert_ids_to_tokens(generated) == ["▁world"]
    assert apply_stop_strings(generated, spm_tok).text == "world"  # decoded alone the space is lost
    with_context = apply_stop_strings(generated, spm_tok, prompt_token_ids=prompt)
    assert with_context.text == " world"
    out = apply_stop_strings(generated, spm_tok, [" w"], prompt_token_ids=prompt)
    assert out == FinishedRow("", generated[:1], "stop", " w")


def _reference(ids, tok, stop, include, min_tokens):
    """vLLM's loop, one token at a time: emitted text, held back while it ends mid-character."""
    emitted = ""
    for n in range(1, len(ids) + 1):
        raw = tok.decode(ids[:n], clean_up_tokenization_spaces=False)
        if raw.endswith("\ufffd"):
            continue
        previous, emitted = emitted, raw
        if n <= min_tokens:
            continue
        matches = []
        for order, s in enumerate(stop):
            # Only a match ending in this token's new text is new.
            start = emitted.find(s, max(0, len(previous) - len(s) + 1))
            if start != -1:
                matches.append((start + len(s), order, start, s))
        if matches:
            end, _, start, s = min(matches)
            return (emitted[:end] if include else emitted[:start]), ids[:n], "stop", s
    return emitted, ids, "length", None


def test_random_rows_match_a_token_by_token_reference(bpe_tok):
    rng = random.Random(0)
    vocab = [i for i in range(len(bpe_tok)) if i != bpe_tok.eos_token_id]
    for _ in range(150):
        ids = [rng.choice(vocab) for _ in range(rng.randint(1, 25))]
        text = bpe_tok.decode(ids, clean_up_tokenization_spaces=False).replace("\ufffd", "")
        stop = []
        for _ in range(rng.randint(0, 3)):
            if len(text) >= 2:
                a = rng.randrange(len(text) - 1)
                stop.append(text[a:a + rng.randint(1, 4)])
        stop = [s for s in stop if s] + ([rng.choice(["zzz", "e", " "])] if rng.random() < 0.3 else [])
        include = rng.random() < 0.5
        min_tokens = rng.choice([0, 0, 2, 5])
        expected = _reference(ids, bpe_tok, stop, include, min_tokens)
        got = apply_stop_strings(ids, bpe_tok, stop, include_stop_str_in_output=include, min_tokens=min_tokens,
                                 finish_reason="length")
        assert tuple(got) == expected, (ids, stop, include, min_tokens)


def test_token_finish_reason_follows_vllm_check_order():
    assert token_finish_reason([5, 2], eos_token_id=2, stop_token_ids=[2, 7], ignore_eos=False) == ("stop", None)
    assert token_finish_reason([5, 7], eos_token_id=2, stop_token_ids=[7], ignore_eos=False) == ("stop", 7)
    assert token_finish_reason([5, 2], eos_token_id=2, stop_token_ids=[], ignore_eos=True) == ("length", None)
    assert token_finish_reason([5, 6], eos_token_id=2, stop_token_ids=[7], ignore_eos=False) == ("length", None)
    assert token_finish_reason([], eos_token_id=2, stop_token_ids=[7], ignore_eos=False) == ("length", None)
