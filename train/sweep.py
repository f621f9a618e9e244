"""The table of a `--multirun` sweep: each job's swept overrides, τ and loss, written into the
sweep directory when the sweep ends (`SweepTable`, a hydra.callbacks entry of
conf/config.yaml), and printed.

    sweep.md    the table (markdown), also printed at the end of the sweep
    sweep.csv   the same rows
    sweep.json  {"sweep_dir", "swept", "best_job", "jobs": [row, ...]}
    sweep.png   τ (eval, decoder walk, real decoding) and loss (train, eval) per job

A job is a directory under the sweep directory with the `.hydra/overrides.yaml` the job writes
once its run directory is claimed (train/main.py); its figures come from its `summary.json`
and the last train/loss of its `metrics.jsonl`. A job without summary.json (it failed before
the end, or was a dry run without training) keeps its row, figures empty.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)

TABLE = "sweep"
COLUMNS = ("job", "overrides", "steps", "train_loss", "eval_loss", "tau", "tau_walk",
           "tau_speculative", "dir")
FIGURES = {"tau": ("tau", "tau_walk", "tau_speculative"), "loss": ("train_loss", "eval_loss")}
LEGEND = {"tau": "eval tau", "tau_walk": "decoder walk", "tau_speculative": "real decoding",
          "train_loss": "train loss (last window)", "eval_loss": "eval loss"}


class SweepTable(Callback):
    """conf/config.yaml's hydra.callbacks: after each job, the records until the next job's
    run directory is known are kept for its train.log (the launcher's `#1 : …` line is job
    1's, not job 0's); at the end of a --multirun sweep, `write_table` into hydra.sweep.dir
    (rank 0 of a launch)."""

    def on_job_end(self, config: DictConfig, **kwargs: Any) -> None:
        from eyas.data.common.log import setup_logging
        setup_logging(keep_early=True)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from eyas.data.common.log import current_rank
        if current_rank() == 0:
            rows = write_table(Path(config.hydra.sweep.dir))
            print(markdown(rows, swept_keys(rows)), end="")


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def job_row(job: Path, sweep_dir: Path) -> dict[str, Any]:
    """One job's row: its number (hydra.job.num), overrides, steps, losses, τ and directory."""
    hydra_cfg = OmegaConf.load(job / ".hydra" / "hydra.yaml")
    overrides = [str(o) for o in OmegaConf.load(job / ".hydra" / "overrides.yaml")]
    from eyas.train.plots import _series, read_records
    summary_file, metrics = job / "summary.json", job / "metrics.jsonl"
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
    spec = summary.get("speculative")
    return {"job": int(OmegaConf.select(hydra_cfg, "hydra.job.num", default=-1)),
            "overrides": overrides,
            "steps": summary.get("steps"),
            "train_loss": (_series(read_records(metrics), "train/loss")[1] or [None])[-1]
            if metrics.is_file() else None,
            "eval_loss": _num((summary.get("eval") or {}).get("loss")),
            "tau": _num(summary.get("tau")),
            "tau_walk": _num(summary.get("tau_trajectory")),
            "tau_speculative": _num(spec.get("tau")) if isinstance(spec, dict) else None,
            "dir": str(job.relative_to(sweep_dir)),
            "summary": summary_file.is_file()}


def collect(sweep_dir: Path) -> list[dict[str, Any]]:
    """The rows of the jobs under `sweep_dir`, in job order."""
    jobs = {f.parent.parent for f in sweep_dir.glob("**/.hydra/overrides.yaml")}
    return sorted((job_row(j, sweep_dir) for j in jobs), key=lambda r: (r["job"], r["dir"]))


def swept_keys(rows: list[dict]) -> list[str]:
    """The override keys whose values differ between the jobs (all of them when none does)."""
    values: dict[str, set] = {}
    for r in rows:
        for o in r["overrides"]:
            key, _, value = o.partition("=")
            values.setdefault(key, set()).add(value)
    differ = [k for k, v in values.items() if len(v) > 1 or any(
        not any(o.partition("=")[0] == k for o in r["overrides"]) for r in rows)]
    return differ or list(values)


def _label(row: dict, keys: list[str]) -> str:
    return " ".join(o for o in row["overrides"] if o.partition("=")[0] in keys) or "(defaults)"


def _cell(value: Any) -> str:
    if value is None:
        return "–"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def markdown(rows: list[dict], keys: list[str]) -> str:
    """The table as markdown: one line per job, its swept overrides in place of all."""
    head = ["job", "overrides", "steps", "train loss", "eval loss", "tau", "tau (walk)",
            "tau (decoding)", "dir"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["job"], _label(r, keys)] + [r[c] for c in COLUMNS[2:]]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _csv(rows: list[dict], keys: list[str]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(COLUMNS)
    for r in rows:
        writer.writerow([r["job"], _label(r, keys)]
                        + ["" if r[c] is None else r[c] for c in COLUMNS[2:]])
    return buf.getvalue()


def figure(rows: list[dict], keys: list[str]):
    """τ and loss per job, side by side; None when no job has either."""
    from eyas.train.plots import _figure
    if not any(r[c] is not None for r in rows for cols in FIGURES.values() for c in cols):
        return None
    fig, axes = _figure(2)
    labels = [f"#{r['job']} {_label(r, keys)}" for r in rows]
    for ax, (name, cols) in zip(axes, FIGURES.items()):
        cols = [c for c in cols if any(r[c] is not None for r in rows)]
        width = 0.8 / max(len(cols), 1)
        for j, col in enumerate(cols):
            xs = [k + (j - (len(cols) - 1) / 2) * width for k in range(len(rows))]
            bars = ax.bar(xs, [math.nan if r[col] is None else r[col] for r in rows], width,
                          label=LEGEND[col])
            ax.bar_label(bars, labels=[_cell(r[col]) for r in rows], fontsize=7)
        ax.set_xticks(range(len(rows)), labels, rotation=20, ha="right", fontsize=8)
        ax.set_title(f"{name} per job")
        ax.set_ylabel(name)
        if cols:
            ax.legend(fontsize=8)
    return fig


def write_table(sweep_dir: Path) -> list[dict]:
    """sweep.md, sweep.csv, sweep.json and sweep.png in `sweep_dir`; the rows."""
    from eyas.data.common.utils import atomic_write_bytes, atomic_write_json
    rows = collect(sweep_dir)
    keys = swept_keys(rows)
    scored = [r for r in rows if r["tau"] is not None]
    best = max(scored, key=lambda r: r["tau"])["job"] if scored else None
    record = {"sweep_dir": str(sweep_dir), "swept": keys, "best_job": best, "jobs": rows}
    atomic_write_bytes(sweep_dir / f"{TABLE}.md", markdown(rows, keys).encode())
    atomic_write_bytes(sweep_dir / f"{TABLE}.csv", _csv(rows, keys).encode())
    atomic_write_json(sweep_dir / f"{TABLE}.json", record)
    fig = figure(rows, keys)
    if fig is not None:
        from eyas.train.plots import save_png
        save_png(fig, sweep_dir / f"{TABLE}.png")
    log.info("sweep of %d job(s): %s (.csv, .json%s)%s", len(rows), sweep_dir / f"{TABLE}.md",
             ", .png" if fig is not None else "",
             f"; best tau: job {best}" if best is not None else "")
    return rows
