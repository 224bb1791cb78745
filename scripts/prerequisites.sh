#!/usr/bin/env bash
# What scripts/run_local.sh and scripts/test.sh need of the machine, checked before anything is
# installed:
#
#   scripts/prerequisites.sh NAME [--image]
#
#   * a Python 3.11 or newer (PYTHON, default python3) that can make a virtual environment
#     (Debian's python3 cannot without python3-venv), unless .venv and .venv-vllm exist;
#   * libnuma, which vLLM's CPU build loads at import (without it vLLM exits at once:
#     tests/data/failure_logs/0.32.0/cpu_libnuma_missing.log);
#   * with --image (the image tests, tests/test_image.py): root, debootstrap and unshare.
#
# Run as root on a machine with apt-get, it installs the packages that are missing (as .ci/run
# does for debootstrap); otherwise it prints one line, NAME: what is missing and the command
# that installs it, and exits 1. PREREQUISITES_NO_INSTALL=1 only reports; PREREQUISITES_ROOT
# is where the library folders and /usr/sbin are looked for (default /): both for
# tests/test_install.py, which also hands it a PATH and an `id` of its own.
set -euo pipefail
cd "$(dirname "$0")/.."

name=${1:?usage: scripts/prerequisites.sh NAME [--image]}
image=false
[ "${2:-}" = --image ] && image=true
python=${PYTHON:-python3}
root=${PREREQUISITES_ROOT:-}
missing=()   # what is missing, in words
packages=()  # the Debian packages that install it
advice=()    # what no package installs

need() {  # what package
  missing+=("$1")
  [ -z "$2" ] || packages+=("$2")
}

# -- Python, and its venv (only while a virtual environment is still to be made) -------------
if [ ! -x .venv/bin/python ] || [ ! -x .venv-vllm/bin/python ]; then
  if ! command -v "$python" >/dev/null 2>&1; then
    need "$python" python3
    [ "$python" = python3 ] && need "venv for python3" python3-venv
  elif ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || echo "?")
    missing+=("Python 3.11 or newer ($python is $version)")
    advice+=("set PYTHON to a Python 3.11 or newer")
  elif ! "$python" -c 'import ensurepip, venv' >/dev/null 2>&1; then
    if [ "$python" = python3 ]; then
      need "venv for python3" python3-venv
    else
      need "venv for $python" "python$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')-venv"
    fi
  fi
fi

# -- libnuma, loaded by vLLM's CPU build ----------------------------------------------------
found=""
for library in "$root"/{usr/local/,usr/,}lib{,64}{,/*}/libnuma.so.1; do
  [ -e "$library" ] && found=$library && break
done
[ -n "$found" ] || need "libnuma (vLLM's CPU build loads it)" libnuma1

# -- the image tests --------------------------------------------------------------------------
if $image; then
  if [ "$(id -u)" -ne 0 ]; then
    missing+=("root (the image tests make Debian root filesystems)")
    advice+=("run as root, or leave the image tests out: scripts/test.sh -m 'not image'")
  fi
  command -v debootstrap >/dev/null 2>&1 || [ -x "$root/usr/sbin/debootstrap" ] \
    || need "debootstrap (the image tests)" debootstrap
  command -v unshare >/dev/null 2>&1 || need "unshare (the image tests)" util-linux
fi

[ ${#missing[@]} -gt 0 ] || exit 0

if [ ${#advice[@]} -eq 0 ] && [ "$(id -u)" -eq 0 ] && [ "${PREREQUISITES_NO_INSTALL:-}" != 1 ] \
    && command -v apt-get >/dev/null 2>&1; then
  echo "$name: installing ${packages[*]}"
  # apt's output is kept, and shown only when it fails (with why).
  apt_log=$(mktemp)
  if apt-get update -qq >"$apt_log" 2>&1 \
      && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${packages[@]}" >>"$apt_log" 2>&1; then
    rm -f "$apt_log"
    exit 0
  fi
  tail -n 20 "$apt_log" >&2
  rm -f "$apt_log"
  echo "$name: installing ${packages[*]} failed (apt-get's last lines above)" >&2
  exit 1
fi

sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo "
fixes=()
[ ${#packages[@]} -eq 0 ] || fixes+=("${sudo}apt-get install -y ${packages[*]}")
fixes+=("${advice[@]}")
joined_missing=$(printf '%s, ' "${missing[@]}")
joined_fixes=$(printf '%s; ' "${fixes[@]}")
echo "$name: missing ${joined_missing%, }: ${joined_fixes%; }" >&2
exit 1
