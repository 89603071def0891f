// Splits a model's reply, as it streams in, into reasoning text (between <think> and
// </think>), plain content, and tool calls in the model's own syntax:
//   Qwen3 (Hermes style):  <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>
//   DeepSeek-V3:           <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f
//                          ```json\n{...}\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
//   DeepSeek-V3.1:         ...<｜tool▁call▁begin｜>f<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...
// Text that may be the start of a marker is held back until it is decided, so the events
// of a stream concatenate to the same result as one feed() of the whole reply. A tool call
// whose body does not parse (bad JSON, no name) comes back as content, unchanged: nothing
// the model wrote is lost. Whitespace right after <think>, </think> and a tool call block is
// dropped (templates put newlines there).
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace ts::server {

struct ToolCall {
  std::string name;
  std::string arguments;  // JSON text of an object
};

struct OutputEvent {
  enum class Kind { kReasoning, kContent, kToolCall } kind;
  std::string text;  // kReasoning, kContent
  ToolCall call;     // kToolCall
};

class OutputParser {
 public:
  struct Options {
    // The prompt already opened a <think> block (the template ends the generation prompt
    // with "<think>\n"), so the reply begins inside it.
    bool starts_in_reasoning = false;
    // Look for tool calls (the request declared tools); else tool syntax is plain content.
    bool parse_tools = true;
  };
  explicit OutputParser(Options options);
  std::vector<OutputEvent> feed(std::string_view text);
  // End of the reply: held-back text and an unterminated block come out.
  std::vector<OutputEvent> finish();

 private:
  enum class State { kContent, kReasoning, kQwenCall, kDeepSeekCalls };
  void step(std::vector<OutputEvent>& out, bool at_end);
  void emit_text(std::vector<OutputEvent>& out, std::string text);
  // Ends a tool-call block; false when it held no valid call (its text became content).
  bool close_block(std::vector<OutputEvent>& out, const std::string& body, bool complete);

  State state_;
  bool parse_tools_;
  std::string buf_;       // text not yet turned into events
  bool skip_ws_ = false;  // drop leading whitespace of the next text
};

// Parsers for one tool-call block's inner text; nullopt when it is not a valid call.
std::optional<ToolCall> parse_qwen_tool_call(std::string_view body);
std::optional<std::vector<ToolCall>> parse_deepseek_tool_calls(std::string_view body);

// Whether a rendered prompt ends inside an open <think> block.
bool prompt_opens_reasoning(std::string_view prompt);

}  // namespace ts::server
