// Structured output (runtime/json_schema.h): the schema subset compiles or is refused by name;
// SchemaPrefix takes exactly the prefixes of objects the schema accepts (hand-picked cases);
// and constrained random walks over a real vocabulary end in objects a plain validator of
// the same rules accepts.
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <random>

#include "core/thread_pool.h"
#include "runtime/json_constraint.h"
#include "runtime/json_schema.h"
#include "test_data.h"
#include "tokenizer/tokenizer.h"

namespace {

using ts::runtime::compile_schema;
using ts::runtime::JsonSchema;
using ts::runtime::SchemaNode;
using ts::runtime::SchemaPrefix;
using ojson = nlohmann::ordered_json;

const char* kSchema = R"({
  "type": "object",
  "properties": {
    "name": {"type": "string", "description": "who"},
    "age": {"type": "integer"},
    "score": {"type": "number"},
    "tags": {"type": "array", "items": {"enum": ["a", "b\"c"]}, "maxItems": 2},
    "kind": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    "ok": {"type": "boolean"},
    "nested": {"$ref": "#/$defs/node"}
  },
  "required": ["name", "age"],
  "additionalProperties": false,
  "$defs": {"node": {"type": "object", "properties": {
    "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}}, "required": ["next"]}}
})";

std::shared_ptr<const JsonSchema> schema() {
  auto s = compile_schema(ojson::parse(kSchema));
  EXPECT_TRUE(s.ok()) << s.error().message;
  return s.ok() ? s.value() : nullptr;
}

// Feeds text; returns the index of the first refused byte, or -1.
int refused_at(const JsonSchema& s, std::string_view text) {
  SchemaPrefix p(&s);
  for (size_t i = 0; i < text.size(); ++i)
    if (!p.feed(uint8_t(text[i]))) return int(i);
  return -1;
}

TEST(JsonSchema, AcceptsTheObjectsItsSchemaAccepts) {
  auto s = schema();
  ASSERT_TRUE(s);
  for (const char* ok : {R"({"name": "x", "age": 3})",
                         R"({ "age" : -12 , "name":"y\n", "tags":["a","b\"c"], "kind":null,
                              "ok": true, "score": 2.5e3, "nested":{"next":{"next":null}}})",
                         R"({"kind": "k", "age": 0, "tags": [], "name": ""})"}) {
    SchemaPrefix p(s.get());
    EXPECT_TRUE(p.feed_all(ok)) << ok;
    EXPECT_TRUE(p.complete()) << ok;
  }
}

TEST(JsonSchema, RefusesTheFirstByteThatBreaksARule) {
  auto s = schema();
  ASSERT_TRUE(s);
  struct Case {
    std::string text;
    int at;  // the byte refused
    const char* why;
  };
  const std::vector<Case> cases = {
      {R"({"nam")", 5, "a key that is only a prefix of one"},
      {R"({"extra")", 2, "a key not in properties"},
      {R"({"age": 3.5)", 9, "a fraction in an integer"},
      {R"({"age": 3e2)", 9, "an exponent in an integer"},
      {R"({"name": 1)", 9, "a number where a string goes"},
      {R"({"name": "x"})", 12, "closing before a required key"},
      {R"({"tags": ["c")", 11, "a string outside the enum"},
      {R"({"tags": ["b"])", 12, "an enum value's prefix closed early"},
      {R"({"tags": ["a","a","a")", 17, "more items than maxItems"},
      {R"({"kind": 1)", 9, "a type no anyOf alternative has"},
      {R"({"ok": nul)", 7, "null where a boolean goes"},
      {R"({"age": 1, "age")", 12, "a key read twice"},
      {R"({"nested": {}})", 12, "the nested object's required key"},
      {R"({"name": "x", "age": 1, "nested": {"next": 5)", 43, "recursion through $ref"},
      {R"(["x"])", 0, "a top-level array"},
  };
  for (const Case& c : cases) EXPECT_EQ(refused_at(*s, c.text), c.at) << c.why << ": " << c.text;
}

TEST(JsonSchema, UnsupportedRulesAreRefusedByName) {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {R"({"type":"object","properties":{"a":{"type":"string","pattern":"x"}}})", "pattern"},
      {R"({"type":"object","additionalProperties":true})", "additionalProperties"},
      {R"({"type":"object","properties":{"a":{"anyOf":[{"type":"string"},{"enum":["x"]}]}}})",
       "anyOf"},
      {R"({"type":"object","properties":{"a":{}},"required":["b"]})", "required"},
      {R"({"type":"string"})", "root"},
      {R"({"type":"object","properties":{"a":{"$ref":"#/$defs/nope"}}})", "$ref"},
      {R"({"type":"object","properties":{"a":{"type":"strin"}}})", "properties.a.type"},
      {R"({"type":"object","properties":{"a":{"oneOf":[]}}})", "oneOf"},
  };
  for (const auto& [text, key] : bad) {
    auto r = compile_schema(ojson::parse(text));
    ASSERT_FALSE(r.ok()) << text;
    EXPECT_NE(r.error().message.find(key), std::string::npos) << r.error().message;
  }
}

