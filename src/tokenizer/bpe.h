// The BPE model of tokenizer.json ("model": {"type": "BPE", ...}): vocab, ranked merges,
// unk / fuse_unk, byte_fallback (<0xXX> tokens, SentencePiece style), ignore_merges,
// continuing_subword_prefix and end_of_word_suffix. Merges may be "a b" strings or
// ["a", "b"] arrays.
//
// Algorithm (Hugging Face's Word::merge_all): the word starts as one symbol per code point;
// a min-heap holds candidate merges keyed by (rank, position); the lowest is applied, stale
// heap entries are skipped, and the new neighbours' pairs are pushed. O(n log n) per word,
// so a 2,000-character word without pre-tokenizer splits (Llama-2) stays fast.
// Results for words shorter than kMaxCachedBytes are cached; the cache is behind a mutex,
// so tokenize() may be called from several threads.
#pragma once

#include <cstdint>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/status.h"
#include "tokenizer/tokenizer_json.h"

namespace ts::tokenizer {

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using VocabMap = std::unordered_map<std::string, int, StringHash, std::equal_to<>>;

// Open-addressing index from strings to their position in a vector (which it does not own).
// Flat slots with a hash tag, so a lookup is about one cache miss plus the string compare;
// std::unordered_map made loading gpt-oss's 446k merges (three lookups each) take ~0.5 s.
class StringIndex {
 public:
  void build(const std::vector<std::string>& keys);
  int find(std::string_view key) const;  // -1 when absent

 private:
  const std::vector<std::string>* keys_ = nullptr;
  std::vector<uint64_t> slots_;  // (hash tag << 32) | (position + 1); 0 = empty
  size_t mask_ = 0;
};

class BpeModel {
 public:
  // Reads the "model" object of `file` (its vocab and merges are moved out of `file`).
  // `where` names it for errors ("DIR/tokenizer.json: model").
  static Result<std::unique_ptr<BpeModel>> parse(TokenizerJson& file, const std::string& where);

  // Appends the ids of one pre-tokenized word. Precondition: valid UTF-8.
  void tokenize(std::string_view word, std::vector<int>& out) const;

  std::optional<int> token_to_id(std::string_view token) const;
  // Empty string_view for an id with no entry.
  std::string_view id_to_token(int id) const;
  // One past the largest id in the vocab.
  int size() const { return int(id_to_entry_.size()); }

 private:
  static constexpr size_t kMaxCachedBytes = 256;
  static constexpr size_t kMaxCacheEntries = 1 << 16;

  struct MergeInfo {
    int rank;
    int new_id;
  };
  // (left id, right id) -> merge, open addressing.
  class PairMap {
   public:
    void reserve(size_t n);
    void put(uint64_t key, MergeInfo v);  // a repeated key keeps the later value
    const MergeInfo* find(uint64_t key) const;

   private:
    static constexpr uint64_t kEmpty = ~uint64_t(0);
    size_t slot(uint64_t key) const;
    std::vector<uint64_t> keys_;
    std::vector<MergeInfo> values_;
    size_t mask_ = 0;
  };

  void merge_word(std::string_view word, std::vector<int>& out) const;

  std::vector<std::string> tokens_;  // vocab entries
  std::vector<int> entry_ids_;       // id of each entry
  std::vector<int> id_to_entry_;     // entry of each id, -1 for gaps
  StringIndex index_;
  PairMap merges_;
  std::optional<int> unk_id_;
  bool fuse_unk_ = false;
  bool byte_fallback_ = false;
  bool ignore_merges_ = false;
  std::string continuing_subword_prefix_;
  std::string end_of_word_suffix_;
  int byte_ids_[256];  // id of "<0xXX>", or -1

  mutable std::mutex cache_mu_;
  mutable std::unordered_map<std::string, std::vector<int>, StringHash, std::equal_to<>> cache_;
};

}  // namespace ts::tokenizer
