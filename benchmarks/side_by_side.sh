#!/usr/bin/env bash
# eyas and both peer trainers on one H200 in ONE device call (ratios are only meaningful there):
# `train_step.py` (the default bf16 step and the FP8 step) at one length T, then speculators' and
# SpecForge's own harnesses at the same shape (../shared/peers/README.md), then the table of
# everything in $OUT (benchmarks/side_by_side_table.py; run it again on a folder that holds
# several lengths' outputs for one table).
#
# On the CPU machine, once:
#   ../shared/tools/device-wheels.sh torchao==0.18.0        # .whl/: hydra, deepspeed, torchao, ...
#   mkdir -p .peers && tar -xzf ../shared/peers/peers.tgz -C .peers --strip-components=1
#   grep -qxF '/.peers/' .git/info/exclude || echo '/.peers/' >> .git/info/exclude
# On the device machine (carry .whl .peers), one length per call:
#   T=4096 bash benchmarks/side_by_side.sh                  # ~4 min
#   T=8192 bash benchmarks/side_by_side.sh                  # ~7 min (speculators compiles ~90 s)
#   T=16384 PEERS=sp bash benchmarks/side_by_side.sh        # ~6 min; then, in the next call:
#   T=16384 PEERS=sf CASES= bash benchmarks/side_by_side.sh
# Knobs: CASES (train_step.py cases, empty: no eyas run), PEERS (sp,sf; empty: none), SP_BUDGET / SF_BUDGET
# (seconds each harness may start new configurations; defaults grow with T), PROFILE=N (N more
# steps of each eyas case under torch.profiler: GPU time by role, benchmarks/profile_breakdown.py).
# The harness on this CPU machine, tiny shapes, no wheels (~1 min):
#   SMOKE=1 PYTHON=.venv/bin/python OUT=/tmp/sbs bash benchmarks/side_by_side.sh
# The checkout is put on the path as the `eyas` package (a directory of links), so the working
# tree is what runs. Outputs: $OUT/eyas-T$T.json, $OUT/sp-T$T/, $OUT/sf-T$T/, $OUT/table-T$T.md.
set -uo pipefail
T=${T:-4096}; OUT=${OUT:-/tmp/out}; PEERS=${PEERS-sp,sf}; PY=${PYTHON:-python3}
PY=$(realpath -s "$(command -v "$PY")") || { echo "PYTHON=$PY: not found" >&2; exit 2; }
CASES=${CASES-async-host,fp8-host}
if ((T >= 16384)); then BUDGETS=(280 200); elif ((T >= 8192)); then BUDGETS=(230 120); else BUDGETS=(80 70); fi
SP_BUDGET=${SP_BUDGET:-${BUDGETS[0]}}; SF_BUDGET=${SF_BUDGET:-${BUDGETS[1]}}
if [[ -n ${SMOKE:-} ]]; then
    K=3; EYAS_ARGS=(--target tiny-llama --ttt $K --device cpu --iters 2 --warmup 1); CASES=${CASES:+base}
    SP_ARGS=(--cpu-test --warmup 1 --iters 2); SF_ARGS=(--cpu-test --warmup 1 --iters 2); SITE=
else
    K=7; EYAS_ARGS=(--target llama-3.1-8b --iters 10 --warmup 3); SP_ARGS=(); SF_ARGS=(); SITE=/tmp/site
    $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target $SITE .whl/*.whl
    nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
fi
mkdir -p "$OUT" /tmp/eyas-path/eyas
for d in data models kernels train conf; do ln -sfn "$PWD/$d" /tmp/eyas-path/eyas/$d; done
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
if [[ -n $CASES ]]; then
    echo "== eyas ($CASES, T=$T)"
    PYTHONPATH=$SITE:/tmp/eyas-path:$PWD $PY benchmarks/train_step.py "${EYAS_ARGS[@]}" \
        --tokens "$T" --cases "$CASES" --json "$OUT/eyas-T$T.json" \
        ${PROFILE:+--profile "$PROFILE" --profile-cases "$CASES"} 2>&1 | grep -E "^\||^profile"
fi
if [[ ,$PEERS, == *,sp,* ]]; then
    echo "== speculators (budget ${SP_BUDGET}s)"
    (cd .peers && PYTHONPATH=$SITE:$PWD/sp timeout $((SP_BUDGET + 120)) $PY bench_sp.py \
        "${SP_ARGS[@]}" --plan "fused_adamw:$T:packed:$K" --out "$OUT/sp-T$T" \
        --time-budget-s "$SP_BUDGET" 2>&1 | grep -E "median|Error") || echo "speculators: rc $?"
fi
if [[ ,$PEERS, == *,sf,* ]]; then
    echo "== SpecForge (budget ${SF_BUDGET}s)"
    (cd .peers && PYTHONPATH=$SITE:$PWD timeout $((SF_BUDGET + 120)) $PY bench_sf.py \
        "${SF_ARGS[@]}" --seqlens "$T" --ttt "$K" --opts fused_adamw --out "$OUT/sf-T$T" \
        --time-budget-s "$SF_BUDGET" 2>&1 | grep -E "median|Error") || echo "SpecForge: rc $?"
fi
PYTHONPATH=$SITE:/tmp/eyas-path:$PWD $PY benchmarks/side_by_side_table.py "$OUT" \
    --json "$OUT/side_by_side.json" | tee "$OUT/table-T$T.md"
