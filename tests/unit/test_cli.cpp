// The CLI contract and its bad-input behaviour, through the real binary: one error line
// naming the file / key / tensor, exit code 2, and no partial output file.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "io/npy.h"

namespace {

namespace fs = std::filesystem;

struct RunResult {
  int code;
  std::string out, err;
};

std::string read_all(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

class Cli : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/ts_cli_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    tmp_ = tmpl;
    model_ = (fs::path(TS_TEST_DATA_DIR) / "models" / "qwen3_moe").string();
  }
  void TearDown() override { fs::remove_all(tmp_); }

  RunResult run(const std::string& args) {
    std::string cmd = std::string(TS_BINARY) + " " + args + " >" + (tmp_ / "stdout").string() +
                      " 2>" + (tmp_ / "stderr").string();
    int st = std::system(cmd.c_str());
    RunResult r{WIFEXITED(st) ? WEXITSTATUS(st) : -1, read_all(tmp_ / "stdout"),
                read_all(tmp_ / "stderr")};
    return r;
  }
  // A copy of the fixture model to damage.
  fs::path copy_model() {
    fs::path d = tmp_ / "model";
    fs::create_directories(d);
    for (const char* f : {"config.json", "model.safetensors"}) fs::copy_file(fs::path(model_) / f, d / f);
    return d;
  }
  void expect_error(const RunResult& r, const std::string& needle) {
    EXPECT_EQ(r.code, 2) << r.err;
    EXPECT_NE(r.err.find(needle), std::string::npos) << "stderr: " << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << "one line: " << r.err;
  }

  fs::path tmp_;
  std::string model_;
};

TEST_F(Cli, LogitsWritesNpyOfShapeTokensByVocab) {
  fs::path out = tmp_ / "l.npy";
  RunResult r = run("logits --model " + model_ + " --tokens 5,6,7 --out " + out.string());
  ASSERT_EQ(r.code, 0) << r.err;
  auto a = ts::io::read_npy_f32(out.string());
  ASSERT_TRUE(a.ok()) << a.error().message;
  EXPECT_EQ(a->shape, (std::vector<int64_t>{3, 512}));
}

// --prefill-chunk N: the prompt in chunks of N tokens gives the logits of one chunk (to
// rounding); a chunk of 0 tokens is a one-line error naming the flag.
TEST_F(Cli, PrefillChunkFlag) {
  const std::string tokens = " --tokens 5,6,7,8,9,10,11 --out ";
  RunResult whole = run("logits --model " + model_ + tokens + (tmp_ / "a.npy").string());
  RunResult chunked =
      run("logits --model " + model_ + tokens + (tmp_ / "b.npy").string() + " --prefill-chunk 3");
  ASSERT_EQ(whole.code, 0) << whole.err;
  ASSERT_EQ(chunked.code, 0) << chunked.err;
  auto a = ts::io::read_npy_f32((tmp_ / "a.npy").string());
  auto b = ts::io::read_npy_f32((tmp_ / "b.npy").string());
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_EQ(a->data.size(), b->data.size());
  float num = 0, den = 0;
  for (size_t i = 0; i < a->data.size(); ++i) {
    num = std::max(num, std::fabs(a->data[i] - b->data[i]));
    den = std::max(den, std::fabs(a->data[i]));
  }
  EXPECT_LE(num / den, 1e-5f);
  expect_error(run("logits --model " + model_ + tokens + (tmp_ / "c.npy").string() +
                   " --prefill-chunk 0"),
               "--prefill-chunk");
}

TEST_F(Cli, GenerateGreedyPrintsNIdsOnOneLine) {
  RunResult r = run("generate --model " + model_ + " --tokens 5,6,7 -n 6 --temperature 0");
  ASSERT_EQ(r.code, 0) << r.err;
  std::istringstream ss(r.out);
  std::vector<int> ids;
  int x;
  while (ss >> x) ids.push_back(x);
  EXPECT_EQ(ids.size(), 6u);
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1);
  // Same seed, same sampled ids; the run is reproducible.
  RunResult a = run("generate --model " + model_ + " --tokens 5,6,7 -n 8 --temperature 0.9 --top-p 0.9 --seed 7");
  RunResult b = run("generate --model " + model_ + " --tokens 5,6,7 -n 8 --temperature 0.9 --top-p 0.9 --seed 7");
  ASSERT_EQ(a.code, 0) << a.err;
  EXPECT_EQ(a.out, b.out);
}

