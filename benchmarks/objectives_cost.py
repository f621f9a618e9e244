"""What each loss objective costs in the fused loss: forward + backward of `eagle3_loss` (Triton)
per objective at a drafter's real shape, medians of CUDA-event timings, and peak memory.

    python benchmarks/objectives_cost.py --json objectives_cost.json
    python benchmarks/objectives_cost.py --rows 28672 --hidden 4096 --vocab 32000   # Llama-8B, K=7·4096

soft_ce reads each logits chunk twice; the α objectives (tv, lk_alpha, lk_lambda, mix) a third
time to write dz after α and S are known (kernels/fused_loss.py). The lm_head GEMMs are the same.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from eyas.kernels.loss import Objective, eagle3_loss

OBJECTIVES = {"soft_ce": Objective(), "tv": Objective(kl=0.0, tv=1.0),
              "lk_alpha": Objective(kl=0.0, lk_alpha=1.0),
              "lk_lambda": Objective(kl=0.0, lk_lambda=1.0),
              "mix": Objective(kl=0.5, tv=0.5)}


def time_one(obj: Objective, h, W, p, w, reps: int) -> tuple[float, float]:
    """(median ms of forward + backward, peak GiB) of one objective."""
    torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(reps + 3):
        hh, WW = h.detach().requires_grad_(), W.detach().requires_grad_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        eagle3_loss(hh, WW, p, w, impl="triton", with_accept=True, objective=obj).loss.backward()
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    return statistics.median(times), torch.cuda.max_memory_allocated() / 2 ** 30


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=7 * 4096, help="K·T rows (default 7·4096)")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", help="write the table here")
    args = ap.parse_args(argv)
    K, N = 7, args.rows // 7
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(K, N, args.hidden, device="cuda", generator=g).bfloat16()
    W = (torch.randn(args.vocab, args.hidden, device="cuda", generator=g)
         * args.hidden ** -0.5 * 4).bfloat16()
    p = torch.softmax(torch.randn(N, args.vocab, device="cuda", generator=g) * 3, 1).bfloat16()
    w = torch.full((K, N), 1.0 / N, device="cuda")
    rows = []
    for name, obj in OBJECTIVES.items():
        ms, gib = time_one(obj, h, W, p, w, args.reps)
        rows.append({"objective": name, "ms": ms, "peak_gib": gib})
    base = rows[0]["ms"]
    print(f"{torch.cuda.get_device_name()}: rows {K * N}, hidden {args.hidden}, vocab "
          f"{args.vocab}, bf16, forward + backward")
    print("| objective | ms (median) | × soft_ce | peak GiB |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['objective']} | {r['ms']:.2f} | {r['ms'] / base:.3f} | {r['peak_gib']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "args": vars(args), "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
