#!/usr/bin/env bash
# GPU expert cache fed from disk (issue 5, docs/PERF.md "GPU expert cache"): a 12-layer model
# of qwen3-30b-a3b's layer shape (bench/cuda-disk-12l.json: 128 experts top-8, d_expert 768;
# 7.7 GB of Q8_0 experts) written with `synth`, packed with Q8_0 experts (4096-aligned blobs,
# so O_DIRECT works), then: the disk's O_DIRECT read rate (dd), and `bench --device cuda` with
# the experts streamed from the pack (--residency streamed --direct-io) into GPU caches of 13
# and 64 slots, against host (pinned) and resident, every token's experts drawn uniformly
# (--routing uniform).
#
# usage: bench/cuda_disk.sh BIN WORK_DIR OUT_DIR
set -uo pipefail
bin=$1
work=$2
out=$3
cfg=$(dirname "$0")/cuda-disk-12l.json
mkdir -p "$work" "$out"
if [ ! -f "$work/pack/manifest.json" ]; then
  /usr/bin/time -f "synth %e s" "$bin" synth --config "$cfg" --out "$work/hf" --dtype bf16
  /usr/bin/time -f "pack %e s" "$bin" pack --model "$work/hf" --out "$work/pack" --experts-quant q8_0
  rm -rf "$work/hf"
fi
du -sh "$work/pack"
big=$work/pack/experts-L000.bin
sync
echo 3 >/proc/sys/vm/drop_caches 2>/dev/null || echo "(drop_caches not permitted)"
echo "disk: O_DIRECT read of $big"
dd if="$big" of=/dev/null bs=4M iflag=direct 2>&1 | tail -1
run() {  # name, flags...
  local name=$1
  shift
  echo "== $name: $*"
  "$bin" bench --device cuda --model "$work/pack" --contexts 128 --prompts 512 \
    --gen-tokens "${GEN:-16}" --routing uniform "$@" >"$out/$name.txt" 2>&1
  echo "rc=$?"
  grep -E "decode|prefill|expert cache|GPU cache|error" "$out/$name.txt"
}
run disk-resident
run disk-host-13 --residency host --expert-cache-slots 13
run disk-streamed-13 --residency streamed --direct-io --expert-cache-slots 13 --io-threads 8
run disk-streamed-64 --residency streamed --direct-io --expert-cache-slots 64 --io-threads 8
# Buffered reads after the runs above: the pack is in the page cache, so this is the
# pread + H2D path at memory speed (the store's slots are pinned by the CUDA session).
run disk-streamed-13-pagecache --residency streamed --expert-cache-slots 13 --io-threads 8
