// Jinja2 lexer, configured the way transformers configures its chat-template environment:
// trim_blocks=True (the first newline after a block or comment tag is dropped), lstrip_blocks=True
// (spaces and tabs before a block or comment tag on its own line are dropped), default
// delimiters, keep_trailing_newline=False (one trailing newline of the source is dropped).
// Whitespace control: `{%-`/`{{-`/`{#-` strip all whitespace before the tag, `-%}`/`-}}`/`-#}`
// all whitespace after it; `{%+` and `+%}` switch lstrip / trim off for that tag.
//
// Output: a flat token stream — data, variable/block begin and end, and the expression tokens
// inside tags (names, strings with Python escapes decoded, numbers, operators) — each tagged with
// its 1-based template line.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ts::tokenizer::jinja {

enum class TokenType {
  kData,
  kVariableBegin,
  kVariableEnd,
  kBlockBegin,
  kBlockEnd,
  kName,
  kString,
  kInteger,
  kFloat,
  kOperator,
  kEof,
};

struct Token {
  TokenType type;
  std::string text;  // data, name, decoded string, operator text
  int64_t int_value = 0;
  double float_value = 0.0;
  int line = 1;
};

// Throws TemplateError (with line) on a lexical error: unclosed tag, comment or string, an
// unbalanced bracket, an unexpected character.
std::vector<Token> lex(const std::string& source);

// Describes a token for error messages: "'endfor'", "end of statement block", ...
std::string describe(const Token& t);

}  // namespace ts::tokenizer::jinja
