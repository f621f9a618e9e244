"""Pictures of a training run and of an evaluation (matplotlib, headless Agg canvas).

    write_run_plots(run_dir, selected_step=None) -> [paths]   rank 0, at eval steps and the end
    run_figures(records, selected_step=None) -> {name: Figure}
    evaluation_figure(result) -> Figure | None
    write_evaluation_plot(result, path)                      `eyas evaluate --plot FILE.png`

The run plots (`<run>/metrics.jsonl` drawn into `<run>/plots/`: loss.png, tau.png,
acceptance.png, tau_by_context.png): docs/training.md, "Which checkpoint is exported, and the
run's pictures". Figures are built on `matplotlib.figure.Figure` (no pyplot state, no display
needed), saved to PNG bytes and written atomically. Drawing never stops a training:
`write_run_plots` logs a failure as a warning and returns what it wrote."""

from __future__ import annotations

import io
import json
import logging
import math
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PLOTS_DIR = "plots"
_DPI = 110


def _figure(ncols: int = 1, width: float = 6.4):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(width * ncols, 4.2), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, [fig.add_subplot(1, ncols, i + 1) for i in range(ncols)]


def save_png(fig, path: str | Path) -> Path:
    """`fig` as a PNG at `path`, written atomically (keeps the umask: data.common.utils)."""
    from eyas.data.common.utils import atomic_write_bytes
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    atomic_write_bytes(Path(path), buf.getvalue())
    return Path(path)


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """metrics.jsonl as one merged record per step, in step order (later lines win). A line
    that is not a JSON record with a step (a killed run's last, cut-off write) is left out of
    the pictures, with a warning naming the file and line."""
    by_step: dict[int, dict[str, Any]] = {}
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            step = int(rec["step"])
        except (ValueError, KeyError, TypeError) as e:
            log.warning("%s line %d is not a metrics record (%s): not drawn", path, i, e)
            continue
        by_step.setdefault(step, {}).update(rec)
    return [by_step[s] for s in sorted(by_step)]


def _num(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in records if _num(r.get(key))]
    return [p[0] for p in pts], [p[1] for p in pts]


def _positions(rec: dict, prefix: str = "eval/") -> list[float | None]:
    out, k = [], 0
    while f"{prefix}cond_acc_{k}" in rec:
        v = rec[f"{prefix}cond_acc_{k}"]
        out.append(v if _num(v) else None)
        k += 1
    return out


def _mark(ax, step: int | None, label: str = "selected checkpoint") -> None:
    if step is not None:
        ax.axvline(step, color="tab:red", linestyle="--", linewidth=1, label=f"{label} (step {step})")


def _style(ax, title: str, xlabel: str, ylabel: str, legend: bool = True) -> None:
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    fmt = ax.yaxis.get_major_formatter()
    if hasattr(fmt, "set_useOffset"):          # plain values, also for a flat curve
        fmt.set_useOffset(False)
    ax.grid(alpha=0.3)
    if legend and ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")


def loss_figure(records: list[dict], selected_step: int | None = None):
    fig, (ax,) = _figure()
    for key, label, style in (("train/loss", "train loss (per log window)", "-"),
                              ("eval/loss", "eval loss (held-out)", "o-")):
        x, y = _series(records, key)
        if x:
            ax.plot(x, y, style, label=label, markersize=4)
    _mark(ax, selected_step)
    _style(ax, "Training and eval loss", "optimizer step", "loss")
    return fig


def tau_figure(records: list[dict], selected_step: int | None = None):
    fig, (ax,) = _figure()
    for key, label in (("eval/tau", "tau, every chain start"),
                       ("eval/tau_trajectory", "tau_trajectory, decoder walk (ranks checkpoints)"),
                       ("eval/tau_trajectory_capped", "tau_trajectory_capped, the walk within "
                        "each answer's first eval.max_new_tokens tokens")):
        x, y = _series(records, key)
        if x:
            ax.plot(x, y, "o-", label=label, markersize=4)
    x, y = _series(records, "eval/tau_trajectory")
    if selected_step in x:
        ax.plot([selected_step], [y[x.index(selected_step)]], "*", color="tab:red",
                markersize=14, zorder=5)
    _mark(ax, selected_step)
    _style(ax, "Acceptance length on the held-out split", "optimizer step",
           "tau (tokens per verification)")
    return fig


