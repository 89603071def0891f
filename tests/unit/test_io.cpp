// File-format layer: MappedFile, safetensors (single file, directories, sharded index) and npy.
// Happy paths round-trip random data; every rejected input has a test that checks the message
// names the file and the tensor / field at fault. Bad files are crafted byte by byte.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "io/mapped_file.h"
#include "io/npy.h"
#include "io/safetensors.h"

namespace ts::io {
namespace {

namespace fs = std::filesystem;
constexpr auto npos = std::string::npos;

// A fresh directory under /tmp, removed with its contents at scope exit.
class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/ts_test_io_XXXXXX";
    const char* made = mkdtemp(tmpl);
    TS_CHECK(made != nullptr, "mkdtemp failed");
    path_ = made;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return path_ + "/" + name; }
  const std::string& path() const { return path_; }
  // Names of the entries left in the directory, for checking that no temporary remains.
  std::vector<std::string> entries() const {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(path_)) out.push_back(e.path().filename());
    std::sort(out.begin(), out.end());
    return out;
  }

 private:
  std::string path_;
};

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(bytes.data(), std::streamsize(bytes.size()));
  TS_CHECK(f.good(), "test could not write its input file");
}

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

std::string u64_le(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = char(uint8_t(v >> (8 * i)));
  return s;
}

// A safetensors file from a hand-written header and a data area of `data_bytes` bytes.
std::string safetensors_bytes(const std::string& header, size_t data_bytes) {
  std::string data(data_bytes, '\0');
  for (size_t i = 0; i < data_bytes; ++i) data[i] = char(0x11 + i % 200);
  return u64_le(header.size()) + header + data;
}

std::mt19937& rng() {
  static std::mt19937 gen{std::random_device{}()};
  return gen;
}

// Nonzero random floats.
std::vector<float> random_floats(size_t n) {
  std::uniform_real_distribution<float> dist(0.5f, 2.0f);
  std::bernoulli_distribution sign(0.5);
  std::vector<float> v(n);
  for (float& x : v) x = sign(rng()) ? dist(rng()) : -dist(rng());
  return v;
}

std::vector<uint8_t> random_bytes(size_t n) {
  std::uniform_int_distribution<int> dist(1, 255);
  std::vector<uint8_t> v(n);
  for (uint8_t& b : v) b = uint8_t(dist(rng()));
  return v;
}

// The error of opening one hand-crafted safetensors file; fails the test if it opened.
std::string open_error(const TempDir& dir, const std::string& header, size_t data_bytes) {
  const std::string path = dir.file("bad.safetensors");
  write_bytes(path, safetensors_bytes(header, data_bytes));
  auto r = TensorSet::open_file(path);
  EXPECT_FALSE(r.ok()) << "opened a bad file with header " << header;
  if (r.ok()) return "";
  EXPECT_NE(r.error().message.find(path), npos) << r.error().message;
  return r.error().message;
}

// ---------------------------------------------------------------------------------------------
// MappedFile and write_file_atomic

TEST(MappedFile, MapsWholeFile) {
  TempDir dir;
  auto bytes = random_bytes(4099);
  const std::string content(bytes.begin(), bytes.end());
  write_bytes(dir.file("x.bin"), content);
  auto f = MappedFile::open(dir.file("x.bin"));
  ASSERT_TRUE(f.ok()) << f.error().message;
  ASSERT_EQ((*f)->size(), content.size());
  EXPECT_EQ(std::memcmp((*f)->data(), content.data(), content.size()), 0);
  EXPECT_EQ((*f)->path(), dir.file("x.bin"));
}

TEST(MappedFile, EmptyFileHasSizeZero) {
  TempDir dir;
  write_bytes(dir.file("empty"), "");
  auto f = MappedFile::open(dir.file("empty"));
  ASSERT_TRUE(f.ok()) << f.error().message;
  EXPECT_EQ((*f)->size(), 0u);
}

TEST(MappedFile, MissingFileNamesPathAndReason) {
  TempDir dir;
  auto f = MappedFile::open(dir.file("absent.bin"));
  ASSERT_FALSE(f.ok());
  const std::string& msg = f.error().message;
  EXPECT_NE(msg.find("cannot open " + dir.file("absent.bin")), npos) << msg;
  EXPECT_NE(msg.find("No such file"), npos) << msg;
}

TEST(MappedFile, DirectoryIsNotARegularFile) {
  TempDir dir;
  auto f = MappedFile::open(dir.path());
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.error().message.find(dir.path() + " is not a regular file"), npos)
      << f.error().message;
}

