// Built-in filters, tests, globals and methods; see jinja_builtins.h. Each one follows its
// jinja2/filters.py, jinja2/tests.py or Python counterpart; the comments name deliberate gaps.
#include "tokenizer/jinja_builtins.h"

#include <utf8proc.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <map>

#include "tokenizer/jinja_eval.h"
#include "tokenizer/jinja_pystr.h"

namespace ts::tokenizer::jinja {

namespace {

// ---- argument helpers ----

void check_args(const CallArgs& a, std::string_view fname, size_t max_positional,
                std::initializer_list<std::string_view> keywords) {
  if (a.positional.size() > max_positional)
    throw TemplateError(std::string(fname) + "() takes at most " + std::to_string(max_positional) +
                        " argument(s) (" + std::to_string(a.positional.size()) + " given)");
  for (const auto& [k, v] : a.keyword) {
    if (std::find(keywords.begin(), keywords.end(), k) == keywords.end())
      throw TemplateError(std::string(fname) + "() got an unexpected keyword argument '" + k + "'");
  }
}

// Positional argument `pos` or keyword `name`, else `dflt`.
Value arg(const CallArgs& a, size_t pos, std::string_view name, Value dflt = Value()) {
  if (pos < a.positional.size()) return a.positional[pos];
  for (const auto& [k, v] : a.keyword)
    if (k == name) return v;
  return dflt;
}

const std::string& need_string(const Value& v, std::string_view what) {
  if (!v.is_string()) throw TemplateError(std::string(what) + " must be str, not " + v.type_name());
  return v.as_string();
}

int64_t need_int(const Value& v, std::string_view what) {
  if (!v.is_int() && !v.is_bool())
    throw TemplateError(std::string(what) + ": '" + v.type_name() +
                        "' object cannot be interpreted as an integer");
  return v.to_int();
}

Value make_callable(std::string name, std::function<Value(Interpreter&, CallArgs&)> fn) {
  auto c = std::make_shared<Callable>();
  c->name = std::move(name);
  c->fn = std::move(fn);
  return Value(Value::FuncPtr(c));
}

// ---- filters ----

int64_t length_of(const Value& v) {
  if (v.is_undefined()) return 0;
  if (v.is_string()) return int64_t(utf8_length(v.as_string()));
  if (v.is_list()) return int64_t(v.as_list()->items.size());
  if (v.is_dict()) return int64_t(v.as_dict()->items.size());
  throw TemplateError("object of type '" + v.type_name() + "' has no len()");
}

// Jinja's make_attrgetter: "a.b.0" walks getitem with each part (integers as indices).
Value get_attribute_path(Interpreter& in, const Value& item, const Value& attribute) {
  if (attribute.is_int()) return in.getitem(item, attribute);
  std::string path = to_str(attribute);
  Value cur = item;
  size_t start = 0;
  while (true) {
    size_t dot = path.find('.', start);
    std::string part =
        path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    bool numeric = !part.empty() && std::all_of(part.begin(), part.end(), [](char ch) {
      return std::isdigit(static_cast<unsigned char>(ch));
    });
    cur = in.getitem(cur, numeric ? Value(int64_t(std::stoll(part))) : Value(part));
    if (dot == std::string::npos) return cur;
    start = dot + 1;
  }
}

Value f_length(Interpreter&, const Value& v, CallArgs& a) {
  check_args(a, "length", 0, {});
  return Value(length_of(v));
}

Value f_first(Interpreter& in, const Value& v, CallArgs& a) {
  check_args(a, "first", 0, {});
  std::vector<Value> items = in.iterate(v);
  if (items.empty()) return Value::undefined("No first item, sequence was empty.");
  return items.front();
}

Value f_last(Interpreter& in, const Value& v, CallArgs& a) {
  check_args(a, "last", 0, {});
  if (v.is_generator()) throw TemplateError("'generator' object is not reversible");
  std::vector<Value> items = in.iterate(v);
  if (items.empty()) return Value::undefined("No last item, sequence was empty.");
  return items.back();
}

Value f_list(Interpreter& in, const Value& v, CallArgs& a) {
  check_args(a, "list", 0, {});
  return Value::list(in.iterate(v));
}

Value f_join(Interpreter& in, const Value& v, CallArgs& a) {
  check_args(a, "join", 2, {"d", "attribute"});
  std::string sep = to_str(arg(a, 0, "d", Value("")));
  Value attribute = arg(a, 1, "attribute", Value::none());
  std::string out;
  bool first = true;
  for (const Value& item : in.iterate(v)) {
    if (!first) out += sep;
    first = false;
    out += to_str(attribute.is_none() ? item : get_attribute_path(in, item, attribute));
  }
  return Value(std::move(out));
}

Value f_default(Interpreter&, const Value& v, CallArgs& a) {
  check_args(a, "default", 2, {"default_value", "boolean"});
  Value dflt = arg(a, 0, "default_value", Value(""));
  bool boolean = truthy(arg(a, 1, "boolean", Value(false)));
  if (v.is_undefined() || (boolean && !truthy(v))) return dflt;
  return v;
}

Value f_trim(Interpreter&, const Value& v, CallArgs& a) {
  check_args(a, "trim", 1, {"chars"});
  return Value(py_strip(to_str(v), arg(a, 0, "chars", Value::none()), true, true));
}

Value f_upper(Interpreter&, const Value& v, CallArgs& a) {
  check_args(a, "upper", 0, {});
  return Value(py_upper(to_str(v)));
}

Value f_lower(Interpreter&, const Value& v, CallArgs& a) {
  check_args(a, "lower", 0, {});
  return Value(py_lower(to_str(v)));
}

Value f_capitalize(Interpreter&, const Value& v, CallArgs& a) {
  check_args(a, "capitalize", 0, {});
  return Value(py_capitalize(to_str(v)));
}

// Jinja's title filter: words start after '-', whitespace or an opening bracket.
Value f_title(Interpreter&, const Value& v, CallArgs& a) {
  check_args(a, "title", 0, {});
  std::string out;
  bool word_start = true;
  for (uint32_t c : utf8_decode(to_str(v))) {
    bool delim = c == '-' || c == '(' || c == '{' || c == '[' || c == '<' || is_py_space(c);
    if (delim) {
      utf8_append(out, c);
      word_start = true;
    } else {
      if (word_start)
        append_upper(out, c);
      else
        append_lower(out, c);
      word_start = false;
    }
  }
  return Value(std::move(out));
}

Value f_string(Interpreter&, const Value& v, CallArgs& a) {
  check_args(a, "string", 0, {});
  return Value(to_str(v));
}

Value f_int(Interpreter&, const Value& v, CallArgs& a) {
  check_args(a, "int", 2, {"default", "base"});
  Value dflt = arg(a, 0, "default", Value(0));
  int base = int(need_int(arg(a, 1, "base", Value(10)), "int base"));
  require_defined(v);  // int(Undefined) raises in jinja2
  if (v.is_int()) return v;
  if (v.is_bool()) return Value(v.to_int());
  if (v.is_float()) return std::isfinite(v.as_float()) ? Value(int64_t(v.as_float())) : dflt;
  if (v.is_string()) {
    int64_t i;
    if (parse_py_int(v.as_string(), base, &i)) return Value(i);
    double d;
    if (parse_py_float(v.as_string(), &d) && std::isfinite(d)) return Value(int64_t(d));
  }
  return dflt;
}

Value f_float(Interpreter&, const Value& v, CallArgs& a) {
  check_args(a, "float", 1, {"default"});
  Value dflt = arg(a, 0, "default", Value(0.0));
  require_defined(v);  // float(Undefined) raises in jinja2
  if (v.is_number()) return Value(v.to_double());
  double d;
  if (v.is_string() && parse_py_float(v.as_string(), &d)) return Value(d);
  return dflt;
}

Value f_replace(Interpreter&, const Value& v, CallArgs& a) {
  check_args(a, "replace", 3, {"old", "new", "count"});
  Value count = arg(a, 2, "count", Value::none());
  return Value(py_replace(to_str(v), to_str(arg(a, 0, "old")), to_str(arg(a, 1, "new")),
                          count.is_none() ? -1 : need_int(count, "replace count")));
}

Value f_items(Interpreter&, const Value& v, CallArgs& a) {
  check_args(a, "items", 0, {});
  if (v.is_undefined()) return Value::generator({});
  if (!v.is_dict()) throw TemplateError("Can only get item pairs from a mapping.");
  std::vector<Value> out;
  for (const auto& [k, val] : v.as_dict()->items) out.push_back(Value::tuple({k, val}));
  return Value::generator(std::move(out));
}

Value f_dictsort(Interpreter&, const Value& v, CallArgs& a) {
  check_args(a, "dictsort", 3, {"case_sensitive", "by", "reverse"});
  if (!v.is_dict()) throw TemplateError("dictsort: expected a mapping, got " + v.type_name());
  bool case_sensitive = truthy(arg(a, 0, "case_sensitive", Value(false)));
  std::string by = to_str(arg(a, 1, "by", Value("key")));
  bool reverse = truthy(arg(a, 2, "reverse", Value(false)));
  std::vector<std::pair<Value, Value>> items = v.as_dict()->items;
  auto key = [&](const std::pair<Value, Value>& kv) {
    Value k = by == "value" ? kv.second : kv.first;
    if (!case_sensitive && k.is_string()) return Value(py_lower(k.as_string()));
    return k;
  };
  std::stable_sort(items.begin(), items.end(), [&](const auto& x, const auto& y) {
    int c = compare(key(x), key(y));
    return reverse ? c > 0 : c < 0;
  });
  std::vector<Value> out;
  for (auto& kv : items) out.push_back(Value::tuple({kv.first, kv.second}));
  return Value::list(std::move(out));
}

Value f_tojson(Interpreter&, const Value& v, CallArgs& a) {
  // transformers' override: tojson(x, ensure_ascii=False, indent=None, separators=None,
  // sort_keys=False) -> json.dumps(...). Note the positional order: ensure_ascii comes first.
  check_args(a, "tojson", 4, {"ensure_ascii", "indent", "separators", "sort_keys"});
  JsonOptions o;
  o.ensure_ascii = truthy(arg(a, 0, "ensure_ascii", Value(false)));
  Value indent = arg(a, 1, "indent", Value::none());
  if (indent.is_string()) {
    o.indent_is_string = true;
    o.indent_str = indent.as_string();
  } else if (!indent.is_none() && !indent.is_undefined()) {
    o.indent = int(std::max<int64_t>(0, need_int(indent, "tojson indent")));
  }
  bool pretty = o.indent >= 0 || o.indent_is_string;
  if (pretty) o.item_separator = ",";
  Value seps = arg(a, 2, "separators", Value::none());
  if (!seps.is_none() && !seps.is_undefined()) {
    if (!seps.is_list() || seps.as_list()->items.size() != 2)
      throw TemplateError("tojson separators must be a (item_separator, key_separator) pair");
    o.item_separator = to_str(seps.as_list()->items[0]);
    o.key_separator = to_str(seps.as_list()->items[1]);
  }
  o.sort_keys = truthy(arg(a, 3, "sort_keys", Value(false)));
  return Value(to_json(v, o));
}

Value f_safe(Interpreter&, const Value& v, CallArgs& a) {
  check_args(a, "safe", 0, {});
  return v;
}

Value f_escape(Interpreter&, const Value& v, CallArgs& a) {
  check_args(a, "escape", 0, {});
  return Value(html_escape(to_str(v)));
}

Value f_abs(Interpreter&, const Value& v, CallArgs& a) {
  check_args(a, "abs", 0, {});
  if (v.is_float()) return Value(std::fabs(v.as_float()));
  if (v.is_int() || v.is_bool()) return Value(v.to_int() < 0 ? -v.to_int() : v.to_int());
  throw TemplateError("bad operand type for abs(): '" + v.type_name() + "'");
}

Value f_attr(Interpreter& in, const Value& v, CallArgs& a) {
  check_args(a, "attr", 1, {"name"});
  return in.getattr(v, to_str(arg(a, 0, "name")));
}

// map('filter', args...) or map(attribute='x', default=...)
Value f_map(Interpreter& in, const Value& v, CallArgs& a) {
  std::vector<Value> out;
  if (!truthy(v)) return Value::generator({});  // jinja2: `if value: for item in value: ...`
  Value attribute = arg(a, 99, "attribute");
  if (!attribute.is_undefined()) {
    Value dflt = arg(a, 99, "default");
    for (const Value& item : in.iterate(v)) {
      Value x = get_attribute_path(in, item, attribute);
      out.push_back(x.is_undefined() && !dflt.is_undefined() ? dflt : x);
    }
    return Value::generator(std::move(out));
  }
  if (a.positional.empty()) throw TemplateError("map requires a filter argument");
  std::string name = to_str(a.positional[0]);
  CallArgs rest;
  rest.positional.assign(a.positional.begin() + 1, a.positional.end());
  rest.keyword = a.keyword;
  for (const Value& item : in.iterate(v)) {
    CallArgs copy = rest;
    out.push_back(in.apply_filter(name, item, copy));
  }
  return Value::generator(std::move(out));
}

Value select_impl(Interpreter& in, const Value& v, CallArgs& a, bool by_attr, bool keep) {
  if (!truthy(v)) return Value::generator({});  // jinja2: `if value: for item in value: ...`
  size_t first = by_attr ? 1 : 0;
  Value attribute = by_attr ? arg(a, 0, "attr") : Value();
  std::string test_name;
  CallArgs test_args;
  if (a.positional.size() > first) {
    test_name = to_str(a.positional[first]);
    test_args.positional.assign(a.positional.begin() + long(first) + 1, a.positional.end());
    test_args.keyword = a.keyword;
  }
  std::vector<Value> out;
  for (const Value& item : in.iterate(v)) {
    Value subject = by_attr ? get_attribute_path(in, item, attribute) : item;
    bool ok;
    if (test_name.empty()) {
      ok = truthy(subject);
    } else {
      CallArgs copy = test_args;
      ok = in.apply_test(test_name, subject, copy);
    }
    if (ok == keep) out.push_back(item);
  }
  return Value::generator(std::move(out));
}

Value f_select(Interpreter& in, const Value& v, CallArgs& a) {
  return select_impl(in, v, a, false, true);
}
Value f_reject(Interpreter& in, const Value& v, CallArgs& a) {
  return select_impl(in, v, a, false, false);
}
Value f_selectattr(Interpreter& in, const Value& v, CallArgs& a) {
  return select_impl(in, v, a, true, true);
}
Value f_rejectattr(Interpreter& in, const Value& v, CallArgs& a) {
  return select_impl(in, v, a, true, false);
}

Value sort_key(Interpreter& in, const Value& item, const Value& attribute, bool case_sensitive) {
  Value k = attribute.is_none() || attribute.is_undefined()
                ? item
                : get_attribute_path(in, item, attribute);
  if (!case_sensitive && k.is_string()) return Value(py_lower(k.as_string()));
  return k;
}

Value f_sort(Interpreter& in, const Value& v, CallArgs& a) {
  check_args(a, "sort", 3, {"reverse", "case_sensitive", "attribute"});
  bool reverse = truthy(arg(a, 0, "reverse", Value(false)));
  bool cs = truthy(arg(a, 1, "case_sensitive", Value(false)));
  Value attribute = arg(a, 2, "attribute", Value::none());
  std::vector<Value> items = in.iterate(v);
  std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
    int c = compare(sort_key(in, x, attribute, cs), sort_key(in, y, attribute, cs));
    return reverse ? c > 0 : c < 0;
  });
  return Value::list(std::move(items));
}

