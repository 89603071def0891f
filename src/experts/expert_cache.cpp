#include "experts/expert_cache.h"

#include <algorithm>

#include "core/status.h"

namespace ts::experts {

SlotCache::SlotCache(int n_slots, int n_experts, CachePolicy policy)
    : policy_(policy),
      slot_expert_(size_t(n_slots), -1),
      expert_slot_(size_t(n_experts), -1),
      last_use_(size_t(n_slots), 0),
      uses_(size_t(n_experts), 0),
      protected_(size_t(n_slots), false) {
  TS_CHECK(n_slots >= 1, "a cache needs at least one slot");
}

int SlotCache::victim() const {
  int best = -1;
  for (int s = 0; s < n_slots(); ++s) {
    if (protected_[size_t(s)]) continue;
    if (slot_expert_[size_t(s)] < 0) return s;  // an empty slot first
    if (best < 0) {
      best = s;
      continue;
    }
    const int e = slot_expert_[size_t(s)], be = slot_expert_[size_t(best)];
    bool better = policy_ == CachePolicy::kLru
                      ? last_use_[size_t(s)] < last_use_[size_t(best)]
                      : (uses_[size_t(e)] < uses_[size_t(be)] ||
                         (uses_[size_t(e)] == uses_[size_t(be)] &&
                          last_use_[size_t(s)] < last_use_[size_t(best)]));
    if (better) best = s;
  }
  return best;
}

bool SlotCache::plan(std::span<const int> ids, Plan* out) {
  // Count what is needed before changing anything.
  int hits_unprotected = 0, misses = 0, free_slots = 0;
  for (int id : ids) {
    int s = expert_slot_[size_t(id)];
    if (s < 0) ++misses;
    else if (!protected_[size_t(s)]) ++hits_unprotected;
  }
  for (int s = 0; s < n_slots(); ++s) free_slots += !protected_[size_t(s)];
  if (misses + hits_unprotected > free_slots) return false;

  out->slot.assign(ids.size(), -1);
  out->miss.clear();
  ++tick_;
  for (size_t i = 0; i < ids.size(); ++i) {  // hits first, so misses cannot evict them
    int s = expert_slot_[size_t(ids[i])];
    if (s < 0) continue;
    out->slot[i] = s;
    protected_[size_t(s)] = true;
    last_use_[size_t(s)] = tick_;
    ++uses_[size_t(ids[i])];
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    if (out->slot[i] >= 0) continue;
    int s = victim();
    TS_CHECK(s >= 0, "counted free slots above");
    if (slot_expert_[size_t(s)] >= 0) expert_slot_[size_t(slot_expert_[size_t(s)])] = -1;
    slot_expert_[size_t(s)] = ids[i];
    expert_slot_[size_t(ids[i])] = s;
    protected_[size_t(s)] = true;
    last_use_[size_t(s)] = tick_;
    ++uses_[size_t(ids[i])];
    out->slot[i] = s;
    out->miss.push_back(int(i));
  }
  return true;
}

void SlotCache::invalidate(int slot) {
  int e = slot_expert_[size_t(slot)];
  if (e >= 0) expert_slot_[size_t(e)] = -1;
  slot_expert_[size_t(slot)] = -1;
}

void SlotCache::unprotect_all() { std::fill(protected_.begin(), protected_.end(), false); }

std::vector<int> most_selected(std::span<const uint64_t> counts, int n) {
  std::vector<int> order;
  for (size_t e = 0; e < counts.size(); ++e)
    if (counts[e] > 0) order.push_back(int(e));
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return counts[size_t(a)] > counts[size_t(b)]; });
  order.resize(std::min(order.size(), size_t(std::max(0, n))));
  return order;
}

}  // namespace ts::experts
