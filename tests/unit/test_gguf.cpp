// GGUF reading (src/io/gguf.*) and llama.cpp control vectors as --steer files. The files are
// written byte by byte here, laid out as llama.cpp's gguf_write_to_file lays them out, so the
// reader is checked against the format and not against itself.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <random>
#include <sstream>

#include "io/gguf.h"
#include "io/npy.h"

namespace {

namespace fs = std::filesystem;

// Little-endian byte builder.
struct Bytes {
  std::string b;
  template <class T>
  Bytes& pod(T v) {
    b.append(reinterpret_cast<const char*>(&v), sizeof(T));
    return *this;
  }
  Bytes& u8(uint8_t v) { return pod(v); }
  Bytes& u32(uint32_t v) { return pod(v); }
  Bytes& i32(int32_t v) { return pod(v); }
  Bytes& u64(uint64_t v) { return pod(v); }
  Bytes& str(const std::string& s) {
    u64(s.size());
    b += s;
    return *this;
  }
  void pad_to(size_t align) {
    while (b.size() % align) b += '\0';
  }
};

// One metadata pair, written whole (key, type, value) by `write`.
using Kv = std::function<void(Bytes&)>;
Kv kv_str(const std::string& key, const std::string& v) {
  return [=](Bytes& o) { o.str(key).u32(8).str(v); };
}
Kv kv_u32(const std::string& key, uint32_t v) {
  return [=](Bytes& o) { o.str(key).u32(4).u32(v); };
}
Kv kv_i32(const std::string& key, int32_t v) {
  return [=](Bytes& o) { o.str(key).u32(5).i32(v); };
}

struct Tensor {
  std::string name;
  std::vector<uint64_t> dims;
  std::vector<float> values;
  uint32_t type = 0;               // GGML_TYPE_F32
  std::optional<uint64_t> offset;  // default: the running, aligned offset
};

struct Spec {
  std::string magic = "GGUF";
  uint32_t version = 3;
  std::optional<uint64_t> tensor_count, kv_count;  // default: the real counts
  std::vector<Kv> kvs;
  std::vector<Tensor> tensors;
  uint32_t alignment = 32;  // layout only: add a general.alignment pair to declare another
};

struct Built {
  std::string bytes;
  size_t data_end = 0;  // end of the last tensor's values (before its padding)
};

// Header, pairs, tensor infos, zero padding to the alignment, then each tensor's values
// padded to the alignment: gguf_write_to_file's layout.
Built build(const Spec& s) {
  Bytes o;
  o.b += s.magic;
  o.u32(s.version)
      .u64(s.tensor_count.value_or(s.tensors.size()))
      .u64(s.kv_count.value_or(s.kvs.size()));
  for (const Kv& kv : s.kvs) kv(o);
  uint64_t running = 0;
  for (const Tensor& t : s.tensors) {
    o.str(t.name).u32(uint32_t(t.dims.size()));
    for (uint64_t d : t.dims) o.u64(d);
    o.u32(t.type).u64(t.offset.value_or(running));
    running += (t.values.size() * 4 + s.alignment - 1) / s.alignment * s.alignment;
  }
  o.pad_to(s.alignment);
  const size_t data_start = o.b.size();
  Built out;
  for (const Tensor& t : s.tensors) {
    o.b.append(reinterpret_cast<const char*>(t.values.data()), t.values.size() * 4);
    out.data_end = o.b.size();
    o.pad_to(s.alignment);
  }
  if (s.tensors.empty()) out.data_end = data_start;
  out.bytes = o.b;
  return out;
}

constexpr int64_t kDModel = 96;  // tests/models/qwen3_moe: d_model 96, 3 layers
constexpr int kLayers = 3;

std::vector<float> random_vector(std::mt19937& rng, int64_t n, float scale) {
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(rng);
  return v;
}

// A control vector as llama-cvector-generator writes it.
Spec control_vector(const std::map<int, std::vector<float>>& dirs) {
  Spec s;
  s.kvs = {kv_str("general.architecture", "controlvector"),
           kv_str("controlvector.model_hint", "qwen3moe"),
           kv_i32("controlvector.layer_count", int32_t(dirs.size()))};
  for (const auto& [layer, v] : dirs)
    s.tensors.push_back({.name = "direction." + std::to_string(layer),
                         .dims = {uint64_t(v.size())},
                         .values = v,
                         .type = 0,
                         .offset = std::nullopt});
  return s;
}

std::string read_all(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

class Gguf : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/ts_gguf_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    tmp_ = tmpl;
    rng_.seed(std::random_device{}());
  }
  void TearDown() override { fs::remove_all(tmp_); }

