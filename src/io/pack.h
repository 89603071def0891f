// Pack directories (`turbospark pack`): a checkpoint re-laid for expert streaming.
//
//   PACK_DIR/manifest.json       format, version, family, the model's config, quant types,
//                                every file's size and SHA-256, the expert file layout
//   PACK_DIR/dense.safetensors   every tensor except routed experts, Hub names
//   PACK_DIR/experts-LNNN.bin    one per MoE layer: expert e's blob at offsets[e]
//
// Expert blob layout: gate | up | down, each at a 64-byte aligned offset inside the blob
// (tensor "offset" in the manifest); blobs start on 4096-byte boundaries and the per-layer
// stride is the blob size rounded up to 4096 (layers are never padded to the largest).
// Quantized packs (--experts-quant / --dense-quant) store Q8_0 / Q4_K blocks (core/dtype.h)
// in expert blobs and in dense.safetensors (our dtype extension, io/safetensors.h); a matrix
// whose rows are not whole blocks keeps its source dtype, so each tensor's dtype (manifest
// or safetensors header) is the record, experts_quant / dense_quant only the request.
// Invariants checked on open: format and version, each file present with its manifest
// size, every blob inside its file, bytes == rows * row bytes of the dtype (quantized: cols
// a whole number of blocks).
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/status.h"
#include "io/safetensors.h"

namespace ts::io {

constexpr int kPackFormatVersion = 1;
constexpr uint64_t kPackAlign = 4096;

struct PackTensor {
  std::string name;  // Hub name with "{E}" for the expert index
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t offset = 0;  // inside the blob
  uint64_t n_bytes = 0;
};

struct PackExpertLayer {
  int layer = 0;
  std::string file;
  uint64_t stride = 0;
  std::vector<uint64_t> offsets;  // [n_experts]
  PackTensor gate, up, down;
};

struct PackFile {
  std::string path;  // relative to the pack directory
  uint64_t bytes = 0;
  std::string sha256;
};

struct PackManifest {
  int format_version = kPackFormatVersion;
  std::string family;
  nlohmann::json config;  // the source config.json object
  std::string experts_quant = "none";
  std::string dense_quant = "none";
  std::vector<PackFile> files;
  std::vector<PackExpertLayer> expert_layers;
};

bool is_pack_dir(const std::string& dir);
nlohmann::json manifest_to_json(const PackManifest& m);
// Reads and checks manifest.json and the files' sizes (not their digests: verify_pack).
Result<PackManifest> read_pack_manifest(const std::string& dir);
// Recomputes every file's SHA-256; error names the first file that differs.
Status verify_pack(const std::string& dir, const PackManifest& m, bool progress);
// dense.safetensors plus every expert tensor as a view into its mapped expert file.
Result<std::unique_ptr<TensorSet>> open_pack_tensors(const std::string& dir,
                                                     const PackManifest& m);
// SHA-256 of a whole file, hex.
Result<std::string> sha256_file(const std::string& path);

}  // namespace ts::io
