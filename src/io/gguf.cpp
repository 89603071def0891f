// GGUF reader. Byte layout (little-endian; ggml docs/gguf.md and ggml/include/gguf.h):
//   u32 magic "GGUF" (bytes 47 47 55 46)
//   u32 version            2 or 3 (same layout; 3 only added big-endian files, refused here)
//   u64 tensor_count
//   u64 kv_count
//   kv_count x { string key, u32 value_type, value }
//       string = u64 length + that many bytes (no terminator)
//       value  = the scalar (u8 i8 u16 i16 u32 i32 f32 bool(1 byte, 0|1) u64 i64 f64) or a
//                string, or an array: u32 element type, u64 count, the elements back to back
//   tensor_count x { string name, u32 n_dims, n_dims x u64 dim, u32 ggml_type, u64 offset }
//   zero padding to a multiple of ALIGNMENT (metadata general.alignment, u32; default 32)
//   data section: each tensor at data_start + offset, offset a multiple of ALIGNMENT.
// Limits follow llama.cpp's gguf.cpp where it is stricter than the spec: at most 4 dims,
// tensor names under 64 bytes, an alignment that is a power of two.
#include "io/gguf.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <fstream>

namespace ts::io {

static_assert(std::endian::native == std::endian::little,
              "GGUF values are copied as-is: a big-endian host needs byte swapping");

namespace {

constexpr uint32_t kMaxDims = 4;            // GGML_MAX_DIMS
constexpr size_t kMaxTensorName = 63;       // GGML_MAX_NAME - 1
constexpr size_t kMaxKeyBytes = 65535;      // the spec's limit on keys
constexpr int kMaxArrayDepth = 4;           // nested arrays (the spec allows them)
constexpr uint32_t kDefaultAlignment = 32;  // GGUF_DEFAULT_ALIGNMENT

const char* type_name(GgufType t) {
  static constexpr const char* kNames[] = {"u8",   "i8",  "u16", "i16", "u32", "i32", "f32",
                                           "bool", "str", "arr", "u64", "i64", "f64"};
  const auto i = uint32_t(t);
  return i < std::size(kNames) ? kNames[i] : "unknown";
}

// Size of a fixed-width value type; 0 for string, array and unknown types.
size_t fixed_size(GgufType t) {
  switch (t) {
    case GgufType::kU8:
    case GgufType::kI8:
    case GgufType::kBool:
      return 1;
    case GgufType::kU16:
    case GgufType::kI16:
      return 2;
    case GgufType::kU32:
    case GgufType::kI32:
    case GgufType::kF32:
      return 4;
    case GgufType::kU64:
    case GgufType::kI64:
    case GgufType::kF64:
      return 8;
    default:
      return 0;
  }
}

bool known_type(uint32_t t) { return t <= uint32_t(GgufType::kF64); }

// Bounds-checked little-endian cursor over the mapped file. Every read names what it reads.
class Reader {
 public:
  Reader(const uint8_t* data, size_t size, const std::string& path)
      : p_(data), n_(size), path_(path) {}

  size_t pos() const { return pos_; }
  size_t left() const { return n_ - pos_; }

  Error fail(const std::string& what) const { return make_error(path_ + ": " + what); }

