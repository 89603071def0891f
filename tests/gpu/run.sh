#!/usr/bin/env bash
# The GPU test runner: run on a machine with a CUDA device, from the repository root.
#   bash tests/gpu/run.sh [BIN_DIR]   (BIN_DIR holds turbospark and ts_unit_tests; default build)
# Runs every CUDA kernel and model test (tests/unit/cuda), then the CLI on every fixture with
# --device cuda against --device cpu (logits, greedy generate), and the GPU expert cache modes
# against resident.
set -euo pipefail
bin=${1:-build}
# lib/: shared libraries the build machine has and the GPU machine may not (cpp-httplib).
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:$PWD/$bin/lib:${LD_LIBRARY_PATH:-}
export TS_TEST_DATA_DIR="$PWD/tests"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$bin/ts_unit_tests" --gtest_filter='*Cuda*' --gtest_brief=1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for m in tests/models/*/; do
  ids=$(python3 -c "import json,sys; print(','.join(map(str, json.load(open('$m/ref.json'))['prompt_ids'])))")
  "$bin/turbospark" logits --model "$m" --tokens "$ids" --out "$tmp/cpu.npy"
  # Layer kinds the CUDA backend does not run yet (MLA) are refused by name, exit 2.
  rc=0
  "$bin/turbospark" logits --model "$m" --tokens "$ids" --out "$tmp/cuda.npy" --device cuda \
    2>"$tmp/err" || rc=$?
  if [[ $rc == 2 ]] && grep -q "does not run yet" "$tmp/err"; then
    echo "cli $m: refused on CUDA as expected: $(cat "$tmp/err")"
    continue
  fi
  [[ $rc == 0 ]] || { cat "$tmp/err"; exit 1; }
  python3 - "$tmp/cpu.npy" "$tmp/cuda.npy" "$m" <<'PY'
import sys, numpy as np
a, b = np.load(sys.argv[1]), np.load(sys.argv[2])
rel = np.abs(a - b).max() / np.abs(a).max()
print(f"cli {sys.argv[3]}: cuda vs cpu logits max rel {rel:.3g}")
assert rel <= 1e-3, rel
PY
  # The GPU expert cache: byte-identical files from pinned host memory and from the files.
  "$bin/turbospark" logits --model "$m" --tokens "$ids" --out "$tmp/host.npy" --device cuda \
    --residency host --expert-cache-slots 1 --stats
  "$bin/turbospark" logits --model "$m" --tokens "$ids" --out "$tmp/streamed.npy" --device cuda \
    --residency streamed --expert-cache-slots 2 --cache-policy lfu --stats
  cmp "$tmp/cuda.npy" "$tmp/host.npy"
  cmp "$tmp/cuda.npy" "$tmp/streamed.npy"
  echo "cli $m: host and streamed GPU expert cache logits byte-identical to resident"
  # Greedy `generate` on CUDA (the argmax fed back on the device: Engine::decode_greedy)
  # against the CPU's and transformers' greedy ids (ref.json).
  want=$(python3 -c "import json; print(' '.join(map(str, json.load(open('$m/ref.json'))['greedy_ids'])))")
  n=$(wc -w <<<"$want")
  cpu_ids=$("$bin/turbospark" generate --model "$m" --tokens "$ids" -n "$n")
  cuda_ids=$("$bin/turbospark" generate --model "$m" --tokens "$ids" -n "$n" --device cuda)
  if [[ $cpu_ids != "$want" || $cuda_ids != "$want" ]]; then
    echo "cli $m: greedy ids differ: cpu '$cpu_ids', cuda '$cuda_ids', transformers '$want'"
    exit 1
  fi
  echo "cli $m: greedy generate, cuda = cpu = transformers ($n ids)"
