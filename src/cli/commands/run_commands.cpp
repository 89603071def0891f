// logits and generate: the token-id contract other tools rely on.
#include <cstdio>

#include "cli/commands/commands.h"
#include "cli/commands/common.h"
#include "io/npy.h"
#include "runtime/sampler.h"
#include "runtime/session.h"

namespace ts::cli {
namespace {

// Positions past the config's max_position_embeddings are refused by both commands (the
// model was not trained there; the KV cache and RoPE tables are sized from it elsewhere).
Status check_positions(int64_t n_tokens, const std::string& what, const Loaded& m) {
  if (n_tokens > m.model->hp().max_positions)
    return make_error(
        what + " = " + std::to_string(n_tokens) +
        " tokens exceed max_position_embeddings = " + std::to_string(m.model->hp().max_positions));
  return {};
}

}  // namespace

Status cmd_logits(const Args& args) {
  TS_ASSIGN(std::string tokens_arg, args.str("tokens"));
  TS_ASSIGN(std::string out_path, args.str("out"));
  TS_ASSIGN(std::vector<int> tokens, parse_token_list(tokens_arg));
  TS_ASSIGN(ModelFlags flags, read_model_flags(args));
  TS_TRY(args.check_all_used());
  TS_ASSIGN(Loaded m, load_model(flags));
  TS_TRY(check_positions(int64_t(tokens.size()), "prompt", m));
  TS_ASSIGN(runtime::Interventions iv, build_interventions(flags, m.model->hp()));
  TS_ASSIGN(std::unique_ptr<runtime::Engine> engine,
            make_session(flags, m, {.n_ctx = int(tokens.size()), .interventions = std::move(iv)}));
  runtime::Engine& session = *engine;
  std::vector<float> logits;
  TS_TRY(session.forward(tokens, &logits));
  TS_TRY(io::write_npy_f32(out_path, {int64_t(tokens.size()), m.model->hp().vocab},
                           logits.data()));
  return finish_run(flags, m, session, int64_t(tokens.size()));
}

Status cmd_generate(const Args& args) {
  TS_ASSIGN(std::string tokens_arg, args.str("tokens"));
  TS_ASSIGN(std::vector<int> tokens, parse_token_list(tokens_arg));
  TS_ASSIGN(int64_t n, args.integer_or("n", 16, 0, 1 << 20));
  runtime::SamplerOptions so;
  TS_ASSIGN(double temperature, args.number_or("temperature", 0.0, 0.0, 100.0));
  TS_ASSIGN(int64_t top_k, args.integer_or("top-k", 0, 0, 1 << 30));
  TS_ASSIGN(double top_p, args.number_or("top-p", 1.0, 0.0, 1.0));
  TS_ASSIGN(int64_t seed, args.integer_or("seed", 0, 0, INT64_MAX));
  so.temperature = float(temperature);
  so.top_k = int(top_k);
  so.top_p = float(top_p);
  so.seed = uint64_t(seed);
  TS_ASSIGN(so.logit_bias, parse_logit_biases(args.all("logit-bias")));
  TS_ASSIGN(ModelFlags flags, read_model_flags(args));
  TS_TRY(args.check_all_used());
  TS_ASSIGN(Loaded m, load_model(flags));
  TS_TRY(check_logit_bias(so, m.model->hp().vocab));
  const int64_t n_ctx = int64_t(tokens.size()) + n;
  TS_TRY(check_positions(n_ctx, "prompt + n", m));
  TS_ASSIGN(runtime::Interventions iv, build_interventions(flags, m.model->hp()));
  TS_ASSIGN(std::unique_ptr<runtime::Engine> engine,
            make_session(flags, m, {.n_ctx = int(n_ctx), .interventions = std::move(iv)}));
  runtime::Engine& session = *engine;
  runtime::Sampler sampler(so);
  sampler.set_pool(m.pool.get());
  std::string line;
  if (n > 0) {
    TS_TRY(session.forward(tokens, nullptr));
    if (n > 1 && so.plain_greedy() && flags.router_hist.empty()) {
      // The engine picks the rest (on CUDA without a host round trip per token). Not with
      // --router-hist: steps it runs ahead would count in it.
      const int first = sampler.sample(session.last_logits());
      line = std::to_string(first);
      TS_TRY(session.decode_greedy(first, int(n - 1), [&](int id) {
        line += " " + std::to_string(id);
        return true;
      }));
    } else {
      for (int64_t i = 0; i < n; ++i) {
        int next = sampler.sample(session.last_logits());
        line += (i ? " " : "") + std::to_string(next);
        if (i + 1 < n) TS_TRY(session.forward(std::span<const int>(&next, 1), nullptr));
      }
    }
  }
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
  return finish_run(flags, m, session, int64_t(tokens.size()) + n);
}

}  // namespace ts::cli
