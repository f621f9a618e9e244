#!/usr/bin/env bash
# The training step of two trees side by side, in one device call: rounds of
# `benchmarks/train_step.py --cases async` alternating between a BEFORE checkout and this one.
#
# On the CPU machine, once (BEFORE = a commit to compare with):
#   git worktree add --detach .before BEFORE && echo '/.before/' >> .git/info/exclude
#   ../shared/tools/device-wheels.sh                                  # .whl/: hydra, deepspeed, ...
#   mkdir -p .bench && echo '/.bench/' >> .git/info/exclude
#   git archive HEAD | (d=$(mktemp -d) && tar -x -C "$d" && python -m pip wheel -q --no-deps \
#       --no-build-isolation --no-index -w "$PWD/.bench" "$d")        # this tree as a wheel
# On the device machine (carry .whl .before .bench):
#   ROUNDS=3 T=4096 bash benchmarks/step_before_after.sh            # JSON per run under $OUT
# A tree from before eyas installed as one package (top-level data/, models/, ...) runs from
# its own directory; this tree runs from the wheel.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/eyas .bench/eyas-*.whl
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
ROUNDS=${ROUNDS:-3}; T=${T:-4096}; ITERS=${ITERS:-12}; OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
for r in $(seq 1 "$ROUNDS"); do
  for side in before after; do
    if [[ $side == before ]]; then dir=.before; pp=/tmp/site; else dir=.; pp=/tmp/site:/tmp/eyas; fi
    echo "== round $r $side"
    (cd "$dir" && PYTHONPATH=$pp timeout 280 python3 benchmarks/train_step.py --target llama-3.1-8b \
       --tokens "$T" --cases async --iters "$ITERS" --json "$OUT/${side}_r$r.json" 2>&1 | tail -4)
  done
done
