"""Benchmark the EAGLE-3 loss (lm_head + soft CE vs the teacher, all K TTT steps, fwd+bwd).

Methods, on the same inputs, side by side:
  naive      per step: fp32 logits, log_softmax, soft CE, argmax; one backward
  compile    torch.compile(dynamic=True) of the naive per-step function
  liger      Liger LigerFusedLinearJSDFunction (beta=0: forward KL, same gradient), one call per
             step; it recomputes the teacher from (last, W_teacher) every step
  specforge  SpecForge-style: materialised fp32 logits + fp32 target_p, a loss-only Triton
             kernel writing the gradient in place, argmax as an extra torch pass
  eyas       eagle3_loss(impl="triton"), one call for all K steps (+accept: with_accept);
             eyas+rows lists the weighted rows (known on the host in training), so the GEMMs
             skip masked rows; its floor is the 3-GEMM floor scaled by the listed fraction
Reported: median ms, peak extra memory (GiB, over the inputs; gradients included), relative
errors of loss/dh/dW against an fp32 reference (where it is affordable), and the share of the
cuBLAS floor (3 bf16 GEMMs per step, timed in the same run).

Usage: python benchmarks/fused_loss.py [--quick] [--sweep] [--json PATH]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time

import torch
import triton
import triton.language as tl

import eyas.kernels.loss as kl_loss
from eyas.kernels.loss import auto_chunk_size, eagle3_loss
from eyas.kernels.teacher import teacher_probs
from eyas.kernels import fused_loss

VD = 32000
DEV = "cuda"
GIB = 1 << 30


# --------------------------------------------------------------------------- inputs
def make_inputs(N, H, K, dist, seed=0):
    """Draft hidden/head, teacher (last, W_t, p), weights: mask·0.8^k / valid rows of step k."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    s = 6.0 if dist == "peaked" else 0.5                    # logit std of draft and teacher
    h = torch.randn(K, N, H, device=DEV, generator=g).bfloat16()
    W = (torch.randn(VD, H, device=DEV, generator=g) * s * H ** -0.5).bfloat16()
    last = torch.randn(N, H, device=DEV, generator=g).bfloat16()
    Wt = (torch.randn(VD, H, device=DEV, generator=g) * s * H ** -0.5).bfloat16()
    teacher = teacher_probs(last, Wt)               # [N, VD] bf16
    t = torch.arange(N, device=DEV)
    idx = torch.stack([(t + k).clamp(max=N - 1) for k in range(K)])          # [K, N]
    mask = (torch.rand(K, N, device=DEV, generator=g) > 0.15) & (t + torch.arange(
        K, device=DEV)[:, None] < N)
    m = mask.float()
    w = m * 0.8 ** torch.arange(K, device=DEV)[:, None] / m.sum(1, keepdim=True)
    rows = mask.reshape(-1).nonzero().flatten()             # what a host-side mask lists
    return dict(h=h, W=W, last=last, Wt=Wt, teacher=teacher, idx=idx, mask=mask, w=w, rows=rows)


# --------------------------------------------------------------------------- methods
def _naive_step(h, W, teacher, idx, w):
    z = (h @ W.T).float()                                   # [N, VD] fp32 logits
    p = teacher.index_select(0, idx).float()
    loss = (w * -(p * torch.log_softmax(z, -1)).sum(-1)).sum()
    return loss, z.argmax(-1)


_compiled_step = None


def run_naive(x, compiled=False):
    global _compiled_step
    step = _naive_step
    if compiled:
        if _compiled_step is None:
            _compiled_step = torch.compile(_naive_step, dynamic=True)
        step = _compiled_step
    h = x["h"].detach().requires_grad_()
    W = x["W"].detach().requires_grad_()
    total = 0.0
    for k in range(h.shape[0]):
        loss, _ = step(h[k], W, x["teacher"], x["idx"][k], x["w"][k])
        total = total + loss
    total.backward()
    return total, h.grad, W.grad


def run_liger(x):
    from liger_kernel.ops.fused_linear_jsd import LigerFusedLinearJSDFunction
    h = x["h"].detach().requires_grad_()
    W = x["W"].detach().requires_grad_()
    total = 0.0
    for k in range(h.shape[0]):
        last_k = x["last"].index_select(0, x["idx"][k])      # teacher row t+k
        labels = torch.where(x["mask"][k], 0, -100)         # -100 = ignored row
        loss = LigerFusedLinearJSDFunction.apply(h[k], W, last_k, x["Wt"], labels, 0.0, -100, 1.0)
        total = total + loss * 0.8 ** k                      # liger averages over kept rows
    total.backward()
    return None, h.grad, W.grad                              # its loss omits the teacher entropy


