// Chat templates: our Jinja interpreter against transformers' apply_chat_template.
//  - Reference renders (tests/chat_templates/expected.json, made by scripts/make_template_refs.py
//    with transformers on the device machine): every real template x conversation must match
//    byte for byte, and where transformers raised we must fail too.
//  - Probes: one small template per construct, also rendered by transformers' environment.
//  - Hand-written interpreter cases with literal expectations (whitespace control, scoping,
//    filters, errors that name the line and the construct).
//  - Loading rules (tokenizer_config.json forms, chat_template.jinja) and the CLI contract.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "test_data.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/jinja_builtins.h"
#include "tokenizer/jinja_eval.h"
#include "tokenizer/jinja_parser.h"

namespace {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;
using ts::tokenizer::ChatTemplate;
using ts::tokenizer::SpecialTokens;

const fs::path kData = fs::path(TS_TEST_DATA_DIR) / "chat_templates";

std::string read_all(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

void write_all(const fs::path& p, const std::string& s) {
  std::ofstream f(p, std::ios::binary);
  f << s;
}

// The instant scripts/make_template_refs.py pins strftime_now() to.
std::tm fixed_time() {
  std::tm tm{};
  tm.tm_year = 2025 - 1900;
  tm.tm_mon = 2;
  tm.tm_mday = 14;
  tm.tm_hour = 9;
  tm.tm_min = 26;
  tm.tm_sec = 53;
  time_t t = timegm(&tm);  // normalises tm_wday / tm_yday
  gmtime_r(&t, &tm);
  return tm;
}

SpecialTokens test_tokens() {
  SpecialTokens t;
  t.bos = "<s>";
  t.eos = "</s>";
  return t;
}

const ojson& expected() {
  static const ojson e = [] {
    std::string text = read_all(kData / "expected.json");
    return text.empty() ? ojson() : ojson::parse(text);
  }();
  return e;
}

// Where two renders first differ, for readable failures on long prompts.
std::string first_difference(const std::string& want, const std::string& got) {
  size_t i = 0;
  while (i < want.size() && i < got.size() && want[i] == got[i]) ++i;
  auto around = [&](const std::string& s) {
    size_t b = i >= 40 ? i - 40 : 0;
    return ojson(s.substr(b, 80)).dump();
  };
  return "first difference at byte " + std::to_string(i) + "\n  want: " + around(want) +
         "\n  got:  " + around(got);
}

using ts_test::TempDir;

// A tokenizer-files-only model directory for template NAME: tokenizer_config.json carries the
// special tokens (tests/chat_templates/NAME.json) and chat_template.jinja the template.
void make_model_dir(const fs::path& dir, const std::string& name) {
  fs::copy_file(kData / (name + ".json"), dir / "tokenizer_config.json");
  fs::copy_file(kData / (name + ".jinja"), dir / "chat_template.jinja");
}

// ---- reference renders ----

class ReferenceRender : public ::testing::TestWithParam<std::string> {};

TEST_P(ReferenceRender, MatchesTransformersByteForByte) {
  const std::string name = GetParam();
  ASSERT_FALSE(expected().is_null())
      << "missing " << (kData / "expected.json") << "; run scripts/make_template_refs.py";
  ASSERT_TRUE(expected()["renders"].contains(name)) << name << " has no reference renders";
  const ojson& want = expected()["renders"][name];
  TempDir tmp;
  make_model_dir(tmp.path(), name);
  auto tmpl = ChatTemplate::load(tmp.path().string());
  ASSERT_TRUE(tmpl.ok()) << tmpl.error().message;
  tmpl->set_fixed_time(fixed_time());

  const ojson convs = ojson::parse(read_all(kData / "conversations.json"));
  ASSERT_EQ(convs.size(), want.size()) << "expected.json is stale: conversations changed";
  int compared_text = 0, compared_errors = 0;
  for (const ojson& c : convs) {
    const std::string cname = c["name"].get<std::string>();
    SCOPED_TRACE(name + " x " + cname);
    ASSERT_TRUE(want.contains(cname)) << "no reference for " << cname;
    auto got = tmpl->render(c["messages"], c.value("tools", ojson()),
                            c["add_generation_prompt"].get<bool>(), c.value("kwargs", ojson()));
    const ojson& w = want[cname];
    if (w.contains("text")) {
      ASSERT_TRUE(got.ok()) << got.error().message;
      const std::string ref = w["text"].get<std::string>();
      EXPECT_EQ(ref, got.value()) << first_difference(ref, got.value());
      ++compared_text;
    } else {
      const std::string ref_error = w["error"].get<std::string>();
      EXPECT_FALSE(got.ok()) << "transformers raised \"" << ref_error << "\" but we rendered:\n"
                             << got.value();
      if (!got.ok()) {
        // raise_exception() messages must come through verbatim.
        const std::string prefix = "TemplateError: ";
        if (ref_error.rfind(prefix, 0) == 0) {
          EXPECT_NE(got.error().message.find(ref_error.substr(prefix.size())), std::string::npos)
              << got.error().message;
        }
      }
      ++compared_errors;
    }
  }
  EXPECT_GT(compared_text, 0);
  RecordProperty("renders", compared_text);
  RecordProperty("errors", compared_errors);
}

INSTANTIATE_TEST_SUITE_P(Templates, ReferenceRender,
                         ::testing::Values("qwen3", "deepseek_v3", "gpt_oss", "llama2", "mixtral",
                                           "env_probe"));

TEST(ReferenceRender, ExpectedCoversEveryTemplateFile) {
  ASSERT_FALSE(expected().is_null());
  for (const auto& entry : fs::directory_iterator(kData)) {
    if (entry.path().extension() != ".jinja") continue;
    EXPECT_TRUE(expected()["renders"].contains(entry.path().stem().string()))
        << entry.path() << " has no reference renders";
  }
  EXPECT_TRUE(expected()["generator"]["fixed_date_seen_in_gpt_oss"].get<bool>());
}

// ---- probes: one construct each, rendered by transformers' Jinja environment ----

TEST(ChatTemplateProbes, MatchTransformersEnvironment) {
  ASSERT_FALSE(expected().is_null());
  const ojson probes = ojson::parse(read_all(kData / "probes.json"));
  const ojson& want = expected()["probes"];
  ASSERT_EQ(probes.size(), want.size()) << "expected.json is stale: probes changed";
  for (const ojson& p : probes) {
    const std::string name = p["name"].get<std::string>();
    SCOPED_TRACE("probe " + name + ": " + p["template"].get<std::string>());
    ASSERT_TRUE(want.contains(name));
    ojson ctx = p.value("context", ojson::object());
    ojson messages = ctx.contains("messages") ? ctx["messages"] : ojson::array();
    ojson tools = ctx.contains("tools") ? ctx["tools"] : ojson();
    bool agp = ctx.value("add_generation_prompt", false);
    ctx.erase("messages");
    ctx.erase("tools");
    ctx.erase("add_generation_prompt");
    auto tmpl = ChatTemplate::from_source(p["template"].get<std::string>(), test_tokens());
    ts::Result<std::string> got = tmpl.ok() ? [&] {
      tmpl->set_fixed_time(fixed_time());
      return tmpl->render(messages, tools, agp, ctx);
    }() : ts::Result<std::string>(tmpl.error());
    if (want[name].contains("text")) {
      ASSERT_TRUE(got.ok()) << got.error().message;
      EXPECT_EQ(want[name]["text"].get<std::string>(), got.value());
    } else {
      EXPECT_FALSE(got.ok()) << "transformers raised " << want[name]["error"] << " but we rendered "
                             << ojson(got.value()).dump();
    }
  }
}

// ---- hand-written interpreter cases ----

// Renders `source` with messages/extra from JSON text; returns the text or "ERROR: <message>".
std::string render(const std::string& source, const std::string& extra_json = "{}",
                   const std::string& messages_json = "[]", bool agp = false) {
  auto t = ChatTemplate::from_source(source, test_tokens());
  if (!t.ok()) return "ERROR: " + t.error().message;
  t->set_fixed_time(fixed_time());
  auto r = t->render(ojson::parse(messages_json), ojson(), agp, ojson::parse(extra_json));
  return r.ok() ? r.value() : "ERROR: " + r.error().message;
}

TEST(JinjaInterpreter, WhitespaceControl) {
  // trim_blocks: the newline after a block tag goes; lstrip_blocks: indentation before it goes.
  EXPECT_EQ(render("{% if true %}\nyes\n{% endif %}\nafter"), "yes\nafter");
  EXPECT_EQ(
      render("<ul>\n    {% for x in [1, 2] %}\n    <li>{{ x }}</li>\n    {% endfor %}\n</ul>"),
      "<ul>\n    <li>1</li>\n    <li>2</li>\n</ul>");
  // '-' strips all whitespace (newlines included) on its side; '+' keeps it.
  EXPECT_EQ(render("a   {{- 'b' -}}   c"), "abc");
  EXPECT_EQ(render("x\n\n  {%- if true -%}\n\n  y  {%- endif %}"), "xy");
  EXPECT_EQ(render("  {%+ if true %}x{% endif +%}\ny"), "  x\ny");
  // {{ }} is not lstripped and does not trim the following newline.
  EXPECT_EQ(render("  {{ 'v' }}\nz"), "  v\nz");
  // Comments behave like blocks; one trailing newline of the template is dropped.
  EXPECT_EQ(render("a\n  {# note #}\nb\n"), "a\nb");
  EXPECT_EQ(render("a\r\n{% if true %}\r\nb\r\n{% endif %}\r\n"), "a\nb\n");
  EXPECT_EQ(render("{% raw %}{{ x }}{% endraw %}"), "{{ x }}");
}

TEST(JinjaInterpreter, ExpressionsFollowPython) {
  EXPECT_EQ(
      render("{{ 7 // 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 2 ** 10 }} {{ 1 + 1.5 }}"),
      "3 -4 2 3.5 1024 2.5");
  EXPECT_EQ(render("{{ 1.0 }} {{ 1e20 }} {{ 0.00001 }} {{ 1 / 3 }} {{ none }} {{ true }}"),
            "1.0 1e+20 1e-05 0.3333333333333333 None True");
  EXPECT_EQ(render("{{ 'a' ~ 1 ~ none }} {{ 'ab' * 2 }} {{ [1] + [2] }}"), "a1None abab [1, 2]");
  EXPECT_EQ(render("{{ ['it\\'s', {'k': none}] }} {{ (1,) }}"), "[\"it's\", {'k': None}] (1,)");
  EXPECT_EQ(render("{{ 1 < 2 < 3 }} {{ 'a' in 'cat' }} {{ 3 not in [1, 2] }} {{ 1 == 1.0 }}"),
            "True True True True");
  EXPECT_EQ(render("{{ 0 or '' or 'last' }} {{ 'y' if false else 'n' }} [{{ 'y' if false }}]"),
            "last n []");
  EXPECT_EQ(
      render("{{ 'héllo'[1:3] }} {{ 'hello'[::-1] }} {{ [1, 2, 3, 4][-2:] }} {{ 'héllo'|length }}"),
      "él olleh [3, 4] 5");
}

TEST(JinjaInterpreter, VariablesAttributesAndUndefined) {
  const std::string msgs = R"([{"role": "user", "content": "hi"}])";
  EXPECT_EQ(render("{{ messages[0].role }}/{{ messages[-1]['content'] }}", "{}", msgs), "user/hi");
  EXPECT_EQ(render("[{{ messages[0].nope }}][{{ nothing }}][{{ nothing is defined }}]", "{}", msgs),
            "[][][False]");
  // A dict method shadows a key of the same name on '.', not on '[]'.
  EXPECT_EQ(render("{{ d.items is defined }} {{ d['items'] }} {{ d.get('x', 'dflt') }}",
                   R"({"d": {"items": 7}})"),
            "True 7 dflt");
  EXPECT_EQ(render("{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}",
                   R"({"d": {"z": 1, "a": 2}})"),
            "z=1;a=2;");  // insertion order, as Python dicts keep it
}

TEST(JinjaInterpreter, LoopsAndScoping) {
  EXPECT_EQ(render("{% for x in ['a', 'b', 'c'] %}{{ loop.index }}{{ loop.first }}{{ loop.last }}"
                   "{{ loop.length }}[{{ loop.previtem }}] {% endfor %}"),
            "1TrueFalse3[] 2FalseFalse3[a] 3FalseTrue3[b] ");
  EXPECT_EQ(render("{% for x in [] %}x{% else %}empty{% endfor %}"), "empty");
  EXPECT_EQ(render("{% for x in [1, 2, 3, 4] if x is even %}{{ loop.index }}:{{ x }} {% endfor %}"),
            "1:2 2:4 ");
  EXPECT_EQ(render("{% for i in range(9) %}{% if i == 1 %}{% continue %}{% endif %}"
                   "{% if i == 4 %}{% break %}{% endif %}{{ i }}{% endfor %}"),
            "023");
  // `set` in a loop body is per-iteration and does not leak; `if` does not open a scope.
  EXPECT_EQ(
      render("{% set x = 0 %}{% for i in range(3) %}{% set x = x + 1 %}{{ x }}{% endfor %}{{ x }}"),
      "1110");
  EXPECT_EQ(render("{% if true %}{% set z = 3 %}{% endif %}{{ z }}"), "3");
  // namespace() carries state out of the loop, including the list-append idiom.
  EXPECT_EQ(
      render(
          "{% set ns = namespace(n=0, items=[]) %}{% for i in range(3) %}{% set ns.n = ns.n + i %}"
          "{% set ns.items = ns.items + [i] %}{% endfor %}{{ ns.n }} {{ ns.items }}"),
      "3 [0, 1, 2]");
  EXPECT_EQ(render("{% set a, b = 1, 2 %}{{ b }}{{ a }}"), "21");
  EXPECT_EQ(render("{% set body %}x{{ 1 }}{% endset %}[{{ body }}]"), "[x1]");
}

TEST(JinjaInterpreter, Macros) {
  EXPECT_EQ(render("{% macro g(name, greeting='Hello') %}{{ greeting }}, {{ name }}{% endmacro %}"
                   "{{ g('Ann') }}|{{ g('Bob', greeting='Hi') }}"),
            "Hello, Ann|Hi, Bob");
  EXPECT_EQ(render("{% macro f(n) %}{% if n <= 1 %}1{% else %}{{ n * f(n - 1)|int }}{% endif %}"
                   "{% endmacro %}{{ f(5) }}"),
            "120");
  EXPECT_EQ(render("{% macro w(t) %}<{{ t }}>{{ caller() }}</{{ t }}>{% endmacro %}"
                   "{% call w('b') %}in{% endcall %}"),
            "<b>in</b>");
  // A macro reads template variables as they are when it runs.
  EXPECT_EQ(
      render(
          "{% macro m() %}{{ q }}{% endmacro %}{% set q = 1 %}{{ m() }}{% set q = 2 %}{{ m() }}"),
      "12");
}

TEST(JinjaInterpreter, MacroScopesAreFreedAfterTheRender) {
  // A macro (and a call block's caller) closes over the scope it is defined in, which holds
  // the macro: with shared_ptr both ways, every render that defined one leaked its scopes and
  // all they held (LeakSanitizer, issue 56) - a server renders a template per request.
  namespace jinja = ts::tokenizer::jinja;
  std::weak_ptr<jinja::ListData> xs_data;
  {
    const std::unique_ptr<jinja::Template> tmpl = jinja::parse(
        "{% macro m() %}{{ xs|length }}{% endmacro %}{{ m() }}"
        "{% macro w() %}[{{ caller() }}]{% endmacro %}"
        "{% for i in range(2) %}{% call w() %}{{ m() }}{{ i }}{% endcall %}{% endfor %}");
    jinja::Value xs = jinja::Value::list({jinja::Value(1), jinja::Value(2), jinja::Value(3)});
    xs_data = xs.as_list();
    jinja::Value globals = jinja::Value::dict();
    jinja::add_builtin_globals(*globals.as_dict());
    globals.as_dict()->set(jinja::Value("xs"), xs);
    jinja::Interpreter interp(*tmpl, globals);
    EXPECT_EQ(interp.render(), "3[30][31]");
  }
  EXPECT_TRUE(xs_data.expired()) << "the render's scopes (holding xs) outlived it";
}

TEST(JinjaInterpreter, Filters) {
  EXPECT_EQ(
      render("[{{ '  a \\n'|trim }}] {{ 'Hi'|upper }}{{ 'Hi'|lower }} {{ 'hello world'|title }}"
             " {{ 'hello'|capitalize }}"),
      "[a] HIhi Hello World Hello");
  EXPECT_EQ(
      render("{{ [1, 2]|join(', ') }} {{ [3, 1, 2]|sort|first }} {{ [1, 2]|last }} {{ 'x'|string }}"
             " {{ '42'|int + 1 }} {{ nothing|default('d') }} {{ 'aa'|replace('a', 'b') }}"),
      "1, 2 1 2 x 43 d bb");
  EXPECT_EQ(render("{{ m|selectattr('role', 'equalto', 'user')|map(attribute='c')|list }} "
                   "{{ m|rejectattr('role', 'eq', 'user')|list|length }} "
                   "{{ m|selectattr('tool_calls', 'defined')|list|length }}",
                   R"({"m": [{"role": "user", "c": 1}, {"role": "x", "c": 2, "tool_calls": []}]})"),
            "[1] 1 1");
  // map/select return generators: always truthy, and length() of one is an error (as in Jinja).
  EXPECT_EQ(render("{{ 'y' if [1]|select('even') else 'n' }}"), "y");
  EXPECT_NE(render("{{ [1]|select('odd')|length }}").find("has no len()"), std::string::npos);
}

TEST(JinjaInterpreter, TojsonIsTransformersJsonDumps) {
  const std::string d = R"({"d": {"b": 1, "a": {"z": [1, 2.0, null, true], "s": "é\"<&>\n"}}})";
  // Key order kept, ", " / ": " separators, no HTML escaping, non-ASCII kept.
  EXPECT_EQ(render("{{ d|tojson }}", d),
            R"({"b": 1, "a": {"z": [1, 2.0, null, true], "s": "é\"<&>\n"}})");
  // indent switches the item separator to "," (Python's json.dumps rule).
  EXPECT_EQ(render("{{ {'a': [1], 'b': {}}|tojson(indent=2) }}"),
            "{\n  \"a\": [\n    1\n  ],\n  \"b\": {}\n}");
  EXPECT_EQ(
      render("{{ {'b': 1, 'a': 2}|tojson(sort_keys=true) }} {{ 'é'|tojson(ensure_ascii=true) }}"),
      "{\"a\": 2, \"b\": 1} \"\\u00e9\"");
  EXPECT_NE(render("{{ nothing|tojson }}").find("not JSON serializable"), std::string::npos);
}

