#!/usr/bin/env bash
# A/B of two or more turbospark builds on one GPU machine (docs/PERF.md "Decode latency
# chains"): the binaries run alternately, ROUNDS times, on qwen3-30b-a3b's shape with random
# weights generated on the device, so every binary sees the same machine, clocks and order.
# Compare binaries within one run only: the spread between machines (~5-10%) is larger than
# most single-kernel effects.
#
# usage: bench/cuda_ab.sh ROUNDS "DTYPES" BIN...
#   e.g. bench/cuda_ab.sh 2 "q8_0 bf16" build-gpu/turbospark_old build-gpu/turbospark
# env:   PROMPTS=512,4096 CONTEXTS=128,4096 GEN=64 CONFIG=bench/qwen3-30b-a3b.json
# prints one line per run: AB <binary> <dtype> <decode tok/s per context> <prefill tok/s per prompt>
set -euo pipefail
rounds=$1
dtypes=$2
shift 2
cfg=${CONFIG:-$(dirname "$0")/qwen3-30b-a3b.json}
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
for _ in $(seq "$rounds"); do
  for dt in $dtypes; do
    for bin in "$@"; do
      "$bin" bench --device cuda --synthetic "$cfg" --dtype "$dt" --contexts "${CONTEXTS:-128,4096}" \
        --prompts "${PROMPTS:-512,4096}" --gen-tokens "${GEN:-64}" --json > "$tmp"
      python3 - "$tmp" "$bin" "$dt" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
print("AB", sys.argv[2].ljust(32), sys.argv[3].ljust(5),
      " ".join("%8.1f" % d["tokens_per_s"] for d in j["decode"]),
      " ".join("%8.0f" % p["tokens_per_s"] for p in j["prefill"]))
PY
    done
  done
done
