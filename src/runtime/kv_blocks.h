// The paged KV cache's block bookkeeping (no KV data; Session owns the rows): which blocks are
// free, how many sequences hold each, and which hold the rows of a known token prefix — the
// prefix cache. A block's rows depend only on the tokens at and before its positions, so a
// whole block is named exactly by its parent block (the one before it in the sequence) and
// its own kTokens tokens; a sequence that starts with the same tokens shares it instead of
// computing it again. Shared blocks are whole and sequences only append after them, so no
// block is ever written while shared (no copy on write needed).
//
// A block no sequence holds that names a prefix stays cached and is given up, least recently
// used first, when a block is needed. Every time a block is taken for new rows its generation
// moves on, and a name records its parent's generation, so the name of a block whose parent
// was given up can never be found again.
#pragma once

#include <array>
#include <cstdint>
#include <set>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

namespace ts::runtime {

class KvBlocks {
 public:
  static constexpr int kTokens = 16;  // positions per block

  explicit KvBlocks(int n_blocks);
  int n_blocks() const { return int(refs_.size()); }
  // Blocks a sequence may take: free ones and cached ones nobody holds.
  int64_t available() const { return int64_t(free_.size() + lru_.size()); }
  int64_t held() const { return n_blocks() - available(); }
  int64_t cached() const { return int64_t(lru_.size()); }  // cached, held by no sequence

  // A block for new rows, held once: a free one, else the least recently used cached one
  // (its prefix forgotten); -1 when every block is held.
  int take();
  void hold(int b);     // one more sequence holds b (a found prefix block)
  void release(int b);  // one fewer; at none, b is cached if it names a prefix, else free

  // The block holding the rows of `tokens` (kTokens of them) after block `parent` (-1: the
  // first block of a sequence), or -1.
  int find(int parent, std::span<const int> tokens) const;
  // Block b (held) now holds the final rows of `tokens` after `parent`: later sequences may
  // find it. Ignored where another block already names that prefix.
  void remember(int b, int parent, std::span<const int> tokens);

 private:
  struct Name {
    int parent;
    uint32_t parent_generation;
    std::array<int, kTokens> tokens;
    bool operator==(const Name&) const = default;
  };
  struct NameHash {
    size_t operator()(const Name& n) const;
  };
  Name name(int parent, std::span<const int> tokens) const;

  std::vector<int> refs_;                   // sequences holding each block
  std::vector<uint32_t> generation_;        // moves on each time the block is taken
  std::vector<uint64_t> last_use_;          // tick of the last hold or release
  std::vector<bool> named_;                 // the block is in by_name_
  std::vector<Name> name_of_;               // its name, where named_
  std::vector<int> free_;                   // taken from the back
  std::set<std::pair<uint64_t, int>> lru_;  // named blocks no sequence holds, oldest first
  std::unordered_map<Name, int, NameHash> by_name_;
  uint64_t tick_ = 0;
};

// The pool that holds `sequences` sequences of `positions` each (whole blocks per sequence).
inline int64_t kv_pool_tokens(int64_t positions, int64_t sequences) {
  return (positions + KvBlocks::kTokens - 1) / KvBlocks::kTokens * KvBlocks::kTokens * sequences;
}

}  // namespace ts::runtime
