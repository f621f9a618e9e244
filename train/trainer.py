"""The training loop: build data, model and optimizer from the typed config, then fit.

    train(cfg, resolved, accelerator, datasets) -> summary dict

Reading order: `build_data` (datasets, held-out split, loaders), `build_model` (vocab map,
drafter, training module), `setup` (both, the optimizer and its schedule, then
`accelerator.prepare`), `fit` (the loop: resume → step → log → eval → save → export) and
`train_step` (the micro-batches of one optimizer step, which never wait for the device off
DeepSpeed: `train.update`). Evaluation runs the loop of
`train.evaluate.offline.count_acceptance`; metrics and their names come from `models.metrics`."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import Tensor, nn

from eyas.data.store.dataset import open_dataset
from eyas.data.store.format import DatasetError
from eyas.data.store.loader import PackedLoader
from eyas.data.store.packing import split_indices
from eyas.data.store.read_checks import contract_mismatch
from eyas.data.produce.vocab import build_vocab, load_vocab, save_vocab
from eyas.models.config import Eagle3Config
from eyas.models.drafter import Eagle3Drafter
from eyas.models.fp8 import convert_drafter_to_float8
from eyas.models.context import context_scalars, context_table
from eyas.models.metrics import summarize
from eyas.data.common.targets import load_embedding_and_head, load_target_config, text_config
from eyas.train import checkpoint as ckpt
from eyas.train.trackers import init_trackers
from eyas.train.config import (ConfigError, DataConfig, DistBackend, DrafterConfig, EyasConfig,
                               ExportSelect, FP8Recipe, LossConfig, TargetConfig)
from eyas.train.batches import DeviceBatches
from eyas.train.limits import ttt_memory_error
from eyas.train.resolve import Resolved
from eyas.train.evaluate.offline import count_acceptance
from eyas.train.optim import apply_optim_settings, build_optimizer, build_scheduler
from eyas.train.profiling import StepProfiler
from eyas.train.plots import write_run_plots
from eyas.train.run_export import export_final, export_selected, write_export_meta
from eyas.train.selection import BestWalk
from eyas.train.step import TrainingModule, to_device
from eyas.train.stop import StopRequest, Stopped
from eyas.train.tracking import (MetricsLogger, MetricsWindow, Progress, alpha_text,
                                 default_peak_flops, flops_per_token, mean_over_ranks)
from eyas.train.update import SkippedSteps, micro_step_for, skipped_samples

log = logging.getLogger(__name__)


@dataclass
class Data:
    """The training and held-out loaders of this rank, and what the dataset says of its target."""
    train: PackedLoader
    eval: PackedLoader | None
    target_config: dict         # the target's config.json (from the manifest if it has one)
    aux_layer_ids: list[int]    # the aux layers the dataset stores (HF hidden_states ids)
    stream: Any = None          # data.stream: the producer capturing `train`'s samples


@dataclass
class Model:
    """The drafter in its training module, with the vocab map it was built with."""
    module: TrainingModule
    config: Eagle3Config        # holds ttt_steps for everything downstream
    d2t: Tensor
    t2d: Tensor


@dataclass
class Trainer:
    """Everything `fit` runs: the typed config, the prepared module and optimizer, the data."""
    cfg: EyasConfig
    accelerator: Accelerator
    module: nn.Module           # the prepared TrainingModule (DDP wrapper / DeepSpeed engine)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    data: Data
    model: Model
    total_steps: int
    flops_per_token: float
    out: Path
    device_prefetch: bool = False   # data.device_prefetch as resolved (train.batches)


# ---------------------------------------------------------------------------------------------
# Building


def build_data(data_cfg: DataConfig, target: TargetConfig, datasets, *, seed: int, rank: int,
               world_size: int, pin_memory: bool, stream=None) -> Data:
    """Open the dataset(s) (or take the streamed one), split the held-out part off, and build
    this rank's loaders."""
    train_ds = open_dataset(datasets.train) if stream is None else stream.dataset
    manifest = train_ds.manifest
    aux_ids = list(manifest["aux_layer_ids"])
    if target.aux_layer_ids is not None and list(target.aux_layer_ids) != aux_ids:
        raise ValueError(f"target.aux_layer_ids={list(target.aux_layer_ids)} but the dataset "
                         f"{datasets.train} stores layers {aux_ids}; set target.aux_layer_ids="
                         f"null or re-extract with --layers")
    if datasets.eval is not None:
        eval_ds, train_idx, eval_idx = open_dataset(datasets.eval), None, None
        diff = contract_mismatch(manifest, eval_ds.manifest)
        if diff is not None:
            raise DatasetError(f"data.eval_dataset={datasets.eval} has {diff[0]}={diff[2]!r} but "
                               f"data.dataset={datasets.train} has {diff[1]!r}: evaluate on a "
                               f"dataset extracted with the same target, layers and format")
    else:
        train_idx, eval_idx = split_indices(len(train_ds), data_cfg.eval_fraction, seed)
        eval_ds = train_ds if len(eval_idx) else None
    if data_cfg.verify and stream is None:
        nonfinite = "error" if data_cfg.nonfinite == "raise" else "skip"
        for ds in {id(train_ds): train_ds, id(eval_ds): eval_ds}.values():
            if ds is not None:
                ds.enable_read_checks(checksum=True, nonfinite=nonfinite)
    train = PackedLoader(train_ds, data_cfg.token_budget, rank, world_size, seed,
                         num_workers=data_cfg.num_workers, indices=train_idx,
                         pin_memory=pin_memory)
    held_out = None if eval_ds is None else PackedLoader(
        eval_ds, data_cfg.token_budget, rank, world_size, seed, shuffle=False,
        num_workers=data_cfg.num_workers, indices=eval_idx)
    target_config = manifest.get("target_config") or load_target_config(target.name)
    if stream is not None:
        stream.attach(train, held_out)
    return Data(train, held_out, target_config, aux_ids, stream)


