#include "cli/commands/common.h"

#include <cstdio>

#include "io/mapped_file.h"

namespace ts::cli {

nlohmann::json stats_json(const runtime::LoadedModel& model, const runtime::Session& session,
                          int64_t tokens_processed) {
  const runtime::PhaseTimes& p = session.phases();
  const experts::StoreStats s = model.experts().stats();
  const double t = double(std::max<int64_t>(1, tokens_processed));
  return {
      {"residency", std::string(experts::residency_name(model.experts().residency()))},
      {"slots_per_layer", model.slots_per_layer()},
      {"attention_ms", p.attention_us / 1e3},
      {"router_ms", p.router_us / 1e3},
      {"expert_io_ms", p.expert_io_us / 1e3},
      {"expert_compute_ms", p.expert_compute_us / 1e3},
      {"dense_ffn_ms", p.dense_ffn_us / 1e3},
      {"lm_head_ms", p.lm_head_us / 1e3},
      {"expert_selections", p.expert_requests},
      {"expert_requests", s.requests},
      {"expert_hits", s.hits},
      {"expert_hit_rate", s.requests ? double(s.hits) / double(s.requests) : 1.0},
      {"storage_bytes_read", s.bytes_read},
      {"storage_bytes_per_token", double(s.bytes_read) / t},
      {"tokens", tokens_processed},
  };
}

void print_stats(const nlohmann::json& j) {
  std::fprintf(stderr,
               "stats: residency %s, attention %.1f ms, router %.1f ms, expert I/O %.1f ms, "
               "expert compute %.1f ms, dense FFN %.1f ms, lm head %.1f ms\n"
               "stats: expert requests %llu, hits %llu (%.1f%%), storage read %.1f MB "
               "(%.2f MB/token over %lld tokens)\n",
               j["residency"].get<std::string>().c_str(), j["attention_ms"].get<double>(),
               j["router_ms"].get<double>(), j["expert_io_ms"].get<double>(),
               j["expert_compute_ms"].get<double>(), j["dense_ffn_ms"].get<double>(),
               j["lm_head_ms"].get<double>(),
               (unsigned long long)j["expert_requests"].get<uint64_t>(),
               (unsigned long long)j["expert_hits"].get<uint64_t>(),
               100.0 * j["expert_hit_rate"].get<double>(),
               double(j["storage_bytes_read"].get<uint64_t>()) / 1e6,
               j["storage_bytes_per_token"].get<double>() / 1e6,
               (long long)j["tokens"].get<int64_t>());
}

Status write_router_hist(const std::string& path, const runtime::LoadedModel& model,
                         const runtime::Session& session) {
  const model::HParams& hp = model.hp();
  nlohmann::json counts = nlohmann::json::array();
  for (int l = 0; l < hp.n_layers; ++l) {
    std::vector<uint64_t> row(session.router_hist().begin() + l * hp.n_experts,
                              session.router_hist().begin() + (l + 1) * hp.n_experts);
    counts.push_back(hp.layer_is_moe[size_t(l)] ? nlohmann::json(row) : nlohmann::json(nullptr));
  }
  nlohmann::json j = {{"n_layers", hp.n_layers},
                      {"n_experts", hp.n_experts},
                      {"top_k", hp.top_k},
                      {"counts", counts}};
  std::string text = j.dump() + "\n";
  return io::write_file_atomic(path, {io::ConstBytes{text.data(), text.size()}});
}

Status finish_run(const ModelFlags& flags, const Loaded& m, const runtime::Session& session,
                  int64_t tokens_processed) {
  if (flags.stats) print_stats(stats_json(*m.model, session, tokens_processed));
  if (!flags.router_hist.empty()) TS_TRY(write_router_hist(flags.router_hist, *m.model, session));
  return {};
}

}  // namespace ts::cli
