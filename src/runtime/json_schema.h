// Structured output (response_format json_schema, OpenAI's strict mode): a JSON Schema
// compiled into nodes, and SchemaPrefix, JsonPrefix with the schema's rules on top — each byte
// must keep the reply a prefix of a JSON object the schema accepts.
//
// The subset taken (compile_schema refuses anything else, naming it, rather than let a reply
// ignore a rule): "type" (object, array, string, number, integer, boolean, null, or a list of
// them), "properties" with "required" (keys in any order, each at most once; no other keys:
// additionalProperties false, as strict mode requires), "items", "minItems", "maxItems",
// "enum" and "const" of scalars, "anyOf" of alternatives whose first bytes tell them apart
// (e.g. a string or null), "$ref" to "#/$defs/..." or "#/definitions/..." (recursion too);
// annotations (title, description, default, examples, $schema, strict) are ignored.
// Strings in enum and const, and property names, are matched as their JSON text (the escapes
// JSON serialisation writes); an integer has no fraction or exponent.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/status.h"
#include "runtime/json_constraint.h"

namespace ts::runtime {

struct SchemaNode {
  enum Type : uint8_t {
    kObject = 1,
    kArray = 2,
    kString = 4,
    kNumber = 8,
    kInteger = 16,  // a number without fraction or exponent
    kBoolean = 32,
    kNull = 64,
    kAny = 127,
  };
  uint8_t types = kAny;
  std::vector<std::string> keys;  // object: property names as JSON string bodies (escaped)
  std::vector<int> key_node;      // and their schemas
  uint64_t required = 0;          // bit i: keys[i] must appear
  int items = -1;                 // array: the elements' schema (-1: any JSON value)
  int min_items = 0, max_items = 1 << 30;
  std::vector<std::string> literals;  // enum / const: the allowed values' JSON texts
  std::vector<int> any_of;            // alternatives, told apart by a value's first byte
};

struct JsonSchema {
  std::vector<SchemaNode> nodes;  // nodes[0] is the root
};

// The schema object -> nodes; errors name the schema path (e.g. "properties.tags.items").
Result<std::shared_ptr<const JsonSchema>> compile_schema(const nlohmann::ordered_json& schema);

// JsonPrefix (JSON syntax) plus a schema's rules: the same interface, so JsonConstraint masks
// tokens with it. Without a schema it is JsonPrefix.
class SchemaPrefix {
 public:
  static constexpr int kMaxDepth = 16;  // containers open at once under a schema
  explicit SchemaPrefix(const JsonSchema* schema = nullptr) : schema_(schema) {}
  // Copies only the open containers' frames: the mask copies the state for every candidate
  // token, and the depth is usually 1-3 of kMaxDepth.
  SchemaPrefix(const SchemaPrefix& o)
      : schema_(o.schema_), json_(o.json_), scalar_(o.scalar_), depth_(o.depth_) {
    std::copy_n(o.frames_.begin(), o.depth_, frames_.begin());
  }
  SchemaPrefix& operator=(const SchemaPrefix& o) {
    schema_ = o.schema_, json_ = o.json_, scalar_ = o.scalar_, depth_ = o.depth_;
    std::copy_n(o.frames_.begin(), o.depth_, frames_.begin());
    return *this;
  }
  bool feed(uint8_t c);
  bool feed_all(std::string_view s);
  bool complete() const { return json_.complete(); }
  // Without a schema the state is the JsonPrefix alone (cheaper to copy per candidate token).
  const JsonSchema* schema() const { return schema_; }
  const JsonPrefix& json() const { return json_; }
  // Inside a string whose content is free (no key, no enum), between characters.
  bool in_plain_string() const {
    return json_.in_plain_string() && (!schema_ || (!json_.key_ && free_string()));
  }

 private:
  struct Frame {
    int16_t node;       // the container's schema node (-1: unconstrained)
    int16_t pending;    // object: the schema of the value after the key just read
    uint16_t count;     // array: elements so far
    uint16_t key_at;    // object: bytes of the key being read
    uint64_t seen;      // object: keys read
    uint64_t key_cand;  // object: keys the one being read may still become
  };
  // The scalar being read (string, number, literal) when its node constrains its text or
  // kind: its node, the literals it may still become, bytes read.
  struct Scalar {
    bool active = false;
    bool integer = false;
    int16_t node = -1;
    uint64_t cand = 0;
    uint16_t at = 0;
    char kind = 0;  // '"' string, '0' number, 'l' literal
  };
  bool step(uint8_t c);
  int expected_node() const;                   // the schema of a value starting now (-1: any)
  int resolve(int node, uint8_t first) const;  // anyOf -> the alternative taking `first`
  bool start_value(uint8_t c);
  bool scalar_byte(uint8_t c);  // c is part of the active scalar
  bool scalar_done() const;     // the active scalar's text is a whole literal
  bool free_string() const;     // a string value whose text no literal constrains
  void value_ended();           // a value of the top frame (or the root) is complete

  const JsonSchema* schema_;
  JsonPrefix json_;
  Scalar scalar_;
  int depth_ = 0;
  std::array<Frame, kMaxDepth> frames_;  // [0, depth_) in use; each set when pushed
};

}  // namespace ts::runtime
