#!/usr/bin/env bash
# Instructions per request: visor and the bare hyper proxy (`loadkit
# proxy`), each run under valgrind's callgrind in front of the same mock
# upstream, one request at a time. An instruction count does not move with
# the neighbours' load on a shared host (there, one binary's req/s moved by
# 2-3x within a day), so a change's cost on the small-request path can be
# read to within about a per cent, before and after, on any machine.
#
#   benches/instructions.sh                      # small chats and streams
#   N=500 benches/instructions.sh                # fewer requests
#   BODIES=conversation benches/instructions.sh  # the 1.2 MB conversation
#                                                # (N/50 requests, at least 20)
#   VISOR=/tmp/visor-old benches/instructions.sh # another build of visor
#   LOG=info benches/instructions.sh             # visor with its default log
#                                                # line (one a request); warn
#                                                # otherwise, as in load.sh
#
# What it counts is user-space work only: the kernel's share (the socket
# reads and writes; nginx's whole CPU per small request, kernel included,
# is 11-13 us on the development machine) is not in it, and a
# `rep movsb` copy counts one instruction a byte, so glibc's memcpy of a
# large future weighs more here than in CPU time. Each run leaves its
# profile in target/instructions/ (`callgrind_annotate --inclusive=yes
# FILE` reads it). Needs valgrind (apt-get install valgrind; done here when
# missing and running as root), and python3 for the conversation.
# Everything listens on 127.0.0.1.
set -euo pipefail
cd "$(dirname "$0")/.."

N="${N:-2000}"
LOG="${LOG:-warn}"
WORK=target/instructions
MOCK_PORT=19150; VISOR_PORT=19250; HYPER_PORT=19450
mkdir -p "$WORK"

if ! command -v valgrind >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq valgrind >/dev/null
  else
    echo "need valgrind (apt-get install valgrind)" >&2; exit 1
  fi
fi

cargo build --release --quiet --bin visor --example loadkit
VISOR="${VISOR:-target/release/visor}"
KIT=target/release/examples/loadkit

echo '{"model":"gpt-4o","messages":[{"role":"user","content":"Say hello."}]}' > "$WORK/small.json"
echo '{"model":"gpt-4o","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"Say hello."}]}' > "$WORK/stream.json"
BODIES="${BODIES:-small stream}"
for body in $BODIES; do
  case "$body" in
    small|stream) ;;
    conversation) python3 benches/conversation.py "$WORK/conversation.json" ;;
    *) echo "unknown body $body (small, stream, conversation)" >&2; exit 1 ;;
  esac
done
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
cleanup() { for p in ${pids[@]+"${pids[@]}"}; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT
trap 'exit 130' INT TERM

port_free() { ! (echo >"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
for p in $MOCK_PORT $VISOR_PORT $HYPER_PORT; do
  port_free "$p" || { echo "port $p is taken: stop what listens there" >&2; exit 1; }
done
wait_port() {
  for _ in $(seq 1 300); do (echo >"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.2; done
  echo "port $1 not up" >&2; exit 1
}

"$KIT" mock "127.0.0.1:$MOCK_PORT" >/dev/null 2>&1 & pids+=($!)
wait_port "$MOCK_PORT"

# count KEY PORT BODY REQUESTS -- COMMAND…: sets IR[KEY] to the
# instructions per request of COMMAND over REQUESTS sequential requests,
# after 220 to warm it. Runs in this shell (not in a `$(…)`), so a failure
# stops the script and what it starts is stopped with it.
declare -A IR
count() {
  local key=$1 port=$2 body=$3 n=$4; shift 5
  local out="$WORK/${key//\//-}.callgrind"
  rm -f "$out" "$out".*
  RUST_LOG=$LOG valgrind --tool=callgrind --dump-instr=no --callgrind-out-file="$out" "$@" \
    >/dev/null 2>"$out.log" &
  local vg=$!
  pids+=($vg)
  wait_port "$port"
  local url="http://127.0.0.1:$port/v1/chat/completions"
  "$KIT" first-byte "$url" "$WORK/$body.json" 200 >/dev/null
  callgrind_control --zero "$vg" >/dev/null 2>>"$out.ctl" ||
    { echo "$key: callgrind_control --zero failed (see $out.ctl)" >&2; exit 1; }
  # `first-byte` sends 20 requests of its own before the N it times.
  "$KIT" first-byte "$url" "$WORK/$body.json" "$n" >/dev/null
  callgrind_control --dump=measured "$vg" >/dev/null 2>>"$out.ctl" ||
    { echo "$key: callgrind_control --dump=measured failed (see $out.ctl)" >&2; exit 1; }
  kill "$vg" 2>/dev/null || true
  wait "$vg" 2>/dev/null || true
  local total
  total=$(callgrind_annotate "$out.1" 2>/dev/null | awk '/PROGRAM TOTALS/ { gsub(",", "", $1); print $1 }')
  [ -n "$total" ] || { echo "$key: no profile (see $out.log)" >&2; exit 1; }
  IR[$key]=$((total / (n + 20)))
}

for body in $BODIES; do
  case "$body" in
    small) n=$N ;;
    stream) n=$((N / 2)) ;;
    *) n=$((N / 50)); [ "$n" -ge 20 ] || n=20 ;; # the conversation
  esac
  [ "$n" -ge 1 ] || { echo "N must be 2 or more" >&2; exit 1; }
  echo "counting $body via visor ($n requests)" >&2
  count "visor/$body" "$VISOR_PORT" "$body" "$n" -- "$VISOR" serve --config "$WORK/visor.toml"
  echo "counting $body via hyper ($n requests)" >&2
  count "hyper/$body" "$HYPER_PORT" "$body" "$n" -- "$KIT" proxy "127.0.0.1:$HYPER_PORT" "127.0.0.1:$MOCK_PORT"
done

echo
echo "instructions per request (callgrind, user space; $(date -u +%F); $VISOR; RUST_LOG=$LOG)"
printf '%-13s %12s %12s %8s\n' request visor hyper "x hyper"
for body in $BODIES; do
  awk -v b="$body" -v v="${IR[visor/$body]}" -v h="${IR[hyper/$body]}" \
    'BEGIN { printf "%-13s %12d %12d %8.2f\n", b, v, h, v / h }'
done
echo "profiles: $WORK/*.callgrind.1 (callgrind_annotate --inclusive=yes FILE)"
