#!/usr/bin/env bash
# What compressed storage costs in acceptance, on the SmolLM2 quality recipe (one GPU): the same
# conversations are extracted three ways, one drafter is trained on each with the same schedule,
# and each is scored on the held-out prompts (offline decoder walk and real decoding).
#   modes:  bf16   aux states bf16, teacher = last hidden state (bf16)
#           fp8    aux states fp8 e4m3 with per-token scales, teacher = last hidden state
#           fp8k   aux states fp8, teacher = the target's top-32 logits (no last state stored)
# Stages (each skips what exists, so a stage can be re-run alone):
#   data   SmolLM2 writes N_SYNTH prompts, answers them and the 645 shipped prompts greedily
#          (<= MAX_NEW_TOKENS), answers the 64 held-out prompts (float32, <= 128 tokens);
#          everything extracted with the target in float32, once per mode
#   train  the three drafters train side by side on the GPU (K = 7, EPOCHS epochs, lr 3e-3,
#          32000-token draft vocabulary, MLP width 3072, 16384-token batches), then each export's
#          offline τ on the held-out hidden states (on DEVICE) goes to OUT/<mode>/offline.json
#   real   real speculative decoding of the held-out prompts (fp32, batch 1; the target on
#          DEVICE: cpu, or cuda to verify on the GPU), the prompts split over PARTS processes
#          per drafter: OUT/<mode>/real-<i>.json
#   table  bytes/token and τ per mode (OUT/storage_tau.json)
# Usage: benchmarks/storage_tau.sh OUT [data|train|real|table|all]
#   N_SYNTH (4000), MAX_NEW_TOKENS (256), EPOCHS (12), GEN_BATCH (4096), PARTS (5),
#   REAL_PROMPTS (64), REAL_TOKENS (128), DEVICE (cpu)
set -euo pipefail
out=${1:?usage: benchmarks/storage_tau.sh OUT [data|train|real|table|all]}
stage=${2:-all}
py=${PYTHON:-python3}
eyas() { "$py" -m eyas.train.cli "$@"; }
modes=(bf16 fp8 fp8k)
mkdir -p "$out"
heldout=$("$py" -c "from eyas.data.produce.prompts import prompts_path; print(prompts_path('heldout'))")
shipped=$("$py" -c "from eyas.data.produce.prompts import prompts_path; print(prompts_path('default'))")

extract_args() {
  case $1 in
    bf16) echo "--aux-format bf16 --teacher last" ;;
    fp8) echo "--aux-format fp8 --teacher last" ;;
    fp8k) echo "--aux-format fp8 --teacher topk --topk 32" ;;
  esac
}

data() {
  if [ ! -f "$out/prompts.jsonl" ]; then
    eyas synthesize --target smollm2 --n "${N_SYNTH:-4000}" --out "$out/synthetic.jsonl" \
      --batch-size "${GEN_BATCH:-4096}" --exclude "$shipped"
    cat "$shipped" "$out/synthetic.jsonl" > "$out/prompts.tmp" && mv "$out/prompts.tmp" "$out/prompts.jsonl"
  fi
  [ -f "$out/tokens/manifest.json" ] || eyas prepare --generate --input "$out/prompts.jsonl" \
    --target smollm2 --out "$out/tokens" --max-new-tokens "${MAX_NEW_TOKENS:-256}" \
    --batch-size "${GEN_BATCH:-4096}"
  [ -f "$out/heldout-tokens/manifest.json" ] || eyas prepare --generate --input "$heldout" \
    --target smollm2 --out "$out/heldout-tokens" --dtype float32 --max-new-tokens 128 \
    --batch-size 64
  [ -f "$out/heldout-hidden/manifest.json" ] || eyas extract --tokens "$out/heldout-tokens" \
    --target smollm2 --out "$out/heldout-hidden" --dtype float32
  for m in "${modes[@]}"; do
    # shellcheck disable=SC2046
    [ -f "$out/$m/hidden/manifest.json" ] || eyas extract --tokens "$out/tokens" --target smollm2 \
      --out "$out/$m/hidden" --dtype float32 --pad-batches --batch-tokens 32768 $(extract_args "$m")
  done
}

train() {
  pids=()
  for m in "${modes[@]}"; do
    [ -d "$out/$m/run/export" ] && continue
    EYAS_RUN_ID=storage-$m "$py" train/main.py hydra.run.dir="$out/$m/run" target=smollm2 \
      data.dataset="$out/$m/hidden" drafter.draft_vocab_size=32000 drafter.intermediate_size=3072 \
      data.token_budget=16384 train.epochs="${EPOCHS:-12}" optim.lr=3e-3 train.eval_every=1000 \
      train.log_every=100 train.save_every=1000 eval.speculative=false eval.engines=false \
      > "$out/$m/train.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done
  for m in "${modes[@]}"; do
    [ -f "$out/$m/offline.json" ] || eyas evaluate --drafter "$out/$m/run/export" \
      --data "$out/heldout-hidden" --all --k 7 --device "${DEVICE:-cpu}" \
      --out "$out/$m/offline.json" > /dev/null
  done
}

