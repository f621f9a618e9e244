#!/usr/bin/env python3
"""Train an EAGLE-3 drafter with vLLM speculators' OWN trainer on an eyas dataset.

The peer's code does the whole run, unmodified, at the pinned commit c05b95b3: its
`scripts/train.py` (TrainConfig CLI -> build_draft_model -> create_train_val_loaders ->
Trainer.run_training), so the model, the KL loss over the TTT unroll, the optimizer(s), the
scheduler, clipping, packing, noise and checkpointing are all speculators'. This script only

  1. finds the speculators source (`--speculators`: a checkout at c05b95b3, or a git directory
     from which scripts/, src/ and hs_connectors/ are extracted at c05b95b3 into
     `.peers/speculators-c05b95b3`, the folder used by default afterwards; the device machine
     gets it with carry: [".peers"]);
  2. resolves `--target` (an eyas preset such as tiny-llama / smollm2, a hub id already in the
     HF cache, or a directory; default: the target recorded in DATA/eyas_export.json) to a local
     HF directory: speculators reads the verifier's config, tokenizer and its embed_tokens /
     lm_head / model.norm weights from it (`--verifier-name-or-path`), offline;
  3. runs `scripts/train.py` in a child process (`torch.distributed.run` with --nproc > 1) with
     the peer source appended at the END of sys.path (real `datasets` / `openai` win) and:
       --data-path DATA (an `eyas export-data --format speculators` directory: rows, hidden
       states, token_freq.pt, and d2t.npy/t2d.npy, which speculators loads as the draft vocab)
       --target-layer-ids (the export's aux ids) --on-missing raise --save-path OUT/checkpoints
       and, with --shape eyas (default), the drafter eyas trains and imports: 1 decoder layer,
       full attention, no norm before the residual / before fc / on the output
       (--no-norm-before-residual --no-norm-before-fc --no-norm-output
       --full-attention-indices 0); --shape speculators keeps speculators' eagle3 defaults
       (norm_before_residual, norm_before_fc, norm_output, sliding window 2048), which eyas's
       importer refuses (norm_before_residual);
  4. records (passively) every dict speculators' metric logger emits to OUT/metrics.jsonl and
     times Trainer.run_training, then writes OUT/result.json (and prints it): optimizer steps,
     tokens seen (non-padding positions of the packed batches), wall seconds, the checkpoint
     directory (speculators' native format: OUT/checkpoints/<epoch>/config.json +
     model.safetensors in bf16), and the resolved training settings;
  5. with --check-import (default), reads the checkpoint with eyas's importer
     (eyas.models.serving.importer.import_drafter).

Without an accelerator (a CPU machine, or --device cpu) speculators' trainer cannot run as is;
these in-process shims are installed in the child (no peer file is edited), and only then:
  * Trainer.local_rank -> torch.device("cpu"): trainer.py:289 `self.model.to(self.local_rank)`
    (and :453/:547 for batches) pass the int 0, an accelerator index ("Cannot access accelerator
    device when none is available");
  * Trainer.device_type -> "cpu": trainer.py:182 falls back to "cuda" for autocast;
  * torch.accelerator.synchronize -> no-op: the step timer (trainer.py:57/67, every step at its
    default --log-freq 1) raises without an accelerator;
  * checkpointer.get_current_device -> "cpu" (utils/util.py:17 says "cuda:0"; resume only);
and these of its own flags are passed (overridable after `--`): --draft-attn-impl sdpa
(FlexAttention has no CPU backward: "FlexAttention does not support backward on CPU"),
--loss-implementation eager (the fused loss is a Triton kernel), --num-workers 0.
On CUDA nothing is patched and speculators' defaults stand (flex attention, fused loss,
torch.compile of the forward, 12 spawn data workers).

Usage (repository root):
  .venv/bin/eyas export-data --format speculators DATASET SPEC --vocab VOCAB.safetensors
  .venv/bin/python benchmarks/peer_speculators.py --data SPEC --target tiny-llama --out RUN \\
      --epochs 2 --lr 1e-3 --ttt-steps 3 --token-budget 512 [--speculators GITDIR] \\
      [-- any other scripts/train.py flag]
Needs in the venv (beyond eyas's): pydantic-settings, loguru (speculators' schema / loaders).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMIT = "c05b95b3"
PEER_DIR = ROOT / ".peers" / f"speculators-{COMMIT}"
#: what a speculators checkout needs for scripts/train.py (relative to its root)
TREE = ("scripts/train.py", "src/speculators", "hs_connectors/src/hs_connectors")
#: speculators' config.py reads importlib.metadata.version("speculators") at import
DIST_INFO = "speculators-0.0.0+c05b95b.dist-info"
#: scripts/train.py flags this script sets itself (pass others after `--`)
OWN_FLAGS = ("--verifier-name-or-path", "--data-path", "--save-path", "--log-dir")
#: --shape eyas: the drafter eyas trains (models/config.py defaults) and can import
EYAS_SHAPE = ["--num-layers", "1", "--no-norm-before-residual", "--no-norm-before-fc",
              "--no-norm-output", "--full-attention-indices", "0"]
#: CPU: speculators' own flags for hardware without flex attention / Triton
CPU_FLAGS = {"--draft-attn-impl": "sdpa", "--loss-implementation": "eager",
             "--num-workers": "0"}


def log(*a) -> None:
    print("[peer_speculators]", *a, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# The speculators source
# ---------------------------------------------------------------------------------------------

def _git(args: list[str], git_dir: Path, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["git", f"--git-dir={git_dir}", *args], check=True, **kw)


def _git_dir(path: Path) -> Path | None:
    """The git directory of `path` (a bare/mirror repository or a work tree), else None."""
    for cand in (path, path / ".git"):
        if (cand / "HEAD").is_file() and (cand / "objects").is_dir():
            return cand
    return None


def _complete(d: Path) -> bool:
    return all((d / p).exists() for p in TREE)


def materialise(git_dir: Path, out: Path) -> Path:
    """scripts/train.py, src/speculators and hs_connectors at COMMIT from `git_dir` -> `out`."""
    try:
        _git(["cat-file", "-e", f"{COMMIT}^{{commit}}"], git_dir, capture_output=True)
    except subprocess.CalledProcessError:
        sys.exit(f"{git_dir}: has no commit {COMMIT} (fetch vllm-project/speculators first)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        with tempfile.TemporaryFile() as tarf:
            _git(["archive", "--format=tar", COMMIT, *TREE], git_dir, stdout=tarf)
            tarf.seek(0)
            with tarfile.open(fileobj=tarf) as tar:
                try:
                    tar.extractall(tmp, filter="data")
                except TypeError:               # a Python without extraction filters
                    tar.extractall(tmp)
        (tmp / "COMMIT").write_text(COMMIT + "\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"extracted speculators {COMMIT} ({', '.join(TREE)}) from {git_dir} into {out}")
    return out


def find_speculators(arg: str | None) -> tuple[Path, str]:
    """(checkout root holding TREE, its commit or 'unknown')."""
    cand = arg or os.environ.get("EYAS_SPECULATORS_REPO")
    if cand:
        p = Path(cand).expanduser().resolve()
        if _complete(p):
            commit = "unknown"
            if (p / "COMMIT").is_file():
                commit = (p / "COMMIT").read_text().strip()
            elif (g := _git_dir(p)) is not None:
                commit = _git(["rev-parse", "HEAD"], g, capture_output=True,
                              text=True).stdout.strip()
            if not commit.startswith(COMMIT):
                log(f"WARNING: {p} is at commit {commit}, not the pinned {COMMIT}")
            return p, commit
        g = _git_dir(p)
        if g is None:
            sys.exit(f"--speculators {p}: neither a speculators checkout ({', '.join(TREE)}) nor "
                     f"a git directory")
        return materialise(g, PEER_DIR), COMMIT
    if _complete(PEER_DIR):
        return PEER_DIR, (PEER_DIR / "COMMIT").read_text().strip()
    sys.exit(f"no speculators source: pass --speculators DIR (a checkout of "
             f"vllm-project/speculators at {COMMIT}, or its git directory, which is extracted "
             f"into {PEER_DIR}), or set EYAS_SPECULATORS_REPO. The peers archive "
             f"(../shared/peers/peers.tgz) lacks scripts/train.py. Fix: git clone "
             f"https://github.com/vllm-project/speculators && git -C speculators checkout "
             f"{COMMIT}")


def meta_dir(commit: str) -> Path:
    """A folder holding speculators' package metadata (config.py reads its version)."""
    d = PEER_DIR.parent / f"speculators-meta-{commit[:8]}"
    info = d / DIST_INFO
    if not (info / "METADATA").is_file():
        info.mkdir(parents=True, exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: speculators\n"
                                       f"Version: 0.0.0+{commit[:7]}\n")
    return d


