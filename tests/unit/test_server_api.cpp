// The server's wire formats: request validation (each error names its field), conversion of
// OpenAI and Anthropic conversations for the chat template, responses and SSE sequences.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>

#include "server/api.h"
#include "server/metrics.h"
#include "tokenizer/chat_template.h"

namespace {

using ts::server::ApiError;
using ts::server::GenRequest;
using ts::server::json;

// Prints what the template saw, so tests can check the conversion.
const ts::tokenizer::ChatTemplate& echo_template() {
  static auto t = ts::tokenizer::ChatTemplate::from_source(
      "{% for m in messages %}[{{ m.role }}|{{ m.content }}"
      "{% if m.tool_calls %}|calls={{ m.tool_calls | tojson }}{% endif %}"
      "{% if m.tool_call_id %}|id={{ m.tool_call_id }}{% endif %}]{% endfor %}"
      "{% if tools %}tools={{ tools | tojson }}{% endif %}"
      "{% if enable_thinking is defined %}think={{ enable_thinking }}{% endif %}",
      {});
  return t.value();
}

ApiError chat_error(const json& body) {
  auto r = ts::server::parse_chat_request(body, echo_template(), "tiny");
  EXPECT_TRUE(std::holds_alternative<ApiError>(r)) << body.dump();
  return std::holds_alternative<ApiError>(r) ? std::get<ApiError>(r) : ApiError{};
}

GenRequest chat_ok(const json& body) {
  auto r = ts::server::parse_chat_request(body, echo_template(), "tiny");
  if (auto* e = std::get_if<ApiError>(&r)) ADD_FAILURE() << e->message;
  return std::holds_alternative<GenRequest>(r) ? std::get<GenRequest>(r) : GenRequest{};
}

const json kUser = json::array({{{"role", "user"}, {"content", "hi"}}});

TEST(ServerApi, ChatErrorsNameTheField) {
  struct Case {
    json body;
    int status;
    std::string param;
  };
  const std::vector<Case> cases = {
      {json::array(), 400, ""},
      {{{"model", "tiny"}}, 400, "messages"},
      {{{"messages", json::array()}}, 400, "messages"},
      {{{"messages", "hi"}}, 400, "messages"},
      {{{"messages", kUser}, {"model", "gpt-4o"}}, 404, "model"},
      {{{"messages", kUser}, {"temperature", "hot"}}, 400, "temperature"},
      {{{"messages", kUser}, {"temperature", 3}}, 400, "temperature"},
      {{{"messages", kUser}, {"top_p", 1.5}}, 400, "top_p"},
      {{{"messages", kUser}, {"top_k", 2.5}}, 400, "top_k"},
      {{{"messages", kUser}, {"max_tokens", 0}}, 400, "max_tokens"},
      {{{"messages", kUser}, {"max_tokens", -3}}, 400, "max_tokens"},
      {{{"messages", kUser}, {"max_completion_tokens", 0}}, 400, "max_completion_tokens"},
      {{{"messages", kUser}, {"stop", json::array({"a", 1})}}, 400, "stop"},
      {{{"messages", kUser}, {"stop", ""}}, 400, "stop"},
      {{{"messages", kUser}, {"stream", "yes"}}, 400, "stream"},
      {{{"messages", kUser}, {"n", 0}}, 400, "n"},
      {{{"messages", kUser}, {"n", 129}}, 400, "n"},
      {{{"messages", kUser}, {"n", 2}, {"stream", true}}, 400, "n"},
      {{{"messages", kUser}, {"presence_penalty", 5}}, 400, "presence_penalty"},
      {{{"messages", kUser}, {"logit_bias", json::array({1})}}, 400, "logit_bias"},
      {{{"messages", kUser}, {"logit_bias", {{"abc", 1}}}}, 400, "logit_bias"},
      {{{"messages", kUser}, {"logit_bias", {{"-3", 1}}}}, 400, "logit_bias"},
      {{{"messages", kUser}, {"logit_bias", {{"7", 101}}}}, 400, "logit_bias"},
      {{{"messages", kUser}, {"logit_bias", {{"7", "up"}}}}, 400, "logit_bias"},
      {{{"messages", kUser}, {"response_format", "json"}}, 400, "response_format"},
      {{{"messages", kUser}, {"response_format", {{"type", "xml"}}}}, 400, "response_format"},
      {{{"messages", kUser}, {"response_format", {{"type", "json_schema"}}}},
       400,
       "response_format"},
      {{{"messages", json::array({{{"content", "x"}}})}}, 400, "messages[0].role"},
      {{{"messages", json::array({{{"role", "robot"}, {"content", "x"}}})}},
       400,
       "messages[0].role"},
      {{{"messages", json::array({{{"role", "user"}}})}}, 400, "messages[0].content"},
      {{{"messages",
         json::array({{{"role", "user"}, {"content", json::array({{{"type", "image_url"}}})}}})}},
       400,
       "messages[0].content[0]"},
      {{{"messages", kUser}, {"tools", json::array({{{"type", "function"}}})}}, 400, "tools[0]"},
      // A field of the wrong type is a 400 too (nlohmann's value() threw: a 500).
      {{{"messages", json::array({{{"role", "user"},
                                   {"content", json::array({{{"type", 7}, {"text", "x"}}})}}})}},
       400,
       "messages[0].content[0]"},
      {{{"messages", kUser},
        {"tools", json::array({{{"type", true}, {"function", {{"name", "f"}}}}})}},
       400,
       "tools[0]"},
  };
  for (const Case& c : cases) {
    ApiError e = chat_error(c.body);
    EXPECT_EQ(e.status, c.status) << c.body.dump();
    EXPECT_EQ(e.param, c.param) << c.body.dump();
    if (!c.param.empty()) {
      EXPECT_NE(e.message.find(c.param), std::string::npos) << e.message;
    }
  }
  EXPECT_EQ(chat_error({{"messages", kUser}, {"model", "gpt-4o"}}).code, "model_not_found");
}

TEST(ServerApi, ChatFieldsAndRendering) {
  GenRequest r = chat_ok(
      {{"model", "tiny"},
       {"messages", json::array({{{"role", "developer"}, {"content", "be brief"}},
                                 {{"role", "user"},
                                  {"content", json::array({{{"type", "text"}, {"text", "a"}},
                                                           {{"type", "text"}, {"text", "b"}}})}}})},
       {"temperature", 0.7},
       {"top_p", 0.9},
       {"top_k", 40},
       {"min_p", 0.1},
       {"seed", 42},
       {"presence_penalty", 0.5},
       {"frequency_penalty", -0.25},
       {"logit_bias", {{"5", -100}, {"17", 2.5}}},
       {"response_format", {{"type", "json_object"}}},
       {"max_completion_tokens", 17},
       {"stop", "END"},
       {"stream", true},
       {"stream_options", {{"include_usage", true}}},
       {"chat_template_kwargs", {{"enable_thinking", false}}}});
  EXPECT_EQ(r.prompt_text, "[system|be brief][user|a\nb]think=False");
  EXPECT_FLOAT_EQ(r.sampling.temperature, 0.7f);
  EXPECT_FLOAT_EQ(r.sampling.top_p, 0.9f);
  EXPECT_EQ(r.sampling.top_k, 40);
  EXPECT_FLOAT_EQ(r.sampling.min_p, 0.1f);
  EXPECT_EQ(r.sampling.seed, 42u);
  EXPECT_TRUE(r.seed_given);
  EXPECT_FLOAT_EQ(r.sampling.presence_penalty, 0.5f);
  EXPECT_FLOAT_EQ(r.sampling.frequency_penalty, -0.25f);
  std::vector<std::pair<int, float>> bias = r.sampling.logit_bias;
  std::sort(bias.begin(), bias.end());
  EXPECT_EQ(bias, (std::vector<std::pair<int, float>>{{5, -100.0f}, {17, 2.5f}}));
  EXPECT_TRUE(r.json_object);
  EXPECT_EQ(r.n, 1);
  EXPECT_EQ(chat_ok({{"messages", kUser}, {"n", 3}}).n, 3);
  EXPECT_FALSE(chat_ok({{"messages", kUser}, {"response_format", {{"type", "text"}}}}).json_object);
  EXPECT_EQ(r.max_tokens, 17);
  EXPECT_EQ(r.stops, std::vector<std::string>{"END"});
  EXPECT_TRUE(r.stream && r.include_usage);
  EXPECT_FALSE(r.parse_tools);

  // Tools reach the template and switch on tool-call parsing; an assistant turn with
  // tool_calls and null content, then the tool's answer.
  const json tools = json::array({{{"type", "function"}, {"function", {{"name", "get_weather"}}}}});
  r = chat_ok(
      {{"messages",
        json::array(
            {{{"role", "user"}, {"content", "w?"}},
             {{"role", "assistant"},
              {"content", nullptr},
              {"tool_calls",
               json::array({{{"id", "c1"},
                             {"type", "function"},
                             {"function", {{"name", "get_weather"}, {"arguments", "{}"}}}}})}},
             {{"role", "tool"}, {"tool_call_id", "c1"}, {"content", "sunny"}}})},
       {"tools", tools}});
  EXPECT_TRUE(r.parse_tools);
  EXPECT_NE(r.prompt_text.find("[assistant|None|calls=[{\"id\": \"c1\""), std::string::npos)
      << r.prompt_text;
  EXPECT_NE(r.prompt_text.find("[tool|sunny|id=c1]"), std::string::npos) << r.prompt_text;
  EXPECT_NE(r.prompt_text.find("tools=[{\"type\": \"function\""), std::string::npos)
      << r.prompt_text;
  // tool_choice "none" keeps them out.
  r = chat_ok({{"messages", kUser}, {"tools", tools}, {"tool_choice", "none"}});
  EXPECT_FALSE(r.parse_tools);
  EXPECT_EQ(r.prompt_text.find("tools="), std::string::npos);
  // Explicit nulls are absent fields.
  r = chat_ok(
      {{"messages", kUser}, {"temperature", nullptr}, {"max_tokens", nullptr}, {"stop", nullptr}});
  EXPECT_EQ(r.sampling.temperature, 0.0f);
  EXPECT_FALSE(r.max_tokens.has_value());
}

TEST(ServerApi, TemplateErrorIsA400OnMessages) {
  auto t =
      ts::tokenizer::ChatTemplate::from_source("{{ raise_exception('roles must alternate') }}", {});
  ASSERT_TRUE(t.ok());
  auto r = ts::server::parse_chat_request({{"messages", kUser}}, t.value(), "tiny");
  ASSERT_TRUE(std::holds_alternative<ApiError>(r));
  EXPECT_EQ(std::get<ApiError>(r).param, "messages");
  EXPECT_NE(std::get<ApiError>(r).message.find("roles must alternate"), std::string::npos);
}

TEST(ServerApi, CompletionPrompts) {
  auto ok = [](const json& body) {
    auto r = ts::server::parse_completion_request(body, "tiny");
    EXPECT_TRUE(std::holds_alternative<GenRequest>(r)) << body.dump();
    return std::holds_alternative<GenRequest>(r) ? std::get<GenRequest>(r) : GenRequest{};
  };
  EXPECT_EQ(ok({{"prompt", "abc"}}).prompt_text, "abc");
  EXPECT_TRUE(ok({{"prompt", "abc"}}).add_special);
  EXPECT_EQ(ok({{"prompt", json::array({"xyz"})}}).prompt_text, "xyz");
  EXPECT_EQ(ok({{"prompt", json::array({5, 6, 7})}}).prompt_ids, (std::vector<int>{5, 6, 7}));
  // echo: the prompt comes back; max_tokens 0 only with it (score the prompt).
  EXPECT_TRUE(ok({{"prompt", "x"}, {"echo", true}}).echo);
  EXPECT_FALSE(ok({{"prompt", "x"}}).echo);
  EXPECT_EQ(ok({{"prompt", "x"}, {"echo", true}, {"max_tokens", 0}}).max_tokens, 0);
  EXPECT_EQ(ok({{"prompt", "x"}, {"echo", true}, {"max_tokens", 3}}).max_tokens, 3);
  for (const json& bad :
       {json{{"model", "tiny"}}, json{{"prompt", 3}}, json{{"prompt", json::array({"a", "b"})}},
        json{{"prompt", json::array({1, -2})}}, json{{"prompt", "x"}, {"echo", true}, {"stream", true}},
        json{{"prompt", "x"}, {"max_tokens", 0}}, json{{"prompt", "x"}, {"echo", 1}}}) {
    auto r = ts::server::parse_completion_request(bad, "tiny");
    ASSERT_TRUE(std::holds_alternative<ApiError>(r)) << bad.dump();
    EXPECT_EQ(std::get<ApiError>(r).status, 400);
    EXPECT_FALSE(std::get<ApiError>(r).param.empty());
  }
}

// logprobs: chat's boolean + top_logprobs (0-20), completions' integer (0-5); not with
// stream; the response forms with their bytes and offsets.
TEST(ServerApi, Logprobs) {
  EXPECT_EQ(chat_ok({{"messages", kUser}}).logprobs, -1);
  EXPECT_EQ(chat_ok({{"messages", kUser}, {"logprobs", false}}).logprobs, -1);
  EXPECT_EQ(chat_ok({{"messages", kUser}, {"logprobs", true}}).logprobs, 0);
  EXPECT_EQ(chat_ok({{"messages", kUser}, {"logprobs", true}, {"top_logprobs", 20}}).logprobs, 20);
  EXPECT_EQ(chat_error({{"messages", kUser}, {"top_logprobs", 2}}).param, "top_logprobs");
  EXPECT_EQ(chat_error({{"messages", kUser}, {"logprobs", true}, {"top_logprobs", 21}}).param,
            "top_logprobs");
  EXPECT_EQ(chat_ok({{"messages", kUser}, {"logprobs", true}, {"stream", true}}).logprobs, 0);
  EXPECT_EQ(chat_error({{"messages", kUser}, {"logprobs", 1}}).param, "logprobs");
  const auto completion = [](const json& body) {
    return ts::server::parse_completion_request(body, "tiny");
  };
  auto r = completion({{"prompt", "x"}, {"logprobs", 5}});
  ASSERT_TRUE(std::holds_alternative<GenRequest>(r));
  EXPECT_EQ(std::get<GenRequest>(r).logprobs, 5);
  for (const json& bad : {json{{"prompt", "x"}, {"logprobs", 6}}, json{{"prompt", "x"}, {"logprobs", true}}}) {
    auto e = completion(bad);
    ASSERT_TRUE(std::holds_alternative<ApiError>(e)) << bad.dump();
    EXPECT_EQ(std::get<ApiError>(e).param, "logprobs") << bad.dump();
  }

  ts::server::TokenLogprob first{.text = "<s>", .first = true};
  const json with_first = ts::server::completion_logprobs_json({first, {"a", -1.0f, {}}});
  EXPECT_TRUE(with_first["token_logprobs"][0].is_null());
  EXPECT_TRUE(with_first["top_logprobs"][0].is_null());
  EXPECT_EQ(with_first["token_logprobs"][1], -1.0f);
  EXPECT_EQ(with_first["text_offset"], json::array({0, 3}));
  const std::vector<ts::server::TokenLogprob> lp = {
      {"Hé", -0.25f, {{"Hé", -0.25f}, {"Ho", -1.5f}}},
      {"!", -0.5f, {{"!", -0.5f}, {"!", -3.0f}}}};
  // Streamed: the chat writer sends the tokens' entries in a chunk after their text's; the
  // completion writer with the text, offsets running on across chunks.
  {
    auto w = ts::server::make_sse_writer(ts::server::Api::kChat, {.info = {.id = "c", .model = "m"}});
    std::string sse = w->begin(1);  // (one call per statement: the order matters)
    sse += w->text("Hé", {lp[0]});
    sse += w->text("!", {lp[1]});
    EXPECT_NE(sse.find(R"("logprobs":{"content":[{"token":"Hé","logprob":-0.25)"), std::string::npos) << sse;
    EXPECT_LT(sse.find(R"("content":"Hé")"), sse.find(R"("token":"Hé")")) << sse;
    auto c = ts::server::make_sse_writer(ts::server::Api::kCompletion, {.info = {.id = "c", .model = "m"}});
    std::string csse = c->text("Hé", {lp[0]});
    csse += c->text("!", {lp[1]});
    EXPECT_NE(csse.find(R"("text_offset":[0])"), std::string::npos) << csse;
    EXPECT_NE(csse.find(R"("text_offset":[3])"), std::string::npos) << csse;
  }
  // A token that is the first two bytes of "€" (E2 82 AC): U+FFFD as text, its bytes as they are.
  const json part = ts::server::chat_logprobs_json({{"\xE2\x82", -1.0f, {{"\xE2\x82", -1.0f}}}});
  EXPECT_EQ(part["content"][0]["token"], "\xEF\xBF\xBD");
  EXPECT_EQ(part["content"][0]["bytes"], json::array({0xE2, 0x82}));
  EXPECT_EQ(part["content"][0]["top_logprobs"][0]["bytes"], json::array({0xE2, 0x82}));
  const json chat = ts::server::chat_logprobs_json(lp);
  ASSERT_EQ(chat["content"].size(), 2u);
  EXPECT_EQ(chat["content"][0]["token"], "Hé");
  EXPECT_EQ(chat["content"][0]["logprob"], -0.25f);
  EXPECT_EQ(chat["content"][0]["bytes"], json::array({72, 0xC3, 0xA9}));
  EXPECT_EQ(chat["content"][0]["top_logprobs"][1]["token"], "Ho");
  EXPECT_EQ(chat["content"][0]["top_logprobs"][1]["bytes"], json::array({72, 111}));
  EXPECT_TRUE(chat["refusal"].is_null());
  const json comp = ts::server::completion_logprobs_json(lp);
  EXPECT_EQ(comp["tokens"], json::array({"Hé", "!"}));
  EXPECT_EQ(comp["token_logprobs"], json::array({-0.25f, -0.5f}));
  EXPECT_EQ(comp["text_offset"], json::array({0, 3}));  // bytes: "Hé" is 3
  EXPECT_EQ(comp["top_logprobs"][0]["Ho"], -1.5f);
  EXPECT_EQ(comp["top_logprobs"][1].size(), 1u);  // two ids decoding alike: the likelier
  EXPECT_EQ(comp["top_logprobs"][1]["!"], -0.5f);
}

TEST(ServerApi, AnthropicConversion) {
  const json body = {
      {"model", "tiny"},
      {"max_tokens", 30},
      {"system", json::array({{{"type", "text"}, {"text", "sys"}}})},
      {"stop_sequences", json::array({"###"})},
      {"temperature", 0.5},
      {"tools", json::array({{{"name", "get_weather"},
                              {"description", "d"},
                              {"input_schema", {{"type", "object"}}}}})},
      {"messages", json::array({{{"role", "user"}, {"content", "weather?"}},
                                {{"role", "assistant"},
                                 {"content", json::array({{{"type", "text"}, {"text", "calling"}},
                                                          {{"type", "tool_use"},
                                                           {"id", "tu1"},
                                                           {"name", "get_weather"},
                                                           {"input", {{"city", "Oslo"}}}}})}},
                                {{"role", "user"},
                                 {"content", json::array({{{"type", "tool_result"},
                                                           {"tool_use_id", "tu1"},
                                                           {"content", "cold"}}})}}})}};
  auto r = ts::server::parse_messages_request(body, echo_template(), "tiny");
  ASSERT_TRUE(std::holds_alternative<GenRequest>(r)) << std::get<ApiError>(r).message;
  const GenRequest& g = std::get<GenRequest>(r);
  EXPECT_EQ(g.max_tokens, 30);
  EXPECT_EQ(g.stops, std::vector<std::string>{"###"});
  EXPECT_TRUE(g.parse_tools);
  EXPECT_NE(g.prompt_text.find("[system|sys][user|weather?][assistant|calling|calls="),
            std::string::npos)
      << g.prompt_text;
  EXPECT_NE(g.prompt_text.find("\"arguments\": \"{\\\"city\\\":\\\"Oslo\\\"}\""), std::string::npos)
      << g.prompt_text;
  EXPECT_NE(g.prompt_text.find("[tool|cold|id=tu1]"), std::string::npos) << g.prompt_text;
  EXPECT_NE(g.prompt_text.find("\"parameters\": {\"type\": \"object\"}"), std::string::npos)
      << g.prompt_text;

  // max_tokens is required on this route; temperature tops out at 1.
  for (auto [patch, param] :
       std::vector<std::pair<json, std::string>>{{{{"max_tokens", nullptr}}, "max_tokens"},
                                                 {{{"temperature", 1.5}}, "temperature"},
                                                 {{{"messages", json::array()}}, "messages"},
                                                 {{{"stop_sequences", "x"}}, "stop_sequences"}}) {
    json b = body;
    b.update(patch);
    if (patch.contains("max_tokens")) b.erase("max_tokens");
    auto e = ts::server::parse_messages_request(b, echo_template(), "tiny");
    ASSERT_TRUE(std::holds_alternative<ApiError>(e)) << b.dump();
    EXPECT_EQ(std::get<ApiError>(e).param, param);
  }
  // Mistyped block fields are 400s naming the block, never a 500 (they threw before).
  const std::vector<std::pair<json, std::string>> blocks = {
      {{{"role", "user"}, {"content", json::array({{{"type", true}, {"text", "hi"}}})}},
       "messages[0].content[0]"},
      {{{"role", "assistant"}, {"content", json::array({{{"type", "thinking"}, {"thinking", 3}}})}},
       "messages[0].content[0]"},
      {{{"role", "assistant"},
        {"content",
         json::array(
             {{{"type", "tool_use"}, {"id", 5}, {"name", "f"}, {"input", json::object()}}})}},
       "messages[0].content[0]"},
      {{{"role", "user"},
        {"content", json::array({{{"type", "tool_result"}, {"tool_use_id", json::array()}}})}},
       "messages[0].content[0]"},
  };
  for (const auto& [message, param] : blocks) {
    json b = {{"max_tokens", 4}, {"messages", json::array({message})}};
    auto e = ts::server::parse_messages_request(b, echo_template(), "tiny");
    ASSERT_TRUE(std::holds_alternative<ApiError>(e)) << b.dump();
    EXPECT_EQ(std::get<ApiError>(e).status, 400) << b.dump();
    EXPECT_EQ(std::get<ApiError>(e).param, param) << b.dump();
  }
  json b = body;
  b["tool_choice"] = {{"type", 1}};
  EXPECT_TRUE(std::holds_alternative<GenRequest>(
      ts::server::parse_messages_request(b, echo_template(), "tiny")));
}

TEST(ServerApi, ErrorBodies) {
  ApiError e{
      .status = 404, .message = "no such model", .param = "model", .code = "model_not_found"};
  EXPECT_EQ(
      ts::server::openai_error_body(e),
      json::parse(
          R"({"error":{"message":"no such model","type":"invalid_request_error","param":"model","code":"model_not_found"}})"));
  EXPECT_EQ(
      ts::server::anthropic_error_body(e),
      json::parse(
          R"({"type":"error","error":{"type":"not_found_error","message":"no such model"}})"));
}

ts::runtime::Generation gen(ts::runtime::StopReason why, int64_t generated) {
  return {.prompt_tokens = 9, .generated = generated, .stop_reason = why};
}

// "event: X" names, in order, of an Anthropic stream.
std::vector<std::string> event_names(const std::string& sse) {
  std::vector<std::string> names;
  for (size_t at = 0; (at = sse.find("event: ", at)) != std::string::npos; at += 7)
    names.push_back(sse.substr(at + 7, sse.find('\n', at) - at - 7));
  return names;
}

TEST(ServerApi, AnthropicStreamSequence) {
  auto w = ts::server::make_sse_writer(
      ts::server::Api::kMessages, {.info = {.id = "msg_1", .model = "tiny"}, .parse_tools = true});
  std::string sse = w->begin(9);
  for (const char* piece : {"<thi", "nk>why</think>Hi", " there<tool_call>{\"name\": \"f\", ",
                            "\"arguments\": {\"x\": 1}}</tool_call>"})
    sse += w->text(piece);
  sse += w->end(gen(ts::runtime::StopReason::kEos, 12));
  const std::vector<std::string> want = {
      "message_start",       "ping",
      "content_block_start", "content_block_delta",
      "content_block_delta", "content_block_stop",  // thinking (+ signature)
      "content_block_start", "content_block_delta",
      "content_block_delta", "content_block_stop",  // text
      "content_block_start", "content_block_delta",
      "content_block_stop",  // tool_use
      "message_delta",       "message_stop"};
  EXPECT_EQ(event_names(sse), want) << sse;
  EXPECT_NE(sse.find(R"("stop_reason":"tool_use")"), std::string::npos);
  EXPECT_NE(sse.find(R"("usage":{"output_tokens":12})"), std::string::npos);
  EXPECT_NE(sse.find(R"("partial_json":"{\"x\":1}")"), std::string::npos);
  EXPECT_NE(sse.find(R"("input_tokens":9)"), std::string::npos);
}

TEST(ServerApi, OpenAiChatStream) {
  auto w = ts::server::make_sse_writer(
      ts::server::Api::kChat,
      {.info = {.id = "c", .model = "tiny"}, .include_usage = true, .parse_tools = true});
  std::string sse = w->begin(9);  // one statement each: the order of + operands is unspecified
  sse += w->text("<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>");
  sse += w->end(gen(ts::runtime::StopReason::kEos, 5));
  std::vector<json> chunks;
  size_t at = 0;
  for (size_t next; (next = sse.find("\n\n", at)) != std::string::npos; at = next + 2) {
    std::string frame = sse.substr(at, next - at);
    ASSERT_EQ(frame.rfind("data: ", 0), 0u) << frame;
    if (frame == "data: [DONE]") {
      EXPECT_EQ(next + 2, sse.size());  // last
      break;
    }
    chunks.push_back(json::parse(frame.substr(6)));
  }
  ASSERT_EQ(chunks.size(), 4u) << sse;
  EXPECT_EQ(chunks[0]["choices"][0]["delta"]["role"], "assistant");
  EXPECT_EQ(chunks[1]["choices"][0]["delta"]["tool_calls"][0]["function"]["name"], "f");
  EXPECT_EQ(chunks[1]["choices"][0]["delta"]["tool_calls"][0]["index"], 0);
  EXPECT_EQ(chunks[2]["choices"][0]["finish_reason"], "tool_calls");
  EXPECT_TRUE(chunks[3]["choices"].empty());
  EXPECT_EQ(chunks[3]["usage"]["total_tokens"], 14);
}

TEST(ServerApi, NonStreamResponses) {
  ts::server::ReplyParts parts = ts::server::split_reply("<think>r</think>text", true, false);
  json chat = ts::server::chat_response({.id = "c", .model = "tiny"},
                                        gen(ts::runtime::StopReason::kLength, 3), parts);
  EXPECT_EQ(chat["choices"][0]["message"]["content"], "text");
  EXPECT_EQ(chat["choices"][0]["message"]["reasoning_content"], "r");
  EXPECT_EQ(chat["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(chat["usage"]["completion_tokens"], 3);
  auto stopped = gen(ts::runtime::StopReason::kStop, 2);
  stopped.stop_index = 1;
  json msg =
      ts::server::messages_response({.id = "m", .model = "tiny"}, stopped, parts, {"a", "b"});
  EXPECT_EQ(msg["stop_reason"], "stop_sequence");
  EXPECT_EQ(msg["stop_sequence"], "b");
  EXPECT_EQ(msg["content"][0]["type"], "thinking");
  EXPECT_EQ(msg["content"][1]["text"], "text");
  EXPECT_EQ(msg["usage"], (json{{"input_tokens", 9}, {"output_tokens", 2}}));
}

}  // namespace

// The real Qwen3 and DeepSeek-V3 templates accept the converted conversations: tools, an
// assistant turn with tool_calls and null content, and the tool's answer.
namespace {

void expect_real_template_renders(const std::string& name,
                                  const std::vector<std::string>& needles) {
  const char* env = std::getenv("TS_TOKENIZER_DATA");
  const std::filesystem::path dir =
      (env ? std::filesystem::path(env)
           : std::filesystem::path(TS_TEST_DATA_DIR).parent_path() / "build-data" / "tokenizers") /
      name;
  if (!std::filesystem::exists(dir / "tokenizer_config.json"))
    GTEST_SKIP() << "no " << dir.string() << ": run scripts/fetch_tokenizer_data.sh";
  auto tmpl = ts::tokenizer::ChatTemplate::load(dir.string());
  ASSERT_TRUE(tmpl.ok()) << tmpl.error().message;
  const json tools = json::array({{{"type", "function"},
                                   {"function",
                                    {{"name", "get_weather"},
                                     {"description", "Weather"},
                                     {"parameters", {{"type", "object"}}}}}}});
  const json body = {
      {"tools", tools},
      {"messages",
       json::array({{{"role", "user"}, {"content", "Weather in Paris?"}},
                    {{"role", "assistant"},
                     {"content", nullptr},
                     {"tool_calls", json::array({{{"id", "call_1"},
                                                  {"type", "function"},
                                                  {"function",
                                                   {{"name", "get_weather"},
                                                    {"arguments", "{\"city\": \"Paris\"}"}}}}})}},
                    {{"role", "tool"}, {"tool_call_id", "call_1"}, {"content", "21 C"}}})}};
  auto r = ts::server::parse_chat_request(body, tmpl.value(), "m");
  ASSERT_TRUE(std::holds_alternative<GenRequest>(r)) << std::get<ApiError>(r).message;
  const std::string& text = std::get<GenRequest>(r).prompt_text;
  for (const std::string& n : needles)
    EXPECT_NE(text.find(n), std::string::npos) << n << "\n" << text;
  // The same through the Anthropic route.
  const json ant = {
      {"max_tokens", 10},
      {"tools", json::array({{{"name", "get_weather"}, {"input_schema", {{"type", "object"}}}}})},
      {"messages", json::array({{{"role", "user"}, {"content", "Weather in Paris?"}},
                                {{"role", "assistant"},
                                 {"content", json::array({{{"type", "tool_use"},
                                                           {"id", "call_1"},
                                                           {"name", "get_weather"},
                                                           {"input", {{"city", "Paris"}}}}})}},
                                {{"role", "user"},
                                 {"content", json::array({{{"type", "tool_result"},
                                                           {"tool_use_id", "call_1"},
                                                           {"content", "21 C"}}})}}})}};
  auto a = ts::server::parse_messages_request(ant, tmpl.value(), "m");
  ASSERT_TRUE(std::holds_alternative<GenRequest>(a)) << std::get<ApiError>(a).message;
  EXPECT_NE(std::get<GenRequest>(a).prompt_text.find("21 C"), std::string::npos);
}

TEST(ServerApi, RealQwen3Template) {
  expect_real_template_renders("qwen3", {"<tools>", "\"name\": \"get_weather\"",
                                         "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
                                         "{\"city\": \"Paris\"}}\n</tool_call>",
                                         "<tool_response>\n21 C\n</tool_response>"});
}

TEST(ServerApi, RealDeepSeekV3Template) {
  expect_real_template_renders("deepseek_v3",
                               {"<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather",
                                "{\"city\": \"Paris\"}", "<｜tool▁output▁begin｜>21 C"});
}

// /metrics: the expert store's counters always; the GPU expert cache's only when the engine
// has one (CUDA with --residency host / streamed), with its hit rate computed.
TEST(ServerMetrics, GpuExpertCacheCountersAppearOnlyWithAGpuCache) {
  ts::server::Metrics m;
  ts::runtime::Generation g{.prompt_tokens = 5, .generated = 4, .decode_s = 0.5};
  ts::experts::StoreStats store{.requests = 10, .hits = 4, .bytes_read = 123};
  m.record_generation(g, store);
  std::string text = m.prometheus(0, 0);
  EXPECT_NE(text.find("turbospark_expert_requests_total 10\n"), std::string::npos) << text;
  EXPECT_NE(text.find("turbospark_expert_cache_hit_rate 0.40000000000000002\n"), std::string::npos)
      << text;
  EXPECT_EQ(text.find("turbospark_gpu_expert"), std::string::npos) << text;
  m.record_generation(g, store,
                      ts::runtime::ExpertCacheReport{.residency = "host", .slots_per_layer = 64,
                                                     .requests = 200, .hits = 150,
                                                     .copied_bytes = 5000, .copy_ms = 250,
                                                     .bind_ms = 125});
  text = m.prometheus(0, 0);
  for (const char* line :
       {"turbospark_gpu_expert_cache_slots_per_layer 64\n", "turbospark_gpu_expert_requests_total 200\n",
        "turbospark_gpu_expert_hits_total 150\n", "turbospark_gpu_expert_cache_hit_rate 0.75\n",
        "turbospark_gpu_expert_h2d_bytes_total 5000\n",
        "turbospark_gpu_expert_copy_seconds_total 0.25\n",
        "turbospark_gpu_expert_bind_seconds_total 0.125\n", "turbospark_completion_tokens_total 8\n"})
    EXPECT_NE(text.find(line), std::string::npos) << line << " missing from\n" << text;
  EXPECT_EQ(text.find("turbospark_expert_predict"), std::string::npos) << text;
}

// The expert prediction's counts (CUDA decode) appear once an engine has made predictions.
TEST(ServerMetrics, ExpertPredictionCountersAppearOnlyWithPredictions) {
  ts::server::Metrics m;
  ts::runtime::Generation g{.prompt_tokens = 5, .generated = 4, .decode_s = 0.5};
  m.record_generation(g, {}, std::nullopt, ts::runtime::PhaseTimes{});
  EXPECT_EQ(m.prometheus(0, 0).find("turbospark_expert_predict"), std::string::npos);
  m.record_generation(g, {}, std::nullopt,
                      ts::runtime::PhaseTimes{.predicted_picks = 800, .predicted_right = 600});
  const std::string text = m.prometheus(0, 0);
  for (const char* line :
       {"turbospark_expert_prediction_picks_total 800\n", "turbospark_expert_predicted_total 600\n",
        "turbospark_expert_prediction_rate 0.75\n"})
    EXPECT_NE(text.find(line), std::string::npos) << line << " missing from\n" << text;
}

}  // namespace