real() {
  parts=${PARTS:-5} n=${REAL_PROMPTS:-64}
  head -n "$n" "$heldout" > "$out/real-prompts.jsonl"
  split -n "l/$parts" -d -a 1 "$out/real-prompts.jsonl" "$out/real-part-"
  pids=()
  for m in "${modes[@]}"; do
    for ((i = 0; i < parts; i++)); do
      [ -f "$out/$m/real-$i.json" ] && continue
      [ -s "$out/real-part-$i" ] || continue    # split may leave a part empty
      eyas evaluate --drafter "$out/$m/run/export" --target smollm2 \
        --prompts "$out/real-part-$i" --k 7 --max-new-tokens "${REAL_TOKENS:-128}" --threads 1 \
        --device "${DEVICE:-cpu}" \
        --out "$out/$m/real-$i.json" > "$out/$m/real-$i.log" 2>&1 &
      pids+=($!)
    done
  done
  failed=0
  for p in "${pids[@]}"; do wait "$p" || failed=1; done
  for m in "${modes[@]}"; do
    for ((i = 0; i < parts; i++)); do
      [ -s "$out/real-part-$i" ] && [ ! -f "$out/$m/real-$i.json" ] && { echo "real decoding $m part $i failed:" >&2
                                          tail -n 5 "$out/$m/real-$i.log" >&2; }
    done
  done
  return $failed
}

table() {
  "$py" - "$out" "${modes[@]}" <<'EOF'
import json, sys
from pathlib import Path
from eyas.data.store.dataset import open_dataset
out, modes = Path(sys.argv[1]), sys.argv[2:]
hidden = int(open_dataset(out / "bf16/hidden").manifest["hidden_size"])
rows = {}
for m in modes:
    man = open_dataset(out / m / "hidden").manifest
    off = json.loads((out / m / "offline.json").read_text())
    parts = sorted((out / m).glob("real-*.json"))
    real = [json.loads(p.read_text()) for p in parts]
    tok = sum(r["decode_tokens"] for r in real)
    rounds = sum(r["decode_rounds"] for r in real)
    accepted = sum(sum(r["counts"]["accepted"]) for r in real)
    rows[m] = {"bytes_per_token": round(man["bytes"] / man["n_tokens"], 1),
               "bytes_per_tH": round(man["bytes"] / man["n_tokens"] / hidden, 3),
               "offline": {k: off.get(k) for k in ("tau_trajectory", "tau", "tau_independent")},
               "real_parts": len(real), "real_prompts": sum(r["num_prompts"] for r in real),
               "real_tokens": tok, "real_rounds": rounds,
               # the engines' acceptance length: 1 + accepted drafts per verification round
               "real_tau": round(1 + accepted / rounds, 4) if rounds else None,
               "real_tau_emitted": round(tok / rounds, 4) if rounds else None,
               "real_identical": all(r["tokens_identical"] for r in real) if real else None}
base = rows[modes[0]]
for m, r in rows.items():
    for k in ("real_tau",):
        if r[k] and base[k]:
            r[k + "_vs_bf16"] = round(r[k] / base[k] - 1, 4)
    walk, walk0 = r["offline"]["tau_trajectory"], base["offline"]["tau_trajectory"]
    if walk and walk0:
        r["walk_tau_vs_bf16"] = round(walk / walk0 - 1, 4)
(out / "storage_tau.json").write_text(json.dumps(rows, indent=1) + "\n")
print(f"{'mode':<6} {'B/token':>8} {'x tH':>6} {'walk tau':>9} {'vs bf16':>8} {'real tau':>9} "
      f"{'vs bf16':>8} {'identical':>9}")
for m, r in rows.items():
    print(f"{m:<6} {r['bytes_per_token']:>8} {r['bytes_per_tH']:>6} "
          f"{r['offline']['tau_trajectory'] or 0:>9.3f} {r.get('walk_tau_vs_bf16', 0):>8.2%} "
          f"{r['real_tau'] or 0:>9.3f} {r.get('real_tau_vs_bf16', 0):>8.2%} "
          f"{str(r['real_identical']):>9}")
EOF
}

case $stage in
  data) data ;; train) train ;; real) real ;; table) table ;;
  all) data; train; real; table ;;
  *) echo "unknown stage $stage (data|train|real|table|all)" >&2; exit 2 ;;
esac
