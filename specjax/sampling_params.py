"""vLLM's `SamplingParams`: per-request sampling settings, validated when built.

Field names, defaults and validation follow vLLM's `SamplingParams`, so a vLLM script runs
unchanged. `to_row_arrays` turns a batch of them into the per-row numpy arrays the jitted
sampler takes (one entry per row, see `specjax/engine/sampling.py`).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

# vLLM treats temperatures below this as greedy (argmax) decoding.
GREEDY_TEMPERATURE_EPS = 1e-5
# vLLM raises tiny positive temperatures to this, since 1/temperature overflows logits.
MIN_RANDOM_TEMPERATURE = 1e-2

# vLLM's bound on presence and frequency penalties (OpenAI's range).
MAX_ABS_PENALTY = 2.0


@dataclasses.dataclass
class SamplingParams:
    """Sampling parameters for one request (vLLM's names, defaults and checks).

    presence_penalty / frequency_penalty: in [-2, 2], subtracted from a token's logit once if it was
    generated / once per time it was (OpenAI's definitions; 0 = off); repetition_penalty: > 0, divides the
    positive logits and multiplies the others of tokens in the prompt or generated (1 = off); all three as
    vLLM applies them, before temperature, so they steer greedy decoding too.
    temperature: 0 means greedy; top_k: 0 or -1 means off (-1 is stored as 0);
    top_p: 1 means off; min_p: 0 means off; max_tokens: None means "until max_model_len";
    min_tokens: EOS and stop_token_ids cannot end the request before this many tokens;
    logprobs: None, or the number of top log-probabilities per token (-1: whole vocabulary; 0: only the
    generated token's, with its rank); prompt_logprobs: the same for each prompt token;
    stop: string(s) that end the request, trimmed from the text unless
    include_stop_str_in_output; seed: per-request seed (-1 is stored as None).
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        self._normalise()
        self._validate()
        if self.is_greedy:
            # Greedy ignores the filters; clearing them keeps the device arrays canonical.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
            if self.n > 1:
                raise ValueError(f"n must be 1 when using greedy sampling (temperature=0), got {self.n}; "
                                 "set temperature > 0 to draw several samples")

    @property
    def is_greedy(self) -> bool:
        """True when this request decodes by argmax (vLLM: temperature below 1e-5)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def has_penalties(self) -> bool:
        """True when a presence, frequency or repetition penalty is set (not at its neutral value)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def _normalise(self) -> None:
        """vLLM's spellings: -1 for "off"/"none", a lone stop string, True for one logprob."""
        if self.seed == -1:
            self.seed = None
        if self.top_k == -1:
            self.top_k = 0
        if self.logprobs is True:
            self.logprobs = 1
        if self.prompt_logprobs is True:
            self.prompt_logprobs = 1
        self.stop = _as_list(self.stop, "stop", "a string or a list of strings")
        # Order-preserving de-duplication, as vLLM does.
        self.stop_token_ids = list(dict.fromkeys(_as_list(self.stop_token_ids, "stop_token_ids",
                                                          "a list of token ids")))
        if _is_real(self.temperature):
            self.temperature = float(self.temperature)
        if _is_real(self.temperature) and 0 < self.temperature < MIN_RANDOM_TEMPERATURE:
            warnings.warn(f"temperature {self.temperature} is below {MIN_RANDOM_TEMPERATURE}, which may give "
                          f"inf/nan logits; raised to {MIN_RANDOM_TEMPERATURE} (as vLLM does)", stacklevel=4)
            self.temperature = MIN_RANDOM_TEMPERATURE

    def _validate(self) -> None:
        _check_int(self.n, "n", minimum=1)
        self._validate_penalties()
        _check_real(self.temperature, "temperature")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        _check_real(self.top_p, "top_p")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        _check_int(self.top_k, "top_k")
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 or -1 (off) or at least 1, got {self.top_k}")
        _check_real(self.min_p, "min_p")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        if self.seed is not None:
            _check_int(self.seed, "seed")
        self._validate_lengths()
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(value, name)
                if value < -1:
                    raise ValueError(f"{name} must be None, -1 (whole vocabulary) or >= 0, got {value}")
        self._validate_stops()
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")

    def _validate_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
            _check_real(getattr(self, name), name)
            setattr(self, name, float(getattr(self, name)))
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_ABS_PENALTY <= getattr(self, name) <= MAX_ABS_PENALTY:
                raise ValueError(f"{name} must be in [-2, 2] (0 = off), got {getattr(self, name)}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")

    def _validate_lengths(self) -> None:
        if self.max_tokens is not None:
            _check_int(self.max_tokens, "max_tokens", minimum=1)
        _check_int(self.min_tokens, "min_tokens", minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")

    def _validate_stops(self) -> None:
        for s in self.stop:
            if not isinstance(s, str):
                raise TypeError(f"stop must be a string or a list of strings, got an entry {s!r}")
            if not s:
                raise ValueError("stop cannot contain an empty string; remove it")
        for token_id in self.stop_token_ids:
            if isinstance(token_id, bool) or not isinstance(token_id, (int, np.integer)) or token_id < 0:
                raise ValueError(f"stop_token_ids must contain only non-negative integer token ids, "
                                 f"got {self.stop_token_ids}")
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]


def _check_int(value: object, name: str, minimum: int | None = None) -> None:
    """Raise unless `value` is an int (bools are rejected) and at least `minimum`."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _is_real(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float, np.integer, np.floating))


def _check_real(value: object, name: str) -> None:
    """Raise unless `value` is a finite real number (bools are rejected)."""
    if not _is_real(value):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")


def _as_list(value: object, name: str, expected: str) -> list:
    """None -> [], a lone string -> [it], a list or tuple -> a list copy."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be {expected}, got {value!r}")
    return list(value)


def child_params(params: SamplingParams) -> list[SamplingParams]:
    """The n single-sample requests one request with n samples becomes (vLLM's parallel sampling).

    Sample i gets n=1 and, when the request is seeded, seed + i, so samples differ but the
    request as a whole stays reproducible.
    """
    return [dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + i)
            for i in range(params.n)]


class RowArrays(NamedTuple):
    """Per-row sampling parameters in the dtypes the jitted sampler takes, each shaped [B]."""

    temperature: np.ndarray  # f32, 0 for greedy rows
    top_k: np.ndarray  # i32, 0 = off
    top_p: np.ndarray  # f32, 1 = off
    min_p: np.ndarray  # f32, 0 = off
    seed: np.ndarray  # u32, the row's PRNG seed


def to_row_arrays(params_list: Sequence[SamplingParams], vocab_size: int, *, base_seed: int = 0) -> RowArrays:
    """Stack one SamplingParams per row into the sampler's [B] arrays.

    Greedy rows get temperature 0; top_k >= vocab_size means keep everything, so it becomes 0
    (off). A row without a seed gets one mixed from (base_seed, row index): distinct per row,
    reproducible for a given LLM seed. Seeds are taken modulo 2**32.
    """
    _check_int(vocab_size, "vocab_size", minimum=1)
    _check_int(base_seed, "base_seed")
    temperature = [0.0 if p.is_greedy else p.temperature for p in params_list]
    top_k = [0 if p.top_k >= vocab_size else p.top_k for p in params_list]
    seed = [_row_seed(p.seed, base_seed, row) for row, p in enumerate(params_list)]
    return RowArrays(
        temperature=np.asarray(temperature, np.float32),
        top_k=np.asarray(top_k, np.int32),
        top_p=np.asarray([p.top_p for p in params_list], np.float32),
        min_p=np.asarray([p.min_p for p in params_list], np.float32),
        seed=np.asarray(seed, np.uint32),
    )


def _row_seed(seed: int | None, base_seed: int, row: int) -> int:
    if seed is not None:
        return int(seed) % 2**32
    # SeedSequence hashes (base_seed, row) so unseeded rows do not collide with small user seeds.
    return int(np.random.SeedSequence([base_seed % 2**32, row]).generate_state(1, np.uint32)[0])
