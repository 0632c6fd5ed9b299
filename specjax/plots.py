"""Plots of speculative decoding: acceptance rate per draft position, acceptance length per request, and
speedup over k and batch size. Each function takes plain data (numbers, dicts of them, or the
`RequestOutput` lists `LLM.generate` returns), returns a matplotlib `Figure` and saves it when given a path.

matplotlib is an optional extra: `pip install "specjax[plots]"`.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specjax.outputs import RequestOutput, acceptance_rate_per_pos

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# One series (numbers, or the outputs of one generate call), or several keyed by their legend label.
Series = Sequence[float] | Sequence[RequestOutput]
SeriesOrMany = Series | Mapping[str, Series]


def acceptance_per_position(data: SeriesOrMany, *, title: str = "Acceptance rate per draft position",
                            path: str | Path | None = None) -> Figure:
    """Grouped bars: for each draft position i, the fraction of drafts whose first i+1 tokens were accepted
    (vLLM's per-position rate). `data`: rates, or RequestOutputs (their counters are summed), or a dict of
    either per label."""
    series = {label: _per_position_rates(values) for label, values in _labelled(data).items()}
    figure, ax = _new_figure()
    width = 0.8 / max(len(series), 1)
    for n, (label, rates) in enumerate(series.items()):
        ax.bar([i + n * width for i in range(len(rates))], rates, width, label=label)
    positions = max((len(r) for r in series.values()), default=0)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(positions)], [str(i + 1) for i in range(positions)])
    ax.set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1), title=title)
    _legend_if_named(ax, series)
    return _finish(figure, path)


def acceptance_length_histogram(data: SeriesOrMany, *, bins: int = 20,
                                title: str = "Acceptance length per request",
                                path: str | Path | None = None) -> Figure:
    """Histogram of each completion's mean acceptance length (1 + accepted / drafts). `data`: lengths, or
    RequestOutputs (one value per completion), or a dict of either per label."""
    series = {label: _acceptance_lengths(values) for label, values in _labelled(data).items()}
    figure, ax = _new_figure()
    ax.hist(list(series.values()), bins=bins, label=list(series), alpha=0.8)
    ax.set(xlabel="mean acceptance length (tokens per target step)", ylabel="requests", title=title)
    _legend_if_named(ax, series)
    return _finish(figure, path)


def speedup(results: Sequence[Mapping[str, Any]], *, title: str = "Speedup over plain decoding",
            path: str | Path | None = None) -> Figure:
    """One line per batch size: speedup (plain time / speculative time) against k. `results`: dicts with
    "k", "batch_size" and "speedup" (what `specjax bench` writes)."""
    by_batch: dict[int, list[tuple[int, float]]] = {}
    for row in results:
        by_batch.setdefault(int(row["batch_size"]), []).append((int(row["k"]), float(row["speedup"])))
    figure, ax = _new_figure()
    for batch, points in sorted(by_batch.items()):
        points.sort()
        ax.plot([k for k, _ in points], [s for _, s in points], marker="o", label=f"batch {batch}")
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set_xticks(sorted({k for points in by_batch.values() for k, _ in points}))
    ax.set(xlabel="speculative tokens k (0: plain)", ylabel="speedup", title=title)
    ax.legend()
    return _finish(figure, path)


def _labelled(data: SeriesOrMany) -> dict[str, Series]:
    """A dict as given; a single series under the empty label (no legend)."""
    return dict(data) if isinstance(data, Mapping) else {"": data}


def _completions(outputs: Sequence[RequestOutput]):
    return [c for r in outputs for c in r.outputs]


def _per_position_rates(values: Series) -> list[float]:
    if values and isinstance(values[0], RequestOutput):
        completions = _completions(values)
        per_pos = [sum(column) for column in zip(*(c.num_accepted_tokens_per_pos for c in completions))]
        return acceptance_rate_per_pos(per_pos, sum(c.num_drafts for c in completions))
    return [float(v) for v in values]


def _acceptance_lengths(values: Series) -> list[float]:
    if values and isinstance(values[0], RequestOutput):
        return [c.mean_acceptance_length for c in _completions(values)]
    return [float(v) for v in values]


def _new_figure():
    try:
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError('specjax.plots needs matplotlib: pip install "specjax[plots]"') from err
    # A Figure of its own, not pyplot's: no global state, no GUI backend (works in scripts and notebooks).
    figure = Figure(figsize=(6.4, 4.0), layout="constrained")
    return figure, figure.add_subplot()


def _legend_if_named(ax, series: Mapping[str, Any]) -> None:
    if any(series):
        ax.legend()


def _finish(figure: Figure, path: str | Path | None) -> Figure:
    if path is not None:
        figure.savefig(path, dpi=120)
    return figure
