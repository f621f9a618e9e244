"""Acceptance you can trust before serving: offline chain τ on a hidden-state dataset, and real
speculative decoding with the target.

    offline_eval(drafter_dir_or_module, dataset_dir, k=K, token_budget=T)     -> dict
    speculative_eval(drafter_dir, target, prompts_path, k=K, num_prompts=N, max_new_tokens=M)
(the `eyas evaluate` command around them is `train.evaluate.cli`; what the figures mean and how
they agree with real decoding: docs/acceptance.md)

Offline: the exported drafter is imported into the training module (`Eagle3Drafter`, target
embedding) and run with the trainer's TTT forward; row (k, t) is CORRECT iff it counts (valid,
assistant token t+1+k) and its draft argmax mapped through d2t equals the target argmax at t+1+k.
The counts, τ, its variants and their key names are defined once, in `models.metrics`
(`chain_counts`, `summarize`, `tau_curves`); `count_acceptance` is the one evaluation loop, used by
`offline_eval` and by the trainer (tests/train/evaluate/test_agreement.py holds it to real
decoding).

Real decoding: `train.evaluate.specdec` (target via transformers, drafter via the engine reference)."""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from eyas.data.common.targets import target_dtype
from eyas.models.alpha import batch_alpha
from eyas.models.context import DEFAULT_EDGES, check_edges, context_table
from eyas.models.metrics import add_counts, chain_counts, summarize, tau_curves, zero_counts
from eyas.models.objective import metric_mask
from eyas.models.serving.importer import load_training_drafter
from eyas.train.evaluate.pool import DecodePool, decode_job, load_pair

log = logging.getLogger(__name__)


@torch.no_grad()
def count_acceptance(forward, loader, d2t: Tensor, k: int, *, show_progress: bool = False,
                     edges=DEFAULT_EDGES, walk_cap: int | None = None, alpha: bool = False
                     ) -> tuple[dict[str, Tensor], int]:
    """(`models.metrics.chain_counts` summed over the loader and all ranks, this rank's tokens;
    with `walk_cap`, the decoder walk within each answer's first walk_cap tokens as well).

    forward(host batch) -> (batch on the device, draft argmax [K, T], metric mask [K, T]) or
    the same plus `models.metrics.alpha_counts` (then `alpha` must be true): the trainer passes
    its wrapped training module's (DDP/ZeRO-3 gather the weights in its forward),
    `offline_eval` the drafter's own (`draft_argmax`). d2t [Vd] on the device. A rank without a
    batch adds zeros, so the one collective still matches.
    """
    from eyas.data.common.utils import progress
    counts, tokens = None, 0
    batches = progress(loader, total=len(loader), desc="offline eval", unit="batch") \
        if show_progress else loader
    for batch in batches:
        batch, arg, mask, *rates = forward(batch)
        new = chain_counts(arg, d2t, batch.target_argmax, mask, batch.positions, edges, walk_cap)
        if alpha:
            new.update(rates[0])
        counts = add_counts(counts, new)
        tokens += batch.num_tokens
    empty = zero_counts(k, d2t.device, edges, walk_cap, alpha)
    return all_reduce_counts(counts if counts is not None else empty), tokens


