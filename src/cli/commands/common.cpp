#include "cli/commands/common.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>

#include "io/gguf.h"
#include "io/mapped_file.h"
#include "io/npy.h"
#include "io/safetensors.h"

namespace ts::cli {

experts::LayerProgress tty_layer_progress(std::string what) {
  if (!isatty(fileno(stderr))) return {};
  return [what = std::move(what)](int done, int total, uint64_t bytes) {
    std::fprintf(stderr, "\rturbospark: %s: layer %d/%d, %.1f GB%s", what.c_str(), done, total,
                 double(bytes) / 1e9, done == total ? "\n" : "");
    std::fflush(stderr);
  };
}

nlohmann::json stats_json(const runtime::LoadedModel& model, const runtime::Engine& session,
                          int64_t tokens_processed) {
  return stats_json(model, session, tokens_processed, {});
}

nlohmann::json stats_json(const runtime::LoadedModel& model, const runtime::Engine& session,
                          int64_t tokens_processed, const RunCounters& since) {
  const runtime::PhaseTimes p = session.phases().since(since.phases);
  experts::StoreStats s = model.experts().stats().since(since.store);
  const double t = double(std::max<int64_t>(1, tokens_processed));
  std::string residency(experts::residency_name(model.experts().residency()));
  int slots = model.slots_per_layer();
  nlohmann::json gpu_cache = nullptr;
  if (const auto cache = session.expert_cache()) {
    // The GPU's expert cache is the one that hits or misses; the store only feeds it.
    const runtime::ExpertCacheReport c = cache->since(since.cache);
    residency = c.residency;
    slots = c.slots_per_layer;
    const uint64_t bytes = c.copied_bytes;
    const double ms = c.copy_ms;
    s.requests = c.requests;
    s.hits = c.hits;
    gpu_cache = {{"h2d_bytes", bytes},
                 {"h2d_bytes_per_token", double(bytes) / t},
                 {"copy_ms", ms},
                 {"bind_ms", c.bind_ms},
                 {"h2d_gbps", ms > 0 ? double(bytes) / (ms * 1e-3) / 1e9 : 0.0}};
  }
  nlohmann::json prediction = nullptr;
  if (p.predicted_picks > 0)
    prediction = {{"picks", p.predicted_picks},
                  {"predicted", p.predicted_right},
                  {"rate", double(p.predicted_right) / double(p.predicted_picks)}};
  return {
      {"residency", residency},
      {"slots_per_layer", slots},
      {"gpu_expert_cache", gpu_cache},
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
      {"expert_prediction", prediction},
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
  if (!j["gpu_expert_cache"].is_null()) {
    const nlohmann::json& g = j["gpu_expert_cache"];
    std::fprintf(stderr,
                 "stats: GPU expert cache %d slots/layer, host->device %.1f MB (%.2f MB/token), "
                 "%.1f GB/s while copying, host binding %.1f ms\n",
                 j["slots_per_layer"].get<int>(), double(g["h2d_bytes"].get<uint64_t>()) / 1e6,
                 g["h2d_bytes_per_token"].get<double>() / 1e6, g["h2d_gbps"].get<double>(),
                 g["bind_ms"].get<double>());
  }
  if (!j["expert_prediction"].is_null()) {
    const nlohmann::json& e = j["expert_prediction"];
    std::fprintf(stderr,
                 "stats: experts predicted a layer ahead (best ranks prefetched into L2): "
                 "%llu of %llu picks (%.1f%%)\n",
                 (unsigned long long)e["predicted"].get<uint64_t>(),
                 (unsigned long long)e["picks"].get<uint64_t>(), 100.0 * e["rate"].get<double>());
  }
}

Status warm_store(experts::ExpertStore& store, const std::vector<std::vector<uint64_t>>& counts) {
  for (size_t l = 0; l < counts.size(); ++l) {
    if (counts[l].empty()) continue;
    TS_TRY(store.warm(int(l), experts::most_selected(counts[l], store.max_batch(int(l)))));
  }
  return {};
}

Result<std::vector<std::vector<uint64_t>>> read_cache_warm(const std::string& path,
                                                           const model::HParams& hp) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return make_error("--cache-warm: cannot read " + path);
  std::stringstream ss;
  ss << f.rdbuf();
  nlohmann::json j = nlohmann::json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object())
    return make_error(path + ": not a JSON object (--cache-warm takes --router-hist's output)");
  for (const char* key : {"n_layers", "n_experts"})
    if (!j.contains(key) || !j[key].is_number_integer())
      return make_error(path + ": field '" + key + "' is missing or not an integer");
  if (j["n_layers"].get<int64_t>() != hp.n_layers || j["n_experts"].get<int64_t>() != hp.n_experts)
    return make_error(path + ": a histogram of " + std::to_string(j["n_layers"].get<int64_t>()) +
                      " layers x " + std::to_string(j["n_experts"].get<int64_t>()) +
                      " experts, the model has " + std::to_string(hp.n_layers) + " x " +
                      std::to_string(hp.n_experts));
  if (!j.contains("counts") || !j["counts"].is_array() ||
      j["counts"].size() != size_t(hp.n_layers))
    return make_error(path + ": field 'counts' must be an array of " +
                      std::to_string(hp.n_layers) + " rows");
  std::vector<std::vector<uint64_t>> out(size_t(hp.n_layers));
  for (int l = 0; l < hp.n_layers; ++l) {
    const nlohmann::json& row = j["counts"][size_t(l)];
    if (row.is_null()) continue;
    if (!row.is_array() || row.size() != size_t(hp.n_experts))
      return make_error(path + ": counts[" + std::to_string(l) + "] must be null or " +
                        std::to_string(hp.n_experts) + " counts");
    for (const nlohmann::json& c : row) {
      if (!c.is_number_unsigned() && !(c.is_number_integer() && c.get<int64_t>() >= 0))
        return make_error(path + ": counts[" + std::to_string(l) +
                          "] holds something that is not a count");
      out[size_t(l)].push_back(c.get<uint64_t>());
    }
  }
  return out;
}

