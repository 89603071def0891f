// GGUF model files (src/model/gguf_model.*, src/tokenizer/gguf_vocab.*): every fixture written
// as llama.cpp's converter writes it (tests/unit/gguf_convert.h) must load to the same
// hyper-parameters and the same logits, byte for byte, as its Hugging Face directory; the
// logits themselves are checked against transformers by test_models.cpp. The tokenizer
// rebuilt from a GGUF's metadata must encode and decode like the tokenizer.json it came from.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "core/thread_pool.h"
#include "gguf_convert.h"
#include "io/gguf.h"
#include "io/npy.h"
#include "model/gguf_model.h"
#include "runtime/model.h"
#include "runtime/session.h"
#include "test_data.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace {

namespace fs = std::filesystem;
using ts::runtime::LoadedModel;

using ts_test::TempDir;

std::vector<int> prompt_of(const std::string& dir) {
  std::ifstream f(dir + "/ref.json");
  return nlohmann::json::parse(f)["prompt_ids"].get<std::vector<int>>();
}

std::vector<float> prefill(const LoadedModel& m, const std::vector<int>& prompt) {
  ts::ThreadPool pool(2);
  ts::runtime::Session s(m, pool, {.n_ctx = int(prompt.size())});
  std::vector<float> logits;
  EXPECT_TRUE(s.forward(prompt, &logits).ok());
  return logits;
}

std::unique_ptr<LoadedModel> load(const std::string& path, ts::runtime::LoadOptions opt = {}) {
  auto m = LoadedModel::load(path, opt);
  EXPECT_TRUE(m.ok()) << (m.ok() ? "" : m.error().message);
  return m.ok() ? std::move(m.value()) : nullptr;
}

std::string model_dir(const std::string& name) {
  return (ts_test::data_dir() / "models" / name).string();
}

double max_rel(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num = std::max(num, double(std::fabs(a[i] - b[i])));
    den = std::max(den, double(std::fabs(b[i])));
  }
  return num / den;
}

// An integer metadata value of a file the test wrote (-1 when absent or not an integer).
int64_t meta_int(const ts::io::GgufFile& g, const std::string& key) {
  auto v = g.integer(key);
  return v.ok() && v.value() ? *v.value() : -1;
}

class GgufFixture : public ::testing::TestWithParam<std::string> {};

TEST_P(GgufFixture, LoadsAsItsCheckpointWithTheSameLogits) {
  const std::string dir = model_dir(GetParam());
  TempDir tmp;
  const std::string gguf = tmp.file("model.gguf");
  ts_test::convert_hf_dir(dir, gguf);
  auto a = load(dir);
  auto b = load(gguf);
  ASSERT_TRUE(a && b);
  const auto &ha = a->hp(), &hb = b->hp();
  EXPECT_EQ(ha.family, hb.family);
  EXPECT_EQ(ha.d_model, hb.d_model);
  EXPECT_EQ(ha.n_layers, hb.n_layers);
  EXPECT_EQ(ha.n_heads, hb.n_heads);
  EXPECT_EQ(ha.n_kv_heads, hb.n_kv_heads);
  EXPECT_EQ(ha.head_dim, hb.head_dim);
  EXPECT_EQ(ha.vocab, hb.vocab);
  EXPECT_EQ(ha.n_experts, hb.n_experts);
  EXPECT_EQ(ha.top_k, hb.top_k);
  EXPECT_EQ(ha.d_expert, hb.d_expert);
  EXPECT_EQ(ha.d_ff, hb.d_ff);
  EXPECT_EQ(ha.d_shared, hb.d_shared);
  EXPECT_EQ(ha.shared_expert_gate, hb.shared_expert_gate);
  EXPECT_EQ(ha.qkv_bias, hb.qkv_bias);
  EXPECT_EQ(ha.qk_norm, hb.qk_norm);
  EXPECT_EQ(ha.attention, hb.attention);
  EXPECT_EQ(ha.mla.q_lora_rank, hb.mla.q_lora_rank);
  EXPECT_EQ(ha.mla.kv_lora_rank, hb.mla.kv_lora_rank);
  EXPECT_EQ(ha.mla.nope_dim, hb.mla.nope_dim);
  EXPECT_EQ(ha.mla.rope_dim, hb.mla.rope_dim);
  EXPECT_EQ(ha.mla.v_dim, hb.mla.v_dim);
  EXPECT_EQ(ha.attn_scale, hb.attn_scale);
  EXPECT_EQ(ha.router.scoring, hb.router.scoring);
  EXPECT_EQ(ha.router.correction_bias, hb.router.correction_bias);
  EXPECT_EQ(ha.router.n_group, hb.router.n_group);
  EXPECT_EQ(ha.router.topk_group, hb.router.topk_group);
  EXPECT_EQ(ha.router.group_score, hb.router.group_score);
  EXPECT_EQ(ha.router.renormalize, hb.router.renormalize);
  EXPECT_EQ(ha.router.scale, hb.router.scale);
  EXPECT_EQ(ha.rms_eps, hb.rms_eps);
  EXPECT_EQ(ha.rope.theta, hb.rope.theta);
  EXPECT_EQ(ha.rope.dim, hb.rope.dim);
  EXPECT_EQ(ha.rope.layout, hb.rope.layout);
  EXPECT_EQ(ha.rope.yarn, hb.rope.yarn);
  EXPECT_EQ(ha.rope.factor, hb.rope.factor);
  EXPECT_EQ(ha.rope.mscale_all_dim, hb.rope.mscale_all_dim);
  EXPECT_EQ(ha.rope.attention_factor, hb.rope.attention_factor);
  EXPECT_EQ(ha.rope.inv_freq, hb.rope.inv_freq);
  EXPECT_EQ(ha.max_positions, hb.max_positions);
  EXPECT_EQ(ha.tie_word_embeddings, hb.tie_word_embeddings);
  EXPECT_EQ(ha.layer_is_moe, hb.layer_is_moe);
  const std::vector<int> prompt = prompt_of(dir);
  const std::vector<float> la = prefill(*a, prompt), lb = prefill(*b, prompt);
  ASSERT_EQ(la.size(), lb.size());
  EXPECT_EQ(0, std::memcmp(la.data(), lb.data(), la.size() * 4)) << "max rel " << max_rel(lb, la);
  // And against transformers' logits, row by row, as test_models.cpp checks the directory.
  const auto ref = ts::io::read_npy_f32(dir + "/logits.npy");
  ASSERT_TRUE(ref.ok());
  ASSERT_EQ(ref->data.size(), lb.size());
  const size_t V = size_t(hb.vocab);
  for (size_t t = 0; t * V < lb.size(); ++t)
    EXPECT_LE(
        max_rel(std::vector<float>(lb.begin() + t * V, lb.begin() + (t + 1) * V),
                std::vector<float>(ref->data.begin() + t * V, ref->data.begin() + (t + 1) * V)),
        1e-4)
        << "position " << t;
}

