// run and chat: text in, text out. The model directory holds the weights and the tokenizer
// files (tokenizer.json, tokenizer_config.json, generation_config.json); a GGUF file holds
// both, the tokenizer as metadata. Text streams to
// stdout as it is generated; generation stops at the model's EOS ids, a --stop string, or
// the token budget.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

#include "cli/commands/commands.h"
#include "cli/commands/common.h"
#include "runtime/generate.h"
#include "runtime/sampler.h"
#include "runtime/session.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace ts::cli {
namespace {

using ojson = nlohmann::ordered_json;

struct GenFlags {
  runtime::SamplerOptions sampler;
  int64_t max_tokens = 256;
  std::vector<std::string> stops;
};

Result<GenFlags> read_gen_flags(const Args& args) {
  GenFlags g;
  TS_ASSIGN(g.max_tokens, args.integer_or("n", 256, 1, 1 << 20));
  TS_ASSIGN(double temperature, args.number_or("temperature", 0.0, 0.0, 100.0));
  TS_ASSIGN(int64_t top_k, args.integer_or("top-k", 0, 0, 1 << 30));
  TS_ASSIGN(double top_p, args.number_or("top-p", 1.0, 0.0, 1.0));
  TS_ASSIGN(int64_t seed, args.integer_or("seed", 0, 0, INT64_MAX));
  g.sampler = {.temperature = float(temperature), .top_k = int(top_k), .top_p = float(top_p),
               .seed = uint64_t(seed)};
  TS_ASSIGN(g.sampler.logit_bias, parse_logit_biases(args.all("logit-bias")));
  g.stops = args.all("stop");
  for (const std::string& s : g.stops)
    if (s.empty()) return make_error("--stop: an empty stop string would stop at once");
  return g;
}

Result<ojson> read_json_file(const std::string& path, const char* what) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return make_error("cannot read " + std::string(what) + " file " + path);
  std::stringstream ss;
  ss << f.rdbuf();
  ojson j = ojson::parse(ss.str(), nullptr, false);
  if (j.is_discarded()) return make_error(path + ": not valid JSON");
  return j;
}

struct TurnResult {
  std::string text;
  int64_t prompt_tokens = 0, generated = 0;
  double prefill_s = 0, decode_s = 0;
  std::string stop_reason;
};

// Runs prompt ids (reusing the session's cached prefix `cached`) and streams the reply.
Result<TurnResult> generate_text(runtime::Engine& session, std::vector<int>& cached,
                                 const std::vector<int>& prompt, const tokenizer::Tokenizer& tok,
                                 const GenFlags& g, runtime::Sampler& sampler, bool router_hist) {
  if (int64_t(prompt.size()) + g.max_tokens > session.n_ctx())
    return make_error("prompt of " + std::to_string(prompt.size()) + " tokens + " +
                      std::to_string(g.max_tokens) + " new tokens exceed the context of " +
                      std::to_string(session.n_ctx()) + " (use -n or --n-ctx)");
  runtime::GenerateParams params{
      .max_tokens = g.max_tokens,
      .stops = g.stops,
      .next_token = [&](std::span<const float> logits) { return sampler.sample(logits); },
      // Not with --router-hist: steps the engine runs ahead of a stop would count in it.
      .greedy_on_engine = sampler.options().plain_greedy() && !router_hist,
      .on_text =
          [](std::string_view piece) {
            std::fwrite(piece.data(), 1, piece.size(), stdout);
            std::fflush(stdout);
            return true;
          },
  };
  TS_ASSIGN(runtime::Generation gen, runtime::generate(session, cached, prompt, tok, params));
  return TurnResult{.text = std::move(gen.text),
                    .prompt_tokens = gen.prompt_tokens,
                    .generated = gen.generated,
                    .prefill_s = gen.prefill_s,
                    .decode_s = gen.decode_s,
                    .stop_reason = runtime::stop_reason_name(gen.stop_reason)};
}

void print_turn_stats(const TurnResult& r) {
  std::fprintf(stderr, "\nstats: prompt %lld tokens in %.2f s (%.1f tok/s), generated %lld in %.2f s "
               "(%.1f tok/s), stop: %s\n",
               (long long)r.prompt_tokens, r.prefill_s,
               r.prefill_s > 0 ? double(r.prompt_tokens) / r.prefill_s : 0.0,
               (long long)r.generated, r.decode_s,
               r.decode_s > 0 ? double(r.generated) / r.decode_s : 0.0, r.stop_reason.c_str());
}

}  // namespace

