"""Wall time and peak disk of three ways to train on a target's hidden states, one after the
other on this machine, from the same token dataset and seed:

  extract   `eyas extract` writes the dataset, then the trainer reads it;
  keep_all  `data.stream=true`: the trainer trains while the target captures, keeping the shards
            (epoch 1 streamed, later epochs read them);
  keep_none `data.stream=true data.stream.keep=none`: only a bounded spool, every epoch
            captures again.

    python benchmarks/stream_cost.py --tokens ~/.cache/eyas/datasets/<key>/tokens \\
        --out /tmp/stream-cost --json stream_cost.json train.epochs=3

Extra arguments are Hydra overrides every training gets (the main job's settings otherwise;
its speculative and engine checks are off, since they do not depend on how the states came).
Peak disk is the largest size, sampled every 0.2 s, of what the way writes besides the run's
checkpoints: the dataset (extract, keep_all) or the spool (keep_none). The three exports are
compared tensor by tensor (with data.vocab_count=next_token, which a streamed run counts).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAIN = [sys.executable, str(ROOT / "train" / "main.py")]
CHECKS = ["eval.speculative=false", "eval.engines=false", "eval.heldout_offline=false",
          "data.vocab_count=next_token"]


def du(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass            # a spool file removed while walking
    return total


class PeakDisk(threading.Thread):
    def __init__(self, path: Path):
        super().__init__(daemon=True)
        self.path, self.peak, self.done = path, 0, threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.2):
            self.peak = max(self.peak, du(self.path))

    def stop(self) -> int:
        self.done.set()
        self.join()
        return max(self.peak, du(self.path))


def timed(cmd: list[str], log: Path, watch: Path) -> tuple[float, int]:
    watcher = PeakDisk(watch)
    watcher.start()
    t0 = time.perf_counter()
    with open(log, "w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    dt = time.perf_counter() - t0
    peak = watcher.stop()
    if r.returncode:
        raise SystemExit(f"stream_cost: {' '.join(cmd[:4])} ... failed ({r.returncode}); see {log}")
    return dt, peak


def run(args, overrides: list[str]) -> list[dict]:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common = [*CHECKS, f"target={args.target}", *overrides]
    rows = []
    ds = out / "extract-dataset"
    t_ex, disk = timed(["eyas", "extract", "--tokens", args.tokens, "--target", args.target_name,
                        "--out", str(ds)], out / "extract.log", ds)
    t_tr, _ = timed([*MAIN, *common, f"data.dataset={ds}", f"hydra.run.dir={out / 'extract'}"],
                    out / "extract-train.log", ds)
    rows.append({"way": "extract", "wall_s": t_ex + t_tr, "capture_s": t_ex, "train_s": t_tr,
                 "peak_disk_bytes": disk, "run": str(out / "extract")})
    for keep in ("all", "none"):
        run_dir = out / f"keep_{keep}"
        kept = out / f"keep_{keep}-dataset"
        watch = kept if keep == "all" else run_dir / "stream-spool"
        wall, disk = timed([*MAIN, *common, "data.stream=true", f"data.stream.keep={keep}",
                            f"data.tokens={args.tokens}", f"data.dataset={kept}",
                            f"hydra.run.dir={run_dir}"], out / f"keep_{keep}.log", watch)
        rows.append({"way": f"keep_{keep}", "wall_s": wall, "peak_disk_bytes": disk,
                     "run": str(run_dir)})
    ref = _export(Path(rows[0]["run"]))
    for r in rows:
        got = _export(Path(r["run"]))
        r["export_equal_to_extract"] = got.keys() == ref.keys() and all(
            bool((got[k] == ref[k]).all()) for k in ref)
        r["ratio_wall_to_extract"] = r["wall_s"] / rows[0]["wall_s"]
    return rows


def _export(run_dir: Path) -> dict:
    from safetensors.torch import load_file
    return load_file(str(run_dir / "export" / "model.safetensors"))


def table(rows: list[dict]) -> str:
    lines = ["| way | wall s | × extract | peak disk MiB | export equal |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['way']} | {r['wall_s']:.0f} | {r['ratio_wall_to_extract']:.3f} | "
                     f"{r['peak_disk_bytes'] / 2**20:.1f} | {r['export_equal_to_extract']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", required=True, help="token dataset (eyas prepare)")
    p.add_argument("--target", default="smollm2", help="the trainer's target group")
    p.add_argument("--target-name", default="smollm2", help="the target `eyas extract` loads")
    p.add_argument("--out", required=True, help="work directory (runs, datasets, logs)")
    p.add_argument("--json", help="write the rows here")
    args, overrides = p.parse_known_args(argv)
    rows = run(args, overrides)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"overrides": overrides, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