TEST(WriteFileAtomic, FailedRenameLeavesNoTemporary) {
  TempDir dir;
  // The target is a non-empty directory, so the write succeeds and the rename fails.
  fs::create_directory(dir.file("target"));
  write_bytes(dir.file("target/keep"), "x");
  const std::string payload = "payload";
  Status s = write_file_atomic(dir.file("target"), {{payload.data(), payload.size()}});
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.error().message.find(dir.file("target")), npos) << s.error().message;
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"target"});
}

TEST(WriteFileAtomic, MissingParentDirectoryNamesPath) {
  TempDir dir;
  const std::string path = dir.file("no/such/dir/out.bin");
  Status s = write_file_atomic(path, {});
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.error().message.find(path), npos) << s.error().message;
  EXPECT_TRUE(dir.entries().empty());
}

// ---------------------------------------------------------------------------------------------
// Safetensors: writing and reading back

TEST(Safetensors, ParseDtype) {
  EXPECT_EQ(parse_safetensors_dtype("F32").value(), DType::kF32);
  EXPECT_EQ(parse_safetensors_dtype("F16").value(), DType::kF16);
  EXPECT_EQ(parse_safetensors_dtype("BF16").value(), DType::kBF16);
  auto i64 = parse_safetensors_dtype("I64");
  ASSERT_FALSE(i64.ok());
  EXPECT_NE(i64.error().message.find("unsupported safetensors dtype I64"), npos);
  auto junk = parse_safetensors_dtype("f32");  // case matters in the format
  ASSERT_FALSE(junk.ok());
  EXPECT_NE(junk.error().message.find("unknown safetensors dtype f32"), npos);
}

TEST(Safetensors, RoundTripKeepsDtypeShapeAndBytes) {
  TempDir dir;
  const std::string path = dir.file("model.safetensors");
  // An odd-length F16 tensor first, so later tensors start at offsets the writer did not pad.
  auto a = random_bytes(2 * 7);
  auto b = random_floats(3 * 5);
  auto c = random_bytes(2 * 4 * 2 * 3);
  auto scalar = random_floats(1);
  std::vector<TensorToWrite> in = {
      {.name = "a.f16", .dtype = DType::kF16, .shape = {7}, .data = a.data(), .n_bytes = a.size()},
      {.name = "b.f32",
       .dtype = DType::kF32,
       .shape = {3, 5},
       .data = b.data(),
       .n_bytes = b.size() * 4},
      {.name = "c.bf16",
       .dtype = DType::kBF16,
       .shape = {4, 2, 3},
       .data = c.data(),
       .n_bytes = c.size()},
      {.name = "empty", .dtype = DType::kF32, .shape = {0, 8}, .data = nullptr, .n_bytes = 0},
      {.name = "scalar", .dtype = DType::kF32, .shape = {}, .data = scalar.data(), .n_bytes = 4},
  };
  Status written = write_safetensors(path, in);
  ASSERT_TRUE(written.ok()) << written.error().message;
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"model.safetensors"});  // no temporary left

  const std::string raw = read_bytes(path);
  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = header_bytes << 8 | uint8_t(raw[i]);
  EXPECT_EQ(header_bytes % 8, 0u);
  EXPECT_EQ(raw.size(), 8 + header_bytes + a.size() + b.size() * 4 + c.size() + 4);

  auto set = TensorSet::open_file(path);
  ASSERT_TRUE(set.ok()) << set.error().message;
  EXPECT_EQ((*set)->tensors().size(), in.size());
  EXPECT_EQ((*set)->file_bytes(), raw.size());
  for (const TensorToWrite& t : in) {
    const TensorView* v = (*set)->find(t.name);
    ASSERT_NE(v, nullptr) << t.name;
    EXPECT_EQ(v->name, t.name);
    EXPECT_EQ(v->dtype, t.dtype) << t.name;
    EXPECT_EQ(v->shape, t.shape) << t.name;
    EXPECT_EQ(v->file, path);
    ASSERT_EQ(v->n_bytes, t.n_bytes) << t.name;
    if (t.n_bytes > 0) {
      EXPECT_EQ(std::memcmp(v->data, t.data, t.n_bytes), 0) << t.name;
    }
  }
  EXPECT_EQ((*set)->find("absent"), nullptr);
}

