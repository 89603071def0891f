#include "hub/hub_cache.h"

#include <fnmatch.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

namespace ts::hub {
namespace fs = std::filesystem;

namespace {

bool repo_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
         c == '_' || c == '.';
}

// One part of a repo id (the ORG or the NAME); empty when it is valid.
std::string part_problem(std::string_view part) {
  if (part.empty()) return "an empty name";
  for (char c : part)
    if (!repo_char(c)) return std::string("the character '") + c + "'";
  if (part.front() == '-' || part.front() == '.' || part.back() == '-' || part.back() == '.')
    return "a name that starts or ends with '-' or '.'";
  if (part.find("--") != std::string_view::npos || part.find("..") != std::string_view::npos)
    return "'--' or '..'";
  return "";
}

bool all_hex(std::string_view s, size_t n) {
  if (s.size() != n) return false;
  for (char c : s)
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  return true;
}

std::string getenv_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::string(v) : fallback;
}

// "~" and "~/..." as Python's os.path.expanduser reads them (the library expands its paths).
std::string expand_user(std::string p) {
  if (p == "~" || p.rfind("~/", 0) == 0) p = getenv_or("HOME", "") + p.substr(1);
  return p;
}

std::string read_trimmed(const fs::path& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return "";
  std::stringstream ss;
  ss << f.rdbuf();
  std::string s = ss.str();
  const size_t b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t\r\n") - b + 1);
}

}  // namespace

Result<RepoRef> parse_repo_ref(std::string_view text) {
  RepoRef ref;
  std::string_view id = text;
  ref.revision = "main";
  if (const size_t at = text.find('@'); at != std::string_view::npos) {
    id = text.substr(0, at);
    ref.revision = std::string(text.substr(at + 1));
    if (ref.revision.empty())
      return make_error("'" + std::string(text) + "': empty revision after '@'");
    for (char c : ref.revision)
      if (c <= ' ' || c == 0x7f || c == '\\' || c == '~' || c == '^' || c == ':' || c == '?' ||
          c == '*' || c == '[')
        return make_error("'" + std::string(text) +
                          "': the revision holds a character git refuses");
    if (ref.revision.find("..") != std::string::npos || ref.revision.front() == '/' ||
        ref.revision.back() == '/' || ref.revision.find("//") != std::string::npos)
      return make_error("'" + std::string(text) + "': not a valid revision");
  }
  const size_t slash = id.find('/');
  if (slash == std::string_view::npos || id.find('/', slash + 1) != std::string_view::npos)
    return make_error("'" + std::string(text) + "' is not ORG/NAME[@REVISION]");
  if (id.size() > 96)
    return make_error("'" + std::string(text) + "': a repo id has at most 96 characters");
  for (std::string_view part : {id.substr(0, slash), id.substr(slash + 1)}) {
    const std::string p = part_problem(part);
    if (!p.empty())
      return make_error("'" + std::string(text) + "' is not ORG/NAME[@REVISION]: it has " + p);
  }
  ref.repo_id = std::string(id);
  return ref;
}

bool is_commit_hash(std::string_view s) { return all_hex(s, 40); }
bool is_sha256_hex(std::string_view s) { return all_hex(s, 64); }

std::string normalize_etag(std::string_view h) {
  while (!h.empty() && (h.front() == ' ' || h.front() == '\t')) h.remove_prefix(1);
  while (!h.empty() &&
         (h.back() == ' ' || h.back() == '\t' || h.back() == '\r' || h.back() == '\n'))
    h.remove_suffix(1);
  if (h.size() >= 2 && (h[0] == 'W' || h[0] == 'w') && h[1] == '/') h.remove_prefix(2);
  if (h.size() >= 2 && h.front() == '"' && h.back() == '"') h = h.substr(1, h.size() - 2);
  return std::string(h);
}

HubEnv read_hub_env() {
  HubEnv env;
  env.endpoint = getenv_or("HF_ENDPOINT", "https://huggingface.co");
  while (!env.endpoint.empty() && env.endpoint.back() == '/') env.endpoint.pop_back();
  const std::string xdg = getenv_or("XDG_CACHE_HOME", expand_user("~/.cache"));
  const std::string hf_home = expand_user(getenv_or("HF_HOME", xdg + "/huggingface"));
  env.cache_dir = expand_user(getenv_or("HF_HUB_CACHE", hf_home + "/hub"));
  env.token = getenv_or("HF_TOKEN", "");
  if (env.token.empty())
    env.token = read_trimmed(expand_user(getenv_or("HF_TOKEN_PATH", hf_home + "/token")));
  return env;
}

std::string repo_folder_name(std::string_view repo_id) {
  std::string out = "models--";
  for (char c : repo_id) {
    if (c == '/')
      out += "--";
    else
      out += c;
  }
  return out;
}

