#!/usr/bin/env python3
"""Expected chat-template renders for turbospark's tests, computed with transformers.

For every template in tests/chat_templates/<name>.jinja (special tokens in <name>.json) and every
conversation in tests/chat_templates/conversations.json, renders
tokenizer.apply_chat_template(messages, tools=..., add_generation_prompt=..., tokenize=False,
**kwargs) with a PreTrainedTokenizerFast that carries the template and the special tokens (the
vocabulary does not matter for tokenize=False). It also renders the small interpreter probes in
tests/chat_templates/probes.json through transformers' own compiled Jinja environment.

A render that raises is recorded as {"error": "<ExceptionType>: <message>"}; the C++ tests then
require our renderer to fail too. strftime_now() is pinned to 2025-03-14 09:26:53 so renders that
print the date (gpt-oss) are reproducible.

Usage (needs transformers + jinja2; run where they are installed):
  python3 scripts/make_template_refs.py --out tests/chat_templates/expected.json
  python3 scripts/make_template_refs.py --engine jinja ...   # local Jinja2 replica, for debugging
"""
import argparse
import datetime as _dt
import inspect
import json
import os
import platform
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "tests", "chat_templates")
FIXED_NOW = (2025, 3, 14, 9, 26, 53)


class FixedDatetime(_dt.datetime):
    @classmethod
    def now(cls, tz=None):
        return cls(*FIXED_NOW)


def err(e):
    return {"error": "%s: %s" % (type(e).__name__, e)}


def token_str(v):
    if isinstance(v, dict):
        return v.get("content")
    return v


def load_specials(name):
    with open(os.path.join(DATA, name + ".json"), encoding="utf-8") as f:
        raw = json.load(f)
    return {k: token_str(v) for k, v in raw.items() if token_str(v) is not None}


def read(path):
    with open(path, encoding="utf-8", newline="") as f:
        return f.read()


# ---- engines ----

