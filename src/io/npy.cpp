// NumPy .npy float32 arrays. Byte layout (format 1.0; 2.0 differs only in a u32 length):
//   [0, 6)    magic "\x93NUMPY"
//   [6, 8)    version major, minor (1, 0)
//   [8, 10)   u16 little-endian header length H   (2.0: u32 at [8, 12), header from 12)
//   [10, 10 + H)  ASCII Python dict literal, e.g.
//                 {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }
//                 padded with spaces and ended by '\n' so the data starts at a multiple of 64
//   then product(shape) little-endian float32 values in C order.
// The writer reproduces numpy 1.24's np.save bytes exactly (checked by hand against numpy),
// including the spare spaces numpy leaves so a header can grow in place.
#include "io/npy.h"

#include <bit>
#include <cstring>
#include <string_view>

#include "io/mapped_file.h"

namespace ts::io {

static_assert(std::endian::native == std::endian::little,
              "npy '<f4' data is copied as-is: a big-endian host needs byte swapping");

namespace {

constexpr std::string_view kMagic = "\x93NUMPY";
constexpr size_t kArrayAlign = 64;           // numpy's ARRAY_ALIGN
constexpr size_t kGrowthAxisMaxDigits = 21;  // numpy's GROWTH_AXIS_MAX_DIGITS

// Element count of `shape`; false on a negative dim or overflow of the byte count.
bool float_count(const std::vector<int64_t>& shape, int64_t* numel) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(n, d, &n)) return false;
  }
  int64_t n_bytes;
  if (__builtin_mul_overflow(n, int64_t(sizeof(float)), &n_bytes)) return false;
  *numel = n;
  return true;
}

// Python's repr of a tuple of ints: (), (3,), (2, 3).
std::string shape_tuple(const std::vector<int64_t>& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + (shape.size() == 1 ? ",)" : ")");
}

// Reads the header dict literal. Only what numpy writes for a plain array is accepted: the
// keys descr, fortran_order and shape, each once, in any order.
class HeaderParser {
 public:
  HeaderParser(std::string_view text, const std::string& path) : s_(text), path_(path) {}

  struct Header {
    std::string descr;
    bool fortran_order = false;
    std::vector<int64_t> shape;
  };

  Result<Header> parse() {
    Header h;
    bool have_descr = false, have_order = false, have_shape = false;
    if (!eat('{')) return fail("header does not start with '{'");
    while (!eat('}')) {
      TS_ASSIGN(std::string key, string_literal("key"));
      if (!eat(':')) return fail("expected ':' after key '" + key + "'");
      if (key == "descr" && !have_descr) {
        TS_ASSIGN(h.descr, string_literal("descr (structured dtypes are not supported)"));
        have_descr = true;
      } else if (key == "fortran_order" && !have_order) {
        if (eat_word("True")) {
          h.fortran_order = true;
        } else if (eat_word("False")) {
          h.fortran_order = false;
        } else {
          return fail("fortran_order is not True or False");
        }
        have_order = true;
      } else if (key == "shape" && !have_shape) {
        TS_ASSIGN(h.shape, int_tuple());
        have_shape = true;
      } else {
        return fail("unexpected or repeated key '" + key + "'");
      }
      if (!eat(',')) {
        if (!eat('}')) return fail("expected ',' or '}' after the value of '" + key + "'");
        break;
      }
    }
    skip_space();
    if (i_ != s_.size()) return fail("unexpected text after the header dict");
    if (!have_descr) return fail("header lacks key 'descr'");
    if (!have_order) return fail("header lacks key 'fortran_order'");
    if (!have_shape) return fail("header lacks key 'shape'");
    return h;
  }

 private:
  Error fail(const std::string& what) const {
    return make_error(path_ + ": " + what + " (header: " + std::string(s_) + ")");
  }
  void skip_space() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\n' || s_[i_] == '\t')) ++i_;
  }
  bool eat(char c) {
    skip_space();
    if (i_ < s_.size() && s_[i_] == c) {
      ++i_;
      return true;
    }
    return false;
  }
  bool eat_word(std::string_view w) {
    skip_space();
    if (s_.substr(i_, w.size()) != w) return false;
    i_ += w.size();
    return true;
  }
  Result<std::string> string_literal(const std::string& what) {
    skip_space();
    if (i_ >= s_.size() || (s_[i_] != '\'' && s_[i_] != '"')) {
      return fail("expected a quoted string for " + what);
    }
    const char quote = s_[i_++];
    size_t end = s_.find(quote, i_);
    if (end == std::string_view::npos) return fail("unterminated string for " + what);
    std::string out(s_.substr(i_, end - i_));
    if (out.find('\\') != std::string::npos) return fail("escapes in " + what);
    i_ = end + 1;
    return out;
  }
  Result<std::vector<int64_t>> int_tuple() {
    std::vector<int64_t> dims;
    if (!eat('(')) return fail("shape is not a tuple");
    while (!eat(')')) {
      skip_space();
      int64_t d = 0;
      size_t start = i_;
      while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') {
        if (__builtin_mul_overflow(d, 10, &d) || __builtin_add_overflow(d, s_[i_] - '0', &d)) {
          return fail("shape dimension is too large");
        }
        ++i_;
      }
      if (i_ == start) return fail("shape holds something other than non-negative integers");
      if (i_ < s_.size() && s_[i_] == 'L') ++i_;  // Python 2 long, as old numpy wrote
      dims.push_back(d);
      if (!eat(',')) {
        if (!eat(')')) return fail("expected ',' or ')' in shape");
        break;
      }
    }
    return dims;
  }

  std::string_view s_;
  const std::string& path_;
  size_t i_ = 0;
};

}  // namespace

