#include "server/output_parser.h"

#include <nlohmann/json.hpp>
#include <span>

#include "server/json_depth.h"

namespace ts::server {
namespace {

using json = nlohmann::json;

// The model's text as JSON; discarded when invalid or nested too deep (json_depth.h: a reply
// steered by the prompt or logit_bias can be "[[[[...").
json parse_model_json(std::string_view text) {
  if (json_too_deep_at(text)) return json(json::value_t::discarded);
  return json::parse(text, nullptr, false);
}

constexpr std::string_view kThinkOpen = "<think>";
constexpr std::string_view kThinkClose = "</think>";
constexpr std::string_view kQwenOpen = "<tool_call>";
constexpr std::string_view kQwenClose = "</tool_call>";
constexpr std::string_view kDsOpen = "<｜tool▁calls▁begin｜>";
constexpr std::string_view kDsClose = "<｜tool▁calls▁end｜>";
constexpr std::string_view kDsCallOpen = "<｜tool▁call▁begin｜>";
constexpr std::string_view kDsCallClose = "<｜tool▁call▁end｜>";
constexpr std::string_view kDsSep = "<｜tool▁sep｜>";

bool is_space(char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; }

std::string_view trim(std::string_view s) {
  while (!s.empty() && is_space(s.front())) s.remove_prefix(1);
  while (!s.empty() && is_space(s.back())) s.remove_suffix(1);
  return s;
}

// Arguments as the JSON text of an object; a string holding an object is accepted too.
std::optional<std::string> arguments_text(const json& args) {
  if (args.is_object()) return args.dump();
  if (args.is_string()) {
    json inner = parse_model_json(args.get<std::string>());
    if (!inner.is_discarded() && inner.is_object()) return inner.dump();
  }
  return std::nullopt;
}

// Length of the longest suffix of `text` that is a proper prefix of one of `markers`.
size_t partial_marker_suffix(std::string_view text,
                             std::initializer_list<std::string_view> markers) {
  size_t keep = 0;
  for (std::string_view m : markers)
    for (size_t n = std::min(m.size() - 1, text.size()); n > keep; --n)
      if (text.substr(text.size() - n) == m.substr(0, n)) {
        keep = n;
        break;
      }
  return keep;
}

}  // namespace

std::optional<ToolCall> parse_qwen_tool_call(std::string_view body) {
  json j = parse_model_json(trim(body));
  if (j.is_discarded() || !j.is_object() || !j.contains("name") || !j["name"].is_string())
    return std::nullopt;
  ToolCall call{.name = j["name"].get<std::string>(), .arguments = "{}"};
  if (call.name.empty()) return std::nullopt;
  if (j.contains("arguments")) {
    std::optional<std::string> args = arguments_text(j["arguments"]);
    if (!args) return std::nullopt;
    call.arguments = *args;
  }
  return call;
}

std::optional<std::vector<ToolCall>> parse_deepseek_tool_calls(std::string_view body) {
  std::vector<ToolCall> calls;
  size_t pos = 0;
  for (;;) {
    size_t open = body.find(kDsCallOpen, pos);
    if (open == std::string_view::npos) break;
    if (!trim(body.substr(pos, open - pos)).empty()) return std::nullopt;  // stray text
    size_t start = open + kDsCallOpen.size();
    size_t close = body.find(kDsCallClose, start);
    std::string_view inner =
        body.substr(start, close == std::string_view::npos ? body.npos : close - start);
    pos = close == std::string_view::npos ? body.size() : close + kDsCallClose.size();
    size_t sep = inner.find(kDsSep);
    if (sep == std::string_view::npos) return std::nullopt;
    std::string_view left = trim(inner.substr(0, sep));
    std::string_view right = inner.substr(sep + kDsSep.size());
    std::string_view name, args;
    size_t fence = right.find("```json");
    if (fence != std::string_view::npos) {
      // V3: "function<sep>NAME\n```json\n{...}\n```"
      name = trim(right.substr(0, fence));
      std::string_view rest = right.substr(fence + 7);
      size_t end = rest.find("```");
      args = trim(rest.substr(0, end));
    } else {
      // V3.1: "NAME<sep>{...}"
      name = left;
      args = trim(right);
    }
    json j = parse_model_json(args);
    if (name.empty() || j.is_discarded()) return std::nullopt;
    std::optional<std::string> text = arguments_text(j);
    if (!text) return std::nullopt;
    calls.push_back({.name = std::string(name), .arguments = *text});
  }
  if (calls.empty() || !trim(body.substr(pos)).empty()) return std::nullopt;
  return calls;
}

bool prompt_opens_reasoning(std::string_view prompt) {
  std::string_view t = trim(prompt);
  return t.size() >= kThinkOpen.size() && t.substr(t.size() - kThinkOpen.size()) == kThinkOpen;
}

OutputParser::OutputParser(Options options)
    : state_(options.starts_in_reasoning ? State::kReasoning : State::kContent),
      parse_tools_(options.parse_tools),
      skip_ws_(options.starts_in_reasoning) {}

std::vector<OutputEvent> OutputParser::feed(std::string_view text) {
  buf_ += text;
  std::vector<OutputEvent> out;
  step(out, false);
  return out;
}

std::vector<OutputEvent> OutputParser::finish() {
  std::vector<OutputEvent> out;
  step(out, true);
  return out;
}

void OutputParser::emit_text(std::vector<OutputEvent>& out, std::string text) {
  if (text.empty()) return;
  const auto kind =
      state_ == State::kReasoning ? OutputEvent::Kind::kReasoning : OutputEvent::Kind::kContent;
  if (!out.empty() && out.back().kind == kind)
    out.back().text += text;
  else
    out.push_back({.kind = kind, .text = std::move(text)});
}

bool OutputParser::close_block(std::vector<OutputEvent>& out, const std::string& body,
                               bool complete) {
  const bool qwen = state_ == State::kQwenCall;
  std::vector<ToolCall> calls;
  if (qwen) {
    if (auto call = parse_qwen_tool_call(body)) calls.push_back(std::move(*call));
  } else if (auto parsed = parse_deepseek_tool_calls(body)) {
    calls = std::move(*parsed);
  }
  state_ = State::kContent;
  if (calls.empty()) {
    // Not a call after all: give the text back exactly as written.
    std::string raw = std::string(qwen ? kQwenOpen : kDsOpen) + body;
    if (complete) raw += qwen ? kQwenClose : kDsClose;
    emit_text(out, std::move(raw));
    return false;
  }
  for (ToolCall& c : calls)
    out.push_back({.kind = OutputEvent::Kind::kToolCall, .call = std::move(c)});
  return true;
}

void OutputParser::step(std::vector<OutputEvent>& out, bool at_end) {
  for (;;) {
    if (state_ == State::kQwenCall || state_ == State::kDeepSeekCalls) {
      std::string_view close = state_ == State::kQwenCall ? kQwenClose : kDsClose;
      size_t at = buf_.find(close);
      if (at == std::string::npos) {
        if (at_end) {
          close_block(out, buf_, false);
          buf_.clear();
        }
        return;
      }
      skip_ws_ = close_block(out, buf_.substr(0, at), true);
      buf_.erase(0, at + close.size());
      continue;
    }
    if (skip_ws_) {
      size_t n = 0;
      while (n < buf_.size() && is_space(buf_[n])) ++n;
      buf_.erase(0, n);
      if (buf_.empty()) return;
      skip_ws_ = false;
    }
    // Content looks for the three openers, reasoning for its end.
    struct Marker {
      std::string_view text;
      State next;
    };
    const bool reasoning = state_ == State::kReasoning;
    const Marker content_markers[] = {{kThinkOpen, State::kReasoning},
                                      {kQwenOpen, State::kQwenCall},
                                      {kDsOpen, State::kDeepSeekCalls}};
    const Marker reasoning_markers[] = {{kThinkClose, State::kContent}};
    std::span<const Marker> markers =
        reasoning ? std::span<const Marker>(reasoning_markers)
                  : std::span<const Marker>(content_markers).first(parse_tools_ ? 3 : 1);
    size_t best = std::string::npos;
    const Marker* hit = nullptr;
    for (const Marker& m : markers) {
      size_t at = buf_.find(m.text);
      if (at < best) best = at, hit = &m;
    }
    if (hit) {
      emit_text(out, buf_.substr(0, best));
      buf_.erase(0, best + hit->text.size());
      state_ = hit->next;
      skip_ws_ = hit->next == State::kReasoning || hit->next == State::kContent;
      continue;
    }
    size_t hold = 0;
    if (!at_end)
      hold = reasoning      ? partial_marker_suffix(buf_, {kThinkClose})
             : parse_tools_ ? partial_marker_suffix(buf_, {kThinkOpen, kQwenOpen, kDsOpen})
                            : partial_marker_suffix(buf_, {kThinkOpen});
    emit_text(out, buf_.substr(0, buf_.size() - hold));
    buf_.erase(0, buf_.size() - hold);
    return;
  }
}

}  // namespace ts::server
