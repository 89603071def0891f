// The CUDA backend's session: every weight resident in GPU memory, the forward pass of
// runtime::Session on the device. Decode steps (one token) run the routed experts through
// per-layer address tables and are replayed from a CUDA graph; prefill chunks run the dense
// projections and the expert-grouped MoE through cuBLAS.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>

#include "core/dtype.h"
#include "core/status.h"
#include "model/hparams.h"
#include "runtime/engine.h"
#include "runtime/session.h"

namespace ts::cuda {

// Uploads `model`'s weights to device `device` (experts through its ExpertStore).
Result<std::unique_ptr<runtime::Engine>> make_cuda_session(const runtime::LoadedModel& model,
                                                           runtime::SessionOptions options,
                                                           int device);

// Random weights generated on the device for a config (bench --synthetic): matrices
// uniform in ±1/sqrt(cols) in `dtype` (F32, F16, BF16, or Q8_0 quantized from F32), norms 1.
struct SyntheticOptions {
  DType dtype = DType::kBF16;
  uint64_t seed = 1;
  // bench --routing uniform|zipf:S. Random weights route by what they happen to compute,
  // which for this model is a few experts for every token; sampled routing instead draws
  // each token's top-k afresh (Gumbel top-k after the router GEMV) from uniform or Zipf(S)
  // popularity: the expert of rank r (a random order per layer) has weight (r + 1)^-S.
  bool sampled_routing = false;
  double zipf = 0;
  // The routed experts' down matrices in another type than `dtype` (a Q4_K_M GGUF's Q6_K
  // down matrices arrive as Q8_0), for tests.
  std::optional<DType> expert_down_dtype;
};
Result<std::unique_ptr<runtime::Engine>> make_synthetic_cuda_session(
    const model::HParams& hp, runtime::SessionOptions options, int device,
    SyntheticOptions synthetic);

// What a CUDA session reports to `bench`: bytes of weights one decode step reads, the
// device's name and its memory in use.
struct CudaBenchInfo {
  uint64_t decode_weight_bytes = 0;  // dense + lm head + top_k experts per MoE layer
  uint64_t kv_bytes_per_position = 0;
  uint64_t device_bytes = 0;         // weights + KV + scratch allocated
  bool graphs = false;
  uint64_t expert_bytes = 0;         // one routed expert (gate + up + down), for the cache
  int moe_layers = 0;
  int prefill_chunk = 0;             // tokens per prefill chunk (--prefill-chunk or the default)
  double device_peak_gbps = 0;  // this GPU's DRAM peak: 2 x memory clock x bus width (0: unknown)
};
CudaBenchInfo bench_info(const runtime::Engine& engine);

// Per-kernel timing: with profiling on, CUDA graphs are off and every launch is timed with
// CUDA events; the table sums time, calls and the bytes each launch must move.
struct KernelStat {
  std::string name;
  double ms = 0;
  int64_t calls = 0;
  double bytes = 0;
};
// bench --routing uniform on a model directory: each token's top-k drawn afresh (see
// SyntheticOptions::sampled_routing). Call before the first forward.
void set_sampled_routing(runtime::Engine& engine, uint64_t seed);
void set_profiling(runtime::Engine& engine, bool on);  // also clears the table
std::vector<KernelStat> profile_table(const runtime::Engine& engine);
// The last decode step's graph replayed n times back to back, with no host round trip between
// replays (each rewrites the same KV row with the same values, so the session's state is
// unchanged): the step's time on the device alone, ms. Against the host loop's step time it
// shows what the synchronize, the host's turn and the next launch cost a token. An error where
// the last step did not run as one graph (an expert cache, profiling, --steer, ...).
Result<double> replay_step_ms(runtime::Engine& engine, int n);

}  // namespace ts::cuda
