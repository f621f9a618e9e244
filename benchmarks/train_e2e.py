"""The REAL trainer end to end on synthetic real-shape data: tokens/s, MFU, data wait, memory.

What it does, in a work directory (default: a temporary one):
  1. target/   a config-only preset made loadable: its config.json plus model.safetensors with
               random bf16 `model.embed_tokens.weight` and `lm_head.weight` [V, tH]
  2. data/     a hidden-state dataset written with data.store.shards.write_shard: documents of
               64-1536 tokens (`--doc-tokens`; 20 % prompt), random aux [n, 3, tH], last [n, tH], input_ids and
               target_argmax (90 % drawn from 30000 frequent ids, so the draft vocabulary the
               trainer builds covers them), ~`--epoch-steps` batches of `--tokens` per epoch
  3. runs `accelerate launch ... train/main.py dist=zero2 tracker=none target.name=target/
     data.dataset=data/ ...` (DeepSpeed ZeRO-2; `--dist ddp` for the DDP path) for `--steps`
     optimizer steps, logging every `--log-every`
  4. reads run/metrics.jsonl: per logged window tokens/s (real tokens, padding excluded),
     step ms (padding included: the figure to hold against train_step.py's step), packing
     fill, MFU (train.tracking.flops_per_token at the train.peak_tflops peak), data-wait fraction
     and peak memory; the summary averages the windows after the first (compile warm-up).

Usage (GPU machine, repository root):
  python benchmarks/train_step.py --trainer --target llama-3.1-8b --tokens 4096 --steps 40 \
      --json $OUT/trainer_llama.json
CPU smoke run: --target tiny-llama --tokens 256 --ttt 3 --draft-vocab 1024 --steps 4 --log-every 2
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent

from eyas.data.store.shards import write_manifest, write_shard
from eyas.data.common.targets import default_aux_layer_ids, load_target_config, text_config


def _randn(shape, device, g) -> torch.Tensor:
    return torch.randn(shape, device=device, generator=g).bfloat16().cpu()


def write_target(out: Path, preset: str, device) -> dict:
    """config.json + model.safetensors (random embedding and head) of a preset's shape."""
    cfg = load_target_config(preset)
    tc = text_config(cfg)
    V, tH = int(tc["vocab_size"]), int(tc["hidden_size"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    g = torch.Generator(device=device).manual_seed(0)
    save_file({"model.embed_tokens.weight": _randn((V, tH), device, g),
               "lm_head.weight": (_randn((V, tH), device, g).float() * 4 * tH ** -0.5).bfloat16()},
              str(out / "model.safetensors"))
    return cfg


def write_dataset(out: Path, cfg: dict, target_dir: Path, tokens: int, device,
                  docs_per_shard: int = 64, doc_tokens: tuple[int, int] = (64, 1536)) -> dict:
    """A hidden-state dataset of about `tokens` tokens (see the module docstring)."""
    tc = text_config(cfg)
    V, tH = int(tc["vocab_size"]), int(tc["hidden_size"])
    ids = default_aux_layer_ids(int(tc["num_hidden_layers"]))
    g = torch.Generator(device=device).manual_seed(1)
    cpu_g = torch.Generator().manual_seed(1)
    frequent = torch.randperm(V, generator=cpu_g)[:min(30000, V)]
    samples, metas, total = [], [], 0
    while total < tokens:
        n = int(torch.randint(doc_tokens[0], doc_tokens[1] + 1, (1,), generator=cpu_g))
        argmax = frequent[torch.randint(0, frequent.numel(), (n,), generator=cpu_g)]
        rand = torch.randint(0, V, (n,), generator=cpu_g)
        samples.append(dict(
            input_ids=torch.randint(0, V, (n,), generator=cpu_g),
            loss_mask=torch.arange(n) >= n // 5,
            aux=_randn((n, 3, tH), device, g), last=_randn((n, tH), device, g),
            target_argmax=torch.where(torch.rand(n, generator=cpu_g) < 0.9, argmax, rand)))
        total += n
        if len(samples) == docs_per_shard:
            metas.append(write_shard(out, len(metas), samples))
            samples = []
    if samples:
        metas.append(write_shard(out, len(metas), samples))
    return write_manifest(out, {"kind": "hidden", "target": str(target_dir),
                                "target_config": cfg, "aux_layer_ids": ids,
                                "convention": "hf_hidden_states", "hidden_size": tH,
                                "teacher": "last"}, metas)


def launch(args, target_dir: Path, data_dir: Path, run_dir: Path) -> tuple[int, float, str]:
    """accelerate launch train/main.py with the overrides of this benchmark."""
    acc = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes",
           str(args.num_processes), "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", "--main_process_port", str(args.port)]
    if args.dist.startswith("zero"):
        acc += ["--use_deepspeed", "--zero_stage", args.dist[-1]]
    elif args.num_processes > 1:
        acc += ["--multi_gpu"]
    overrides = [f"dist={args.dist}", "tracker=none", f"target.name={target_dir}",
                 f"data.dataset={data_dir}", f"data.token_budget={args.tokens}",
                 "data.eval_fraction=0", f"drafter.ttt_steps={args.ttt}",
                 f"drafter.draft_vocab_size={args.draft_vocab}",
                 f"train.max_steps={args.steps + args.profile}",
                 f"train.log_every={args.log_every}", "optim.warmup_steps=0",
                 "export.enabled=false", "eval.speculative=false", f"hydra.run.dir={run_dir}"]
    if args.profile:    # after the timed steps: a profiled step ends with a device sync
        overrides += [f"train.profile_start={args.steps + 1}",
                      f"train.profile_steps={args.profile}"]
    given = {o.split("=", 1)[0] for o in args.override}
    overrides = [o for o in overrides if o.split("=", 1)[0] not in given] + args.override
    cmd = acc + [str(ROOT / "train" / "main.py"), *overrides]
    # eyas comes from the environment (installed, or PYTHONPATH on a device machine); the
    # checkout itself stays off the path: its kernels/ would stand in for the `kernels` package
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="disabled", EYAS_RUN_ID=run_dir.name)
    t = time.perf_counter()
    logf = run_dir.parent / f"{run_dir.name}.log"
    logf.parent.mkdir(parents=True, exist_ok=True)
    with open(logf, "w") as fh:     # own process group: a time-out ends the workers too
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc = 124
    log = logf.read_text(errors="replace")[-12000:]
    return rc, time.perf_counter() - t, " ".join(cmd) + "\n" + log


