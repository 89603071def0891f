// The tokenizer against the reference `tokenizers` library on real tokenizers (Qwen3,
// DeepSeek-V3, gpt-oss, Llama-2/Mistral-style SentencePiece BPE): ids for every line of
// tests/tokenizer/corpus.jsonl with and without special tokens, decode, round trips and the
// stream decoder. Expected outputs: tests/tokenizer/expected_<name>.jsonl, written by
// scripts/make_tokenizer_refs.py. The tokenizer.json files themselves are fetched by
// scripts/fetch_tokenizer_data.sh into build-data/tokenizers/ (or $TS_TOKENIZER_DATA); the
// tests skip, saying so, when that folder is missing.
// Also the `tokenize` CLI contract on the real files.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using ts::tokenizer::StreamDecoder;
using ts::tokenizer::Tokenizer;

std::string read_file(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Lines split on '\n' only (the corpus holds U+2028 and friends inside strings).
std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start < text.size()) {
    size_t nl = text.find('\n', start);
    if (nl == std::string::npos) nl = text.size();
    out.push_back(text.substr(start, nl - start));
    start = nl + 1;
  }
  return out;
}

fs::path tests_dir() { return fs::path(TS_TEST_DATA_DIR); }

fs::path data_dir() {
  if (const char* env = std::getenv("TS_TOKENIZER_DATA")) return env;
  return tests_dir().parent_path() / "build-data" / "tokenizers";
}

const std::vector<std::string>& corpus() {
  static const std::vector<std::string> lines = [] {
    std::vector<std::string> out;
    for (const std::string& l : split_lines(read_file(tests_dir() / "tokenizer" / "corpus.jsonl")))
      out.push_back(json::parse(l).get<std::string>());
    return out;
  }();
  return lines;
}

struct Expected {
  std::vector<json> rows;    // one per corpus line
  std::vector<json> probes;  // decode probes
};

Expected load_expected(const std::string& name) {
  Expected e;
  auto lines = split_lines(read_file(tests_dir() / "tokenizer" / ("expected_" + name + ".jsonl")));
  if (lines.empty()) return e;
  json header = json::parse(lines[0]);
  size_t n = header.value("corpus_lines", size_t(0));
  for (size_t i = 1; i < lines.size(); ++i)
    (i <= n ? e.rows : e.probes).push_back(json::parse(lines[i]));
  return e;
}

std::string show(const std::string& s) {
  std::string out = json(s).dump(-1, ' ', true, json::error_handler_t::replace);
  return out.size() > 160 ? out.substr(0, 160) + "...\"" : out;
}

std::string show_ids(const std::vector<int>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size() && i < 40; ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s + (v.size() > 40 ? ",...]" : "]");
}

// Which corpus lines decode back to themselves, by construction of each tokenizer.
enum class Lossless { kAlways, kIfNfc, kLlama };

struct Case {
  std::string name;
  Lossless lossless;
};

class RealTokenizer : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    dir_ = data_dir() / GetParam().name;
    if (!fs::exists(dir_ / "tokenizer.json"))
      GTEST_SKIP() << "no " << (dir_ / "tokenizer.json").string()
                   << ": run scripts/fetch_tokenizer_data.sh (or set TS_TOKENIZER_DATA)";
    auto t = Tokenizer::load(dir_.string());
    ASSERT_TRUE(t.ok()) << t.error().message;
    tok_ = std::move(t).value();
    expected_ = load_expected(GetParam().name);
    ASSERT_EQ(expected_.rows.size(), corpus().size())
        << "expected_" << GetParam().name << ".jsonl does not match corpus.jsonl; rerun "
        << "scripts/make_tokenizer_refs.py";
  }
  fs::path dir_;
  std::unique_ptr<Tokenizer> tok_;
  Expected expected_;
};

TEST_P(RealTokenizer, EncodeMatchesReference) {
  int bad = 0;
  for (size_t i = 0; i < corpus().size(); ++i) {
    const std::string& s = corpus()[i];
    for (bool special : {false, true}) {
      auto want = expected_.rows[i][special ? "ids_special" : "ids"].get<std::vector<int>>();
      auto got = tok_->encode(s, special);
      if (got != want && ++bad <= 5) {
        ADD_FAILURE() << "corpus line " << i + 1 << " " << show(s) << " add_special=" << special
                      << "\n  want " << show_ids(want) << "\n  got  " << show_ids(got);
      }
    }
  }
  EXPECT_EQ(bad, 0) << "encodings differing from the reference";
}

