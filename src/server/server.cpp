#include "server/server.h"

#include <httplib.h>
#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <ctime>
#include <deque>
#include <future>
#include <mutex>
#include <optional>
#include <random>

#include "server/api.h"
#include "server/connections.h"
#include "server/engine.h"
#include "server/json_depth.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

namespace ts::server {
namespace {

bool is_anthropic(const httplib::Request& req) { return req.path.rfind("/v1/messages", 0) == 0; }

void send_json(httplib::Response& res, int status, const json& body) {
  res.status = status;
  res.set_content(dump_json(body), "application/json");
}

bool is_ollama(const httplib::Request& req) { return req.path.rfind("/api/", 0) == 0; }

void send_error(const httplib::Request& req, httplib::Response& res, const ApiError& e) {
  send_json(res, e.status,
            is_anthropic(req) ? anthropic_error_body(e)
            : is_ollama(req)  ? ollama_error_body(e)
                              : openai_error_body(e));
}

// A request body as JSON: too deep a nesting is refused before nlohmann sees it (its parser
// and every walker after it recurse per level, json_depth.h).
Parsed<json> parse_body(const httplib::Request& req) {
  if (std::optional<size_t> at = json_too_deep_at(req.body))
    return ApiError{.message = "the request body nests arrays and objects deeper than " +
                               std::to_string(kMaxJsonDepth) + " levels (at byte " +
                               std::to_string(*at) + ")",
                    .code = "json_too_deep"};
  json body = json::parse(req.body, nullptr, false);
  if (body.is_discarded()) return ApiError{.message = "the request body is not valid JSON"};
  return body;
}

// The body of /tokenize or /detokenize, which must be a JSON object; otherwise the 400 is sent.
std::optional<json> object_body(const httplib::Request& req, httplib::Response& res) {
  Parsed<json> body = parse_body(req);
  if (auto* e = std::get_if<ApiError>(&body)) {
    send_error(req, res, *e);
    return std::nullopt;
  }
  if (std::get<json>(body).is_object()) return std::move(std::get<json>(body));
  send_error(req, res, {.message = "the request body must be a JSON object"});
  return std::nullopt;
}

// Compares without an early exit, so the time taken does not reveal a matching prefix.
bool same_secret(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= uint8_t(a[i]) ^ uint8_t(b[i]);
  return diff == 0;
}

bool iequals(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::tolower(uint8_t(x)) == std::tolower(uint8_t(y));
         });
}

// The token of "Authorization: Bearer TOKEN"; the scheme is case-insensitive (RFC 7235).
std::optional<std::string> bearer_token(const std::string& header) {
  if (header.size() < 7 || !iequals(std::string_view(header).substr(0, 6), "bearer") ||
      header[6] != ' ')
    return std::nullopt;
  const size_t start = header.find_first_not_of(' ', 7);
  return start == std::string::npos ? std::string() : header.substr(start);
}

bool is_loopback_name(std::string_view host) {
  return host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0;
}

// "name:port", "[v6]:port" or "name" -> the name ("[::1]:8080" -> "::1").
std::string_view host_name(std::string_view host) {
  if (!host.empty() && host.front() == '[') return host.substr(1, host.find(']') - 1);
  return host.substr(0, host.find(':'));
}

const char* route_label(const std::string& path) {
  for (const char* r :
       {"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/models", "/health",
        "/metrics", "/tokenize", "/detokenize", "/v1/messages/count_tokens", "/api/chat",
        "/api/generate", "/api/tags", "/api/ps", "/api/show", "/api/version"})
    if (path == r) return r;
  return path.rfind("/v1/models/", 0) == 0 ? "/v1/models/{id}" : "other";
}

// Text pieces handed from the engine thread to the HTTP thread writing the stream.
struct StreamChannel {
  struct Piece {
    std::string text;
    std::vector<TokenLogprob> logprobs;  // of the tokens since the previous piece
  };
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Piece> pieces;
  std::optional<Result<runtime::Generation>> result;  // set once, after the last piece
};