TEST(JinjaInterpreter, TestsAndStringMethods) {
  EXPECT_EQ(
      render("{{ 'a' is string }} {{ 1 is number }} {{ none is none }} {{ {} is mapping }}"
             " {{ [] is iterable }} {{ 3 is odd }} {{ 'a' is in 'cat' }} {{ 1 is not string }}"),
      "True True True True True True True True");
  EXPECT_EQ(render("[{{ 'xxhixx'.strip('x') }}] {{ 'a,b'.split(',') }} {{ ' a  b '.split() }}"
                   " {{ 'abc'.startswith('ab') }} {{ 'abc'.endswith(('x', 'c')) }}"
                   " {{ 'a</think>b'.split('</think>')[-1] }} {{ '\\n\\nx'.lstrip('\\n') }}"),
            "[hi] ['a', 'b'] ['a', 'b'] True True b x");
  EXPECT_EQ(
      render("{{ '{} {x}'.format(1, x=2) }} {{ 'ab'.upper() }} {{ 'a-b'.replace('-', '+') }}"),
      "1 2 AB a+b");
}

// Jinja2 3.x refuses an unknown filter or test at compile time except inside an if statement or
// a conditional expression, where it fails only when evaluated (templates guard filters they are
// unsure of that way); a for, macro, call, filter, with or set block is strict again. Each
// outcome below is what jinja2 3.1.6 (transformers' sandbox settings) gave for the template.
TEST(JinjaInterpreter, UnknownFiltersFailWhereJinja2Fails) {
  const std::vector<std::pair<std::string, std::string>> ok = {
      {"{% if false %}{{ 1|nofilter }}{% endif %}ok", "ok"},
      {"{% if false %}{{ 1 is notest }}{% endif %}ok", "ok"},
      {"{% if false %}x{% elif false %}{{ 1|nofilter }}{% endif %}ok", "ok"},
      {"{% macro m() %}{% if false %}{{ 1|nofilter }}{% endif %}{% endmacro %}ok", "ok"},
      {"{% set x = 1|nofilter if false else 2 %}{{ x }}", "2"},
      {"{% if false %}{% set x %}a{% endset %}{{ x|nofilter }}{% endif %}ok", "ok"},
      {"{% if false %}{% for x in [1]|nofilter %}{% endfor %}{% endif %}ok", "ok"},
      {"{% if false %}{% with a = 1|nofilter %}{% endwith %}{% endif %}ok", "ok"},
      {"{% for x in [1] %}{{ 2 if x else 3|nofilter }}{% endfor %}", "2"},
      {"{% if false %}{{ [1]|map('nofilter')|list }}{% endif %}ok", "ok"},
  };
  for (const auto& [source, want] : ok) EXPECT_EQ(render(source), want) << source;
  const std::vector<std::string> fail = {
      "{{ 1|nofilter }}",                                 // compile time
      "{% for x in [] %}{{ x|nofilter }}{% endfor %}ok",  // never run, still
      "{% if false %}{% for x in [] %}{{ x|nofilter }}{% endfor %}{% endif %}",
      "{% if false %}{% filter nofilter %}x{% endfilter %}{% endif %}",
      "{% if false %}{% set x | nofilter %}a{% endset %}{% endif %}",
      "{% if false %}{% macro m(a=1|nofilter) %}{% endmacro %}{% endif %}",
      "{% if false %}{% for x in [1] if x|nofilter %}{% endfor %}{% endif %}",
      "{% if false %}{% with a = 1 %}{{ a|nofilter }}{% endwith %}{% endif %}",
      "{% if true %}{{ 1|nofilter }}{% endif %}",  // run time
      "{{ 1 if false else 2|nofilter }}",
      "{% if (1|nofilter) %}{% endif %}",
      "{% if true %}{{ 1 is notest }}{% endif %}",
  };
  for (const std::string& source : fail) {
    std::string got = render(source);
    EXPECT_EQ(got.rfind("ERROR: ", 0), 0u) << source << " -> " << got;
    EXPECT_NE(got.find("unknown "), std::string::npos) << source << " -> " << got;
  }
}

