// Recursive-descent Jinja2 parser; see jinja_parser.h. Function names follow jinja2/parser.py so
// the two can be read side by side (parse_condexpr, parse_or, ..., parse_unary, parse_primary).
#include "tokenizer/jinja_parser.h"

#include <set>

#include "tokenizer/jinja_builtins.h"
#include "tokenizer/jinja_lexer.h"

namespace ts::tokenizer::jinja {

namespace {

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : t_(std::move(tokens)) {}

  std::unique_ptr<Template> parse_template() {
    auto tmpl = std::make_unique<Template>();
    tmpl->body = subparse({});
    if (cur().type != TokenType::kEof) fail("unexpected " + describe(cur()));
    check_names(tmpl->body, false);
    return tmpl;
  }

 private:
  // ---- token stream ----
  const Token& cur() const { return t_[i_]; }
  const Token& look(size_t ahead = 1) const { return t_[std::min(i_ + ahead, t_.size() - 1)]; }
  const Token& next() {
    const Token& tok = t_[i_];
    if (i_ + 1 < t_.size()) ++i_;
    return tok;
  }
  bool is_op(const char* op) const {
    return cur().type == TokenType::kOperator && cur().text == op;
  }
  bool is_name(const char* name) const {
    return cur().type == TokenType::kName && cur().text == name;
  }
  bool skip_op(const char* op) {
    if (!is_op(op)) return false;
    next();
    return true;
  }
  bool skip_name(const char* name) {
    if (!is_name(name)) return false;
    next();
    return true;
  }
  [[noreturn]] void fail(const std::string& msg, int line = 0) const {
    throw TemplateError(msg, line ? line : cur().line);
  }
  const Token& expect_op(const char* op) {
    if (!is_op(op)) fail(std::string("expected '") + op + "', got " + describe(cur()));
    return next();
  }
  const Token& expect_name() {
    if (cur().type != TokenType::kName) fail("expected a name, got " + describe(cur()));
    return next();
  }
  const Token& expect(TokenType type, const char* what) {
    if (cur().type != type) fail(std::string("expected ") + what + ", got " + describe(cur()));
    return next();
  }
  void expect_block_end() {
    skip_op(":");  // jinja2 accepts an optional colon ("{% else: %}")
    expect(TokenType::kBlockEnd, "end of statement block");
  }

  // ---- template structure ----

  // Parses until a block tag whose name is in `end_tags`; stops on its name token (after `{%`).
  Body subparse(const std::set<std::string>& end_tags) {
    Body body;
    while (true) {
      const Token& tok = cur();
      if (tok.type == TokenType::kEof) return body;
      if (tok.type == TokenType::kData) {
        auto n = std::make_unique<Node>(Node::Kind::kText, tok.line);
        n->text = tok.text;
        body.push_back(std::move(n));
        next();
      } else if (tok.type == TokenType::kVariableBegin) {
        next();
        auto n = std::make_unique<Node>(Node::Kind::kOutput, tok.line);
        n->expr = parse_tuple(false, true, {}, false);
        expect(TokenType::kVariableEnd, "end of print statement");
        body.push_back(std::move(n));
      } else if (tok.type == TokenType::kBlockBegin) {
        next();
        if (cur().type == TokenType::kName && end_tags.count(cur().text)) return body;
        body.push_back(parse_statement());
        expect(TokenType::kBlockEnd, "end of statement block");
      } else {
        fail("unexpected " + describe(tok));
      }
    }
  }

  // After a tag header: `%}` then the body up to one of `end_tags` (positioned on its name).
  Body parse_statements(const std::set<std::string>& end_tags, const std::string& construct,
                        int start_line, bool drop_needle) {
    expect_block_end();
    Body body = subparse(end_tags);
    if (cur().type == TokenType::kEof) {
      std::string expected;
      for (const auto& e : end_tags) expected += (expected.empty() ? "'" : " or '") + e + "'";
      fail("unexpected end of template: the '" + construct + "' block opened on line " +
           std::to_string(start_line) + " needs " + expected);
    }
    if (drop_needle) next();
    return body;
  }

