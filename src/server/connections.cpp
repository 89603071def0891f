#include "server/connections.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <httplib.h>
#include <netdb.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

namespace ts::server {
namespace {

using Clock = std::chrono::steady_clock;

// How long a refused connection is read and dropped after its reply, so the client is not
// reset before it reads the reply.
constexpr auto kLinger = std::chrono::seconds(2);
// Chunked framing lines: a chunk size (hex, extensions) and the trailer section.
constexpr size_t kMaxChunkLineBytes = 1024;
constexpr size_t kMaxTrailerBytes = 8 << 10;

bool iequals(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::tolower(uint8_t(x)) == std::tolower(uint8_t(y));
         });
}

std::string_view trim_ows(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r'))
    s.remove_suffix(1);
  return s;
}

const char* reason_phrase(int status) {
  switch (status) {
    case 400:
      return "Bad Request";
    case 408:
      return "Request Timeout";
    case 413:
      return "Payload Too Large";
    case 415:
      return "Unsupported Media Type";
    case 431:
      return "Request Header Fields Too Large";
    case 501:
      return "Not Implemented";
    case 503:
      return "Service Unavailable";
    default:
      return "Error";
  }
}

// Decodes a chunked body as its bytes arrive (RFC 9112 section 7.1).
class ChunkedDecoder {
 public:
  // Consumes what it can of `wire` from `pos`; an error ends the request.
  std::optional<Refusal> feed(std::string_view wire, size_t& pos, size_t max_body_bytes) {
    while (pos < wire.size() && state_ != State::kDone) {
      if (state_ == State::kData) {
        const size_t n = std::min(remaining_, wire.size() - pos);
        body_.append(wire.substr(pos, n));
        pos += n;
        remaining_ -= n;
        if (remaining_ == 0) state_ = State::kDataEnd;
        continue;
      }
      const size_t nl = wire.find('\n', pos);
      if (nl == std::string_view::npos) {
        if (wire.size() - pos > kMaxChunkLineBytes)
          return Refusal{.message = "a chunk-size line is longer than " +
                                    std::to_string(kMaxChunkLineBytes) + " bytes"};
        return std::nullopt;  // wait for the rest of the line
      }
      std::string_view line = wire.substr(pos, nl - pos);
      if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
      pos = nl + 1;
      if (state_ == State::kDataEnd) {
        if (!line.empty()) return Refusal{.message = "chunk data is not followed by CRLF"};
        state_ = State::kSize;
      } else if (state_ == State::kTrailer) {
        trailer_bytes_ += line.size() + 2;
        if (trailer_bytes_ > kMaxTrailerBytes)
          return Refusal{.status = 431,
                         .message = "the chunked trailer is longer than " +
                                    std::to_string(kMaxTrailerBytes) + " bytes"};
        if (line.empty()) state_ = State::kDone;
      } else {  // kSize
        const std::string_view hex = trim_ows(line.substr(0, line.find(';')));
        size_t size = 0;
        if (hex.empty() || hex.size() > 15 ||
            !std::all_of(hex.begin(), hex.end(), [](char c) { return std::isxdigit(uint8_t(c)); }))
          return Refusal{.message = "a chunk size is not a hexadecimal number"};
        for (char c : hex)
          size =
              size * 16 + size_t(std::isdigit(uint8_t(c)) ? c - '0' : (std::tolower(c) - 'a' + 10));
        if (body_.size() + size > max_body_bytes)
          return Refusal{.status = 413, .code = "request_too_large"};
        remaining_ = size;
        state_ = size == 0 ? State::kTrailer : State::kData;
      }
    }
    return std::nullopt;
  }
  bool done() const { return state_ == State::kDone; }
  std::string& body() { return body_; }

 private:
  enum class State { kSize, kData, kDataEnd, kTrailer, kDone };
  State state_ = State::kSize;
  size_t remaining_ = 0, trailer_bytes_ = 0;
  std::string body_;
};

// One client connection, owned by the reader thread or by a worker.
struct Conn {
  int fd = -1;
  std::string in;   // received, not yet handed to a worker
  std::string out;  // a refusal (or 100 Continue) still to send
  enum class State { kReading, kDraining } state = State::kReading;
  Clock::time_point deadline;  // idle (no byte of a request yet), request, or linger end
  bool started = false;        // a byte of the current request came
  // The head of the current request, once whole.
  size_t head_scan = 0, head_lines = 0, head_bytes = 0;
  bool head_done = false;
  std::string method, target, version, normalized_head;
  bool has_length = false, chunked = false, expects_continue = false;
  bool keep_alive = false, wants_close = false;  // the Connection header's words
  size_t content_length = 0;
  size_t body_pos = 0;  // chunked: wire bytes consumed
  std::optional<ChunkedDecoder> chunks;

