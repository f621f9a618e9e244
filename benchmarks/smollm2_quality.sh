#!/usr/bin/env bash
# Drafter quality for the real SmolLM2-135M-Instruct target, end to end on one GPU:
#   1. the main job: SmolLM2 writes 6000 user prompts itself (data.synthetic_prompts, none of
#      them a shipped or held-out prompt) and answers them and the 645 shipped prompts
#      greedily (up to 384 new tokens); hidden states are extracted (padded batches); a drafter
#      trains on them (K = 7, 12 epochs, lr 3e-3) and is exported;
#   2. the held-out prompts (never trained on) are answered greedily and extracted;
#   3. offline acceptance of each export on that held-out hidden-state dataset (exact chain tau).
# Extra arguments go to the main job: `--multirun optim.lr=1e-3,3e-3` trains one drafter per
# value (OUT/sweep/N/export), each evaluated in step 3.
# Real speculative decoding on all held-out prompts then runs on a CPU:
#   eyas evaluate --drafter OUT/run/export --target smollm2 \
#       --prompts data/prompts/heldout.jsonl --k 7 --max-new-tokens 128 --out real.json
#
# Usage: benchmarks/smollm2_quality.sh OUT_DIR [extra Hydra overrides for the main job]
#   (HELDOUT=FILE.jsonl and HELDOUT_MAX_NEW_TOKENS=N change the held-out prompts and length)
set -euo pipefail
out=${1:?usage: benchmarks/smollm2_quality.sh OUT_DIR [hydra overrides]}
shift
py=${PYTHON:-python3}
mkdir -p "$out"
export EYAS_RUN_ID=smollm2-quality

flags=() overrides=()                       # Hydra wants its flags before the overrides
for a in "$@"; do case $a in -*) flags+=("$a") ;; *) overrides+=("$a") ;; esac; done
"$py" train/main.py "${flags[@]}" hydra.run.dir="$out/run" hydra.sweep.dir="$out/sweep" \
  data.num_prompts=645 data.synthetic_prompts=6000 data.max_new_tokens=384 \
  data.generation_batch_size=1024 data.extract_pad_batches=true data.token_budget=8192 \
  train.epochs=12 optim.lr=3e-3 train.eval_every=200 train.log_every=50 \
  eval.speculative=false eval.engines=false "${overrides[@]}" 2>&1 | tee "$out/main.log"

heldout=${HELDOUT:-$("$py" -c "from data.prompts import prompts_path; print(prompts_path('heldout'))")}
"$py" -m train.cli prepare --generate --input "$heldout" --target smollm2 \
  --out "$out/heldout-tokens" --max-new-tokens "${HELDOUT_MAX_NEW_TOKENS:-384}" --batch-size 64
"$py" -m train.cli extract --tokens "$out/heldout-tokens" --target smollm2 \
  --out "$out/heldout-hidden"
for export in "$out"/run/export "$out"/sweep/*/export; do
  [ -d "$export" ] || continue
  "$py" -m train.cli evaluate --drafter "$export" --data "$out/heldout-hidden" --k 7 \
    --out "$(dirname "$export")/offline.json"
done