  NodePtr parse_statement() {
    const Token& tok = cur();
    if (tok.type != TokenType::kName) fail("tag name expected");
    const std::string& name = tok.text;
    if (name == "if") return parse_if();
    if (name == "for") return parse_for();
    if (name == "set") return parse_set();
    if (name == "macro") return parse_macro();
    if (name == "call") return parse_call_block();
    if (name == "filter") return parse_filter_block();
    if (name == "with") return parse_with();
    if (name == "generation") return parse_scope("generation", "endgeneration");
    if (name == "break" || name == "continue") {
      if (loop_depth_ == 0) fail("'" + name + "' outside of a for loop");
      auto n = std::make_unique<Node>(name == "break" ? Node::Kind::kBreak : Node::Kind::kContinue,
                                      tok.line);
      next();
      return n;
    }
    if (name == "print") {
      auto n = std::make_unique<Node>(Node::Kind::kOutput, tok.line);
      next();
      n->expr = parse_tuple(false, true, {}, false);
      return n;
    }
    static const std::set<std::string> kUnsupported = {"include", "import",     "from", "extends",
                                                       "block",   "autoescape", "do",   "trans"};
    if (kUnsupported.count(name)) fail("unsupported tag '" + name + "'");
    static const std::set<std::string> kEndTags = {
        "endif",   "endfor",        "endset", "endmacro", "endcall", "endfilter",
        "endwith", "endgeneration", "elif",   "else",     "endraw",  "endblock"};
    if (kEndTags.count(name)) fail("unexpected '" + name + "' (no open block it could close)");
    fail("unknown tag '" + name + "'");
  }

  NodePtr parse_if() {
    int line = next().line;
    auto n = std::make_unique<Node>(Node::Kind::kIf, line);
    while (true) {
      n->conditions.push_back(parse_tuple(false, false, {}, false));
      n->bodies.push_back(parse_statements({"elif", "else", "endif"}, "if", line, false));
      std::string tag = next().text;
      if (tag == "elif") continue;
      if (tag == "else") n->bodies.push_back(parse_statements({"endif"}, "if", line, true));
      break;
    }
    return n;
  }

  NodePtr parse_for() {
    int line = next().line;
    auto n = std::make_unique<Node>(Node::Kind::kFor, line);
    n->target = parse_assign_target(true, {"in"}, false);
    if (!skip_name("in")) fail("expected 'in' in for loop, got " + describe(cur()));
    n->expr = parse_tuple(false, false, {"recursive"}, false);
    if (skip_name("if")) n->filter = parse_expression(true);
    if (is_name("recursive")) fail("recursive for loops are not supported");
    ++loop_depth_;
    n->bodies.push_back(parse_statements({"endfor", "else"}, "for", line, false));
    --loop_depth_;
    if (next().text == "else")
      n->bodies.push_back(parse_statements({"endfor"}, "for", line, true));
    else
      n->bodies.emplace_back();
    return n;
  }

  NodePtr parse_set() {
    int line = next().line;
    Target target = parse_assign_target(true, {}, true);
    if (skip_op("=")) {
      auto n = std::make_unique<Node>(Node::Kind::kSet, line);
      n->target = std::move(target);
      n->expr = parse_tuple(false, true, {}, false);
      return n;
    }
    auto n = std::make_unique<Node>(Node::Kind::kSetBlock, line);
    if (target.is_tuple || !target.attribute.empty())
      fail("a block set needs a single variable name");
    n->target = std::move(target);
    n->filters = parse_filter_chain(false);
    n->bodies.push_back(parse_statements({"endset"}, "set", line, true));
    return n;
  }

  NodePtr parse_macro() {
    int line = next().line;
    auto n = std::make_unique<Node>(Node::Kind::kMacro, line);
    n->name = expect_name().text;
    n->params = parse_signature();
    int saved = loop_depth_;
    loop_depth_ = 0;
    n->bodies.push_back(parse_statements({"endmacro"}, "macro", line, true));
    loop_depth_ = saved;
    return n;
  }