TEST(Safetensors, WriterRejectsInconsistentTensors) {
  TempDir dir;
  const std::string path = dir.file("out.safetensors");
  auto data = random_floats(6);
  auto fails_with = [&](std::vector<TensorToWrite> tensors, const std::string& what) {
    Status s = write_safetensors(path, tensors);
    ASSERT_FALSE(s.ok()) << what;
    EXPECT_NE(s.error().message.find(path), npos) << s.error().message;
    EXPECT_NE(s.error().message.find(what), npos) << s.error().message;
    EXPECT_TRUE(dir.entries().empty());
  };
  fails_with({{"w.bytes", DType::kF32, {2, 3}, data.data(), 20}}, "w.bytes has 20 bytes");
  fails_with({{"w.neg", DType::kF32, {-2, -3}, data.data(), 24}}, "w.neg has negative");
  fails_with(
      {{"w.dup", DType::kF32, {6}, data.data(), 24}, {"w.dup", DType::kF32, {6}, data.data(), 24}},
      "w.dup appears twice");
}

TEST(Safetensors, ReadsHandWrittenHeaderWithMetadataAndPadding) {
  TempDir dir;
  const std::string path = dir.file("hand.safetensors");
  // Tensors listed out of offset order, with a gap between them and trailing header spaces.
  const std::string header =
      R"({"__metadata__": {"format": "pt"},)"
      R"( "model.layers.0.w": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [16, 24]},)"
      R"( "model.norm": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]}}    )";
  const std::string bytes = safetensors_bytes(header, 24);
  write_bytes(path, bytes);
  auto set = TensorSet::open_file(path);
  ASSERT_TRUE(set.ok()) << set.error().message;
  const uint8_t* data_area = reinterpret_cast<const uint8_t*>(bytes.data()) + 8 + header.size();
  const TensorView* w = (*set)->find("model.layers.0.w");
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->dtype, DType::kBF16);
  EXPECT_EQ(w->shape, (std::vector<int64_t>{2, 2}));
  ASSERT_EQ(w->n_bytes, 8u);
  EXPECT_EQ(std::memcmp(w->data, data_area + 16, 8), 0);
  const TensorView* norm = (*set)->find("model.norm");
  ASSERT_NE(norm, nullptr);
  ASSERT_EQ(norm->n_bytes, 12u);
  EXPECT_EQ(std::memcmp(norm->data, data_area, 12), 0);
  EXPECT_EQ((*set)->find("__metadata__"), nullptr);
}

// ---------------------------------------------------------------------------------------------
// Safetensors: bad single files

TEST(SafetensorsBad, FileShorterThanLengthPrefix) {
  TempDir dir;
  const std::string path = dir.file("short.safetensors");
  write_bytes(path, std::string("\x10\x00\x00", 3));
  auto r = TensorSet::open_file(path);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find(path + ": file is 3 bytes"), npos) << r.error().message;
}

TEST(SafetensorsBad, HeaderLengthLargerThanFile) {
  TempDir dir;
  const std::string path = dir.file("big_header.safetensors");
  write_bytes(path, u64_le(1000) + R"({"a": {}})");
  auto r = TensorSet::open_file(path);
  ASSERT_FALSE(r.ok());
  const std::string& msg = r.error().message;
  EXPECT_NE(msg.find(path), npos) << msg;
  EXPECT_NE(msg.find("header length 1000 exceeds file size 17"), npos) << msg;
}

TEST(SafetensorsBad, TruncatedDataArea) {
  TempDir dir;
  const std::string msg = open_error(
      dir, R"({"model.layers.0.w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", 10);
  EXPECT_NE(msg.find("tensor model.layers.0.w"), npos) << msg;
  EXPECT_NE(msg.find("data_offsets [0, 16] lie outside the data area of 10 bytes"), npos) << msg;
}

TEST(SafetensorsBad, OverlappingOffsetsNameBothTensors) {
  TempDir dir;
  const std::string msg = open_error(
      dir,
      R"({"model.layers.0.w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},)"
      R"( "model.layers.0.b": {"dtype": "F32", "shape": [2], "data_offsets": [24, 32]},)"
      R"( "model.layers.1.w": {"dtype": "F16", "shape": [4], "data_offsets": [12, 20]}})",
      32);
  EXPECT_NE(msg.find("model.layers.0.w"), npos) << msg;
  EXPECT_NE(msg.find("model.layers.1.w"), npos) << msg;
  EXPECT_NE(msg.find("overlap"), npos) << msg;
  EXPECT_EQ(msg.find("model.layers.0.b"), npos) << msg;
}