// The fixtures whose family has a GGUF mapping (model/gguf_arch.cpp: llama = mixtral,
// qwen2moe, qwen3moe, olmoe, deepseek2 = deepseek_v2 / v3, glm4moe, minimax-m2); not
// Qwen3-Next / Qwen3.5 (llama.cpp's qwen3next / qwen35moe) nor gpt-oss (its arch, MXFP4
// experts) yet.
std::vector<std::string> gguf_fixture_names() {
  std::vector<std::string> out;
  for (const std::string& name : ts_test::fixture_names()) {
    std::ifstream f(model_dir(name) + "/config.json");
    const std::string mt = nlohmann::json::parse(f).at("model_type").get<std::string>();
    if (mt != "qwen3_next" && mt != "qwen3_5_moe_text" && mt != "gpt_oss") out.push_back(name);
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Fixtures, GgufFixture, ::testing::ValuesIn(gguf_fixture_names()));

// Mixtral is stored as arch llama, whose q/k rows the converter permutes: the loader must
// undo exactly that (a file written without the permutation then gives other logits).
TEST(GgufModel, LlamaQkPermutationIsUndone) {
  const std::string dir = model_dir("mixtral_gqa");
  TempDir tmp;
  ts_test::convert_hf_dir(dir, tmp.file("p.gguf"));
  ts_test::convert_hf_dir(dir, tmp.file("raw.gguf"), {.permute_qk = false});
  ts_test::convert_hf_dir(dir, tmp.file("legacy.gguf"), {.legacy_expert_names = true});
  auto ref = load(dir), p = load(tmp.file("p.gguf")), raw = load(tmp.file("raw.gguf")),
       legacy = load(tmp.file("legacy.gguf"));
  ASSERT_TRUE(ref && p && raw && legacy);
  const std::vector<int> prompt = prompt_of(dir);
  const std::vector<float> lr = prefill(*ref, prompt), lp = prefill(*p, prompt),
                           lraw = prefill(*raw, prompt), ll = prefill(*legacy, prompt);
  EXPECT_EQ(0, std::memcmp(lr.data(), lp.data(), lr.size() * 4));
  EXPECT_EQ(0, std::memcmp(lr.data(), ll.data(), lr.size() * 4)) << "per-expert tensor names";
  EXPECT_GT(max_rel(lraw, lr), 1e-3) << "an unpermuted file must not give the same logits";
}

// deepseek2 files hold MLA's kv_b_proj split as llama.cpp's converter writes it
// (attn_k_b {nope, kv_lora, heads}, each head's k rows transposed; attn_v_b {kv_lora, v, heads});
// the loader joins them back into the checkpoint's bytes.
TEST(GgufModel, MlaKvBIsJoinedBackFromTheConvertersSplit) {
  const std::string dir = model_dir("deepseek_v2");
  TempDir tmp;
  const std::string gguf = tmp.file("ds.gguf");
  ts_test::convert_hf_dir(dir, gguf);
  auto g = ts::io::read_gguf(gguf);
  ASSERT_TRUE(g.ok());
  ASSERT_TRUE(g->tensor("blk.0.attn_k_b.weight") && g->tensor("blk.0.attn_v_b.weight"));
  EXPECT_EQ(g->tensor("blk.0.attn_k_b.weight")->dims, (std::vector<int64_t>{32, 48, 6}));
  EXPECT_EQ(g->tensor("blk.0.attn_v_b.weight")->dims, (std::vector<int64_t>{48, 24, 6}));
  EXPECT_EQ(g->tensor("blk.0.attn_kv_b.weight"), nullptr);
  EXPECT_EQ(meta_int(*g, "deepseek2.attention.head_count_kv"), 1);
  auto m = ts::model::open_gguf_model(gguf);
  ASSERT_TRUE(m.ok()) << m.error().message;
  auto hf = ts::io::TensorSet::open_dir(dir);
  ASSERT_TRUE(hf.ok());
  for (int l = 0; l < 3; ++l) {
    const std::string name = "model.layers." + std::to_string(l) + ".self_attn.kv_b_proj.weight";
    const ts::io::TensorView *a = (*hf)->find(name), *b = m->tensors->find(name);
    ASSERT_TRUE(a && b) << name;
    EXPECT_EQ(a->shape, b->shape);
    ASSERT_EQ(a->n_bytes, b->n_bytes);
    EXPECT_EQ(0, std::memcmp(a->data, b->data, a->n_bytes)) << name;
  }
  EXPECT_NE(m->note.find("joined attn_k_b + attn_v_b into kv_b_proj for 3 block(s)"),
            std::string::npos)
      << m->note;
  // Files from before the split hold attn_kv_b whole and the head sizes in key_length /
  // value_length: the same model.
  ts_test::convert_hf_dir(dir, tmp.file("legacy.gguf"), {.legacy_mla = true});
  auto lg = ts::io::read_gguf(tmp.file("legacy.gguf"));
  ASSERT_TRUE(lg.ok());
  ASSERT_TRUE(lg->tensor("blk.0.attn_kv_b.weight"));
  EXPECT_EQ(lg->tensor("blk.0.attn_k_b.weight"), nullptr);
  EXPECT_EQ(meta_int(*lg, "deepseek2.attention.key_length"), 48);
  auto legacy = load(tmp.file("legacy.gguf")), split = load(gguf);
  ASSERT_TRUE(legacy && split);
  const std::vector<int> prompt = prompt_of(dir);
  const std::vector<float> ll = prefill(*legacy, prompt), ls = prefill(*split, prompt);
  EXPECT_EQ(0, std::memcmp(ll.data(), ls.data(), ll.size() * 4));
}

// The new families' experts stream from the file's offsets like the others': every
// residency gives the resident file's bytes.
TEST(GgufModel, NewFamiliesStreamTheirExpertsFromTheFile) {
  for (const char* name : {"deepseek_v3", "glm4_moe", "minimax_m2"}) {
    const std::string dir = model_dir(name);
    TempDir tmp;
    const std::string gguf = tmp.file("m.gguf");
    ts_test::convert_hf_dir(dir, gguf);
    auto base = load(gguf);
    ASSERT_TRUE(base) << name;
    const std::vector<int> prompt = prompt_of(dir);
    const std::vector<float> want = prefill(*base, prompt);
    for (int slots : {1, 3}) {
      ts::runtime::LoadOptions opt;
      opt.residency = ts::experts::Residency::kStreamed;
      opt.streamed.slots_per_layer = slots;
      auto m = load(gguf, opt);
      ASSERT_TRUE(m) << name;
      const std::vector<float> got = prefill(*m, prompt);
      EXPECT_EQ(0, std::memcmp(want.data(), got.data(), want.size() * 4))
          << name << " streamed, slots " << slots;
    }
  }
}

// With --outtype q8_0 the converter quantizes attn_k_b (rows of qk_nope = 32) and, rows of
// kv_lora_rank = 48 not being whole blocks, writes attn_v_b as F16: the halves are widened
// and joined; the logits stay near the F32 file's.
TEST(GgufModel, QuantizedMlaHalvesAreWidenedAndJoined) {
  const std::string dir = model_dir("deepseek_v3");
  TempDir tmp;
  ts_test::convert_hf_dir(dir, tmp.file("f32.gguf"));
  ts_test::convert_hf_dir(dir, tmp.file("q8.gguf"), {.q8_0 = true});
  auto g = ts::io::read_gguf(tmp.file("q8.gguf"));
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(g->tensor("blk.0.attn_k_b.weight")->ggml_type, ts::io::kGgmlQ8_0);
  EXPECT_EQ(g->tensor("blk.0.attn_v_b.weight")->ggml_type, ts::io::kGgmlF16);
  auto f = load(tmp.file("f32.gguf")), q = load(tmp.file("q8.gguf"));
  ASSERT_TRUE(f && q);
  EXPECT_NE(q->load_note().find("(4 widened from quantized halves)"), std::string::npos)
      << q->load_note();
  const std::vector<int> prompt = prompt_of(dir);
  const double err = max_rel(prefill(*q, prompt), prefill(*f, prompt));
  EXPECT_LT(err, 0.05);
  EXPECT_GT(err, 0.0);
}

// deepseek2 carries V2 and V3: expert_gating_func says which (1 softmax = V2, 2 sigmoid =
// V3); without it, exp_probs_b biases mean V3 (the fixture's config has no scoring_func).
TEST(GgufModel, DeepseekRouterFollowsTheGatingKeyOrTheBias) {
  const std::string dir = model_dir("deepseek_v3");
  TempDir tmp;
  auto gating = [](uint32_t v) {
    return std::vector<std::pair<std::string, uint32_t>>{{"deepseek2.expert_gating_func", v}};
  };
  ts_test::convert_hf_dir(dir, tmp.file("none.gguf"));
  ts_test::convert_hf_dir(dir, tmp.file("sigmoid.gguf"), {.set_u32 = gating(2)});
  // (V2 never renormalises, so the softmax file goes without expert_weights_norm.)
  ts_test::convert_hf_dir(dir, tmp.file("softmax.gguf"),
                          {.set_u32 = gating(1), .drop_keys = {"deepseek2.expert_weights_norm"}});
  auto none = load(tmp.file("none.gguf")), sig = load(tmp.file("sigmoid.gguf")),
       soft = load(tmp.file("softmax.gguf"));
  ASSERT_TRUE(none && sig && soft);
  EXPECT_EQ(none->hp().family, ts::model::Family::kDeepseekV3);
  EXPECT_EQ(soft->hp().family, ts::model::Family::kDeepseekV2);
  EXPECT_EQ(soft->hp().router.scoring, ts::model::ScoreFn::kSoftmax);
  const std::vector<int> prompt = prompt_of(dir);
  const std::vector<float> ln = prefill(*none, prompt), ls = prefill(*sig, prompt),
                           lsoft = prefill(*soft, prompt);
  EXPECT_EQ(0, std::memcmp(ln.data(), ls.data(), ln.size() * 4));
  EXPECT_GT(max_rel(lsoft, ln), 1e-3) << "softmax routing must give other logits";
  // A V2 file said to be sigmoid-routed lacks V3's correction biases: named.
  ts_test::convert_hf_dir(model_dir("deepseek_v2"), tmp.file("v2sig.gguf"), {.set_u32 = gating(2)});
  auto bad = LoadedModel::load(tmp.file("v2sig.gguf"));
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.error().message.find("e_score_correction_bias"), std::string::npos)
      << bad.error().message;
}

