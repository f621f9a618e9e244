"""The training loop: build everything from the config, train, evaluate, checkpoint, export.

    train(cfg, accelerator, datasets) -> summary dict

Reading order: `build()` (data, vocab, drafter, optimizer), then `train()` (the loop), then
`evaluate()` (exact acceptance counts on the held-out split) and `export_final()`.

Off DeepSpeed the optimizer step never waits for the device (`train.update.micro_step`):
whether a step with a NaN/inf loss or gradient is skipped is decided on the device, and the
host reads the skip count and the metrics only when it logs or checkpoints, so it queues the
next step while the device still runs this one.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import DistributedType, set_seed

from eyas.data.dataset import open_dataset
from eyas.data.loader import PackedLoader
from eyas.data.packing import split_indices
from eyas.data.vocab import build_vocab, load_vocab, save_vocab
from eyas.models.config import Eagle3Config
from eyas.models.drafter import Eagle3Drafter
from eyas.models.metrics import accept_counts, add_counts, summarize
from eyas.models.targets import load_embedding_and_head, load_target_config, text_config
from eyas.train import checkpoint as ckpt
from eyas.train.config import DistBackend, to_plain
from eyas.train.config import enum_value as _value
from eyas.train.dist import param_dtype
from eyas.train.evaluate import count_acceptance
from eyas.train.optim import build_optimizer, build_scheduler
from eyas.train.step import TrainingModule, resolve_loss_impl, to_device
from eyas.train.tracking import MetricsLogger, default_peak_flops, flops_per_token, progress_bar
from eyas.train.update import SkippedSteps, host_checked_micro_step, micro_step

log = logging.getLogger(__name__)


@dataclass
class Setup:
    module: Any                 # the prepared TrainingModule (DDP / DeepSpeed engine)
    optimizer: Any
    scheduler: Any
    train_loader: PackedLoader
    eval_loader: PackedLoader | None
    config: Eagle3Config
    d2t: torch.Tensor
    t2d: torch.Tensor
    target_config: dict
    total_steps: int
    flops_per_token: float
    ttt_steps: int
    skip_masked_rows: bool      # list the loss rows on the host (loss.skip_masked_rows)


def _vocab(cfg, accelerator, train_ds, V: int, out: Path, warm) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft vocab map: the warm-start drafter's, a given file, or built (rank 0) and shared."""
    if warm is not None:
        log.info("vocab map: kept from the warm-start drafter %s", cfg.drafter.warm_start)
        return warm.d2t, warm.t2d
    if cfg.data.vocab:
        return load_vocab(cfg.data.vocab)
    path = out / "vocab.safetensors"
    if accelerator.is_main_process:
        force = []
        try:
            from eyas.data.vocab import special_token_ids
            from eyas.models.targets import load_tokenizer
            force = special_token_ids(load_tokenizer(cfg.target.name, cfg.data.cache_dir))
        except Exception as e:  # config-only targets have no tokenizer here
            log.info("no tokenizer for %s (%s): no special tokens forced into the draft vocab",
                     cfg.target.name, e)
        size = min(int(cfg.drafter.draft_vocab_size), V)
        d2t, t2d = build_vocab(train_ds, size=size, force_ids=force, target_vocab_size=V)
        save_vocab(path, d2t, t2d)
    accelerator.wait_for_everyone()
    return load_vocab(path)


