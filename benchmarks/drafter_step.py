"""Benchmark one drafter training step: the K-step TTT unroll forward + backward.

The drafter (models.drafter.Eagle3Drafter, bf16 parameters) runs over one packed batch of T
tokens holding several documents, for K TTT steps, then a loss and its backward:
  standin  Σ_k sum(lm_head(hidden[k])) in fp32, one step at a time (the loss's GEMM cost without
           its soft-CE: isolates the drafter)
  fused    kernels.eagle3_loss(impl="triton") against a random teacher (the real training loss)
Attention: "flex" (compiled flex_attention, step-0 BlockMask + log-sum-exp diagonal) or "eager".
Two batches with different document layouts alternate (a new layout must not recompile).
Reported per case: median forward and backward ms (synchronised wall clock), peak memory (GiB, absolute and
above the parameters + gradients), tokens/s (T per step) and model TFLOP/s (matmul + attention
FLOPs of the unroll and lm_head, 3x forward).

Usage: python benchmarks/drafter_step.py [--target llama-3.1-8b] [--tokens 4096] [--ttt 7]
         [--cases flex:standin,flex:fused] [--iters 10] [--json PATH]
       CPU smoke run: --target tiny-llama --tokens 256 --ttt 3 --cases eager:standin --device cpu
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from eyas.models.config import Eagle3Config
from eyas.models.drafter import Eagle3Drafter
from eyas.data.common.targets import load_target_config

GIB = 1 << 30


def make_batch(T: int, tH: int, V: int, device, seed: int = 0):
    """A packed batch of documents of random lengths (64..1536 tokens) filling T exactly."""
    g = torch.Generator().manual_seed(seed)
    lengths, left = [], T
    while left > 0:
        n = min(left, int(torch.randint(64, 1537, (1,), generator=g)))
        lengths.append(n)
        left -= n
    doc = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])
    pos = torch.cat([torch.arange(n) for n in lengths])
    ids = torch.randint(0, V, (T,), generator=g)
    aux = torch.randn(T, 3 * tH, generator=g).bfloat16()
    return [x.to(device) for x in (ids, aux, doc, pos)], lengths


def model_flops(cfg: Eagle3Config, T: int, K: int, lengths: list[int]) -> float:
    """Training FLOPs (3x forward) of the unroll + lm_head: GEMMs and attention score/value products."""
    H, I, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    per_step = 2 * H * (nh + 2 * nkv) * hd + nh * hd * H + 3 * H * I + cfg.draft_vocab_size * H
    fwd = 2 * T * (K * per_step + 3 * cfg.target_hidden_size * H)
    causal_pairs = sum(n * (n + 1) // 2 for n in lengths)
    for k in range(K):
        fwd += 2 * 2 * nh * hd * (causal_pairs + k * T)
    return 3.0 * fwd


def _recompiles() -> int:
    """Graphs dynamo compiled so far (a new document layout must not add one)."""
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def run_case(cfg: Eagle3Config, attention: str, loss_kind: str, batches, K: int, iters: int,
             warmup: int, device) -> dict:
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg, attention=attention, compile_flex=True).to(device, torch.bfloat16)
    drafter.embed_tokens.weight.normal_()
    T = batches[0][0].shape[0]
    teacher = w = None
    if loss_kind == "fused":
        from eyas import kernels
        teacher = torch.softmax(torch.randn(T, cfg.draft_vocab_size, device=device) * 3, -1).bfloat16()
        w = torch.full((K, T), 1.0 / T, device=device)
        for k in range(K):
            w[k, T - 1 - k:] = 0

    def loss_fn(hidden):
        if loss_kind == "fused":
            return kernels.eagle3_loss(hidden, drafter.lm_head.weight, teacher, w, impl="triton").loss
        total = hidden.new_zeros((), dtype=torch.float32)
        for k in range(hidden.shape[0]):
            total = total + torch.nn.functional.linear(hidden[k], drafter.lm_head.weight).float().sum()
        return total

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    params = sum(p.numel() * p.element_size() for p in drafter.parameters())
    grads = sum(p.numel() * p.element_size() for p in drafter.parameters() if p.requires_grad)
    fwd_ms, bwd_ms, first_s = [], [], None
    for i in range(warmup + iters):
        drafter.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        sync()
        ids, aux, doc, pos = batches[i % len(batches)]      # alternate document layouts
        t0 = time.perf_counter()
        out = drafter(ids, aux, doc, pos, K)
        loss = loss_fn(out.hidden)
        sync()
        t1 = time.perf_counter()
        loss.backward()
        sync()
        t2 = time.perf_counter()
        if i == 0:
            first_s = t2 - t0
        if i >= warmup:
            fwd_ms.append((t1 - t0) * 1e3)
            bwd_ms.append((t2 - t1) * 1e3)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
    fwd, bwd = statistics.median(fwd_ms), statistics.median(bwd_ms)
    return dict(attention=attention, loss=loss_kind, tokens=T, ttt_steps=K, fwd_ms=fwd,
                bwd_ms=bwd, step_ms=fwd + bwd, first_iter_s=first_s,
                peak_gib=peak / GIB,
                peak_over_params_grads_gib=(peak - params - grads) / GIB if peak else 0.0,
                tokens_per_s=T / ((fwd + bwd) / 1e3), loss_value=float(loss.detach()),
                recompiles=_recompiles())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="drafter_step", description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="llama-3.1-8b", help="target preset the drafter is shaped for")
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--tokens", type=int, default=4096, help="packed tokens per batch (T)")
    ap.add_argument("--ttt", type=int, default=7, help="TTT steps (K)")
    ap.add_argument("--cases", default="flex:standin,flex:fused",
                    help="comma list of attention:loss (attention flex|eager|lse-eager, loss standin|fused)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    cfg = Eagle3Config.from_target(load_target_config(args.target), draft_vocab_size=args.draft_vocab)
    made = [make_batch(args.tokens, cfg.target_hidden_size, cfg.vocab_size, device, seed=s)
            for s in (0, 1)]
    batches, lengths = [b for b, _ in made], made[0][1]
    flops = statistics.mean(model_flops(cfg, args.tokens, args.ttt, n) for _, n in made)
    rows = []
    for case in args.cases.split(","):
        attention, loss_kind = case.split(":")
        r = run_case(cfg, attention, loss_kind, batches, args.ttt, args.iters, args.warmup, device)
        r["tflops"] = flops / (r["step_ms"] / 1e3) / 1e12
        rows.append(r)
        print(f"{case:>16}: fwd {r['fwd_ms']:8.2f} ms  bwd {r['bwd_ms']:8.2f} ms  "
              f"peak {r['peak_gib']:6.2f} GiB  first iter {r['first_iter_s']:.1f} s", file=sys.stderr)
    head = f"{'case':>16} | {'fwd ms':>8} | {'bwd ms':>8} | {'step ms':>8} | {'peak GiB':>8} | " \
           f"{'act GiB':>8} | {'tok/s':>9} | {'TFLOP/s':>7}"
    print(f"drafter {args.target}: H={cfg.hidden_size} heads={cfg.num_attention_heads}/"
          f"{cfg.num_key_value_heads} I={cfg.intermediate_size} Vd={cfg.draft_vocab_size} "
          f"T={args.tokens} ({len(lengths)}/{len(made[1][1])} docs) K={args.ttt} on {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['attention'] + ':' + r['loss']:>16} | {r['fwd_ms']:8.2f} | {r['bwd_ms']:8.2f} | "
              f"{r['step_ms']:8.2f} | {r['peak_gib']:8.2f} | {r['peak_over_params_grads_gib']:8.2f} | "
              f"{r['tokens_per_s']:9.0f} | {r['tflops']:7.1f}")
    result = dict(target=args.target, config=cfg.to_dict(), doc_lengths=[n for _, n in made],
                  torch=torch.__version__, model_tflop_per_step=flops / 1e12, results=rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