// --logit-bias ID=BIAS: -100 on greedy's first token makes it another; +100 on a token makes
// greedy start with it; a malformed item or an id past the vocabulary is a one-line error.
TEST_F(Cli, GenerateLogitBias) {
  const std::string base = "generate --model " + model_ + " --tokens 5,6,7 -n 1";
  RunResult plain = run(base);
  ASSERT_EQ(plain.code, 0) << plain.err;
  const int first = std::stoi(plain.out);
  RunResult banned = run(base + " --logit-bias " + std::to_string(first) + "=-100");
  ASSERT_EQ(banned.code, 0) << banned.err;
  EXPECT_NE(std::stoi(banned.out), first);
  const int forced = first == 300 ? 301 : 300;
  RunResult lifted =
      run(base + " --logit-bias 11=0.5 --logit-bias " + std::to_string(forced) + "=100");
  ASSERT_EQ(lifted.code, 0) << lifted.err;
  EXPECT_EQ(std::stoi(lifted.out), forced);
  expect_error(run(base + " --logit-bias 12"), "--logit-bias '12'");
  expect_error(run(base + " --logit-bias x=1"), "--logit-bias 'x=1'");
  expect_error(run(base + " --logit-bias 3=101"), "--logit-bias '3=101'");
  expect_error(run(base + " --logit-bias 512=1"), "outside the vocabulary of 512");
}

TEST_F(Cli, InspectJsonCountsExperts) {
  RunResult r = run("inspect --model " + model_ + " --json");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("\"family\": \"qwen3_moe\""), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\"bytes_routed_experts\""), std::string::npos) << r.out;
}

