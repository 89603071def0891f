// A checkpoint's chat template: turns a conversation (OpenAI-style messages, optional tool
// definitions) into the exact prompt text transformers' apply_chat_template(tokenize=False)
// produces, with our own Jinja interpreter (tokenizer/jinja_*.h).
//
// Where the template comes from (transformers' rules): DIR/chat_template.jinja if present, else
// tokenizer_config.json's "chat_template" — a string, or a list of {"name", "template"} of which
// "default" is used. The template sees: messages, tools (None when absent), documents (None),
// add_generation_prompt, the special tokens bos_token / eos_token / pad_token / unk_token from
// tokenizer_config.json (a string or an AddedToken object {"content": ...}; null ones stay
// undefined), any extra keyword arguments (enable_thinking, reasoning_effort, ...), and the
// functions raise_exception(msg) and strftime_now(fmt).
//
// JSON inputs are nlohmann::ordered_json: key order is part of the output (tojson of a tool
// definition prints keys in the order given, as Python's json.dumps does).
//
// Errors name the file and, for template errors, the line and construct:
//   "<dir>/chat_template.jinja: template line 12: unknown filter 'foo'".
//
// render() is const and keeps no state between calls: concurrent renders are safe.
//
// Not supported (an error names them, nothing is silently mis-rendered): {% include %},
// {% import %}, {% extends %} / blocks, recursive for-loops, *args / **kwargs in calls, macro
// varargs, the groupby / truncate / wordwrap / urlencode filters, str.format specs ("{:>4}").
// Known differences from Python: map/select/dict.items()/range results print as lists rather
// than "<generator object ...>" / "dict_items([...])"; upper/lower use Unicode's simple case
// mappings (plus Python's for ß, İ and the Latin ligatures); integers are 64-bit.
#pragma once

#include <ctime>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "core/status.h"

namespace ts::tokenizer {

namespace jinja {
struct Template;
}

// Special tokens a template may print; absent (nullopt) ones are undefined in the template.
struct SpecialTokens {
  std::optional<std::string> bos, eos, pad, unk;
};

class ChatTemplate {
 public:
  // Reads DIR/tokenizer_config.json (required; only tokenizer files are needed in DIR) and the
  // template, and parses it, so syntax errors and unknown tags / filters / tests surface here.
  static Result<ChatTemplate> load(const std::string& dir);
  // From template text; `origin` prefixes error messages (a file name).
  static Result<ChatTemplate> from_source(const std::string& source, SpecialTokens tokens,
                                          std::string origin = "chat template");

  // Renders the conversation. `messages` must be an array; `tools` null (none) or an array;
  // `extra` an object of additional template variables (null = none). Errors from the template
  // itself (raise_exception, a type error) name the template line.
  Result<std::string> render(const nlohmann::ordered_json& messages,
                             const nlohmann::ordered_json& tools, bool add_generation_prompt,
                             const nlohmann::ordered_json& extra = nullptr) const;

  // strftime_now() normally reads the local clock; fixing it makes renders reproducible.
  void set_fixed_time(const std::tm& local_time) { fixed_time_ = local_time; }

  const std::string& source() const { return source_; }
  const SpecialTokens& special_tokens() const { return tokens_; }

 private:
  std::string source_;
  std::string origin_;
  SpecialTokens tokens_;
  std::shared_ptr<const jinja::Template> tmpl_;
  std::optional<std::tm> fixed_time_;
};

}  // namespace ts::tokenizer
