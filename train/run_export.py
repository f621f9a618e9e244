"""The end of a run: which checkpoint is exported, its export with the model card, and the
metadata every checkpoint carries so `eyas export CHECKPOINT` gives the same card.

    export_selected(t, step, last_eval) -> summary entries   (export.select: best | last)
    export_final(t, out_dir, step, evaluated, selection=None) -> out_dir
    write_export_meta(t, checkpoint_dir, step, evaluated)

`t` is the `train.trainer.Trainer` of the run.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from accelerate.utils import broadcast_object_list

from eyas.data.produce.vocab import save_vocab
from eyas.train.plots import write_run_plots
from eyas.train.provenance import run_record
from eyas.train.selection import describe, select_checkpoint

log = logging.getLogger(__name__)


def export_selected(t, step: int, last_eval: dict) -> dict[str, Any]:
    """The export of the checkpoint export.select picks (`train.selection`) and the run's plots;
    their summary entries."""
    sel = select_checkpoint(t.out / "checkpoints", t.cfg.export.select.value, step, last_eval,
                            has_eval=t.data.eval is not None)
    if t.accelerator.num_processes > 1:  # rank 0's reading of checkpoints/ decides for all
        sel = broadcast_object_list([sel], from_process=0)[0]
    found: dict[str, Any] = {"checkpoint_selection": sel}
    if t.cfg.export.enabled:
        log.info("%s", describe(sel))
        found["export"] = str(export_final(t, t.out / "export", step, last_eval, selection=sel))
    if t.accelerator.is_main_process:
        write_run_plots(t.out, selected_step=sel["step"])
    return found


def write_export_meta(t, path: Path, step: int, evaluated: dict | None) -> None:
    """eyas.json + vocab next to the accelerate state, so `eyas export CHECKPOINT` works, and
    the run record its export's model card is made from (train/provenance.py)."""
    if not t.accelerator.is_main_process:
        return
    from eyas.data.common.utils import atomic_write_json, json_safe
    from eyas.models.serving.card import PROVENANCE
    atomic_write_json(path / PROVENANCE, json_safe(run_record(t, step, evaluated)))
    m = t.model
    save_vocab(path / "vocab.safetensors", m.d2t, m.t2d)
    atomic_write_json(path / "eyas.json", {"drafter": m.config.to_dict(),
                                           "ttt_steps": m.config.ttt_steps,
                                           "vocab_map": "vocab.safetensors",
                                           "target": str(t.cfg.target.name),
                                           "data": _data_record(t)})


def _provenance(t, step: int, evaluated: dict | None, sel: dict | None) -> dict:
    """The run record of the exported weights: the selected checkpoint's own (written at its
    save), else the run's at `step`; `selected` says which step and why, with both τ."""
    from eyas.models.serving.card import PROVENANCE
    rec = None
    if sel is not None and sel.get("checkpoint"):
        f = Path(sel["checkpoint"]) / PROVENANCE
        rec = json.loads(f.read_text()) if f.is_file() else None
    rec = rec or run_record(t, step, evaluated)
    if sel is not None:
        best, last = sel.get("best") or {}, sel["last"]
        rec["selected"] = {"step": sel["step"], "by": sel["exported"], "reason": sel["reason"],
                           "tau": (best if sel["exported"] == "best" else last).get(
                               "tau_trajectory"),
                           "last_step": last["step"], "last_tau": last.get("tau_trajectory")}
    return rec


def _data_record(t) -> dict:
    """Which samples trained the drafter (`eyas evaluate --data` scores the rest by default)."""
    train_ds = t.data.train.dataset
    eval_ds = None if t.data.eval is None else t.data.eval.dataset
    return {"dataset": str(Path(train_ds.root).resolve()),
            "eval_dataset": None if eval_ds is None or eval_ds is train_ds
            else str(Path(eval_ds.root).resolve()),
            "eval_fraction": float(t.cfg.data.eval_fraction), "seed": int(t.cfg.train.seed)}


def export_final(t, out_dir: Path, step: int, evaluated: dict | None,
                 selection: dict | None = None) -> Path:
    """Layout-A export, written by rank 0, of the current weights (gathers ZeRO-3 shards), or of
    the checkpoint `selection` names (`train.selection`: read back from its files), with the
    model card of the run at `step` (`evaluated`: that step's eval record, if any) or the
    record the selected checkpoint holds."""
    from eyas.models.serving.export import export_drafter
    from eyas.models.serving.importer import read_trainer_checkpoint
    acc, m, cfg = t.accelerator, t.model, t.cfg
    from_checkpoint = selection is not None and selection["checkpoint"] is not None
    state = None if from_checkpoint else acc.get_state_dict(t.module)
    if acc.is_main_process:
        if from_checkpoint:
            state = read_trainer_checkpoint(selection["checkpoint"]).state_dict
        training = {"run": cfg.run_name, "target": str(cfg.target.name), "data": _data_record(t)}
        provenance = _provenance(t, step, evaluated, selection)
        if selection is not None:
            training["checkpoint_selection"] = selection
        spec = cfg.export.speculators_config
        export_drafter(state, m.config, m.d2t, m.t2d, out_dir, target_config=t.data.target_config,
                       ttt_steps=m.config.ttt_steps, overwrite=True, speculators=spec,
                       verifier=str(cfg.target.name) if spec else None,
                       training=training, provenance=provenance)
        log.info("exported %s", out_dir)
    acc.wait_for_everyone()
    return out_dir