def build(cfg, accelerator, datasets, out: Path) -> Setup:
    set_seed(cfg.train.seed)
    if cfg.train.deterministic:
        torch.use_deterministic_algorithms(True)
    device = accelerator.device
    rank, world = accelerator.process_index, accelerator.num_processes

    train_ds = open_dataset(datasets.train)
    manifest = train_ds.manifest
    target_cfg = manifest.get("target_config") or load_target_config(cfg.target.name)
    tcfg = text_config(target_cfg)
    aux_ids = list(manifest["aux_layer_ids"])
    if cfg.target.aux_layer_ids is not None and list(cfg.target.aux_layer_ids) != aux_ids:
        raise ValueError(f"target.aux_layer_ids={list(cfg.target.aux_layer_ids)} but the dataset "
                         f"{datasets.train} stores layers {aux_ids}; set target.aux_layer_ids="
                         f"null or re-extract with --layers")
    V = int(tcfg["vocab_size"])
    if datasets.eval is not None:
        eval_ds, train_idx, eval_idx = open_dataset(datasets.eval), None, None
    else:
        train_idx, eval_idx = split_indices(len(train_ds), cfg.data.eval_fraction, cfg.train.seed)
        eval_ds = train_ds if len(eval_idx) else None

    warm = None
    if cfg.drafter.warm_start:
        from eyas.models.importer import import_drafter
        warm = import_drafter(cfg.drafter.warm_start, target_cfg)
    d2t, t2d = _vocab(cfg, accelerator, train_ds, V, out, warm)

    overrides = {k: cfg.drafter[k] for k in ("num_attention_heads", "num_key_value_heads",
                                              "head_dim", "intermediate_size",
                                              "max_position_embeddings")
                 if cfg.drafter[k] is not None}
    config = (Eagle3Config.from_config_dict(warm.config_dict, ttt_steps=cfg.drafter.ttt_steps)
              if warm is not None else
              Eagle3Config.from_target(target_cfg, draft_vocab_size=int(d2t.numel()),
                                       aux_layer_ids=aux_ids, ttt_steps=cfg.drafter.ttt_steps,
                                       **overrides))
    if list(config.aux_layer_ids) != aux_ids:
        raise ValueError(f"the warm-start drafter reads layers {config.aux_layer_ids} but the "
                         f"dataset stores {aux_ids}: re-extract with --layers "
                         f"{','.join(map(str, config.aux_layer_ids))}")
    attention = _value(cfg.drafter.attention)
    if attention == "auto":
        attention = "flex" if device.type == "cuda" else "eager"
    drafter = Eagle3Drafter(config, attention=attention,
                            compile_flex=bool(cfg.drafter.compile) and device.type == "cuda",
                            checkpoint_mlp=bool(cfg.drafter.checkpoint_mlp))
    embed, head = load_embedding_and_head(cfg.target.name, cfg.data.cache_dir)
    drafter.load_target_embedding(embed)
    if warm is not None:
        missing = drafter.load_state_dict(warm.state_dict, strict=False)
        log.info("warm start from %s (missing: %s)", cfg.drafter.warm_start,
                 [k for k in missing.missing_keys if k != "embed_tokens.weight"])
        drafter.set_vocab_map(d2t, t2d)
    elif cfg.drafter.init_lm_head_from_target:
        drafter.init_lm_head_from_target(head, d2t)
    else:
        drafter.set_vocab_map(d2t, t2d)
    dtype = param_dtype(cfg, device)
    drafter.to(dtype)
    head_rows = head[torch.arange(d2t.numel()) + d2t].to(dtype).contiguous()
    module = TrainingModule(drafter, head_rows, cfg.loss,
                            loss_impl=resolve_loss_impl(cfg.loss.impl, device),
                            ttt_steps=cfg.drafter.ttt_steps)
    deepspeed = cfg.dist.backend == DistBackend.deepspeed
    if deepspeed and cfg.dist.zero_stage == 3:
        module.register_for_zero3()

    train_loader = PackedLoader(train_ds, cfg.data.token_budget, rank, world, cfg.train.seed,
                                num_workers=cfg.data.num_workers, indices=train_idx,
                                pin_memory=device.type == "cuda")
    eval_loader = None if eval_ds is None else PackedLoader(
        eval_ds, cfg.data.token_budget, rank, world, cfg.train.seed, shuffle=False,
        num_workers=cfg.data.num_workers, indices=eval_idx)
    per_epoch = math.ceil(len(train_loader) / cfg.optim.grad_accum)
    total = cfg.train.max_steps or per_epoch * cfg.train.epochs
    module.to(device)  # the optimizer's fp32 master copies must live where the parameters do
    optimizer = build_optimizer(module.parameters(), cfg.optim,
                                master_weights=not deepspeed and dtype != torch.float32)
    scheduler = build_scheduler(optimizer, cfg.optim, total)
    module, optimizer = accelerator.prepare(module, optimizer)
    accelerator.register_for_checkpointing(scheduler)
    lengths = train_ds.sample_lengths
    fpt = flops_per_token(config, cfg.drafter.ttt_steps, float(lengths.mean()) if len(lengths) else 0)
    log.info("drafter: %.1fM trainable parameters, draft vocab %d of %d, aux layers %s, K=%d; "
             "%d micro-batches/epoch/rank, %d optimizer steps", drafter.num_trainable_parameters() / 1e6,
             d2t.numel(), V, aux_ids, cfg.drafter.ttt_steps, len(train_loader), total)
    return Setup(module, optimizer, scheduler, train_loader, eval_loader, config, d2t, t2d,
                 target_cfg, total, fpt, cfg.drafter.ttt_steps,
                 bool(cfg.loss.skip_masked_rows))


def _drafter(module):
    inner = getattr(module, "module", module)
    return inner.drafter


def evaluate(s: Setup, accelerator) -> dict[str, float]:
    """Exact acceptance on the held-out split (`train.evaluate.count_acceptance`, summed over
    ranks): `tau` averages the chain over every start, `tau_trajectory` walks the text as a
    greedy decoder does (`models.metrics`)."""
    if s.eval_loader is None:
        return {}

    def forward(batch):
        batch, inputs = to_device(batch, accelerator.device, s.ttt_steps, s.skip_masked_rows)
        res = s.module(**inputs)
        return batch, res.draft_argmax, res.metric_mask

    s.module.eval()
    counts, _ = count_acceptance(forward, s.eval_loader, _drafter(s.module).d2t, s.ttt_steps)
    s.module.train()
    return summarize(counts)


