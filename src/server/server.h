// The HTTP front of `turbospark serve` (cpp-httplib's parser and router over connections.h,
// which reads each request whole within its limits): routes, API-key, Host and Origin checks,
// JSON errors, SSE streaming. Requests are validated and tokenized on the worker threads,
// then queued to the Engine; a streaming response is written as the engine produces text,
// and a client that went away (a failed write; for a non-streaming request, its closed
// connection) cancels the generation at the next token.
//
// Routes: POST /v1/chat/completions, /v1/completions, /v1/messages; GET /v1/models,
// /v1/models/{id}, /health (never needs the key), /metrics.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"

namespace ts::tokenizer {
class Tokenizer;
class ChatTemplate;
}  // namespace ts::tokenizer

namespace ts::server {

class Engine;

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8080;      // 0 = any free port
  std::string api_key;  // empty = no key needed
  // Web origins whose requests are served (with CORS headers); "*" any. Requests with another
  // Origin header get 403.
  std::vector<std::string> cors_origins;
  std::string model_id;
  size_t max_body_bytes = 8 << 20;
  int request_timeout_s = 30;  // a request's first byte to its last (slow clients: 408)
  int http_threads = 80;       // workers: enough for every queued request plus a few for /health
};

class Server {
 public:
  Server(ServerOptions options, Engine& engine, const tokenizer::Tokenizer& tok,
         const tokenizer::ChatTemplate& tmpl);
  ~Server();
  // Binds, calls on_listening(port) once the socket accepts connections, and serves until
  // stop() (callable from any thread). Error: the address cannot be bound.
  Status run(const std::function<void(int)>& on_listening);
  void stop();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace ts::server
