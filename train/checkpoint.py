"""Checkpoints: accelerate `save_state` + the loop's own state, atomic, rotated, checked on resume.

Layout under `<run>/checkpoints/`:
    step-000100/          accelerate state (model, optimizer, RNG per rank; DeepSpeed
                          shards under DeepSpeed) + eyas_state.json (step, loader position,
                          learning-rate schedule, objective settings, metrics)
    latest                text file naming the newest complete checkpoint
    best                  text file naming the checkpoint with the best decoder-walk τ
    best.json             {"checkpoint", "step", "tau_trajectory", "tau",
                          "tau_trajectory_capped"} of that checkpoint

A checkpoint is written to `.step-000100.tmp` and renamed only when every rank has finished,
so a crash while saving leaves the previous checkpoint as `latest`; before the rename rank 0
records every file's SHA-256 in `SHA256SUMS` (data.common.checksums). What resume refuses,
rotation (`keep_last` and the best, `.del` before deleting) and the leftovers of killed runs
(`clean_leftovers`): docs/training.md, "Where runs go, resuming and overwriting".

Every file gets the mode the user's umask gives (accelerate writes model.safetensors 0600). A
save needs about the size of the newest checkpoint: with less free it is refused before
writing, and a save that runs out of room raises DiskFullError naming the directory
(data/common/space.py); the unfinished `.step-N.tmp` is removed either way."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Callable

from safetensors import SafetensorError

from eyas.data.common.checksums import CHECKSUMS_NAME, verify_checksums, write_checksums
from eyas.data.common.space import DiskFullError, no_room_is_an_error, require_free
from eyas.data.common.utils import atomic_write_bytes, atomic_write_json, umask_modes

log = logging.getLogger(__name__)

STATE_FILE = "eyas_state.json"
#: what to do when a checkpoint does not fit
NO_ROOM_FIX = ("free space there (train.keep_last=1 keeps fewer checkpoints), or write the run "
               "to another disk (hydra.run.dir=DIR); resume with train.resume=latest")


class CheckpointError(ValueError):
    """A checkpoint cannot be resumed from: named file missing, changed or unreadable."""


#: objective settings added after checkpoints were first written: their value in an older one
OBJECTIVE_DEFAULTS = {"optim.name": "adamw"}


def objective_record(cfg, world_size: int) -> dict[str, Any]:
    """Settings that change what is optimised (of the whole typed config: they span its
    groups), and the optimizer, whose state only its own kind loads: resuming with different
    ones is refused."""
    ids = cfg.target.aux_layer_ids
    return {
        "target.name": str(cfg.target.name),
        "target.aux_layer_ids": None if ids is None else list(ids),
        "drafter.ttt_steps": int(cfg.drafter.ttt_steps),
        "drafter.draft_vocab_size": int(cfg.drafter.draft_vocab_size),
        "loss.step_weight": float(cfg.loss.step_weight),
        "loss.normalisation": cfg.loss.normalisation.value,
        "loss.position_mask": bool(cfg.loss.position_mask),
        "data.token_budget": int(cfg.data.token_budget),
        "data.dataset": None if cfg.data.dataset is None else str(cfg.data.dataset),
        "optim.grad_accum": int(cfg.optim.grad_accum),
        "optim.name": getattr(cfg.optim.name, "value", cfg.optim.name),
        "world_size": int(world_size),
    }


def _name(step: int) -> str:
    return f"step-{step:06d}"


def latest(root: Path) -> Path | None:
    pointer = root / "latest"
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    return path if (path / STATE_FILE).is_file() else None


def save(accelerator, root: Path, step: int, state: dict[str, Any], *, keep_last: int,
         best_metric: float | None = None, best_record: dict[str, Any] | None = None,
         add_files: Callable[[Path], None] | None = None) -> Path:
    """Write checkpoint `step` on every rank; rank 0 publishes it and rotates old ones.

    `add_files(dir)` (rank 0) writes more files into the checkpoint before it is checksummed.
    `best_metric` (the eval's decoder-walk τ, `tau_trajectory`) competes for the `best` pointer;
    `best_record` is written with it into best.json.

    Every rank writes its part into one `.step-N.tmp` directory that all of them can name, then
    rank 0 renames it onto `step-N` (a single-writer `data.common.utils.atomic_write_dir` cannot be
    shared by the ranks)."""
    root.mkdir(parents=True, exist_ok=True)
    final, tmp = root / _name(step), root / f".{_name(step)}.tmp"
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    # the room it needs: about the newest checkpoint's bytes, the files it writes again
    newest, main = latest(root), accelerator.is_main_process
    need = None if newest is None else sum(p.stat().st_size for p in newest.rglob("*")
                                           if p.is_file() and not p.is_symlink())
    try:
        if need:
            _on_every_rank(accelerator, root, final.name, need, lambda: require_free(
                root, need, what=f"checkpoint {final.name}", fix=NO_ROOM_FIX))
        _on_every_rank(accelerator, root, final.name, need,
                       lambda: accelerator.save_state(str(tmp)))
        _on_every_rank(accelerator, root, final.name, need,   # after every rank's save_state
                       lambda: _complete(tmp, state, add_files) if main else None)
    except Exception:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if accelerator.is_main_process:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_pointer(root / "latest", final.name)
        best = _read_best(root)        # the first finite eval walk, or one beating the best
        if best_metric is not None and (best is None or best_metric > best[1]):
            _write_best(root, step, best_metric, best_record)
        _rotate(root, keep_last, final.name)
        log.info("checkpoint %s", final)
    accelerator.wait_for_everyone()
    return final


class NotSavedElsewhere(DiskFullError):
    """Another rank found no room for this checkpoint (its own line says where); this rank
    stops with it, silently (train/main.py)."""

    reported_elsewhere = True


def _on_every_rank(accelerator, root: Path, name: str, need: int | None, write) -> None:
    """`write()` on every rank, then every rank learns whether any found no room: all of them
    raise (that rank its DiskFullError, the others NotSavedElsewhere), so none waits at a
    barrier for a rank that has stopped. A collective: a barrier of its own."""
    error = None
    try:
        with no_room_is_an_error(root, what=f"checkpoint {name}", fix=NO_ROOM_FIX,
                                 needed=need):
            write()
    except DiskFullError as e:
        error = e
    if getattr(accelerator, "num_processes", 1) > 1:
        import torch
        flags = accelerator.gather(torch.tensor([int(error is not None)],
                                                device=accelerator.device)).tolist()
        if error is None and any(flags):
            error = NotSavedElsewhere(f"checkpoint {name} not saved: rank(s) "
                                      f"{[i for i, f in enumerate(flags) if f]} found no room")
    if error is not None:
        raise error


def _complete(tmp: Path, state: dict[str, Any], add_files) -> None:
    """Rank 0, once every rank has saved its part into `tmp`: the umask's modes, the loop's
    state, `add_files` and SHA256SUMS."""
    umask_modes(tmp)
    atomic_write_json(tmp / STATE_FILE, state)
    if add_files is not None:
        add_files(tmp)
    write_checksums(tmp)


def _write_pointer(path: Path, name: str) -> None:
    atomic_write_bytes(path, name.encode())


def _write_best(root: Path, step: int, tau: float, record: dict[str, Any] | None = None) -> None:
    """The `best` pointer and best.json naming checkpoint `step`, its decoder-walk τ `tau`."""
    _write_pointer(root / "best", _name(step))
    atomic_write_json(root / "best.json", {**(record or {}), "checkpoint": _name(step),
                                           "step": step, "tau_trajectory": tau})


def read_best(root: Path) -> dict[str, Any] | None:
    """best.json of the checkpoints dir `root` when it names a complete checkpoint, else None."""
    f = root / "best.json"
    if not f.is_file():
        return None
    d = json.loads(f.read_text())
    return d if (root / d["checkpoint"] / STATE_FILE).is_file() else None


def _read_best(root: Path) -> tuple[str, float] | None:
    f = root / "best.json"
    if not f.is_file():
        return None
    d = json.loads(f.read_text())
    for key in ("tau_trajectory", "tau", "accept_len"):  # older runs ranked by tau/accept_len
        if d.get(key) is not None:
            return d["checkpoint"], float(d[key])
    return None


def _rotate(root: Path, keep_last: int, current: str) -> None:
    """Keep the `keep_last` newest checkpoints up to `current` (the one just written) and the
    best one; remove the rest."""
    steps = sorted(p for p in root.glob("step-*") if (p / STATE_FILE).is_file())
    best = _read_best(root)
    keep = {p.name for p in [p for p in steps if p.name <= current][-max(1, keep_last):]}
    keep.add(current)
    if best:
        keep.add(best[0])
    _remove(p for p in steps if p.name not in keep)
    for p in root.glob(".step-*.tmp"):  # left by a crash during an earlier save
        shutil.rmtree(p, ignore_errors=True)


def _remove(checkpoints) -> None:
    for p in checkpoints:
        doomed = p.with_name(f".{p.name}.del")
        os.replace(p, doomed)  # from here on no longer a checkpoint, even if cut short
        shutil.rmtree(doomed, ignore_errors=True)


def rewind(root: Path, path: Path, best: dict[str, Any]) -> list[str]:
    """After resuming from checkpoint `path` of this run's `root` while newer ones exist: the
    newer ones belong to the abandoned continuation, so they are removed, `latest` names
    `path`, and `best` is the resumed state's own best (`best`: its tau_trajectory and step)
    when that checkpoint still exists, else none. Rank 0 only; returns the names removed."""
    if path.resolve().parent != root.resolve():
        return []
    newer = [p for p in sorted(root.glob("step-*")) if p.name > path.name]
    if not newer:
        return []
    log.warning("resuming from %s: removing the later checkpoints of the continuation it "
                "replaces: %s", path.name, ", ".join(p.name for p in newer))
    _remove(newer)
    _write_pointer(root / "latest", path.name)
    named = _read_best(root)
    if named and not (root / named[0] / STATE_FILE).is_file():
        for name in ("best", "best.json"):
            (root / name).unlink(missing_ok=True)
        kept = best.get("step") is not None and (root / _name(best["step"]) / STATE_FILE).is_file()
        if kept and best.get("tau_trajectory") is not None:
            _write_best(root, best["step"], best["tau_trajectory"])
    return [p.name for p in newer]


def clean_leftovers(root: Path) -> list[str]:
    """Remove what killed runs left under `root` (rank 0, holding the run's lock): unfinished
    saves (`.step-N.tmp`), interrupted rotations (`.step-N.del`) and checkpoints deleted half
    way by one (`step-N` without its eyas_state.json). Logs each; returns the names removed."""
    if not root.is_dir():
        return []
    found = sorted([*root.glob(".step-*.tmp"), *root.glob(".step-*.del"),
                    *(p for p in root.glob("step-*") if p.is_dir()
                      and not (p / STATE_FILE).is_file())])
    for p in found:
        why = ("an unfinished checkpoint save" if p.name.endswith(".tmp") else
               "an interrupted checkpoint rotation" if p.name.endswith(".del") else
               f"a checkpoint deleted half way (no {STATE_FILE})")
        log.warning("removing %s, left by %s of an earlier run", p, why)
        shutil.rmtree(p, ignore_errors=True)
    return [p.name for p in found]


def resolve_resume(resume: str | None, root: Path) -> Path | None:
    if not resume:
        return None
    if resume == "latest":
        found = latest(root)
        pointer = root / "latest"
        if found is None and pointer.is_file():
            raise CheckpointError(f"train.resume=latest: {pointer} names "
                                  f"{pointer.read_text().strip()!r}, which is not a complete "
                                  f"checkpoint (no {STATE_FILE}); resume from another one "
                                  f"(train.resume={root}/step-NNNNNN) or start a new run")
        if found is None:
            _no_checkpoint_yet(root)
        return found
    path = Path(resume).expanduser()
    if not (path / STATE_FILE).is_file():
        raise FileNotFoundError(f"train.resume={resume}: {path / STATE_FILE} does not exist; "
                                f"point it at a checkpoint dir (…/checkpoints/step-NNNNNN) "
                                f"or use train.resume=latest")
    return path


def load(accelerator, path: Path, objective: dict[str, Any]) -> dict[str, Any]:
    """Restore accelerate state from `path` after checking its files' SHA-256 and that the
    objective settings match."""
    verify(path)
    state = json.loads((path / STATE_FILE).read_text())
    if "schedule" not in state:
        raise CheckpointError(f"refusing to resume from {path}: its {STATE_FILE} has no "
                              f"learning-rate schedule (an older eyas wrote it); start a new run "
                              f"warm-started from its export (drafter.warm_start=DIR)")
    saved = state.get("objective", {})
    saved = {**OBJECTIVE_DEFAULTS, **saved}
    diff = {k: (saved.get(k), v) for k, v in objective.items() if saved.get(k) != v}
    if diff:
        lines = "; ".join(f"{k}: checkpoint {a!r}, now {b!r}" for k, (a, b) in diff.items())
        raise ValueError(f"refusing to resume from {path}: the objective differs ({lines}). "
                         f"Use the checkpoint's settings, or start a new run (train.resume=null) "
                         f"warm-started from an export (drafter.warm_start=DIR)")
    try:
        accelerator.load_state(str(path))
    except (OSError, RuntimeError, SafetensorError) as e:   # a damaged file in an unsummed one
        raise CheckpointError(f"refusing to resume from {path}: its state does not load "
                              f"({' '.join(str(e).split())[:300]}); resume from an older "
                              f"checkpoint or start a new run") from None
    log.info("resumed from %s (step %d)", path, state["step"])
    return state


def verify(path: Path) -> None:
    """Raise CheckpointError naming the first file of checkpoint `path` that is missing or
    differs from its SHA256SUMS (checkpoints written before checksums: a warning)."""
    problems = verify_checksums(path)
    if problems is None:
        log.warning("checkpoint %s has no %s (written by an older eyas): resuming without "
                    "checking its files", path, CHECKSUMS_NAME)
    elif problems:
        more = f" (and {len(problems) - 1} more file(s))" if len(problems) > 1 else ""
        raise CheckpointError(f"refusing to resume from {path}: {problems[0]}{more}; resume "
                              f"from an older checkpoint (train.resume={path.parent}/step-NNNNNN) "
                              f"or start a new run")


def _no_checkpoint_yet(root: Path) -> None:
    """train.resume=latest found nothing in this run's `root`: say so, and when another run
    directory beside this one holds a checkpoint (a run named by its start time gets a new
    directory each launch), name the newest and the override that continues it."""
    run = root.parent
    others = sorted((p for p in run.parent.glob("*/checkpoints/latest")
                     if p.parent.parent != run and latest(p.parent) is not None),
                    key=lambda p: p.stat().st_mtime)
    if not others:
        log.info("train.resume=latest: no checkpoint in %s yet; starting fresh", root)
        return
    other = others[-1].parent.parent
    log.warning("train.resume=latest: no checkpoint in %s (a new run directory); starting "
                "fresh. To continue %s instead, run again with run_name=%s "
                "train.resume=latest", root, other, other.name)