TEST(SafetensorsBad, OffsetsDisagreeWithDtypeTimesShape) {
  TempDir dir;
  const std::string msg = open_error(
      dir, R"({"model.layers.0.w": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 24]}})",
      24);
  EXPECT_NE(msg.find("tensor model.layers.0.w"), npos) << msg;
  EXPECT_NE(msg.find("span 24 bytes"), npos) << msg;
  EXPECT_NE(msg.find("needs 12 bytes"), npos) << msg;
}

TEST(SafetensorsBad, OffsetsBeginAfterEnd) {
  TempDir dir;
  const std::string msg = open_error(
      dir, R"({"model.layers.0.w": {"dtype": "F32", "shape": [0], "data_offsets": [8, 4]}})", 8);
  EXPECT_NE(msg.find("tensor model.layers.0.w"), npos) << msg;
  EXPECT_NE(msg.find("[8, 4] begin after"), npos) << msg;
}

TEST(SafetensorsBad, CorruptJson) {
  TempDir dir;
  const std::string msg = open_error(
      dir, R"({"model.layers.0.w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16])", 16);
  EXPECT_NE(msg.find("header is not valid JSON"), npos) << msg;
}

TEST(SafetensorsBad, HeaderIsNotAnObject) {
  TempDir dir;
  const std::string msg = open_error(dir, "[1, 2]", 0);
  EXPECT_NE(msg.find("header is not a JSON object"), npos) << msg;
}

TEST(SafetensorsBad, UnknownDtype) {
  TempDir dir;
  const std::string msg = open_error(
      dir, R"({"model.layers.0.w": {"dtype": "Q5_K", "shape": [4], "data_offsets": [0, 16]}})", 16);
  EXPECT_NE(msg.find("unknown dtype Q5_K for tensor model.layers.0.w in"), npos) << msg;
}

TEST(SafetensorsBad, ValidButUnsupportedDtypes) {
  for (const char* dtype : {"I64", "F64", "F8_E4M3"}) {
    TempDir dir;
    const std::string msg = open_error(dir,
                                       std::string(R"({"model.layers.0.w": {"dtype": ")") + dtype +
                                           R"(", "shape": [1], "data_offsets": [0, 8]}})",
                                       8);
    EXPECT_NE(msg.find(std::string("unsupported dtype ") + dtype +
                       " for tensor model.layers.0.w in " + dir.file("bad.safetensors")),
              npos)
        << msg;
  }
}

TEST(SafetensorsBad, NegativeDimension) {
  TempDir dir;
  const std::string msg = open_error(
      dir, R"({"model.layers.0.w": {"dtype": "F32", "shape": [-2, -2], "data_offsets": [0, 16]}})",
      16);
  EXPECT_NE(msg.find("tensor model.layers.0.w"), npos) << msg;
  EXPECT_NE(msg.find("negative dimension -2"), npos) << msg;
}

TEST(SafetensorsBad, ElementCountOverflow) {
  TempDir dir;
  const std::string msg =
      open_error(dir,
                 R"({"model.layers.0.w": {"dtype": "F32", "shape": [4294967296, 4294967296, 2],)"
                 R"( "data_offsets": [0, 0]}})",
                 0);
  EXPECT_NE(msg.find("tensor model.layers.0.w"), npos) << msg;
  EXPECT_NE(msg.find("overflows"), npos) << msg;
}

TEST(SafetensorsBad, MissingFields) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"dtype", R"({"model.layers.0.w": {"shape": [4], "data_offsets": [0, 16]}})"},
      {"shape", R"({"model.layers.0.w": {"dtype": "F32", "data_offsets": [0, 16]}})"},
      {"data_offsets", R"({"model.layers.0.w": {"dtype": "F32", "shape": [4]}})"},
  };
  for (const auto& [field, header] : cases) {
    TempDir dir;
    const std::string msg = open_error(dir, header, 16);
    EXPECT_NE(msg.find("tensor model.layers.0.w"), npos) << msg;
    EXPECT_NE(msg.find("missing field " + field), npos) << msg;
  }
}

