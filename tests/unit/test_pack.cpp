// Packs: logits from a pack are byte-identical to the HF directory's in every residency
// mode (O_DIRECT too); verify catches a flipped byte; opening a truncated pack fails with a
// message naming the file; a future format version is refused.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/thread_pool.h"
#include "runtime/model.h"
#include "runtime/session.h"

namespace {

namespace fs = std::filesystem;

struct CmdResult {
  int code;
  std::string err;
};

class Pack : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/ts_pack_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    tmp_ = tmpl;
    src_ = (fs::path(TS_TEST_DATA_DIR) / "models" / "qwen2_moe_dense").string();
    pack_ = (tmp_ / "pack").string();
    ASSERT_EQ(run("pack --model " + src_ + " --out " + pack_).code, 0);
  }
  void TearDown() override { fs::remove_all(tmp_); }
  CmdResult run(const std::string& args) {
    std::string err = (tmp_ / "err").string();
    int st = std::system((std::string(TS_BINARY) + " " + args + " >/dev/null 2>" + err).c_str());
    std::ifstream f(err);
    std::stringstream ss;
    ss << f.rdbuf();
    return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, ss.str()};
  }
  std::vector<float> logits(const std::string& dir, const ts::runtime::LoadOptions& opt) {
    auto m = ts::runtime::LoadedModel::load(dir, opt);
    EXPECT_TRUE(m.ok()) << m.error().message;
    if (!m.ok()) return {};
    ts::ThreadPool pool(2);
    ts::runtime::Session s(*m.value(), pool, {.n_ctx = 64});
    std::vector<int> prompt;
    for (int i = 0; i < 40; ++i) prompt.push_back((i * 37 + 11) % 512);
    std::vector<float> out;
    EXPECT_TRUE(s.forward(prompt, &out).ok());
    return out;
  }
  fs::path tmp_;
  std::string src_, pack_;
};

TEST_F(Pack, LogitsByteIdenticalToSourceInEveryMode) {
  const std::vector<float> ref = logits(src_, {});
  ASSERT_FALSE(ref.empty());
  using ts::experts::Residency;
  for (Residency r : {Residency::kMapped, Residency::kResident, Residency::kStreamed}) {
    for (bool direct : {false, true}) {
      if (direct && r != Residency::kStreamed) continue;
      ts::runtime::LoadOptions opt;
      opt.residency = r;
      opt.streamed.slots_per_layer = 1;
      opt.streamed.direct_io = direct;
      std::vector<float> got = logits(pack_, opt);
      ASSERT_EQ(got.size(), ref.size());
      EXPECT_EQ(0, std::memcmp(got.data(), ref.data(), ref.size() * 4))
          << ts::experts::residency_name(r) << (direct ? " O_DIRECT" : "");
    }
  }
}

// gpt-oss's stacked experts, split per expert at load, are packed per expert (their biases
// with the dense weights), so its pack streams: logits byte-identical to the checkpoint's in
// every residency mode.
TEST_F(Pack, GptOssPackIsByteIdenticalInEveryMode) {
  const std::string src = (fs::path(TS_TEST_DATA_DIR) / "models" / "gpt_oss").string();
  const std::string pack = (tmp_ / "gpt_oss").string();
  const CmdResult made = run("pack --model " + src + " --out " + pack);
  ASSERT_EQ(made.code, 0) << made.err;
  EXPECT_NE(made.err.find("split per expert"), std::string::npos) << made.err;
  const std::vector<float> ref = logits(src, {});
  ASSERT_FALSE(ref.empty());
  using ts::experts::Residency;
  for (Residency r : {Residency::kMapped, Residency::kResident, Residency::kStreamed}) {
    ts::runtime::LoadOptions opt;
    opt.residency = r;
    opt.streamed.slots_per_layer = 2;
    std::vector<float> got = logits(pack, opt);
    ASSERT_EQ(got.size(), ref.size());
    EXPECT_EQ(0, std::memcmp(got.data(), ref.data(), ref.size() * 4))
        << ts::experts::residency_name(r);
  }
}

