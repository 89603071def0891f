// Generation results -> OpenAI / Anthropic response JSON and SSE frames.
#include "server/api.h"
#include "server/json_depth.h"
#include "tokenizer/utf8.h"

namespace ts::server {
namespace {

using runtime::StopReason;

std::string openai_finish(const runtime::Generation& gen, bool has_calls) {
  if (gen.stop_reason == StopReason::kLength) return "length";
  return has_calls ? "tool_calls" : "stop";
}

json anthropic_stop(const runtime::Generation& gen, bool has_calls,
                    const std::vector<std::string>& stops, json* stop_sequence) {
  *stop_sequence = nullptr;
  if (gen.stop_reason == StopReason::kLength) return "max_tokens";
  if (gen.stop_reason == StopReason::kStop && gen.stop_index >= 0 &&
      size_t(gen.stop_index) < stops.size()) {
    *stop_sequence = stops[size_t(gen.stop_index)];
    return "stop_sequence";
  }
  return has_calls ? "tool_use" : "end_turn";
}

json openai_usage(const runtime::Generation& gen) {
  return {{"prompt_tokens", gen.prompt_tokens},
          {"completion_tokens", gen.generated},
          {"total_tokens", gen.prompt_tokens + gen.generated}};
}

json tool_call_json(const ToolCall& c, const std::string& id) {
  return {{"id", id},
          {"type", "function"},
          {"function", {{"name", c.name}, {"arguments", c.arguments}}}};
}

json parse_object(const std::string& text) {
  // (Arguments come from output_parser, already depth-checked; checked again as they are
  // parsed again.)
  if (json_too_deep_at(text)) return json::object();
  json j = json::parse(text, nullptr, false);
  return j.is_object() ? j : json::object();
}

std::string data_frame(const json& j) { return "data: " + dump_json(j) + "\n\n"; }
std::string event_frame(const char* event, const json& j) {
  return std::string("event: ") + event + "\ndata: " + dump_json(j) + "\n\n";
}

}  // namespace

std::string dump_json(const json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

ReplyParts split_reply(const std::string& text, bool parse_tools, bool starts_in_reasoning) {
  OutputParser parser({.starts_in_reasoning = starts_in_reasoning, .parse_tools = parse_tools});
  std::vector<OutputEvent> events = parser.feed(text);
  for (OutputEvent& e : parser.finish()) events.push_back(std::move(e));
  ReplyParts r;
  for (OutputEvent& e : events) {
    switch (e.kind) {
      case OutputEvent::Kind::kReasoning:
        r.reasoning += e.text;
        break;
      case OutputEvent::Kind::kContent:
        r.content += e.text;
        break;
      case OutputEvent::Kind::kToolCall:
        r.calls.push_back(std::move(e.call));
        break;
    }
  }
  return r;
}

namespace {
json utf8_bytes(const std::string& s) {
  json b = json::array();
  for (unsigned char c : s) b.push_back(int(c));
  return b;
}
}  // namespace

json chat_logprobs_json(const std::vector<TokenLogprob>& lp) {
  json content = json::array();
  for (const TokenLogprob& t : lp) {
    json top = json::array();
    for (const auto& [text, l] : t.top)
      top.push_back({{"token", tokenizer::to_valid_utf8(text)},
                     {"logprob", l},
                     {"bytes", utf8_bytes(text)}});
    content.push_back({{"token", tokenizer::to_valid_utf8(t.text)},
                       {"logprob", t.logprob},
                       {"bytes", utf8_bytes(t.text)},
                       {"top_logprobs", top}});
  }
  return {{"content", content}, {"refusal", nullptr}};
}

json completion_logprobs_json(const std::vector<TokenLogprob>& lp, size_t offset) {
  json tokens = json::array(), logprobs = json::array(), top = json::array(),
       offsets = json::array();
  size_t at = offset;  // byte offset of the token's text in the completion
  for (const TokenLogprob& t : lp) {
    tokens.push_back(tokenizer::to_valid_utf8(t.text));
    logprobs.push_back(t.first ? json(nullptr) : json(t.logprob));
    json alt = json::object();
    for (const auto& [text, l] : t.top) {
      const std::string key = tokenizer::to_valid_utf8(text);
      if (!alt.contains(key)) alt[key] = l;  // two ids may read alike: the likelier stays
    }
    top.push_back(t.first ? json(nullptr) : alt);
    offsets.push_back(at);
    at += t.text.size();
  }
  return {{"tokens", tokens},
          {"token_logprobs", logprobs},
          {"top_logprobs", top},
          {"text_offset", offsets}};
}

json chat_response(const ResponseInfo& info, const runtime::Generation& gen,
                   const ReplyParts& reply, json logprobs) {
  json message = {{"role", "assistant"},
                  {"content", reply.content.empty() && !reply.calls.empty() ? json(nullptr)
                                                                            : json(reply.content)}};
  if (!reply.reasoning.empty()) message["reasoning_content"] = reply.reasoning;
  if (!reply.calls.empty()) {
    json calls = json::array();
    for (const ToolCall& c : reply.calls) calls.push_back(tool_call_json(c, make_id("call_")));
    message["tool_calls"] = calls;
  }
  return {{"id", info.id},
          {"object", "chat.completion"},
          {"created", info.created},
          {"model", info.model},
          {"choices", json::array({{{"index", 0},
                                    {"message", message},
                                    {"logprobs", std::move(logprobs)},
                                    {"finish_reason", openai_finish(gen, !reply.calls.empty())}}})},
          {"usage", openai_usage(gen)}};
}

json completion_response(const ResponseInfo& info, const runtime::Generation& gen,
                         json logprobs) {
  return {{"id", info.id},
          {"object", "text_completion"},
          {"created", info.created},
          {"model", info.model},
          {"choices", json::array({{{"index", 0},
                                    {"text", gen.text},
                                    {"logprobs", std::move(logprobs)},
                                    {"finish_reason", openai_finish(gen, false)}}})},
          {"usage", openai_usage(gen)}};
}

json merge_choices(std::vector<json> responses) {
  json out = std::move(responses.at(0));
  json choices = json::array();
  int64_t completion = 0;
  for (size_t i = 0; i < responses.size(); ++i) {
    const json& r = i == 0 ? out : responses[i];
    json c = r.at("choices").at(0);
    c["index"] = i;
    choices.push_back(std::move(c));
    completion += r.at("usage").at("completion_tokens").get<int64_t>();
  }
  const int64_t prompt = out.at("usage").at("prompt_tokens").get<int64_t>();
  out["choices"] = std::move(choices);
  out["usage"] = {{"prompt_tokens", prompt},
                  {"completion_tokens", completion},
                  {"total_tokens", prompt + completion}};
  return out;
}

json messages_response(const ResponseInfo& info, const runtime::Generation& gen,
                       const ReplyParts& reply, const std::vector<std::string>& stops) {
  json content = json::array();
  if (!reply.reasoning.empty())
    content.push_back({{"type", "thinking"}, {"thinking", reply.reasoning}, {"signature", ""}});
  if (!reply.content.empty()) content.push_back({{"type", "text"}, {"text", reply.content}});
  for (const ToolCall& c : reply.calls)
    content.push_back({{"type", "tool_use"},
                       {"id", make_id("toolu_")},
                       {"name", c.name},
                       {"input", parse_object(c.arguments)}});
  json stop_sequence;
  json stop_reason = anthropic_stop(gen, !reply.calls.empty(), stops, &stop_sequence);
  return {{"id", info.id},
          {"type", "message"},
          {"role", "assistant"},
          {"model", info.model},
          {"content", content},
          {"stop_reason", stop_reason},
          {"stop_sequence", stop_sequence},
          {"usage", {{"input_tokens", gen.prompt_tokens}, {"output_tokens", gen.generated}}}};
}

namespace {

// OpenAI chat.completion.chunk frames.
class ChatSse final : public SseWriter {
 public:
  explicit ChatSse(StreamSpec spec)
      : spec_(std::move(spec)),
        parser_(
            {.starts_in_reasoning = spec_.starts_in_reasoning, .parse_tools = spec_.parse_tools}) {}
  std::string begin(int64_t) override {
    return chunk({{"role", "assistant"}, {"content", ""}}, nullptr);
  }
  std::string text(std::string_view piece, const std::vector<TokenLogprob>& lp) override {
    std::string out = frames(parser_.feed(piece));
    // The tokens' log-probabilities in a chunk of their own, after their text's.
    if (!lp.empty()) out += chunk(json::object(), nullptr, chat_logprobs_json(lp));
    return out;
  }
  std::string end(const runtime::Generation& gen) override {
    std::string out = frames(parser_.finish());
    out += chunk(json::object(), openai_finish(gen, n_calls_ > 0));
    if (spec_.include_usage) {
      json usage = base();
      usage["choices"] = json::array();
      usage["usage"] = openai_usage(gen);
      out += data_frame(usage);
    }
    return out + "data: [DONE]\n\n";
  }

 private:
  json base() const {
    return {{"id", spec_.info.id},
            {"object", "chat.completion.chunk"},
            {"created", spec_.info.created},
            {"model", spec_.info.model}};
  }
  std::string chunk(const json& delta, const json& finish, json logprobs = nullptr) const {
    json j = base();
    j["choices"] = json::array({{{"index", 0},
                                 {"delta", delta},
                                 {"logprobs", std::move(logprobs)},
                                 {"finish_reason", finish}}});
    return data_frame(j);
  }
  std::string frames(const std::vector<OutputEvent>& events) {
    std::string out;
    for (const OutputEvent& e : events) {
      if (e.kind == OutputEvent::Kind::kReasoning) {
        out += chunk({{"reasoning_content", e.text}}, nullptr);
      } else if (e.kind == OutputEvent::Kind::kContent) {
        out += chunk({{"content", e.text}}, nullptr);
      } else {
        json call = tool_call_json(e.call, make_id("call_"));
        call["index"] = n_calls_++;
        out += chunk({{"tool_calls", json::array({call})}}, nullptr);
      }
    }
    return out;
  }
  StreamSpec spec_;
  OutputParser parser_;
  int n_calls_ = 0;
};

// OpenAI text_completion frames: the raw text, no parsing.
class CompletionSse final : public SseWriter {
 public:
  explicit CompletionSse(StreamSpec spec) : spec_(std::move(spec)) {}
  std::string begin(int64_t) override { return {}; }
  std::string text(std::string_view piece, const std::vector<TokenLogprob>& lp) override {
    if (piece.empty() && lp.empty()) return {};
    json logprobs = nullptr;
    if (!lp.empty()) {
      logprobs = completion_logprobs_json(lp, offset_);
      for (const TokenLogprob& t : lp) offset_ += t.text.size();
    }
    return chunk(std::string(piece), nullptr, std::move(logprobs));
  }
  std::string end(const runtime::Generation& gen) override {
    std::string out = chunk("", openai_finish(gen, false));
    if (spec_.include_usage) {
      json usage = base();
      usage["choices"] = json::array();
      usage["usage"] = openai_usage(gen);
      out += data_frame(usage);
    }
    return out + "data: [DONE]\n\n";
  }

 private:
  json base() const {
    return {{"id", spec_.info.id},
            {"object", "text_completion"},
            {"created", spec_.info.created},
            {"model", spec_.info.model}};
  }
  std::string chunk(const std::string& text, const json& finish, json logprobs = nullptr) const {
    json j = base();
    j["choices"] = json::array({{{"index", 0},
                                 {"text", text},
                                 {"logprobs", std::move(logprobs)},
                                 {"finish_reason", finish}}});
    return data_frame(j);
  }
  StreamSpec spec_;
  size_t offset_ = 0;  // bytes of the completion so far, by its tokens
};

// Anthropic's event sequence: message_start, then per content block content_block_start /
// content_block_delta... / content_block_stop, then message_delta (stop reason, output
// tokens) and message_stop.
class MessagesSse final : public SseWriter {
 public:
  explicit MessagesSse(StreamSpec spec)
      : spec_(std::move(spec)),
        parser_(
            {.starts_in_reasoning = spec_.starts_in_reasoning, .parse_tools = spec_.parse_tools}) {}
  std::string begin(int64_t prompt_tokens) override {
    json message = {{"id", spec_.info.id},
                    {"type", "message"},
                    {"role", "assistant"},
                    {"model", spec_.info.model},
                    {"content", json::array()},
                    {"stop_reason", nullptr},
                    {"stop_sequence", nullptr},
                    {"usage", {{"input_tokens", prompt_tokens}, {"output_tokens", 0}}}};
    return event_frame("message_start", {{"type", "message_start"}, {"message", message}}) +
           event_frame("ping", {{"type", "ping"}});
  }
  std::string text(std::string_view piece, const std::vector<TokenLogprob>&) override {
    return frames(parser_.feed(piece));
  }
  std::string end(const runtime::Generation& gen) override {
    std::string out = frames(parser_.finish());
    out += close_block();
    json stop_sequence;
    json stop_reason = anthropic_stop(gen, has_calls_, spec_.stops, &stop_sequence);
    out += event_frame("message_delta",
                       {{"type", "message_delta"},
                        {"delta", {{"stop_reason", stop_reason}, {"stop_sequence", stop_sequence}}},
                        {"usage", {{"output_tokens", gen.generated}}}});
    return out + event_frame("message_stop", {{"type", "message_stop"}});
  }

 private:
  enum class Block { kNone, kThinking, kText };
  std::string close_block() {
    if (open_ == Block::kNone) return {};
    std::string out;
    if (open_ == Block::kThinking)
      out += event_frame("content_block_delta",
                         {{"type", "content_block_delta"},
                          {"index", index_},
                          {"delta", {{"type", "signature_delta"}, {"signature", ""}}}});
    out += event_frame("content_block_stop", {{"type", "content_block_stop"}, {"index", index_}});
    open_ = Block::kNone;
    ++index_;
    return out;
  }
  std::string open_block(const json& block) {
    return event_frame(
        "content_block_start",
        {{"type", "content_block_start"}, {"index", index_}, {"content_block", block}});
  }
  std::string frames(const std::vector<OutputEvent>& events) {
    std::string out;
    for (const OutputEvent& e : events) {
      if (e.kind == OutputEvent::Kind::kToolCall) {
        out += close_block();
        has_calls_ = true;
        out += open_block({{"type", "tool_use"},
                           {"id", make_id("toolu_")},
                           {"name", e.call.name},
                           {"input", json::object()}});
        out += event_frame(
            "content_block_delta",
            {{"type", "content_block_delta"},
             {"index", index_},
             {"delta", {{"type", "input_json_delta"}, {"partial_json", e.call.arguments}}}});
        out +=
            event_frame("content_block_stop", {{"type", "content_block_stop"}, {"index", index_}});
        ++index_;
        continue;
      }
      const bool thinking = e.kind == OutputEvent::Kind::kReasoning;
      const std::string& text = e.text;
      const Block want = thinking ? Block::kThinking : Block::kText;
      if (open_ != want) {
        out += close_block();
        out += open_block(thinking ? json{{"type", "thinking"}, {"thinking", ""}, {"signature", ""}}
                                   : json{{"type", "text"}, {"text", ""}});
        open_ = want;
      }
      json delta = thinking ? json{{"type", "thinking_delta"}, {"thinking", text}}
                            : json{{"type", "text_delta"}, {"text", text}};
      out += event_frame("content_block_delta",
                         {{"type", "content_block_delta"}, {"index", index_}, {"delta", delta}});
    }
    return out;
  }
  StreamSpec spec_;
  OutputParser parser_;
  Block open_ = Block::kNone;
  int index_ = 0;
  bool has_calls_ = false;
};

}  // namespace

std::unique_ptr<SseWriter> make_sse_writer(Api api, const StreamSpec& spec) {
  switch (api) {
    case Api::kChat:
      return std::make_unique<ChatSse>(spec);
    case Api::kCompletion:
      return std::make_unique<CompletionSse>(spec);
    case Api::kMessages:
      return std::make_unique<MessagesSse>(spec);
    case Api::kOllamaChat:
    case Api::kOllamaGenerate:
      return make_ollama_writer(api, spec);
  }
  return nullptr;
}

}  // namespace ts::server
