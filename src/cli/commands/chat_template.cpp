// chat-template: render a conversation with the checkpoint's chat template, exactly as
// transformers' apply_chat_template(tokenize=False) would. Stdout gets the rendered text and
// nothing else (no trailing newline), so the output can be diffed or piped byte for byte.
#include "tokenizer/chat_template.h"

#include <cstdio>
#include <fstream>
#include <sstream>

#include "cli/commands/commands.h"
#include "hub/hub_cache.h"

namespace ts::cli {

namespace {

using ojson = nlohmann::ordered_json;

Result<ojson> read_json_file(const std::string& path, const char* flag) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return make_error("--" + std::string(flag) + ": cannot read " + path);
  std::stringstream ss;
  ss << f.rdbuf();
  try {
    return ojson::parse(ss.str());
  } catch (const std::exception& e) {
    return make_error("--" + std::string(flag) + ": " + path + " is not valid JSON: " + e.what());
  }
}

}  // namespace

Status cmd_chat_template(const Args& args) {
  TS_ASSIGN(std::string model, args.str("model"));
  TS_ASSIGN(std::string dir, hub::resolve_model_arg(model));
  TS_ASSIGN(std::string messages_path, args.str("messages"));
  std::string tools_path = args.str_or("tools", "");
  std::string kwargs_path = args.str_or("kwargs", "");
  const bool add_generation_prompt = args.has("add-generation-prompt");
  TS_TRY(args.check_all_used());

  // --messages: an array of messages, or an OpenAI-style request body {"messages": [...],
  // "tools": [...]} (its tools are used when --tools is not given).
  TS_ASSIGN(ojson doc, read_json_file(messages_path, "messages"));
  ojson messages, tools;
  if (doc.is_array()) {
    messages = std::move(doc);
  } else if (doc.is_object() && doc.contains("messages")) {
    messages = doc["messages"];
    if (doc.contains("tools")) tools = doc["tools"];
  } else {
    return make_error("--messages: " + messages_path +
                      " must hold a JSON array of messages or an object with \"messages\"");
  }
  if (!messages.is_array())
    return make_error("--messages: " + messages_path + ": \"messages\" must be a JSON array");
  for (size_t i = 0; i < messages.size(); ++i)
    if (!messages[i].is_object())
      return make_error("--messages: " + messages_path + ": message " + std::to_string(i) +
                        " is not a JSON object");
  if (!tools_path.empty()) {
    TS_ASSIGN(tools, read_json_file(tools_path, "tools"));
    if (!tools.is_array())
      return make_error("--tools: " + tools_path + " must hold a JSON array of tool definitions");
  }
  ojson extra;
  if (!kwargs_path.empty()) {
    TS_ASSIGN(extra, read_json_file(kwargs_path, "kwargs"));
    if (!extra.is_object())
      return make_error("--kwargs: " + kwargs_path + " must hold a JSON object");
  }

  TS_ASSIGN(tokenizer::ChatTemplate tmpl, tokenizer::ChatTemplate::load(dir));
  TS_ASSIGN(std::string text, tmpl.render(messages, tools, add_generation_prompt, extra));
  if (!text.empty() && std::fwrite(text.data(), 1, text.size(), stdout) != text.size())
    return make_error("writing the rendered template to stdout failed");
  std::fflush(stdout);
  return {};
}

}  // namespace ts::cli
