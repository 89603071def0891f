// The CLI's subcommands. Each parses its flags, calls the runtime and prints; errors come
// back as values and main() turns them into one line on stderr and exit code 2.
#pragma once

#include "cli/args.h"
#include "core/status.h"

namespace ts::cli {

Status cmd_logits(const Args& args);
Status cmd_generate(const Args& args);
Status cmd_inspect(const Args& args);
Status cmd_synth(const Args& args);
Status cmd_bench(const Args& args);
Status cmd_bench_cuda(const Args& args);  // bench --device cuda
Status cmd_pack(const Args& args);
Status cmd_verify(const Args& args);
Status cmd_analyze_router(const Args& args);
Status cmd_run(const Args& args);
Status cmd_chat(const Args& args);
Status cmd_chat_template(const Args& args);
Status cmd_tokenize(const Args& args);
Status cmd_serve(const Args& args);
Status cmd_pull(const Args& args);

}  // namespace ts::cli
