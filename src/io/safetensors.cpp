// Safetensors reading and writing. Byte layout (see safetensors.h):
//   [0, 8)        u64 little-endian N
//   [8, 8 + N)    JSON header, UTF-8, may be padded with trailing spaces
//   [8 + N, end)  data area; each tensor's data_offsets [b, e) are relative to its start
// Every check in the header comment of safetensors.h runs on open, before any TensorView is
// handed out, so later code may trust shape, dtype and byte counts.
//
// Policy choices:
// - Gaps between tensors are accepted (only overlaps are errors); the reference Rust loader is
//   stricter, but a gap cannot make a view read the wrong bytes.
// - The writer lays tensors out back to back in the given order, as the reference loader
//   requires (it rejects gaps), so a tensor's data is only aligned to its element size if the
//   tensors before it keep it so (e.g. an odd-length F16 tensor misaligns a following F32 one).
//   Readers memcpy or use unaligned loads; nothing here promises alignment beyond 8 for the
//   data area's start in files this writer made.
#include "io/safetensors.h"

#include <algorithm>
#include <array>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <string_view>
#include <utility>

namespace ts::io {

namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

constexpr std::string_view kIndexFile = "model.safetensors.index.json";
constexpr std::string_view kSingleFile = "model.safetensors";
constexpr std::string_view kSupported = "supported: F32, F16, BF16";

// Every dtype the safetensors format defines. Those beyond F32/F16/BF16 make valid files that
// this engine cannot run; telling them apart from garbage makes the message say which.
constexpr std::array<std::string_view, 20> kFormatDtypes = {
    "BOOL", "U8",  "I8",  "I16",     "U16",     "I32",     "I64", "U32",     "U64",     "F16",
    "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4",  "F6_E2M3", "F6_E3M2", "C64"};

bool is_format_dtype(const std::string& s) {
  return std::find(kFormatDtypes.begin(), kFormatDtypes.end(), s) != kFormatDtypes.end();
}

uint64_t read_u64_le(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

std::string offsets_str(uint64_t b, uint64_t e) {
  return "[" + std::to_string(b) + ", " + std::to_string(e) + "]";
}

// Why a shape cannot hold a block-quantized dtype (pack-internal Q8_0 / Q4_K): they must be
// [rows, cols] with whole blocks per row. Empty when it can (or dtype is a float type).
std::string quant_shape_problem(const std::vector<int64_t>& shape, DType dtype) {
  if (!dtype_is_quantized(dtype)) return "";
  const std::string name(dtype_name(dtype));
  if (shape.size() != 2) return name + " needs a 2-D shape [rows, cols], got " + shape_str(shape);
  if (!dtype_row_ok(dtype, shape[1]))
    return name + " needs cols to be a multiple of " + std::to_string(dtype_block_elems(dtype)) +
           ", got shape " + shape_str(shape);
  return "";
}

// Bytes of a tensor: the product of the dims times the element size, or rows times the row
// bytes for a quantized dtype (its shape checked by quant_shape_problem first); false on
// overflow. Dims must be >= 0.
bool byte_count(const std::vector<int64_t>& shape, DType dtype, uint64_t* n_bytes) {
  if (dtype_is_quantized(dtype))
    return !__builtin_mul_overflow(uint64_t(shape[0]), dtype_row_bytes(dtype, shape[1]), n_bytes);
  int64_t numel = 1;
  for (int64_t d : shape) {
    if (__builtin_mul_overflow(numel, d, &numel)) return false;
  }
  return !__builtin_mul_overflow(uint64_t(numel), uint64_t(dtype_size(dtype)), n_bytes);
}

struct Entry {
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t begin = 0;
  uint64_t end = 0;
};

// Validates one header entry against the data area of `data_bytes` bytes.
Result<Entry> parse_entry(const std::string& path, const std::string& name, const json& v,
                          uint64_t data_bytes) {
  const std::string where = "tensor " + name + " in " + path;
  if (!v.is_object()) return make_error(where + ": entry is not a JSON object: " + v.dump());
  for (const char* field : {"dtype", "shape", "data_offsets"}) {
    if (!v.contains(field)) return make_error(where + ": missing field " + field);
  }
  Entry entry;

  const json& dtype = v["dtype"];
  if (!dtype.is_string()) {
    return make_error(where + ": field dtype is not a string: " + dtype.dump());
  }
  const std::string dtype_s = dtype.get<std::string>();
  Result<DType> parsed = parse_safetensors_dtype(dtype_s);
  if (!parsed.ok()) {
    return make_error(std::string(is_format_dtype(dtype_s) ? "unsupported" : "unknown") +
                      " dtype " + dtype_s + " for " + where + " (" + std::string(kSupported) + ")");
  }
  entry.dtype = parsed.value();

  const json& shape = v["shape"];
  if (!shape.is_array()) {
    return make_error(where + ": field shape is not an array: " + shape.dump());
  }
  for (const json& d : shape) {
    if (!d.is_number_integer()) {
      return make_error(where + ": field shape " + shape.dump() + " holds a non-integer " +
                        d.dump());
    }
    if (d.is_number_unsigned()) {
      if (d.get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max())) {
        return make_error(where + ": dimension " + d.dump() + " in shape " + shape.dump() +
                          " is too large");
      }
      entry.shape.push_back(int64_t(d.get<uint64_t>()));
    } else {
      int64_t x = d.get<int64_t>();
      if (x < 0) {
        return make_error(where + ": negative dimension " + std::to_string(x) + " in shape " +
                          shape.dump());
      }
      entry.shape.push_back(x);
    }
  }
  if (std::string why = quant_shape_problem(entry.shape, entry.dtype); !why.empty()) {
    return make_error(where + ": " + why);
  }
  uint64_t need_bytes = 0;
  if (!byte_count(entry.shape, entry.dtype, &need_bytes)) {
    return make_error(where + ": element count of shape " + shape_str(entry.shape) + " overflows");
  }

  const json& offsets = v["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
      !offsets[1].is_number_unsigned()) {
    return make_error(where + ": field data_offsets must be [begin, end] of non-negative " +
                      "integers, got " + offsets.dump());
  }
  entry.begin = offsets[0].get<uint64_t>();
  entry.end = offsets[1].get<uint64_t>();
  const std::string range = offsets_str(entry.begin, entry.end);
  if (entry.begin > entry.end) {
    return make_error(where + ": data_offsets " + range + " begin after they end");
  }
  if (entry.end > data_bytes) {
    return make_error(where + ": data_offsets " + range + " lie outside the data area of " +
                      std::to_string(data_bytes) + " bytes (file truncated?)");
  }
  if (entry.end - entry.begin != need_bytes) {
    return make_error(where + ": data_offsets " + range + " span " +
                      std::to_string(entry.end - entry.begin) + " bytes but " +
                      std::string(dtype_name(entry.dtype)) + " shape " + shape_str(entry.shape) +
                      " needs " + std::to_string(need_bytes) + " bytes");
  }
  return entry;
}

// The parsed header, with a duplicate top-level key reported rather than silently dropped
// (nlohmann keeps the last of two equal keys).
Result<json> parse_header(const std::string& path, const char* first, const char* last) {
  std::string duplicate;
  std::set<std::string> keys;
  auto on_event = [&](int depth, json::parse_event_t event, json& parsed) {
    if (depth == 1 && event == json::parse_event_t::key && duplicate.empty()) {
      const std::string& key = parsed.get_ref<const std::string&>();
      if (!keys.insert(key).second) duplicate = key;
    }
    return true;
  };
  json header;
  try {
    header = json::parse(first, last, on_event);
  } catch (const json::exception& e) {
    return make_error(path + ": header is not valid JSON: " + e.what());
  }
  if (!header.is_object()) {
    return make_error(path + ": header is not a JSON object but " +
                      std::string(header.type_name()));
  }
  if (!duplicate.empty()) {
    return make_error("tensor " + duplicate + " appears twice in the header of " + path);
  }
  return header;
}

struct ShardIndex {
  std::set<std::string> shards;                              // file names, each opened once
  std::vector<std::pair<std::string, std::string>> weights;  // tensor -> shard file name
};

Result<ShardIndex> read_index(const std::string& index_path) {
  TS_ASSIGN(std::unique_ptr<MappedFile> file, MappedFile::open(index_path));
  const char* text = reinterpret_cast<const char*>(file->data());
  json index;
  try {
    index = json::parse(text, text + file->size());
  } catch (const json::exception& e) {
    return make_error(index_path + ": not valid JSON: " + e.what());
  }
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object()) {
    return make_error(index_path + ": missing object field weight_map");
  }
  const json& weight_map = index["weight_map"];
  if (weight_map.empty()) return make_error(index_path + ": weight_map is empty");
  ShardIndex out;
  for (const auto& [tensor, shard] : weight_map.items()) {
    if (!shard.is_string()) {
      return make_error(index_path + ": weight_map entry for tensor " + tensor +
                        " is not a string: " + shard.dump());
    }
    const std::string name = shard.get<std::string>();
    const fs::path p(name);
    bool escapes = name.empty() || p.is_absolute();
    for (const fs::path& part : p) escapes = escapes || part == "..";
    if (escapes) {
      return make_error(index_path + ": shard \"" + name + "\" of tensor " + tensor +
                        " is not a path inside the model directory");
    }
    out.shards.insert(name);
    out.weights.emplace_back(tensor, name);
  }
  return out;
}

}  // namespace

