#!/usr/bin/env bash
# Install everything the test suite needs on a fresh Debian machine (as root),
# then run the linters, the type checker and the tests.  `.ci/run` calls this.
set -euo pipefail
cd "$(dirname "$0")/.."

if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends \
    openssh-server openssh-client xxhash busybox rsync zstd dash tar gzip coreutils procps \
    >/dev/null
fi

python3 -m pip install -q --disable-pip-version-check -e '.[test]'

ruff check src tests bench
ruff format --check src tests bench
mypy --strict src

# pytest exits 5 when it collected no tests: that is a failure here too.
python3 -m pytest -q -p no:cacheprovider "$@"
