#!/usr/bin/env bash
# Container entrypoint: the worker in its own venv, exec'd so that signals reach it.
# The worker picks its mode (WORKER_MODE, else serverless on a queue endpoint, else http):
#   serverless  Runpod's job environment is present: the queue worker
#   http        a plain pod: `vllm serve` itself on 0.0.0.0:$PORT, same env-built command
#   local       the runpod SDK's local test API on $PORT, vLLM behind it on loopback
set -euo pipefail
exec "${WORKER_PYTHON:-python3}" -m worker "$@"
