// Continuous batching on the CPU (Engine::open_sequence / step): every fixture model runs 16
// prompts of different lengths alone (Session::forward, a sequence at a time) and together
// (steps mixing prefill chunks and decode rows, arrivals staggered, the order within a step
// changed), and each sequence's logits must be the same bytes either way. Also: a closed
// sequence's blocks reused by a new one, the KV pool running out, and bad steps refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <random>

#include "core/thread_pool.h"
#include "runtime/model.h"
#include "runtime/sampler.h"
#include "runtime/session.h"
#include "test_data.h"

namespace {

using ts::runtime::Engine;
using ts::runtime::Session;

constexpr int kPrompts = 16;
constexpr int kNew = 6;  // greedy tokens after each prompt

class Batch : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    auto m = ts::runtime::LoadedModel::load((ts_test::data_dir() / "models" / GetParam()).string());
    ASSERT_TRUE(m.ok()) << m.error().message;
    model_ = std::move(m.value());
    vocab_ = size_t(model_->hp().vocab);
    std::mt19937 rng(1234);
    for (int i = 0; i < kPrompts; ++i) {
      std::vector<int> p(size_t(1 + (i * 7) % 37));  // 1 .. 37 tokens
      for (int& t : p) t = int(rng() % uint32_t(vocab_));
      prompts_.push_back(std::move(p));
    }
  }

  // Each prompt alone: its last-token logits, then each greedy step's.
  std::vector<std::vector<float>> alone() {
    ts::ThreadPool pool(2);
    std::vector<std::vector<float>> out;
    for (const std::vector<int>& p : prompts_) {
      Session s(*model_, pool, {.n_ctx = 64, .prefill_chunk = 8});
      EXPECT_TRUE(s.forward(p, nullptr).ok());
      std::vector<float> rows(s.last_logits().begin(), s.last_logits().end());
      for (int i = 0; i < kNew; ++i) {
        const int t = ts::runtime::argmax(s.last_logits());
        EXPECT_TRUE(s.forward(std::span<const int>(&t, 1), nullptr).ok());
        rows.insert(rows.end(), s.last_logits().begin(), s.last_logits().end());
      }
      out.push_back(std::move(rows));
    }
    return out;
  }

  // All prompts through one session's steps: prompt i arrives at step i / 3, prefills in
  // chunks that share a budget of `budget` tokens a step with the decode rows; `reverse`
  // lists the step's sequences last-arrived first.
  std::vector<std::vector<float>> batched(int budget, bool reverse,
                                          const ts::runtime::LoadedModel* model = nullptr) {
    ts::ThreadPool pool(2);
    Session s(model ? *model : *model_, pool,
              {.n_ctx = 64, .prefill_chunk = budget, .kv_tokens = 64 * kPrompts});
    struct Live {
      int index, seq;
      size_t fed = 0;
      int next = -1;
      std::vector<float> rows;
    };
    std::vector<std::vector<float>> out(kPrompts);
    std::deque<Live> live;
    int arrived = 0;
    for (int step = 0; arrived < kPrompts || !live.empty(); ++step) {
      while (arrived < kPrompts && arrived / 3 <= step) {
        auto seq = s.open_sequence(int(prompts_[size_t(arrived)].size()) + kNew);
        EXPECT_TRUE(seq.ok()) << seq.error().message;
        if (!seq.ok()) return out;
        live.push_back({.index = arrived++, .seq = *seq});
      }
      std::vector<Engine::SeqInput> inputs;
      std::vector<Live*> who;
      int left = budget;
      for (Live& l : live) {  // decode rows first, then prefill chunks
        if (l.next >= 0 && left > 0) {
          inputs.push_back({.seq = l.seq, .tokens = std::span<const int>(&l.next, 1)});
          who.push_back(&l);
          --left;
        }
      }
      for (Live& l : live) {
        const std::vector<int>& p = prompts_[size_t(l.index)];
        if (l.next < 0 && l.fed < p.size() && left > 0) {
          const size_t n = std::min(p.size() - l.fed, size_t(left));
          inputs.push_back({.seq = l.seq, .tokens = std::span<const int>(p.data() + l.fed, n)});
          who.push_back(&l);
          left -= int(n);
        }
      }
      if (reverse) {
        std::reverse(inputs.begin(), inputs.end());
        std::reverse(who.begin(), who.end());
      }
      std::vector<float> logits;
      const ts::Status st = s.step(inputs, &logits);
      EXPECT_TRUE(st.ok()) << st.error().message;
      if (!st.ok()) return out;
      EXPECT_EQ(logits.size(), inputs.size() * vocab_);
      for (size_t i = 0; i < inputs.size(); ++i) {
        Live& l = *who[i];
        if (l.next < 0) {
          l.fed += inputs[i].tokens.size();
          if (l.fed < prompts_[size_t(l.index)].size()) continue;  // prompt not done yet
        }
        const std::span<const float> row(logits.data() + i * vocab_, vocab_);
        l.rows.insert(l.rows.end(), row.begin(), row.end());
        l.next = ts::runtime::argmax(row);
      }
      for (auto it = live.begin(); it != live.end();) {
        if (it->rows.size() == size_t(kNew + 1) * vocab_) {
          out[size_t(it->index)] = std::move(it->rows);
          s.close_sequence(it->seq);
          it = live.erase(it);
        } else {
          ++it;
        }
      }
    }
    return out;
  }

  std::unique_ptr<ts::runtime::LoadedModel> model_;
  size_t vocab_ = 0;
  std::vector<std::vector<int>> prompts_;
};