  template <class T>
  Result<T> pod(const std::string& what) {
    if (left() < sizeof(T))
      return fail("truncated: " + what + " needs " + std::to_string(sizeof(T)) +
                  " bytes at offset " + std::to_string(pos_) + ", the file has " +
                  std::to_string(left()) + " left");
    T v;
    std::memcpy(&v, p_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }

  Status skip(uint64_t n_bytes, const std::string& what) {
    if (n_bytes > left())
      return fail("truncated: " + what + " needs " + std::to_string(n_bytes) + " bytes at offset " +
                  std::to_string(pos_) + ", the file has " + std::to_string(left()) + " left");
    pos_ += size_t(n_bytes);
    return {};
  }

  Result<std::string> str(const std::string& what) {
    TS_ASSIGN(uint64_t len, pod<uint64_t>(what + " length"));
    if (len > left())
      return fail(what + ": string length " + std::to_string(len) + " at offset " +
                  std::to_string(pos_ - 8) + " runs past the end of the file (" +
                  std::to_string(left()) + " bytes left)");
    std::string s(reinterpret_cast<const char*>(p_ + pos_), size_t(len));
    pos_ += size_t(len);
    return s;
  }

 private:
  const uint8_t* p_;
  size_t n_;
  size_t pos_ = 0;
  const std::string& path_;
};

// Validates and skips `count` elements of type `t` (an array's body).
Status skip_elements(Reader& r, GgufType t, uint64_t count, const std::string& what, int depth) {
  const std::string items = what + ": array of " + std::to_string(count) + " " + type_name(t);
  if (const size_t sz = fixed_size(t)) {
    if (count > r.left() / sz)
      return r.fail(items + " runs past the end of the file (" + std::to_string(r.left()) +
                    " bytes left)");
    if (t == GgufType::kBool) {
      for (uint64_t i = 0; i < count; ++i) {
        TS_ASSIGN(uint8_t b, r.pod<uint8_t>(what));
        if (b > 1)
          return r.fail(what + ": element " + std::to_string(i) + " is bool " + std::to_string(b) +
                        ", not 0 or 1");
      }
      return {};
    }
    return r.skip(count * sz, items);
  }
  if (t == GgufType::kString) {
    if (count > r.left() / 8)  // each element has at least its u64 length
      return r.fail(items + " runs past the end of the file (" + std::to_string(r.left()) +
                    " bytes left)");
    for (uint64_t i = 0; i < count; ++i) {
      TS_ASSIGN(std::string s, r.str(what + " element " + std::to_string(i)));
      (void)s;
    }
    return {};
  }
  if (t == GgufType::kArray) {
    if (depth >= kMaxArrayDepth)
      return r.fail(what + ": arrays nested deeper than " + std::to_string(kMaxArrayDepth));
    if (count > r.left() / 12)  // each element has at least a u32 type and a u64 count
      return r.fail(items + " runs past the end of the file (" + std::to_string(r.left()) +
                    " bytes left)");
    for (uint64_t i = 0; i < count; ++i) {
      const std::string elem = what + " element " + std::to_string(i);
      TS_ASSIGN(uint32_t et, r.pod<uint32_t>(elem + " type"));
      if (!known_type(et)) return r.fail(elem + ": unknown value type " + std::to_string(et));
      TS_ASSIGN(uint64_t n, r.pod<uint64_t>(elem + " count"));
      TS_TRY(skip_elements(r, GgufType(et), n, elem, depth + 1));
    }
    return {};
  }
  return r.fail(what + ": unknown value type " + std::to_string(uint32_t(t)));
}

// A fixed-width scalar, widened to the variant's type.
template <class T, class Wide>
Result<GgufValue> scalar(Reader& r, GgufType t, const std::string& what) {
  TS_ASSIGN(T x, r.pod<T>(what));
  return GgufValue{.type = t, .value = Wide(x)};
}

Result<GgufValue> read_value(Reader& r, GgufType t, const std::string& what) {
  switch (t) {
    case GgufType::kU8:
      return scalar<uint8_t, uint64_t>(r, t, what);
    case GgufType::kU16:
      return scalar<uint16_t, uint64_t>(r, t, what);
    case GgufType::kU32:
      return scalar<uint32_t, uint64_t>(r, t, what);
    case GgufType::kU64:
      return scalar<uint64_t, uint64_t>(r, t, what);
    case GgufType::kI8:
      return scalar<int8_t, int64_t>(r, t, what);
    case GgufType::kI16:
      return scalar<int16_t, int64_t>(r, t, what);
    case GgufType::kI32:
      return scalar<int32_t, int64_t>(r, t, what);
    case GgufType::kI64:
      return scalar<int64_t, int64_t>(r, t, what);
    case GgufType::kF32:
      return scalar<float, double>(r, t, what);
    case GgufType::kF64:
      return scalar<double, double>(r, t, what);
    case GgufType::kBool: {
      TS_ASSIGN(uint8_t x, r.pod<uint8_t>(what));
      if (x > 1) return r.fail(what + ": bool value " + std::to_string(x) + " is not 0 or 1");
      return GgufValue{.type = t, .value = x == 1};
    }
    case GgufType::kString: {
      TS_ASSIGN(std::string s, r.str(what));
      return GgufValue{.type = t, .value = std::move(s)};
    }
    case GgufType::kArray: {
      GgufValue v;
      v.type = t;
      TS_ASSIGN(uint32_t et, r.pod<uint32_t>(what + " array type"));
      if (!known_type(et))
        return r.fail(what + ": unknown array element type " + std::to_string(et));
      TS_ASSIGN(v.array_len, r.pod<uint64_t>(what + " array count"));
      v.array_type = GgufType(et);
      v.array_pos = r.pos();
      TS_TRY(skip_elements(r, v.array_type, v.array_len, what, 1));
      return v;
    }
  }
  return r.fail(what + ": unknown value type " + std::to_string(uint32_t(t)));
}

// Integer metadata value of any width, if it is one.
bool as_int(const GgufValue& v, int64_t* out) {
  if (const auto* i = std::get_if<int64_t>(&v.value)) {
    *out = *i;
    return true;
  }
  if (const auto* u = std::get_if<uint64_t>(&v.value); u && *u <= uint64_t(INT64_MAX)) {
    *out = int64_t(*u);
    return true;
  }
  return false;
}

// "direction.N" with N a decimal >= 1 without sign or leading zeros; -1 otherwise.
int direction_layer(const std::string& name) {
  constexpr std::string_view kPrefix = "direction.";
  if (name.size() <= kPrefix.size() || name.compare(0, kPrefix.size(), kPrefix) != 0) return -1;
  const std::string_view digits = std::string_view(name).substr(kPrefix.size());
  if (digits.size() > 9 || digits[0] == '0') return -1;
  int n = 0;
  for (char c : digits) {
    if (c < '0' || c > '9') return -1;
    n = n * 10 + (c - '0');
  }
  return n;
}

}  // namespace

std::string ggml_type_name(uint32_t t) {
  // ggml.h's enum ggml_type; ids 4 and 5 (Q4_2, Q4_3) were removed, 31-33 are gone too.
  static constexpr const char* kNames[] = {
      "F32",     "F16",     "Q4_0",    "Q4_1",  "Q4_2",    "Q4_3",    "Q5_0",    "Q5_1",
      "Q8_0",    "Q8_1",    "Q2_K",    "Q3_K",  "Q4_K",    "Q5_K",    "Q6_K",    "Q8_K",
      "IQ2_XXS", "IQ2_XS",  "IQ3_XXS", "IQ1_S", "IQ4_NL",  "IQ3_S",   "IQ2_S",   "IQ4_XS",
      "I8",      "I16",     "I32",     "I64",   "F64",     "IQ1_M",   "BF16",    "type 31",
      "type 32", "type 33", "TQ1_0",   "TQ2_0", "type 36", "type 37", "type 38", "MXFP4"};
  return t < std::size(kNames) ? std::string(kNames[t]) : "type " + std::to_string(t);
}

bool ggml_type_block(uint32_t type, int64_t* block_elems, uint64_t* block_bytes) {
  // ggml.c's type_traits (blck_size, type_size) for the layouts MoE files use.
  struct Block {
    uint32_t type;
    int64_t elems;
    uint64_t bytes;
  };
  static constexpr Block kBlocks[] = {
      {0, 1, 4},      {1, 1, 2},     {2, 32, 18},    {3, 32, 20},    {6, 32, 22},    {7, 32, 24},
      {8, 32, 34},    {10, 256, 84}, {11, 256, 110}, {12, 256, 144}, {13, 256, 176}, {14, 256, 210},
      {15, 256, 292}, {16, 256, 66}, {17, 256, 74},  {18, 256, 98},  {19, 256, 50},  {20, 32, 18},
      {21, 256, 110}, {22, 256, 82}, {23, 256, 136}, {24, 1, 1},     {25, 1, 2},     {26, 1, 4},
      {27, 1, 8},     {28, 1, 8},    {29, 256, 56},  {30, 1, 2},     {34, 256, 54},  {35, 256, 66},
      {39, 32, 17}};
  for (const Block& b : kBlocks)
    if (b.type == type) {
      *block_elems = b.elems;
      *block_bytes = b.bytes;
      return true;
    }
  return false;
}

bool is_gguf_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  char magic[4] = {};
  return f && f.read(magic, 4) && std::memcmp(magic, "GGUF", 4) == 0;
}

const GgufValue* GgufFile::find(std::string_view key) const {
  for (const auto& [k, v] : kv)
    if (k == key) return &v;
  return nullptr;
}

const GgufTensorInfo* GgufFile::tensor(std::string_view name) const {
  for (const GgufTensorInfo& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}

namespace {
Error wrong_type(const GgufFile& g, std::string_view key, const char* what) {
  return make_error(g.file->path() + ": metadata '" + std::string(key) + "' must be " + what);
}
}  // namespace

Result<std::optional<int64_t>> GgufFile::integer(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) return std::optional<int64_t>{};
  if (const auto* i = std::get_if<int64_t>(&v->value)) return std::optional<int64_t>{*i};
  if (const auto* u = std::get_if<uint64_t>(&v->value))
    return std::optional<int64_t>{int64_t(std::min<uint64_t>(*u, uint64_t(INT64_MAX)))};
  return wrong_type(*this, key, "an integer");
}

Result<std::optional<double>> GgufFile::number(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) return std::optional<double>{};
  if (const auto* d = std::get_if<double>(&v->value)) return std::optional<double>{*d};
  if (std::holds_alternative<int64_t>(v->value) || std::holds_alternative<uint64_t>(v->value)) {
    TS_ASSIGN(std::optional<int64_t> i, integer(key));
    return std::optional<double>{double(*i)};
  }
  return wrong_type(*this, key, "a number");
}