TEST_P(RealTokenizer, DecodeMatchesReference) {
  int bad = 0;
  auto check = [&](const json& row, const std::vector<int>& ids, const std::string& what) {
    for (bool skip : {false, true}) {
      std::string want = row[skip ? "decoded_skip" : "decoded"].get<std::string>();
      std::string got = tok_->decode(ids, skip);
      if (got != want && ++bad <= 5)
        ADD_FAILURE() << what << " skip_special=" << skip << " ids " << show_ids(ids) << "\n  want "
                      << show(want) << "\n  got  " << show(got);
    }
  };
  for (size_t i = 0; i < corpus().size(); ++i)
    check(expected_.rows[i], expected_.rows[i]["ids_special"].get<std::vector<int>>(),
          "corpus line " + std::to_string(i + 1));
  ASSERT_FALSE(expected_.probes.empty());
  for (size_t i = 0; i < expected_.probes.size(); ++i)
    check(expected_.probes[i], expected_.probes[i]["probe"].get<std::vector<int>>(),
          "probe " + std::to_string(i));
  EXPECT_EQ(bad, 0);
}

bool is_nfc_invariant(const std::string& s);

// Whether corpus line s decodes back to itself with a tokenizer of this kind.
bool decodes_back(Lossless kind, const std::string& s) {
  switch (kind) {
    case Lossless::kAlways: return true;
    case Lossless::kIfNfc: return is_nfc_invariant(s);
    // Prepend("▁") + Strip(1 leading space) loses nothing on text without added tokens
    // (the stripped space is the one prepended) and without "▁" (decoded as a space).
    case Lossless::kLlama:
      return s.find("<s>") == std::string::npos && s.find("</s>") == std::string::npos &&
             s.find("<unk>") == std::string::npos && s.find("\u2581") == std::string::npos;
  }
  return false;
}

TEST_P(RealTokenizer, RoundTripIsLossless) {
  size_t checked = 0;
  int bad = 0;
  for (const std::string& s : corpus()) {
    if (!decodes_back(GetParam().lossless, s)) continue;
    ++checked;
    std::string back = tok_->decode(tok_->encode(s, false), false);
    if (back != s && ++bad <= 5) ADD_FAILURE() << "want " << show(s) << "\n got  " << show(back);
  }
  EXPECT_EQ(bad, 0);
  EXPECT_GT(checked, corpus().size() * 3 / 4) << "too few lossless lines checked";
}

// A token's bytes as a piece of text (token_bytes): the pieces of a lossless line's ids add up
// to the line byte for byte (SentencePiece: after the space its normalizer prepends), and
// somewhere a piece is part of a character (not valid UTF-8 on its own).
TEST_P(RealTokenizer, TokenBytesAddUpToTheText) {
  size_t checked = 0, partial = 0;
  for (const std::string& s : corpus()) {
    const bool llama = GetParam().lossless == Lossless::kLlama;
    if (!decodes_back(GetParam().lossless, s) || s.empty()) continue;
    ++checked;
    std::string pieces;
    for (int id : tok_->encode(s, false)) {
      const std::string b = tok_->token_bytes(id);
      partial += !ts::tokenizer::is_valid_utf8(b);
      pieces += b;
    }
    EXPECT_EQ(pieces, (llama ? " " : "") + s) << show(s);
  }
  EXPECT_GT(checked, corpus().size() * 3 / 4);
  EXPECT_GT(partial, 0u) << "no token split a character in the corpus";
  EXPECT_EQ(tok_->token_bytes(tok_->vocab_size() + 5), "");
}

// Feeds ids one at a time; every chunk must be valid UTF-8 and must not show U+FFFD that the
// one-shot decode does not have; the chunks must add up to the one-shot decode.
void expect_stream_matches(const Tokenizer& tok, const std::vector<int>& ids, bool skip,
                           const std::string& what) {
  StreamDecoder stream(tok, skip);
  std::string all;
  const std::string one_shot = tok.decode(ids, skip);
  const bool one_shot_has_fffd = one_shot.find("\xEF\xBF\xBD") != std::string::npos;
  for (int id : ids) {
    std::string chunk = stream.push(id);
    ASSERT_TRUE(ts::tokenizer::is_valid_utf8(chunk)) << what << ": chunk " << show(chunk);
    if (!one_shot_has_fffd) {
      ASSERT_EQ(chunk.find("\xEF\xBF\xBD"), std::string::npos)
          << what << ": emitted an unfinished character";
    }
    all += chunk;
  }
  std::string last = stream.flush();
  ASSERT_TRUE(ts::tokenizer::is_valid_utf8(last));
  all += last;
  EXPECT_EQ(all, one_shot) << what;
}

TEST_P(RealTokenizer, StreamDecoderMatchesOneShot) {
  for (size_t i = 0; i < corpus().size(); ++i) {
    auto ids = tok_->encode(corpus()[i], true);
    for (bool skip : {false, true}) {
      expect_stream_matches(*tok_, ids, skip, "corpus line " + std::to_string(i + 1));
      if (HasFailure()) return;
    }
  }
}