// bench --parallel: one report per sequence count, as llama-batched-bench prints them; the
// counts a bad list names are refused before the model loads.
TEST_F(Cli, BenchParallelReportsEachSequenceCount) {
  RunResult r = run("bench --model " + model_ +
                    " --threads 2 --prompt-tokens 20 --gen-tokens 5 --parallel 1,3 --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j.at("parallel").size(), 2u) << r.out;
  for (size_t i = 0; i < 2; ++i) {
    const nlohmann::json& p = j["parallel"][i];
    EXPECT_EQ(p.at("parallel").get<int>(), i == 0 ? 1 : 3);
    EXPECT_GT(p.at("decode_tokens_per_s").get<double>(), 0);
    EXPECT_NEAR(p.at("decode_tokens_per_s").get<double>(),
                p.at("decode_tokens_per_s_per_sequence").get<double>() * (i == 0 ? 1 : 3), 1e-6);
    EXPECT_LE(p.at("ttft_p50_ms").get<double>(), p.at("ttft_p99_ms").get<double>());
    EXPECT_GT(p.at("decode_bytes_per_step").get<double>(), 0);
  }
  expect_error(run("bench --model " + model_ + " --parallel 2,0"), "--parallel");
}

TEST_F(Cli, MissingDirectory) {
  expect_error(run("logits --model /nonexistent/dir --tokens 1 --out " + (tmp_ / "x.npy").string()),
               "/nonexistent/dir");
  EXPECT_FALSE(fs::exists(tmp_ / "x.npy"));
}

// Device flags: a bad name, a CUDA-only option on the CPU, and CUDA where there is none (CI)
// or a device index that does not exist are one-line errors, exit 2, no output.
TEST_F(Cli, BadDeviceFlagsAreClearErrors) {
  fs::path out = tmp_ / "x.npy";
  const std::string base = "logits --model " + model_ + " --tokens 1,2 --out " + out.string();
  expect_error(run(base + " --device tpu"), "--device");
  expect_error(run(base + " --quant q8_0"), "--quant");
  expect_error(run(base + " --device cuda --quant q4_0"), "--quant");
  RunResult r = run(base + " --device cuda:7");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("cuda"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(out));
}

// --cache-warm on the CPU's streamed store: the histogram of a first run fills each layer's
// slots before the next run's first token; the logits are byte-identical to a cold run and
// the warm run hits more (its warm-up reads are not counted).
TEST_F(Cli, CacheWarmOnTheCpuStreamedStore) {
  const fs::path hist = tmp_ / "hist.json", cold = tmp_ / "cold.npy", warm = tmp_ / "warm.npy";
  const std::string tokens = " --tokens 5,6,7,8,9,10,11,12,13,14,15,16";
  const std::string streamed = " --residency streamed --expert-cache-slots 2 --stats";
  RunResult r = run("logits --model " + model_ + tokens + " --out " + (tmp_ / "h.npy").string() +
                    " --router-hist " + hist.string());
  ASSERT_EQ(r.code, 0) << r.err;
  RunResult c = run("logits --model " + model_ + tokens + streamed + " --out " + cold.string());
  ASSERT_EQ(c.code, 0) << c.err;
  RunResult w = run("logits --model " + model_ + tokens + streamed + " --cache-warm " +
                    hist.string() + " --out " + warm.string());
  ASSERT_EQ(w.code, 0) << w.err;
  EXPECT_EQ(read_all(cold), read_all(warm));
  auto hits = [](const std::string& err) {
    const size_t at = err.find(", hits ");
    return at == std::string::npos ? -1L : std::stol(err.substr(at + 7));
  };
  EXPECT_GE(hits(c.err), 0) << c.err;
  EXPECT_GT(hits(w.err), hits(c.err)) << "cold: " << c.err << "\nwarm: " << w.err;
  // A histogram of another shape is refused, naming the file.
  fs::path other = tmp_ / "other.json";
  std::ofstream(other) << R"({"n_layers": 1, "n_experts": 4, "counts": [[1, 2, 3, 4]]})";
  expect_error(run("logits --model " + model_ + tokens + streamed + " --cache-warm " +
                   other.string() + " --out " + (tmp_ / "x.npy").string()),
               other.string());
}

// The GPU expert cache's flags: each combination that cannot mean anything is an error that
// names the flag, before any model is loaded.
TEST_F(Cli, GpuExpertCacheFlagsAreClearErrors) {
  fs::path out = tmp_ / "x.npy";
  const std::string base = "logits --model " + model_ + " --tokens 1,2 --out " + out.string();
  expect_error(run(base + " --residency host"), "--device cuda");
  expect_error(run(base + " --residency pinned"), "--residency");
  expect_error(run(base + " --gpu-expert-cache-gb 2"), "--gpu-expert-cache-gb");
  expect_error(run(base + " --residency streamed --cache-warm h.json"), "--cache-warm");
  expect_error(run(base + " --device cuda --residency host --expert-cache-mb 64"),
               "--gpu-expert-cache-gb");
  expect_error(run(base + " --device cuda --residency host --expert-cache-slots 2 "
                          "--gpu-expert-cache-gb 1"),
               "--expert-cache-slots");
  expect_error(run(base + " --device cuda --residency host --direct-io"), "--direct-io");
  expect_error(run(base + " --device cuda --residency host --cache-policy mru"), "mru");
  EXPECT_FALSE(fs::exists(out));
}

TEST_F(Cli, TokenOutOfVocabulary) {
  fs::path out = tmp_ / "x.npy";
  expect_error(run("logits --model " + model_ + " --tokens 1,512 --out " + out.string()), "512");
  EXPECT_FALSE(fs::exists(out));
}

TEST_F(Cli, PositionsPastTheConfigAreRefusedByLogitsAndGenerate) {
  fs::path d = copy_model();
  std::string cfg = read_all(d / "config.json");
  const size_t at = cfg.find("\"max_position_embeddings\"");
  ASSERT_NE(at, std::string::npos);
  cfg.replace(at, cfg.find(',', at) - at, "\"max_position_embeddings\": 4");
  std::ofstream(d / "config.json") << cfg;
  fs::path out = tmp_ / "x.npy";
  expect_error(run("logits --model " + d.string() + " --tokens 1,2,3,4,5 --out " + out.string()),
               "prompt = 5 tokens exceed max_position_embeddings = 4");
  EXPECT_FALSE(fs::exists(out));
  expect_error(run("generate --model " + d.string() + " --tokens 1,2,3 -n 2"),
               "prompt + n = 5 tokens exceed max_position_embeddings = 4");
  // At the limit both run.
  EXPECT_EQ(run("logits --model " + d.string() + " --tokens 1,2,3,4 --out " + out.string()).code,
            0);
  EXPECT_EQ(run("generate --model " + d.string() + " --tokens 1,2 -n 2").code, 0);
}

TEST_F(Cli, EmptyAndMalformedTokenLists) {
  expect_error(run("generate --model " + model_ + " --tokens '' -n 2"), "empty");
  expect_error(run("generate --model " + model_ + " --tokens 1,x,3 -n 2"), "'x'");
}

TEST_F(Cli, UnknownFlagAndUnknownCommand) {
  expect_error(run("generate --model " + model_ + " --tokens 1 --tempreture 1"), "--tempreture");
  RunResult r = run("frobnicate");
  EXPECT_EQ(r.code, 2);
}

TEST_F(Cli, UnknownModelType) {
  fs::path d = copy_model();
  std::string cfg = read_all(d / "config.json");
  cfg.replace(cfg.find("qwen3_moe"), 9, "gpt_neo_x");
  std::ofstream(d / "config.json") << cfg;
  expect_error(run("inspect --model " + d.string()), "model_type");
}

TEST_F(Cli, TruncatedSafetensors) {
  fs::path d = copy_model();
  fs::resize_file(d / "model.safetensors", fs::file_size(d / "model.safetensors") - 100);
  fs::path out = tmp_ / "x.npy";
  expect_error(run("logits --model " + d.string() + " --tokens 1,2 --out " + out.string()),
               "model.safetensors");
  EXPECT_FALSE(fs::exists(out));
}

TEST_F(Cli, MissingTensorIsNamed) {
  fs::path d = copy_model();
  // Rename one tensor in the header (same length, so offsets stay valid).
  std::string bytes = read_all(d / "model.safetensors");
  size_t at = bytes.find("model.layers.1.mlp.gate.weight");
  ASSERT_NE(at, std::string::npos);
  bytes[at + 20] = 'X';  // "mlp.gate" -> "mlp.Xate"
  std::ofstream(d / "model.safetensors", std::ios::binary) << bytes;
  expect_error(run("inspect --model " + d.string()), "model.layers.1.mlp.gate.weight");
}

TEST_F(Cli, ShapeMismatchIsNamed) {
  fs::path d = copy_model();
  std::string cfg = read_all(d / "config.json");
  cfg.replace(cfg.find("\"moe_intermediate_size\": 48"), 27, "\"moe_intermediate_size\": 24");
  std::ofstream(d / "config.json") << cfg;
  expect_error(run("inspect --model " + d.string()), "experts.0.gate_proj.weight");
}

// gpt-oss's bad input: a layer_types list of the wrong length or with an unknown kind, a
// missing sinks tensor, stacked experts of the wrong shape; each one line naming it, exit 2.
TEST_F(Cli, GptOssBadInputIsNamed) {
  model_ = (fs::path(TS_TEST_DATA_DIR) / "models" / "gpt_oss").string();
  const std::string config = read_all(fs::path(model_) / "config.json");
  const std::string types = R"("sliding_attention",
    "full_attention",
    "sliding_attention")";
  ASSERT_NE(config.find(types), std::string::npos);
  struct Case {
    std::string from, to, needle;
  };
  for (const Case& c :
       std::vector<Case>{{types, R"("sliding_attention", "full_attention")", "layer_types"},
                         {types, R"("sliding_attention", "full_attention", "local_attention")",
                          "local_attention"},
                         {"\"intermediate_size\": 64", "\"intermediate_size\": 32",
                          "model.layers.0.mlp.experts.gate_up_proj"}}) {
    fs::path d = copy_model();
    std::string cfg = config;
    ASSERT_NE(cfg.find(c.from), std::string::npos) << c.from;
    cfg.replace(cfg.find(c.from), c.from.size(), c.to);
    std::ofstream(d / "config.json") << cfg;
    expect_error(run("inspect --model " + d.string()), c.needle);
    fs::remove_all(d);
  }
  fs::path d = copy_model();
  std::string bytes = read_all(d / "model.safetensors");
  size_t at = bytes.find("model.layers.2.self_attn.sinks");
  ASSERT_NE(at, std::string::npos);
  bytes[at + 25] = 'X';  // "sinks" -> "Xinks"
  std::ofstream(d / "model.safetensors", std::ios::binary) << bytes;
  expect_error(
      run("logits --model " + d.string() + " --tokens 1,2 --out " + (tmp_ / "x.npy").string()),
      "model.layers.2.self_attn.sinks");
  EXPECT_FALSE(fs::exists(tmp_ / "x.npy"));
}

