#include "hub/hub_client.h"

#include <curl/curl.h>
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "core/sha256.h"

namespace ts::hub {
namespace fs = std::filesystem;

namespace {

constexpr int kAttempts = 4;           // tries per file when the connection drops
constexpr long kConnectTimeoutS = 15;  // no answer from the host in this long: unreachable
constexpr long kStallSeconds = 60;     // under 1 byte/s for this long: the transfer stalled
constexpr size_t kMaxErrorBody = 4096;

std::string errno_text(int e) { return std::strerror(e); }

std::string lower(std::string s) {
  for (char& c : s)
    if (c >= 'A' && c <= 'Z') c = char(c - 'A' + 'a');
  return s;
}

std::string human_bytes(uint64_t b) {
  char buf[32];
  if (b >= 1000000000ull)
    std::snprintf(buf, sizeof buf, "%.2f GB", double(b) / 1e9);
  else if (b >= 1000000ull)
    std::snprintf(buf, sizeof buf, "%.1f MB", double(b) / 1e6);
  else if (b >= 1000ull)
    std::snprintf(buf, sizeof buf, "%.1f kB", double(b) / 1e3);
  else
    std::snprintf(buf, sizeof buf, "%llu B", (unsigned long long)b);
  return buf;
}

// scheme://host[:port] of an absolute URL.
std::string url_origin(const std::string& url) {
  const size_t scheme = url.find("://");
  if (scheme == std::string::npos) return url;
  const size_t path = url.find('/', scheme + 3);
  return path == std::string::npos ? url : url.substr(0, path);
}

// One response: status, the headers of the last response in a redirect chain (names in
// lowercase), and a body when asked for one.
struct Response {
  long status = 0;
  std::map<std::string, std::string> headers;
  std::string body;
  std::string header(const std::string& name) const {
    auto it = headers.find(name);
    return it == headers.end() ? "" : it->second;
  }
};

size_t on_header(char* data, size_t size, size_t n, void* user) {
  auto* r = static_cast<Response*>(user);
  std::string line(data, size * n);
  if (line.rfind("HTTP/", 0) == 0) {
    r->headers.clear();  // a new response in the chain
    return size * n;
  }
  const size_t colon = line.find(':');
  if (colon == std::string::npos) return size * n;
  std::string value = line.substr(colon + 1);
  const size_t b = value.find_first_not_of(" \t");
  const size_t e = value.find_last_not_of(" \t\r\n");
  value = b == std::string::npos ? "" : value.substr(b, e - b + 1);
  r->headers[lower(line.substr(0, colon))] = value;
  return size * n;
}

size_t on_body_to_string(char* data, size_t size, size_t n, void* user) {
  auto* r = static_cast<Response*>(user);
  r->body.append(data, size * n);
  return size * n;
}

// A curl easy handle with the options every request shares.
class Http {
 public:
  explicit Http(const HubEnv& env) : env_(env), curl_(curl_easy_init()) {
    TS_CHECK(curl_ != nullptr, "curl_easy_init failed (out of memory)");
  }
  ~Http() {
    if (headers_) curl_slist_free_all(headers_);
    curl_easy_cleanup(curl_);
  }
  Http(const Http&) = delete;
  Http& operator=(const Http&) = delete;