// jinja2's indent appends "\n" to its input, so a number or a mapping is a TypeError there.
TEST(JinjaInterpreter, IndentTakesOnlyStrings) {
  EXPECT_EQ(render("{{ 'a\nb'|indent(2) }}|{{ 'a\n\nb'|indent(1, true, true) }}"),
            "a\n  b| a\n \n b");
  for (const char* source : {"{{ 5|indent }}", "{{ {'a': 1}|indent(2) }}", "{{ 2.5|indent }}"})
    EXPECT_NE(render(source).find("indent input must be str"), std::string::npos) << source;
}

// Filters added after random templates named them; each expected text is jinja2 3.1.6's render.
TEST(JinjaInterpreter, TruncateSliceUrlencodeFilesizeformat) {
  EXPECT_EQ(
      render("{{ 'hello world foo bar baz'|truncate(12) }}|{{ 'hello world foo bar "
             "baz'|truncate(12, true) }}|{{ 'h\u00e9llo w\u00f6rld \u00fcn\u00efcode'|truncate(9, "
             "false, '~', 0) }}|{{ 'short'|truncate(3) }}|{{ [1, 2]|truncate(3) }}"),
      "hello...|hello wor...|h\u00e9llo~|short|[1, 2]");
  EXPECT_EQ(
      render("{{ [1, 2, 3, 4, 5, 6, 7]|slice(3)|list }}|{{ [1, 2, 3, 4]|slice(3, 'F')|list }}"),
      "[[1, 2, 3], [4, 5], [6, 7]]|[[1, 2], [3, 'F'], [4, 'F']]");
  EXPECT_EQ(
      render("{{ 'a b/c?d=\u00e9'|urlencode }}|{{ {'k': 'v w', 'x/y': 1}|urlencode }}|{{ [('a', "
             "'&')]|urlencode }}"),
      "a%20b/c%3Fd%3D%C3%A9|k=v+w&x%2Fy=1|a=%26");
  EXPECT_EQ(
      render("{{ 1|filesizeformat }}|{{ 999|filesizeformat }}|{{ 1500000|filesizeformat }}|{{ "
             "1536|filesizeformat(true) }}|{{ '2048'|filesizeformat }}"),
      "1 Byte|999 Bytes|1.5 MB|1.5 KiB|2.0 kB");
  EXPECT_NE(render("{{ 5|truncate }}").find("truncate input must be str"), std::string::npos);
  EXPECT_NE(render("{{ 'x'|filesizeformat }}").find("could not convert"), std::string::npos);
  EXPECT_NE(render("{{ 'abc'|truncate(2) }}").find("expected length >= 3"), std::string::npos);
}