void expect_same(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b,
                 const char* what) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].size(), b[i].size()) << what << ": sequence " << i;
    ASSERT_FALSE(a[i].empty());
    EXPECT_EQ(0, std::memcmp(a[i].data(), b[i].data(), a[i].size() * sizeof(float)))
        << what << ": sequence " << i << "'s logits differ from the sequence run alone";
  }
}

TEST_P(Batch, EachSequenceGetsItsAloneLogitsInAnyBatch) {
  const auto want = alone();
  expect_same(want, batched(48, false), "budget 48");
  expect_same(want, batched(20, true), "budget 20, reversed order");
  // Experts streamed into a cache of 2 slots a layer: a step's experts are read in batches
  // of what the cache holds, each released before the next.
  ts::runtime::LoadOptions opt;
  opt.residency = ts::experts::Residency::kStreamed;
  opt.streamed.slots_per_layer = 2;
  auto streamed =
      ts::runtime::LoadedModel::load((ts_test::data_dir() / "models" / GetParam()).string(), opt);
  // Experts split at load (gpt-oss's stacked layout) stream only from a pack (test_pack.cpp).
  if (!streamed.ok() && streamed.error().message.find("make a pack") != std::string::npos) return;
  ASSERT_TRUE(streamed.ok()) << streamed.error().message;
  expect_same(want, batched(48, false, streamed->get()), "streamed, 2 slots");
  const auto st = (*streamed)->experts().stats();
  EXPECT_LT(st.hits, st.requests) << "a 2-slot cache must miss";
}

TEST_P(Batch, ClosedBlocksReusedByANewSequenceAndThePoolRunsOut) {
  ts::ThreadPool pool(2);
  const std::vector<int>& p = prompts_[5];  // 36 tokens: 3 blocks with kNew more
  Session s(*model_, pool, {.n_ctx = 64, .kv_tokens = 3 * Session::kKvBlock});
  EXPECT_EQ(s.free_kv_tokens(), 3 * Session::kKvBlock);
  auto first = s.open_sequence(int(p.size()) + kNew);
  ASSERT_TRUE(first.ok()) << first.error().message;
  EXPECT_EQ(s.free_kv_tokens(), 0);
  // Another sequence does not fit until the first closes.
  auto refused = s.open_sequence(1);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.error().message.find("KV cache is full"), std::string::npos)
      << refused.error().message;
  // A different prompt fills the blocks first, so stale rows would show.
  std::vector<int> other(p.rbegin(), p.rend());
  std::vector<float> logits;
  ASSERT_TRUE(
      s.step(std::vector<Engine::SeqInput>{{.seq = *first, .tokens = other}}, &logits).ok());
  s.close_sequence(*first);
  EXPECT_EQ(s.free_kv_tokens(), 3 * Session::kKvBlock);
  auto second = s.open_sequence(int(p.size()) + kNew);
  ASSERT_TRUE(second.ok());
  ASSERT_TRUE(s.step(std::vector<Engine::SeqInput>{{.seq = *second, .tokens = p}}, &logits).ok());
  EXPECT_EQ(0, std::memcmp(logits.data(), alone()[5].data(), vocab_ * sizeof(float)));
}

