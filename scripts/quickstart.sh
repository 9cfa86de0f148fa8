#!/usr/bin/env bash
# Set-up, then the main job: start the gRPC server on the built-in default model, write a WAV of
# TEXT with the CLI client, stop the server.   Usage: scripts/quickstart.sh [TEXT] [OUT.wav]
set -euo pipefail
cd "$(dirname "$0")/.."
TEXT=${1:-"Hello! This is audio pipeline speaking."}
OUT=${2:-hello.wav}
scripts/setup.sh
log=$(mktemp -t audio-pipeline-server.XXXXXX.log)
.venv/bin/audio-pipeline serve --host 127.0.0.1 --port 0 2>"$log" &
server=$!
trap 'kill -TERM $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
port=""
for _ in $(seq 1 600); do
  port=$(sed -n 's/.*listening on 127.0.0.1:\([0-9]*\).*/\1/p' "$log" | head -n 1)
  [ -n "$port" ] && break
  kill -0 $server 2>/dev/null || { cat "$log" >&2; echo "quickstart: the server failed to start" >&2; exit 1; }
  sleep 0.5
done
[ -n "$port" ] || { cat "$log" >&2; echo "quickstart: the server did not start listening" >&2; exit 1; }
echo "quickstart: server on 127.0.0.1:$port (log: $log)" >&2
.venv/bin/tts-client --server "127.0.0.1:$port" --wait-ready 300 --text "$TEXT" --output "$OUT"
