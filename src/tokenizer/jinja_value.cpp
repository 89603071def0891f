// Python semantics of template values: see jinja_value.h.
#include "tokenizer/jinja_value.h"

#include <utf8proc.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

namespace ts::tokenizer::jinja {

Value Value::list(std::vector<Value> items) {
  auto l = std::make_shared<ListData>();
  l->items = std::move(items);
  return Value(l);
}

Value Value::tuple(std::vector<Value> items) {
  auto l = std::make_shared<ListData>();
  l->items = std::move(items);
  l->kind = ListData::Kind::kTuple;
  return Value(l);
}

Value Value::generator(std::vector<Value> items) {
  auto l = std::make_shared<ListData>();
  l->items = std::move(items);
  l->kind = ListData::Kind::kGenerator;
  return Value(l);
}

Value Value::dict() { return Value(std::make_shared<DictData>()); }

Value Value::namespace_object() {
  auto d = std::make_shared<DictData>();
  d->kind = DictData::Kind::kNamespace;
  return Value(d);
}

Value Value::from_json(const nlohmann::ordered_json& j) {
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null:
      return none();
    case nlohmann::ordered_json::value_t::boolean:
      return Value(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
      return Value(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: {
      uint64_t u = j.get<uint64_t>();
      if (u > uint64_t(INT64_MAX)) return Value(double(u));
      return Value(int64_t(u));
    }
    case nlohmann::ordered_json::value_t::number_float:
      return Value(j.get<double>());
    case nlohmann::ordered_json::value_t::string:
      return Value(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      std::vector<Value> items;
      items.reserve(j.size());
      for (const auto& e : j) items.push_back(from_json(e));
      return list(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      Value d = dict();
      for (auto it = j.begin(); it != j.end(); ++it)
        d.as_dict()->items.emplace_back(Value(it.key()), from_json(it.value()));
      return d;
    }
    default:
      return none();  // binary / discarded: not produced by the JSON parser
  }
}

bool Value::is_list() const {
  return is_list_like() && as_list()->kind != ListData::Kind::kGenerator;
}
bool Value::is_generator() const {
  return is_list_like() && as_list()->kind == ListData::Kind::kGenerator;
}
bool Value::is_tuple() const { return is_list_like() && as_list()->kind == ListData::Kind::kTuple; }
bool Value::is_dict() const { return is_dict_like() && as_dict()->kind == DictData::Kind::kDict; }
bool Value::is_namespace() const {
  return is_dict_like() && as_dict()->kind == DictData::Kind::kNamespace;
}

double Value::to_double() const {
  if (is_float()) return as_float();
  if (is_int()) return double(as_int());
  if (is_bool()) return as_bool() ? 1.0 : 0.0;
  return 0.0;
}

int64_t Value::to_int() const {
  if (is_int()) return as_int();
  if (is_bool()) return as_bool() ? 1 : 0;
  if (is_float()) return int64_t(as_float());
  return 0;
}

std::string Value::type_name() const {
  if (is_undefined()) return "Undefined";
  if (is_none()) return "NoneType";
  if (is_bool()) return "bool";
  if (is_int()) return "int";
  if (is_float()) return "float";
  if (is_string()) return "str";
  if (is_list_like()) {
    switch (as_list()->kind) {
      case ListData::Kind::kList:
        return "list";
      case ListData::Kind::kTuple:
        return "tuple";
      case ListData::Kind::kGenerator:
        return "generator";
    }
  }
  if (is_dict_like()) {
    switch (as_dict()->kind) {
      case DictData::Kind::kDict:
        return "dict";
      case DictData::Kind::kNamespace:
        return "Namespace";
      case DictData::Kind::kObject:
        return "LoopContext";
    }
  }
  return "function";
}

const Value* DictData::find(const Value& key) const {
  for (const auto& [k, v] : items)
    if (equals(k, key)) return &v;
  return nullptr;
}

const Value* DictData::find_key(std::string_view key) const {
  for (const auto& [k, v] : items)
    if (k.is_string() && k.as_string() == key) return &v;
  return nullptr;
}

void DictData::set(const Value& key, Value value) {
  for (auto& [k, v] : items) {
    if (equals(k, key)) {
      v = std::move(value);
      return;
    }
  }
  items.emplace_back(key, std::move(value));
}

bool truthy(const Value& v) {
  if (v.is_undefined() || v.is_none()) return false;
  if (v.is_bool()) return v.as_bool();
  if (v.is_int()) return v.as_int() != 0;
  if (v.is_float()) return v.as_float() != 0.0;
  if (v.is_string()) return !v.as_string().empty();
  if (v.is_list_like()) return v.is_generator() || !v.as_list()->items.empty();
  if (v.is_dict_like()) return !v.is_dict() || !v.as_dict()->items.empty();
  return true;
}

bool equals(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) return a.to_double() == b.to_double();
    return a.to_int() == b.to_int();
  }
  if (a.is_string() && b.is_string()) return a.as_string() == b.as_string();
  if (a.is_none() && b.is_none()) return true;
  if (a.is_undefined() && b.is_undefined()) return true;
  if (a.is_list_like() && b.is_list_like()) {
    const auto& la = *a.as_list();
    const auto& lb = *b.as_list();
    if (&la == &lb) return true;
    if (la.kind != lb.kind || la.kind == ListData::Kind::kGenerator) return false;
    if (la.items.size() != lb.items.size()) return false;
    for (size_t i = 0; i < la.items.size(); ++i)
      if (!equals(la.items[i], lb.items[i])) return false;
    return true;
  }
  if (a.is_dict_like() && b.is_dict_like()) {
    if (a.as_dict() == b.as_dict()) return true;
    if (!a.is_dict() || !b.is_dict()) return false;
    const auto& da = *a.as_dict();
    const auto& db = *b.as_dict();
    if (da.items.size() != db.items.size()) return false;
    for (const auto& [k, v] : da.items) {
      const Value* other = db.find(k);
      if (!other || !equals(v, *other)) return false;
    }
    return true;
  }
  if (a.is_callable() && b.is_callable()) return a.as_callable() == b.as_callable();
  return false;
}

int compare(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) {
      double x = a.to_double(), y = b.to_double();
      return x < y ? -1 : (x > y ? 1 : 0);
    }
    int64_t x = a.to_int(), y = b.to_int();
    return x < y ? -1 : (x > y ? 1 : 0);
  }
  if (a.is_string() && b.is_string()) {
    int c = a.as_string().compare(b.as_string());  // UTF-8 byte order == code point order
    return c < 0 ? -1 : (c > 0 ? 1 : 0);
  }
  if (a.is_list() && b.is_list() && a.is_tuple() == b.is_tuple()) {
    const auto& la = a.as_list()->items;
    const auto& lb = b.as_list()->items;
    for (size_t i = 0; i < la.size() && i < lb.size(); ++i) {
      if (equals(la[i], lb[i])) continue;
      return compare(la[i], lb[i]);
    }
    return la.size() < lb.size() ? -1 : (la.size() > lb.size() ? 1 : 0);
  }
  throw TemplateError("'<' not supported between instances of '" + a.type_name() + "' and '" +
                      b.type_name() + "'");
}