  std::string write(const std::string& name, const std::string& bytes) {
    const fs::path p = tmp_ / name;
    std::ofstream(p, std::ios::binary) << bytes;
    return p.string();
  }
  // The control-vector reader must refuse `bytes` with a message naming the file and `needle`.
  void expect_refused(const std::string& bytes, const std::string& needle,
                      const std::string& label) {
    const std::string path = write("bad.gguf", bytes);
    auto r = ts::io::read_control_vector(path, kDModel);
    ASSERT_FALSE(r.ok()) << label << ": accepted";
    const std::string& m = r.error().message;
    EXPECT_EQ(m.rfind(path + ": ", 0), 0u)
        << label << ": message does not start with the path: " << m;
    EXPECT_NE(m.find(needle), std::string::npos) << label << ": '" << needle << "' not in: " << m;
  }

  fs::path tmp_;
  std::mt19937 rng_;
};

TEST_F(Gguf, ControlVectorRoundTrips) {
  for (uint32_t version : {2u, 3u}) {
    for (uint32_t alignment : {32u, 64u, 8u}) {
      std::map<int, std::vector<float>> dirs = {{1, random_vector(rng_, kDModel, 1.0f)},
                                                {2, random_vector(rng_, kDModel, 1.0f)},
                                                {7, random_vector(rng_, kDModel, 1.0f)}};
      Spec s = control_vector(dirs);
      s.version = version;
      s.alignment = alignment;
      if (alignment != 32) s.kvs.push_back(kv_u32("general.alignment", alignment));
      const std::string path = write("cv.gguf", build(s).bytes);
      auto cv = ts::io::read_control_vector(path, kDModel);
      ASSERT_TRUE(cv.ok()) << cv.error().message;
      EXPECT_EQ(cv->model_hint, "qwen3moe");
      EXPECT_EQ(cv->layer_count, 3);
      ASSERT_EQ(cv->directions.size(), 3u);
      auto it = dirs.begin();
      for (const auto& [layer, v] : cv->directions) {
        EXPECT_EQ(layer, it->first);
        ASSERT_EQ(v.size(), it->second.size());
        EXPECT_EQ(std::memcmp(v.data(), it->second.data(), v.size() * 4), 0)
            << "direction." << layer;
        ++it;
      }
      auto g = ts::io::read_gguf(path);
      ASSERT_TRUE(g.ok());
      EXPECT_EQ(g->version, version);
      EXPECT_EQ(g->alignment, alignment);
      EXPECT_EQ(g->data_offset % alignment, 0u);
    }
  }
}

