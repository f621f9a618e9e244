"""A drafter for the real SmolLM2 target that has memorised the target's greedy answers to a few
prompts: real greedy speculative decoding of exactly those prompts accepts most drafts, so a
test that needs high acceptance (drafts at positions >= 3 accepted, tau well above 3) has a
real export to decode, made by eyas's own pipeline in about two minutes on a 2-core CPU.

    export, prompts = memorised_drafter(tmp_path / "memo")
    # eyas evaluate --drafter EXPORT --target smollm2 --prompts PROMPTS --k 7 \
    #     --max-new-tokens 48 --dtype fp32 --out tau.json

The stages are the README's, one command each (their logs in `<root>/logs/`):

1. `eyas prepare --generate`: SmolLM2 answers the prompts greedily in float32, one prompt per
   generate() call (no padding: the answers batch-1 greedy decoding writes), and the
   conversations are tokenised with its chat template (`<root>/tokens`; the answers in
   `tokens/generated.jsonl`);
2. `eyas extract --dtype float32`: the hidden states (`<root>/hidden`);
3. the main job (`train/main.py`, what `./launch.sh --gpus 0` runs) on that dataset alone:
   every sample in one micro-batch (`data.token_budget` = the dataset's tokens rounded up to
   64; past 1024 tokens, several micro-batches an epoch), no held-out split
   (`data.eval_fraction=0`, so the final step is exported), `steps` epochs at a high
   learning rate, a small drafter (2 heads, MLP width 512,
   draft vocabulary 1024: the answers use ~100 distinct ids; K = 7 as usual), real decoding
   and the engine loaders off. It exports to `<root>/run/export` (layout A, as any run does),
   the directory returned.

On a 2-core CPU (one torch thread) the defaults take about 2 minutes: prepare ~18 s, extract
~7 s, training ~85 s (150 steps of ~0.5 s); real decoding of the 4 prompts then reaches
tau ~7.4 at K = 7.

Cached: `<root>/memorised.json`, written last and atomically, names the export; with it present
the call returns at once. Without it, an earlier attempt with the same arguments keeps its
finished stages (each ends with its manifest) and the rest run again (generation and extract
resume; the run starts over); one with other arguments is removed first (`tokens/`, `hidden/`
and `run/` of `root`, nothing else).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAIN = ROOT / "train" / "main.py"
MARKER = "memorised.json"
STARTED = "memorised.settings.json"   # the arguments of the attempt whose stages root holds

#: short chat prompts whose answers run long (a long answer has many full rounds of K drafts);
#: the first n_prompts are used when no prompts file is given, then data/produce/prompts/default.jsonl
PROMPTS = [
    "Give me three tips for staying focused while studying.",
    "Explain how a car engine works.",
    "Write a short story about a cat who learns to fly.",
    "Describe the water cycle.",
    "List five healthy breakfast ideas.",
    "What are the benefits of regular exercise?",
    "How do I make a cup of tea?",
    "Explain what a black hole is.",
]

#: the training run's settings besides the dataset, the steps and the seed. Measured on the 4
#: default prompts (train tau after 100 steps): lr 5e-3 6.5, 2e-3 5.5, 1e-2 3.1 (with
#: loss.step_weight=1.0, which alone also cost: 4.5); 2 attention heads step ~30 % faster than
#: 4 at the same tau; every step is ~0.5 s on one CPU thread, the TTT unroll's GEMMs.
TRAIN = ["drafter.num_attention_heads=2", "drafter.num_key_value_heads=1",
         "drafter.intermediate_size=512", "drafter.draft_vocab_size=1024",
         "optim.lr=5e-3", "optim.warmup_steps=5", "optim.clip_grad_norm=1.0",
         "data.eval_fraction=0", "data.num_workers=1", "train.log_every=25",
         "eval.speculative=false", "eval.engines=false", "export.select=last"]
MAX_BUDGET = 1024   # tokens per micro-batch: eager attention's cost and memory grow as T**2


def _prompt_lines(prompts: Path | None, n: int) -> list[str]:
    """The first `n` prompt records as JSONL lines (OpenAI `messages`)."""
    if prompts is not None:
        lines = [x for x in Path(prompts).read_text(encoding="utf-8").splitlines() if x.strip()]
    else:
        lines = [json.dumps({"id": f"memo-{i}", "messages": [{"role": "user", "content": p}]})
                 for i, p in enumerate(PROMPTS)]
        if n > len(lines):
            from eyas.data.produce.prompts import prompts_path
            lines += [x for x in prompts_path("default").read_text(encoding="utf-8").splitlines()
                      if x.strip()]
    if not 1 <= n <= len(lines):
        raise ValueError(f"n_prompts={n}: the prompts hold {len(lines)} records")
    return lines[:n]


def _env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false")
    env.pop("TRITON_INTERPRET", None)   # on the CPU eyas takes its torch paths, no Triton
    return env


def _stage(name: str, cmd: list[str], logs: Path, timeout: float, seconds: dict) -> None:
    """Run one stage, its output into logs/<name>.log; RuntimeError with its tail on failure."""
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / f"{name}.log"
    start = time.perf_counter()
    with open(log_path, "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        try:
            r = subprocess.run(cmd, check=False, cwd=logs.parent, env=_env(), stdout=log,
                               stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"memorised drafter: {name} ran past {timeout:.0f} s "
                               f"(log {log_path})") from None
    seconds[name] = round(time.perf_counter() - start, 1)
    if r.returncode != 0:
        tail = log_path.read_text(errors="replace")[-4000:]
        raise RuntimeError(f"memorised drafter: {name} exited {r.returncode} "
                           f"(log {log_path}):\n{tail}")


def memorised_drafter(root: Path, *, prompts: Path | None = None, n_prompts: int = 4,
                      max_new_tokens: int = 48, steps: int = 150, seed: int = 0,
                      timeout: float = 900) -> tuple[Path, Path]:
    """Train an EAGLE-3 drafter for the real SmolLM2 target (eyas preset `smollm2`) that has
    MEMORISED the target's greedy answers (float32, at most `max_new_tokens` tokens) to the
    first `n_prompts` records of `prompts` (JSONL with OpenAI `messages`; default: a few
    built-in questions with long answers), export it, and return (export_dir, prompts_jsonl).

    prompts_jsonl (in `root`) holds exactly the records the answers were generated from:
    decode all of it with the same `max_new_tokens` (fp32) to reach high acceptance.
    `steps`: epochs over the samples (train.epochs), one optimizer step each while they fit
    one micro-batch of 1024 tokens (about 10 prompts at 48 tokens; more take several steps an
    epoch); `seed`: train.seed and the generation seed. Cached in `root`
    (see the module doc): a finished root made with the same arguments returns at once, one
    made with others is an error. Each stage is bounded by `timeout` seconds; a failing stage
    raises RuntimeError naming its log.
    """
    from eyas.data.common.utils import atomic_write_bytes, atomic_write_json

    root = Path(root).expanduser().resolve()
    lines = _prompt_lines(prompts, n_prompts)
    text = "".join(line + "\n" for line in lines)
    settings = {"prompts_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
                "n_prompts": n_prompts, "max_new_tokens": max_new_tokens, "steps": steps,
                "seed": seed}
    marker = root / MARKER
    if marker.is_file():
        done = json.loads(marker.read_text())
        if done["settings"] != settings:
            raise ValueError(f"{root} holds a memorised drafter made with {done['settings']}, "
                             f"not {settings}: use another root")
        return Path(done["export"]), Path(done["prompts"])

    root.mkdir(parents=True, exist_ok=True)
    prompts_file, started = root / "prompts.jsonl", root / STARTED
    tokens, hidden, run_dir, logs = root / "tokens", root / "hidden", root / "run", root / "logs"
    if not started.is_file() or json.loads(started.read_text()) != settings:
        for d in (tokens, hidden, run_dir):   # an unfinished attempt with other arguments
            if d.exists():
                shutil.rmtree(d)
        atomic_write_bytes(prompts_file, text.encode("utf-8"))
        atomic_write_json(started, settings)
    eyas = [sys.executable, "-m", "eyas.train.cli"]
    seconds: dict[str, float] = {}
    if not (tokens / "manifest.json").is_file():
        _stage("prepare", [*eyas, "prepare", "--generate", "--input", str(prompts_file),
                           "--target", "smollm2", "--out", str(tokens),
                           "--max-new-tokens", str(max_new_tokens), "--batch-size", "1",
                           "--dtype", "float32", "--seed", str(seed)], logs, timeout, seconds)
    if not (hidden / "manifest.json").is_file():
        _stage("extract", [*eyas, "extract", "--tokens", str(tokens), "--target", "smollm2",
                           "--out", str(hidden), "--dtype", "float32"], logs, timeout, seconds)
    from eyas.data.store.dataset import open_dataset
    lengths = open_dataset(hidden).sample_lengths     # reads the index, not the shards
    # every sample in one packed micro-batch; past MAX_BUDGET tokens several, each at least as
    # long as the longest sample (the loader would cut a longer one)
    budget = 64 * math.ceil(max(min(int(lengths.sum()), MAX_BUDGET), int(lengths.max())) / 64)
    _stage("train", [sys.executable, str(MAIN), "target=smollm2", f"data.dataset={hidden}",
                     f"data.token_budget={budget}", f"train.epochs={steps}",
                     f"train.seed={seed}", *TRAIN, "train.overwrite=true",
                     "run_name=memorised", f"hydra.run.dir={run_dir}"],
           logs, timeout, seconds)
    export = run_dir / "export"
    if not (export / "config.json").is_file():
        raise RuntimeError(f"memorised drafter: the run wrote no export in {run_dir} "
                           f"(log {logs / 'train.log'})")
    summary = json.loads((run_dir / "summary.json").read_text())
    atomic_write_json(marker, {"export": str(export), "prompts": str(prompts_file),
                               "settings": settings, "stage_seconds": seconds,
                               "train_stage_seconds": summary.get("stage_seconds"),
                               "steps": summary.get("steps"), "token_budget": budget})
    return export, prompts_file
