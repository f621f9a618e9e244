"""Benchmark the FULL drafter training step: forward, backward, clip, optimizer step.

The step is the trainer's own path (train.step.TrainingModule: TTT unroll → teacher → fused
loss; train.optim: MasterAdamW on bf16 parameters; the trainer's clip and metrics counts), on
drafters of real shapes with random weights and synthetic packed batches of several documents
(random aux / last / target_argmax, documents of 64-1536 tokens filling T).

Reported per case (median of the timed steps after warm-up): step ms (each step synchronised;
CUDA events split it into forward / backward / optimizer), stream ms (`iters` steps back to
back, one sync at the end: what a host that never waits inside the step sustains), tokens/s
for both (T per step), MFU with two FLOP counts, peak memory, and a torch.profiler breakdown
of GPU time (matmul / attention / loss kernels / elementwise / optimizer / idle;
benchmarks/profile_breakdown.py).
  mfu_eyas   train.tracking.flops_per_token (attention over the documents actually packed,
             fc counted 4×, teacher over the draft vocabulary)
  mfu_sf     SpecForge-compatible: 6 × trainable matmul params × K + 6 × fc + 2·tH·V (teacher
             logits over the full target vocabulary) + causal attention over the whole packed
             sequence (context T/2, fwd+bwd 12·ctx·heads·head_dim per step)
Both against the dense bf16 peak (989 TFLOP/s for H100/H200, `--peak-tflops`).

Cases (`--cases`, comma list; all but async keep the two host syncs the trainer had before it
decided skipped steps on the device: a per-micro-batch `.item()` NaN check and float(grad
norm)): base (eager element-wise, optimizer via fp32 gradient copies + torch fused AdamW: the
step before compile/fusion), compile (torch.compile of each step's element-wise work), fused
(compile + one-pass Triton master AdamW), nosync (fused without the `.item()` NaN check), ckpt
(fused + the MLP of each step recomputed in backward), rows (fused, the loss rows listed on the
host as the trainer does with loss.skip_masked_rows: masked rows skip the lm_head GEMMs),
rows+ckpt (both), async (rows with no host sync inside the step: the norm stays on the device
and a skip flag goes to the optimizer, as train.update.micro_step does, and compact masters;
the embedding table on the GPU), async-fp32m (async with full fp32 master copies), async-host
(async with drafter.host_embedding: the embedding rows, pinned on the host as the loader's
threads leave them, sent with each step: the trainer's default with CUDA),
async-host-qkv-per-step (async-host with drafter.embedding_qkv_once=false: the embedding half
of q/k/v projected in every step, the step before that option),
async-host-autotune (async-host with every step graph, flex attention and the merge
included, compiled in torch.compile's "max-autotune-no-cudagraphs" mode: Triton GEMM templates
tried against cuBLAS, with their epilogues fused, and tuned element-wise kernels; its first
compile took over 6 minutes at T = 4096 on an H200: run it alone in a call), fp8 / fp8-rowwise (async with drafter.fp8=tensorwise / rowwise: torchao float8
linears in the default drafter.fp8_layers, all but fc), fp8-host (fp8 with the host
embedding), fp8-host-split (fp8-host with drafter.fp8_split_qkv: the embedding half of q/k/v
in bf16 once per unroll, the hidden half in FP8), fp8-all (fp8 with fc's GEMMs in FP8 too:
the default before fc was kept in bf16).

The real trainer end to end (accelerate + DeepSpeed ZeRO-2 on shards on disk): see
benchmarks/train_e2e.py (`python benchmarks/train_step.py --trainer ...` forwards to it).

Usage:
  python benchmarks/train_step.py --target llama-3.1-8b --tokens 4096 --cases base,compile,fused
  python benchmarks/train_step.py --target kimi-k2.5 --tokens 2048,4096,8192,32768 --cases fused
  CPU smoke run: --target tiny-llama --tokens 256 --ttt 3 --cases base --device cpu --iters 2
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import NamedTuple
from unittest import mock

import torch


from eyas.data.store.loader import Batch
from eyas.models import attention
from eyas.models.config import Eagle3Config
from eyas.models.drafter import Eagle3Drafter
from eyas.models.fp8 import DEFAULT_FP8_LAYERS, FP8_LAYERS, convert_drafter_to_float8
from eyas.models.metrics import accept_counts
from eyas.models.objective import metric_rows
from eyas.data.common.targets import load_target_config, text_config
from eyas.train.choices import Schedule
from eyas.train.config import LossConfig, OptimConfig
from eyas.train.optim import MasterAdamW, build_scheduler
from eyas.data.store.packing import embedding_ids
from eyas.train.step import TrainingModule, batch_inputs, send
from eyas.train.tracking import flops_per_token
from eyas.train.update import poisoned

GIB = 1 << 30


class Case(NamedTuple):
    compile_layer: bool
    impl: str                   # MasterAdamW impl
    nan_sync: bool              # per-micro-batch `.item()` NaN check
    ckpt: bool                  # checkpoint_mlp
    rows: bool                  # loss rows listed on the host (loss.skip_masked_rows)
    norm_sync: bool = True      # float(grad norm) on the host; False: a device skip flag
    fp8: str = "off"            # drafter.fp8 (models.fp8): torchao float8 linears
    compact: bool = False       # optim.compact_masters: masters as bf16 param + int16 low bits
    host_embed: bool = False    # drafter.host_embedding: rows looked up on the host per step
    qkv_once: bool = True       # drafter.embedding_qkv_once
    moments: str = "fp32"       # optim.moments: AdamW moments in fp32 or bf16
    vmap_mask: bool = False     # the step-0 BlockMask through create_block_mask (the T² vmap)
    fp8_layers: tuple = DEFAULT_FP8_LAYERS  # drafter.fp8_layers: which linears run FP8 GEMMs
    compile_mode: str | None = None  # torch.compile mode of the step graphs (None: torch's default)
    fp8_split: bool = False     # drafter.fp8_split_qkv


CASES = {
    "base": Case(False, "torch", True, False, False),
    "compile": Case(True, "torch", True, False, False),
    "fused": Case(True, "triton", True, False, False),
    "nosync": Case(True, "triton", False, False, False),
    "ckpt": Case(True, "triton", True, True, False),
    "rows": Case(True, "triton", True, False, True),
    "rows+ckpt": Case(True, "triton", True, True, True),
    "async-fp32m": Case(True, "triton", False, False, True, norm_sync=False),
    "async": Case(True, "triton", False, False, True, norm_sync=False, compact=True),
    "async-host": Case(True, "triton", False, False, True, norm_sync=False, compact=True,
                       host_embed=True),
    "async-host-qkv-per-step": Case(True, "triton", False, False, True, norm_sync=False,
                                    compact=True, host_embed=True, qkv_once=False),
    "async-host-vmap-mask": Case(True, "triton", False, False, True, norm_sync=False,
                                 compact=True, host_embed=True, vmap_mask=True),
    "async-host-bf16m": Case(True, "triton", False, False, True, norm_sync=False, compact=True,
                             host_embed=True, moments="bf16"),
    "async-host-bf16m-ckpt": Case(True, "triton", False, True, True, norm_sync=False,
                                  compact=True, host_embed=True, moments="bf16"),
    "async-host-autotune": Case(True, "triton", False, False, True, norm_sync=False,
                                compact=True, host_embed=True,
                                compile_mode="max-autotune-no-cudagraphs"),
    "fp8": Case(True, "triton", False, False, True, norm_sync=False, fp8="tensorwise",
                compact=True),
    "fp8-host": Case(True, "triton", False, False, True, norm_sync=False, fp8="tensorwise",
                     compact=True, host_embed=True),
    "fp8-host-split": Case(True, "triton", False, False, True, norm_sync=False,
                           fp8="tensorwise", compact=True, host_embed=True, fp8_split=True),
    "fp8-rowwise": Case(True, "triton", False, False, True, norm_sync=False, fp8="rowwise",
                        compact=True),
    "fp8-all": Case(True, "triton", False, False, True, norm_sync=False, fp8="tensorwise",
                    compact=True, fp8_layers=FP8_LAYERS),
}


# ------------------------------------------------------------------------------ inputs
def doc_lengths(T: int, seed: int) -> list[int]:
    """Random document lengths in [64, 1536] summing to exactly T."""
    g = torch.Generator().manual_seed(seed)
    out, left = [], T
    while left > 0:
        n = min(left, int(torch.randint(64, 1537, (1,), generator=g)))
        out.append(n)
        left -= n
    return out


def make_batch(cfg: Eagle3Config, T: int, vocab_ids: torch.Tensor, device, seed: int) -> Batch:
    """A full packed Batch: 20 % of each document is prompt (loss_mask 0), 90 % of the target
    argmaxes fall inside the draft vocabulary `vocab_ids` (the position mask drops the rest)."""
    lengths = doc_lengths(T, seed)
    g = torch.Generator(device=device).manual_seed(seed)
    doc = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])
    pos = torch.cat([torch.arange(n) for n in lengths])
    mask = torch.cat([torch.arange(n) >= n // 5 for n in lengths])
    V, tH = cfg.vocab_size, cfg.target_hidden_size
    ids = torch.randint(0, V, (T,), device=device, generator=g)
    pick = vocab_ids[torch.randint(0, vocab_ids.numel(), (T,), device=device, generator=g)]
    argmax = torch.where(torch.rand(T, device=device, generator=g) < 0.9, pick,
                         torch.randint(0, V, (T,), device=device, generator=g))
    return Batch(input_ids=ids, loss_mask=mask.to(device), doc_ids=doc.to(device),
                 positions=pos.to(device),
                 aux=torch.randn(T, 3 * tH, device=device, generator=g).bfloat16(),
                 last=torch.randn(T, tH, device=device, generator=g).bfloat16(),
                 target_argmax=argmax, num_tokens=T)


def build(cfg: Eagle3Config, case: str, device, K: int, seed: int = 0):
    """(TrainingModule, MasterAdamW, scheduler, draft vocab ids) for one case, on `device`."""
    c = CASES[case]
    torch.manual_seed(seed)
    on_cuda = device.type == "cuda"
    with torch.device(device):
        drafter = Eagle3Drafter(cfg, attention="flex" if on_cuda else "eager",
                                compile_flex=on_cuda, compile_layer=c.compile_layer and on_cuda,
                                checkpoint_mlp=c.ckpt, embedding_qkv_once=c.qkv_once,
                                fp8_split_qkv=c.fp8_split and c.fp8 != "off" and on_cuda)
    dtype = torch.bfloat16 if on_cuda else torch.float32
    drafter.to(dtype)
    convert_drafter_to_float8(drafter, c.fp8 if on_cuda else "off", c.fp8_layers)
    drafter.embed_tokens.weight.normal_()
    V, Vd, tH = cfg.vocab_size, cfg.draft_vocab_size, cfg.target_hidden_size
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:Vd].sort().values
    drafter.set_vocab_map(ids - torch.arange(Vd))
    head_rows = (torch.randn(Vd, tH, device=device) * 4 * tH ** -0.5).to(dtype)
    module = TrainingModule(drafter.cpu() if c.host_embed else drafter, head_rows, LossConfig(),
                            loss_impl="triton" if on_cuda else "torch", ttt_steps=K,
                            host_embedding=c.host_embed).to(device)   # 0.8 step weight, valid rows
    params = [p for p in module.parameters() if p.requires_grad]
    opt = MasterAdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0,
                      impl=c.impl if on_cuda else "torch", compact=c.compact and on_cuda,
                      moments=c.moments)
    optim_cfg = OptimConfig(warmup_steps=0, warmup_ratio=0.0, schedule=Schedule.constant)
    return module, opt, build_scheduler(opt, optim_cfg, 1000), ids.to(device)


# ------------------------------------------------------------------------------ the step
def train_step(module, opt, sched, batch: Batch, case: Case, events=None,
               rows=None, host_embeds=None) -> float | torch.Tensor:
    """One optimizer step as train/trainer.py runs it (grad_accum 1, DDP path), with the host
    syncs `case` asks for; `host_embeds` (pinned host rows, as the loader's threads fill them
    with drafter.host_embedding) are sent with the step, as train.step.to_device does.
    Returns the gradient norm (a device tensor without norm_sync)."""
    rec = (lambda i: events[i].record()) if events else (lambda i: None)
    rec(0)
    embeds = None if host_embeds is None else send(host_embeds, batch.input_ids.device)
    res = module(**batch_inputs(batch, rows, embeds))
    loss = res.loss
    if case.nan_sync and (~torch.isfinite(loss)).item():   # the old per-micro-batch check
        raise RuntimeError("non-finite loss in the benchmark")
    if not case.norm_sync:
        loss = poisoned(loss)                      # a NaN/inf loss makes the norm non-finite
    rec(1)
    loss.backward()
    rec(2)
    accept_counts(res.draft_argmax.detach(), module.drafter.d2t, batch.target_argmax,
                  res.metric_mask)                   # the trainer's metrics window
    params = [p for p in module.parameters() if p.requires_grad]
    with torch.profiler.record_function("bench.clip"):
        gnorm = torch.nn.utils.clip_grad_norm_(params, 0.5)
    if case.norm_sync:
        gnorm = float(gnorm)                         # the old trainer's step sync
        opt.step()
    else:
        opt.step(skip=~torch.isfinite(gnorm))
    opt.zero_grad(set_to_none=True)
    sched.step()
    rec(3)
    return gnorm


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def stream_ms(step, iters: int, device) -> float:
    """Mean ms of `iters` calls step(i) back to back, synchronised once at the end."""
    _sync(device)
    t = time.perf_counter()
    for i in range(iters):
        step(i)
    _sync(device)
    return (time.perf_counter() - t) * 1e3 / max(iters, 1)


def run_case(cfg, case: str, T: int, K: int, iters: int, warmup: int, device,
             profile_steps: int, diagnose_steps: int = 0) -> dict:
    c = CASES[case]
    with contextlib.ExitStack() as stack:
        if c.vmap_mask:                    # the attention module looks the builder up per batch
            stack.enter_context(mock.patch.object(attention, "step0_block_mask",
                                                  attention.reference_block_mask))
        if c.compile_mode:   # every step graph (layer pieces, flex attention, the merge) in
            # a cache of its own: the default-mode graphs of the other cases are neither reused
            # nor replaced
            stack.enter_context(mock.patch.dict(attention._COMPILED, clear=True))
            stack.enter_context(mock.patch.object(torch, "compile", functools.partial(
                torch.compile, mode=c.compile_mode)))
        return _run_case(cfg, case, T, K, iters, warmup, device, profile_steps, diagnose_steps)


def _run_case(cfg, case: str, T: int, K: int, iters: int, warmup: int, device,
              profile_steps: int, diagnose_steps: int = 0) -> dict:
    module, opt, sched, vocab_ids = build(cfg, case, device, K)
    batches = [make_batch(cfg, T, vocab_ids, device, seed=s) for s in (0, 1)]
    # the trainer lists rows from the host copy of the batch (train.step.to_device)
    rows = [metric_rows(b.doc_ids.cpu(), b.loss_mask.cpu(), K).to(device) if CASES[case].rows
            else None for b in batches]
    on_cuda = device.type == "cuda"

    table, host = module.host_embedding, []
    for b in batches:   # the rows as the loader's threads leave them: pinned host memory
        e = None if table is None else table.index_select(0, embedding_ids(b.input_ids.cpu(), K))
        host.append(e.pin_memory() if e is not None and on_cuda else e)

    def step(i, events=None):
        return train_step(module, opt, sched, batches[i % 2], CASES[case], events,
                          rows=rows[i % 2], host_embeds=host[i % 2])

    t0 = time.perf_counter()
    first = None
    for i in range(warmup):
        gn = step(i)
        first = gn if i == 0 else first          # same seed in every case: a parity check
    _sync(device)
    warm_s = time.perf_counter() - t0
    static = torch.cuda.memory_allocated() if on_cuda else 0      # params + masters + moments
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    step_ms, split = [], []
    for i in range(iters):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)] if on_cuda else None
        _sync(device)
        t = time.perf_counter()
        step(i, ev)
        _sync(device)
        step_ms.append((time.perf_counter() - t) * 1e3)
        if ev:
            split.append([ev[j].elapsed_time(ev[j + 1]) for j in range(3)])
    peak = torch.cuda.max_memory_allocated() if on_cuda else 0
    ms, stream = statistics.median(step_ms), stream_ms(step, iters, device)
    out = dict(case=case, tokens=T, ttt_steps=K, step_ms=ms, stream_ms=stream,
               step_ms_all=step_ms,
               rows_listed=None if rows[0] is None else rows[0].numel() / (K * T),
               tokens_per_s=T / (ms / 1e3), stream_tokens_per_s=T / (stream / 1e3),
               warmup_s=warm_s, first_grad_norm=None if first is None else float(first),
               peak_gib=peak / GIB,
               static_gib=static / GIB, activations_gib=(peak - static) / GIB,
               doc_lengths=[doc_lengths(T, s) for s in (0, 1)])
    if split:
        med = [statistics.median(x[j] for x in split) for j in range(3)]
        out.update(fwd_ms=med[0], bwd_ms=med[1], opt_ms=med[2])
    if profile_steps and on_cuda:
        from benchmarks.profile_breakdown import profile_steps as prof
        out["profile"] = prof(step, profile_steps)
    if diagnose_steps and on_cuda:
        from benchmarks.host_overhead import diagnose
        out["host"] = diagnose(step, diagnose_steps)
    del module, opt, sched, batches
    if on_cuda:
        torch.cuda.empty_cache()
    return out


# ------------------------------------------------------------------------------ FLOPs
def specforge_flops_per_token(cfg: Eagle3Config, K: int, T: int) -> float:
    """SpecForge-compatible count (module docstring): 6·P·K + 6·fc + 2·tH·V + attention."""
    H, tH, I = cfg.hidden_size, cfg.target_hidden_size, cfg.intermediate_size
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    p_step = 2 * H * (nh + 2 * nkv) * hd + nh * hd * H + 3 * H * I + H * cfg.draft_vocab_size
    attention = K * 12 * (T / 2) * nh * hd
    return 6 * p_step * K + 6 * 3 * tH * H + 2 * tH * cfg.vocab_size + attention


def drafter_config(target: str, K: int, draft_vocab: int) -> Eagle3Config:
    tcfg = load_target_config(target)
    vd = min(draft_vocab, int(text_config(tcfg)["vocab_size"]))
    return Eagle3Config.from_target(tcfg, draft_vocab_size=vd, ttt_steps=K)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--trainer" in argv:
        argv.remove("--trainer")
        sys.path.insert(0, str(Path(__file__).resolve().parent))   # run as a script or -m
        from train_e2e import main as e2e
        return e2e(argv)
    ap = argparse.ArgumentParser(prog="train_step", description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="llama-3.1-8b",
                    help="target preset the drafter is shaped for")
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--tokens", default="4096", help="comma list of packed tokens per step (T)")
    ap.add_argument("--ttt", type=int, default=7, help="TTT steps (K)")
    ap.add_argument("--cases", default="base,compile,fused", help=f"comma list of {list(CASES)}")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profile", type=int, default=0,
                    help="profile this many extra steps (GPU time breakdown) of --profile-cases")
    ap.add_argument("--profile-cases", default=None, help="comma list (default: the last case)")
    ap.add_argument("--host", type=int, default=0, help="also profile this many steps' host "
                    "side and list the synchronising calls of one (benchmarks/host_overhead.py)")
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    for knob in ("cache_size_limit", "recompile_limit"):   # several drafters/shapes per process
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 64)
    cfg = drafter_config(args.target, args.ttt, args.draft_vocab)
    cases = args.cases.split(",")
    for c in cases:
        if c not in CASES:
            ap.error(f"unknown case {c!r}; choose from {list(CASES)}")
    profiled = args.profile_cases.split(",") if args.profile_cases else cases[-1:]
    rows = []
    for T in [int(x) for x in args.tokens.split(",")]:
        for case in cases:
            try:
                r = run_case(cfg, case, T, args.ttt, args.iters, args.warmup, device,
                             args.profile if case in profiled else 0,
                             args.host if case in profiled else 0)
            except torch.OutOfMemoryError as e:
                r = dict(case=case, tokens=T, ttt_steps=args.ttt, error=f"OOM: {e}"[:300])
                torch.cuda.empty_cache()
            except Exception as e:      # a compiler or library error: this case's row, not the run
                traceback.print_exc()
                r = dict(case=case, tokens=T, ttt_steps=args.ttt,
                         error=f"{type(e).__name__}: {' '.join(str(e).split())}"[:300])
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            if "error" not in r:
                mean_doc = statistics.mean(n for ls in r["doc_lengths"] for n in ls)
                f_e = flops_per_token(cfg, args.ttt, mean_doc)
                f_s = specforge_flops_per_token(cfg, args.ttt, T)
                peak = args.peak_tflops * 1e12
                r.update(flops_per_token_eyas=f_e, flops_per_token_sf=f_s,
                         mfu_eyas=f_e * r["tokens_per_s"] / peak,
                         mfu_sf=f_s * r["tokens_per_s"] / peak,
                         us_per_token=1e6 / r["tokens_per_s"])
            rows.append(r)
            print(json.dumps({k: v for k, v in r.items()
                              if k not in ("doc_lengths", "step_ms_all", "profile", "host")}),
                  file=sys.stderr, flush=True)
            if args.json:   # after every case: a later OOM or time-out keeps what was measured
                Path(args.json).write_text(json.dumps(dict(
                    target=args.target, config=cfg.to_dict(), torch=torch.__version__,
                    device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    results=rows), indent=1))
    sys.path.insert(0, str(Path(__file__).resolve().parent))   # run as a script or loaded
    from train_step_table import format_table
    print(format_table(args.target, cfg, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
