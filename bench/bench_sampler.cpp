// Micro-benchmark of the sampler (runtime/sampler): ms per draw over a vocabulary of Qwen3's
// size (151,936 logits), greedy and at temperature > 0 with the cuts clients send, on three
// kinds of logits: flat (normal, sd 3), peaked (the same with a few tokens 15 above the rest:
// a trained model's typical step) and near-uniform (sd 0.05: a small random-weight model's,
// where the draw walks deep into the order). The sum of the drawn ids is printed so
// runs can be compared draw for draw.
//
// Build by hand (no CMake target on purpose; it is a lab tool), after a build in build/:
//   g++ -std=c++20 -O2 -Isrc bench/bench_sampler.cpp build/libturbospark_lib.a -pthread \
//     -o bench_sampler
// Run: ./bench_sampler [THREADS]   (a pool of THREADS for the passes over the vocabulary)
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "core/thread_pool.h"
#include "runtime/sampler.h"

int main(int argc, char** argv) {
  ts::ThreadPool pool(argc > 1 ? std::atoi(argv[1]) : 1);
  using ts::runtime::SamplerOptions;
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  std::vector<float> flat(151936);
  for (float& l : flat) l = nd(rng);
  std::vector<float> peaked = flat;
  for (int i = 0; i < 5; ++i) peaked[rng() % peaked.size()] += 15.0f;
  std::vector<float> uniform = flat;
  for (float& l : uniform) l *= 0.05f / 3.0f;
  struct Case {
    const char* name;
    SamplerOptions o;
  };
  const Case cases[] = {
      {"greedy", {}},
      {"T 0.7", {.temperature = 0.7f}},
      {"T 0.7, top_p 0.95", {.temperature = 0.7f, .top_p = 0.95f}},
      {"T 0.7, top_k 40, top_p 0.95", {.temperature = 0.7f, .top_k = 40, .top_p = 0.95f}},
      {"T 1, min_p 0.05", {.temperature = 1.0f, .min_p = 0.05f}},
  };
  for (const auto& [kind, logits] :
       {std::pair{"flat", &flat}, std::pair{"peaked", &peaked}, std::pair{"uniform", &uniform}})
    for (const Case& c : cases) {
      ts::runtime::Sampler s(c.o);
      s.set_pool(&pool);
      long sum = 0;
      const int n = 50;
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < n; ++i) sum += s.sample(*logits);
      const double ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      std::printf("%-7s %-30s %8.3f ms/draw  (ids sum %ld)\n", kind, c.name, ms / n, sum);
    }
}