def build_vocab_map(data_cfg: DataConfig, target: TargetConfig, draft_vocab_size: int,
                    train_ds, vocab_size: int, accelerator, out: Path) -> tuple[Tensor, Tensor]:
    """The draft vocab map: a given file, or built from the training set (rank 0) and shared."""
    if data_cfg.vocab:
        return load_vocab(data_cfg.vocab)
    path = out / "vocab.safetensors"
    if accelerator.is_main_process:
        from eyas.data.produce.vocab import forced_special_ids
        force = forced_special_ids(target.name, data_cfg.cache_dir)
        size = min(int(draft_vocab_size), vocab_size)
        d2t, t2d = build_vocab(train_ds, size=size, force_ids=force, target_vocab_size=vocab_size,
                               count=data_cfg.vocab_count)
        save_vocab(path, d2t, t2d)
    accelerator.wait_for_everyone()
    return load_vocab(path)


def build_model(drafter_cfg: DrafterConfig, loss_cfg: LossConfig, data_cfg: DataConfig,
                target: TargetConfig, data: Data, resolved: Resolved, accelerator,
                out: Path) -> Model:
    """Vocab map, drafter config and weights (target embedding, warm start or lm_head from the
    target head), in the resolved dtype, inside the training module with the teacher rows."""
    V = int(text_config(data.target_config)["vocab_size"])
    warm = None
    if drafter_cfg.warm_start:
        from eyas.models.serving.importer import import_drafter
        warm = import_drafter(drafter_cfg.warm_start, data.target_config)
        log.info("vocab map: kept from the warm-start drafter %s", drafter_cfg.warm_start)
        d2t, t2d = warm.d2t, warm.t2d
        config = Eagle3Config.from_config_dict(warm.config_dict, ttt_steps=drafter_cfg.ttt_steps)
    else:
        d2t, t2d = build_vocab_map(data_cfg, target, drafter_cfg.draft_vocab_size,
                                   data.train.dataset, V, accelerator, out)
        shape = {**drafter_cfg.overrides(), "draft_vocab_size": int(d2t.numel())}
        config = Eagle3Config.from_target(data.target_config, aux_layer_ids=data.aux_layer_ids,
                                          **shape)
    if list(config.aux_layer_ids) != data.aux_layer_ids:
        raise ValueError(f"the warm-start drafter reads layers {config.aux_layer_ids} but the "
                         f"dataset stores {data.aux_layer_ids}: re-extract with --layers "
                         f"{','.join(map(str, config.aux_layer_ids))}")
    drafter = Eagle3Drafter(config, attention=resolved.attention, compile_flex=resolved.compile,
                            checkpoint_mlp=bool(drafter_cfg.checkpoint_mlp),
                            embedding_qkv_once=bool(drafter_cfg.embedding_qkv_once),
                            fp8_split_qkv=bool(drafter_cfg.fp8_split_qkv))
    embed, head = load_embedding_and_head(target.name, data_cfg.cache_dir)
    drafter.load_target_embedding(embed)
    if warm is not None:
        missing = drafter.load_state_dict(warm.state_dict, strict=False)
        log.info("warm start from %s (missing: %s)", drafter_cfg.warm_start,
                 [k for k in missing.missing_keys if k != "embed_tokens.weight"])
        drafter.set_vocab_map(d2t, t2d)
    elif drafter_cfg.init_lm_head_from_target:
        drafter.init_lm_head_from_target(head, d2t)
    else:
        drafter.set_vocab_map(d2t, t2d)
    drafter.to(resolved.param_dtype)
    convert_drafter_to_float8(drafter, FP8Recipe(drafter_cfg.fp8).value,
                              tuple(drafter_cfg.fp8_layers))
    head_rows = head[drafter.target_ids].to(resolved.param_dtype).contiguous()
    module = TrainingModule(drafter, head_rows, loss_cfg, loss_impl=resolved.loss_impl,
                            host_embedding=resolved.host_embedding)
    return Model(module, config, d2t, t2d)


