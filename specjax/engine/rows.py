"""Per-row request settings for the loop (`RowParams`) from `SamplingParams`: the one way the runner, the
functional core, feature recording and the benchmarks build them."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from specjax.engine.shapes import bucket
from specjax.engine.state import Penalties, RowParams
from specjax.sampling_params import SamplingParams, to_row_arrays


def stop_token_ids(params: SamplingParams, eos_token_ids: Sequence[int]) -> list[int]:
    """The ids that end a request: the model's EOS ids (unless ignore_eos) and its stop_token_ids."""
    eos = [] if params.ignore_eos else list(eos_token_ids)
    return sorted(set(eos) | set(params.stop_token_ids or []))


def row_params(params: Sequence[SamplingParams], *, vocab_size: int, max_tokens: Sequence[int],
               eos_token_ids: Sequence[int], seeds: Sequence[int] | None = None) -> RowParams:
    """RowParams (numpy, one entry per row) for rows with these sampling settings and new-token budgets.
    seeds: each row's uint32 seed; None takes the requests' own seeds (rows without one get one from their
    row index). Stop ids are padded with -1 to a power of two, so few distinct shapes are compiled. Penalties
    are carried only when some row has one (the loop counts tokens only then)."""
    arrays = to_row_arrays(params, vocab_size)
    stops = [stop_token_ids(p, eos_token_ids) for p in params]
    stop_ids = np.full((len(params), bucket(max((len(s) for s in stops), default=1))), -1, np.int32)
    for row, ids in enumerate(stops):
        stop_ids[row, :len(ids)] = ids
    return RowParams(
        temperature=arrays.temperature, top_k=arrays.top_k, top_p=arrays.top_p, min_p=arrays.min_p,
        seed=arrays.seed if seeds is None else np.asarray(seeds, np.uint32),
        max_tokens=np.asarray(max_tokens, np.int32),
        min_tokens=np.asarray([p.min_tokens for p in params], np.int32), stop_ids=stop_ids,
        penalties=penalties(params))


def penalties(params: Sequence[SamplingParams]) -> Penalties | None:
    """The rows' penalties as f32 [B] arrays, or None when every row leaves them neutral."""
    if not any(p.has_penalties for p in params):
        return None
    return Penalties(*(np.asarray([getattr(p, name) for p in params], np.float32)
                       for name in ("presence_penalty", "frequency_penalty", "repetition_penalty")))


def greedy_rows(batch: int, max_tokens: Sequence[int], eos_token_ids: Sequence[int]) -> RowParams:
    """`batch` greedy rows with the given budgets (0: a padding row that generates nothing)."""
    return row_params([SamplingParams(temperature=0.0)] * batch, vocab_size=1 << 30, max_tokens=max_tokens,
                      eos_token_ids=eos_token_ids)