TEST(JinjaInterpreter, Globals) {
  EXPECT_EQ(render("{{ range(3)|list }} {{ dict(a=1) }} {{ namespace(x=1).x }}"),
            "[0, 1, 2] {'a': 1} 1");
  EXPECT_EQ(render("{{ strftime_now('%Y-%m-%d %a') }}"), "2025-03-14 Fri");
  EXPECT_EQ(render("{{ bos_token }}{{ eos_token }}{{ add_generation_prompt }}{{ tools is none }}"),
            "<s></s>FalseTrue");
  EXPECT_EQ(render("{{ reasoning_effort }}", R"({"reasoning_effort": "high"})"), "high");
}

// Errors name the template line and the construct.
TEST(JinjaInterpreter, ErrorsNameLineAndConstruct) {
  auto contains = [](const std::string& s, const std::string& needle) {
    return s.find(needle) != std::string::npos;
  };
  std::string e = render("line one\n{{ x|foo }}");
  EXPECT_TRUE(contains(e, "template line 2: unknown filter 'foo'")) << e;
  e = render("a\nb\n{% frobnicate %}");
  EXPECT_TRUE(contains(e, "template line 3: unknown tag 'frobnicate'")) << e;
  e = render("{% if x is frobnicated %}{% endif %}");
  EXPECT_TRUE(contains(e, "template line 1: unknown test 'frobnicated'")) << e;
  e = render("\n{% for x in y %}\nopen");
  EXPECT_TRUE(contains(e, "'for' block opened on line 2")) << e;
  e = render("{{ 1 + }}");
  EXPECT_TRUE(contains(e, "template line 1: unexpected end of print statement")) << e;
  e = render("a\n{% if true %}\n{{ raise_exception('roles must alternate') }}\n{% endif %}");
  EXPECT_TRUE(contains(e, "template line 3: raise_exception: roles must alternate")) << e;
  e = render("\n\n{{ messages[0].content.x.y }}", "{}", R"([{"content": {}}])");
  EXPECT_TRUE(contains(e, "template line 3: 'dict object' has no attribute 'x'")) << e;
  e = render("{{ 'a' + 1 }}");
  EXPECT_TRUE(contains(e, "can only concatenate str (not \"int\") to str")) << e;
  e = render("{% set l = [] %}{{ l.append(1) }}");
  EXPECT_TRUE(contains(e, "'append' of 'list' object is unsafe")) << e;
  e = render("{% macro m() %}{{ m() }}{% endmacro %}{{ m() }}");
  EXPECT_TRUE(contains(e, "recursion depth")) << e;
}