# ---------------------------------------------------------------------------------------------
# The child: scripts/train.py in this interpreter, shims only without an accelerator
# ---------------------------------------------------------------------------------------------

def child_main(spec_file: str, train_args: list[str]) -> None:
    import logging
    import runpy
    from collections.abc import Mapping

    spec = json.loads(Path(spec_file).read_text())
    for p in spec["sys_path"]:            # after site-packages: the real packages win
        if p not in sys.path:
            sys.path.append(p)
    import torch
    import speculators.train.checkpointer as checkpointer
    import speculators.train.logger as sp_logger
    import speculators.train.trainer as trainer

    rank0 = int(os.environ.get("RANK", "0")) == 0
    timing: dict = {}

    if spec["cpu_shims"]:
        cpu = torch.device("cpu")
        trainer.get_local_rank = lambda: cpu
        init = trainer.Trainer.__init__

        def __init__(self, *a, **k):
            init(self, *a, **k)
            self.device_type = "cpu"
        trainer.Trainer.__init__ = __init__
        torch.accelerator.synchronize = lambda *a, **k: None
        checkpointer.get_current_device = lambda: "cpu"

    class Jsonl(logging.Handler):
        """Every dict speculators' metric logger emits, one JSON line each (rank 0)."""

        def __init__(self, path: str):
            super().__init__()
            self.f = open(path, "a")

        def emit(self, record):
            msg = record.msg
            if not isinstance(msg, Mapping):
                return
            kind = "config" if getattr(record, "hparams", False) else \
                "train" if "train" in msg else "val" if "val" in msg else "other"
            self.f.write(json.dumps({"kind": kind, "time": record.created,
                                     "step": getattr(record, "step", None), **msg},
                                    default=str) + "\n")
            self.f.flush()

    setup = sp_logger.setup_metric_logger

    def setup_metric_logger(*a, **k):
        setup(*a, **k)                    # its dictConfig replaces handlers: add ours after
        if rank0:
            logging.getLogger("speculators.metrics").addHandler(Jsonl(spec["metrics"]))
    sp_logger.setup_metric_logger = setup_metric_logger

    run = trainer.Trainer.run_training

    def run_training(self, *a, **k):
        timing["train_start"] = time.time()
        try:
            return run(self, *a, **k)
        finally:
            timing["train_end"] = time.time()
            if rank0:
                Path(spec["timing"]).write_text(json.dumps(timing))
    trainer.Trainer.run_training = run_training

    sys.argv = [spec["train_script"], *train_args]
    runpy.run_path(spec["train_script"], run_name="__main__")