def _picks(evals: list[dict], selected_step: int | None) -> list[tuple[str, dict]]:
    """The eval records drawn per position: the selected checkpoint's (when it is not the last
    eval) and the last eval's."""
    chosen = [r for r in evals if r["step"] == selected_step][:1]
    picks = [("selected checkpoint", r) for r in chosen if r is not evals[-1]]
    return picks + [("last eval", r) for r in evals[-1:]]


def acceptance_figure(records: list[dict], selected_step: int | None = None):
    fig, (over, at) = _figure(2)
    evals = [r for r in records if _positions(r)]
    K = max((len(_positions(r)) for r in evals), default=0)
    for k in range(K):
        x, y = _series(evals, f"eval/cond_acc_{k}")
        if x:
            over.plot(x, y, "o-", markersize=3, label=f"position {k}")
    _mark(over, selected_step)
    _style(over, "Per-position acceptance over training", "optimizer step",
           "cond_acc_k (accepted | all before accepted)")
    for name, rec in _picks(evals, selected_step):
        acc = _positions(rec)
        at.plot(range(len(acc)), [math.nan if v is None else v for v in acc], "o-",
                label=f"{name} (step {rec['step']})")
    at.set_xticks(range(K))
    at.set_ylim(0, 1.02)
    _style(at, "Per-position acceptance", "draft position k", "cond_acc_k")
    return fig


def context_axes(ax, groups: dict[str, list[dict]], title: str) -> None:
    """Grouped bars of τ per context bucket; `groups` maps a legend label to a `by_context` list."""
    buckets = list(dict.fromkeys(b["bucket"] for rows in groups.values() for b in rows))
    width = 0.8 / max(1, len(groups))
    for i, (label, rows) in enumerate(groups.items()):
        by = {b["bucket"]: b for b in rows}
        xs = [j + (i - (len(groups) - 1) / 2) * width for j in range(len(buckets))]
        ys = [by[b]["tau"] if b in by and _num(by[b].get("tau")) else math.nan for b in buckets]
        bars = ax.bar(xs, ys, width=width, label=label)
        ax.bar_label(bars, labels=["" if math.isnan(y) else f"{y:.2f}" for y in ys],
                     fontsize="small")
    for j, name in enumerate(buckets):
        if not any(_num(b.get("tau")) for rows in groups.values() for b in rows
                   if b["bucket"] == name):
            ax.text(j, 0, "no rounds", ha="center", va="bottom", color="gray")
    tokens = {b["bucket"]: b.get("tokens") for rows in groups.values() for b in rows}
    ax.margins(y=0.1)                   # room for the value labels
    ax.set_xticks(range(len(buckets)))
    ax.set_xticklabels([f"{b}\n{tokens[b]} tok" if tokens.get(b) is not None else b
                        for b in buckets])
    _style(ax, title, "context position where the round starts",
           "tau (tokens per verification)", legend=len(groups) > 1)


def context_figure(records: list[dict], selected_step: int | None = None):
    evals = [r for r in records if r.get("eval/by_context")]
    if not evals:
        return None
    fig, (ax,) = _figure()
    picks = {f"{name} (step {rec['step']})": rec["eval/by_context"]
             for name, rec in _picks(evals, selected_step)}
    context_axes(ax, picks, "Acceptance length by context position")
    return fig


def run_figures(records: list[dict], selected_step: int | None = None) -> dict[str, Any]:
    """{file stem: Figure} of a run's records (`read_records`); tau_by_context only when the
    evals report `by_context`."""
    figs = {"loss": loss_figure(records, selected_step),
            "tau": tau_figure(records, selected_step),
            "acceptance": acceptance_figure(records, selected_step),
            "tau_by_context": context_figure(records, selected_step)}
    return {k: v for k, v in figs.items() if v is not None}


