#!/usr/bin/env bash
# Build the isolated Python environment that runs the Kyutai TTS reference package
# (moshi 0.2.13, which pins torch < 2.10 and huggingface-hub < 1.0, hence its own venv).
#
#   bash scripts/kyutai_tts_reference/build_env.sh [VENV_DIR]     (default /work/kyutai-ref-venv)
#
# Idempotent: re-running it on a complete environment changes nothing.
# Environment knobs:
#   PYTHON       interpreter used to create the venv (default: python3.11, else python3; needs >= 3.10)
#   TORCH_INDEX  an index for the torch wheel. PyPI's Linux wheel of torch 2.9.1 is the CUDA build
#                (about 4 GB with its libraries, which is what this project's machines take);
#                TORCH_INDEX=https://download.pytorch.org/whl/cpu takes the CPU build where that
#                index is reachable. The fixtures are computed on the CPU either way.
set -euo pipefail

VENV="${1:-/work/kyutai-ref-venv}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

TORCH_VERSION="2.9.1"
MOSHI_VERSION="0.2.13"

if [ -z "${PYTHON:-}" ]; then
    if command -v python3.11 >/dev/null 2>&1; then PYTHON=python3.11; else PYTHON=python3; fi
fi

if [ ! -x "$VENV/bin/python" ]; then
    echo "creating venv $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

# 1. torch, the newest release the package admits.
torch_opts=()
if [ -n "${TORCH_INDEX:-}" ]; then torch_opts=(--index-url "$TORCH_INDEX"); fi
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$TORCH_VERSION' else 1)" 2>/dev/null; then
    "${PIP[@]}" install "${torch_opts[@]}" "torch==$TORCH_VERSION"
fi

# 2. the package's dependencies, every version pinned, then the package itself.
"${PIP[@]}" install -q -r "$HERE/requirements.txt"
"${PIP[@]}" install -q --no-deps "moshi==$MOSHI_VERSION"

# 3. smoke test: the modules the fixtures call import.
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import torch
from moshi.models import loaders, tts  # noqa: F401
assert md.version("moshi") == "0.2.13", md.version("moshi")
assert torch.__version__.split("+")[0] == "2.9.1", torch.__version__
print("kyutai tts reference env ok: moshi", md.version("moshi"), "torch", torch.__version__,
      "sentencepiece", md.version("sentencepiece"))
PY