Value f_unique(Interpreter& in, const Value& v, CallArgs& a) {
  check_args(a, "unique", 2, {"case_sensitive", "attribute"});
  bool cs = truthy(arg(a, 0, "case_sensitive", Value(false)));
  Value attribute = arg(a, 1, "attribute", Value::none());
  std::vector<Value> out, seen;
  for (const Value& item : in.iterate(v)) {
    Value k = sort_key(in, item, attribute, cs);
    if (std::any_of(seen.begin(), seen.end(), [&](const Value& s) { return equals(s, k); }))
      continue;
    seen.push_back(k);
    out.push_back(item);
  }
  return Value::generator(std::move(out));
}

Value min_max(Interpreter& in, const Value& v, CallArgs& a, bool want_max) {
  check_args(a, want_max ? "max" : "min", 2, {"case_sensitive", "attribute"});
  bool cs = truthy(arg(a, 0, "case_sensitive", Value(false)));
  Value attribute = arg(a, 1, "attribute", Value::none());
  std::vector<Value> items = in.iterate(v);
  if (items.empty())
    return Value::undefined(std::string("No aggregated item, sequence was empty."));
  Value best = items[0];
  for (size_t i = 1; i < items.size(); ++i) {
    int c = compare(sort_key(in, items[i], attribute, cs), sort_key(in, best, attribute, cs));
    if (want_max ? c > 0 : c < 0) best = items[i];
  }
  return best;
}
Value f_max(Interpreter& in, const Value& v, CallArgs& a) { return min_max(in, v, a, true); }
Value f_min(Interpreter& in, const Value& v, CallArgs& a) { return min_max(in, v, a, false); }

