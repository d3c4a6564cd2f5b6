#!/usr/bin/env bash
# Fuzzes visor with cargo-fuzz (libFuzzer), one target at a time, each for
# a bounded number of runs and time, and prints per target: executions,
# exec/s, corpus size and whether anything was found. Exits 1 on a finding.
#
#   scripts/fuzz.sh [TARGET...]        # default: every target below
#
# Targets (fuzz/fuzz_targets/):
#   target           src/proxy/router.rs check_target / path_problem /
#                    canonical_path
#   ws_event         src/proxy/websocket.rs read_event (a client event of
#                    the WebSocket mode, read as an HTTP body is)
#   stream           usage (proxy/usage.rs) and the session reply
#                    (sessions::StreamedReply, reply_from_json) in any chunk split
#   config           Config::from_toml over any text
#   transform_json   transform::rewrite over conversations built from the input
#   transform_bytes  transform::rewrite over any bytes that pass the JSON probe
#
# Budgets: FUZZ_RUNS_<target> and FUZZ_TIME_<target> (seconds) override the
# defaults below (about 12 million executions in at most about 32 minutes on
# two cores; each target stops at whichever comes first). FUZZ_TIME_SCALE
# (a percentage, default 100) scales every time budget. Other settings:
#   FUZZ_SANITIZER  none (default; debug assertions and overflow checks are
#                   on either way) or address
#   FUZZ_BUILD_JOBS cargo build jobs (default 2)
# Corpora grow in fuzz/corpus/<target> (seeded from fuzz/seeds/,
# tests/fixtures/*.json and config/*.toml), findings land in
# fuzz/artifacts/<target>/, logs in fuzz/target/fuzz-logs/. A finding is
# replayed with: fuzz/target/<triple>/release/<target> <artifact file>.
# Needs the nightly toolchain (rustup); installs cargo-fuzz when missing.
# Not run in CI.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

all=(target ws_event stream config transform_json transform_bytes)
declare -A runs=(
  [target]=6000000 [ws_event]=3000000 [stream]=3000000 [config]=1000000
  [transform_json]=2000000 [transform_bytes]=200000
)
declare -A secs=(
  [target]=120 [ws_event]=180 [stream]=300 [config]=300
  [transform_json]=600 [transform_bytes]=600
)
declare -A max_len=(
  [target]=4096 [ws_event]=8192 [stream]=8192 [config]=20000
  [transform_json]=4096 [transform_bytes]=262144
)
scale=${FUZZ_TIME_SCALE:-100}
sanitizer=${FUZZ_SANITIZER:-none}

targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=("${all[@]}")
for t in "${targets[@]}"; do
  [ -n "${runs[$t]:-}" ] || { echo "unknown target: $t (one of: ${all[*]})" >&2; exit 2; }
done

echo "== tools"
if ! cargo +nightly --version >/dev/null 2>&1; then
  echo "the nightly toolchain is needed: rustup toolchain install nightly" >&2
  exit 2
fi
cargo +nightly --version
if ! cargo fuzz --version >/dev/null 2>&1; then
  cargo install cargo-fuzz --locked
fi
cargo fuzz --version

echo "== build (sanitizer: $sanitizer)"
CARGO_BUILD_JOBS=${FUZZ_BUILD_JOBS:-2} cargo +nightly fuzz build -s "$sanitizer"
triple=$(rustc +nightly -vV | sed -n 's/^host: //p')
bin="$root/fuzz/target/$triple/release"
logs="$root/fuzz/target/fuzz-logs"
mkdir -p "$logs"

seed() {
  local t=$1 dir=$2
  [ -d "fuzz/seeds/$t" ] && cp -n fuzz/seeds/"$t"/* "$dir"/ 2>/dev/null || true
  case $t in
    transform_bytes) cp -n tests/fixtures/*.json "$dir"/ 2>/dev/null || true ;;
    config) cp -n config/*.toml "$dir"/ 2>/dev/null || true ;;
  esac
}

found=0
total=0
report=()
for t in "${targets[@]}"; do
  var_runs="FUZZ_RUNS_$t"
  var_time="FUZZ_TIME_$t"
  n=${!var_runs:-${runs[$t]}}
  s=${!var_time:-$(( secs[$t] * scale / 100 ))}
  [ "$s" -ge 1 ] || s=1
  corpus="fuzz/corpus/$t"
  artifacts="fuzz/artifacts/$t"
  mkdir -p "$corpus" "$artifacts"
  seed "$t" "$corpus"
  before=$(find "$artifacts" -type f | wc -l)
  log="$logs/$t.log"
  echo "== $t: up to $n runs or $s s"
  started=$(date +%s)
  set +e
  "$bin/$t" "$corpus" -runs="$n" -max_total_time="$s" -max_len="${max_len[$t]}" \
    -rss_limit_mb=4096 -timeout=30 -print_final_stats=1 \
    -artifact_prefix="$artifacts/" >"$log" 2>&1
  rc=$?
  set -e
  elapsed=$(( $(date +%s) - started ))
  after=$(find "$artifacts" -type f | wc -l)
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  files=$(find "$corpus" -type f | wc -l)
  size=$(du -sk "$corpus" | cut -f1)
  result="no finding"
  if [ "$rc" -ne 0 ] || [ "$after" -gt "$before" ]; then
    result="FINDING (exit $rc; see $log and $artifacts/)"
    found=1
    grep -m1 -A3 -E "panicked|ERROR: libFuzzer|ERROR: AddressSanitizer" "$log" || true
  fi
  total=$(( total + ${execs:-0} ))
  report+=("$(printf '%-16s %12s %9s %7s %8s %6s  %s' "$t" "${execs:-?}" "${rate:-?}" "$files" "${size}K" "$elapsed" "$result")")
done

echo
echo "== results ($(nproc) cores, sanitizer $sanitizer)"
printf '%-16s %12s %9s %7s %8s %6s  %s\n' target executions exec/s corpus size secs result
printf '%s\n' "${report[@]}"
printf '%-16s %12s\n' total "$total"
if [ "$found" -ne 0 ]; then
  echo "FINDINGS: see fuzz/artifacts/" >&2
  exit 1
fi
echo "no finding"