  void next_request(Clock::time_point idle_deadline) {
    started = !in.empty();
    head_scan = head_lines = head_bytes = 0;
    head_done = has_length = chunked = expects_continue = keep_alive = wants_close = false;
    method.clear(), target.clear(), version.clear(), normalized_head.clear();
    content_length = body_pos = 0;
    chunks.reset();
    deadline = idle_deadline;
  }
};

// A request read whole, for a worker.
struct Ready {
  std::unique_ptr<Conn> conn;
  std::string request;  // the normalised head and the body
};

// httplib::Stream over a request in memory; writes go to the socket.
class RequestStream final : public httplib::Stream {
 public:
  RequestStream(int fd, std::string request, int write_timeout_s)
      : fd_(fd), in_(std::move(request)), write_timeout_ms_(write_timeout_s * 1000) {}
  bool is_readable() const override { return pos_ < in_.size(); }
  bool is_writable() const override {
    pollfd p{.fd = fd_, .events = POLLOUT, .revents = 0};
    return ::poll(&p, 1, write_timeout_ms_) == 1 && !(p.revents & (POLLERR | POLLHUP));
  }
  ssize_t read(char* ptr, size_t size) override {
    size = std::min(size, in_.size() - pos_);  // 0 past the request: it was read whole
    std::memcpy(ptr, in_.data() + pos_, size);
    pos_ += size;
    return ssize_t(size);
  }
  ssize_t write(const char* ptr, size_t size) override {
    size_t done = 0;
    while (done < size) {
      const ssize_t n = ::send(fd_, ptr + done, size - done, MSG_NOSIGNAL);
      if (n > 0) {
        done += size_t(n);
      } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        if (!is_writable()) return -1;  // the client took nothing for write_timeout_s
      } else if (n < 0 && errno == EINTR) {
        continue;
      } else {
        return -1;
      }
    }
    return ssize_t(done);
  }
  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    sockaddr_storage a{};
    socklen_t len = sizeof a;
    if (::getpeername(fd_, reinterpret_cast<sockaddr*>(&a), &len) == 0) name(a, len, ip, port);
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    sockaddr_storage a{};
    socklen_t len = sizeof a;
    if (::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len) == 0) name(a, len, ip, port);
  }
  socket_t socket() const override { return fd_; }

 private:
  static void name(const sockaddr_storage& a, socklen_t len, std::string& ip, int& port) {
    char host[NI_MAXHOST], serv[NI_MAXSERV];
    if (::getnameinfo(reinterpret_cast<const sockaddr*>(&a), len, host, sizeof host, serv,
                      sizeof serv, NI_NUMERICHOST | NI_NUMERICSERV) == 0) {
      ip = host;
      port = std::atoi(serv);
    }
  }
  int fd_;
  std::string in_;
  size_t pos_ = 0;
  int write_timeout_ms_;
};

struct WorkerContext {
  int fd = -1;
  bool close_after = false;
};
thread_local WorkerContext* tl_worker = nullptr;

}  // namespace

struct Connections::Impl {
  ConnectionOptions opt;
  ServeRequest serve;
  RefusalBody refusal_body;

  std::mutex mu;
  std::vector<std::unique_ptr<Conn>> incoming;  // new sockets and kept-alive connections
  std::deque<Ready> ready;
  std::condition_variable ready_cv;
  bool stopping = false;
  std::atomic<int> open{0};
  int wake[2] = {-1, -1};  // a pipe: wakes the reader's poll

  std::thread reader;
  std::vector<std::thread> workers;

  void wake_reader() {
    const char b = 1;
    [[maybe_unused]] ssize_t n = ::write(wake[1], &b, 1);
  }
  void close_conn(std::unique_ptr<Conn>& c) {
    if (c && c->fd >= 0) {
      ::close(c->fd);
      c->fd = -1;
      --open;
    }
    c.reset();
  }

  void refuse(Conn& c, const Refusal& r) {
    Refusal full = r;
    if (full.message.empty() && r.status == 413)
      full.message = "the request body is larger than " + std::to_string(opt.max_body_bytes) +
                     " bytes (--max-body-bytes)";
    const std::string body = refusal_body(c.target, full);
    c.out +=
        "HTTP/1.1 " + std::to_string(r.status) + " " + reason_phrase(r.status) +
        "\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
        "\r\nConnection: close\r\n\r\n" + body;
    c.state = Conn::State::kDraining;
    c.in.clear();
    c.deadline = Clock::now() + kLinger;
    flush(c);
  }

