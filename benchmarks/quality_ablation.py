"""Drafter-quality ablations side by side on one GPU: one training job per variant, all on the
same embedded dataset, all scored on the same held-out prompts (the quality recipe's real
decoding and held-out decoder walk).

    python benchmarks/quality_ablation.py --out /tmp/abl \\
        --common "+experiment=smollm2_quality data.synthetic_prompts=6000 eval.processes=4" \\
        norms= "nonorm=drafter.norm_before_fc=false drafter.fc_norm=false" \\
        fp8=drafter.fp8=tensorwise

(the recipe turns on the EAGLE-3.1 norms drafter.norm_before_fc and drafter.fc_norm, so
`norms=` is the recipe as it is and the reference of the ratios; on one H200, with the
recipe's settings before 2026-12-04: dataset ~3.5 min, the three trainings side by side
~4 min, their real decoding ~3.5 min; benchmarks/README.md has the table.)

The first variant builds the dataset (synthesise → generate → extract, cached under
data.cache_dir); the others start once its trainer has logged the drafter (the dataset is then
complete and only read), so they train and decode concurrently. A variant that changes a
setting of the dataset (a data.* field such as data.synthetic_examples) gets a dataset of its
own, which it builds beside the others' training. A small drafter leaves most of an H200 idle,
which is why several fit beside each other; three SmolLM2 trainings ran at ~100 k tokens/s
each there, five at ~60 k. Each variant runs as `run_name=<prefix>-<name>` in
OUT/runs/<name> (the quality recipe's train.resume=latest continues an interrupted one), its
log in OUT/<name>.log. At the end a table (the training batches' τ at the last step every run
logged, eval-split walk, the same within each answer's first eval.max_new_tokens tokens
(the length real decoding checks), held-out walk (with eval.heldout_max_new_tokens longer than
eval.max_new_tokens: within each answer's first eval.max_new_tokens tokens, and the walk over
the longer answers in the next column), real τ with its standard error over prompts,
identical-to-greedy, training seconds) goes to stdout and OUT/ablation.json, with each row's
ratio to the first variant's real τ and that ratio's standard error paired over the prompts
(both decoded the same prompts, and the same text when both are identical to greedy, so what
the prompts share cancels: five times tighter than the two rows' own errors combined on the
64 held-out prompts). At --timeout each running job gets SIGTERM (a training
checkpoints the step it is in and exits 143); stopped runs keep their rows, with what they
logged, and the same command again continues them (a finished training is read back from its
last checkpoint, and only the export and the evaluation run). OUT also holds the run
directories, checkpoints included: from a remote machine, bring back OUT/ablation.json and the
logs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: one process on one GPU needs no launcher, and `accelerate launch` with one process would
#: SIGKILL the trainer 5 s after passing on a SIGTERM, which can be too soon for its checkpoint
LAUNCHER = f"{shlex.quote(sys.executable)} train/main.py"
#: logged by the trainer once the dataset exists (train/trainer.py)
DATASET_READY = "trainable parameters"


def parse_variant(spec: str) -> tuple[str, list[str]]:
    """"NAME=OVERRIDES" → (NAME, [override, ...]); "base=" is the common settings alone."""
    name, sep, rest = spec.partition("=")
    if not sep or not name or not name.replace("-", "").replace("_", "").isalnum():
        raise SystemExit(f"quality_ablation: variant {spec!r} is not NAME=OVERRIDES (NAME of "
                         f"letters, digits, - and _; e.g. norm=drafter.norm_before_fc=true, "
                         f"or base= for the common settings alone)")
    return name, shlex.split(rest)


def start(name: str, overrides: list[str], args, log_dir: Path) -> subprocess.Popen:
    cmd = [*shlex.split(args.launcher), *shlex.split(args.common), *overrides,
           f"run_name={args.prefix}-{name}", f"hydra.run.dir={run_dir(args, name)}"]
    print(f"[{time.strftime('%H:%M:%S')}] start {name}: {shlex.join(overrides) or '(common)'}",
          flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log_dir / f"{name}.log", "ab") as log:   # the child keeps its own descriptor
        log.write(f"$ {shlex.join(cmd)}\n".encode())
        log.flush()
        return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


def wait_for_dataset(proc: subprocess.Popen, log: Path, offset: int, deadline: float) -> bool:
    """True once the first job's trainer logged the drafter (in the log past `offset`, what
    this invocation wrote); False if the job ended or the deadline passed."""
    while time.monotonic() < deadline:
        with open(log, "rb") as f:
            f.seek(offset)
            if DATASET_READY.encode() in f.read():
                return True
        if proc.poll() is not None:
            return False
        time.sleep(2)
    return False


def stop_all(procs: dict[str, subprocess.Popen], grace: float = 60.0) -> dict[str, int]:
    """SIGTERM every job's process group at once (a training saves a checkpoint of its step
    and ends, `train.stop`), then wait for each whole group, not only its launcher, so that no
    process is still writing on return; SIGKILL a group still there after `grace` s. (Ranks
    of a multi-process launch live in sessions of their own: torch's agent forwards the
    signal to them and waits for them itself.) Returns {name: exit status}."""
    for p in procs.values():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs.values():
        while time.monotonic() < deadline and _group_alive(p):
            time.sleep(0.5)
        if _group_alive(p):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
    return {name: p.wait() for name, p in procs.items()}


def _group_alive(proc: subprocess.Popen) -> bool:
    proc.poll()                                 # reaps the launcher once it has ended
    try:
        os.killpg(proc.pid, 0)
    except ProcessLookupError:
        return False
    return True


def row(name: str, overrides: list[str], summary: dict | None, rc: int | None) -> dict:
    """One table row from a run's summary.json (None: the run wrote none)."""
    s = summary or {}
    spec = s.get("speculative") or {}
    off = s.get("heldout_offline") or {}
    return {"name": name, "overrides": overrides, "exit": rc, "steps": s.get("steps"),
            "eval_walk": eval_walk(s), "eval_walk_capped": eval_walk(s, "tau_trajectory_capped"),
            "heldout_walk": off.get("tau_trajectory_capped", off.get("tau_trajectory")),
            "heldout_walk_long": (off.get("tau_trajectory")
                                  if off.get("tau_trajectory_capped") is not None else None),
            "heldout_long_tokens": off.get("max_new_tokens") if off.get("walk_cap") else None,
            "real_tau": spec.get("tau"), "real_tau_se": spec.get("tau_se_prompts"),
            "identical": spec.get("tokens_identical"), "stage_seconds": s.get("stage_seconds"),
            "alpha": eval_alpha(s), "tau_alpha": (s.get("eval") or {}).get("tau_alpha"),
            "per_prompt": [[p["prompt"], p["accepted"], p["rounds"]]
                           for p in spec.get("per_prompt") or []]}


