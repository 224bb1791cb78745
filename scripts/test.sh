#!/usr/bin/env bash
# Set up everything (first run: a few minutes) and run the whole test suite, real-vLLM
# tests included. Arguments go to pytest (one session, after the whole setup), e.g. the quick
# tier (no vLLM, no image, no soak: the loop to work in)
# `scripts/test.sh -m "not vllm and not image and not soak"`.
#
# Without arguments, the whole suite runs as two sessions. The tests that need nothing of
# .venv-vllm (not `vllm`, not `image`: the quick tier and the soak against a stand-in vLLM;
# the markers say so, tests/suite_report.py) start as soon as .venv is installed, while vLLM
# installs, the soak first (the longest); their output is kept and printed at the end. The
# rest (real vLLM, the image) starts once vLLM is installed, one test at a time, so that no
# two vLLMs run at once.
# Each test's time is kept in .test-results/*.xml; the run ends with the 20 slowest tests and
# the time of every file over both sessions (tests/suite_report.py).
set -euo pipefail
cd "$(dirname "$0")/.."
export VLLM_EXECUTABLE=${VLLM_EXECUTABLE:-$PWD/.venv-vllm/bin/vllm}
mkdir -p .test-results
# What the machine must have (a Python with venv, libnuma; root, debootstrap and unshare for
# the image tests, which run unless the arguments leave them out): installed as root, else
# named in one line with the command that installs it.
image=--image
if [ $# -gt 0 ] && { [[ " $* " != *image* ]] || [[ " $* " == *"not image"* ]]; }; then
  image=""
fi
bash scripts/prerequisites.sh test.sh $image
if [ $# -gt 0 ]; then
  bash scripts/setup.sh
  exec .venv/bin/python -m pytest --junitxml=.test-results/junit.xml "$@"
fi

beside="not vllm and not image"
rm -f .test-results/*.xml .test-results/*.json .test-results/*.log
bash scripts/setup.sh --vllm &
vllm_setup=$!
trap 'kill "$vllm_setup" 2>/dev/null || true' EXIT
bash scripts/setup.sh --worker
soak_first=(tests/test_soak.py)
for file in tests/test_*.py; do [ "$file" = tests/test_soak.py ] || soak_first+=("$file"); done
WORKER_TEST_TIMES=.test-results/no-vllm.json .venv/bin/python -m pytest -m "$beside" \
  "${soak_first[@]}" --junitxml=.test-results/no-vllm.xml > .test-results/no-vllm.log 2>&1 &
no_vllm=$!
trap 'kill "$vllm_setup" "$no_vllm" 2>/dev/null || true' EXIT

rest=0
if wait "$vllm_setup"; then
  WORKER_TEST_TIMES=.test-results/rest.json .venv/bin/python -m pytest -m "not ($beside)" \
    --junitxml=.test-results/rest.xml 2>&1 | tee .test-results/rest.log || rest=$?
else
  rest=$?
  echo "test.sh: the vLLM install failed; the tests that need it did not run" >&2
fi
no_vllm_status=0
wait "$no_vllm" || no_vllm_status=$?
trap - EXIT
echo
echo "== the tests that need no vLLM ($beside), run while vLLM installed: their output =="
cat .test-results/no-vllm.log
echo
times=(.test-results/no-vllm.json .test-results/rest.json)
existing=()
for file in "${times[@]}"; do [ -f "$file" ] && existing+=("$file"); done
if [ ${#existing[@]} -gt 0 ]; then
  .venv/bin/python -m tests.suite_report "${existing[@]}"
fi
outcome() {  # pytest's last line of a session's output, or why there is none
  { grep -E '^=+ .+ in [0-9.]+s' "$1" 2>/dev/null || echo "= did not run ="; } | tail -1 | tr -d '='
}
echo "test.sh: without vLLM:$(outcome .test-results/no-vllm.log)(exit status $no_vllm_status);" \
  "the rest:$(outcome .test-results/rest.log)(exit status $rest)"
[ "$no_vllm_status" -eq 0 ] && [ "$rest" -eq 0 ]
