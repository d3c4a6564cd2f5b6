#!/usr/bin/env bash
# Instructions per request: visor and the bare hyper proxy (`loadkit
# proxy`), each run under valgrind's callgrind in front of the same mock
# upstream, one request at a time. An instruction count does not move with
# the neighbours' load on a shared host (a req/s figure moves by 3x there
# within minutes), so a change's cost on the small-request path can be read
# to a fraction of a per cent, before and after, on any machine.
#
#   benches/instructions.sh                      # small chats and streams
#   N=500 benches/instructions.sh                # fewer requests
#   VISOR=/tmp/visor-old benches/instructions.sh # another build of visor
#
# What it counts is user-space work only: the kernel's share (the socket
# reads and writes, about 9 us of CPU a request here) is not in it, and a
# `rep movsb` copy counts one instruction a byte, so glibc's memcpy of a
# large future weighs more here than in CPU time. Each run leaves its
# profile in target/instructions/ (`callgrind_annotate --inclusive=yes
# FILE` reads it). Needs valgrind (apt-get install valgrind; done here when
# missing and running as root). Everything listens on 127.0.0.1.
set -euo pipefail
cd "$(dirname "$0")/.."

N="${N:-2000}"
WORK=target/instructions
MOCK_PORT=19150; VISOR_PORT=19250; HYPER_PORT=19450
mkdir -p "$WORK"

if ! command -v valgrind >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq valgrind >/dev/null
  else
    echo "need valgrind (apt-get install valgrind)"; exit 1
  fi
fi

cargo build --release --quiet --bin visor --example loadkit
VISOR="${VISOR:-target/release/visor}"
KIT=target/release/examples/loadkit

echo '{"model":"gpt-4o","messages":[{"role":"user","content":"Say hello."}]}' > "$WORK/small.json"
echo '{"model":"gpt-4o","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"Say hello."}]}' > "$WORK/stream.json"
cat > "$WORK/visor.toml" <<TOML
[server]
listen = "127.0.0.1:$VISOR_PORT"
data_dir = "$WORK/var"
[[upstream]]
name = "mock"
base_url = "http://127.0.0.1:$MOCK_PORT/v1"
models = ["*"]
TOML

pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT
"$KIT" mock "127.0.0.1:$MOCK_PORT" 2>/dev/null & pids+=($!)

wait_port() { for _ in $(seq 1 300); do (echo >"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.2; done; echo "port $1 not up"; exit 1; }

# count NAME PORT BODY REQUESTS -- COMMAND…: the instructions per request
# of COMMAND over REQUESTS sequential requests, after 200 to warm it.
count() {
  local name=$1 port=$2 body=$3 n=$4; shift 5
  local out="$WORK/$name-$body.callgrind"
  rm -f "$out" "$out".*
  RUST_LOG=warn valgrind --tool=callgrind --dump-instr=no --callgrind-out-file="$out" "$@" \
    2>"$WORK/$name.log" & local vg=$!
  pids+=($vg)
  wait_port "$port"
  local url="http://127.0.0.1:$port/v1/chat/completions"
  "$KIT" first-byte "$url" "$WORK/$body.json" 200 >/dev/null
  callgrind_control --zero "$vg" >/dev/null 2>&1
  "$KIT" first-byte "$url" "$WORK/$body.json" "$n" >/dev/null
  callgrind_control --dump=measured "$vg" >/dev/null 2>&1
  kill "$vg" 2>/dev/null || true
  wait "$vg" 2>/dev/null || true
  local total
  total=$(callgrind_annotate "$out.1" 2>/dev/null | awk '/PROGRAM TOTALS/ { gsub(",", "", $1); print $1 }')
  [ -n "$total" ] || { echo "$name $body: no profile (see $WORK/$name.log)"; exit 1; }
  echo $((total / n))
}

declare -A IR
for body in small stream; do
  n=$N; [ "$body" = stream ] && n=$((N / 2))
  echo "counting $body via visor ($n requests)" >&2
  IR[visor/$body]=$(count visor "$VISOR_PORT" "$body" "$n" -- "$VISOR" serve --config "$WORK/visor.toml")
  echo "counting $body via hyper ($n requests)" >&2
  IR[hyper/$body]=$(count hyper "$HYPER_PORT" "$body" "$n" -- "$KIT" proxy "127.0.0.1:$HYPER_PORT" "127.0.0.1:$MOCK_PORT")
done

echo
echo "instructions per request (callgrind, user space; $(date -u +%F); $VISOR)"
printf '%-8s %12s %12s %8s\n' request visor hyper "x hyper"
for body in small stream; do
  awk -v b="$body" -v v="${IR[visor/$body]}" -v h="${IR[hyper/$body]}" \
    'BEGIN { printf "%-8s %12d %12d %8.2f\n", b, v, h, v / h }'
done
echo "profiles: $WORK/*.callgrind.1"
