// turbospark command-line entry point: dispatches to a subcommand. Any error is one line on
// stderr naming what was wrong, and exit code 2.
#include <cstdio>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "cli/commands/commands.h"

namespace {

// clang-format off
constexpr const char* kUsage =
    "usage: turbospark <command> [flags]\n"
    "commands:\n"
    "  run      --model DIR --prompt TEXT | --messages FILE.json [--tools FILE.json]\n"
    "           [-n N --temperature T --top-k K --top-p P --seed S --stop STR ... --stats]\n"
    "           [--logit-bias ID=BIAS ...]  BIAS -100..100 added to the token's logit\n"
    "  chat     --model DIR [--system TEXT] [sampling flags]  interactive; /reset, Ctrl-D\n"
    "  serve    --model DIR [--host 127.0.0.1 --port 8080 --api-key K --max-queue N --n-ctx N\n"
    "           --parallel N --kv-tokens T --max-body-bytes B --model-name ID --stats\n"
    "           --no-warmup]  OpenAI / Anthropic HTTP API\n"
    "  logits   --model DIR --tokens 1,2,3 --out FILE.npy   logits at every prompt position\n"
    "  generate --model DIR --tokens 1,2,3 -n N [--temperature T --top-k K --top-p P --seed S\n"
    "           --logit-bias ID=BIAS ...]\n"
    "  inspect  --model DIR [--json]                         shapes, parameters, bytes\n"
    "  synth    --config CONFIG.json --out DIR [--dtype bf16] [--seed N]\n"
    "  bench    --model DIR [--prompt-tokens N --gen-tokens M --roofline-gbps G --no-warmup] [--json]\n"
    "  chat-template --model DIR --messages FILE.json [--tools F.json --kwargs F.json --add-generation-prompt]\n"
    "  tokenize --model DIR --input FILE.jsonl [--add-special]  JSON string per line -> ids\n"
    "  pack     --model HF_DIR|FILE.gguf --out PACK_DIR [--experts-quant q8_0|q4_k] [--dense-quant q8_0|q4_k]\n"
    "  verify   PACK_DIR                                     check files against manifest\n"
    "  analyze-router HIST_OR_TRACE [--slots N,..] [--json]  routing entropy, cache hit rates\n"
    "  pull     ORG/NAME[@REV] [--include GLOB ...] [--parallel N]  from the Hugging Face Hub\n"
    "           into its cache (HF_HUB_CACHE; HF_TOKEN, HF_ENDPOINT); then --model ORG/NAME\n"
    "  bench --device cuda [--model DIR | --synthetic CONFIG.json --dtype bf16|q8_0] [--quant q8_0]\n"
    "           [--contexts 128,4096 --prompts 512,4096 --gen-tokens N --no-warmup --profile --json]\n"
    "DIR: a Hugging Face model directory, a pack, or a GGUF file (llama.cpp's; split: its first file),\n"
    "     or ORG/NAME[@REV] from the Hugging Face cache (see pull)\n"
    "common flags: --threads N  --device cpu|cuda[:N]  --quant q8_0 (cuda: quantize at load)\n"
    "  --prefill-chunk N   tokens per prefill chunk (default: cpu 256; cuda 4096, 2048 if tight)\n"
    "  --residency resident|mapped|streamed   where routed experts live (default mapped)\n"
    "  --expert-cache-slots N | --expert-cache-mb M   streamed cache size (slots per layer)\n"
    "  --cache-policy lru|lfu  --direct-io  --io-threads N   streamed cache and readers\n"
    "  --stats (or TURBOSPARK_PHASES=1)  --router-hist FILE.json  --router-trace FILE.jsonl\n"
    "  --capture-residual LAYERS --capture-out FILE.npy|.safetensors [--capture-last]\n"
    "  --steer FILE.npy@LAYERS[:SCALE[:add|ablate|clamp|renorm]]  (repeatable)\n";
// clang-format on

struct Command {
  const char* name;
  ts::Status (*fn)(const ts::cli::Args&);
  std::set<std::string> switches;
};

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    std::fputs(kUsage, argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  const Command commands[] = {
      {"logits", ts::cli::cmd_logits, {"direct-io", "stats", "capture-last"}},
      {"generate", ts::cli::cmd_generate, {"direct-io", "stats", "capture-last"}},
      {"inspect", ts::cli::cmd_inspect, {"json"}},
      {"synth", ts::cli::cmd_synth, {}},
      {"bench", ts::cli::cmd_bench, {"json", "direct-io", "stats", "no-warmup", "profile"}},
      {"pack", ts::cli::cmd_pack, {}},
      {"verify", ts::cli::cmd_verify, {}},
      {"analyze-router", ts::cli::cmd_analyze_router, {"json"}},
      {"run", ts::cli::cmd_run, {"direct-io", "stats", "capture-last"}},
      {"chat", ts::cli::cmd_chat, {"direct-io", "stats"}},
      {"chat-template", ts::cli::cmd_chat_template, {"add-generation-prompt"}},
      {"tokenize", ts::cli::cmd_tokenize, {"add-special"}},
      {"serve", ts::cli::cmd_serve, {"direct-io", "stats", "no-warmup"}},
      {"pull", ts::cli::cmd_pull, {}},
  };
  std::string name = argv[1];
  std::vector<std::string> rest;
  for (int i = 2; i < argc; ++i) {
    // `-n N` is the one short flag (generate's token count).
    rest.push_back(std::strcmp(argv[i], "-n") == 0 ? "--n" : argv[i]);
  }
  for (const Command& c : commands) {
    if (name != c.name) continue;
    auto args = ts::cli::Args::parse(rest, c.switches);
    ts::Status st = args.ok() ? c.fn(args.value()) : ts::Status(args.error());
    if (!st.ok()) {
      std::fprintf(stderr, "turbospark %s: error: %s\n", c.name, st.error().message.c_str());
      return 2;
    }
    return 0;
  }
  std::fprintf(stderr, "turbospark: error: unknown command '%s'\n%s", name.c_str(), kUsage);
  return 2;
}
