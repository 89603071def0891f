// Jinja2 parser: token stream (jinja_lexer.h) -> syntax tree (jinja_ast.h). The grammar and the
// operator precedence are those of jinja2/parser.py; the statements are the ones chat templates
// use (if/elif/else, for/else with a filter, set, block set, macro, call, filter, with, raw,
// break/continue, transformers' generation). Unknown tags, filters and tests are errors at parse
// time, as in Jinja2: "template line 12: unknown filter 'foo'".
#pragma once

#include <memory>
#include <string>

#include "tokenizer/jinja_ast.h"

namespace ts::tokenizer::jinja {

// Throws TemplateError with the line of the offending token.
std::unique_ptr<Template> parse(const std::string& source);

}  // namespace ts::tokenizer::jinja