def all_reduce_counts(counts: dict[str, Tensor]) -> dict[str, Tensor]:
    """SUM the counts over ranks when torch.distributed is initialised (one collective)."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return counts
    keys = list(counts)            # the same order on every rank (chain_counts, zero_counts)
    flat = torch.cat([counts[k].reshape(-1).to(torch.int64) for k in keys])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    parts = flat.split([counts[key].numel() for key in keys])
    return {key: part.view(counts[key].shape) for key, part in zip(keys, parts)}


# ---------------------------------------------------------------------------------------------
# Offline evaluation


@torch.no_grad()
def draft_argmax(drafter, batch, k: int, *, chunk_rows: int = 4096,
                 head_rows: Tensor | None = None) -> tuple:
    """(draft argmax [K, T] draft-vocab ids, metric mask [K, T]) of one packed batch, with the
    trainer's TTT forward; lm_head logits (fp32) are formed `chunk_rows` rows at a time. With
    the target's head rows (`head[drafter.target_ids]`) also the batch's α counts against
    its stored teacher (`models.alpha.batch_alpha`)."""
    out = drafter(batch.input_ids, batch.aux, batch.doc_ids, batch.positions, k)
    hidden = out.hidden.reshape(-1, out.hidden.shape[-1])                 # [K·T, H]
    arg = torch.cat([drafter.draft_logits(hidden[i:i + chunk_rows]).argmax(-1)
                     for i in range(0, hidden.shape[0], chunk_rows)])
    mask = metric_mask(out.valid, batch.loss_mask)
    if head_rows is None:
        return arg.view(k, -1), mask
    return arg.view(k, -1), mask, batch_alpha(drafter, out.hidden, mask, batch, head_rows)


def teacher_head_rows(drafter, ds, target, cache_dir, device) -> Tensor | None:
    """The target's lm_head rows of the drafter's vocabulary [Vd, tH] when the dataset stores a
    teacher (`last` or a top-k) and the target's weights load; else None (no α)."""
    if not ({"last", "topk_ids"} & set(ds.fields)):
        return None
    from eyas.data.common.targets import load_embedding_and_head
    try:
        _, head = load_embedding_and_head(target or ds.manifest.get("target"), cache_dir)
    except (OSError, ValueError) as e:
        log.warning("no expected acceptance: the target's lm_head did not load (%s)", e)
        return None
    return head[drafter.target_ids.cpu()].to(device, drafter.lm_head.weight.dtype)


def drafter_for(drafter_dir_or_module, ds, dataset_dir, *, target, cache_dir, dtype,
                 device: torch.device):
    """(drafter, name): a module as it is, or an exported directory imported onto `device` with
    the embedding of `target` (default: the dataset manifest's)."""
    if not isinstance(drafter_dir_or_module, (str, Path)):
        return drafter_dir_or_module, type(drafter_dir_or_module).__name__
    tgt = target or ds.manifest.get("target")
    if tgt is None:
        raise ValueError(f"{dataset_dir}/manifest.json names no target: pass target=")
    drafter = load_training_drafter(drafter_dir_or_module, tgt, cache_dir=cache_dir,
                                    dtype=dtype or target_dtype("auto", device), device=device)
    return drafter, str(drafter_dir_or_module)


def offline_eval(drafter_dir_or_module, dataset_dir: str | Path, *, k: int, token_budget: int,
                 indices=None, rank: int = 0, world_size: int = 1,
                 device: str | torch.device = "cpu", target: str | Path | None = None,
                 cache_dir: str | Path | None = None, dtype: torch.dtype | None = None,
                 num_workers: int = 1, context_buckets=DEFAULT_EDGES,
                 walk_cap: int | None = None) -> dict[str, Any]:
    """Exact offline acceptance of a drafter on a hidden-state dataset (module docstring).

    drafter_dir_or_module: an exported layout-A directory (imported into `Eagle3Drafter` with
    the target embedding), or an `Eagle3Drafter` already holding it. k: chain length K (TTT
    steps run; may exceed the training K). token_budget: packed tokens per forward (longer
    samples are truncated, with a warning). indices: dataset indices to use (default all).
    rank/world_size: this process's share; counts are all-reduced (SUM) when torch.distributed
    is initialised. target: whose embedding to use (default: the dataset manifest's target).
    dtype: compute dtype for a directory (default bf16 on CUDA, fp32 on CPU; the exported
    values are bf16 either way). context_buckets: edges of the `by_context` buckets (chain
    start positions, `models.context`). walk_cap: also walk each answer's first walk_cap tokens
    only (`tau_trajectory_capped`). Returns `models.metrics.summarize` and `tau_curves`
    of the counts (with α per step, `alpha_k` and `tau_alpha`, when the dataset stores a
    teacher and the target's lm_head loads), `by_context`, the counts and run information.
    """
    from eyas.data.store.dataset import open_dataset
    from eyas.data.store.loader import PackedLoader
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    edges = check_edges(context_buckets)
    dev = torch.device(device)
    ds = open_dataset(dataset_dir)
    for f in ("aux", "target_argmax"):
        if f not in ds.fields:
            raise ValueError(f"{dataset_dir}: dataset has no {f!r} field (fields: "
                             f"{sorted(ds.fields)}); offline evaluation needs a hidden-state "
                             f"dataset from `eyas extract`")
    drafter, name = drafter_for(drafter_dir_or_module, ds, dataset_dir, target=target,
                                 cache_dir=cache_dir, dtype=dtype, device=dev)
    aux_ids = list(ds.manifest.get("aux_layer_ids") or [])
    if aux_ids and list(drafter.config.aux_layer_ids) != aux_ids:
        raise ValueError(f"the drafter reads aux layers {list(drafter.config.aux_layer_ids)} but "
                         f"{dataset_dir} stores layers {aux_ids}: re-extract with --layers "
                         f"{','.join(map(str, drafter.config.aux_layer_ids))}")
    head_rows = teacher_head_rows(drafter, ds, target, cache_dir, dev)
    teacher = (() if head_rows is None else ("last",) if "last" in ds.fields
               else ("topk_ids", "topk_logits"))
    loader = PackedLoader(ds, token_budget, rank, world_size, seed=0, shuffle=False,
                          num_workers=num_workers, indices=indices,
                          load_fields=("aux", "target_argmax", *teacher))
    was_training = drafter.training
    drafter.eval()
    t0 = time.perf_counter()

    def forward(batch):
        batch = batch.to(dev)
        return (batch, *draft_argmax(drafter, batch, k, head_rows=head_rows))

    counts, tokens = count_acceptance(forward, loader, drafter.d2t, k, show_progress=True,
                                      edges=edges, walk_cap=walk_cap,
                                      alpha=head_rows is not None)
    drafter.train(was_training)
    out = {"k": k, **summarize(counts), **tau_curves(counts),
           "chain_starts": int(counts["chain_starts"]), "walk_cap": walk_cap,
           "context_buckets": list(edges),
           "by_context": context_table(counts, edges),
           "counts": {key: [int(x) for x in v.reshape(-1).tolist()] for key, v in counts.items()}}
    out.update(mode="offline", drafter=name, dataset=str(dataset_dir), rank_tokens=tokens,
               num_samples=len(loader.indices), seconds=time.perf_counter() - t0)
    return out