// glm4moe counts its NextN (multi-token-prediction) blocks in block_count; their tensors are
// skipped and named, and a file converted with --no-mtp loads the same.
TEST(GgufModel, NextnBlocksAreSkippedAndNamed) {
  const std::string dir = model_dir("glm4_moe");
  TempDir tmp;
  auto mtp = [](ts_test::GgufWriter& w) {
    w.tensor("blk.3.nextn.eh_proj.weight", {192, 96}, 0, std::string(192 * 96 * 4, '\1'));
    w.tensor("blk.3.attn_norm.weight", {96}, 0, std::string(96 * 4, '\1'));
  };
  ts_test::convert_hf_dir(dir, tmp.file("mtp.gguf"), {.extra = mtp});
  ts_test::convert_hf_dir(dir, tmp.file("no_mtp.gguf"), {.no_mtp = true});
  auto g = ts::io::read_gguf(tmp.file("mtp.gguf"));
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(meta_int(*g, "glm4moe.block_count"), 4);
  EXPECT_EQ(meta_int(*g, "glm4moe.nextn_predict_layers"), 1);
  auto a = load(tmp.file("mtp.gguf")), b = load(tmp.file("no_mtp.gguf"));
  ASSERT_TRUE(a && b);
  EXPECT_EQ(a->hp().n_layers, 3);
  EXPECT_EQ(a->hp().n_nextn_layers, 1);
  EXPECT_NE(a->load_note().find("skipped 2 tensor(s) of the multi-token-prediction block(s) "
                                "blk.3 (glm4moe.nextn_predict_layers = 1)"),
            std::string::npos)
      << a->load_note();
  const std::vector<int> prompt = prompt_of(dir);
  const std::vector<float> la = prefill(*a, prompt), lb = prefill(*b, prompt);
  EXPECT_EQ(0, std::memcmp(la.data(), lb.data(), la.size() * 4));
  ts_test::convert_hf_dir(dir, tmp.file("past.gguf"), {.extra = [](ts_test::GgufWriter& w) {
                            w.tensor("blk.4.attn_norm.weight", {96}, 0, std::string(96 * 4, 0));
                          }});
  auto past = LoadedModel::load(tmp.file("past.gguf"));
  ASSERT_FALSE(past.ok());
  EXPECT_NE(past.error().message.find("'blk.4.attn_norm.weight' names a block past "
                                      "glm4moe.block_count = 4"),
            std::string::npos)
      << past.error().message;
}

