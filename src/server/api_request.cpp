// Request bodies -> GenRequest. Each check names the field it is about.
#include <charconv>
#include <random>

#include "server/api.h"

#include "runtime/json_schema.h"
#include "tokenizer/chat_template.h"

namespace ts::server {
namespace {

// j[key] when it is a string, else "" (a missing or mistyped field then fails the caller's
// check with a 400 naming it; nlohmann's value() would throw, a 500).
std::string string_field(const json& j, const char* key) {
  if (!j.is_object()) return "";
  auto it = j.find(key);
  return it != j.end() && it->is_string() ? it->get<std::string>() : "";
}

ApiError bad(std::string param, std::string message) {
  return ApiError{.status = 400, .message = std::move(message), .param = std::move(param)};
}

// Block b's optional string field key ("" when absent), or a 400 naming at.key when it is
// present with another type.
Parsed<std::string> optional_string(const json& b, const char* key, const std::string& at) {
  if (b.contains(key) && !b[key].is_string())
    return bad(at, "'" + at + "." + key + "' must be a string");
  return string_field(b, key);
}

// Reads optional fields of a JSON object; the first problem is kept and reported.
class Fields {
 public:
  explicit Fields(const json& obj) : obj_(obj) {}

  const json* get(const char* key) const {
    auto it = obj_.find(key);
    return it == obj_.end() || it->is_null() ? nullptr : &*it;
  }
  std::optional<double> number(const char* key, double lo, double hi) {
    const json* v = get(key);
    if (!v) return std::nullopt;
    if (!v->is_number()) return fail(key, "must be a number"), std::nullopt;
    double x = v->get<double>();
    if (!(x >= lo && x <= hi))
      return fail(key, "must be between " + num(lo) + " and " + num(hi)), std::nullopt;
    return x;
  }
  std::optional<int64_t> integer(const char* key, int64_t lo, int64_t hi) {
    const json* v = get(key);
    if (!v) return std::nullopt;
    if (!v->is_number_integer()) return fail(key, "must be an integer"), std::nullopt;
    if (v->is_number_unsigned() && v->get<uint64_t>() > uint64_t(INT64_MAX))
      return fail(key, "is too large"), std::nullopt;
    int64_t x = v->get<int64_t>();
    if (x < lo) return fail(key, "must be at least " + std::to_string(lo)), std::nullopt;
    if (x > hi) return fail(key, "must be at most " + std::to_string(hi)), std::nullopt;
    return x;
  }
  std::optional<bool> boolean(const char* key) {
    const json* v = get(key);
    if (!v) return std::nullopt;
    if (!v->is_boolean()) return fail(key, "must be a boolean"), std::nullopt;
    return v->get<bool>();
  }
  std::optional<std::string> string(const char* key) {
    const json* v = get(key);
    if (!v) return std::nullopt;
    if (!v->is_string()) return fail(key, "must be a string"), std::nullopt;
    return v->get<std::string>();
  }
  void fail(const std::string& key, const std::string& what) {
    if (!error_) error_ = bad(key, "'" + key + "' " + what);
  }
  const std::optional<ApiError>& error() const { return error_; }

