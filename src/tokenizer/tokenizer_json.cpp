// SAX reader for tokenizer.json; see tokenizer_json.h.
#include "tokenizer/tokenizer_json.h"

#include <cstdio>

namespace ts::tokenizer {

namespace {

using nlohmann::json;

class Reader {
 public:
  explicit Reader(TokenizerJson& out) : out_(out) {}

  bool null() { return value(json()); }
  bool boolean(bool v) { return value(json(v)); }
  bool number_integer(json::number_integer_t v) { return integer(v); }
  bool number_unsigned(json::number_unsigned_t v) {
    return v > uint64_t(INT64_MAX) ? value(json(v)) : integer(int64_t(v));
  }
  bool number_float(json::number_float_t v, const json::string_t&) { return value(json(v)); }
  bool binary(json::binary_t&) { return value(json()); }
  bool string(json::string_t& s) {
    Frame& f = top();
    if (f.kind == Kind::kMerges) {
      out_.merges.emplace_back(std::move(s), std::string());
      out_.merge_is_pair.push_back(false);
      return true;
    }
    if (f.kind == Kind::kMergeEntry) {
      if (f.count == 0) out_.merges.back().first = std::move(s);
      if (f.count == 1) out_.merges.back().second = std::move(s);
      ++f.count;
      return true;
    }
    return value(json(std::move(s)));
  }
  bool key(json::string_t& k) {
    key_ = std::move(k);
    return true;
  }
  bool start_object(size_t) {
    if (stack_.empty()) {
      out_.root = json::object();
      stack_.push_back({Kind::kDom, &out_.root, 0, false});
      return true;
    }
    Frame& f = top();
    if (f.kind == Kind::kDom && f.is_model && key_ == "vocab") {
      out_.has_vocab = true;
      stack_.push_back({Kind::kVocab, nullptr, 0, false});
      return true;
    }
    if (f.kind != Kind::kDom) {
      mark_bad(f);
      stack_.push_back({Kind::kSkip, nullptr, 0, false});
      return true;
    }
    bool is_model = stack_.size() == 1 && key_ == "model";
    json* node = insert(json::object());
    stack_.push_back({Kind::kDom, node, 0, is_model});
    return true;
  }
  bool start_array(size_t) {
    if (stack_.empty()) {
      out_.root = json::array();
      stack_.push_back({Kind::kDom, &out_.root, 0, false});
      return true;
    }
    Frame& f = top();
    if (f.kind == Kind::kDom && f.is_model && key_ == "merges") {
      out_.has_merges = true;
      stack_.push_back({Kind::kMerges, nullptr, 0, false});
      return true;
    }
    if (f.kind == Kind::kMerges) {
      out_.merges.emplace_back();
      out_.merge_is_pair.push_back(true);
      stack_.push_back({Kind::kMergeEntry, nullptr, 0, false});
      return true;
    }
    if (f.kind != Kind::kDom) {
      mark_bad(f);
      stack_.push_back({Kind::kSkip, nullptr, 0, false});
      return true;
    }
    json* node = insert(json::array());
    stack_.push_back({Kind::kDom, node, 0, false});
    return true;
  }
  bool end_object() { return pop(); }
  bool end_array() {
    Frame& f = top();
    if (f.kind == Kind::kMergeEntry && f.count != 2) note_bad_merge();
    return pop();
  }
  bool parse_error(size_t position, const std::string&, const nlohmann::detail::exception& e) {
    error_ = "not valid JSON at byte " + std::to_string(position) + ": " + e.what();
    return false;
  }
  const std::string& error() const { return error_; }

 private:
  enum class Kind { kDom, kVocab, kMerges, kMergeEntry, kSkip };
  struct Frame {
    Kind kind;
    json* node;     // kDom: the container values go into
    size_t count;   // kMergeEntry: strings seen
    bool is_model;  // kDom: this is the root's "model" object
  };

  Frame& top() { return stack_.back(); }
  bool pop() {
    stack_.pop_back();
    return true;
  }
  void note_bad_merge() {
    if (out_.first_bad_merge < 0) out_.first_bad_merge = int64_t(out_.merges.size()) - 1;
  }
  void mark_bad(const Frame& f) {
    if (f.kind == Kind::kVocab) out_.vocab_ids_are_integers = false;
    if (f.kind == Kind::kMerges || f.kind == Kind::kMergeEntry) {
      if (f.kind == Kind::kMerges) {
        out_.merges.emplace_back();
        out_.merge_is_pair.push_back(true);
      }
      note_bad_merge();
    }
  }
  bool integer(int64_t v) {
    Frame& f = top();
    if (f.kind == Kind::kVocab) {
      out_.vocab.emplace_back(std::move(key_), v);
      return true;
    }
    return value(json(v));
  }
  bool value(json v) {
    if (stack_.empty()) {
      out_.root = std::move(v);
      return true;
    }
    Frame& f = top();
    if (f.kind == Kind::kDom) {
      insert(std::move(v));
    } else if (f.kind != Kind::kSkip) {
      mark_bad(f);
    }
    return true;
  }
  json* insert(json v) {
    json& c = *top().node;
    if (c.is_object()) return &(c[key_] = std::move(v));
    c.push_back(std::move(v));
    return &c.back();
  }

  TokenizerJson& out_;
  std::vector<Frame> stack_;
  std::string key_;
  std::string error_;
};

}  // namespace

Result<std::string> read_file_bytes(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return make_error(path + ": cannot open");
  std::string bytes;
  char buf[1 << 16];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) bytes.append(buf, n);
  bool failed = std::ferror(f);
  std::fclose(f);
  if (failed) return make_error(path + ": read error");
  return bytes;
}

Result<TokenizerJson> read_tokenizer_json(const std::string& path) {
  TS_ASSIGN(std::string bytes, read_file_bytes(path));
  TokenizerJson out;
  Reader reader(out);
  if (!json::sax_parse(bytes.begin(), bytes.end(), &reader))
    return make_error(path + ": " + (reader.error().empty() ? "not valid JSON" : reader.error()));
  return out;
}

}  // namespace ts::tokenizer
