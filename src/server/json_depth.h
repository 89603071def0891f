// A bound on the nesting of JSON text before nlohmann parses it. nlohmann's parser, its
// destructor, dump() and every walker over a parsed value (jinja::Value::from_json, the
// request checks) recurse once per level, so 100k nested arrays overflow a thread's stack:
// every JSON text from outside (request bodies, and the model's own tool-call output) is
// scanned here first. The scan counts '[' / '{' outside strings (a backslash escapes the
// next byte inside one); it does not validate - the parser still does.
#pragma once

#include <cstddef>
#include <optional>
#include <string_view>

namespace ts::server {

// Deeper request bodies are refused (400): OpenAI's and Anthropic's own schemas nest a few
// levels; tool schemas, the deepest real input, a few dozen at most.
inline constexpr int kMaxJsonDepth = 128;

// The byte offset of the bracket that first opens level max_depth + 1, or nullopt when
// `text` never nests deeper than max_depth.
std::optional<size_t> json_too_deep_at(std::string_view text, int max_depth = kMaxJsonDepth);

}  // namespace ts::server
