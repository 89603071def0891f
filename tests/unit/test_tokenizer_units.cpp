// Tokenizer pieces on small tokenizer.json files written by the tests (no fetched data
// needed): BPE merge priority, merges as strings or arrays, ignore_merges, byte fallback and
// unk fusing, added-token flags, pre-tokenizers, the lossy UTF-8 repair, BOS / EOS from the
// config files, the stream decoder's hold-back, the Unicode versions the reference classifies
// (\p{..}) and normalizes by, and the errors for files this implementation
// does not read (through the library and through `turbospark tokenize`, exit code 2).
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>

#include "tokenizer/normalizer.h"
#include "tokenizer/pre_tokenizer.h"
#include "tokenizer/regex.h"
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

// The GPT-2 byte-level spelling of a UTF-8 string ("hello world" -> "helloĠworld").
std::string bl(const std::string& s) {
  std::string out;
  for (unsigned char c : s)
    ts::tokenizer::append_utf8(out, ts::tokenizer::byte_to_unicode_table()[c]);
  return out;
}

class TokFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/ts_tok_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    tmp_ = tmpl;
  }
  void TearDown() override { fs::remove_all(tmp_); }

  // Writes DIR/<name>/tokenizer.json (+ optional configs) and returns DIR/<name>.
  fs::path write(const std::string& name, const json& tokenizer, const json& tcfg = nullptr,
                 const json& gcfg = nullptr) {
    fs::path d = tmp_ / name;
    fs::create_directories(d);
    std::ofstream(d / "tokenizer.json") << tokenizer.dump();
    if (!tcfg.is_null()) std::ofstream(d / "tokenizer_config.json") << tcfg.dump();
    if (!gcfg.is_null()) std::ofstream(d / "generation_config.json") << gcfg.dump();
    return d;
  }
  std::unique_ptr<Tokenizer> load(const fs::path& d) {
    auto t = Tokenizer::load(d.string());
    EXPECT_TRUE(t.ok()) << (t.ok() ? "" : t.error().message);
    return t.ok() ? std::move(t).value() : nullptr;
  }
  std::string load_error(const fs::path& d) {
    auto t = Tokenizer::load(d.string());
    EXPECT_FALSE(t.ok());
    return t.ok() ? "" : t.error().message;
  }

  // A byte-level BPE: ids 0..255 are the byte chars, then `extra` tokens, then the added
  // tokens <|bos|> and <|end|>.
  json byte_level(const std::vector<std::string>& extra, const json& merges) {
    json vocab = json::object();
    for (int b = 0; b < 256; ++b) vocab[bl(std::string(1, char(b)))] = b;
    int id = 256;
    for (const std::string& t : extra) vocab[t] = id++;
    json j = {
        {"version", "1.0"},
        {"added_tokens",
         {{{"id", id},
           {"content", "<|bos|>"},
           {"special", true},
           {"normalized", false},
           {"lstrip", false},
           {"rstrip", false},
           {"single_word", false}},
          {{"id", id + 1},
           {"content", "<|end|>"},
           {"special", true},
           {"normalized", false},
           {"lstrip", false},
           {"rstrip", false},
           {"single_word", false}}}},
        {"normalizer", nullptr},
        {"pre_tokenizer",
         {{"type", "Sequence"},
          {"pretokenizers",
           {{{"type", "Split"},
             {"pattern", {{"Regex", R"( ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)"}}},
             {"behavior", "Isolated"},
             {"invert", false}},
            {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}}},
        {"post_processor",
         {{"type", "TemplateProcessing"},
          {"single",
           {{{"SpecialToken", {{"id", "<|bos|>"}, {"type_id", 0}}}},
            {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
          {"special_tokens",
           {{"<|bos|>", {{"id", "<|bos|>"}, {"ids", {id}}, {"tokens", {"<|bos|>"}}}}}}}},
        {"decoder", {{"type", "ByteLevel"}}},
        {"model",
         {{"type", "BPE"},
          {"vocab", vocab},
          {"merges", merges},
          {"unk_token", nullptr},
          {"byte_fallback", false}}},
    };
    return j;
  }

  int id(const Tokenizer& t, const std::string& token) {
    auto i = t.token_to_id(token);
    EXPECT_TRUE(i.has_value()) << token;
    return i.value_or(-1);
  }

  fs::path tmp_;
};

const std::vector<std::string> kHelloTokens = {"he", "ll", "hell", "hello", bl(" w"), bl(" wo")};
const json kHelloMerges = {"h e", "l l", "he ll", "hell o", bl(" ") + " w", bl(" w") + " o"};

TEST_F(TokFiles, ByteLevelBpeAppliesMergesAndBos) {
  auto t = load(write("a", byte_level(kHelloTokens, kHelloMerges)));
  ASSERT_TRUE(t);
  std::vector<int> want = {id(*t, "hello"), id(*t, bl(" wo")), 'r', 'l', 'd'};
  EXPECT_EQ(t->encode("hello world", false), want);
  want.insert(want.begin(), id(*t, "<|bos|>"));
  EXPECT_EQ(t->encode("hello world", true), want);
  EXPECT_EQ(t->decode(want, false), "<|bos|>hello world");
  EXPECT_EQ(t->decode(want, true), "hello world");
  EXPECT_EQ(t->vocab_size(), 256 + int(kHelloTokens.size()) + 2);
}

TEST_F(TokFiles, MergesAsArraysEqualMergesAsStrings) {
  json arrays = json::array();
  for (const auto& m : kHelloMerges) {
    std::string s = m.get<std::string>();
    size_t sp = s.find(' ');
    arrays.push_back({s.substr(0, sp), s.substr(sp + 1)});
  }
  auto a = load(write("a", byte_level(kHelloTokens, kHelloMerges)));
  auto b = load(write("b", byte_level(kHelloTokens, arrays)));
  ASSERT_TRUE(a && b);
  for (std::string s : {"hello world", "hell", "he ll o", "wow hello"})
    EXPECT_EQ(a->encode(s, false), b->encode(s, false)) << s;
  EXPECT_EQ(b->encode("hello", false), std::vector<int>{id(*b, "hello")});
}

TEST_F(TokFiles, LowestRankMergeWinsNotLeftmost) {
  // "abc": with "b c" ranked first, the result is [a, bc]; swapped ranks give [ab, c].
  auto t1 = load(write("a", byte_level({"ab", "bc"}, {"b c", "a b"})));
  auto t2 = load(write("b", byte_level({"ab", "bc"}, {"a b", "b c"})));
  ASSERT_TRUE(t1 && t2);
  EXPECT_EQ(t1->encode("abc", false), (std::vector<int>{'a', id(*t1, "bc")}));
  EXPECT_EQ(t2->encode("abc", false), (std::vector<int>{id(*t2, "ab"), 'c'}));
  // Equal ranks never happen; equal pairs at two places merge leftmost first.
  EXPECT_EQ(t2->encode("ababab", false), std::vector<int>(3, id(*t2, "ab")));
}

TEST_F(TokFiles, IgnoreMergesEmitsWholeWordsFromTheVocab) {
  // "abc" is in the vocab but no merge builds it.
  json j = byte_level({"ab", "abc"}, {"a b"});
  auto plain = load(write("a", j));
  j["model"]["ignore_merges"] = true;
  auto ignoring = load(write("b", j));
  ASSERT_TRUE(plain && ignoring);
  EXPECT_EQ(plain->encode("abc", false), (std::vector<int>{id(*plain, "ab"), 'c'}));
  EXPECT_EQ(ignoring->encode("abc", false), std::vector<int>{id(*ignoring, "abc")});
}

TEST_F(TokFiles, LongWordWithoutSplitsIsFastAndExact) {
  auto t = load(write("a", byte_level({"ab", "abab"}, {"a b", "ab ab"})));
  ASSERT_TRUE(t);
  std::string word;
  for (int i = 0; i < 20000; ++i) word += "ab";
  auto ids = t->encode(word, false);
  EXPECT_EQ(ids, std::vector<int>(10000, id(*t, "abab")));
  EXPECT_EQ(t->decode(ids, false), word);
}

// A SentencePiece-style BPE (Llama-2 / Mistral): Prepend + Replace normalizer, no
// pre-tokenizer, byte fallback, ▁ decoder chain.
json sentencepiece(bool byte_fallback, bool fuse_unk) {
  json vocab = {{"<unk>", 0}, {"<s>", 1}, {"</s>", 2}};
  int id = 3;
  if (byte_fallback) {
    for (int b = 0; b < 256; ++b) {
      char name[8];
      std::snprintf(name, sizeof name, "<0x%02X>", b);
      vocab[name] = id++;
    }
  }
  for (std::string t : {"\u2581", "h", "i", "x", "y", "\u2581h", "\u2581hi"}) vocab[t] = id++;
  json added = json::array();
  for (int i = 0; i < 3; ++i) {
    added.push_back({{"id", i},
                     {"content", i == 0   ? "<unk>"
                                 : i == 1 ? "<s>"
                                          : "</s>"},
                     {"special", true},
                     {"normalized", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"single_word", false}});
  }
  return {
      {"added_tokens", added},
      {"normalizer",
       {{"type", "Sequence"},
        {"normalizers",
         {{{"type", "Prepend"}, {"prepend", "\u2581"}},
          {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "\u2581"}}}}}},
      {"pre_tokenizer", nullptr},
      {"post_processor",
       {{"type", "TemplateProcessing"},
        {"single",
         {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
          {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
        {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {1}}, {"tokens", {"<s>"}}}}}}}},
      {"decoder",
       {{"type", "Sequence"},
        {"decoders",
         {{{"type", "Replace"}, {"pattern", {{"String", "\u2581"}}}, {"content", " "}},
          {{"type", "ByteFallback"}},
          {{"type", "Fuse"}},
          {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}}},
      {"model",
       {{"type", "BPE"},
        {"vocab", vocab},
        {"merges", {"\u2581 h", "\u2581h i"}},
        {"unk_token", "<unk>"},
        {"fuse_unk", fuse_unk},
        {"byte_fallback", byte_fallback}}},
  };
}

TEST_F(TokFiles, ByteFallbackSpellsUnknownCharactersAsBytes) {
  auto t = load(write("a", sentencepiece(true, true)));
  ASSERT_TRUE(t);
  // "hi €": ▁hi ▁ <0xE2> <0x82> <0xAC>
  std::vector<int> want = {id(*t, "\u2581hi"), id(*t, "\u2581"), id(*t, "<0xE2>"), id(*t, "<0x82>"),
                           id(*t, "<0xAC>")};
  EXPECT_EQ(t->encode("hi \u20ac", false), want);
  want.insert(want.begin(), 1);
  EXPECT_EQ(t->encode("hi \u20ac", true), want);
  EXPECT_EQ(t->decode(want, true), "hi \u20ac");
  // Bytes that are not UTF-8 decode to one U+FFFD each (Hugging Face ByteFallback).
  EXPECT_EQ(t->decode(std::vector<int>{id(*t, "h"), id(*t, "<0xE2>"), id(*t, "<0x82>")}, false),
            "h\xEF\xBF\xBD\xEF\xBF\xBD");
  // Prepend applies to each stretch between added tokens.
  EXPECT_EQ(t->encode("hi</s>hi", false),
            (std::vector<int>{id(*t, "\u2581hi"), 2, id(*t, "\u2581hi")}));
}

TEST_F(TokFiles, UnknownCharactersFuseIntoOneUnkWhenAsked) {
  auto fused = load(write("a", sentencepiece(false, true)));
  auto unfused = load(write("b", sentencepiece(false, false)));
  ASSERT_TRUE(fused && unfused);
  const int x = id(*fused, "x"), y = id(*fused, "y");
  EXPECT_EQ(fused->encode("x\u20ac\u20acy", false),
            (std::vector<int>{id(*fused, "\u2581"), x, 0, y}));
  EXPECT_EQ(unfused->encode("x\u20ac\u20acy", false),
            (std::vector<int>{id(*unfused, "\u2581"), x, 0, 0, y}));
}

TEST_F(TokFiles, AddedTokenFlags) {
  json j = byte_level({}, json::array());
  int next = 258;
  auto add = [&](const std::string& content, bool lstrip, bool rstrip, bool single_word) {
    j["added_tokens"].push_back({{"id", next++},
                                 {"content", content},
                                 {"special", false},
                                 {"normalized", false},
                                 {"lstrip", lstrip},
                                 {"rstrip", rstrip},
                                 {"single_word", single_word}});
  };
  add("<L>", true, false, false);
  add("<R>", false, true, false);
  add("[W]", false, false, true);
  add("<|end|>x", false, false, false);  // longer than <|end|>: leftmost-longest wins
  auto t = load(write("a", j));
  ASSERT_TRUE(t);
  const int L = id(*t, "<L>"), R = id(*t, "<R>"), W = id(*t, "[W]"), E = id(*t, "<|end|>");
  const int sp = id(*t, bl(" "));
  EXPECT_EQ(t->encode("a  <L>b", false), (std::vector<int>{'a', L, 'b'}));
  EXPECT_EQ(t->encode("a<R>  b", false), (std::vector<int>{'a', R, 'b'}));
  EXPECT_EQ(t->encode("a [W] b", false), (std::vector<int>{'a', sp, W, sp, 'b'}));
  auto glued = t->encode("a[W]b", false);
  EXPECT_EQ(std::count(glued.begin(), glued.end(), W), 0) << "single_word matched inside a word";
  EXPECT_EQ(t->encode("<|end|>x<|end|>", false), (std::vector<int>{id(*t, "<|end|>x"), E}));
}

TEST_F(TokFiles, DigitsAndMetaspacePreTokenizers) {
  json j = byte_level({"12", "123"}, {"1 2", "12 3"});
  j["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers",
       {{{"type", "Digits"}, {"individual_digits", true}},
        {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}};
  auto t = load(write("a", j));
  ASSERT_TRUE(t);
  EXPECT_EQ(t->encode("a123", false), (std::vector<int>{'a', '1', '2', '3'}));
  j["pre_tokenizer"]["pretokenizers"][0]["individual_digits"] = false;
  auto t2 = load(write("b", j));
  ASSERT_TRUE(t2);
  EXPECT_EQ(t2->encode("a123", false), (std::vector<int>{'a', id(*t2, "123")}));

  json m = sentencepiece(true, false);
  m["normalizer"] = nullptr;
  m["pre_tokenizer"] = {{"type", "Metaspace"},
                        {"replacement", "\u2581"},
                        {"prepend_scheme", "always"},
                        {"split", true}};
  m["decoder"] = {{"type", "Metaspace"}, {"replacement", "\u2581"}, {"prepend_scheme", "always"}};
  auto t3 = load(write("c", m));
  ASSERT_TRUE(t3);
  auto ids = t3->encode("hi hi", false);
  EXPECT_EQ(ids, (std::vector<int>{id(*t3, "\u2581hi"), id(*t3, "\u2581hi")}));
  EXPECT_EQ(t3->decode(ids, false), "hi hi");
}

TEST_F(TokFiles, NormalizerNfcComposesBeforeMerging) {
  json j = byte_level({bl("\u00e9")}, {bl("\u00e9").substr(0, 2) + " " + bl("\u00e9").substr(2)});
  j["normalizer"] = {{"type", "NFC"}};
  auto t = load(write("a", j));
  ASSERT_TRUE(t);
  EXPECT_EQ(t->encode("e\u0301", false), std::vector<int>{id(*t, bl("\u00e9"))});
  EXPECT_EQ(t->decode(t->encode("e\u0301", false), false), "\u00e9");
}

// The reference classifies \p{..} by Unicode 16.0 (Oniguruma in tokenizers 0.23), PCRE2 here by
// 14.0: compile() widens the escapes. Code points measured against the reference (npm
// `tokenizers` 0.23.2): letters of 15.0 (U+11F04 Kawi), 15.1 (U+2EBF6 CJK Ext I) and 16.0
// (U+14030 Egyptian Ext-A) are \p{L} to it, a letter of 17.0 (U+10940 Sidetic) is not.
TEST(Regex, PropertiesFollowUnicode16AsTheReferenceDoes) {
  using ts::tokenizer::Regex;
  auto matches = [](const std::string& pattern, const std::string& text) {
    auto re = Regex::compile(pattern, "test");
    EXPECT_TRUE(re.ok()) << (re.ok() ? "" : re.error().message);
    std::vector<std::pair<size_t, size_t>> m;
    if (re.ok()) re.value().find_all(text, m);
    std::vector<std::string> out;
    for (auto [b, e] : m) out.push_back(text.substr(b, e - b));
    return out;
  };
  const std::string kawi = "\U00011F04", cjk_i = "\U0002EBF6", egypt = "\U00014030",
                    sidetic = "\U00010940", nag_digit = "\U0001E4F0";
  EXPECT_EQ(matches(R"(\p{L}+)", kawi + cjk_i + egypt + "a"),
            std::vector<std::string>{kawi + cjk_i + egypt + "a"});
  EXPECT_EQ(matches(R"(\p{L}+)", sidetic), std::vector<std::string>{});
  EXPECT_EQ(matches(R"(\pN)", nag_digit), std::vector<std::string>{nag_digit});
  // Inside a negated class: the new letters are no longer "other".
  EXPECT_EQ(matches(R"( ?[^\s\p{L}\p{N}]+)", "!" + egypt + "?"),
            (std::vector<std::string>{"!", "?"}));
  EXPECT_EQ(matches(R"(\P{L}+)", "a" + cjk_i + "!" + sidetic),
            std::vector<std::string>{"!" + sidetic});
  // \w and \s as Oniguruma's (measured on the reference's Whitespace pre-tokenizer, \w+|[^\w\s]+):
  // \w takes letters, marks, Nd, Pc, Nl, circled letters and ZWJ, not U+00B2 (No); \s is
  // White_Space: U+0085 yes, U+180E no.
  EXPECT_EQ(matches(R"(\w+)", "a\u24D0\u0E31\u200D\u2160\u203F" + kawi + "\u00B2"),
            std::vector<std::string>{"a\u24D0\u0E31\u200D\u2160\u203F" + kawi});
  EXPECT_EQ(matches(R"(\s+)", "a\u0085\u3000b\u180Ec"), std::vector<std::string>{"\u0085\u3000"});
  EXPECT_EQ(matches(R"(\W+)", "a\u00B2\u180E\u0E31"), std::vector<std::string>{"\u00B2\u180E"});
  // The category table the Digits pre-tokenizer asks (binary search over sorted ranges).
  using ts::tokenizer::unicode16_added_category;
  EXPECT_EQ(unicode16_added_category(0x11F04), "Lo");
  EXPECT_EQ(unicode16_added_category(0x2EE5D), "Lo");  // the last of CJK Extension I
  EXPECT_EQ(unicode16_added_category(0x1E4F0), "Nd");
  EXPECT_EQ(unicode16_added_category(0x1171E), "Mc");  // the one category change (Mn -> Mc)
  EXPECT_EQ(unicode16_added_category(0x41), "");
  EXPECT_EQ(unicode16_added_category(0x10940), "");  // Unicode 17.0
  EXPECT_EQ(unicode16_added_category(0x10FFFF), "");
  // The GPT-2 / Qwen contraction split that showed the difference: X'S is X, 'S.
  EXPECT_EQ(
      matches(
          R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*)",
          egypt + "'S"),
      (std::vector<std::string>{egypt, "'S"}));
}

TEST(Regex, WideningRewritesOnlyCategoryEscapesAndShorthands) {
  using ts::tokenizer::widen_unicode_properties;
  const std::string letters = widen_unicode_properties(R"(\p{L})");
  EXPECT_EQ(letters.rfind(R"([\p{L}\x{)", 0), 0u) << letters;
  EXPECT_NE(letters.find(R"(\x{2EBF0}-\x{2EE5D})"), std::string::npos) << letters;
  EXPECT_EQ(letters.back(), ']');
  // Inside a class the ranges join it; the class stays one class.
  const std::string cls = widen_unicode_properties(R"([^\s\p{L}\p{N}]+)");
  EXPECT_EQ(cls.rfind(R"([^\x{9}-\x{D}\x{20})", 0), 0u) << cls;  // \s spelled out
  EXPECT_NE(cls.find(R"(\p{L}\x{)"), std::string::npos) << cls;
  EXPECT_EQ(std::count(cls.begin(), cls.end(), '['), 1) << cls;
  EXPECT_EQ(cls.substr(cls.size() - 2), "]+");
  // Left alone: scripts, literal text, complements inside a class, \p{Cn}.
  for (const char* p :
       {R"(\p{Han}+)", R"(\Q\p{L}\w\E)", R"([\P{L}x])", R"([\W\S\D])", R"(\p{Cn})", R"(a[]\\p]b)"})
    EXPECT_EQ(widen_unicode_properties(p), p);
  // A ']' first in a class is literal: the \p{N} after it is still inside the class.
  const std::string lit = widen_unicode_properties(R"([]\p{N}])");
  EXPECT_EQ(std::count(lit.begin(), lit.end(), '['), 1) << lit;
  // A pattern that does not compile names the pattern as written.
  auto bad = ts::tokenizer::Regex::compile(R"(\p{L}(x)", "where");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.error().message.find(R"('\p{L}(x')"), std::string::npos) << bad.error().message;
}

// The reference normalizes with Unicode 9.0's tables (crate unicode-normalization-alignments):
// a mark of a later version has class 0 to it, so it blocks composition and reordering.
// U+0D3B (Malayalam, 10.0, class 9) blocks a + U+0301; U+0CBC (Kannada, 4.0, class 7) does not.
TEST_F(TokFiles, NormalizerUsesUnicode9ClassesAsTheReferenceDoes) {
  json nfc = {{"type", "NFC"}};
  auto n = ts::tokenizer::Normalizer::parse(nfc, "test");
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(n.value().apply("a\u0CBC\u0301"), "\u00E1\u0CBC");
  EXPECT_EQ(n.value().apply("a\u0D3B\u0301"), "a\u0D3B\u0301");
  EXPECT_EQ(n.value().apply("a\u0301\u0D3B e\u0301"), "\u00E1\u0D3B \u00E9");
  EXPECT_EQ(n.value().apply("x\u089E\u0656"), "x\u089E\u0656");  // 14.0 mark: not reordered
  EXPECT_EQ(n.value().apply("x\u0301\u0656"), "x\u0656\u0301");  // 6.0 marks: reordered
}

TEST(Utf8, LossyRepairReplacesMaximalSubparts) {
  using ts::tokenizer::to_valid_utf8;
  const std::string R = "\xEF\xBF\xBD";
  EXPECT_EQ(to_valid_utf8("a\xFF"
                          "b"),
            "a" + R + "b");
  EXPECT_EQ(to_valid_utf8("\xF0\x90\x80"
                          "a"),
            R + "a");                                           // truncated 4-byte
  EXPECT_EQ(to_valid_utf8("\xC0\x80"), R + R);                  // overlong lead
  EXPECT_EQ(to_valid_utf8("\xED\xA0\x80"), R + R + R);          // surrogate
  EXPECT_EQ(to_valid_utf8("\xF4\x90\x80\x80"), R + R + R + R);  // past U+10FFFF
  EXPECT_EQ(to_valid_utf8("\xE1\x80"), R);                      // cut at the end
  EXPECT_EQ(to_valid_utf8("\xE2\x82\xAC\xF0\x9F\x99\x82"), "\xE2\x82\xAC\xF0\x9F\x99\x82");
  EXPECT_TRUE(ts::tokenizer::is_valid_utf8("\xF4\x8F\xBF\xBF"));
  EXPECT_FALSE(ts::tokenizer::is_valid_utf8("\xF4\x90\x80\x80"));
}

TEST_F(TokFiles, InvalidUtf8InputEncodesAsReplacementCharacter) {
  auto t = load(write("a", byte_level({}, json::array())));
  ASSERT_TRUE(t);
  EXPECT_EQ(t->encode("a\xFF"
                      "b",
                      false),
            t->encode("a\xEF\xBF\xBD"
                      "b",
                      false));
  EXPECT_NE(t->encode("a\xFF"
                      "b",
                      false),
            t->encode("ab", false));
}

TEST_F(TokFiles, StreamDecoderHoldsBackIncompleteCharacters) {
  auto t = load(write("a", sentencepiece(true, false)));
  ASSERT_TRUE(t);
  StreamDecoder s(*t, true);
  EXPECT_EQ(s.push(1), "");  // <s>, skipped
  EXPECT_EQ(s.push(id(*t, "\u2581hi")), "hi");
  EXPECT_EQ(s.push(id(*t, "\u2581")), " ");
  EXPECT_EQ(s.push(id(*t, "<0xE2>")), "");
  EXPECT_EQ(s.push(id(*t, "<0x82>")), "");
  EXPECT_EQ(s.push(id(*t, "<0xAC>")), "\u20ac");
  EXPECT_EQ(s.push(id(*t, "<0xE2>")), "");
  // The stream ends inside a character: flush gives U+FFFD for the pending byte. (One-shot
  // decode gives four: ByteFallback replaces the whole invalid byte run E2 82 AC E2.)
  EXPECT_EQ(s.flush(), "\xEF\xBF\xBD");
  EXPECT_EQ(s.push(id(*t, "\u2581hi")), "hi") << "after flush the stream starts afresh";

  // Byte-level: a 4-byte emoji split over single-byte tokens.
  auto b = load(write("b", byte_level({}, json::array())));
  ASSERT_TRUE(b);
  StreamDecoder bs(*b, false);
  std::string emoji = "\xF0\x9F\x99\x82";
  std::string got;
  for (unsigned char c : emoji) {
    std::string chunk = bs.push(c);
    EXPECT_TRUE(chunk.empty() || chunk == emoji);
    got += chunk;
  }
  EXPECT_EQ(got, emoji);
}

TEST_F(TokFiles, BosAndEosFromConfigFiles) {
  json tcfg = {{"bos_token", {{"content", "<|bos|>"}, {"__type", "AddedToken"}}},
               {"eos_token", "<|end|>"}};
  json gcfg = {{"eos_token_id", {7, 9}}, {"bos_token_id", 5}};
  auto t = load(write("a", byte_level({}, json::array()), tcfg, gcfg));
  ASSERT_TRUE(t);
  EXPECT_EQ(t->bos_id(), 256);
  EXPECT_EQ(t->eos_ids(), (std::vector<int>{7, 9, 257}));
  auto only_gen = load(write("b", byte_level({}, json::array()), nullptr, {{"eos_token_id", 257}}));
  ASSERT_TRUE(only_gen);
  EXPECT_EQ(only_gen->eos_ids(), std::vector<int>{257});
  EXPECT_EQ(only_gen->bos_id(), -1);
  auto none = load(write("c", byte_level({}, json::array())));
  ASSERT_TRUE(none);
  EXPECT_TRUE(none->eos_ids().empty());

  std::string err =
      load_error(write("d", byte_level({}, json::array()), {{"eos_token", "<nope>"}}));
  EXPECT_NE(err.find("tokenizer_config.json"), std::string::npos) << err;
  EXPECT_NE(err.find("<nope>"), std::string::npos) << err;
}

TEST_F(TokFiles, UnsupportedFilesAreNamedErrors) {
  json j = byte_level({}, json::array());
  auto expect = [&](const std::string& name, json broken, std::vector<std::string> needles) {
    std::string err = load_error(write(name, broken));
    for (const std::string& n : needles) EXPECT_NE(err.find(n), std::string::npos) << err;
  };
  json wp = j;
  wp["model"] = {{"type", "WordPiece"}, {"vocab", {{"a", 0}}}, {"unk_token", "[UNK]"}};
  expect("wp", wp, {"tokenizer.json", "model.type", "WordPiece"});
  json uni = j;
  uni["model"] = {{"type", "Unigram"}, {"vocab", {{"a", 0.0}}}};
  expect("uni", uni, {"tokenizer.json", "model.type", "Unigram"});
  json norm = j;
  norm["normalizer"] = {{"type", "Lowercase"}};
  expect("norm", norm, {"normalizer.type", "Lowercase"});
  json pre = j;
  pre["pre_tokenizer"]["pretokenizers"][1] = {{"type", "BertPreTokenizer"}};
  expect("pre", pre, {"pre_tokenizer.pretokenizers[1].type", "BertPreTokenizer"});
  json dec = j;
  dec["decoder"] = {{"type", "WordPiece"}};
  expect("dec", dec, {"decoder.type", "WordPiece"});
  json merge = j;
  merge["model"]["merges"] = {"q zz"};
  expect("merge", merge, {"model.merges[0]", "zz"});
  json re = j;
  re["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(unclosed";
  expect("re", re, {"pattern.Regex", "(unclosed"});

  fs::path bad = tmp_ / "badjson";
  fs::create_directories(bad);
  std::ofstream(bad / "tokenizer.json") << "{\"model\": ";
  std::string err = load_error(bad);
  EXPECT_NE(err.find("tokenizer.json"), std::string::npos) << err;
  EXPECT_NE(err.find("JSON"), std::string::npos) << err;
  fs::create_directories(tmp_ / "empty");
  err = load_error(tmp_ / "empty");
  EXPECT_NE(err.find("tokenizer.json: not found"), std::string::npos) << err;
}

// A field of the wrong type is an error naming the field, never an exception out of the loader.
TEST_F(TokFiles, WronglyTypedFieldsAreNamedErrors) {
  json j = byte_level({}, json::array());
  struct Case {
    std::string name;
    std::function<void(json&)> edit;
    std::string needle;
  };
  std::vector<Case> cases = {
      {"fuse_unk", [](json& t) { t["model"]["fuse_unk"] = 7; }, "model.fuse_unk"},
      {"byte_fallback", [](json& t) { t["model"]["byte_fallback"] = "yes"; },
       "model.byte_fallback"},
      {"ignore_merges", [](json& t) { t["model"]["ignore_merges"] = json::array(); },
       "model.ignore_merges"},
      {"invert", [](json& t) { t["pre_tokenizer"]["pretokenizers"][0]["invert"] = 1; },
       "pretokenizers[0].invert"},
      {"use_regex", [](json& t) { t["pre_tokenizer"]["pretokenizers"][1]["use_regex"] = 0.5; },
       "pretokenizers[1].use_regex"},
      {"metaspace",
       [](json& t) {
         t["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", 9}};
       },
       "pre_tokenizer.replacement"},
      {"strip",
       [](json& t) {
         t["normalizer"] = {{"type", "Strip"}, {"strip_left", "no"}};
       },
       "normalizer.strip_left"},
      {"decoder_strip",
       [](json& t) {
         t["decoder"] = {{"type", "Strip"}, {"content", " "}, {"start", -1}};
       },
       "decoder.start"},
      {"added_special", [](json& t) { t["added_tokens"][0]["special"] = "true"; },
       "added_tokens[0].special"},
      {"added_id", [](json& t) { t["added_tokens"][1]["id"] = int64_t(1) << 40; },
       "added_tokens[1].id"},
      {"post_id", [](json& t) { t["post_processor"]["special_tokens"]["<|bos|>"]["ids"] = {-3}; },
       "special_tokens"},
  };
  for (const Case& c : cases) {
    json broken = j;
    c.edit(broken);
    std::string err = load_error(write(c.name, broken));
    EXPECT_NE(err.find("tokenizer.json"), std::string::npos) << c.name << ": " << err;
    EXPECT_NE(err.find(c.needle), std::string::npos) << c.name << ": " << err;
  }
  // null means "not given", as with Hugging Face's optional fields.
  json with_nulls = j;
  with_nulls["model"]["fuse_unk"] = nullptr;
  with_nulls["pre_tokenizer"]["pretokenizers"][0]["invert"] = nullptr;
  EXPECT_NE(load(write("nulls", with_nulls)), nullptr);
}

// ---------------------------------------------------------------------------------------------
// `turbospark tokenize`: contract and bad input, through the binary.

class TokenizeCommand : public TokFiles {
 protected:
  struct RunResult {
    int code;
    std::string out, err;
  };
  RunResult run(const std::string& args) {
    std::string cmd = std::string(TS_BINARY) + " " + args + " >" + (tmp_ / "stdout").string() +
                      " 2>" + (tmp_ / "stderr").string();
    int st = std::system(cmd.c_str());
    return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, read_file(tmp_ / "stdout"),
            read_file(tmp_ / "stderr")};
  }
  fs::path input(const std::string& bytes) {
    fs::path p = tmp_ / "in.jsonl";
    std::ofstream(p, std::ios::binary) << bytes;
    return p;
  }
  void expect_error(const RunResult& r, const std::vector<std::string>& needles) {
    EXPECT_EQ(r.code, 2) << r.err;
    for (const std::string& n : needles)
      EXPECT_NE(r.err.find(n), std::string::npos) << "stderr: " << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << "one line: " << r.err;
    EXPECT_TRUE(r.out.empty()) << r.out;
  }
  std::string ids_line(const std::vector<int>& ids) {
    std::string s = "[";
    for (size_t i = 0; i < ids.size(); ++i) s += (i ? "," : "") + std::to_string(ids[i]);
    return s + "]\n";
  }
};

TEST_F(TokenizeCommand, OneIdArrayPerLineFromTokenizerOnlyFolder) {
  fs::path d = write("m", byte_level(kHelloTokens, kHelloMerges));
  auto t = load(d);
  ASSERT_TRUE(t);
  fs::path in = input("\"hello world\"\n\"\"\n\"he said \\\"hello\\\"\\n\\u00e9\\ud83d\\ude42\"\n");
  RunResult r = run("tokenize --model " + d.string() + " --input " + in.string());
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, ids_line(t->encode("hello world", false)) + "[]\n" +
                       ids_line(t->encode("he said \"hello\"\n\u00e9\U0001F642", false)));
  r = run("tokenize --model " + d.string() + " --input " + in.string() + " --add-special");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out.substr(0, r.out.find('\n') + 1), ids_line(t->encode("hello world", true)));
}

