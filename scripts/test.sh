#!/usr/bin/env bash
# Set up everything (first run: a few minutes) and run the whole test suite, real-vLLM
# tests included. Arguments go to pytest (one session, after the whole setup), e.g. the quick
# tier (no vLLM, no image, no soak: the loop to work in)
# `scripts/test.sh -m "not vllm and not image and not soak"`.
#
# Without arguments, the whole suite runs as three sessions. The tests that need nothing of
# .venv-vllm (not `vllm`, not `image`: the quick tier and the soak against a stand-in vLLM;
# the markers say so, tests/suite_report.py; and the fresh machine's run of
# scripts/run_local.sh) start as soon as .venv is installed, while vLLM installs, the longest
# first; their output is kept and printed at the end. The
# rest (real vLLM, the image) starts once vLLM is installed, one test at a time, so that no
# two vLLMs run at once, while the oldest vLLM of the supported range installs; the tests on
# that one (marker oldest_vllm) run last, as a third session.
# Each test's time is kept in .test-results/*.xml; the run ends with the 20 slowest tests and
# the time of every file over the sessions (tests/suite_report.py).
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
  bash scripts/setup.sh --all
  exec .venv/bin/python -m pytest --junitxml=.test-results/junit.xml "$@"
fi

# The first session also runs the README's first command on a fresh Debian 12 (marker
# fresh_machine, tests/test_fresh_machine.py: minutes of installs of its own, which need
# nothing of .venv-vllm), first, then the soak.
beside="(not vllm and not image) or fresh_machine"
rm -f .test-results/*.xml .test-results/*.json .test-results/*.log
bash scripts/setup.sh --vllm &
vllm_setup=$!
trap 'kill "$vllm_setup" 2>/dev/null || true' EXIT
bash scripts/setup.sh --worker
soak_first=(tests/test_fresh_machine.py tests/test_soak.py)
for file in tests/test_*.py; do
  [[ " ${soak_first[*]} " == *" $file "* ]] || soak_first+=("$file")
done
WORKER_TEST_TIMES=.test-results/no-vllm.json .venv/bin/python -m pytest -m "$beside" \
  "${soak_first[@]}" --junitxml=.test-results/no-vllm.xml > .test-results/no-vllm.log 2>&1 &
no_vllm=$!
trap 'kill "$vllm_setup" "$no_vllm" 2>/dev/null || true' EXIT

rest=0
oldest=0
tools_status=0
if wait "$vllm_setup"; then
  # The oldest vLLM of the supported range installs while the rest runs (its tests, marked
  # oldest_vllm, come last, still one vLLM at a time).
  bash scripts/setup.sh --oldest-vllm > .test-results/oldest-setup.log 2>&1 &
  oldest_setup=$!
  # The tests that run or read vLLM's install without serving it (marker vllm_tools: its
  # parser, its downloads, a catalog dump) run beside those that serve, their output kept,
  # once the first session has ended: its soak's faults are timed, and on 2 cores a third
  # session beside it moved them onto each other.
  (while kill -0 "$no_vllm" 2>/dev/null; do sleep 2; done
   WORKER_TEST_TIMES=.test-results/tools.json exec .venv/bin/python -m pytest \
     -m "vllm_tools and not oldest_vllm and not ($beside)" \
     --junitxml=.test-results/tools.xml > .test-results/tools.log 2>&1) &
  tools=$!
  trap 'kill "$no_vllm" "$oldest_setup" "$tools" 2>/dev/null || true' EXIT
  WORKER_TEST_TIMES=.test-results/rest.json .venv/bin/python -m pytest \
    -m "not ($beside) and not oldest_vllm and not vllm_tools" \
    --junitxml=.test-results/rest.xml 2>&1 | tee .test-results/rest.log || rest=$?
  wait "$tools" || tools_status=$?
  if wait "$oldest_setup"; then
    WORKER_TEST_TIMES=.test-results/oldest.json .venv/bin/python -m pytest -m oldest_vllm \
      --junitxml=.test-results/oldest.xml 2>&1 | tee .test-results/oldest.log || oldest=$?
  else
    oldest=$?
    cat .test-results/oldest-setup.log >&2
    echo "test.sh: the oldest vLLM's install failed; its tests did not run" >&2
  fi
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
if [ -f .test-results/tools.log ]; then
  echo "== the tests that run vLLM's install without serving it, run beside the rest: their output =="
  cat .test-results/tools.log
  echo
fi
times=(.test-results/no-vllm.json .test-results/tools.json .test-results/rest.json
       .test-results/oldest.json)
existing=()
for file in "${times[@]}"; do [ -f "$file" ] && existing+=("$file"); done
if [ ${#existing[@]} -gt 0 ]; then
  .venv/bin/python -m tests.suite_report "${existing[@]}"
fi
outcome() {  # pytest's last line of a session's output, or why there is none
  { grep -E '^=+ .+ in [0-9.]+s' "$1" 2>/dev/null || echo "= did not run ="; } | tail -1 | tr -d '='
}
echo "test.sh: without vLLM:$(outcome .test-results/no-vllm.log)(exit status $no_vllm_status);" \
  "vLLM's install, not served:$(outcome .test-results/tools.log)(exit status $tools_status);" \
  "the rest:$(outcome .test-results/rest.log)(exit status $rest);" \
  "on the oldest vLLM:$(outcome .test-results/oldest.log)(exit status $oldest)"
[ "$no_vllm_status" -eq 0 ] && [ "$tools_status" -eq 0 ] && [ "$rest" -eq 0 ] && \
  [ "$oldest" -eq 0 ]