// Metadata of every type, arrays (of strings, of bools, nested) included, is parsed or
// skipped exactly: the tensor table after it is still found.
TEST_F(Gguf, EveryMetadataTypeIsReadOrSkipped) {
  Spec s = control_vector({{1, random_vector(rng_, kDModel, 1.0f)}});
  s.kvs.push_back([](Bytes& o) { o.str("t.u8").u32(0).u8(200); });
  s.kvs.push_back([](Bytes& o) { o.str("t.i8").u32(1).pod<int8_t>(-5); });
  s.kvs.push_back([](Bytes& o) { o.str("t.u16").u32(2).pod<uint16_t>(60000); });
  s.kvs.push_back([](Bytes& o) { o.str("t.i16").u32(3).pod<int16_t>(-300); });
  s.kvs.push_back([](Bytes& o) { o.str("t.f32").u32(6).pod<float>(1.5f); });
  s.kvs.push_back([](Bytes& o) { o.str("t.bool").u32(7).u8(1); });
  s.kvs.push_back([](Bytes& o) { o.str("t.u64").u32(10).u64(uint64_t(1) << 40); });
  s.kvs.push_back([](Bytes& o) { o.str("t.i64").u32(11).pod<int64_t>(-(int64_t(1) << 40)); });
  s.kvs.push_back([](Bytes& o) { o.str("t.f64").u32(12).pod<double>(-2.25); });
  s.kvs.push_back(
      [](Bytes& o) { o.str("t.strs").u32(9).u32(8).u64(3).str("a").str("").str("ccc"); });
  s.kvs.push_back([](Bytes& o) { o.str("t.bools").u32(9).u32(7).u64(2).u8(0).u8(1); });
  s.kvs.push_back([](Bytes& o) {  // [[1, 2], [3]] as u32 arrays
    o.str("t.nested").u32(9).u32(9).u64(2).u32(4).u64(2).u32(1).u32(2).u32(4).u64(1).u32(3);
  });
  const std::string path = write("meta.gguf", build(s).bytes);
  auto g = ts::io::read_gguf(path);
  ASSERT_TRUE(g.ok()) << g.error().message;
  auto num = [&](const char* k) { return g->find(k); };
  EXPECT_EQ(std::get<uint64_t>(num("t.u8")->value), 200u);
  EXPECT_EQ(std::get<int64_t>(num("t.i8")->value), -5);
  EXPECT_EQ(std::get<uint64_t>(num("t.u16")->value), 60000u);
  EXPECT_EQ(std::get<int64_t>(num("t.i16")->value), -300);
  EXPECT_EQ(std::get<double>(num("t.f32")->value), 1.5);
  EXPECT_EQ(std::get<bool>(num("t.bool")->value), true);
  EXPECT_EQ(std::get<uint64_t>(num("t.u64")->value), uint64_t(1) << 40);
  EXPECT_EQ(std::get<int64_t>(num("t.i64")->value), -(int64_t(1) << 40));
  EXPECT_EQ(std::get<double>(num("t.f64")->value), -2.25);
  EXPECT_EQ(num("t.strs")->array_type, ts::io::GgufType::kString);
  EXPECT_EQ(num("t.strs")->array_len, 3u);
  EXPECT_EQ(num("t.nested")->array_len, 2u);
  EXPECT_EQ(std::get<std::string>(num("controlvector.model_hint")->value), "qwen3moe");
  ASSERT_EQ(g->tensors.size(), 1u);
  EXPECT_EQ(g->tensors[0].name, "direction.1");
  EXPECT_EQ(num("no.such.key"), nullptr);
}

// Every proper prefix of a valid file that cuts into what the reader needs is refused with a
// message naming the file; the file cut right after the last tensor's values (its trailing
// padding gone) is still read.
TEST_F(Gguf, EveryTruncationIsAnError) {
  Spec s = control_vector(
      {{1, random_vector(rng_, kDModel, 1.0f)}, {2, random_vector(rng_, kDModel, 1.0f)}});
  s.kvs.push_back([](Bytes& o) { o.str("t.strs").u32(9).u32(8).u64(2).str("xy").str("z"); });
  const Built b = build(s);
  for (size_t n = 0; n < b.data_end; ++n) {
    const std::string path = write("cut.gguf", b.bytes.substr(0, n));
    auto r = ts::io::read_control_vector(path, kDModel);
    ASSERT_FALSE(r.ok()) << "prefix of " << n << " bytes accepted";
    EXPECT_EQ(r.error().message.rfind(path + ": ", 0), 0u) << r.error().message;
  }
  auto whole =
      ts::io::read_control_vector(write("cut.gguf", b.bytes.substr(0, b.data_end)), kDModel);
  EXPECT_TRUE(whole.ok()) << whole.error().message;
  auto empty = ts::io::read_gguf(write("empty.gguf", ""));
  ASSERT_FALSE(empty.ok());
  EXPECT_NE(empty.error().message.find("truncated: magic"), std::string::npos)
      << empty.error().message;
}

