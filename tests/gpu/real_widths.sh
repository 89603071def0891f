#!/usr/bin/env bash
# CUDA against the CPU at the widths of released models: two-layer random-weight checkpoints
# of qwen3-30b-a3b, qwen3-235b-a22b (64 query heads on 4 KV heads, d_model 4096), olmoe-1b-7b,
# qwen1.5-moe-a2.7b, qwen2-57b-a14b (28 query heads on 4 KV heads: groups of 7, d_model 3584),
# mixtral-8x7b and mixtral-8x22b (d_model 6144) (tests/gpu/shapes), written by `turbospark
# synth`, as BF16 and as Q8_0 packs (qwen3-30b-a3b also Q4_K experts). The
# fixtures in tests/models are small (d_model 64); many CUDA paths (Q8 activations, clusters,
# tensor-core decode attention past 256 keys, the top-k in the expert phases, the plan's tile
# heights) only run at these widths.
#
#   bash tests/gpu/real_widths.sh [BIN_DIR] [WORK_DIR]   (BIN_DIR as for tests/gpu/run.sh)
#   SHAPES="qwen3-30b-a3b-2layer ..." runs only those shapes.
#
# Each model: 291 prompt tokens (random ids, fixed seed); the CPU's logits at every position
# against CUDA's with one prefill chunk, chunks of 64, of 20 (the quantized experts' short
# tiles) and of 1 (the decode kernels, decode attention past 256 keys). Per position, the
# largest logit error relative to the position's largest logit must be small: median <= 0.02,
# 90th percentile <= 0.05 (a BF16 model against its own Q8_0 pack, both on the CPU, measured
# 0.012 / 0.013: a routing choice that flips moves one position by a few percent; a wrong
# rotation, norm or routing rule moves nearly every position by O(1)). Then greedy decoding
# on CUDA (the decode graph, the expert prediction) from 100 and from 280 prompt tokens: at
# every step the CPU's logits on the same sequence must rank the generated id within 0.1 of
# the row's largest magnitude of their best (a near tie may flip, as above; a broken step
# picks a token whose logit is O(1) below the best).
set -euo pipefail
bin=${1:-build}
work=${2:-$(mktemp -d)}
mkdir -p "$work"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:$PWD/$bin/lib:${LD_LIBRARY_PATH:-}
ts="$bin/turbospark"
here=$(dirname "$0")

check() {  # cpu.npy cuda.npy label
  python3 - "$@" <<'PY'
import sys, numpy as np
a, b, label = np.load(sys.argv[1]), np.load(sys.argv[2]), sys.argv[3]
assert a.shape == b.shape, (a.shape, b.shape)
assert np.isfinite(b).all(), "non-finite CUDA logits"
e = np.abs(a - b).max(1) / np.abs(a).max(1)
med, p90 = float(np.median(e)), float(np.quantile(e, 0.9))
agree = float((a.argmax(1) == b.argmax(1)).mean())
print(f"{label}: per-position rel error median {med:.3g} p90 {p90:.3g} max {e.max():.3g}, argmax agree {agree:.3f}")
assert med <= 0.02 and p90 <= 0.05, (med, p90)
PY
}

greedy() {  # model prompt_len label
  local m=$1 n=$2 label=$3
  local p g
  p=$(cut -d, -f1-"$n" "$work/ids")
  g=$("$ts" generate --model "$m" --tokens "$p" -n 12 --device cuda | tr -s ' ' ',' | sed 's/,$//')
  "$ts" logits --model "$m" --tokens "$p,${g%,*}" --out "$work/g.npy"
  python3 - "$work/g.npy" "$n" "$g" "$label" <<'PY'
import sys, numpy as np
l, n, g, label = np.load(sys.argv[1]), int(sys.argv[2]), [int(x) for x in sys.argv[3].split(",")], sys.argv[4]
assert len(g) == 12, g
gaps = []
for i, t in enumerate(g):
    row = l[n - 1 + i]
    gaps.append(float(row.max() - row[t]) / float(np.abs(row).max()))
    assert gaps[-1] <= 0.1, (i, t, int(row.argmax()), float(row[t]), float(row.max()))
same = sum(x == 0 for x in gaps)
print(f"{label}: 12 greedy ids from {n} tokens, {same} the CPU's argmax, largest gap {max(gaps):.3g}")
PY
}

python3 -c "import random; r = random.Random(11); print(','.join(str(r.randrange(32000)) for _ in range(291)))" >"$work/ids"
ids=$(cat "$work/ids")
# Reverse name order: qwen3-30b-a3b (the bench's shape) first, mixtral (the largest) last.
for shape in $(ls -r "$here"/shapes/*.json); do
  name=$(basename "$shape" .json)
  [[ -z ${SHAPES:-} || " $SHAPES " == *" $name "* ]] || continue
  m=$work/$name
  [ -f "$m/config.json" ] || "$ts" synth --config "$shape" --out "$m" --dtype bf16 --seed 7 >/dev/null
  models=("$m")
  "$ts" pack --model "$m" --out "$m.q8_0" --experts-quant q8_0 --dense-quant q8_0 >/dev/null
  models+=("$m.q8_0")
  if [[ $name == qwen3-* ]]; then
    "$ts" pack --model "$m" --out "$m.q4_k" --experts-quant q4_k --dense-quant q8_0 >/dev/null
    models+=("$m.q4_k")
  fi
  for v in "${models[@]}"; do
    label=$(basename "$v")
    "$ts" logits --model "$v" --tokens "$ids" --out "$work/cpu.npy"
    "$ts" logits --model "$v" --tokens "$ids" --out "$work/cuda.npy" --device cuda
    check "$work/cpu.npy" "$work/cuda.npy" "$label, one chunk"
    for c in 64 20 1; do
      "$ts" logits --model "$v" --tokens "$ids" --out "$work/cuda.npy" --device cuda --prefill-chunk $c
      check "$work/cpu.npy" "$work/cuda.npy" "$label, chunks of $c"
    done
    greedy "$v" 100 "$label"
    greedy "$v" 280 "$label"
  done
  rm -rf "$m" "$m".q*
done
echo "real widths: all passed"