def eval_walk(summary: dict, key: str = "tau_trajectory") -> float | None:
    """The eval-split decoder walk of the exported weights (key: `tau_trajectory`, or
    `tau_trajectory_capped` for the walk within each answer's first eval.max_new_tokens
    tokens), as the run's checkpoint selection recorded it (export.select=best can export an
    earlier step than the last eval's, and a re-run that resumed at the final step evaluates
    nothing itself); without that record, the run's last eval."""
    sel = summary.get("checkpoint_selection") or {}
    exported = (sel.get(sel.get("exported")) or {}).get(key)
    if exported is not None:
        return exported
    return summary.get(key, (summary.get("eval") or {}).get(key))


def eval_alpha(summary: dict) -> list[float] | None:
    """The last eval's expected acceptance α per TTT step (`alpha_k`), or None."""
    ev = summary.get("eval") or {}
    rates = [ev[f"alpha_{k}"] for k in range(len(ev)) if f"alpha_{k}" in ev]
    return rates or None


def step_ms(metrics: Path) -> float | None:
    """The median wall time per optimizer step over the logged windows after the first (which
    holds the compile), from a run's metrics.jsonl."""
    if not metrics.is_file():
        return None
    import statistics
    from eyas.train.plots import read_records
    ms = [float(r["train/step_ms"]) for r in read_records(metrics)
          if r.get("train/step_ms") is not None]
    return statistics.median(ms[1:] or ms) if ms else None