TEST_F(Gguf, MalformedHeadersAreNamed) {
  const std::vector<float> v1 = random_vector(rng_, kDModel, 1.0f),
                           v2 = random_vector(rng_, kDModel, 1.0f);
  auto good = [&] { return control_vector({{1, v1}, {2, v2}}); };
  struct Case {
    std::string label;
    std::function<void(Spec&)> edit;
    std::string needle;
  };
  const std::vector<Case> cases = {
      {"magic", [](Spec& s) { s.magic = "GGML"; }, "bad magic 'GGML'"},
      {"version 1", [](Spec& s) { s.version = 1; }, "unsupported GGUF version 1"},
      {"version 4", [](Spec& s) { s.version = 4; }, "unsupported GGUF version 4"},
      {"tensor count", [](Spec& s) { s.tensor_count = uint64_t(1) << 40; },
       "tensor_count 1099511627776 is too large"},
      {"kv count", [](Spec& s) { s.kv_count = ~uint64_t(0); },
       "kv_count 18446744073709551615 is too large"},
      {"key length",
       [](Spec& s) { s.kvs.insert(s.kvs.begin(), [](Bytes& o) { o.u64(uint64_t(1) << 50); }); },
       "metadata key 0: string length 1125899906842624"},
      {"string value length",
       [](Spec& s) {
         s.kvs[1] = [](Bytes& o) { o.str("controlvector.model_hint").u32(8).u64(999999); };
       },
       "metadata 'controlvector.model_hint': string length 999999"},
      {"empty key", [](Spec& s) { s.kvs.push_back(kv_u32("", 1)); }, "metadata key 3 is empty"},
      {"duplicate key", [](Spec& s) { s.kvs.push_back(kv_str("general.architecture", "x")); },
       "duplicate metadata 'general.architecture'"},
      {"value type",
       [](Spec& s) { s.kvs.push_back([](Bytes& o) { o.str("t.x").u32(13).u32(0); }); },
       "metadata 't.x': unknown value type 13"},
      {"array type",
       [](Spec& s) { s.kvs.push_back([](Bytes& o) { o.str("t.a").u32(9).u32(77).u64(1); }); },
       "metadata 't.a': unknown array element type 77"},
      {"array count",
       [](Spec& s) {
         s.kvs.push_back([](Bytes& o) { o.str("t.a").u32(9).u32(4).u64(uint64_t(1) << 60); });
       },
       "metadata 't.a': array of 1152921504606846976 u32 runs past the end"},
      {"string array count",
       [](Spec& s) {
         s.kvs.push_back([](Bytes& o) { o.str("t.a").u32(9).u32(8).u64(uint64_t(1) << 60); });
       },
       "metadata 't.a': array of 1152921504606846976 str runs past the end"},
      {"array element length",
       [](Spec& s) {
         s.kvs.push_back(
             [](Bytes& o) { o.str("t.a").u32(9).u32(8).u64(2).str("ok").u64(1 << 30); });
       },
       "metadata 't.a' element 1: string length 1073741824"},
      {"nesting",
       [](Spec& s) {
         s.kvs.push_back([](Bytes& o) {
           o.str("t.deep").u32(9);
           for (int i = 0; i < 6; ++i) o.u32(9).u64(1);
           o.u32(4).u64(0);
         });
       },
       "arrays nested deeper than 4"},
      {"bool", [](Spec& s) { s.kvs.push_back([](Bytes& o) { o.str("t.b").u32(7).u8(2); }); },
       "metadata 't.b': bool value 2 is not 0 or 1"},
      {"alignment type", [](Spec& s) { s.kvs.push_back(kv_i32("general.alignment", 32)); },
       "'general.alignment' is i32, expected u32"},
      {"alignment value",
       [](Spec& s) {
         s.kvs.push_back(kv_u32("general.alignment", 48));
         s.alignment = 48;
       },
       "'general.alignment' = 48 is not a power of two"},
      {"tensor name length", [](Spec& s) { s.tensors[1].name = std::string(64, 'd'); },
       "tensor 1 name is 64 bytes"},
      {"tensor type F16", [](Spec& s) { s.tensors[0].type = 1; },
       "tensor 'direction.1' is F16; control vector directions must be F32"},
      {"tensor type Q8_0", [](Spec& s) { s.tensors[1].type = 8; },
       "tensor 'direction.2' is Q8_0; control vector directions must be F32"},
      {"tensor type unknown", [](Spec& s) { s.tensors[1].type = 31; },
       "tensor 'direction.2' has ggml type 31 (type 31), whose layout this reader does not know"},
      {"tensor blocks",
       [](Spec& s) {
         s.tensors[1].type = 8;
         s.tensors[1].dims = {48};
       },
       "tensor 'direction.2' is Q8_0 with dim 0 = 48, not a whole number of 32-element blocks"},
      {"misaligned offset", [](Spec& s) { s.tensors[1].offset = 388; },
       "tensor 'direction.2' offset 388 is not a multiple of the alignment 32"},
      {"offset past the end", [](Spec& s) { s.tensors[1].offset = 4096; },
       "truncated: tensor 'direction.2' (384 bytes of F32 at data offset 4096) runs past the end"},
      {"overlap", [](Spec& s) { s.tensors[1].offset = 352; },
       "tensor 'direction.2' at data offset 352 overlaps tensor 'direction.1'"},
      {"dims",
       [](Spec& s) {
         s.tensors[0].dims = {96, 1, 1, 1, 1};
       },
       "tensor 'direction.1' has 5 dims, more than ggml's 4"},
      {"dim overflow",
       [](Spec& s) {
         s.tensors[0].dims = {uint64_t(1) << 62, 4};
       },
       "tensor 'direction.1' has an element count that overflows"},
      {"duplicate tensor", [](Spec& s) { s.tensors[1].name = "direction.1"; },
       "duplicate tensor 'direction.1'"},
      {"vector length",
       [](Spec& s) {
         s.tensors[1].dims = {95};
         s.tensors[1].values.resize(95);
       },
       "tensor 'direction.2' has shape [95]; expected [96]"},
      {"vector shape",
       [](Spec& s) {
         s.tensors[0].dims = {48, 2};
       },
       "tensor 'direction.1' has shape [48, 2]; expected [96]"},
      {"NaN", [](Spec& s) { s.tensors[1].values[5] = NAN; },
       "tensor 'direction.2' has a non-finite value at element 5"},
      {"Inf", [](Spec& s) { s.tensors[0].values[95] = -INFINITY; },
       "tensor 'direction.1' has a non-finite value at element 95"},
      {"tensor name", [](Spec& s) { s.tensors[0].name = "blk.0.ffn_up.weight"; },
       "tensor 'blk.0.ffn_up.weight' is not named direction.N"},
      {"direction.0", [](Spec& s) { s.tensors[0].name = "direction.0"; },
       "tensor 'direction.0' is not named direction.N with N >= 1"},
      {"leading zero", [](Spec& s) { s.tensors[0].name = "direction.01"; },
       "tensor 'direction.01' is not named"},
      {"trailing text", [](Spec& s) { s.tensors[0].name = "direction.1x"; },
       "tensor 'direction.1x' is not named"},
      {"architecture", [](Spec& s) { s.kvs[0] = kv_str("general.architecture", "qwen3moe"); },
       "general.architecture is 'qwen3moe', not 'controlvector'"},
      {"layer_count type", [](Spec& s) { s.kvs[2] = kv_str("controlvector.layer_count", "2"); },
       "controlvector.layer_count is not a non-negative integer"},
      {"model_hint type", [](Spec& s) { s.kvs[1] = kv_u32("controlvector.model_hint", 2); },
       "controlvector.model_hint is not a string"},
      {"no tensors", [](Spec& s) { s.tensors.clear(); }, "holds no direction.N tensors"},
  };
  // The unedited file passes, so each refusal below is the edit's doing.
  auto ok = ts::io::read_control_vector(write("good.gguf", build(good()).bytes), kDModel);
  ASSERT_TRUE(ok.ok()) << ok.error().message;
  for (const Case& c : cases) {
    Spec s = good();
    c.edit(s);
    expect_refused(build(s).bytes, c.needle, c.label);
  }
}

