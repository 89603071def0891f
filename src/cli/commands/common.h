// Pieces shared by the subcommands: loading the model named by --model with a thread pool.
#pragma once

#include <memory>
#include <thread>

#include "cli/args.h"
#include "core/thread_pool.h"
#include "runtime/model.h"

namespace ts::cli {

struct Loaded {
  std::unique_ptr<runtime::LoadedModel> model;
  std::unique_ptr<ThreadPool> pool;
};

// The flags every model-running command takes. Read them (with the command's own flags)
// before Args::check_all_used(), so a typo is reported before a slow load.
struct ModelFlags {
  std::string dir;
  int threads = 1;
};

inline Result<ModelFlags> read_model_flags(const Args& args) {
  ModelFlags f;
  TS_ASSIGN(f.dir, args.str("model"));
  TS_ASSIGN(int64_t threads,
            args.integer_or("threads", std::max(1u, std::thread::hardware_concurrency()), 1, 1024));
  f.threads = int(threads);
  return f;
}

inline Result<Loaded> load_model(const ModelFlags& flags) {
  Loaded out;
  TS_ASSIGN(out.model, runtime::LoadedModel::load(flags.dir));
  out.pool = std::make_unique<ThreadPool>(flags.threads);
  return out;
}

}  // namespace ts::cli