// ---- loading ----

TEST(ChatTemplateLoad, TokenizerConfigForms) {
  TempDir tmp;
  const fs::path cfg = tmp.path() / "tokenizer_config.json";
  // A string template; AddedToken-style special tokens.
  write_all(cfg, R"({"bos_token": {"__type": "AddedToken", "content": "<B>"}, "eos_token": "<E>",
                     "chat_template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"})");
  auto t = ChatTemplate::load(tmp.path().string());
  ASSERT_TRUE(t.ok()) << t.error().message;
  auto r = t->render(ojson::parse(R"([{"role": "user", "content": "x"}])"), ojson(), false);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r.value(), "<B>x<E>");
  // A list of named templates: "default" is used.
  write_all(cfg, R"({"chat_template": [{"name": "tool_use", "template": "T"},
                                        {"name": "default", "template": "D{{ bos_token is defined }}"}]})");
  t = ChatTemplate::load(tmp.path().string());
  ASSERT_TRUE(t.ok()) << t.error().message;
  EXPECT_EQ(t->render(ojson::array(), ojson(), false).value(), "DFalse");
  // chat_template.jinja next to the config wins over the config's entry.
  write_all(tmp.path() / "chat_template.jinja", "from file\n");
  t = ChatTemplate::load(tmp.path().string());
  ASSERT_TRUE(t.ok()) << t.error().message;
  EXPECT_EQ(t->render(ojson::array(), ojson(), false).value(), "from file");
}