TEST_F(Cli, SteeringBadInputIsRejected) {
  // qwen3_moe: d_model 96, 3 layers.
  std::vector<float> ok(96, 0.5f), short_v(95, 0.5f), nan_v(96, 0.5f);
  nan_v[7] = NAN;
  ASSERT_TRUE(ts::io::write_npy_f32((tmp_ / "ok.npy").string(), {96}, ok.data()).ok());
  ASSERT_TRUE(ts::io::write_npy_f32((tmp_ / "short.npy").string(), {95}, short_v.data()).ok());
  ASSERT_TRUE(ts::io::write_npy_f32((tmp_ / "nan.npy").string(), {96}, nan_v.data()).ok());
  const std::string base = "generate --model " + model_ + " --tokens 1,2,3 -n 2 --steer ";
  expect_error(run(base + (tmp_ / "short.npy").string() + "@1"), "short.npy");
  expect_error(run(base + (tmp_ / "ok.npy").string() + "@3"), "out of range");
  expect_error(run(base + (tmp_ / "nan.npy").string() + "@0"), "element 7");
  expect_error(run(base + (tmp_ / "ok.npy").string() + "@0:1:twist"), "twist");
  RunResult r = run(base + (tmp_ / "ok.npy").string() + "@0-2:2:renorm --steer " +
                    (tmp_ / "ok.npy").string() + "@1:0.5:ablate");
  EXPECT_EQ(r.code, 0) << r.err;
}

