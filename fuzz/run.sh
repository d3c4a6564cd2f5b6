#!/usr/bin/env bash
# Fuzz the transform entry point for a bounded time (default 120 s):
#   fuzz/run.sh [SECONDS]
# Needs the nightly toolchain and cargo-fuzz (installed here when missing).
# Seeds the corpus with the repo's request fixtures (tests/fixtures). Not run in CI.
set -euo pipefail
cd "$(dirname "$0")"
secs="${1:-120}"
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
corpus=corpus/transform
mkdir -p "$corpus"
cp ../tests/fixtures/*.json "$corpus/"
cargo +nightly fuzz run transform "$corpus" -- \
  -max_total_time="$secs" -max_len=262144 -rss_limit_mb=4096
