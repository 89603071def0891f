// Quantized packs (`turbospark pack --experts-quant / --dense-quant`): which tensors are
// quantized and which fall back, byte-identical logits across residency modes, and the
// accuracy gate: next-token distributions of a quantized pack against the unquantized
// model (mean KL(p_float || p_quant) <= 0.01 for Q8_0, <= 0.05 for Q4_K; top-1 agreement
// printed), on a synthesized checkpoint whose every matrix quantizes and on real fixtures.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/thread_pool.h"
#include "io/safetensors.h"
#include "runtime/model.h"
#include "runtime/session.h"

namespace {

namespace fs = std::filesystem;
using ts::DType;

class QuantPack : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/ts_qpack_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    tmp_ = tmpl;
  }
  void TearDown() override { fs::remove_all(tmp_); }

  // Runs the binary; returns its exit code (stderr in tmp_/err).
  int run(const std::string& args) {
    std::string cmd =
        std::string(TS_BINARY) + " " + args + " >/dev/null 2>" + (tmp_ / "err").string();
    int st = std::system(cmd.c_str());
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  }
  std::string err() {
    std::ifstream f(tmp_ / "err");
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  }
  static std::string fixture(const std::string& name) {
    return (fs::path(TS_TEST_DATA_DIR) / "models" / name).string();
  }
  std::string pack(const std::string& src, const std::string& name, const std::string& flags) {
    std::string out = (tmp_ / name).string();
    EXPECT_EQ(run("pack --model " + src + " --out " + out + " " + flags), 0) << err();
    return out;
  }
  static nlohmann::json manifest(const std::string& pack) {
    return nlohmann::json::parse(std::ifstream(fs::path(pack) / "manifest.json"));
  }
  static std::vector<int> prompt(int n, int vocab) {
    std::vector<int> p;
    for (int i = 0; i < n; ++i) p.push_back((i * 37 + 11) % vocab);
    return p;
  }
  // Logits of every prompt position; prefill_chunk 1 runs the decode (matvec) path.
  static std::vector<float> logits(const std::string& dir, const ts::runtime::LoadOptions& opt,
                                   const std::vector<int>& tokens, int prefill_chunk = 256) {
    auto m = ts::runtime::LoadedModel::load(dir, opt);
    EXPECT_TRUE(m.ok()) << m.error().message;
    if (!m.ok()) return {};
    ts::ThreadPool pool(2);
    ts::runtime::Session s(*m.value(), pool, {.n_ctx = 64, .prefill_chunk = prefill_chunk});
    std::vector<float> out;
    EXPECT_TRUE(s.forward(tokens, &out).ok());
    return out;
  }

  fs::path tmp_;
};

TEST_F(QuantPack, ExpertsQuantizeWhereRowsAreWholeBlocksAndFallBackElsewhere) {
  // qwen3_moe: d_model 96 (3 blocks of 32), d_expert 48 (not whole blocks): gate and up
  // quantize, down keeps the source dtype.
  const std::string src = fixture("qwen3_moe");
  const std::string p = pack(src, "q8", "--experts-quant q8_0");
  nlohmann::json m = manifest(p);
  EXPECT_EQ(m["experts_quant"], "q8_0");
  EXPECT_EQ(m["dense_quant"], "none");
  auto set = ts::io::TensorSet::open_dir(src);
  ASSERT_TRUE(set.ok());
  const std::string src_dtype(
      ts::dtype_name(set.value()->find("model.layers.0.mlp.experts.0.down_proj.weight")->dtype));
  ASSERT_FALSE(m["expert_layers"].empty());
  for (const auto& l : m["expert_layers"]) {
    EXPECT_EQ(l["gate"]["dtype"], "Q8_0");
    EXPECT_EQ(l["up"]["dtype"], "Q8_0");
    EXPECT_EQ(l["down"]["dtype"], src_dtype);
    EXPECT_EQ(l["gate"]["bytes"], 48 * 3 * 34);  // [48, 96]: 3 blocks per row
  }
  // Q4_K needs 256-weight rows: nothing here quantizes, and the pack still runs.
  const std::string p4 = pack(src, "q4", "--experts-quant q4_k");
  // The manifest is a named local: a range-for over a member of a temporary dangles.
  const nlohmann::json m4 = manifest(p4);
  for (const auto& l : m4["expert_layers"]) EXPECT_EQ(l["gate"]["dtype"], src_dtype);
  EXPECT_EQ(run("verify " + p), 0) << err();
  EXPECT_FALSE(logits(p, {}, prompt(8, 512)).empty());
}