// Bad deepseek2 / glm4moe / minimax-m2 files: the error names the key or tensor.
TEST(GgufModel, NewArchitectureErrorsNameTheKeyOrTensor) {
  TempDir tmp;
  struct Case {
    const char* fixture;
    ts_test::ConvertOptions opt;
    std::string needle;
  };
  const std::vector<Case> cases = {
      {"deepseek_v2",
       {.drop_tensor = "blk.1.attn_v_b.weight"},
       "tensor 'blk.1.attn_v_b.weight' is missing (its other half is there)"},
      {"deepseek_v2",
       {.set_u32 = {{"deepseek2.expert_gating_func", 4}}},
       "metadata 'deepseek2.expert_gating_func' = 4 is not supported (1 softmax, 2 sigmoid)"},
      {"deepseek_v3",
       {.set_u32 = {{"deepseek2.expert_gating_func", 1}}},
       "metadata 'deepseek2.expert_weights_norm' is true with softmax gating"},
      {"deepseek_v2",
       {.drop_keys = {"deepseek2.attention.kv_lora_rank"}},
       "metadata 'deepseek2.attention.kv_lora_rank' is missing"},
      {"deepseek_v3",
       {.set_u32 = {{"deepseek2.attention.q_lora_rank", 32}}},
       "metadata 'deepseek2.attention.q_lora_rank' = 32 but blk.*.attn_q_a.weight has 64 rows"},
      {"deepseek_v2",
       {.set_u32 = {{"deepseek2.expert_shared_count", 1}}},
       "metadata 'deepseek2.expert_shared_count' = 1 but ffn_gate_shexp has 80 rows"},
      {"glm4_moe",
       {.set_u32 = {{"glm4moe.leading_dense_block_count", 2}}},
       "metadata 'glm4moe.leading_dense_block_count' = 2 but block 1 has ffn_gate_inp.weight"},
      {"glm4_moe",
       {.set_u32 = {{"glm4moe.expert_gating_func", 1}}},
       "metadata 'glm4moe.expert_gating_func' = 1 (softmax); glm4moe routes by sigmoid"},
      {"minimax_m2",
       {.set_u32 = {{"minimax-m2.expert_gating_func", 1}}},
       "metadata 'minimax-m2.expert_gating_func' = 1 (softmax); minimax-m2 routes by sigmoid"},
  };
  int i = 0;
  for (const Case& c : cases) {
    const std::string path = tmp.file(std::string(c.fixture) + std::to_string(i++) + ".gguf");
    ts_test::convert_hf_dir(model_dir(c.fixture), path, c.opt);
    auto m = LoadedModel::load(path);
    ASSERT_FALSE(m.ok()) << c.needle;
    EXPECT_NE(m.error().message.find(c.needle), std::string::npos) << m.error().message;
    EXPECT_NE(m.error().message.find(path), std::string::npos) << m.error().message;
  }
}

