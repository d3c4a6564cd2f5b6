#!/usr/bin/env bash
# Peak memory of `visor serve` running the config that deploy/k8s ships
# (the ConfigMap's visor.toml: a proxy key, describe for text-only models,
# the Redis store), with its upstream and Redis on this machine, under load:
# the figures deploy/k8s/deployment.yaml's memory request and limit rest on
# (deploy/README.md). Prints VmHWM (the peak resident size) after each
# workload; the workloads run in turn on one process, so each figure is the
# peak so far.
#
#   benches/k8s_memory.sh                  # builds target/release/visor and loadkit
#   VISOR=path/to/visor KIT=path/to/loadkit benches/k8s_memory.sh
#
# Needs wrk, redis-server, curl and python3. Everything listens on
# 127.0.0.1; each wrk run lasts DURATION seconds, each curl at most 60 s.
set -euo pipefail
cd "$(dirname "$0")/.."

DURATION="${DURATION:-10}"
CONNS="${CONNS:-32}"
MOCK_PORT=19500; REDIS_PORT=19501; VISOR_PORT=19502
WORK=target/k8s-memory
rm -rf "$WORK"; mkdir -p "$WORK"

if [ -z "${VISOR:-}" ] || [ -z "${KIT:-}" ]; then
  cargo build --release --quiet --bin visor --example loadkit
fi
VISOR="${VISOR:-target/release/visor}"
KIT="${KIT:-target/release/examples/loadkit}"

pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT
trap "exit 130" INT TERM

"$KIT" mock "127.0.0.1:$MOCK_PORT" 2>/dev/null & pids+=($!)
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no >/dev/null & pids+=($!)

# The ConfigMap's visor.toml, pointed at this machine.
awk '/visor.toml: \|/ {on=1; next} on { sub(/^    /, ""); print }' deploy/k8s/configmap.yaml |
  sed -e "s|^listen = .*|listen = \"127.0.0.1:$VISOR_PORT\"|" \
      -e "s|^data_dir = .*|data_dir = \"$WORK/var\"|" \
      -e "s|https://api.openai.com/v1|http://127.0.0.1:$MOCK_PORT/v1|" \
      -e "s|redis://visor-redis:6379/0|redis://127.0.0.1:$REDIS_PORT/0|" > "$WORK/visor.toml"
OPENAI_API_KEY=sk-mock VISOR_API_KEY=sk-load RUST_LOG=warn \
  "$VISOR" serve --config "$WORK/visor.toml" 2>"$WORK/visor.log" & VISOR_PID=$!; pids+=($VISOR_PID)

wait_port() { for _ in $(seq 1 100); do (echo >"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.1; done; echo "port $1 not up"; exit 1; }
for p in $MOCK_PORT $REDIS_PORT $VISOR_PORT; do wait_port "$p"; done
kb() { awk -v k="$2:" '$1==k {print $2}' "/proc/$1/status"; }
report() { echo "$1: VmHWM $(( $(kb "$VISOR_PID" VmHWM) / 1024 )) MB, VmRSS $(( $(kb "$VISOR_PID" VmRSS) / 1024 )) MB"; }
report "idle"

# ---- request bodies
echo '{"model":"gpt-4o","messages":[{"role":"user","content":"Say hello."}]}' > "$WORK/small.json"
echo '{"model":"gpt-4o","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"Say hello."}]}' > "$WORK/stream.json"
cp tests/fixtures/chat-image-nonvision.json "$WORK/describe.json"
cp tests/fixtures/make_fixtures.py "$WORK/"
python3 "$WORK/make_fixtures.py" --large >/dev/null
sed 's/"model": "gpt-oss-120b"/"model": "gpt-4o"/' "$WORK/large-image-4mb.json" > "$WORK/large-vision.json"
for name in small stream describe large-vision; do
  cat > "$WORK/$name.lua" <<LUA
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer sk-load"
local f = assert(io.open("$WORK/$name.json", "rb"))
wrk.body = f:read("*a")
f:close()
LUA
done
# Eight distinct 6000x4000 PNGs (24 megapixels, a few hundred KB each) for
# a model that sees: each is decoded and scaled down to fit the model.
python3 - "$WORK" <<'PY'
import base64, json, struct, sys, zlib
w, h = 6000, 4000
def chunk(t, d):
    return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d))
for i in range(8):
    row = bytes((x * (i + 1)) & 255 for x in range(w * 3))
    raw = b"".join(b"\0" + row[y % 7:] + row[:y % 7] for y in range(h))
    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": url}}]}]}
    open(f"{sys.argv[1]}/fit-{i}.json", "w").write(json.dumps(body))
PY

run() { # name conns
  wrk -t2 -c"$2" -d"${DURATION}s" -s "$WORK/$1.lua" "http://127.0.0.1:$VISOR_PORT/v1/chat/completions" \
    | awk '/Requests\/sec|Non-2xx|Socket errors/' | sed "s/^/  /"
  report "$1 (c=$2)"
}
run small "$CONNS"
run stream "$CONNS"
run describe 8
run large-vision "$CONNS"
ls "$WORK"/fit-*.json | xargs -P 4 -I{} curl -s -o /dev/null -w "  fit %{http_code} %{time_total}s\n" --max-time 60 \
  -H "Content-Type: application/json" -H "Authorization: Bearer sk-load" --data-binary @{} \
  "http://127.0.0.1:$VISOR_PORT/v1/chat/completions"
report "8 images of 24 megapixels fitted, 4 at a time"
curl -s "http://127.0.0.1:$VISOR_PORT/metrics" | grep -E '^visor_(images_total\{action="(resized|described)"|describe_total)' | sed "s/^/  /"
echo "machine: $(nproc) cores; $("$VISOR" --version); $(date -u +%F)"
