// The connection layer of `turbospark serve`, under cpp-httplib's parser and router.
//
// cpp-httplib 0.11 gives each accepted socket a pool thread for its whole life: a client that
// trickles header bytes, idles on keep-alive or sends a chunked or gzip body holds that thread,
// and nothing bounds the header count, the chunked body or the decompressed size (issue 56).
// Here one poll thread reads every request whole - head and body - with no thread per
// connection, and checks its framing before anything parses it:
//   - the head (request line + headers) at most kMaxHeadBytes and kMaxHeaders lines (431);
//   - Content-Length: digits, one value even when repeated (400), at most max_body_bytes
//     (413, answered before the body is read); Transfer-Encoding: chunked only (501), never
//     with Content-Length (400), decoded here and counted against max_body_bytes (413);
//     Content-Encoding: identity only (415);
//   - a request must arrive whole within request_timeout_s of its first byte (408), the next
//     request on a kept-alive connection start within idle_timeout_s (closed quietly).
// Only then does a worker thread run it: cpp-httplib's process_request reads the request
// from memory, normalised (a chunked body as Content-Length, no Expect), so no worker ever
// waits on a client's bytes. Bytes after the request (pipelining) stay for the next one.
// Refusals close the connection after the reply (lingering: the rest of the body is read and
// dropped for a moment, so the client sees the reply rather than a reset).
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>

namespace httplib {
class Stream;
}

namespace ts::server {

inline constexpr size_t kMaxHeadBytes = 64 << 10;
inline constexpr int kMaxHeaders = 100;

struct ConnectionOptions {
  size_t max_body_bytes = 8 << 20;
  int request_timeout_s = 30;
  int idle_timeout_s = 5;
  // Open at once (at most the open-file limit less 64); later ones get a 503 at accept.
  int max_connections = 1024;
  int workers = 80;            // threads running whole requests
  int write_timeout_s = 30;    // one write's wait for the client to take bytes
};

// A refusal by the connection layer: the status and a message for the JSON error body.
struct Refusal {
  int status = 400;
  std::string message, code;
};

// What the worker asks of the owner (Server): run one request read whole, writing the
// response to `stream`; returns false when the connection must close afterwards.
using ServeRequest = std::function<bool(httplib::Stream& stream, bool close_connection)>;
// The JSON body of a refusal (OpenAI or Anthropic shape by the request target; empty when
// the request line was not read); called once per refusal, on the reader thread.
using RefusalBody = std::function<std::string(const std::string& target, const Refusal&)>;

class Connections {
 public:
  Connections(ConnectionOptions options, ServeRequest serve, RefusalBody refusal_body);
  ~Connections();  // closes every connection and joins the threads
  // Takes an accepted socket (from any thread); it is closed here in the end.
  void add(int fd);
  void stop();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// The connection of the request the calling worker thread runs; -1 on other threads.
int current_connection_fd();
// Whether the client of the calling worker's request closed its side (a generation for it
// can stop); false on other threads.
bool current_client_gone();
// The response being written must end the connection (HTTP/1.0 stream without a length).
void close_current_connection_after_response();

}  // namespace ts::server
