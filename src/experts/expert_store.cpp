#include "experts/expert_store.h"

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <mutex>

#include "core/thread_pool.h"

namespace ts::experts {

Result<Residency> parse_residency(const std::string& s) {
  if (s == "resident") return Residency::kResident;
  if (s == "mapped") return Residency::kMapped;
  if (s == "streamed") return Residency::kStreamed;
  return make_error("--residency: '" + s + "' is not one of resident, mapped, streamed");
}

std::string_view residency_name(Residency r) {
  switch (r) {
    case Residency::kResident: return "resident";
    case Residency::kMapped: return "mapped";
    case Residency::kStreamed: return "streamed";
  }
  return "?";
}

std::unique_ptr<TableStore> TableStore::mapped(model::ExpertTable table) {
  return std::unique_ptr<TableStore>(new TableStore(std::move(table), Residency::kMapped));
}

std::unique_ptr<TableStore> TableStore::resident(const model::ExpertTable& table) {
  std::unique_ptr<TableStore> s(new TableStore(table, Residency::kResident));
  for (auto& layer : s->table_) {
    for (model::ExpertWeights& e : layer) {
      for (model::Matrix* m : {&e.gate, &e.up, &e.down}) {
        auto buf = std::make_unique<uint8_t[]>(m->n_bytes());
        std::memcpy(buf.get(), m->data, m->n_bytes());
        m->data = buf.get();
        s->owned_.push_back(std::move(buf));
      }
    }
  }
  return s;
}

Status TableStore::acquire(int layer, std::span<const int> ids,
                           std::span<model::ExpertWeights> out) {
  const auto& experts = table_[size_t(layer)];
  for (size_t i = 0; i < ids.size(); ++i) out[i] = experts[size_t(ids[i])];
  stats_.requests += ids.size();
  stats_.hits += ids.size();
  return {};
}

namespace {

constexpr uint64_t kAlign = 4096;
uint64_t round_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

struct AlignedFree {
  void operator()(uint8_t* p) const { std::free(p); }
};

class StreamedStore final : public ExpertStore {
 public:
  StreamedStore(ExpertSource source, StreamedOptions opt)
      : source_(std::move(source)), opt_(opt), readers_(opt.io_threads) {}
  ~StreamedStore() override {
    for (int fd : fds_)
      if (fd >= 0) ::close(fd);
  }

  Status open() {
    const int flags = O_RDONLY | O_CLOEXEC | (opt_.direct_io ? O_DIRECT : 0);
    for (const std::string& f : source_.files) {
      int fd = ::open(f.c_str(), flags);
      if (fd < 0)
        return make_error("cannot open " + f + " for streaming" +
                          (opt_.direct_io ? " with O_DIRECT" : "") + ": " + std::strerror(errno));
      fds_.push_back(fd);
    }
    for (size_t l = 0; l < source_.layers.size(); ++l) {
      uint64_t slot_bytes = 0;
      for (const ExpertLocation& loc : source_.layers[l]) {
        slot_bytes = std::max(slot_bytes, loc.slot_bytes);
        if (!opt_.direct_io) continue;
        for (const ExpertPiece& p : loc.pieces)
          if (p.file_offset % kAlign || p.n_bytes % kAlign || p.slot_offset % kAlign)
            return make_error("--direct-io needs 4096-byte aligned experts, but layer " +
                              std::to_string(l) + " in " + source_.files[size_t(p.file)] +
                              " is not aligned; make a pack with `turbospark pack`");
      }
      Layer L;
      if (!source_.layers[l].empty()) {
        const int n_experts = int(source_.layers[l].size());
        const int n_slots = std::max(1, std::min(opt_.slots_per_layer, n_experts));
        L.slot_bytes = round_up(slot_bytes, kAlign);
        L.cache = std::make_unique<SlotCache>(n_slots, n_experts, opt_.policy);
        uint8_t* mem = static_cast<uint8_t*>(std::aligned_alloc(kAlign, L.slot_bytes * n_slots));
        if (!mem) return make_error("cannot allocate the expert cache (" +
                                    std::to_string(L.slot_bytes * n_slots) + " bytes for layer " +
                                    std::to_string(l) + ")");
        L.memory.reset(mem);
      }
      layers_.push_back(std::move(L));
    }
    return {};
  }

