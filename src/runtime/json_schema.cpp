#include "runtime/json_schema.h"

#include <map>
#include <set>

namespace ts::runtime {
namespace {

using json = nlohmann::ordered_json;

uint8_t type_bit(const std::string& t) {
  if (t == "object") return SchemaNode::kObject;
  if (t == "array") return SchemaNode::kArray;
  if (t == "string") return SchemaNode::kString;
  if (t == "number") return SchemaNode::kNumber | SchemaNode::kInteger;
  if (t == "integer") return SchemaNode::kInteger;
  if (t == "boolean") return SchemaNode::kBoolean;
  if (t == "null") return SchemaNode::kNull;
  return 0;
}

// The kinds of value a first byte starts.
uint8_t kinds_of_first(uint8_t c) {
  switch (c) {
    case '{':
      return SchemaNode::kObject;
    case '[':
      return SchemaNode::kArray;
    case '"':
      return SchemaNode::kString;
    case 't':
    case 'f':
      return SchemaNode::kBoolean;
    case 'n':
      return SchemaNode::kNull;
    default:
      return c == '-' || (c >= '0' && c <= '9') ? SchemaNode::kNumber | SchemaNode::kInteger : 0;
  }
}

// The JSON text of a string without its quotes: what the reply's bytes are matched against.
std::string string_body(const std::string& s) {
  const std::string t = json(s).dump();
  return t.substr(1, t.size() - 2);
}

// The kinds a schema names by "type" (or implies by properties / items); all when neither.
uint8_t declared_types(const json& s) {
  if (!s.is_object()) return SchemaNode::kAny;
  if (s.contains("type")) {
    uint8_t t = 0;
    for (const json& e : s["type"].is_array() ? s["type"] : json::array({s["type"]}))
      t |= e.is_string() ? type_bit(e.get<std::string>()) : 0;
    return t ? t : uint8_t(SchemaNode::kAny);
  }
  if (s.contains("properties")) return SchemaNode::kObject;
  if (s.contains("items")) return SchemaNode::kArray;
  return SchemaNode::kAny;
}

struct Compiler {
  const json& root;
  JsonSchema out;
  std::map<std::string, int> refs;  // "$ref" target -> node

  Error err(const std::string& path, const std::string& what) const {
    return make_error("json_schema" + (path.empty() ? std::string() : "." + path) + ": " + what);
  }

  Result<const json*> target(const std::string& ref, const std::string& path) const {
    for (const char* prefix : {"#/$defs/", "#/definitions/"}) {
      const std::string p = prefix;
      if (ref.rfind(p, 0) != 0) continue;
      const std::string group = p.substr(2, p.size() - 3), name = ref.substr(p.size());
      if (root.contains(group) && root[group].is_object() && root[group].contains(name))
        return &root[group][name];
    }
    return err(path, "$ref \"" + ref + "\" does not name an entry of #/$defs or #/definitions");
  }