def train(cfg, accelerator, datasets) -> dict[str, Any]:
    out = Path(cfg.output_dir)
    s = build(cfg, accelerator, datasets, out)
    ckpt_root = out / "checkpoints"
    objective = ckpt.objective_record(cfg, accelerator.num_processes)
    trackers = _value(cfg.tracker.kind) == "wandb"
    if trackers:
        _init_wandb(cfg, accelerator, out)
    logger = MetricsLogger(accelerator, out, use_trackers=trackers)

    step, nonfinite, best = 0, 0, None
    resume = ckpt.resolve_resume(cfg.train.resume, ckpt_root)
    if resume is not None:
        state = ckpt.load(accelerator, resume, objective)
        step, nonfinite = state["step"], state.get("nonfinite", 0)
        s.train_loader.load_state_dict(state["loader"])
    skipped = SkippedSteps(cfg.train.max_nonfinite_steps, accelerator.device, done=nonfinite)
    deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
    update = host_checked_micro_step if deepspeed else micro_step

    peak = (cfg.train.peak_tflops * 1e12 if cfg.train.peak_tflops
            else default_peak_flops(accelerator.device))
    bar = progress_bar(s.total_steps, step, accelerator.is_main_process)
    window = _Window()
    micro = 0
    s.module.train()
    last_eval: dict[str, float] = {}
    while step < s.total_steps:
        t_wait = time.perf_counter()
        for batch in one_pass(s.train_loader):
            window.wait += time.perf_counter() - t_wait
            batch, inputs = to_device(batch, accelerator.device, s.ttt_steps, s.skip_masked_rows)
            with accelerator.accumulate(s.module):
                res = s.module(**inputs)
                # off DeepSpeed a NaN/inf micro-batch drops its whole optimizer step (train.update)
                gnorm = update(cfg, accelerator, s.module, s.optimizer, res.loss, skipped, step)
                window.add(res, batch, _drafter(s.module).d2t)
            micro += 1
            if not accelerator.sync_gradients:
                t_wait = time.perf_counter()
                continue
            s.scheduler.step()
            step += 1
            window.gnorm = gnorm
            bar.update(1)
            done = step >= s.total_steps
            if step % cfg.train.log_every == 0 or done:
                skipped.read(step)
                rec = window.flush(accelerator, s, peak, s.scheduler.get_last_lr()[0])
                logger.log(step, rec)
                bar.set_postfix(loss=f"{rec['loss']:.3f}", tok_s=f"{rec['tokens_per_s']:.0f}",
                                tau=f"{rec['tau']:.2f}")
            is_eval = (cfg.train.eval_every and step % cfg.train.eval_every == 0) or done
            if is_eval:
                last_eval = evaluate(s, accelerator)
                if last_eval:
                    logger.log(step, last_eval, prefix="eval")
                    log.info("eval step %d: tau %.3f (decoder walk %.3f), acc_0 %.3f",
                             step, last_eval["tau"], last_eval["tau_trajectory"],
                             last_eval["acc_0"])
            if (cfg.train.save_every and step % cfg.train.save_every == 0) or done:
                metric = last_eval.get("tau") if is_eval else None
                metric = metric if metric is not None and math.isfinite(metric) else None
                state = {"step": step, "nonfinite": skipped.read(step), "objective": objective,
                         "loader": s.train_loader.state_dict(),
                         "eval": {k: v for k, v in last_eval.items() if math.isfinite(v)}}
                path = ckpt.save(accelerator, ckpt_root, step, state, keep_last=cfg.train.keep_last,
                                 best_metric=metric)
                _write_export_meta(accelerator, path, s, cfg)
            if cfg.export.every and step % cfg.export.every == 0 and not done:
                export_final(cfg, accelerator, s, out / f"export-step{step:06d}")
            if done:
                break
            t_wait = time.perf_counter()
    bar.close()
    logger.close()
    summary: dict[str, Any] = {"steps": step, "nonfinite_steps": skipped.read(step),
                               "eval": last_eval,
                               "tau": last_eval.get("tau"),
                               "tau_trajectory": last_eval.get("tau_trajectory")}
    if cfg.export.enabled:
        summary["export"] = str(export_final(cfg, accelerator, s, out / "export"))
    if accelerator.is_main_process:
        (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary


def one_pass(loader: PackedLoader):
    """The rest of the loader's current epoch. The loader alone owns the epoch: it moves to the
    next one when a pass ends, so the trainer only iterates (and resume state stays exact)."""
    if len(loader.plan(loader.epoch)) == 0:
        raise ValueError("the training loader has no batches: the dataset is empty or smaller "
                         "than one rank's share")
    yield from loader


class _Window:
    """Loss, counts, tokens and timings accumulated between two log lines."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.loss, self.step_loss, self.n = 0.0, 0.0, 0   # device tensors after the first add
        self.tokens, self.counts, self.wait = 0, None, 0.0
        self.gnorm, self.t0 = None, time.perf_counter()

    def add(self, res, batch, d2t):
        """Accumulate one micro-batch on the device (no host sync). A micro-batch with a NaN/inf
        loss adds only its tokens: its step is skipped and its metrics are meaningless."""
        loss = res.loss.detach().float()
        ok = torch.isfinite(loss)
        self.loss = self.loss + torch.where(ok, loss, 0.0)
        self.step_loss = self.step_loss + torch.where(ok, res.step_loss.detach().float(), 0.0)
        self.n = self.n + ok.to(torch.int64)
        self.tokens += batch.num_tokens
        counts = accept_counts(res.draft_argmax.detach(), d2t, batch.target_argmax,
                               res.metric_mask)
        self.counts = add_counts(self.counts, {k: v * ok for k, v in counts.items()})

    def flush(self, accelerator, s: Setup, peak: float | None, lr: float) -> dict[str, float]:
        """The record of this window, summed over ranks; the host syncs happen here."""
        dt = time.perf_counter() - self.t0
        dev = accelerator.device
        n = accelerator.reduce(torch.as_tensor(self.n, dtype=torch.float32, device=dev), "sum")
        loss = accelerator.reduce(torch.as_tensor(self.loss, dtype=torch.float32, device=dev),
                                  "sum")
        tokens = accelerator.reduce(torch.tensor(float(self.tokens), device=dev), "sum")
        rec = {"loss": float(loss / n), "lr": lr,        # NaN if no micro-batch was finite
               "tokens_per_s": float(tokens) / dt, "data_wait": self.wait / dt,
               "grad_norm": float(self.gnorm) if self.gnorm is not None else float("nan")}
        if self.counts is not None:
            per_step = accelerator.reduce(self.step_loss, "sum") / n             # [K]
            rec.update({f"loss_{k}": float(v) for k, v in enumerate(per_step)})
            counts = {k: accelerator.reduce(v, "sum") for k, v in self.counts.items()}
            rec.update(summarize(counts))
        else:
            rec["tau"] = float("nan")
        if peak:
            rec["mfu"] = s.flops_per_token * rec["tokens_per_s"] / (peak * accelerator.num_processes)
        if dev.type == "cuda":
            rec["peak_mem_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
        self.reset()
        return rec


def _init_wandb(cfg, accelerator, out: Path) -> None:
    from hydra.core.hydra_config import HydraConfig
    name, group = cfg.tracker.run_name, cfg.tracker.group
    try:
        hc = HydraConfig.get()
        if name is None:
            name = hc.job.override_dirname or cfg.run_name
        if group is None and str(hc.mode) == "RunMode.MULTIRUN":
            group = Path(hc.sweep.dir).name
    except ValueError:  # not under Hydra (tests, notebooks)
        name = name or cfg.run_name
    init = {"wandb": {"name": name, "group": group, "mode": _value(cfg.tracker.mode),
                      "dir": str(out), "entity": cfg.tracker.entity}}
    accelerator.init_trackers(cfg.tracker.project, config=to_plain(cfg), init_kwargs=init)


def _write_export_meta(accelerator, path: Path, s: Setup, cfg) -> None:
    """eyas.json + vocab next to the accelerate state, so `eyas export CHECKPOINT` works."""
    if not accelerator.is_main_process:
        return
    from eyas.data.utils import atomic_write_json
    save_vocab(path / "vocab.safetensors", s.d2t, s.t2d)
    atomic_write_json(path / "eyas.json", {"drafter": s.config.to_dict(),
                                           "ttt_steps": cfg.drafter.ttt_steps,
                                           "vocab_map": "vocab.safetensors",
                                           "target": str(cfg.target.name)})


def export_final(cfg, accelerator, s: Setup, out_dir: Path) -> Path:
    """Layout-A export of the current weights (gathers ZeRO-3 shards), written by rank 0."""
    from eyas.models.export import export_drafter
    state = accelerator.get_state_dict(s.module)
    if accelerator.is_main_process:
        export_drafter(state, s.config, s.d2t, s.t2d, out_dir, target_config=s.target_config,
                       ttt_steps=cfg.drafter.ttt_steps, overwrite=True,
                       speculators=cfg.export.speculators_config,
                       verifier=str(cfg.target.name) if cfg.export.speculators_config else None,
                       training={"run": cfg.run_name, "target": str(cfg.target.name)})
        log.info("exported %s", out_dir)
    accelerator.wait_for_everyone()
    return out_dir