TEST_F(TokenizeCommand, InvalidUtf8BecomesReplacementCharacter) {
  fs::path d = write("m", byte_level(kHelloTokens, kHelloMerges));
  auto t = load(d);
  ASSERT_TRUE(t);
  // A raw 0xFF byte, a truncated 3-byte sequence, and a lone surrogate escape.
  fs::path in = input("\"he\xFFllo\"\n\"x\xE2\x82\"\n\"a\\ud800b\"\n");
  RunResult r = run("tokenize --model " + d.string() + " --input " + in.string());
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, ids_line(t->encode("he\uFFFDllo", false)) +
                       ids_line(t->encode("x\uFFFD", false)) +
                       ids_line(t->encode("a\uFFFDb", false)));
}

TEST_F(TokenizeCommand, BadInputIsOneErrorLineAndExitCode2) {
  fs::path good = write("m", byte_level(kHelloTokens, kHelloMerges));
  fs::path in = input("\"hi\"\n");
  expect_error(run("tokenize --model " + (tmp_ / "nope").string() + " --input " + in.string()),
               {"nope"});
  fs::create_directories(tmp_ / "weights_only");
  std::ofstream(tmp_ / "weights_only" / "config.json") << "{}";
  expect_error(
      run("tokenize --model " + (tmp_ / "weights_only").string() + " --input " + in.string()),
      {"tokenizer.json", "not found"});
  json wp = byte_level({}, json::array());
  wp["model"] = {{"type", "WordPiece"}, {"vocab", {{"a", 0}}}};
  expect_error(run("tokenize --model " + write("wp", wp).string() + " --input " + in.string()),
               {"tokenizer.json", "model.type", "WordPiece"});
  json uni = byte_level({}, json::array());
  uni["model"] = {{"type", "Unigram"}, {"vocab", json::array()}};
  expect_error(run("tokenize --model " + write("uni", uni).string() + " --input " + in.string()),
               {"tokenizer.json", "model.type", "Unigram"});
  expect_error(
      run("tokenize --model " + good.string() + " --input " + (tmp_ / "missing.jsonl").string()),
      {"missing.jsonl"});
  fs::path bad = input("\"ok\"\nnot json\n");
  expect_error(run("tokenize --model " + good.string() + " --input " + bad.string()),
               {"in.jsonl:2", "JSON string"});
  expect_error(
      run("tokenize --model " + good.string() + " --input " + in.string() + " --add-specials"),
      {"--add-specials"});
}

}  // namespace
