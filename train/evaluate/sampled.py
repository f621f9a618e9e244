"""Acceptance at temperature T > 0: the offline expected τ on a hidden-state dataset, and the
`--temperature` / `--temperatures` options of `eyas evaluate`.

    offline_sampling_eval(drafter, dataset_dir, k=K, temperature=T, token_budget=B, head=W)

runs the drafter's TTT forward over the dataset (as the greedy `offline_eval` does) and, per
counted row (k, t), the probability that the rejection sampler accepted the draft given the
stored token (`models.expected_tau`). When the estimate predicts serving, and the
`text_temperature` it records and warns about: docs/acceptance.md, "Temperature > 0". Real
decoding at T > 0 is `train.evaluate.specdec` with `temperature=`."""

from __future__ import annotations

import argparse
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from eyas.data.common.options import option
from eyas.models.expected_tau import (add_expected, expected_counts, step_acceptance,
                                      summarize_expected, topk_step_acceptance)
from eyas.models.objective import metric_mask
from eyas.train.evaluate.sampling import DRAFT_MODES, check_sampling
from eyas.train.evaluate.offline import drafter_for

log = logging.getLogger(__name__)


def teacher_of(fields: dict, dataset_dir) -> str:
    """"last" when the dataset stores the last hidden state (full distribution), else "topk"."""
    if "last" in fields:
        return "last"
    if "topk_ids" in fields and "topk_logits" in fields:
        return "topk"
    raise ValueError(f"{dataset_dir}: the expected τ at temperature > 0 needs the target's "
                     f"distribution, but the dataset stores neither 'last' nor 'topk_ids/"
                     f"topk_logits' (fields: {sorted(fields)}); re-extract with --teacher last, "
                     f"topk or both")


def _target_logits(last: Tensor, head: Tensor, transform: tuple) -> Tensor:
    """lm_head(last) as fp32 logits, with the target's logit scale / soft-capping where it has
    them."""
    logits = (last.to(head.dtype) @ head.T).float()
    scale, cap = transform
    if scale is not None:
        logits = logits * scale
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits


@torch.no_grad()
def batch_acceptance(drafter, batch, k: int, *, temperature: float, draft: str, teacher: str,
                     head: Tensor | None, transform: tuple = (None, None),
                     chunk_rows: int = 1024) -> tuple[Tensor, Tensor]:
    """(β [K, T] float64, mask [K, T] bool) of one packed batch (on the drafter's device): β of
    row (k, t) against the stored token t+2+k (`models.expected_tau`), 0 where the document
    holds no such token."""
    out = drafter(batch.input_ids, batch.aux, batch.doc_ids, batch.positions, k)
    mask = metric_mask(out.valid, batch.loss_mask)                      # [K, T]
    T = mask.shape[1]
    hidden = out.hidden.reshape(k, T, -1)                               # [K, T, H]
    beta = torch.zeros(mask.shape, dtype=torch.float64, device=mask.device)
    for j in range(k):
        rows = mask[j].nonzero()[:, 0]
        tr = rows + 1 + j                                               # target row of the token
        has = tr + 1 < T
        has[has.clone()] = batch.doc_ids[tr[has] + 1] == batch.doc_ids[tr[has]]
        rows, tr = rows[has], tr[has]
        for c in range(0, rows.shape[0], chunk_rows):
            r, t = rows[c:c + chunk_rows], tr[c:c + chunk_rows]
            z = drafter.draft_logits(hidden[j, r])                      # [n, Vd]
            token = batch.input_ids[t + 1]                              # the stored token
            if teacher == "last":
                beta[j, r] = step_acceptance(z, _target_logits(batch.last[t], head, transform),
                                              drafter.t2d_index, token, temperature=temperature,
                                              draft=draft)
            else:
                beta[j, r] = topk_step_acceptance(z, batch.topk_ids[t], batch.topk_logits[t],
                                                   drafter.t2d_index, token,
                                                   temperature=temperature, draft=draft)
    return beta, mask


def answer_temperatures(manifest: dict, dataset_dir, temperature: float) -> list[float] | None:
    """The temperatures the dataset's answers were sampled at, where its `prepare` record says
    (None: unknown, e.g. imported text); warns when they are not `temperature` at top_p 1."""
    rows = (manifest.get("prepare") or {}).get("answer_sampling")
    if not rows:
        return None
    temps = sorted({float(r["temperature"]) for r in rows})
    nucleus = any(r.get("top_p") not in (None, 1, 1.0) for r in rows)
    if temps != [temperature] or nucleus:
        log.warning("%s: its answers were sampled at temperature %s%s, not at %g: the offline "
                    "estimate predicts serving at T only on answers the target sampled at T "
                    "(eyas prepare --generate --temperature %g)", dataset_dir,
                    "/".join(f"{t:g}" for t in temps), " with top_p < 1" if nucleus else "",
                    temperature, temperature)
    return temps


