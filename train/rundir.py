"""The run directory: one per run, the same on every rank, never reused by accident.

How it is named, what a non-empty one needs (`train.resume`, `train.overwrite`) and the one
training per directory: docs/training.md, "Where runs go, resuming and overwriting".

Every rank of a launch composes its own config, and ranks that start in different seconds
would name different timestamp directories, so rank 0's directory is the run's: the others
take it over the process group (`agree`) and remove the empty directory Hydra made for them.
Rank 0 alone looks into it before anything is written (`claim`) and every rank gets its
verdict, so no rank writes into a directory another one refused. Rank 0 holds the directory's
lock (data/common/lock.py) from `claim` to the end of the run and, once the directory is the
run's, removes what killed earlier runs left there (`checkpoint.clean_leftovers`)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from accelerate.utils import broadcast_object_list

from eyas.data.common.lock import LOCK_NAME, DirectoryLocked, DirLock
from eyas.train import checkpoint as ckpt
from eyas.train.config import ConfigError

log = logging.getLogger(__name__)

# What a run writes into its directory (train/main.py, train/trainer.py, train/tracking.py), and
# what its trackers write there (train/trackers.py): wandb/, aim's .aim/, mlflow's mlruns/,
# dvclive/, and tensorboard's <tracker.project>/ (`tracker_dir`).
RUN_FILES = ("checkpoints", "metrics.jsonl", "train.log", "plots", "profile", "export",
             "export-speculators", "summary.json", "config.resolved.yaml", "vocab.safetensors",
             "ranks", "wandb", ".aim", "mlruns", "dvclive", ".hydra")
RUN_GLOBS = ("export-step*", ".tmp-*", ".*.lock")  # .export.lock: a killed export's lock


def agree(accelerator, out: Path, run_name: str) -> tuple[Path, str]:
    """(run directory, run name) of rank 0, on every rank. A rank that had composed another
    directory (it started in another second) removes it when it is still empty."""
    if accelerator.num_processes == 1:
        return out, run_name
    shared = [str(Path(out).absolute()), run_name] if accelerator.is_main_process else [None, None]
    broadcast_object_list(shared, from_process=0)
    chosen, name = Path(shared[0]), shared[1]
    mine = Path(out).absolute()
    if mine != chosen:
        log.info("rank %d: run directory %s (rank 0's), not %s", accelerator.process_index,
                 chosen, mine)
        try:
            mine.rmdir()  # Hydra made it empty; anything else in it stays
        except OSError:
            pass
    return chosen, name


def tracker_dir(project: str | None) -> str | None:
    """The entry of the run dir that tensorboard's events go under: accelerate writes them to
    <run dir>/<tracker.project>/."""
    parts = Path(project).parts if project else ()
    if not parts or Path(project).is_absolute() or parts[0] in (".", ".."):
        return None
    return parts[0]


def run_entries(out: Path, project: str | None = None) -> list[Path]:
    """The entries of `out` that a run wrote (`project`: tracker.project, see `tracker_dir`)."""
    names = list(RUN_FILES)
    if tracker_dir(project) and tracker_dir(project) not in names:
        names.append(tracker_dir(project))
    found = [out / n for n in names if (out / n).exists()]
    for pattern in RUN_GLOBS:
        found += sorted(p for p in out.glob(pattern) if p not in found and p.name != LOCK_NAME)
    return found


def _listing(out: Path) -> list[Path]:
    """The entries of `out` but the run's own lock file."""
    return [p for p in out.iterdir() if p.name != LOCK_NAME]


def describe(out: Path, project: str | None = None) -> str:
    """What `out` holds, in a few words: checkpoints (with `latest`), metrics, exports, others."""
    entries = run_entries(out, project)
    parts = []
    for p in entries:
        if p.name == "checkpoints":
            steps = sorted(c.name for c in p.glob("step-*") if (c / ckpt.STATE_FILE).is_file())
            newest = ckpt.latest(p)
            parts.append(f"checkpoints {', '.join(steps) or 'none complete'}"
                         + (f" (latest {newest.name})" if newest else ""))
        elif p.name == "metrics.jsonl":
            parts.append(f"metrics.jsonl ({_count_lines(p)} records)")
        else:
            parts.append(p.name + ("/" if p.is_dir() else ""))
    others = sorted(p.name for p in _listing(out) if p not in entries)
    if others:
        shown = ", ".join(others[:3]) + (", …" if len(others) > 3 else "")
        parts.append(f"{len(others)} other entr{'y' if len(others) == 1 else 'ies'} ({shown})")
    return "; ".join(parts)