std::string float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d < 0 ? "-inf" : "inf";
  if (d == 0.0) return std::signbit(d) ? "-0.0" : "0.0";
  // Shortest round-trip digits, then Python's layout rule (repr switches to exponent form when
  // the decimal point position is <= -4 or > 16).
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof(buf), d, std::chars_format::scientific);
  std::string sci(buf, res.ptr);
  std::string out;
  size_t pos = 0;
  if (sci[0] == '-') {
    out = "-";
    pos = 1;
  }
  size_t e_pos = sci.find('e');
  std::string mantissa = sci.substr(pos, e_pos - pos);
  int exponent = std::stoi(sci.substr(e_pos + 1));
  std::string digits;
  for (char c : mantissa)
    if (c != '.') digits += c;
  int decpt = exponent + 1;
  if (decpt > -4 && decpt <= 16) {
    if (decpt <= 0) {
      out += "0." + std::string(size_t(-decpt), '0') + digits;
    } else if (size_t(decpt) >= digits.size()) {
      out += digits + std::string(size_t(decpt) - digits.size(), '0') + ".0";
    } else {
      out += digits.substr(0, size_t(decpt)) + "." + digits.substr(size_t(decpt));
    }
  } else {
    out += digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    int e = decpt - 1;
    char eb[16];
    std::snprintf(eb, sizeof(eb), "e%c%02d", e < 0 ? '-' : '+', e < 0 ? -e : e);
    out += eb;
  }
  return out;
}

// ---- UTF-8 ----

