// analyze-router: per-layer routing statistics from a router histogram (--router-hist) or a
// router trace (--router-trace), and the hit rate an expert cache of N slots per layer would
// reach. With a trace the LRU and LFU caches are simulated with the engine's own SlotCache
// on the recorded request order; a histogram has no order, so it gives the static hit rate
// of keeping the N most used experts (what a warmed LFU cache approaches).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/commands/commands.h"
#include "experts/expert_cache.h"

namespace ts::cli {
namespace {

using json = nlohmann::json;

struct Routing {
  int n_experts = 0;
  std::vector<std::vector<uint64_t>> counts;             // [layer][expert]; empty = dense
  std::vector<std::vector<std::vector<int>>> requests;  // [layer][token] -> ids (trace only)
  bool has_order = false;
};

Result<Routing> read_routing(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return make_error("cannot read " + path);
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string text = ss.str();
  Routing r;
  json whole = json::parse(text, nullptr, false);
  if (!whole.is_discarded() && whole.is_object() && whole.contains("counts")) {
    try {
      r.n_experts = whole.at("n_experts").get<int>();
      for (const json& row : whole.at("counts")) {
        if (row.is_null()) {
          r.counts.emplace_back();
          continue;
        }
        r.counts.push_back(row.get<std::vector<uint64_t>>());
        if (int(r.counts.back().size()) != r.n_experts)
          return make_error(path + ": a counts row has " + std::to_string(r.counts.back().size()) +
                            " entries, n_experts is " + std::to_string(r.n_experts));
      }
    } catch (const std::exception& e) {
      return make_error(path + ": not a router histogram: " + e.what());
    }
    return r;
  }
  // A trace: one JSON object per line.
  r.has_order = true;
  std::istringstream lines(text);
  std::string line;
  int line_no = 0;
  while (std::getline(lines, line)) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    json j = json::parse(line, nullptr, false);
    const std::string where = path + " line " + std::to_string(line_no);
    if (j.is_discarded() || !j.is_object() || !j.contains("layers"))
      return make_error(where + ": not a router histogram or trace line");
    try {
      for (const json& L : j.at("layers")) {
        const int layer = L.at("layer").get<int>();
        std::vector<int> ids = L.at("ids").get<std::vector<int>>();
        if (layer < 0 || layer > 4096) return make_error(where + ": bad layer");
        if (int(r.requests.size()) <= layer) r.requests.resize(size_t(layer) + 1);
        for (int id : ids) {
          if (id < 0 || id > (1 << 20)) return make_error(where + ": bad expert id");
          r.n_experts = std::max(r.n_experts, id + 1);
        }
        r.requests[size_t(layer)].push_back(std::move(ids));
      }
    } catch (const std::exception& e) {
      return make_error(where + ": " + e.what());
    }
  }
  if (r.requests.empty()) return make_error(path + ": no routing records");
  r.counts.resize(r.requests.size());
  for (size_t l = 0; l < r.requests.size(); ++l) {
    if (r.requests[l].empty()) continue;
    r.counts[l].assign(size_t(r.n_experts), 0);
    for (const auto& ids : r.requests[l])
      for (int id : ids) ++r.counts[l][size_t(id)];
  }
  return r;
}

double simulate(const std::vector<std::vector<int>>& reqs, int n_experts, int slots,
                experts::CachePolicy policy) {
  experts::SlotCache cache(slots, n_experts, policy);
  uint64_t total = 0, hits = 0;
  for (const auto& ids : reqs) {
    // Requests larger than the cache are served in batches, as the engine does.
    for (size_t b = 0; b < ids.size(); b += size_t(slots)) {
      std::vector<int> batch(ids.begin() + long(b),
                             ids.begin() + long(std::min(ids.size(), b + size_t(slots))));
      experts::SlotCache::Plan plan;
      cache.plan(batch, &plan);
      total += batch.size();
      hits += batch.size() - plan.miss.size();
      cache.unprotect_all();
    }
  }
  return total ? double(hits) / double(total) : 0.0;
}

}  // namespace