// cpp-httplib's server with its connection handling replaced (connections.h): an accepted
// socket goes to Connections, which reads each request whole and hands it back to
// process_request, the library's own parser and router.
class HttpServer final : public httplib::Server {
 public:
  std::unique_ptr<Connections> connections;
  // Runs one request read whole; false when the connection must close afterwards.
  bool serve(httplib::Stream& stream, bool close_connection) {
    bool closed = false;
    const bool ok = process_request(stream, close_connection, closed, nullptr);
    return ok && !closed;
  }
  int listening_socket() const { return svr_sock_; }

 private:
  bool process_and_close_socket(socket_t sock) override {
    connections->add(sock);
    return true;
  }
};

// Connects queued before accept() takes them; httplib's own is 5 (CPPHTTPLIB_LISTEN_BACKLOG,
// compiled into Debian's libcpp-httplib), which put bursts of 32-64 connects into SYN cookies.
constexpr int kListenBacklog = 512;

}  // namespace

struct Server::Impl {
  ServerOptions opt;
  Engine& engine;
  const tokenizer::Tokenizer& tok;
  const tokenizer::ChatTemplate& tmpl;
  HttpServer http;
  int64_t started = std::time(nullptr);
  size_t max_token_bytes = 1;  // of the vocabulary's longest token

  void setup();
  void setup_ollama();
  void handle_generate(Api api, const httplib::Request& req, httplib::Response& res);
  Parsed<std::vector<int>> tokenize(const GenRequest& r, Api api);
};

