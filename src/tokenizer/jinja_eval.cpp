// Jinja interpreter: statements, scopes, macros and expression evaluation. See jinja_eval.h.
#include "tokenizer/jinja_eval.h"

#include <cmath>
#include <cstdio>

#include "tokenizer/jinja_builtins.h"

namespace ts::tokenizer::jinja {

// A scope: a few variables and the enclosing scope. Lookups walk outwards; assignments always
// land in the innermost scope (Jinja's rule; namespace attributes are the escape hatch).
struct Frame {
  std::vector<std::pair<std::string, Value>> vars;
  std::shared_ptr<Frame> parent;

  const Value* find(const std::string& name) const {
    for (const Frame* f = this; f; f = f->parent.get())
      for (const auto& [k, v] : f->vars)
        if (k == name) return &v;
    return nullptr;
  }
  void set(const std::string& name, Value v) {
    for (auto& [k, old] : vars) {
      if (k == name) {
        old = std::move(v);
        return;
      }
    }
    vars.emplace_back(name, std::move(v));
  }
};

namespace {

constexpr int kMaxMacroDepth = 200;

std::shared_ptr<Frame> child_of(const std::shared_ptr<Frame>& parent) {
  auto f = std::make_shared<Frame>();
  f->parent = parent;
  return f;
}

// "dict object", "list object", "None": how Jinja names an object in undefined-errors.
std::string object_type_repr(const Value& v) {
  if (v.is_none()) return "None";
  return v.type_name() + " object";
}

Value missing_attribute(const Value& obj, const std::string& name) {
  return Value::undefined("'" + object_type_repr(obj) + "' has no attribute '" + name + "'");
}

Value missing_element(const Value& obj, const Value& key) {
  if (key.is_string()) return missing_attribute(obj, key.as_string());
  return Value::undefined(object_type_repr(obj) + " has no element " + repr(key));
}

int64_t floordiv(int64_t a, int64_t b) {
  int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}

int64_t pymod(int64_t a, int64_t b) {
  int64_t r = a % b;
  if (r != 0 && ((r < 0) != (b < 0))) r += b;
  return r;
}

double pyfmod(double a, double b) {
  double r = std::fmod(a, b);
  if (r == 0) return std::copysign(0.0, b);  // Python: a zero result takes the divisor's sign
  if ((r < 0) != (b < 0)) r += b;
  return r;
}

[[noreturn]] void unsupported(const std::string& op, const Value& l, const Value& r) {
  throw TemplateError("unsupported operand type(s) for " + op + ": '" + l.type_name() + "' and '" +
                      r.type_name() + "'");
}

// Python slice index normalisation (PySlice_AdjustIndices).
std::vector<int64_t> slice_indices(int64_t n, const Value& start_v, const Value& stop_v,
                                   const Value& step_v) {
  auto as_index = [](const Value& v) {
    if (!v.is_int() && !v.is_bool())
      throw TemplateError("slice indices must be integers or None, not " + v.type_name());
    return v.to_int();
  };
  int64_t step = step_v.is_none() || step_v.is_undefined() ? 1 : as_index(step_v);
  if (step == 0) throw TemplateError("slice step cannot be zero");
  int64_t lower = step < 0 ? -1 : 0, upper = step < 0 ? n - 1 : n;
  auto adjust = [&](const Value& v, int64_t dflt) {
    if (v.is_none() || v.is_undefined()) return dflt;
    int64_t i = as_index(v);
    if (i < 0) {
      i += n;
      if (i < lower) i = lower;
    } else if (i > upper) {
      i = upper;
    }
    return i;
  };
  int64_t start = adjust(start_v, step < 0 ? upper : lower);
  int64_t stop = adjust(stop_v, step < 0 ? lower : upper);
  std::vector<int64_t> idx;
  if (step > 0)
    for (int64_t i = start; i < stop; i += step) idx.push_back(i);
  else
    for (int64_t i = start; i > stop; i += step) idx.push_back(i);
  return idx;
}

}  // namespace

// printf-style `str % args` (the conversions templates use: %s %r %d %i %f %x %%).
std::string percent_format(const std::string& fmt, const Value& args) {
  std::vector<Value> items;
  if (args.is_tuple())
    items = args.as_list()->items;
  else
    items.push_back(args);
  size_t next = 0;
  std::string out;
  for (size_t i = 0; i < fmt.size(); ++i) {
    if (fmt[i] != '%') {
      out += fmt[i];
      continue;
    }
    size_t j = i + 1;
    std::string spec = "%";
    while (j < fmt.size() && std::string_view("-+ #0123456789.").find(fmt[j]) != std::string::npos)
      spec += fmt[j++];
    if (j >= fmt.size()) throw TemplateError("incomplete format");
    char conv = fmt[j];
    i = j;
    if (conv == '%') {
      out += '%';
      continue;
    }
    if (next >= items.size()) throw TemplateError("not enough arguments for format string");
    const Value& a = items[next++];
    char buf[512];
    switch (conv) {
      case 's':
      case 'r': {
        std::string s = conv == 's' ? to_str(a) : repr(a);
        if (spec.size() > 1) {
          std::snprintf(buf, sizeof(buf), (spec + "s").c_str(), s.c_str());
          out += buf;
        } else {
          out += s;
        }
        break;
      }
      case 'd':
      case 'i':
      case 'x':
      case 'X':
      case 'o': {
        if (!a.is_number())
          throw TemplateError("%" + std::string(1, conv) +
                              " format: a real number is required, not " + a.type_name());
        std::snprintf(buf, sizeof(buf), (spec + "ll" + (conv == 'i' ? 'd' : conv)).c_str(),
                      static_cast<long long>(a.is_float() ? int64_t(a.as_float()) : a.to_int()));
        out += buf;
        break;
      }
      case 'f':
      case 'F':
      case 'e':
      case 'E':
      case 'g':
      case 'G': {
        if (!a.is_number()) throw TemplateError("must be real number, not " + a.type_name());
        std::snprintf(buf, sizeof(buf), (spec + conv).c_str(), a.to_double());
        out += buf;
        break;
      }
      default:
        throw TemplateError(std::string("unsupported format character '") + conv + "'");
    }
  }
  // Python skips this check when the argument is mapping-like (dict, list, Undefined).
  const bool mapping_like =
      !args.is_tuple() && (args.is_dict() || args.is_list() || args.is_undefined());
  if (next < items.size() && !mapping_like)
    throw TemplateError("not all arguments converted during string formatting");
  return out;
}

void require_defined(const Value& v) {
  if (v.is_undefined()) {
    const std::string& hint = v.as_undefined().hint;
    throw TemplateError(hint.empty() ? "undefined value" : hint);
  }
}

bool contains(const Value& container, const Value& item) {
  if (container.is_undefined()) return false;  // Undefined iterates as empty
  if (container.is_string()) {
    if (!item.is_string())
      throw TemplateError("'in <string>' requires string as left operand, not " + item.type_name());
    return container.as_string().find(item.as_string()) != std::string::npos;
  }
  if (container.is_list_like()) {
    for (const Value& v : container.as_list()->items)
      if (equals(v, item)) return true;
    return false;
  }
  if (container.is_dict()) {
    if ((item.is_list() && !item.is_tuple()) || item.is_dict_like() || item.is_generator())
      throw TemplateError("unhashable type: '" + item.type_name() + "'");
    return container.as_dict()->find(item) != nullptr;
  }
  throw TemplateError("argument of type '" + container.type_name() + "' is not iterable");
}

Interpreter::Interpreter(const Template& tmpl, Value globals) : tmpl_(tmpl) {
  globals_ = std::make_shared<Frame>();
  for (auto& [k, v] : globals.as_dict()->items) globals_->set(to_str(k), v);
}

std::string Interpreter::render() {
  auto root = child_of(globals_);
  std::string out;
  exec(tmpl_.body, root, out);
  return out;
}

Interpreter::Flow Interpreter::exec(const Body& body, const FramePtr& frame, std::string& out) {
  for (const NodePtr& n : body) {
    Flow f = exec_node(*n, frame, out);
    if (f != Flow::kNormal) return f;
  }
  return Flow::kNormal;
}

Interpreter::Flow Interpreter::exec_node(const Node& node, const FramePtr& frame,
                                         std::string& out) {
  try {
    switch (node.kind) {
      case Node::Kind::kText:
        out += node.text;
        return Flow::kNormal;
      case Node::Kind::kOutput:
        out += to_str(eval(*node.expr, frame));
        return Flow::kNormal;
      case Node::Kind::kIf:
        for (size_t i = 0; i < node.conditions.size(); ++i)
          if (truthy(eval(*node.conditions[i], frame))) return exec(node.bodies[i], frame, out);
        if (node.bodies.size() > node.conditions.size())
          return exec(node.bodies.back(), frame, out);
        return Flow::kNormal;
      case Node::Kind::kFor:
        return exec_for(node, frame, out);
      case Node::Kind::kSet:
        assign(node.target, eval(*node.expr, frame), frame);
        return Flow::kNormal;
      case Node::Kind::kSetBlock: {
        std::string captured;
        exec(node.bodies[0], frame, captured);
        assign(node.target, apply_filters(node.filters, Value(std::move(captured)), frame), frame);
        return Flow::kNormal;
      }
      case Node::Kind::kMacro:
        frame->set(node.name, make_macro(node, frame));
        return Flow::kNormal;
      case Node::Kind::kCallBlock: {
        // The body becomes `caller`, a macro closed over the current scope.
        const Node* body_node = &node;
        auto caller = std::make_shared<Callable>();
        caller->name = "caller";
        caller->fn = [this, body_node, def_frame = keep_scope(frame)](Interpreter&, CallArgs& a) {
          return call_macro(*body_node, def_frame.lock(), a);
        };
        const Expr& call = *node.expr;
        Value callee = eval(*call.object, frame);
        CallArgs args = eval_args(call.args, frame);
        args.keyword.emplace_back("caller", Value(Value::FuncPtr(caller)));
        out += to_str(this->call(callee, args));
        return Flow::kNormal;
      }
      case Node::Kind::kFilterBlock: {
        std::string captured;
        exec(node.bodies[0], frame, captured);
        out += to_str(apply_filters(node.filters, Value(std::move(captured)), frame));
        return Flow::kNormal;
      }
      case Node::Kind::kWith: {
        auto scope = child_of(frame);
        for (const auto& [target, expr] : node.assignments)
          assign(target, eval(*expr, frame), scope);
        return exec(node.bodies[0], scope, out);
      }
      case Node::Kind::kScope:
        return exec(node.bodies[0], frame, out);
      case Node::Kind::kBreak:
        return Flow::kBreak;
      case Node::Kind::kContinue:
        return Flow::kContinue;
    }
  } catch (const TemplateError& e) {
    if (e.line() == 0) throw TemplateError(e.what(), node.line);
    throw;
  }
  return Flow::kNormal;
}

Interpreter::Flow Interpreter::exec_for(const Node& node, const FramePtr& frame, std::string& out) {
  std::vector<Value> items = iterate(eval(*node.expr, frame));
  if (node.filter) {
    std::vector<Value> kept;
    for (Value& item : items) {
      auto scope = child_of(frame);
      assign(node.target, item, scope);
      if (truthy(eval(*node.filter, scope))) kept.push_back(std::move(item));
    }
    items = std::move(kept);
  }
  if (items.empty()) {
    exec(node.bodies[1], frame, out);
    return Flow::kNormal;
  }
  const int64_t n = int64_t(items.size());
  for (int64_t i = 0; i < n; ++i) {
    auto scope = child_of(frame);
    assign(node.target, items[size_t(i)], scope);
    auto loop = std::make_shared<DictData>();
    loop->kind = DictData::Kind::kObject;
    loop->set(Value("index"), Value(i + 1));
    loop->set(Value("index0"), Value(i));
    loop->set(Value("revindex"), Value(n - i));
    loop->set(Value("revindex0"), Value(n - i - 1));
    loop->set(Value("first"), Value(i == 0));
    loop->set(Value("last"), Value(i == n - 1));
    loop->set(Value("length"), Value(n));
    loop->set(Value("depth"), Value(1));
    loop->set(Value("depth0"), Value(0));
    if (i > 0) loop->set(Value("previtem"), items[size_t(i - 1)]);
    if (i + 1 < n) loop->set(Value("nextitem"), items[size_t(i + 1)]);
    auto cycle = std::make_shared<Callable>();
    cycle->name = "loop.cycle";
    cycle->fn = [i](Interpreter&, CallArgs& a) -> Value {
      if (a.positional.empty()) throw TemplateError("no items for cycling given");
      return a.positional[size_t(i) % a.positional.size()];
    };
    loop->set(Value("cycle"), Value(Value::FuncPtr(cycle)));
    scope->set("loop", Value(loop));
    if (exec(node.bodies[0], scope, out) == Flow::kBreak) break;
  }
  return Flow::kNormal;
}

void Interpreter::assign(const Target& target, Value value, const FramePtr& frame) {
  if (!target.attribute.empty()) {
    const Value* obj = frame->find(target.names[0]);
    if (!obj || !obj->is_namespace())
      throw TemplateError("cannot assign attribute on non-namespace object");
    obj->as_dict()->set(Value(target.attribute), std::move(value));
    return;
  }
  if (!target.is_tuple) {
    frame->set(target.names[0], std::move(value));
    return;
  }
  std::vector<Value> items = iterate(value);
  if (items.size() < target.names.size())
    throw TemplateError("not enough values to unpack (expected " +
                        std::to_string(target.names.size()) + ", got " +
                        std::to_string(items.size()) + ")");
  if (items.size() > target.names.size())
    throw TemplateError("too many values to unpack (expected " +
                        std::to_string(target.names.size()) + ")");
  for (size_t i = 0; i < items.size(); ++i) frame->set(target.names[i], std::move(items[i]));
}

Value Interpreter::make_macro(const Node& node, const FramePtr& frame) {
  auto m = std::make_shared<Callable>();
  m->name = node.name;
  const Node* np = &node;
  m->fn = [this, np, def_frame = keep_scope(frame)](Interpreter&, CallArgs& a) {
    return call_macro(*np, def_frame.lock(), a);
  };
  return Value(Value::FuncPtr(m));
}

std::weak_ptr<Frame> Interpreter::keep_scope(const FramePtr& frame) {
  if (closures_.empty() || closures_.back() != frame) closures_.push_back(frame);
  return frame;
}

Value Interpreter::call_macro(const Node& node, const FramePtr& def_frame, CallArgs& args) {
  // (def_frame is never null: closures_ keeps it while the interpreter lives, and the header's
  // precondition keeps every macro Value within that.)
  const std::string label =
      node.kind == Node::Kind::kMacro ? "macro '" + node.name + "'" : "caller";
  if (args.positional.size() > node.params.size())
    throw TemplateError(label + " takes not more than " + std::to_string(node.params.size()) +
                        " argument(s)");
  if (depth_ >= kMaxMacroDepth)
    throw TemplateError("maximum macro recursion depth (" + std::to_string(kMaxMacroDepth) +
                        ") exceeded");
  struct DepthGuard {
    int& depth;
    explicit DepthGuard(int& d) : depth(d) { ++depth; }
    ~DepthGuard() { --depth; }
  } guard(depth_);
  auto scope = child_of(def_frame);
  std::vector<bool> used(args.keyword.size(), false);
  for (size_t i = 0; i < node.params.size(); ++i) {
    const MacroParam& p = node.params[i];
    if (i < args.positional.size()) {
      scope->set(p.name, args.positional[i]);
      continue;
    }
    bool found = false;
    for (size_t k = 0; k < args.keyword.size(); ++k) {
      if (args.keyword[k].first == p.name) {
        scope->set(p.name, args.keyword[k].second);
        used[k] = found = true;
      }
    }
    if (found) continue;
    if (p.default_value)
      scope->set(p.name, eval(*p.default_value, scope));
    else
      scope->set(p.name, Value::undefined("parameter '" + p.name + "' was not provided"));
  }
  for (size_t k = 0; k < args.keyword.size(); ++k) {
    if (used[k]) continue;
    if (args.keyword[k].first == "caller") {
      scope->set("caller", args.keyword[k].second);
      continue;
    }
    throw TemplateError(label + " takes no keyword argument '" + args.keyword[k].first + "'");
  }
  std::string out;
  exec(node.bodies[0], scope, out);
  return Value(std::move(out));
}

Value Interpreter::apply_filters(const std::vector<FilterCall>& filters, Value v,
                                 const FramePtr& frame) {
  for (const FilterCall& f : filters) {
    CallArgs args = eval_args(f.args, frame);
    v = apply_filter(f.name, v, args);
  }
  return v;
}

Value Interpreter::call(const Value& callee, CallArgs& args) {
  require_defined(callee);
  if (!callee.is_callable())
    throw TemplateError("'" + callee.type_name() + "' object is not callable");
  return callee.as_callable()->fn(*this, args);
}

Value Interpreter::apply_filter(const std::string& name, const Value& subject, CallArgs& args) {
  FilterFn f = find_filter(name);
  if (!f) throw TemplateError("unknown filter '" + name + "'");
  return f(*this, subject, args);
}

bool Interpreter::apply_test(const std::string& name, const Value& subject, CallArgs& args) {
  TestFn t = find_test(name);
  if (!t) throw TemplateError("unknown test '" + name + "'");
  return t(*this, subject, args);
}

Value Interpreter::getattr(const Value& obj, const std::string& name) {
  require_defined(obj);
  if (obj.is_dict_like() && !obj.is_dict()) {
    if (const Value* v = obj.as_dict()->find_key(name)) return *v;
    return missing_attribute(obj, name);
  }
  Value m = find_method(obj, name);
  if (!m.is_undefined() || !m.as_undefined().hint.empty()) return m;
  if (obj.is_dict())
    if (const Value* v = obj.as_dict()->find_key(name)) return *v;
  return missing_attribute(obj, name);
}

Value Interpreter::getitem(const Value& obj, const Value& key) {
  require_defined(obj);
  if (obj.is_dict()) {
    if (const Value* v = obj.as_dict()->find(key)) return *v;
  } else if ((obj.is_list() || obj.is_string()) && (key.is_int() || key.is_bool())) {
    int64_t i = key.to_int();
    if (obj.is_list()) {
      const auto& items = obj.as_list()->items;
      int64_t n = int64_t(items.size());
      if (i < 0) i += n;
      if (i >= 0 && i < n) return items[size_t(i)];
    } else {
      std::vector<uint32_t> cps = utf8_decode(obj.as_string());
      int64_t n = int64_t(cps.size());
      if (i < 0) i += n;
      if (i >= 0 && i < n) {
        std::string s;
        utf8_append(s, cps[size_t(i)]);
        return Value(std::move(s));
      }
    }
    return missing_element(obj, key);
  }
  if (key.is_string()) return getattr(obj, key.as_string());
  return missing_element(obj, key);
}

std::vector<Value> Interpreter::iterate(const Value& v) {
  if (v.is_undefined()) return {};
  if (v.is_list_like()) return v.as_list()->items;
  if (v.is_dict()) {
    std::vector<Value> keys;
    for (const auto& kv : v.as_dict()->items) keys.push_back(kv.first);
    return keys;
  }
  if (v.is_string()) {
    std::vector<Value> chars;
    for (uint32_t cp : utf8_decode(v.as_string())) {
      std::string s;
      utf8_append(s, cp);
      chars.emplace_back(std::move(s));
    }
    return chars;
  }
  throw TemplateError("'" + v.type_name() + "' object is not iterable");
}

CallArgs Interpreter::eval_args(const Arguments& a, const FramePtr& frame) {
  CallArgs out;
  for (const ExprPtr& e : a.positional) out.positional.push_back(eval(*e, frame));
  for (const auto& [k, e] : a.keyword) out.keyword.emplace_back(k, eval(*e, frame));
  return out;
}

Value Interpreter::slice(const Value& obj, const Value& start, const Value& stop,
                         const Value& step) {
  require_defined(obj);
  if (obj.is_string()) {
    std::vector<uint32_t> cps = utf8_decode(obj.as_string());
    std::string s;
    for (int64_t i : slice_indices(int64_t(cps.size()), start, stop, step))
      utf8_append(s, cps[size_t(i)]);
    return Value(std::move(s));
  }
  if (obj.is_list()) {
    const auto& items = obj.as_list()->items;
    std::vector<Value> out;
    for (int64_t i : slice_indices(int64_t(items.size()), start, stop, step))
      out.push_back(items[size_t(i)]);
    return obj.is_tuple() ? Value::tuple(std::move(out)) : Value::list(std::move(out));
  }
  return Value::undefined("'" + obj.type_name() + "' object is not subscriptable");
}

Value Interpreter::eval(const Expr& e, const FramePtr& frame) {
  try {
    switch (e.kind) {
      case Expr::Kind::kConst:
        return e.value;
      case Expr::Kind::kName: {
        if (const Value* v = frame->find(e.name)) return *v;
        return Value::undefined("'" + e.name + "' is undefined");
      }
      case Expr::Kind::kList:
      case Expr::Kind::kTuple: {
        std::vector<Value> items;
        for (const ExprPtr& i : e.items) items.push_back(eval(*i, frame));
        return e.kind == Expr::Kind::kList ? Value::list(std::move(items))
                                           : Value::tuple(std::move(items));
      }
      case Expr::Kind::kDict: {
        Value d = Value::dict();
        for (size_t i = 0; i + 1 < e.items.size(); i += 2)
          d.as_dict()->set(eval(*e.items[i], frame), eval(*e.items[i + 1], frame));
        return d;
      }
      case Expr::Kind::kGetAttr:
        return getattr(eval(*e.object, frame), e.name);
      case Expr::Kind::kGetItem:
        return getitem(eval(*e.object, frame), eval(*e.items[0], frame));
      case Expr::Kind::kSlice: {
        Value obj = eval(*e.object, frame);
        auto part = [&](size_t i) { return e.items[i] ? eval(*e.items[i], frame) : Value::none(); };
        return slice(obj, part(0), part(1), part(2));
      }
      case Expr::Kind::kCall: {
        Value callee = eval(*e.object, frame);
        CallArgs args = eval_args(e.args, frame);
        return call(callee, args);
      }
      case Expr::Kind::kFilter: {
        Value v = eval(*e.object, frame);
        CallArgs args = eval_args(e.args, frame);
        return apply_filter(e.name, v, args);
      }
      case Expr::Kind::kTest: {
        Value v = eval(*e.object, frame);
        CallArgs args = eval_args(e.args, frame);
        return Value(apply_test(e.name, v, args) != e.negated);
      }
      case Expr::Kind::kNeg:
      case Expr::Kind::kPos: {
        Value v = eval(*e.object, frame);
        require_defined(v);
        if (!v.is_number())
          throw TemplateError(std::string("bad operand type for unary ") +
                              (e.kind == Expr::Kind::kNeg ? "-" : "+") + ": '" + v.type_name() +
                              "'");
        if (e.kind == Expr::Kind::kPos) return v.is_bool() ? Value(v.to_int()) : v;
        if (v.is_float()) return Value(-v.as_float());
        return Value(-v.to_int());
      }
      case Expr::Kind::kNot:
        return Value(!truthy(eval(*e.object, frame)));
      case Expr::Kind::kAnd: {
        Value l = eval(*e.items[0], frame);
        if (!truthy(l)) return l;
        return eval(*e.items[1], frame);
      }
      case Expr::Kind::kOr: {
        Value l = eval(*e.items[0], frame);
        if (truthy(l)) return l;
        return eval(*e.items[1], frame);
      }
      case Expr::Kind::kBinary:
        return eval_binary(e.op, eval(*e.items[0], frame), eval(*e.items[1], frame));
      case Expr::Kind::kCompare: {
        Value left = eval(*e.object, frame);
        for (size_t i = 0; i < e.ops.size(); ++i) {
          Value right = eval(*e.items[i], frame);
          if (!eval_compare(e.ops[i], left, right)) return Value(false);
          left = std::move(right);
        }
        return Value(true);
      }
      case Expr::Kind::kCondExpr: {
        if (truthy(eval(*e.items[1], frame))) return eval(*e.items[0], frame);
        if (e.items[2]) return eval(*e.items[2], frame);
        return Value::undefined("the inline if-expression on line " + std::to_string(e.line) +
                                " evaluated to false and no else section was defined.");
      }
      case Expr::Kind::kConcat: {
        std::string s;
        for (const ExprPtr& i : e.items) s += to_str(eval(*i, frame));
        return Value(std::move(s));
      }
    }
  } catch (const TemplateError& err) {
    if (err.line() == 0) throw TemplateError(err.what(), e.line);
    throw;
  }
  return Value();
}

bool Interpreter::eval_compare(const std::string& op, const Value& l, const Value& r) {
  if (op == "==") return equals(l, r);
  if (op == "!=") return !equals(l, r);
  if (op == "in") return contains(r, l);
  if (op == "not in") return !contains(r, l);
  require_defined(l);
  require_defined(r);
  int c = compare(l, r);
  if (op == "<") return c < 0;
  if (op == ">") return c > 0;
  if (op == "<=") return c <= 0;
  return c >= 0;  // ">="
}

Value Interpreter::eval_binary(const std::string& op, const Value& l, const Value& r) {
  require_defined(l);
  if (op == "%" && l.is_string()) return Value(percent_format(l.as_string(), r));
  require_defined(r);
  const bool ints = (l.is_int() || l.is_bool()) && (r.is_int() || r.is_bool());
  const bool nums = l.is_number() && r.is_number();
  if (op == "+") {
    if (ints) {
      int64_t out;
      if (__builtin_add_overflow(l.to_int(), r.to_int(), &out))
        throw TemplateError("integer overflow");
      return Value(out);
    }
    if (nums) return Value(l.to_double() + r.to_double());
    if (l.is_string() && r.is_string()) return Value(l.as_string() + r.as_string());
    if (l.is_list() && r.is_list() && l.is_tuple() == r.is_tuple()) {
      std::vector<Value> items = l.as_list()->items;
      items.insert(items.end(), r.as_list()->items.begin(), r.as_list()->items.end());
      return l.is_tuple() ? Value::tuple(std::move(items)) : Value::list(std::move(items));
    }
    if (l.is_string())
      throw TemplateError("can only concatenate str (not \"" + r.type_name() + "\") to str");
    if (l.is_list())
      throw TemplateError("can only concatenate " + l.type_name() + " (not \"" + r.type_name() +
                          "\") to " + l.type_name());
    unsupported("+", l, r);
  }
  if (op == "-") {
    if (ints) {
      int64_t out;
      if (__builtin_sub_overflow(l.to_int(), r.to_int(), &out))
        throw TemplateError("integer overflow");
      return Value(out);
    }
    if (nums) return Value(l.to_double() - r.to_double());
    unsupported("-", l, r);
  }
  if (op == "*") {
    if (ints) {
      int64_t out;
      if (__builtin_mul_overflow(l.to_int(), r.to_int(), &out))
        throw TemplateError("integer overflow");
      return Value(out);
    }
    if (nums) return Value(l.to_double() * r.to_double());
    const Value* seq =
        (l.is_string() || l.is_list()) ? &l : ((r.is_string() || r.is_list()) ? &r : nullptr);
    const Value* count = seq == &l ? &r : &l;
    if (seq && (count->is_int() || count->is_bool())) {
      int64_t n = std::max<int64_t>(0, count->to_int());
      if (n > 1000000) throw TemplateError("repetition count too large");
      if (seq->is_string()) {
        std::string s;
        for (int64_t i = 0; i < n; ++i) s += seq->as_string();
        return Value(std::move(s));
      }
      std::vector<Value> items;
      for (int64_t i = 0; i < n; ++i)
        items.insert(items.end(), seq->as_list()->items.begin(), seq->as_list()->items.end());
      return seq->is_tuple() ? Value::tuple(std::move(items)) : Value::list(std::move(items));
    }
    unsupported("*", l, r);
  }
  if (op == "/") {
    if (!nums) unsupported("/", l, r);
    if (r.to_double() == 0.0) throw TemplateError("division by zero");
    return Value(l.to_double() / r.to_double());
  }
  if (op == "//") {
    if (!nums) unsupported("//", l, r);
    if (r.to_double() == 0.0) throw TemplateError("integer division or modulo by zero");
    if (ints) return Value(floordiv(l.to_int(), r.to_int()));
    return Value(std::floor(l.to_double() / r.to_double()));
  }
  if (op == "%") {
    if (l.is_string()) return Value(percent_format(l.as_string(), r));
    if (!nums) unsupported("%", l, r);
    if (r.to_double() == 0.0) throw TemplateError("integer division or modulo by zero");
    if (ints) return Value(pymod(l.to_int(), r.to_int()));
    return Value(pyfmod(l.to_double(), r.to_double()));
  }
  if (op == "**") {
    if (!nums) unsupported("** or pow()", l, r);
    if (l.to_double() == 0.0 && r.to_double() < 0)
      throw TemplateError("0.0 cannot be raised to a negative power");
    if (ints && r.to_int() >= 0) {
      int64_t base = l.to_int(), result = 1;
      for (int64_t i = 0; i < r.to_int(); ++i)
        if (__builtin_mul_overflow(result, base, &result)) throw TemplateError("integer overflow");
      return Value(result);
    }
    return Value(std::pow(l.to_double(), r.to_double()));
  }
  throw TemplateError("unknown operator '" + op + "'");
}

}  // namespace ts::tokenizer::jinja