TEST(SafetensorsBad, WrongFieldTypes) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"field dtype is not a string",
       R"({"model.layers.0.w": {"dtype": 7, "shape": [4], "data_offsets": [0, 16]}})"},
      {"field shape is not an array",
       R"({"model.layers.0.w": {"dtype": "F32", "shape": "4", "data_offsets": [0, 16]}})"},
      {"holds a non-integer 4.0",
       R"({"model.layers.0.w": {"dtype": "F32", "shape": [4.0], "data_offsets": [0, 16]}})"},
      {"field data_offsets must be [begin, end]",
       R"({"model.layers.0.w": {"dtype": "F32", "shape": [4], "data_offsets": [16]}})"},
      {"field data_offsets must be [begin, end]",
       R"({"model.layers.0.w": {"dtype": "F32", "shape": [4], "data_offsets": [-4, 12]}})"},
      {"entry is not a JSON object", R"({"model.layers.0.w": [0, 16]})"},
  };
  for (const auto& [what, header] : cases) {
    TempDir dir;
    const std::string msg = open_error(dir, header, 16);
    EXPECT_NE(msg.find("tensor model.layers.0.w"), npos) << msg;
    EXPECT_NE(msg.find(what), npos) << msg;
  }
}

TEST(SafetensorsBad, MetadataIsNotAnObject) {
  TempDir dir;
  const std::string msg = open_error(dir, R"({"__metadata__": "pt"})", 0);
  EXPECT_NE(msg.find("__metadata__ is not a JSON object"), npos) << msg;
}

TEST(SafetensorsBad, TensorTwiceInOneHeader) {
  TempDir dir;
  const std::string msg =
      open_error(dir,
                 R"({"model.layers.0.w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},)"
                 R"( "model.layers.0.w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}})",
                 16);
  EXPECT_NE(msg.find("tensor model.layers.0.w appears twice"), npos) << msg;
}

// ---------------------------------------------------------------------------------------------
// Safetensors: directories and sharded checkpoints

// Writes a one-tensor-per-name F32 shard with random contents; returns the contents by name.
std::map<std::string, std::vector<float>> write_shard(const std::string& path,
                                                      const std::vector<std::string>& names) {
  std::map<std::string, std::vector<float>> contents;
  std::vector<TensorToWrite> tensors;
  for (size_t i = 0; i < names.size(); ++i) contents[names[i]] = random_floats(2 + i);
  for (const std::string& n : names) {
    tensors.push_back({n,
                       DType::kF32,
                       {int64_t(contents[n].size())},
                       contents[n].data(),
                       contents[n].size() * 4});
  }
  Status s = write_safetensors(path, tensors);
  TS_CHECK(s.ok(), "test could not write a shard");
  return contents;
}

std::string index_json(const std::vector<std::pair<std::string, std::string>>& weight_map) {
  std::string s = R"({"metadata": {"total_size": 0}, "weight_map": {)";
  for (size_t i = 0; i < weight_map.size(); ++i) {
    s += (i ? ", " : "") + ("\"" + weight_map[i].first + "\": \"" + weight_map[i].second + "\"");
  }
  return s + "}}";
}

constexpr const char* kShard1 = "model-00001-of-00002.safetensors";
constexpr const char* kShard2 = "model-00002-of-00002.safetensors";

TEST(SafetensorsDir, ShardedWithIndex) {
  TempDir dir;
  auto c1 = write_shard(dir.file(kShard1), {"model.embed_tokens.weight", "model.layers.0.w"});
  auto c2 = write_shard(dir.file(kShard2), {"model.layers.1.w", "lm_head.weight"});
  write_bytes(dir.file("model.safetensors.index.json"),
              index_json({{"model.embed_tokens.weight", kShard1},
                          {"model.layers.0.w", kShard1},
                          {"model.layers.1.w", kShard2},
                          {"lm_head.weight", kShard2}}));
  auto set = TensorSet::open_dir(dir.path());
  ASSERT_TRUE(set.ok()) << set.error().message;
  EXPECT_EQ((*set)->tensors().size(), 4u);
  EXPECT_EQ((*set)->file_bytes(),
            fs::file_size(dir.file(kShard1)) + fs::file_size(dir.file(kShard2)));
  for (const auto& [contents, shard] : {std::pair{&c1, kShard1}, std::pair{&c2, kShard2}}) {
    for (const auto& [name, values] : *contents) {
      const TensorView* v = (*set)->find(name);
      ASSERT_NE(v, nullptr) << name;
      EXPECT_EQ(v->file, dir.file(shard));
      EXPECT_EQ(v->shape, std::vector<int64_t>{int64_t(values.size())});
      ASSERT_EQ(v->n_bytes, values.size() * 4);
      EXPECT_EQ(std::memcmp(v->data, values.data(), v->n_bytes), 0) << name;
    }
  }
}

