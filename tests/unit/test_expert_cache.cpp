// SlotCache: LRU / LFU replacement and the protect invariant (a slot acquired by in-flight
// work is never a victim), on random request streams checked against a simple model; and the
// resident TableStore's copies.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <set>
#include <tuple>
#include <vector>

#include "experts/expert_cache.h"
#include "experts/expert_store.h"

namespace {

using ts::experts::CachePolicy;
using ts::experts::SlotCache;

TEST(SlotCache, LruEvictsLeastRecentlyUsed) {
  SlotCache c(2, 8, CachePolicy::kLru);
  SlotCache::Plan p;
  int a[] = {1}, b[] = {2}, d[] = {3};
  ASSERT_TRUE(c.plan(a, &p)); c.unprotect_all();
  ASSERT_TRUE(c.plan(b, &p)); c.unprotect_all();
  ASSERT_TRUE(c.plan(a, &p)); c.unprotect_all();  // 1 is now more recent than 2
  ASSERT_TRUE(c.plan(d, &p)); c.unprotect_all();
  EXPECT_EQ(p.miss.size(), 1u);
  EXPECT_GE(c.slot_of(1), 0);
  EXPECT_EQ(c.slot_of(2), -1);
  EXPECT_GE(c.slot_of(3), 0);
}

TEST(SlotCache, LfuEvictsLeastFrequentlyUsed) {
  SlotCache c(2, 8, CachePolicy::kLfu);
  SlotCache::Plan p;
  int a[] = {1}, b[] = {2}, d[] = {3};
  for (int i = 0; i < 3; ++i) { ASSERT_TRUE(c.plan(b, &p)); c.unprotect_all(); }
  ASSERT_TRUE(c.plan(a, &p)); c.unprotect_all();  // 1 is most recent but used once
  ASSERT_TRUE(c.plan(d, &p)); c.unprotect_all();
  EXPECT_EQ(c.slot_of(1), -1);
  EXPECT_GE(c.slot_of(2), 0);
}

TEST(SlotCache, ProtectedSlotsAreNeverEvictedAndOverflowIsRefused) {
  SlotCache c(3, 16, CachePolicy::kLru);
  SlotCache::Plan p;
  int first[] = {4, 5};
  ASSERT_TRUE(c.plan(first, &p));
  const int s4 = c.slot_of(4), s5 = c.slot_of(5);
  // Two more misses while 4 and 5 are protected: only one free slot -> refused, unchanged.
  int more[] = {6, 7};
  EXPECT_FALSE(c.plan(more, &p));
  EXPECT_EQ(c.slot_of(4), s4);
  EXPECT_EQ(c.slot_of(6), -1);
  int one[] = {6};
  ASSERT_TRUE(c.plan(one, &p));
  EXPECT_EQ(c.slot_of(4), s4);
  EXPECT_EQ(c.slot_of(5), s5);
  EXPECT_TRUE(c.is_protected(s4));
}

TEST(SlotCache, RandomStreamsKeepTheInvariants) {
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE(seed);
  std::mt19937 rng(seed);
  for (CachePolicy pol : {CachePolicy::kLru, CachePolicy::kLfu}) {
    const int n_slots = 1 + int(rng() % 6), n_experts = 16;
    SlotCache c(n_slots, n_experts, pol);
    std::set<int> prot;  // experts protected right now
    for (int step = 0; step < 2000; ++step) {
      if (rng() % 3 == 0) {
        c.unprotect_all();
        prot.clear();
      }
      std::vector<int> ids;
      const int k = 1 + int(rng() % 3);
      while (int(ids.size()) < k) {
        int e = int(rng() % n_experts);
        if (std::find(ids.begin(), ids.end(), e) == ids.end()) ids.push_back(e);
      }
      std::vector<int> before(n_experts);
      for (int e = 0; e < n_experts; ++e) before[size_t(e)] = c.slot_of(e);
      SlotCache::Plan p;
      bool ok = c.plan(ids, &p);
      std::set<int> want(prot);
      want.insert(ids.begin(), ids.end());
      EXPECT_EQ(ok, int(want.size()) <= n_slots);
      if (!ok) {
        for (int e = 0; e < n_experts; ++e) EXPECT_EQ(c.slot_of(e), before[size_t(e)]);
        continue;
      }
      for (int e : prot) EXPECT_EQ(c.slot_of(e), before[size_t(e)]) << "protected expert moved";
      for (size_t i = 0; i < ids.size(); ++i) {
        EXPECT_EQ(c.slot_of(ids[i]), p.slot[i]);
        bool was_cached = before[size_t(ids[i])] >= 0;
        bool listed_miss = std::find(p.miss.begin(), p.miss.end(), int(i)) != p.miss.end();
        EXPECT_EQ(listed_miss, !was_cached);
      }
      std::set<int> used_slots(p.slot.begin(), p.slot.end());
      EXPECT_EQ(used_slots.size(), ids.size()) << "two ids share a slot";
      prot = want;
    }
  }
}

}  // namespace