  CURL* reset(const std::string& url, bool follow) {
    curl_easy_reset(curl_);
    curl_easy_setopt(curl_, CURLOPT_URL, url.c_str());
    curl_easy_setopt(curl_, CURLOPT_NOSIGNAL, 1L);  // several threads; no SIGALRM timeouts
    curl_easy_setopt(curl_, CURLOPT_PROTOCOLS_STR, "http,https");
    curl_easy_setopt(curl_, CURLOPT_REDIR_PROTOCOLS_STR, "http,https");
    curl_easy_setopt(curl_, CURLOPT_FOLLOWLOCATION, follow ? 1L : 0L);
    curl_easy_setopt(curl_, CURLOPT_MAXREDIRS, 10L);
    curl_easy_setopt(curl_, CURLOPT_CONNECTTIMEOUT, kConnectTimeoutS);
    curl_easy_setopt(curl_, CURLOPT_LOW_SPEED_LIMIT, 1L);
    curl_easy_setopt(curl_, CURLOPT_LOW_SPEED_TIME, kStallSeconds);
    curl_easy_setopt(curl_, CURLOPT_USERAGENT, "turbospark; hf_hub-compatible");
    curl_easy_setopt(curl_, CURLOPT_ERRORBUFFER, error_);
    error_[0] = 0;
    if (headers_) curl_slist_free_all(headers_);
    headers_ = nullptr;
    // The token goes only to the endpoint's own host: curl does not forward a custom
    // Authorization header across a redirect to another host, and a CDN location is only
    // given one when it is on the endpoint's origin.
    if (!env_.token.empty() && url_origin(url) == url_origin(env_.endpoint))
      headers_ = curl_slist_append(headers_, ("Authorization: Bearer " + env_.token).c_str());
    return curl_;
  }
  void add_header(const std::string& h) { headers_ = curl_slist_append(headers_, h.c_str()); }
  CURLcode perform(Response& r) {
    curl_easy_setopt(curl_, CURLOPT_HTTPHEADER, headers_);
    curl_easy_setopt(curl_, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(curl_, CURLOPT_HEADERDATA, &r);
    const CURLcode rc = curl_easy_perform(curl_);
    curl_easy_getinfo(curl_, CURLINFO_RESPONSE_CODE, &r.status);
    return rc;
  }
  std::string error_text(CURLcode rc) const {
    return error_[0] ? std::string(error_) : std::string(curl_easy_strerror(rc));
  }

 private:
  const HubEnv& env_;
  CURL* curl_;
  curl_slist* headers_ = nullptr;
  char error_[CURL_ERROR_SIZE];
};

bool transient(CURLcode rc) {
  switch (rc) {
    case CURLE_PARTIAL_FILE:
    case CURLE_RECV_ERROR:
    case CURLE_SEND_ERROR:
    case CURLE_GOT_NOTHING:
    case CURLE_OPERATION_TIMEDOUT:
    case CURLE_COULDNT_CONNECT:
    case CURLE_HTTP2:
    case CURLE_HTTP2_STREAM:
    case CURLE_SSL_CONNECT_ERROR:
      return true;
    default:
      return false;
  }
}

// A transport failure of a request to `url` as one line.
Error network_error(const std::string& url, const std::string& what, CURLcode rc,
                    const std::string& detail) {
  if (rc == CURLE_COULDNT_RESOLVE_HOST || rc == CURLE_COULDNT_CONNECT ||
      rc == CURLE_COULDNT_RESOLVE_PROXY || rc == CURLE_OPERATION_TIMEDOUT)
    return make_error("cannot reach " + url_origin(url) +
                      " (no network? HF_ENDPOINT names a mirror): " + detail);
  return make_error(what + ": " + detail);
}

// An HTTP error status from the Hub as one line that says what to do.
Error hub_error(const HubEnv& env, const RepoRef& ref, const std::string& what, const Response& r) {
  const std::string code = r.header("x-error-code");
  const std::string repo = ref.repo_id;
  const std::string page = env.endpoint + "/" + repo;
  if (code == "GatedRepo" || (r.status == 403 && !env.token.empty()))
    return make_error(repo + " is gated: accept its terms at " + page +
                      (env.token.empty() ? " and set HF_TOKEN to an access token of that account"
                                         : " with the account whose token is in HF_TOKEN") +
                      " (HTTP " + std::to_string(r.status) + ")");
  if (code == "RevisionNotFound")
    return make_error(repo + " has no revision '" + ref.revision + "' (HTTP " +
                      std::to_string(r.status) + ")");
  if (code == "EntryNotFound")
    return make_error(what + ": not in " + repo + " (HTTP " + std::to_string(r.status) + ")");
  if (code == "RepoNotFound" || r.status == 404)
    return make_error(repo + ": no such model on " + env.endpoint +
                      (env.token.empty() ? " (a private or gated repo needs HF_TOKEN)"
                                         : " that the token in HF_TOKEN can see") +
                      " (HTTP " + std::to_string(r.status) + ")");
  if (r.status == 401 || r.status == 403)
    return make_error(repo + ": access refused (HTTP " + std::to_string(r.status) + "): " +
                      (env.token.empty() ? "set HF_TOKEN to an access token that can read it"
                                         : "the token in HF_TOKEN is not valid for it"));
  return make_error(what + ": HTTP " + std::to_string(r.status) + " from " + env.endpoint);
}

struct RemoteFile {
  std::string rfilename;
  std::string etag;      // normalized; the blob's name
  int64_t size = -1;     // -1: not given
  std::string location;  // where the bytes are
};

// The commit and the file names of the repo at `ref.revision`.
struct Listing {
  std::string commit;
  std::vector<std::string> files;
};

Result<Listing> list_repo(Http& http, const HubEnv& env, const RepoRef& ref) {
  const std::string url =
      env.endpoint + "/api/models/" + ref.repo_id + "/revision/" + url_quote(ref.revision, "");
  Response r;
  CURL* c = http.reset(url, true);
  curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_body_to_string);
  curl_easy_setopt(c, CURLOPT_WRITEDATA, &r);
  curl_easy_setopt(c, CURLOPT_TIMEOUT, 120L);
  const CURLcode rc = http.perform(r);
  if (rc != CURLE_OK) return network_error(url, url, rc, http.error_text(rc));
  if (r.status != 200) return hub_error(env, ref, url, r);
  nlohmann::json j = nlohmann::json::parse(r.body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object())
    return make_error(url + ": the answer is not a JSON object");
  if (!j.contains("sha") || !j["sha"].is_string() || !is_commit_hash(j["sha"].get<std::string>()))
    return make_error(url + ": field 'sha' is missing or not a commit hash");
  if (!j.contains("siblings") || !j["siblings"].is_array())
    return make_error(url + ": field 'siblings' is missing or not an array");
  Listing out;
  out.commit = j["sha"].get<std::string>();
  for (const nlohmann::json& s : j["siblings"]) {
    if (!s.is_object() || !s.contains("rfilename") || !s["rfilename"].is_string())
      return make_error(url + ": a sibling without a string 'rfilename'");
    std::string name = s["rfilename"].get<std::string>();
    if (!is_safe_rfilename(name))
      return make_error(url + ": the file name '" + name + "' would leave the snapshot directory");
    out.files.push_back(std::move(name));
  }
  return out;
}

// HEAD on the resolve URL: the blob's ETag, size and location. Relative redirects (a renamed
// repo) are followed; an absolute one is the CDN location and is not.
Result<RemoteFile> file_metadata(Http& http, const HubEnv& env, const RepoRef& ref,
                                 const std::string& commit, const std::string& rfilename) {
  std::string url =
      env.endpoint + "/" + ref.repo_id + "/resolve/" + commit + "/" + url_quote(rfilename, "/");
  for (int hop = 0; hop < 10; ++hop) {
    Response r;
    CURL* c = http.reset(url, false);
    curl_easy_setopt(c, CURLOPT_NOBODY, 1L);
    curl_easy_setopt(c, CURLOPT_TIMEOUT, 60L);
    http.add_header("Accept-Encoding: identity");  // Content-Length is then the file's size
    CURLcode rc = CURLE_OK;
    for (int attempt = 0; attempt < kAttempts; ++attempt) {
      rc = http.perform(r);
      if (!transient(rc) && !(rc == CURLE_OK && r.status >= 500)) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(250 << attempt));
    }
    if (rc != CURLE_OK) return network_error(url, rfilename, rc, http.error_text(rc));
    const std::string location = r.header("location");
    if (r.status >= 300 && r.status < 400 && !location.empty() && location[0] == '/') {
      url = url_origin(url) + location;
      continue;
    }
    if (r.status >= 400 || (r.status >= 300 && location.empty())) {
      return hub_error(env, ref, rfilename, r);
    }
    RemoteFile f;
    f.rfilename = rfilename;
    std::string etag = r.header("x-linked-etag");
    if (etag.empty()) etag = r.header("etag");
    f.etag = normalize_etag(etag);
    // The ETag names a file in blobs/: only plain names.
    if (f.etag.empty() || f.etag == "." || f.etag == ".." ||
        f.etag.find_first_not_of(
            "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.") !=
            std::string::npos)
      return make_error(rfilename + ": the server gave no usable ETag ('" + etag + "')");
    std::string size = r.header("x-linked-size");
    if (size.empty()) size = r.header("content-length");
    if (!size.empty()) {
      char* end = nullptr;
      const long long v = std::strtoll(size.c_str(), &end, 10);
      if (end && *end == 0 && v >= 0) f.size = v;
    }
    f.location = r.status >= 300 ? location : url;
    return f;
  }
  return make_error(rfilename + ": too many redirects");
}

// Shared by the workers: the first error, a stop flag, the counters the progress line shows.
struct PullState {
  std::atomic<bool> stop{false};
  std::mutex mu;
  std::optional<Error> error;
  std::atomic<uint64_t> bytes_done{0};      // bytes of the files being fetched now on disk
  std::atomic<uint64_t> bytes_expected{0};  // sizes of the files being fetched, as learned
  std::atomic<uint64_t> bytes_fetched{0};   // bytes received over the network
  std::atomic<int> done{0};
  std::atomic<int> downloaded{0};
  void fail(Error e) {
    std::lock_guard<std::mutex> lock(mu);
    if (!error) error = std::move(e);
    stop = true;
  }
};

// An exclusive flock on the lock file the Python library also takes for this blob.
class BlobLock {
 public:
  static Result<BlobLock> take(const fs::path& path) {
    std::error_code ec;
    fs::create_directories(path.parent_path(), ec);
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0)
      return make_error("cannot open lock file " + path.string() + ": " + errno_text(errno));
    if (::flock(fd, LOCK_EX) != 0) {
      const int e = errno;
      ::close(fd);
      return make_error("cannot lock " + path.string() + ": " + errno_text(e));
    }
    return BlobLock(fd);
  }
  BlobLock(BlobLock&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  ~BlobLock() {
    if (fd_ >= 0) ::close(fd_);  // closing releases the flock
  }

 private:
  explicit BlobLock(int fd) : fd_(fd) {}
  int fd_;
};

// The download of one blob into its .incomplete file.
struct Transfer {
  int fd = -1;
  Sha256 sha;
  uint64_t have = 0;  // bytes in the file, all hashed
  bool checked_status = false;
  int write_errno = 0;
  std::string error_body;  // the body of an error status, for its message
  PullState* state = nullptr;
  CURL* curl = nullptr;
};

size_t on_blob_bytes(char* data, size_t size, size_t n, void* user) {
  auto* t = static_cast<Transfer*>(user);
  const size_t len = size * n;
  if (!t->checked_status) {
    t->checked_status = true;
    long status = 0;
    curl_easy_getinfo(t->curl, CURLINFO_RESPONSE_CODE, &status);
    if (status == 200 && t->have > 0) {
      // The server ignored the Range: start over.
      if (::ftruncate(t->fd, 0) != 0 || ::lseek(t->fd, 0, SEEK_SET) != 0) {
        t->write_errno = errno;
        return 0;
      }
      t->state->bytes_done -= t->have;
      t->have = 0;
      t->sha = Sha256();
    }
  }
  long status = 0;
  curl_easy_getinfo(t->curl, CURLINFO_RESPONSE_CODE, &status);
  if (status != 200 && status != 206) {
    if (t->error_body.size() < kMaxErrorBody)
      t->error_body.append(data, std::min(len, kMaxErrorBody));
    return len;
  }
  size_t off = 0;
  while (off < len) {
    const ssize_t w = ::write(t->fd, data + off, len - off);
    if (w < 0) {
      if (errno == EINTR) continue;
      t->write_errno = errno;
      return 0;  // curl stops with CURLE_WRITE_ERROR
    }
    off += size_t(w);
  }
  t->sha.update(data, len);
  t->have += len;
  t->state->bytes_done += len;
  t->state->bytes_fetched += len;
  return len;
}

int on_blob_progress(void* user, curl_off_t, curl_off_t, curl_off_t, curl_off_t) {
  return static_cast<Transfer*>(user)->state->stop ? 1 : 0;
}

// Hashes the bytes already in a partial download, so the digest covers the whole file.
Status hash_prefix(int fd, uint64_t n, Sha256& sha, const fs::path& path) {
  std::vector<char> buf(1 << 20);
  uint64_t off = 0;
  while (off < n) {
    const ssize_t r = ::pread(fd, buf.data(), std::min<uint64_t>(buf.size(), n - off), off_t(off));
    if (r <= 0)
      return make_error("reading " + path.string() + ": " + errno_text(r < 0 ? errno : EIO));
    sha.update(buf.data(), size_t(r));
    off += uint64_t(r);
  }
  return {};
}

std::string write_error_text(const fs::path& path, int e) {
  std::string s = "writing " + path.string() + ": " + errno_text(e);
  if (e == ENOSPC || e == EDQUOT) s += " (free some space; the pull resumes from what was written)";
  return s;
}

// Fetches `f` into blobs/<etag> through blobs/<etag>.incomplete, resuming what is there.
// Returns how many bytes were there to resume from.
Result<uint64_t> fetch_blob(Http& http, const HubEnv& env, const RepoRef& ref,
                            const RepoCache& cache, const RemoteFile& f, PullState& state) {
  const fs::path part = cache.incomplete(f.etag);
  const int fd = ::open(part.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return make_error("cannot create " + part.string() + ": " + errno_text(errno));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  Transfer t;
  t.fd = fd;
  t.state = &state;
  const off_t existing = ::lseek(fd, 0, SEEK_END);
  if (existing < 0) return make_error("reading " + part.string() + ": " + errno_text(errno));
  t.have = uint64_t(existing);
  if (f.size >= 0 && t.have > uint64_t(f.size)) {
    // Longer than the file: not a prefix of it.
    if (::ftruncate(fd, 0) != 0) return make_error(write_error_text(part, errno));
    ::lseek(fd, 0, SEEK_SET);
    t.have = 0;
  }
  TS_TRY(hash_prefix(fd, t.have, t.sha, part));
  const uint64_t resumed_from = t.have;
  state.bytes_done += t.have;
  state.bytes_expected += f.size >= 0 ? uint64_t(f.size) : 0;

  for (int attempt = 0;; ++attempt) {
    if (f.size >= 0 && t.have == uint64_t(f.size)) break;
    Response r;
    CURL* c = http.reset(f.location, true);
    t.curl = c;
    t.checked_status = false;
    t.error_body.clear();
    if (t.have > 0) http.add_header("Range: bytes=" + std::to_string(t.have) + "-");
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_blob_bytes);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &t);
    curl_easy_setopt(c, CURLOPT_NOPROGRESS, 0L);
    curl_easy_setopt(c, CURLOPT_XFERINFOFUNCTION, on_blob_progress);
    curl_easy_setopt(c, CURLOPT_XFERINFODATA, &t);
    const CURLcode rc = http.perform(r);
    if (state.stop && rc == CURLE_ABORTED_BY_CALLBACK) return resumed_from;  // another failed
    if (t.write_errno) return make_error(write_error_text(part, t.write_errno));
    if (rc == CURLE_OK && (r.status == 200 || r.status == 206)) {
      if (f.size < 0 || t.have == uint64_t(f.size)) break;
      if (t.have > uint64_t(f.size))
        return make_error(f.rfilename + ": the server sent " + std::to_string(t.have) +
                          " bytes, more than the " + std::to_string(f.size) + " it announced");
      // Short but "complete": treat as a dropped connection.
    } else if (rc == CURLE_OK && r.status == 416 && t.have > 0) {
      // Our Range starts past the end: the partial file is not a prefix. Start over.
      if (::ftruncate(fd, 0) != 0) return make_error(write_error_text(part, errno));
      ::lseek(fd, 0, SEEK_SET);
      state.bytes_done -= t.have;
      t.have = 0;
      t.sha = Sha256();
    } else if (rc == CURLE_OK && (r.status == 401 || r.status == 403)) {
      return hub_error(env, ref, f.rfilename, r);
    } else if (rc == CURLE_OK && r.status < 500 && r.status != 429) {
      return make_error(f.rfilename + ": HTTP " + std::to_string(r.status) + " from " +
                        url_origin(f.location) + " while downloading it");
    } else if (rc != CURLE_OK && !transient(rc)) {
      return network_error(f.location, f.rfilename, rc, http.error_text(rc));
    }
    if (attempt + 1 >= kAttempts) {
      const std::string why =
          rc != CURLE_OK ? http.error_text(rc) : "HTTP " + std::to_string(r.status);
      return make_error(f.rfilename + ": the download failed " + std::to_string(kAttempts) +
                        " times (" + why + "); " + std::to_string(t.have) + " bytes are kept in " +
                        part.string() + " and the next pull resumes there");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(500 << attempt));
  }

