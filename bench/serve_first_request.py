#!/usr/bin/env python3
"""What the first request to `turbospark serve` costs, with and without the warm-up.

Starts `serve` (with the given extra flags) ROUNDS times with the warm-up and ROUNDS times
with --no-warmup, alternating; each time it measures the seconds until the listening line,
then three chat requests of different prompts (so none reuses the previous one's KV rows),
each to its end (max_tokens greedy tokens). Prints one line per start and the medians.

  python3 bench/serve_first_request.py BIN MODEL_DIR [--rounds 3] [--max-tokens 16] -- [serve flags]
"""
import argparse
import json
import re
import statistics
import subprocess
import sys
import time
import urllib.request

PROMPTS = ["write a poem", "name three moons of Jupiter", "what is a mixture of experts"]


def start(binary, model, extra):
    t0 = time.perf_counter()
    proc = subprocess.Popen([binary, "serve", "--model", model, "--port", "0", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    log = ""
    while True:
        line = proc.stderr.readline()
        if not line:
            raise SystemExit(f"serve exited ({proc.wait()}): {log}")
        log += line
        m = re.search(r"http://127\.0\.0\.1:(\d+)", line)
        if m:
            return proc, int(m.group(1)), time.perf_counter() - t0, line.strip()


def chat(port, model_id, prompt, max_tokens):
    body = json.dumps({"model": model_id, "max_tokens": max_tokens, "temperature": 0,
                       "messages": [{"role": "user", "content": prompt}]}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                 {"content-type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        reply = json.load(r)
    return time.perf_counter() - t0, reply["choices"][0]["message"]["content"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binary")
    ap.add_argument("model")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    a = ap.parse_args(argv[:cut])
    a.serve_flags = argv[cut + 1:]
    model_id = a.model.rstrip("/").split("/")[-1]
    rows = {"warm": [], "cold": []}
    replies = {}
    for _ in range(a.rounds):
        for mode in ("warm", "cold"):
            extra = a.serve_flags + ([] if mode == "warm" else ["--no-warmup"])
            proc, port, ready_s, line = start(a.binary, a.model, extra)
            try:
                times = []
                for p in PROMPTS:
                    s, text = chat(port, model_id, p, a.max_tokens)
                    times.append(s)
                    replies.setdefault(p, set()).add(text)
            finally:
                proc.terminate()
                proc.wait()
            rows[mode].append([ready_s, *times])
            print(f"{mode}: ready {ready_s:.3f} s, requests " +
                  " ".join(f"{t * 1e3:.1f}" for t in times) + f" ms  [{line}]", flush=True)
    for mode, r in rows.items():
        med = [statistics.median(c) for c in zip(*r)]
        print(f"median {mode}: ready {med[0]:.3f} s, first request {med[1] * 1e3:.1f} ms, "
              f"second {med[2] * 1e3:.1f} ms, third {med[3] * 1e3:.1f} ms")
    same = all(len(v) == 1 for v in replies.values())
    print("replies identical across starts and modes:", same)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
