// Chat template loading and rendering; see chat_template.h.
#include "tokenizer/chat_template.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "io/gguf.h"
#include "tokenizer/gguf_vocab.h"
#include "tokenizer/jinja_builtins.h"
#include "tokenizer/jinja_eval.h"
#include "tokenizer/jinja_parser.h"

namespace ts::tokenizer {

namespace {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

Result<std::string> read_file(const fs::path& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return make_error("cannot read " + path.string());
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string template_error(const std::string& origin, const jinja::TemplateError& e) {
  std::string where = e.line() > 0 ? "template line " + std::to_string(e.line()) + ": " : "";
  // One line: the CLI prints errors as a single line.
  std::string msg = e.what();
  for (char& c : msg)
    if (c == '\n') c = ' ';
  return origin + ": " + where + msg;
}

// bos_token etc.: a string, an AddedToken object {"content": ...}, or null.
Result<std::optional<std::string>> special_token(const ojson& config, const char* key,
                                                 const std::string& path) {
  auto it = config.find(key);
  if (it == config.end() || it->is_null()) return std::optional<std::string>();
  if (it->is_string()) return std::optional<std::string>(it->get<std::string>());
  if (it->is_object()) {
    auto c = it->find("content");
    if (c != it->end() && c->is_string()) return std::optional<std::string>(c->get<std::string>());
  }
  return make_error(path + ": \"" + key +
                    "\" must be a string or an object with a \"content\" string");
}

}  // namespace

Result<ChatTemplate> ChatTemplate::load(const std::string& dir) {
  ojson config;
  std::string cp;
  if (io::is_gguf_file(dir)) {
    // The template and the special tokens' texts from the file's metadata.
    TS_ASSIGN(GgufVocab vocab, read_gguf_vocab(dir));
    config = ojson::parse(vocab.tokenizer_config.dump());
    cp = dir + " (metadata tokenizer.chat_template)";
    if (!config.contains("chat_template"))
      return make_error(dir +
                        ": metadata 'tokenizer.chat_template' is missing (the file has no "
                        "chat template)");
  } else {
    const fs::path config_path = fs::path(dir) / "tokenizer_config.json";
    cp = config_path.string();
    if (!fs::exists(config_path))
      return make_error("missing " + cp +
                        " (the chat template and special tokens are read from it)");
    TS_ASSIGN(std::string text, read_file(config_path));
    try {
      config = ojson::parse(text);
    } catch (const std::exception& e) {
      return make_error(cp + ": invalid JSON: " + e.what());
    }
  }
  if (!config.is_object()) return make_error(cp + ": expected a JSON object");

  SpecialTokens tokens;
  TS_ASSIGN(tokens.bos, special_token(config, "bos_token", cp));
  TS_ASSIGN(tokens.eos, special_token(config, "eos_token", cp));
  TS_ASSIGN(tokens.pad, special_token(config, "pad_token", cp));
  TS_ASSIGN(tokens.unk, special_token(config, "unk_token", cp));

  const fs::path jinja_path = fs::path(dir) / "chat_template.jinja";
  if (fs::exists(jinja_path)) {
    TS_ASSIGN(std::string source, read_file(jinja_path));
    return from_source(source, std::move(tokens), jinja_path.string());
  }
  auto it = config.find("chat_template");
  if (it == config.end() || it->is_null())
    return make_error(cp + ": no \"chat_template\" (and no chat_template.jinja next to it)");
  if (it->is_string()) return from_source(it->get<std::string>(), std::move(tokens), cp);
  if (it->is_array()) {
    std::string names;
    for (const auto& entry : *it) {
      if (!entry.is_object() || !entry.contains("name") || !entry.contains("template") ||
          !entry["name"].is_string() || !entry["template"].is_string())
        return make_error(
            cp + ": \"chat_template\" list entries must be {\"name\": ..., \"template\": ...}");
      if (entry["name"] == "default")
        return from_source(entry["template"].get<std::string>(), std::move(tokens),
                           cp + " (chat_template 'default')");
      names += (names.empty() ? "'" : ", '") + entry["name"].get<std::string>() + "'";
    }
    return make_error(cp + ": \"chat_template\" has no 'default' entry (it has " +
                      (names.empty() ? std::string("none") : names) + ")");
  }
  return make_error(cp + ": \"chat_template\" must be a string or a list of {name, template}");
}

Result<ChatTemplate> ChatTemplate::from_source(const std::string& source, SpecialTokens tokens,
                                               std::string origin) {
  ChatTemplate t;
  try {
    t.tmpl_ = jinja::parse(source);
  } catch (const jinja::TemplateError& e) {
    return make_error(template_error(origin, e));
  }
  t.source_ = source;
  t.origin_ = std::move(origin);
  t.tokens_ = std::move(tokens);
  return t;
}

Result<std::string> ChatTemplate::render(const ojson& messages, const ojson& tools,
                                         bool add_generation_prompt, const ojson& extra) const {
  using jinja::Value;
  if (!messages.is_array()) return make_error("messages must be a JSON array of message objects");
  if (!tools.is_null() && !tools.is_array())
    return make_error("tools must be a JSON array of tool definitions");
  if (!extra.is_null() && !extra.is_object())
    return make_error("extra template variables must be a JSON object");

  Value globals = Value::dict();
  jinja::DictData& g = *globals.as_dict();
  jinja::add_builtin_globals(g);
  const std::pair<const char*, const std::optional<std::string>*> specials[] = {
      {"bos_token", &tokens_.bos},
      {"eos_token", &tokens_.eos},
      {"pad_token", &tokens_.pad},
      {"unk_token", &tokens_.unk}};
  for (const auto& [name, tok] : specials)
    if (tok->has_value()) g.set(Value(name), Value(**tok));
  if (extra.is_object()) {
    for (auto it = extra.begin(); it != extra.end(); ++it) {
      const std::string& k = it.key();
      if (k == "messages" || k == "tools" || k == "documents" || k == "add_generation_prompt")
        return make_error("extra template variable '" + k + "' collides with a render argument");
      g.set(Value(k), Value::from_json(it.value()));
    }
  }
  g.set(Value("messages"), Value::from_json(messages));
  g.set(Value("tools"), tools.is_null() ? Value::none() : Value::from_json(tools));
  g.set(Value("documents"), Value::none());
  g.set(Value("add_generation_prompt"), Value(add_generation_prompt));

  jinja::Interpreter interp(*tmpl_, globals);
  std::optional<std::tm> fixed = fixed_time_;
  interp.strftime_now = [fixed](const std::string& format) {
    std::tm tm{};
    if (fixed) {
      tm = *fixed;
    } else {
      std::time_t now = std::time(nullptr);
      localtime_r(&now, &tm);
    }
    if (format.empty()) return std::string();
    std::string buf(256, '\0');
    while (true) {
      size_t n = std::strftime(buf.data(), buf.size(), format.c_str(), &tm);
      if (n > 0 || buf.size() > 65536) return buf.substr(0, n);
      buf.resize(buf.size() * 4);
    }
  };
  try {
    return interp.render();
  } catch (const jinja::TemplateError& e) {
    return make_error(template_error(origin_, e));
  }
}

}  // namespace ts::tokenizer