// Random ids: partial UTF-8 everywhere. Chunks stay valid UTF-8, and the text equals the
// one-shot decode whenever that decode has no U+FFFD. (Where it has, bytes never formed a
// character, and the stream may already have emitted a valid prefix of the run that
// Hugging Face's ByteFallback then replaces whole.)
TEST_P(RealTokenizer, StreamDecoderOnRandomIdsEmitsValidUtf8) {
  size_t compared = 0;
  for (const json& p : expected_.probes) {
    auto ids = p["probe"].get<std::vector<int>>();
    StreamDecoder stream(*tok_, false);
    std::string all;
    for (int id : ids) {
      std::string chunk = stream.push(id);
      ASSERT_TRUE(ts::tokenizer::is_valid_utf8(chunk)) << show_ids(ids);
      all += chunk;
    }
    std::string last = stream.flush();
    ASSERT_TRUE(ts::tokenizer::is_valid_utf8(last)) << show_ids(ids);
    all += last;
    std::string one_shot = tok_->decode(ids, false);
    if (one_shot.find("\xEF\xBF\xBD") != std::string::npos) continue;
    ++compared;
    EXPECT_EQ(all, one_shot) << show_ids(ids);
  }
  EXPECT_GT(compared, expected_.probes.size() / 4);
}

TEST_P(RealTokenizer, SpecialIdsAndTokenText) {
  const std::string& name = GetParam().name;
  EXPECT_GE(tok_->vocab_size(), int(expected_.rows.size()));
  std::string text = tok_->token_text(tok_->encode("Hello", false).at(0));
  EXPECT_FALSE(text.empty());
  EXPECT_EQ(tok_->token_to_id(text), tok_->encode("Hello", false).at(0));
  EXPECT_TRUE(tok_->token_text(-1).empty());
  EXPECT_TRUE(tok_->token_text(tok_->vocab_size()).empty());
  ASSERT_FALSE(tok_->eos_ids().empty());
  for (int id : tok_->eos_ids()) EXPECT_TRUE(tok_->is_special(id)) << id;
  // Values from the packages' tokenizer_config.json.
  std::map<std::string, std::pair<std::string, std::string>> bos_eos = {
      {"qwen3", {"", "<|im_end|>"}},
      {"deepseek_v3", {"<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"}},
      {"gptoss", {"<|startoftext|>", "<|return|>"}},
      {"llama2", {"<s>", "</s>"}},
  };
  auto [bos, eos] = bos_eos.at(name);
  if (bos.empty()) {
    EXPECT_EQ(tok_->bos_id(), -1);
  } else {
    EXPECT_EQ(tok_->token_text(tok_->bos_id()), bos);
  }
  EXPECT_EQ(tok_->token_text(tok_->eos_ids()[0]), eos);
}

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

INSTANTIATE_TEST_SUITE_P(Tokenizers, RealTokenizer,
                         ::testing::Values(Case{"qwen3", Lossless::kIfNfc},
                                           Case{"deepseek_v3", Lossless::kAlways},
                                           Case{"gptoss", Lossless::kAlways},
                                           Case{"llama2", Lossless::kLlama}),
                         [](const auto& info) { return info.param.name; });

// ---------------------------------------------------------------------------------------------
// The CLI on a real tokenizer: a folder with only the tokenizer files, the whole corpus.

struct RunResult {
  int code;
  std::string out, err;
};

RunResult run_cli(const std::string& args, const fs::path& tmp) {
  std::string cmd = std::string(TS_BINARY) + " " + args + " >" + (tmp / "stdout").string() + " 2>" +
                    (tmp / "stderr").string();
  int st = std::system(cmd.c_str());
  return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, read_file(tmp / "stdout"),
          read_file(tmp / "stderr")};
}

TEST(TokenizeCli, CorpusIdsMatchReferenceForEveryLine) {
  fs::path dir = data_dir() / "qwen3";
  if (!fs::exists(dir / "tokenizer.json"))
    GTEST_SKIP() << "no " << dir.string() << ": run scripts/fetch_tokenizer_data.sh";
  char tmpl[] = "/tmp/ts_tok_cli_XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  fs::path tmp = tmpl;
  Expected e = load_expected("qwen3");
  for (bool special : {false, true}) {
    RunResult r = run_cli("tokenize --model " + dir.string() + " --input " +
                              (tests_dir() / "tokenizer" / "corpus.jsonl").string() +
                              (special ? " --add-special" : ""),
                          tmp);
    ASSERT_EQ(r.code, 0) << r.err;
    auto lines = split_lines(r.out);
    ASSERT_EQ(lines.size(), corpus().size());
    for (size_t i = 0; i < lines.size(); ++i)
      EXPECT_EQ(json::parse(lines[i]), e.rows[i][special ? "ids_special" : "ids"])
          << "line " << i + 1;
  }
  fs::remove_all(tmp);
}

}  // namespace

#include <utf8proc.h>

namespace {
bool is_nfc_invariant(const std::string& s) {
  if (s.empty()) return true;
  utf8proc_uint8_t* dst = nullptr;
  auto n =
      utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()), utf8proc_ssize_t(s.size()),
                   &dst, utf8proc_option_t(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  bool same = n >= 0 && std::string(reinterpret_cast<char*>(dst), size_t(n)) == s;
  std::free(dst);
  return same;
}
}  // namespace