TEST_F(QuantPack, DenseQuantCoversProjectionsAndHeadOnly) {
  const std::string src = fixture("qwen2_moe_dense");  // shared expert, dense layer, biases
  const std::string p = pack(src, "q8d", "--experts-quant q8_0 --dense-quant q8_0");
  EXPECT_EQ(manifest(p)["dense_quant"], "q8_0");
  auto set = ts::io::TensorSet::open_file(p + "/dense.safetensors");
  ASSERT_TRUE(set.ok()) << set.error().message;
  int quantized = 0;
  for (const auto& [name, v] : set.value()->tensors()) {
    const bool want = name.find("_proj.weight") != std::string::npos || name == "lm_head.weight";
    EXPECT_EQ(v.dtype == DType::kQ8_0, want) << name << " is " << ts::dtype_name(v.dtype);
    quantized += v.dtype == DType::kQ8_0;
  }
  EXPECT_GT(quantized, 10);
  EXPECT_EQ(set.value()->find("model.embed_tokens.weight")->dtype,
            ts::io::TensorSet::open_dir(src).value()->find("model.embed_tokens.weight")->dtype);
}

TEST_F(QuantPack, BadQuantFlagIsAnError) {
  EXPECT_EQ(run("pack --model " + fixture("olmoe") + " --out " + (tmp_ / "x").string() +
                " --experts-quant q5_k"),
            2);
  EXPECT_NE(err().find("--experts-quant q5_k"), std::string::npos) << err();
}

// Views carry their dtype, so every residency mode computes on the same quantized bytes.
TEST_F(QuantPack, Q8_0LogitsByteIdenticalAcrossResidencyModes) {
  const std::string p = pack(fixture("qwen2_moe_dense"), "q8", "--experts-quant q8_0");
  const nlohmann::json m = manifest(p);
  for (const auto& l : m["expert_layers"]) ASSERT_EQ(l["down"]["dtype"], "Q8_0");
  const std::vector<int> tokens = prompt(40, 512);
  using ts::experts::Residency;
  const std::vector<float> ref = logits(p, {.residency = Residency::kMapped}, tokens);
  ASSERT_FALSE(ref.empty());
  for (Residency r : {Residency::kResident, Residency::kStreamed}) {
    for (bool direct : {false, true}) {
      if (direct && r != Residency::kStreamed) continue;
      ts::runtime::LoadOptions opt;
      opt.residency = r;
      opt.streamed.slots_per_layer = 1;
      opt.streamed.direct_io = direct;
      std::vector<float> got = logits(p, opt, tokens);
      ASSERT_EQ(got.size(), ref.size());
      EXPECT_EQ(0, std::memcmp(got.data(), ref.data(), ref.size() * 4))
          << ts::experts::residency_name(r) << (direct ? " O_DIRECT" : "");
    }
  }
}

// ---- accuracy gate ---------------------------------------------------------------------

struct Agreement {
  double mean_kl = 0;  // mean over positions of KL(p_ref || p_quant), nats
  double max_kl = 0;
  double top1 = 0;  // fraction of positions with the same argmax
};

Agreement compare(const std::vector<float>& ref, const std::vector<float>& got, int vocab) {
  Agreement a;
  const size_t n = ref.size() / size_t(vocab);
  auto log_softmax = [vocab](const float* z, std::vector<double>& out) {
    double mx = z[0];
    for (int i = 0; i < vocab; ++i) mx = std::max(mx, double(z[i]));
    double s = 0;
    for (int i = 0; i < vocab; ++i) s += std::exp(double(z[i]) - mx);
    out.resize(size_t(vocab));
    for (int i = 0; i < vocab; ++i) out[size_t(i)] = double(z[i]) - mx - std::log(s);
  };
  std::vector<double> lp, lq;
  for (size_t t = 0; t < n; ++t) {
    const float* zr = &ref[t * size_t(vocab)];
    const float* zq = &got[t * size_t(vocab)];
    log_softmax(zr, lp);
    log_softmax(zq, lq);
    double kl = 0;
    for (int i = 0; i < vocab; ++i) kl += std::exp(lp[size_t(i)]) * (lp[size_t(i)] - lq[size_t(i)]);
    a.mean_kl += kl / double(n);
    a.max_kl = std::max(a.max_kl, kl);
    a.top1 += (std::max_element(zr, zr + vocab) - zr == std::max_element(zq, zq + vocab) - zq) /
              double(n);
  }
  return a;
}

