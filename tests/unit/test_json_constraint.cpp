// JSON mode: the byte automaton against hand-written documents and nlohmann's parser on
// random and mutated ones, the token mask on a small vocabulary, and constrained random walks
// over a real tokenizer's vocabulary.
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <random>
#include <string>

#include "core/thread_pool.h"
#include "runtime/json_constraint.h"
#include "test_data.h"
#include "tokenizer/tokenizer.h"

namespace {

using ts::runtime::JsonConstraint;
using ts::runtime::JsonPrefix;

// How many leading bytes of s the automaton takes, and whether it then holds a whole object.
std::pair<size_t, bool> run(const std::string& s) {
  JsonPrefix p;
  for (size_t i = 0; i < s.size(); ++i)
    if (!p.feed(uint8_t(s[i]))) return {i, p.complete()};
  return {s.size(), p.complete()};
}

TEST(JsonPrefix, AcceptsObjectsByteByByteAndCompletesAtTheLastBrace) {
  const std::vector<std::string> docs = {
      "{}",
      " \n{ \"a\" : 1 }",
      R"({"a":[1,-2.5e+10,0,0.5,-0,1E3,2e-2,true,false,null,{"b":"x\"y\\\/\b\f\n\r\t\u00e9z"}],"c":{}})",
      R"({"k":[[],[[]],[{}],"",[1,[2,[3]]]]})",
      "{\"caf\xc3\xa9\":\"\xe2\x82\xac \xf0\x9f\x98\x80\"}",  // raw UTF-8 in keys, strings
  };
  for (const std::string& d : docs) {
    JsonPrefix p;
    for (size_t i = 0; i < d.size(); ++i) {
      ASSERT_FALSE(p.complete()) << d << " complete before byte " << i;
      ASSERT_TRUE(p.feed(uint8_t(d[i]))) << d << " refused at byte " << i;
    }
    EXPECT_TRUE(p.complete()) << d;
    EXPECT_TRUE(p.feed(' ') && p.feed('\n') && p.complete()) << "whitespace after the object";
    EXPECT_FALSE(p.feed('{')) << "a second value";
  }
}

TEST(JsonPrefix, RefusesTheFirstBadByte) {
  struct Case {
    std::string doc;
    size_t at;  // the refused byte
    bool complete_before = false;
  };
  const std::vector<Case> cases = {
      {"[1]", 0},  // the top level is an object
      {"\"s\"", 0},
      {"{\"a\" 1}", 5},   // no colon
      {"{\"a\":01}", 6},  // a digit after a leading 0
      {"{\"a\":1,}", 7},  // a trailing comma
      {"{\"a\":1.}", 7},  // no fraction digit
      {"{\"a\":-}", 6},
      {"{\"a\":1e}", 7},
      {"{\"a\":tru e}", 8},
      {"{'a':1}", 1},
      {"{\"a\":1}}", 7, true},  // the object was whole
      {"{\"a\":\"\\q\"}", 7},
      {"{\"a\":\"\\u12G4\"}", 10},
      {"{\"a\":\"x\x01\"}", 7},  // a raw control character in a string
      {"{\"a\":[1}", 7},         // mismatched closer
      {"{\"a\":{]}", 6},
      {"{1:2}", 1},  // keys are strings
      {"{\"a\":1 2}", 7},
      {"{\"a\":\"\x80\"}", 6},              // a UTF-8 continuation byte without a lead
      {"{\"a\":\"\xc3(\"}", 7},             // a lead without its continuation
      {"{\"a\":\"\xc0\xaf\"}", 6},          // an overlong form
      {"{\"a\":\"\xed\xa0\x80\"}", 7},      // a surrogate
      {"{\"a\":\"\xf4\x90\x80\x80\"}", 7},  // past U+10FFFF
      {"{\"a\":1e123}", 9},                 // an exponent past a double's range
      {"{\"a\":-2.5E-999}", 13},
  };
  for (const Case& c : cases) {
    const auto [taken, complete] = run(c.doc);
    EXPECT_EQ(taken, c.at) << c.doc;
    EXPECT_EQ(complete, c.complete_before) << c.doc;
  }
}

TEST(JsonPrefix, NestingBeyondTheLimitIsRefused) {
  std::string d = "{\"a\":";
  for (int i = 1; i < JsonPrefix::kMaxDepth; ++i) d += "[";
  JsonPrefix p;
  ASSERT_TRUE(p.feed_all(d));
  EXPECT_FALSE(p.feed('['));
  EXPECT_TRUE(p.feed('1'));
}

TEST(JsonPrefix, NumbersStayWithinADoublesRange) {
  JsonPrefix p;
  ASSERT_TRUE(p.feed_all("{\"a\":-" + std::string(JsonPrefix::kMaxIntDigits, '7')));
  EXPECT_FALSE(p.feed('7'));
  EXPECT_TRUE(p.feed_all(".25e-99}"));
  EXPECT_TRUE(p.complete());
}

