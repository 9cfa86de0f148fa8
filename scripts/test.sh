#!/usr/bin/env bash
# Set-up (if needed), then the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test,ray
set +e
.venv/bin/python -m pytest "$@"
status=$?
set -e
if [ $status -eq 5 ]; then
  echo "test: pytest collected no tests; that is a failure" >&2
  exit 1
fi
exit $status