# ---------------------------------------------------------------------------------------------
# The parent
# ---------------------------------------------------------------------------------------------

def resolve_verifier(target: str) -> Path:
    p = Path(target).expanduser()
    if (p / "config.json").is_file():
        return p.resolve()
    from eyas.data.common.targets import resolve_target     # presets, HF-cache hub ids
    return Path(resolve_target(target)).resolve()


def has_accelerator() -> bool:
    import torch
    acc = getattr(torch, "accelerator", None)
    return bool(acc and acc.current_accelerator() is not None)


def _flag_given(extra: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in extra)


def build_train_args(a, verifier: Path, export: dict, save: Path, logs: Path,
                     cpu: bool) -> tuple[list[str], list[str]]:
    """(scripts/train.py argv, notes on what was set for this machine)."""
    args = ["--verifier-name-or-path", str(verifier), "--data-path", str(a.data),
            "--save-path", str(save), "--log-dir", str(logs), "--on-missing", "raise"]
    aux = export.get("aux_layer_ids")
    if aux and not _flag_given(a.extra, "--target-layer-ids"):
        args += ["--target-layer-ids", *map(str, aux)]
    if a.shape == "eyas":
        args += EYAS_SHAPE
    for flag, val in (("--epochs", a.epochs), ("--lr", a.lr), ("--ttt-steps", a.ttt_steps),
                      ("--total-seq-len", a.token_budget), ("--optimizer", a.optimizer),
                      ("--draft-vocab-size", a.draft_vocab_size), ("--max-steps", a.max_steps),
                      ("--seed", a.seed), ("--num-workers", a.num_workers)):
        if val is not None:
            args += [flag, str(val)]
    notes = []
    if cpu:
        for flag, val in CPU_FLAGS.items():
            if not _flag_given(a.extra + args, flag):
                args += [flag, val]
                notes.append(f"{flag} {val}")
    return args + a.extra, notes


