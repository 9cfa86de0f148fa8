#!/usr/bin/env bash
# Set-up (if needed), then the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test,ray
# The playground's browser tests drive Debian's chromium (tests/browser.py): installed where it is
# missing and this machine allows it (root with apt-get).
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "test: installing chromium for the playground's browser tests" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq chromium >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }
fi
# The suite runs in parallel, one test module per worker (pytest-xdist, --dist loadfile: a module's
# fixtures are made once): one worker per core, at most 4. PYTEST_WORKERS=0 runs it in this one
# process (for pdb); an explicit -n in the arguments wins.
workers=${PYTEST_WORKERS:-$(.venv/bin/python -c 'import os; print(min(len(os.sched_getaffinity(0)), 4))')}
parallel=(-n "$workers" --dist loadfile)
for arg in "$@"; do
  case "$arg" in -n|-n[0-9]*|--numprocesses|--numprocesses=*|no:xdist|-pno:xdist) parallel=() ;; esac
done
set +e
.venv/bin/python -m pytest "${parallel[@]}" "$@"
status=$?
set -e
if [ $status -eq 5 ]; then
  echo "test: pytest collected no tests; that is a failure" >&2
  exit 1
fi
exit $status
