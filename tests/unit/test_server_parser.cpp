// The reply parser of the server: <think> reasoning, Qwen3 and DeepSeek-V3 tool calls, and
// that any split of the text into stream pieces gives the same result as one piece.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>

#include "server/output_parser.h"
#include "tokenizer/tokenizer.h"

namespace {

using ts::server::OutputEvent;
using ts::server::OutputParser;
using Kind = OutputEvent::Kind;

// Events with adjacent text of one kind merged, as a client would see them.
std::vector<OutputEvent> merged(std::vector<OutputEvent> events) {
  std::vector<OutputEvent> out;
  for (OutputEvent& e : events) {
    if (!out.empty() && e.kind != Kind::kToolCall && out.back().kind == e.kind)
      out.back().text += e.text;
    else
      out.push_back(std::move(e));
  }
  return out;
}

std::vector<OutputEvent> parse_pieces(const std::vector<std::string>& pieces,
                                      OutputParser::Options opt = {}) {
  OutputParser p(opt);
  std::vector<OutputEvent> all;
  for (const std::string& s : pieces)
    for (OutputEvent& e : p.feed(s)) all.push_back(std::move(e));
  for (OutputEvent& e : p.finish()) all.push_back(std::move(e));
  return merged(std::move(all));
}

std::vector<OutputEvent> parse(const std::string& text, OutputParser::Options opt = {}) {
  return parse_pieces({text}, opt);
}

void expect_events_equal(const std::vector<OutputEvent>& a, const std::vector<OutputEvent>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].kind, b[i].kind) << i;
    EXPECT_EQ(a[i].text, b[i].text) << i;
    EXPECT_EQ(a[i].call.name, b[i].call.name) << i;
    EXPECT_EQ(a[i].call.arguments, b[i].call.arguments) << i;
  }
}

TEST(ServerParser, QwenToolCall) {
  auto ev = parse(
      "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
      "{\"city\": \"Paris\", \"days\": 2}}\n</tool_call>");
  ASSERT_EQ(ev.size(), 2u);
  EXPECT_EQ(ev[0].kind, Kind::kContent);
  EXPECT_EQ(ev[0].text, "Let me check.\n");
  EXPECT_EQ(ev[1].kind, Kind::kToolCall);
  EXPECT_EQ(ev[1].call.name, "get_weather");
  EXPECT_EQ(nlohmann::json::parse(ev[1].call.arguments),
            (nlohmann::json{{"city", "Paris"}, {"days", 2}}));
}

TEST(ServerParser, QwenTwoCallsAndStringArguments) {
  auto ev = parse(
      "<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>\n"
      "<tool_call>\n{\"name\": \"b\", \"arguments\": \"{\\\"x\\\": 1}\"}\n</tool_call>");
  ASSERT_EQ(ev.size(), 2u);
  EXPECT_EQ(ev[0].call.name, "a");
  EXPECT_EQ(ev[0].call.arguments, "{}");
  EXPECT_EQ(ev[1].call.name, "b");
  EXPECT_EQ(ev[1].call.arguments, "{\"x\":1}");
}

TEST(ServerParser, BadToolCallStaysText) {
  const std::string text = "x <tool_call>\n{\"name\": 3}\n</tool_call> y";
  auto ev = parse(text);
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].kind, Kind::kContent);
  EXPECT_EQ(ev[0].text, text);
  // Unterminated garbage at the end, too.
  ev = parse("a<tool_call>{oops");
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].text, "a<tool_call>{oops");
  // An unterminated but complete call (the model stopped at EOS) is still a call.
  ev = parse("<tool_call>{\"name\": \"f\", \"arguments\": {\"k\": [1]}}");
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].kind, Kind::kToolCall);
  EXPECT_EQ(ev[0].call.arguments, "{\"k\":[1]}");
}

TEST(ServerParser, ToolsNotDeclaredMeansText) {
  const std::string text = "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>";
  auto ev = parse(text, {.parse_tools = false});
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].kind, Kind::kContent);
  EXPECT_EQ(ev[0].text, text);
}

TEST(ServerParser, Reasoning) {
  auto ev = parse("<think>\nFirst, 2+2.\n</think>\n\nIt is 4.");
  ASSERT_EQ(ev.size(), 2u);
  EXPECT_EQ(ev[0].kind, Kind::kReasoning);
  EXPECT_EQ(ev[0].text, "First, 2+2.\n");
  EXPECT_EQ(ev[1].kind, Kind::kContent);
  EXPECT_EQ(ev[1].text, "It is 4.");
  // The template opened the block: the reply starts inside it.
  ev = parse("\nhmm</think>ok", {.starts_in_reasoning = true});
  ASSERT_EQ(ev.size(), 2u);
  EXPECT_EQ(ev[0].text, "hmm");
  EXPECT_EQ(ev[1].text, "ok");
  // Unclosed reasoning stays reasoning.
  ev = parse("<think>still going");
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].kind, Kind::kReasoning);
}

