#!/usr/bin/env bash
# The project's GPU check, one time-boxed command for a GPU machine with no network (docs/performance.md: "Measuring on a GPU").
# From the repository root, with .gpukit/ made by scripts/gpu_kit.sh (the GPU kit, its espeak extra, a
# transformers the project takes, >= 5.24 where the GPU machine has 5.17; optionally another tree's Python and
# py-spy), sent with the tree (carry: [".gpukit"]; together under the 64 MiB a GPU call carries):
#     bash scripts/gpu_check.sh [BUDGET_S, default 540]
# Phase A runs the correctness checks side by side (they share the GPU; no timing is read from them):
#   smoke     FlashInfer against the reference at Orpheus-3B's shape, eager and in a re-planned CUDA graph
#   kernels   tests/test_kernels.py's FlashInfer cases
#   cuda      tests/test_cuda.py (the engine on FlashInfer, buckets, graphs, overlap, fp8, decoders, CSM, frame voice)
#   runner    tests/test_model_runner.py on CUDA in float32 (the host-sync guard on the CUDA runner; RUNNER_TESTS
#             replaces the files, e.g. with tests/test_table_staging.py beside it)
# Phase B runs the timings one after the other, alone on the GPU:
#   decoder   python -m audio_pipeline.bench.decoder (SNAC 24 kHz on CUDA: seconds of audio per second, batched)
#   step      python -m audio_pipeline.bench.decode_step (graphs / eager / fp8 per batch, floor, a profiled step)
#   serve     python -m audio_pipeline.bench.serve --random-model orpheus-3b (streams holding real time)
#   live      python -m audio_pipeline.bench.live_text --random-model kyutai-tts-1.6b (first audio after the first
#             word of live text; only where STAGES names it or LIVE_ARGS is set)
# STAGES picks stages (default all); STEP_ARGS and SERVE_ARGS replace each benchmark's arguments; CUDA_K
# selects tests of tests/test_cuda.py (pytest -k), CUDA_LIMIT their time limit (default 200 s: 117 s alone on an H200, past 140 beside the other checks); SERVE2_ARGS adds a second serving run; PROFILE=1 records the
# first with py-spy (a static py-spy binary at .gpukit/py-spy); BASE_TREE with BASE_ARGS / BASE_STEP_ARGS run
# another tree's serving / decode-step benchmark (below).
# Everything lands in $OUT (default /tmp/gpu-check): summary.txt first; at most 8 files.
set -u
cd "$(dirname "$0")/.."
KIT=${KIT:-$PWD/.gpukit} OUT=${OUT:-/tmp/gpu-check}; mkdir -p "$OUT"
T0=$SECONDS DEADLINE=$((SECONDS + ${1:-540})) S=$OUT/summary.txt
STAGES=${STAGES:-jit smoke kernels cuda runner decoder step serve}
say() { echo "[$((SECONDS - T0))s] $*" | tee -a "$S"; }
want() { [[ " $STAGES " == *" $1 "* ]]; }
limit() {  # the smaller of $1 and what is left before the deadline (20 s kept back)
  local left=$((DEADLINE - SECONDS - 20)); [ "$left" -lt "$1" ] && echo "$left" || echo "$1"; }
stage() {  # stage NAME LIMIT LOG CMD...: runs CMD for at most LIMIT seconds into LOG, reports to the summary
  local name=$1 lim; lim=$(limit "$2"); local log=$3; shift 3
  if [ "$lim" -lt 30 ]; then say "SKIP $name (no time left)"; return 99; fi
  say "START $name (limit ${lim}s)"; local t=$SECONDS
  # timeout leads a process group of its own (the stage, its servers and their engine cores); what
  # outlives the stage (a server killed past the limit) would hold the GPU's memory: that group, by
  # its id, and nothing else on the machine, is ended after it.
  timeout -k 5 "$lim" "$@" > "$log" 2>&1 & local pid=$!
  wait "$pid"; local rc=$?
  kill -9 -- "-$pid" 2>/dev/null && sleep 2
  say "END $name rc=$rc in $((SECONDS - t))s$([ $rc = 124 ] && echo ' (timed out)')"
  tail -n 8 "$log" | sed 's/^/    /' >> "$S"; return $rc
}

PY=${PY:-/opt/torch/.venv/bin/python3}; [ -x "$PY" ] || PY=$(command -v python3)
mkdir -p /tmp/site
for k in "$KIT"/site312.tar.xz "$KIT"/extra-*-site312.tar.xz; do
  [ -f "$k" ] && { tar -xJf "$k" -C /tmp/site || { say "unpack of $k failed"; exit 1; }; }