// A Q8_0 file (token_embd included, as llama-quantize writes it): the quantized embedding is
// dequantized as it is gathered, experts stream from the file's offsets, and every residency
// gives the same bytes.
TEST(GgufModel, Q8_0FileRunsTheSameInEveryResidency) {
  const std::string dir = model_dir("qwen3_moe");
  TempDir tmp;
  const std::string gguf = tmp.file("q8.gguf");
  ts_test::convert_hf_dir(dir, gguf, {.q8_0 = true});
  auto g = ts::io::read_gguf(gguf);
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(g->tensor("token_embd.weight")->ggml_type, ts::io::kGgmlQ8_0);
  EXPECT_EQ(g->tensor("blk.0.ffn_gate_exps.weight")->ggml_type, ts::io::kGgmlQ8_0);
  EXPECT_EQ(g->tensor("blk.0.ffn_gate_inp.weight")->ggml_type, ts::io::kGgmlF32);
  const std::vector<int> prompt = prompt_of(dir);
  auto f32 = load(dir);
  auto base = load(gguf);
  ASSERT_TRUE(f32 && base);
  const std::vector<float> want = prefill(*base, prompt);
  const double err = max_rel(want, prefill(*f32, prompt));
  EXPECT_LT(err, 0.1) << "Q8_0 weights stay close to F32";
  EXPECT_GT(err, 0.0) << "the weights were quantized";
  using ts::experts::Residency;
  for (auto [res, slots] : {std::pair{Residency::kResident, 0}, std::pair{Residency::kStreamed, 1},
                            std::pair{Residency::kStreamed, 3}}) {
    ts::runtime::LoadOptions opt;
    opt.residency = res;
    opt.streamed.slots_per_layer = std::max(1, slots);
    auto m = load(gguf, opt);
    ASSERT_TRUE(m);
    const std::vector<float> got = prefill(*m, prompt);
    EXPECT_EQ(0, std::memcmp(want.data(), got.data(), want.size() * 4))
        << ts::experts::residency_name(res) << " slots " << slots;
  }
}

// A model split by gguf-split loads from its first file, as one file does; a missing shard
// is named.
TEST(GgufModel, SplitFilesLoadAsOne) {
  const std::string dir = model_dir("qwen2_moe_dense");
  TempDir tmp;
  ts_test::convert_hf_dir(dir, tmp.file("whole.gguf"));
  ts_test::convert_hf_dir(dir, tmp.file("m"), {.split = 3});
  auto a = load(tmp.file("whole.gguf"));
  auto b = load(tmp.file("m-00001-of-00003.gguf"));
  ASSERT_TRUE(a && b);
  const std::vector<int> prompt = prompt_of(dir);
  const std::vector<float> la = prefill(*a, prompt), lb = prefill(*b, prompt);
  EXPECT_EQ(0, std::memcmp(la.data(), lb.data(), la.size() * 4));
  ts::runtime::LoadOptions streamed;
  streamed.residency = ts::experts::Residency::kStreamed;
  streamed.streamed.slots_per_layer = 2;
  auto c = load(tmp.file("m-00001-of-00003.gguf"), streamed);
  ASSERT_TRUE(c);
  const std::vector<float> lc = prefill(*c, prompt);
  EXPECT_EQ(0, std::memcmp(la.data(), lc.data(), la.size() * 4)) << "experts streamed from shards";
  fs::remove(tmp.file("m-00003-of-00003.gguf"));
  auto d = LoadedModel::load(tmp.file("m-00001-of-00003.gguf"));
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.error().message.find("m-00003-of-00003.gguf is missing"), std::string::npos)
      << d.error().message;
  auto e = LoadedModel::load(tmp.file("m-00002-of-00003.gguf"));
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.error().message.find("a split model of 3 files; give its first file"),
            std::string::npos)
      << e.error().message;
}

// A K-quant mix (Q6_K experts, as a Q4_K_M / Q6_K file holds): converted to Q8_0 at load and
// said so; close to the F32 model it was quantized from; not streamable from the file, but a
// pack made from it streams the same bytes.
// Experts in block types the kernels do not read (Q6_K, as in a Q4_K_M file; IQ4_XS) are
// requantized to Q8_0 at load: the note says so, the logits stay near F32, such experts cannot
// stream from the file (named error), and a pack made from the file streams the same logits.
TEST(GgufModel, Q6_KAndIQ4_XSTensorsAreConvertedToQ8_0AtLoad) {
  TempDir tmp;
  const std::string cfg = tmp.file("config.json"), dir = tmp.file("f32");
  std::ofstream(cfg) << R"({"model_type": "qwen3_moe", "hidden_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 300,
    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 256,
    "norm_topk_prob": true, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
    "max_position_embeddings": 128, "tie_word_embeddings": false})";
  ASSERT_EQ(0, std::system((std::string(TS_BINARY) + " synth --config " + cfg + " --out " + dir +
                            " --dtype f32 --seed 3 >/dev/null")
                               .c_str()));
  auto f32 = load(dir);
  ASSERT_TRUE(f32);
  const std::vector<int> prompt = {1, 7, 42, 99, 150, 299, 3, 64};
  const std::vector<float> base = prefill(*f32, prompt);
  struct Kind {
    const char* name;
    uint32_t ggml_type;
    ts_test::ConvertOptions opt;
    double tol;  // 6-bit experts stay closer to F32 than 4-bit ones
  };
  for (const Kind& k : {Kind{"Q6_K", ts::io::kGgmlQ6_K, {.q6_k_experts = true}, 0.05},
                        Kind{"IQ4_XS", 23, {.iq4_xs_experts = true}, 0.2}}) {
    const std::string file = tmp.file(std::string(k.name) + ".gguf");
    ts_test::convert_hf_dir(dir, file, k.opt);
    auto g = ts::io::read_gguf(file);
    ASSERT_TRUE(g.ok());
    EXPECT_EQ(g->tensor("blk.1.ffn_down_exps.weight")->ggml_type, k.ggml_type) << k.name;
    auto m = load(file);
    ASSERT_TRUE(m) << k.name;
    EXPECT_NE(
        m->load_note().find(std::string("converted 6 ") + k.name + " tensor(s) to Q8_0 at load"),
        std::string::npos)
        << m->load_note();
    const std::vector<float> want = prefill(*m, prompt);
    const double err = max_rel(want, base);
    EXPECT_LT(err, k.tol) << k.name << " experts stay close to F32";
    EXPECT_GT(err, 0.0) << k.name;
    ts::runtime::LoadOptions streamed;
    streamed.residency = ts::experts::Residency::kStreamed;
    streamed.streamed.slots_per_layer = 2;
    auto s = LoadedModel::load(file, streamed);
    ASSERT_FALSE(s.ok()) << k.name;
    EXPECT_NE(s.error().message.find("was converted at load"), std::string::npos)
        << s.error().message;
    const std::string pack = tmp.file(std::string("pack_") + k.name);
    ASSERT_EQ(0, std::system((std::string(TS_BINARY) + " pack --model " + file + " --out " + pack +
                              " >/dev/null 2>&1")
                                 .c_str()));
    auto p = load(pack, streamed);
    ASSERT_TRUE(p) << k.name;
    const std::vector<float> got = prefill(*p, prompt);
    EXPECT_EQ(0, std::memcmp(want.data(), got.data(), want.size() * 4)) << k.name;
  }
}

