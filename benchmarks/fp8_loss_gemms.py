"""Could the loss's three lm_head GEMMs run in FP8? Their gradient error and time, measured.

The fused loss (kernels/loss.py) runs three GEMMs per row chunk: z = h @ W.T (logits),
dh = dz @ W and dW = dz.T @ h, with dz = w·(softmax(z)·Σp − p). They are about a quarter of
a Llama-8B-shaped training step and already run near the bf16 peak, so FP8 there is the one
lever left for the step (benchmarks/README.md, "Where the time goes"), but the loss keeps its
gradients within 1e-2 relative of an fp32 reference (kernels' tests and
benchmarks/fused_loss.py). This script measures, on one chunk at the training shape, the
relative error of loss, dh and dW against fp32 for:
  bf16       what the loss does today (bf16 operands, fp32 accumulation and logits)
  fp8-z      the logits GEMM alone in FP8 (row-wise, as fp8-row), dh and dW in bf16
  fp8-row    e4m3 operands with a scale per row of each operand along the contraction
             (torch._scaled_mm's row-wise form; dz in e4m3 too)
  fp8-tensor e4m3 operands with one scale per tensor (the tensor-wise recipe)
and, on CUDA, the median time of the three GEMMs each way (FP8: each call quantises its
operands and transposes two of them, unfused). On a CPU the FP8 GEMMs are emulated (quantise,
dequantise, fp32 matmul: the same rounding, another summation order).

    python benchmarks/fp8_loss_gemms.py --rows 4096 --json fp8_loss.json     # H200, ~20 s
    python benchmarks/fp8_loss_gemms.py --rows 256 --hidden 512 --vocab 4096  # CPU
"""

from __future__ import annotations

import argparse
import statistics

import torch

from eyas.data.common.utils import atomic_write_json

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max


def quantise(x: torch.Tensor, rowwise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / scale in e4m3, scale fp32): scale per row ([M, 1]) or one ([1, 1])."""
    amax = x.abs().amax(dim=1, keepdim=True) if rowwise else x.abs().amax().reshape(1, 1)
    scale = (amax.float().clamp(min=1e-12) / E4M3_MAX)
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def fp8_mm(a: torch.Tensor, b_t: torch.Tensor, rowwise: bool) -> torch.Tensor:
    """a [M, K] @ b_t.T [K, N] in FP8, fp32 out; both quantised along K (b_t is [N, K])."""
    qa, sa = quantise(a, rowwise)
    qb, sb = quantise(b_t, rowwise)
    if a.is_cuda:
        if not rowwise:
            sa, sb = sa.reshape(()), sb.reshape(())
        else:
            sb = sb.reshape(1, -1)
        return torch._scaled_mm(qa, qb.t(), scale_a=sa, scale_b=sb, out_dtype=torch.float32)
    return (qa.float() * sa) @ (qb.float() * sb.reshape(-1, 1)).t()


def logits(h, W, mode: str) -> torch.Tensor:
    """z = h @ W.T in fp32, the operands as `mode` feeds them to the GEMM."""
    if mode == "fp32":
        return h.float() @ W.float().t()
    if mode == "bf16":
        return torch.mm(h, W.t(), out_dtype=torch.float32) if h.is_cuda else \
            h.float() @ W.float().t()
    return fp8_mm(h, W, mode != "fp8-tensor")


def grads(dz, h, W, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(dh = dz @ W, dW = dz.T @ h) in fp32, the operands as `mode` feeds them."""
    if mode == "fp32":
        return dz.float() @ W.float(), dz.float().t() @ h.float()
    if mode in ("bf16", "fp8-z"):
        dz = dz.to(h.dtype)
        if h.is_cuda:
            return torch.mm(dz, W).float(), torch.mm(dz.t(), h, out_dtype=torch.float32)
        return (dz.float() @ W.float()).to(h.dtype).float(), dz.float().t() @ h.float()
    rowwise = mode == "fp8-row"
    return (fp8_mm(dz, W.t().contiguous(), rowwise),                  # contraction over Vd
            fp8_mm(dz.t().contiguous(), h.t().contiguous(), rowwise))  # contraction over rows


def soft_ce(z, p, w) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ w·CE(p, softmax(z)), its gradient dz = w·(softmax(z)·Σp − p)) of fp32 logits z."""
    lse = torch.logsumexp(z, 1, keepdim=True)
    loss = (w * (lse.squeeze(1) * p.sum(1) - (p * z).sum(1))).sum()
    return loss, w[:, None] * (torch.exp(z - lse) * p.sum(1, keepdim=True) - p)


def chain(h, W, p, w, mode: str):
    """(loss, dh, dW) of the soft cross-entropy w·CE(p, softmax(h @ W.T)), GEMMs in `mode`."""
    loss, dz = soft_ce(logits(h, W, mode), p, w)
    return (loss, *grads(dz, h, W, mode))


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref).norm() / ref.norm().clamp(min=1e-30))


def timed(fn, iters: int) -> float:
    times = []
    for _ in range(iters + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[2:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=4096, help="rows of the chunk (tokens)")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32000, help="draft vocabulary")
    ap.add_argument("--logit-std", type=float, default=2.0, help="std of the draft logits")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cuda" and tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 8):
        ap.error(f"torch {torch.__version__}: the bf16 GEMMs with fp32 output (mm(out_dtype=)) "
                 f"and row-wise torch._scaled_mm need torch >= 2.8")
    g = torch.Generator(device=dev).manual_seed(0)
    N, H, V = args.rows, args.hidden, args.vocab
    h = torch.randn(N, H, device=dev, generator=g).bfloat16()
    W = (torch.randn(V, H, device=dev, generator=g) * args.logit_std * H ** -0.5).bfloat16()
    p = torch.softmax(torch.randn(N, V, device=dev, generator=g) * 2.0, 1).bfloat16().float()
    w = torch.full((N,), 1.0 / N, device=dev)
    ref = chain(h, W, p, w, "fp32")
    dz = soft_ce(logits(h, W, "fp32"), p, w)[1].to(torch.bfloat16)  # what the kernel writes
    rows = []
    for mode in ("bf16", "fp8-z", "fp8-row", "fp8-tensor"):
        loss, dh, dW = chain(h, W, p, w, mode)
        row = dict(mode=mode, loss_rel=rel(loss, ref[0]), dh_rel=rel(dh, ref[1]),
                   dW_rel=rel(dW, ref[2]))
        if dev == "cuda":                           # the three GEMMs alone (quantising included)
            row["gemm_ms"] = timed(lambda: (logits(h, W, mode), grads(dz, h, W, mode)),
                                   args.iters)
        rows.append(row)
    print(f"N={N} H={H} Vd={V} on {dev}; tolerance of the loss: 1e-2 relative (gradients)")
    print("| GEMMs | loss rel. err | dh rel. err | dW rel. err | ms, the 3 GEMMs |")
    print("|---|---|---|---|---|")
    for r in rows:
        ms = f"{r['gemm_ms']:.2f}" if "gemm_ms" in r else "–"
        print(f"| {r['mode']} | {r['loss_rel']:.2e} | {r['dh_rel']:.2e} | {r['dW_rel']:.2e} "
              f"| {ms} |")
    if args.json:
        atomic_write_json(args.json, dict(N=N, H=H, Vd=V, device=dev, results=rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
