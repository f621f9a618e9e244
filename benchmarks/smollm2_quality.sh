#!/usr/bin/env bash
# Drafter quality for the real SmolLM2-135M-Instruct target, end to end on one GPU (~30 min on
# an H200), one CLI stage at a time so each can be re-run or swapped for your own data:
#   1. SmolLM2 writes N_SYNTH user prompts itself (`eyas synthesize`; never a shipped or a
#      held-out prompt; OPENER_WORDS=N > 0 starts each with the first N words of a shipped one);
#   2. it answers them and the 645 shipped prompts greedily, up to MAX_NEW_TOKENS new tokens
#      (`eyas prepare --generate`, bf16);
#   3. hidden states are extracted with the target in float32, the precision the real decoding
#      check below runs in (`eyas extract --dtype float32`);
#   4. the drafter trains on them (K = 7, 9 epochs, lr 3e-3, loss.step_weight 0.6, 32000-token
#      draft vocabulary, MLP width 6144, the EAGLE-3.1 norms before fc: norm_before_fc and
#      fc_norm; the settings of +experiment=smollm2_quality) and is exported;
#   5. the held-out prompts (never trained on) are answered greedily and extracted, both in
#      float32, and each export's offline acceptance on them is written to .../offline.json.
# Extra arguments go to the training job: `--multirun optim.lr=1e-3,3e-3` trains one drafter per
# value (OUT/sweep/N/export), each evaluated in step 5. Stages whose output exists are skipped.
# Real speculative decoding on all held-out prompts then runs on a CPU:
#   eyas evaluate --drafter OUT/run/export --target smollm2 \
#       --prompts data/produce/prompts/heldout.jsonl --k 7 --max-new-tokens 128 --out real.json
#
# Usage: benchmarks/smollm2_quality.sh OUT_DIR [extra Hydra overrides for the training job]
#   N_SYNTH (60000), OPENER_WORDS (2; 0 = the chat template alone), MAX_NEW_TOKENS (128), GEN_BATCH (4096; lower it on a smaller GPU),
#   SHIPPED=FILE.jsonl, HELDOUT=FILE.jsonl and HELDOUT_MAX_NEW_TOKENS (128) change the data.
set -euo pipefail
out=${1:?usage: benchmarks/smollm2_quality.sh OUT_DIR [hydra overrides]}
shift
py=${PYTHON:-python3}
eyas() { "$py" -m eyas.train.cli "$@"; }
mkdir -p "$out"
export EYAS_RUN_ID=smollm2-quality
shipped=${SHIPPED:-$("$py" -c "from eyas.data.produce.prompts import prompts_path; print(prompts_path('default'))")}
heldout=${HELDOUT:-$("$py" -c "from eyas.data.produce.prompts import prompts_path; print(prompts_path('heldout'))")}

if [ ! -f "$out/prompts.jsonl" ]; then
  openers=()
  [ "${OPENER_WORDS:-2}" -gt 0 ] && openers=(--openers-from "$shipped" --opener-words "${OPENER_WORDS:-2}")
  eyas synthesize --target smollm2 --n "${N_SYNTH:-60000}" --out "$out/synthetic.jsonl" \
    --batch-size "${GEN_BATCH:-4096}" --exclude "$shipped" "${openers[@]}"
  cat "$shipped" "$out/synthetic.jsonl" > "$out/prompts.tmp" && mv "$out/prompts.tmp" "$out/prompts.jsonl"
fi
[ -f "$out/tokens/manifest.json" ] || eyas prepare --generate --input "$out/prompts.jsonl" \
  --target smollm2 --out "$out/tokens" --max-new-tokens "${MAX_NEW_TOKENS:-128}" \
  --batch-size "${GEN_BATCH:-4096}"
eyas extract --tokens "$out/tokens" --target smollm2 --out "$out/hidden" --dtype float32 \
  --pad-batches --batch-tokens 32768

flags=() overrides=()                       # Hydra wants its flags before the overrides
for a in "$@"; do case $a in -*) flags+=("$a") ;; *) overrides+=("$a") ;; esac; done
"$py" train/main.py "${flags[@]}" hydra.run.dir="$out/run" hydra.sweep.dir="$out/sweep" \
  target=smollm2 data.dataset="$out/hidden" drafter.draft_vocab_size=32000 \
  drafter.intermediate_size=6144 drafter.norm_before_fc=true drafter.fc_norm=true \
  data.token_budget=16384 loss.step_weight=0.6 \
  train.epochs=9 optim.lr=3e-3 train.eval_every=1000 train.log_every=100 train.save_every=500 \
  train.resume=latest \
  eval.speculative=false eval.engines=false "${overrides[@]}" 2>&1 | tee "$out/main.log"

[ -f "$out/heldout-tokens/manifest.json" ] || eyas prepare --generate --input "$heldout" \
  --target smollm2 --out "$out/heldout-tokens" --dtype float32 \
  --max-new-tokens "${HELDOUT_MAX_NEW_TOKENS:-128}" --batch-size 64
eyas extract --tokens "$out/heldout-tokens" --target smollm2 --out "$out/heldout-hidden" \
  --dtype float32
for export in "$out"/run/export "$out"/sweep/*/export; do
  [ -d "$export" ] || continue
  eyas evaluate --drafter "$export" --data "$out/heldout-hidden" --k 7 \
    --out "$(dirname "$export")/offline.json"
done
