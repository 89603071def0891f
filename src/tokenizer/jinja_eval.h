// The Jinja interpreter: renders a parsed template (jinja_ast.h) against a set of global
// variables, with Jinja2's scoping rules — a for-loop iteration and a macro call each get their
// own scope (so `set` inside a loop does not leak out; namespace() objects are how templates
// carry state across iterations), `if` blocks share their enclosing scope, macros see the
// template's top-level variables as they are when the macro runs.
//
// Precondition: the Template outlives the Interpreter and every macro Value it produced.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tokenizer/jinja_ast.h"
#include "tokenizer/jinja_value.h"

namespace ts::tokenizer::jinja {

struct Frame;

class Interpreter {
 public:
  // `globals`: the render context (messages, tools, bos_token, ... and the builtin functions).
  Interpreter(const Template& tmpl, Value globals);

  // Renders the whole template; throws TemplateError (with the line of the failing statement).
  std::string render();

  // Services for the builtins (jinja_builtins.cpp).
  Value call(const Value& callee, CallArgs& args);
  Value apply_filter(const std::string& name, const Value& subject, CallArgs& args);
  bool apply_test(const std::string& name, const Value& subject, CallArgs& args);
  Value getattr(const Value& obj, const std::string& name);
  Value getitem(const Value& obj, const Value& key);
  // Elements of an iterable value (a dict yields its keys, a str its characters).
  std::vector<Value> iterate(const Value& v);

  // strftime_now(format) — replaceable so tests and reference renders can fix the clock.
  std::function<std::string(const std::string& format)> strftime_now;

 private:
  enum class Flow { kNormal, kBreak, kContinue };
  using FramePtr = std::shared_ptr<Frame>;

  Flow exec(const Body& body, const FramePtr& frame, std::string& out);
  Flow exec_node(const Node& node, const FramePtr& frame, std::string& out);
  Flow exec_for(const Node& node, const FramePtr& frame, std::string& out);
  void assign(const Target& target, Value value, const FramePtr& frame);
  Value make_macro(const Node& node, const FramePtr& frame);
  // The scope a macro or caller closes over, kept alive by closures_ and held by the macro
  // only weakly: the scope holds the macro, so a shared_ptr back would be a cycle, leaked
  // with everything the scope holds at the end of every render.
  std::weak_ptr<Frame> keep_scope(const FramePtr& frame);
  Value call_macro(const Node& node, const FramePtr& def_frame, CallArgs& args);
  Value apply_filters(const std::vector<FilterCall>& filters, Value v, const FramePtr& frame);

  Value eval(const Expr& e, const FramePtr& frame);
  CallArgs eval_args(const Arguments& a, const FramePtr& frame);
  Value eval_binary(const std::string& op, const Value& l, const Value& r);
  bool eval_compare(const std::string& op, const Value& l, const Value& r);
  Value slice(const Value& obj, const Value& start, const Value& stop, const Value& step);

  const Template& tmpl_;
  FramePtr globals_;
  std::vector<FramePtr> closures_;  // scopes closed over by macros (keep_scope)
  int depth_ = 0;                   // macro recursion depth
};

// Raises the Undefined's error ("'x' is undefined") if v is Undefined.
void require_defined(const Value& v);

// printf-style `fmt % args` (%s %r %d %i %x %o %f %e %g and %%); a tuple supplies several.
std::string percent_format(const std::string& fmt, const Value& args);

// contains(container, item): Python's `item in container`.
bool contains(const Value& container, const Value& item);

}  // namespace ts::tokenizer::jinja