  const std::string digest = t.sha.hex_digest();
  if (is_sha256_hex(lower(f.etag)) && digest != lower(f.etag)) {
    std::error_code ec;
    fs::remove(part, ec);
    return make_error(f.rfilename + ": SHA-256 of the download is " + digest +
                      ", the Hub's ETag says " + f.etag + "; the download was deleted");
  }
  if (::fsync(fd) != 0) return make_error(write_error_text(part, errno));
  std::error_code ec;
  fs::rename(part, cache.blob(f.etag), ec);
  if (ec) return make_error("cannot rename " + part.string() + ": " + ec.message());
  return resumed_from;
}

// snapshots/<commit>/<rfilename> -> ../../blobs/<etag>, made under a temporary name and
// renamed into place so the link appears whole.
Status link_pointer(const RepoCache& cache, const std::string& commit, const RemoteFile& f) {
  const fs::path pointer = cache.pointer(commit, f.rfilename);
  std::error_code ec;
  fs::create_directories(pointer.parent_path(), ec);
  if (ec)
    return make_error("cannot create " + pointer.parent_path().string() + ": " + ec.message());
  const fs::path tmp = pointer.parent_path() /
                       ("." + pointer.filename().string() + ".tmp" + std::to_string(::getpid()));
  fs::remove(tmp, ec);
  fs::create_symlink(pointer_target(f.rfilename, f.etag), tmp, ec);
  if (ec) return make_error("cannot create the link " + tmp.string() + ": " + ec.message());
  fs::rename(tmp, pointer, ec);
  if (ec) {
    fs::remove(tmp, ec);
    return make_error("cannot create the link " + pointer.string() + ": " + ec.message());
  }
  return {};
}

