#!/usr/bin/env bash
# Storage-bound residency benchmark (issue 3 item 6, docs/PERF.md "Storage-bound streaming"):
# a 24-layer qwen3_moe model with 128 experts top-8 (d_model 2048, d_expert 768, vocab 32000,
# bench/cpu-storage-24l.json), experts packed as Q4_K (8.15 GB of experts, 2.65 MB per
# expert blob). Measures the disk's read rate, then decode tok/s, expert hit rate and storage
# bytes per decoded token for resident, mapped and streamed (13 / 32 / 64 slots per layer =
# 10 / 25 / 50% cache, with and without O_DIRECT, plus --io-threads 1 and 8 at 10%), in two
# tables: A = sampled decode (generate --temperature 1: diverse tokens), B = bench (greedy).
#
# usage: bench/cpu_storage.sh [WORK_DIR]        (default /tmp/ts-bench)
# env:   TS_BIN      turbospark binary (default WORK_DIR/build/turbospark)
#        THREADS=2   compute threads     GEN=64  decoded tokens per timed run
#        RUN_TIMEOUT=900 seconds per bench run   KEEP_HF=1 keeps the BF16 checkpoint
#        REPS=1      times the run tables are repeated
#        SKIP_DISK=1 / SKIP_RUNS=1 / SKIP_SAMPLED=1 / SKIP_GREEDY=1 skip a part
#
# Every bench run here uses a 1-token prompt, so every step reads at most top_k = 8 experts
# per layer. `bench` counts its warm-up pass (prompt + 8 tokens) and the timed prefill in its
# stats, so each configuration runs twice, with --gen-tokens 8 and --gen-tokens GEN: the
# difference of the two runs' counters is exactly decoded tokens 9..GEN (the runs are
# deterministic), which gives decode-only hit rate and bytes per token. tok/s is the GEN
# run's own timed decode; phase times are that run's averages over all its tokens (warm-up
# included). Both runs start after drop_caches.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
work=${1:-/tmp/ts-bench}
bin=${TS_BIN:-$work/build/turbospark}
threads=${THREADS:-2}
gen=${GEN:-64}
reps=${REPS:-1}
tmo=${RUN_TIMEOUT:-900}
hf=$work/hf24
pack=$work/pack24
mkdir -p "$work"

drop_caches() { sync; echo 3 >/proc/sys/vm/drop_caches 2>/dev/null || echo "(drop_caches not permitted)" >&2; }

# ---- 1. model -------------------------------------------------------------------------------
if [ ! -f "$pack/manifest.json" ]; then
  if [ ! -f "$hf/model.safetensors.index.json" ]; then
    /usr/bin/time -f "synth: %e s" "$bin" synth --config "$here/cpu-storage-24l.json" --out "$hf" --seed 1
  fi
  /usr/bin/time -f "pack: %e s" "$bin" pack --model "$hf" --out "$pack" --experts-quant q4_k
  [ "${KEEP_HF:-0}" = 1 ] || rm -rf "$hf"
fi
"$bin" inspect --model "$pack"
echo "machine: $(nproc) cores, $(awk '/MemTotal/{printf "%.1f GB", $2/1e6}' /proc/meminfo) RAM;" \
  "commit $(git -C "$here/.." rev-parse --short HEAD 2>/dev/null || echo '?'); load: $(cut -d' ' -f1-3 /proc/loadavg)"

# ---- 2. disk read rate ----------------------------------------------------------------------
# GB/s of one dd (bytes / seconds from dd's own summary line).
dd_rate() { dd "$@" of=/dev/null 2>&1 | awk '/copied/{printf "%.2f", $1 / $(NF-3) / 1e9}'; }
if [ "${SKIP_DISK:-0}" != 1 ]; then
  echo "== disk (expert files: 24 x 340 MB) =="
  # Sequential, one reader, O_DIRECT, 4 MiB requests, over all 24 expert files (8.15 GB).
  # Run twice: the VM's host caches what it has served (and what was written), so the
  # second pass shows the re-read rate the benchmark runs below see.
  for pass in 1 2; do
    t0=$(date +%s.%N)
    for f in "$pack"/experts-L*.bin; do dd if="$f" of=/dev/null bs=4M iflag=direct 2>/dev/null; done
    t1=$(date +%s.%N)
    bytes=$(du -cb "$pack"/experts-L*.bin | tail -1 | cut -f1)
    echo "dd O_DIRECT bs=4M, all expert files, pass $pass: $(python3 -c "print('%.2f' % ($bytes / ($t1 - $t0) / 1e9))") GB/s"
  done
  echo "dd O_DIRECT bs=4M, experts-L012.bin: $(dd_rate if="$pack/experts-L012.bin" bs=4M iflag=direct) GB/s"
  # Four parallel O_DIRECT readers on four files.
  t0=$(date +%s.%N)
  for l in 004 008 016 020; do dd if="$pack/experts-L$l.bin" of=/dev/null bs=4M iflag=direct 2>/dev/null & done
  wait
  t1=$(date +%s.%N)
  echo "dd O_DIRECT bs=4M, 4 readers in parallel: $(python3 -c "print('%.2f' % (4 * $(stat -c %s "$pack/experts-L004.bin") / ($t1 - $t0) / 1e9))") GB/s"
  drop_caches
  echo "dd buffered bs=4M after drop_caches, experts-L013.bin: $(dd_rate if="$pack/experts-L013.bin" bs=4M) GB/s"
  # The engine's pattern: random whole expert blobs (2.65 MB, 4096-aligned) by N threads.
  for direct in 1 0; do
    for n in 1 4 8; do
      drop_caches
      python3 - "$pack" "$n" "$direct" <<'EOF'