done
for w in "$KIT"/*.whl; do [ -f "$w" ] && "$PY" -m zipfile -e "$w" /tmp/site; done
# What scripts/gpu_kit.sh adds: another tree's Python (--base) and a compressed py-spy (--py-spy).
[ -f "$KIT/base.tar.xz" ] && { mkdir -p /tmp/base && tar -xJf "$KIT/base.tar.xz" -C /tmp/base; }
[ -f "$KIT/py-spy.xz" ] && [ ! -x "$KIT/py-spy" ] && xz -dc "$KIT/py-spy.xz" > "$KIT/py-spy" && chmod +x "$KIT/py-spy"
export PYTHONPATH=/tmp/site:$PWD:$PWD/kernels:$PWD/clients PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export FLASHINFER_WORKSPACE_BASE=/tmp/fi FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a} MAX_JOBS=${MAX_JOBS:-16}
export AUDIO_PIPELINE_CACHE=/tmp/ap-cache
# FlashInfer derives CUDA_HOME from `which nvcc`, wrong where nvcc is a wrapper script.
[ -x /usr/local/cuda/bin/nvcc ] && export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
NVCC=${CUDA_HOME:+$CUDA_HOME/bin/nvcc}; NVCC=${NVCC:-$(command -v nvcc)}
export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "$NVCC")")")}
# FlashInfer links each module with -lcudart -lcuda: provide both names where the toolkit lacks them.
mkdir -p /tmp/cudalib /tmp/curandinc
[ -e "$CUDA_HOME/lib64/libcudart.so" ] || ln -sf "$(ls "$CUDA_HOME"/lib*/libcudart.so.1* 2>/dev/null | head -1)" /tmp/cudalib/libcudart.so
if [ ! -e "$CUDA_HOME/lib64/stubs/libcuda.so" ]; then
  c=$(ldconfig -p | awk '/libcuda\.so\.1 /{print $NF; exit}')
  [ -n "$c" ] || c=$(ls /usr/local/nvidia/lib64/libcuda.so.1 /usr/lib/x86_64-linux-gnu/libcuda.so.1 2>/dev/null | head -1)
  [ -n "$c" ] && ln -sf "$c" /tmp/cudalib/libcuda.so
fi
export FLASHINFER_EXTRA_LDFLAGS="-L/tmp/cudalib"
# FA3's CUTLASS headers include curand_kernel.h: borrow the curand headers if the toolkit lacks them.
if [ ! -e "$CUDA_HOME/include/curand_kernel.h" ]; then
  h=$(find "$(dirname "$(dirname "$PY")")" /usr/local /usr/include -name curand_kernel.h 2>/dev/null | head -1)
  [ -n "$h" ] && ln -sf "$(dirname "$h")"/curand*.h /tmp/curandinc/ && export FLASHINFER_EXTRA_CUDAFLAGS="-I/tmp/curandinc"
fi
{ echo "== probe $(date -u +%FT%TZ) $(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet 2>/dev/null || echo '+changes')"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader
  "$NVCC" --version | tail -1; nproc; free -g | sed -n 2p
  "$PY" -c "import torch; print('torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
  "$PY" -c "import flashinfer, grpc, google.protobuf as p, pydantic, transformers; print('flashinfer', flashinfer.__version__, 'grpc', grpc.__version__, 'protobuf', p.__version__, 'pydantic', pydantic.VERSION, 'transformers', transformers.__version__)"
  ls /tmp/site/flashinfer/data/aot 2>/dev/null | wc -l | sed 's/^/AOT kernels: /'
} >> "$S" 2>&1