def summarise(metrics_file: Path, timing_file: Path, save: Path, wall: float) -> dict:
    recs = [json.loads(l) for l in metrics_file.read_text().splitlines()] \
        if metrics_file.is_file() else []
    train = [r for r in recs if r["kind"] == "train"]
    val = [r for r in recs if r["kind"] == "val"]
    config = next((r for r in recs if r["kind"] == "config"), {})
    tokens = 0
    step_s = 0.0
    for r in train:
        prof = r.get("profile") or {}
        ms = float(prof.get("step_ms", 0.0))
        tokens += round(float(prof.get("tokens_per_s", 0.0)) * ms / 1e3)
        step_s += ms / 1e3
    epochs = sorted(int(p.name) for p in save.iterdir() if p.is_dir() and not p.is_symlink()
                    and p.name.isdigit()) if save.is_dir() else []
    ckpt = save / str(epochs[-1]) if epochs else None
    state = {}
    if ckpt is not None and (ckpt / "training_state.json").is_file():
        state = json.loads((ckpt / "training_state.json").read_text())
    steps = int(state.get("global_step", len(train)))
    timing = json.loads(timing_file.read_text()) if timing_file.is_file() else {}
    best = save / "checkpoint_best"
    out = {
        "steps": steps, "tokens_seen": tokens,
        "tokens_seen_note": "non-padding positions of the packed [1, total_seq_len] batches "
                            "(rank 0's), from speculators' per-step profile",
        "wall_s": round(wall, 3),
        "train_loop_s": round(timing["train_end"] - timing["train_start"], 3)
        if "train_end" in timing else None,
        "step_s_sum": round(step_s, 3),
        "checkpoint_dir": str(ckpt) if ckpt else None,
        "checkpoint_best": str(best.resolve()) if best.exists() else None,
        "epochs_saved": epochs,
        "logged_train_steps": len(train),
        "loss_first": train[0]["train"].get("loss") if train else None,
        "loss_last": train[-1]["train"].get("loss") if train else None,
        "val_last": val[-1]["val"] if val else None,
    }
    if config:
        flat = {k: v for g in config.values() if isinstance(g, dict) for k, v in g.items()}
        flat.update({k: v for k, v in config.items() if not isinstance(v, dict)})
        keys = ("speculator_type", "optimizer", "lr", "muon_lr", "weight_decay",
                "muon_weight_decay", "scheduler_type", "scheduler_warmup_steps",
                "scheduler_warmup_ratio", "loss_fn", "loss_implementation", "ttt_steps",
                "ttt_step_loss_decay", "total_seq_len", "noise_std", "train_data_ratio",
                "epochs", "max_steps", "draft_attn_impl", "num_layers", "norm_before_residual",
                "norm_before_fc", "norm_output", "full_attention_indices", "sliding_window",
                "target_layer_ids", "embed_requires_grad", "hidden_states_dtype", "seed")
        out["settings"] = {k: flat.get(k) for k in keys if k in flat}
    return out