TEST_F(Cli, CaptureWritesLayersAndShape) {
  fs::path out = tmp_ / "cap.npy";
  RunResult r = run("logits --model " + model_ + " --tokens 1,2,3,4 --out " + (tmp_ / "l.npy").string() +
                    " --capture-residual -1,1-2 --capture-out " + out.string());
  ASSERT_EQ(r.code, 0) << r.err;
  auto a = ts::io::read_npy_f32(out.string());
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->shape, (std::vector<int64_t>{3, 4, 96}));
  EXPECT_NE(read_all(out.string() + ".json").find("\"layers\": [\n  -1,\n  1,\n  2\n ]"), std::string::npos)
      << read_all(out.string() + ".json");
  expect_error(run("logits --model " + model_ + " --tokens 1 --out " + (tmp_ / "l.npy").string() +
                   " --capture-residual 7 --capture-out " + out.string()), "out of range");
}

TEST_F(Cli, RouterTraceFeedsAnalyzeRouter) {
  fs::path trace = tmp_ / "t.jsonl";
  RunResult r = run("generate --model " + model_ + " --tokens 1,2,3,4,5 -n 6 --router-trace " + trace.string());
  ASSERT_EQ(r.code, 0) << r.err;
  std::string t = read_all(trace);
  EXPECT_EQ(std::count(t.begin(), t.end(), '\n'), 10);  // 5 prompt + 5 decoded positions
  RunResult a = run("analyze-router " + trace.string() + " --slots 4,16 --json");
  ASSERT_EQ(a.code, 0) << a.err;
  // With as many slots as experts, only the first use of each expert misses.
  EXPECT_NE(a.out.find("\"lru_hit_rate\""), std::string::npos);
  expect_error(run("analyze-router " + model_ + "/config.json"), "config.json");
}


