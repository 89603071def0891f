// Micro-benchmark of JSON mode's token mask (runtime/json_constraint): the time of one
// JsonConstraint::mask over a tokenizer's whole vocabulary in four states (after '{', inside a
// string, inside an array of numbers, after a number), and how many tokens each allows.
//
// Build by hand (no CMake target on purpose; it is a lab tool), after a build in build/:
//   g++ -std=c++20 -O2 -Isrc bench/bench_json_mask.cpp build/libturbospark_lib.a
//     /usr/lib/x86_64-linux-gnu/libpcre2-8.a /usr/lib/x86_64-linux-gnu/libutf8proc.a
//     -pthread -o bench_json_mask
// Run: ./bench_json_mask TOKENIZER_DIR [THREADS]   (e.g. build-data/tokenizers/qwen3; THREADS:
// a pool for the mask, as serve hands it)
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "core/thread_pool.h"
#include "runtime/json_constraint.h"
#include "tokenizer/tokenizer.h"

int main(int argc, char** argv) {
  if (argc != 2 && argc != 3) {
    std::fprintf(stderr, "usage: bench_json_mask TOKENIZER_DIR [THREADS]\n");
    return 2;
  }
  auto tok = ts::tokenizer::Tokenizer::load(argv[1]);
  if (!tok.ok()) {
    std::fprintf(stderr, "%s\n", tok.error().message.c_str());
    return 2;
  }
  const ts::tokenizer::Tokenizer& t = *tok.value();
  std::vector<std::string> bytes(size_t(t.vocab_size()));
  for (int id = 0; id < t.vocab_size(); ++id)
    if (!t.is_special(id)) bytes[size_t(id)] = t.token_bytes(id);
  std::vector<float> logits(bytes.size(), 0.0f), out;
  ts::ThreadPool pool(argc == 3 ? std::atoi(argv[2]) : 1);
  std::printf("%d tokens\n", t.vocab_size());
  for (const char* prefix : {"{", "{\"key\": \"some text", "{\"a\": [1, 2", "{\"a\": 1"}) {
    ts::runtime::JsonConstraint c(bytes, t.eos_ids());
    for (const char* p = prefix; *p; ++p)  // one character at a time, as tokens
      for (int id : t.encode(std::string(1, *p), false)) c.accept(id);
    const int reps = 50;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i) c.mask(logits, out, &pool);
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    int allowed = 0;
    for (float v : out) allowed += std::isfinite(v);
    std::printf("after %-22s %6.2f ms per mask, %6d tokens allowed\n", prefix, ms / reps, allowed);
  }
}