Value f_sum(Interpreter& in, const Value& v, CallArgs& a) {
  check_args(a, "sum", 2, {"attribute", "start"});
  Value attribute = arg(a, 0, "attribute", Value::none());
  Value total = arg(a, 1, "start", Value(0));
  for (const Value& item : in.iterate(v)) {
    Value x = attribute.is_none() ? item : get_attribute_path(in, item, attribute);
    require_defined(x);
    if (!x.is_number() || !total.is_number())
      throw TemplateError("unsupported operand type(s) for +: '" + total.type_name() + "' and '" +
                          x.type_name() + "'");
    if (total.is_float() || x.is_float())
      total = Value(total.to_double() + x.to_double());
    else
      total = Value(total.to_int() + x.to_int());
  }
  return total;
}

Value f_reverse(Interpreter& in, const Value& v, CallArgs& a) {
  check_args(a, "reverse", 0, {});
  if (v.is_string()) {
    CodePoints cps = utf8_decode(v.as_string());
    std::reverse(cps.begin(), cps.end());
    return Value(utf8_encode(cps));
  }
  std::vector<Value> items = in.iterate(v);
  std::reverse(items.begin(), items.end());
  return Value::generator(std::move(items));
}

Value f_round(Interpreter&, const Value& v, CallArgs& a) {
  check_args(a, "round", 2, {"precision", "method"});
  int64_t precision = need_int(arg(a, 0, "precision", Value(0)), "round precision");
  std::string method = to_str(arg(a, 1, "method", Value("common")));
  if (!v.is_number()) throw TemplateError("round: expected a number, got " + v.type_name());
  double x = v.to_double(), scale = std::pow(10.0, double(precision));
  if (method == "ceil") return Value(std::ceil(x * scale) / scale);
  if (method == "floor") return Value(std::floor(x * scale) / scale);
  if (method != "common") throw TemplateError("method must be common, ceil or floor");
  if ((v.is_int() || v.is_bool()) && precision >= 0) return Value(v.to_int());  // round(int) is int
  if (precision < 0 || !std::isfinite(x)) {
    double y = x * scale, r = std::nearbyint(y);
    return Value(r / scale);
  }
  // Python's round(x, n) rounds the exact binary value half-to-even; so does printf's %.*f.
  char buf[512];
  std::snprintf(buf, sizeof(buf), "%.*f", int(std::min<int64_t>(precision, 300)), x);
  return Value(std::strtod(buf, nullptr));
}