void Server::Impl::setup() {
  for (int id = 0; id < tok.vocab_size(); ++id)
    max_token_bytes = std::max(max_token_bytes, tok.token_bytes(id).size());
  // The accept loop's queue only hands sockets to `connections`, whose workers run requests.
  http.new_task_queue = [] { return new httplib::ThreadPool(2); };
  http.connections = std::make_unique<Connections>(
      ConnectionOptions{.max_body_bytes = opt.max_body_bytes,
                        .request_timeout_s = opt.request_timeout_s,
                        .workers = opt.http_threads},
      [this](httplib::Stream& stream, bool close) { return http.serve(stream, close); },
      [this](const std::string& target, const Refusal& r) {
        // (httplib's logger never sees these requests: counted here.)
        const std::string path = target.substr(0, target.find('?'));
        engine.metrics().count_response(route_label(path), r.status);
        const ApiError e{.status = r.status, .message = r.message, .code = r.code};
        return dump_json(path.rfind("/v1/messages", 0) == 0 ? anthropic_error_body(e)
                                                            : openai_error_body(e));
      });
  http.set_payload_max_length(opt.max_body_bytes);  // (connections.h enforces it first)
  http.set_keep_alive_max_count(1000);              // (only named in the Keep-Alive header now)
  // SO_REUSEADDR only: httplib's default adds SO_REUSEPORT, with which a second server binds
  // the same port and the kernel splits the connections between the two.
  http.set_socket_options([](socket_t sock) {
    int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
  });

  http.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    // A keyless server on loopback trusts whoever reaches it; a web page reaches it too, by
    // DNS rebinding (its own name resolved to 127.0.0.1): only loopback names pass as Host.
    if (opt.api_key.empty() && is_loopback_name(opt.host) && req.has_header("Host")) {
      const std::string host = req.get_header_value("Host");
      const std::string_view name = host_name(host);
      if (!is_loopback_name(name) && name != opt.host) {
        send_error(req, res,
                   {.status = 403,
                    .message = "Host '" + std::string(name) +
                               "' is not a loopback name of this server (a keyless server on " +
                               opt.host + " answers only localhost, 127.0.0.1 and [::1])",
                    .code = "host_not_allowed"});
        return httplib::Server::HandlerResponse::Handled;
      }
    }
    // A browser names the page's origin; cross-site requests (even the "simple" POSTs that
    // need no preflight) are refused unless --cors-origin allows that origin.
    if (req.has_header("Origin")) {
      const std::string origin = req.get_header_value("Origin");
      const bool allowed = std::find(opt.cors_origins.begin(), opt.cors_origins.end(), origin) !=
                               opt.cors_origins.end() ||
                           std::find(opt.cors_origins.begin(), opt.cors_origins.end(), "*") !=
                               opt.cors_origins.end();
      if (!allowed) {
        send_error(req, res,
                   {.status = 403,
                    .message = "requests from the web origin '" + origin +
                               "' are refused (--cors-origin allows an origin)",
                    .code = "origin_not_allowed"});
        return httplib::Server::HandlerResponse::Handled;
      }
      res.set_header("Access-Control-Allow-Origin", origin);
      res.set_header("Vary", "Origin");
      if (req.method == "OPTIONS") {  // the preflight
        res.status = 204;
        res.set_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS");
        res.set_header("Access-Control-Allow-Headers",
                       req.has_header("Access-Control-Request-Headers")
                           ? req.get_header_value("Access-Control-Request-Headers")
                           : "Authorization, Content-Type, x-api-key, anthropic-version");
        res.set_header("Access-Control-Max-Age", "600");
        return httplib::Server::HandlerResponse::Handled;
      }
    }
    if (opt.api_key.empty() || req.path == "/health")
      return httplib::Server::HandlerResponse::Unhandled;
    const std::optional<std::string> bearer = bearer_token(req.get_header_value("Authorization"));
    const bool ok = (bearer && same_secret(*bearer, opt.api_key)) ||
                    (req.has_header("x-api-key") &&
                     same_secret(req.get_header_value("x-api-key"), opt.api_key));
    if (ok) return httplib::Server::HandlerResponse::Unhandled;
    send_error(
        req, res,
        {.status = 401,
         .message =
             "a valid API key is required: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
         .code = "invalid_api_key"});
    return httplib::Server::HandlerResponse::Handled;
  });

  // Errors httplib produces itself (no route, body over the limit) get JSON bodies too.
  http.set_error_handler(httplib::Server::HandlerWithResponse(
      [this](const httplib::Request& req, httplib::Response& res) {
        if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
        ApiError e{.status = res.status, .message = "HTTP error " + std::to_string(res.status)};
        if (res.status == 404) {
          e.message = "no route " + req.method + " " + req.path;
          e.code = "not_found";
        } else if (res.status == 413) {
          e.message = "the request body is larger than " + std::to_string(opt.max_body_bytes) +
                      " bytes (--max-body-bytes)";
          e.code = "request_too_large";
        } else if (res.status >= 500) {
          e.type = "server_error";
        }
        send_error(req, res, e);
        return httplib::Server::HandlerResponse::Handled;
      }));

  http.set_exception_handler(
      [](const httplib::Request& req, httplib::Response& res, std::exception_ptr ep) {
        std::string what = "unknown exception";
        try {
          std::rethrow_exception(ep);
        } catch (const std::exception& e) {
          what = e.what();
        } catch (...) {
        }
        send_error(req, res,
                   {.status = 500, .message = "internal error: " + what, .type = "server_error"});
      });

  http.set_logger([this](const httplib::Request& req, const httplib::Response& res) {
    engine.metrics().count_response(route_label(req.path), res.status);
  });

  http.Get("/health", [](const httplib::Request&, httplib::Response& res) {
    send_json(res, 200, {{"status", "ok"}});
  });
  http.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(engine.metrics().prometheus(engine.queue_depth(), engine.running(), engine.kv_stats()),
                    "text/plain; version=0.0.4");
  });
  auto model_json = [this] {
    return json{{"id", opt.model_id},
                {"object", "model"},
                {"created", started},
                {"owned_by", "turbospark"}};
  };
  http.Get("/v1/models", [model_json](const httplib::Request&, httplib::Response& res) {
    send_json(res, 200, {{"object", "list"}, {"data", json::array({model_json()})}});
  });
  http.Get(R"(/v1/models/(.+))", [this, model_json](const httplib::Request& req,
                                                    httplib::Response& res) {
    if (req.matches[1] != opt.model_id)
      return send_error(req, res,
                        {.status = 404,
                         .message = "The model '" + req.matches[1].str() + "' does not exist",
                         .param = "model",
                         .code = "model_not_found"});
    send_json(res, 200, model_json());
  });
  // llama.cpp's server routes for counting and inspecting tokens (UIs and tools use them).
  http.Post("/tokenize", [this](const httplib::Request& req, httplib::Response& res) {
    const std::optional<json> body = object_body(req, res);
    if (!body) return;
    const auto it = body->find("content");
    if (it == body->end() || !it->is_string())
      return send_error(req, res, {.message = "'content' must be a string", .param = "content"});
    const json add_special = body->value("add_special", json(false)),
               with_pieces = body->value("with_pieces", json(false));
    for (const auto& [name, v] :
         {std::pair{"add_special", &add_special}, {"with_pieces", &with_pieces}})
      if (!v->is_boolean() && !v->is_null())
        return send_error(
            req, res, {.message = "'" + std::string(name) + "' must be a boolean", .param = name});
    const std::vector<int> ids = tok.encode(it->get<std::string>(), add_special == true);
    if (with_pieces != true) return send_json(res, 200, {{"tokens", ids}});
    // Each piece as text, or as its byte values where it is not valid UTF-8 on its own.
    json tokens = json::array();
    for (int id : ids) {
      const std::string piece = tok.token_bytes(id);
      json p = piece;
      if (!tokenizer::is_valid_utf8(piece)) {
        p = json::array();
        for (unsigned char b : piece) p.push_back(int(b));
      }
      tokens.push_back({{"id", id}, {"piece", p}});
    }
    send_json(res, 200, {{"tokens", tokens}});
  });
  http.Post("/detokenize", [this](const httplib::Request& req, httplib::Response& res) {
    const std::optional<json> body = object_body(req, res);
    if (!body) return;
    const auto it = body->find("tokens");
    if (it == body->end() || !it->is_array())
      return send_error(req, res,
                        {.message = "'tokens' must be an array of token ids", .param = "tokens"});
    std::vector<int> ids;
    for (size_t i = 0; i < it->size(); ++i) {
      const json& v = (*it)[i];
      if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= tok.vocab_size())
        return send_error(req, res,
                          {.message = "'tokens[" + std::to_string(i) + "]' is " + v.dump() +
                                      ", not a token id below " + std::to_string(tok.vocab_size()),
                           .param = "tokens"});
      ids.push_back(int(v.get<int64_t>()));
    }
    send_json(res, 200, {{"content", tok.decode(ids, /*skip_special=*/false)}});
  });
  // Anthropic's token count: the prompt a Messages request with this body would prefill.
  http.Post(
      "/v1/messages/count_tokens", [this](const httplib::Request& req, httplib::Response& res) {
        Parsed<json> parsed_body = parse_body(req);
        if (auto* e = std::get_if<ApiError>(&parsed_body)) return send_error(req, res, *e);
        json& body = std::get<json>(parsed_body);
        if (body.is_object() && !body.contains("max_tokens")) body["max_tokens"] = 1;  // not asked
        Parsed<GenRequest> parsed = parse_messages_request(body, tmpl, opt.model_id);
        if (auto* e = std::get_if<ApiError>(&parsed)) return send_error(req, res, *e);
        const GenRequest& r = std::get<GenRequest>(parsed);
        send_json(res, 200, {{"input_tokens", tok.encode(r.prompt_text, r.add_special).size()}});
      });
  http.Post("/v1/chat/completions", [this](const httplib::Request& req, httplib::Response& res) {
    handle_generate(Api::kChat, req, res);
  });
  http.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
    handle_generate(Api::kCompletion, req, res);
  });
  http.Post("/v1/messages", [this](const httplib::Request& req, httplib::Response& res) {
    handle_generate(Api::kMessages, req, res);
  });
  setup_ollama();
}

