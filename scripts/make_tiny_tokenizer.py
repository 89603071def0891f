#!/usr/bin/env python3
"""Writes a tiny byte-level BPE tokenizer (Qwen-style pre-tokenizer, ChatML chat template) for
the fixture models, whose vocabulary is only 512: ids 0-255 are the bytes, a few merges
follow, and three special tokens. It lets `run` and `chat` be tested end to end on a model
that ships in the repo. Usage: scripts/make_tiny_tokenizer.py DIR"""
import json, sys

def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b); cs.append(256 + n); n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}

b2u = bytes_to_unicode()
vocab = {b2u[b]: b for b in range(256)}
merges = []
def merge(a, b):
    merges.append([a, b]); vocab[a + b] = len(vocab)
for a, b in [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"),
             ("Ġ", "s"), ("r", "e"), ("Ġ", "w"), ("a", "t"), ("e", "n"), ("Ġ", "o"), ("l", "l"),
             ("Ġ", "c"), ("i", "s"), ("o", "u"), ("Ġ", "i"), ("Ġw", "h"), ("a", "n")]:
    merge(a, b)
specials = {"<|endoftext|>": 400, "<|im_start|>": 401, "<|im_end|>": 402}
pattern = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
tok = {
    "version": "1.0",
    "truncation": None, "padding": None,
    "added_tokens": [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
                      "normalized": False, "special": True} for c, i in specials.items()],
    "normalizer": {"type": "NFC"},
    "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]},
    "post_processor": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
    "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
    "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
              "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
              "vocab": vocab, "merges": merges},
}
template = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
cfg = {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
       "pad_token": "<|endoftext|>", "chat_template": template,
       "added_tokens_decoder": {str(i): {"content": c, "special": True} for c, i in specials.items()}}
out = sys.argv[1]
json.dump(tok, open(out + "/tokenizer.json", "w"), ensure_ascii=False, indent=1)
json.dump(cfg, open(out + "/tokenizer_config.json", "w"), ensure_ascii=False, indent=1)
