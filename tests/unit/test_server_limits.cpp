// The server's input bounds that hold before any parser runs: the JSON nesting scan.
#include <gtest/gtest.h>

#include <random>
#include <string>

#include "server/json_depth.h"

namespace {

using ts::server::json_too_deep_at;

TEST(JsonDepth, CountsBracketsOutsideStrings) {
  EXPECT_EQ(json_too_deep_at("[[1,{\"a\":[]}]]", 4), std::nullopt);
  EXPECT_EQ(json_too_deep_at("[[1,{\"a\":[]}]]", 3), 9u);  // the inner '[' opens level 4
  EXPECT_EQ(json_too_deep_at("[[1,{\"a\":[]}]]", 2), 4u);  // the '{' opens level 3
  // Brackets inside strings, with escaped quotes and backslashes, do not count.
  EXPECT_EQ(json_too_deep_at(R"({"s":"[[[[\"[[[[\\","t":[0]})", 2), std::nullopt);
  EXPECT_EQ(json_too_deep_at(R"({"s":"\\"[[)", 2),
            10u);  // an escaped backslash: the '"' after it ends the string
  // Closers never take the count below zero: "]]]][[" is depth 2, not 0.
  EXPECT_EQ(json_too_deep_at("]]]][[", 1), 5u);
}

TEST(JsonDepth, DeepRandomNestingIsFoundWhereItCrosses) {
  std::mt19937 rng{std::random_device{}()};
  for (int trial = 0; trial < 20; ++trial) {
    const int limit = 1 + int(rng() % 300);
    const int depth = limit + 1 + int(rng() % 100000);
    std::string text;
    size_t crossing = 0;
    for (int d = 0; d < depth; ++d) {
      if (d == limit) crossing = text.size();
      text += rng() % 2 ? "[" : "{\"k\":";
    }
    EXPECT_EQ(json_too_deep_at(text, limit), crossing) << "limit " << limit;
    EXPECT_EQ(json_too_deep_at(text, depth), std::nullopt);
  }
}

}  // namespace