def write_run_plots(run_dir: str | Path, selected_step: int | None = None) -> list[Path]:
    """Draw `<run_dir>/metrics.jsonl` into `<run_dir>/plots/*.png`; never raises (a failure is
    logged as a warning: pictures must not stop a training)."""
    run_dir = Path(run_dir)
    try:
        metrics = run_dir / "metrics.jsonl"
        if not metrics.is_file():
            return []
        figs = run_figures(read_records(metrics), selected_step)
        return [save_png(fig, run_dir / PLOTS_DIR / f"{name}.png") for name, fig in figs.items()]
    except Exception as e:  # noqa: BLE001 -- any drawing error: warn, keep training
        log.warning("could not draw the run's plots into %s: %s: %s", run_dir / PLOTS_DIR,
                    type(e).__name__, e)
        return []


# ---------------------------------------------------------------------------------------------
# `eyas evaluate --plot`


def _temperature_axes(ax, rows: list[dict]) -> None:
    rows = sorted(rows, key=lambda r: r["temperature"])
    x = [r["temperature"] for r in rows]
    y = [r["tau"] if _num(r.get("tau")) else math.nan for r in rows]
    se = [r["tau_se"] if _num(r.get("tau_se")) else 0.0 for r in rows]
    ax.errorbar(x, y, yerr=se, fmt="o-", capsize=4, label="tau (± standard error)")
    off = [(r["temperature"], r["offline_tau"]) for r in rows if _num(r.get("offline_tau"))]
    if off:
        ax.plot([p[0] for p in off], [p[1] for p in off], "s--", label="offline estimate")
    ax.set_xticks(x)
    _style(ax, "Acceptance length by temperature", "sampling temperature",
           "tau (tokens per verification)")


def evaluation_figure(res: dict[str, Any]):
    """The figure of an `eyas evaluate` result: per-position acceptance (overall and per context
    bucket), τ by context bucket and τ by temperature, each panel when its keys are present
    (`cond_acc_k`, `by_context`, `by_temperature`); None when none is."""
    acc = [v if _num(v) else math.nan for v in _positions(res, prefix="")]
    buckets = res.get("by_context") or []
    temps = res.get("by_temperature") or []
    panels = [p for p, present in (("positions", acc), ("context", buckets),
                                   ("temperature", temps)) if present]
    if not panels:
        return None
    fig, axes = _figure(len(panels), width=5.6)
    ax = dict(zip(panels, axes))
    if acc:
        a = ax["positions"]
        a.plot(range(len(acc)), acc, "o-", linewidth=2, label="all positions in the text")
        for b in buckets:
            if any(_num(v) for v in b.get("cond_acc") or []):
                a.plot(range(len(b["cond_acc"])),
                       [v if _num(v) else math.nan for v in b["cond_acc"]], ".--",
                       alpha=0.7, label=f"context {b['bucket']}")
        a.set_xticks(range(len(acc)))
        a.set_ylim(0, 1.02)
        _style(a, "Per-position acceptance", "draft position k",
               "cond_acc_k (accepted | all before accepted)")
    if buckets:
        context_axes(ax["context"], {"tau": buckets}, "Acceptance length by context position")
    if temps:
        _temperature_axes(ax["temperature"], temps)
    what = "offline (hidden-state dataset)" if res.get("mode") == "offline" else \
        "speculative decoding"
    tau = f", tau {res['tau']:.3f}" if _num(res.get("tau")) else ""
    fig.suptitle(f"eyas evaluate: {what}, K={res.get('k', len(acc))}{tau}")
    return fig


def write_evaluation_plot(res: dict[str, Any], path: str | Path) -> Path | None:
    """`evaluation_figure(res)` as a PNG at `path` (atomic); None (logged) when there is
    nothing to draw."""
    fig = evaluation_figure(res)
    if fig is None:
        log.warning("--plot %s: the result has no cond_acc_k, by_context or by_temperature to "
                    "draw; no plot written", path)
        return None
    return save_png(fig, path)
