#!/usr/bin/env bash
# Load comparison: the mock upstream directly, through visor, through nginx
# as a plain reverse proxy, and through the least proxy hyper makes
# (`loadkit proxy`: no reading, no checks, no metrics) — same load generator
# (wrk), same settings, one run. Prints req/s, p50, p99, what each proxy adds
# over direct, each proxy's CPU time per small request, and how long a
# copy of 1.2 MB out of cache took before and after the runs (on a shared
# host it moves by 3x within minutes, and a large body's figures with it).
#
#   benches/load.sh                # c=32, 10 s per run
#   DURATION=5 CONNS=16 benches/load.sh
#
# Needs wrk and nginx (apt-get install -y wrk nginx-light; done here when
# missing and running as root) and python3 for the 4 MB fixture and the memory probe.
# Everything listens on 127.0.0.1 and every run is bounded by DURATION.
set -euo pipefail
cd "$(dirname "$0")/.."

DURATION="${DURATION:-10}"
CONNS="${CONNS:-32}"
THREADS="${THREADS:-2}"
MOCK_PORT=19100; PACED_PORT=19101; VISOR_PORT=19200; NGINX_PORT=19300; HYPER_PORT=19400
WORK=target/load
mkdir -p "$WORK"

need() { command -v "$1" >/dev/null 2>&1; }
if ! need wrk || ! need nginx; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk nginx-light >/dev/null
  else
    echo "need wrk and nginx (apt-get install wrk nginx-light)"; exit 1
  fi
fi

cargo build --release --quiet --bin visor --example loadkit
VISOR=target/release/visor
KIT=target/release/examples/loadkit

# ---- request bodies
echo '{"model":"gpt-4o","messages":[{"role":"user","content":"Say hello."}]}' > "$WORK/small.json"
echo '{"model":"gpt-4o","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"Say hello."}]}' > "$WORK/stream.json"
if [ ! -f "$WORK/large-image-4mb.json" ]; then
  cp tests/fixtures/make_fixtures.py "$WORK/"
  python3 "$WORK/make_fixtures.py" --large >/dev/null
fi
# The 4 MB request goes to a vision model: it must pass byte for byte (its
# 1000x1000 image is within every gpt-4o limit; with images.provider_size
# on, the default, it would be sent at the 768 px OpenAI reads it at: that
# path is `cargo bench --bench fit`'s, so it is off here).
sed 's/"model": "gpt-oss-120b"/"model": "gpt-4o"/' "$WORK/large-image-4mb.json" > "$WORK/large-vision.json"

# The same 4 MB request for a text-only model: the image is replaced.
cp "$WORK/large-image-4mb.json" "$WORK/large-strip.json"

# A 1.2 MB agent conversation (1,000 messages of prose), sent again and
# again one at a time: what a hop adds to a large body. visor holds it
# whole, and goes on from the same body sent before; nginx buffers it
# (its default, in memory here); the bare hyper proxy streams it through.
python3 benches/conversation.py "$WORK/conversation.json"

for name in small stream large-vision large-strip conversation; do
  cat > "$WORK/$name.lua" <<LUA
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer sk-load"
local f = assert(io.open("$WORK/$name.json", "rb"))
wrk.body = f:read("*a")
f:close()
LUA
done

# The host's memory, as a request of 1.2 MB meets it: a copy of 1.2 MB
# between places in two buffers of PROBE_MIB MiB each (default 256; past
# the L2 cache, not necessarily past all of a large shared L3) and again
# between the same two places (within cache). On a shared host the first
# varies with the neighbours' load; every pass a proxy makes over a large
# body pays it.
memory_probe() {
  PROBE_MIB="${PROBE_MIB:-256}" python3 - <<'PY'
import ctypes, os, time
n, span = 1_200_000, int(os.environ["PROBE_MIB"]) << 20
src, dst = bytearray(span), bytearray(span)  # zero-filled: resident
s = ctypes.addressof(ctypes.c_char.from_buffer(src))
d = ctypes.addressof(ctypes.c_char.from_buffer(dst))
k = span // n
t = time.perf_counter()
for r in range(2):
    for i in range(k):
        ctypes.memmove(d + i * n, s + i * n, n)
cold = (time.perf_counter() - t) / (2 * k)
t = time.perf_counter()
for _ in range(200):
    ctypes.memmove(d, s, n)
hot = (time.perf_counter() - t) / 200
print(f"1.2 MB copied across two {span >> 20} MiB buffers {cold * 1e3:.2f} ms ({n / cold / 1e9:.1f} GB/s), within cache {hot * 1e3:.2f} ms ({n / hot / 1e9:.1f} GB/s)")
PY
}
MEMORY_BEFORE=$(memory_probe || echo "probe failed")