Status cmd_analyze_router(const Args& args) {
  const bool as_json = args.has("json");
  std::vector<int> slot_list;
  const std::string slots_s = args.str_or("slots", "");
  TS_TRY(args.check_all_used());
  if (args.positional().size() != 1)
    return make_error("usage: turbospark analyze-router HIST_OR_TRACE [--slots N[,N..]] [--json]");
  TS_ASSIGN(Routing r, read_routing(args.positional()[0]));
  if (!slots_s.empty()) {
    std::stringstream ss(slots_s);
    std::string item;
    while (std::getline(ss, item, ',')) {
      char* end = nullptr;
      long v = std::strtol(item.c_str(), &end, 10);
      if (item.empty() || *end || v < 1 || v > r.n_experts)
        return make_error("--slots: '" + item + "' is not a slot count in [1, " +
                          std::to_string(r.n_experts) + "]");
      slot_list.push_back(int(v));
    }
  } else {
    for (int s : {r.n_experts / 10, r.n_experts / 4, r.n_experts / 2})
      if (s >= 1 && (slot_list.empty() || slot_list.back() != s)) slot_list.push_back(s);
  }
  json out = {{"n_experts", r.n_experts}, {"source", r.has_order ? "trace" : "histogram"},
              {"layers", json::array()}};
  for (size_t l = 0; l < r.counts.size(); ++l) {
    const auto& c = r.counts[l];
    if (c.empty()) continue;
    uint64_t total = 0;
    for (uint64_t x : c) total += x;
    if (total == 0) continue;
    double entropy = 0;
    for (uint64_t x : c)
      if (x) entropy -= double(x) / double(total) * std::log2(double(x) / double(total));
    std::vector<uint64_t> sorted = c;
    std::sort(sorted.rbegin(), sorted.rend());
    const size_t top10 = std::max<size_t>(1, (c.size() + 9) / 10);
    uint64_t top_sum = 0;
    for (size_t i = 0; i < top10; ++i) top_sum += sorted[i];
    json L = {{"layer", l},
              {"selections", total},
              {"entropy_bits", entropy},
              {"max_entropy_bits", std::log2(double(c.size()))},
              {"top10pct_share", double(top_sum) / double(total)},
              {"cache", json::array()}};
    for (int s : slot_list) {
      uint64_t static_hits = 0;
      for (int i = 0; i < s; ++i) static_hits += sorted[size_t(i)];
      json e = {{"slots", s}, {"static_top_n_hit_rate", double(static_hits) / double(total)}};
      if (r.has_order) {
        e["lru_hit_rate"] = simulate(r.requests[l], r.n_experts, s, experts::CachePolicy::kLru);
        e["lfu_hit_rate"] = simulate(r.requests[l], r.n_experts, s, experts::CachePolicy::kLfu);
      }
      L["cache"].push_back(e);
    }
    out["layers"].push_back(L);
  }
  if (as_json) {
    std::printf("%s\n", out.dump(2).c_str());
    return {};
  }
  std::printf("%s of %d experts (%s)\n", args.positional()[0].c_str(), r.n_experts,
              r.has_order ? "trace: LRU/LFU simulated" : "histogram: static top-N only");
  for (const json& L : out["layers"]) {
    std::printf("layer %3d  entropy %.2f / %.2f bits  top 10%% share %.1f%% ", L["layer"].get<int>(),
                L["entropy_bits"].get<double>(), L["max_entropy_bits"].get<double>(),
                100 * L["top10pct_share"].get<double>());
    for (const json& e : L["cache"]) {
      std::printf(" | %d slots: top-N %.1f%%", e["slots"].get<int>(),
                  100 * e["static_top_n_hit_rate"].get<double>());
      if (e.contains("lru_hit_rate"))
        std::printf(" LRU %.1f%% LFU %.1f%%", 100 * e["lru_hit_rate"].get<double>(),
                    100 * e["lfu_hit_rate"].get<double>());
    }
    std::printf("\n");
  }
  return {};
}

}  // namespace ts::cli
