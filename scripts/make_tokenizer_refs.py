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
Needs the `tokenizers` Python package (0.23.2 was used for the committed files) or, without it,
node with the npm package of the same library and version (scripts/tokenizers_node.js: `npm
install --no-save tokenizers@0.23.2` in the repository); both write the same files.
"""
import gzip
import json
import os
import random
import shutil
import sys
import tempfile

import subprocess

try:
    import tokenizers
    from tokenizers import Tokenizer
except ImportError:  # the same library through node (scripts/tokenizers_node.js)
    tokenizers = None

NAMES = ["qwen3", "deepseek_v3", "gptoss", "llama2"]
PROBES = 200


def probes(n, seed):
    """Random id sequences over a vocabulary of n; half of the ids come from the first 300
    (single bytes in the byte-level vocabularies, <0xXX> tokens in Llama-2's)."""
    rng = random.Random(seed)
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


class NodeTokenizer:
    """The calls main() makes, answered by one run of scripts/tokenizers_node.js per batch."""

    def __init__(self, path):
        self.path = path
        self.version = self._run([], [])["version"]
        self.vocab_size = None

    def _run(self, texts, id_lists):
        helper = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tokenizers_node.js")
        req = json.dumps({"tokenizer": self.path, "encode": texts, "decode": id_lists})
        res = subprocess.run(["node", helper], input=req.encode(), capture_output=True, check=True)
        out = json.loads(res.stdout)
        self.vocab_size = out["vocab_size"]
        return out

    def encode_all(self, texts):
        return self._run(texts, [])["encoded"]

    def decode_all(self, id_lists):
        return self._run([], id_lists)["decoded"]


def load(data_dir, name):
    path = os.path.join(data_dir, name, "tokenizer.json")
    if not os.path.exists(path):
        tmp = tempfile.NamedTemporaryFile(suffix=".json", delete=False)
        with gzip.open(path + ".gz", "rb") as src, tmp as dst:
            shutil.copyfileobj(src, dst)
        path = tmp.name
    if tokenizers is None:
        return NodeTokenizer(path)
    return Tokenizer.from_file(path)


def encode_rows(tok, corpus):
    if isinstance(tok, NodeTokenizer):
        return tok.encode_all(corpus)
    return [{"ids": tok.encode(s, add_special_tokens=False).ids,
             "ids_special": tok.encode(s, add_special_tokens=True).ids} for s in corpus]


def decode_rows(tok, id_lists):
    if isinstance(tok, NodeTokenizer):
        return tok.decode_all(id_lists)
    return [{"decoded": tok.decode(ids, skip_special_tokens=False),
             "decoded_skip": tok.decode(ids, skip_special_tokens=True)} for ids in id_lists]


def vocab_size(tok):
    if isinstance(tok, NodeTokenizer):
        return tok.vocab_size
    return tok.get_vocab_size(with_added_tokens=True)


def main():
    data_dir, corpus_path, out_dir = sys.argv[1:4]
    corpus = read_corpus(corpus_path)
    os.makedirs(out_dir, exist_ok=True)
    for name in NAMES:
        tok = load(data_dir, name)
        out_path = os.path.join(out_dir, f"expected_{name}.jsonl")
        encoded = encode_rows(tok, corpus)
        n = vocab_size(tok)
        probe_ids = probes(n, seed=len(name))
        decoded = decode_rows(tok, [row["ids_special"] for row in encoded] + probe_ids)
        version = tok.version if isinstance(tok, NodeTokenizer) else tokenizers.__version__
        with open(out_path, "w", encoding="utf-8", newline="\n") as f:
            header = {"tokenizers": version, "corpus_lines": len(corpus), "probes": PROBES,
                      "vocab_size": n}
            f.write(json.dumps(header) + "\n")
            for enc, dec in zip(encoded, decoded):
                row = {"ids": enc["ids"], "ids_special": enc["ids_special"],
                       "decoded": dec["decoded"], "decoded_skip": dec["decoded_skip"]}
                # ensure_ascii keeps U+2028 and friends escaped, so "\n" alone ends a line.
                f.write(json.dumps(row, ensure_ascii=True, separators=(",", ":")) + "\n")
            for ids, dec in zip(probe_ids, decoded[len(encoded):]):
                row = {"probe": ids, "decoded": dec["decoded"], "decoded_skip": dec["decoded_skip"]}
                f.write(json.dumps(row, ensure_ascii=True, separators=(",", ":")) + "\n")
        print(f"{name}: {len(corpus)} lines -> {out_path} ({os.path.getsize(out_path)} bytes)")

if __name__ == "__main__":
    main()
