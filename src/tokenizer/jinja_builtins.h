// The built-in filters, tests, globals and methods of the chat-template interpreter: Jinja2's
// builtins that templates use, transformers' tojson / raise_exception / strftime_now, and the
// Python str / dict / list methods the sandbox lets templates call ("x".strip(), d.items()).
// Methods that would mutate (list.append, dict.update) fail as in transformers'
// ImmutableSandboxedEnvironment.
#pragma once

#include <string>
#include <string_view>

#include "tokenizer/jinja_value.h"

namespace ts::tokenizer::jinja {

using FilterFn = Value (*)(Interpreter& in, const Value& subject, CallArgs& args);
using TestFn = bool (*)(Interpreter& in, const Value& subject, CallArgs& args);

// Null when no such filter / test exists.
FilterFn find_filter(std::string_view name);
TestFn find_test(std::string_view name);

// `obj.name` for a str / dict / list method: a bound Callable; Undefined with an "unsafe" hint
// for mutating methods (calling it fails, as in the sandbox); Undefined with an empty hint when
// the type has no such method (the caller then looks for a key / reports the attribute).
Value find_method(const Value& obj, const std::string& name);

// range, dict, namespace, raise_exception, strftime_now, cycler-free Jinja globals.
void add_builtin_globals(DictData& globals);

}  // namespace ts::tokenizer::jinja
