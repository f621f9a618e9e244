#!/usr/bin/env bash
# FP8 against bf16 over the first STEPS optimizer steps of the real trainer, Llama-3.1-8B drafter
# shape, same data, seed and schedule (benchmarks/train_e2e.py: synthetic real-shape hidden
# states, lr 1e-4 cosine, no warmup). Prints the loss of both runs every LOG steps and the
# largest relative gap; JSON per run in $OUT (its "windows" are the curve). The FP8 run uses
# drafter.fp8_layers' default (all but fc: call N's curve in benchmarks/README.md); LAYERS=all
# puts fc in FP8 too (the default before 2026-12-03: call I's curve).
# Device machine (carry .whl): bash benchmarks/fp8_curve.sh   (~4.5 minutes for 300 steps:
# each run ~2 min with its start and compile, 2026-12-03)
set -uo pipefail
OUT=${OUT:-/tmp/out}; T=${T:-4096}; STEPS=${STEPS:-300}; LOG=${LOG:-10}
mkdir -p "$OUT" /tmp/eyas-path/eyas
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
for d in data models kernels train conf; do ln -sfn "$PWD/$d" /tmp/eyas-path/eyas/$d; done
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/site:/tmp/eyas-path:$PWD
rm -rf /tmp/curve/run
for run in bf16 fp8; do
  extra=(); [[ $run == fp8 ]] && extra=(--override drafter.fp8=tensorwise)
  [[ $run == fp8 && ${LAYERS:-} == all ]] && extra+=(--override \
      "drafter.fp8_layers=[fc,q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]")
  timeout 400 python3 benchmarks/train_e2e.py --tokens "$T" --steps "$STEPS" --log-every "$LOG" \
      --dist ddp --workdir /tmp/curve --tag="-$run" --timeout 360 --json "$OUT/curve_$run.json" \
      "${extra[@]}" > "$OUT/curve_$run.log" 2>&1
  echo "$run: rc $?"
done
python3 - "$OUT" <<'EOF'
import json, sys
a, b = (json.load(open(f"{sys.argv[1]}/curve_{r}.json"))["windows"] for r in ("bf16", "fp8"))
print("| step | bf16 loss | fp8 loss | fp8 / bf16 |\n|---|---|---|---|")
gaps = []
for x, y in zip(a, b):
    gaps.append(y["loss"] / x["loss"] - 1)
    print(f"| {x['step']} | {x['loss']:.4f} | {y['loss']:.4f} | {y['loss'] / x['loss']:.4f} |")
print(f"largest relative gap {max(map(abs, gaps)):.2%}; last window {gaps[-1]:+.2%}; "
      f"step ms bf16 {sum(w['step_ms'] for w in a[1:]) / max(1, len(a) - 1):.1f}, "
      f"fp8 {sum(w['step_ms'] for w in b[1:]) / max(1, len(b) - 1):.1f}")
EOF
