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
# Knobs: CASES (train_step.py cases, empty: no eyas run), PEERS (sp,sf; empty: none), PROFILE=N
# (N more steps of each eyas case under torch.profiler: GPU time by role,
# benchmarks/profile_breakdown.py), LIMIT (seconds for the whole script, default 560), SP_NEED /
# SF_NEED (seconds kept for each peer; defaults grow with T). Every stage runs under `timeout`
# with what is left of LIMIT after the later stages' needs, so a stage that runs long costs its
# own row (listed with the reason), not the call.
# The harness on this CPU machine, tiny shapes, no wheels (~1 min):
#   SMOKE=1 PYTHON=.venv/bin/python OUT=/tmp/sbs bash benchmarks/side_by_side.sh
# The checkout is put on the path as the `eyas` package (a directory of links), so the working
# tree is what runs. Outputs, named apart by T, cases and peers (TAG): $OUT/eyas$TAG.json and
# .log, $OUT/sp-T$T/, $OUT/sf-T$T/, $OUT/table$TAG.md and side_by_side$TAG.json.
set -uo pipefail
T=${T:-4096}; OUT=${OUT:-/tmp/out}; PEERS=${PEERS-sp,sf}; PY=${PYTHON:-python3}
PY=$(realpath -s "$(command -v "$PY")") || { echo "PYTHON=$PY: not found" >&2; exit 2; }
CASES=${CASES-async-host,fp8-host}
LIMIT=${LIMIT:-560}   # seconds for the whole script: a device call stops at 600
# What each peer is expected to need at this length (calls J, K, L): the stages before it leave
# that much; a stage may use what is left beyond the later stages' needs, never more.
if ((T >= 16384)); then NEEDS=(290 210); elif ((T >= 8192)); then NEEDS=(230 140); else NEEDS=(110 90); fi
SP_NEED=${SP_NEED:-${NEEDS[0]}}; SF_NEED=${SF_NEED:-${NEEDS[1]}}
[[ ,$PEERS, == *,sp,* ]] || SP_NEED=0
[[ ,$PEERS, == *,sf,* ]] || SF_NEED=0
if [[ -n ${SMOKE:-} ]]; then
    K=3; EYAS_ARGS=(--target tiny-llama --ttt $K --device cpu --iters 2 --warmup 1); CASES=${CASES:+base}
    SP_ARGS=(--cpu-test --warmup 1 --iters 2); SF_ARGS=(--cpu-test --warmup 1 --iters 2); SITE=
else
    K=7; EYAS_ARGS=(--target llama-3.1-8b --iters 10 --warmup 3); SP_ARGS=(); SF_ARGS=(); SITE=/tmp/site
    $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target $SITE .whl/*.whl
    nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
fi
TAG=-T$T${CASES:+-${CASES//,/_}}${PEERS:+-${PEERS//,/_}}   # names one call's files apart
mkdir -p "$OUT" /tmp/eyas-path/eyas
for d in data models kernels train conf; do ln -sfn "$PWD/$d" /tmp/eyas-path/eyas/$d; done
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
left() { echo $((LIMIT - SECONDS - $1)); }     # seconds left after reserving $1
# (`timeout 0` would mean no limit: a stage left under 20 s does not start)

# a peer that ended without its JSON (killed at its limit, crashed) still gets a row
peer_failed() {  # DIR FILE RC
    [[ -f "$1/$2" ]] && return
    mkdir -p "$1"
    printf '{"runs": [{"T": %d, "error": "%s"}]}\n' "$T" \
        "$([[ $3 == 124 ]] && echo "stopped at its time limit" || echo "exit status $3")" > "$1/$2"
}

if [[ -n $CASES ]]; then
    budget=$(left $((SP_NEED + SF_NEED)))
    ((budget >= 20)) || { echo "eyas: not started, ${budget}s left of LIMIT=$LIMIT" >&2; budget=1; }
    echo "== eyas ($CASES, T=$T, at most ${budget}s)"
    PYTHONPATH=$SITE:/tmp/eyas-path:$PWD timeout "$budget" $PY benchmarks/train_step.py \
        "${EYAS_ARGS[@]}" --tokens "$T" --cases "$CASES" --json "$OUT/eyas$TAG.json" \
        ${PROFILE:+--profile "$PROFILE" --profile-cases "$CASES"} > "$OUT/eyas$TAG.log" 2>&1
    rc=$?
    grep -E "^\||^profile|Error" "$OUT/eyas$TAG.log"
    if ((rc != 0)); then   # the cases it did not finish get rows saying why
        echo "eyas: exit status $rc$( ((rc == 124)) && echo ' (time limit)')"
        $PY - "$OUT/eyas$TAG.json" "$CASES" "$T" "$rc" <<'EOF_PY'
import json, pathlib, sys
f, cases, T, rc = pathlib.Path(sys.argv[1]), sys.argv[2].split(","), int(sys.argv[3]), int(sys.argv[4])
d = json.loads(f.read_text()) if f.exists() else {"results": []}
done = {r["case"] for r in d["results"] if r.get("tokens") == T}
why = "stopped at its time limit" if rc == 124 else f"exit status {rc}"
d["results"] += [dict(case=c, tokens=T, error=f"not measured: {why}") for c in cases if c not in done]
f.write_text(json.dumps(d, indent=1))
EOF_PY
    fi
fi
if [[ ,$PEERS, == *,sp,* ]]; then
    budget=$(left "$SF_NEED")
    ((budget >= 20)) || { echo "speculators: ${budget}s left of LIMIT=$LIMIT" >&2; budget=1; }
    echo "== speculators (at most ${budget}s)"
    (cd .peers && PYTHONPATH=$SITE:$PWD/sp timeout "$budget" $PY bench_sp.py \
        "${SP_ARGS[@]}" --plan "fused_adamw:$T:packed:$K" --out "$OUT/sp-T$T" \
        --time-budget-s "$budget" 2>&1 | grep -E "median|Error"; exit "${PIPESTATUS[0]}")
    rc=$?
    ((rc == 0)) || echo "speculators: exit status $rc"
    peer_failed "$OUT/sp-T$T" speculators_bench.json "$rc"
fi
if [[ ,$PEERS, == *,sf,* ]]; then
    budget=$(left 0)
    ((budget >= 20)) || { echo "SpecForge: ${budget}s left of LIMIT=$LIMIT" >&2; budget=1; }
    echo "== SpecForge (at most ${budget}s)"
    (cd .peers && PYTHONPATH=$SITE:$PWD timeout "$budget" $PY bench_sf.py \
        "${SF_ARGS[@]}" --seqlens "$T" --ttt "$K" --opts fused_adamw --out "$OUT/sf-T$T" \
        --time-budget-s "$budget" 2>&1 | grep -E "median|Error"; exit "${PIPESTATUS[0]}")
    rc=$?
    ((rc == 0)) || echo "SpecForge: exit status $rc"
    peer_failed "$OUT/sf-T$T" specforge_bench.json "$rc"
fi
PYTHONPATH=$SITE:/tmp/eyas-path:$PWD $PY benchmarks/side_by_side_table.py "$OUT" \
    --json "$OUT/side_by_side$TAG.json" | tee "$OUT/table$TAG.md"