  std::vector<MacroParam> parse_signature() {
    std::vector<MacroParam> params;
    expect_op("(");
    while (!is_op(")")) {
      if (!params.empty()) expect_op(",");
      if (is_op(")")) break;
      MacroParam p;
      p.name = expect_name().text;
      if (skip_op("="))
        p.default_value = parse_expression(true);
      else if (!params.empty() && params.back().default_value)
        fail("non-default argument '" + p.name + "' follows a default argument");
      params.push_back(std::move(p));
    }
    expect_op(")");
    return params;
  }

  NodePtr parse_call_block() {
    int line = next().line;
    auto n = std::make_unique<Node>(Node::Kind::kCallBlock, line);
    if (is_op("(")) n->params = parse_signature();
    n->expr = parse_expression(true);
    if (n->expr->kind != Expr::Kind::kCall) fail("expected a call after 'call'", line);
    n->bodies.push_back(parse_statements({"endcall"}, "call", line, true));
    return n;
  }

  NodePtr parse_filter_block() {
    int line = next().line;
    auto n = std::make_unique<Node>(Node::Kind::kFilterBlock, line);
    n->filters = parse_filter_chain(true);
    n->bodies.push_back(parse_statements({"endfilter"}, "filter", line, true));
    return n;
  }

  NodePtr parse_with() {
    int line = next().line;
    auto n = std::make_unique<Node>(Node::Kind::kWith, line);
    while (cur().type != TokenType::kBlockEnd) {
      if (!n->assignments.empty()) expect_op(",");
      Target t = parse_assign_target(false, {}, false);
      expect_op("=");
      n->assignments.emplace_back(std::move(t), parse_expression(true));
    }
    n->bodies.push_back(parse_statements({"endwith"}, "with", line, true));
    return n;
  }

  NodePtr parse_scope(const std::string& tag, const std::string& end_tag) {
    int line = next().line;
    auto n = std::make_unique<Node>(Node::Kind::kScope, line);
    n->bodies.push_back(parse_statements({end_tag}, tag, line, true));
    return n;
  }

  // `| f(args) | g` in a set block / filter block header.
  std::vector<FilterCall> parse_filter_chain(bool start_inline) {
    std::vector<FilterCall> chain;
    while (start_inline || skip_op("|")) {
      start_inline = false;
      chain.push_back(parse_filter_call());
    }
    return chain;
  }

  FilterCall parse_filter_call() {
    FilterCall f;
    f.line = cur().line;
    f.name = expect_name().text;
    while (skip_op(".")) f.name += "." + expect_name().text;
    if (is_op("(")) f.args = parse_call_args();
    return f;
  }

  Target parse_assign_target(bool with_tuple, const std::set<std::string>& extra_end,
                             bool with_namespace) {
    Target t;
    if (with_namespace && cur().type == TokenType::kName && look().type == TokenType::kOperator &&
        look().text == ".") {
      t.names.push_back(next().text);
      next();
      t.attribute = expect_name().text;
      return t;
    }
    bool parens = skip_op("(");
    while (true) {
      if (!t.names.empty()) {
        if (!skip_op(",")) break;
        t.is_tuple = true;
      }
      if (cur().type != TokenType::kName || extra_end.count(cur().text)) {
        if (t.names.empty()) fail("can't assign to " + describe(cur()));
        break;
      }
      const std::string& nm = cur().text;
      if (nm == "true" || nm == "false" || nm == "none" || nm == "True" || nm == "False" ||
          nm == "None")
        fail("can't assign to constant '" + nm + "'");
      t.names.push_back(next().text);
      if (!with_tuple && !parens) break;
    }
    if (parens) {
      expect_op(")");
      t.is_tuple = true;
    }
    return t;
  }

  // ---- expressions ----

