#!/usr/bin/env python3
"""Loads GGUF files with transformers' own GGUF reader (which needs the `gguf` package) and
compares its logits with the fixture's reference logits (transformers on the Hugging Face
checkpoint). An independent check that the files the tests write (tests/unit/gguf_convert.h)
follow llama.cpp's layout as transformers reads it: names, dim order, stacked experts, the
llama q/k permutation.

usage: python3 tests/gpu/gguf_transformers.py GGUF_DIR   (files NAME.gguf, NAME = a fixture)
Prints one line per file: the max relative error, or why transformers could not load it.
"""
import json
import os
import sys

import numpy as np
import torch
from transformers import AutoModelForCausalLM

try:
    import gguf  # noqa: F401  (transformers' GGUF reader needs it)
except ImportError:
    sys.exit("gguf_transformers: the gguf package is not installed here (pip install gguf); "
             "transformers cannot read GGUF files without it")

gguf_dir = sys.argv[1]
worst = 0.0
compared = 0
for f in sorted(os.listdir(gguf_dir)):
    if not f.endswith(".gguf") or f.endswith(".q8_0.gguf"):
        continue
    name = f[: -len(".gguf")]
    fixture = os.path.join("tests", "models", name)
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=f, torch_dtype=torch.float32)
    except Exception as e:  # an architecture transformers' GGUF reader does not take
        print(f"{name}: transformers did not load it: {type(e).__name__}: {str(e)[:160]}")
        continue
    ids = json.load(open(os.path.join(fixture, "ref.json")))["prompt_ids"]
    with torch.no_grad():
        got = model(torch.tensor([ids])).logits[0].float().numpy()
    want = np.load(os.path.join(fixture, "logits.npy"))
    rel = float(np.abs(got - want).max() / np.abs(want).max())
    worst = max(worst, rel)
    compared += 1
    print(f"{name}: transformers from the GGUF vs from the checkpoint: max rel {rel:.3g}")
if compared == 0:
    sys.exit("gguf_transformers: transformers loaded none of the files")
print(f"worst {worst:.3g} over {compared} files")