// A random JSON value of ASCII text (nlohmann then agrees on UTF-8 by construction).
nlohmann::json random_value(std::mt19937& rng, int depth) {
  std::uniform_int_distribution<int> kind(0, depth > 4 ? 4 : 6);
  auto str = [&] {
    static const std::string chars = "ab z\"\\/\n\t0{}[],:";
    std::string s;
    for (int i = int(rng() % 6); i > 0; --i) s += chars[rng() % chars.size()];
    return s;
  };
  switch (kind(rng)) {
    case 0:
      return nullptr;
    case 1:
      return bool(rng() % 2);
    case 2:
      return int64_t(rng() % 2000) - 1000;
    case 3:
      return std::ldexp(double(int64_t(rng() % 20000) - 10000), int(rng() % 40) - 20);
    case 4:
      return str();
    case 5: {
      nlohmann::json a = nlohmann::json::array();
      for (int i = int(rng() % 4); i > 0; --i) a.push_back(random_value(rng, depth + 1));
      return a;
    }
    default: {
      nlohmann::json o = nlohmann::json::object();
      for (int i = int(rng() % 4); i > 0; --i) o[str()] = random_value(rng, depth + 1);
      return o;
    }
  }
}

// Random objects, compact and indented, are taken whole; one ASCII byte replaced at random,
// the automaton completes a document exactly when nlohmann's parser accepts it as an object.
TEST(JsonPrefix, AgreesWithNlohmannOnRandomAndMutatedObjects) {
  std::mt19937 rng(20261205);  // fixed: a failure must reproduce
  int mutated_valid = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    nlohmann::json o = nlohmann::json::object();
    for (int i = int(rng() % 5); i > 0; --i) o["k" + std::to_string(i)] = random_value(rng, 1);
    const std::string doc = o.dump(trial % 2 ? 2 : -1);
    const auto [taken, complete] = run(doc);
    ASSERT_EQ(taken, doc.size()) << doc;
    ASSERT_TRUE(complete) << doc;
    // (Digits and number signs stay: nlohmann refuses numbers out of double's range, which
    // JSON's grammar allows.)
    std::string bad = doc;
    const size_t at = rng() % bad.size();
    const char to = char(0x20 + rng() % 95);
    const std::string numeric = "0123456789+-.eE";
    if (numeric.find(bad[at]) != std::string::npos || numeric.find(to) != std::string::npos)
      continue;
    bad[at] = to;
    const auto [btaken, bcomplete] = run(bad);
    const bool whole = btaken == bad.size() && bcomplete;
    const bool ok = nlohmann::json::accept(bad) && nlohmann::json::parse(bad).is_object();
    ASSERT_EQ(whole, ok) << bad;
    mutated_valid += ok && bad != doc;
  }
  EXPECT_GT(mutated_valid, 0) << "some mutations should stay valid JSON (e.g. inside strings)";
}

// A small vocabulary: what may come first, inside, and after the object; -inf in the mask
// exactly for the refused tokens.
TEST(JsonConstraint, MasksTokensThatCannotComeNext) {
  const std::vector<std::string> vocab = {"{",  "}", "\"a\"", ":", "1",
                                          "\"", "x", "",      " ", "{\"b\":"};
  const int eos = 7;  // its bytes are empty; allowed only when the object is complete
  JsonConstraint c(vocab, {eos});
  const auto allowed = [&] {
    std::vector<int> out;
    for (int t = 0; t < int(vocab.size()); ++t)
      if (c.allowed(t)) out.push_back(t);
    return out;
  };
  EXPECT_EQ(allowed(), (std::vector<int>{0, 8, 9}));
  ASSERT_TRUE(c.accept(0));
  EXPECT_EQ(allowed(), (std::vector<int>{1, 2, 5, 8}));
  EXPECT_FALSE(c.accept(4)) << "a number where a key belongs";
  ASSERT_TRUE(c.accept(2));
  ASSERT_TRUE(c.accept(3));
  EXPECT_EQ(allowed(), (std::vector<int>{0, 2, 4, 5, 8, 9}));
  ASSERT_TRUE(c.accept(4));
  ASSERT_FALSE(c.complete());
  ASSERT_TRUE(c.accept(1));
  EXPECT_TRUE(c.complete());
  EXPECT_EQ(allowed(), (std::vector<int>{eos})) << "only the end once the object is whole";
  std::vector<float> logits(vocab.size() + 2, 1.0f), masked;  // ids past the vocabulary too
  c.mask(logits, masked);
  for (size_t t = 0; t < masked.size(); ++t)
    EXPECT_EQ(std::isinf(masked[t]), t != size_t(eos)) << t;
  EXPECT_TRUE(c.accept(eos));
}

