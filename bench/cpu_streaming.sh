#!/usr/bin/env bash
# Residency benchmark on the CPU (docs/PERF.md): decode tok/s, hit rate and storage bytes per
# token for resident, mapped and streamed (10/25/50% cache, with and without O_DIRECT).
# usage: bench/cpu_streaming.sh PACK_DIR [threads] [gen_tokens]
set -euo pipefail
pack=$1; threads=${2:-2}; gen=${3:-16}
bin=${TS_BIN:-build/turbospark}
n_experts=$($bin inspect --model "$pack" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["n_experts"])')
run() {
  $bin bench --model "$pack" --threads "$threads" --prompt-tokens 16 --gen-tokens "$gen" --json "$@" |
    python3 -c 'import json,sys; j=json.load(sys.stdin); s=j["stats"]
print("%-44s decode %6.2f tok/s  hit %5.1f%%  storage %7.1f MB/token  prefill %6.1f tok/s" % (
  " ".join(sys.argv[1:]), j["decode_tokens_per_s"], 100*s["expert_hit_rate"],
  s["storage_bytes_per_token"]/1e6, j["prefill_tokens_per_s"]))' "$@"
}
run --residency resident
run --residency mapped
for pct in 10 25 50; do
  slots=$(( n_experts * pct / 100 )); [ "$slots" -ge 1 ] || slots=1
  run --residency streamed --expert-cache-slots "$slots"
  run --residency streamed --expert-cache-slots "$slots" --direct-io
done