done
# GGUF files (each fixture as F32 and Q8_0, written by the test binary as llama.cpp's
# converter lays them out). F32: CUDA against the CPU on the same file. Q8_0: on these small
# random fixtures any two Q8_0 paths (CPU, CUDA, another quantizer) differ by as much as each
# differs from F32 (a routing choice flips), so the check is against transformers' F32 logits:
# the file's CUDA logits must be as close to them as the checkpoint quantized at load is
# (--quant q8_0), within 1.5x + 0.02; a wrong tensor or embedding lands near 1.
TS_GGUF_OUT="$tmp/gguf" "$bin/ts_unit_tests" --gtest_also_run_disabled_tests \
  --gtest_filter='*WriteFixtureGgufs' --gtest_brief=1 >/dev/null
for g in "$tmp"/gguf/*.gguf; do
  name=$(basename "$g" .gguf)
  m=tests/models/${name%.q8_0}
  ids=$(python3 -c "import json,sys; print(','.join(map(str, json.load(open('$m/ref.json'))['prompt_ids'])))")
  "$bin/turbospark" logits --model "$g" --tokens "$ids" --out "$tmp/cpu.npy" 2>/dev/null
  rc=0
  "$bin/turbospark" logits --model "$g" --tokens "$ids" --out "$tmp/cuda.npy" --device cuda \
    2>"$tmp/err" || rc=$?
  if [[ $rc == 2 ]] && grep -q "does not run yet" "$tmp/err"; then
    echo "gguf $name: refused on CUDA as expected"
    continue
  fi
  [[ $rc == 0 ]] || { cat "$tmp/err"; exit 1; }
  "$bin/turbospark" logits --model "$m" --tokens "$ids" --out "$tmp/quant.npy" --device cuda \
    --quant q8_0 2>/dev/null
  python3 - "$tmp" "$m" "$name" <<'PY'
import sys, numpy as np
t, m, name = sys.argv[1:]
cpu, cuda, quant = (np.load(f"{t}/{k}.npy") for k in ("cpu", "cuda", "quant"))
ref = np.load(m + "/logits.npy")
rel = lambda a, b: float(np.abs(a - b).max() / np.abs(b).max())
if name.endswith("q8_0"):
    got, env = rel(cuda, ref), rel(quant, ref)
    print(f"gguf {name}: cuda vs transformers F32 {got:.3g} (checkpoint --quant q8_0: {env:.3g})")
    assert np.isfinite(cuda).all() and got <= 1.5 * env + 0.02, (got, env)
else:
    print(f"gguf {name}: cuda vs cpu logits max rel {rel(cuda, cpu):.3g}")
    assert rel(cuda, cpu) <= 1e-3
PY
done
# bench --device cuda --json on the first fixture: the fields a script reads, and their sums.
m=tests/models/qwen3_moe
"$bin/turbospark" bench --model "$m" --device cuda --contexts 8 --prompts 8 --gen-tokens 4 --json \
  >"$tmp/bench.json"
python3 - "$tmp/bench.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
peak = j["device_peak_gbps"]
assert 500 < peak < 20000, peak  # any HBM card's 2 x memory clock x bus width, in GB/s
for d in j["decode"]:
    assert d["tokens_per_s"] > 0 and d["achieved_gbps"] > 0, d
    assert abs(d["achieved_gbps"] - d["bytes_per_token"] * d["tokens_per_s"] / 1e9) < 1e-6 * d["achieved_gbps"]
    assert abs(d["device_peak_fraction"] * peak - d["achieved_gbps"]) < 1e-6 * d["achieved_gbps"], d
    assert abs(d["roofline_fraction"] * j["roofline_gbps"] - d["achieved_gbps"]) < 1e-6 * d["achieved_gbps"], d
assert all(p["tokens_per_s"] > 0 for p in j["prefill"]), j["prefill"]
print(f"bench --json on {j['device']}: DRAM peak {peak:.0f} GB/s, decode {j['decode'][0]['tokens_per_s']:.1f} tok/s")
PY
echo "gpu tests: all passed"
