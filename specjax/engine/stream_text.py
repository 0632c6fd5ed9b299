"""What a streamed completion may show while its row is still running: never more than the final output holds.

The final text and tokens (`apply_stop_strings`) are computed from the tokens so far, as if the row ended
there, and shown up to what later tokens cannot take back:
- tokens: all of them until a stop string completes (a token before the completing one is always kept);
- text: held back while it ends mid-character (`apply_stop_strings` already does), and by the longest stop
  string's length - 1 characters, which a stop string completed later would cut (vLLM's stop buffer; none
  with include_stop_str_in_output, whose cut falls after the completed match).
Text is decoded from whole prefixes, so what is shown is a prefix of the final text and the deltas concatenate
to it.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from specjax.engine.stop_strings import FinishedRow


class Delta(NamedTuple):
    token_ids: list[int]
    text: str
    finished: bool


class TextStream:
    """One completion's shown tokens and text. finish(token_ids, done) -> the row's FinishedRow as if it ended
    after token_ids (done: the device loop ended it there, so its stop token applies)."""

    def __init__(self, finish: Callable[[Sequence[int], bool], FinishedRow], stop: Sequence[str],
                 include_stop_str_in_output: bool):
        self._finish = finish
        self._hold = 0 if include_stop_str_in_output or not stop else max(len(s) for s in stop) - 1
        self.token_ids: list[int] = []
        self.text = ""
        self.finished = False

    def update(self, token_ids: Sequence[int], done: bool) -> Delta:
        """What the row's tokens so far add to what was shown; finished once the loop or a stop string ended it."""
        row = self._finish(token_ids, done)
        self.finished = done or row.finish_reason is not None
        shown = row.text if self.finished else row.text[:max(0, len(row.text) - self._hold)]
        delta = Delta(row.token_ids[len(self.token_ids):], shown[len(self.text):], self.finished)
        self.token_ids, self.text = self.token_ids + delta.token_ids, self.text + delta.text
        return delta
