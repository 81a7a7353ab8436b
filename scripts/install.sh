#!/usr/bin/env bash
# Install wsync into a virtual environment in this checkout, `.venv/`.
#
# Why a venv: Debian 12 / Ubuntu 24.04 refuse `pip install` into the distro Python
# (PEP 668, "externally-managed-environment"), and a venv is the way they ask for.
# The venv works the same under pyenv, a distro Python or a container image.
#
#   bash scripts/install.sh            # wsync and its runtime dependencies
#   bash scripts/install.sh test       # plus pytest, ruff, mypy (what scripts/test.sh needs)
#
# Afterwards run `.venv/bin/wsync`, or `. .venv/bin/activate` and then `wsync`.
# Set PYTHON to choose the interpreter (default python3, which must be >= 3.11).
set -euo pipefail
cd "$(dirname "$0")/.."

extras=""
if [ "${1:-}" = test ]; then extras="[test]"; fi
py="${PYTHON:-python3}"

# Run a command as root: directly when we are root, through sudo when it works without
# a password prompt; otherwise say what to run and stop.
as_root() {
  if [ "$(id -u)" = 0 ]; then
    "$@"
  elif command -v sudo >/dev/null 2>&1; then
    sudo "$@"
  else
    echo "install.sh: needs root for: $*" >&2
    exit 1
  fi
}

apt_install() {
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "install.sh: please install $* with your package manager, then run this again" >&2
    exit 1
  fi
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" \
    >/dev/null
}

if ! command -v "$py" >/dev/null 2>&1; then
  apt_install python3 python3-venv
fi
if ! "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "install.sh: wsync needs Python >= 3.11; $py is $("$py" -V 2>&1) (set PYTHON=...)" >&2
  exit 1
fi

# A venv left half-made (e.g. by a run without ensurepip) has no pip: make it again.
if [ ! -x .venv/bin/pip ]; then
  rm -rf .venv
  if ! "$py" -m venv .venv 2>/dev/null; then
    # Debian ships venv's ensurepip separately (python3-venv / python3.X-venv).
    rm -rf .venv
    ver="$("$py" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
    apt_install python3-venv "python${ver}-venv"
    "$py" -m venv .venv
  fi
fi

.venv/bin/python -m pip install -q --disable-pip-version-check -e ".${extras}"
echo "wsync installed in $(pwd)/.venv: run .venv/bin/wsync (or . .venv/bin/activate)" >&2
