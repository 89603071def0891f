// Ollama's generating routes over the OpenAI ones: /api/chat and /api/generate bodies become
// OpenAI chat / completion bodies (then validated as those are), and replies become Ollama's
// JSON objects, streamed as NDJSON lines.
#include <chrono>
#include <cstdio>
#include <ctime>

#include "server/api.h"

namespace ts::server {
namespace {

ApiError bad(const std::string& param, const std::string& message) {
  return ApiError{.message = message, .param = param};
}

// "2026-12-08T03:04:05.123456Z", the time stamp Ollama puts in every object.
std::string now_iso8601() {
  const auto now = std::chrono::system_clock::now();
  const std::time_t t = std::chrono::system_clock::to_time_t(now);
  const auto us =
      std::chrono::duration_cast<std::chrono::microseconds>(now.time_since_epoch()).count() %
      1000000;
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[64];
  std::snprintf(buf, sizeof buf, "%04d-%02d-%02dT%02d:%02d:%02d.%06lldZ", tm.tm_year + 1900,
                tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, (long long)us);
  return buf;
}

// Ollama's options object -> OpenAI sampling fields (names that differ: num_predict, stop).
std::optional<ApiError> copy_options(const json& body, json& out) {
  if (!body.contains("options") || body["options"].is_null()) return std::nullopt;
  const json& o = body["options"];
  if (!o.is_object()) return bad("options", "'options' must be an object");
  for (const char* k :
       {"temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty"})
    if (o.contains(k) && !o[k].is_null()) out[k] = o[k];
  if (o.contains("num_predict") && !o["num_predict"].is_null()) {
    const json& n = o["num_predict"];
    if (!n.is_number_integer())
      return bad("options.num_predict", "'options.num_predict' must be an integer");
    // -1 (and -2, "fill the context") is Ollama's "no limit": the rest of the context.
    if (n.get<int64_t>() >= 0) out["max_tokens"] = n;
  }
  if (o.contains("stop") && !o["stop"].is_null()) out["stop"] = o["stop"];
  return std::nullopt;
}

// format "json" is JSON mode; a schema object is response_format json_schema.
std::optional<ApiError> copy_format(const json& body, json& out) {
  if (!body.contains("format") || body["format"].is_null() || body["format"] == "")
    return std::nullopt;
  if (body["format"] == "json") {
    out["response_format"] = {{"type", "json_object"}};
    return std::nullopt;
  }
  if (body["format"].is_object()) {
    out["response_format"] = {{"type", "json_schema"},
                              {"json_schema", {{"name", "format"}, {"schema", body["format"]}}}};
    return std::nullopt;
  }
  return bad("format", "'format' must be \"json\" or a JSON schema object");
}

// Ollama's message fields -> OpenAI's: tool calls with object arguments, images refused.
Parsed<json> openai_message(const json& m, const std::string& at) {
  if (!m.is_object()) return bad(at, "'" + at + "' must be an object");
  if (m.contains("images") && !m["images"].is_null() && !m["images"].empty())
    return bad(at + ".images", "images are not supported (the model reads text)");
  json out = json::object();
  for (const char* k : {"role", "content"})
    if (m.contains(k)) out[k] = m[k];
  if (m.contains("tool_calls") && m["tool_calls"].is_array()) {
    json calls = json::array();
    for (size_t i = 0; i < m["tool_calls"].size(); ++i) {
      const json& c = m["tool_calls"][i];
      const json* fn = c.is_object() && c.contains("function") ? &c["function"] : nullptr;
      if (!fn || !fn->is_object() || !fn->contains("name") || !(*fn)["name"].is_string())
        return bad(at + ".tool_calls", "'" + at + ".tool_calls[" + std::to_string(i) +
                                           "].function.name' must be a string");
      const json args = fn->contains("arguments") ? (*fn)["arguments"] : json::object();
      calls.push_back(
          {{"id", "call_" + std::to_string(i)},
           {"type", "function"},
           {"function",
            {{"name", (*fn)["name"]},
             {"arguments", args.is_string() ? args.get<std::string>() : args.dump()}}}});
    }
    out["tool_calls"] = std::move(calls);
    if (!out.contains("content") || out["content"] == "") out["content"] = nullptr;
  }
  return out;
}

}  // namespace

Parsed<json> ollama_to_openai(const json& body, Api api, const std::string& model_id) {
  if (!body.is_object()) return bad("", "the request body must be a JSON object");
  json out = json::object();
  // Ollama names carry a tag; "NAME:latest" is NAME.
  if (body.contains("model") && body["model"].is_string()) {
    std::string m = body["model"].get<std::string>();
    if (m.size() > 7 && m.compare(m.size() - 7, 7, ":latest") == 0 && m != model_id)
      m.resize(m.size() - 7);
    out["model"] = m;
  }
  if (body.contains("stream") && !body["stream"].is_null() && !body["stream"].is_boolean())
    return bad("stream", "'stream' must be true or false");
  out["stream"] = body.value("stream", true);  // Ollama streams unless told not to
  if (auto e = copy_options(body, out)) return *e;
  if (auto e = copy_format(body, out)) return *e;
  if (body.contains("tools") && !body["tools"].is_null()) out["tools"] = body["tools"];
  if (api == Api::kOllamaChat) {
    if (!body.contains("messages") || !body["messages"].is_array())
      return bad("messages", "'messages' must be an array");
    json messages = json::array();
    for (size_t i = 0; i < body["messages"].size(); ++i) {
      Parsed<json> m = openai_message(body["messages"][i], "messages[" + std::to_string(i) + "]");
      if (auto* e = std::get_if<ApiError>(&m)) return *e;
      messages.push_back(std::move(std::get<json>(m)));
    }
    out["messages"] = std::move(messages);
    return out;
  }
  // /api/generate: the prompt as it is (raw), or as a user turn (after `system`) through the
  // chat template.
  for (const char* k : {"template", "suffix", "context"})
    if (body.contains(k) && !body[k].is_null() && body[k] != "" && !body[k].empty())
      return bad(k, std::string("'") + k + "' is not supported");
  if (body.contains("images") && !body["images"].is_null() && !body["images"].empty())
    return bad("images", "images are not supported (the model reads text)");
  if (!body.contains("prompt") || !body["prompt"].is_string())
    return bad("prompt", "'prompt' must be a string");
  if (body.value("raw", false)) {
    out["prompt"] = body["prompt"];
    return out;
  }
  json messages = json::array();
  if (body.contains("system") && body["system"].is_string() && body["system"] != "")
    messages.push_back({{"role", "system"}, {"content", body["system"]}});
  messages.push_back({{"role", "user"}, {"content", body["prompt"]}});
  out["messages"] = std::move(messages);
  return out;
}

namespace {

// The fields of the last object: why it stopped, counts, and nanosecond timings.
void add_done(json& j, const runtime::Generation& gen, bool has_calls) {
  j["done"] = true;
  j["done_reason"] =
      gen.stop_reason == runtime::StopReason::kLength && !has_calls ? "length" : "stop";
  const auto ns = [](double s) { return int64_t(s * 1e9); };
  j["total_duration"] = ns(gen.prefill_s + gen.decode_s);
  j["load_duration"] = 0;
  j["prompt_eval_count"] = gen.prompt_tokens;
  j["prompt_eval_duration"] = ns(gen.prefill_s);
  j["eval_count"] = gen.generated;
  j["eval_duration"] = ns(gen.decode_s);
}

json tool_calls_json(const std::vector<ToolCall>& calls) {
  json out = json::array();
  for (const ToolCall& c : calls) {
    json args = json::parse(c.arguments, nullptr, false);
    out.push_back(
        {{"function",
          {{"name", c.name}, {"arguments", args.is_discarded() ? json::object() : args}}}});
  }
  return out;
}

class OllamaNdjson final : public SseWriter {
 public:
  OllamaNdjson(Api api, StreamSpec spec)
      : api_(api),
        spec_(std::move(spec)),
        parser_(
            {.starts_in_reasoning = spec_.starts_in_reasoning, .parse_tools = spec_.parse_tools}) {}
  std::string begin(int64_t) override { return {}; }
  std::string text(std::string_view piece, const std::vector<TokenLogprob>&) override {
    return lines(parser_.feed(piece));
  }
  std::string end(const runtime::Generation& gen) override {
    std::string out = lines(parser_.finish());
    json j = base();
    if (api_ == Api::kOllamaChat)
      j["message"] = {{"role", "assistant"}, {"content", ""}};
    else
      j["response"] = "";
    add_done(j, gen, n_calls_ > 0);
    return out + dump_json(j) + "\n";
  }