// Damaged headers (bytes changed in the metadata and tensor table of a model with its
// tokenizer) load or fail with an error; they never crash or hang the loader.
TEST(GgufModel, DamagedHeadersAreErrorsNotCrashes) {
  const std::string dir = model_dir("qwen3_moe");
  TempDir tmp;
  const std::string good = tmp.file("good.gguf");
  ts_test::convert_hf_dir(dir, good);
  std::string bytes;
  {
    std::ifstream f(good, std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    bytes = ss.str();
  }
  auto g = ts::io::read_gguf(good);
  ASSERT_TRUE(g.ok());
  const size_t header_end = size_t(g->data_offset);
  std::mt19937 rng(5);
  int errors = 0;
  const std::string bad = tmp.file("bad.gguf");
  for (int trial = 0; trial < 150; ++trial) {
    std::string b = bytes;
    for (int k = 0; k < 1 + trial % 4; ++k) {
      const size_t at = rng() % header_end;
      b[at] = char(trial % 3 == 0 ? 0xFF : rng());
    }
    std::ofstream(bad, std::ios::binary).write(b.data(), std::streamsize(b.size()));
    auto m = LoadedModel::load(bad);
    auto t = ts::tokenizer::Tokenizer::load(bad);
    if (!m.ok()) {
      ++errors;
      EXPECT_NE(m.error().message.find(bad), std::string::npos) << m.error().message;
    }
    (void)t;
  }
  EXPECT_GT(errors, 20) << "most damaged headers must be refused";
}

// Bad files: the error names the file and the key or tensor.
TEST(GgufModel, BadFilesAreNamedErrors) {
  const std::string dir = model_dir("qwen3_moe");
  TempDir tmp;
  struct Case {
    const char* what;
    std::function<void(ts_test::GgufWriter&)> extra;
    std::string needle;
  };
  const std::vector<Case> cases = {
      {"unknown tensor",
       [](ts_test::GgufWriter& w) {
         w.tensor("blk.0.attn_sinks.weight", {4}, 0, std::string(16, 0));
       },
       "tensor 'blk.0.attn_sinks.weight' is not one turbospark knows for architecture 'qwen3moe'"},
      {"Q6_K tensor",
       [](ts_test::GgufWriter& w) {
         w.tensor("blk.9.ffn_up.weight", {256, 1}, 14, std::string(210, 0));
       },
       "names a block past qwen3moe.block_count"},
      {"MXFP4 type",
       [](ts_test::GgufWriter& w) {
         w.tensor("blk.0.ffn_gate.weight", {32, 2}, 39, std::string(34, 0));
       },
       "tensor 'blk.0.ffn_gate.weight' (MXFP4) is a type turbospark neither computes with nor "
       "converts"},
      {"duplicate key", [](ts_test::GgufWriter& w) { w.u32("qwen3moe.block_count", 2); },
       "duplicate metadata 'qwen3moe.block_count'"},
  };
  for (const Case& c : cases) {
    const std::string path = tmp.file(std::string(c.what) + ".gguf");
    ts_test::convert_hf_dir(dir, path, {.extra = c.extra});
    auto m = LoadedModel::load(path);
    ASSERT_FALSE(m.ok()) << c.what;
    EXPECT_NE(m.error().message.find(c.needle), std::string::npos) << m.error().message;
    EXPECT_NE(m.error().message.find(path), std::string::npos) << m.error().message;
  }
  // Architectures and keys.
  auto write = [&](const std::string& name, const std::function<void(ts_test::GgufWriter&)>& f) {
    ts_test::GgufWriter w;
    f(w);
    w.write(tmp.file(name));
    auto m = LoadedModel::load(tmp.file(name));
    return m.ok() ? std::string("loaded") : m.error().message;
  };
  EXPECT_NE(write("gemma.gguf", [](auto& w) { w.str("general.architecture", "gemma3"); })
                .find("general.architecture' = 'gemma3' is not supported"),
            std::string::npos);
  EXPECT_NE(write("dense.gguf", [](auto& w) { w.str("general.architecture", "llama"); })
                .find("a dense model"),
            std::string::npos);
  EXPECT_NE(write("nokey.gguf",
                  [](auto& w) {
                    w.str("general.architecture", "qwen3moe");
                    w.u32("qwen3moe.block_count", 2);
                  })
                .find("metadata 'qwen3moe.embedding_length' is missing"),
            std::string::npos);
  EXPECT_NE(
      write("yarn.gguf",
            [](auto& w) {
              w.str("general.architecture", "qwen3moe");
              for (const char* k : {"embedding_length", "block_count", "attention.head_count"})
                w.u32(std::string("qwen3moe.") + k, 64);
              w.str("qwen3moe.rope.scaling.type", "yarn");
            })
          .find("rope.scaling.type' = 'yarn' is not supported"),
      std::string::npos);
}

std::string read_all(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::vector<std::string> corpus() {
  std::vector<std::string> out;
  std::stringstream ss(read_all(ts_test::data_dir() / "tokenizer" / "corpus.jsonl"));
  for (std::string line; std::getline(ss, line);)
    if (!line.empty()) out.push_back(nlohmann::json::parse(line).get<std::string>());
  return out;
}

fs::path tokenizer_data() {
  if (const char* env = std::getenv("TS_TOKENIZER_DATA")) return env;
  return ts_test::data_dir().parent_path() / "build-data" / "tokenizers";
}

// The tokenizer rebuilt from GGUF metadata (byte-level BPE with merges, or SentencePiece with
// scores) encodes the whole corpus, with and without special tokens, and decodes, as the
// tokenizer.json it was written from (itself checked against Hugging Face in test_tokenizer).
class GgufTokenizer : public ::testing::TestWithParam<std::string> {};

TEST_P(GgufTokenizer, MatchesItsTokenizerJson) {
  const fs::path src = tokenizer_data() / GetParam();
  ASSERT_TRUE(fs::exists(src / "tokenizer.json")) << "run scripts/fetch_tokenizer_data.sh";
  TempDir tmp;
  const std::string path = tmp.file("tok.gguf");
  ts_test::GgufWriter w;
  w.str("general.architecture", "qwen3moe");
  ts_test::gguf_detail::add_tokenizer(w, src, "qwen2");
  w.write(path);
  auto a = ts::tokenizer::Tokenizer::load(src.string());
  auto b = ts::tokenizer::Tokenizer::load(path);
  ASSERT_TRUE(a.ok()) << a.error().message;
  ASSERT_TRUE(b.ok()) << b.error().message;
  EXPECT_EQ((*a)->vocab_size(), (*b)->vocab_size());
  EXPECT_EQ((*a)->bos_id(), (*b)->bos_id());
  for (int id : (*a)->eos_ids())
    EXPECT_NE(std::find((*b)->eos_ids().begin(), (*b)->eos_ids().end(), id), (*b)->eos_ids().end())
        << "end-of-generation id " << id;
  if (auto end = (*b)->token_to_id("<|endoftext|>"); end && (*b)->is_special(*end)) {
    EXPECT_NE(std::find((*b)->eos_ids().begin(), (*b)->eos_ids().end(), *end),
              (*b)->eos_ids().end())
        << "a control <|endoftext|> ends generation, as llama.cpp takes it";
  }
  int mismatches = 0;
  for (const std::string& s : corpus())
    for (bool special : {false, true}) {
      const std::vector<int> ia = (*a)->encode(s, special), ib = (*b)->encode(s, special);
      if (ia != ib && ++mismatches <= 5) ADD_FAILURE() << "add_special=" << special << ": " << s;
      if (ia == ib) {
        EXPECT_EQ((*a)->decode(ia, false), (*b)->decode(ib, false)) << s;
      }
    }
  EXPECT_EQ(mismatches, 0);
  // The chat template comes along when the tokenizer_config.json had one.
  if (read_all(src / "tokenizer_config.json").find("\"chat_template\"") != std::string::npos) {
    auto ta = ts::tokenizer::ChatTemplate::load(src.string());
    auto tb = ts::tokenizer::ChatTemplate::load(path);
    ASSERT_TRUE(ta.ok()) << ta.error().message;
    ASSERT_TRUE(tb.ok()) << tb.error().message;
    EXPECT_EQ(ta->source(), tb->source());
    EXPECT_EQ(ta->special_tokens().eos, tb->special_tokens().eos);
    const auto messages = nlohmann::ordered_json::parse(
        R"([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2?"}])");
    auto ra = ta->render(messages, nullptr, true);
    auto rb = tb->render(messages, nullptr, true);
    ASSERT_TRUE(ra.ok()) << ra.error().message;
    ASSERT_TRUE(rb.ok()) << rb.error().message;
    EXPECT_EQ(*ra, *rb);
  }
}

