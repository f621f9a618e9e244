#!/usr/bin/env bash
# The real trainer next to the in-process step, in ONE device call: how far
# `accelerate launch train/main.py` (benchmarks/train_e2e.py, one GPU) is from
# `benchmarks/train_step.py`'s step, and which setting accounts for the difference.
#
# Runs (each e2e run: --steps optimizer steps, windows of 8, the first window left out):
#   step       train_step.py --cases async-host (the trainer's defaults, in process, + profile)
#   default    the trainer as it ships (data.device_prefetch on with CUDA)
#   inline     data.device_prefetch=false: each batch copied on the compute stream
#   noverify   data.verify=false: no crc32/NaN read checks in the loader threads
#   gpuembed   drafter.host_embedding=false: the embedding table on the GPU
#   zero2      dist=zero2 (DeepSpeed) with the defaults (one process: overlap_comm off)
#   z2overlap  dist=zero2 with zero_optimization.overlap_comm=true (the shipped JSON before it
#              became "auto": on with more than one process)
#   z2nocontig dist=zero2 with zero_optimization.contiguous_gradients=false
# Device machine (carry .whl): bash benchmarks/trainer_gap.sh, ~7 minutes for the default six (one
# H200, 2026-12-02: the step ~1.5 min, the first e2e run ~70 s with the data, the others ~60 s);
# RUNS=default,inline for fewer; RUNS=default,zero2,z2overlap,z2nocontig for the ZeRO-2 knobs (~60 s
# each). Prints a table (step ms of each run against the in-process step)
# and leaves JSON in $OUT. PROFILE=3: each trainer run then profiles 3 more steps (train_e2e.py
# --profile: after the timed windows, each ending with a device sync) and prints their GPU time
# by role (benchmarks/profile_breakdown.py), the trace copied to $OUT/trace_<run>.json.
set -uo pipefail
OUT=${OUT:-/tmp/out}; T=${T:-4096}; TARGET=${TARGET:-llama-3.1-8b}; STEPS=${STEPS:-40}
PROFILE=${PROFILE:-0}
RUNS=${RUNS:-default,inline,noverify,gpuembed,zero2}
mkdir -p "$OUT" /tmp/eyas-path/eyas
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
for d in data models kernels train conf; do ln -sfn "$PWD/$d" /tmp/eyas-path/eyas/$d; done
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/site:/tmp/eyas-path:$PWD
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
echo "== in-process step ($TARGET, T=$T)"
timeout 200 python3 benchmarks/train_step.py --target "$TARGET" --tokens "$T" --cases async-host \
    --iters 10 --warmup 3 --profile 3 --json "$OUT/step.json" 2>&1 | grep -E "^\||^profile"
rm -rf /tmp/e2e/run     # run directories of an earlier call would be refused, not re-run
# the ZeRO-2 knob variants: the shipped JSON with one field set
python3 - /tmp/e2e/knobs <<'EOF2'
import json, sys
from pathlib import Path
out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
for name, knob in {"overlap": ("overlap_comm", True), "nocontig": ("contiguous_gradients", False)}.items():
    ds = json.loads(Path("conf/deepspeed/zero2.json").read_text())
    ds["zero_optimization"][knob[0]] = knob[1]
    (out / f"zero2_{name}.json").write_text(json.dumps(ds, indent=1))
EOF2
declare -A EXTRA=([default]="" [inline]="--override data.device_prefetch=false"
                  [noverify]="--override data.verify=false"
                  [gpuembed]="--override drafter.host_embedding=false" [zero2]="--dist zero2"
                  [z2overlap]="--dist zero2 --override dist.deepspeed_config=/tmp/e2e/knobs/zero2_overlap.json"
                  [z2nocontig]="--dist zero2 --override dist.deepspeed_config=/tmp/e2e/knobs/zero2_nocontig.json")
for run in ${RUNS//,/ }; do
  echo "== trainer: $run"
  # shellcheck disable=SC2086
  # train_e2e.py ends its own trainer at --timeout; the outer bound leaves it that time
  timeout 240 python3 benchmarks/train_e2e.py --target "$TARGET" --tokens "$T" --steps "$STEPS" \
      --log-every 8 --dist ddp --workdir /tmp/e2e --tag="-$run" --timeout 150 \
      --json "$OUT/e2e_$run.json" --profile "$PROFILE" ${EXTRA[$run]} > "$OUT/e2e_$run.log" 2>&1
  echo "   rc $?"
  trace=$(ls /tmp/e2e/run/*-"$run"/profile/trace-rank0.json 2>/dev/null | head -1)
  if [[ -n "$trace" ]]; then
    python3 benchmarks/profile_breakdown.py "$trace" | head -12
    cp "$trace" "$OUT/trace_$run.json"
  fi
done
python3 - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
path = out / "step.json"
step = json.loads(path.read_text())["results"][0] if path.is_file() else {}
if "step_ms" in step:
    print(f"in-process step: {step['step_ms']:.1f} ms, {step['tokens_per_s']:.0f} tok/s, "
          f"peak {step['peak_gib']:.2f} GiB")
else:
    print(f"in-process step: not measured ({step.get('error', 'no step.json')})")
print("| run | step ms | vs in-process | tokens/s (real) | fill | data wait | peak GiB |")
print("|---|---|---|---|---|---|---|")
for f in sorted(out.glob("e2e_*.json")):
    r = json.loads(f.read_text())
    if r.get("returncode") != 0 or "step_ms" not in r:
        print(f"| {f.stem[4:]} | failed (rc {r.get('returncode')}) |")
        continue
    ratio = f"{step['step_ms'] / r['step_ms']:.3f}" if "step_ms" in step else "–"
    print(f"| {f.stem[4:]} | {r['step_ms']:.1f} | {ratio} | "
          f"{r['tokens_per_s']:.0f} | {r['fill']:.3f} | {100 * r['data_wait']:.1f} % | "
          f"{r['peak_mem_gib']:.2f} |")
EOF