Value f_batch(Interpreter& in, const Value& v, CallArgs& a) {
  check_args(a, "batch", 2, {"linecount", "fill_with"});
  int64_t n = need_int(arg(a, 0, "linecount"), "batch linecount");
  if (n <= 0) throw TemplateError("batch linecount must be positive");
  Value fill = arg(a, 1, "fill_with", Value::none());
  std::vector<Value> out, cur;
  for (const Value& item : in.iterate(v)) {
    cur.push_back(item);
    if (int64_t(cur.size()) == n) {
      out.push_back(Value::list(std::move(cur)));
      cur.clear();
    }
  }
  if (!cur.empty()) {
    if (!fill.is_none())
      while (int64_t(cur.size()) < n) cur.push_back(fill);
    out.push_back(Value::list(std::move(cur)));
  }
  return Value::generator(std::move(out));
}

Value f_indent(Interpreter&, const Value& v, CallArgs& a) {
  check_args(a, "indent", 3, {"width", "first", "blank"});
  Value width = arg(a, 0, "width", Value(4));
  bool first = truthy(arg(a, 1, "first", Value(false)));
  bool blank = truthy(arg(a, 2, "blank", Value(false)));
  std::string ind =
      width.is_string()
          ? width.as_string()
          : std::string(size_t(std::max<int64_t>(0, need_int(width, "indent width"))), ' ');
  // Jinja2's indent appends "\n" to its input: anything but a string is a TypeError there.
  std::vector<std::string> lines = splitlines(need_string(v, "indent input") + "\n", false);
  std::string rv;
  if (blank) {
    for (size_t i = 0; i < lines.size(); ++i) rv += (i ? "\n" + ind : "") + lines[i];
  } else {
    rv = lines.empty() ? "" : lines[0];
    for (size_t i = 1; i < lines.size(); ++i) rv += "\n" + (lines[i].empty() ? "" : ind + lines[i]);
  }
  if (first) rv = ind + rv;
  return Value(rv);
}

Value f_center(Interpreter&, const Value& v, CallArgs& a) {
  check_args(a, "center", 1, {"width"});
  std::string s = to_str(v);
  int64_t width = need_int(arg(a, 0, "width", Value(80)), "center width");
  int64_t len = int64_t(utf8_length(s));
  if (width <= len) return Value(s);
  int64_t marg = width - len, left = marg / 2 + (marg & width & 1);
  return Value(std::string(size_t(left), ' ') + s + std::string(size_t(marg - left), ' '));
}

// slice(n, fill_with=None): n columns, the first len % n one item longer (jinja2's do_slice).
Value f_slice(Interpreter& in, const Value& v, CallArgs& a) {
  check_args(a, "slice", 2, {"slices", "fill_with"});
  const int64_t slices = need_int(arg(a, 0, "slices"), "slice slices");
  if (slices <= 0) throw TemplateError("slice slices must be positive");
  Value fill = arg(a, 1, "fill_with", Value::none());
  std::vector<Value> seq = in.iterate(v), out;
  const int64_t length = int64_t(seq.size()), per = length / slices, extra = length % slices;
  int64_t offset = 0;
  for (int64_t n = 0; n < slices; ++n) {
    const int64_t start = offset + n * per;
    if (n < extra) ++offset;
    const int64_t end = offset + (n + 1) * per;
    std::vector<Value> col(seq.begin() + start, seq.begin() + end);
    if (!fill.is_none() && n >= extra) col.push_back(fill);
    out.push_back(Value::list(std::move(col)));
  }
  return Value::generator(std::move(out));
}

// truncate(length=255, killwords=False, end='...', leeway=5), in code points (jinja2's). A list
// or mapping short enough comes back as it is (jinja2 only measures it); anything else that is
// not a string is an error, as jinja2's TypeError.
Value f_truncate(Interpreter&, const Value& v, CallArgs& a) {
  check_args(a, "truncate", 4, {"length", "killwords", "end", "leeway"});
  const int64_t length = need_int(arg(a, 0, "length", Value(255)), "truncate length");
  const bool killwords = truthy(arg(a, 1, "killwords", Value(false)));
  const std::string end = to_str(arg(a, 2, "end", Value("...")));
  Value leeway_v = arg(a, 3, "leeway", Value::none());
  const int64_t leeway = leeway_v.is_none() ? 5 : need_int(leeway_v, "truncate leeway");
  const int64_t end_len = int64_t(utf8_length(end));
  if (length < end_len)
    throw TemplateError("expected length >= " + std::to_string(end_len) + ", got " +
                        std::to_string(length));
  if (leeway < 0) throw TemplateError("expected leeway >= 0, got " + std::to_string(leeway));
  if (!v.is_string()) {
    const int64_t n = v.is_list()   ? int64_t(v.as_list()->items.size())
                      : v.is_dict() ? int64_t(v.as_dict()->items.size())
                                    : -1;
    if (n >= 0 && n <= length + leeway) return v;
    throw TemplateError(std::string("truncate input must be str, not ") + v.type_name());
  }
  const std::vector<uint32_t> s = utf8_decode(v.as_string());
  if (int64_t(s.size()) <= length + leeway) return v;
  std::vector<uint32_t> head(s.begin(), s.begin() + (length - end_len));
  if (!killwords) {  // s[:length - len(end)].rsplit(" ", 1)[0]
    auto space = std::find(head.rbegin(), head.rend(), uint32_t(' '));
    if (space != head.rend()) head.resize(size_t(head.rend() - space - 1));
  }
  return Value(utf8_encode(head) + end);
}