import json, mmap, os, random, sys, threading, time
pack, n, direct = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
m = json.load(open(os.path.join(pack, "manifest.json")))
layers = m["expert_layers"]
fds = [os.open(os.path.join(pack, L["file"]), os.O_RDONLY | (os.O_DIRECT if direct else 0)) for L in layers]
stride = layers[0]["stride"]
n_exp = len(layers[0]["offsets"])
# Every blob at most once, in a random order, so buffered reads after drop_caches come from
# the disk and not from the page cache.
todo = [(fd, e * stride) for fd in fds for e in range(n_exp)]
random.Random(1).shuffle(todo)
total, lock, stop = [0], threading.Lock(), time.time() + 6.0
def worker(seed):
    buf = mmap.mmap(-1, stride)  # page-aligned, as O_DIRECT needs
    got = 0
    while time.time() < stop:
        with lock:
            if not todo: break
            fd, off = todo.pop()
        done = 0
        while done < stride:
            done += os.preadv(fd, [memoryview(buf)[done:]], off + done)
        got += stride
    with lock:
        total[0] += got
t0 = time.time()
ts = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
for t in ts: t.start()
for t in ts: t.join()
dt = time.time() - t0
print("random %.2f MB expert blobs, %s, %d reader(s): %.2f GB/s (%.1f GB in %.1f s)" % (
    stride / 1e6, "O_DIRECT" if direct else "buffered after drop_caches", n, total[0] / dt / 1e9, total[0] / 1e9, dt))
EOF
    done
  done
fi