  // Sends what `out` holds without blocking; a draining connection's write side is shut once
  // all of it went.
  void flush(Conn& c) {
    while (!c.out.empty()) {
      const ssize_t n = ::send(c.fd, c.out.data(), c.out.size(), MSG_NOSIGNAL);
      if (n <= 0) {
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
        c.out.clear();  // the client is gone; the linger ends it
        break;
      }
      c.out.erase(0, size_t(n));
    }
    if (c.state == Conn::State::kDraining) ::shutdown(c.fd, SHUT_WR);
  }

  // Parses the head lines that arrived since the last call. Returns a refusal, or sets
  // head_done once the blank line came.
  std::optional<Refusal> scan_head(Conn& c) {
    for (;;) {
      // Blank lines before a request line are skipped (RFC 9112 section 2.2).
      if (c.head_lines == 0) {
        const size_t skip = c.in.find_first_not_of("\r\n");
        if (skip == std::string::npos) {
          c.in.clear();
          return std::nullopt;
        }
        c.in.erase(0, skip);
      }
      const size_t nl = c.in.find('\n', c.head_scan);
      if (nl == std::string::npos) break;
      std::string_view line(c.in.data() + c.head_scan, nl - c.head_scan);
      if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
      c.head_scan = nl + 1;
      if (c.head_scan > kMaxHeadBytes) break;
      if (c.head_lines++ == 0) {
        const size_t a = line.find(' '), b = line.rfind(' ');
        if (a == std::string_view::npos || a == b)
          return Refusal{.message = "the request line is not 'METHOD TARGET HTTP/1.x'"};
        c.method = line.substr(0, a);
        c.target = line.substr(a + 1, b - a - 1);
        c.version = line.substr(b + 1);
        if (c.version != "HTTP/1.1" && c.version != "HTTP/1.0")
          return Refusal{.status = 400, .message = "only HTTP/1.0 and HTTP/1.1 are served"};
        c.normalized_head = std::string(line) + "\r\n";
        continue;
      }
      if (line.empty()) {
        c.head_bytes = c.head_scan;
        c.head_done = true;
        return std::nullopt;
      }
      if (c.head_lines > size_t(kMaxHeaders) + 1)
        return Refusal{.status = 431,
                       .message = "the request has more than " + std::to_string(kMaxHeaders) +
                                  " header fields"};
      if (line.front() == ' ' || line.front() == '\t')
        return Refusal{.message = "obsolete header line folding is not accepted"};
      const size_t colon = line.find(':');
      if (colon == std::string_view::npos || colon == 0 ||
          line.substr(0, colon).find_first_of(" \t") != std::string_view::npos)
        return Refusal{.message = "a header line is not 'Name: value'"};
      const std::string_view name = line.substr(0, colon), value = trim_ows(line.substr(colon + 1));
      if (iequals(name, "Content-Length")) {
        if (value.empty() || value.size() > 19 ||
            !std::all_of(value.begin(), value.end(),
                         [](char ch) { return std::isdigit(uint8_t(ch)); }))
          return Refusal{.message = "Content-Length is not a number"};
        const size_t n = std::stoull(std::string(value));
        // A repeat is accepted only with the same value (RFC 9110 section 8.6).
        if (c.has_length && n != c.content_length)
          return Refusal{.message = "conflicting Content-Length headers (" +
                                    std::to_string(c.content_length) + " and " + std::to_string(n) +
                                    ")"};
        c.content_length = n;
        c.has_length = true;
        continue;
      }
      if (iequals(name, "Transfer-Encoding")) {
        if (!iequals(value, "chunked") || c.chunked)
          return Refusal{.status = 501,
                         .message = "Transfer-Encoding '" + std::string(value) +
                                    "' is not supported (only a single 'chunked')"};
        c.chunked = true;
        continue;
      }
      if (iequals(name, "Content-Encoding") && !iequals(value, "identity"))
        return Refusal{.status = 415,
                       .message = "Content-Encoding '" + std::string(value) +
                                  "' is not accepted: send the body uncompressed",
                       .code = "unsupported_content_encoding"};
      if (iequals(name, "Expect")) {
        if (!iequals(value, "100-continue"))
          return Refusal{.message = "Expect '" + std::string(value) + "' is not supported"};
        c.expects_continue = true;  // answered once the framing is checked
        continue;
      }
      if (iequals(name, "Connection") && iequals(value, "close")) c.wants_close = true;
      if (iequals(name, "Connection") && iequals(value, "keep-alive")) c.keep_alive = true;
      c.normalized_head.append(line).append("\r\n");
    }
    if (c.in.size() > kMaxHeadBytes)
      return Refusal{.status = 431,
                     .message = "the request line and headers are longer than " +
                                std::to_string(kMaxHeadBytes) + " bytes"};
    return std::nullopt;
  }