// urlencode: a string percent-encoded as UTF-8 ('/' kept); a mapping or a sequence of pairs
// as a query string (keys and values with '/' encoded and spaces as '+'), as jinja2's.
Value f_urlencode(Interpreter& in, const Value& v, CallArgs& a) {
  check_args(a, "urlencode", 0, {});
  auto quote = [](const std::string& text, bool for_qs) {
    static const char* kHex = "0123456789ABCDEF";
    std::string out;
    for (unsigned char c : text) {
      if (std::isalnum(c) || c == '_' || c == '.' || c == '-' || c == '~' ||
          (c == '/' && !for_qs)) {
        out += char(c);
      } else if (c == ' ' && for_qs) {
        out += '+';
      } else {
        out += '%';
        out += kHex[c >> 4];
        out += kHex[c & 15];
      }
    }
    return out;
  };
  if (v.is_string()) return Value(quote(v.as_string(), false));
  std::vector<Value> pairs;
  if (v.is_dict()) {
    for (const auto& [k, val] : v.as_dict()->items) pairs.push_back(Value::tuple({k, val}));
  } else if (v.is_list() || v.is_generator()) {
    pairs = in.iterate(v);
  } else {
    return Value(quote(to_str(v), false));
  }
  std::string out;
  for (const Value& p : pairs) {
    std::vector<Value> kv = in.iterate(p);
    if (kv.size() != 2) throw TemplateError("urlencode expects pairs");
    out += (out.empty() ? "" : "&") + quote(to_str(kv[0]), true) + "=" + quote(to_str(kv[1]), true);
  }
  return Value(out);
}