// ---- End to end, through the CLI on the fixture -------------------------------------------

class GgufSteering : public Gguf {
 protected:
  void SetUp() override {
    Gguf::SetUp();
    model_ = (fs::path(TS_TEST_DATA_DIR) / "models" / "qwen3_moe").string();
  }
  struct Run {
    int code;
    std::string err;
    std::vector<float> logits;
  };
  Run logits(const std::string& steer) {
    const fs::path out = tmp_ / "logits.npy";
    fs::remove(out);
    const std::string cmd = std::string(TS_BINARY) + " logits --model " + model_ +
                            " --tokens 5,6,7,8 --threads 1 --out " + out.string() + " " + steer +
                            " >/dev/null 2>" + (tmp_ / "stderr").string();
    const int st = std::system(cmd.c_str());
    Run r{WIFEXITED(st) ? WEXITSTATUS(st) : -1, read_all(tmp_ / "stderr"), {}};
    if (r.code == 0) {
      auto a = ts::io::read_npy_f32(out.string());
      EXPECT_TRUE(a.ok());
      if (a.ok()) r.logits = a->data;
    }
    return r;
  }
  Run ok(const std::string& steer) {
    Run r = logits(steer);
    EXPECT_EQ(r.code, 0) << steer << ": " << r.err;
    EXPECT_FALSE(r.logits.empty());
    return r;
  }
  static bool same(const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
  }
  std::string npy(const std::string& name, std::vector<int64_t> shape,
                  const std::vector<float>& v) {
    const std::string p = (tmp_ / name).string();
    EXPECT_TRUE(ts::io::write_npy_f32(p, shape, v.data()).ok());
    return p;
  }

