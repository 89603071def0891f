// Values of the Jinja interpreter behind chat templates, with the Python semantics Jinja2 gives
// them (transformers renders chat templates with Jinja2, so "what Python would do" is the spec):
// truthiness, ==, ordering, str() and repr() text, and json.dumps() for the tojson filter.
//
// Invariants: lists and dicts are shared (copying a Value copies a pointer), as in Python; the
// sandbox transformers uses is immutable, so only namespace() objects are ever mutated. Dicts keep
// insertion order (JSON input is read with nlohmann::ordered_json for the same reason). Strings
// are UTF-8; lengths, indices and slices count code points, as Python's str does.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

namespace ts::tokenizer::jinja {

// A template error: the message and the template line it belongs to (0 = not yet known; the
// statement being executed fills it in). Thrown inside the interpreter only; the public API
// (chat_template.h) turns it into an Error value. Exceptions here keep the recursive evaluator
// readable: every expression can fail, and threading Result<> through ~100 evaluation paths
// would bury the semantics.
class TemplateError : public std::runtime_error {
 public:
  explicit TemplateError(const std::string& message, int line = 0)
      : std::runtime_error(message), line_(line) {}
  int line() const { return line_; }

 private:
  int line_;
};

class Value;
struct ListData;
struct DictData;
struct Callable;

// Python None.
struct NoneType {
  bool operator==(const NoneType&) const = default;
};
// Jinja's Undefined: a missing variable, key or attribute. `hint` is the error to raise when the
// value is used in a way Undefined forbids ("'x' is undefined").
struct Undefined {
  std::string hint;
};

class Value {
 public:
  using ListPtr = std::shared_ptr<ListData>;
  using DictPtr = std::shared_ptr<DictData>;
  using FuncPtr = std::shared_ptr<const Callable>;

  Value() : v_(Undefined{}) {}
  Value(Undefined u) : v_(std::move(u)) {}      // NOLINT
  Value(NoneType n) : v_(n) {}                  // NOLINT
  Value(bool b) : v_(b) {}                      // NOLINT
  Value(int64_t i) : v_(i) {}                   // NOLINT
  Value(int i) : v_(int64_t(i)) {}              // NOLINT
  Value(double d) : v_(d) {}                    // NOLINT
  Value(std::string s) : v_(std::move(s)) {}    // NOLINT
  Value(const char* s) : v_(std::string(s)) {}  // NOLINT
  Value(ListPtr l) : v_(std::move(l)) {}        // NOLINT
  Value(DictPtr d) : v_(std::move(d)) {}        // NOLINT
  Value(FuncPtr f) : v_(std::move(f)) {}        // NOLINT

  static Value undefined(std::string hint) { return Value(Undefined{std::move(hint)}); }
  static Value none() { return Value(NoneType{}); }
  static Value list(std::vector<Value> items = {});
  static Value tuple(std::vector<Value> items);
  // A lazily evaluated sequence in Python (map/select/... results): iterable, always truthy,
  // but with no len() and no indexing — exactly the traps templates can fall into.
  static Value generator(std::vector<Value> items);
  static Value dict();
  static Value namespace_object();
  static Value from_json(const nlohmann::ordered_json& j);

  bool is_undefined() const { return std::holds_alternative<Undefined>(v_); }
  bool is_none() const { return std::holds_alternative<NoneType>(v_); }
  bool is_bool() const { return std::holds_alternative<bool>(v_); }
  bool is_int() const { return std::holds_alternative<int64_t>(v_); }
  bool is_float() const { return std::holds_alternative<double>(v_); }
  bool is_number() const { return is_int() || is_float() || is_bool(); }
  bool is_string() const { return std::holds_alternative<std::string>(v_); }
  bool is_list_like() const { return std::holds_alternative<ListPtr>(v_); }  // list/tuple/gen
  bool is_list() const;  // a real list or tuple (not a generator)
  bool is_generator() const;
  bool is_tuple() const;
  bool is_dict_like() const { return std::holds_alternative<DictPtr>(v_); }
  bool is_dict() const;  // a mapping (not a namespace / loop object)
  bool is_namespace() const;
  bool is_callable() const { return std::holds_alternative<FuncPtr>(v_); }

  bool as_bool() const { return std::get<bool>(v_); }
  int64_t as_int() const { return std::get<int64_t>(v_); }
  double as_float() const { return std::get<double>(v_); }
  const std::string& as_string() const { return std::get<std::string>(v_); }
  const ListPtr& as_list() const { return std::get<ListPtr>(v_); }
  const DictPtr& as_dict() const { return std::get<DictPtr>(v_); }
  const FuncPtr& as_callable() const { return std::get<FuncPtr>(v_); }
  const Undefined& as_undefined() const { return std::get<Undefined>(v_); }
  // Numeric value of an int/float/bool.
  double to_double() const;
  // An int or bool as int64.
  int64_t to_int() const;

  // Python's type name, as error messages print it: 'str', 'int', 'NoneType', 'dict', ...
  std::string type_name() const;

 private:
  std::variant<Undefined, NoneType, bool, int64_t, double, std::string, ListPtr, DictPtr, FuncPtr>
      v_;
};

struct ListData {
  enum class Kind { kList, kTuple, kGenerator };
  std::vector<Value> items;
  Kind kind = Kind::kList;
};

// A Python dict (kind kDict), a Jinja namespace() (kNamespace: attributes only, mutable), or an
// object whose attributes the interpreter provides (kObject: the `loop` variable).
struct DictData {
  enum class Kind { kDict, kNamespace, kObject };
  std::vector<std::pair<Value, Value>> items;
  Kind kind = Kind::kDict;

  const Value* find(const Value& key) const;
  const Value* find_key(std::string_view key) const;
  void set(const Value& key, Value value);
};

struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;
};

class Interpreter;
// A function templates can call: a global (range, namespace, raise_exception), a bound method
// ("abc".upper), or a macro.
struct Callable {
  std::string name;
  std::function<Value(Interpreter&, CallArgs&)> fn;
};

// Python semantics.
bool truthy(const Value& v);
bool equals(const Value& a, const Value& b);
// -1, 0, 1 for a < b, a == b, a > b; throws TypeError-like TemplateError for unorderable types.
int compare(const Value& a, const Value& b);
// str(v), as {{ v }} prints it (Undefined prints as "").
std::string to_str(const Value& v);
// repr(v).
std::string repr(const Value& v);
// Python repr of a float ("1.0", "1e-05", "0.30000000000000004").
std::string float_repr(double d);

// json.dumps(v, ensure_ascii, indent, separators, sort_keys) — transformers' tojson filter.
struct JsonOptions {
  bool ensure_ascii = false;
  int indent = -1;         // < 0: None (single line)
  std::string indent_str;  // used when indent was given as a string
  bool indent_is_string = false;
  std::string item_separator = ", ";
  std::string key_separator = ": ";
  bool sort_keys = false;
};
std::string to_json(const Value& v, const JsonOptions& options);

// UTF-8 helpers (code-point semantics of Python str).
std::vector<uint32_t> utf8_decode(std::string_view s);
std::string utf8_encode(const std::vector<uint32_t>& cps);
void utf8_append(std::string& out, uint32_t cp);
size_t utf8_length(std::string_view s);
bool is_py_space(uint32_t cp);

}  // namespace ts::tokenizer::jinja