@triton.jit
def _sf_loss_kernel(z_ptr, p_ptr, w_ptr, loss_ptr, V, BLOCK: tl.constexpr):
    """Soft CE over one materialised fp32 row; the gradient overwrites the logits in place."""
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * V
    p_row = p_ptr + row * V
    w = tl.load(w_ptr + row)
    offs = tl.arange(0, BLOCK)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    sp = tl.zeros((BLOCK,), tl.float32)
    spz = tl.zeros((BLOCK,), tl.float32)
    for v0 in range(0, V, BLOCK):
        mask = v0 + offs < V
        z = tl.load(z_row + v0 + offs, mask=mask, other=float("-inf"))
        p = tl.load(p_row + v0 + offs, mask=mask, other=0.0)
        m_new = tl.maximum(m, tl.max(z, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), 0)
        m = m_new
        sp += p
        spz += p * tl.where(mask, z, 0.0)
    lse = m + tl.log(s)
    psum = tl.sum(sp, 0)
    tl.store(loss_ptr + row, w * (lse * psum - tl.sum(spz, 0)))
    for v0 in range(0, V, BLOCK):
        mask = v0 + offs < V
        z = tl.load(z_row + v0 + offs, mask=mask, other=0.0)
        p = tl.load(p_row + v0 + offs, mask=mask, other=0.0)
        tl.store(z_row + v0 + offs, w * (tl.exp(z - lse) * psum - p), mask=mask)


class _SFLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target_p, w):
        N, V = logits.shape
        loss = torch.empty(N, device=logits.device, dtype=torch.float32)
        _sf_loss_kernel[(N,)](logits, target_p, w, loss, V, BLOCK=4096, num_warps=8)
        ctx.save_for_backward(logits)                        # now holds dloss/dlogits
        return loss.sum()

    @staticmethod
    def backward(ctx, g):
        (grad,) = ctx.saved_tensors
        return grad * g, None, None


def run_specforge(x):
    h = x["h"].detach().requires_grad_()
    W = x["W"].detach().requires_grad_()
    total = 0.0
    for k in range(h.shape[0]):
        logits = (h[k] @ W.T).float()                        # [N, VD] fp32, materialised
        target_p = x["teacher"].index_select(0, x["idx"][k]).float()
        _ = logits.detach().argmax(-1)                       # accuracy: extra full-vocab pass
        total = total + _SFLoss.apply(logits, target_p, x["w"][k].contiguous())
    total.backward()
    return total, h.grad, W.grad


def run_eyas(x, with_accept=False, chunk_size=None, listed=False):
    h = x["h"].detach().requires_grad_()
    W = x["W"].detach().requires_grad_()
    out = eagle3_loss(h, W, x["teacher"], x["w"], impl="triton",
                              with_accept=with_accept, chunk_size=chunk_size,
                              rows=x["rows"] if listed else None)
    out.loss.backward()
    return out.loss, h.grad, W.grad


METHODS = {
    "naive": run_naive,
    "compile": lambda x: run_naive(x, compiled=True),
    "liger": run_liger,
    "specforge": run_specforge,
    "eyas": run_eyas,
    "eyas+accept": lambda x: run_eyas(x, with_accept=True),
    "eyas+rows": lambda x: run_eyas(x, listed=True),
}


# --------------------------------------------------------------------------- measuring
def reference(x):
    """fp32 loss and gradients (IEEE fp32 GEMMs), one step at a time."""
    h32 = x["h"].float()
    W32 = x["W"].float().requires_grad_()
    dh = torch.empty_like(h32)
    loss = 0.0
    for k in range(h32.shape[0]):
        hk = h32[k].clone().requires_grad_()
        p = x["teacher"].index_select(0, x["idx"][k]).float()
        lk = (x["w"][k] * -(p * torch.log_softmax(hk @ W32.T, -1)).sum(-1)).sum()
        lk.backward()
        dh[k] = hk.grad
        loss += lk.item()
    return loss, dh, W32.grad


def rel(a, b):
    return ((a.float() - b).norm() / b.norm()).item()


def time_fn(fn, min_reps=3, max_reps=10, budget_s=1.5):
    """Median ms of fn() (one warmup); returns (ms, peak extra GiB, last result)."""
    out = fn()
    del out
    torch.cuda.synchronize()
    times, res = [], None
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t_start = time.perf_counter()
    while len(times) < max_reps and (len(times) < min_reps
                                     or time.perf_counter() - t_start < budget_s):
        res = None
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        res = fn()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1))
    peak = (torch.cuda.max_memory_allocated() - base) / GIB
    return statistics.median(times), peak, res