TEST(ChatTemplateLoad, ErrorsNameWhatIsWrong) {
  TempDir tmp;
  auto t = ChatTemplate::load(tmp.path().string());
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.error().message.find("tokenizer_config.json"), std::string::npos)
      << t.error().message;
  const fs::path cfg = tmp.path() / "tokenizer_config.json";
  write_all(cfg, R"({"eos_token": "</s>"})");
  t = ChatTemplate::load(tmp.path().string());
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.error().message.find("no \"chat_template\""), std::string::npos) << t.error().message;
  write_all(cfg, R"({"chat_template": [{"name": "tool_use", "template": "T"}]})");
  t = ChatTemplate::load(tmp.path().string());
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.error().message.find("no 'default' entry (it has 'tool_use')"), std::string::npos)
      << t.error().message;
  write_all(cfg, "{not json");
  t = ChatTemplate::load(tmp.path().string());
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.error().message.find("invalid JSON"), std::string::npos) << t.error().message;
  write_all(cfg, R"({"chat_template": "ok\n{{ x | nosuchfilter }}"})");
  t = ChatTemplate::load(tmp.path().string());
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.error().message.find(
                "tokenizer_config.json: template line 2: unknown filter 'nosuchfilter'"),
            std::string::npos)
      << t.error().message;
}