def train_curve(metrics: Path) -> dict[int, float]:
    """{step: τ of the training batches} from a run's metrics.jsonl (the logged windows); a
    line cut off by a stopped run is skipped."""
    if not metrics.is_file():
        return {}
    from eyas.train.plots import read_records
    return {int(r["step"]): float(r["train/tau"]) for r in read_records(metrics)
            if r.get("train/tau") is not None}


def with_ratios(rows: list[dict]) -> list[dict]:
    """Each row's real τ and held-out walk as a ratio to the first row's (None where absent);
    `real_tau_ratio_se`, the real-τ ratio's standard error paired over the prompts both decoded
    (`models.expected_tau.paired_ratio_se`; None unless both decoded the same prompts); and
    `train_tau_common`: its training-batch τ at the last step every run logged (so runs cut
    short are still compared at one step; a run that logged nothing is left out of it). Each
    row's `train_tau` becomes a list of [step, τ] pairs."""
    from eyas.models.expected_tau import paired_ratio_se
    ref = rows[0] if rows else {}
    for r in rows:
        for key in ("real_tau", "heldout_walk"):
            a, b = r.get(key), ref.get(key)
            r[f"{key}_ratio"] = round(a / b, 4) if a is not None and b else None
        mine, theirs = r.get("per_prompt") or [], ref.get("per_prompt") or []
        same = mine and [p[0] for p in mine] == [p[0] for p in theirs]
        r["real_tau_ratio_se"] = (round(paired_ratio_se([p[1:] for p in theirs],
                                                        [p[1:] for p in mine]), 4)
                                  if same and r.get("real_tau_ratio") is not None else None)
    logged = [set(r.get("train_tau", {})) for r in rows if r.get("train_tau")]
    step = max(set.intersection(*logged), default=None) if logged else None
    for r in rows:
        tau = r.get("train_tau", {}).get(step)
        r["train_tau_common"] = None if tau is None else {"step": step, "tau": tau}
        r["train_tau"] = sorted(r.get("train_tau", {}).items())   # [[step, τ], ...] in JSON
    return rows


def table(rows: list[dict]) -> str:
    def f(x, spec=".3f"):
        return "–" if x is None else format(x, spec)
    common = next((r["train_tau_common"] for r in rows if r["train_tau_common"]), None)
    at = f"train τ @{common['step']}" if common else "train τ"
    head = ("| variant | exit | steps | " + at + " | eval-split walk | the same, first "
            "eval.max_new_tokens | held-out walk | the same, longer answers | real τ ± s.e. | "
            "× first ± paired s.e. | identical | eval α per step | τ of the α chain | step ms "
            "| train s |")
    lines = [head, "|" + "---|" * 15]
    for r in rows:
        stages = r.get("stage_seconds") or {}
        train = (r["train_tau_common"] or {}).get("tau")
        same = "–" if r["identical"] is None else r["identical"]
        lines.append(f"| {r['name']} | {f(r['exit'], 'd')} | {f(r['steps'], 'd')} | "
                     f"{f(train)} | {f(r['eval_walk'])} | {f(r.get('eval_walk_capped'))} | "
                     f"{f(r['heldout_walk'])} | {long_walk(r)} | "
                     f"{f(r['real_tau'])} ± {f(r['real_tau_se'])} | "
                     f"{f(r['real_tau_ratio'], '.4f')} ± {f(r['real_tau_ratio_se'], '.4f')} | "
                     f"{same} | {' '.join(f(a, '.2f') for a in r.get('alpha') or [None])} | "
                     f"{f(r.get('tau_alpha'))} | {f(r.get('step_ms'), '.1f')} | "
                     f"{f(stages.get('train'), '.0f')} |")
    return "\n".join(lines)