Status write_router_hist(const std::string& path, const runtime::LoadedModel& model,
                         const runtime::Engine& session) {
  const model::HParams& hp = model.hp();
  nlohmann::json counts = nlohmann::json::array();
  const std::vector<uint64_t> hist = session.router_hist();
  for (int l = 0; l < hp.n_layers; ++l) {
    std::vector<uint64_t> row(hist.begin() + l * hp.n_experts, hist.begin() + (l + 1) * hp.n_experts);
    counts.push_back(hp.layer_is_moe[size_t(l)] ? nlohmann::json(row) : nlohmann::json(nullptr));
  }
  nlohmann::json j = {{"n_layers", hp.n_layers},
                      {"n_experts", hp.n_experts},
                      {"top_k", hp.top_k},
                      {"counts", counts}};
  std::string text = j.dump() + "\n";
  return io::write_file_atomic(path, {io::ConstBytes{text.data(), text.size()}});
}

namespace {

bool has_suffix(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// A llama.cpp control vector: direction.N steers our layer N (io/gguf.h says why). LAYERS
// picks among the file's directions: "all" takes every one; a list or range takes those
// layers, each of which the file must hold. Either way every direction in the file must
// fall inside the model, since a file made for this model cannot hold one past its last layer.
Result<std::vector<std::pair<int, runtime::SteerOp>>> control_vector_ops(
    const std::string& file, const std::string& layers_s, float scale, runtime::SteerMode mode,
    const model::HParams& hp) {
  TS_ASSIGN(io::ControlVector cv, io::read_control_vector(file, hp.d_model));
  std::vector<bool> in_file(size_t(hp.n_layers), false);
  for (const auto& [layer, v] : cv.directions) {
    if (layer >= hp.n_layers)
      return make_error(file + ": tensor 'direction." + std::to_string(layer) +
                        "' is out of range: the model's layers are 0-" +
                        std::to_string(hp.n_layers - 1));
    in_file[size_t(layer)] = true;
  }
  std::vector<bool> chosen = in_file;
  if (layers_s != "all") {
    TS_ASSIGN(std::vector<int> layers, runtime::parse_layer_list(layers_s, hp.n_layers, false));
    std::fill(chosen.begin(), chosen.end(), false);
    for (int l : layers) {
      if (!in_file[size_t(l)])
        return make_error("--steer " + file + "@" + layers_s + ": the file has no direction." +
                          std::to_string(l) + " for layer " + std::to_string(l));
      chosen[size_t(l)] = true;
    }
  }
  std::vector<std::pair<int, runtime::SteerOp>> ops;  // (layer, op), ascending layers
  for (auto& [layer, v] : cv.directions)
    if (chosen[size_t(layer)])
      ops.emplace_back(layer, runtime::SteerOp{.v = std::move(v), .scale = scale, .mode = mode});
  return ops;
}

}  // namespace

Result<runtime::Interventions> build_interventions(const ModelFlags& flags,
                                                   const model::HParams& hp) {
  runtime::Interventions iv;
  iv.steer.resize(size_t(hp.n_layers));
  if (!flags.capture_layers.empty()) {
    TS_ASSIGN(iv.capture_layers,
              runtime::parse_layer_list(flags.capture_layers, hp.n_layers, true));
  }
  iv.capture_last = flags.capture_last;
  iv.trace_router = !flags.router_trace.empty();
  for (const std::string& spec : flags.steer) {
    // FILE@LAYERS[:SCALE[:MODE]]
    const size_t at = spec.rfind('@');
    if (at == std::string::npos || at == 0)
      return make_error("--steer '" + spec + "': expected FILE@LAYERS[:SCALE[:MODE]]");
    const std::string file = spec.substr(0, at);
    std::string rest = spec.substr(at + 1), layers_s = rest, scale_s = "1", mode_s = "add";
    if (size_t c = rest.find(':'); c != std::string::npos) {
      layers_s = rest.substr(0, c);
      scale_s = rest.substr(c + 1);
      if (size_t c2 = scale_s.find(':'); c2 != std::string::npos) {
        mode_s = scale_s.substr(c2 + 1);
        scale_s = scale_s.substr(0, c2);
      }
    }
    char* end = nullptr;
    const float scale = std::strtof(scale_s.c_str(), &end);
    if (end == scale_s.c_str() || *end || !std::isfinite(scale))
      return make_error("--steer '" + spec + "': scale '" + scale_s + "' is not a number");
    TS_ASSIGN(runtime::SteerMode mode, runtime::parse_steer_mode(mode_s));
    if (has_suffix(file, ".gguf")) {
      TS_ASSIGN(auto ops, control_vector_ops(file, layers_s, scale, mode, hp));
      for (auto& [layer, op] : ops) iv.steer[size_t(layer)].push_back(std::move(op));
      continue;
    }
    TS_ASSIGN(std::vector<int> layers, runtime::parse_layer_list(layers_s, hp.n_layers, false));
    TS_ASSIGN(io::NpyArray a, io::read_npy_f32(file));
    const int64_t d = hp.d_model;
    const bool per_layer = a.shape.size() == 2 && a.shape[0] == hp.n_layers && a.shape[1] == d;
    if (!(a.shape.size() == 1 && a.shape[0] == d) && !per_layer)
      return make_error("steering vector " + file + " has shape " +
                        nlohmann::json(a.shape).dump() + "; expected [" + std::to_string(d) +
                        "] or [" + std::to_string(hp.n_layers) + ", " + std::to_string(d) + "]");
    for (size_t i = 0; i < a.data.size(); ++i)
      if (!std::isfinite(a.data[i]))
        return make_error("steering vector " + file + " has a non-finite value at element " +
                          std::to_string(i));
    for (int l : layers) {
      runtime::SteerOp op{.v = {}, .scale = scale, .mode = mode};
      const float* row = a.data.data() + (per_layer ? size_t(l) * size_t(d) : 0);
      op.v.assign(row, row + d);
      iv.steer[size_t(l)].push_back(std::move(op));
    }
  }
  return iv;
}

namespace {

Status write_captures(const ModelFlags& flags, const runtime::LoadedModel& m,
                      const runtime::Engine& s) {
  const auto& layers = s.captures();
  const int64_t P = s.captured_positions(), d = m.hp().d_model;
  std::vector<float> all;
  for (const auto& c : layers) all.insert(all.end(), c.begin(), c.end());
  const std::vector<int64_t> shape = {int64_t(layers.size()), P, d};
  const std::string& out = flags.capture_out;
  if (out.size() > 12 && out.substr(out.size() - 12) == ".safetensors") {
    TS_TRY(io::write_safetensors(out, {{"residual", DType::kF32, shape, all.data(), all.size() * 4}}));
  } else {
    TS_TRY(io::write_npy_f32(out, shape, all.data()));
  }
  // The layer list and shape, beside the array (layer -1 = embedding output).
  runtime::Interventions iv;
  nlohmann::json meta = {{"file", out},
                         {"shape", shape},
                         {"layers", nullptr},
                         {"capture_last", flags.capture_last},
                         {"point", "after each layer's FFN/MoE residual add, after steering"}};
  TS_ASSIGN(auto list, runtime::parse_layer_list(flags.capture_layers, m.hp().n_layers, true));
  meta["layers"] = list;
  std::string text = meta.dump(1) + "\n";
  return io::write_file_atomic(out + ".json", {io::ConstBytes{text.data(), text.size()}});
}

Status write_router_trace(const std::string& path, const runtime::Engine& s) {
  // One line per token: {"pos": p, "layers": [{"layer": l, "ids": [...], "weights": [...]}]}
  std::map<int, nlohmann::json> by_pos;
  for (const runtime::RouterTraceEntry& e : s.router_trace()) {
    nlohmann::json& line = by_pos[e.position];
    if (line.is_null()) line = {{"pos", e.position}, {"layers", nlohmann::json::array()}};
    line["layers"].push_back({{"layer", e.layer}, {"ids", e.ids}, {"weights", e.weights}});
  }
  std::string text;
  for (const auto& [pos, line] : by_pos) text += line.dump() + "\n";
  return io::write_file_atomic(path, {io::ConstBytes{text.data(), text.size()}});
}

}  // namespace

Status finish_run(const ModelFlags& flags, const Loaded& m, const runtime::Engine& session,
                  int64_t tokens_processed) {
  if (flags.stats) print_stats(stats_json(*m.model, session, tokens_processed));
  if (!flags.router_hist.empty()) TS_TRY(write_router_hist(flags.router_hist, *m.model, session));
  if (!flags.capture_out.empty()) TS_TRY(write_captures(flags, *m.model, session));
  if (!flags.router_trace.empty()) TS_TRY(write_router_trace(flags.router_trace, session));
  return {};
}

}  // namespace ts::cli
