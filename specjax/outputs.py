"""What `LLM.generate` and `LLM.get_metrics` return, with vLLM's names and definitions.

`CompletionOutput` / `RequestOutput` carry vLLM's fields plus per-request speculative
decoding counters. `get_metrics()` returns a list of `Counter` / `Vector` / `Gauge` records
shaped like vLLM's `vllm.v1.metrics.reader`, under vLLM's metric names.

Definitions (vLLM's): a *draft* is one propose/verify step of one request that proposed
at least one token; per draft, the accepted count is the length of the accepted prefix.
  mean acceptance length  = 1 + accepted tokens / drafts   (1.0 when there were no drafts;
                            the 1 is the token the target emits every step)
  acceptance rate         = accepted tokens / draft tokens (nan when nothing was drafted)
  per-position rate i     = drafts whose first i+1 tokens were accepted / drafts
                            (0.0 when there were no drafts)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

NUM_DRAFTS = "vllm:spec_decode_num_drafts"
NUM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
NUM_ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens"
NUM_ACCEPTED_TOKENS_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
# Adaptive speculation's record (specjax's own): loop iterations run at each k = 0, 1, ..., and the running rows
# and compiled slots summed over iterations (their ratio is the slots' occupancy).
ITERATIONS_PER_K = "specjax:spec_decode_iterations_per_k"
LIVE_ROW_ITERATIONS = "specjax:spec_decode_live_row_iterations"
SLOT_ITERATIONS = "specjax:spec_decode_slot_iterations"
SHADOW_ITERATIONS = "specjax:spec_decode_shadow_iterations"


def mean_acceptance_length(num_drafts: int, num_accepted_tokens: int) -> float:
    """Tokens emitted per target step: 1 + accepted / drafts (1.0 without drafts), as vLLM."""
    return 1.0 + num_accepted_tokens / num_drafts if num_drafts > 0 else 1.0


def acceptance_rate(num_accepted_tokens: int, num_draft_tokens: int) -> float:
    """Fraction of drafted tokens that were accepted (nan when nothing was drafted, as vLLM logs)."""
    return num_accepted_tokens / num_draft_tokens if num_draft_tokens > 0 else float("nan")


def acceptance_rate_per_pos(num_accepted_tokens_per_pos: Sequence[int], num_drafts: int) -> list[float]:
    """For each draft position i, the fraction of drafts that got position i accepted."""
    if num_drafts <= 0:
        return [0.0] * len(num_accepted_tokens_per_pos)
    return [count / num_drafts for count in num_accepted_tokens_per_pos]


@dataclasses.dataclass
class Logprob:
    """vLLM's per-token log-probability record: the value and the token's rank in the vocabulary."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    """One generated sequence of a request (vLLM's fields plus speculative counters).

    finish_reason: "stop" (EOS, a stop token id or a stop string), "length" (max_tokens or
    max_model_len), or None while unfinished. stop_reason: the stop token id (int) or stop
    string (str) that ended it; None for EOS, length, or unfinished.
    logprobs: when requested, one {token_id: Logprob} dict per generated token: the token's own (with its
    rank in the vocabulary) and the top `logprobs` ones (ranks 1..n), so n or n + 1 entries, as vLLM.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = dataclasses.field(default_factory=list)

    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def mean_acceptance_length(self) -> float:
        return mean_acceptance_length(self.num_drafts, self.num_accepted_tokens)

    @property
    def acceptance_rate(self) -> float:
        return acceptance_rate(self.num_accepted_tokens, self.num_draft_tokens)

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        return acceptance_rate_per_pos(self.num_accepted_tokens_per_pos, self.num_drafts)


@dataclasses.dataclass
class RequestMetrics:
    """vLLM's request timing (`vllm.sequence.RequestMetrics`), in seconds since the epoch (time.time()), as the
    wave runner can measure it: a wave's tokens come back together when its one jitted call returns, so the
    host first sees any token of a request when its whole wave is done. Under continuous admission every request
    of a generate() call is in the call's one "wave": they share its times.

    arrival_time: when generate() / chat() received the request. first_scheduled_time: when the first wave
    running one of its n samples started. first_token_time: when that wave returned. last_token_time and
    finished_time: when the last wave running one of its samples returned. time_in_queue: first_scheduled_time
    - arrival_time (the checks, tokenization and earlier waves before it). model_execute_time: the summed wall
    time of its waves (padding, the jitted prefill and decode loop, compilation on a first call, reading back).
    Streamed requests are timed the same way, by their waves (their first tokens come before first_token_time;
    a wave's time then includes the caller's between updates).
    """

    arrival_time: float
    last_token_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    time_in_queue: float | None
    finished_time: float | None = None
    model_execute_time: float | None = None