// Ollama's routes: the two generating ones through handle_generate, and what its clients ask
// about the model. /api/version reports the Ollama API version whose routes these follow.
void Server::Impl::setup_ollama() {
  http.Post("/api/chat", [this](const httplib::Request& req, httplib::Response& res) {
    handle_generate(Api::kOllamaChat, req, res);
  });
  http.Post("/api/generate", [this](const httplib::Request& req, httplib::Response& res) {
    handle_generate(Api::kOllamaGenerate, req, res);
  });
  http.Get("/api/version", [](const httplib::Request&, httplib::Response& res) {
    send_json(res, 200, {{"version", "0.12.0"}});
  });
  const auto details = [this] {
    const runtime::LoadedModel& m = engine.model();
    const model::WeightCounts& c = m.counts();
    char params[32];
    const double n = double(c.params_total);
    std::snprintf(params, sizeof params, n >= 1e9 ? "%.1fB" : "%.1fM", n >= 1e9 ? n / 1e9 : n / 1e6);
    return json{{"format", m.dir().size() > 5 && m.dir().ends_with(".gguf") ? "gguf" : "safetensors"},
                {"family", std::string(model::family_name(m.hp().family))},
                {"families", json::array({std::string(model::family_name(m.hp().family))})},
                {"parameter_size", params},
                {"quantization_level", std::string(dtype_name(m.dense().lm_head.dtype))}};
  };
  const auto entry = [this, details] {
    const model::WeightCounts& c = engine.model().counts();
    return json{{"name", opt.model_id},
                {"model", opt.model_id},
                {"modified_at", "1970-01-01T00:00:00Z"},
                {"size", c.dense_bytes + c.routed_bytes},
                {"digest", ""},
                {"details", details()}};
  };
  http.Get("/api/tags", [entry](const httplib::Request&, httplib::Response& res) {
    send_json(res, 200, {{"models", json::array({entry()})}});
  });
  http.Get("/api/ps", [this, entry](const httplib::Request&, httplib::Response& res) {
    json e = entry();
    e["expires_at"] = "2318-01-01T00:00:00Z";  // loaded for as long as the server runs
    e["size_vram"] = 0;
    e["context_length"] = engine.n_ctx();
    send_json(res, 200, {{"models", json::array({e})}});
  });
  http.Post("/api/show", [this, details](const httplib::Request& req, httplib::Response& res) {
    Parsed<json> parsed = parse_body(req);
    if (auto* e = std::get_if<ApiError>(&parsed)) return send_error(req, res, *e);
    const json& body = std::get<json>(parsed);
    const json* name = body.is_object() && body.contains("model") ? &body["model"]
                       : body.is_object() && body.contains("name") ? &body["name"]
                                                                    : nullptr;
    const std::string id = name && name->is_string() ? name->get<std::string>() : "";
    if (id != opt.model_id && id != opt.model_id + ":latest")
      return send_error(req, res,
                        {.status = 404,
                         .message = "model '" + id + "' not found; this server serves '" +
                                    opt.model_id + "'",
                         .param = "model"});
    const model::HParams& hp = engine.model().hp();
    const std::string arch(model::family_name(hp.family));
    send_json(res, 200,
              {{"modelfile", ""},
               {"parameters", ""},
               {"template", tmpl.source()},
               {"details", details()},
               {"model_info",
                {{"general.architecture", arch},
                 {"general.parameter_count", engine.model().counts().params_total},
                 {arch + ".context_length", engine.n_ctx()},
                 {arch + ".embedding_length", hp.d_model},
                 {arch + ".block_count", hp.n_layers},
                 {arch + ".expert_count", hp.n_experts},
                 {arch + ".expert_used_count", hp.top_k}}},
               {"capabilities", json::array({"completion", "tools"})}});
  });
}