# Kernels the kit lacks are built here (16 jobs) and come back, to be added to the kit.
want jit && stage jit 120 "$OUT/jit.log" "$PY" "$KIT/prebuild.py" ${JIT_SETS:-bench decode64 tests fp8}
( cd /tmp/fi/.cache/flashinfer/*/90a/cached_ops 2>/dev/null && ls */*.so > /dev/null 2>&1 \
  && tar -cJf - */*.so | split -b 15m - "$OUT/jit-so.tar.xz." )
[ -f "$OUT/jit.log" ] && { cat "$OUT/jit.log" >> "$S"; rm "$OUT/jit.log"; }

# Phase A: correctness, side by side.
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -rfEs --timeout=170)
pids=()
want smoke && { stage smoke 60 "$OUT/smoke.log" "$PY" "$KIT/smoke.py" & pids+=($!); }
want kernels && { stage kernels 120 "$OUT/kernels.log" "${PYTEST[@]}" tests/test_kernels.py -k flashinfer & pids+=($!); }
want cuda && { stage cuda ${CUDA_LIMIT:-200} "$OUT/cuda.log" "${PYTEST[@]}" -s tests/test_cuda.py ${CUDA_K:+-k "$CUDA_K"} & pids+=($!); }
want runner && { stage runner 120 "$OUT/runner.log" env AUDIO_PIPELINE_TEST_DEVICE=${TEST_DEVICE:-cuda} \
  AUDIO_PIPELINE_TEST_DTYPE=float32 "${PYTEST[@]}" ${RUNNER_TESTS:-tests/test_model_runner.py} & pids+=($!); }
[ ${#pids[@]} -gt 0 ] && wait "${pids[@]}"
for f in smoke kernels cuda runner; do  # one file for the checks: $OUT returns at most 8 files
  [ -f "$OUT/$f.log" ] && { echo "===== $f"; cat "$OUT/$f.log"; rm "$OUT/$f.log"; } >> "$OUT/tests.log"
done

# Phase B: timings, alone on the GPU.
want decoder && stage decoder 90 "$OUT/decoder.log" "$PY" -m audio_pipeline.bench.decoder \
  ${DECODER_ARGS:---decoder snac --device cuda --streams 1,64,256 --chunk 56}
want step && stage step 100 "$OUT/step.log" "$PY" -m audio_pipeline.bench.decode_step \
  ${STEP_ARGS:---batches 1,128,256 --context 300 --steps 30 --variants graphs,unfused,eager,fp8 --profile 128 --trace /tmp/step-trace.json}
[ -f /tmp/step-trace.json ] && gzip -c /tmp/step-trace.json > "$OUT/step-trace.json.gz"
# BASE_TREE and BASE_STEP_ARGS: the decode-step benchmark of another tree, right after this tree's.
want step && [ -n "${BASE_TREE:-}" ] && [ -n "${BASE_STEP_ARGS:-}" ] && stage basestep 100 "$OUT/basestep.log" \
  env PYTHONPATH="/tmp/site:$BASE_TREE:$BASE_TREE/kernels:$BASE_TREE/clients" \
  bash -c "cd '$BASE_TREE' && exec '$PY' -m audio_pipeline.bench.decode_step $BASE_STEP_ARGS"
# PROFILE=1 with a py-spy binary at .gpukit/py-spy: the first serve stage runs under it (as its parent: a
# container's ptrace rules let a parent read its children), raw stacks of every thread into pyspy.txt.
SPY=(); [ -n "${PROFILE:-}" ] && [ -x "$KIT/py-spy" ] && \
  SPY=("$KIT/py-spy" record --subprocesses --nonblocking -r "${PROFILE_RATE:-100}" -f raw -o "$OUT/pyspy.txt" --)
want serve && stage serve ${SERVE_LIMIT:-150} "$OUT/serve.log" "${SPY[@]}" "$PY" -m audio_pipeline.bench.serve --server-log "$OUT/server.log" \
  ${SERVE_ARGS:---device cuda --random-model orpheus-3b --streams 1,32,64,128,256 --utterance-tokens 490 --start-timeout 100 --task-arg max_batch_size=512}
# BASE_TREE and BASE_ARGS: the serving benchmark of another tree (an earlier commit's `git archive` unpacked
# there), its server started from that tree, on the same machine: before and after in one call.
want serve && [ -n "${BASE_TREE:-}" ] && stage base ${BASE_LIMIT:-150} "$OUT/base.log" \
  env PYTHONPATH="/tmp/site:$BASE_TREE:$BASE_TREE/kernels:$BASE_TREE/clients" \
  bash -c "cd '$BASE_TREE' && exec '$PY' -m audio_pipeline.bench.serve ${BASE_ARGS:-}"
# SERVE2_ARGS .. SERVE4_ARGS: more serving benchmarks (e.g. other settings, --spread), each with its own server.
for n in 2 3 4; do
  a=SERVE${n}_ARGS l=SERVE${n}_LIMIT
  want serve && [ -n "${!a:-}" ] && stage serve$n ${!l:-150} "$OUT/serve$n.log" "$PY" -m audio_pipeline.bench.serve ${!a}
done
# Live text (Kyutai TTS reads words as they come: first audio after the first word, against Kyutai's 220 ms).
{ want live || [ -n "${LIVE_ARGS:-}" ]; } && stage live ${LIVE_LIMIT:-120} "$OUT/live.log" "$PY" -m audio_pipeline.bench.live_text \
  ${LIVE_ARGS:---random-model kyutai-tts-1.6b --rate 15 --sentences 2 --rounds 3 --task-arg chunk_size=96,128}
say "total $((SECONDS - T0)) s; files: $(ls "$OUT" | tr '\n' ' ')"