 private:
  static std::string num(double x) {
    std::string s = std::to_string(x);
    s.erase(s.find_last_not_of('0') + 1);
    if (s.back() == '.') s.pop_back();
    return s;
  }
  const json& obj_;
  std::optional<ApiError> error_;
};

std::optional<ApiError> check_model(Fields& f, const std::string& model_id) {
  std::optional<std::string> model = f.string("model");
  if (model && *model != model_id)
    return ApiError{.status = 404,
                    .message = "The model '" + *model + "' does not exist; this server serves '" +
                               model_id + "'",
                    .param = "model",
                    .code = "model_not_found"};
  return std::nullopt;
}

// Sampling fields common to the OpenAI routes (Anthropic's are a subset, read the same way).
void read_sampling(Fields& f, GenRequest& r, double max_temperature) {
  if (auto t = f.number("temperature", 0, max_temperature)) r.sampling.temperature = float(*t);
  if (auto p = f.number("top_p", 0, 1)) r.sampling.top_p = float(*p);
  if (auto k = f.integer("top_k", 0, 1 << 30)) r.sampling.top_k = int(*k);
  if (auto m = f.number("min_p", 0, 1)) r.sampling.min_p = float(*m);
  if (auto s = f.integer("seed", INT64_MIN, INT64_MAX)) {
    r.sampling.seed = uint64_t(*s);
    r.seed_given = true;
  }
}

// "stop": a string or an array of non-empty strings.
void read_stops(Fields& f, const char* key, bool allow_string, GenRequest& r) {
  const json* v = f.get(key);
  if (!v) return;
  if (allow_string && v->is_string()) {
    r.stops = {v->get<std::string>()};
  } else if (v->is_array()) {
    for (const json& s : *v) {
      if (!s.is_string()) return f.fail(key, "must hold only strings");
      r.stops.push_back(s.get<std::string>());
    }
  } else {
    return f.fail(key, allow_string ? "must be a string or an array of strings"
                                    : "must be an array of strings");
  }
  for (const std::string& s : r.stops)
    if (s.empty()) return f.fail(key, "must not contain an empty string");
}

// max_tokens from `min` (completions take 0 with echo: checked by the caller).
void read_max_tokens(Fields& f, GenRequest& r, bool chat, int64_t min = 1) {
  // The context check comes later, once the prompt is tokenized.
  if (auto n = f.integer("max_tokens", min, INT32_MAX)) r.max_tokens = *n;
  if (chat) {
    if (auto n = f.integer("max_completion_tokens", 1, INT32_MAX)) r.max_tokens = *n;
  }
}

// "logit_bias": {"<token id>": bias, ...}, each bias in [-100, 100] (OpenAI's). Ids are checked
// against the vocabulary once the tokenizer is at hand (Server::Impl::tokenize).
void read_logit_bias(Fields& f, GenRequest& r) {
  const json* v = f.get("logit_bias");
  if (!v) return;
  if (!v->is_object()) return f.fail("logit_bias", "must be an object of token ids to numbers");
  for (const auto& [key, bias] : v->items()) {
    int id = -1;
    const auto [end, ec] = std::from_chars(key.data(), key.data() + key.size(), id);
    if (ec != std::errc() || end != key.data() + key.size() || id < 0)
      return f.fail("logit_bias", "has key '" + key + "', which is not a token id");
    if (!bias.is_number() || !(bias.get<double>() >= -100 && bias.get<double>() <= 100))
      return f.fail("logit_bias", "maps token " + key + " to " + bias.dump() +
                                      "; a bias is a number between -100 and 100");
    r.sampling.logit_bias.emplace_back(id, bias.get<float>());
  }
}

// "response_format": {"type": "text"}, {"type": "json_object"} (the reply constrained to one
// JSON object) or {"type": "json_schema", "json_schema": {"name", "schema", "strict"}} (to an
// object the schema accepts: runtime/json_schema.h's subset; others are refused, naming the
// schema keyword).
void read_response_format(Fields& f, GenRequest& r) {
  const json* v = f.get("response_format");
  if (!v) return;
  const json* type = v->is_object() && v->contains("type") ? &(*v)["type"] : nullptr;
  if (!type || !type->is_string())
    return f.fail("response_format", "must be an object with a string 'type'");
  const std::string t = type->get<std::string>();
  if (t == "json_object") {
    r.json_object = true;
  } else if (t == "json_schema") {
    const json* js = v->contains("json_schema") ? &(*v)["json_schema"] : nullptr;
    if (!js || !js->is_object() || !js->contains("schema"))
      return f.fail("response_format",
                    "type 'json_schema' needs 'json_schema': {\"name\": ..., \"schema\": {...}}");
    auto schema = runtime::compile_schema((*js)["schema"]);
    if (!schema.ok()) return f.fail("response_format", schema.error().message);
    r.json_object = true;
    r.schema = std::move(schema.value());
  } else if (t != "text") {
    f.fail("response_format", "type '" + t + "' is not one of text, json_object, json_schema");
  }
}

// What /v1/chat/completions and /v1/completions read alike: streaming, sampling with the
// OpenAI penalties and logit biases, the token budget, stop strings, and n (not streamed).
void read_openai_options(Fields& f, GenRequest& r, bool chat) {
  r.stream = f.boolean("stream").value_or(false);
  if (const json* so = f.get("stream_options")) {
    if (!so->is_object())
      f.fail("stream_options", "must be an object");
    else
      r.include_usage = Fields(*so).boolean("include_usage").value_or(false);
  }
  read_sampling(f, r, 2.0);
  if (auto p = f.number("presence_penalty", -2, 2)) r.sampling.presence_penalty = float(*p);
  if (auto p = f.number("frequency_penalty", -2, 2)) r.sampling.frequency_penalty = float(*p);
  read_logit_bias(f, r);
  read_response_format(f, r);
  read_max_tokens(f, r, chat, chat ? 1 : 0);
  read_stops(f, "stop", /*allow_string=*/true, r);
  if (auto k = f.integer("n", 1, 128)) r.n = int(*k);
  if (r.n > 1 && r.stream) f.fail("n", "above 1 is not supported with stream: true");
}

// OpenAI content: a string, null, or an array of {"type": "text", "text": ...} parts, which
// are joined with newlines (templates expect a string).
std::optional<ApiError> flatten_content(json& msg, const std::string& where) {
  auto it = msg.find("content");
  if (it == msg.end() || it->is_null() || it->is_string()) return std::nullopt;
  if (!it->is_array())
    return bad(where + ".content",
               "'" + where + ".content' must be a string, null or an array of text parts");
  std::string text;
  for (size_t i = 0; i < it->size(); ++i) {
    const json& part = (*it)[i];
    const std::string at = where + ".content[" + std::to_string(i) + "]";
    if (!part.is_object() || string_field(part, "type") != "text" || !part.contains("text") ||
        !part["text"].is_string())
      return bad(
          at,
          "'" + at +
              "' must be a {\"type\": \"text\", \"text\": string} part (only text is supported)");
    if (!text.empty()) text += "\n";
    text += part["text"].get<std::string>();
  }
  *it = text;
  return std::nullopt;
}

std::optional<ApiError> check_openai_tools(const json& tools) {
  if (!tools.is_array()) return bad("tools", "'tools' must be an array");
  for (size_t i = 0; i < tools.size(); ++i) {
    const json& t = tools[i];
    const std::string at = "tools[" + std::to_string(i) + "]";
    if (!t.is_object() || string_field(t, "type") != "function" || !t.contains("function") ||
        !t["function"].is_object() || !t["function"].contains("name") ||
        !t["function"]["name"].is_string())
      return bad(
          at,
          "'" + at + "' must be {\"type\": \"function\", \"function\": {\"name\": string, ...}}");
  }
  return std::nullopt;
}

Parsed<std::string> render(const tokenizer::ChatTemplate& tmpl, const json& messages,
                           const json& tools, const json& kwargs) {
  auto text = tmpl.render(messages, tools, /*add_generation_prompt=*/true, kwargs);
  if (!text.ok()) {
    // Templates disagree on an assistant turn with tool calls and no text: DeepSeek-V3's
    // renders the calls only when content is null, Qwen3's fails on null (`'</think>' in
    // content`). Null as sent first, then "" in its place.
    json blank = messages;
    bool changed = false;
    for (json& m : blank)
      if (m["content"].is_null()) m["content"] = "", changed = true;
    if (changed) {
      auto again = tmpl.render(blank, tools, /*add_generation_prompt=*/true, kwargs);
      if (again.ok()) return std::move(again.value());
    }
    return bad("messages", "the chat template rejected the conversation: " + text.error().message);
  }
  return std::move(text.value());
}

}  // namespace

Parsed<GenRequest> parse_chat_request(const json& body, const tokenizer::ChatTemplate& tmpl,
                                      const std::string& model_id) {
  if (!body.is_object()) return bad("", "the request body must be a JSON object");
  Fields f(body);
  if (auto e = check_model(f, model_id)) return *e;
  GenRequest r{.api = Api::kChat};
  read_openai_options(f, r, /*chat=*/true);
  const bool logprobs = f.boolean("logprobs").value_or(false);
  const std::optional<int64_t> top = f.integer("top_logprobs", 0, 20);
  if (top && !logprobs) f.fail("top_logprobs", "needs logprobs: true");
  if (logprobs) r.logprobs = int(top.value_or(0));
  if (f.error()) return *f.error();

  const json* msgs = f.get("messages");
  if (!msgs) return bad("messages", "'messages' is required");
  if (!msgs->is_array()) return bad("messages", "'messages' must be an array");
  if (msgs->empty()) return bad("messages", "'messages' must not be empty");
  json messages = json::array();
  for (size_t i = 0; i < msgs->size(); ++i) {
    const std::string at = "messages[" + std::to_string(i) + "]";
    json m = (*msgs)[i];
    if (!m.is_object()) return bad(at, "'" + at + "' must be an object");
    if (!m.contains("role") || !m["role"].is_string())
      return bad(at + ".role", "'" + at + ".role' must be a string");
    std::string role = m["role"].get<std::string>();
    if (role == "developer") m["role"] = role = "system";  // templates know "system"
    if (role != "system" && role != "user" && role != "assistant" && role != "tool")
      return bad(at + ".role",
                 "'" + at + ".role' must be system, developer, user, assistant or tool");
    if (auto e = flatten_content(m, at)) return *e;
    const bool has_calls = m.contains("tool_calls") && !m["tool_calls"].is_null();
    if (!m.contains("content") || m["content"].is_null()) {
      if (!(role == "assistant" && has_calls))
        return bad(at + ".content", "'" + at + ".content' is required");
    }
    if (!m.contains("content")) m["content"] = nullptr;
    if (has_calls && (role != "assistant" || !m["tool_calls"].is_array()))
      return bad(at + ".tool_calls",
                 "'" + at + ".tool_calls' must be an array on an assistant message");
    messages.push_back(std::move(m));
  }
  json tools = nullptr;
  if (const json* t = f.get("tools")) {
    if (auto e = check_openai_tools(*t)) return *e;
    if (!t->empty()) tools = *t;
  }
  // tool_choice "none": the tools stay out of the prompt and replies are not parsed for calls.
  // "required" and a named function would need the reply constrained to a call (issue 56):
  // refused rather than served as "auto".
  if (const json* choice = f.get("tool_choice")) {
    if (*choice == "none")
      tools = nullptr;
    else if (*choice == "required" || choice->is_object())
      return bad("tool_choice",
                 std::string("'tool_choice' ") +
                     (choice->is_object() ? "naming a function" : "\"required\"") +
                     " is not supported yet (the reply is not constrained to a "
                     "tool call): send \"auto\", where the model chooses, or \"none\"");
    else if (*choice != "auto")
      return bad("tool_choice",
                 "'tool_choice' must be \"none\", \"auto\", \"required\" or "
                 "{\"type\": \"function\", \"function\": {\"name\": ...}}");
  }
  r.parse_tools = !tools.is_null();
  json kwargs = nullptr;
  if (const json* k = f.get("chat_template_kwargs")) {
    if (!k->is_object())
      return bad("chat_template_kwargs", "'chat_template_kwargs' must be an object");
    kwargs = *k;
  }
  auto text = render(tmpl, messages, tools, kwargs);
  if (auto* e = std::get_if<ApiError>(&text)) return *e;
  r.prompt_text = std::move(std::get<std::string>(text));
  return r;
}

Parsed<GenRequest> parse_completion_request(const json& body, const std::string& model_id) {
  if (!body.is_object()) return bad("", "the request body must be a JSON object");
  Fields f(body);
  if (auto e = check_model(f, model_id)) return *e;
  GenRequest r{.api = Api::kCompletion, .add_special = true};
  read_openai_options(f, r, /*chat=*/false);
  r.echo = f.boolean("echo").value_or(false);
  // With echo, max_tokens 0 asks for the prompt's logprobs only (how evaluation harnesses
  // score text); elsewhere max_tokens is at least 1.
  if (r.max_tokens == 0 && !r.echo) f.fail("max_tokens", "must be at least 1 (0 only with echo)");
  if (r.echo && r.stream) f.fail("echo", "is not supported with stream: true");
  if (f.get("suffix")) f.fail("suffix", "is not supported");
  if (auto n = f.integer("logprobs", 0, 5)) r.logprobs = int(*n);
  if (f.error()) return *f.error();

  // "prompt": a string, an array of one string, or token ids (one array, or one nested).
  const json* p = f.get("prompt");
  if (!p) return bad("prompt", "'prompt' is required");
  json prompt = *p;
  if (prompt.is_array() && prompt.size() == 1 && (prompt[0].is_string() || prompt[0].is_array()))
    prompt = json(prompt[0]);
  if (prompt.is_string()) {
    r.prompt_text = prompt.get<std::string>();
  } else if (prompt.is_array() && !prompt.empty()) {
    for (const json& id : prompt) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX)
        return bad("prompt", "'prompt' must be a string, an array of one string, or token ids");
      r.prompt_ids.push_back(int(id.get<int64_t>()));
    }
  } else {
    return bad("prompt",
               "'prompt' must be a string, an array of one string, or token ids "
               "(one prompt per request)");
  }
  return r;
}

