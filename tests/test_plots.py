"""specjax.plots: the bars, bins and points each figure draws come from the data given (numbers or
RequestOutputs), saving writes the file, and a missing matplotlib names the extra to install."""
from __future__ import annotations

import sys

import pytest

from specjax import plots
from specjax.outputs import CompletionOutput, RequestOutput


def request(drafts: int, accepted_per_pos: list[int], completions: int = 1) -> RequestOutput:
    outputs = [CompletionOutput(index=i, text="", token_ids=[], num_drafts=drafts,
                                num_draft_tokens=drafts * len(accepted_per_pos),
                                num_accepted_tokens=sum(accepted_per_pos),
                                num_accepted_tokens_per_pos=list(accepted_per_pos)) for i in range(completions)]
    return RequestOutput(request_id="0", prompt=None, prompt_token_ids=[1], outputs=outputs)


def bar_heights(figure) -> list[float]:
    return [patch.get_height() for patch in figure.axes[0].patches]


def test_acceptance_per_position_draws_one_bar_per_position_and_series():
    figure = plots.acceptance_per_position({"ngram": [0.9, 0.5, 0.25], "eagle3": [0.8, 0.6, 0.4]})
    assert bar_heights(figure) == pytest.approx([0.9, 0.5, 0.25, 0.8, 0.6, 0.4])
    assert [t.get_text() for t in figure.axes[0].get_xticklabels()] == ["1", "2", "3"]
    assert [t.get_text() for t in figure.axes[0].get_legend().get_texts()] == ["ngram", "eagle3"]


def test_acceptance_per_position_sums_the_counters_of_request_outputs():
    # 10 + 30 drafts; position 1 accepted 8 + 12 times, position 2 4 + 6 times.
    figure = plots.acceptance_per_position([request(10, [8, 4]), request(30, [12, 6])])
    assert bar_heights(figure) == pytest.approx([20 / 40, 10 / 40])
    assert figure.axes[0].get_legend() is None


def test_acceptance_length_histogram_counts_every_completion():
    outputs = [request(10, [5, 5]), request(4, [4, 4], completions=2), request(0, [0, 0])]
    figure = plots.acceptance_length_histogram(outputs, bins=3)
    assert sum(bar_heights(figure)) == 4   # one value per completion: 2.0, 3.0, 3.0 and 1.0 (no drafts)
    assert bar_heights(figure) == [1, 1, 2]


def test_speedup_draws_a_line_per_batch_size_with_a_point_per_k():
    rows = [{"k": k, "batch_size": b, "speedup": s}
            for b, speedups in ((8, (1.0, 0.9, 0.7)), (1, (1.0, 1.5, 1.8))) for k, s in zip((4, 0, 2), speedups)]
    ax = plots.speedup(rows).axes[0]
    assert list(ax.get_xticks()) == [0, 2, 4]
    lines = ax.get_lines()
    curves = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in lines
              if line.get_label().startswith("batch")}   # not the y=1 reference line
    assert curves == {"batch 1": ([0, 2, 4], [1.5, 1.8, 1.0]), "batch 8": ([0, 2, 4], [0.9, 0.7, 1.0])}


def test_a_path_saves_the_figure(tmp_path):
    path = tmp_path / "per_position.png"
    plots.acceptance_per_position([0.5, 0.25], path=path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_matplotlib_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)   # makes the import fail
    with pytest.raises(ImportError, match=r"specjax\[plots\]"):
        plots.speedup([])