TEST(SafetensorsDir, MissingShard) {
  TempDir dir;
  write_shard(dir.file(kShard1), {"model.layers.0.w"});
  write_bytes(dir.file("model.safetensors.index.json"),
              index_json({{"model.layers.0.w", kShard1}, {"model.layers.1.w", kShard2}}));
  auto set = TensorSet::open_dir(dir.path());
  ASSERT_FALSE(set.ok());
  const std::string& msg = set.error().message;
  EXPECT_NE(msg.find("shard " + dir.file(kShard2)), npos) << msg;
  EXPECT_NE(msg.find("does not exist"), npos) << msg;
  EXPECT_NE(msg.find("model.safetensors.index.json"), npos) << msg;
}

TEST(SafetensorsDir, IndexNamesTensorMissingFromItsShard) {
  TempDir dir;
  write_shard(dir.file(kShard1), {"model.layers.0.w"});
  write_shard(dir.file(kShard2), {"model.layers.1.w"});
  write_bytes(dir.file("model.safetensors.index.json"),
              index_json({{"model.layers.0.w", kShard1},
                          {"model.layers.1.w", kShard2},
                          {"model.layers.2.w", kShard2}}));
  auto set = TensorSet::open_dir(dir.path());
  ASSERT_FALSE(set.ok());
  const std::string& msg = set.error().message;
  EXPECT_NE(msg.find("tensor model.layers.2.w"), npos) << msg;
  EXPECT_NE(msg.find(dir.file(kShard2)), npos) << msg;
  EXPECT_NE(msg.find("does not hold it"), npos) << msg;
}

TEST(SafetensorsDir, IndexMapsTensorsToTheWrongShards) {
  TempDir dir;
  write_shard(dir.file(kShard1), {"model.layers.0.w"});
  write_shard(dir.file(kShard2), {"model.layers.1.w"});
  write_bytes(dir.file("model.safetensors.index.json"),
              index_json({{"model.layers.0.w", kShard2}, {"model.layers.1.w", kShard1}}));
  auto set = TensorSet::open_dir(dir.path());
  ASSERT_FALSE(set.ok());
  const std::string& msg = set.error().message;
  EXPECT_NE(msg.find("tensor model.layers.0.w is mapped to " + dir.file(kShard2)), npos) << msg;
  EXPECT_NE(msg.find("but is in " + dir.file(kShard1)), npos) << msg;
}

TEST(SafetensorsDir, TensorInTwoShards) {
  TempDir dir;
  write_shard(dir.file(kShard1), {"model.layers.0.w"});
  write_shard(dir.file(kShard2), {"model.layers.0.w", "model.layers.1.w"});
  write_bytes(dir.file("model.safetensors.index.json"),
              index_json({{"model.layers.0.w", kShard1}, {"model.layers.1.w", kShard2}}));
  auto set = TensorSet::open_dir(dir.path());
  ASSERT_FALSE(set.ok());
  const std::string& msg = set.error().message;
  EXPECT_NE(msg.find("tensor model.layers.0.w appears in both " + dir.file(kShard1) + " and " +
                     dir.file(kShard2)),
            npos)
      << msg;
}

TEST(SafetensorsDir, BadIndexFiles) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"weight_map": {"model.layers.0.w": )", "not valid JSON"},
      {R"({"metadata": {}})", "missing object field weight_map"},
      {R"({"weight_map": {}})", "weight_map is empty"},
      {R"({"weight_map": {"model.layers.0.w": 3}})", "tensor model.layers.0.w is not a string"},
      {R"({"weight_map": {"model.layers.0.w": "../model.safetensors"}})",
       "\"../model.safetensors\" of tensor model.layers.0.w is not a path inside"},
  };
  for (const auto& [text, what] : cases) {
    TempDir dir;
    write_bytes(dir.file("model.safetensors.index.json"), text);
    auto set = TensorSet::open_dir(dir.path());
    ASSERT_FALSE(set.ok()) << text;
    const std::string& msg = set.error().message;
    EXPECT_NE(msg.find(dir.file("model.safetensors.index.json")), npos) << msg;
    EXPECT_NE(msg.find(what), npos) << msg;
  }
}

TEST(SafetensorsDir, MissingDirectory) {
  TempDir dir;
  const std::string missing = dir.file("no_such_model");
  auto set = TensorSet::open_dir(missing);
  ASSERT_FALSE(set.ok());
  EXPECT_NE(set.error().message.find("model directory " + missing + " does not exist"), npos)
      << set.error().message;
}