// Writes `text` to `path` through a temporary file and a rename.
Status write_small_file(const fs::path& path, const std::string& text) {
  std::error_code ec;
  fs::create_directories(path.parent_path(), ec);
  if (ec) return make_error("cannot create " + path.parent_path().string() + ": " + ec.message());
  const fs::path tmp = path.string() + ".tmp" + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return make_error("cannot create " + tmp.string() + ": " + errno_text(errno));
  const bool ok = ::write(fd, text.data(), text.size()) == ssize_t(text.size());
  const int e = errno;
  ::close(fd);
  if (!ok) {
    fs::remove(tmp, ec);
    return make_error(write_error_text(path, e));
  }
  fs::rename(tmp, path, ec);
  if (ec) return make_error("cannot write " + path.string() + ": " + ec.message());
  return {};
}

// One file of the pull: skip it when its snapshot link already reaches a blob, else learn
// its ETag, fetch the blob unless present, and link it.
Status pull_file(Http& http, const PullOptions& opt, const RepoRef& ref, const RepoCache& cache,
                 const std::string& commit, const std::string& rfilename, PullState& state) {
  std::error_code ec;
  if (fs::is_regular_file(cache.pointer(commit, rfilename), ec)) {
    if (opt.log && !opt.tty_progress) opt.log(rfilename + ": already in the cache");
    return {};
  }
  TS_ASSIGN(RemoteFile f, file_metadata(http, opt.env, ref, commit, rfilename));
  const fs::path blob = cache.blob(f.etag);
  fs::create_directories(blob.parent_path(), ec);
  if (ec) return make_error("cannot create " + blob.parent_path().string() + ": " + ec.message());
  TS_ASSIGN(BlobLock lock, BlobLock::take(cache.lock(f.etag)));
  bool fetched = false;
  uint64_t resumed_from = 0;
  if (!fs::is_regular_file(blob, ec)) {
    TS_ASSIGN(resumed_from, fetch_blob(http, opt.env, ref, cache, f, state));
    if (state.stop) return {};
    fetched = true;
  }
  TS_TRY(link_pointer(cache, commit, f));
  if (fetched) ++state.downloaded;
  if (!opt.log || opt.tty_progress) return {};
  if (!fetched)
    opt.log(rfilename + ": blob already in the cache, linked");
  else if (resumed_from > 0)
    opt.log(rfilename + ": " + human_bytes(uint64_t(std::max<int64_t>(f.size, 0))) +
            ", resumed after " + std::to_string(resumed_from) + " bytes");
  else
    opt.log(rfilename + ": " + human_bytes(uint64_t(std::max<int64_t>(f.size, 0))));
  return {};
}

