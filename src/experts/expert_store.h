// ExpertStore: where each routed expert (layer, expert) lives, and the one way the forward
// pass reaches its weights. acquire() returns an address table (weight views) for the
// experts a step needs; kernels compute on those views and never learn the residency.
//
// This file holds the interface and the resident store (all experts addressable in memory,
// e.g. the checkpoint's memory mapping). Streamed stores implement the same interface.
#pragma once

#include <span>

#include "core/status.h"
#include "model/weights.h"

namespace ts::experts {

class ExpertStore {
 public:
  virtual ~ExpertStore() = default;
  // Fills out[i] with the weights of expert ids[i] of `layer`. The views stay valid until
  // release(layer) (a cache slot is protected while acquired).
  virtual Status acquire(int layer, std::span<const int> ids,
                         std::span<model::ExpertWeights> out) = 0;
  virtual void release(int layer) { (void)layer; }
};

class ResidentStore final : public ExpertStore {
 public:
  explicit ResidentStore(model::ExpertTable table) : table_(std::move(table)) {}
  Status acquire(int layer, std::span<const int> ids,
                 std::span<model::ExpertWeights> out) override {
    const auto& experts = table_[size_t(layer)];
    for (size_t i = 0; i < ids.size(); ++i) out[i] = experts[size_t(ids[i])];
    return {};
  }

 private:
  model::ExpertTable table_;
};

}  // namespace ts::experts
