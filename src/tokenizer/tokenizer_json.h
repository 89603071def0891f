// Reading tokenizer.json fast. The file is 2-30 MB, almost all of it model.vocab (up to
// 200k entries) and model.merges (up to 450k pairs). Building nlohmann's DOM for those
// costs a tree node per entry and two strings per merge (about 1 s for gpt-oss); this
// SAX reader builds the DOM for everything else and streams those two into flat vectors.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "core/status.h"

namespace ts::tokenizer {

struct TokenizerJson {
  nlohmann::json root;  // the whole file except model.vocab (object form) and model.merges
  bool has_vocab = false;
  std::vector<std::pair<std::string, int64_t>> vocab;  // model.vocab, in file order
  bool vocab_ids_are_integers = true;
  bool has_merges = false;
  // model.merges: ["left", "right"] entries as they are; a "left right" string entry is
  // kept whole in .first, with merge_is_pair false.
  std::vector<std::pair<std::string, std::string>> merges;
  std::vector<bool> merge_is_pair;
  int64_t first_bad_merge = -1;  // index of an entry that is neither form
};

// `path` is used for reading and in error messages.
Result<TokenizerJson> read_tokenizer_json(const std::string& path);

// The whole file as bytes, or an error naming it.
Result<std::string> read_file_bytes(const std::string& path);

}  // namespace ts::tokenizer