# ---------------------------------------------------------------------------------------------
# Real speculative decoding

#: precisions of real decoding (`--dtype`; the names of benchmarks/specdec.py)
SPECDEC_DTYPES = ("bf16", "fp32")


def load_prompts(path: str | Path, tokenizer, *, num_prompts: int | None = None
                 ) -> list[tuple[str, list[int]]]:
    """(id, prompt token ids) per JSONL record (OpenAI `messages` or ShareGPT), first N records.

    Trailing assistant messages are dropped (the target answers the last user turn itself);
    the target's chat template is applied with add_generation_prompt=True.
    """
    from eyas.data.produce.records import read_conversations
    from eyas.data.common.templates import for_template
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such prompts file (JSONL with OpenAI `messages`)")
    out: list[tuple[str, list[int]]] = []
    for _, conv in itertools.islice(read_conversations(path), num_prompts):  # none read past N
        msgs = list(conv.messages)
        while msgs and msgs[-1]["role"] == "assistant":
            msgs.pop()
        if not msgs or msgs[-1]["role"] not in ("user", "tool"):
            raise ValueError(f"{path}: record {conv.id!r} has no user (or tool) turn to answer")
        text = tokenizer.apply_chat_template(for_template(msgs), tools=conv.tools, tokenize=False,
                                             add_generation_prompt=True)
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        out.append((conv.id, ids))
    if not out:
        raise ValueError(f"{path}: no prompt records")
    return out