Result<DType> parse_safetensors_dtype(const std::string& s) {
  if (s == "F32") return DType::kF32;
  if (s == "F16") return DType::kF16;
  if (s == "BF16") return DType::kBF16;
  if (s == "Q8_0") return DType::kQ8_0;  // pack-internal extension (safetensors.h)
  if (s == "Q4_K") return DType::kQ4_K;
  return make_error(std::string(is_format_dtype(s) ? "unsupported" : "unknown") +
                    " safetensors dtype " + s + " (" + std::string(kSupported) + ")");
}

Status TensorSet::add_file(const std::string& path) {
  TS_ASSIGN(std::unique_ptr<MappedFile> file, MappedFile::open(path));
  const uint64_t file_size = file->size();
  if (file_size < 8) {
    return make_error(path + ": file is " + std::to_string(file_size) +
                      " bytes, too short for the 8-byte safetensors header length");
  }
  const uint64_t header_bytes = read_u64_le(file->data());
  if (header_bytes > file_size - 8) {
    return make_error(path + ": header length " + std::to_string(header_bytes) +
                      " exceeds file size " + std::to_string(file_size));
  }
  const char* header_begin = reinterpret_cast<const char*>(file->data() + 8);
  TS_ASSIGN(json header, parse_header(path, header_begin, header_begin + header_bytes));

  const uint8_t* data_area = file->data() + 8 + header_bytes;
  const uint64_t data_bytes = file_size - 8 - header_bytes;
  struct Range {
    uint64_t begin, end;
    const std::string* name;
  };
  std::vector<Range> ranges;
  std::map<std::string, TensorView> views;
  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      if (!value.is_object()) return make_error(path + ": __metadata__ is not a JSON object");
      continue;
    }
    TS_ASSIGN(Entry entry, parse_entry(path, name, value, data_bytes));
    auto [it, inserted] = views.emplace(name, TensorView{});
    TS_CHECK(inserted, "parse_header rejects duplicate keys");
    TensorView& view = it->second;
    view.name = name;
    view.dtype = entry.dtype;
    view.shape = std::move(entry.shape);
    view.data = data_area + entry.begin;
    view.n_bytes = size_t(entry.end - entry.begin);
    view.file = path;
    view.file_offset = 8 + header_bytes + entry.begin;
    // Empty tensors own no bytes, so they cannot overlap anything.
    if (entry.end > entry.begin) ranges.push_back({entry.begin, entry.end, &it->first});
  }

  // Sorted by start, with no overlap so far each range ends before the next begins, so a
  // range overlaps an earlier one iff it starts before its predecessor ends.
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  for (size_t i = 1; i < ranges.size(); ++i) {
    const Range& prev = ranges[i - 1];
    const Range& cur = ranges[i];
    if (cur.begin < prev.end) {
      return make_error("tensors " + *prev.name + " and " + *cur.name + " in " + path +
                        " overlap: data_offsets " + offsets_str(prev.begin, prev.end) + " and " +
                        offsets_str(cur.begin, cur.end));
    }
  }

  for (const auto& [name, view] : views) {
    auto seen = tensors_.find(name);
    if (seen != tensors_.end()) {
      return make_error("tensor " + name + " appears in both " + seen->second.file + " and " +
                        path);
    }
  }
  tensors_.merge(views);
  files_.push_back(std::move(file));
  return Status::ok_status();
}

