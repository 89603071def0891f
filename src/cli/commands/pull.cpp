// pull: a model repo from the Hugging Face Hub into the huggingface_hub cache
// (src/hub/hub_client.h), after which `--model ORG/NAME` finds it offline.
//   turbospark pull ORG/NAME[@REV] [--include GLOB ...] [--parallel N]
#include <unistd.h>

#include <csignal>
#include <cstdio>

#include "cli/commands/commands.h"
#include "hub/hub_client.h"

namespace ts::cli {

Status cmd_pull(const Args& args) {
  if (args.positional().size() != 1)
    return make_error(
        "usage: turbospark pull ORG/NAME[@REVISION] [--include GLOB ...] "
        "[--parallel N]");
  TS_ASSIGN(hub::RepoRef ref, hub::parse_repo_ref(args.positional()[0]));
  hub::PullOptions opt;
  opt.includes = args.all("include");
  TS_ASSIGN(int64_t parallel, args.integer_or("parallel", 4, 1, 32));
  opt.parallel = int(parallel);
  TS_TRY(args.check_all_used());
  opt.env = hub::read_hub_env();
  opt.tty_progress = isatty(fileno(stderr));
  opt.log = [](const std::string& line) {
    std::fprintf(stderr, "turbospark pull: %s\n", line.c_str());
  };
  // A file-size limit (ulimit -f) then fails the write with EFBIG, reported like a full disk,
  // instead of killing the process mid-file.
  std::signal(SIGXFSZ, SIG_IGN);

  TS_ASSIGN(hub::PullResult r, hub::pull(ref, opt));
  std::fprintf(stderr,
               "turbospark pull: %s@%s: %d files (%d downloaded, %.1f MB fetched), commit %s\n",
               ref.repo_id.c_str(), ref.revision.c_str(), r.files, r.downloaded,
               double(r.bytes_fetched) / 1e6, r.commit.c_str());
  // The snapshot's path on stdout, for scripts.
  std::printf("%s\n", r.snapshot.string().c_str());
  return {};
}

}  // namespace ts::cli
