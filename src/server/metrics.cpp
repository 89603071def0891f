#include "server/metrics.h"

#include <cstdio>

namespace ts::server {

void Metrics::count_response(const std::string& route, int status) {
  std::lock_guard lock(mu_);
  ++responses_[{route, status}];
}

void Metrics::add_stream_bytes(uint64_t n) {
  std::lock_guard lock(mu_);
  stream_bytes_ += n;
}

void Metrics::count_failure() {
  std::lock_guard lock(mu_);
  ++failures_;
}

void Metrics::record_generation(const runtime::Generation& g, const experts::StoreStats& store,
                                const std::optional<runtime::ExpertCacheReport>& gpu,
                                const runtime::PhaseTimes& phases) {
  std::lock_guard lock(mu_);
  ++generations_;
  if (g.stop_reason == runtime::StopReason::kCancelled) ++cancelled_;
  prompt_tokens_ += uint64_t(g.prompt_tokens);
  reused_tokens_ += uint64_t(g.reused_tokens);
  completion_tokens_ += uint64_t(g.generated);
  prefill_s_ += g.prefill_s;
  decode_s_ += g.decode_s;
  if (g.generated > 0 && g.decode_s > 0) last_decode_tok_s_ = double(g.generated) / g.decode_s;
  store_ = store.since(base_store_);
  gpu_.reset();
  if (gpu) gpu_ = gpu->since(base_gpu_);
  const runtime::PhaseTimes counted = phases.since(base_phases_);
  predicted_picks_ = counted.predicted_picks;
  predicted_right_ = counted.predicted_right;
}

void Metrics::set_baseline(const experts::StoreStats& store,
                           const std::optional<runtime::ExpertCacheReport>& gpu,
                           const runtime::PhaseTimes& phases) {
  std::lock_guard lock(mu_);
  base_store_ = store;
  base_gpu_ = gpu.value_or(runtime::ExpertCacheReport{});
  base_phases_ = phases;
}

std::string Metrics::prometheus(int queue_depth, int running,
                                const runtime::Engine::KvStats& kv) const {
  std::lock_guard lock(mu_);
  std::string out;
  char line[512];
  auto metric = [&](const char* name, const char* type, const char* help, double value) {
    std::snprintf(line, sizeof line, "# HELP %s %s\n# TYPE %s %s\n%s %.17g\n", name, help, name,
                  type, name, value);
    out += line;
  };
  out +=
      "# HELP turbospark_http_responses_total HTTP responses by route and status.\n"
      "# TYPE turbospark_http_responses_total counter\n";
  for (const auto& [key, n] : responses_) {
    std::snprintf(line, sizeof line,
                  "turbospark_http_responses_total{route=\"%s\",status=\"%d\"} %llu\n",
                  key.first.c_str(), key.second, (unsigned long long)n);
    out += line;
  }
  metric("turbospark_engine_threads", "gauge",
         "Engine threads; one, running every request in flight (--parallel) step by step.", 1);
  metric("turbospark_queue_depth", "gauge", "Requests waiting for the engine.", queue_depth);
  metric("turbospark_requests_running", "gauge", "Requests the engine is generating for.", running);
  if (kv.blocks > 0) {
    metric("turbospark_kv_block_tokens", "gauge", "Positions per KV cache block.",
           double(kv.block_tokens));
    metric("turbospark_kv_blocks", "gauge", "KV cache blocks in the pool.", double(kv.blocks));
    metric("turbospark_kv_blocks_used", "gauge", "KV cache blocks held by running requests.",
           double(kv.used));
    metric("turbospark_kv_blocks_cached", "gauge",
           "KV cache blocks kept for prefix reuse, held by no request.", double(kv.cached));
    metric("turbospark_kv_prefix_tokens_total", "counter",
           "Prompt tokens looked up in the prefix cache.", double(kv.prefix_tokens));
    metric("turbospark_kv_prefix_hit_tokens_total", "counter",
           "Of those, found cached (their KV rows shared, not computed).",
           double(kv.reused_tokens));
    metric("turbospark_kv_prefix_hit_rate", "gauge", "Prefix-cache hit tokens / looked up.",
           kv.prefix_tokens ? double(kv.reused_tokens) / double(kv.prefix_tokens) : 0.0);
  }
  metric("turbospark_generations_total", "counter", "Generations finished (any stop reason).",
         double(generations_));
  metric("turbospark_generations_cancelled_total", "counter",
         "Generations cancelled because the client went away.", double(cancelled_));
  metric("turbospark_generation_failures_total", "counter", "Generations that failed.",
         double(failures_));
  metric("turbospark_prompt_tokens_total", "counter", "Prompt tokens.", double(prompt_tokens_));
  metric("turbospark_prompt_tokens_reused_total", "counter",
         "Prompt tokens whose KV cache was reused from the previous request.",
         double(reused_tokens_));
  metric("turbospark_completion_tokens_total", "counter", "Generated tokens.",
         double(completion_tokens_));
  metric("turbospark_prefill_seconds_total", "counter", "Time in prefill.", prefill_s_);
  metric("turbospark_decode_seconds_total", "counter", "Time in decode.", decode_s_);
  metric("turbospark_decode_tokens_per_second", "gauge",
         "Decode speed over all requests (generated tokens / decode time).",
         decode_s_ > 0 ? double(completion_tokens_) / decode_s_ : 0);
  metric("turbospark_last_decode_tokens_per_second", "gauge", "Decode speed of the last request.",
         last_decode_tok_s_);
  metric("turbospark_expert_requests_total", "counter", "Experts asked of the expert store.",
         double(store_.requests));
  metric("turbospark_expert_hits_total", "counter", "Of those, already in memory.",
         double(store_.hits));
  metric("turbospark_expert_cache_hit_rate", "gauge", "Expert hits / requests (1 when none).",
         store_.requests ? double(store_.hits) / double(store_.requests) : 1.0);
  metric("turbospark_expert_bytes_read_total", "counter",
         "Bytes the expert store read from storage (streamed residency).",
         double(store_.bytes_read));
  if (gpu_) {
    metric("turbospark_gpu_expert_cache_slots_per_layer", "gauge",
           "GPU expert cache slots per MoE layer (experts in host memory or files behind it).",
           gpu_->slots_per_layer);
    metric("turbospark_gpu_expert_requests_total", "counter",
           "Distinct experts the GPU expert cache was asked for, per layer and step.",
           double(gpu_->requests));
    metric("turbospark_gpu_expert_hits_total", "counter", "Of those, already in a GPU slot.",
           double(gpu_->hits));
    metric("turbospark_gpu_expert_cache_hit_rate", "gauge",
           "GPU expert cache hits / requests (1 when none).",
           gpu_->requests ? double(gpu_->hits) / double(gpu_->requests) : 1.0);
    metric("turbospark_gpu_expert_h2d_bytes_total", "counter",
           "Expert bytes copied host -> device into the GPU expert cache.",
           double(gpu_->copied_bytes));
    metric("turbospark_gpu_expert_copy_seconds_total", "counter",
           "Time the copy stream spent copying experts.", gpu_->copy_ms / 1e3);
    metric("turbospark_gpu_expert_bind_seconds_total", "counter",
           "Host time spent planning misses and issuing their copies.", gpu_->bind_ms / 1e3);
  }
  if (predicted_picks_ > 0) {
    metric("turbospark_expert_prediction_picks_total", "counter",
           "Router picks compared with the prediction made a layer ahead (CUDA decode).",
           double(predicted_picks_));
    metric("turbospark_expert_predicted_total", "counter",
           "Of those, predicted (the best-ranked predictions are prefetched into L2).",
           double(predicted_right_));
    metric("turbospark_expert_prediction_rate", "gauge", "Predicted / picks.",
           double(predicted_right_) / double(predicted_picks_));
  }
  metric("turbospark_stream_bytes_total", "counter", "Bytes of SSE frames sent to clients.",
         double(stream_bytes_));
  return out;
}

}  // namespace ts::server