// A read that fails while streaming (an expert file cut short after the pack was opened) is
// an error naming the expert, layer and file, never garbage; the failed batch leaves no slot
// claiming an expert it does not hold, so once the file is whole again the same model gives
// the resident logits byte for byte. Runs with reads overlapping compute (several slots).
TEST_F(Pack, StreamedReadFailureIsAClearErrorAndTheCacheRecovers) {
  const std::vector<float> ref = logits(src_, {});
  ASSERT_FALSE(ref.empty());
  ts::runtime::LoadOptions opt;
  opt.residency = ts::experts::Residency::kStreamed;
  opt.streamed.slots_per_layer = 3;
  auto m = ts::runtime::LoadedModel::load(pack_, opt);
  ASSERT_TRUE(m.ok()) << m.error().message;
  std::string victim;
  for (const auto& e : fs::directory_iterator(pack_))
    if (e.path().filename().string().rfind("experts-", 0) == 0 &&
        (victim.empty() || e.path().string() < victim))
      victim = e.path().string();
  ASSERT_FALSE(victim.empty());
  std::string bytes;
  {
    std::ifstream f(victim, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(f), {});
  }
  fs::resize_file(victim, 0);  // same inode: the store's open descriptor sees it
  std::vector<int> prompt;
  for (int i = 0; i < 40; ++i) prompt.push_back((i * 37 + 11) % 512);
  ts::ThreadPool pool(2);
  {
    ts::runtime::Session s(*m.value(), pool, {.n_ctx = 64});
    std::vector<float> out;
    ts::Status st = s.forward(prompt, &out);
    ASSERT_FALSE(st.ok());
    EXPECT_NE(st.error().message.find("reading expert"), std::string::npos) << st.error().message;
    EXPECT_NE(st.error().message.find(victim), std::string::npos) << st.error().message;
    EXPECT_NE(st.error().message.find("unexpected end of file"), std::string::npos) << st.error().message;
  }
  {
    std::ofstream f(victim, std::ios::binary | std::ios::in | std::ios::out);
    f.write(bytes.data(), std::streamsize(bytes.size()));
  }
  ts::runtime::Session s(*m.value(), pool, {.n_ctx = 64});
  std::vector<float> out;
  ASSERT_TRUE(s.forward(prompt, &out).ok());
  ASSERT_EQ(out.size(), ref.size());
  EXPECT_EQ(0, std::memcmp(out.data(), ref.data(), ref.size() * 4));
}

TEST_F(Pack, VerifyPassesThenCatchesAFlippedByte) {
  EXPECT_EQ(run("verify " + pack_).code, 0);
  fs::path f = fs::path(pack_) / "experts-L002.bin";
  {
    std::fstream io(f, std::ios::in | std::ios::out | std::ios::binary);
    io.seekg(1000);
    char c;
    io.read(&c, 1);
    c = char(c ^ 0x10);
    io.seekp(1000);
    io.write(&c, 1);
  }
  CmdResult r = run("verify " + pack_);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("experts-L002.bin"), std::string::npos) << r.err;
}

TEST_F(Pack, TruncatedPackFailsToOpen) {
  fs::path f = fs::path(pack_) / "experts-L000.bin";
  fs::resize_file(f, fs::file_size(f) - 4096);
  CmdResult r = run("inspect --model " + pack_);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("experts-L000.bin"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("truncated"), std::string::npos) << r.err;
}

TEST_F(Pack, FutureFormatVersionIsRefused) {
  fs::path mf = fs::path(pack_) / "manifest.json";
  nlohmann::json j = nlohmann::json::parse(std::ifstream(mf));
  j["format_version"] = 99;
  std::ofstream(mf) << j.dump();
  CmdResult r = run("inspect --model " + pack_);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("format_version"), std::string::npos) << r.err;
}

// The streamed source places blobs by the manifest's layer and offsets fields: a manifest that
// disagrees with its own tensor names or the config is refused, never read into the wrong layer.
TEST_F(Pack, ManifestExpertLayersThatDisagreeAreRefused) {
  fs::path mf = fs::path(pack_) / "manifest.json";
  const nlohmann::json good = nlohmann::json::parse(std::ifstream(mf));
  ASSERT_GE(good["expert_layers"].size(), 2u);
  auto expect_refused = [&](const char* what, auto edit, std::vector<std::string> needles) {
    nlohmann::json j = good;
    edit(j["expert_layers"]);
    std::ofstream(mf) << j.dump();
    CmdResult r = run("logits --model " + pack_ + " --tokens 1,2 --out " +
                      (tmp_ / "o.npy").string() + " --residency streamed --expert-cache-slots 2");
    EXPECT_EQ(r.code, 2) << what << ": " << r.err;
    for (const std::string& n : needles)
      EXPECT_NE(r.err.find(n), std::string::npos) << what << ": " << r.err;
  };
  expect_refused("swapped", [](nlohmann::json& l) { std::swap(l[0]["layer"], l[1]["layer"]); },
                 {"manifest.json", "expert_layers[0]", "is not of layer"});
  expect_refused("out of range", [](nlohmann::json& l) { l[1]["layer"] = 4098; },
                 {"expert_layers[1].layer = 4098"});
  expect_refused("twice", [&](nlohmann::json& l) { l[1] = l[0]; }, {"expert_layers[1]", "twice"});
  expect_refused("offsets",
                 [](nlohmann::json& l) { l[0]["offsets"].erase(l[0]["offsets"].size() - 1); },
                 {"expert_layers[0].offsets"});
  std::ofstream(mf) << good.dump();
  EXPECT_EQ(run("logits --model " + pack_ + " --tokens 1,2 --out " + (tmp_ / "o.npy").string() +
                " --residency streamed --expert-cache-slots 2")
                .code,
            0);
}

}  // namespace
