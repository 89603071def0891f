// ExpertStore: where each routed expert (layer, expert) lives, and the one way the forward
// pass reaches its weights. acquire() returns an address table (weight views) for the
// experts a step needs; kernels compute on those views and never learn the residency.
//
// Modes (--residency):
//   resident  every expert copied into process memory at load;
//   mapped    views point into the memory-mapped files; the OS page cache decides;
//   streamed  a fixed number of cache slots per layer, misses read with pread (optionally
//             O_DIRECT) by reader threads; slots acquired by in-flight work are protected.
#pragma once

#include <climits>
#include <cstdlib>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/status.h"
#include "experts/expert_cache.h"
#include "model/weights.h"

namespace ts::experts {

enum class Residency : uint8_t { kResident, kMapped, kStreamed };
// Progress of work done layer by layer (weights copied at load): (layers done, layers, bytes).
using LayerProgress = std::function<void(int, int, uint64_t)>;
Result<Residency> parse_residency(const std::string& s);
std::string_view residency_name(Residency r);

struct StoreStats {
  uint64_t requests = 0;    // experts asked for by acquire()
  uint64_t hits = 0;        // of those, already in memory
  uint64_t bytes_read = 0;  // read from storage by the store itself
  double io_us = 0;         // wall time spent waiting for reads
  // What was counted after `base`, an earlier reading of the same counters.
  StoreStats since(const StoreStats& base) const {
    return {requests - base.requests, hits - base.hits, bytes_read - base.bytes_read,
            io_us - base.io_us};
  }
};

class ExpertStore {
 public:
  virtual ~ExpertStore() = default;
  // Fills out[i] with the weights of expert ids[i] of `layer` (ids distinct, at most
  // max_batch(layer) of them). Views stay valid and their slots protected until release().
  virtual Status acquire(int layer, std::span<const int> ids,
                         std::span<model::ExpertWeights> out) = 0;
  virtual void release(int layer) { (void)layer; }
  // acquire() in two steps, so compute can start on the experts already in memory while the
  // others are still being read: acquire_begin() plans and starts the reads and fills out[]
  // (a view is usable once its expert is ready); wait_ready(layer, i) blocks until ids[i]
  // is in. A failed read makes wait_ready return the error (the batch is then given up:
  // its slots invalidated, nothing protected); release() waits for reads still in flight.
  virtual Status acquire_begin(int layer, std::span<const int> ids,
                               std::span<model::ExpertWeights> out) {
    return acquire(layer, ids, out);
  }
  virtual bool ready(int layer, size_t i) const {
    (void)layer;
    (void)i;
    return true;
  }
  virtual Status wait_ready(int layer, size_t i) {
    (void)layer;
    (void)i;
    return {};
  }
  // The most experts one acquire() may hold at once (the cache's slots per layer).
  virtual int max_batch(int layer) const {
    (void)layer;
    return INT_MAX;
  }
  virtual StoreStats stats() const { return stats_; }
  // --cache-warm: brings ids (at most max_batch(layer)) into the layer's cache before the
  // first token, not counted in the statistics. Stores without a cache do nothing.
  virtual Status warm(int layer, std::span<const int> ids) {
    (void)layer;
    (void)ids;
    return {};
  }
  virtual Residency residency() const = 0;
  // The memory the store reads experts into (the streamed store's slots; empty for others),
  // e.g. for a GPU backend to pin it so copies from the slots run at the link's rate.
  virtual std::vector<std::span<uint8_t>> slot_memory() const { return {}; }

 protected:
  StoreStats stats_;
};

// Where one expert's bytes are in the source files, and how they sit in a slot.
struct ExpertPiece {
  int file = 0;              // index into ExpertSource::files
  uint64_t file_offset = 0;  // bytes
  uint64_t n_bytes = 0;
  uint64_t slot_offset = 0;  // where the piece goes in the slot
};
struct ExpertLocation {
  std::vector<ExpertPiece> pieces;  // gate, up, down (safetensors) or one blob (pack)
  model::ExpertWeights layout;      // dtype/shape; data = slot-relative offset
  uint64_t slot_bytes = 0;
};
struct ExpertSource {
  std::vector<std::string> files;
  std::vector<std::vector<ExpertLocation>> layers;  // [layer][expert]; empty for dense layers
};

// Frees the stores' aligned_alloc'd memory (resident copies, streamed slots).
struct AlignedFree {
  void operator()(uint8_t* p) const { std::free(p); }
};

// Every expert addressable through a table (resident copies or the mapping itself).
class TableStore final : public ExpertStore {
 public:
  // mapped: views into the mapping as given.
  static std::unique_ptr<TableStore> mapped(model::ExpertTable table);
  // resident: copies every expert into memory owned by the store (an error, naming the size,
  // where that memory cannot be had); on_layer, if set, after each layer's copies (layers
  // done, layers, bytes copied so far).
  static Result<std::unique_ptr<TableStore>> resident(const model::ExpertTable& table,
                                                      const LayerProgress& on_layer = {});
  Status acquire(int layer, std::span<const int> ids,
                 std::span<model::ExpertWeights> out) override;
  Residency residency() const override { return residency_; }

 private:
  TableStore(model::ExpertTable table, Residency r) : table_(std::move(table)), residency_(r) {}
  model::ExpertTable table_;
  Residency residency_;
  std::unique_ptr<uint8_t, AlignedFree> owned_;  // resident: every copy, in one region
};

struct StreamedOptions {
  int slots_per_layer = 8;
  CachePolicy policy = CachePolicy::kLru;
  bool direct_io = false;
  int io_threads = 4;
};

// Opens the source files and allocates the slots. Errors: unreadable files, or O_DIRECT on
// pieces that are not 4096-byte aligned (use a pack).
Result<std::unique_ptr<ExpertStore>> open_streamed_store(ExpertSource source,
                                                         StreamedOptions options);

}  // namespace ts::experts
