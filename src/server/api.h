// The OpenAI and Anthropic wire formats: request bodies -> a validated GenRequest (errors
// name the field, as the APIs do), and a finished or streaming generation -> response JSON
// and SSE frames. No I/O here; server.cpp moves the bytes.
//
// Request rules shared by the three generating routes:
//   - "model" must be the served id when given (404 model_not_found otherwise); absent is
//     accepted (only Anthropic's SDK insists on it).
//   - null counts as absent for optional fields (clients send explicit nulls).
//   - sampling fields are range-checked: temperature [0, 2], top_p [0, 1], top_k >= 0,
//     min_p [0, 1], presence/frequency_penalty [-2, 2], seed any integer.
//   - max_tokens (chat: also max_completion_tokens) >= 1; absent = the rest of the context,
//     except on /v1/messages where Anthropic requires it.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "runtime/generate.h"
#include "runtime/sampler.h"
#include "server/output_parser.h"

namespace ts::tokenizer {
class ChatTemplate;
}
namespace ts::runtime {
struct JsonSchema;
}

namespace ts::server {

using json = nlohmann::ordered_json;

struct ApiError {
  int status = 400;
  std::string message;
  std::string param;  // the request field at fault; empty -> null
  std::string code;   // e.g. "model_not_found"; empty -> null
  std::string type = "invalid_request_error";
};

template <class T>
using Parsed = std::variant<ApiError, T>;

// The wire format of a generating route. Ollama's two (/api/chat, /api/generate) are read as
// OpenAI chat / completion bodies (ollama_to_openai) and answered in Ollama's objects.
enum class Api { kChat, kCompletion, kMessages, kOllamaChat, kOllamaGenerate };

// A generating request, validated, before tokenization.
struct GenRequest {
  Api api = Api::kChat;
  bool stream = false;
  bool include_usage = false;   // OpenAI stream_options.include_usage
  std::string prompt_text;      // the rendered chat template, or a completion prompt
  std::vector<int> prompt_ids;  // a completion prompt given as token ids
  bool add_special = false;     // completion text prompts get BOS, as `run --prompt` does
  bool parse_tools = false;     // the request declared tools: look for tool calls
  runtime::SamplerOptions sampling;
  bool seed_given = false;
  std::optional<int64_t> max_tokens;
  std::vector<std::string> stops;
  // Log-probabilities of the generated tokens: -1 none, else how many alternatives per token
  // (chat: logprobs true + top_logprobs 0-20; completions: logprobs 0-5); streamed with the
  // chunks of their tokens.
  int logprobs = -1;
  // Completions: the prompt comes back before the completion (with logprobs, its tokens' too;
  // the first has none). max_tokens may then be 0: score the prompt only. Not with stream.
  bool echo = false;
  // response_format {"type": "json_object"}: the reply is one JSON object (constrained
  // decoding, runtime/json_constraint.h).
  bool json_object = false;
  // response_format json_schema: the object is also one the schema accepts.
  std::shared_ptr<const runtime::JsonSchema> schema;
  // OpenAI's n: choices generated one after another from the same prompt (choice i samples
  // with seed + i; without a seed, from a fresh random one); not with stream.
  int n = 1;
};

Parsed<GenRequest> parse_chat_request(const json& body, const tokenizer::ChatTemplate& tmpl,
                                      const std::string& model_id);
Parsed<GenRequest> parse_completion_request(const json& body, const std::string& model_id);
Parsed<GenRequest> parse_messages_request(const json& body, const tokenizer::ChatTemplate& tmpl,
                                          const std::string& model_id);

// Error bodies: {"error": {message, type, param, code}} and Anthropic's
// {"type": "error", "error": {type, message}}.
json openai_error_body(const ApiError& e);
json anthropic_error_body(const ApiError& e);

// Compact JSON; invalid UTF-8 (which should not occur: the stream decoder emits whole
// characters) becomes U+FFFD instead of an exception.
std::string dump_json(const json& j);

// "chatcmpl-" + 24 random hex digits, and the like.
std::string make_id(const std::string& prefix);

// What the reply parsed into, for non-streaming responses.
struct ReplyParts {
  std::string reasoning, content;
  std::vector<ToolCall> calls;
};
ReplyParts split_reply(const std::string& text, bool parse_tools, bool starts_in_reasoning);

struct ResponseInfo {
  std::string id, model;
  int64_t created = 0;  // unix seconds
};

// One generated token's log-probability under the model (log-softmax of its logits, before
// temperature and the other sampling filters) and the most likely alternatives, each with its
// bytes as a piece of text (Tokenizer::token_bytes: may be part of a UTF-8 character; the JSON
// "token" strings show such a part as U+FFFD, "bytes" has it as it is).
struct TokenLogprob {
  std::string text;
  float logprob = 0;
  std::vector<std::pair<std::string, float>> top;
  bool first = false;  // the prompt's first token (echo): nothing before it, no logprob
};
// OpenAI's chat form {"content": [{token, logprob, bytes, top_logprobs}], "refusal": null}
// and the completions form {tokens, token_logprobs, top_logprobs, text_offset}.
json chat_logprobs_json(const std::vector<TokenLogprob>& lp);
// (text_offset counts from `offset`: the bytes of the completion before these tokens.)
json completion_logprobs_json(const std::vector<TokenLogprob>& lp, size_t offset = 0);

json chat_response(const ResponseInfo& info, const runtime::Generation& gen,
                   const ReplyParts& reply, json logprobs = nullptr);
json completion_response(const ResponseInfo& info, const runtime::Generation& gen,
                         json logprobs = nullptr);
json messages_response(const ResponseInfo& info, const runtime::Generation& gen,
                       const ReplyParts& reply, const std::vector<std::string>& stops);
// n choices of one request as one response: the first response with every response's (single)
// choice in order, index i, and usage summed (the prompt counted once).
json merge_choices(std::vector<json> responses);

// Turns a stream of reply text into SSE frames ("data: {...}\n\n", Anthropic frames with an
// "event:" line). begin() once, then text() per piece, then end() with the result.
class SseWriter {
 public:
  virtual ~SseWriter() = default;
  virtual std::string begin(int64_t prompt_tokens) = 0;
  // lp: the log-probabilities of the tokens since the last call (logprobs requested).
  virtual std::string text(std::string_view piece, const std::vector<TokenLogprob>& lp = {}) = 0;
  virtual std::string end(const runtime::Generation& gen) = 0;
};

struct StreamSpec {
  ResponseInfo info;
  bool include_usage = false;
  bool parse_tools = false;
  bool starts_in_reasoning = false;
  std::vector<std::string> stops;  // Anthropic reports which one matched
};
// The writer of a route's stream (Ollama's: make_ollama_writer's NDJSON lines).
std::unique_ptr<SseWriter> make_sse_writer(Api api, const StreamSpec& spec);

// Ollama: a /api/chat or /api/generate body as the OpenAI chat body (generate: its prompt as a
// user turn after `system`) or, with raw: true, the completion body. stream defaults to true;
// options (temperature, top_p, top_k, min_p, seed, presence / frequency_penalty, num_predict,
// stop), format "json" and a format schema map to their OpenAI fields (JSON mode,
// json_schema); "NAME:latest" names NAME. Images, template, suffix and context are refused.
Parsed<json> ollama_to_openai(const json& body, Api api, const std::string& model_id);
// NDJSON lines ({"model", "created_at", "message": {...} | "response", "done": false}, then a
// last object with done_reason, token counts and nanosecond durations); reasoning goes to
// "thinking", tool calls to message.tool_calls with object arguments.
std::unique_ptr<SseWriter> make_ollama_writer(Api api, const StreamSpec& spec);
json ollama_response(Api api, const ResponseInfo& info, const runtime::Generation& gen,
                     const ReplyParts& reply);
json ollama_error_body(const ApiError& e);  // {"error": message}

}  // namespace ts::server
