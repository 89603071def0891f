#include "experts/expert_store.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>

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

namespace {
constexpr uint64_t kAlign = 4096;  // O_DIRECT's unit: streamed slots and their pieces
constexpr uint64_t kHugePage = uint64_t(2) << 20;
uint64_t round_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }
}  // namespace

std::unique_ptr<TableStore> TableStore::mapped(model::ExpertTable table) {
  return std::unique_ptr<TableStore>(new TableStore(std::move(table), Residency::kMapped));
}

Result<std::unique_ptr<TableStore>> TableStore::resident(const model::ExpertTable& table,
                                                         const LayerProgress& on_layer) {
  std::unique_ptr<TableStore> s(new TableStore(table, Residency::kResident));
  // One region for every copy, 2 MiB aligned and marked for transparent huge pages, each
  // matrix at a 64-byte boundary: decode streams a few experts' matrices per layer, and on
  // 4 KiB pages their translations miss the TLB (docs/PERF.md, "Huge pages for the CPU's
  // weights").
  constexpr uint64_t kAlignMatrix = 64;
  uint64_t total = 0;
  for (const auto& layer : s->table_)
    for (const model::ExpertWeights& e : layer)
      for (const model::Matrix* m : {&e.gate, &e.up, &e.down})
        total += round_up(m->n_bytes(), kAlignMatrix);
  if (total == 0) return s;
  total = round_up(total, kHugePage);
  auto* mem = static_cast<uint8_t*>(std::aligned_alloc(kHugePage, total));
  if (!mem)
    return make_error("--residency resident: cannot allocate " + std::to_string(total) +
                      " bytes for the routed experts; use --residency mapped or streamed");
  ::madvise(mem, total, MADV_HUGEPAGE);  // a hint; ignored where THP is off
  s->owned_.reset(mem);
  uint64_t at = 0;
  for (auto& layer : s->table_) {
    for (model::ExpertWeights& e : layer) {
      for (model::Matrix* m : {&e.gate, &e.up, &e.down}) {
        std::memcpy(mem + at, m->data, m->n_bytes());
        m->data = mem + at;
        at += round_up(m->n_bytes(), kAlignMatrix);
      }
    }
    if (on_layer) on_layer(int(&layer - s->table_.data()) + 1, int(s->table_.size()), at);
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

class StreamedStore final : public ExpertStore {
 public:
  StreamedStore(ExpertSource source, StreamedOptions opt)
      : source_(std::move(source)), opt_(opt), readers_(opt.io_threads),
        driver_([this] { drive(); }) {}
  ~StreamedStore() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    driver_.join();
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

  int max_batch(int layer) const override {
    const Layer& L = layers_[size_t(layer)];
    return L.cache ? L.cache->n_slots() : 0;  // 0: a dense layer, no experts
  }
  Residency residency() const override { return Residency::kStreamed; }
  std::vector<std::span<uint8_t>> slot_memory() const override {
    std::vector<std::span<uint8_t>> out;
    for (const Layer& L : layers_)
      if (L.memory) out.emplace_back(L.memory.get(), L.slot_bytes * size_t(L.cache->n_slots()));
    return out;
  }

  Status acquire(int layer, std::span<const int> ids,
                 std::span<model::ExpertWeights> out) override {
    TS_TRY(acquire_begin(layer, ids, out));
    for (size_t i = 0; i < ids.size(); ++i) TS_TRY(wait_ready(layer, i));
    return {};
  }

  Status acquire_begin(int layer, std::span<const int> ids,
                       std::span<model::ExpertWeights> out) override {
    finish_batch();  // a batch not released: its reads must end before slots move
    Layer& L = layers_[size_t(layer)];
    SlotCache::Plan plan;
    if (!L.cache->plan(ids, &plan))
      return make_error("expert cache: " + std::to_string(ids.size()) +
                        " experts requested at once with " + std::to_string(L.cache->n_slots()) +
                        " slots for layer " + std::to_string(layer));
    std::lock_guard<std::mutex> lock(mu_);
    stats_.requests += ids.size();
    stats_.hits += ids.size() - plan.miss.size();
    batch_ = Batch{};
    batch_.layer = layer;
    batch_.remaining.assign(ids.size(), 0);
    // One job per (miss, piece); each reads into its own slot range.
    for (int i : plan.miss) {
      const ExpertLocation& loc = source_.layers[size_t(layer)][size_t(ids[size_t(i)])];
      uint8_t* slot = L.memory.get() + uint64_t(plan.slot[size_t(i)]) * L.slot_bytes;
      for (const ExpertPiece& p : loc.pieces) {
        batch_.jobs.push_back({p.file, p.file_offset, p.n_bytes, slot + p.slot_offset,
                               ids[size_t(i)], plan.slot[size_t(i)], i});
        ++batch_.remaining[size_t(i)];
      }
    }
    for (size_t i = 0; i < ids.size(); ++i) {
      const ExpertLocation& loc = source_.layers[size_t(layer)][size_t(ids[i])];
      const uint8_t* slot = L.memory.get() + uint64_t(plan.slot[i]) * L.slot_bytes;
      model::ExpertWeights w = loc.layout;
      for (model::Matrix* m : {&w.gate, &w.up, &w.down})
        m->data = slot + reinterpret_cast<uintptr_t>(m->data);
      out[i] = w;
    }
    batch_.done = batch_.jobs.empty();
    if (!batch_.done) cv_.notify_all();  // the driver starts the reads
    return {};
  }

  StoreStats stats() const override {
    std::lock_guard<std::mutex> lock(mu_);  // the readers count bytes as they land
    return stats_;
  }

  Status warm(int layer, std::span<const int> ids) override {
    if (!layers_[size_t(layer)].cache || ids.empty()) return {};
    const StoreStats before = stats();
    std::vector<model::ExpertWeights> views(ids.size());
    TS_TRY(acquire(layer, ids, views));
    release(layer);
    std::lock_guard<std::mutex> lock(mu_);
    stats_ = before;
    return {};
  }

  bool ready(int layer, size_t i) const override {
    (void)layer;
    std::lock_guard<std::mutex> lock(mu_);
    return i < batch_.remaining.size() && batch_.remaining[i] == 0 && batch_.failure.empty();
  }

  Status wait_ready(int layer, size_t i) override {
    (void)layer;
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return batch_.done || batch_.remaining[i] == 0 || !batch_.failure.empty(); });
    if (batch_.failure.empty()) return {};
    cv_.wait(lock, [&] { return batch_.done; });
    give_up(lock);
    return make_error(batch_.failure);
  }

  void release(int layer) override {
    finish_batch();
    layers_[size_t(layer)].cache->unprotect_all();
  }

 private:
  struct Job {
    int file;
    uint64_t offset, n_bytes;
    uint8_t* dst;
    int expert, slot, index;  // index: into the batch's ids
  };
  // The reads of the batch in flight (at most one: a batch is released before the next).
  struct Batch {
    int layer = -1;
    std::vector<Job> jobs;
    std::vector<int> remaining;  // per ids index: pieces not yet read
    std::string failure;
    bool done = true;            // every job has ended
    bool given_up = false;
    bool running = false;        // taken by the driver
  };

  // The driver thread runs each batch's reads on the reader pool, counting pieces down as
  // they land, so the session computes on ready experts meanwhile.
  void drive() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || (!batch_.done && !batch_.running); });
      if (stop_) return;
      batch_.running = true;
      const int layer = batch_.layer;
      // Nothing rewrites the jobs until the batch is done (acquire_begin waits for that).
      const std::vector<Job>& jobs = batch_.jobs;
      lock.unlock();
      const auto t0 = std::chrono::steady_clock::now();
      readers_.parallel_for(int64_t(jobs.size()), 1, [&](int64_t b, int64_t e) {
        for (int64_t j = b; j < e; ++j) {
          const Job& job = jobs[size_t(j)];
          std::string error = read_job(job, layer);
          std::lock_guard<std::mutex> guard(mu_);
          if (!error.empty()) {
            if (batch_.failure.empty()) batch_.failure = error;
          } else {
            --batch_.remaining[size_t(job.index)];
            stats_.bytes_read += job.n_bytes;
          }
          cv_.notify_all();
        }
      });
      lock.lock();
      stats_.io_us +=
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
      batch_.done = true;
      batch_.running = false;
      cv_.notify_all();
    }
  }

  // Reads one piece; the error text names the expert, layer, file and offset.
  std::string read_job(const Job& job, int layer) const {
    uint64_t done = 0;
    while (done < job.n_bytes) {
      ssize_t r = ::pread(fds_[size_t(job.file)], job.dst + done, job.n_bytes - done,
                          off_t(job.offset + done));
      if (r <= 0)
        return "reading expert " + std::to_string(job.expert) + " of layer " +
               std::to_string(layer) + " from " + source_.files[size_t(job.file)] +
               " at offset " + std::to_string(job.offset + done) + ": " +
               (r == 0 ? std::string("unexpected end of file") : std::strerror(errno));
      done += uint64_t(r);
    }
    return {};
  }

  // After a failed read (the batch is done): no slot of the batch keeps an expert it may
  // not hold, and nothing stays protected.
  void give_up(std::unique_lock<std::mutex>&) {
    if (batch_.given_up) return;
    batch_.given_up = true;
    Layer& L = layers_[size_t(batch_.layer)];
    for (const Job& job : batch_.jobs) L.cache->invalidate(job.slot);
    L.cache->unprotect_all();
  }

  // Waits for the batch in flight, if any, to end.
  void finish_batch() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return batch_.done; });
    if (!batch_.failure.empty()) give_up(lock);
  }

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
  mutable std::mutex mu_;
  std::condition_variable cv_;
  Batch batch_;
  bool stop_ = false;
  std::thread driver_;  // last: it starts in the constructor and uses the members above
};

}  // namespace

Result<std::unique_ptr<ExpertStore>> open_streamed_store(ExpertSource source,
                                                         StreamedOptions options) {
  auto s = std::make_unique<StreamedStore>(std::move(source), options);
  TS_TRY(s->open());
  return std::unique_ptr<ExpertStore>(std::move(s));
}

}  // namespace ts::experts