def summarise(run_dir: Path, upto: int | None = None) -> dict:
    """Windows of metrics.jsonl and their mean after the first (warm-up) window; windows that
    end after step `upto` (the profiled steps of --profile) are listed but not averaged."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return {"windows": []}
    keys = ("tokens_per_s", "step_ms", "fill", "mfu", "data_wait", "peak_mem_gib", "loss",
            "grad_norm")
    windows = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if "train/tokens_per_s" in rec:
            windows.append({"step": rec["step"], **{k: rec.get(f"train/{k}") for k in keys}})
    timed = [w for w in windows if upto is None or w["step"] <= upto]
    steady = timed[1:] or timed
    out = {"windows": windows}
    rank0 = run_dir / "ranks" / "rank0.json"
    if rank0.is_file():                  # what accelerate really set up (no silent fallback)
        r = json.loads(rank0.read_text())
        out.update(world_size=r["world_size"], distributed_type=r["distributed_type"])
    for k in keys:
        vals = [w[k] for w in steady if w[k] is not None]
        if vals:
            out[k] = statistics.mean(vals) if k != "peak_mem_gib" else max(vals)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="train_step --trainer", description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="llama-3.1-8b", help="config-only target preset")
    ap.add_argument("--tokens", type=int, default=4096, help="data.token_budget (T)")
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--steps", type=int, default=40, help="optimizer steps (train.max_steps)")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--epoch-steps", type=int, default=24,
                    help="dataset size in batches of --tokens (more steps reuse it by epochs)")
    ap.add_argument("--doc-tokens", default="64:1536", help="document lengths MIN:MAX (uniform; "
                    "one number: all equal), e.g. 32768 for long-context runs")
    ap.add_argument("--dist", default="zero2", help="dist preset: zero1 | zero2 | zero3 | ddp")
    ap.add_argument("--num-processes", type=int, default=1)
    ap.add_argument("--port", type=int, default=29561)
    ap.add_argument("--timeout", type=int, default=420, help="seconds for the training run")
    ap.add_argument("--workdir", help="keep target/, data/ and run/ here (default: temporary); "
                    "a workdir that already holds data/ is reused as it is")
    ap.add_argument("--tag", default="", help="suffix of the run directory's name (several runs "
                    "in one --workdir)")
    ap.add_argument("--override", action="append", default=[], help="extra Hydra override")
    ap.add_argument("--profile", type=int, default=0, help="then profile this many more steps "
                    "(train.profile_steps: RUN/profile/trace-rank0.json; not in the averages)")
    ap.add_argument("--json", help="write the summary here")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="eyas-e2e-"))
    t = time.perf_counter()
    if (work / "data" / "manifest.json").is_file():     # a kept workdir: same target and data
        cfg = json.loads((work / "target" / "config.json").read_text())
        manifest = json.loads((work / "data" / "manifest.json").read_text())
        t_target = t_data = 0.0
    else:
        cfg = write_target(work / "target", args.target, device)
        t_target = time.perf_counter() - t
        lo, _, hi = args.doc_tokens.partition(":")
        manifest = write_dataset(work / "data", cfg, work / "target",
                                 int(args.epoch_steps * args.tokens * 1.1), device,
                                 docs_per_shard=max(1, min(64, 2 ** 17 // int(hi or lo))),
                                 doc_tokens=(int(lo), int(hi or lo)))
        t_data = time.perf_counter() - t - t_target
    run_dir = work / "run" / f"e2e-{args.target}-{args.dist}-T{args.tokens}{args.tag}"
    rc, wall, log = launch(args, work / "target", work / "data", run_dir)
    if rc == 124:
        log = f"timed out after {args.timeout} s (metrics logged so far are kept)\n" + log
    result = dict(target=args.target, dist=args.dist, num_processes=args.num_processes,
                  tokens=args.tokens, ttt_steps=args.ttt, steps=args.steps, returncode=rc,
                  wall_s=wall, write_target_s=t_target, write_data_s=t_data,
                  dataset_tokens=manifest["n_tokens"], dataset_gib=manifest["bytes"] / 2**30,
                  run_dir=str(run_dir), **summarise(run_dir, upto=args.steps))
    if rc != 0:
        result["log_tail"] = log[-6000:]
    print(json.dumps({k: v for k, v in result.items() if k != "log_tail"}, indent=1))
    if rc != 0:
        print(log[-6000:], file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
