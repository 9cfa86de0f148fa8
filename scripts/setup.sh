#!/usr/bin/env bash
# Creates .venv and installs the project with its test extras. Idempotent: a second run is quick.
# PyTorch: prefers torch 2.13.0 (on this project's build machines a local CPU wheel), and falls back
# to any torch>=2.4 from the package index.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($PYTHON --version)" >&2
  "$PYTHON" -m venv .venv
fi
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "setup: installing PyTorch" >&2
  pip install "torch==2.13.0" || pip install "torch>=2.4"
fi
stamp=.venv/.audio-pipeline-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ clients/pyproject.toml -nt "$stamp" ]; then
  echo "setup: installing audio-pipeline and its dependencies" >&2
  pip install -e ".[test]"
  touch "$stamp"
fi