std::vector<uint32_t> utf8_decode(std::string_view s) {
  std::vector<uint32_t> out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    utf8proc_int32_t cp = 0;
    utf8proc_ssize_t n = utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(s.data() + i),
                                          utf8proc_ssize_t(s.size() - i), &cp);
    if (n <= 0) {
      out.push_back(0xFFFD);
      ++i;
    } else {
      out.push_back(uint32_t(cp));
      i += size_t(n);
    }
  }
  return out;
}

void utf8_append(std::string& out, uint32_t cp) {
  utf8proc_uint8_t buf[4];
  utf8proc_ssize_t n = utf8proc_encode_char(utf8proc_int32_t(cp), buf);
  out.append(reinterpret_cast<const char*>(buf), size_t(n));
}

std::string utf8_encode(const std::vector<uint32_t>& cps) {
  std::string out;
  out.reserve(cps.size());
  for (uint32_t cp : cps) utf8_append(out, cp);
  return out;
}

size_t utf8_length(std::string_view s) {
  size_t n = 0;
  for (unsigned char c : s)
    if ((c & 0xC0) != 0x80) ++n;
  return n;
}

bool is_py_space(uint32_t cp) {
  switch (cp) {
    case ' ':
    case '\t':
    case '\n':
    case '\v':
    case '\f':
    case '\r':
    case 0x1c:
    case 0x1d:
    case 0x1e:
    case 0x1f:
    case 0x85:
    case 0xa0:
    case 0x1680:
    case 0x2028:
    case 0x2029:
    case 0x202f:
    case 0x205f:
    case 0x3000:
      return true;
    default:
      return cp >= 0x2000 && cp <= 0x200a;
  }
}

// ---- str / repr ----

namespace {

bool py_printable(uint32_t cp) {
  if (cp == ' ') return true;
  switch (utf8proc_category(utf8proc_int32_t(cp))) {
    case UTF8PROC_CATEGORY_CC:
    case UTF8PROC_CATEGORY_CF:
    case UTF8PROC_CATEGORY_CS:
    case UTF8PROC_CATEGORY_CO:
    case UTF8PROC_CATEGORY_CN:
    case UTF8PROC_CATEGORY_ZL:
    case UTF8PROC_CATEGORY_ZP:
    case UTF8PROC_CATEGORY_ZS:
      return false;
    default:
      return true;
  }
}

std::string string_repr(const std::string& s) {
  bool has_single = s.find('\'') != std::string::npos;
  bool has_double = s.find('"') != std::string::npos;
  char quote = (has_single && !has_double) ? '"' : '\'';
  std::string out(1, quote);
  for (uint32_t cp : utf8_decode(s)) {
    if (cp == '\\') {
      out += "\\\\";
    } else if (cp == uint32_t(quote)) {
      out += '\\';
      out += quote;
    } else if (cp == '\n') {
      out += "\\n";
    } else if (cp == '\r') {
      out += "\\r";
    } else if (cp == '\t') {
      out += "\\t";
    } else if (!py_printable(cp)) {
      char buf[16];
      if (cp <= 0xff)
        std::snprintf(buf, sizeof(buf), "\\x%02x", cp);
      else if (cp <= 0xffff)
        std::snprintf(buf, sizeof(buf), "\\u%04x", cp);
      else
        std::snprintf(buf, sizeof(buf), "\\U%08x", cp);
      out += buf;
    } else {
      utf8_append(out, cp);
    }
  }
  out += quote;
  return out;
}

}  // namespace

std::string to_str(const Value& v) {
  if (v.is_undefined()) return "";
  if (v.is_string()) return v.as_string();
  return repr(v);
}

std::string repr(const Value& v) {
  if (v.is_undefined()) return "Undefined";
  if (v.is_none()) return "None";
  if (v.is_bool()) return v.as_bool() ? "True" : "False";
  if (v.is_int()) return std::to_string(v.as_int());
  if (v.is_float()) return float_repr(v.as_float());
  if (v.is_string()) return string_repr(v.as_string());
  if (v.is_list_like()) {
    const auto& l = *v.as_list();
    if (l.kind == ListData::Kind::kGenerator) return "<generator object>";
    bool tuple = l.kind == ListData::Kind::kTuple;
    std::string out = tuple ? "(" : "[";
    for (size_t i = 0; i < l.items.size(); ++i) {
      if (i) out += ", ";
      out += repr(l.items[i]);
    }
    if (tuple && l.items.size() == 1) out += ",";
    out += tuple ? ")" : "]";
    return out;
  }
  if (v.is_dict_like()) {
    const auto& d = *v.as_dict();
    std::string out = d.kind == DictData::Kind::kNamespace ? "<Namespace {" : "{";
    for (size_t i = 0; i < d.items.size(); ++i) {
      if (i) out += ", ";
      out += repr(d.items[i].first) + ": " + repr(d.items[i].second);
    }
    out += d.kind == DictData::Kind::kNamespace ? "}>" : "}";
    return out;
  }
  return "<function " + v.as_callable()->name + ">";
}

