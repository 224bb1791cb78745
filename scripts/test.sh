#!/usr/bin/env bash
# Set up everything (first run: a few minutes) and run the whole test suite, real-vLLM
# tests included. Arguments go to pytest (one session, after the whole setup), e.g. the quick
# tier (no vLLM, no image, no soak: the loop to work in)
# `scripts/test.sh -m "not vllm and not image and not soak"`.
#
# Without arguments, the whole suite runs as two sessions: the quick tier needs nothing of
# .venv-vllm (its markers say so, tests/suite_report.py), so it runs while vLLM installs, its
# output kept and printed when the rest is done; the rest (real vLLM, the image, the soak)
# starts once vLLM is installed, one test at a time, so that no two vLLMs run at once.
# Each test's time is kept in .test-results/*.xml; the run ends with the 20 slowest tests and
# the time of every file over both sessions (tests/suite_report.py).
set -euo pipefail
cd "$(dirname "$0")/.."
export VLLM_EXECUTABLE=${VLLM_EXECUTABLE:-$PWD/.venv-vllm/bin/vllm}
mkdir -p .test-results
if [ $# -gt 0 ]; then
  bash scripts/setup.sh
  exec .venv/bin/python -m pytest --junitxml=.test-results/junit.xml "$@"
fi

quick_tier="not vllm and not image and not soak"
rm -f .test-results/*.xml .test-results/*.json .test-results/*.log
bash scripts/setup.sh --vllm &
vllm_setup=$!
trap 'kill "$vllm_setup" 2>/dev/null || true' EXIT
bash scripts/setup.sh --worker
WORKER_TEST_TIMES=.test-results/quick.json .venv/bin/python -m pytest -m "$quick_tier" \
  --junitxml=.test-results/quick.xml > .test-results/quick.log 2>&1 &
quick=$!
trap 'kill "$vllm_setup" "$quick" 2>/dev/null || true' EXIT

rest=0
if wait "$vllm_setup"; then
  WORKER_TEST_TIMES=.test-results/rest.json .venv/bin/python -m pytest -m "not ($quick_tier)" \
    --junitxml=.test-results/rest.xml 2>&1 | tee .test-results/rest.log || rest=$?
else
  rest=$?
  echo "test.sh: the vLLM install failed; the tests that need it did not run" >&2
fi
quick_status=0
wait "$quick" || quick_status=$?
trap - EXIT
echo
echo "== the quick tier ($quick_tier), run while vLLM installed: its output =="
cat .test-results/quick.log
echo
times=(.test-results/quick.json .test-results/rest.json)
existing=()
for file in "${times[@]}"; do [ -f "$file" ] && existing+=("$file"); done
if [ ${#existing[@]} -gt 0 ]; then
  .venv/bin/python -m tests.suite_report "${existing[@]}"
fi
outcome() {  # pytest's last line of a session's output, or why there is none
  { grep -E '^=+ .+ in [0-9.]+s' "$1" 2>/dev/null || echo "= did not run ="; } | tail -1 | tr -d '='
}
echo "test.sh: the quick tier:$(outcome .test-results/quick.log)(exit status $quick_status);" \
  "the rest:$(outcome .test-results/rest.log)(exit status $rest)"
[ "$quick_status" -eq 0 ] && [ "$rest" -eq 0 ]
