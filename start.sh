#!/usr/bin/env bash
# Container entrypoint. Picks the mode, then execs so that signals reach the process:
#   serverless  Runpod's job environment is present: the queue worker (python -m worker)
#   http        a plain pod: `vllm serve` itself on 0.0.0.0:$PORT, same env-built command
#   local       the runpod SDK's local test API on $PORT, vLLM behind it on loopback
# WORKER_MODE overrides the automatic choice.
set -euo pipefail

python=${WORKER_PYTHON:-python3}
mode=${WORKER_MODE:-}
if [ -z "$mode" ]; then
  if [ -n "${RUNPOD_WEBHOOK_GET_JOB:-}" ]; then mode=serverless; else mode=http; fi
fi

no_gpu() { ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; }

case "$mode" in
  serverless)
    exec "$python" -m worker "$@"
    ;;
  http)
    exec "$python" -m worker --http "$@"
    ;;
  local)
    if no_gpu; then
      # CPU-friendly defaults: no CUDA graphs, and a KV cache of a fixed size (the default
      # memory fraction applies to one NUMA node and fails on small machines).
      export ENFORCE_EAGER=${ENFORCE_EAGER:-true}
      export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
    fi
    # PORT is the local API's here, not vLLM's (which stays on 127.0.0.1:VLLM_PORT).
    api_port=${PORT:-8000}
    unset PORT
    exec "$python" -m worker --rp_serve_api --rp_api_host "${RP_API_HOST:-127.0.0.1}" \
      --rp_api_port "$api_port" "$@"
    ;;
  *)
    echo "start.sh: WORKER_MODE must be serverless, http or local (got '$mode')" >&2
    exit 2
    ;;
esac
