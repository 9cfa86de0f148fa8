#!/usr/bin/env bash
# Creates .venv and installs the project with its extras (the first argument, default "test";
# scripts/test.sh asks for "test,ray"). Idempotent: a second run is quick.
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
EXTRAS=${1:-test}
stamp=.venv/.audio-pipeline-installed
installed=$(cat "$stamp" 2>/dev/null || true)
have=1  # every extra asked for is installed already
for extra in ${EXTRAS//,/ }; do
  case ",$installed," in *",$extra,"*) ;; *) have=0 ;; esac
done
if [ ! -f "$stamp" ] || [ $have -eq 0 ] || [ pyproject.toml -nt "$stamp" ] || [ clients/pyproject.toml -nt "$stamp" ]; then
  echo "setup: installing audio-pipeline and its dependencies (extras: $EXTRAS)" >&2
  pip install -e ".[$EXTRAS]"
  echo "$EXTRAS" > "$stamp"
fi
# The native CPU kernels, compiled now (side by side, about 45 s once; cached after) rather than in
# the first request or test that needs them.
.venv/bin/python -m audio_pipeline_kernels.build
