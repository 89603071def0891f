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
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/status.h"

namespace ts::tokenizer {

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using VocabMap = std::unordered_map<std::string, int, StringHash, std::equal_to<>>;

class BpeModel {
 public:
  // `j` is the "model" object; `where` names it for errors ("DIR/tokenizer.json: model").
  static Result<std::unique_ptr<BpeModel>> parse(const nlohmann::json& j,
                                                 const std::string& where);

  // Appends the ids of one pre-tokenized word. Precondition: valid UTF-8.
  void tokenize(std::string_view word, std::vector<int>& out) const;

  std::optional<int> token_to_id(std::string_view token) const;
  // Empty string_view for an id with no entry.
  std::string_view id_to_token(int id) const;
  // One past the largest id in the vocab.
  int size() const { return int(id_to_token_.size()); }

 private:
  static constexpr size_t kMaxCachedBytes = 256;
  static constexpr size_t kMaxCacheEntries = 1 << 16;

  void merge_word(std::string_view word, std::vector<int>& out) const;

  VocabMap vocab_;
  std::vector<std::string> id_to_token_;
  struct MergeInfo {
    int rank;
    int new_id;
  };
  std::unordered_map<uint64_t, MergeInfo> merges_;  // (left id << 32 | right id) -> merge
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