  Result<int> node(const json& s, const std::string& path) {
    if (!s.is_object()) return err(path, "a schema must be an object");
    if (s.contains("$ref")) {
      if (!s["$ref"].is_string()) return err(path, "$ref must be a string");
      const std::string ref = s["$ref"].get<std::string>();
      if (auto it = refs.find(ref); it != refs.end()) return it->second;
      TS_ASSIGN(const json* t, target(ref, path));
      const int id = int(out.nodes.size());
      out.nodes.emplace_back();
      // Its kinds already, for an anyOf that reaches it again before its body is compiled.
      out.nodes[size_t(id)].types = declared_types(*t);
      refs[ref] = id;
      TS_ASSIGN(int body, node(*t, ref.substr(2)));
      out.nodes[size_t(id)] = out.nodes[size_t(body)];
      return id;
    }
    static const std::set<std::string> kAnnotations = {
        "title", "description", "default", "examples", "$schema",
        "$id",   "$comment",    "strict",  "$defs",    "definitions"};
    static const std::set<std::string> kRules = {
        "type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems",
        "enum", "const",      "anyOf"};
    for (auto it = s.begin(); it != s.end(); ++it)
      if (!kAnnotations.count(it.key()) && !kRules.count(it.key()))
        return err(path, "'" + it.key() +
                             "' is not supported (supported: type, properties, "
                             "required, items, minItems, maxItems, enum, const, anyOf, $ref)");
    const int id = int(out.nodes.size());
    out.nodes.emplace_back();
    SchemaNode n;
    if (s.contains("type")) {
      const json& t = s["type"];
      n.types = 0;
      for (const json& e : t.is_array() ? t : json::array({t})) {
        const uint8_t b = e.is_string() ? type_bit(e.get<std::string>()) : 0;
        if (!b) return err(path + ".type", "unknown type " + e.dump());
        n.types |= b;
      }
    } else if (s.contains("properties")) {
      n.types = SchemaNode::kObject;
    } else if (s.contains("items")) {
      n.types = SchemaNode::kArray;
    }
    if (s.contains("enum") || s.contains("const")) {
      const json values = s.contains("const") ? json::array({s["const"]}) : s["enum"];
      if (!values.is_array() || values.empty() || values.size() > 64)
        return err(path + ".enum", "must be a list of 1 to 64 values");
      uint8_t kinds = 0;
      for (const json& v : values) {
        if (v.is_object() || v.is_array())
          return err(path + ".enum", "objects and arrays in enum / const are not supported");
        n.literals.push_back(v.dump());
        kinds |= kinds_of_first(uint8_t(n.literals.back()[0]));
      }
      n.types &= kinds;
    }
    if (s.contains("properties")) {
      const json& p = s["properties"];
      if (!p.is_object()) return err(path + ".properties", "must be an object");
      if (p.size() > 64) return err(path + ".properties", "more than 64 are not supported");
      for (auto it = p.begin(); it != p.end(); ++it) {
        n.keys.push_back(string_body(it.key()));
        TS_ASSIGN(int child, node(it.value(), path + ".properties." + it.key()));
        n.key_node.push_back(child);
      }
    }
    if (s.contains("required")) {
      const json& r = s["required"];
      if (!r.is_array()) return err(path + ".required", "must be a list of property names");
      for (const json& name : r) {
        const std::string body = name.is_string() ? string_body(name.get<std::string>()) : "";
        auto at = std::find(n.keys.begin(), n.keys.end(), body);
        if (!name.is_string() || at == n.keys.end())
          return err(path + ".required", name.dump() + " is not one of the properties");
        n.required |= uint64_t(1) << (at - n.keys.begin());
      }
    }
    if (s.contains("additionalProperties") && s["additionalProperties"] != false)
      return err(path + ".additionalProperties",
                 "must be false (keys other than the properties are not generated)");
    if (s.contains("items")) {
      TS_ASSIGN(n.items, node(s["items"], path + ".items"));
    }
    for (const char* k : {"minItems", "maxItems"}) {
      if (!s.contains(k)) continue;
      if (!s[k].is_number_integer() || s[k].get<int64_t>() < 0 || s[k].get<int64_t>() > (1 << 30))
        return err(path + "." + k, "must be an integer >= 0");
      (std::string(k) == "minItems" ? n.min_items : n.max_items) = s[k].get<int>();
    }
    if (n.min_items > n.max_items) return err(path + ".minItems", "exceeds maxItems");
    if (s.contains("anyOf")) {
      const json& a = s["anyOf"];
      if (!a.is_array() || a.empty()) return err(path + ".anyOf", "must be a non-empty list");
      uint8_t taken = 0;
      for (size_t i = 0; i < a.size(); ++i) {
        TS_ASSIGN(int alt, node(a[i], path + ".anyOf[" + std::to_string(i) + "]"));
        const uint8_t t = out.nodes[size_t(alt)].types;
        // The first byte must tell the alternatives apart (number and integer start alike).
        const uint8_t cls = uint8_t((t & (SchemaNode::kNumber | SchemaNode::kInteger))
                                        ? (t | SchemaNode::kNumber | SchemaNode::kInteger)
                                        : t);
        if (cls & taken)
          return err(path + ".anyOf",
                     "alternatives of the same JSON type are not supported (each must start "
                     "with a different byte: object, array, string, number, boolean, null)");
        taken |= cls;
        n.any_of.push_back(alt);
      }
    }
    if (n.types == 0) return err(path, "no value satisfies both its type and its enum / const");
    out.nodes[size_t(id)] = std::move(n);
    return id;
  }
};

bool is_ws(uint8_t c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

}  // namespace

Result<std::shared_ptr<const JsonSchema>> compile_schema(const json& schema) {
  Compiler c{schema, {}, {}};
  TS_ASSIGN(int root, c.node(schema, ""));
  if (root != 0 || !(c.out.nodes[0].types & SchemaNode::kObject) || !c.out.nodes[0].any_of.empty())
    return make_error("json_schema: the root must be an object schema (\"type\": \"object\")");
  return std::shared_ptr<const JsonSchema>(std::make_shared<JsonSchema>(std::move(c.out)));
}

int SchemaPrefix::expected_node() const {
  if (depth_ == 0) return 0;
  const Frame& f = frames_[size_t(depth_ - 1)];
  if (f.node < 0) return -1;
  const SchemaNode& n = schema_->nodes[size_t(f.node)];
  return json_.stack_[size_t(json_.depth_ - 1)] == '{' ? f.pending : n.items;
}

int SchemaPrefix::resolve(int node, uint8_t first) const {
  if (node < 0) return -1;
  const SchemaNode& n = schema_->nodes[size_t(node)];
  if (n.any_of.empty()) return node;
  for (int alt : n.any_of) {
    const int r = resolve(alt, first);
    if (r >= 0 && (schema_->nodes[size_t(r)].types & kinds_of_first(first))) return r;
  }
  return -2;  // no alternative starts with this byte
}

bool SchemaPrefix::start_value(uint8_t c) {
  const int node = resolve(expected_node(), c);
  if (node == -2) return false;
  uint64_t cand = 0;
  bool integer = false;
  if (node >= 0) {
    const SchemaNode& n = schema_->nodes[size_t(node)];
    if (!(n.types & kinds_of_first(c))) return false;
    for (size_t i = 0; i < n.literals.size(); ++i)
      if (uint8_t(n.literals[i][0]) == c) cand |= uint64_t(1) << i;
    if (!n.literals.empty() && cand == 0) return false;
    integer = (n.types & SchemaNode::kInteger) && !(n.types & SchemaNode::kNumber);
  }
  if (c == '{' || c == '[') {
    if (depth_ == kMaxDepth) return false;
    frames_[size_t(depth_++)] = {
        .node = int16_t(node), .pending = -1, .count = 0, .key_at = 0, .seen = 0, .key_cand = 0};
    return true;
  }
  scalar_ = {.active = true,
             .integer = integer,
             .node = int16_t(node),
             .cand = cand,
             .at = 1,
             .kind = c == '"'                             ? '"'
                     : (c == 't' || c == 'f' || c == 'n') ? 'l'
                                                          : '0'};
  return true;
}

bool SchemaPrefix::scalar_byte(uint8_t c) {
  if (scalar_.kind == '0' && scalar_.integer && (c == '.' || c == 'e' || c == 'E')) return false;
  if (scalar_.node >= 0) {
    const std::vector<std::string>& lit = schema_->nodes[size_t(scalar_.node)].literals;
    if (!lit.empty()) {
      uint64_t keep = 0;
      for (size_t i = 0; i < lit.size(); ++i)
        if ((scalar_.cand >> i & 1) && lit[i].size() > scalar_.at &&
            uint8_t(lit[i][scalar_.at]) == c)
          keep |= uint64_t(1) << i;
      if (!keep) return false;
      scalar_.cand = keep;
    }
  }
  ++scalar_.at;
  return true;
}

bool SchemaPrefix::scalar_done() const {
  if (scalar_.node < 0) return true;
  const std::vector<std::string>& lit = schema_->nodes[size_t(scalar_.node)].literals;
  if (lit.empty()) return true;
  for (size_t i = 0; i < lit.size(); ++i)
    if ((scalar_.cand >> i & 1) && lit[i].size() == scalar_.at) return true;
  return false;
}

bool SchemaPrefix::free_string() const {
  return scalar_.active && scalar_.kind == '"' &&
         (scalar_.node < 0 || schema_->nodes[size_t(scalar_.node)].literals.empty());
}

void SchemaPrefix::value_ended() {
  if (depth_ == 0) return;
  Frame& f = frames_[size_t(depth_ - 1)];
  if (json_.stack_[size_t(json_.depth_ - 1)] == '{')
    f.pending = -1;
  else
    ++f.count;
}

bool SchemaPrefix::step(uint8_t c) {
  using M = JsonPrefix::Mode;
  if (!schema_) return json_.step(c);
  if (scalar_.active) {
    const bool part = scalar_.kind != '0' || (c >= '0' && c <= '9') || c == '.' || c == 'e' ||
                      c == 'E' || c == '+' || c == '-';
    if (part) {
      if (!scalar_byte(c) || !json_.step(c)) return false;
      const M n = json_.mode_;
      const bool inside = scalar_.kind == '"'
                              ? n == M::kString || n == M::kEscape || n == M::kUnicode
                          : scalar_.kind == 'l' ? n == M::kLiteral
                                                : true;
      if (!inside) {
        if (!scalar_done()) return false;
        scalar_.active = false;
        value_ended();
      }
      return true;
    }
    // c ends a number: it must be whole, then c is read after it.
    if (!scalar_done()) return false;
    scalar_.active = false;
    value_ended();
  }
  // Where JsonPrefix is, once a number c ends is over.
  M m = json_.mode_;
  if (m == M::kNumber) m = json_.depth_ == 0 ? M::kDone : M::kAfter;
  if (is_ws(c) && m != M::kString) return json_.step(c);
  const bool has_frame = depth_ > 0;
  Frame* f = has_frame ? &frames_[size_t(depth_ - 1)] : nullptr;
  const SchemaNode* n = f && f->node >= 0 ? &schema_->nodes[size_t(f->node)] : nullptr;
  const uint64_t all_keys =
      n ? (n->keys.size() == 64 ? ~uint64_t(0) : (uint64_t(1) << n->keys.size()) - 1) : 0;
  switch (m) {
    case M::kStart:
    case M::kValue:
      if (!start_value(c)) return false;
      break;
    case M::kArrayFirst:
      if (c == ']') {
        if (n && n->min_items > 0) return false;
      } else if (!start_value(c)) {
        return false;
      }
      break;
    case M::kKeyFirst:
    case M::kKey:
      if (c == '"') {
        f->key_cand = n ? all_keys & ~f->seen : 0;
        f->key_at = 0;
        if (n && f->key_cand == 0) return false;
      } else if (c == '}' && n && (n->required & ~f->seen)) {
        return false;
      }
      break;
    case M::kString:
    case M::kEscape:
    case M::kUnicode:
      if (!json_.key_ || !n) break;
      if (m == M::kString && c == '"') {  // the key ends
        int found = -1;
        for (size_t i = 0; i < n->keys.size(); ++i)
          if ((f->key_cand >> i & 1) && n->keys[i].size() == f->key_at) found = int(i);
        if (found < 0) return false;
        f->seen |= uint64_t(1) << found;
        f->pending = int16_t(n->key_node[size_t(found)]);
      } else {
        uint64_t keep = 0;
        for (size_t i = 0; i < n->keys.size(); ++i)
          if ((f->key_cand >> i & 1) && n->keys[i].size() > f->key_at &&
              uint8_t(n->keys[i][f->key_at]) == c)
            keep |= uint64_t(1) << i;
        if (!keep) return false;
        f->key_cand = keep;
        ++f->key_at;
      }
      break;
    case M::kAfter:
      if (!f) break;
      if (c == ',') {
        if (n && json_.stack_[size_t(json_.depth_ - 1)] == '{' && (all_keys & ~f->seen) == 0)
          return false;
        if (n && json_.stack_[size_t(json_.depth_ - 1)] == '[' && f->count >= n->max_items)
          return false;
      } else if (c == '}' && n && (n->required & ~f->seen)) {
        return false;
      } else if (c == ']' && n && f->count < n->min_items) {
        return false;
      }
      break;
    default:
      break;
  }
  const int depth_before = json_.depth_;
  if (!json_.step(c)) return false;
  if (json_.depth_ < depth_before) {  // a container closed
    --depth_;
    value_ended();
  }
  return true;
}

bool SchemaPrefix::feed(uint8_t c) {
  const SchemaPrefix save = *this;
  if (step(c)) return true;
  *this = save;
  return false;
}

bool SchemaPrefix::feed_all(std::string_view s) {
  const SchemaPrefix save = *this;
  for (char ch : s)
    if (!step(uint8_t(ch))) {
      *this = save;
      return false;
    }
  return true;
}

}  // namespace ts::runtime