def setup(cfg: EyasConfig, resolved: Resolved, accelerator, datasets, out: Path) -> Trainer:
    """Seed, build data, model and optimizer, and hand them to accelerate."""
    set_seed(cfg.train.seed)
    if cfg.train.deterministic:
        torch.use_deterministic_algorithms(True)
    from eyas.train.streaming import open_stream
    stream = None if datasets.tokens is None else open_stream(
        cfg.data, cfg.target, datasets, rank=accelerator.process_index,
        world_size=accelerator.num_processes, device=accelerator.device,
        target_dtype=resolved.target_dtype)
    data = build_data(cfg.data, cfg.target, datasets, seed=cfg.train.seed,
                      rank=accelerator.process_index, world_size=accelerator.num_processes,
                      pin_memory=resolved.pin_memory, stream=stream)
    model = build_model(cfg.drafter, cfg.loss, cfg.data, cfg.target, data, resolved,
                        accelerator, out)
    if model.module.host_embedding is not None:    # the loaders' threads look the rows up
        for loader in (data.train, data.eval):
            if loader is not None:
                loader.attach_embedding(model.module.host_embedding, model.config.ttt_steps)
    if (why := ttt_memory_error(model.config, cfg.data.token_budget, resolved,
                                accelerator.device)) is not None:
        raise ConfigError(why)          # before the first step runs out of memory
    deepspeed = cfg.dist.backend == DistBackend.deepspeed
    if deepspeed and cfg.dist.zero_stage == 3:
        model.module.register_for_zero3()
    per_epoch = math.ceil(len(data.train) / cfg.optim.grad_accum)
    total = cfg.train.max_steps or per_epoch * cfg.train.epochs
    model.module.to(accelerator.device)   # the fp32 master copies live where the parameters do
    # fp32 master weights over bf16 parameters off DeepSpeed
    optimizer = build_optimizer(
        model.module.parameters(), cfg.optim, impl=resolved.optim_impl,
        compact=resolved.compact_masters, moments=resolved.moments,
        master_weights=not deepspeed and resolved.param_dtype != torch.float32)
    log.info("optimizer: %s", optimizer.describe() if hasattr(optimizer, "describe") else
             f"torch AdamW on {optimizer.param_groups[0]['params'][0].dtype} parameters")
    scheduler = build_scheduler(optimizer, cfg.optim, total)
    module, optimizer = accelerator.prepare(model.module, optimizer)
    c = model.config
    lengths = data.train.dataset.sample_lengths
    fpt = flops_per_token(c, c.ttt_steps, float(lengths.mean()) if len(lengths) else 0)
    log.info("drafter: %.1fM trainable parameters, draft vocab %d of %d, aux layers %s, K=%d; "
             "%d micro-batches/epoch/rank, %d optimizer steps",
             model.module.drafter.num_trainable_parameters() / 1e6, c.draft_vocab_size,
             c.vocab_size, c.aux_layer_ids, c.ttt_steps, len(data.train), total)
    return Trainer(cfg, accelerator, module, optimizer, scheduler, data, model, total, fpt, out,
                   device_prefetch=resolved.device_prefetch)


# ---------------------------------------------------------------------------------------------
# The loop


def train(cfg: EyasConfig, resolved: Resolved, accelerator, datasets) -> dict[str, Any]:
    """Build everything, then fit; the summary the main job prints from."""
    return fit(setup(cfg, resolved, accelerator, datasets, Path(cfg.output_dir)))


