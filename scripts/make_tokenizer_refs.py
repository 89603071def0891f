#!/usr/bin/env python3
"""Writes the tokenizer tests' expected outputs with the reference implementation.

For each tokenizer NAME in the data folder (DATA/NAME/tokenizer.json, as unpacked by
scripts/fetch_tokenizer_data.sh; a tokenizer.json.gz is read too) and each line of
tests/tokenizer/corpus.jsonl (one JSON string per line), writes one JSON object per line to
OUT/expected_NAME.jsonl:
  {"ids": encode(s, add_special_tokens=False), "ids_special": encode(s, True),
   "decoded": decode(ids_special, skip_special_tokens=False),
   "decoded_skip": decode(ids_special, skip_special_tokens=True)}
Line k of the expected file belongs to line k of the corpus (the text is not repeated, to keep
the files small). The first line is a header: {"tokenizers": VERSION, "corpus_lines": N,
"probes": M, "vocab_size": V}. After the corpus rows come M decode probes, seeded random id
sequences that stress the decoders on partial UTF-8 and byte tokens:
  {"probe": [ids], "decoded": decode(ids, False), "decoded_skip": decode(ids, True)}

Usage: make_tokenizer_refs.py DATA_DIR CORPUS OUT_DIR
Needs the `tokenizers` Python package (0.23 was used for the committed files).
"""
import gzip
import json
import os
import random
import shutil
import sys
import tempfile

import tokenizers
from tokenizers import Tokenizer

NAMES = ["qwen3", "deepseek_v3", "gptoss", "llama2"]
PROBES = 200


def probes(tok, seed):
    """Random id sequences; half of the ids come from the first 300 (single bytes in the
    byte-level vocabularies, <0xXX> tokens in Llama-2's)."""
    rng = random.Random(seed)
    n = tok.get_vocab_size(with_added_tokens=True)
    out = []
    for _ in range(PROBES):
        out.append([rng.randrange(300) if rng.random() < 0.5 else rng.randrange(n)
                    for _ in range(rng.randint(1, 6))])
    return out


def read_corpus(path):
    # Split on "\n" only: str.splitlines() would also split on U+2028, U+0085 etc.
    with open(path, encoding="utf-8", newline="") as f:
        text = f.read()
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [json.loads(line) for line in lines]


def load(data_dir, name):
    path = os.path.join(data_dir, name, "tokenizer.json")
    if os.path.exists(path):
        return Tokenizer.from_file(path)
    with gzip.open(path + ".gz", "rb") as src, tempfile.NamedTemporaryFile(suffix=".json") as dst:
        shutil.copyfileobj(src, dst)
        dst.flush()
        return Tokenizer.from_file(dst.name)


def main():
    data_dir, corpus_path, out_dir = sys.argv[1:4]
    corpus = read_corpus(corpus_path)
    os.makedirs(out_dir, exist_ok=True)
    for name in NAMES:
        tok = load(data_dir, name)
        out_path = os.path.join(out_dir, f"expected_{name}.jsonl")
        with open(out_path, "w", encoding="utf-8", newline="\n") as f:
            header = {"tokenizers": tokenizers.__version__, "corpus_lines": len(corpus),
                      "probes": PROBES, "vocab_size": tok.get_vocab_size(with_added_tokens=True)}
            f.write(json.dumps(header) + "\n")
            for s in corpus:
                ids = tok.encode(s, add_special_tokens=False).ids
                ids_special = tok.encode(s, add_special_tokens=True).ids
                row = {
                    "ids": ids,
                    "ids_special": ids_special,
                    "decoded": tok.decode(ids_special, skip_special_tokens=False),
                    "decoded_skip": tok.decode(ids_special, skip_special_tokens=True),
                }
                # ensure_ascii keeps U+2028 and friends escaped, so "\n" alone ends a line.
                f.write(json.dumps(row, ensure_ascii=True, separators=(",", ":")) + "\n")
            for ids in probes(tok, seed=len(name)):
                row = {
                    "probe": ids,
                    "decoded": tok.decode(ids, skip_special_tokens=False),
                    "decoded_skip": tok.decode(ids, skip_special_tokens=True),
                }
                f.write(json.dumps(row, ensure_ascii=True, separators=(",", ":")) + "\n")
        print(f"{name}: {len(corpus)} lines -> {out_path} ({os.path.getsize(out_path)} bytes)")


if __name__ == "__main__":
    main()