Parsed<std::vector<int>> Server::Impl::tokenize(const GenRequest& r, Api api) {
  const std::string param = api == Api::kCompletion ? "prompt" : "messages";
  // No token is longer than max_token_bytes, so a longer text is more than n_ctx tokens:
  // refused before the tokenizer spends seconds on it.
  const size_t max_prompt_bytes = size_t(engine.n_ctx()) * max_token_bytes;
  if (r.prompt_ids.empty() && r.prompt_text.size() > max_prompt_bytes)
    return ApiError{.message = "the prompt is " + std::to_string(r.prompt_text.size()) +
                               " bytes: more than the context's " + std::to_string(engine.n_ctx()) +
                               " tokens (--n-ctx) of at most " + std::to_string(max_token_bytes) +
                               " bytes each can hold",
                    .param = param,
                    .code = "context_length_exceeded"};
  std::vector<int> ids = r.prompt_ids;
  if (ids.empty()) ids = tok.encode(r.prompt_text, r.add_special);
  for (int id : ids)
    if (id >= tok.vocab_size())
      return ApiError{.message = "'prompt' holds token id " + std::to_string(id) +
                                 ", outside the vocabulary of " + std::to_string(tok.vocab_size()),
                      .param = param};
  if (ids.empty()) return ApiError{.message = "the prompt encodes to no tokens", .param = param};
  if (r.json_object && tok.eos_ids().empty())
    return ApiError{.message =
                        "'response_format' json_object needs an end-of-generation token, "
                        "and this model's tokenizer names none",
                    .param = "response_format"};
  if (const int id = r.sampling.bias_outside(tok.vocab_size()); id >= 0)
    return ApiError{.message = "'logit_bias' names token id " + std::to_string(id) +
                               ", outside the vocabulary of " + std::to_string(tok.vocab_size()),
                    .param = "logit_bias"};
  const int64_t n_ctx = engine.n_ctx();
  if (int64_t(ids.size()) >= n_ctx)
    return ApiError{.message = "the prompt is " + std::to_string(ids.size()) +
                               " tokens; the context holds " + std::to_string(n_ctx) + " (--n-ctx)",
                    .param = param,
                    .code = "context_length_exceeded"};
  if (r.max_tokens && int64_t(ids.size()) + *r.max_tokens > n_ctx)
    return ApiError{.message = "the prompt (" + std::to_string(ids.size()) +
                               " tokens) + max_tokens (" + std::to_string(*r.max_tokens) +
                               ") exceed the context of " + std::to_string(n_ctx) + " tokens",
                    .param = "max_tokens",
                    .code = "context_length_exceeded"};
  return ids;
}