def fit(t: Trainer) -> dict[str, Any]:
    """resume, then train_step → log → eval → save → export until the last step; the summary."""
    cfg, acc = t.cfg, t.accelerator
    trackers = bool(cfg.tracker.kind)
    init_trackers(cfg, acc, t.out)
    logger = MetricsLogger(acc, t.out, use_trackers=trackers)
    objective = ckpt.objective_record(cfg, acc.num_processes)
    step, nonfinite, best = _resume(t, objective)
    start = step
    logger.keep_through(step)       # what was logged past it belongs to a replaced continuation
    skipped = SkippedSteps(cfg.train.max_nonfinite_steps, acc.device, done=nonfinite)
    peak = (cfg.train.peak_tflops * 1e12 if cfg.train.peak_tflops
            else default_peak_flops(acc.device))
    bar = Progress(t.total_steps, step, acc.is_main_process)
    window, last_eval = MetricsWindow(), {}
    batches = DeviceBatches(t.data.train, acc.device, t.model.config.ttt_steps,
                            bool(cfg.loss.skip_masked_rows), prefetch=t.device_prefetch)
    t.module.train()
    stopping = False
    profiler = StepProfiler(cfg.train.profile_start, cfg.train.profile_steps,
                            t.out / "profile", acc.process_index)
    update = micro_step_for(acc, t.module, t.optimizer, skipped, cfg.optim.clip_grad_norm)
    with StopRequest() as stop, contextlib.ExitStack() as closing, profiler:
        for c in (logger, bar, batches):   # batches: stops the loader's prefetch threads
            closing.callback(c.close)
        if t.data.stream is not None:      # after the loader's threads: they wait on it
            closing.callback(t.data.stream.close)
        while step < t.total_steps and not stopping:
            with profiler.step(step + 1):       # numbered as the metrics number it
                window.gnorm = train_step(t, batches, window, step, update)
            window.steps += 1
            step += 1
            bar.update(1)
            done = step >= t.total_steps
            if _every(step, cfg.train.log_every) or done:
                skipped.read(step)
                rec = window.flush(acc, t.flops_per_token, peak)
                logger.log(step, rec)
                bar.report(step, rec)   # the bar on a terminal, a log line otherwise
            is_eval = _every(step, cfg.train.eval_every) or done
            if is_eval:
                last_eval = _evaluate_and_log(t, logger, step)
            walk = last_eval.get("tau_trajectory") if is_eval else None
            # a new best decoder-walk τ is checkpointed, so export.select=best can export it
            new_best = best.offer(walk, step) and cfg.export.select == ExportSelect.best
            stopping = not done and stop.due(acc, step, cfg.train.log_every)
            if _every(step, cfg.train.save_every) or done or new_best or stopping:
                _save(t, step, batches.state_dict(), objective, skipped, last_eval, best,
                      walk=walk, evaluated=is_eval)
            if is_eval and acc.is_main_process:
                write_run_plots(t.out, selected_step=best.step)
            if _every(step, cfg.export.every) and not done:
                export_final(t, t.out / f"export-step{step:06d}", step,
                             last_eval if is_eval else None)
        if stopping or stop.due(acc, step, every=0):   # also a signal during the last step
            raise Stopped(f"stopped at step {step} of {t.total_steps} on {stop.signal}: "
                          f"checkpoint saved in {t.out / 'checkpoints'}; the same command "
                          f"with run_name={cfg.run_name} train.resume=latest continues "
                          f"from it", stop.signum)
    if step == start and t.data.eval is not None:   # resumed at the end: nothing ran
        last_eval = evaluate(t)
    if t.data.stream is not None:
        t.data.stream.finish()
    summary: dict[str, Any] = {"steps": step, "nonfinite_steps": skipped.read(step),
                               "skipped_samples": skipped_samples(t.data.train.dataset),
                               "eval": last_eval, "tau": last_eval.get("tau"),
                               "tau_trajectory": last_eval.get("tau_trajectory"),
                               "tau_alpha": last_eval.get("tau_alpha")}
    return {**summary, **export_selected(t, step, last_eval)}


def train_step(t: Trainer, batches: DeviceBatches, window: MetricsWindow,
               step: int, update: Callable[[Tensor, int], Tensor | float | None]
               ) -> Tensor | float | None:
    """One optimizer step: optim.grad_accum micro-batches (forward, backward with `update`, the
    run's `train.update.micro_step_for`, metrics window, then clip + update at the last), then
    the LR schedule. Returns the gradient norm (a device tensor, no host sync here, except on
    the host-checked DeepSpeed path: a float)."""
    acc, d2t = t.accelerator, t.model.module.drafter.d2t
    while True:
        batch, inputs = next(batches)
        window.wait += batches.take_wait()
        with acc.accumulate(t.module):
            res = t.module(**inputs)
            # a NaN/inf micro-batch drops its whole optimizer step (train.update), except on
            # the host-checked DeepSpeed path, which skips the micro-batch alone
            gnorm = update(res.loss, step)
            window.add(res, batch, d2t)
        if acc.sync_gradients:
            window.lr = t.scheduler.get_last_lr()[0]     # the rate this step trained at
            t.scheduler.step()
            return gnorm


