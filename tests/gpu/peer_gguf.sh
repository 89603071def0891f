#!/usr/bin/env bash
# llama.cpp's own converter on the fixtures of deepseek2 / glm4moe / minimax-m2, and our loader
# on its output: run on the GPU machine (torch is there), from the repository root.
#   bash tests/gpu/peer_gguf.sh BIN_DIR LLAMA_TARBALL
# BIN_DIR holds turbospark; LLAMA_TARBALL is ../shared/peer/llama.cpp-de3ff81.tar.xz copied
# into a carried folder. Prints, per fixture, the GGUF's logits against the checkpoint
# directory's (byte-identical expected) and against transformers'.
set -u
bin=$1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:$PWD/$bin/lib:${LD_LIBRARY_PATH:-}
rt=$(mktemp -d)
xz -T0 -dc "$2" | tar -x -C "$rt"
for f in deepseek_v2 deepseek_v2_yarn deepseek_v3 glm4_moe minimax_m2; do
  m=tests/models/$f
  if ! python3 tests/gpu/convert_novocab.py "$rt" "$m" "$rt/$f.gguf" f32 >"$rt/$f.log" 2>&1; then
    echo "$f: convert failed"
    tail -4 "$rt/$f.log"
    continue
  fi
  ids=$(python3 -c "import json; print(','.join(map(str, json.load(open('$m/ref.json'))['prompt_ids'])))")
  "$bin/turbospark" logits --model "$rt/$f.gguf" --tokens "$ids" --out "$rt/$f.g.npy" || continue
  "$bin/turbospark" logits --model "$m" --tokens "$ids" --out "$rt/$f.d.npy" 2>/dev/null
  python3 - "$rt/$f.g.npy" "$rt/$f.d.npy" "$m/logits.npy" "$f" <<'PY'
import sys, numpy as np
g, d, r = (np.load(p) for p in sys.argv[1:4])
rel = lambda a, b: float(np.abs(a - b).max() / np.abs(b).max())
print(f"{sys.argv[4]}: llama.cpp-converted GGUF vs checkpoint {rel(g, d):.3g} "
      f"(byte-identical: {np.array_equal(g, d)}), vs transformers {rel(g, r):.3g}")
PY
done