// The rules written out plainly, on a parsed value.
bool valid(const ojson& v, const JsonSchema& s, int node) {
  if (node < 0) return true;
  const SchemaNode& n = s.nodes[size_t(node)];
  if (!n.any_of.empty()) {
    for (int alt : n.any_of)
      if (valid(v, s, alt)) return true;
    return false;
  }
  if (!n.literals.empty() &&
      std::find(n.literals.begin(), n.literals.end(), v.dump()) == n.literals.end())
    return false;
  if (v.is_object()) {
    if (!(n.types & SchemaNode::kObject)) return false;
    uint64_t seen = 0;
    for (auto it = v.begin(); it != v.end(); ++it) {
      const std::string body = ojson(it.key()).dump().substr(1, ojson(it.key()).dump().size() - 2);
      auto k = std::find(n.keys.begin(), n.keys.end(), body);
      if (k == n.keys.end()) return false;
      seen |= uint64_t(1) << (k - n.keys.begin());
      if (!valid(it.value(), s, n.key_node[size_t(k - n.keys.begin())])) return false;
    }
    return (n.required & ~seen) == 0;
  }
  if (v.is_array()) {
    if (!(n.types & SchemaNode::kArray)) return false;
    if (int(v.size()) < n.min_items || int(v.size()) > n.max_items) return false;
    for (const ojson& e : v)
      if (!valid(e, s, n.items)) return false;
    return true;
  }
  if (v.is_string()) return n.types & SchemaNode::kString;
  if (v.is_boolean()) return n.types & SchemaNode::kBoolean;
  if (v.is_null()) return n.types & SchemaNode::kNull;
  if (v.is_number_integer() || v.is_number_unsigned()) return n.types & SchemaNode::kInteger;
  return n.types & SchemaNode::kNumber;
}

TEST(JsonSchema, ConstrainedWalksEndInObjectsTheSchemaAccepts) {
  auto s = schema();
  ASSERT_TRUE(s);
  auto tok =
      ts::tokenizer::Tokenizer::load((ts_test::data_dir() / "models" / "qwen3_moe").string());
  ASSERT_TRUE(tok.ok()) << tok.error().message;
  const ts::tokenizer::Tokenizer& t = *tok.value();
  std::vector<std::string> bytes(size_t(t.vocab_size()));
  for (int id = 0; id < t.vocab_size(); ++id)
    if (!t.is_special(id)) bytes[size_t(id)] = t.token_bytes(id);
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> logits(bytes.size()), masked;
  ts::ThreadPool pool(2);
  int ended = 0;
  for (int walk = 0; walk < 16; ++walk) {
    ts::runtime::JsonConstraint c(bytes, t.eos_ids(), s.get());
    std::string text;
    for (int step = 0; step < 600; ++step) {
      for (size_t i = 0; i < logits.size(); ++i) {
        logits[i] = nd(rng);
        // Structure a little likelier, so walks finish: closing quotes, brackets, commas.
        if (bytes[i].find_first_of("\"}],") != std::string::npos) logits[i] += 2.0f;
      }
      for (int e : t.eos_ids()) logits[size_t(e)] += 20.0f;
      c.mask(logits, masked, step % 2 ? &pool : nullptr);
      if (step % 16 == 0) {
        for (size_t i = 0; i < masked.size(); ++i)
          ASSERT_EQ(std::isfinite(masked[i]), c.allowed(int(i)))
              << "mask and allowed() differ on token " << i << " after " << text;
      }
      const int next = int(std::max_element(masked.begin(), masked.end()) - masked.begin());
      ASSERT_TRUE(std::isfinite(masked[size_t(next)])) << "no token allowed after " << text;
      ASSERT_TRUE(c.accept(next));
      if (std::find(t.eos_ids().begin(), t.eos_ids().end(), next) != t.eos_ids().end()) {
        ++ended;
        ASSERT_TRUE(ojson::accept(text)) << text;
        EXPECT_TRUE(valid(ojson::parse(text), *s, 0)) << text;
        break;
      }
      text += bytes[size_t(next)];
    }
  }
  EXPECT_GT(ended, 4) << "few walks closed their object within 600 tokens";
}

}  // namespace