def _count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for _ in f)


def verdict(out: Path, *, resume: str | None, overwrite: bool,
            project: str | None = None) -> str | None:
    """Rank 0's decision on `out`: None (go ahead; with overwrite the old run is removed
    first) or the one-line refusal."""
    if not out.is_dir() or not _listing(out):
        return None
    if overwrite:
        inside = resume and out.resolve() in _resolved(resume).parents
        if inside:
            return (f"train.overwrite=true would remove {resume}, the checkpoint train.resume "
                    f"names. Fix: drop train.overwrite=true, or resume from a checkpoint "
                    f"outside {out}")
        remove_run(out, project)
        return None
    if resume and resume != "latest" and out.resolve() not in _resolved(resume).parents:
        return (f"train.resume={resume} is a checkpoint of the run {_run_of(resume)}, but the "
                f"run directory {out} is another run's and not empty ({describe(out, project)})."
                f" Fix: resume in that run's directory, name a new run with run_name=NAME (or "
                f"EYAS_RUN_ID=NAME), or replace {out} with train.overwrite=true")
    if resume:
        if resume == "latest" and ckpt.latest(out / "checkpoints") is None:
            log.warning("train.resume=latest: %s holds no complete checkpoint (%s); training "
                        "starts at step 0 in it", out, describe(out, project))
        return None
    return (f"the run directory {out} is not empty ({describe(out, project)}). Fix: resume that run "
            f"with train.resume=latest, replace it with train.overwrite=true, or name a new "
            f"run with run_name=NAME (or EYAS_RUN_ID=NAME)")


def _resolved(resume: str) -> Path:
    return Path(resume).expanduser().resolve()


def _run_of(resume: str) -> Path:
    """The run directory a checkpoint belongs to: <run>/checkpoints/step-N -> <run>."""
    path = _resolved(resume)
    if path.name == "checkpoints":
        return path.parent
    return path.parent.parent if path.parent.name == "checkpoints" else path.parent


def remove_run(out: Path, project: str | None = None) -> list[str]:
    """Remove what a run wrote into `out` (train.overwrite=true); the names removed."""
    entries = run_entries(out, project)
    what = describe(out, project)
    for p in entries:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
    kept = sorted(p.name for p in _listing(out))
    log.warning("train.overwrite=true: removed the previous run from %s (%s)%s", out, what,
                f"; kept {', '.join(kept)} (not written by eyas)" if kept else "")
    return [p.name for p in entries]


def claim(accelerator, out: Path, *, resume: str | None, overwrite: bool,
          project: str | None = None) -> DirLock | None:
    """Rank 0 takes the run directory's lock and decides whether this run may write into `out`
    (`verdict`; `project`: tracker.project), before anything is written; every rank raises the
    same ConfigError when it may not. Returns rank 0's lock (None on the other ranks), held
    until it is released or the process ends."""
    message, lock = None, None
    if accelerator.is_main_process:
        try:
            lock = DirLock(out, what="run directory").acquire()
            message = verdict(out, resume=resume, overwrite=overwrite, project=project)
            if message is None:
                ckpt.clean_leftovers(out / "checkpoints")
        except DirectoryLocked as e:
            message = f"train.resume={resume}: {e}" if resume else str(e)
        except OSError as e:
            message = f"the run directory {out} could not be prepared: {e}"
    shared = [message]
    if accelerator.num_processes > 1:
        broadcast_object_list(shared, from_process=0)
    if shared[0]:
        if lock is not None:
            lock.release()
        raise ConfigError(shared[0])
    return lock