namespace {

// Anthropic text: a string or an array of {"type": "text"} blocks.
Parsed<std::string> anthropic_text(const json& v, const std::string& at) {
  if (v.is_string()) return v.get<std::string>();
  if (!v.is_array()) return bad(at, "'" + at + "' must be a string or an array of text blocks");
  std::string text;
  for (size_t i = 0; i < v.size(); ++i) {
    const json& b = v[i];
    if (!b.is_object() || string_field(b, "type") != "text" || !b.contains("text") ||
        !b["text"].is_string())
      return bad(at, "'" + at + "[" + std::to_string(i) + "]' must be a text block");
    if (!text.empty()) text += "\n";
    text += b["text"].get<std::string>();
  }
  return text;
}

// One Anthropic message -> template messages (OpenAI shape): tool_result blocks become "tool"
// messages, tool_use blocks the assistant's tool_calls, thinking blocks reasoning_content.
std::optional<ApiError> convert_anthropic_message(const json& m, const std::string& at, json& out) {
  if (!m.is_object()) return bad(at, "'" + at + "' must be an object");
  const std::string role = string_field(m, "role");
  if (role != "user" && role != "assistant")
    return bad(at + ".role", "'" + at + ".role' must be user or assistant");
  if (!m.contains("content")) return bad(at + ".content", "'" + at + ".content' is required");
  const json& content = m["content"];
  if (content.is_string()) {
    out.push_back({{"role", role}, {"content", content}});
    return std::nullopt;
  }
  if (!content.is_array())
    return bad(at + ".content", "'" + at + ".content' must be a string or an array of blocks");
  std::string text, thinking;
  json calls = json::array();
  for (size_t i = 0; i < content.size(); ++i) {
    const json& b = content[i];
    const std::string bat = at + ".content[" + std::to_string(i) + "]";
    const std::string type = string_field(b, "type");
    if (type == "text" && b.contains("text") && b["text"].is_string()) {
      if (!text.empty()) text += "\n";
      text += b["text"].get<std::string>();
    } else if (type == "thinking" && role == "assistant") {
      auto t = optional_string(b, "thinking", bat);
      if (auto* e = std::get_if<ApiError>(&t)) return *e;
      thinking += std::get<std::string>(t);
    } else if (type == "tool_use" && role == "assistant") {
      if (!b.contains("name") || !b["name"].is_string() || !b.contains("input") ||
          !b["input"].is_object())
        return bad(bat, "'" + bat + "' (tool_use) needs a string name and an object input");
      auto id = optional_string(b, "id", bat);
      if (auto* e = std::get_if<ApiError>(&id)) return *e;
      calls.push_back({{"id", std::get<std::string>(id)},
                       {"type", "function"},
                       {"function", {{"name", b["name"]}, {"arguments", b["input"].dump()}}}});
    } else if (type == "tool_result" && role == "user") {
      std::string result;
      if (b.contains("content")) {
        auto r = anthropic_text(b["content"], bat + ".content");
        if (auto* e = std::get_if<ApiError>(&r)) return *e;
        result = std::get<std::string>(r);
      }
      auto id = optional_string(b, "tool_use_id", bat);
      if (auto* e = std::get_if<ApiError>(&id)) return *e;
      out.push_back(
          {{"role", "tool"}, {"tool_call_id", std::get<std::string>(id)}, {"content", result}});
    } else {
      return bad(
          bat, "'" + bat + "' has an unsupported block type '" + type +
                   "' (text, tool_use and thinking from the assistant, tool_result from the user)");
    }
  }
  if (role == "user" && text.empty() && !out.empty() && out.back()["role"] == "tool")
    return std::nullopt;
  json msg = {{"role", role},
              {"content", text.empty() && !calls.empty() ? json(nullptr) : json(text)}};
  if (!thinking.empty()) msg["reasoning_content"] = thinking;
  if (!calls.empty()) msg["tool_calls"] = calls;
  out.push_back(std::move(msg));
  return std::nullopt;
}

}  // namespace

