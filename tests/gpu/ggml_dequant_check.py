#!/usr/bin/env python3
"""Compares turbospark's ggml block dequantization (src/model/ggml_dequant.cpp) with gguf-py's
numpy reference (gguf.quants.dequantize) on the random blocks the unit binary writes:
  TS_GGUF_OUT=DIR ts_unit_tests --gtest_also_run_disabled_tests --gtest_filter='*WriteRandomBlocks'
  python3 tests/gpu/ggml_dequant_check.py DIR
Needs the `gguf` package (pip install gguf). Prints one line per type; exits 1 on a mismatch.
"""
import os
import sys

import numpy as np
from gguf import GGMLQuantizationType, quants

d = sys.argv[1]
bad = 0
for f in sorted(os.listdir(d)):
    if not f.startswith("blocks_"):
        continue
    tid = int(f[len("blocks_"):-len(".bin")])
    qt = GGMLQuantizationType(tid)
    blocks = np.fromfile(os.path.join(d, f), dtype=np.uint8)
    ours = np.fromfile(os.path.join(d, f"dequant_{tid}.f32"), dtype=np.float32)
    ref = quants.dequantize(blocks, qt).reshape(-1).astype(np.float32)
    diff = np.abs(ref - ours)
    # gguf-py multiplies step by step in float32 where C may fuse: allow one rounding.
    tol = 1e-6 * np.maximum(np.abs(ref), 1.0)
    n = int((diff > tol).sum())
    bad += n
    print(f"{qt.name}: {ours.size} weights, {n} differ, max |diff| {diff.max():.3g}")
sys.exit(1 if bad else 0)
