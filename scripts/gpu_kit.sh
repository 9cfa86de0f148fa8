#!/usr/bin/env bash
# Assembles .gpukit/ for scripts/gpu_check.sh, from the repository root, on the CPU machine:
#     bash scripts/gpu_kit.sh [--base REV] [--py-spy] [--no-espeak]
# - the shared GPU kit (KIT_SRC, default ../shared/gpu): FlashInfer with its prebuilt kernels and the
#   project's other dependencies for the GPU machine's Python 3.12, the espeak extra (eSpeak NG for
#   the lpc-en voice and the frame voice's CUDA test, English only), prebuild.py and smoke.py;
# - transformers from .venv (the project needs 5.24 or newer; the GPU machine has 5.17), pure Python,
#   cut to what travels: every model's configuration (a config lookup by model type reads them all)
#   and the whole code of the families the project and its tests use;
# - pyzmq and msgspec wheels for Python 3.12 (the engine core's transport; the shared kit predates it);
# - --base REV: that commit's Python (audio_pipeline, kernels, clients; no weights) as base.tar.xz,
#   which gpu_check.sh unpacks to /tmp/base: BASE_TREE=/tmp/base with BASE_ARGS / BASE_STEP_ARGS
#   measures it beside the working tree in the same call;
# - --py-spy: .venv's py-spy (static), compressed, for PROFILE=1;
# - --no-espeak: leaves out the espeak extra (cut to English, 0.6 MB; only the frame voice's CUDA
#   test needs it).
# A GPU call carries the tree and .gpukit, 64 MiB in all: the script says what it came to and fails
# past it. The folder is ignored through .git/info/exclude.
set -euo pipefail
cd "$(dirname "$0")/.."
KIT_SRC=${KIT_SRC:-../shared/gpu}
base="" spy="" espeak=1
while [ $# -gt 0 ]; do
  case "$1" in
    --base) base=$2; shift 2 ;;
    --py-spy) spy=1; shift ;;
    --no-espeak) espeak=; shift ;;
    *) echo "gpu_kit: unknown argument $1" >&2; exit 2 ;;
  esac
done
[ -f "$KIT_SRC/site312.tar.xz" ] || { echo "gpu_kit: no GPU kit at $KIT_SRC (KIT_SRC)" >&2; exit 1; }
rm -rf .gpukit && mkdir .gpukit
cp "$KIT_SRC"/site312.tar.xz "$KIT_SRC"/prebuild.py "$KIT_SRC"/smoke.py .gpukit/
chmod -R u+w .gpukit
exclude=$(git rev-parse --git-path info/exclude)  # a worktree's .git is a file
mkdir -p "$(dirname "$exclude")" && { grep -qx '/.gpukit/' "$exclude" 2>/dev/null || echo '/.gpukit/' >> "$exclude"; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [ -n "$espeak" ]; then
  # The built-in voices speak English only: eSpeak NG's other languages' dictionaries (6.5 of its
  # 7 MB compressed) stay behind.
  mkdir "$work/espeak"
  tar -xJf "$KIT_SRC"/extra-espeakng-site312.tar.xz -C "$work/espeak"
  find "$work/espeak" -path '*/espeak-ng-data/*_dict' ! -name en_dict -delete
  tar -cf - -C "$work/espeak" . | xz -9 -T2 > .gpukit/extra-espeakng-site312.tar.xz
  rm -rf "$work/espeak"
fi

site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
version=$(.venv/bin/python -c 'import transformers; print(transformers.__version__)')
(
  cd "$site"
  tar -cf - --exclude=__pycache__ --exclude='transformers/models/*/*' transformers "transformers-$version.dist-info"
) | tar -xf - -C "$work"
# Families the project imports (models, decoders, tests) and what their modeling code imports.
families="auto llama qwen2 qwen3 mimi csm neucodec xcodec2 dac wav2vec2_bert seamless_m4t encoder_decoder"
for dir in "$site"/transformers/models/*/; do
  name=$(basename "$dir"); [ "$name" = __pycache__ ] && continue
  mkdir -p "$work/transformers/models/$name"
  cp "$dir"/__init__.py "$dir"/configuration_*.py "$work/transformers/models/$name/" 2>/dev/null || true
done
for name in $families; do cp -r "$site/transformers/models/$name" "$work/transformers/models/"; done
find "$work" -name __pycache__ -prune -exec rm -rf {} +
tar -cJf .gpukit/extra-transformers-site312.tar.xz -C "$work" transformers "transformers-$version.dist-info"

# The project's dependencies newer than the shared kit, as Python 3.12 wheels (gpu_check.sh unpacks
# every .whl into its site): the engine core's transport (pyzmq, msgspec).
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .gpukit "pyzmq>=25" "msgspec>=0.18"

if [ -n "$base" ]; then
  git archive "$base" -- audio_pipeline kernels clients pyproject.toml ':(exclude)*.safetensors' ':(exclude)*.gz' \
    | xz -T2 > .gpukit/base.tar.xz
fi
[ -n "$spy" ] && xz -9 -c .venv/bin/py-spy > .gpukit/py-spy.xz

limit=$((64 * 1024 * 1024))
tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
untracked=$(git ls-files -z --others --exclude-standard | xargs -0 -r du -cb | tail -1 | cut -f1)
kit=$(du -cb .gpukit | tail -1 | cut -f1)
total=$((tree + ${untracked:-0} + kit))
echo "gpu_kit: .gpukit $((kit / 1024)) KiB (transformers $version$([ -n "$base" ] && echo ", base $base")$([ -n "$spy" ] && echo ", py-spy")$([ -z "$espeak" ] && echo ", no espeak")); with the tree $((total / 1024)) KiB of $((limit / 1024))"
if [ "$total" -gt "$limit" ]; then
  echo "gpu_kit: over the 64 MiB a GPU call carries: leave out --base or --py-spy, or pass --no-espeak" >&2
  exit 1
fi
