// Tokenizer loading, the encode pipeline, decode and the stream decoder; see tokenizer.h.
#include "tokenizer/tokenizer.h"

#include <filesystem>
#include <nlohmann/json.hpp>
#include <unordered_map>

#include "io/gguf.h"
#include "tokenizer/added_vocab.h"
#include "tokenizer/bpe.h"
#include "tokenizer/decoder.h"
#include "tokenizer/gguf_vocab.h"
#include "tokenizer/json_util.h"
#include "tokenizer/normalizer.h"
#include "tokenizer/pre_tokenizer.h"
#include "tokenizer/tokenizer_json.h"
#include "tokenizer/utf8.h"

namespace ts::tokenizer {

namespace fs = std::filesystem;
using nlohmann::json;

struct Tokenizer::Impl {
  Normalizer normalizer;
  PreTokenizer pre_tokenizer;
  std::unique_ptr<BpeModel> model;
  AddedTokenMatcher raw_added;         // normalized=false: matched in the input
  AddedTokenMatcher normalized_added;  // normalized=true: matched after normalization
  std::unordered_map<int, AddedToken> added_by_id;
  VocabMap added_by_content;
  std::vector<int> post_prefix, post_suffix;  // post-processor ids around the sequence
  Decoder decoder;
};

namespace {

Result<json> read_json(const fs::path& path) {
  TS_ASSIGN(std::string bytes, read_file_bytes(path.string()));
  json j = json::parse(bytes, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return make_error(path.string() + ": not valid JSON");
  return j;
}

// tokenizer_config.json writes a token as "text", null, or {"content": "text", ...}.
std::string config_token(const json& cfg, const char* key) {
  auto it = cfg.find(key);
  if (it == cfg.end()) return {};
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content") && (*it)["content"].is_string())
    return (*it)["content"].get<std::string>();
  return {};
}

// A token id as a file writes it: an integer in [0, 2^31).
bool is_token_id(const json& v) {
  return v.is_number_integer() && v.get<int64_t>() >= 0 && v.get<int64_t>() <= INT32_MAX;
}

struct PostProcess {
  std::vector<int> prefix, suffix;
};

Status parse_post_processor(const json& j, const std::string& where, PostProcess& pp) {
  if (j.is_null()) return {};
  TS_ASSIGN(std::string type, json_string(j, "type", where));
  if (type == "Sequence") {
    TS_ASSIGN(const json* list, json_array(j, "processors", where));
    for (size_t i = 0; i < list->size(); ++i)
      TS_TRY(
          parse_post_processor((*list)[i], where + ".processors[" + std::to_string(i) + "]", pp));
    return {};
  }
  if (type == "ByteLevel") return {};  // only trims offsets; adds no ids
  std::vector<int> prefix, suffix;
  if (type == "TemplateProcessing") {
    TS_ASSIGN(const json* single, json_array(j, "single", where));
    auto specials = j.find("special_tokens");
    bool seen_sequence = false;
    for (size_t i = 0; i < single->size(); ++i) {
      const json& item = (*single)[i];
      std::string at = where + ".single[" + std::to_string(i) + "]";
      if (item.contains("Sequence")) {
        seen_sequence = true;
        continue;
      }
      if (!item.contains("SpecialToken") || !item["SpecialToken"].is_object())
        return make_error(at + ": expected {\"SpecialToken\": ...} or {\"Sequence\": ...}");
      TS_ASSIGN(std::string name, json_string(item["SpecialToken"], "id", at + ".SpecialToken"));
      if (specials == j.end() || !specials->contains(name) || !(*specials)[name].contains("ids") ||
          !(*specials)[name]["ids"].is_array())
        return make_error(where + ".special_tokens: no ids for '" + name + "'");
      for (const json& id : (*specials)[name]["ids"]) {
        if (!is_token_id(id))
          return make_error(where + ".special_tokens[\"" + name +
                            "\"].ids: expected non-negative integers");
        (seen_sequence ? suffix : prefix).push_back(id.get<int>());
      }
    }
  } else if (type == "BertProcessing" || type == "RobertaProcessing") {
    // {"cls": ["[CLS]", 101], "sep": ["[SEP]", 102]}: cls A sep.
    for (const char* key : {"cls", "sep"}) {
      auto it = j.find(key);
      if (it == j.end() || !it->is_array() || it->size() != 2 || !is_token_id((*it)[1]))
        return make_error(where + "." + key + ": expected [token, id]");
      (std::string(key) == "cls" ? prefix : suffix).push_back((*it)[1].get<int>());
    }
  } else {
    return make_error(where + ".type: post-processor '" + type +
                      "' is not supported (supported: TemplateProcessing, ByteLevel, "
                      "BertProcessing, RobertaProcessing, Sequence)");
  }
  // A later processor wraps what the earlier ones produced.
  pp.prefix.insert(pp.prefix.begin(), prefix.begin(), prefix.end());
  pp.suffix.insert(pp.suffix.end(), suffix.begin(), suffix.end());
  return {};
}

Status parse_added_tokens(const json& root, const std::string& where, const BpeModel& model,
                          std::vector<AddedToken>& out) {
  auto it = root.find("added_tokens");
  if (it == root.end() || it->is_null()) return {};
  if (!it->is_array()) return make_error(where + ": not an array");
  for (size_t i = 0; i < it->size(); ++i) {
    const json& t = (*it)[i];
    std::string at = where + "[" + std::to_string(i) + "]";
    AddedToken a;
    TS_ASSIGN(a.content, json_string(t, "content", at));
    if (!t.contains("id") || !is_token_id(t["id"]))
      return make_error(at + ".id: missing or not a non-negative integer");
    // Hugging Face gives a token that is also in the model's vocab the vocab's id.
    a.id = model.token_to_id(a.content).value_or(t["id"].get<int>());
    TS_ASSIGN(a.single_word, json_bool_or(t, "single_word", false, at));
    TS_ASSIGN(a.lstrip, json_bool_or(t, "lstrip", false, at));
    TS_ASSIGN(a.rstrip, json_bool_or(t, "rstrip", false, at));
    TS_ASSIGN(a.special, json_bool_or(t, "special", false, at));
    TS_ASSIGN(a.normalized, json_bool_or(t, "normalized", !a.special, at));
    if (!a.content.empty()) out.push_back(std::move(a));
  }
  return {};
}

}  // namespace

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::~Tokenizer() = default;

// Everything load() does once the files (or a GGUF's metadata) are read; the names are for
// errors.
struct TokenizerBuilder {
  static Result<std::unique_ptr<Tokenizer>> build(TokenizerJson file, const std::string& tok_name,
                                                  json tcfg, const std::string& tcfg_name,
                                                  json gcfg, const std::string& gcfg_name);
};

Result<std::unique_ptr<Tokenizer>> Tokenizer::load(const std::string& path) {
  if (io::is_gguf_file(path)) {
    TS_ASSIGN(GgufVocab v, read_gguf_vocab(path));
    return TokenizerBuilder::build(
        std::move(v.tokenizer), path + " (tokenizer.json from its metadata)",
        std::move(v.tokenizer_config), path + " (tokenizer_config.json from its metadata)",
        std::move(v.generation_config), path + " (generation_config.json from its metadata)");
  }
  const fs::path root(path);
  const fs::path tok_path = root / "tokenizer.json";
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return make_error(path + ": not a directory");
  if (!fs::exists(tok_path, ec)) {
    std::string hint = fs::exists(root / "tokenizer.model", ec)
                           ? " (only tokenizer.model is there; SentencePiece .model files are "
                             "not read, convert to tokenizer.json)"
                           : "";
    return make_error(tok_path.string() + ": not found" + hint);
  }
  TS_ASSIGN(TokenizerJson file, read_tokenizer_json(tok_path.string()));
  // BOS / EOS from the two optional config files.
  json tcfg = json::object(), gcfg = json::object();
  if (fs::exists(root / "tokenizer_config.json", ec)) {
    TS_ASSIGN(tcfg, read_json(root / "tokenizer_config.json"));
  }
  if (fs::exists(root / "generation_config.json", ec)) {
    TS_ASSIGN(gcfg, read_json(root / "generation_config.json"));
  }
  return TokenizerBuilder::build(std::move(file), tok_path.string(), std::move(tcfg),
                                 (root / "tokenizer_config.json").string(), std::move(gcfg),
                                 (root / "generation_config.json").string());
}

Result<std::unique_ptr<Tokenizer>> TokenizerBuilder::build(TokenizerJson file,
                                                           const std::string& tok_name, json tcfg,
                                                           const std::string& tcfg_name, json gcfg,
                                                           const std::string& gcfg_name) {
  const json& j = file.root;
  const std::string where = tok_name + ": ";
  if (!j.is_object() || !j.contains("model") || !j["model"].is_object())
    return make_error(where + "model: missing (is this a Hugging Face tokenizer.json?)");

  auto impl = std::make_unique<Tokenizer::Impl>();
  const json& model = j["model"];
  // Files from old `tokenizers` versions leave out model.type; merges then mean BPE.
  std::string type = model.contains("type") && model["type"].is_string()
                         ? model["type"].get<std::string>()
                         : (file.has_merges ? "BPE" : "");
  if (type != "BPE")
    return make_error(where + "model.type: '" + (type.empty() ? "(none)" : type) +
                      "' is not supported (only BPE models are)");
  TS_ASSIGN(impl->model, BpeModel::parse(file, where + "model"));
  const json null_json;
  auto part = [&](const char* key) -> const json& {
    auto it = j.find(key);
    return it == j.end() ? null_json : *it;
  };
  TS_ASSIGN(impl->normalizer, Normalizer::parse(part("normalizer"), where + "normalizer"));
  TS_ASSIGN(impl->pre_tokenizer,
            PreTokenizer::parse(part("pre_tokenizer"), where + "pre_tokenizer"));
  TS_ASSIGN(impl->decoder, Decoder::parse(part("decoder"), where + "decoder"));
  PostProcess pp;
  TS_TRY(parse_post_processor(part("post_processor"), where + "post_processor", pp));
  impl->post_prefix = pp.prefix;
  impl->post_suffix = pp.suffix;

  std::vector<AddedToken> added;
  TS_TRY(parse_added_tokens(j, where + "added_tokens", *impl->model, added));
  std::vector<AddedToken> raw, norm;
  std::vector<std::string> raw_pat, norm_pat;
  int max_id = impl->model->size() - 1;
  for (const AddedToken& a : added) {
    max_id = std::max(max_id, a.id);
    impl->added_by_id[a.id] = a;
    impl->added_by_content.emplace(a.content, a.id);
    if (a.normalized) {
      norm.push_back(a);
      norm_pat.push_back(impl->normalizer.apply(to_valid_utf8(a.content)));
    } else {
      raw.push_back(a);
      raw_pat.push_back(a.content);
    }
  }
  impl->raw_added.build(std::move(raw), std::move(raw_pat));
  impl->normalized_added.build(std::move(norm), std::move(norm_pat));

  auto tok = std::unique_ptr<Tokenizer>(new Tokenizer(std::move(impl)));
  tok->vocab_size_ = max_id + 1;
  for (int id : tok->impl_->post_prefix) tok->vocab_size_ = std::max(tok->vocab_size_, id + 1);

  auto id_of = [&](const std::string& file, const char* key, const std::string& t) -> Result<int> {
    const std::string& token = t;
    auto id = tok->token_to_id(token);
    if (!id)
      return make_error(file + ": " + key + " '" + token + "' is not a token of tokenizer.json");
    return *id;
  };
  if (std::string bos = config_token(tcfg, "bos_token"); !bos.empty()) {
    TS_ASSIGN(tok->bos_id_, id_of(tcfg_name, "bos_token", bos));
  } else if (gcfg.contains("bos_token_id") && gcfg["bos_token_id"].is_number_integer()) {
    tok->bos_id_ = gcfg["bos_token_id"].get<int>();
  }
  if (auto e = gcfg.find("eos_token_id"); e != gcfg.end()) {
    if (e->is_number_integer()) {
      tok->eos_ids_.push_back(e->get<int>());
    } else if (e->is_array()) {
      for (const json& v : *e) {
        if (!v.is_number_integer())
          return make_error(gcfg_name +
                            ": eos_token_id: expected an integer or a list of integers");
        tok->eos_ids_.push_back(v.get<int>());
      }
    } else if (!e->is_null()) {
      return make_error(gcfg_name + ": eos_token_id: expected an integer or a list of integers");
    }
  }
  if (std::string eos = config_token(tcfg, "eos_token"); !eos.empty()) {
    TS_ASSIGN(int id, id_of(tcfg_name, "eos_token", eos));
    if (std::find(tok->eos_ids_.begin(), tok->eos_ids_.end(), id) == tok->eos_ids_.end())
      tok->eos_ids_.push_back(id);
  }
  return tok;
}

std::vector<int> Tokenizer::encode(std::string_view text, bool add_special) const {
  const Impl& m = *impl_;
  std::string owned;
  if (!is_valid_utf8(text)) {
    owned = to_valid_utf8(text);
    text = owned;
  }
  std::vector<int> ids;
  if (add_special) ids = m.post_prefix;
  std::vector<Segment> raw, norm;
  std::vector<Piece> pieces;
  m.raw_added.split(text, raw);
  for (Segment& seg : raw) {
    if (seg.id >= 0) {
      ids.push_back(seg.id);
      continue;
    }
    std::string normalized = m.normalizer.apply(std::move(seg.text));
    norm.clear();
    if (m.normalized_added.empty()) {
      if (!normalized.empty()) norm.push_back({std::move(normalized), -1, 0});
    } else {
      m.normalized_added.split(normalized, norm);
    }
    for (Segment& sub : norm) {
      if (sub.id >= 0) {
        ids.push_back(sub.id);
        continue;
      }
      pieces.clear();
      pieces.push_back({std::move(sub.text), seg.offset == 0 && sub.offset == 0});
      m.pre_tokenizer.apply(pieces);
      for (const Piece& p : pieces) m.model->tokenize(p.text, ids);
    }
  }
  if (add_special) ids.insert(ids.end(), m.post_suffix.begin(), m.post_suffix.end());
  return ids;
}

std::string Tokenizer::decode(std::span<const int> ids, bool skip_special) const {
  const Impl& m = *impl_;
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int id : ids) {
    if (auto it = m.added_by_id.find(id); it != m.added_by_id.end()) {
      if (!(skip_special && it->second.special)) tokens.push_back(it->second.content);
      continue;
    }
    std::string_view t = m.model->id_to_token(id);
    if (!t.empty()) tokens.emplace_back(t);
  }
  return m.decoder.decode(std::move(tokens));
}

std::string Tokenizer::token_bytes(int id) const {
  const Impl& m = *impl_;
  if (auto it = m.added_by_id.find(id); it != m.added_by_id.end()) return it->second.content;
  std::string_view t = m.model->id_to_token(id);
  if (t.empty()) return {};
  return m.decoder.decode({std::string(t)}, /*pieces=*/true);
}

std::string Tokenizer::token_text(int id) const {
  if (auto it = impl_->added_by_id.find(id); it != impl_->added_by_id.end())
    return it->second.content;
  return std::string(impl_->model->id_to_token(id));
}

std::optional<int> Tokenizer::token_to_id(std::string_view token) const {
  if (auto it = impl_->added_by_content.find(token); it != impl_->added_by_content.end())
    return it->second;
  return impl_->model->token_to_id(token);
}

bool Tokenizer::is_special(int id) const {
  auto it = impl_->added_by_id.find(id);
  return it != impl_->added_by_id.end() && it->second.special;
}

// ---------------------------------------------------------------------------------------------
// StreamDecoder

namespace {

bool ends_with_replacement(const std::string& s) {
  return s.size() >= 3 && s.compare(s.size() - 3, 3, "\xEF\xBF\xBD") == 0;
}

// An incomplete UTF-8 sequence spans at most 4 byte tokens; more pending ids that still end
// in U+FFFD mean the text really ends with one (or with invalid bytes), so emit it rather
// than let the window grow without bound.
constexpr size_t kMaxPendingIds = 8;

}  // namespace

StreamDecoder::StreamDecoder(const Tokenizer& tokenizer, bool skip_special)
    : tok_(tokenizer), skip_special_(skip_special) {}

std::string StreamDecoder::push(int id) {
  ids_.push_back(id);
  std::string text = tok_.decode(ids_, skip_special_);
  bool held = ends_with_replacement(text) && ids_.size() - prefix_index_ < kMaxPendingIds;
  if (text.size() <= prefix_.size() || held) return {};
  std::string out = pending_text(text);
  // The ids just emitted become the context for the next ones.
  ids_.erase(ids_.begin(), ids_.begin() + long(prefix_index_));
  prefix_ = tok_.decode(ids_, skip_special_);
  prefix_index_ = ids_.size();
  return out;
}

std::string StreamDecoder::pending_text(const std::string& text) const {
  if (text.compare(0, prefix_.size(), prefix_) == 0) return text.substr(prefix_.size());
  // The new ids changed how the context decodes. Seen with ByteFallback: a byte run that
  // ends in an incomplete character turns wholly into U+FFFD, already emitted characters
  // included. What was emitted stays; the pending ids are decoded on their own.
  std::vector<int> pending(ids_.begin() + long(prefix_index_), ids_.end());
  return tok_.decode(pending, skip_special_);
}

std::string StreamDecoder::flush() {
  std::string out;
  if (ids_.size() > prefix_index_) out = pending_text(tok_.decode(ids_, skip_special_));
  ids_.clear();
  prefix_.clear();
  prefix_index_ = 0;
  return out;
}

}  // namespace ts::tokenizer
