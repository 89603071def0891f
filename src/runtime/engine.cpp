#include "runtime/engine.h"

#include <cstdlib>

#include "runtime/sampler.h"
#include "runtime/session.h"

#ifdef TS_HAVE_CUDA
#include "backend/cuda/cuda_session.h"
#endif

namespace ts::runtime {

Status Engine::decode_greedy(int token, int n, const std::function<bool(int)>& on_token) {
  for (int i = 0; i < n; ++i) {
    TS_TRY(forward(std::span<const int>(&token, 1), nullptr));
    token = argmax(last_logits());
    if (!on_token(token)) break;
  }
  return {};
}

Result<int> Engine::open_sequence(int, std::span<const int>) {
  return make_error("the " + device_name() + " backend does not batch sequences");
}

Status Engine::step(std::span<const SeqInput>, std::vector<float>*) {
  return make_error("the " + device_name() + " backend does not batch sequences");
}

Result<Device> parse_device(const std::string& s) {
  if (s == "cpu") return Device{DeviceKind::kCpu, 0};
  if (s == "cuda") return Device{DeviceKind::kCuda, 0};
  if (s.rfind("cuda:", 0) == 0 && s.size() > 5 && s.size() < 9) {
    int index = 0;
    for (char c : s.substr(5)) {
      if (c < '0' || c > '9') return make_error("--device: '" + s + "' is not cpu, cuda or cuda:N");
      index = index * 10 + (c - '0');
    }
    return Device{DeviceKind::kCuda, index};
  }
  return make_error("--device: '" + s + "' is not cpu, cuda or cuda:N");
}

Result<std::unique_ptr<Engine>> make_engine(const LoadedModel& model, ThreadPool& pool,
                                            SessionOptions options, Device device) {
  if (device.kind == DeviceKind::kCpu && options.quantize_q8_0)
    return make_error("quantizing at load is a CUDA option; for the CPU, make a Q8_0 pack");
  if (device.kind == DeviceKind::kCpu)
    return std::unique_ptr<Engine>(std::make_unique<Session>(model, pool, std::move(options)));
#ifdef TS_HAVE_CUDA
  return cuda::make_cuda_session(model, std::move(options), device.index);
#else
  return make_error("--device cuda: this turbospark was built without CUDA (configure with "
                    "nvcc on the PATH, or -DTS_CUDA=ON)");
#endif
}

}  // namespace ts::runtime