# ---- 3. runs --------------------------------------------------------------------------------
[ "${SKIP_RUNS:-0}" = 1 ] && exit 0
bench_json() {  # bench_json OUT.json GEN_TOKENS FLAGS...
  local out=$1 n=$2
  shift 2
  timeout "$tmo" "$bin" bench --model "$pack" \
    --threads "$threads" --prompt-tokens 1 --gen-tokens "$n" --json "$@" >"$out"
}
row() {  # row LABEL FLAGS...: the GEN run and the 8-token baseline, each after drop_caches
  local label=$1
  shift
  local tag
  tag=$(echo "$rep $*" | tr ' -' '_.')
  drop_caches
  bench_json "$work/run$tag.json" "$gen" "$@"
  drop_caches
  bench_json "$work/base$tag.json" 8 "$@"
  python3 - "$label" "$work/run$tag.json" "$work/base$tag.json" <<'EOF'
import json, sys
label, run, base = sys.argv[1], json.load(open(sys.argv[2])), json.load(open(sys.argv[3]))
s, b = run["stats"], base["stats"]
n = run["gen_tokens"] - base["gen_tokens"]  # decoded tokens 9..GEN
d = lambda k: s[k] - b[k]
req, hits, by = d("expert_requests"), d("expert_hits"), d("storage_bytes_read")
tps = run["decode_tokens_per_s"]
bpt = by / n
# Phase times are wall times, too noisy to difference: the GEN run's totals over every token
# it processed (warm-up prompt + 8, timed prompt + GEN), per token.
t = 2 * run["prompt_tokens"] + min(8, run["gen_tokens"]) + run["gen_tokens"]
ms = lambda k: s[k] / t
phases = ("attention_ms", "router_ms", "expert_io_ms", "expert_compute_ms", "lm_head_ms")
print("%-36s decode %6.2f tok/s | hit %5.1f%% | storage %6.1f MB/tok | achieved %5.2f GB/s"
      " | ms/token: expert I/O %6.1f, expert compute %5.1f, attention %5.1f, lm head %4.1f, sum %5.1f (1/tok/s %5.1f)"
      " | bench's own figures: hit %5.1f%%, %6.1f MB/tok | load %s" % (
    label, tps, 100.0 * hits / req if req else 100.0, bpt / 1e6, bpt * tps / 1e9,
    ms("expert_io_ms"), ms("expert_compute_ms"), ms("attention_ms"), ms("lm_head_ms"),
    sum(ms(k) for k in phases), 1000.0 / tps,
    100 * s["expert_hit_rate"], s["storage_bytes_per_token"] / 1e6,
    open("/proc/loadavg").read().split()[0]))
EOF
}
# Sampled decode: `generate --temperature 1 --seed 1` from a 1-token prompt, N1 = 16 and
# N2 = 16 + GEN tokens, each after drop_caches; hit rate, bytes and phase times from the
# difference of the two runs' --stats, and decode ms/token = the difference of the summed
# phase times / GEN (generate prints no timing; wall clock would include the model load,
# which varies by seconds after drop_caches). Sampled tokens of a random model are near-uniform, so routing is
# too: this is the storage-bound case. (bench's greedy decode of a random model repeats
# tokens, so its routing is concentrated: table B.)
gen_row() {  # gen_row LABEL FLAGS...
  local label=$1
  shift
  local tag n1=16 n2=$((16 + gen))
  tag=$(echo "$rep $*" | tr ' -' '_.')
  for n in $n1 $n2; do
    drop_caches
    local t0 t1
    t0=$(date +%s.%N)
    timeout "$tmo" "$bin" generate --model "$pack" --threads "$threads" --tokens 13 -n "$n" \
      --temperature 1 --seed 1 --stats "$@" >"$work/gen$n$tag.out" 2>"$work/gen$n$tag.err"
    t1=$(date +%s.%N)
    echo "$t0 $t1" >"$work/gen$n$tag.time"
  done
  python3 - "$label" "$work/gen$n1$tag" "$work/gen$n2$tag" "$n1" "$n2" <<'EOF'
import re, sys
label, a, b, n1, n2 = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
def load(p):
    t0, t1 = map(float, open(p + ".time").read().split())
    e = open(p + ".err").read()
    num = lambda pat: float(re.search(pat, e).group(1))
    return {"wall": t1 - t0, "req": num(r"expert requests (\d+)"), "hits": num(r"hits (\d+)"),
            "mb": num(r"storage read ([\d.]+) MB"), "io": num(r"expert I/O ([\d.]+) ms"),
            "comp": num(r"expert compute ([\d.]+) ms"), "att": num(r"attention ([\d.]+) ms"),
            "lm": num(r"lm head ([\d.]+) ms"), "router": num(r"router ([\d.]+) ms"),
            "ffn": num(r"dense FFN ([\d.]+) ms")}
A, B = load(a), load(b)
n = n2 - n1
d = {k: B[k] - A[k] for k in A}
tps = 1000.0 * n / sum(d[k] for k in ("io", "comp", "att", "lm", "router", "ffn"))
mbt = d["mb"] / n
print("%-36s decode %6.2f tok/s | hit %5.1f%% | storage %6.1f MB/tok | achieved %5.2f GB/s"
      " | ms/token: expert I/O %6.1f, expert compute %5.1f, attention %5.1f, lm head %4.1f, router %4.1f"
      " | wall-clock estimate %5.2f tok/s | load %s" % (
    label, tps, 100 * d["hits"] / d["req"] if d["req"] else 100.0, mbt, mbt * tps / 1e3,
    d["io"] / n, d["comp"] / n, d["att"] / n, d["lm"] / n, d["router"] / n, n / d["wall"],
    open("/proc/loadavg").read().split()[0]))
EOF
}
rows() {  # rows FUNCTION
  "$1" "resident" --residency resident
  "$1" "mapped (after drop_caches)" --residency mapped
  for slots in 13 32 64; do
    "$1" "streamed $slots slots" --residency streamed --expert-cache-slots "$slots"
    "$1" "streamed $slots slots O_DIRECT" --residency streamed --expert-cache-slots "$slots" --direct-io
  done
  for io in 1 8; do
    "$1" "streamed 13 O_DIRECT io-threads $io" --residency streamed --expert-cache-slots 13 --direct-io --io-threads "$io"
  done
}
for rep in $(seq "$reps"); do
  echo "== A. sampled decode (generate --temperature 1), $threads threads, $gen tokens, pass $rep (load: $(cut -d' ' -f1-3 /proc/loadavg)) =="
  [ "${SKIP_SAMPLED:-0}" = 1 ] || rows gen_row
  [ "${SKIP_GREEDY:-0}" = 1 ] && continue
  echo "== B. bench (greedy decode), $threads threads, 1-token prompt, $gen tokens, pass $rep (load: $(cut -d' ' -f1-3 /proc/loadavg)) =="
  rows row
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