def _evaluate_and_log(t: Trainer, logger: MetricsLogger, step: int) -> dict[str, Any]:
    """The held-out eval at `step`, logged (empty without an eval split)."""
    res = evaluate(t)
    if res:
        logger.log(step, res, prefix="eval")
        log.info("eval step %d: decoder walk tau %.3f (within each answer's first %d tokens "
                 "%.3f; mean over every start %.3f), acc_0 %.3f, %s", step,
                 res["tau_trajectory"], t.cfg.eval.max_new_tokens, res["tau_trajectory_capped"],
                 res["tau"], res["acc_0"], alpha_text(res))
    return res


def _every(step: int, n: int) -> bool:
    return bool(n) and step % n == 0


def evaluate(t: Trainer) -> dict[str, Any]:
    """Exact acceptance on the held-out split (`train.evaluate.offline.count_acceptance`, summed over
    ranks): `tau` averages the chain over every start, `tau_trajectory` walks the text as a
    greedy decoder does and counts as the engines do (`models.metrics`), and
    `tau_trajectory_capped` within each answer's first eval.max_new_tokens tokens, the length
    real decoding checks; `tau_ctx_<bucket>` and the `by_context` table per bucket of
    eval.context_buckets (`models.context`); `loss` is the training objective's mean."""
    if t.data.eval is None:
        return {}
    K, skip_rows = t.model.config.ttt_steps, bool(t.cfg.loss.skip_masked_rows)
    losses: list[Tensor] = []

    def forward(batch):
        batch, inputs = to_device(batch, t.accelerator.device, K, skip_rows)
        res = t.module(**inputs)
        losses.append(res.loss.detach().float())
        return batch, res.draft_argmax, res.metric_mask, res.alpha

    edges = tuple(t.cfg.eval.context_buckets)
    t.module.eval()
    counts, _ = count_acceptance(forward, t.data.eval, t.model.module.drafter.d2t, K,
                                 edges=edges, walk_cap=t.cfg.eval.max_new_tokens, alpha=True)
    t.module.train()
    table = context_table(counts, edges)
    return {**summarize(counts), **context_scalars(table), "by_context": table,
            "loss": mean_over_ranks(t.accelerator, losses)}


def _resume(t: Trainer, objective: dict) -> tuple[int, int, BestWalk]:
    """(step, non-finite steps so far, best eval decoder walk so far) of the checkpoint
    train.resume names, or (0, 0, none)."""
    path = ckpt.resolve_resume(t.cfg.train.resume, t.out / "checkpoints")
    if path is None:
        return 0, 0, BestWalk()
    state = ckpt.load(t.accelerator, path, objective)
    t.data.train.load_state_dict(state["loader"])
    t.scheduler.load_state_dict(state["schedule"])
    for line in apply_optim_settings(t.scheduler, t.cfg.optim):
        log.warning("resumed with a changed setting: %s", line)
    best = state.get("best") or {}
    if t.accelerator.is_main_process:
        ckpt.rewind(t.out / "checkpoints", path, best)
    t.accelerator.wait_for_everyone()
    return (state["step"], state.get("nonfinite", 0),
            BestWalk(best.get("tau_trajectory"), best.get("step")))


def _save(t: Trainer, step: int, loader_state: dict, objective: dict, skipped: SkippedSteps,
          last_eval: dict[str, float], best: BestWalk, walk: float | None,
          evaluated: bool = False) -> None:
    """Checkpoint `step` (the eval decoder-walk τ of this step, when finite, competes for
    `best`; `train.selection`); its provenance holds the eval record when `evaluated`.
    loader_state: where the training batches resume (`DeviceBatches.state_dict`)."""
    state = {"step": step, "nonfinite": skipped.read(step), "objective": objective,
             "loader": loader_state, "schedule": t.scheduler.state_dict(),
             "eval": {k: v for k, v in last_eval.items()
                      if isinstance(v, (int, float)) and math.isfinite(v)},
             "best": {"tau_trajectory": best.value, "step": best.step}}
    walk = walk if walk is not None and math.isfinite(walk) else None
    ckpt.save(t.accelerator, t.out / "checkpoints", step, state, keep_last=t.cfg.train.keep_last,
              best_metric=walk,
              best_record={key: last_eval.get(key) for key in ("tau", "tau_trajectory_capped")},
              add_files=lambda d: write_export_meta(t, d, step,
                                                     last_eval if evaluated else None))