INSTANTIATE_TEST_SUITE_P(Tokenizers, GgufTokenizer, ::testing::Values("qwen3", "llama2"));

TEST(GgufTokenizerErrors, MissingOrUnsupportedVocabularyIsNamed) {
  TempDir tmp;
  auto msg = [&](const std::string& name, const std::function<void(ts_test::GgufWriter&)>& f) {
    ts_test::GgufWriter w;
    w.str("general.architecture", "qwen3moe");
    f(w);
    w.write(tmp.file(name));
    auto t = ts::tokenizer::Tokenizer::load(tmp.file(name));
    return t.ok() ? std::string("loaded") : t.error().message;
  };
  // A three-token byte-level vocabulary with the given merges.
  auto gpt2 = [](ts_test::GgufWriter& w, std::vector<std::string> merges) {
    w.str("tokenizer.ggml.model", "gpt2");
    w.strs("tokenizer.ggml.tokens", {"a", "b", "ab"});
    w.strs("tokenizer.ggml.merges", merges);
  };
  EXPECT_NE(msg("none.gguf", [](auto&) {}).find("metadata 'tokenizer.ggml.model' is missing"),
            std::string::npos);
  EXPECT_NE(msg("bert.gguf", [](auto& w) { w.str("tokenizer.ggml.model", "bert"); })
                .find("'tokenizer.ggml.model' = 'bert' is not supported"),
            std::string::npos);
  EXPECT_NE(msg("pre.gguf",
                [&](auto& w) {
                  gpt2(w, {"a b"});
                  w.str("tokenizer.ggml.pre", "chatglm-bpe");
                })
                .find("'tokenizer.ggml.pre' = 'chatglm-bpe' is not supported"),
            std::string::npos);
  EXPECT_NE(msg("merge.gguf", [&](auto& w) { gpt2(w, {"ab"}); })
                .find("'tokenizer.ggml.merges' entry 0 'ab' is not \"left right\""),
            std::string::npos);
  EXPECT_NE(msg("eos.gguf",
                [&](auto& w) {
                  gpt2(w, {"a b"});
                  w.u32("tokenizer.ggml.eos_token_id", 7);
                })
                .find("'tokenizer.ggml.eos_token_id' = 7 is not a token id (the vocabulary has 3)"),
            std::string::npos);
}

