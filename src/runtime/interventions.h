// Steering vectors and residual-stream capture at layer boundaries. Both act on the residual
// stream right after a layer's FFN (routed MoE) output is added, steering first, so a capture
// at a layer shows the steered stream. Layer -1 is the embedding output (capture only).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"

namespace ts::runtime {

enum class SteerMode : uint8_t {
  kAdd,     // x += s * v
  kAblate,  // x -= s * (x . u) u, u = v / |v|   (s = 1 removes the component)
  kClamp,   // x += (s - x . u) u                (component along u set to s)
  kRenorm,  // y = x + s * v; x = y * |x| / |y|  (add, keep the norm)
};
Result<SteerMode> parse_steer_mode(const std::string& s);

struct SteerOp {
  std::vector<float> v;  // [d_model]
  float scale = 1.0f;
  SteerMode mode = SteerMode::kAdd;
};

// Applies one op to one residual row (the single definition both backends follow).
void apply_steer(const SteerOp& op, float* x, int64_t d);

struct Interventions {
  std::vector<std::vector<SteerOp>> steer;  // [n_layers]; applied in order
  std::vector<int> capture_layers;          // ascending, -1 = embedding output
  bool capture_last = false;                // only the last position of each forward call
  bool trace_router = false;                // record every selection (router trace)
};

// "all", "0,5,12", "10-20", "-1,3-4" -> sorted distinct layers in [-1, n_layers).
Result<std::vector<int>> parse_layer_list(const std::string& s, int n_layers, bool allow_embedding);

}  // namespace ts::runtime
