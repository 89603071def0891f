#include "runtime/kv_blocks.h"

#include <algorithm>

#include "core/status.h"

namespace ts::runtime {

KvBlocks::KvBlocks(int n_blocks)
    : refs_(size_t(n_blocks), 0),
      generation_(size_t(n_blocks), 0),
      last_use_(size_t(n_blocks), 0),
      named_(size_t(n_blocks), false),
      name_of_(size_t(n_blocks)) {
  for (int b = n_blocks - 1; b >= 0; --b) free_.push_back(b);  // block 0 first
}

size_t KvBlocks::NameHash::operator()(const Name& n) const {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a over the fields
  const auto mix = [&](uint64_t v) {
    h ^= v;
    h *= 0x100000001b3ull;
  };
  mix(uint64_t(uint32_t(n.parent)));
  mix(n.parent_generation);
  for (int t : n.tokens) mix(uint64_t(uint32_t(t)));
  return size_t(h);
}

KvBlocks::Name KvBlocks::name(int parent, std::span<const int> tokens) const {
  TS_CHECK(tokens.size() == size_t(kTokens), "a block is named by kTokens tokens");
  Name n{.parent = parent,
         .parent_generation = parent >= 0 ? generation_[size_t(parent)] : 0,
         .tokens = {}};
  std::copy(tokens.begin(), tokens.end(), n.tokens.begin());
  return n;
}

int KvBlocks::take() {
  int b;
  if (!free_.empty()) {
    b = free_.back();
    free_.pop_back();
  } else if (!lru_.empty()) {
    b = lru_.begin()->second;
    lru_.erase(lru_.begin());
    by_name_.erase(name_of_[size_t(b)]);
    named_[size_t(b)] = false;
  } else {
    return -1;
  }
  ++generation_[size_t(b)];
  refs_[size_t(b)] = 1;
  last_use_[size_t(b)] = ++tick_;
  return b;
}

void KvBlocks::hold(int b) {
  if (refs_[size_t(b)]++ == 0) lru_.erase({last_use_[size_t(b)], b});
  last_use_[size_t(b)] = ++tick_;
}

void KvBlocks::release(int b) {
  TS_CHECK(refs_[size_t(b)] > 0, "released a block no sequence holds");
  last_use_[size_t(b)] = ++tick_;
  if (--refs_[size_t(b)] > 0) return;
  if (named_[size_t(b)])
    lru_.insert({last_use_[size_t(b)], b});
  else
    free_.push_back(b);
}

int KvBlocks::find(int parent, std::span<const int> tokens) const {
  auto it = by_name_.find(name(parent, tokens));
  return it == by_name_.end() ? -1 : it->second;
}

void KvBlocks::remember(int b, int parent, std::span<const int> tokens) {
  if (named_[size_t(b)]) return;
  Name n = name(parent, tokens);
  if (by_name_.contains(n)) return;
  by_name_.emplace(n, b);
  name_of_[size_t(b)] = n;
  named_[size_t(b)] = true;
}

}  // namespace ts::runtime