Result<std::unique_ptr<TensorSet>> TensorSet::open_file(const std::string& path) {
  auto set = std::make_unique<TensorSet>();
  TS_TRY(set->add_file(path));
  return set;
}

Result<std::unique_ptr<TensorSet>> TensorSet::open_dir(const std::string& dir) {
  std::error_code ec;
  const fs::file_status status = fs::status(dir, ec);
  if (status.type() == fs::file_type::not_found) {
    return make_error("model directory " + dir + " does not exist");
  }
  if (ec) return make_error("cannot access model directory " + dir + ": " + ec.message());
  if (!fs::is_directory(status)) return make_error(dir + " is not a directory");

  auto set = std::make_unique<TensorSet>();
  const std::string index_path = (fs::path(dir) / kIndexFile).string();
  if (fs::exists(index_path, ec)) {
    TS_ASSIGN(ShardIndex index, read_index(index_path));
    for (const std::string& shard : index.shards) {
      const std::string shard_path = (fs::path(dir) / shard).string();
      if (!fs::exists(shard_path, ec)) {
        return make_error("shard " + shard_path + " listed in " + index_path + " does not exist");
      }
      TS_TRY(set->add_file(shard_path));
    }
    for (const auto& [tensor, shard] : index.weights) {
      const std::string shard_path = (fs::path(dir) / shard).string();
      const TensorView* view = set->find(tensor);
      if (view == nullptr) {
        return make_error("tensor " + tensor + " is mapped to " + shard_path + " by " + index_path +
                          " but that shard does not hold it");
      }
      if (view->file != shard_path) {
        return make_error("tensor " + tensor + " is mapped to " + shard_path + " by " + index_path +
                          " but is in " + view->file);
      }
    }
    return set;
  }

  const std::string single_path = (fs::path(dir) / kSingleFile).string();
  if (fs::exists(single_path, ec)) {
    TS_TRY(set->add_file(single_path));
    return set;
  }

  std::vector<std::string> found;
  for (fs::directory_iterator it(dir, ec); !ec && it != fs::directory_iterator();
       it.increment(ec)) {
    // is_regular_file follows symlinks, as in the Hugging Face cache's snapshot folders.
    std::error_code entry_ec;
    if (it->path().extension() == ".safetensors" && it->is_regular_file(entry_ec)) {
      found.push_back(it->path().string());
    }
  }
  if (ec) return make_error("cannot list model directory " + dir + ": " + ec.message());
  if (found.empty()) {
    return make_error("no model.safetensors or model.safetensors.index.json in " + dir);
  }
  std::sort(found.begin(), found.end());
  for (const std::string& path : found) TS_TRY(set->add_file(path));
  return set;
}