// Text front end on the fixture with the tiny tokenizer (scripts/make_tiny_tokenizer.py).
TEST_F(Cli, RunStreamsTextAndHonoursStopStrings) {
  RunResult full = run("run --model " + model_ + " --prompt 'the cat is on the mat' -n 24");
  ASSERT_EQ(full.code, 0) << full.err;
  ASSERT_GT(full.out.size(), 8u);
  // Pick a stop string from inside the greedy output: the run must end just before it.
  std::string text = full.out.substr(0, full.out.size() - 1);  // drop the final newline
  size_t cut = text.size() / 2;
  while (cut < text.size() && (uint8_t(text[cut]) & 0xC0) == 0x80) ++cut;  // char boundary
  std::string stop = text.substr(cut, 2);
  while (stop.size() < text.size() - cut && (uint8_t(text[cut + stop.size()]) & 0xC0) == 0x80)
    stop += text[cut + stop.size()];
  size_t first = text.find(stop);
  std::ofstream(tmp_ / "stop.txt") << stop;
  RunResult cut_run = run("run --model " + model_ + " --prompt 'the cat is on the mat' -n 24 --stop \"$(cat " +
                          (tmp_ / "stop.txt").string() + ")\"");
  ASSERT_EQ(cut_run.code, 0) << cut_run.err;
  EXPECT_EQ(cut_run.out, text.substr(0, first) + "\n");
}

TEST_F(Cli, RunWithMessagesUsesTheChatTemplate) {
  std::ofstream(tmp_ / "m.json") << R"([{"role":"user","content":"hello there"}])";
  RunResult a = run("run --model " + model_ + " --messages " + (tmp_ / "m.json").string() + " -n 6 --stats");
  ASSERT_EQ(a.code, 0) << a.err;
  // The prompt is the rendered template, tokenized without added specials.
  RunResult rendered = run("chat-template --model " + model_ + " --messages " +
                           (tmp_ / "m.json").string() + " --add-generation-prompt");
  ASSERT_EQ(rendered.code, 0) << rendered.err;
  EXPECT_EQ(rendered.out, "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n");
  std::ofstream(tmp_ / "t.jsonl") << nlohmann::json(rendered.out).dump() << "\n";
  RunResult ids = run("tokenize --model " + model_ + " --input " + (tmp_ / "t.jsonl").string());
  ASSERT_EQ(ids.code, 0) << ids.err;
  const size_t n_ids = nlohmann::json::parse(ids.out).size();
  EXPECT_NE(a.err.find("prompt " + std::to_string(n_ids) + " tokens"), std::string::npos)
      << a.err << " expected " << n_ids;
  expect_error(run("run --model " + model_ + " --prompt x --messages " + (tmp_ / "m.json").string()),
               "exactly one");
  std::ofstream(tmp_ / "bad.json") << "[{\"role\": ";
  expect_error(run("run --model " + model_ + " --messages " + (tmp_ / "bad.json").string()), "bad.json");
  fs::path d = copy_model();
  expect_error(run("run --model " + d.string() + " --prompt hi"), "tokenizer.json");
}

TEST_F(Cli, ChatKeepsHistoryAndResets) {
  std::ofstream(tmp_ / "in.txt") << "hello\nhow are you\n/reset\nhello\n";
  std::string cmd = "chat --model " + model_ + " -n 5 --stats < " + (tmp_ / "in.txt").string();
  RunResult r = run(cmd);
  ASSERT_EQ(r.code, 0) << r.err;
  // Three replies; the second turn's prompt holds the whole history, so it is longer than
  // the first; after /reset the same first message gives the same prompt length again.
  std::vector<int> prompt_lens;
  for (size_t at = 0; (at = r.err.find("prompt ", at)) != std::string::npos; at += 7)
    prompt_lens.push_back(std::atoi(r.err.c_str() + at + 7));
  ASSERT_EQ(prompt_lens.size(), 3u) << r.err;
  EXPECT_GT(prompt_lens[1], prompt_lens[0]);
  EXPECT_EQ(prompt_lens[2], prompt_lens[0]);
}

}  // namespace

TEST_F(Cli, ServeBadFlagsAreOneLineErrors) {
  expect_error(run("serve --model " + model_ + " --port 70000"), "--port");
  expect_error(run("serve --model " + model_ + " --max-queue -1"), "--max-queue");
  expect_error(run("serve --model " + model_ + " --bogus 1"), "bogus");
  expect_error(run("serve --model " + model_ + " --capture-residual 0 --capture-out " +
                   (tmp_ / "c.npy").string()),
               "not available in serve");
  // 203.0.113.0/24 is TEST-NET-3: never an address of this machine.
  expect_error(run("serve --model " + model_ + " --host 203.0.113.7 --port 8089"), "cannot bind");
}