// ---- json.dumps ----

namespace {

void json_string(std::string& out, const std::string& s, bool ensure_ascii) {
  out += '"';
  for (uint32_t cp : utf8_decode(s)) {
    switch (cp) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default: {
        char buf[16];
        if (cp < 0x20) {
          std::snprintf(buf, sizeof(buf), "\\u%04x", cp);
          out += buf;
        } else if (ensure_ascii && cp > 0x7e) {
          if (cp > 0xffff) {
            uint32_t c = cp - 0x10000;
            std::snprintf(buf, sizeof(buf), "\\u%04x\\u%04x", 0xd800 + (c >> 10),
                          0xdc00 + (c & 0x3ff));
          } else {
            std::snprintf(buf, sizeof(buf), "\\u%04x", cp);
          }
          out += buf;
        } else {
          utf8_append(out, cp);
        }
      }
    }
  }
  out += '"';
}

std::string json_float(double d) {
  if (std::isnan(d)) return "NaN";
  if (std::isinf(d)) return d < 0 ? "-Infinity" : "Infinity";
  return float_repr(d);
}

std::string json_key(const Value& k) {
  if (k.is_string()) return k.as_string();
  if (k.is_bool()) return k.as_bool() ? "true" : "false";
  if (k.is_int()) return std::to_string(k.as_int());
  if (k.is_float()) return json_float(k.as_float());
  if (k.is_none()) return "null";
  throw TemplateError("keys must be str, int, float, bool or None, not " + k.type_name());
}

void json_value(std::string& out, const Value& v, const JsonOptions& o, int level) {
  auto newline = [&](int lvl) {
    out += '\n';
    for (int i = 0; i < lvl; ++i) {
      if (o.indent_is_string)
        out += o.indent_str;
      else
        out += std::string(size_t(o.indent), ' ');
    }
  };
  bool pretty = o.indent >= 0 || o.indent_is_string;
  if (v.is_none()) {
    out += "null";
  } else if (v.is_bool()) {
    out += v.as_bool() ? "true" : "false";
  } else if (v.is_int()) {
    out += std::to_string(v.as_int());
  } else if (v.is_float()) {
    out += json_float(v.as_float());
  } else if (v.is_string()) {
    json_string(out, v.as_string(), o.ensure_ascii);
  } else if (v.is_list()) {
    const auto& items = v.as_list()->items;
    if (items.empty()) {
      out += "[]";
      return;
    }
    out += '[';
    for (size_t i = 0; i < items.size(); ++i) {
      if (i) out += o.item_separator;
      if (pretty) newline(level + 1);
      json_value(out, items[i], o, level + 1);
    }
    if (pretty) newline(level);
    out += ']';
  } else if (v.is_dict()) {
    const auto& items = v.as_dict()->items;
    if (items.empty()) {
      out += "{}";
      return;
    }
    std::vector<std::pair<std::string, const Value*>> kv;
    for (const auto& [k, val] : items) kv.emplace_back(json_key(k), &val);
    if (o.sort_keys)
      std::stable_sort(kv.begin(), kv.end(),
                       [](const auto& a, const auto& b) { return a.first < b.first; });
    out += '{';
    for (size_t i = 0; i < kv.size(); ++i) {
      if (i) out += o.item_separator;
      if (pretty) newline(level + 1);
      json_string(out, kv[i].first, o.ensure_ascii);
      out += o.key_separator;
      json_value(out, *kv[i].second, o, level + 1);
    }
    if (pretty) newline(level);
    out += '}';
  } else {
    throw TemplateError("Object of type " + v.type_name() + " is not JSON serializable");
  }
}

}  // namespace

std::string to_json(const Value& v, const JsonOptions& options) {
  std::string out;
  json_value(out, v, options, 0);
  return out;
}

}  // namespace ts::tokenizer::jinja