const TensorView* TensorSet::find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

Status TensorSet::add_mapped(std::unique_ptr<MappedFile> file, std::vector<TensorView> views) {
  for (TensorView& v : views) {
    if (tensors_.count(v.name))
      return make_error("tensor " + v.name + " appears in " + v.file + " and " +
                        tensors_.at(v.name).file);
    std::string name = v.name;
    tensors_.emplace(std::move(name), std::move(v));
  }
  files_.push_back(std::move(file));
  return {};
}

Status TensorSet::add_owned(std::unique_ptr<uint8_t[]> bytes, std::vector<TensorView> views) {
  for (TensorView& v : views) {
    v.owned = true;
    if (tensors_.count(v.name))
      return make_error("tensor " + v.name + " appears twice (" + v.file + ")");
    std::string name = v.name;
    tensors_.emplace(std::move(name), std::move(v));
  }
  owned_.push_back(std::move(bytes));
  return {};
}

uint64_t TensorSet::file_bytes() const {
  uint64_t total = 0;
  for (const auto& f : files_) total += f->size();
  return total;
}

Status write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors) {
  const std::string prefix = "cannot write " + path + ": tensor ";
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  std::vector<ConstBytes> chunks(2);  // length prefix and header, filled in below
  uint64_t offset = 0;
  for (const TensorToWrite& t : tensors) {
    if (t.name.empty() || t.name == "__metadata__") {
      return make_error(prefix + "name \"" + t.name + "\" is reserved or empty");
    }
    if (header.contains(t.name)) return make_error(prefix + t.name + " appears twice");
    for (int64_t d : t.shape) {
      if (d < 0) {
        return make_error(prefix + t.name + " has negative dimension in shape " +
                          shape_str(t.shape));
      }
    }
    if (std::string why = quant_shape_problem(t.shape, t.dtype); !why.empty()) {
      return make_error(prefix + t.name + ": " + why);
    }
    uint64_t need_bytes = 0;
    if (!byte_count(t.shape, t.dtype, &need_bytes)) {
      return make_error(prefix + t.name + ": element count of shape " + shape_str(t.shape) +
                        " overflows");
    }
    if (need_bytes != t.n_bytes) {
      return make_error(prefix + t.name + " has " + std::to_string(t.n_bytes) + " bytes but " +
                        std::string(dtype_name(t.dtype)) + " shape " + shape_str(t.shape) +
                        " needs " + std::to_string(need_bytes));
    }
    if (t.n_bytes > 0 && t.data == nullptr) {
      return make_error(prefix + t.name + " has " + std::to_string(t.n_bytes) +
                        " bytes but no data");
    }
    header[t.name] = {{"dtype", std::string(dtype_name(t.dtype))},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + t.n_bytes}}};
    offset += t.n_bytes;
    if (t.n_bytes > 0) chunks.push_back({t.data, t.n_bytes});
  }

  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::json::exception& e) {  // a name that is not valid UTF-8
    return make_error("cannot write " + path + ": header JSON: " + e.what());
  }
  // Spaces (which JSON ignores) so the data area starts 8-byte aligned.
  text.append((8 - text.size() % 8) % 8, ' ');
  std::array<uint8_t, 8> length{};
  for (size_t i = 0; i < 8; ++i) length[i] = uint8_t(uint64_t(text.size()) >> (8 * i));
  chunks[0] = {length.data(), length.size()};
  chunks[1] = {text.data(), text.size()};
  return write_file_atomic(path, chunks);
}

}  // namespace ts::io