// The prefix cache: a sequence whose prompt starts with another's tokens shares that one's
// whole blocks — while it runs and after it closed — and gets the logits it gets alone; the
// one it shares with goes on unharmed; blocks given up for room are not found again. With
// gated DeltaNet layers (a recurrent state, not in the blocks) nothing is shared, and the
// logits are the same.
TEST_P(Batch, PrefixBlocksAreSharedAndGiveTheAloneLogits) {
  ts::ThreadPool pool(2);
  const int shared = model_->hp().has_deltanet() ? 0 : 2 * Session::kKvBlock;
  const std::vector<int>& p = prompts_[5];  // 36 tokens: 2 whole blocks
  std::vector<int> longer = p;
  longer.insert(longer.end(), prompts_[3].begin(), prompts_[3].end());
  const auto alone_last = [&](const std::vector<int>& tokens) {
    Session s(*model_, pool, {.n_ctx = 128});
    EXPECT_TRUE(s.forward(tokens, nullptr).ok());
    return std::vector<float>(s.last_logits().begin(), s.last_logits().end());
  };
  const auto run = [&](Session& s, int seq, std::span<const int> tokens) {
    std::vector<float> logits;
    const ts::Status st =
        s.step(std::vector<Engine::SeqInput>{{.seq = seq, .tokens = tokens}}, &logits);
    EXPECT_TRUE(st.ok()) << st.error().message;
    return logits;
  };
  Session s(*model_, pool, {.n_ctx = 128, .kv_tokens = 8 * Session::kKvBlock});
  auto a = s.open_sequence(int(p.size()) + 1, p);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(s.sequence_position(*a), 0);  // nothing cached yet
  run(s, *a, p);
  // While a runs: b finds a's two whole blocks.
  auto b = s.open_sequence(int(longer.size()), longer);
  ASSERT_TRUE(b.ok());
  ASSERT_EQ(s.sequence_position(*b), shared);
  std::vector<float> got = run(s, *b, std::span<const int>(longer).subspan(size_t(shared)));
  EXPECT_EQ(0, std::memcmp(got.data(), alone_last(longer).data(), vocab_ * sizeof(float)));
  // a goes on past the shared blocks, unharmed.
  std::vector<int> a_next = p;
  a_next.push_back(7);
  got = run(s, *a, std::span<const int>(a_next).subspan(p.size()));
  EXPECT_EQ(0, std::memcmp(got.data(), alone_last(a_next).data(), vocab_ * sizeof(float)));
  s.close_sequence(*a);
  s.close_sequence(*b);
  EXPECT_EQ(s.kv_stats().cached > 0, shared > 0);
  EXPECT_EQ(s.kv_stats().reused_tokens, uint64_t(shared));
  // After both closed: found again (the prompt itself: all but its last token, 2 blocks).
  auto c = s.open_sequence(int(p.size()), p);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(s.sequence_position(*c), shared);
  got = run(s, *c, std::span<const int>(p).subspan(size_t(shared)));
  EXPECT_EQ(0, std::memcmp(got.data(), alone_last(p).data(), vocab_ * sizeof(float)));
  s.close_sequence(*c);
  // A sequence that needs the whole pool takes the cached blocks; p's are then gone.
  std::vector<int> other(8 * Session::kKvBlock - 1);
  for (size_t i = 0; i < other.size(); ++i) other[i] = int((i * 13 + 5) % vocab_);
  auto d = s.open_sequence(int(other.size()) + 1);
  ASSERT_TRUE(d.ok()) << d.error().message;
  EXPECT_EQ(s.kv_stats().cached, 0);
  run(s, *d, std::span<const int>(other).first(100));
  s.close_sequence(*d);
  auto e = s.open_sequence(int(p.size()), p);
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(s.sequence_position(*e), 0);
  got = run(s, *e, p);
  EXPECT_EQ(0, std::memcmp(got.data(), alone_last(p).data(), vocab_ * sizeof(float)));
}