class TransformersEngine:
    def __init__(self):
        import jinja2
        import transformers
        from transformers.utils import chat_template_utils as ctu

        self.ctu = ctu
        self.versions = {"transformers": transformers.__version__, "jinja2": jinja2.__version__}
        # Pin the clock strftime_now() reads, however the module imported datetime.
        dt = getattr(ctu, "datetime", None)
        if isinstance(dt, type):
            ctu.datetime = FixedDatetime
        elif isinstance(dt, types.ModuleType):
            shim = types.ModuleType("datetime_shim")
            shim.__dict__.update(dt.__dict__)
            shim.datetime = FixedDatetime
            ctu.datetime = shim
        self.clock_patch = type(dt).__name__ if dt is not None else "none"

        # The main path is apply_chat_template on a real tokenizer object; if this transformers
        # cannot build one that way, fall back to its lower-level render functions (recorded).
        self.mode, self.mode_reason = "apply_chat_template", None
        try:
            probe = self._make_tokenizer({"bos_token": "<s>"},
                                         "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}")
            got = probe.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
            if got != "<s>x":
                raise RuntimeError("self-test rendered %r" % (got,))
        except Exception as e:  # noqa: BLE001 - any failure selects the fallback
            self.mode, self.mode_reason = "render_jinja_template", "%s: %s" % (type(e).__name__, e)

    def _make_tokenizer(self, specials, template):
        from tokenizers import Tokenizer, models
        from transformers import PreTrainedTokenizerFast

        vocab = {"<placeholder_unk>": 0}
        for v in specials.values():
            vocab.setdefault(v, len(vocab))
        backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<placeholder_unk>"))
        tok = PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=template, **specials)
        tok.chat_template = template
        return tok

    def _pin_clock(self, template):
        """Belt and braces: also replace strftime_now in the (lru-cached) compiled template's
        environment, in case this transformers does not read the module-level datetime."""
        compile_fn = getattr(self.ctu, "_compile_jinja_template", None)
        if compile_fn is None:
            return
        try:
            env = compile_fn(template).environment
            if "strftime_now" in env.globals:
                env.globals["strftime_now"] = lambda fmt: FixedDatetime.now().strftime(fmt)
        except Exception:  # noqa: BLE001 - a template that does not compile fails later, recorded
            pass

    def tokenizer(self, specials, template):
        self._pin_clock(template)
        if self.mode == "apply_chat_template":
            return self._make_tokenizer(specials, template)
        return (specials, template)

    def _render_low_level(self, template, messages, tools, agp, ctx):
        f = getattr(self.ctu, "render_jinja_template", None)
        if f is not None:
            out = f(conversations=[messages], tools=tools, chat_template=template,
                    add_generation_prompt=agp, **ctx)
            while isinstance(out, (tuple, list)):  # (rendered list, generation indices)
                out = out[0]
            return out
        compiled = self.ctu._compile_jinja_template(template)
        return compiled.render(messages=messages, tools=tools, documents=None,
                               add_generation_prompt=agp, **ctx)

    def render_conversation(self, tok, conv):
        kwargs = dict(conv.get("kwargs", {}))
        if self.mode == "apply_chat_template":
            return tok.apply_chat_template(conv["messages"], tools=conv.get("tools"),
                                           add_generation_prompt=conv["add_generation_prompt"],
                                           tokenize=False, **kwargs)
        specials, template = tok
        ctx = dict(specials)
        ctx.update(kwargs)
        return self._render_low_level(template, conv["messages"], conv.get("tools"),
                                      conv["add_generation_prompt"], ctx)

    def render_direct(self, template, context):
        """Through transformers' compiled environment, without a tokenizer (probes)."""
        ctx = dict(context)
        messages = ctx.pop("messages", [])
        tools = ctx.pop("tools", None)
        agp = ctx.pop("add_generation_prompt", False)
        ctx.setdefault("bos_token", "<s>")
        ctx.setdefault("eos_token", "</s>")
        self._pin_clock(template)
        compile_fn = getattr(self.ctu, "_compile_jinja_template", None)
        if compile_fn is None:
            return self._render_low_level(template, messages, tools, agp, ctx)
        return compile_fn(template).render(messages=messages, tools=tools, documents=None,
                                           add_generation_prompt=agp, **ctx)

    def cross_check(self, template, specials, conv):
        """render_jinja_template, if this transformers has it, for comparison."""
        if self.mode != "apply_chat_template" or getattr(self.ctu, "render_jinja_template", None) is None:
            return None
        ctx = dict(specials)
        ctx.update(conv.get("kwargs", {}))
        return self._render_low_level(template, conv["messages"], conv.get("tools"),
                                      conv["add_generation_prompt"], ctx)


class JinjaEngine:
    """A local replica of transformers' environment (for debugging without transformers)."""

    def __init__(self):
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                              separators=separators, sort_keys=sort_keys)

        def strftime_now(fmt):
            return FixedDatetime.now().strftime(fmt)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        self.env = env
        self.versions = {"jinja2": jinja2.__version__, "transformers": None}
        self.clock_patch = "replica"
        self.mode, self.mode_reason = "jinja2 replica", None

    def tokenizer(self, specials, template):
        return (specials, template)

    def render_conversation(self, tok, conv):
        specials, template = tok
        ctx = dict(specials)
        ctx.update(conv.get("kwargs", {}))
        return self.env.from_string(template).render(
            messages=conv["messages"], tools=conv.get("tools"), documents=None,
            add_generation_prompt=conv["add_generation_prompt"], **ctx)

    def render_direct(self, template, context):
        ctx = dict(context)
        messages = ctx.pop("messages", [])
        tools = ctx.pop("tools", None)
        agp = ctx.pop("add_generation_prompt", False)
        ctx.setdefault("bos_token", "<s>")
        ctx.setdefault("eos_token", "</s>")
        return self.env.from_string(template).render(messages=messages, tools=tools,
                                                     documents=None, add_generation_prompt=agp,
                                                     **ctx)

    def cross_check(self, template, specials, conv):
        return None


