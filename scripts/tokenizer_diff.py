#!/usr/bin/env python3
"""Differential test of `turbospark tokenize` against the reference tokenizers library.

Writes a seeded random corpus (ASCII words and contractions, many scripts, emoji sequences,
whitespace of every kind, special-token strings, random code points of all planes, combining
marks out of canonical order, Hangul jamo, compatibility characters), encodes it with the
reference (npm `tokenizers`, the Rust library the Python package wraps, through
scripts/tokenizers_node.js) and with turbospark, and prints the lines that differ.
Not part of the test suite (it needs the npm package and takes a minute per tokenizer); the
differences it found are pinned by the last lines of tests/tokenizer/corpus.jsonl.

Usage: npm install --no-save tokenizers@0.23.2     (in the repository; node_modules is ignored)
       scripts/tokenizer_diff.py TOKENIZER_DIR [TOKENIZER_DIR ...] [--lines N] [--seed S]
       [--bin build/turbospark]
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import unicodedata

WORDS = ["the", "The", " don't", "I'm", "we'll", "they've", "it's", "'S", "'LL", "hello",
         "  ", "   ", "\n\n", "\r\n", "\t", "1234567", "3.14159", "1,000,000", "0x1F",
         "http://example.com/a?b=c", "foo_bar", "camelCase", "<|im_start|>", "<|im_end|>",
         "<|endoftext|>", "<s>", "</s>", "<unk>", "<|im_", "<|start|>", "<|message|>", "\u2581",
         "[INST]", "  def f(x):\n    return x\n", "na\u00efve caf\u00e9", "e\u0301", "\u180e",
         "\u0085", "\u200d", "\u00b2", "\u24d0"]
POOLS = ["abcdefghijklmnopqrstuvwxyz", "ABCDEFGHIJKLMNOPQRSTUVWXYZ", "0123456789",
         " \t\n\r\u00a0\u3000\u2003\u200b\u2028\u0085\x0b\x0c\x1c",
         "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~", "\u00e4\u00f6\u00fc\u00df\u00e9\u00e7\u00f1\u00f8",
         "\u4f60\u597d\u4e16\u754c\u4e2d\u6587", "\u3053\u3093\u306b\u3061\u306f\u30ab\u30bf",
         "\uc548\ub155\ud558\uc138\uc694", "\u041f\u0440\u0438\u0432\u0435\u0442",
         "\u0645\u0631\u062d\u0628\u0627", "\u05e9\u05dc\u05d5\u05dd", "\u0928\u092e\u0938\u094d\u0924\u0947",
         "\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35", "\U0001F600\U0001F44D\U0001F3FD\u200d\u2764\ufe0f\U0001F1EB\U0001F1F7",
         "\u0301\u0308\u0327\u20dd", "\ufb01\u2460\u216b\u338f\uff48"]


def corpus(seed, n):
    rng = random.Random(seed)
    marks = [c for c in range(0x300, 0x30000) if not 0xD800 <= c <= 0xDFFF
             and unicodedata.combining(chr(c))]

    def any_cp():
        c = rng.choice([rng.randint(0x80, 0x3000), rng.randint(0x3000, 0xFFFF),
                        rng.randint(0x10000, 0x3FFFF), rng.randint(0, 0x10FFFF)])
        return chr(0x41 if 0xD800 <= c <= 0xDFFF or c == 0 else c)

    out = []
    for i in range(n):
        parts = []
        for _ in range(rng.randint(1, 12)):
            r = rng.random()
            if r < 0.35:
                parts.append(rng.choice(WORDS))
            elif r < 0.65:
                p = rng.choice(POOLS)
                parts.append("".join(rng.choice(p) for _ in range(rng.randint(1, 8))))
            elif r < 0.8:
                parts.append(any_cp())
            else:
                parts.append(rng.choice("aeouAnNcs\u1100\u1161\u11a8\u0915") +
                             "".join(chr(rng.choice(marks)) for _ in range(rng.randint(1, 3))))
        out.append(rng.choice(["", " ", "\n"]).join(parts))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--lines", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--bin", default="build/turbospark")
    args = ap.parse_args()
    texts = corpus(args.seed, args.lines)
    helper = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tokenizers_node.js")
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "corpus.jsonl")
        with open(path, "w", encoding="utf-8", newline="\n") as f:
            for s in texts:
                f.write(json.dumps(s, ensure_ascii=True) + "\n")
        for d in args.dirs:
            req = json.dumps({"tokenizer": os.path.join(d, "tokenizer.json"), "encode": texts,
                              "decode": []})
            ref = json.loads(subprocess.run(["node", helper], input=req.encode(),
                                            capture_output=True, check=True).stdout)["encoded"]
            for special in (False, True):
                cmd = [args.bin, "tokenize", "--model", d, "--input", path]
                ours = subprocess.run(cmd + (["--add-special"] if special else []),
                                      capture_output=True, check=True).stdout.decode().splitlines()
                key = "ids_special" if special else "ids"
                bad = [i for i in range(len(texts)) if json.loads(ours[i]) != ref[i][key]]
                print(f"{d} add_special={special}: {len(bad)} of {len(texts)} lines differ")
                for i in bad[:5]:
                    print("  text", json.dumps(texts[i])[:200])
                    print("  ref ", ref[i][key][:40])
                    print("  ours", json.loads(ours[i])[:40])
                failed |= bool(bad)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