@dataclasses.dataclass(kw_only=True)
class RequestOutput:
    """The result of one prompt: its n completions (vLLM's fields). prompt_logprobs: when the request asked
    for them, one entry per prompt token, None for the first (nothing precedes it), then {token_id: Logprob}
    holding the prompt token's own and the top prompt_logprobs ones."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    outputs: list[CompletionOutput]
    finished: bool = True
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    metrics: RequestMetrics | None = None


@dataclasses.dataclass
class Metric:
    """A named metric with key=value labels (vLLM's `vllm.v1.metrics.reader.Metric`)."""

    name: str
    labels: dict[str, str]


@dataclasses.dataclass
class Counter(Metric):
    """A monotonically increasing integer count."""

    value: int


@dataclasses.dataclass
class Vector(Metric):
    """An ordered array of integer counts (vLLM uses it for accepted tokens per position)."""

    values: list[int]


@dataclasses.dataclass
class Gauge(Metric):
    """A value that can go up or down."""

    value: float


def spec_decode_metrics(num_drafts: int, num_draft_tokens: int, num_accepted: int,
                        accepted_per_pos: Sequence[int], *,
                        labels: Mapping[str, str] | None = None) -> list[Metric]:
    """The four speculative-decoding metrics `llm.get_metrics()` reports, under vLLM's names.

    accepted_per_pos[i] counts drafts whose first i+1 tokens were accepted, so it sums to
    num_accepted; a mismatch means the engine's counters are inconsistent.
    """
    counts = {"num_drafts": num_drafts, "num_draft_tokens": num_draft_tokens, "num_accepted": num_accepted}
    for name, value in counts.items():
        if int(value) < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    per_pos = [int(v) for v in accepted_per_pos]
    if sum(per_pos) != int(num_accepted):
        raise ValueError(f"accepted_per_pos {per_pos} must sum to num_accepted={num_accepted}")
    if int(num_accepted) > int(num_draft_tokens):
        raise ValueError(f"num_accepted={num_accepted} cannot exceed num_draft_tokens={num_draft_tokens}")
    base = dict(labels or {})
    return [
        Counter(name=NUM_DRAFTS, labels=dict(base), value=int(num_drafts)),
        Counter(name=NUM_DRAFT_TOKENS, labels=dict(base), value=int(num_draft_tokens)),
        Counter(name=NUM_ACCEPTED_TOKENS, labels=dict(base), value=int(num_accepted)),
        Vector(name=NUM_ACCEPTED_TOKENS_PER_POS, labels=dict(base), values=per_pos),
    ]


def adaptive_metrics(iterations_per_k: Sequence[int], live_row_iterations: int, slot_iterations: int,
                     shadow_iterations: int) -> list[Metric]:
    """What an adaptive loop adds to get_metrics: how often each k ran, how full the slots were, and how many
    iterations drafted one token more than their k to measure the next position (engine/adaptive.py)."""
    return [Vector(name=ITERATIONS_PER_K, labels={}, values=[int(v) for v in iterations_per_k]),
            Counter(name=LIVE_ROW_ITERATIONS, labels={}, value=int(live_row_iterations)),
            Counter(name=SLOT_ITERATIONS, labels={}, value=int(slot_iterations)),
            Counter(name=SHADOW_ITERATIONS, labels={}, value=int(shadow_iterations))]


@dataclasses.dataclass
class StreamOutput:
    """One update of `LLM.generate_stream` / `chat_stream`: what one completion added since its last update.

    request_id: the prompt's, as generate's RequestOutput numbers it (its index in the prompts given).
    index: which of the prompt's n completions. token_ids, text: the new token ids and text (either may be empty:
    text waits for a whole character, and for a stop string it could still become). finished: the completion is
    complete (it gets no more tokens). output: on the prompt's last update only (no new tokens then), the
    RequestOutput generate returns for it.
    """

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    finished: bool
    output: RequestOutput | None = None