  std::string model_;
};

// A GGUF control vector steers exactly as the .npy holding the same rows at the same layers:
// logits byte-identical, in every mode; direction.N lands on layer N (not N - 1).
TEST_F(GgufSteering, MatchesTheEquivalentNpy) {
  const std::vector<float> v1 = random_vector(rng_, kDModel, 1.0f),
                           v2 = random_vector(rng_, kDModel, 1.0f);
  const std::string both = write("both.gguf", build(control_vector({{1, v1}, {2, v2}})).bytes);
  const std::string only2 = write("only2.gguf", build(control_vector({{2, v2}})).bytes);
  std::vector<float> rows(size_t(kLayers * kDModel), 0.0f);  // [n_layers, d_model], row 0 unused
  std::copy(v1.begin(), v1.end(), rows.begin() + kDModel);
  std::copy(v2.begin(), v2.end(), rows.begin() + 2 * kDModel);
  const std::string rows_npy = npy("rows.npy", {kLayers, kDModel}, rows);
  const std::string v2_npy = npy("v2.npy", {kDModel}, v2);

  const Run plain = ok("");
  for (const char* tail : {":3", ":2:renorm", ":0.5:ablate", ":-1:clamp"}) {
    const std::string t = tail;
    const Run g = ok("--steer " + both + "@all" + t);
    const Run n = ok("--steer " + rows_npy + "@1-2" + t);
    EXPECT_TRUE(same(g.logits, n.logits)) << t;
    EXPECT_FALSE(same(g.logits, plain.logits)) << t << ": steering had no effect";
  }
  // direction.2 alone is the [d_model] vector at layer 2, and not at layer 1.
  const Run g2 = ok("--steer " + only2 + "@all:3");
  EXPECT_TRUE(same(g2.logits, ok("--steer " + v2_npy + "@2:3").logits));
  EXPECT_FALSE(same(g2.logits, ok("--steer " + v2_npy + "@1:3").logits));
  // LAYERS picks among the file's directions.
  EXPECT_TRUE(same(ok("--steer " + both + "@2:3").logits, g2.logits));
  // Repeated --steer flags compose in order, as for .npy files.
  EXPECT_TRUE(same(ok("--steer " + both + "@1:3 --steer " + only2 + "@all:3").logits,
                   ok("--steer " + rows_npy + "@1-2:3").logits));
}

TEST_F(GgufSteering, BadFilesExitTwoWithOneLine) {
  const std::vector<float> v = random_vector(rng_, kDModel, 1.0f);
  auto expect_error = [&](const std::string& steer, const std::string& needle) {
    const Run r = logits(steer);
    EXPECT_EQ(r.code, 2) << steer << ": " << r.err;
    EXPECT_NE(r.err.find(needle), std::string::npos) << "stderr: " << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << "one line: " << r.err;
  };
  const std::string past = write("past.gguf", build(control_vector({{1, v}, {3, v}})).bytes);
  expect_error("--steer " + past + "@all", "past.gguf: tensor 'direction.3' is out of range");
  const std::string one = write("one.gguf", build(control_vector({{1, v}})).bytes);
  expect_error("--steer " + one + "@0-1", "the file has no direction.0 for layer 0");
  expect_error("--steer " + one + "@5", "out of range");
  Spec bad = control_vector({{1, v}});
  bad.tensors[0].values[3] = NAN;
  const std::string nan = write("nan.gguf", build(bad).bytes);
  expect_error("--steer " + nan + "@all",
               "nan.gguf: tensor 'direction.1' has a non-finite value at element 3");
  const std::string short_v =
      write("short.gguf", build(control_vector({{1, std::vector<float>(95, 1.0f)}})).bytes);
  expect_error("--steer " + short_v + "@all",
               "short.gguf: tensor 'direction.1' has shape [95]; expected [96]");
  const std::string not_gguf = write("npy.gguf", read_all(npy("x.npy", {kDModel}, v)));
  expect_error("--steer " + not_gguf + "@all", "npy.gguf: bad magic");
  expect_error("--steer " + (tmp_ / "missing.gguf").string() + "@all", "missing.gguf");
}

}  // namespace