  bool is_tuple_end(const std::set<std::string>& extra_end) const {
    TokenType ty = cur().type;
    if (ty == TokenType::kVariableEnd || ty == TokenType::kBlockEnd || ty == TokenType::kEof)
      return true;
    if (is_op(")")) return true;
    return ty == TokenType::kName && extra_end.count(cur().text);
  }

  ExprPtr parse_tuple(bool simplified, bool with_condexpr, const std::set<std::string>& extra_end,
                      bool explicit_parentheses) {
    int line = cur().line;
    std::vector<ExprPtr> items;
    bool is_tuple = false;
    while (true) {
      if (!items.empty()) expect_op(",");
      if (is_tuple_end(extra_end)) break;
      items.push_back(simplified ? parse_primary() : parse_expression(with_condexpr));
      if (is_op(","))
        is_tuple = true;
      else
        break;
    }
    if (!is_tuple) {
      if (!items.empty()) return std::move(items[0]);
      if (!explicit_parentheses) fail("expected an expression, got " + describe(cur()));
    }
    auto e = std::make_unique<Expr>(Expr::Kind::kTuple, line);
    e->items = std::move(items);
    return e;
  }

  ExprPtr parse_expression(bool with_condexpr) {
    return with_condexpr ? parse_condexpr() : parse_or();
  }

  ExprPtr parse_condexpr() {
    int line = cur().line;
    ExprPtr expr1 = parse_or();
    while (skip_name("if")) {
      ExprPtr cond = parse_or();
      ExprPtr else_expr;
      if (skip_name("else")) else_expr = parse_condexpr();
      auto e = std::make_unique<Expr>(Expr::Kind::kCondExpr, line);
      e->items.push_back(std::move(expr1));
      e->items.push_back(std::move(cond));
      e->items.push_back(std::move(else_expr));
      expr1 = std::move(e);
      line = cur().line;
    }
    return expr1;
  }

  ExprPtr binary(Expr::Kind kind, std::string op, ExprPtr l, ExprPtr r, int line) {
    auto e = std::make_unique<Expr>(kind, line);
    e->op = std::move(op);
    e->items.push_back(std::move(l));
    e->items.push_back(std::move(r));
    return e;
  }

  ExprPtr parse_or() {
    int line = cur().line;
    ExprPtr left = parse_and();
    while (skip_name("or")) {
      left = binary(Expr::Kind::kOr, "or", std::move(left), parse_and(), line);
      line = cur().line;
    }
    return left;
  }

  ExprPtr parse_and() {
    int line = cur().line;
    ExprPtr left = parse_not();
    while (skip_name("and")) {
      left = binary(Expr::Kind::kAnd, "and", std::move(left), parse_not(), line);
      line = cur().line;
    }
    return left;
  }

  ExprPtr parse_not() {
    if (is_name("not")) {
      int line = next().line;
      auto e = std::make_unique<Expr>(Expr::Kind::kNot, line);
      e->object = parse_not();
      return e;
    }
    return parse_compare();
  }

  ExprPtr parse_compare() {
    int line = cur().line;
    ExprPtr expr = parse_math1();
    std::vector<std::string> ops;
    std::vector<ExprPtr> operands;
    while (true) {
      static const std::set<std::string> kCompare = {"==", "!=", "<", ">", "<=", ">="};
      if (cur().type == TokenType::kOperator && kCompare.count(cur().text)) {
        ops.push_back(next().text);
      } else if (skip_name("in")) {
        ops.push_back("in");
      } else if (is_name("not") && look().type == TokenType::kName && look().text == "in") {
        next();
        next();
        ops.push_back("not in");
      } else {
        break;
      }
      operands.push_back(parse_math1());
    }
    if (ops.empty()) return expr;
    auto e = std::make_unique<Expr>(Expr::Kind::kCompare, line);
    e->object = std::move(expr);
    e->ops = std::move(ops);
    e->items = std::move(operands);
    return e;
  }

