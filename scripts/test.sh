#!/usr/bin/env bash
# Set up everything (first run: a few minutes) and run the whole test suite, real-vLLM
# tests included. Extra arguments go to pytest, e.g. the quick tier (no vLLM, no image, no
# soak: the loop to work in) `scripts/test.sh -m "not vllm and not image and not soak"`.
# Each test's time is kept in .test-results/junit.xml; the run ends with the 20 slowest tests
# and the time of every file (tests/suite_report.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export VLLM_EXECUTABLE=${VLLM_EXECUTABLE:-$PWD/.venv-vllm/bin/vllm}
mkdir -p .test-results
exec .venv/bin/python -m pytest --junitxml=.test-results/junit.xml "$@"