Status write_npy_f32(const std::string& path, const std::vector<int64_t>& shape,
                     const float* data) {
  int64_t numel = 0;
  if (!float_count(shape, &numel)) {
    return make_error("cannot write " + path + ": invalid shape " + shape_tuple(shape));
  }
  if (numel > 0 && data == nullptr) return make_error("cannot write " + path + ": no data");

  // As numpy's _write_array_header and _wrap_header: sorted keys, spare spaces for growing
  // the first axis, then padding so that magic + length + header + '\n' is 64-aligned.
  std::string dict =
      "{'descr': '<f4', 'fortran_order': False, 'shape': " + shape_tuple(shape) + ", }";
  if (!shape.empty()) {
    size_t digits = std::to_string(shape[0]).size();
    if (digits < kGrowthAxisMaxDigits) dict.append(kGrowthAxisMaxDigits - digits, ' ');
  }
  size_t length_bytes = 2;
  size_t header_len = dict.size() + 1;  // + '\n'
  size_t pad = kArrayAlign - (kMagic.size() + 2 + length_bytes + header_len) % kArrayAlign;
  if (header_len + pad > 0xffff) {  // numpy switches to 2.0 only when 1.0 cannot hold it
    length_bytes = 4;
    pad = kArrayAlign - (kMagic.size() + 2 + length_bytes + header_len) % kArrayAlign;
  }
  const uint64_t field = header_len + pad;
  std::string prefix(kMagic);
  prefix += char(length_bytes == 2 ? 1 : 2);
  prefix += char(0);
  for (size_t i = 0; i < length_bytes; ++i) prefix += char(uint8_t(field >> (8 * i)));
  prefix += dict;
  prefix.append(pad, ' ');
  prefix += '\n';
  return write_file_atomic(path,
                           {{prefix.data(), prefix.size()}, {data, size_t(numel) * sizeof(float)}});
}

Result<NpyArray> read_npy_f32(const std::string& path) {
  TS_ASSIGN(std::unique_ptr<MappedFile> file, MappedFile::open(path));
  const uint8_t* p = file->data();
  const size_t size = file->size();
  if (size < 10 || std::memcmp(p, kMagic.data(), kMagic.size()) != 0) {
    return make_error(path + ": not a .npy file (no \\x93NUMPY magic)");
  }
  const int major = p[6], minor = p[7];
  size_t header_start = 0;
  uint64_t header_len = 0;
  if (major == 1 && minor == 0) {
    header_start = 10;
    header_len = uint64_t(p[8]) | uint64_t(p[9]) << 8;
  } else if (major == 2 && minor == 0) {
    if (size < 12) return make_error(path + ": file too short for a version 2.0 header");
    header_start = 12;
    for (int i = 3; i >= 0; --i) header_len = header_len << 8 | p[8 + i];
  } else {
    return make_error(path + ": unsupported .npy version " + std::to_string(major) + "." +
                      std::to_string(minor) + " (supported: 1.0, 2.0)");
  }
  if (header_len > size - header_start) {
    return make_error(path + ": header length " + std::to_string(header_len) +
                      " exceeds file size " + std::to_string(size));
  }
  std::string_view text(reinterpret_cast<const char*>(p + header_start), header_len);
  TS_ASSIGN(HeaderParser::Header header, HeaderParser(text, path).parse());
  if (header.descr != "<f4") {
    return make_error(path + ": dtype '" + header.descr + "' is not '<f4' (float32)");
  }
  if (header.fortran_order) {
    return make_error(path + ": fortran_order True is not supported (need C order)");
  }
  int64_t numel = 0;
  if (!float_count(header.shape, &numel)) {
    return make_error(path + ": element count of shape " + shape_tuple(header.shape) +
                      " overflows");
  }
  const uint64_t data_bytes = size - header_start - header_len;
  const uint64_t need_bytes = uint64_t(numel) * sizeof(float);
  if (data_bytes != need_bytes) {
    return make_error(path + ": data is " + std::to_string(data_bytes) + " bytes but shape " +
                      shape_tuple(header.shape) + " needs " + std::to_string(need_bytes));
  }
  NpyArray out;
  out.shape = std::move(header.shape);
  out.data.resize(size_t(numel));
  if (numel > 0) std::memcpy(out.data.data(), p + header_start + header_len, need_bytes);
  return out;
}

}  // namespace ts::io