  int max_batch(int layer) const override { return layers_[size_t(layer)].cache->n_slots(); }
  Residency residency() const override { return Residency::kStreamed; }
  std::vector<std::span<uint8_t>> slot_memory() const override {
    std::vector<std::span<uint8_t>> out;
    for (const Layer& L : layers_)
      if (L.memory) out.emplace_back(L.memory.get(), L.slot_bytes * size_t(L.cache->n_slots()));
    return out;
  }

  Status acquire(int layer, std::span<const int> ids,
                 std::span<model::ExpertWeights> out) override {
    Layer& L = layers_[size_t(layer)];
    SlotCache::Plan plan;
    if (!L.cache->plan(ids, &plan))
      return make_error("expert cache: " + std::to_string(ids.size()) +
                        " experts requested at once with " + std::to_string(L.cache->n_slots()) +
                        " slots for layer " + std::to_string(layer));
    stats_.requests += ids.size();
    stats_.hits += ids.size() - plan.miss.size();
    auto t0 = std::chrono::steady_clock::now();
    // One job per (miss, piece); each reads into its own slot range.
    struct Job {
      int file;
      uint64_t offset, n_bytes;
      uint8_t* dst;
      int expert, slot;
    };
    std::vector<Job> jobs;
    for (int i : plan.miss) {
      const ExpertLocation& loc = source_.layers[size_t(layer)][size_t(ids[size_t(i)])];
      uint8_t* slot = L.memory.get() + uint64_t(plan.slot[size_t(i)]) * L.slot_bytes;
      for (const ExpertPiece& p : loc.pieces)
        jobs.push_back({p.file, p.file_offset, p.n_bytes, slot + p.slot_offset, ids[size_t(i)],
                        plan.slot[size_t(i)]});
    }
    std::mutex mu;
    std::string failure;
    readers_.parallel_for(int64_t(jobs.size()), 1, [&](int64_t b, int64_t e) {
      for (int64_t j = b; j < e; ++j) {
        const Job& job = jobs[size_t(j)];
        uint64_t done = 0;
        while (done < job.n_bytes) {
          ssize_t r = ::pread(fds_[size_t(job.file)], job.dst + done, job.n_bytes - done,
                              off_t(job.offset + done));
          if (r <= 0) {
            std::lock_guard<std::mutex> lock(mu);
            failure = "reading expert " + std::to_string(job.expert) + " of layer " +
                      std::to_string(layer) + " from " + source_.files[size_t(job.file)] +
                      " at offset " + std::to_string(job.offset + done) + ": " +
                      (r == 0 ? std::string("unexpected end of file") : std::strerror(errno));
            break;
          }
          done += uint64_t(r);
        }
      }
    });
    stats_.io_us += std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    if (!failure.empty()) {
      for (const Job& job : jobs) L.cache->invalidate(job.slot);
      L.cache->unprotect_all();
      return make_error(failure);
    }
    for (const Job& job : jobs) stats_.bytes_read += job.n_bytes;
    for (size_t i = 0; i < ids.size(); ++i) {
      const ExpertLocation& loc = source_.layers[size_t(layer)][size_t(ids[i])];
      const uint8_t* slot = L.memory.get() + uint64_t(plan.slot[i]) * L.slot_bytes;
      model::ExpertWeights w = loc.layout;
      for (model::Matrix* m : {&w.gate, &w.up, &w.down})
        m->data = slot + reinterpret_cast<uintptr_t>(m->data);
      out[i] = w;
    }
    return {};
  }

  void release(int layer) override { layers_[size_t(layer)].cache->unprotect_all(); }

 private:
  struct Layer {
    std::unique_ptr<SlotCache> cache;
    std::unique_ptr<uint8_t, AlignedFree> memory;
    uint64_t slot_bytes = 0;
  };
  ExpertSource source_;
  StreamedOptions opt_;
  ThreadPool readers_;
  std::vector<int> fds_;
  std::vector<Layer> layers_;
};

}  // namespace

Result<std::unique_ptr<ExpertStore>> open_streamed_store(ExpertSource source,
                                                         StreamedOptions options) {
  auto s = std::make_unique<StreamedStore>(std::move(source), options);
  TS_TRY(s->open());
  return std::unique_ptr<ExpertStore>(std::move(s));
}

}  // namespace ts::experts
