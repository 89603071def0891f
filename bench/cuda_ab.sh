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
#        EXTRA="more bench flags", e.g. the GPU expert cache (docs/PERF.md "the order of a
#        binding's copies"): EXTRA="--residency host --expert-cache-slots 64 --routing uniform"
# prints one line per run: AB <binary> <dtype> <decode tok/s per context> <prefill tok/s per
# prompt> <warm|cold: how prefill was timed>, and with an expert cache its first decode's hit
# rate, H2D GB/s while copying, the share of the time copying and the host binding time per
# token
# (a binary may be a wrapper script, e.g. one that sets an environment variable)
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
        --prompts "${PROMPTS:-512,4096}" --gen-tokens "${GEN:-64}" ${EXTRA:-} --json > "$tmp"
      python3 - "$tmp" "$bin" "$dt" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
c = j["decode"][0].get("expert_cache") if j["decode"] else None
# Prefill timed warm (each length run once untimed first) or cold (a first prompt: binaries
# from before the bench warmed up, --no-warmup, or an expert cache): compare like with like.
warm = any(p.get("warm", False) for p in j["prefill"])
print("AB", sys.argv[2].ljust(32), sys.argv[3].ljust(5),
      " ".join("%8.1f" % d["tokens_per_s"] for d in j["decode"]),
      " ".join("%8.0f" % p["tokens_per_s"] for p in j["prefill"]),
      ("warm" if warm else "cold") if j["prefill"] else "",
      "" if not c else "hits %.3f copy %.2f GB/s share %.3f bind %.0f us/token" % (
          c["hit_rate"], c["h2d_gbps_copying"], c["copy_share"], c.get("bind_us_per_token", 0)))
PY
    done
  done
done