def long_walk(r: dict) -> str:
    """The held-out walk over answers longer than the real check's (eval.heldout_max_new_tokens),
    with their length; "–" without them."""
    if r.get("heldout_walk_long") is None:
        return "–"
    return f"{r['heldout_walk_long']:.3f} (≤ {r['heldout_long_tokens']})"


def run_dir(args, name: str) -> Path:
    return Path(args.out).resolve() / "runs" / name


def read_summary(args, name: str, *, since: float) -> dict | None:
    """The run's summary.json if this invocation wrote it (not one left by an earlier run)."""
    path = run_dir(args, name) / "summary.json"
    if not path.is_file() or path.stat().st_mtime < since:
        return None
    return json.loads(path.read_text())


def run_jobs(variants: list[tuple[str, list[str]]], args, out: Path,
             procs: dict[str, subprocess.Popen]) -> dict[str, int]:
    """Start the first variant, the rest once its dataset is ready; their exit statuses."""
    deadline = time.monotonic() + args.timeout
    (first, first_ov), rest = variants[0], variants[1:]
    log = out / f"{first}.log"
    offset = log.stat().st_size if log.is_file() else 0
    procs[first] = start(first, first_ov, args, out)
    if rest and not wait_for_dataset(procs[first], log, offset, deadline):
        print(f"quality_ablation: {first} ended or timed out before its dataset was ready; "
              f"see {log}", file=sys.stderr)
    elif rest:
        for name, ov in rest:
            procs[name] = start(name, ov, args, out)
            time.sleep(args.stagger)
    codes = {}
    for name, p in procs.items():
        try:
            codes[name] = p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            break
    late = {n: p for n, p in procs.items() if n not in codes and p.poll() is None}
    codes.update({n: p.returncode for n, p in procs.items() if n not in codes and n not in late})
    codes.update(stop_all(late))     # every late job gets SIGTERM at once, then all are awaited
    for name in late:
        print(f"quality_ablation: {name} passed --timeout and was stopped", file=sys.stderr)
    return codes


def run(args) -> list[dict]:
    variants = [parse_variant(v) for v in args.variants]
    names = [n for n, _ in variants]
    if len(set(names)) != len(names):
        raise SystemExit(f"quality_ablation: variant names repeat: {names}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    procs: dict[str, subprocess.Popen] = {}
    try:
        codes = run_jobs(variants, args, out, procs)
    finally:   # interrupted or failed here: no training is left running on the GPU
        stop_all({n: p for n, p in procs.items() if p.poll() is None})
    rows = [row(n, ov, read_summary(args, n, since=started), codes.get(n))
            for n, ov in variants]
    for r in rows:
        r["train_tau"] = train_curve(run_dir(args, r["name"]) / "metrics.jsonl")
        r["step_ms"] = step_ms(run_dir(args, r["name"]) / "metrics.jsonl")
    rows = with_ratios(rows)
    from eyas.data.common.utils import atomic_write_bytes
    record = {"common": args.common, "launcher": args.launcher, "rows": rows}
    atomic_write_bytes(out / "ablation.json", (json.dumps(record, indent=1) + "\n").encode())
    print(table(rows))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("variants", nargs="+", help="NAME=OVERRIDES, the first the reference "
                   "(base= for the common settings alone)")
    p.add_argument("--out", required=True, help="directory for the logs and ablation.json")
    p.add_argument("--common", default="+experiment=smollm2_quality",
                   help="Hydra overrides every variant gets (default: %(default)s)")
    p.add_argument("--launcher", default=LAUNCHER, help="the training command before the "
                   "overrides (default: %(default)s)")
    p.add_argument("--prefix", default="ablation", help="run names are PREFIX-NAME")
    p.add_argument("--stagger", type=float, default=10.0,
                   help="seconds between starting the variants after the first")
    p.add_argument("--timeout", type=float, default=7200.0,
                   help="seconds for the whole ablation; running jobs then get SIGTERM "
                        "(a training checkpoints its step and ends; the same command continues)")
    rows = run(p.parse_args(argv))
    return 0 if all(r["exit"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