def offline_sampling_eval(drafter, dataset_dir: str | Path, *, k: int, temperature: float,
                          token_budget: int, draft: str = "argmax", head: Tensor | None = None,
                          indices=None, device: str | torch.device = "cpu",
                          num_workers: int = 1) -> dict[str, Any]:
    """Expected τ of `drafter` (an `Eagle3Drafter` on `device`) under speculative sampling at
    `temperature` on a hidden-state dataset (module docstring of `models.expected_tau`).

    head: the target's lm_head [V, tH] (needed when the dataset stores `last`; the top-k
    teacher needs none). Returns tau, tau_se, tau_by_k, cond_acc_{k}, chain_starts and the
    run settings; the keys match the greedy offline result where they mean the same.
    """
    from eyas.data.store.dataset import open_dataset
    from eyas.data.store.loader import PackedLoader
    from eyas.data.common.targets import text_config
    check_sampling(temperature, draft)
    if temperature == 0:
        raise ValueError("temperature 0 is the exact greedy evaluation (offline_eval)")
    dev = torch.device(device)
    ds = open_dataset(dataset_dir)
    teacher = teacher_of(ds.fields, dataset_dir)
    if teacher == "last" and head is None:
        raise ValueError(f"{dataset_dir} stores the last hidden state: pass the target's head")
    text_temps = answer_temperatures(ds.manifest, dataset_dir, temperature)
    cfg = text_config(ds.manifest.get("target_config") or {})
    transform = (cfg.get("logit_scale"), cfg.get("final_logit_softcapping"))
    fields = ("aux", "last") if teacher == "last" else ("aux", "topk_ids", "topk_logits")
    loader = PackedLoader(ds, token_budget, 0, 1, seed=0, shuffle=False, num_workers=num_workers,
                          indices=indices, load_fields=fields)
    # fp32 on the CPU (no fast bf16 GEMMs there); on an accelerator the head keeps its dtype
    # (a bf16 GEMM with fp32 accumulation, as the target computes it; no fp32 copy of a
    # [V, tH] head) and the logits are taken to fp32 per row chunk
    if head is not None:
        head = head.to(dev, torch.float32 if dev.type == "cpu" else head.dtype)
    was_training = drafter.training
    drafter.eval()
    t0, counts = time.perf_counter(), None
    for batch in loader:
        beta, mask = batch_acceptance(drafter, batch.to(dev), k, temperature=temperature,
                                       draft=draft, teacher=teacher, head=head,
                                       transform=transform)
        counts = add_expected(counts, expected_counts(beta, mask))
    drafter.train(was_training)
    if counts is None:
        raise ValueError(f"{dataset_dir}: no samples to score")
    out = {"mode": "offline", "k": k, "temperature": temperature, "draft": draft,
           "teacher": teacher, **summarize_expected(counts)}
    out.update(dataset=str(dataset_dir), num_samples=len(loader.indices),
               text_temperature=text_temps,
               seconds=time.perf_counter() - t0)
    return out


# ---------------------------------------------------------------------------------------------
# CLI


def offline_at_temperature(args, indices, temperature: float) -> dict[str, Any]:
    """`eyas evaluate --data` at temperature > 0 (the exported drafter imported onto the device
    with the target's embedding, as `train.evaluate.offline.offline_eval` does)."""
    from eyas.data.store.dataset import open_dataset
    from eyas.data.common.targets import TARGET_DTYPES, load_embedding_and_head
    ds = open_dataset(args.data)
    dev = torch.device(args.device)
    dtype = TARGET_DTYPES[args.dtype] if args.dtype else None
    drafter, name = drafter_for(args.drafter, ds, args.data, target=args.target,
                                cache_dir=args.cache_dir, dtype=dtype, device=dev)
    head = None
    if "last" in ds.fields:
        head = load_embedding_and_head(args.target or ds.manifest["target"], args.cache_dir)[1]
    res = offline_sampling_eval(drafter, args.data, k=args.k, temperature=temperature,
                                token_budget=args.token_budget, draft=args.draft_sampling,
                                head=head, indices=indices, device=dev)
    res["drafter"] = name
    return res


def fmt(x, spec: str = ".3f") -> str:
    """`x` as `spec` formats it; "n/a" for None and a float that is not finite."""
    missing = x is None or (isinstance(x, float) and not math.isfinite(x))
    return "n/a" if missing else format(x, spec)


def format_sampled(res: dict) -> str:
    """The stdout lines of a result at temperature > 0 (τ ± its standard error; offline: the
    expected decoder walk, τ by chain cap and the per-position acceptance)."""
    lines = [f"{res['mode']} at temperature {res['temperature']:g} (draft "
             f"{res.get('draft', 'argmax')}): tau {fmt(res['tau'])} ± "
             f"{fmt(res.get('tau_se'))} (s.e.)"]
    if res["mode"] == "offline":
        lines.append(f"  expected decoder walk: tau_trajectory {fmt(res['tau_trajectory'])} ± "
                     f"{fmt(res.get('tau_trajectory_se'))} (s.e. over answers)")
        lines.append(f"{'k':>3} {'tau_by_k':>9} {'cond_acc_{k}':>12}")
        lines += [f"{j:>3} {fmt(res['tau_by_k'][j]):>9} {fmt(res[f'cond_acc_{j}']):>12}"
                  for j in range(res["k"])]
    return "\n".join(lines)


