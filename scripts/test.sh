#!/usr/bin/env bash
# Install everything the test suite needs, then run the linters, the type checker and
# the tests.  `.ci/run` calls exactly this; so does the README.
#
# System packages come from apt when it exists (as root, or through sudo): a real sshd
# for the ssh tests, busybox and dash for the guest scripts, xxhash/zstd/rsync for the
# guest tools and the benchmark, python3-venv for the venv.  Python packages go into
# `.venv/` in this checkout (scripts/install.sh), never into the system Python (PEP 668).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -x tests/test_cli.py`.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" = 0 ]; then sudo=(); else sudo=(sudo); fi
if command -v apt-get >/dev/null 2>&1 && { [ "$(id -u)" = 0 ] || command -v sudo >/dev/null 2>&1; }; then
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    python3 python3-venv openssh-server openssh-client xxhash busybox rsync zstd dash tar gzip \
    coreutils procps curl jq >/dev/null
else
  echo "test.sh: no apt-get (or neither root nor sudo): install openssh-server, busybox," \
    "dash, xxhash, zstd, rsync and curl yourself; the tests that need them will fail" >&2
fi

bash scripts/install.sh test

# The tools and every subprocess the tests start (sys.executable, `wsync`) use the venv.
export VIRTUAL_ENV="$PWD/.venv"
export PATH="$VIRTUAL_ENV/bin:$PATH"

ruff check src tests bench
ruff format --check src tests bench
mypy --strict src

# pytest exits 5 when it collected no tests: under `set -e` that fails this script too.
python -m pytest -q -p no:cacheprovider "$@"