def gemm_floor_ms(N, H, K):
    """3 bf16 GEMMs of one step (z = h W^T, dh = dz W, dW = dz^T h), times K."""
    h = torch.randn(N, H, device=DEV).bfloat16()
    W = torch.randn(VD, H, device=DEV).bfloat16()
    dz = torch.randn(N, VD, device=DEV).bfloat16()

    def f():
        torch.mm(h, W.T)
        torch.mm(dz, W)
        torch.mm(dz.T, h)
    ms, _, _ = time_fn(f, min_reps=5)
    return ms * K


def bench_config(N, H, K, dist, methods, with_ref):
    x = make_inputs(N, H, K, dist)
    floor = gemm_floor_ms(N, H, K)
    ref = reference(x) if with_ref else None
    rows = []
    for name in methods:
        torch.cuda.empty_cache()
        fl = floor
        if name.endswith("+rows"):                     # GEMMs over the listed rows only
            fl = floor * x["rows"].numel() / (K * N)
        rec = dict(N=N, H=H, K=K, dist=dist, method=name, floor_ms=round(fl, 2))
        try:
            ms, peak, (loss, dh, dW) = time_fn(lambda: METHODS[name](x))
            rec.update(ms=round(ms, 2), peak_gib=round(peak, 2),
                       pct_floor=round(100 * fl / ms, 1))
            if ref is not None:
                rec.update(dh_err=rel(dh, ref[1]), dW_err=rel(dW, ref[2]))
                if loss is not None:
                    rec["loss_err"] = abs(float(loss.detach()) - ref[0]) / abs(ref[0])
            del loss, dh, dW
        except torch.OutOfMemoryError:
            rec.update(ms=None, note="OOM")
        except Exception as e:  # a baseline that fails is reported, not fatal
            rec.update(ms=None, note=f"{type(e).__name__}: {str(e)[:120]}")
        rows.append(rec)
        print(fmt_row(rec), flush=True)
    del x, ref
    torch.cuda.empty_cache()
    return rows


def fmt_row(r):
    if r.get("ms") is None:
        return (f"{r['N']:>6} {r['H']:>5} {r['K']:>2} {r['dist']:<6} {r['method']:<12} "
                f"{r.get('note')}")
    err = "".join(f" {r[k]:9.1e}" if k in r else f" {'-':>9}"
                  for k in ("loss_err", "dh_err", "dW_err"))
    return (f"{r['N']:>6} {r['H']:>5} {r['K']:>2} {r['dist']:<6} {r['method']:<12} {r['ms']:9.2f} "
            f"{r['peak_gib']:7.2f} {r['pct_floor']:6.1f}%{err}   floor {r['floor_ms']:.1f}")


HEADER = (f"{'N':>6} {'H':>5} {'K':>2} {'dist':<6} {'method':<12} {'ms':>9} {'GiB':>7} "
          f"{'%floor':>7} {'loss_err':>9} {'dh_err':>9} {'dW_err':>9}")


# --------------------------------------------------------------------------- tuning sweep
def gemm_breakdown(x, C=1024, G=4096):
    """ms of the loop's GEMM kinds over all K·N rows, vs their bf16-output counterparts."""
    h2d = x["h"].reshape(-1, x["h"].shape[-1])
    W = x["W"]
    R = h2d.shape[0]
    z32 = torch.empty(C, VD, device=DEV)
    dz = torch.randn(G, VD, device=DEV).bfloat16()
    dW = torch.zeros(VD, W.shape[1], device=DEV)
    dh = torch.empty(G, W.shape[1], device=DEV, dtype=torch.bfloat16)
    kinds = {
        "z_fp32_out": (lambda: torch.mm(h2d[:C], W.T, out_dtype=torch.float32, out=z32), R / C),
        "z_bf16_out": (lambda: torch.mm(h2d[:C], W.T), R / C),
        "dh": (lambda: torch.mm(dz, W, out=dh), R / G),
        "dW_fp32_accumulate": (lambda: torch.addmm(dW, dz.T, h2d[:G], out_dtype=torch.float32,
                                                   out=dW), R / G),
        "dW_bf16_out": (lambda: torch.mm(dz.T, h2d[:G]), R / G),
    }
    res = {}
    for name, (fn, times) in kinds.items():
        ms, _, _ = time_fn(fn, min_reps=10, max_reps=30, budget_s=0.3)
        res[name] = ms * times
        print(f"GEMM {name:<20} x{times:5.1f}: {ms * times:7.1f} ms", flush=True)
    return res