def dump_sources(path):
    """transformers' chat-template code, to check the environment our interpreter mirrors."""
    from transformers.utils import chat_template_utils as ctu

    parts = ["# transformers.utils.chat_template_utils\n", inspect.getsource(ctu)]
    try:
        from transformers import tokenization_utils_base as tub

        src = inspect.getsource(tub.PreTrainedTokenizerBase.apply_chat_template)
        parts += ["\n\n# PreTrainedTokenizerBase.apply_chat_template\n", src]
    except Exception as e:  # noqa: BLE001 - diagnostics only
        parts.append("\n# apply_chat_template source unavailable: %r\n" % (e,))
    with open(path, "w", encoding="utf-8") as f:
        f.write("".join(parts))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(DATA, "expected.json"))
    ap.add_argument("--engine", choices=["transformers", "jinja"], default="transformers")
    ap.add_argument("--source-dump", help="also write transformers' chat-template source here")
    args = ap.parse_args()

    engine = TransformersEngine() if args.engine == "transformers" else JinjaEngine()
    with open(os.path.join(DATA, "conversations.json"), encoding="utf-8") as f:
        conversations = json.load(f)
    with open(os.path.join(DATA, "probes.json"), encoding="utf-8") as f:
        probes = json.load(f)

    renders, mismatches = {}, []
    templates = sorted(f[:-len(".jinja")] for f in os.listdir(DATA) if f.endswith(".jinja"))
    for name in templates:
        template = read(os.path.join(DATA, name + ".jinja"))
        specials = load_specials(name)
        tok = engine.tokenizer(specials, template)
        renders[name] = {}
        for conv in conversations:
            try:
                result = {"text": engine.render_conversation(tok, conv)}
            except Exception as e:  # noqa: BLE001 - the error is the expected result
                result = err(e)
            renders[name][conv["name"]] = result
            try:
                other = engine.cross_check(template, specials, conv)
            except Exception as e:  # noqa: BLE001
                other = err(e)
            agree = other is None or (isinstance(other, str) and other == result.get("text")) or (
                isinstance(other, dict) and "error" in result)
            if not agree:
                mismatches.append({"template": name, "conversation": conv["name"],
                                   "render_jinja_template": other})

    probe_results = {}
    for p in probes:
        try:
            probe_results[p["name"]] = {"text": engine.render_direct(p["template"],
                                                                     p.get("context", {}))}
        except Exception as e:  # noqa: BLE001
            probe_results[p["name"]] = err(e)

    date_seen = any("2025-03-14" in r.get("text", "") for r in renders.get("gpt_oss", {}).values())
    out = {
        "generator": {
            "script": "scripts/make_template_refs.py",
            "engine": args.engine,
            "versions": engine.versions,
            "python": platform.python_version(),
            "fixed_now": "%04d-%02d-%02d %02d:%02d:%02d" % FIXED_NOW,
            "clock_patch": engine.clock_patch,
            "mode": engine.mode,
            "mode_reason": engine.mode_reason,
            "fixed_date_seen_in_gpt_oss": date_seen,
            "cross_check_mismatches": mismatches,
        },
        "renders": renders,
        "probes": probe_results,
    }
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1, ensure_ascii=False)
        f.write("\n")
    if args.source_dump:
        try:
            dump_sources(args.source_dump)
        except Exception as e:  # noqa: BLE001
            print("source dump failed:", e, file=sys.stderr)
    n = sum(len(v) for v in renders.values())
    n_err = sum(1 for v in renders.values() for r in v.values() if "error" in r)
    print("%d renders (%d errors), %d probes, %d cross-check mismatches, date pinned: %s -> %s"
          % (n, n_err, len(probe_results), len(mismatches), date_seen, args.out))
    return 0 if date_seen else 1


if __name__ == "__main__":
    sys.exit(main())