namespace {

// --residency resident: the copies hold the same bytes, each matrix at a 64-byte boundary of
// one region (marked for huge pages); a dense layer between (no experts) is skipped.
TEST(TableStore, ResidentCopiesAreEqualAndAligned) {
  std::mt19937 rng(7);
  std::vector<std::vector<uint8_t>> backing;
  ts::model::ExpertTable table(3);
  for (int l : {0, 2}) {  // layer 1: dense
    for (int e = 0; e < 5; ++e) {
      ts::model::ExpertWeights w;
      for (ts::model::Matrix* m : {&w.gate, &w.up, &w.down}) {
        // Odd sizes (F32 rows of 3 and 7 columns), so the next copy's start must be padded.
        *m = {nullptr, ts::DType::kF32, 5 + e, m == &w.down ? 7 : 3};
        backing.emplace_back(m->n_bytes());
        for (uint8_t& b : backing.back()) b = uint8_t(rng());
        m->data = backing.back().data();
      }
      table[size_t(l)].push_back(w);
    }
  }
  // The progress callback: once per layer (the dense one too), in order, bytes growing to
  // the padded total of the copies.
  std::vector<std::tuple<int, int, uint64_t>> progress;
  auto store = ts::experts::TableStore::resident(table, [&](int done, int total, uint64_t bytes) {
    progress.emplace_back(done, total, bytes);
  });
  ASSERT_TRUE(store.ok()) << store.error().message;
  ASSERT_EQ(progress.size(), 3u);
  uint64_t padded = 0;
  for (const auto& layer : table)
    for (const ts::model::ExpertWeights& w : layer)
      for (const ts::model::Matrix* m : {&w.gate, &w.up, &w.down})
        padded += (m->n_bytes() + 63) / 64 * 64;
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(std::get<0>(progress[size_t(i)]), i + 1);
    EXPECT_EQ(std::get<1>(progress[size_t(i)]), 3);
  }
  EXPECT_GT(std::get<2>(progress[0]), 0u);
  EXPECT_EQ(std::get<2>(progress[1]), std::get<2>(progress[0])) << "layer 1 has no experts";
  EXPECT_EQ(std::get<2>(progress[2]), padded);
  for (int l : {0, 2}) {
    std::vector<int> ids{0, 1, 2, 3, 4};
    std::vector<ts::model::ExpertWeights> out(ids.size());
    ASSERT_TRUE((*store)->acquire(l, ids, out).ok());
    for (size_t i = 0; i < ids.size(); ++i) {
      const ts::model::ExpertWeights& want = table[size_t(l)][i];
      for (auto [got, ref] : {std::pair{&out[i].gate, &want.gate}, std::pair{&out[i].up, &want.up},
                              std::pair{&out[i].down, &want.down}}) {
        EXPECT_NE(got->data, ref->data) << "a copy, not the source";
        EXPECT_EQ(reinterpret_cast<uintptr_t>(got->data) % 64, 0u) << "layer " << l;
        ASSERT_EQ(got->n_bytes(), ref->n_bytes());
        EXPECT_EQ(std::memcmp(got->data, ref->data, ref->n_bytes()), 0) << "layer " << l;
      }
    }
  }
  EXPECT_EQ((*store)->residency(), ts::experts::Residency::kResident);
}

}  // namespace