// An end token past the tokenizer's vocabulary (a model whose logits outnumber its token
// bytes): allowed, and accepted, only once the object is whole; other ids past it never.
TEST(JsonConstraint, EndTokenPastTheVocabularyOnlyWhenComplete) {
  const std::vector<std::string> vocab = {"{", "}"};
  const int eos = 5;
  JsonConstraint c(vocab, {eos});
  EXPECT_FALSE(c.allowed(eos));
  EXPECT_FALSE(c.accept(eos));
  EXPECT_FALSE(c.allowed(4));
  ASSERT_TRUE(c.accept(0));
  ASSERT_TRUE(c.accept(1));
  ASSERT_TRUE(c.complete());
  EXPECT_TRUE(c.allowed(eos));
  EXPECT_FALSE(c.allowed(4));
  EXPECT_FALSE(c.accept(4));
  std::vector<float> logits(6, 1.0f), masked;
  c.mask(logits, masked);
  for (size_t t = 0; t < masked.size(); ++t)
    EXPECT_EQ(std::isinf(masked[t]), t != size_t(eos)) << t;
  EXPECT_TRUE(c.accept(eos));
  EXPECT_TRUE(c.complete());
}

// Constrained greedy draws from random logits over a tokenizer's vocabulary (special tokens
// excluded): the text stays a prefix the automaton takes, and every walk that ends with EOS is
// a JSON object by nlohmann's parser. Returns how many walks ended.
int constrained_walks(const std::string& dir, int walks) {
  auto tok = ts::tokenizer::Tokenizer::load(dir);
  EXPECT_TRUE(tok.ok()) << tok.error().message;
  if (!tok.ok()) return 0;
  const ts::tokenizer::Tokenizer& t = *tok.value();
  std::vector<std::string> bytes(size_t(t.vocab_size()));
  for (int id = 0; id < t.vocab_size(); ++id)
    if (!t.is_special(id)) bytes[size_t(id)] = t.token_bytes(id);
  EXPECT_FALSE(t.eos_ids().empty());
  std::mt19937 rng(7);  // fixed: a failure must reproduce
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> logits(bytes.size()), masked;
  ts::ThreadPool pool(3);
  int ended = 0;
  for (int walk = 0; walk < walks; ++walk) {
    JsonConstraint c(bytes, t.eos_ids());
    std::string text;
    // The end gets a large bias once allowed, as a model that has finished would give it.
    for (int step = 0; step < 400; ++step) {
      for (float& l : logits) l = nd(rng);
      for (int e : t.eos_ids()) logits[size_t(e)] += 20.0f;
      c.mask(logits, masked);
      // On a pool's threads, the same mask.
      if (step % 8 == 4) {
        std::vector<float> pooled;
        c.mask(logits, pooled, &pool);
        if (pooled != masked) {
          ADD_FAILURE() << "the pool's mask differs after " << text;
          return ended;
        }
      }
      // mask() takes shortcuts (plain string content, first bytes): the same answers as
      // allowed() token by token, checked every 8th step.
      if (step % 8 == 0)
        for (size_t i = 0; i < masked.size(); ++i)
          if (std::isfinite(masked[i]) != c.allowed(int(i))) {
            ADD_FAILURE() << "mask and allowed() differ on token " << i << " after " << text;
            return ended;
          }
      const int next = int(std::max_element(masked.begin(), masked.end()) - masked.begin());
      EXPECT_TRUE(std::isfinite(masked[size_t(next)])) << "no token allowed after " << text;
      EXPECT_TRUE(c.accept(next));
      if (std::find(t.eos_ids().begin(), t.eos_ids().end(), next) != t.eos_ids().end()) {
        ++ended;
        EXPECT_TRUE(nlohmann::json::accept(text)) << text;
        if (nlohmann::json::accept(text)) {
          EXPECT_TRUE(nlohmann::json::parse(text).is_object()) << text;
        }
        break;
      }
      text += bytes[size_t(next)];
      JsonPrefix check;
      EXPECT_TRUE(check.feed_all(text)) << text;
      if (::testing::Test::HasFailure()) return ended;
    }
  }
  return ended;
}

TEST(JsonConstraint, RandomWalksOverTheFixtureVocabularyEndInObjects) {
  EXPECT_GT(constrained_walks((ts_test::data_dir() / "models" / "qwen3_moe").string(), 12), 0)
      << "no walk closed its object within 400 tokens";
}

// The same over Qwen3's real vocabulary (151,669 tokens), from scripts/fetch_tokenizer_data.sh.
TEST(JsonConstraint, RandomWalksOverQwen3sVocabularyEndInObjects) {
  const char* env = std::getenv("TS_TOKENIZER_DATA");
  const std::filesystem::path dir =
      (env ? std::filesystem::path(env)
           : ts_test::data_dir().parent_path() / "build-data" / "tokenizers") /
      "qwen3";
  if (!std::filesystem::exists(dir / "tokenizer.json"))
    GTEST_SKIP() << "no " << (dir / "tokenizer.json").string()
                 << ": run scripts/fetch_tokenizer_data.sh (or set TS_TOKENIZER_DATA)";
  EXPECT_GT(constrained_walks(dir.string(), 4), 0) << "no walk closed its object within 400 tokens";
}

}  // namespace
