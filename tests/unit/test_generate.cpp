// generate() with the engine picking greedy ids (GenerateParams::greedy_on_engine, what `run`,
// `chat` and `serve` ask for when sampling is plain greedy) against the host's loop of forward
// + argmax: the same text, stop, counts, cached tokens and session position. The engine here
// runs every step ahead of the callback and takes back what it ran past the stop, as the CUDA
// session's queued steps do (the most any engine may run ahead).
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "core/thread_pool.h"
#include "runtime/generate.h"
#include "runtime/model.h"
#include "runtime/sampler.h"
#include "runtime/session.h"
#include "test_data.h"
#include "tokenizer/tokenizer.h"

namespace {

using ts::runtime::Engine;

// A Session whose decode_greedy computes all n steps before handing any id on.
class AheadEngine final : public Engine {
 public:
  AheadEngine(const ts::runtime::LoadedModel& m, ts::ThreadPool& pool, int n_ctx)
      : s_(m, pool, {.n_ctx = n_ctx}) {}
  int position() const override { return s_.position(); }
  int n_ctx() const override { return s_.n_ctx(); }
  void reset() override { s_.reset(); }
  void truncate(int n) override { s_.truncate(n); }
  ts::Status forward(std::span<const int> t, std::vector<float>* all) override {
    return s_.forward(t, all);
  }
  std::span<const float> last_logits() const override { return s_.last_logits(); }
  const ts::runtime::PhaseTimes& phases() const override { return s_.phases(); }
  std::vector<uint64_t> router_hist() const override { return s_.router_hist(); }
  const std::vector<std::vector<float>>& captures() const override { return s_.captures(); }
  int64_t captured_positions() const override { return s_.captured_positions(); }
  const std::vector<ts::runtime::RouterTraceEntry>& router_trace() const override {
    return s_.router_trace();
  }
  std::string device_name() const override { return "ahead"; }
  ts::Status decode_greedy(int token, int n, const std::function<bool(int)>& on_token) override {
    const int start = s_.position();
    std::vector<int> ids;
    for (int i = 0; i < n; ++i) {
      TS_TRY(s_.forward(std::span<const int>(&token, 1), nullptr));
      token = ts::runtime::argmax(s_.last_logits());
      ids.push_back(token);
    }
    int read = 0;
    for (int id : ids) {
      ++read;
      if (!on_token(id)) break;
    }
    s_.truncate(start + read);
    ++calls;
    return {};
  }
  int calls = 0;

 private:
  ts::runtime::Session s_;
};

class GenerateGreedy : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string dir = (ts_test::data_dir() / "models" / "qwen3_moe").string();
    auto m = ts::runtime::LoadedModel::load(dir);
    ASSERT_TRUE(m.ok()) << m.error().message;
    model_ = std::move(m.value());
    auto t = ts::tokenizer::Tokenizer::load(dir);
    ASSERT_TRUE(t.ok()) << t.error().message;
    tok_ = std::move(t.value());
  }
  struct Out {
    ts::runtime::Generation gen;
    std::vector<int> cached;
    int position = 0;
    std::string second;  // a second call's text, from the first's prompt + reply
  };
  Out run(bool on_engine, int64_t max_tokens, std::vector<std::string> stops) {
    Out o;
    AheadEngine e(*model_, pool_, 64);
    ts::runtime::Sampler sampler({});
    const ts::runtime::GenerateParams p{
        .max_tokens = max_tokens,
        .stops = std::move(stops),
        .next_token = [&](std::span<const float> l) { return sampler.sample(l); },
        .greedy_on_engine = on_engine,
    };
    const std::vector<int> prompt{3, 14, 15, 92, 65};
    auto g = ts::runtime::generate(e, o.cached, prompt, *tok_, p);
    EXPECT_TRUE(g.ok()) << g.error().message;
    if (!g.ok()) return o;
    o.gen = g.value();
    o.position = e.position();
    EXPECT_EQ(e.calls, on_engine && max_tokens > 1 && o.gen.generated > 0 ? 1 : 0);
    std::vector<int> cached = o.cached, next = o.cached;
    next.push_back(7);
    auto g2 = ts::runtime::generate(e, cached, next, *tok_, p);
    EXPECT_TRUE(g2.ok()) << g2.error().message;
    if (g2.ok()) o.second = g2.value().text;
    return o;
  }
  ts::ThreadPool pool_{2};
  std::unique_ptr<ts::runtime::LoadedModel> model_;
  std::unique_ptr<ts::tokenizer::Tokenizer> tok_;
};

TEST_F(GenerateGreedy, EnginePickedIdsGiveTheLoopsResult) {
  const Out whole = run(false, 12, {});
  ASSERT_GE(whole.gen.text.size(), 4u);
  // A stop string inside the reply: the generation ends early, with steps run past it.
  const std::string stop = whole.gen.text.substr(whole.gen.text.size() / 2, 2);
  for (int64_t n : {1, 2, 5, 12}) {
    for (const std::vector<std::string>& stops :
         {std::vector<std::string>{}, std::vector<std::string>{stop}}) {
      SCOPED_TRACE("max_tokens " + std::to_string(n) + (stops.empty() ? "" : ", stop"));
      const Out a = run(false, n, stops), b = run(true, n, stops);
      EXPECT_EQ(b.gen.text, a.gen.text);
      EXPECT_EQ(b.gen.generated, a.gen.generated);
      EXPECT_EQ(int(b.gen.stop_reason), int(a.gen.stop_reason));
      EXPECT_EQ(b.gen.stop_index, a.gen.stop_index);
      EXPECT_EQ(b.cached, a.cached);
      EXPECT_EQ(b.position, a.position);
      EXPECT_EQ(int(b.cached.size()), b.position);
      EXPECT_EQ(b.second, a.second);
    }
  }
  const Out stopped = run(true, 12, {stop});
  EXPECT_EQ(stopped.gen.stop_reason, ts::runtime::StopReason::kStop);
  EXPECT_LT(stopped.gen.generated, 12);
}

// The default Engine::decode_greedy is the loop: the ids of forward + argmax, stopped where
// on_token says, the last id given not fed.
TEST_F(GenerateGreedy, DefaultDecodeGreedyIsTheLoop) {
  ts::runtime::Session a(*model_, pool_, {.n_ctx = 32}), b(*model_, pool_, {.n_ctx = 32});
  const std::vector<int> prompt{3, 14, 15};
  ASSERT_TRUE(a.forward(prompt, nullptr).ok());
  ASSERT_TRUE(b.forward(prompt, nullptr).ok());
  int next = ts::runtime::argmax(a.last_logits());
  const int first = next;
  std::vector<int> want;
  for (int i = 0; i < 6; ++i) {
    ASSERT_TRUE(a.forward(std::span<const int>(&next, 1), nullptr).ok());
    next = ts::runtime::argmax(a.last_logits());
    want.push_back(next);
  }
  std::vector<int> got;
  ASSERT_TRUE(b.decode_greedy(first, 10, [&](int id) {
                 got.push_back(id);
                 return got.size() < 6;
               }).ok());
  EXPECT_EQ(got, want);
  EXPECT_EQ(b.position(), a.position());
  EXPECT_EQ(b.last_logits().size(), a.last_logits().size());
  EXPECT_TRUE(std::equal(b.last_logits().begin(), b.last_logits().end(), a.last_logits().begin()));
}

}  // namespace