void Server::Impl::handle_generate(Api api, const httplib::Request& req, httplib::Response& res) {
  Parsed<json> parsed_body = parse_body(req);
  if (auto* e = std::get_if<ApiError>(&parsed_body)) return send_error(req, res, *e);
  const bool ollama = api == Api::kOllamaChat || api == Api::kOllamaGenerate;
  if (ollama) {
    parsed_body = ollama_to_openai(std::get<json>(parsed_body), api, opt.model_id);
    if (auto* e = std::get_if<ApiError>(&parsed_body)) return send_error(req, res, *e);
  }
  const json& body = std::get<json>(parsed_body);
  // The OpenAI form a request is read as (Ollama's generate without raw is a chat turn).
  const Api form = !ollama               ? api
                   : body.contains("prompt") ? Api::kCompletion
                                             : Api::kChat;
  Parsed<GenRequest> parsed = form == Api::kChat ? parse_chat_request(body, tmpl, opt.model_id)
                              : form == Api::kCompletion
                                  ? parse_completion_request(body, opt.model_id)
                                  : parse_messages_request(body, tmpl, opt.model_id);
  if (auto* e = std::get_if<ApiError>(&parsed)) return send_error(req, res, *e);
  GenRequest& r = std::get<GenRequest>(parsed);
  // A JSON-mode reply is the object itself: not read for tool calls or reasoning.
  if (r.json_object) r.parse_tools = false;
  Parsed<std::vector<int>> ids = tokenize(r, form);
  if (auto* e = std::get_if<ApiError>(&ids)) return send_error(req, res, *e);

  const std::vector<int> prompt = std::move(std::get<std::vector<int>>(ids));
  const uint64_t seed = r.seed_given ? r.sampling.seed : uint64_t(std::random_device{}());
  // The request's job; choice i of n samples with seed + i.
  const auto make_job = [&](int choice) {
    auto j = std::make_shared<Job>();
    j->prompt = prompt;
    j->max_tokens = r.max_tokens.value_or(engine.n_ctx() - int64_t(prompt.size()));
    j->stops = r.stops;
    j->sampling = r.sampling;
    j->sampling.seed = seed + uint64_t(choice);
    j->top_logprobs = r.logprobs;
    j->echo = r.echo;
    j->json_object = r.json_object;
    j->schema = r.schema;
    return j;
  };
  auto job = make_job(0);
  const int64_t prompt_tokens = int64_t(prompt.size());
  const char* prefix = form == Api::kChat ? "chatcmpl-" : form == Api::kCompletion ? "cmpl-" : "msg_";
  const ResponseInfo info{
      .id = make_id(prefix), .model = opt.model_id, .created = std::time(nullptr)};
  const bool in_reasoning =
      form != Api::kCompletion && !r.json_object && prompt_opens_reasoning(r.prompt_text);
  const ApiError busy{.status = 503, .code = "queue_full", .type = "server_error"};

  if (!r.stream) {
    // n choices, one job after another.
    std::vector<json> choices;
    for (int i = 0; i < r.n; ++i) {
      auto one = i == 0 ? job : make_job(i);
      auto done = std::make_shared<std::promise<Result<runtime::Generation>>>();
      auto result = done->get_future();
      one->on_done = [done](Result<runtime::Generation> g) { done->set_value(std::move(g)); };
      if (Status st = engine.submit(one); !st.ok()) {
        ApiError e = busy;
        e.message = st.error().message;
        res.set_header("Retry-After", "1");
        return send_error(req, res, e);
      }
      // A client that leaves while its reply is generated stops the job at the next token
      // (a stream notices at its next write; this reply is written only at the end).
      while (result.wait_for(std::chrono::milliseconds(100)) != std::future_status::ready)
        if (!one->cancelled && current_client_gone()) one->cancelled = true;
      Result<runtime::Generation> gen = result.get();
      if (one->cancelled) {
        res.status = 499;  // (nginx's "client closed request": counted, never sent)
        close_current_connection_after_response();
        return;
      }
      if (!gen.ok())
        return send_error(req, res,
                          {.status = 500,
                           .message = "generation failed: " + gen.error().message,
                           .type = "server_error"});
      // (The engine is done with the job: its logprobs are complete.)
      if (ollama)
        return send_json(res, 200,
                         ollama_response(api, info, *gen,
                                         split_reply(gen->text, r.parse_tools, in_reasoning)));
      if (api == Api::kCompletion) {
        if (r.echo)
          gen->text =
              (r.prompt_ids.empty() ? r.prompt_text : tok.decode(r.prompt_ids, false)) + gen->text;
        choices.push_back(completion_response(
            info, *gen, r.logprobs >= 0 ? completion_logprobs_json(one->logprobs) : json(nullptr)));
        continue;
      }
      ReplyParts reply = split_reply(gen->text, r.parse_tools, in_reasoning);
      choices.push_back(
          api == Api::kChat
              ? chat_response(info, *gen, reply,
                              r.logprobs >= 0 ? chat_logprobs_json(one->logprobs) : json(nullptr))
              : messages_response(info, *gen, reply, r.stops));
    }
    return send_json(res, 200,
                     r.n == 1 ? std::move(choices[0]) : merge_choices(std::move(choices)));
  }

  auto channel = std::make_shared<StreamChannel>();
  Job* raw = job.get();  // the engine holds the job while it calls on_text
  // (on the engine thread, which also appends the job's logprobs)
  job->on_text = [channel, raw, sent = size_t(0)](std::string_view piece) mutable {
    std::vector<TokenLogprob> fresh(raw->logprobs.begin() + long(sent), raw->logprobs.end());
    sent = raw->logprobs.size();
    if (!piece.empty() || !fresh.empty()) {
      std::lock_guard lock(channel->mu);
      channel->pieces.push_back({std::string(piece), std::move(fresh)});
    }
    channel->cv.notify_one();
    return !raw->cancelled;
  };
  job->on_done = [channel](Result<runtime::Generation> g) {
    {
      std::lock_guard lock(channel->mu);
      channel->result = std::move(g);
    }
    channel->cv.notify_one();
  };
  if (Status st = engine.submit(job); !st.ok()) {
    ApiError e = busy;
    e.message = st.error().message;
    res.set_header("Retry-After", "1");
    return send_error(req, res, e);
  }
  const StreamSpec spec{.info = info,
                        .include_usage = r.include_usage,
                        .parse_tools = r.parse_tools,
                        .starts_in_reasoning = in_reasoning,
                        .stops = r.stops};
  std::shared_ptr<SseWriter> writer = make_sse_writer(api, spec);
  const char* content_type = ollama ? "application/x-ndjson" : "text/event-stream";
  const bool anthropic = api == Api::kMessages;
  res.set_header("Cache-Control", "no-cache");
  auto provider = [this, channel, job, writer, prompt_tokens, anthropic, ollama](
                      size_t, httplib::DataSink& sink) {
    auto send = [&](const std::string& frame) {
      if (frame.empty()) return true;
      if (!sink.write(frame.data(), frame.size())) {
        job->cancelled = true;  // the client went away
        return false;
      }
      engine.metrics().add_stream_bytes(frame.size());
      return true;
    };
    if (!send(writer->begin(prompt_tokens))) return false;
    for (;;) {
      std::deque<StreamChannel::Piece> batch;
      bool finished;
      {
        std::unique_lock lock(channel->mu);
        channel->cv.wait(lock, [&] { return !channel->pieces.empty() || channel->result; });
        batch.swap(channel->pieces);
        finished = channel->result.has_value();
      }
      for (const StreamChannel::Piece& piece : batch)
        if (!send(writer->text(piece.text, piece.logprobs))) return false;
      if (finished) break;
    }
    Result<runtime::Generation>& gen = *channel->result;
    if (!gen.ok()) {
      // Headers are gone already: the failure is reported in the stream.
      ApiError e{.status = 500,
                 .message = "generation failed: " + gen.error().message,
                 .type = "server_error"};
      if (!send(anthropic ? "event: error\ndata: " + dump_json(anthropic_error_body(e)) + "\n\n"
                : ollama  ? dump_json(ollama_error_body(e)) + "\n"
                          : "data: " + dump_json(openai_error_body(e)) + "\n\n"))
        return false;
    } else if (!send(writer->end(*gen))) {
      return false;
    }
    sink.done();
    return true;
  };
  auto release = [job](bool success) {
    if (!success) job->cancelled = true;
  };
  if (req.version == "HTTP/1.0") {
    // HTTP/1.0 has no chunked encoding: the stream ends where the connection does.
    // (httplib names "Connection: close" itself unless the client asked to keep it alive.)
    if (iequals(req.get_header_value("Connection"), "keep-alive"))
      res.set_header("Connection", "close");
    close_current_connection_after_response();
    res.set_content_provider(content_type, std::move(provider), std::move(release));
  } else {
    res.set_chunked_content_provider(content_type, std::move(provider), std::move(release));
  }
}

