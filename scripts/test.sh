#!/usr/bin/env bash
# Set up everything (first run: a few minutes) and run the whole test suite, real-vLLM
# tests included. Arguments go to pytest (one session, after the whole setup), e.g. the quick
# tier (no vLLM, no image, no soak: the loop to work in, on two processes of pytest-xdist)
# `scripts/test.sh -m "not vllm and not image and not soak" -n 2`.
#
# Without arguments, the whole suite runs as three sessions. The tests that need nothing of
# .venv-vllm (not `vllm`, not `image`: the quick tier and the soak against a stand-in vLLM;
# the markers say so, tests/suite_report.py; and the fresh machine's run of
# scripts/run_local.sh) start as soon as .venv is installed, while vLLM installs, the longest
# first; their output is kept and printed at the end. The tests that serve the CPU vLLM
# start once vLLM is installed, one test at a time, while the oldest vLLM of the supported
# range installs. Beside them, once the first session has ended, a third session runs the
# rest, one test at a time too: vLLM's install read without serving it (marker vllm_tools),
# the image's builds and containers (image) and the oldest vLLM's tests (oldest_vllm). At most
# two vLLMs run at once, one per session. Its output is printed at the end.
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
rm -f .test-results/*.xml .test-results/*.json .test-results/*.log .test-results/*.status
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
beside_status=0
if wait "$vllm_setup"; then
  # The oldest vLLM of the supported range installs while the rest runs; its exit status is
  # kept in a file for the session beside (not a child of its shell, so not for its `wait`).
  (status=0; bash scripts/setup.sh --oldest-vllm > .test-results/oldest-setup.log 2>&1 || status=$?
   echo "$status" > .test-results/oldest-setup.status) &
  oldest_setup=$!
  # Beside the tests that serve, a session of its own, its output kept: the tests that run or
  # read vLLM's install without serving it (marker vllm_tools), the image's (builds, and
  # containers that serve), and the oldest vLLM's (marker oldest_vllm), once that one is
  # installed. It starts once the first session has ended: that session's soak has timed
  # faults, and on 2 cores a session beside it once moved two of them onto each other.
  (while kill -0 "$no_vllm" 2>/dev/null; do sleep 2; done
   while [ ! -f .test-results/oldest-setup.status ]; do sleep 2; done
   selection="(vllm_tools or image or oldest_vllm) and not ($beside)"
   if [ "$(cat .test-results/oldest-setup.status)" != 0 ]; then
     selection="(vllm_tools or image) and not oldest_vllm and not ($beside)"
   fi
   WORKER_TEST_TIMES=.test-results/beside.json exec .venv/bin/python -m pytest \
     -m "$selection" --junitxml=.test-results/beside.xml > .test-results/beside.log 2>&1) &
  beside_session=$!
  trap 'kill "$no_vllm" "$oldest_setup" "$beside_session" 2>/dev/null || true' EXIT
  WORKER_TEST_TIMES=.test-results/rest.json .venv/bin/python -m pytest \
    -m "not ($beside) and not (vllm_tools or image or oldest_vllm)" \
    --junitxml=.test-results/rest.xml 2>&1 | tee .test-results/rest.log || rest=$?
  wait "$beside_session" || beside_status=$?
  if [ "$(cat .test-results/oldest-setup.status 2>/dev/null)" != 0 ]; then
    cat .test-results/oldest-setup.log >&2
    echo "test.sh: the oldest vLLM's install failed; its tests did not run" >&2
    beside_status=1
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
if [ -f .test-results/beside.log ]; then
  echo "== vLLM's install not served, the image, the oldest vLLM, run beside the rest: their output =="
  cat .test-results/beside.log
  echo
fi
times=(.test-results/no-vllm.json .test-results/beside.json .test-results/rest.json)
existing=()
for file in "${times[@]}"; do [ -f "$file" ] && existing+=("$file"); done
if [ ${#existing[@]} -gt 0 ]; then
  .venv/bin/python -m tests.suite_report "${existing[@]}"
fi
outcome() {  # pytest's last line of a session's output, or why there is none
  { grep -E '^=+ .+ in [0-9.]+s' "$1" 2>/dev/null || echo "= did not run ="; } | tail -1 | tr -d '='
}
echo "test.sh: without vLLM:$(outcome .test-results/no-vllm.log)(exit status $no_vllm_status);" \
  "beside (vLLM's install, the image, the oldest vLLM):$(outcome .test-results/beside.log)(exit status $beside_status);" \
  "the rest:$(outcome .test-results/rest.log)(exit status $rest)"
[ "$no_vllm_status" -eq 0 ] && [ "$beside_status" -eq 0 ] && [ "$rest" -eq 0 ]