TEST(ServerParser, DeepSeekV3AndV31) {
  const std::string v3 =
      "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
      "```json\n{\"location\": \"Tokyo\"}\n```<｜tool▁call▁end｜>\n"
      "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```<｜tool▁call▁end｜>"
      "<｜tool▁calls▁end｜>";
  auto ev = parse(v3);
  ASSERT_EQ(ev.size(), 3u);
  EXPECT_EQ(ev[0].text, "Sure.");
  EXPECT_EQ(ev[1].call.name, "get_weather");
  EXPECT_EQ(ev[1].call.arguments, "{\"location\":\"Tokyo\"}");
  EXPECT_EQ(ev[2].call.name, "get_time");
  EXPECT_EQ(ev[2].call.arguments, "{}");
  const std::string v31 =
      "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>{\"q\": \"moe\"}"
      "<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
  ev = parse(v31);
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].call.name, "search");
  EXPECT_EQ(ev[0].call.arguments, "{\"q\":\"moe\"}");
  // Stray text inside the block: not a call, kept as written.
  const std::string bad = "<｜tool▁calls▁begin｜>junk<｜tool▁calls▁end｜>";
  ev = parse(bad);
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].text, bad);
}

TEST(ServerParser, PartialMarkersAreHeldBack) {
  OutputParser p({});
  auto ev = p.feed("abc<tool");
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].text, "abc");
  ev = p.feed("box");
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].text, "<toolbox");
  EXPECT_TRUE(p.finish().empty());
}

TEST(ServerParser, AnySplitGivesTheSameEvents) {
  const std::vector<std::string> texts = {
      "<think>\nplan é ✓\n</think>\n\nLet me call.<tool_call>\n{\"name\": \"f\", \"arguments\": "
      "{\"a\": \"<think>\"}}\n</tool_call>\ndone <tool",
      "pre<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>g<｜tool▁sep｜>{\"b\": 1}<｜tool▁call▁end｜>"
      "<｜tool▁calls▁end｜>post </thi",
  };
  std::mt19937 rng(std::random_device{}());
  for (const std::string& text : texts) {
    const auto whole = parse(text);
    for (int trial = 0; trial < 200; ++trial) {
      std::vector<std::string> pieces;
      for (size_t at = 0; at < text.size();) {
        size_t n = 1 + rng() % 6;
        pieces.push_back(text.substr(at, n));
        at += n;
      }
      expect_events_equal(parse_pieces(pieces), whole);
    }
  }
}

TEST(ServerParser, PromptOpensReasoning) {
  EXPECT_TRUE(ts::server::prompt_opens_reasoning("<|im_start|>assistant\n<think>\n"));
  EXPECT_FALSE(
      ts::server::prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
  EXPECT_FALSE(ts::server::prompt_opens_reasoning("<|im_start|>assistant\n"));
}

}  // namespace

// With the real Qwen3 and DeepSeek-V3 tokenizers: a reply encoded to ids, detokenized one id
// at a time as the server does (special tokens skipped), parses into the same tool call. This
// holds only because the tool-call markers are non-special added tokens in both.
namespace {

std::filesystem::path tokenizer_data_dir() {
  if (const char* env = std::getenv("TS_TOKENIZER_DATA")) return env;
  return std::filesystem::path(TS_TEST_DATA_DIR).parent_path() / "build-data" / "tokenizers";
}

void expect_streamed_call(const std::string& name, const std::string& reply) {
  const auto dir = tokenizer_data_dir() / name;
  if (!std::filesystem::exists(dir / "tokenizer.json"))
    GTEST_SKIP() << "no " << dir.string() << ": run scripts/fetch_tokenizer_data.sh";
  auto tok = ts::tokenizer::Tokenizer::load(dir.string());
  ASSERT_TRUE(tok.ok()) << tok.error().message;
  ts::tokenizer::StreamDecoder stream(**tok, /*skip_special=*/true);
  OutputParser parser({});
  std::vector<OutputEvent> events;
  for (int id : (*tok)->encode(reply, false))
    for (OutputEvent& e : parser.feed(stream.push(id))) events.push_back(std::move(e));
  for (OutputEvent& e : parser.feed(stream.flush())) events.push_back(std::move(e));
  for (OutputEvent& e : parser.finish()) events.push_back(std::move(e));
  events = merged(std::move(events));
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[0].kind, Kind::kReasoning);
  EXPECT_EQ(events[0].text, "Paris is in France.\n");
  EXPECT_EQ(events[1].text, "Checking.");
  EXPECT_EQ(events[2].call.name, "get_weather");
  EXPECT_EQ(events[2].call.arguments, "{\"city\":\"Paris\"}");
}

TEST(ServerParser, Qwen3TokenizerRoundTrip) {
  expect_streamed_call("qwen3",
                       "<think>\nParis is in France.\n</think>\n\nChecking.<tool_call>\n{\"name\": "
                       "\"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>");
}

TEST(ServerParser, DeepSeekV3TokenizerRoundTrip) {
  expect_streamed_call(
      "deepseek_v3",
      "<think>Paris is in France.\n</think>Checking.<｜tool▁calls▁begin｜><｜tool▁call▁"
      "begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```<｜"
      "tool▁call▁end｜><｜tool▁calls▁end｜>");
}

}  // namespace