// filesizeformat(binary=False): "1 Byte", "12 Bytes", "1.5 kB" / "1.5 KiB", ...
Value f_filesizeformat(Interpreter&, const Value& v, CallArgs& a) {
  check_args(a, "filesizeformat", 1, {"binary"});
  const bool binary = truthy(arg(a, 0, "binary", Value(false)));
  double bytes = 0;
  if (v.is_int() || v.is_bool())
    bytes = double(v.is_int() ? v.as_int() : int64_t(v.as_bool()));
  else if (v.is_float())
    bytes = v.as_float();
  else {  // float(value): a string must hold a number
    const std::string& text = need_string(v, "filesizeformat input");
    char* end = nullptr;
    bytes = std::strtod(text.c_str(), &end);
    while (end && std::isspace((unsigned char)*end)) ++end;
    if (text.empty() || !end || *end)
      throw TemplateError("could not convert string to float: '" + text + "'");
  }
  const double base = binary ? 1024 : 1000;
  static const char* kDec[] = {"kB", "MB", "GB", "TB", "PB", "EB", "ZB", "YB"};
  static const char* kBin[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB", "YiB"};
  if (bytes == 1) return Value("1 Byte");
  if (bytes < base) return Value(std::to_string(int64_t(bytes)) + " Bytes");
  char buf[64];
  double unit = base;
  for (int i = 0; i < 8; ++i) {
    unit *= base;
    if (bytes < unit || i == 7) {
      std::snprintf(buf, sizeof buf, "%.1f %s", base * bytes / unit, binary ? kBin[i] : kDec[i]);
      break;
    }
  }
  return Value(buf);
}

Value f_wordcount(Interpreter&, const Value& v, CallArgs& a) {
  check_args(a, "wordcount", 0, {});
  int64_t n = 0;
  bool in_word = false;
  for (uint32_t c : utf8_decode(to_str(v))) {
    bool w = cp_is_alpha(c) || cp_is_numeric(c) || c == '_';
    if (w && !in_word) ++n;
    in_word = w;
  }
  return Value(n);
}

// "%s, %s"|format(a, b) is `"%s, %s" % (a, b)` (keyword arguments would mean `% dict`).
Value f_format(Interpreter&, const Value& v, CallArgs& a) {
  if (!a.keyword.empty()) throw TemplateError("format with keyword arguments is not supported");
  return Value(percent_format(to_str(v), Value::tuple(a.positional)));
}

// ---- tests ----

bool t_defined(Interpreter&, const Value& v, CallArgs&) { return !v.is_undefined(); }
bool t_undefined(Interpreter&, const Value& v, CallArgs&) { return v.is_undefined(); }
bool t_none(Interpreter&, const Value& v, CallArgs&) { return v.is_none(); }
bool t_boolean(Interpreter&, const Value& v, CallArgs&) { return v.is_bool(); }
bool t_true(Interpreter&, const Value& v, CallArgs&) { return v.is_bool() && v.as_bool(); }
bool t_false(Interpreter&, const Value& v, CallArgs&) { return v.is_bool() && !v.as_bool(); }
bool t_integer(Interpreter&, const Value& v, CallArgs&) { return v.is_int(); }
bool t_float(Interpreter&, const Value& v, CallArgs&) { return v.is_float(); }
bool t_number(Interpreter&, const Value& v, CallArgs&) { return v.is_number(); }
bool t_string(Interpreter&, const Value& v, CallArgs&) { return v.is_string(); }
bool t_mapping(Interpreter&, const Value& v, CallArgs&) { return v.is_dict(); }
bool t_iterable(Interpreter&, const Value& v, CallArgs&) {
  return v.is_undefined() || v.is_string() || v.is_list_like() || v.is_dict();
}
bool t_sequence(Interpreter&, const Value& v, CallArgs&) {
  // jinja2: len() works and __getitem__ exists (true for str, list, tuple, dict and Undefined).
  return v.is_undefined() || v.is_string() || v.is_list() || v.is_dict();
}
bool t_callable(Interpreter&, const Value& v, CallArgs&) {
  return v.is_callable() || v.is_undefined();  // jinja2's Undefined defines __call__
}
bool t_escaped(Interpreter&, const Value&, CallArgs&) { return false; }
bool t_lower(Interpreter&, const Value& v, CallArgs&) {
  std::string s = to_str(v);
  return py_lower(s) == s && py_upper(s) != s;
}
bool t_upper(Interpreter&, const Value& v, CallArgs&) {
  std::string s = to_str(v);
  return py_upper(s) == s && py_lower(s) != s;
}
// value % 2 == 0 / == 1, as Python computes it (floats included).
double mod2(const Value& v) {
  require_defined(v);
  if (!v.is_number())
    throw TemplateError("unsupported operand type(s) for %: '" + v.type_name() + "' and 'int'");
  double r = std::fmod(v.to_double(), 2.0);
  return r < 0 ? r + 2.0 : r;
}
bool t_even(Interpreter&, const Value& v, CallArgs&) { return mod2(v) == 0.0; }
bool t_odd(Interpreter&, const Value& v, CallArgs&) { return mod2(v) == 1.0; }
bool t_divisibleby(Interpreter&, const Value& v, CallArgs& a) {
  int64_t n = need_int(arg(a, 0, "num"), "divisibleby");
  if (n == 0) throw TemplateError("integer division or modulo by zero");
  return need_int(v, "divisibleby") % n == 0;
}
bool t_eq(Interpreter&, const Value& v, CallArgs& a) { return equals(v, arg(a, 0, "other")); }
bool t_ne(Interpreter&, const Value& v, CallArgs& a) { return !equals(v, arg(a, 0, "other")); }
bool t_lt(Interpreter&, const Value& v, CallArgs& a) { return compare(v, arg(a, 0, "other")) < 0; }
bool t_le(Interpreter&, const Value& v, CallArgs& a) { return compare(v, arg(a, 0, "other")) <= 0; }
bool t_gt(Interpreter&, const Value& v, CallArgs& a) { return compare(v, arg(a, 0, "other")) > 0; }
bool t_ge(Interpreter&, const Value& v, CallArgs& a) { return compare(v, arg(a, 0, "other")) >= 0; }
bool t_in(Interpreter&, const Value& v, CallArgs& a) { return contains(arg(a, 0, "seq"), v); }
bool t_sameas(Interpreter&, const Value& v, CallArgs& a) {
  Value o = arg(a, 0, "other");
  if (v.is_none() || v.is_bool() || o.is_none() || o.is_bool())  // singletons
    return (v.is_none() && o.is_none()) ||
           (v.is_bool() && o.is_bool() && v.as_bool() == o.as_bool());
  if (v.is_list_like() && o.is_list_like()) return v.as_list() == o.as_list();
  if (v.is_dict_like() && o.is_dict_like()) return v.as_dict() == o.as_dict();
  return false;
}
bool t_filter(Interpreter&, const Value& v, CallArgs&) {
  return v.is_string() && find_filter(v.as_string()) != nullptr;
}
bool t_test(Interpreter&, const Value& v, CallArgs&) {
  return v.is_string() && find_test(v.as_string()) != nullptr;
}

const std::map<std::string, FilterFn, std::less<>>& filters() {
  static const std::map<std::string, FilterFn, std::less<>> kFilters = {
      {"abs", f_abs},
      {"attr", f_attr},
      {"batch", f_batch},
      {"capitalize", f_capitalize},
      {"center", f_center},
      {"count", f_length},
      {"d", f_default},
      {"default", f_default},
      {"dictsort", f_dictsort},
      {"e", f_escape},
      {"escape", f_escape},
      {"first", f_first},
      {"float", f_float},
      {"filesizeformat", f_filesizeformat},
      {"forceescape", f_escape},
      {"format", f_format},
      {"indent", f_indent},
      {"int", f_int},
      {"items", f_items},
      {"join", f_join},
      {"last", f_last},
      {"length", f_length},
      {"list", f_list},
      {"lower", f_lower},
      {"map", f_map},
      {"max", f_max},
      {"min", f_min},
      {"reject", f_reject},
      {"rejectattr", f_rejectattr},
      {"replace", f_replace},
      {"reverse", f_reverse},
      {"round", f_round},
      {"safe", f_safe},
      {"select", f_select},
      {"slice", f_slice},
      {"selectattr", f_selectattr},
      {"sort", f_sort},
      {"string", f_string},
      {"sum", f_sum},
      {"title", f_title},
      {"tojson", f_tojson},
      {"trim", f_trim},
      {"truncate", f_truncate},
      {"unique", f_unique},
      {"upper", f_upper},
      {"urlencode", f_urlencode},
      {"wordcount", f_wordcount},
  };
  return kFilters;
}

const std::map<std::string, TestFn, std::less<>>& tests() {
  static const std::map<std::string, TestFn, std::less<>> kTests = {
      {"!=", t_ne},
      {"<", t_lt},
      {"<=", t_le},
      {"==", t_eq},
      {">", t_gt},
      {">=", t_ge},
      {"boolean", t_boolean},
      {"callable", t_callable},
      {"defined", t_defined},
      {"divisibleby", t_divisibleby},
      {"eq", t_eq},
      {"equalto", t_eq},
      {"escaped", t_escaped},
      {"even", t_even},
      {"false", t_false},
      {"filter", t_filter},
      {"float", t_float},
      {"ge", t_ge},
      {"greaterthan", t_gt},
      {"gt", t_gt},
      {"in", t_in},
      {"integer", t_integer},
      {"iterable", t_iterable},
      {"le", t_le},
      {"lessthan", t_lt},
      {"lower", t_lower},
      {"lt", t_lt},
      {"mapping", t_mapping},
      {"ne", t_ne},
      {"none", t_none},
      {"number", t_number},
      {"odd", t_odd},
      {"sameas", t_sameas},
      {"sequence", t_sequence},
      {"string", t_string},
      {"test", t_test},
      {"true", t_true},
      {"undefined", t_undefined},
      {"upper", t_upper},
  };
  return kTests;
}

// ---- methods ----

Value bind_method(const Value& self, const std::string& name,
                  std::function<Value(Interpreter&, const Value&, CallArgs&)> fn) {
  return make_callable(name, [self, fn](Interpreter& in, CallArgs& a) { return fn(in, self, a); });
}

Value unsafe_method(const Value& obj, const std::string& name) {
  return Value::undefined("access to attribute '" + name + "' of '" + obj.type_name() +
                          "' object is unsafe.");
}

Value string_method(const Value& self, const std::string& name) {
  using A = CallArgs;
  auto S = [](const Value& v) -> const std::string& { return v.as_string(); };
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    bool l = name != "rstrip", r = name != "lstrip";
    return bind_method(self, name, [S, l, r, name](Interpreter&, const Value& s, A& a) {
      check_args(a, name, 1, {});
      return Value(py_strip(S(s), arg(a, 0, "chars", Value::none()), l, r));
    });
  }
  if (name == "split" || name == "rsplit") {
    bool right = name == "rsplit";
    return bind_method(self, name, [S, right, name](Interpreter&, const Value& s, A& a) {
      check_args(a, name, 2, {"sep", "maxsplit"});
      Value sep = arg(a, 0, "sep", Value::none());
      int64_t maxsplit = need_int(arg(a, 1, "maxsplit", Value(-1)), "maxsplit");
      return Value::list(right ? py_rsplit(S(s), sep, maxsplit) : py_split(S(s), sep, maxsplit));
    });
  }
  if (name == "splitlines") {
    return bind_method(self, name, [S](Interpreter&, const Value& s, A& a) {
      check_args(a, "splitlines", 1, {"keepends"});
      std::vector<Value> out;
      for (auto& l : splitlines(S(s), truthy(arg(a, 0, "keepends", Value(false)))))
        out.emplace_back(l);
      return Value::list(std::move(out));
    });
  }
  if (name == "startswith" || name == "endswith") {
    bool starts = name == "startswith";
    return bind_method(self, name, [S, starts, name](Interpreter&, const Value& s, A& a) {
      check_args(a, name, 1, {});
      Value p = arg(a, 0, "prefix");
      std::vector<Value> options = p.is_tuple() ? p.as_list()->items : std::vector<Value>{p};
      const std::string& str = S(s);
      for (const Value& o : options) {
        if (!o.is_string())
          throw TemplateError(name + " first arg must be str or a tuple of str, not " +
                              o.type_name());
        const std::string& x = o.as_string();
        if (x.size() <= str.size() &&
            str.compare(starts ? 0 : str.size() - x.size(), x.size(), x) == 0)
          return Value(true);
      }
      return Value(false);
    });
  }
  if (name == "replace") {
    return bind_method(self, name, [S](Interpreter&, const Value& s, A& a) {
      check_args(a, "replace", 3, {});
      Value count = arg(a, 2, "count", Value(-1));
      return Value(py_replace(S(s), need_string(arg(a, 0, "old"), "replace() argument 1"),
                              need_string(arg(a, 1, "new"), "replace() argument 2"),
                              need_int(count, "replace count")));
    });
  }
  if (name == "upper" || name == "lower" || name == "swapcase" || name == "casefold") {
    // casefold() is lower() here: the two differ only for a few characters (ß -> ss).
    auto f = name == "upper" ? py_upper : (name == "swapcase" ? py_swapcase : py_lower);
    return bind_method(self, name, [S, f, name](Interpreter&, const Value& s, A& a) {
      check_args(a, name, 0, {});
      return Value(f(S(s)));
    });
  }
  if (name == "title") {
    return bind_method(self, name, [S](Interpreter&, const Value& s, A& a) {
      check_args(a, "title", 0, {});
      return Value(py_title(S(s)));
    });
  }
  if (name == "capitalize") {
    return bind_method(self, name, [S](Interpreter&, const Value& s, A& a) {
      check_args(a, "capitalize", 0, {});
      return Value(py_capitalize(S(s)));
    });
  }
  if (name == "find" || name == "rfind" || name == "index" || name == "rindex" || name == "count") {
    return bind_method(self, name, [S, name](Interpreter&, const Value& s, A& a) {
      check_args(a, name, 1, {});
      std::string sub = need_string(arg(a, 0, "sub"), name + "() argument");
      const std::string& str = S(s);
      if (name == "count") {
        if (sub.empty()) return Value(int64_t(utf8_length(str)) + 1);
        int64_t n = 0;
        for (size_t p = str.find(sub); p != std::string::npos; p = str.find(sub, p + sub.size()))
          ++n;
        return Value(n);
      }
      bool right = name[0] == 'r';
      size_t p = right ? str.rfind(sub) : str.find(sub);
      if (p == std::string::npos) {
        if (name == "index" || name == "rindex") throw TemplateError("substring not found");
        return Value(int64_t(-1));
      }
      return Value(int64_t(utf8_length(std::string_view(str).substr(0, p))));
    });
  }
  if (name == "join") {
    return bind_method(self, name, [S](Interpreter& in, const Value& s, A& a) {
      check_args(a, "join", 1, {});
      std::string out;
      bool first = true;
      for (const Value& item : in.iterate(arg(a, 0, "iterable"))) {
        if (!item.is_string())
          throw TemplateError("sequence item: expected str instance, " + item.type_name() +
                              " found");
        if (!first) out += S(s);
        first = false;
        out += item.as_string();
      }
      return Value(std::move(out));
    });
  }
  if (name == "format") {
    return bind_method(
        self, name, [S](Interpreter&, const Value& s, A& a) { return Value(py_format(S(s), a)); });
  }
  if (name == "removeprefix" || name == "removesuffix") {
    bool prefix = name == "removeprefix";
    return bind_method(self, name, [S, prefix, name](Interpreter&, const Value& s, A& a) {
      check_args(a, name, 1, {});
      std::string x = need_string(arg(a, 0, "affix"), name + "() argument");
      const std::string& str = S(s);
      if (x.size() <= str.size() &&
          str.compare(prefix ? 0 : str.size() - x.size(), x.size(), x) == 0)
        return Value(prefix ? str.substr(x.size()) : str.substr(0, str.size() - x.size()));
      return Value(str);
    });
  }
  if (name == "partition" || name == "rpartition") {
    bool right = name == "rpartition";
    return bind_method(self, name, [S, right, name](Interpreter&, const Value& s, A& a) {
      check_args(a, name, 1, {});
      std::string sep = need_string(arg(a, 0, "sep"), name + "() argument");
      if (sep.empty()) throw TemplateError("empty separator");
      const std::string& str = S(s);
      size_t p = right ? str.rfind(sep) : str.find(sep);
      if (p == std::string::npos)
        return right ? Value::tuple({Value(""), Value(""), Value(str)})
                     : Value::tuple({Value(str), Value(""), Value("")});
      return Value::tuple({Value(str.substr(0, p)), Value(sep), Value(str.substr(p + sep.size()))});
    });
  }
  if (name == "zfill" || name == "ljust" || name == "rjust" || name == "center") {
    return bind_method(self, name, [S, name](Interpreter&, const Value& s, A& a) {
      check_args(a, name, 2, {});
      int64_t width = need_int(arg(a, 0, "width"), name + " width");
      std::string fill = name == "zfill" ? "0" : to_str(arg(a, 1, "fillchar", Value(" ")));
      const std::string& str = S(s);
      int64_t pad = width - int64_t(utf8_length(str));
      if (pad <= 0) return Value(str);
      auto rep = [&](int64_t n) {
        std::string o;
        for (int64_t i = 0; i < n; ++i) o += fill;
        return o;
      };
      if (name == "ljust") return Value(str + rep(pad));
      if (name == "rjust") return Value(rep(pad) + str);
      if (name == "center") {
        int64_t left = pad / 2 + (pad & width & 1);
        return Value(rep(left) + str + rep(pad - left));
      }
      if (!str.empty() && (str[0] == '-' || str[0] == '+'))
        return Value(str.substr(0, 1) + rep(pad) + str.substr(1));
      return Value(rep(pad) + str);
    });
  }
  using Pred = bool (*)(uint32_t);
  static const std::map<std::string, Pred> kPredicates = {
      {"isalpha", cp_is_alpha},
      {"isdigit", cp_is_digit},
      {"isdecimal", cp_is_digit},
      {"isnumeric", cp_is_numeric},
      {"isalnum", [](uint32_t c) { return cp_is_alpha(c) || cp_is_numeric(c); }},
      {"isspace", is_py_space},
  };
  if (auto it = kPredicates.find(name); it != kPredicates.end()) {
    Pred p = it->second;
    return bind_method(self, name, [S, p, name](Interpreter&, const Value& s, A& a) {
      check_args(a, name, 0, {});
      return Value(all_cps(S(s), p));
    });
  }
  if (name == "isupper" || name == "islower") {
    bool upper = name == "isupper";
    return bind_method(self, name, [S, upper, name](Interpreter&, const Value& s, A& a) {
      check_args(a, name, 0, {});
      bool cased = false;
      for (uint32_t c : utf8_decode(S(s))) {
        if (upper ? cp_is_cased_lower(c) && !cp_is_cased_upper(c) : cp_is_cased_upper(c))
          return Value(false);
        cased = cased || cp_is_cased(c);
      }
      return Value(cased);
    });
  }
  return Value();
}