// The CLI takes a .gguf wherever it takes a model directory: same generated ids, and text in
// and out through the file's own tokenizer.
TEST(GgufCli, GenerateAndRunFromAGgufFile) {
  const std::string dir = model_dir("qwen3_moe");
  TempDir tmp;
  const std::string gguf = tmp.file("m.gguf");
  ts_test::convert_hf_dir(dir, gguf);
  auto run = [&](const std::string& args) {
    const std::string out = tmp.file("out"), err = tmp.file("err");
    const int st =
        std::system((std::string(TS_BINARY) + " " + args + " >" + out + " 2>" + err).c_str());
    return std::tuple{WIFEXITED(st) ? WEXITSTATUS(st) : -1, read_all(out), read_all(err)};
  };
  auto [c1, o1, e1] = run("generate --model " + dir + " --tokens 1,2,3,4,5 -n 12");
  auto [c2, o2, e2] = run("generate --model " + gguf + " --tokens 1,2,3,4,5 -n 12");
  ASSERT_EQ(c1, 0) << e1;
  ASSERT_EQ(c2, 0) << e2;
  EXPECT_EQ(o1, o2);
  auto [c3, o3, e3] = run("run --model " + dir + " --prompt 'the cat is on the mat' -n 8");
  auto [c4, o4, e4] = run("run --model " + gguf + " --prompt 'the cat is on the mat' -n 8");
  ASSERT_EQ(c3, 0) << e3;
  ASSERT_EQ(c4, 0) << e4;
  EXPECT_EQ(o3, o4);
  EXPECT_FALSE(o4.empty());
  auto [c5, o5, e5] = run("inspect --model " + gguf);
  EXPECT_EQ(c5, 0) << e5;
  EXPECT_NE(o5.find("qwen3_moe"), std::string::npos) << o5;
  // A pack made from the GGUF (its experts re-laid in 4096-byte blobs) generates the same.
  const std::string q8 = tmp.file("q8.gguf");
  ts_test::convert_hf_dir(dir, q8, {.q8_0 = true});
  auto [p1, po1, pe1] = run("pack --model " + q8 + " --out " + tmp.file("pack"));
  ASSERT_EQ(p1, 0) << pe1;
  auto [p2, po2, pe2] = run("generate --model " + q8 + " --tokens 1,2,3,4,5 -n 12");
  auto [p3, po3, pe3] =
      run("generate --model " + tmp.file("pack") +
          " --tokens 1,2,3,4,5 -n 12 --residency streamed --expert-cache-slots 2");
  ASSERT_EQ(p2, 0) << pe2;
  ASSERT_EQ(p3, 0) << pe3;
  EXPECT_EQ(po2, po3);
  // The pack carries the tokenizer (rebuilt from the GGUF's metadata): text in and out as from
  // the GGUF; and a pack of the checkpoint directory carries its tokenizer files.
  auto [t1, to1, te1] = run("run --model " + q8 + " --prompt 'the cat is on the mat' -n 8");
  auto [t2, to2, te2] =
      run("run --model " + tmp.file("pack") + " --prompt 'the cat is on the mat' -n 8");
  ASSERT_EQ(t1, 0) << te1;
  ASSERT_EQ(t2, 0) << te2;
  EXPECT_EQ(to1, to2);
  auto [t3, to3, te3] = run("pack --model " + dir + " --out " + tmp.file("dirpack"));
  ASSERT_EQ(t3, 0) << te3;
  auto [t4, to4, te4] =
      run("run --model " + tmp.file("dirpack") + " --prompt 'the cat is on the mat' -n 8");
  ASSERT_EQ(t4, 0) << te4;
  EXPECT_EQ(to4, o3);
  auto [t5, to5, te5] = run("verify " + tmp.file("dirpack"));
  EXPECT_EQ(t5, 0) << te5;
  // Streamed straight from the GGUF file's tensor offsets; O_DIRECT needs a pack's 4096-byte
  // aligned blobs (GGUF aligns to 32), which the error says.
  auto [p4, po4, pe4] =
      run("generate --model " + q8 +
          " --tokens 1,2,3,4,5 -n 12 --residency streamed --expert-cache-slots 1");
  ASSERT_EQ(p4, 0) << pe4;
  EXPECT_EQ(po2, po4);
  auto [p5, po5, pe5] =
      run("generate --model " + q8 + " --tokens 1,2,3,4,5 -n 12 --residency streamed --direct-io");
  EXPECT_EQ(p5, 2);
  EXPECT_NE(pe5.find("q8.gguf is not aligned; make a pack"), std::string::npos) << pe5;
  auto [c6, o6, e6] = run("generate --model " + tmp.file("missing.gguf") + " --tokens 1 -n 1");
  EXPECT_EQ(c6, 2);
  EXPECT_NE(e6.find("missing.gguf"), std::string::npos) << e6;
  auto [c7, o7, e7] = run("generate --model " + dir + "/model.safetensors --tokens 1 -n 1");
  EXPECT_EQ(c7, 2);
  EXPECT_NE(e7.find("model.safetensors is neither a model directory nor a GGUF file"),
            std::string::npos)
      << e7;
}

}  // namespace

namespace {

// Not a check: writes every fixture as F32 and Q8_0 GGUF files into $TS_GGUF_OUT, for runs
// elsewhere (tests/gpu/run.sh compares CUDA against the CPU on them; a transformers script
// can load them). Run with --gtest_also_run_disabled_tests --gtest_filter='*WriteFixtureGgufs'.
TEST(GgufFiles, DISABLED_WriteFixtureGgufs) {
  const char* out = std::getenv("TS_GGUF_OUT");
  ASSERT_TRUE(out && *out) << "set TS_GGUF_OUT to a directory";
  fs::create_directories(out);
  for (const std::string& name : gguf_fixture_names()) {
    const std::string dir = model_dir(name);
    ts_test::convert_hf_dir(dir, (fs::path(out) / (name + ".gguf")).string());
    ts_test::convert_hf_dir(dir, (fs::path(out) / (name + ".q8_0.gguf")).string(), {.q8_0 = true});
  }
}

}  // namespace
