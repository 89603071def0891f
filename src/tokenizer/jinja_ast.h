// Syntax tree of a parsed Jinja template: expressions (Expr) and statements (Node), each with the
// template line it came from so run-time errors can name it. The shapes follow jinja2/nodes.py.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tokenizer/jinja_value.h"

namespace ts::tokenizer::jinja {

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

// Positional and keyword arguments of a call, filter or test.
struct Arguments {
  std::vector<ExprPtr> positional;
  std::vector<std::pair<std::string, ExprPtr>> keyword;
};

struct Expr {
  enum class Kind {
    kConst,     // value
    kName,      // name
    kList,      // items
    kTuple,     // items
    kDict,      // items: key, value, key, value, ...
    kGetAttr,   // a.name          (object, name)
    kGetItem,   // a[b]            (object, items[0])
    kSlice,     // a[b:c:d]        (object, items = {start, stop, step}, each may be null)
    kCall,      // f(args)         (object, args)
    kFilter,    // a | name(args)  (object, name, args)
    kTest,      // a is [not] name(args)
    kNeg,       // -a
    kPos,       // +a
    kNot,       // not a
    kBinary,    // a op b: + - * / // % **  (op)
    kAnd,       // a and b
    kOr,        // a or b
    kCompare,   // a op1 b op2 c ...  (object, ops, items)
    kCondExpr,  // items = {then, cond, else (may be null)}
    kConcat,    // a ~ b ~ c  (items)
  };
  Kind kind;
  int line = 0;
  Value value;
  std::string name;
  std::string op;
  std::vector<std::string> ops;
  ExprPtr object;
  std::vector<ExprPtr> items;
  Arguments args;
  bool negated = false;  // kTest: `is not`

  Expr(Kind k, int l) : kind(k), line(l) {}
};

// An assignment target: `x`, `a, b` (tuple unpacking) or `ns.attr`.
struct Target {
  std::vector<std::string> names;
  bool is_tuple = false;
  std::string attribute;  // non-empty: names[0].attribute = value (namespace assignment)
};

struct Node;
using NodePtr = std::unique_ptr<Node>;
using Body = std::vector<NodePtr>;

struct FilterCall {
  std::string name;
  Arguments args;
  int line = 0;
};

struct MacroParam {
  std::string name;
  ExprPtr default_value;  // may be null
};

struct Node {
  enum class Kind {
    kText,         // text
    kOutput,       // {{ expr }}
    kIf,           // conditions[i] -> bodies[i]; bodies.size() > conditions.size(): else
    kFor,          // target in iter [if filter] body [else else_body]
    kSet,          // target = expr
    kSetBlock,     // {% set target [| filters] %}body{% endset %}
    kMacro,        // name(params) body
    kCallBlock,    // {% call(params) expr %}body{% endcall %}
    kFilterBlock,  // {% filter f %}body{% endfilter %}
    kWith,         // {% with a = 1 %}body{% endwith %}
    kScope,        // a block rendered in place (transformers' {% generation %})
    kBreak,
    kContinue,
  };
  Kind kind;
  int line = 0;
  std::string text;
  ExprPtr expr;    // kOutput, kSet value, kFor iter, kCallBlock call
  ExprPtr filter;  // kFor `if` filter
  Target target;
  std::vector<ExprPtr> conditions;
  std::vector<Body> bodies;  // kFor: {body, else}; others: {body}
  std::vector<FilterCall> filters;
  std::string name;                                     // kMacro
  std::vector<MacroParam> params;                       // kMacro, kCallBlock (caller's params)
  std::vector<std::pair<Target, ExprPtr>> assignments;  // kWith

  Node(Kind k, int l) : kind(k), line(l) {}
};

struct Template {
  Body body;
};

}  // namespace ts::tokenizer::jinja
