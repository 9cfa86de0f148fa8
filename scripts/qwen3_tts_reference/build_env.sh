#!/usr/bin/env bash
# Build the isolated Python environment that runs the Qwen3-TTS reference
# package (qwen-tts 0.1.1, which pins transformers==4.57.3).
#
#   bash scripts/qwen3_tts_reference/build_env.sh [VENV_DIR]     (default /work/qwen3tts-ref-venv)
#
# Idempotent: re-running it on a complete environment changes nothing.
# Environment knobs:
#   PYTHON       interpreter used to create the venv (default: python3.11, else python3; needs >= 3.10)
#   TORCH_INDEX  extra pip option source for the torch CPU wheel. Not needed on this project's
#                machines (pip's configured find-links hold torch-2.13.0+cpu). Elsewhere use
#                TORCH_INDEX=https://download.pytorch.org/whl/cpu so pip does not pull the CUDA build.
set -euo pipefail

VENV="${1:-/work/qwen3tts-ref-venv}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

TORCH_VERSION="2.13.0"
TORCHAUDIO_VERSION="2.11.0"
QWEN_TTS_VERSION="0.1.1"

if [ -z "${PYTHON:-}" ]; then
    if command -v python3.11 >/dev/null 2>&1; then PYTHON=python3.11; else PYTHON=python3; fi
fi

if [ ! -x "$VENV/bin/python" ]; then
    echo "creating venv $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

# 1. torch, CPU build.
torch_opts=()
if [ -n "${TORCH_INDEX:-}" ]; then torch_opts=(--index-url "$TORCH_INDEX"); fi
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$TORCH_VERSION' else 1)" 2>/dev/null; then
    "${PIP[@]}" install "${torch_opts[@]}" "torch==$TORCH_VERSION"
fi

# 2. the pinned pure dependencies (transformers 4.57.3, accelerate 1.12.0, librosa, ...).
"${PIP[@]}" install -q -r "$HERE/requirements.txt"

# 3. the reference itself and torchaudio, without their dependency pins:
#    - qwen-tts requires gradio (demo UI only) -- left out;
#    - torchaudio 2.11.0 requires torch==2.11.0; no torchaudio wheel exists for torch 2.13.
"${PIP[@]}" install -q --no-deps "qwen-tts==$QWEN_TTS_VERSION" "torchaudio==$TORCHAUDIO_VERSION"

# 4. torchaudio's compiled extension is built against torch 2.11 and fails to load under 2.13.
#    qwen-tts only imports the pure-Python torchaudio.compliance.kaldi (for the 25 Hz tokenizer,
#    unused here); without the .so files torchaudio imports in its pure-Python mode.
rm -f "$VENV"/lib/python3*/site-packages/torchaudio/lib/*.so

# 5. smoke test
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import torch, transformers
import qwen_tts  # noqa: F401  (imports the 12 Hz and 25 Hz code paths)
from qwen_tts.core.models import Qwen3TTSForConditionalGeneration  # noqa: F401
want = {"qwen-tts": "0.1.1", "transformers": "4.57.3", "accelerate": "1.12.0"}
for name, version in want.items():
    assert md.version(name) == version, (name, md.version(name))
assert torch.__version__.split("+")[0] == "2.13.0", torch.__version__
print("qwen3-tts reference env ok:", {k: md.version(k) for k in want}, "torch", torch.__version__)
PY