RepoCache::RepoCache(const fs::path& cache_dir, std::string_view repo_id)
    : cache_dir_(cache_dir), folder_(repo_folder_name(repo_id)) {
  root_ = cache_dir_ / folder_;
}

fs::path RepoCache::blob(std::string_view etag) const { return root_ / "blobs" / etag; }
fs::path RepoCache::incomplete(std::string_view etag) const {
  return root_ / "blobs" / (std::string(etag) + ".incomplete");
}
fs::path RepoCache::lock(std::string_view etag) const {
  return cache_dir_ / ".locks" / folder_ / (std::string(etag) + ".lock");
}
fs::path RepoCache::snapshot(std::string_view commit) const { return root_ / "snapshots" / commit; }
fs::path RepoCache::pointer(std::string_view commit, std::string_view rfilename) const {
  return snapshot(commit) / rfilename;
}
fs::path RepoCache::ref(std::string_view revision) const { return root_ / "refs" / revision; }

std::string pointer_target(std::string_view rfilename, std::string_view etag) {
  std::string up = "../../";
  for (char c : rfilename)
    if (c == '/') up += "../";
  return up + "blobs/" + std::string(etag);
}

bool is_safe_rfilename(std::string_view name) {
  if (name.empty() || name.front() == '/') return false;
  size_t start = 0;
  while (start <= name.size()) {
    size_t end = name.find('/', start);
    if (end == std::string_view::npos) end = name.size();
    const std::string_view part = name.substr(start, end - start);
    if (part.empty() || part == "." || part == "..") return false;
    start = end + 1;
  }
  for (char c : name)
    if (c == '\\' || c == '\0') return false;
  return true;
}

const std::vector<std::string>& default_includes() {
  static const std::vector<std::string> k = {"config.json",
                                             "generation_config.json",
                                             "tokenizer.json",
                                             "tokenizer_config.json",
                                             "special_tokens_map.json",
                                             "added_tokens.json",
                                             "vocab.json",
                                             "merges.txt",
                                             "tokenizer.model",
                                             "chat_template.jinja",
                                             "chat_template.json",
                                             "model*.safetensors",
                                             "model.safetensors.index.json"};
  return k;
}

bool matches_any(const std::vector<std::string>& globs, std::string_view rfilename) {
  const std::string name(rfilename);
  for (std::string g : globs) {
    if (!g.empty() && g.back() == '/') g += '*';
    if (fnmatch(g.c_str(), name.c_str(), 0) == 0) return true;
  }
  return false;
}

Result<fs::path> resolve_cached(const fs::path& cache_dir, const RepoRef& ref) {
  const RepoCache repo(cache_dir, ref.repo_id);
  const std::string pull_hint = "run `turbospark pull " + ref.repo_id +
                                (ref.revision == "main" ? std::string() : "@" + ref.revision) +
                                "` first";
  std::string commit;
  std::error_code ec;
  if (fs::is_regular_file(repo.ref(ref.revision), ec)) {
    commit = read_trimmed(repo.ref(ref.revision));
    if (!is_commit_hash(commit))
      return make_error(repo.ref(ref.revision).string() + " does not hold a commit hash");
  } else if (is_commit_hash(ref.revision)) {
    commit = ref.revision;
  } else {
    return make_error(ref.repo_id + "@" + ref.revision + " is not in the Hugging Face cache (" +
                      cache_dir.string() + "): " + pull_hint);
  }
  const fs::path snap = repo.snapshot(commit);
  if (!fs::is_directory(snap, ec))
    return make_error(ref.repo_id + "@" + ref.revision + ": snapshot " + commit +
                      " is not in the Hugging Face cache (" + cache_dir.string() +
                      "): " + pull_hint);
  return snap;
}

Result<std::string> resolve_model_arg(const std::string& arg) {
  std::error_code ec;
  if (arg.empty() || fs::exists(arg, ec)) return arg;
  auto ref = parse_repo_ref(arg);
  if (!ref.ok()) return arg;
  auto snap = resolve_cached(read_hub_env().cache_dir, ref.value());
  if (!snap.ok())
    return make_error("--model " + arg + ": no such file or directory, and " +
                      snap.error().message);
  return snap.value().string();
}

std::string url_quote(std::string_view s, std::string_view keep) {
  static const char* kHex = "0123456789ABCDEF";
  std::string out;
  for (unsigned char c : s) {
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
        c == '.' || c == '-' || c == '~' || keep.find(char(c)) != std::string_view::npos) {
      out += char(c);
    } else {
      out += '%';
      out += kHex[c >> 4];
      out += kHex[c & 15];
    }
  }
  return out;
}

}  // namespace ts::hub