# ---- servers
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  [ -f "$WORK/nginx.pid" ] && kill "$(cat "$WORK/nginx.pid")" 2>/dev/null || true
}
trap cleanup EXIT

"$KIT" mock "127.0.0.1:$MOCK_PORT" 2>/dev/null & pids+=($!)
"$KIT" mock "127.0.0.1:$PACED_PORT" 5 2>/dev/null & pids+=($!)
"$KIT" proxy "127.0.0.1:$HYPER_PORT" "127.0.0.1:$MOCK_PORT" 2>/dev/null & HYPER_PID=$!; pids+=($HYPER_PID)

cat > "$WORK/visor.toml" <<TOML
[server]
listen = "127.0.0.1:$VISOR_PORT"
data_dir = "$WORK/var"
[images]
non_vision = "strip"   # the large-strip row measures the transform, not a describer
provider_size = false  # the large-vision row passes byte for byte (see above)
[[upstream]]
name = "paced"
base_url = "http://127.0.0.1:$PACED_PORT/v1"
models = ["paced-*"]
[[upstream]]
name = "mock"
base_url = "http://127.0.0.1:$MOCK_PORT/v1"
models = ["*"]
TOML
# "paced" (model paced-gpt-4o) is the mock with 5 ms between chunks.
RUST_LOG=warn "$VISOR" serve --config "$WORK/visor.toml" 2>"$WORK/visor.log" & VISOR_PID=$!; pids+=($VISOR_PID)

