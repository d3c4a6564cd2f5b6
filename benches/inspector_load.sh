#!/usr/bin/env bash
# The inspector's cost on the hot path: small chat requests at c=32 through
# two visors on one machine, one with the inspector on (the default: every
# request's summary and bodies recorded) and one with it off, run in turn
# so drift hits both alike. Prints each run's req/s, p50 and the visor's
# CPU time per request (user + system, from /proc: what the inspector costs
# whatever else the shared machine runs), and the medians of "on" against
# those of "off". With BODY_BYTES=0 the "on" side keeps summaries only.
#
#   benches/inspector_load.sh               # 5 rounds of 5 s each way
#   ROUNDS=3 DURATION=10 benches/inspector_load.sh
#
# Needs wrk (apt-get install -y wrk; done here when missing and running as
# root). Everything listens on 127.0.0.1 and every run is bounded.
set -euo pipefail
cd "$(dirname "$0")/.."

DURATION="${DURATION:-5}"
ROUNDS="${ROUNDS:-5}"
CONNS="${CONNS:-32}"
MOCK_PORT=19400; ON_PORT=19401; OFF_PORT=19402
WORK=target/load-inspector
mkdir -p "$WORK"

if ! command -v wrk >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk >/dev/null
  else
    echo "need wrk (apt-get install wrk)"; exit 1
  fi
fi

cargo build --release --quiet --bin visor --example loadkit
VISOR=target/release/visor
KIT=target/release/examples/loadkit

cat > "$WORK/small.lua" <<'LUA'
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer sk-load"
wrk.body = '{"model":"gpt-4o","messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"Say hello."}]}'
LUA

pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

"$KIT" mock "127.0.0.1:$MOCK_PORT" 2>/dev/null & pids+=($!)
for side in on off; do
  port=$ON_PORT; enabled=true
  [ "$side" = off ] && { port=$OFF_PORT; enabled=false; }
  cat > "$WORK/$side.toml" <<TOML
[server]
listen = "127.0.0.1:$port"
data_dir = "$WORK/var-$side"
[inspector]
enabled = $enabled
body_bytes = ${BODY_BYTES:-67108864}
[[upstream]]
name = "mock"
base_url = "http://127.0.0.1:$MOCK_PORT/v1"
models = ["*"]
TOML
  RUST_LOG=warn "$VISOR" serve --config "$WORK/$side.toml" 2>"$WORK/$side.log" & pids+=($!)
  [ "$side" = on ] && ON_PID=$! || OFF_PID=$!
done
TICKS=$(getconf CLK_TCK)
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

wait_port() { for _ in $(seq 1 100); do (echo >"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.1; done; echo "port $1 not up"; exit 1; }
for p in $MOCK_PORT $ON_PORT $OFF_PORT; do wait_port "$p"; done

run() { # port pid → "req/s p50 µs-of-CPU-per-request"
  local before after out n
  before=$(cpu_ticks "$2")
  out=$(wrk -t2 -c"$CONNS" -d"${DURATION}s" --latency -s "$WORK/small.lua" "http://127.0.0.1:$1/v1/chat/completions" 2>&1)
  after=$(cpu_ticks "$2")
  n=$(echo "$out" | awk '/requests in/ {print $1}')
  echo "$(echo "$out" | awk '/Requests\/sec/ {print $2}') $(echo "$out" | awk '$1=="50%" {print $2}') $(awk -v t=$((after - before)) -v n="$n" -v hz="$TICKS" 'BEGIN {printf "%.1f", t / hz * 1e6 / n}')"
}
# Warm both (connections, allocator, the inspector's ring filled).
DURATION=2 run $ON_PORT $ON_PID >/dev/null; DURATION=2 run $OFF_PORT $OFF_PID >/dev/null

on=(); off=(); on_cpu=(); off_cpu=()
# The order flips every round (on, off, off, on, …): a first slot that
# runs faster or slower favours neither.
for i in $(seq 1 "$ROUNDS"); do
  for side in $( [ $((i % 2)) = 1 ] && echo "on off" || echo "off on" ); do
    if [ "$side" = on ]; then
      r=$(run $ON_PORT $ON_PID); on+=("${r%% *}"); on_cpu+=("${r##* }"); echo "round $i  on:  $r"
    else
      r=$(run $OFF_PORT $OFF_PID); off+=("${r%% *}"); off_cpu+=("${r##* }"); echo "round $i  off: $r"
    fi
  done
done
median() { printf '%s\n' "$@" | sort -n | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
m_on=$(median "${on[@]}"); m_off=$(median "${off[@]}")
c_on=$(median "${on_cpu[@]}"); c_off=$(median "${off_cpu[@]}")
kept=$(curl -s "http://127.0.0.1:$ON_PORT/visor/api/requests?limit=1000" | python3 -c 'import json,sys; v=json.load(sys.stdin); print(len(v["requests"]), "summaries kept,", v["dropped"], "dropped")' 2>/dev/null || echo "?")
echo
echo "small requests, c=$CONNS, ${ROUNDS}×${DURATION}s each way: inspector on ${m_on} req/s, off ${m_off} req/s, on/off = $(awk -v a="$m_on" -v b="$m_off" 'BEGIN {printf "%.3f", a/b}') (the on side: $kept)"
echo "visor CPU per request: on ${c_on} µs, off ${c_off} µs, on/off = $(awk -v a="$c_on" -v b="$c_off" 'BEGIN {printf "%.3f", a/b}')"