// "turbospark pull: 3/7 files, 1.20 GB / 3.40 GB, 45.6 MB/s" rewritten in place.
void progress_line(const PullState& s, int total, double seconds, bool last) {
  const uint64_t got = s.bytes_done, want = s.bytes_expected, net = s.bytes_fetched;
  std::fprintf(stderr, "\r\033[Kturbospark pull: %d/%d files, %s / %s, %.1f MB/s%s", s.done.load(),
               total, human_bytes(got).c_str(), human_bytes(want).c_str(),
               seconds > 0 ? double(net) / 1e6 / seconds : 0.0, last ? "\n" : "");
  std::fflush(stderr);
}

}  // namespace

Result<PullResult> pull(const RepoRef& ref, const PullOptions& opt) {
  static const CURLcode global = curl_global_init(CURL_GLOBAL_DEFAULT);
  if (global != CURLE_OK)
    return make_error("libcurl failed to start: " + std::string(curl_easy_strerror(global)));
  Http http(opt.env);
  TS_ASSIGN(Listing listing, list_repo(http, opt.env, ref));

  const bool defaults = opt.includes.empty();
  std::vector<std::string> files;
  for (const std::string& name : listing.files)
    if (matches_any(defaults ? default_includes() : opt.includes, name)) files.push_back(name);
  if (files.empty()) {
    std::string ggufs, all;
    int n = 0;
    for (const std::string& name : listing.files) {
      if (name.size() > 5 && name.compare(name.size() - 5, 5, ".gguf") == 0)
        ggufs += (ggufs.empty() ? "" : ", ") + name;
      if (n++ < 12) all += (all.empty() ? "" : ", ") + name;
    }
    if (defaults && !ggufs.empty())
      return make_error(ref.repo_id +
                        " holds GGUF files; pick one with --include, e.g. --include "
                        "'*Q4_K_M*' (its split parts come with it): " +
                        ggufs);
    return make_error(ref.repo_id + "@" + ref.revision + ": no file matches " +
                      (defaults ? std::string("the model files pull takes by default (config.json, "
                                              "tokenizer, *.safetensors); give --include GLOB")
                                : std::string("--include")) +
                      "; the repo has: " + (all.empty() ? std::string("no files") : all));
  }

  const RepoCache cache(opt.env.cache_dir, ref.repo_id);
  PullState state;
  std::atomic<size_t> next{0};
  const int workers = std::max(1, std::min<int>(opt.parallel, int(files.size())));
  const auto start = std::chrono::steady_clock::now();
  auto work = [&] {
    Http own(opt.env);
    for (size_t i; !state.stop && (i = next++) < files.size();) {
      Status st = pull_file(own, opt, ref, cache, listing.commit, files[i], state);
      if (!st.ok())
        state.fail(st.error());
      else
        ++state.done;
    }
  };
  std::vector<std::thread> threads;
  for (int w = 0; w < workers; ++w) threads.emplace_back(work);
  std::mutex mu;
  std::condition_variable cv;
  bool finished = false;
  std::thread progress;
  if (opt.tty_progress)
    progress = std::thread([&] {
      std::unique_lock<std::mutex> lock(mu);
      while (!cv.wait_for(lock, std::chrono::milliseconds(250), [&] { return finished; }))
        progress_line(
            state, int(files.size()),
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), false);
    });
  for (std::thread& t : threads) t.join();
  if (progress.joinable()) {
    {
      std::lock_guard<std::mutex> lock(mu);
      finished = true;
    }
    cv.notify_all();
    progress.join();
    progress_line(state, int(files.size()),
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
                  true);
  }
  if (state.error) return *state.error;

  // Every file is linked: now the revision may name this snapshot.
  if (ref.revision != listing.commit)
    TS_TRY(write_small_file(cache.ref(ref.revision), listing.commit));
  PullResult out;
  out.commit = listing.commit;
  out.snapshot = cache.snapshot(listing.commit);
  out.files = int(files.size());
  out.downloaded = state.downloaded;
  out.bytes_fetched = state.bytes_fetched;
  return out;
}

}  // namespace ts::hub
