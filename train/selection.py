"""Which weights the end-of-training export holds (`export.select`), and the record saying so.

The ranking by the eval decoder-walk τ, `best` and `last`, and the fall-back to the final step
without a finite eval τ: docs/training.md, "Which checkpoint is exported". `checkpoint.save`
names the best in `checkpoints/best` and `best.json`; `BestWalk` tells the loop when an eval
beats it. `best` reads that checkpoint's weights back (checksums verified), or takes the final
weights themselves when the final step is the best.

The record (`summary.json` key `checkpoint_selection`, and `training.checkpoint_selection` in
the export's eyas_export.json):
    {"select": "best"|"last", "exported": "best"|"last", "step": exported step,
     "checkpoint": the checkpoint dir read back or null (the final weights), "reason": str,
     "best": {"step", "checkpoint", "tau_trajectory", "tau", "tau_trajectory_capped"} or null,
     "last": {"step", "tau_trajectory", "tau", "tau_trajectory_capped"}}
(`tau_trajectory_capped`: the walk within each answer's first eval.max_new_tokens tokens; null
for a checkpoint saved before eyas recorded it)"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from eyas.train import checkpoint as ckpt

log = logging.getLogger(__name__)


def _finite(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


class BestWalk:
    """The best eval decoder-walk τ so far, the same on every rank (the eval counts are summed
    over ranks), so all of them agree on when to checkpoint a new best."""

    def __init__(self, value: float | None = None, step: int | None = None):
        self.value = _finite(value)
        self.step = step if self.value is not None else None

    def offer(self, walk: float | None, step: int) -> bool:
        """True (and remember it) when `walk` is finite and beats the best so far."""
        walk = _finite(walk)
        if walk is None or (self.value is not None and walk <= self.value):
            return False
        self.value, self.step = walk, step
        return True


def select_checkpoint(root: Path, select: str, step: int, last_eval: dict[str, Any],
                      has_eval: bool) -> dict[str, Any]:
    """The record (module docstring) of what the final export holds; logged on the way.

    root: the run's checkpoints dir, select: export.select, step: the final step, last_eval: the
    final eval's record ({} without one), has_eval: whether the run has held-out data."""
    scores = ("tau_trajectory", "tau", "tau_trajectory_capped")
    last = {"step": step, **{key: _finite(last_eval.get(key)) for key in scores}}
    found = ckpt.read_best(root)
    best = None if found is None else {
        "step": int(found.get("step", found["checkpoint"].rsplit("-", 1)[-1])),
        "checkpoint": found["checkpoint"], **{key: _finite(found.get(key)) for key in scores}}
    rec: dict[str, Any] = {"select": select, "best": best, "last": last}
    if select == "last":
        return {**rec, "exported": "last", "step": step, "checkpoint": None,
                "reason": "export.select=last"}
    if best is None:
        why = ("no held-out samples to evaluate on (data.eval_fraction and data.eval_dataset "
               "left none)" if not has_eval else _no_best_why(root))
        log.info("export.select=best: %s; exporting the final step %d instead", why, step)
        return {**rec, "exported": "last", "step": step, "checkpoint": None,
                "reason": f"export.select=best fell back to the final step: {why}"}
    path = None if best["step"] == step else str(root / best["checkpoint"])
    return {**rec, "exported": "best", "step": best["step"], "checkpoint": path,
            "reason": "export.select=best: the highest eval decoder-walk tau"}


def _no_best_why(root: Path) -> str:
    """Why a run with held-out data has no best checkpoint to export."""
    try:
        named = json.loads((root / "best.json").read_text())["checkpoint"]
    except (OSError, ValueError, KeyError, TypeError):
        return "no eval gave a finite decoder-walk tau"
    log.warning("%s names %s, which is not a complete checkpoint", root / "best.json", named)
    return f"best.json names {named}, which is not a complete checkpoint"


def describe(sel: dict[str, Any]) -> str:
    """One line: which step was exported and the decoder-walk τ of the best and the last."""
    def tau(r):
        v = None if r is None else r.get("tau_trajectory")
        return "n/a" if v is None else f"{v:.3f}"

    best = sel["best"]
    where = f"best step {best['step']} tau {tau(best)}" if best else "no best (no eval tau)"
    return (f"exported step {sel['step']} ({sel['exported']}, export.select={sel['select']}); "
            f"{where}, last step {sel['last']['step']} tau {tau(sel['last'])} (decoder walk)")