def sweep(N=16384, H=4096, K=7):
    """Row-kernel block/warps on one chunk, then chunk size end to end (main shape)."""
    res = {"kernel": [], "chunk": []}
    x = make_inputs(N, H, K, "flat")
    C = 2048
    z = torch.randn(C, VD, device=DEV)
    dz = torch.empty(C, VD, device=DEV, dtype=torch.bfloat16)
    st = kl_loss.RowStats.empty(K * N, DEV, True)
    w = x["w"].reshape(-1).contiguous()
    tsum = x["teacher"].sum(1, dtype=torch.float32)

    def kernel_ms(blk, nw, acc):
        fused_loss.MAX_BLOCK_V, fused_loss.NUM_WARPS = blk, nw
        ms, _, _ = time_fn(lambda: fused_loss.loss_rows(z, x["teacher"], tsum, w, 0, N, st, dz,
                                                        acc),
                           min_reps=20, max_reps=50, budget_s=0.3)
        gbs = C * VD * (4 + 2 + 2) / ms / 1e6
        res["kernel"].append(dict(block=blk, warps=nw, accept=acc, ms=ms, gbs=gbs))
        print(f"row kernel block={blk:5d} warps={nw:2d} accept={acc:d}: "
              f"{ms:.3f} ms ({gbs:.0f} GB/s of z+p+dz)", flush=True)

    for blk, nw in itertools.product((2048, 4096, 8192), (8, 16)):
        kernel_ms(blk, nw, False)
    best = min(res["kernel"], key=lambda r: r["ms"])
    kernel_ms(best["block"], best["warps"], True)
    fused_loss.MAX_BLOCK_V, fused_loss.NUM_WARPS = best["block"], best["warps"]

    import eyas.kernels.loss as kl
    dz_bytes = kl.DZ_BYTES
    for C, G in [(1024, 1024), (2048, 2048), (4096, 4096), (512, 4096), (1024, 4096),
                 (2048, 4096), (1024, 6144), (1024, 8192), (2048, 8192)]:
        kl.DZ_BYTES = G * VD * 2
        torch.cuda.empty_cache()
        ms, peak, _ = time_fn(lambda: run_eyas(x, chunk_size=C), min_reps=3, max_reps=5)
        res["chunk"].append(dict(chunk=C, group=G, ms=ms, peak_gib=peak))
        print(f"chunk {C:5d} group {G:5d}: {ms:.1f} ms, {peak:.2f} GiB", flush=True)
    kl.DZ_BYTES = dz_bytes
    res["gemms"] = gemm_breakdown(x)
    # Where the time goes: the same chunk loop with the row kernel replaced by nothing.
    real = fused_loss.loss_rows
    fused_loss.loss_rows = lambda *a, **k: None
    ms, _, _ = time_fn(lambda: run_eyas(x), min_reps=3, max_reps=5)
    ms_rows, _, _ = time_fn(lambda: run_eyas(x, listed=True), min_reps=3, max_reps=5)
    fused_loss.loss_rows = real
    res["gemms_only_rows_ms"] = ms_rows
    res["gemms_only_ms"] = ms
    res["floor_ms"] = gemm_floor_ms(N, H, K)
    print(f"chunk loop without the row kernel: {ms:.1f} ms; 3-GEMM floor {res['floor_ms']:.1f} ms")
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(prog="benchmarks/fused_loss.py",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="main shape only (N=16384 H=4096 K=1,7)")
    ap.add_argument("--sweep", action="store_true", help="tune block/warps/chunk first")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset")
    ap.add_argument("--json", default=None, help="write results here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "block_v": fused_loss.MAX_BLOCK_V,
           "num_warps": fused_loss.NUM_WARPS, "z_bytes": kl_loss.Z_BYTES,
           "dz_bytes": kl_loss.DZ_BYTES}
    if args.sweep:
        out["sweep"] = sweep()
    print(f"block={fused_loss.MAX_BLOCK_V} warps={fused_loss.NUM_WARPS} "
          f"chunk(Vd={VD})={auto_chunk_size(VD, 1 << 30)}")
    methods = args.methods.split(",")
    configs = ([(16384, 4096, k, d) for k in (1, 7) for d in ("peaked", "flat")] if args.quick
               else list(itertools.product((4096, 16384, 32768), (4096, 7168), (1, 7),
                                           ("peaked", "flat"))))
    print(HEADER)
    out["results"] = []
    for N, H, K, d in configs:
        with_ref = N * H * K <= 16384 * 4096 * 7       # fp32 reference where it is affordable
        out["results"] += bench_config(N, H, K, d, methods, with_ref)
        if args.json:                                  # rewritten after every configuration
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