TEST(SafetensorsDir, PathIsAFile) {
  TempDir dir;
  write_bytes(dir.file("config.json"), "{}");
  auto set = TensorSet::open_dir(dir.file("config.json"));
  ASSERT_FALSE(set.ok());
  EXPECT_NE(set.error().message.find(dir.file("config.json") + " is not a directory"), npos)
      << set.error().message;
}

TEST(SafetensorsDir, DirectoryWithoutSafetensors) {
  TempDir dir;
  write_bytes(dir.file("config.json"), "{}");
  auto set = TensorSet::open_dir(dir.path());
  ASSERT_FALSE(set.ok());
  EXPECT_NE(set.error().message.find("no model.safetensors or model.safetensors.index.json in " +
                                     dir.path()),
            npos)
      << set.error().message;
}

TEST(SafetensorsDir, SingleModelSafetensorsIsPreferredOverOtherFiles) {
  TempDir dir;
  auto contents = write_shard(dir.file("model.safetensors"), {"model.layers.0.w"});
  // Would clash with model.safetensors if it were read too.
  write_shard(dir.file("extra.safetensors"), {"model.layers.0.w"});
  auto set = TensorSet::open_dir(dir.path());
  ASSERT_TRUE(set.ok()) << set.error().message;
  const TensorView* v = (*set)->find("model.layers.0.w");
  ASSERT_NE(v, nullptr);
  EXPECT_EQ(v->file, dir.file("model.safetensors"));
  EXPECT_EQ(std::memcmp(v->data, contents["model.layers.0.w"].data(), v->n_bytes), 0);
}

TEST(SafetensorsDir, OtherSafetensorsFilesInNameOrder) {
  TempDir dir;
  write_shard(dir.file("b.safetensors"), {"model.layers.1.w"});
  write_shard(dir.file("a.safetensors"), {"model.layers.0.w"});
  write_bytes(dir.file("notes.txt"), "not a checkpoint");
  auto set = TensorSet::open_dir(dir.path());
  ASSERT_TRUE(set.ok()) << set.error().message;
  EXPECT_EQ((*set)->find("model.layers.0.w")->file, dir.file("a.safetensors"));
  EXPECT_EQ((*set)->find("model.layers.1.w")->file, dir.file("b.safetensors"));

  // Name order shows in which file a duplicate is reported as the second one.
  write_shard(dir.file("c.safetensors"), {"model.layers.0.w"});
  auto dup = TensorSet::open_dir(dir.path());
  ASSERT_FALSE(dup.ok());
  EXPECT_NE(dup.error().message.find("appears in both " + dir.file("a.safetensors") + " and " +
                                     dir.file("c.safetensors")),
            npos)
      << dup.error().message;
}

// ---------------------------------------------------------------------------------------------
// npy

TEST(Npy, RoundTrip) {
  const std::vector<std::vector<int64_t>> shapes = {{}, {7}, {3, 5}, {2, 3, 4}, {4, 0, 3}};
  for (const auto& shape : shapes) {
    TempDir dir;
    const std::string path = dir.file("a.npy");
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    auto data = random_floats(size_t(n));
    Status s = write_npy_f32(path, shape, data.data());
    ASSERT_TRUE(s.ok()) << s.error().message;
    EXPECT_EQ(dir.entries(), std::vector<std::string>{"a.npy"});  // no temporary left
    EXPECT_EQ(read_bytes(path).size() % 64, size_t(n * 4) % 64);  // data starts 64-aligned
    auto r = read_npy_f32(path);
    ASSERT_TRUE(r.ok()) << r.error().message;
    EXPECT_EQ(r->shape, shape);
    EXPECT_EQ(r->data, data);
  }
}

TEST(Npy, WriterHeaderMatchesNumpy) {
  // Bytes np.save (numpy 1.24) writes for a float32 array of shape (2, 3) and (5,).
  const std::vector<std::pair<std::vector<int64_t>, std::string>> cases = {
      {{2, 3},
       std::string("\x93NUMPY\x01\x00v\x00", 10) +
           "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }" + std::string(58, ' ') +
           "\n"},
      {{5},
       std::string("\x93NUMPY\x01\x00v\x00", 10) +
           "{'descr': '<f4', 'fortran_order': False, 'shape': (5,), }" + std::string(60, ' ') +
           "\n"},
  };
  for (const auto& [shape, header] : cases) {
    TempDir dir;
    auto data = random_floats(size_t(shape.size() == 2 ? 6 : 5));
    ASSERT_TRUE(write_npy_f32(dir.file("a.npy"), shape, data.data()).ok());
    const std::string raw = read_bytes(dir.file("a.npy"));
    ASSERT_EQ(raw.size(), 128 + data.size() * 4);
    EXPECT_EQ(raw.substr(0, 128), header);
    EXPECT_EQ(std::memcmp(raw.data() + 128, data.data(), data.size() * 4), 0);
  }
}