def speculative_eval(drafter_dir: str | Path, target: str | Path, prompts_path: str | Path, *,
                     k: int, num_prompts: int | None, max_new_tokens: int,
                     cache_dir: str | Path | None = None, dtype: str = "fp32",
                     model=None, tokenizer=None, progress: bool = True,
                     context_buckets=DEFAULT_EDGES, temperature: float = 0.0,
                     draft: str = "argmax", seed: int = 0,
                     device: str | torch.device = "cpu", processes: int = 1,
                     pool=None) -> dict[str, Any]:
    """Real speculative decoding of the first `num_prompts` prompts vs target-only greedy.

    drafter_dir: the exported drafter (loaded like vLLM, `models.serving.reference.EngineDrafter`);
    target: preset or model directory (`data.common.targets.load_target`), or pass an already loaded
    `model` + `tokenizer`. dtype: "fp32" (default: token identity is exact, and on CPUs without
    bf16 units it is also ~1.6x faster) or "bf16" (the serving numerics; a near-tie may then
    flip between one-token and multi-token forwards, see `mismatches[*].target_top2_logit_gap`).
    Batch size 1; the target runs on `device` (when it is loaded here), the drafter (the
    engine-math reference, `EngineDrafter`) on the target's device. context_buckets: edges of
    the `by_context` buckets (the verified position of each round, `models.context`).
    temperature > 0: the engines' rejection sampling (`train.evaluate.sampling`; draft "argmax"
    or "sample"), prompt i seeded seed + i.
    processes > 1 (when the target is loaded here): the prompts are split into parts that many
    processes decode, each with its own copy of the target and the drafter
    (`train.evaluate.pool`): the same tokens and acceptance as in one process, while the
    per-prompt timings (tokens/s, speedup) are measured with the processes sharing the machine
    and `wall_seconds` includes their start. pool: a `DecodePool` made for this drafter,
    target and dtype, reused across calls (several temperatures; only its first decoding's
    `wall_seconds` includes the loading); processes is then the pool's.
    Returns train.evaluate.specdec_summary.summarize's dict plus the run settings.
    """
    from eyas.train.evaluate.specdec_summary import summarize
    if dtype not in SPECDEC_DTYPES:
        raise ValueError(f"dtype must be one of {list(SPECDEC_DTYPES)}, got {dtype!r}")
    if processes < 1 or ((processes > 1 or pool is not None) and model is not None):
        raise ValueError(f"processes must be >= 1 (got {processes}), and 1 with a model passed "
                         f"in (each process loads its own copy of the target)")
    edges = check_edges(context_buckets)
    job = decode_job(drafter_dir, target, dtype=dtype, cache_dir=cache_dir, device=device, k=k,
                     max_new_tokens=max_new_tokens, temperature=temperature, draft=draft)
    prompts, pairs, t0 = _decode(job, prompts_path, num_prompts, seed=seed, model=model,
                                 tokenizer=tokenizer, progress=progress, processes=processes,
                                 pool=pool)
    res = summarize(pairs, k, context_buckets=edges, temperature=temperature)
    if temperature > 0:
        res.update(draft=draft, seed=seed)
    res.update(drafter=str(drafter_dir), target=str(target), prompts=str(prompts_path),
               dtype=dtype, max_new_tokens=max_new_tokens, wall_seconds=time.perf_counter() - t0)
    if res["tokens_identical"] is False:
        log.warning("%d of %d prompts diverge from target-only greedy decoding (first: %s)%s",
                    len(res["mismatches"]), len(prompts), res["mismatches"][0],
                    "; bf16 near-ties (see target_top2_logit_gap) can flip between one-token "
                    "and multi-token forwards: use --dtype fp32 for an exact check"
                    if dtype == "bf16" else "")
    return res


def _decode(job: dict[str, Any], prompts_path, num_prompts: int | None, *, seed: int, model,
            tokenizer, progress: bool, processes: int, pool) -> tuple[list, list, float]:
    """(prompts, `decode_prompts`' pairs, the start time) of `speculative_eval`: here, or in
    `processes` processes, or in `pool`."""
    from eyas.train.evaluate.specdec import decode_prompts, stop_token_ids
    if processes > 1 or pool is not None:
        from eyas.data.common.targets import load_tokenizer
        if pool is not None:
            pool.check(job)
        prompts = load_prompts(prompts_path, load_tokenizer(job["target"], job["cache_dir"]),
                               num_prompts=num_prompts)
        t0 = time.perf_counter()        # the processes' start and loading count here
        with contextlib.nullcontext(pool) if pool else DecodePool(job, processes) as pool:
            return prompts, pool.decode(prompts, temperature=job["temperature"],
                                        draft=job["draft"], seed=seed), t0
    model, tokenizer, engine, cfg = load_pair(job, model, tokenizer)
    prompts = load_prompts(prompts_path, tokenizer, num_prompts=num_prompts)
    t0 = time.perf_counter()
    return prompts, decode_prompts(model, engine, cfg, [p for _, p in prompts], k=job["k"],
                                   max_new_tokens=job["max_new_tokens"],
                                   stop_ids=stop_token_ids(model, tokenizer),
                                   names=[n for n, _ in prompts], progress=progress,
                                   temperature=job["temperature"], draft=job["draft"],
                                   seed=seed), t0