  ExprPtr parse_math1() {
    int line = cur().line;
    ExprPtr left = parse_concat();
    while (is_op("+") || is_op("-")) {
      std::string op = next().text;
      left = binary(Expr::Kind::kBinary, op, std::move(left), parse_concat(), line);
      line = cur().line;
    }
    return left;
  }

  ExprPtr parse_concat() {
    int line = cur().line;
    std::vector<ExprPtr> args;
    args.push_back(parse_math2());
    while (skip_op("~")) args.push_back(parse_math2());
    if (args.size() == 1) return std::move(args[0]);
    auto e = std::make_unique<Expr>(Expr::Kind::kConcat, line);
    e->items = std::move(args);
    return e;
  }

  ExprPtr parse_math2() {
    int line = cur().line;
    ExprPtr left = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      std::string op = next().text;
      left = binary(Expr::Kind::kBinary, op, std::move(left), parse_pow(), line);
      line = cur().line;
    }
    return left;
  }

  ExprPtr parse_pow() {
    int line = cur().line;
    ExprPtr left = parse_unary(true);
    while (skip_op("**")) {
      left = binary(Expr::Kind::kBinary, "**", std::move(left), parse_unary(true), line);
      line = cur().line;
    }
    return left;
  }

  ExprPtr parse_unary(bool with_filter) {
    int line = cur().line;
    ExprPtr node;
    if (skip_op("-")) {
      node = std::make_unique<Expr>(Expr::Kind::kNeg, line);
      node->object = parse_unary(false);
    } else if (skip_op("+")) {
      node = std::make_unique<Expr>(Expr::Kind::kPos, line);
      node->object = parse_unary(false);
    } else {
      node = parse_primary();
    }
    node = parse_postfix(std::move(node));
    if (with_filter) node = parse_filter_expr(std::move(node));
    return node;
  }

  ExprPtr parse_primary() {
    const Token& tok = cur();
    int line = tok.line;
    if (tok.type == TokenType::kName) {
      auto e = std::make_unique<Expr>(Expr::Kind::kConst, line);
      const std::string& v = tok.text;
      if (v == "true" || v == "True")
        e->value = Value(true);
      else if (v == "false" || v == "False")
        e->value = Value(false);
      else if (v == "none" || v == "None")
        e->value = Value::none();
      else {
        e->kind = Expr::Kind::kName;
        e->name = v;
      }
      next();
      return e;
    }
    if (tok.type == TokenType::kString) {
      std::string s;
      while (cur().type == TokenType::kString) s += next().text;  // adjacent literals concatenate
      auto e = std::make_unique<Expr>(Expr::Kind::kConst, line);
      e->value = Value(std::move(s));
      return e;
    }
    if (tok.type == TokenType::kInteger || tok.type == TokenType::kFloat) {
      auto e = std::make_unique<Expr>(Expr::Kind::kConst, line);
      e->value = tok.type == TokenType::kInteger ? Value(tok.int_value) : Value(tok.float_value);
      next();
      return e;
    }
    if (skip_op("(")) {
      ExprPtr e = parse_tuple(false, true, {}, true);
      expect_op(")");
      return e;
    }
    if (is_op("[")) return parse_list();
    if (is_op("{")) return parse_dict();
    fail("unexpected " + describe(tok));
  }

  ExprPtr parse_list() {
    int line = expect_op("[").line;
    auto e = std::make_unique<Expr>(Expr::Kind::kList, line);
    while (!is_op("]")) {
      if (!e->items.empty()) expect_op(",");
      if (is_op("]")) break;
      e->items.push_back(parse_expression(true));
    }
    expect_op("]");
    return e;
  }

  ExprPtr parse_dict() {
    int line = expect_op("{").line;
    auto e = std::make_unique<Expr>(Expr::Kind::kDict, line);
    while (!is_op("}")) {
      if (!e->items.empty()) expect_op(",");
      if (is_op("}")) break;
      e->items.push_back(parse_expression(true));
      expect_op(":");
      e->items.push_back(parse_expression(true));
    }
    expect_op("}");
    return e;
  }

