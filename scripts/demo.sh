#!/usr/bin/env bash
# The main job, end to end on this machine: builds if needed, starts skyreels-server with a tiny random-weight model
# (transformer and VAE) on two CPU replicas (loopback only), waits until it is ready, submits a long video (several
# chunks) through the `skyreels` client with random prompt embeddings, follows it, downloads the latents and the MP4
# into ./out/, stops the server with SIGTERM (graceful drain) and exits 0. Random weights make a noise video: this
# shows the service working, not a model.
#   scripts/demo.sh                 # build the server and the client into ./build first (scripts/setup.sh), then run
#   SKYREELS_SKIP_BUILD=1 BUILD_DIR=build-x scripts/demo.sh   # use binaries that are already built
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_DIR=${BUILD_DIR:-build}
OUT=${OUT:-out}
if [ "${SKYREELS_SKIP_BUILD:-0}" != 1 ]; then
  # Only what the demo runs: the test binaries and bench_* are left to scripts/test.sh (a first video sooner).
  BUILD_DIR="$BUILD_DIR" SKYREELS_TARGETS="skyreels-server skyreels" scripts/setup.sh
fi
BIN="$BUILD_DIR/bin"
for b in skyreels-server skyreels; do
  [ -x "$BIN/$b" ] || { echo "demo: $BIN/$b is missing (run scripts/setup.sh)" >&2; exit 1; }
done

# A free loopback port: nothing answers a connection to it.
free_port() {
  local port
  for _ in $(seq 100); do
    port=$((20000 + RANDOM % 40000))
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then echo "$port"; return; fi
  done
  echo "demo: no free port found" >&2
  exit 1
}
PORT=${PORT:-$(free_port)}
METRICS_PORT=${METRICS_PORT:-$(free_port)}
HTTP_PORT=${HTTP_PORT:-$(free_port)}
SERVER="127.0.0.1:$PORT"
mkdir -p "$OUT"
LOG="$OUT/server.log"
# A fresh data dir (the job store) per run: a demo never resumes an earlier run's jobs.
DATA_DIR=$(mktemp -d "${TMPDIR:-/tmp}/skyreels-demo-data-XXXXXX")

echo "demo: starting skyreels-server --demo on $SERVER (2 CPU replicas), HTTP on 127.0.0.1:$HTTP_PORT," \
  "metrics on 127.0.0.1:$METRICS_PORT"
"$BIN/skyreels-server" --demo --vae demo --text-encoder demo --tokenizer assets/demo/tokenizer \
  --devices cpu,cpu --listen "$SERVER" --data-dir "$DATA_DIR" \
  --metrics-listen "127.0.0.1:$METRICS_PORT" --http-listen "127.0.0.1:$HTTP_PORT" \
  >"$LOG" 2>&1 &
SERVER_PID=$!
stop_server() {
  if kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID"
    wait "$SERVER_PID" || true
  fi
  rm -rf "$DATA_DIR"
}
trap stop_server EXIT

# A text prompt (tiny random UMT5 + the demo tokenizer) -> 57 frames in chunks of 17 with a 9-frame overlap:
# 6 chunks of diffusion forcing at 64x64, 4 steps each.
echo "demo: waiting for readiness, then submitting a 57-frame long video"
if ! JOB=$("$BIN/skyreels" submit --server "$SERVER" --wait-ready 120 \
    --prompt "a red fox running through fresh snow at sunrise, cinematic" \
    --num-frames 57 --base-num-frames 17 --overlap-history 9 --height 64 --width 64 \
    --num-inference-steps 4 --seed 42); then
  echo "demo: submit failed; server log:" >&2
  tail -n 30 "$LOG" >&2
  exit 1
fi
echo "demo: job $JOB"
"$BIN/skyreels" watch --server "$SERVER" "$JOB"
"$BIN/skyreels" download --server "$SERVER" "$JOB" --out "$OUT/"
"$BIN/skyreels" download --server "$SERVER" "$JOB" --out "$OUT/" --format mp4

# The same server through its HTTP door, as an OpenAI SDK or curl sees it: POST /v1/videos, poll, download the MP4.
HTTP="http://127.0.0.1:$HTTP_PORT"
echo "demo: the OpenAI-compatible API: POST $HTTP/v1/videos"
VIDEO=$(curl -sS --fail-with-body "$HTTP/v1/videos" -F "prompt=a lighthouse in a storm, waves crashing" \
  -F size=64x64 -F seconds=2 -F fps=8 -F num_inference_steps=4 -F seed=7)
VIDEO_ID=$(printf '%s' "$VIDEO" | grep -o '"id":"[^"]*"' | head -n 1 | cut -d'"' -f4)
echo "demo: video $VIDEO_ID"
for _ in $(seq 600); do
  STATE=$(curl -sS "$HTTP/v1/videos/$VIDEO_ID" | grep -o '"status":"[^"]*"' | head -n 1 | cut -d'"' -f4)
  [ "$STATE" = completed ] && break
  [ "$STATE" = failed ] && { echo "demo: the HTTP video failed" >&2; exit 1; }
  sleep 0.2
done
[ "$STATE" = completed ] || { echo "demo: the HTTP video did not complete" >&2; exit 1; }
curl -sS --fail "$HTTP/v1/videos/$VIDEO_ID/content" -o "$OUT/$VIDEO_ID.mp4"
curl -sS --fail "$HTTP/v1/videos/$VIDEO_ID/content?variant=thumbnail" -o "$OUT/$VIDEO_ID.png"

# Keep the metrics the run produced next to the result.
{
  exec 3<>"/dev/tcp/127.0.0.1/$METRICS_PORT"
  printf 'GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n' >&3
  sed '1,/^\r$/d' <&3 >"$OUT/metrics.txt"
} || true

echo "demo: stopping the server (SIGTERM drains, then exits)"
trap - EXIT
kill -TERM "$SERVER_PID"
STATUS=0
wait "$SERVER_PID" || STATUS=$?
rm -rf "$DATA_DIR"
if [ "$STATUS" -ne 0 ]; then
  echo "demo: server exited with $STATUS; log in $LOG" >&2
  exit 1
fi
echo "demo: done: $OUT/$JOB.safetensors (latents), $OUT/$JOB.mp4, over HTTP $OUT/$VIDEO_ID.mp4 and its" \
  "thumbnail $OUT/$VIDEO_ID.png, $OUT/metrics.txt, $OUT/server.log"
