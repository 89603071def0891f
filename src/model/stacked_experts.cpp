#include "model/stacked_experts.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "io/safetensors.h"
#include "model/families/family.h"
#include "model/weights.h"

namespace ts::model {
namespace {

Result<const io::TensorView*> stacked_tensor(const io::TensorSet& set, const std::string& name,
                                             const std::vector<int64_t>& shape) {
  TS_ASSIGN(const io::TensorView* t, find_tensor(set, name, shape, "config.json"));
  if (t->dtype != DType::kF32 && t->dtype != DType::kF16 && t->dtype != DType::kBF16)
    return make_error("tensor " + name + " in " + t->file + " is " +
                      std::string(dtype_name(t->dtype)) +
                      "; stacked experts must be F32, F16 or BF16");
  return t;
}

// Columns first, first + step, ... (cols of them) of a row-major [rows, width] matrix.
struct Columns {
  const uint8_t* data;
  int64_t rows, width;
  int64_t first, step, cols;
};

// dst[c][r] = src[r][first + c * step]: the columns, transposed into [cols, rows], in 32 x 32
// tiles so that both sides move along cache lines. T: an element of the tensor's dtype.
template <class T>
void transpose_columns(const Columns& src, uint8_t* dst_bytes) {
  constexpr int64_t kTile = 32;
  const T* in = reinterpret_cast<const T*>(src.data);
  T* out = reinterpret_cast<T*>(dst_bytes);
  for (int64_t r0 = 0; r0 < src.rows; r0 += kTile)
    for (int64_t c0 = 0; c0 < src.cols; c0 += kTile)
      for (int64_t c = c0; c < std::min(src.cols, c0 + kTile); ++c)
        for (int64_t r = r0; r < std::min(src.rows, r0 + kTile); ++r)
          out[c * src.rows + r] = in[r * src.width + src.first + c * src.step];
}
// F32 as 4-byte words, F16 / BF16 as 2-byte ones: values move bit for bit.
void transpose_columns(const Columns& src, size_t elem, uint8_t* dst) {
  if (elem == 4)
    transpose_columns<uint32_t>(src, dst);
  else
    transpose_columns<uint16_t>(src, dst);
}

// One owned buffer of `views` laid end to end (sizes from each view's n_bytes), filled by
// `fill(view index, destination)`, added to the set.
template <class Fill>
Status add_copies(io::TensorSet& set, std::vector<io::TensorView> views, Fill fill) {
  size_t total = 0;
  for (const io::TensorView& v : views) total += v.n_bytes;
  std::unique_ptr<uint8_t[]> bytes(new uint8_t[total]);
  size_t at = 0;
  for (size_t i = 0; i < views.size(); ++i) {
    views[i].data = bytes.get() + at;
    fill(i, bytes.get() + at);
    at += views[i].n_bytes;
  }
  return set.add_owned(std::move(bytes), std::move(views));
}

}  // namespace

Result<std::string> unstack_experts(const HParams& hp, io::TensorSet& set) {
  const FamilyNames& names = family_def(hp.family).names;
  const StackedExperts* st = names.stacked;
  if (!st) return std::string();
  const int64_t n_e = hp.n_experts, d = hp.d_model, ff = hp.d_expert;
  uint64_t copied_bytes = 0;
  for (int l = 0; l < hp.n_layers; ++l) {
    if (!hp.layer_is_moe[size_t(l)]) continue;
    const std::string p = "model.layers." + std::to_string(l) + "." + names.moe_block + ".experts.";
    // A pack (or a checkpoint written by expert) already names each one.
    if (!set.find(p + st->gate_up) && set.find(p + "0." + names.expert_gate + ".weight")) continue;
    TS_ASSIGN(const io::TensorView* gu, stacked_tensor(set, p + st->gate_up, {n_e, d, 2 * ff}));
    TS_ASSIGN(const io::TensorView* gub, stacked_tensor(set, p + st->gate_up_bias, {n_e, 2 * ff}));
    TS_ASSIGN(const io::TensorView* dn, stacked_tensor(set, p + st->down, {n_e, ff, d}));
    TS_ASSIGN(const io::TensorView* dnb, stacked_tensor(set, p + st->down_bias, {n_e, d}));
    auto view = [](const io::TensorView& from, std::string name, std::vector<int64_t> shape) {
      const size_t bytes =
          size_t(shape[0]) * (shape.size() > 1 ? size_t(shape[1]) : 1) * dtype_size(from.dtype);
      return io::TensorView{.name = std::move(name),
                            .dtype = from.dtype,
                            .shape = std::move(shape),
                            .n_bytes = bytes,
                            .file = from.file};
    };
    // gate_up: per expert, the gate matrix then the up matrix; gate_up_bias alike.
    std::vector<io::TensorView> mats, biases, downs, down_biases;
    for (int64_t e = 0; e < n_e; ++e) {
      const std::string pe = p + std::to_string(e) + ".";
      for (const char* part : {names.expert_gate, names.expert_up}) {
        mats.push_back(view(*gu, pe + part + ".weight", {ff, d}));
        biases.push_back(view(*gub, pe + part + ".bias", {ff}));
      }
      downs.push_back(view(*dn, pe + names.expert_down + ".weight", {d, ff}));
      down_biases.push_back(view(*dnb, pe + names.expert_down + ".bias", {d}));
    }
    const size_t gu_elem = dtype_size(gu->dtype), gub_elem = dtype_size(gub->dtype);
    const size_t dn_elem = dtype_size(dn->dtype), dnb_elem = dtype_size(dnb->dtype);
    // View i is expert i / 2's gate (i even: columns 0, 2, ...) or up (odd: 1, 3, ...).
    TS_TRY(add_copies(set, std::move(mats), [&](size_t i, uint8_t* out) {
      const uint8_t* src = gu->data + (i / 2) * size_t(d * 2 * ff) * gu_elem;
      transpose_columns({src, d, 2 * ff, int64_t(i % 2), 2, ff}, gu_elem, out);
    }));
    TS_TRY(add_copies(set, std::move(biases), [&](size_t i, uint8_t* out) {
      const uint8_t* src = gub->data + (i / 2) * size_t(2 * ff) * gub_elem;
      transpose_columns({src, 1, 2 * ff, int64_t(i % 2), 2, ff}, gub_elem, out);
    }));
    TS_TRY(add_copies(set, std::move(downs), [&](size_t e, uint8_t* out) {
      transpose_columns({dn->data + e * size_t(ff * d) * dn_elem, ff, d, 0, 1, d}, dn_elem, out);
    }));
    TS_TRY(add_copies(set, std::move(down_biases), [&](size_t e, uint8_t* out) {
      std::memcpy(out, dnb->data + e * size_t(d) * dnb_elem, size_t(d) * dnb_elem);
    }));
    for (const io::TensorView* t : {gu, gub, dn, dnb}) copied_bytes += t->n_bytes;
    for (const char* stacked : {st->gate_up, st->gate_up_bias, st->down, st->down_bias})
      set.drop(p + stacked);
  }
  if (copied_bytes == 0) return std::string();
  return std::string(family_def(hp.family).name) + "'s stacked experts (" + names.moe_block +
         ".experts." + st->gate_up + ", " + st->down +
         ") were split per expert and transposed at load, into " +
         std::to_string((copied_bytes + 999999) / 1000000) + " MB of memory";
}

}  // namespace ts::model