cat > "$WORK/nginx.conf" <<NGINX
worker_processes auto;
pid $PWD/$WORK/nginx.pid;
error_log $PWD/$WORK/nginx-error.log warn;
daemon off;
events { worker_connections 4096; }
http {
  access_log off;
  client_max_body_size 64m;
  client_body_buffer_size 8m;
  client_body_temp_path $PWD/$WORK/nginx-body;
  proxy_temp_path $PWD/$WORK/nginx-proxy;
  fastcgi_temp_path $PWD/$WORK/nginx-fcgi;
  uwsgi_temp_path $PWD/$WORK/nginx-uwsgi;
  scgi_temp_path $PWD/$WORK/nginx-scgi;
  upstream mock { server 127.0.0.1:$MOCK_PORT; keepalive 128; }
  upstream paced { server 127.0.0.1:$PACED_PORT; keepalive 128; }
  server {
    listen 127.0.0.1:$NGINX_PORT;
    location / {
      proxy_pass http://mock;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }
    location /paced/ {
      proxy_pass http://paced/;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }
  }
}
NGINX
nginx -c "$PWD/$WORK/nginx.conf" -e "$PWD/$WORK/nginx-error.log" & pids+=($!)

wait_port() { for _ in $(seq 1 100); do (echo >"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.1; done; echo "port $1 not up"; exit 1; }
for p in $MOCK_PORT $PACED_PORT $VISOR_PORT $NGINX_PORT $HYPER_PORT; do wait_port "$p"; done

rss_kb() { awk '/^VmRSS/ {print $2}' "/proc/$1/status"; }
hwm_kb() { awk '/^VmHWM/ {print $2}' "/proc/$1/status"; }
IDLE_RSS=$(rss_kb "$VISOR_PID")

# CPU time (user + system, clock ticks) of processes, summed.
ticks() { local s=0 p; for p in "$@"; do s=$((s + $(awk '{print $14 + $15}' "/proc/$p/stat"))); done; echo "$s"; }
# nginx writes its pid file and starts its workers after it listens.
NGINX_PIDS=""
for _ in $(seq 1 50); do
  NGINX_PIDS=$( { pgrep -P "$(cat "$WORK/nginx.pid" 2>/dev/null)" 2>/dev/null || true; } | tr '\n' ' ')
  [ -n "${NGINX_PIDS// }" ] && break
  sleep 0.1
done
[ -n "${NGINX_PIDS// }" ] || { echo "nginx workers not found"; exit 1; }
declare -A CPU_PIDS=([visor]="$VISOR_PID" [nginx]="$NGINX_PIDS" [hyper]="$HYPER_PID")
HZ=$(getconf CLK_TCK)

# ---- runs
declare -A RPS P50 P99 REQS CPU_US
to_us() { # wrk latency like 1.23ms / 456.00us / 1.02s → microseconds
  awk -v v="$1" 'BEGIN { n=v+0; if (v ~ /us$/) print n; else if (v ~ /ms$/) print n*1000; else if (v ~ /s$/) print n*1000000; else print n }'
}
run() { # key url lua conns
  local t=$THREADS; [ "$4" -lt "$t" ] && t=$4
  local out; out=$(wrk -t"$t" -c"$4" -d"${DURATION}s" --latency -s "$WORK/$3.lua" "$2" 2>&1)
  RPS[$1]=$(echo "$out" | awk '/Requests\/sec/ {print $2}')
  P50[$1]=$(to_us "$(echo "$out" | awk '$1=="50%" {print $2}')")
  P99[$1]=$(to_us "$(echo "$out" | awk '$1=="99%" {print $2}')")
  REQS[$1]=$(echo "$out" | awk '/requests in/ {print $1}')
  local errs; errs=$(echo "$out" | grep -E "Non-2xx|Socket errors" || true)
  [ -n "$errs" ] && echo "  $1: $errs" >&2
  return 0
}

declare -A URL=(
  [direct]="http://127.0.0.1:$MOCK_PORT/v1/chat/completions"
  [visor]="http://127.0.0.1:$VISOR_PORT/v1/chat/completions"
  [nginx]="http://127.0.0.1:$NGINX_PORT/v1/chat/completions"
  [hyper]="http://127.0.0.1:$HYPER_PORT/v1/chat/completions"
)
for w in small stream large-vision; do
  for t in direct visor nginx hyper; do
    echo "running $w via $t (c=$CONNS, ${DURATION}s)" >&2
    [ "$w" = small ] && [ "$t" != direct ] && before=$(ticks ${CPU_PIDS[$t]})
    run "$w/$t" "${URL[$t]}" "$w" "$CONNS"
    if [ "$w" = small ] && [ "$t" != direct ]; then
      CPU_US[$t]=$(awk -v a="$before" -v b="$(ticks ${CPU_PIDS[$t]})" -v n="${REQS[$w/$t]}" -v hz="$HZ" \
        'BEGIN { if (n > 0) printf "%.1f", (b - a) / hz * 1e6 / n; else print "-" }')
    fi
  done
  # VmHWM is the peak resident size so far.
  [ "$w" = stream ] && PEAK_RSS_SMALL=$(hwm_kb "$VISOR_PID")
done
PEAK_RSS=$(hwm_kb "$VISOR_PID")
for t in direct visor nginx hyper; do
  echo "running small via $t (c=1, ${DURATION}s)" >&2
  run "c1/$t" "${URL[$t]}" small 1
done
for t in direct visor nginx hyper; do
  echo "running conversation via $t (c=1, ${DURATION}s)" >&2
  run "conv/$t" "${URL[$t]}" conversation 1
done

# The image path: 4 MB bodies for a text-only model, through visor only
# (nginx and the mock would just pass the image on). Peak memory is measured
# from a reset high-water mark (clear_refs 5) at STRIP_CONNS in flight.
STRIP_CONNS=${STRIP_CONNS:-8}
echo "running large-strip via visor (c=$STRIP_CONNS, ${DURATION}s)" >&2
STRIP_BASE=$(rss_kb "$VISOR_PID")
echo 5 > "/proc/$VISOR_PID/clear_refs" 2>/dev/null || true
run "strip/visor" "${URL[visor]}" large-strip "$STRIP_CONNS"
STRIP_HWM=$(hwm_kb "$VISOR_PID")
STRIP_SIZE=$(stat -c %s "$WORK/large-strip.json")

# First byte with chunks paced 5 ms apart (sequential, one connection).
sed 's/"model":"gpt-4o"/"model":"paced-gpt-4o"/' "$WORK/stream.json" > "$WORK/paced.json"
declare -A FB
FB[direct]=$("$KIT" first-byte "http://127.0.0.1:$PACED_PORT/v1/chat/completions" "$WORK/paced.json" 200)
FB[visor]=$("$KIT" first-byte "http://127.0.0.1:$VISOR_PORT/v1/chat/completions" "$WORK/paced.json" 200)
FB[nginx]=$("$KIT" first-byte "http://127.0.0.1:$NGINX_PORT/paced/v1/chat/completions" "$WORK/paced.json" 200)

# ---- report
echo
echo "machine: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo); wrk -t$THREADS -d${DURATION}s; $(date -u +%F)"
printf '%-14s %-7s %10s %10s %10s %9s\n' workload via "req/s" "p50 us" "p99 us" "x direct"
for w in small stream large-vision c1 conv; do
  for t in direct visor nginx hyper; do
    k="$w/$t"
    ratio=$(awk -v a="${RPS[$k]}" -v b="${RPS[$w/direct]}" 'BEGIN { if (b>0) printf "%.2f", a/b; else print "-" }')
    printf '%-14s %-7s %10s %10s %10s %9s\n' "$w" "$t" "${RPS[$k]}" "${P50[$k]}" "${P99[$k]}" "$ratio"
  done
done
echo
for w in small stream large-vision; do
  awk -v w="$w" -v v="${RPS[$w/visor]}" -v n="${RPS[$w/nginx]}" -v h="${RPS[$w/hyper]}" \
    'BEGIN { if (n > 0 && h > 0) printf "%-13s visor/nginx req/s = %.2f, visor/hyper = %.2f\n", w, v/n, v/h; else printf "%-13s (a run gave no figure)\n", w }'
done
echo "CPU per small request (c=$CONNS, user + system): visor ${CPU_US[visor]} us, nginx ${CPU_US[nginx]} us, hyper ${CPU_US[hyper]} us"
for t in visor nginx hyper; do
  awk -v t="$t" -v p50="${P50[c1/$t]}" -v d50="${P50[c1/direct]}" -v p99="${P99[c1/$t]}" -v d99="${P99[c1/direct]}" \
    'BEGIN { printf "c=1 added by %-5s p50 %+.0f us, p99 %+.0f us\n", t, p50-d50, p99-d99 }'
done
for t in visor nginx hyper; do
  awk -v t="$t" -v p50="${P50[conv/$t]}" -v d50="${P50[conv/direct]}" \
    'BEGIN { printf "1.2 MB conversation, c=1, added by %-5s p50 %+.0f us\n", t, p50-d50 }'
done
for t in direct visor nginx; do echo "paced stream first byte via $t: ${FB[$t]}"; done
echo "memory before the runs: $MEMORY_BEFORE"
echo "memory after the runs:  $(memory_probe || echo "probe failed")"
awk -v r="${RPS[strip/visor]}" -v p50="${P50[strip/visor]}" -v p99="${P99[strip/visor]}" -v c="$STRIP_CONNS" \
    -v base="$STRIP_BASE" -v hwm="$STRIP_HWM" -v size="$STRIP_SIZE" \
  'BEGIN { per=(hwm-base)*1024/c; printf "4 MB image replaced (c=%d): %s req/s, p50 %.0f us, p99 %.0f us; peak RSS %.0f MB over %.0f MB before = %.1f MB per request in flight (%.1fx the body)\n", c, r, p50, p99, hwm/1024, base/1024, per/1048576, per/size }'
echo "visor RSS: idle $((IDLE_RSS / 1024)) MB; peak $((PEAK_RSS_SMALL / 1024)) MB over the small and stream runs at c=$CONNS; peak $((PEAK_RSS / 1024)) MB once the 4 MB bodies ran"
