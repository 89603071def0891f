// Counters for GET /metrics, in Prometheus text format. HTTP threads count requests and
// streamed bytes; the engine thread records each finished generation and the expert store's
// counters after it (so nothing here reads the store while the engine uses it).
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>

#include "experts/expert_store.h"
#include "runtime/engine.h"
#include "runtime/generate.h"

namespace ts::server {

class Metrics {
 public:
  void count_response(const std::string& route, int status);
  void add_stream_bytes(uint64_t n);
  // gpu: the GPU expert cache's counters (--device cuda with --residency host / streamed);
  // phases: the engine's (its expert prediction counts, CUDA decode with resident experts).
  void record_generation(const runtime::Generation& g, const experts::StoreStats& store,
                         const std::optional<runtime::ExpertCacheReport>& gpu = std::nullopt,
                         const runtime::PhaseTimes& phases = {});
  void count_failure();
  // The counters as they stand before the first request (after serve's warm-up): what
  // /metrics reports of the store, the GPU expert cache and the prediction is counted from here.
  void set_baseline(const experts::StoreStats& store,
                    const std::optional<runtime::ExpertCacheReport>& gpu,
                    const runtime::PhaseTimes& phases);
  // queue_depth: jobs waiting; running: jobs in flight (up to --parallel); kv: the KV
  // pool's blocks and prefix cache (all zero where the backend does not batch).
  std::string prometheus(int queue_depth, int running,
                         const runtime::Engine::KvStats& kv = {}) const;

 private:
  mutable std::mutex mu_;
  std::map<std::pair<std::string, int>, uint64_t> responses_;  // (route, status) -> count
  uint64_t stream_bytes_ = 0;
  uint64_t generations_ = 0, cancelled_ = 0, failures_ = 0;
  uint64_t prompt_tokens_ = 0, reused_tokens_ = 0, completion_tokens_ = 0;
  double prefill_s_ = 0, decode_s_ = 0;
  double last_decode_tok_s_ = 0;
  experts::StoreStats store_;
  std::optional<runtime::ExpertCacheReport> gpu_;
  uint64_t predicted_picks_ = 0, predicted_right_ = 0;
  experts::StoreStats base_store_;
  runtime::ExpertCacheReport base_gpu_;
  runtime::PhaseTimes base_phases_;
};

}  // namespace ts::server