// A .npy file with a hand-written header, data from `data`.
std::string npy_bytes(int major, const std::string& dict, const std::vector<float>& data) {
  std::string header = dict + "\n";
  std::string prefix = std::string("\x93NUMPY", 6) + char(major) + char(0);
  const size_t len_bytes = major == 1 ? 2 : 4;
  for (size_t i = 0; i < len_bytes; ++i) prefix += char(uint8_t(header.size() >> (8 * i)));
  return prefix + header + std::string(reinterpret_cast<const char*>(data.data()), data.size() * 4);
}

TEST(Npy, ReadsHandWrittenHeaders) {
  auto data = random_floats(6);
  const std::vector<std::pair<int, std::string>> cases = {
      {1, "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }          "},
      {1, "{\"shape\": (2,3), \"fortran_order\": False, \"descr\": \"<f4\"}"},  // any key order
      {1, "{'descr': '<f4', 'fortran_order': False, 'shape': (2L, 3L), }"},     // Python 2
      {2, "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }"},
  };
  for (const auto& [major, dict] : cases) {
    TempDir dir;
    write_bytes(dir.file("a.npy"), npy_bytes(major, dict, data));
    auto r = read_npy_f32(dir.file("a.npy"));
    ASSERT_TRUE(r.ok()) << r.error().message;
    EXPECT_EQ(r->shape, (std::vector<int64_t>{2, 3})) << dict;
    EXPECT_EQ(r->data, data) << dict;
  }
}

TEST(Npy, RejectsBadFiles) {
  auto data = random_floats(6);
  const std::string good = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
  std::string bad_magic = npy_bytes(1, good, data);
  bad_magic[1] = 'X';
  std::string version3 = npy_bytes(1, good, data);
  version3[6] = 3;
  const std::vector<std::pair<std::string, std::string>> cases = {
      {bad_magic, "not a .npy file"},
      {version3, "unsupported .npy version 3.0"},
      {npy_bytes(1, "{'descr': '<f8', 'fortran_order': False, 'shape': (2, 3), }", data),
       "dtype '<f8' is not '<f4'"},
      {npy_bytes(1, "{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }", data),
       "fortran_order True is not supported"},
      {npy_bytes(1, "{'descr': '<f4', 'shape': (2, 3), }", data),
       "header lacks key 'fortran_order'"},
      {npy_bytes(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), 'x': 1}", data),
       "unexpected or repeated key 'x'"},
      {npy_bytes(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (2, -3), }", data),
       "shape holds something other than non-negative integers"},
      {npy_bytes(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 4), }", data),
       "data is 24 bytes but shape (2, 4) needs 32"},
      {npy_bytes(1, good, data).substr(0, 40), "header length 60 exceeds file size 40"},
      {npy_bytes(1, good, random_floats(7)), "data is 28 bytes but shape (2, 3) needs 24"},
  };
  for (const auto& [bytes, what] : cases) {
    TempDir dir;
    const std::string path = dir.file("bad.npy");
    write_bytes(path, bytes);
    auto r = read_npy_f32(path);
    ASSERT_FALSE(r.ok()) << what;
    EXPECT_NE(r.error().message.find(path + ": "), npos) << r.error().message;
    EXPECT_NE(r.error().message.find(what), npos) << r.error().message;
  }
}

TEST(Npy, MissingFileNamesPath) {
  TempDir dir;
  auto r = read_npy_f32(dir.file("absent.npy"));
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find(dir.file("absent.npy")), npos) << r.error().message;
}

TEST(Npy, FailedWriteLeavesNoFile) {
  TempDir dir;
  auto data = random_floats(4);
  const std::string path = dir.file("missing_dir/a.npy");
  Status s = write_npy_f32(path, {4}, data.data());
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.error().message.find(path), npos) << s.error().message;
  EXPECT_TRUE(dir.entries().empty());

  Status neg = write_npy_f32(dir.file("neg.npy"), {-1}, data.data());
  ASSERT_FALSE(neg.ok());
  EXPECT_NE(neg.error().message.find(dir.file("neg.npy")), npos) << neg.error().message;
  EXPECT_TRUE(dir.entries().empty());
}

}  // namespace
}  // namespace ts::io