def check_import(ckpt: str, verifier: Path) -> dict:
    """eyas's importer and its serving-contract check (`eyas validate`) on the checkpoint."""
    out: dict = {}
    try:
        from eyas.models.serving.importer import import_drafter
        d = import_drafter(ckpt)
        c = d.config
        out["import"] = {"ok": True, "source_format": d.source_format,
                         "draft_vocab_size": c.draft_vocab_size, "hidden_size": c.hidden_size,
                         "aux_layer_ids": list(c.aux_layer_ids),
                         "norm_before_fc": c.norm_before_fc, "norm_output": c.norm_output,
                         "tensors": sorted(d.state_dict)}
    except Exception as e:  # noqa: BLE001
        out["import"] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    try:
        from eyas.models.serving.validate import validate
        found = validate(ckpt, str(verifier))
        out["validate"] = {sev: sorted(f.code for f in found if f.severity == sev)
                           for sev in sorted({f.severity for f in found})}
    except Exception as e:  # noqa: BLE001
        out["validate"] = {"error": f"{type(e).__name__}: {e}"}
    return out


def parse(argv: list[str]) -> argparse.Namespace:
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(
        description="Train an EAGLE-3 drafter with vLLM speculators' own scripts/train.py "
                    "(commit c05b95b3) on an `eyas export-data --format speculators` dataset; "
                    "flags after `--` go to scripts/train.py verbatim.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--data", required=True, help="export-data --format speculators directory")
    ap.add_argument("--target", help="verifier: eyas preset, HF-cache hub id or directory "
                    "(default: DATA/eyas_export.json's target)")
    ap.add_argument("--out", required=True, help="run directory (checkpoints/, logs/, "
                    "metrics.jsonl, train.log, result.json); must be new or empty")
    ap.add_argument("--speculators", help="speculators checkout at c05b95b3, or its git "
                    f"directory (extracted into {PEER_DIR}); default $EYAS_SPECULATORS_REPO, "
                    f"else {PEER_DIR}")
    ap.add_argument("--epochs", type=int, help="--epochs (speculators' default 20)")
    ap.add_argument("--lr", type=float, help="--lr, AdamW (group) LR; Muon's is 10x unless "
                    "--muon-lr is passed after -- (speculators' default 1e-4)")
    ap.add_argument("--ttt-steps", "--k", type=int, dest="ttt_steps",
                    help="TTT unroll K (speculators' default 3)")
    ap.add_argument("--token-budget", "--total-seq-len", type=int, dest="token_budget",
                    help="packed tokens per step (--total-seq-len; speculators' default 8192)")
    ap.add_argument("--optimizer", choices=("muon", "adamw"),
                    help="speculators' default: muon (Muon on 2D weights + AdamW on the rest)")
    ap.add_argument("--draft-vocab-size", type=int, help="only when DATA has no d2t.npy/t2d.npy: "
                    "speculators then builds (and writes into DATA) its own from token_freq.pt")
    ap.add_argument("--max-steps", type=int, help="--max-steps (note: speculators checks it "
                    "after each step, and a later epoch still runs one step before stopping)")
    ap.add_argument("--seed", type=int, help="--seed (speculators' default 42)")
    ap.add_argument("--num-workers", type=int, help="data workers (speculators' default 12; "
                    "0 on CPU)")
    ap.add_argument("--shape", choices=("eyas", "speculators"), default="eyas",
                    help="eyas: the drafter eyas trains and imports (no norm before residual/"
                    "fc/output, full attention); speculators: its eagle3 defaults")
    ap.add_argument("--device", choices=("auto", "cpu"), default="auto",
                    help="cpu: hide GPUs (CUDA_VISIBLE_DEVICES='') and use the CPU shims")
    ap.add_argument("--nproc", type=int, default=1, help="GPUs (torch.distributed.run)")
    ap.add_argument("--json", help="also write the result here (default: OUT/result.json)")
    ap.add_argument("--check-import", action=argparse.BooleanOptionalAction, default=True,
                    help="read the checkpoint with eyas's importer afterwards")
    a = ap.parse_args(argv)
    a.extra = extra
    for f in OWN_FLAGS:
        if _flag_given(extra, f):
            ap.error(f"{f} is set by this script")
    return a


