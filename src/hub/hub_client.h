// `turbospark pull`: a model repo's files from the Hugging Face Hub (or a mirror at
// HF_ENDPOINT) into the huggingface_hub cache (hub_cache.h has the layout), over HTTPS with
// libcurl.
//
// The Hub's protocol, as huggingface_hub speaks it:
//   GET  {endpoint}/api/models/{repo}/revision/{rev}   -> {"sha": commit, "siblings":
//        [{"rfilename": path}, ...]}; every file is then fetched at that commit, so one pull
//        is one snapshot even if the branch moves meanwhile.
//   HEAD {endpoint}/{repo}/resolve/{commit}/{path}     (relative redirects followed, others
//        not) -> X-Repo-Commit, ETag / X-Linked-Etag (sha256 of an LFS file, git sha1 of a
//        small one), X-Linked-Size / Content-Length, and for LFS files a Location to the CDN.
//   GET  that location, with Range: bytes=N- when blobs/<etag>.incomplete holds N bytes.
// Errors come back with X-Error-Code (RepoNotFound, GatedRepo, RevisionNotFound,
// EntryNotFound) and 401 / 403 / 404.
//
// Guarantees: a blob is renamed from .incomplete only once its size matches and, for an LFS
// file, its SHA-256 equals the ETag (a mismatch deletes the download and is an error naming
// the file); snapshot links point only at such blobs; refs/<revision> is written last, once
// every file is linked, so `--model ORG/NAME` never finds a partial pull. A dropped
// connection is retried with Range a few times; what is left in .incomplete resumes on the
// next pull.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "core/status.h"
#include "hub/hub_cache.h"

namespace ts::hub {

struct PullOptions {
  HubEnv env;
  std::vector<std::string> includes;  // empty: default_includes() (top-level model files)
  int parallel = 4;                   // files downloaded at once
  bool tty_progress = false;          // one aggregate line rewritten in place on stderr
  // Plain progress lines (a file done, already cached) when not on a terminal.
  std::function<void(const std::string&)> log;
};

struct PullResult {
  std::string commit;
  std::filesystem::path snapshot;
  int files = 0;       // files of the snapshot that the pull covers
  int downloaded = 0;  // of which fetched now (the rest were in the cache)
  uint64_t bytes_fetched = 0;
};

Result<PullResult> pull(const RepoRef& ref, const PullOptions& options);

}  // namespace ts::hub