def parse_temperatures(text: str) -> list[float]:
    """"0,0.7,1.0" -> [0.0, 0.7, 1.0]; each >= 0, no repeats."""
    try:
        temps = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--temperatures {text!r}: expected comma-separated "
                                         f"numbers >= 0, e.g. 0,0.7,1.0") from None
    if not temps or any(not t >= 0 for t in temps) or len(set(temps)) != len(temps):
        raise argparse.ArgumentTypeError(f"--temperatures {text!r}: expected distinct "
                                         f"comma-separated numbers >= 0, e.g. 0,0.7,1.0")
    return temps


@dataclass(kw_only=True)
class SamplingOptions:
    """--temperature, --temperatures, --draft-sampling, --sampling-seed of `eyas evaluate`."""

    temperature: float = option(
        0.0, "sampling temperature T (default 0 = greedy). T > 0: --prompts decodes with the "
        "engines' rejection sampling (the output is a sample of the target at T), --data "
        "estimates it from answers the target sampled at T (each stored token scored with the "
        "probability its draft was accepted)", min=0, exclusive="temperature")
    temperatures: list[float] | None = option(
        None, "comma-separated temperatures, e.g. 0,0.7,1.0: one evaluation each, listed under "
        "by_temperature, the first one's full result at the top level (none: one evaluation, at "
        "--temperature)", type=parse_temperatures, exclusive="temperature")
    draft_sampling: str = option(
        "argmax", "T > 0: how drafts are proposed: argmax (what vLLM and SGLang serve by "
        "default; q one-hot) or sample (drawn from the drafter's softmax at T: vLLM's "
        "draft_sample_method probabilistic); default: argmax", choices=DRAFT_MODES)
    sampling_seed: int = option(0, "T > 0 with --prompts: seed of prompt i's generator is this "
                                "+ i (reproducible runs)")


#: the offline figures copied into a real result evaluated with --data too
OFFLINE_SUMMARY = ("tau", "tau_se", "tau_trajectory", "tau_trajectory_se",
                   "tau_trajectory_capped", "walk_cap", "chain_starts", "num_samples", "dataset",
                   "teacher", "draft", "text_temperature")


def evaluate_temperatures(temps: list[float], real_at: Callable[[float], dict] | None,
                          offline_at: Callable[[float], dict] | None, *, table: bool
                          ) -> dict[str, Any]:
    """`eyas evaluate`'s result: real decoding (real_at) and/or the offline estimate
    (offline_at) at each temperature. With both, the real result carries `offline` (the
    offline figures) and `offline_tau` (the offline decoder-walk τ, which predicts it: at T = 0
    the walk within each answer's first walk_cap tokens when the offline result has it, the
    text real decoding with max_new_tokens = walk_cap writes).
    table: the first temperature's result with `by_temperature` = [{temperature, tau, tau_se,
    and, for offline results or real ones evaluated with --data too, offline_tau: the offline
    decoder-walk τ (`tau_trajectory`), the figure that predicts real decoding}], else the one
    temperature's result."""
    def one(t: float) -> dict[str, Any]:
        if real_at is None:
            return offline_at(t)
        res = real_at(t)
        if offline_at is not None:
            off = offline_at(t)
            res["offline"] = {key: off.get(key) for key in OFFLINE_SUMMARY if key in off}
            res["offline_tau"] = off.get("tau_trajectory_capped", off.get("tau_trajectory"))
        return res
    if not table:
        return one(temps[0])
    results, rows = [one(t) for t in temps], []
    for t, res in zip(temps, results):
        row = {"temperature": t, "tau": res.get("tau"), "tau_se": res.get("tau_se")}
        if "offline_tau" in res:
            row["offline_tau"] = res["offline_tau"]
        elif res.get("mode") == "offline":
            row["offline_tau"] = res.get("tau_trajectory")
        rows.append(row)
    return {**results[0], "by_temperature": rows}


def format_by_temperature(res: dict) -> str:
    """The stdout table of `by_temperature` (or the one row of a real result evaluated with
    --data too): τ, its standard error and the offline decoder-walk τ per temperature."""
    rows = res.get("by_temperature") or [{"temperature": res.get("temperature", 0.0),
                                          "tau": res["tau"], "tau_se": res.get("tau_se"),
                                          "offline_tau": res.get("offline_tau")}]
    lines = [f"{'T':>5} {'tau':>7} {'tau_se':>7} {'offline_tau (walk)':>18}"]
    lines += [f"{r['temperature']:>5g} {fmt(r['tau']):>7} {fmt(r['tau_se']):>7} "
              f"{fmt(r.get('offline_tau')):>18}" for r in rows]
    return "\n".join(lines)