Parsed<GenRequest> parse_messages_request(const json& body, const tokenizer::ChatTemplate& tmpl,
                                          const std::string& model_id) {
  if (!body.is_object()) return bad("", "the request body must be a JSON object");
  Fields f(body);
  if (auto e = check_model(f, model_id)) return *e;
  GenRequest r{.api = Api::kMessages};
  r.stream = f.boolean("stream").value_or(false);
  read_sampling(f, r, 1.0);
  read_stops(f, "stop_sequences", /*allow_string=*/false, r);
  if (!f.get("max_tokens") && !f.error()) f.fail("max_tokens", "is required");
  read_max_tokens(f, r, /*chat=*/false);
  if (f.error()) return *f.error();

  json messages = json::array();
  if (const json* sys = f.get("system")) {
    auto text = anthropic_text(*sys, "system");
    if (auto* e = std::get_if<ApiError>(&text)) return *e;
    messages.push_back({{"role", "system"}, {"content", std::get<std::string>(text)}});
  }
  const json* msgs = f.get("messages");
  if (!msgs) return bad("messages", "'messages' is required");
  if (!msgs->is_array()) return bad("messages", "'messages' must be an array");
  if (msgs->empty()) return bad("messages", "'messages' must not be empty");
  for (size_t i = 0; i < msgs->size(); ++i)
    if (auto e =
            convert_anthropic_message((*msgs)[i], "messages[" + std::to_string(i) + "]", messages))
      return *e;
  json tools = nullptr;
  if (const json* t = f.get("tools")) {
    if (!t->is_array()) return bad("tools", "'tools' must be an array");
    tools = json::array();
    for (size_t i = 0; i < t->size(); ++i) {
      const json& d = (*t)[i];
      const std::string at = "tools[" + std::to_string(i) + "]";
      if (!d.is_object() || !d.contains("name") || !d["name"].is_string())
        return bad(at, "'" + at + "' must be an object with a string name");
      json fn = {{"name", d["name"]}};
      if (d.contains("description")) fn["description"] = d["description"];
      fn["parameters"] = d.value("input_schema", json::object());
      tools.push_back({{"type", "function"}, {"function", fn}});
    }
    if (tools.empty()) tools = nullptr;
  }
  if (const json* choice = f.get("tool_choice")) {
    const std::string type = string_field(*choice, "type");
    if (type == "none") tools = nullptr;
    // "any" and a named tool would need the reply constrained to a call (issue 56).
    if (type == "any" || type == "tool")
      return bad("tool_choice",
                 "'tool_choice' {\"type\": \"" + type +
                     "\"} is not supported yet (the reply is not constrained to a "
                     "tool call): send {\"type\": \"auto\"} or {\"type\": \"none\"}");
  }
  r.parse_tools = !tools.is_null();
  auto text = render(tmpl, messages, tools, nullptr);
  if (auto* e = std::get_if<ApiError>(&text)) return *e;
  r.prompt_text = std::move(std::get<std::string>(text));
  return r;
}

json openai_error_body(const ApiError& e) {
  return {{"error",
           {{"message", e.message},
            {"type", e.type},
            {"param", e.param.empty() ? json(nullptr) : json(e.param)},
            {"code", e.code.empty() ? json(nullptr) : json(e.code)}}}};
}

json anthropic_error_body(const ApiError& e) {
  // Anthropic's types by status: invalid_request_error, authentication_error, not_found_error,
  // request_too_large, overloaded_error, api_error.
  std::string type = e.type;
  if (e.status == 401)
    type = "authentication_error";
  else if (e.status == 404)
    type = "not_found_error";
  else if (e.status == 413)
    type = "request_too_large";
  else if (e.status == 503)
    type = "overloaded_error";
  return {{"type", "error"}, {"error", {{"type", type}, {"message", e.message}}}};
}

std::string make_id(const std::string& prefix) {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  static constexpr char kHex[] = "0123456789abcdef";
  std::string id = prefix;
  for (int i = 0; i < 24; ++i) id += kHex[rng() & 15];
  return id;
}

}  // namespace ts::server