 private:
  json base() const { return {{"model", spec_.info.model}, {"created_at", now_iso8601()}}; }
  std::string lines(const std::vector<OutputEvent>& events) {
    std::string out;
    for (const OutputEvent& e : events) {
      json j = base();
      const bool chat = api_ == Api::kOllamaChat;
      json m = {{"role", "assistant"}, {"content", ""}};
      if (e.kind == OutputEvent::Kind::kToolCall) {
        ++n_calls_;
        m["tool_calls"] = tool_calls_json({e.call});
      } else if (e.kind == OutputEvent::Kind::kReasoning) {
        m["thinking"] = e.text;
      } else {
        m["content"] = e.text;
      }
      if (chat) {
        j["message"] = std::move(m);
      } else {
        j["response"] = m["content"];
        if (m.contains("thinking")) j["thinking"] = m["thinking"];
      }
      j["done"] = false;
      out += dump_json(j) + "\n";
    }
    return out;
  }
  Api api_;
  StreamSpec spec_;
  OutputParser parser_;
  int n_calls_ = 0;
};

}  // namespace

std::unique_ptr<SseWriter> make_ollama_writer(Api api, const StreamSpec& spec) {
  return std::make_unique<OllamaNdjson>(api, spec);
}

json ollama_response(Api api, const ResponseInfo& info, const runtime::Generation& gen,
                     const ReplyParts& reply) {
  json j = {{"model", info.model}, {"created_at", now_iso8601()}};
  if (api == Api::kOllamaChat) {
    json m = {{"role", "assistant"}, {"content", reply.content}};
    if (!reply.reasoning.empty()) m["thinking"] = reply.reasoning;
    if (!reply.calls.empty()) m["tool_calls"] = tool_calls_json(reply.calls);
    j["message"] = std::move(m);
  } else {
    j["response"] = reply.content;
    if (!reply.reasoning.empty()) j["thinking"] = reply.reasoning;
  }
  add_done(j, gen, !reply.calls.empty());
  return j;
}

json ollama_error_body(const ApiError& e) { return {{"error", e.message}}; }

}  // namespace ts::server