class QuantAccuracy : public QuantPack {
 protected:
  // Packs `src` with `flags`, compares 40 prompt positions through prefill (matmul) and
  // decode (matvec) against the source model, prints and returns the worse of the two.
  Agreement gate(const std::string& src, const std::string& label, const std::string& flags,
                 double max_mean_kl) {
    auto m = ts::runtime::LoadedModel::load(src);
    EXPECT_TRUE(m.ok());
    if (!m.ok()) return {};
    const int vocab = m.value()->hp().vocab;
    const std::vector<int> tokens = prompt(40, vocab);
    const std::string p = pack(src, "pack" + std::to_string(n_packs_++), flags);
    Agreement worst{0, 0, 1};
    for (int chunk : {256, 1}) {
      const std::vector<float> ref = logits(src, {}, tokens, chunk);
      const std::vector<float> got = logits(p, {}, tokens, chunk);
      EXPECT_EQ(ref.size(), got.size());
      if (ref.size() != got.size() || ref.empty()) return {};
      Agreement a = compare(ref, got, vocab);
      std::printf("[ accuracy ] %-28s %-36s %-7s mean KL %.2e  max KL %.2e  top-1 %.3f\n",
                  label.c_str(), flags.c_str(), chunk == 1 ? "decode" : "prefill", a.mean_kl,
                  a.max_kl, a.top1);
      EXPECT_LE(a.mean_kl, max_mean_kl) << label << " " << flags;
      EXPECT_GT(a.mean_kl, 0.0) << "quantization changed nothing: was anything quantized?";
      worst = {std::max(worst.mean_kl, a.mean_kl), std::max(worst.max_kl, a.max_kl),
               std::min(worst.top1, a.top1)};
    }
    return worst;
  }
  // A bf16 qwen3_moe checkpoint whose every matrix has whole 256-weight rows.
  std::string synth_model() {
    const fs::path cfg = tmp_ / "synth_config.json";
    std::ofstream(cfg) << R"({
      "model_type": "qwen3_moe", "hidden_size": 256, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 512,
      "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 256,
      "intermediate_size": 512, "norm_topk_prob": true, "rms_norm_eps": 1e-06,
      "rope_theta": 1000000.0, "max_position_embeddings": 1024, "tie_word_embeddings": false
    })";
    const std::string out = (tmp_ / "synth").string();
    EXPECT_EQ(run("synth --config " + cfg.string() + " --out " + out + " --dtype bf16 --seed 7"), 0)
        << err();
    return out;
  }
  int n_packs_ = 0;
};

TEST_F(QuantAccuracy, SynthesizedQwen3Moe) {
  const std::string src = synth_model();
  gate(src, "synth-qwen3moe-d256", "--experts-quant q8_0", 0.01);
  gate(src, "synth-qwen3moe-d256", "--experts-quant q8_0 --dense-quant q8_0", 0.01);
  gate(src, "synth-qwen3moe-d256", "--experts-quant q4_k", 0.05);
  gate(src, "synth-qwen3moe-d256", "--experts-quant q4_k --dense-quant q4_k", 0.05);
}

// Fixtures whose experts are whole 32-weight rows (mixtral_gqa: 64 / 128; olmoe: 64 / 64;
// qwen2_moe_dense: 64 / 32).
TEST_F(QuantAccuracy, FixturesQ8_0) {
  for (const char* name : {"mixtral_gqa", "olmoe", "qwen2_moe_dense"}) {
    gate(fixture(name), name, "--experts-quant q8_0", 0.01);
    gate(fixture(name), name, "--experts-quant q8_0 --dense-quant q8_0", 0.01);
  }
}

}  // namespace