  ExprPtr parse_postfix(ExprPtr node) {
    while (true) {
      if (is_op(".") || is_op("["))
        node = parse_subscript(std::move(node));
      else if (is_op("("))
        node = parse_call(std::move(node));
      else
        return node;
    }
  }

  ExprPtr parse_filter_expr(ExprPtr node) {
    while (true) {
      if (is_op("|"))
        node = parse_filter(std::move(node));
      else if (is_name("is"))
        node = parse_test(std::move(node));
      else if (is_op("("))
        node = parse_call(std::move(node));
      else
        return node;
    }
  }

  ExprPtr parse_subscript(ExprPtr node) {
    const Token& tok = next();
    int line = tok.line;
    if (tok.text == ".") {
      const Token& attr = next();
      if (attr.type == TokenType::kName) {
        auto e = std::make_unique<Expr>(Expr::Kind::kGetAttr, line);
        e->object = std::move(node);
        e->name = attr.text;
        return e;
      }
      if (attr.type != TokenType::kInteger) fail("expected name or number after '.'", attr.line);
      auto idx = std::make_unique<Expr>(Expr::Kind::kConst, attr.line);
      idx->value = Value(attr.int_value);
      auto e = std::make_unique<Expr>(Expr::Kind::kGetItem, line);
      e->object = std::move(node);
      e->items.push_back(std::move(idx));
      return e;
    }
    // '['
    std::vector<ExprPtr> args;
    while (!is_op("]")) {
      if (!args.empty()) expect_op(",");
      args.push_back(parse_subscribed());
    }
    expect_op("]");
    if (args.size() == 1 && args[0]->kind == Expr::Kind::kSlice) {
      args[0]->object = std::move(node);
      return std::move(args[0]);
    }
    auto e = std::make_unique<Expr>(Expr::Kind::kGetItem, line);
    e->object = std::move(node);
    if (args.size() == 1) {
      e->items.push_back(std::move(args[0]));
    } else {
      auto t = std::make_unique<Expr>(Expr::Kind::kTuple, line);
      t->items = std::move(args);
      e->items.push_back(std::move(t));
    }
    return e;
  }

  // An index or a slice `a:b:c` (object filled in by the caller).
  ExprPtr parse_subscribed() {
    int line = cur().line;
    ExprPtr start;
    if (!is_op(":")) {
      start = parse_expression(true);
      if (!is_op(":")) return start;
    }
    next();  // ':'
    auto e = std::make_unique<Expr>(Expr::Kind::kSlice, line);
    ExprPtr stop, step;
    if (!is_op("]") && !is_op(",") && !is_op(":")) stop = parse_expression(true);
    if (skip_op(":")) {
      if (!is_op("]") && !is_op(",")) step = parse_expression(true);
    }
    e->items.push_back(std::move(start));
    e->items.push_back(std::move(stop));
    e->items.push_back(std::move(step));
    return e;
  }

  Arguments parse_call_args() {
    int line = expect_op("(").line;
    Arguments a;
    bool require_comma = false;
    while (!is_op(")")) {
      if (require_comma) {
        expect_op(",");
        if (is_op(")")) break;
      }
      if (is_op("*") || is_op("**")) fail("*args / **kwargs in calls are not supported");
      if (cur().type == TokenType::kName && look().type == TokenType::kOperator &&
          look().text == "=") {
        std::string key = next().text;
        next();
        a.keyword.emplace_back(key, parse_expression(true));
      } else {
        if (!a.keyword.empty()) fail("positional argument follows keyword argument", line);
        a.positional.push_back(parse_expression(true));
      }
      require_comma = true;
    }
    expect_op(")");
    return a;
  }

  ExprPtr parse_call(ExprPtr node) {
    int line = cur().line;
    auto e = std::make_unique<Expr>(Expr::Kind::kCall, line);
    e->object = std::move(node);
    e->args = parse_call_args();
    return e;
  }

