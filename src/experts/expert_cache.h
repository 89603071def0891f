// The slot bookkeeping of a streamed expert cache for one layer: which expert sits in which
// slot, the replacement policy (LRU or LFU), and the protect set. Pure logic, no I/O, so it
// is tested on its own.
//
// Invariant: a protected slot (one that in-flight work still reads) is never chosen as a
// victim; when every slot is protected, plan() reports that the request must be split.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace ts::experts {

enum class CachePolicy : uint8_t { kLru, kLfu };

class SlotCache {
 public:
  SlotCache(int n_slots, int n_experts, CachePolicy policy);

  struct Plan {
    std::vector<int> slot;  // per requested id: its slot
    std::vector<int> miss;  // indices into the request whose slot must be (re)loaded
  };
  // Assigns a slot to every id (distinct ids), protecting them until unprotect_all().
  // Returns false (and changes nothing) if more ids than unprotected-or-matching slots.
  bool plan(std::span<const int> ids, Plan* out);
  void unprotect_all();
  // Forgets the expert in `slot` (after a failed load), leaving the slot empty.
  void invalidate(int slot);

  int n_slots() const { return int(slot_expert_.size()); }
  int slot_of(int expert) const { return expert_slot_[size_t(expert)]; }
  bool is_protected(int slot) const { return protected_[size_t(slot)]; }

 private:
  int victim() const;  // an unprotected slot by policy, or -1

  CachePolicy policy_;
  uint64_t tick_ = 0;
  std::vector<int> slot_expert_;     // [n_slots] expert id or -1
  std::vector<int> expert_slot_;     // [n_experts] slot or -1
  std::vector<uint64_t> last_use_;   // [n_slots]
  std::vector<uint64_t> uses_;       // [n_experts] request count (LFU keeps it across evictions)
  std::vector<bool> protected_;      // [n_slots]
};

// --cache-warm: the experts of one layer with a positive count, most selected first (ties:
// lower id), at most n of them.
std::vector<int> most_selected(std::span<const uint64_t> counts, int n);

}  // namespace ts::experts