Status cmd_run(const Args& args) {
  TS_ASSIGN(ModelFlags flags, read_model_flags(args));
  TS_ASSIGN(GenFlags g, read_gen_flags(args));
  const bool has_prompt = args.has("prompt"), has_messages = args.has("messages");
  const std::string prompt_text = args.str_or("prompt", "");
  const std::string messages_path = args.str_or("messages", "");
  const std::string tools_path = args.str_or("tools", "");
  TS_ASSIGN(int64_t n_ctx, args.integer_or("n-ctx", 0, 1, 1 << 24));
  TS_TRY(args.check_all_used());
  if (has_prompt == has_messages) return make_error("give exactly one of --prompt and --messages");
  TS_ASSIGN(std::unique_ptr<tokenizer::Tokenizer> tok, tokenizer::Tokenizer::load(flags.dir));
  std::vector<int> ids;
  if (has_prompt) {
    ids = tok->encode(prompt_text, /*add_special=*/true);
  } else {
    TS_ASSIGN(tokenizer::ChatTemplate tmpl, tokenizer::ChatTemplate::load(flags.dir));
    TS_ASSIGN(ojson messages, read_json_file(messages_path, "--messages"));
    ojson tools = nullptr;
    if (!tools_path.empty()) {
      TS_ASSIGN(tools, read_json_file(tools_path, "--tools"));
    }
    TS_ASSIGN(std::string text, tmpl.render(messages, tools, /*add_generation_prompt=*/true));
    ids = tok->encode(text, /*add_special=*/false);
  }
  if (ids.empty()) return make_error("the prompt encodes to no tokens");
  TS_ASSIGN(Loaded m, load_model(flags));
  TS_TRY(check_logit_bias(g.sampler, m.model->hp().vocab));
  TS_ASSIGN(runtime::Interventions iv, build_interventions(flags, m.model->hp()));
  const int ctx = n_ctx ? int(n_ctx) : int(std::min<int64_t>(m.model->hp().max_positions,
                                                             int64_t(ids.size()) + g.max_tokens));
  TS_ASSIGN(std::unique_ptr<runtime::Engine> engine,
            make_session(flags, m, {.n_ctx = ctx, .interventions = std::move(iv)}));
  runtime::Engine& session = *engine;
  runtime::Sampler sampler(g.sampler);
  sampler.set_pool(m.pool.get());
  std::vector<int> cached;
  TS_ASSIGN(TurnResult r,
            generate_text(session, cached, ids, *tok, g, sampler, !flags.router_hist.empty()));
  std::printf("\n");
  std::fflush(stdout);
  if (flags.stats) print_turn_stats(r);
  return finish_run(flags, m, session, r.prompt_tokens + r.generated);
}

Status cmd_chat(const Args& args) {
  TS_ASSIGN(ModelFlags flags, read_model_flags(args));
  TS_ASSIGN(GenFlags g, read_gen_flags(args));
  const std::string system = args.str_or("system", "");
  TS_ASSIGN(int64_t n_ctx, args.integer_or("n-ctx", 4096, 16, 1 << 24));
  TS_TRY(args.check_all_used());
  TS_ASSIGN(std::unique_ptr<tokenizer::Tokenizer> tok, tokenizer::Tokenizer::load(flags.dir));
  TS_ASSIGN(tokenizer::ChatTemplate tmpl, tokenizer::ChatTemplate::load(flags.dir));
  TS_ASSIGN(Loaded m, load_model(flags));
  TS_TRY(check_logit_bias(g.sampler, m.model->hp().vocab));
  const int ctx = int(std::min<int64_t>(n_ctx, m.model->hp().max_positions));
  TS_ASSIGN(std::unique_ptr<runtime::Engine> engine, make_session(flags, m, {.n_ctx = ctx}));
  runtime::Engine& session = *engine;
  runtime::Sampler sampler(g.sampler);
  sampler.set_pool(m.pool.get());
  const bool tty = isatty(fileno(stdin));
  ojson history = ojson::array();
  auto start = [&] {
    history = ojson::array();
    if (!system.empty()) history.push_back({{"role", "system"}, {"content", system}});
  };
  start();
  std::vector<int> cached;
  if (tty) std::fprintf(stderr, "turbospark chat: /reset clears the history, Ctrl-D leaves\n");
  std::string line;
  for (;;) {
    if (tty) std::fprintf(stderr, "> ");
    if (!std::getline(std::cin, line)) break;
    if (line == "/reset") {
      start();
      std::fprintf(stderr, "(history cleared)\n");
      continue;
    }
    if (line.empty()) continue;
    history.push_back({{"role", "user"}, {"content", line}});
    TS_ASSIGN(std::string text, tmpl.render(history, nullptr, true));
    std::vector<int> ids = tok->encode(text, false);
    auto r = generate_text(session, cached, ids, *tok, g, sampler, !flags.router_hist.empty());
    if (!r.ok()) {
      // A turn that does not fit is reported; the conversation can go on after /reset.
      std::fprintf(stderr, "turbospark chat: error: %s\n", r.error().message.c_str());
      history.erase(history.end() - 1);
      continue;
    }
    std::printf("\n");
    std::fflush(stdout);
    history.push_back({{"role", "assistant"}, {"content", r->text}});
    if (flags.stats) print_turn_stats(r.value());
  }
  if (tty) std::fprintf(stderr, "\n");
  return {};
}

}  // namespace ts::cli