  // Advances the connection's current request; a whole one goes to the workers.
  void advance(std::unique_ptr<Conn>& c) {
    if (c->state != Conn::State::kReading) return;
    if (!c->head_done) {
      if (auto r = scan_head(*c)) return refuse(*c, *r);
      if (!c->head_done) return;
      if (c->version == "HTTP/1.0" && !c->keep_alive) c->wants_close = true;
      if (c->chunked && c->has_length)
        return refuse(*c, {.message = "both Content-Length and Transfer-Encoding were sent"});
      if (c->content_length > opt.max_body_bytes)
        return refuse(*c, {.status = 413, .code = "request_too_large"});
      if (c->chunked) c->chunks.emplace();
      c->body_pos = c->head_bytes;
      if (c->expects_continue && (c->chunked || c->content_length > 0)) {
        c->out += "HTTP/1.1 100 Continue\r\n\r\n";
        flush(*c);
      }
    }
    std::string body;
    size_t end;  // of this request's bytes in `in`
    if (c->chunks) {
      if (auto r = c->chunks->feed(c->in, c->body_pos, opt.max_body_bytes)) return refuse(*c, *r);
      // The consumed framing is dropped so `in` stays within the body limit.
      c->in.erase(c->head_bytes, c->body_pos - c->head_bytes);
      c->body_pos = c->head_bytes;
      if (!c->chunks->done()) return;
      body = std::move(c->chunks->body());
      end = c->head_bytes;
    } else {
      if (c->in.size() < c->head_bytes + c->content_length) return;
      body = c->in.substr(c->head_bytes, c->content_length);
      end = c->head_bytes + c->content_length;
    }
    std::string request = std::move(c->normalized_head);
    if (!body.empty() || c->chunked || c->method == "POST" || c->method == "PUT" ||
        c->method == "PATCH" || c->method == "DELETE")
      request += "Content-Length: " + std::to_string(body.size()) + "\r\n";
    request += "\r\n";
    request += body;
    c->in.erase(0, end);
    std::lock_guard lock(mu);
    ready.push_back({.conn = std::move(c), .request = std::move(request)});
    ready_cv.notify_one();
  }

  void read_loop() {
    std::vector<std::unique_ptr<Conn>> conns;
    std::vector<pollfd> fds;
    for (;;) {
      {
        std::lock_guard lock(mu);
        if (stopping) break;
        for (auto& c : incoming) conns.push_back(std::move(c));
        incoming.clear();
      }
      // Kept-alive connections may already hold their next (pipelined) request.
      for (auto& c : conns)
        if (c && c->state == Conn::State::kReading && !c->in.empty()) advance(c);
      const auto now = Clock::now();
      for (auto& c : conns) {
        if (!c || now < c->deadline) continue;
        if (c->state == Conn::State::kReading && c->started)
          refuse(*c, {.status = 408,
                      .message = "the request did not arrive whole within " +
                                 std::to_string(opt.request_timeout_s) + " s (--request-timeout-s)",
                      .code = "request_timeout"});
        else
          close_conn(c);
      }
      std::erase_if(conns, [](const auto& c) { return !c; });

      fds.assign(1, pollfd{.fd = wake[0], .events = POLLIN, .revents = 0});
      auto next = now + std::chrono::seconds(1);
      for (auto& c : conns) {
        fds.push_back(
            {.fd = c->fd, .events = short(POLLIN | (c->out.empty() ? 0 : POLLOUT)), .revents = 0});
        next = std::min(next, c->deadline);
      }
      const auto wait_ms =
          std::chrono::duration_cast<std::chrono::milliseconds>(next - now).count() + 1;
      if (::poll(fds.data(), fds.size(), int(std::max<int64_t>(wait_ms, 0))) < 0 && errno != EINTR)
        break;
      if (fds[0].revents & POLLIN) {
        char drain[64];
        while (::read(wake[0], drain, sizeof drain) > 0) {
        }
      }
      for (size_t i = 1; i < fds.size(); ++i) {
        std::unique_ptr<Conn>& c = conns[i - 1];
        if (!fds[i].revents) continue;
        if (fds[i].revents & POLLOUT) flush(*c);
        if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
        char buf[64 << 10];
        const ssize_t n = ::recv(c->fd, buf, sizeof buf, 0);
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
          close_conn(c);  // gone (or done lingering)
          continue;
        }
        if (n < 0 || c->state == Conn::State::kDraining) continue;
        if (!c->started) {
          c->started = true;
          c->deadline = Clock::now() + std::chrono::seconds(opt.request_timeout_s);
        }
        c->in.append(buf, size_t(n));
        advance(c);
      }
      std::erase_if(conns, [](const auto& c) { return !c; });
    }
    for (auto& c : conns) close_conn(c);
  }

  void work_loop() {
    for (;;) {
      Ready job;
      {
        std::unique_lock lock(mu);
        ready_cv.wait(lock, [&] { return stopping || !ready.empty(); });
        if (stopping) return;
        job = std::move(ready.front());
        ready.pop_front();
      }
      Conn& c = *job.conn;
      WorkerContext ctx{.fd = c.fd};
      tl_worker = &ctx;
      RequestStream stream(c.fd, std::move(job.request), opt.write_timeout_s);
      const bool keep = serve(stream, c.wants_close) && !c.wants_close && !ctx.close_after;
      tl_worker = nullptr;
      if (keep) {
        c.next_request(Clock::now() + std::chrono::seconds(opt.idle_timeout_s));
        if (c.started) c.deadline = Clock::now() + std::chrono::seconds(opt.request_timeout_s);
      } else {
        // Whatever the client still sends is read and dropped until it closes or the linger
        // ends, so the reply is not lost to a reset.
        c.state = Conn::State::kDraining;
        c.in.clear();
        c.deadline = Clock::now() + kLinger;
        ::shutdown(c.fd, SHUT_WR);
      }
      std::lock_guard lock(mu);
      if (stopping) {
        close_conn(job.conn);
        continue;
      }
      incoming.push_back(std::move(job.conn));
      wake_reader();
    }
  }
};