TEST_P(Batch, BadStepsAreRefusedAndChangeNothing) {
  ts::ThreadPool pool(2);
  Session s(*model_, pool, {.n_ctx = 64, .prefill_chunk = 16, .kv_tokens = 256});
  auto a = s.open_sequence(8);
  ASSERT_TRUE(a.ok());
  const std::vector<int> nine(9, 1), one{1}, bad{int(vocab_)};
  std::vector<float> logits;
  const auto refused = [&](std::vector<Engine::SeqInput> in, const char* says) {
    const ts::Status st = s.step(in, &logits);
    ASSERT_FALSE(st.ok()) << says;
    EXPECT_NE(st.error().message.find(says), std::string::npos) << st.error().message;
  };
  refused({{.seq = *a, .tokens = nine}}, "exceed its reserve of 8");
  refused({{.seq = 7, .tokens = one}}, "sequence 7 is not open");
  refused({{.seq = 0, .tokens = one}}, "sequence 0 is not open");  // forward()'s own
  refused({{.seq = *a, .tokens = one}, {.seq = *a, .tokens = one}}, "appears twice");
  refused({{.seq = *a, .tokens = bad}}, "outside the vocabulary");
  auto b = s.open_sequence(64);
  ASSERT_TRUE(b.ok());
  const std::vector<int> seventeen(17, 1);
  refused({{.seq = *b, .tokens = seventeen}}, "exceeds step_tokens() = 16");
  EXPECT_FALSE(s.open_sequence(65).ok());
  // Nothing moved: the sequence still takes its whole reserve.
  const std::vector<int> eight(8, 1);
  EXPECT_TRUE(s.step(std::vector<Engine::SeqInput>{{.seq = *a, .tokens = eight}}, &logits).ok());
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Batch, ::testing::ValuesIn(ts_test::fixture_names()),
                         [](const auto& info) { return info.param; });

}  // namespace

namespace {

// A recurrent state cannot be cut back like KV rows: on a model with gated DeltaNet layers,
// truncate() short of the whole sequence starts again from 0 (position() says so, and
// generate() then prefills everything), while going on from the exact end reuses the state.
// Either way the logits are those of one fresh prefill.
TEST(RecurrentState, TruncateStartsAgainAndContinuingReusesTheState) {
  for (const char* name : {"qwen3_next", "qwen3_5_moe"}) {
    auto m = ts::runtime::LoadedModel::load((ts_test::data_dir() / "models" / name).string());
    ASSERT_TRUE(m.ok()) << m.error().message;
    ASSERT_TRUE((*m)->hp().has_deltanet());
    ts::ThreadPool pool(2);
    std::vector<int> all(30);
    for (size_t i = 0; i < all.size(); ++i) all[i] = int((i * 31 + 7) % 500);
    const std::span<const int> head(all.data(), 20), tail(all.data() + 20, 10);
    Session fresh(**m, pool, {.n_ctx = 64});
    ASSERT_TRUE(fresh.forward(all, nullptr).ok());
    const std::vector<float> want(fresh.last_logits().begin(), fresh.last_logits().end());
    const auto same = [&](const Session& s) {
      return std::memcmp(s.last_logits().data(), want.data(), want.size() * sizeof(float)) == 0;
    };

    Session s(**m, pool, {.n_ctx = 64});
    ASSERT_TRUE(s.forward(head, nullptr).ok());
    s.truncate(20);  // the whole sequence: kept
    EXPECT_EQ(s.position(), 20) << name;
    ASSERT_TRUE(s.forward(tail, nullptr).ok());
    EXPECT_TRUE(same(s)) << name << ": continuing from the state";
    s.truncate(25);  // short of the end: starts again
    EXPECT_EQ(s.position(), 0) << name;
    ASSERT_TRUE(s.forward(all, nullptr).ok());
    EXPECT_TRUE(same(s)) << name << ": after starting again";
  }
}

}  // namespace
