"""Host-side finishing of one generated row: its text, stop strings, and finish reason.

The device loop stops a row on EOS, a stop token id, max_tokens or max_model_len; it cannot
see text. Afterwards `apply_stop_strings` detokenizes the row and applies the stop strings
exactly as vLLM would had the tokens arrived one at a time (so speculative decoding, which
commits several tokens per step, gives the same result as plain decoding):

- a stop string counts once a token completes it; the first such token wins, and within that
  token the match that ends first (ties: the earlier stop string in the list);
- token_ids are cut right after that token; text is cut before the stop string, or after it
  with include_stop_str_in_output;
- a stop string must end after the text of the first min_tokens tokens;
- when a stop *token* ended the row (finish_reason "stop"), its text is left out unless
  include_stop_str_in_output (vLLM v1);
- text that ends in an incomplete UTF-8 character ("\\ufffd") is held back, as vLLM's
  incremental detokenizer does, so a row cut mid-character drops that character's tokens' text.

Text is decoded from whole prefixes (decode(ids[:n])), with the last prompt tokens as left
context so SentencePiece-style leading spaces come out as vLLM's incremental detokenizer
gives them. Tokenization-space cleanup is off, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

# vLLM's incremental detokenizer starts from this many prompt tokens of left context.
PROMPT_CONTEXT_TOKENS = 5
_INCOMPLETE = "\ufffd"  # what a decoder prints for bytes that do not form a whole character yet


class FinishedRow(NamedTuple):
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None


def token_finish_reason(token_ids: Sequence[int], *, eos_token_id: int | None, stop_token_ids: Sequence[int],
                        ignore_eos: bool) -> tuple[str, int | None]:
    """Why the device loop ended a finished row, in vLLM's terms and check order.

    ("stop", None) for EOS (unless ignore_eos), ("stop", token) for a stop token id,
    else ("length", None). vLLM moves a model's extra EOS ids (generation_config) into
    stop_token_ids, so those report their id as stop_reason.
    """
    last = token_ids[-1] if len(token_ids) else None
    if last is not None and not ignore_eos and last == eos_token_id:
        return "stop", None
    if last is not None and last in stop_token_ids:
        return "stop", int(last)
    return "length", None


def apply_stop_strings(token_ids: Sequence[int], tokenizer: Any, stop: Sequence[str] = (), *,
                       include_stop_str_in_output: bool = False, skip_special_tokens: bool = True,
                       finish_reason: str | None = None, stop_reason: int | str | None = None,
                       min_tokens: int = 0, prompt_token_ids: Sequence[int] = ()) -> FinishedRow:
    """The row's final (text, token_ids, finish_reason, stop_reason) (see the module docstring).

    token_ids: the generated tokens as the device left them. finish_reason / stop_reason: what
    the device loop decided (see `token_finish_reason`); a stop string found in the text
    overrides them. prompt_token_ids: the request's prompt, used as decoding context only.
    """
    ids = [int(t) for t in token_ids]
    stop_token_ended = finish_reason == "stop" and bool(ids)
    decodable = ids[:-1] if stop_token_ended and not include_stop_str_in_output else ids
    text_of = _PrefixText(tokenizer, decodable, prompt_token_ids[-PROMPT_CONTEXT_TOKENS:], skip_special_tokens)
    full_text = text_of(len(decodable))
    first = min(min_tokens, len(decodable))
    offset = len(text_of(first)) if first else 0
    if not stop or _earliest_match(full_text, stop, offset) is None:
        return FinishedRow(full_text, ids, finish_reason, stop_reason)
    n = _first_completing_token(text_of, stop, offset, first, len(decodable))
    start, end, stop_str = _earliest_match(text_of(n), stop, offset)
    text = text_of(n)[:end] if include_stop_str_in_output else text_of(n)[:start]
    return FinishedRow(text, ids[:n], "stop", stop_str)


def _earliest_match(text: str, stop: Sequence[str], offset: int) -> tuple[int, int, str] | None:
    """(start, end, stop string) of the match ending first after `offset`; ties -> list order."""
    best = None
    for stop_str in stop:
        # A match may start before `offset` as long as it ends after it.
        start = text.find(stop_str, max(0, offset - len(stop_str) + 1))
        if start != -1 and (best is None or start + len(stop_str) < best[1]):
            best = (start, start + len(stop_str), stop_str)
    return best


def _first_completing_token(text_of: _PrefixText, stop: Sequence[str], offset: int, low: int, high: int) -> int:
    """Smallest n in (low, high] whose text holds a stop match (emitted text only grows)."""
    while high - low > 1:
        mid = (low + high) // 2
        if _earliest_match(text_of(mid), stop, offset) is None:
            low = mid
        else:
            high = mid
    return high


class _PrefixText:
    """text_of(n): the text vLLM would have emitted after the first n generated tokens."""

    def __init__(self, tokenizer: Any, ids: list[int], context: Sequence[int], skip_special_tokens: bool):
        self._tokenizer = tokenizer
        self._ids = ids
        self._skip = skip_special_tokens
        context = [int(t) for t in context]
        context_text = self._decode(context)
        # A context cut mid-character cannot serve as a clean prefix; decode without it then.
        self._context, self._context_text = (context, context_text) if not context_text.endswith(
            _INCOMPLETE) else ([], "")
        self._cache: dict[int, str] = {0: ""}

    def __call__(self, n: int) -> str:
        # Walk back to the last prefix that does not end mid-character (vLLM holds such text back).
        pending = []
        while n not in self._cache:
            raw = self._raw(n)
            if not raw.endswith(_INCOMPLETE):
                self._cache[n] = raw
                break
            pending.append(n)
            n -= 1
        for held in pending:
            self._cache[held] = self._cache[n]
        return self._cache[pending[0] if pending else n]

    def _raw(self, n: int) -> str:
        with_context = self._decode(self._context + self._ids[:n])
        if with_context.startswith(self._context_text):
            return with_context[len(self._context_text):]
        return self._decode(self._ids[:n])

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip, clean_up_tokenization_spaces=False)