Server::Server(ServerOptions options, Engine& engine, const tokenizer::Tokenizer& tok,
               const tokenizer::ChatTemplate& tmpl)
    : impl_(new Impl{.opt = std::move(options), .engine = engine, .tok = tok, .tmpl = tmpl}) {
  impl_->setup();
}

Server::~Server() = default;

Status Server::run(const std::function<void(int)>& on_listening) {
  HttpServer& http = impl_->http;
  const ServerOptions& opt = impl_->opt;
  int port = opt.port;
  if (port == 0) {
    port = http.bind_to_any_port(opt.host);
    if (port < 0) return make_error("cannot bind " + opt.host + " to a free port");
  } else if (!http.bind_to_port(opt.host, port)) {
    return make_error("cannot bind " + opt.host + ":" + std::to_string(port) +
                      " (in use - by another server? - or not an address of this machine)");
  }
  if (::listen(http.listening_socket(), kListenBacklog) != 0)
    return make_error("cannot set the listen backlog of " + opt.host + ":" + std::to_string(port));
  on_listening(port);
  const bool ok = http.listen_after_bind();
  http.connections->stop();
  if (!ok) return make_error("the HTTP server stopped with an error");
  return {};
}

void Server::stop() {
  impl_->http.stop();
  impl_->http.connections->stop();
}

}  // namespace ts::server