Value dict_method(const Value& self, const std::string& name) {
  using A = CallArgs;
  if (name == "items" || name == "keys" || name == "values") {
    int which = name == "items" ? 0 : (name == "keys" ? 1 : 2);
    // Python returns views; a list is the closest value (same iteration, len and truthiness).
    return bind_method(self, name, [which, name](Interpreter&, const Value& d, A& a) {
      check_args(a, name, 0, {});
      std::vector<Value> out;
      for (const auto& [k, v] : d.as_dict()->items)
        out.push_back(which == 0 ? Value::tuple({k, v}) : (which == 1 ? k : v));
      return Value::list(std::move(out));
    });
  }
  if (name == "get") {
    return bind_method(self, name, [](Interpreter&, const Value& d, A& a) {
      check_args(a, "get", 2, {});
      if (a.positional.empty()) throw TemplateError("get expected at least 1 argument, got 0");
      if (const Value* v = d.as_dict()->find(a.positional[0])) return *v;
      return arg(a, 1, "default", Value::none());
    });
  }
  if (name == "copy") {
    return bind_method(self, name, [](Interpreter&, const Value& d, A& a) {
      check_args(a, "copy", 0, {});
      Value c = Value::dict();
      c.as_dict()->items = d.as_dict()->items;
      return c;
    });
  }
  static const char* kUnsafe[] = {"pop", "popitem", "setdefault", "update", "clear", "fromkeys"};
  for (const char* u : kUnsafe)
    if (name == u) return unsafe_method(self, name);
  return Value();
}

