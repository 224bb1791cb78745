#!/usr/bin/env bash
# Set up everything (first run: a few minutes) and run the whole test suite, real-vLLM
# tests included. Extra arguments go to pytest, e.g. `scripts/test.sh -m "not vllm"`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export VLLM_EXECUTABLE=${VLLM_EXECUTABLE:-$PWD/.venv-vllm/bin/vllm}
exec .venv/bin/python -m pytest "$@"