TEST(ChatTemplateLoad, RenderRejectsBadInputShapes) {
  auto t = ChatTemplate::from_source("{{ messages|length }}", {});
  ASSERT_TRUE(t.ok());
  EXPECT_FALSE(t->render(ojson::object(), ojson(), false).ok());
  EXPECT_FALSE(t->render(ojson::array(), ojson("x"), false).ok());
  EXPECT_FALSE(t->render(ojson::array(), ojson(), false, ojson::parse(R"({"messages": 1})")).ok());
}

// ---- CLI contract ----

struct RunResult {
  int code;
  std::string out, err;
};

class ChatTemplateCli : public ::testing::Test {
 protected:
  RunResult run(const std::string& args) {
    std::string cmd = std::string(TS_BINARY) + " chat-template " + args + " >" +
                      (tmp_.path() / "stdout").string() + " 2>" + (tmp_.path() / "stderr").string();
    int st = std::system(cmd.c_str());
    return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, read_all(tmp_.path() / "stdout"),
            read_all(tmp_.path() / "stderr")};
  }
  void expect_error(const RunResult& r, const std::string& needle) {
    EXPECT_EQ(r.code, 2) << r.err;
    EXPECT_NE(r.err.find(needle), std::string::npos) << "stderr: " << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << "one line: " << r.err;
    EXPECT_TRUE(r.out.empty()) << "stdout: " << r.out;
  }
  // Writes conversation CNAME's messages/tools to files; returns the flags naming them.
  std::string conversation_flags(const std::string& cname) {
    const ojson convs = ojson::parse(read_all(kData / "conversations.json"));
    for (const ojson& c : convs) {
      if (c["name"] != cname) continue;
      write_all(tmp_.path() / "messages.json", c["messages"].dump());
      std::string flags = "--messages " + (tmp_.path() / "messages.json").string();
      if (c.contains("tools")) {
        write_all(tmp_.path() / "tools.json", c["tools"].dump());
        flags += " --tools " + (tmp_.path() / "tools.json").string();
      }
      if (c["add_generation_prompt"].get<bool>()) flags += " --add-generation-prompt";
      return flags;
    }
    ADD_FAILURE() << "no conversation " << cname;
    return "";
  }
  TempDir tmp_;
};

