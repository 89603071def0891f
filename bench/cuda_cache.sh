#!/usr/bin/env bash
# GPU expert cache benchmark (issue 5, docs/PERF.md "GPU expert cache"): qwen3-30b-a3b's shape
# with random weights generated on the device, experts in pinned host memory behind a GPU
# cache of 13 / 32 / 64 slots per layer (10 / 25 / 50% of 128), against all experts resident.
# Routing: these random weights send every token to nearly the same few experts ("model"),
# so the main runs sample each token's top-k afresh: uniformly (hit rate ~ cache fraction)
# and Zipf(1)-skewed under LRU and LFU (bench --routing uniform|zipf:1).
#
# usage: bench/cuda_cache.sh BIN OUT_DIR [DTYPES]     (DTYPES default "q8_0 bf16")
# env:   GEN=64 decoded tokens per run   PROMPTS=512,4096   CONTEXTS=128
set -uo pipefail
bin=$1
out=$2
dtypes=${3:-q8_0 bf16}
gen=${GEN:-64}
prompts=${PROMPTS:-512,4096}
contexts=${CONTEXTS:-128}
cfg=$(dirname "$0")/qwen3-30b-a3b.json
mkdir -p "$out"
run() {  # name, flags...
  local name=$1
  shift
  echo "== $name: $*"
  "$bin" bench --device cuda --synthetic "$cfg" --contexts "$contexts" --prompts "$prompts" \
    --gen-tokens "$gen" "$@" >"$out/$name.txt" 2>&1
  echo "rc=$?"
  grep -E "decode|prefill|expert cache|GPU cache" "$out/$name.txt"
}
for dt in $dtypes; do
  run "$dt-resident-uniform" --dtype "$dt" --routing uniform
  for slots in 13 32 64; do
    run "$dt-host-$slots-uniform" --dtype "$dt" --residency host --expert-cache-slots "$slots" \
      --routing uniform
  done
  if [ "$dt" = q8_0 ]; then
    run "$dt-host-64-model" --dtype "$dt" --residency host --expert-cache-slots 64
    for slots in 13 32; do
      for pol in lru lfu; do
        run "$dt-host-$slots-zipf-$pol" --dtype "$dt" --residency host --expert-cache-slots "$slots" \
          --routing zipf:1 --cache-policy "$pol"
      done
    done
  fi
done