Result<std::optional<std::string>> GgufFile::string(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) return std::optional<std::string>{};
  if (const auto* s = std::get_if<std::string>(&v->value)) return std::optional<std::string>{*s};
  return wrong_type(*this, key, "a string");
}

Result<std::optional<bool>> GgufFile::boolean(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) return std::optional<bool>{};
  if (const auto* b = std::get_if<bool>(&v->value)) return std::optional<bool>{*b};
  return wrong_type(*this, key, "a boolean");
}

Result<std::vector<std::string>> GgufFile::strings(std::string_view key) const {
  const GgufValue* v = find(key);
  const std::string what = file->path() + ": metadata '" + std::string(key) + "'";
  if (!v) return make_error(what + " is missing");
  if (v->type != GgufType::kArray || v->array_type != GgufType::kString)
    return make_error(what + " is not an array of strings");
  Reader r(file->data(), file->size(), file->path());
  TS_TRY(r.skip(v->array_pos, what));
  std::vector<std::string> out;
  out.reserve(size_t(v->array_len));
  for (uint64_t i = 0; i < v->array_len; ++i) {
    TS_ASSIGN(std::string s, r.str(what));
    out.push_back(std::move(s));
  }
  return out;
}

Result<std::vector<double>> GgufFile::numbers(std::string_view key) const {
  const GgufValue* v = find(key);
  const std::string what = file->path() + ": metadata '" + std::string(key) + "'";
  if (!v) return make_error(what + " is missing");
  const size_t sz = v->type == GgufType::kArray ? fixed_size(v->array_type) : 0;
  if (sz == 0 || v->array_type == GgufType::kBool)
    return make_error(what + " is not an array of numbers");
  std::vector<double> out(size_t(v->array_len));
  const uint8_t* p = file->data() + v->array_pos;
  // One element type per array: pick the conversion once, then copy.
  auto widen = [&]<class T>(T) {
    for (size_t i = 0; i < out.size(); ++i) {
      T x;
      std::memcpy(&x, p + i * sizeof(T), sizeof(T));
      out[i] = double(x);
    }
  };
  switch (v->array_type) {
    case GgufType::kU8:
      widen(uint8_t{});
      break;
    case GgufType::kI8:
      widen(int8_t{});
      break;
    case GgufType::kU16:
      widen(uint16_t{});
      break;
    case GgufType::kI16:
      widen(int16_t{});
      break;
    case GgufType::kU32:
      widen(uint32_t{});
      break;
    case GgufType::kI32:
      widen(int32_t{});
      break;
    case GgufType::kF32:
      widen(float{});
      break;
    case GgufType::kU64:
      widen(uint64_t{});
      break;
    case GgufType::kI64:
      widen(int64_t{});
      break;
    default:
      widen(double{});
      break;
  }
  return out;
}