Connections::Connections(ConnectionOptions options, ServeRequest serve, RefusalBody refusal_body)
    : impl_(new Impl{.opt = std::move(options),
                     .serve = std::move(serve),
                     .refusal_body = std::move(refusal_body)}) {
  Impl& m = *impl_;
  // Under the open-file limit, with room for the model's files, the listener and the pipe:
  // at the limit accept() fails with EMFILE, and httplib's loop retries it every millisecond
  // while connects pile up unanswered.
  rlimit files{};
  if (::getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur != RLIM_INFINITY)
    m.opt.max_connections =
        int(std::clamp<int64_t>(int64_t(files.rlim_cur) - 64, 16, m.opt.max_connections));
  if (::pipe2(m.wake, O_NONBLOCK | O_CLOEXEC) != 0) throw std::runtime_error("pipe2 failed");
  m.reader = std::thread([&m] { m.read_loop(); });
  for (int i = 0; i < m.opt.workers; ++i) m.workers.emplace_back([&m] { m.work_loop(); });
}

Connections::~Connections() {
  stop();
  impl_->reader.join();
  for (std::thread& t : impl_->workers) t.join();
  for (Ready& r : impl_->ready) impl_->close_conn(r.conn);
  for (auto& c : impl_->incoming) impl_->close_conn(c);
  ::close(impl_->wake[0]);
  ::close(impl_->wake[1]);
}

void Connections::add(int fd) {
  Impl& m = *impl_;
  if (m.open.load() >= m.opt.max_connections) {
    // Over the cap: answered and closed at once (best effort, never blocks).
    static constexpr char kBusy[] =
        "HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Length: 0\r\n"
        "Connection: close\r\n\r\n";
    ::send(fd, kBusy, sizeof kBusy - 1, MSG_NOSIGNAL | MSG_DONTWAIT);
    ::close(fd);
    return;
  }
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  auto c = std::make_unique<Conn>();
  c->fd = fd;
  c->deadline = Clock::now() + std::chrono::seconds(m.opt.idle_timeout_s);
  ++m.open;
  std::lock_guard lock(m.mu);
  if (m.stopping) return m.close_conn(c);
  m.incoming.push_back(std::move(c));
  m.wake_reader();
}

void Connections::stop() {
  std::lock_guard lock(impl_->mu);
  impl_->stopping = true;
  impl_->ready_cv.notify_all();
  impl_->wake_reader();
}

int current_connection_fd() { return tl_worker ? tl_worker->fd : -1; }

bool current_client_gone() {
  if (!tl_worker) return false;
  pollfd p{.fd = tl_worker->fd, .events = POLLRDHUP, .revents = 0};
  return ::poll(&p, 1, 0) == 1 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR));
}

void close_current_connection_after_response() {
  if (tl_worker) tl_worker->close_after = true;
}

}  // namespace ts::server
