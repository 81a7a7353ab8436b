#!/usr/bin/env bash
# Install everything the test suite needs, then run the linters, the type checker and
# the tests.  `.ci/run` calls exactly this; so does the README.
#
# System packages come from apt when it exists (as root, or through sudo): a real sshd
# for the ssh tests, busybox, dash and yash for the guest scripts, xxhash/zstd/rsync for the
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
    coreutils procps curl jq yash >/dev/null
else
  echo "test.sh: no apt-get (or neither root nor sudo): install openssh-server, busybox," \
    "dash, xxhash, zstd, rsync and curl yourself; the tests that need them will fail" >&2
fi

bash scripts/install.sh test

# The daemon fleet tests need a real PostgreSQL at 127.0.0.1:5432 (or at WSYNC_TEST_PG, a
# postgresql:// URL of a database they may use to create scratch databases).  Where none
# answers, install the distribution's server, start its cluster and give the postgres
# role a password for TCP logins (Debian's pg_hba asks for one on 127.0.0.1).
start_postgres() {
  if [ -n "${WSYNC_TEST_PG:-}" ] || pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; then
    return 0
  fi
  if ! command -v apt-get >/dev/null 2>&1 || ! { [ "$(id -u)" = 0 ] || command -v sudo >/dev/null 2>&1; }; then
    echo "test.sh: no PostgreSQL on 127.0.0.1:5432 and no apt-get/root to install one;" \
      "set WSYNC_TEST_PG=postgresql://USER:PASS@HOST:PORT/DB (the fleet tests fail without)" >&2
    return 0
  fi
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    postgresql postgresql-client >/dev/null
  local ver
  ver=$(ls /usr/lib/postgresql | sort -n | tail -1)
  if ! pg_lsclusters -h 2>/dev/null | awk '{print $1, $2}' | grep -qx "$ver main"; then
    "${sudo[@]}" pg_createcluster "$ver" main >/dev/null
  fi
  "${sudo[@]}" pg_ctlcluster --skip-systemctl-redirect "$ver" main start 2>/dev/null || true
  for _ in $(seq 1 60); do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 0.5; done
  local as_pg=("${sudo[@]}" -u postgres)
  if [ "$(id -u)" = 0 ]; then as_pg=(runuser -u postgres --); fi
  (cd / && "${as_pg[@]}" psql -q -c "ALTER ROLE postgres PASSWORD 'wsync-test'") >/dev/null
  (cd / && "${as_pg[@]}" psql -q -tc "SELECT 1 FROM pg_database WHERE datname = 'test'" \
    | grep -q 1) || (cd / && "${as_pg[@]}" createdb test)
  export WSYNC_TEST_PG="postgresql://postgres:wsync-test@127.0.0.1:5432/test"
}
start_postgres

# The tools and every subprocess the tests start (sys.executable, `wsync`) use the venv.
export VIRTUAL_ENV="$PWD/.venv"
export PATH="$VIRTUAL_ENV/bin:$PATH"

ruff check src tests bench
ruff format --check src tests bench
mypy --strict src

# pytest exits 5 when it collected no tests: under `set -e` that fails this script too.
# Four workers (pytest-xdist; WSYNC_TEST_WORKERS=0 runs in one process) on a two-core
# machine: most tests wait on sshd, emulators, PostgreSQL or a subprocess, and two workers
# kept the cores about 55% busy (685 s; four: 500 s, 2026-12-03).  Every deadline in the
# tests is sized for a loaded machine.  worksteal rebalances the few long property tests
# instead of leaving one worker with them.
python -m pytest -q -p no:cacheprovider -n "${WSYNC_TEST_WORKERS:-4}" --dist worksteal "$@"
