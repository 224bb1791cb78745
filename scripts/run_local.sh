#!/usr/bin/env bash
# Set up everything and run the worker locally: CPU vLLM serving the tiny test model (or
# MODEL_NAME), behind Runpod's routes on http://127.0.0.1:${PORT:-8000} (worker/local_api.py):
# /run, /runsync, /status, /stream, /cancel and /openai/v1, as on an endpoint.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/prerequisites.sh run_local.sh
bash scripts/setup.sh

if [ -z "${MODEL_NAME:-}" ]; then
  export MODEL_NAME=$PWD/.cache/tiny-model
  if [ ! -f "$MODEL_NAME/config.json" ]; then
    .venv-vllm/bin/python scripts/make_tiny_model.py "$MODEL_NAME"
  fi
  export MAX_MODEL_LEN=${MAX_MODEL_LEN:-512}
  # float32: vLLM's most portable CPU kernels (bf16 ones differ with the processor).
  export DTYPE=${DTYPE:-float32}
  # No torch.compile of a model this small: vLLM starts in seconds instead of minutes on a
  # CPU; and a KV cache the size of its context, not vLLM's CPU default of gigabytes.
  export ENFORCE_EAGER=${ENFORCE_EAGER:-true}
  export KV_CACHE_MEMORY_BYTES=${KV_CACHE_MEMORY_BYTES:-64M}
  # The model in the engine's process, as on a GPU with one card (vLLM's CPU build otherwise
  # starts a third process for it, importing torch once more: 26 s to healthy, not 14 s).
  export VLLM_ENABLE_V1_MULTIPROCESSING=${VLLM_ENABLE_V1_MULTIPROCESSING:-0}
fi
export VLLM_EXECUTABLE=${VLLM_EXECUTABLE:-$PWD/.venv-vllm/bin/vllm}
export WORKER_PYTHON=$PWD/.venv/bin/python
port=${PORT:-8000}
cat <<MSG
Starting the worker; once it says "local API listening on http://127.0.0.1:$port", send a job
from another shell:

  curl -s http://127.0.0.1:$port/runsync -H 'Content-Type: application/json' \\
    -d '{"input": {"prompt": "Hello", "sampling_params": {"max_tokens": 8}}}'

MSG
WORKER_MODE=local exec ./start.sh
