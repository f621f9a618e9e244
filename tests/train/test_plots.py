"""Pictures: every panel an evaluate result holds is drawn, and a drawing failure never raises."""

import json
import logging

import pytest

from eyas.train.plots import evaluation_figure, write_evaluation_plot, write_run_plots

# the result layout `eyas evaluate` writes (README: context buckets and temperatures)
RESULT = {
    "mode": "speculative", "k": 3, "tau": 2.1,
    "cond_acc_0": 0.7, "cond_acc_1": 0.5, "cond_acc_2": None,
    "by_context": [
        {"bucket": "0-2k", "lo": 0, "hi": 2048, "tau": 2.3, "cond_acc": [0.8, 0.6, 0.4],
         "tokens": 900, "rounds": 400},
        {"bucket": "2k-8k", "lo": 2048, "hi": 8192, "tau": 1.9, "cond_acc": [0.6, 0.4, 0.2],
         "tokens": 300, "rounds": 160},
        {"bucket": "32k+", "lo": 32768, "hi": None, "tau": None, "cond_acc": [None] * 3,
         "tokens": 0, "rounds": 0}],
    "by_temperature": [
        {"temperature": 1.0, "tau": 1.8, "tau_se": 0.05, "offline_tau": 1.82},
        {"temperature": 0.0, "tau": 2.1, "tau_se": 0.03, "offline_tau": 2.09},
        {"temperature": 0.7, "tau": 1.95, "tau_se": 0.04, "offline_tau": None}],
}


def test_every_panel_the_result_holds(tmp_path):
    fig = evaluation_figure(RESULT)
    pos, ctx, temp = fig.axes
    # overall per-position acceptance, then one dashed line per context bucket
    assert [line.get_label() for line in pos.get_lines()] == [
        "all positions in the text", "context 0-2k", "context 2k-8k"]
    assert [t.get_text() for t in ctx.get_xticklabels()] == ["0-2k\n900 tok", "2k-8k\n300 tok",
                                                            "32k+\n0 tok"]
    assert len(ctx.patches) == 3
    errorbar, offline = temp.get_lines()[0], temp.get_lines()[-1]
    assert list(errorbar.get_xdata()) == [0.0, 0.7, 1.0]              # sorted by temperature
    assert list(offline.get_xdata()) == [0.0, 1.0]                    # where an estimate exists
    assert "K=3" in fig.get_suptitle()
    assert write_evaluation_plot(RESULT, tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


def test_only_present_panels_are_drawn(tmp_path, caplog):
    res = {k: v for k, v in RESULT.items() if k not in ("by_context", "by_temperature")}
    assert len(evaluation_figure(res).axes) == 1
    assert len(evaluation_figure({**res, "by_temperature": RESULT["by_temperature"]}).axes) == 2
    with caplog.at_level(logging.WARNING):
        assert write_evaluation_plot({"mode": "offline", "k": 3}, tmp_path / "n.png") is None
    assert "no plot written" in caplog.text and not (tmp_path / "n.png").exists()


def test_a_failed_drawing_is_a_warning_not_an_error(tmp_path, caplog):
    recs = [{"step": 1, "train/loss": 3.0}, {"step": 1, "eval/tau": 1.5, "eval/loss": 3.1,
                                             "eval/tau_trajectory": 1.4, "eval/cond_acc_0": 0.4}]
    (tmp_path / "metrics.jsonl").write_text(
        "\n".join(json.dumps(r) for r in recs) + '\n{"step": 2, "train/lo')   # cut off by a kill
    with caplog.at_level(logging.WARNING):
        written = write_run_plots(tmp_path, selected_step=1)
    assert sorted(p.name for p in written) == ["acceptance.png", "loss.png", "tau.png"]
    assert "metrics.jsonl line 3 is not a metrics record" in caplog.text
    caplog.clear()
    other = tmp_path / "other"
    other.mkdir()
    (other / "metrics.jsonl").write_text((tmp_path / "metrics.jsonl").read_text())
    (other / "plots").write_text("a file where the plots directory goes")
    with caplog.at_level(logging.WARNING):
        assert write_run_plots(other) == []
    assert f"could not draw the run's plots into {other / 'plots'}" in caplog.text


def test_tau_plot_draws_the_capped_walk_when_logged():
    from eyas.train.plots import run_figures
    recs = [{"step": s, "eval/tau": 1.5 + s / 10, "eval/tau_trajectory": 1.4 + s / 10,
             "eval/tau_trajectory_capped": 1.3 + s / 10} for s in (2, 4)]
    (ax,) = run_figures(recs, 4)["tau"].axes
    series = {line.get_label().split(",")[0]: list(line.get_ydata())
              for line in ax.get_lines() if not line.get_label().startswith("_")}
    assert series["tau_trajectory_capped"] == pytest.approx([1.5, 1.7])
    assert series["tau_trajectory"] == pytest.approx([1.6, 1.8])


def test_run_plots_draw_context_buckets_when_the_eval_reports_them(tmp_path):
    from eyas.train.plots import read_records, run_figures
    buckets = RESULT["by_context"]
    recs = [{"step": s, "train/loss": 3.0 - s / 10, "eval/loss": 3.1 - s / 10,
             "eval/tau": 1.5 + s / 10, "eval/tau_trajectory": 1.4 + s / 10,
             "eval/cond_acc_0": 0.4, "eval/cond_acc_1": 0.3,
             "eval/by_context": [dict(b, tau=None if b["tau"] is None else b["tau"] + s / 10)
                                 for b in buckets]} for s in (2, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    written = write_run_plots(tmp_path, selected_step=2)
    assert sorted(p.name for p in written) == ["acceptance.png", "loss.png", "tau.png",
                                               "tau_by_context.png"]
    (tau_ax,) = run_figures(read_records(tmp_path / "metrics.jsonl"), 2)["tau"].axes
    labels = [line.get_label().split(",")[0] for line in tau_ax.get_lines()]
    assert [x for x in labels if not x.startswith("_")] == \
        ["tau", "tau_trajectory", "selected checkpoint (step 2)"]   # no capped walk logged
    (ax,) = run_figures(read_records(tmp_path / "metrics.jsonl"), 2)["tau_by_context"].axes
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["selected checkpoint (step 2)", "last eval (step 4)"]
    assert len(ax.patches) == 2 * len(buckets)           # one bar per bucket and eval
    heights = [p.get_height() for p in ax.patches]
    assert heights[:2] == pytest.approx([2.5, 2.1]) and heights[3:5] == pytest.approx([2.7, 2.3])
