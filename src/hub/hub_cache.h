// The Hugging Face Hub's names and its local cache, laid out exactly as the huggingface_hub
// Python library lays it out, so files either side downloaded are reused by the other:
//
//   $HF_HUB_CACHE/models--ORG--NAME/
//     blobs/<etag>                 file contents, named by the Hub's ETag: the sha256 of an
//                                  LFS file, the git sha1 of a small one
//     blobs/<etag>.incomplete      a download in progress (resumed with a Range request)
//     snapshots/<commit>/<path>    relative symlink to ../../blobs/<etag> (one more ../ per
//                                  directory in <path>)
//     refs/<revision>              the commit hash the revision (branch or tag) points at
//   $HF_HUB_CACHE/.locks/models--ORG--NAME/<etag>.lock   held while a blob is written
//
// Invariant kept by `pull`: a snapshot link is only made to a complete, verified blob, and
// refs/<revision> is written only once every file of the pull is linked.
#pragma once

#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace ts::hub {

// ORG/NAME[@REV]; revision "main" when absent.
struct RepoRef {
  std::string repo_id;  // "ORG/NAME"
  std::string revision;
};

// The Hub's repo id rules (huggingface_hub's validate_repo_id): ORG and NAME of letters,
// digits, '-', '_', '.', not starting or ending with '-' or '.', no "--" or "..", at most 96
// characters in all. Errors say what is wrong with `text`.
Result<RepoRef> parse_repo_ref(std::string_view text);

// A 40-digit lowercase hex commit hash.
bool is_commit_hash(std::string_view s);
// A 64-digit lowercase hex SHA-256 (the ETag of an LFS file).
bool is_sha256_hex(std::string_view s);

// An ETag header as a file name: W/ and the surrounding quotes removed.
std::string normalize_etag(std::string_view header);

// Where the Hub is and who we are to it, from HF_ENDPOINT (default https://huggingface.co),
// HF_TOKEN (else the file at HF_TOKEN_PATH or $HF_HOME/token, as `hf auth login` writes it),
// HF_HUB_CACHE (else $HF_HOME/hub, HF_HOME defaulting to $XDG_CACHE_HOME/huggingface or
// ~/.cache/huggingface).
struct HubEnv {
  std::string endpoint;  // no trailing '/'
  std::string token;     // empty: anonymous
  std::filesystem::path cache_dir;
};
HubEnv read_hub_env();

// "models--ORG--NAME".
std::string repo_folder_name(std::string_view repo_id);

// The paths of one repo in the cache.
class RepoCache {
 public:
  RepoCache(const std::filesystem::path& cache_dir, std::string_view repo_id);
  const std::filesystem::path& root() const { return root_; }
  std::filesystem::path blob(std::string_view etag) const;
  std::filesystem::path incomplete(std::string_view etag) const;  // blob + ".incomplete"
  std::filesystem::path lock(std::string_view etag) const;
  std::filesystem::path snapshot(std::string_view commit) const;
  std::filesystem::path pointer(std::string_view commit, std::string_view rfilename) const;
  std::filesystem::path ref(std::string_view revision) const;

 private:
  std::filesystem::path cache_dir_, root_;
  std::string folder_;
};

// The target of the snapshot link for `rfilename`: "../../blobs/<etag>" with one more "../"
// per '/' in rfilename (what os.path.relpath gives the Python library).
std::string pointer_target(std::string_view rfilename, std::string_view etag);

// A repo file name that is safe to join under a snapshot: relative, no empty, "." or ".."
// parts, no backslash or NUL. The listing comes from a server; this keeps its names inside.
bool is_safe_rfilename(std::string_view rfilename);

// The files a model needs when the user gives no --include: config and generation config,
// tokenizer and chat template files, safetensors shards and their index.
const std::vector<std::string>& default_includes();
// fnmatch-style globs as huggingface_hub's allow_patterns read them ('*' also matches '/';
// a pattern ending in '/' matches everything under it).
bool matches_any(const std::vector<std::string>& globs, std::string_view rfilename);

// The snapshot directory for `ref` in the cache, offline: refs/<revision> -> commit (or the
// revision itself when it is a commit hash) -> snapshots/<commit>. Errors name the cache
// directory and say to run `turbospark pull`.
Result<std::filesystem::path> resolve_cached(const std::filesystem::path& cache_dir,
                                             const RepoRef& ref);

// --model's value as a path: an existing file or directory is itself; otherwise something
// shaped like ORG/NAME[@REV] is looked up in the cache; anything else is returned as given
// (the loader then says it does not exist).
Result<std::string> resolve_model_arg(const std::string& arg);

// Percent-encoding as Python's urllib.parse.quote: letters, digits and "_.-~" kept, and
// `keep` (e.g. "/" for a file path, "" for a revision).
std::string url_quote(std::string_view s, std::string_view keep);

}  // namespace ts::hub
