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
   every sample in one micro-batch (`data.token_budget` = the dataset's tokens, rounded up),
   no held-out split (`data.eval_fraction=0`, so the final step is exported), a high learning
   rate for many steps, real decoding and the engine loaders off. It exports to
   `<root>/run/export` (layout A, as any run does), the directory returned.

Cached: `<root>/memorised.json`, written last and atomically, names the export; with it present
the call returns at once. Without it, finished stages are kept (each ends with its manifest)
and the rest run again (extract resumes its own shards; the run starts over).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAIN = ROOT / "train" / "main.py"
MARKER = "memorised.json"

#: short chat prompts whose answers run long (a long answer has many full rounds of K drafts);
#: the first n_prompts are used when no prompts file is given, then data/prompts/default.jsonl
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

#: optimizer settings of the memorisation (3e-3 is what the small SmolLM2 drafter trains best
#: at on real data, benchmarks/README.md; here it only has to fit a few hundred tokens)
LR = 3e-3
DRAFT_VOCAB = 2048   # the answers use ~100 distinct ids; a smaller lm_head steps faster


def _prompt_lines(prompts: Path | None, n: int) -> list[str]:
    """The first `n` prompt records as JSONL lines (OpenAI `messages`)."""
    if prompts is not None:
        lines = [x for x in Path(prompts).read_text(encoding="utf-8").splitlines() if x.strip()]
    else:
        lines = [json.dumps({"id": f"memo-{i}", "messages": [{"role": "user", "content": p}]})
                 for i, p in enumerate(PROMPTS)]
        if n > len(lines):
            from eyas.data.prompts import prompts_path
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
            r = subprocess.run(cmd, cwd=logs.parent, env=_env(), stdout=log,
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
                      max_new_tokens: int = 48, steps: int = 200, seed: int = 0,
                      timeout: float = 900) -> tuple[Path, Path]:
    """Train an EAGLE-3 drafter for the real SmolLM2 target (eyas preset `smollm2`) that has
    MEMORISED the target's greedy answers (float32, at most `max_new_tokens` tokens) to the
    first `n_prompts` records of `prompts` (JSONL with OpenAI `messages`; default: a few
    built-in questions with long answers), export it, and return (export_dir, prompts_jsonl).

    prompts_jsonl (in `root`) holds exactly the records the answers were generated from:
    decode all of it with the same `max_new_tokens` (fp32) to reach high acceptance.
    `steps`: optimizer steps, each over every sample; `seed`: train.seed. Cached in `root`
    (see the module doc): a finished root made with the same arguments returns at once, one
    made with others is an error. Each stage is bounded by `timeout` seconds; a failing stage
    raises RuntimeError naming its log.
    """
    from eyas.data.utils import atomic_write_bytes, atomic_write_json

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
    prompts_file = root / "prompts.jsonl"
    tokens, hidden, run_dir, logs = root / "tokens", root / "hidden", root / "run", root / "logs"
    if not prompts_file.is_file() or prompts_file.read_text(encoding="utf-8") != text:
        # other prompts than an unfinished earlier attempt's: its dataset is not theirs
        for d in (tokens, hidden):
            if (d / "manifest.json").is_file():
                raise ValueError(f"{d} holds a dataset of other prompts: use another root")
        atomic_write_bytes(prompts_file, text.encode("utf-8"))
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
    n_tokens = int(json.loads((hidden / "manifest.json").read_text())["n_tokens"])
    budget = 64 * math.ceil(n_tokens / 64)   # every sample in one packed micro-batch
    _stage("train", [sys.executable, str(MAIN), "target=smollm2", f"data.dataset={hidden}",
                     "data.eval_fraction=0", f"data.token_budget={budget}", "data.num_workers=1",
                     f"drafter.draft_vocab_size={DRAFT_VOCAB}", f"train.max_steps={steps}",
                     f"train.seed={seed}", "train.log_every=25", f"optim.lr={LR}",
                     "optim.warmup_steps=5", "optim.clip_grad_norm=1.0",
                     "eval.speculative=false", "eval.engines=false", "export.select=last",
                     "train.overwrite=true", "run_name=memorised", f"hydra.run.dir={run_dir}"],
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