std::vector<float> GgufFile::f32(const GgufTensorInfo& t) const {
  TS_CHECK(t.ggml_type == kGgmlF32, "GgufFile::f32 on a non-F32 tensor");
  std::vector<float> out(size_t(t.numel));
  std::memcpy(out.data(), file->data() + data_offset + t.offset, out.size() * sizeof(float));
  return out;
}

Result<GgufFile> read_gguf(const std::string& path) {
  GgufFile g;
  TS_ASSIGN(g.file, MappedFile::open(path));
  Reader r(g.file->data(), g.file->size(), path);

  TS_ASSIGN(uint32_t magic, r.pod<uint32_t>("magic"));
  if (std::memcmp(&magic, "GGUF", 4) != 0) {
    std::string got;
    for (int i = 0; i < 4; ++i) {
      const char c = char((magic >> (8 * i)) & 0xff);
      got += (c >= 0x20 && c < 0x7f) ? c : '?';
    }
    return r.fail("bad magic '" + got + "', expected 'GGUF' (not a GGUF file)");
  }
  TS_ASSIGN(g.version, r.pod<uint32_t>("version"));
  if (g.version != 2 && g.version != 3)
    return r.fail("unsupported GGUF version " + std::to_string(g.version) +
                  " (this reader takes versions 2 and 3, little-endian)");
  TS_ASSIGN(uint64_t n_tensors, r.pod<uint64_t>("tensor_count"));
  TS_ASSIGN(uint64_t n_kv, r.pod<uint64_t>("kv_count"));
  // Each KV pair takes at least 12 bytes (key length, value type), each tensor info 24 (name
  // length, n_dims, type, offset): a count beyond that cannot be honest.
  if (n_kv > r.left() / 12)
    return r.fail("kv_count " + std::to_string(n_kv) + " is too large for a file with " +
                  std::to_string(r.left()) + " bytes after the header");
  if (n_tensors > r.left() / 24)
    return r.fail("tensor_count " + std::to_string(n_tensors) + " is too large for a file with " +
                  std::to_string(r.left()) + " bytes after the header");

  for (uint64_t i = 0; i < n_kv; ++i) {
    const std::string where = "metadata key " + std::to_string(i);
    TS_ASSIGN(std::string key, r.str(where));
    if (key.empty()) return r.fail(where + " is empty");
    if (key.size() > kMaxKeyBytes)
      return r.fail(where + " is " + std::to_string(key.size()) + " bytes, over the limit of " +
                    std::to_string(kMaxKeyBytes));
    const std::string what = "metadata '" + key + "'";
    if (g.find(key)) return r.fail("duplicate " + what);
    TS_ASSIGN(uint32_t type, r.pod<uint32_t>(what + " value type"));
    if (!known_type(type)) return r.fail(what + ": unknown value type " + std::to_string(type));
    TS_ASSIGN(GgufValue v, read_value(r, GgufType(type), what));
    g.kv.emplace_back(std::move(key), std::move(v));
  }

  g.alignment = kDefaultAlignment;
  if (const GgufValue* a = g.find("general.alignment")) {
    if (a->type != GgufType::kU32)
      return r.fail("metadata 'general.alignment' is " + std::string(type_name(a->type)) +
                    ", expected u32");
    const uint64_t al = std::get<uint64_t>(a->value);
    if (al == 0 || (al & (al - 1)) != 0)
      return r.fail("metadata 'general.alignment' = " + std::to_string(al) +
                    " is not a power of two");
    g.alignment = uint32_t(al);
  }

  for (uint64_t i = 0; i < n_tensors; ++i) {
    GgufTensorInfo t;
    TS_ASSIGN(t.name, r.str("tensor " + std::to_string(i) + " name"));
    const std::string what = "tensor '" + t.name + "'";
    if (t.name.size() > kMaxTensorName)
      return r.fail("tensor " + std::to_string(i) + " name is " + std::to_string(t.name.size()) +
                    " bytes, over ggml's limit of " + std::to_string(kMaxTensorName));
    for (const GgufTensorInfo& o : g.tensors)
      if (o.name == t.name) return r.fail("duplicate " + what);
    TS_ASSIGN(uint32_t n_dims, r.pod<uint32_t>(what + " n_dims"));
    if (n_dims > kMaxDims)
      return r.fail(what + " has " + std::to_string(n_dims) + " dims, more than ggml's " +
                    std::to_string(kMaxDims));
    t.numel = 1;
    for (uint32_t j = 0; j < n_dims; ++j) {
      TS_ASSIGN(uint64_t d, r.pod<uint64_t>(what + " dim " + std::to_string(j)));
      if (d > uint64_t(INT64_MAX) || __builtin_mul_overflow(t.numel, int64_t(d), &t.numel))
        return r.fail(what + " has an element count that overflows (dim " + std::to_string(j) +
                      " = " + std::to_string(d) + ")");
      t.dims.push_back(int64_t(d));
    }
    TS_ASSIGN(t.ggml_type, r.pod<uint32_t>(what + " type"));
    int64_t block_elems = 0;
    uint64_t block_bytes = 0;
    if (!ggml_type_block(t.ggml_type, &block_elems, &block_bytes))
      return r.fail(what + " has ggml type " + std::to_string(t.ggml_type) + " (" +
                    ggml_type_name(t.ggml_type) + "), whose layout this reader does not know");
    const int64_t ne0 = t.dims.empty() ? 1 : t.dims[0];
    if (ne0 % block_elems != 0)
      return r.fail(what + " is " + ggml_type_name(t.ggml_type) +
                    " with dim 0 = " + std::to_string(ne0) + ", not a whole number of " +
                    std::to_string(block_elems) + "-element blocks");
    if (__builtin_mul_overflow(uint64_t(t.numel / block_elems), block_bytes, &t.n_bytes))
      return r.fail(what + " has a byte size that overflows");
    TS_ASSIGN(t.offset, r.pod<uint64_t>(what + " offset"));
    if (t.offset % g.alignment != 0)
      return r.fail(what + " offset " + std::to_string(t.offset) + " is not a multiple of the " +
                    "alignment " + std::to_string(g.alignment));
    g.tensors.push_back(std::move(t));
  }

  // The data section starts at the next multiple of the alignment (llama.cpp writes the
  // padding even for an empty data section, but does not need it when there are no tensors).
  const uint64_t end_of_infos = r.pos();
  g.data_offset = (end_of_infos + g.alignment - 1) / g.alignment * g.alignment;
  const uint64_t size = g.file->size();
  if (!g.tensors.empty() && g.data_offset > size)
    return r.fail("truncated: the data section would start at offset " +
                  std::to_string(g.data_offset) + ", past the end of the file (" +
                  std::to_string(size) + " bytes)");
  const uint64_t data_bytes = g.data_offset <= size ? size - g.data_offset : 0;
  struct Span {
    uint64_t begin, end;  // within the data section
    const std::string* name;
  };
  std::vector<Span> spans;
  for (const GgufTensorInfo& t : g.tensors) {
    const bool fits = t.offset <= data_bytes && t.n_bytes <= data_bytes - t.offset;
    if (!fits)
      return r.fail("truncated: tensor '" + t.name + "' (" + std::to_string(t.n_bytes) +
                    " bytes of " + ggml_type_name(t.ggml_type) + " at data offset " +
                    std::to_string(t.offset) + ") runs past the end of the file (data " +
                    "section holds " + std::to_string(data_bytes) + " bytes)");
    const uint64_t n_bytes = t.n_bytes;
    if (n_bytes) spans.push_back({t.offset, t.offset + n_bytes, &t.name});
  }
  std::sort(spans.begin(), spans.end(),
            [](const Span& a, const Span& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < spans.size(); ++i)
    if (spans[i].begin < spans[i - 1].end)
      return r.fail("tensor '" + *spans[i].name + "' at data offset " +
                    std::to_string(spans[i].begin) + " overlaps tensor '" + *spans[i - 1].name +
                    "'");
  return g;
}

Result<ControlVector> read_control_vector(const std::string& path, int64_t n_embd) {
  TS_ASSIGN(GgufFile g, read_gguf(path));
  auto fail = [&](const std::string& what) { return make_error(path + ": " + what); };
  ControlVector cv;
  if (const GgufValue* a = g.find("general.architecture")) {
    const auto* s = std::get_if<std::string>(&a->value);
    if (!s || *s != "controlvector")
      return fail("general.architecture is " + (s ? "'" + *s + "'" : std::string("not a string")) +
                  ", not 'controlvector' (a model file rather than a control vector?)");
  }
  if (const GgufValue* h = g.find("controlvector.model_hint")) {
    const auto* s = std::get_if<std::string>(&h->value);
    if (!s) return fail("controlvector.model_hint is not a string");
    cv.model_hint = *s;
  }
  if (const GgufValue* c = g.find("controlvector.layer_count")) {
    if (!as_int(*c, &cv.layer_count) || cv.layer_count < 0)
      return fail("controlvector.layer_count is not a non-negative integer");
  }
  if (g.tensors.empty()) return fail("holds no direction.N tensors");
  for (const GgufTensorInfo& t : g.tensors) {
    const int layer = direction_layer(t.name);
    if (layer < 1)
      return fail("tensor '" + t.name + "' is not named direction.N with N >= 1 (llama.cpp " +
                  "control vectors hold only those; N is the layer, from 1)");
    if (t.ggml_type != kGgmlF32)
      return fail("tensor '" + t.name + "' is " + ggml_type_name(t.ggml_type) +
                  "; control vector directions must be F32");
    bool flat = !t.dims.empty();
    for (size_t j = 1; j < t.dims.size(); ++j) flat = flat && t.dims[j] == 1;
    if (!flat || t.dims[0] != n_embd) {
      std::string shape;
      for (size_t j = 0; j < t.dims.size(); ++j)
        shape += (j ? ", " : "") + std::to_string(t.dims[j]);
      return fail("tensor '" + t.name + "' has shape [" + shape + "]; expected [" +
                  std::to_string(n_embd) + "] (the model's d_model)");
    }
    std::vector<float> v = g.f32(t);
    for (size_t i = 0; i < v.size(); ++i)
      if (!std::isfinite(v[i]))
        return fail("tensor '" + t.name + "' has a non-finite value at element " +
                    std::to_string(i));
    cv.directions.emplace_back(layer, std::move(v));
  }
  std::sort(cv.directions.begin(), cv.directions.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  return cv;
}

}  // namespace ts::io
