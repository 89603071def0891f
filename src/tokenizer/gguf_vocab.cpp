#include "tokenizer/gguf_vocab.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <unordered_map>

#include "io/gguf.h"

namespace ts::tokenizer {
namespace {

using json = nlohmann::json;

// tokenizer.ggml.token_type values.
constexpr int kNormal = 1, kControl = 3, kUserDefined = 4;  // 2 unknown, 5 unused, 6 byte

// The split patterns of the Hugging Face tokenizer.json files these .pre values stand for.
constexpr const char* kQwen2Pattern =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| "
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
constexpr const char* kLlama3Pattern =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

json byte_level(bool use_regex) {
  return {{"type", "ByteLevel"},
          {"add_prefix_space", false},
          {"trim_offsets", false},
          {"use_regex", use_regex}};
}

json split_then_bytes(const char* pattern) {
  return {{"type", "Sequence"},
          {"pretokenizers", json::array({{{"type", "Split"},
                                          {"pattern", {{"Regex", pattern}}},
                                          {"behavior", "Isolated"},
                                          {"invert", false}},
                                         byte_level(false)})}};
}

// UTF-8 character boundaries of s (0 and s.size() included).
std::vector<size_t> char_bounds(const std::string& s) {
  std::vector<size_t> b;
  for (size_t i = 0; i < s.size(); ++i)
    if ((static_cast<unsigned char>(s[i]) & 0xC0) != 0x80) b.push_back(i);
  b.push_back(s.size());
  return b;
}

// Hugging Face's SentencePieceExtractor: for every piece, each split into two pieces of the
// vocab (ordered by their ids), then all merges ordered by the whole piece's score, highest
// first (a stable sort: ties keep vocabulary order).
std::vector<std::pair<std::string, std::string>> merges_from_scores(
    const std::vector<std::string>& tokens, const std::vector<double>& scores,
    const std::unordered_map<std::string, int>& ids) {
  struct Merge {
    int left, right;
    double score;
  };
  std::vector<Merge> merges;
  for (size_t t = 0; t < tokens.size(); ++t) {
    const std::string& piece = tokens[t];
    const std::vector<size_t> b = char_bounds(piece);
    std::vector<Merge> local;
    for (size_t i = 1; i + 1 < b.size(); ++i) {
      auto l = ids.find(piece.substr(0, b[i]));
      auto r = ids.find(piece.substr(b[i]));
      if (l != ids.end() && r != ids.end()) local.push_back({l->second, r->second, scores[t]});
    }
    std::sort(local.begin(), local.end(), [](const Merge& a, const Merge& b) {
      return a.left != b.left ? a.left < b.left : a.right < b.right;
    });
    merges.insert(merges.end(), local.begin(), local.end());
  }
  std::stable_sort(merges.begin(), merges.end(),
                   [](const Merge& a, const Merge& b) { return a.score > b.score; });
  std::vector<std::pair<std::string, std::string>> out;
  out.reserve(merges.size());
  for (const Merge& m : merges) out.emplace_back(tokens[size_t(m.left)], tokens[size_t(m.right)]);
  return out;
}

}  // namespace

Result<GgufVocab> read_gguf_vocab(const std::string& path) {
  TS_ASSIGN(io::GgufFile g, io::read_gguf(path));
  auto fail = [&](const std::string& key, const std::string& what) {
    return make_error(path + ": metadata '" + key + "' " + what);
  };
  auto boolean = [&](const std::string& key, bool fallback) -> Result<bool> {
    TS_ASSIGN(std::optional<bool> b, g.boolean(key));
    return b.value_or(fallback);
  };
  TS_ASSIGN(std::optional<std::string> model, g.string("tokenizer.ggml.model"));
  if (!model)
    return fail("tokenizer.ggml.model",
                "is missing (the file carries no tokenizer; give token "
                "ids with --tokens)");
  if (*model != "gpt2" && *model != "llama")
    return fail("tokenizer.ggml.model",
                "= '" + *model + "' is not supported (gpt2 byte-level BPE, llama SentencePiece)");
  TS_ASSIGN(std::vector<std::string> tokens, g.strings("tokenizer.ggml.tokens"));
  const int n = int(tokens.size());
  std::vector<double> types(tokens.size(), kNormal);
  if (g.find("tokenizer.ggml.token_type")) {
    TS_ASSIGN(types, g.numbers("tokenizer.ggml.token_type"));
    if (types.size() != tokens.size())
      return fail("tokenizer.ggml.token_type", "has " + std::to_string(types.size()) +
                                                   " entries for " + std::to_string(n) + " tokens");
  }
  auto id_key = [&](const std::string& key) -> Result<int> {
    TS_ASSIGN(std::optional<int64_t> v, g.integer(key));
    if (!v) return -1;
    const int64_t id = *v;
    if (id < 0 || id >= n)
      return fail(key, "= " + std::to_string(id) + " is not a token id (the vocabulary has " +
                           std::to_string(n) + ")");
    return int(id);
  };
  TS_ASSIGN(int bos, id_key("tokenizer.ggml.bos_token_id"));
  TS_ASSIGN(int eos, id_key("tokenizer.ggml.eos_token_id"));
  TS_ASSIGN(int eot, id_key("tokenizer.ggml.eot_token_id"));
  TS_ASSIGN(int eom, id_key("tokenizer.ggml.eom_token_id"));
  TS_ASSIGN(int unk, id_key("tokenizer.ggml.unknown_token_id"));
  const bool spm = *model == "llama";
  TS_ASSIGN(bool add_bos, boolean("tokenizer.ggml.add_bos_token", spm));
  TS_ASSIGN(bool add_space_prefix, boolean("tokenizer.ggml.add_space_prefix", spm));

  GgufVocab out;
  TokenizerJson& tj = out.tokenizer;
  tj.has_vocab = true;
  std::unordered_map<std::string, int> ids;
  ids.reserve(tokens.size());
  for (int i = 0; i < n; ++i)
    if (ids.emplace(tokens[size_t(i)], i).second) tj.vocab.emplace_back(tokens[size_t(i)], i);
  tj.has_merges = true;
  json root = json::object();
  json model_json = {{"type", "BPE"}};
  if (spm) {
    std::vector<double> scores(tokens.size(), 0.0);
    if (g.find("tokenizer.ggml.scores")) {
      TS_ASSIGN(scores, g.numbers("tokenizer.ggml.scores"));
      if (scores.size() != tokens.size())
        return fail("tokenizer.ggml.scores", "has " + std::to_string(scores.size()) +
                                                 " entries for " + std::to_string(n) + " tokens");
    }
    tj.merges = merges_from_scores(tokens, scores, ids);
    tj.merge_is_pair.assign(tj.merges.size(), true);
    model_json["byte_fallback"] = true;
    model_json["fuse_unk"] = true;
    if (unk >= 0) model_json["unk_token"] = tokens[size_t(unk)];
    json norm = json::array();
    if (add_space_prefix) norm.push_back({{"type", "Prepend"}, {"prepend", "\u2581"}});
    norm.push_back({{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "\u2581"}});
    root["normalizer"] = {{"type", "Sequence"}, {"normalizers", norm}};
    root["pre_tokenizer"] = nullptr;
    json dec =
        json::array({{{"type", "Replace"}, {"pattern", {{"String", "\u2581"}}}, {"content", " "}},
                     {{"type", "ByteFallback"}},
                     {{"type", "Fuse"}}});
    if (add_space_prefix)
      dec.push_back({{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}});
    root["decoder"] = {{"type", "Sequence"}, {"decoders", dec}};
  } else {
    TS_ASSIGN(std::vector<std::string> merges, g.strings("tokenizer.ggml.merges"));
    tj.merges.reserve(merges.size());
    for (size_t i = 0; i < merges.size(); ++i) {
      const size_t space = merges[i].find(' ', 1);
      if (space == std::string::npos) {
        tj.first_bad_merge = int64_t(i);
        return fail("tokenizer.ggml.merges",
                    "entry " + std::to_string(i) + " '" + merges[i] + "' is not \"left right\"");
      }
      tj.merges.emplace_back(merges[i].substr(0, space), merges[i].substr(space + 1));
    }
    tj.merge_is_pair.assign(tj.merges.size(), true);
    TS_ASSIGN(std::optional<std::string> pre, g.string("tokenizer.ggml.pre"));
    const std::string p = pre.value_or("default");
    if (p == "qwen2" || p == "deepseek-r1-qwen" || p == "stablelm2" || p == "hunyuan") {
      root["normalizer"] = {{"type", "NFC"}};
      root["pre_tokenizer"] = split_then_bytes(kQwen2Pattern);
    } else if (p == "llama-bpe" || p == "llama3" || p == "llama-v3") {
      root["pre_tokenizer"] = split_then_bytes(kLlama3Pattern);
      model_json["ignore_merges"] = true;
    } else if (p == "gpt-2" || p == "default" || p == "olmo") {
      root["pre_tokenizer"] = byte_level(true);
    } else {
      return fail("tokenizer.ggml.pre", "= '" + p +
                                            "' is not supported (qwen2, deepseek-r1-qwen, "
                                            "llama-bpe, gpt-2, olmo, default)");
    }
    root["decoder"] = byte_level(false);
  }
  root["model"] = model_json;
  if (add_bos && bos >= 0) {
    const std::string& b = tokens[size_t(bos)];
    root["post_processor"] = {
        {"type", "TemplateProcessing"},
        {"single", json::array({{{"SpecialToken", {{"id", b}, {"type_id", 0}}}},
                                {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
        {"special_tokens", {{b, {{"id", b}, {"ids", {bos}}, {"tokens", {b}}}}}}};
  }
  json added = json::array();
  for (int i = 0; i < n; ++i) {
    const int t = int(types[size_t(i)]);
    if (t != kControl && t != kUserDefined) continue;
    added.push_back({{"id", i},
                     {"content", tokens[size_t(i)]},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", t == kControl}});
  }
  root["added_tokens"] = added;
  tj.root = std::move(root);

  json& tcfg = out.tokenizer_config;
  if (bos >= 0) tcfg["bos_token"] = tokens[size_t(bos)];
  if (eos >= 0) tcfg["eos_token"] = tokens[size_t(eos)];
  if (unk >= 0) tcfg["unk_token"] = tokens[size_t(unk)];
  TS_ASSIGN(std::optional<std::string> tmpl, g.string("tokenizer.chat_template"));
  if (tmpl) tcfg["chat_template"] = *tmpl;
  // End of generation: the file's eos / eot / eom ids, and (as llama.cpp does) control tokens
  // whose text marks the end of a turn or of a text, which Hugging Face lists in
  // generation_config.json but GGUF metadata has no key for (Qwen's <|endoftext|> beside
  // <|im_end|>).
  std::vector<int> stop_ids = {eos, eot, eom};
  static const char* const kEndTexts[] = {"<|im_end|>",      "<|endoftext|>", "<|eot_id|>",
                                          "<|end_of_text|>", "<|end|>",       "<end_of_turn>",
                                          "<|eom_id|>",      "<EOT>"};
  for (int i = 0; i < n; ++i)
    if (int(types[size_t(i)]) == kControl)
      for (const char* t : kEndTexts)
        if (tokens[size_t(i)] == t) stop_ids.push_back(i);
  json stop = json::array();
  for (int id : stop_ids)
    if (id >= 0 && std::find(stop.begin(), stop.end(), json(id)) == stop.end()) stop.push_back(id);
  if (!stop.empty()) out.generation_config["eos_token_id"] = stop;
  return out;
}

}  // namespace ts::tokenizer
