#!/usr/bin/env bash
# eyas and both peer trainers on one H200 in ONE device call (ratios are only meaningful there):
# `train_step.py` (eyas bf16 default, FP8, and the optional host embedding) at T = 4096, then
# speculators' and SpecForge's own harnesses at the same shape (../shared/peers/README.md).
#
# On the CPU machine, once:
#   ../shared/tools/device-wheels.sh torchao==0.18.0        # .whl/: hydra, deepspeed, torchao, ...
#   mkdir -p .peers && tar -xzf ../shared/peers/peers.tgz -C .peers --strip-components=1
#   grep -qxF '/.peers/' .git/info/exclude || echo '/.peers/' >> .git/info/exclude
# On the device machine (carry .whl .peers), ~5 minutes:
#   bash benchmarks/side_by_side.sh            # T=8192 CASES=async,fp8 for the longer batch
# The checkout itself is put on the path as the `eyas` package (a directory of links), so the
# working tree is what runs. JSON per program under $OUT.
set -uo pipefail
T=${T:-4096}; CASES=${CASES:-async,fp8,async-host,fp8-host}; OUT=${OUT:-/tmp/out}
SP_BUDGET=${SP_BUDGET:-$([[ $T -ge 8192 ]] && echo 230 || echo 80)}
mkdir -p "$OUT" /tmp/eyas-path/eyas
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
for d in data models kernels train conf; do ln -sfn "$PWD/$d" /tmp/eyas-path/eyas/$d; done
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
echo "== eyas"
PYTHONPATH=/tmp/site:/tmp/eyas-path:$PWD python3 benchmarks/train_step.py --target llama-3.1-8b \
    --tokens "$T" --iters 10 --warmup 3 --cases "$CASES" --json "$OUT/eyas.json" 2>&1 | grep "^|"
echo "== speculators"
(cd .peers && PYTHONPATH=/tmp/site:$PWD/sp python3 bench_sp.py --plan "fused_adamw:$T:packed:7" \
    --out "$OUT/sp" --time-budget-s "$SP_BUDGET" 2>&1 | grep median)
echo "== SpecForge"
(cd .peers && PYTHONPATH=/tmp/site:$PWD python3 bench_sf.py --seqlens "$T" --opts fused_adamw \
    --out "$OUT/sf" --time-budget-s 70 2>&1 | grep -i median)