  ExprPtr parse_filter(ExprPtr node) {
    next();  // '|'
    FilterCall f = parse_filter_call();
    auto e = std::make_unique<Expr>(Expr::Kind::kFilter, f.line);
    e->object = std::move(node);
    e->name = std::move(f.name);
    e->args = std::move(f.args);
    return e;
  }

  ExprPtr parse_test(ExprPtr node) {
    int line = next().line;  // 'is'
    bool negated = skip_name("not");
    std::string name = expect_name().text;
    while (skip_op(".")) name += "." + expect_name().text;
    auto e = std::make_unique<Expr>(Expr::Kind::kTest, line);
    e->object = std::move(node);
    e->name = name;
    e->negated = negated;
    if (is_op("(")) {
      e->args = parse_call_args();
    } else if ((cur().type == TokenType::kName || cur().type == TokenType::kString ||
                cur().type == TokenType::kInteger || cur().type == TokenType::kFloat ||
                is_op("(") || is_op("[") || is_op("{")) &&
               !is_name("else") && !is_name("or") && !is_name("and")) {
      if (is_name("is")) fail("you cannot chain multiple tests with is");
      e->args.positional.push_back(parse_postfix(parse_primary()));
    }
    return e;
  }

  // ---- filter and test names, after parsing ----
  // Jinja2 (3.x) refuses an unknown filter or test when it compiles the template, except inside
  // an if statement (its conditions and bodies) or a conditional expression, where the name
  // fails only if it is evaluated; the body of a for, macro, call, filter, with or set block
  // is checked strictly again (as are a for loop's if, a macro's defaults and a block's filters).
  // The evaluator fails on an unknown name when it reaches one.
  void check_names(const Body& body, bool soft) {
    for (const NodePtr& n : body) check_names(*n, soft);
  }
  void check_names(const Node& n, bool soft) {
    using K = Node::Kind;
    const bool strict_body = n.kind == K::kFor || n.kind == K::kMacro || n.kind == K::kCallBlock ||
                             n.kind == K::kFilterBlock || n.kind == K::kWith ||
                             n.kind == K::kSetBlock || n.kind == K::kScope;
    const bool inner_soft = n.kind == K::kIf ? true : strict_body ? false : soft;
    for (const ExprPtr& c : n.conditions) check_names(c.get(), inner_soft);
    check_names(n.expr.get(), soft);
    check_names(n.filter.get(), false);
    const bool filters_soft = strict_body ? false : soft;
    for (const FilterCall& f : n.filters) {
      if (!filters_soft && !find_filter(f.name)) fail("unknown filter '" + f.name + "'", f.line);
      check_names(f.args, filters_soft);
    }
    for (const MacroParam& p : n.params) check_names(p.default_value.get(), false);
    for (const auto& [target, value] : n.assignments) check_names(value.get(), soft);
    for (const Body& b : n.bodies) check_names(b, inner_soft);
  }
  void check_names(const Arguments& a, bool soft) {
    for (const ExprPtr& e : a.positional) check_names(e.get(), soft);
    for (const auto& [key, e] : a.keyword) check_names(e.get(), soft);
  }
  void check_names(const Expr* e, bool soft) {
    if (!e) return;
    if (e->kind == Expr::Kind::kCondExpr) soft = true;
    if (!soft && e->kind == Expr::Kind::kFilter && !find_filter(e->name))
      fail("unknown filter '" + e->name + "'", e->line);
    if (!soft && e->kind == Expr::Kind::kTest && !find_test(e->name))
      fail("unknown test '" + e->name + "'", e->line);
    check_names(e->object.get(), soft);
    for (const ExprPtr& item : e->items) check_names(item.get(), soft);
    check_names(e->args, soft);
  }

  std::vector<Token> t_;
  size_t i_ = 0;
  int loop_depth_ = 0;
};

}  // namespace

std::unique_ptr<Template> parse(const std::string& source) {
  return Parser(lex(source)).parse_template();
}

}  // namespace ts::tokenizer::jinja