TEST_F(ChatTemplateCli, PrintsExactlyTheRender) {
  ASSERT_FALSE(expected().is_null());
  fs::path model = tmp_.path() / "model";
  fs::create_directories(model);
  make_model_dir(model, "qwen3");
  for (const char* cname : {"multi_turn", "tools_defined_generation", "tool_call_dict_arguments"}) {
    SCOPED_TRACE(cname);
    RunResult r = run("--model " + model.string() + " " + conversation_flags(cname));
    ASSERT_EQ(r.code, 0) << r.err;
    EXPECT_TRUE(r.err.empty()) << r.err;
    EXPECT_EQ(r.out, expected()["renders"]["qwen3"][cname]["text"].get<std::string>());
  }
}

TEST_F(ChatTemplateCli, BadInputIsOneLineAndExitTwo) {
  fs::path model = tmp_.path() / "model";
  fs::create_directories(model);
  write_all(tmp_.path() / "m.json", R"([{"role": "user", "content": "hi"}])");
  const std::string msgs = " --messages " + (tmp_.path() / "m.json").string();
  // No tokenizer_config.json.
  expect_error(run("--model " + model.string() + msgs), "tokenizer_config.json");
  // No chat_template in it.
  write_all(model / "tokenizer_config.json", R"({"eos_token": "</s>"})");
  expect_error(run("--model " + model.string() + msgs), "no \"chat_template\"");
  // An unknown construct in the template: named with its line.
  write_all(model / "chat_template.jinja",
            "{% for m in messages %}\n{{ m.content | shout }}\n{% endfor %}");
  expect_error(run("--model " + model.string() + msgs), "template line 2: unknown filter 'shout'");
  // raise_exception from the template.
  write_all(model / "chat_template.jinja", "{{ raise_exception('only one user turn allowed') }}");
  expect_error(run("--model " + model.string() + msgs),
               "raise_exception: only one user turn allowed");
  write_all(model / "chat_template.jinja", "{{ messages[0].content }}");
  // Invalid messages JSON, wrong shape, missing file, unknown flag.
  write_all(tmp_.path() / "bad.json", "[{\"role\": ");
  expect_error(
      run("--model " + model.string() + " --messages " + (tmp_.path() / "bad.json").string()),
      "not valid JSON");
  write_all(tmp_.path() / "obj.json", R"({"role": "user"})");
  expect_error(
      run("--model " + model.string() + " --messages " + (tmp_.path() / "obj.json").string()),
      "must hold a JSON array");
  expect_error(run("--model " + model.string() + " --messages /nonexistent/m.json"),
               "cannot read /nonexistent/m.json");
  expect_error(
      run("--model " + model.string() + msgs + " --tools " + (tmp_.path() / "obj.json").string()),
      "--tools");
  // And the happy path of the same directory: the text, no newline added.
  RunResult ok = run("--model " + model.string() + msgs);
  EXPECT_EQ(ok.code, 0) << ok.err;
  EXPECT_EQ(ok.out, "hi");
}

}  // namespace