Value list_method(const Value& self, const std::string& name) {
  using A = CallArgs;
  if (name == "index" || name == "count") {
    bool index = name == "index";
    return bind_method(self, name, [index, name](Interpreter&, const Value& l, A& a) {
      check_args(a, name, 1, {});
      Value x = arg(a, 0, "value");
      int64_t n = 0;
      const auto& items = l.as_list()->items;
      for (size_t i = 0; i < items.size(); ++i) {
        if (!equals(items[i], x)) continue;
        if (index) return Value(int64_t(i));
        ++n;
      }
      if (index) throw TemplateError(repr(x) + " is not in list");
      return Value(n);
    });
  }
  if (name == "copy" && !self.is_tuple()) {
    return bind_method(self, name, [](Interpreter&, const Value& l, A& a) {
      check_args(a, "copy", 0, {});
      return Value::list(l.as_list()->items);
    });
  }
  static const char* kUnsafe[] = {"append", "extend", "insert",  "pop",
                                  "remove", "sort",   "reverse", "clear"};
  if (!self.is_tuple())
    for (const char* u : kUnsafe)
      if (name == u) return unsafe_method(self, name);
  return Value();
}

}  // namespace

FilterFn find_filter(std::string_view name) {
  auto it = filters().find(name);
  return it == filters().end() ? nullptr : it->second;
}

TestFn find_test(std::string_view name) {
  auto it = tests().find(name);
  return it == tests().end() ? nullptr : it->second;
}

Value find_method(const Value& obj, const std::string& name) {
  if (obj.is_string()) return string_method(obj, name);
  if (obj.is_dict()) return dict_method(obj, name);
  if (obj.is_list()) return list_method(obj, name);
  return Value();
}

void add_builtin_globals(DictData& g) {
  g.set(Value("range"), make_callable("range", [](Interpreter&, CallArgs& a) {
          check_args(a, "range", 3, {});
          if (a.positional.empty())
            throw TemplateError("range expected at least 1 argument, got 0");
          int64_t start = 0, stop, step = 1;
          if (a.positional.size() == 1) {
            stop = need_int(a.positional[0], "range");
          } else {
            start = need_int(a.positional[0], "range");
            stop = need_int(a.positional[1], "range");
            if (a.positional.size() == 3) step = need_int(a.positional[2], "range");
          }
          if (step == 0) throw TemplateError("range() arg 3 must not be zero");
          std::vector<Value> out;
          for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
            if (out.size() >= 100000)
              throw TemplateError(
                  "Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
            out.emplace_back(i);
          }
          return Value::list(std::move(out));
        }));
  auto make_mapping = [](CallArgs& a, Value d, const char* fname) {
    if (a.positional.size() > 1)
      throw TemplateError(std::string(fname) + " expected at most 1 argument");
    if (!a.positional.empty()) {
      const Value& src = a.positional[0];
      if (!src.is_dict_like())
        throw TemplateError(std::string(fname) + ": argument must be a mapping");
      for (const auto& [k, v] : src.as_dict()->items) d.as_dict()->set(k, v);
    }
    for (const auto& [k, v] : a.keyword) d.as_dict()->set(Value(k), v);
    return d;
  };
  g.set(Value("dict"), make_callable("dict", [make_mapping](Interpreter&, CallArgs& a) {
          return make_mapping(a, Value::dict(), "dict");
        }));
  g.set(Value("namespace"), make_callable("namespace", [make_mapping](Interpreter&, CallArgs& a) {
          return make_mapping(a, Value::namespace_object(), "namespace");
        }));
  g.set(Value("raise_exception"),
        make_callable("raise_exception", [](Interpreter&, CallArgs& a) -> Value {
          throw TemplateError("raise_exception: " + to_str(arg(a, 0, "message")));
        }));
  g.set(Value("strftime_now"), make_callable("strftime_now", [](Interpreter& in, CallArgs& a) {
          check_args(a, "strftime_now", 1, {"format"});
          return Value(in.strftime_now(need_string(arg(a, 0, "format"), "strftime_now format")));
        }));
}

}  // namespace ts::tokenizer::jinja
