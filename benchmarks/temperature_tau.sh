#!/usr/bin/env bash
# Acceptance at temperature T > 0 on SmolLM2: the offline estimate against real speculative
# sampling, for one exported drafter, at each temperature of TEMPS.
#   data   the target answers each of the first REAL_PROMPTS held-out prompts ANSWERS times by
#          sampling at T (fp32, <= REAL_TOKENS tokens; `eyas prepare --generate --temperature
#          T`), extracted (fp32)
#   offline  `eyas evaluate --data ... --temperature T`: the expected decoder walk over those
#          answers, with its standard error over answers (OUT/T<T>/offline.json)
#   real   real speculative sampling of the held-out prompts (`eyas evaluate --prompts
#          --temperature T`, argmax drafts, the target on DEVICE), SEEDS runs of every prompt,
#          the prompts split over PARTS processes per run: OUT/T<T>/real-<seed>-<i>.json
#   table  per T: offline walk τ ± s.e., real τ ± s.e. over prompt runs, their ratio
#          (OUT/temperature_tau.json)
# Usage: benchmarks/temperature_tau.sh OUT DRAFTER [data|offline|real|table|all]
#   TEMPS (0.7 1.0), ANSWERS (4), SEEDS (2), PARTS (4), REAL_PROMPTS (64), REAL_TOKENS (128),
#   DEVICE (cpu), GEN_BATCH (256)
set -euo pipefail
out=${1:?usage: benchmarks/temperature_tau.sh OUT DRAFTER [data|offline|real|table|all]}
drafter=${2:?usage: benchmarks/temperature_tau.sh OUT DRAFTER [stage]}
stage=${3:-all}
py=${PYTHON:-python3}
eyas() { "$py" -m eyas.train.cli "$@"; }
read -r -a temps <<< "${TEMPS:-0.7 1.0}"
device=${DEVICE:-cpu}
mkdir -p "$out"
heldout=$("$py" -c "from eyas.data.produce.prompts import prompts_path; print(prompts_path('heldout'))")

data() {
  if [ ! -f "$out/answer-prompts.jsonl" ]; then
    "$py" - "$heldout" "${ANSWERS:-4}" "$out/answer-prompts.jsonl" "${REAL_PROMPTS:-64}" <<'EOF'
import json, sys
src, n, dst, m = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
recs = [json.loads(line) for line in open(src) if line.strip()][:m]
with open(dst + ".tmp", "w") as f:
    for j in range(n):
        for r in recs:
            f.write(json.dumps(dict(r, id=f"{r['id']}-a{j}")) + "\n")
import os; os.replace(dst + ".tmp", dst)
EOF
  fi
  for t in "${temps[@]}"; do
    d=$out/T$t
    [ -f "$d/tokens/manifest.json" ] || eyas prepare --generate --input "$out/answer-prompts.jsonl" \
      --target smollm2 --out "$d/tokens" --dtype float32 --max-new-tokens "${REAL_TOKENS:-128}" \
      --batch-size "${GEN_BATCH:-256}" --temperature "$t" --seed 1
    [ -f "$d/hidden/manifest.json" ] || eyas extract --tokens "$d/tokens" --target smollm2 \
      --out "$d/hidden" --dtype float32
  done
}

offline() {
  for t in "${temps[@]}"; do
    [ -f "$out/T$t/offline.json" ] || eyas evaluate --drafter "$drafter" --data "$out/T$t/hidden" \
      --all --k 7 --temperature "$t" --device "$device" --out "$out/T$t/offline.json" > /dev/null
  done
}

real() {
  parts=${PARTS:-4} n=${REAL_PROMPTS:-64}
  head -n "$n" "$heldout" > "$out/real-prompts.jsonl"
  split -n "l/$parts" -d -a 1 "$out/real-prompts.jsonl" "$out/real-part-"
  pids=()
  for t in "${temps[@]}"; do
    for ((s = 0; s < ${SEEDS:-2}; s++)); do
      for ((i = 0; i < parts; i++)); do
        f=$out/T$t/real-$s-$i.json
        [ -f "$f" ] && continue
        [ -s "$out/real-part-$i" ] || continue    # split may leave a part empty
        eyas evaluate --drafter "$drafter" --target smollm2 --prompts "$out/real-part-$i" --k 7 \
          --max-new-tokens "${REAL_TOKENS:-128}" --temperature "$t" --sampling-seed $((s * 1000)) \
          --threads 1 --device "$device" --out "$f" > "${f%.json}.log" 2>&1 &
        pids+=($!)
      done
    done
  done
  failed=0
  for p in "${pids[@]}"; do wait "$p" || failed=1; done
  return $failed
}

table() {
  "$py" - "$out" "${temps[@]}" <<'EOF'
import json, sys
from pathlib import Path
from eyas.models.expected_tau import ratio_se_of
out, temps = Path(sys.argv[1]), sys.argv[2:]
rows = {}
for t in temps:
    d = out / f"T{t}"
    off = json.loads((d / "offline.json").read_text())
    runs = [json.loads(p.read_text()) for p in sorted(d.glob("real-*.json"))]
    units = [(p["accepted"], p["rounds"]) for r in runs for p in r["per_prompt"]]
    acc, rounds = sum(a for a, _ in units), sum(r for _, r in units)
    real = 1 + acc / rounds if rounds else None
    walk = off["tau_trajectory"]
    rows[t] = {"offline_walk_tau": walk, "offline_walk_se": off["tau_trajectory_se"],
               "offline_answers": off["num_samples"], "offline_tau_all_starts": off["tau"],
               "real_tau": real, "real_se": ratio_se_of(units) if units else None,
               "real_prompt_runs": len(units), "real_rounds": rounds,
               "offline_vs_real": walk / real - 1 if real else None}
(out / "temperature_tau.json").write_text(json.dumps(rows, indent=1) + "\n")
print(f"{'T':>4} {'offline walk':>13} {'± s.e.':>7} {'answers':>7} {'real':>7} {'± s.e.':>7} "
      f"{'runs':>5} {'offline/real':>12}")
for t, r in rows.items():
    print(f"{t:>4} {r['offline_walk_tau']:>13.3f} {r['offline_walk_se']:>7.3f} "
          f"{r['offline_answers']:>7} {r['real_tau'] or 0:>7.3f} {r['real_se'] or 0:>7.3f} "
          f"{r['real_prompt_runs']:>5} {(r['offline_vs_real'] or 0):>+12.2%}")
EOF
}

case $stage in
  data) data ;; offline) offline ;; real) real ;; table) table ;;
  all) data; offline; real; table ;;
  *) echo "unknown stage $stage (data|offline|real|table|all)" >&2; exit 2 ;;
esac