def main(argv: list[str]) -> int:
    a = parse(argv)
    a.data = Path(a.data).resolve()
    if not (a.data / "hidden_states").is_dir() or not (a.data / "state.json").is_file():
        sys.exit(f"--data {a.data}: not an `eyas export-data --format speculators` directory")
    export = {}
    if (a.data / "eyas_export.json").is_file():
        export = json.loads((a.data / "eyas_export.json").read_text())
    target = a.target or export.get("target")
    if not target:
        sys.exit("--target is required (DATA/eyas_export.json names none)")
    verifier = resolve_verifier(target)
    if not list(verifier.glob("*.safetensors")):
        sys.exit(f"verifier {verifier}: no *.safetensors (speculators reads embed_tokens, "
                 f"lm_head and model.norm weights from it)")
    repo, commit = find_speculators(a.speculators)
    out = Path(a.out).resolve()
    if out.exists() and any(out.iterdir()):
        sys.exit(f"--out {out} is not empty (speculators would resume from its checkpoints)")
    out.mkdir(parents=True, exist_ok=True)
    save, logs = out / "checkpoints", out / "logs"

    env = dict(os.environ)
    for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        env.setdefault(k, "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    if a.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    cpu = a.device == "cpu" or not has_accelerator()
    if cpu and a.nproc > 1:
        sys.exit("--nproc > 1 needs GPUs")
    train_args, notes = build_train_args(a, verifier, export, save, logs, cpu)
    if a.max_steps is not None and (a.epochs or 20) > 1:
        log("note: speculators checks --max-steps after each step, so every epoch after the "
            "one that reaches it still runs one step; use --epochs 1 for an exact count")

    spec = {"sys_path": [str(repo / "src"), str(repo / "hs_connectors" / "src"),
                         str(meta_dir(commit))],
            "train_script": str(repo / "scripts" / "train.py"), "cpu_shims": cpu,
            "metrics": str(out / "metrics.jsonl"), "timing": str(out / "timing.json")}
    (out / "child_spec.json").write_text(json.dumps(spec, indent=1))
    launcher = [sys.executable]
    if a.nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone",
                     f"--nproc_per_node={a.nproc}"]
    cmd = [*launcher, str(Path(__file__).resolve()), "_child", str(out / "child_spec.json"),
           "--", *train_args]
    log("running:", " ".join(cmd))
    t_start = time.time()
    with open(out / "train.log", "w") as lf:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1)
        for line in proc.stdout:
            lf.write(line)
            sys.stderr.write(line)
        rc = proc.wait()
    wall = time.time() - t_start
    result = {"peer": "vllm-project/speculators", "commit": commit,
              "train_script": spec["train_script"], "rc": rc, "device": "cpu" if cpu else
              "accelerator", "nproc": a.nproc, "verifier": str(verifier), "data": str(a.data),
              "command": cmd,
              "cpu_workarounds": (["shim: Trainer.local_rank = cpu (trainer.py:289/453/547)",
                                   "shim: Trainer.device_type = 'cpu' (trainer.py:182)",
                                   "shim: torch.accelerator.synchronize = no-op "
                                   "(trainer.py:57/67)",
                                   "shim: checkpointer.get_current_device = 'cpu' (resume)"]
                                  + [f"flag: {n}" for n in notes]) if cpu else [],
              **summarise(out / "metrics.jsonl", out / "timing.json", save, wall),
              "metrics_file": str(out / "metrics.jsonl"), "log_file": str(out / "train.log")}
    if rc == 0 and a.check_import and result["checkpoint_dir"]:
        result["eyas_check"] = check_import(result["checkpoint_dir"], verifier)
    text = json.dumps(result, indent=1, default=str)
    (out / "result.json").write_text(text + "\n")
    if a.json:
        Path(a.json).write_text(text + "\n")
    print(text)
    return rc


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "_child":
        rest = sys.argv[3:]
        child_main(sys.argv[2], rest[1:] if rest[:1] == ["--"] else rest)
    else:
        sys.exit(main(sys.argv[1:]))
