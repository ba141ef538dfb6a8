"""The Ollama Modelfile written beside an exported GGUF: FROM, the stop tokens, and a TEMPLATE where it is faithful.

Ollama speaks Go's text/template, Hugging Face models ship a Jinja chat template. We never translate Jinja source.
Instead we render the model's Jinja template (sandboxed, as transformers does) on a few probe conversations whose
contents are unique markers, and ask whether one layout explains every rendering exactly:

    [preamble, when the first message is not a system message]
    for each message:  prefix[role] + content + suffix[role]
    after the last message, unless it is the assistant's:  generation prompt

If it does, and the layout, applied as Ollama applies a `.Messages` template (`render_layout`), reproduces the
Jinja rendering of every probe, we write that layout as a Go template over Ollama's `.Messages` (the tests render it
with an interpreter of the Go template subset, tests/go_template.py, to hold the two equal). Anything the layout
cannot express (a system prompt folded into a user turn, today's date, tool calls) means no TEMPLATE: the note then
says what Ollama does instead.

What Ollama does (read in ollama/ollama at fb30760, 0.33): `ollama create` from a GGUF without a TEMPLATE looks for
a built-in template whose Jinja source is within a small edit distance of the GGUF's tokenizer.chat_template
(server/model.go detectChatTemplate, template/template.go Named); without one, Ollama 0.30 and later render the
embedded tokenizer.chat_template itself (llama-server, server/images.go, since "use llama-server exclusively",
#16031), while older versions send the bare prompt. Even with a TEMPLATE, 0.30+ prefers the embedded template when
it offers tools and the TEMPLATE does not (shouldPreferChatTemplate), unless OLLAMA_GO_TEMPLATE is set.

The Modelfile syntax is Ollama's parser/parser.go: no escape sequences at all, a value is bare, "quoted" or
\"\"\"triple quoted\"\"\" and ends at the first newline where it is complete. `parse_modelfile` follows that parser
rule for rule, and every value we write is checked to read back exactly.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from lorafit.errors import InvalidConfig, LorafitError
from lorafit.files import write_atomic

MODELFILE_NAME = "Modelfile"
ROLES = ("system", "user", "assistant")

# What the note says when no TEMPLATE is written: Ollama's behaviour, as read in its source (module docstring).
EMBEDDED_TEMPLATE = (
    "Ollama uses a built-in template if `ollama create` recognises the GGUF's tokenizer.chat_template, otherwise "
    "Ollama 0.30+ renders that embedded template itself (older versions send the bare prompt)"
)
TOOLS_NOTE = (
    "tool calls are not carried into the TEMPLATE, and Ollama 0.30+ prefers the GGUF's embedded template "
    "for that reason unless OLLAMA_GO_TEMPLATE=1"
)


@dataclass(frozen=True)
class Modelfile:
    text: str  # the file's content
    template: bool  # True: a TEMPLATE was derived; False: relies on the GGUF's embedded chat template
    note: str  # one line for the user: what was derived, or why the embedded template is used
    create_command: str  # e.g. `ollama create NAME -f /path/Modelfile`


def modelfile(
    gguf_path: Path,
    *,
    chat_template: str | None,
    stop_tokens: list[str],
    bos_token: str | None,
    name: str,
    system: str | None = None,
) -> Modelfile:
    """The Modelfile for `gguf_path` (it is written beside it, so FROM is relative).

    `bos_token` is the BOS that llama.cpp adds itself (None when it adds none): a leading one is stripped from the
    Jinja renderings, so the TEMPLATE never adds a second. `stop_tokens` are the end-of-turn strings, the
    tokenizer's EOS first: it is the `eos_token` the chat template is rendered with (Mistral's prints it after each
    answer). Empty and repeated ones are dropped; one Ollama's parser cannot read back raises InvalidConfig.
    """
    gguf_path = Path(gguf_path)
    check_name(name)
    stops = list(dict.fromkeys(token for token in stop_tokens if token))
    eos_token = stops[0] if stops else ""
    derived = derive_template(chat_template, bos_token=bos_token or "", eos_token=eos_token)
    if system is not None and derived.template is not None and "system" not in derived.roles:
        raise InvalidConfig("this model's chat template has no system role, so a system prompt cannot be set")

    lines = [f"# Ollama Modelfile for {name}: ollama create {name} -f {MODELFILE_NAME}"]
    lines.append("FROM " + _value(f"./{gguf_path.name}", "the GGUF file name", ("bare", "double", "triple")))
    if derived.template is not None:
        lines.append("TEMPLATE " + _value(derived.template, "the TEMPLATE", ("triple", "double")))
    else:
        lines.append("# No TEMPLATE: " + EMBEDDED_TEMPLATE + ".")
    if system is not None:
        lines.append("SYSTEM " + _value(system, "the system prompt", ("triple", "double")))
    for token in stops:
        lines.append("PARAMETER stop " + _value(token, f"the stop token {token!r}", ("double", "triple")))
    text = "\n".join(lines) + "\n"

    note = derived.note if derived.template is not None else f"no TEMPLATE: {derived.note}; {EMBEDDED_TEMPLATE}"
    folder = gguf_path.parent.resolve()
    command = f"ollama create {shlex.quote(name)} -f {shlex.quote(str(folder / MODELFILE_NAME))}"
    return Modelfile(text=text, template=derived.template is not None, note=note, create_command=command)


def write_modelfile(folder: Path, modelfile: Modelfile) -> Path:
    """Write `folder/Modelfile` atomically, replacing one that is there (the caller decides whether it may).

    Refused when the GGUF its FROM line names is not in `folder`: a relative FROM works only beside the GGUF.
    """
    folder = Path(folder)
    sources = parse_modelfile(modelfile.text).get("FROM", [])
    missing = [source for source in sources if not (folder / source).is_file()]
    if missing:
        raise LorafitError(f"the Modelfile reads {missing[0]} but {folder} has no such file; write it beside the GGUF")
    path = folder / MODELFILE_NAME
    write_atomic(path, modelfile.text)
    return path


# --- Model names -------------------------------------------------------------------------------------------------

# types/model/name.go: each part starts with a letter, digit or underscore, then also '-' (and '.', not in the
# namespace); at most 80 characters. We accept [namespace/]model[:tag].
_PART = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,79}"
_NAME = re.compile(rf"(?:[A-Za-z0-9_][A-Za-z0-9_-]{{0,79}}/)?{_PART}(?::{_PART})?")


def check_name(name: str) -> None:
    """Ollama's own rule for a model name, so `ollama create` does not reject what we print."""
    if not _NAME.fullmatch(name):
        raise InvalidConfig(
            f"{name!r} is not an Ollama model name: use letters, digits, '_', '-' and '.', as [namespace/]model[:tag]"
        )


# --- Deriving the TEMPLATE from the Jinja chat template ----------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """Per role a prefix and suffix around the content, a preamble when no system message comes first, and the
    generation prompt that opens the assistant's turn."""

    prefix: dict[str, str]
    suffix: dict[str, str]
    preamble: str
    generation: str

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(role for role in ROLES if role in self.prefix)


@dataclass(frozen=True)
class Derived:
    template: str | None  # the Go template, or None when none is faithful
    note: str  # what was derived, or why nothing was
    roles: tuple[str, ...] = ()


Message = dict[str, str]


def _marker(index: int) -> str:
    # Plain ASCII that no chat template contains and no `trim` or `strip` changes.
    return f"LORAFITx{index}xPROBE"


def _conversation(roles: str) -> list[Message]:
    names = {"s": "system", "u": "user", "a": "assistant"}
    return [{"role": names[letter], "content": _marker(index)} for index, letter in enumerate(roles)]


# Conversations the layout is read from, and more that it must also reproduce before it is trusted.
DERIVATION_PROBES = ("u", "ua", "uau", "su")
CHECK_PROBES = ("suau", "uauau", "s", "susuau")
JINJA_DATES = (datetime(2001, 2, 3, 4, 5, 6), datetime(2034, 11, 27, 22, 33, 44))


class _Unexplained(Exception):
    """The probe renderings do not fit the role-wrapped layout; the message says where."""


def derive_template(chat_template: str | None, *, bos_token: str = "", eos_token: str = "") -> Derived:
    """The Go TEMPLATE equivalent to `chat_template`, checked on the probes, or None and the reason."""
    if not chat_template:
        return Derived(None, "the model has no chat template")
    try:
        render = jinja_renderer(chat_template, bos_token=bos_token, eos_token=eos_token)
    except ImportError:
        return Derived(None, "jinja2 is not installed, so the chat template could not be read")
    except Exception as error:  # a template that does not compile: jinja2.TemplateSyntaxError and friends
        return Derived(None, f"the chat template does not compile ({_one_line(error)})")

    def rendering(messages: list[Message], generation: bool, now: datetime = JINJA_DATES[0]) -> str:
        text = render(messages, add_generation_prompt=generation, now=now)
        return text[len(bos_token) :] if bos_token and text.startswith(bos_token) else text

    try:
        for probe in (*DERIVATION_PROBES, *CHECK_PROBES):
            messages = _conversation(probe)
            if _renders(rendering, messages) and rendering(messages, True) != rendering(messages, True, JINJA_DATES[1]):
                raise _Unexplained("the chat template writes today's date, which a TEMPLATE cannot")
        layout = _read_layout(rendering)
        go = go_template(layout)
        checked = _check(layout, rendering)
    except _Unexplained as reason:
        return Derived(None, str(reason))

    notes = [f"TEMPLATE derived from the chat template ({_describe(layout)}), checked against it on {checked} probes"]
    spaced = [{"role": "user", "content": " \n padded \n "}]
    if _renders(rendering, spaced) and render_layout(layout, spaced) != rendering(spaced, True):
        notes.append("the chat template strips spaces around each message and Ollama's TEMPLATE cannot")
    if "system" not in layout.roles:
        notes.append("the chat template has no system role, so system messages are left out")
    if _offers_tools(render):
        notes.append(TOOLS_NOTE)
    return Derived(go, "; ".join(notes), layout.roles)


def _renders(rendering: Callable[..., str], messages: list[Message]) -> bool:
    try:
        rendering(messages, True)
    except Exception:
        return False
    return True


def _split(text: str, count: int) -> list[str]:
    """The text around markers 0..count-1, each of which must appear exactly once, in order."""
    pieces = []
    rest = text
    for index in range(count):
        marker = _marker(index)
        if text.count(marker) != 1 or marker not in rest:
            raise _Unexplained("the chat template does not print each message once, in order")
        before, rest = rest.split(marker, 1)
        pieces.append(before)
    pieces.append(rest)
    return pieces


def _read_layout(rendering: Callable[..., str]) -> Layout:
    """Prefixes, suffixes, preamble and generation prompt, read from the derivation probes."""

    def pieces(roles: str) -> list[str]:
        try:
            return _split(rendering(_conversation(roles), False), len(roles))
        except _Unexplained:
            raise
        except Exception as error:
            raise _Unexplained(f"the chat template refuses a plain conversation ({_one_line(error)})") from None

    user = pieces("u")  # [preamble + prefix_u, suffix_u]
    user_assistant = pieces("ua")  # [.., suffix_u + prefix_a, suffix_a]
    turns = pieces("uau")  # [.., .., suffix_a + prefix_u, suffix_u]
    suffix_u = user[1]
    between = user_assistant[1]
    if not between.startswith(suffix_u):
        raise _Unexplained("the user turn ends differently before an assistant turn")
    prefix_a, suffix_a = between[len(suffix_u) :], user_assistant[2]
    if not turns[2].startswith(suffix_a):
        raise _Unexplained("the assistant turn ends differently before a user turn")
    prefix_u = turns[2][len(suffix_a) :]
    if not user[0].endswith(prefix_u):
        raise _Unexplained("the first user turn opens differently from the later ones")
    preamble = user[0][: len(user[0]) - len(prefix_u)]
    prefix = {"user": prefix_u, "assistant": prefix_a}
    suffix = {"user": suffix_u, "assistant": suffix_a}

    try:
        system = _split(rendering(_conversation("su"), False), 2)  # [prefix_s, suffix_s + prefix_u, suffix_u]
    except _Unexplained:
        raise _Unexplained("the chat template does not print a system message as a turn of its own") from None
    except Exception:
        system = None  # the template refuses a system message (Gemma): the TEMPLATE has no system branch
    if system is not None:
        if not system[1].endswith(prefix_u):
            raise _Unexplained("the chat template folds the system prompt into the user turn")
        prefix["system"] = system[0]
        suffix["system"] = system[1][: len(system[1]) - len(prefix_u)]

    closed, opened = rendering(_conversation("u"), False), rendering(_conversation("u"), True)
    if not opened.startswith(closed):
        raise _Unexplained("the generation prompt changes what comes before it")
    return Layout(prefix=prefix, suffix=suffix, preamble=preamble, generation=opened[len(closed) :])


def ollama_expected(rendering: Callable[..., str], messages: list[Message]) -> str:
    """What Ollama should send for `messages`, by the Jinja template: the rendering with the generation prompt; or,
    when the assistant speaks last, the rendering cut right after its content, because Ollama continues (prefills)
    that message, as transformers' continue_final_message does."""
    if messages[-1]["role"] != "assistant":
        return rendering(messages, True)
    full = rendering(messages, False)
    last = messages[-1]["content"]
    return full[: full.rindex(last) + len(last)]


def render_layout(layout: Layout, messages: Sequence[Message]) -> str:
    """What Ollama sends for `messages` under the TEMPLATE `go_template(layout)` writes: Ollama joins consecutive
    messages of one role with a blank line (template/template.go Execute), then each message is wrapped by its
    role; the generation prompt follows a last message that is not the assistant's, which Ollama continues."""
    collated: list[Message] = []
    for message in messages:
        if collated and collated[-1]["role"] == message["role"] and message["role"] != "tool":
            collated[-1] = {"role": message["role"], "content": collated[-1]["content"] + "\n\n" + message["content"]}
        else:
            collated.append({"role": message["role"], "content": message["content"]})
    out = [layout.preamble] if collated and collated[0]["role"] != "system" else []
    for number, message in enumerate(collated, 1):
        role, last = message["role"], number == len(collated)
        if role not in layout.prefix:
            continue
        out.append(layout.prefix[role] + message["content"])
        if role == "assistant":
            out.append("" if last else layout.suffix[role])
        else:
            out.append(layout.suffix[role] + (layout.generation if last else ""))
    return "".join(out)


def _check(layout: Layout, rendering: Callable[..., str]) -> int:
    """Render every probe, and every probe continued by an assistant message, both ways; the count of
    conversations that agree (all that the Jinja template accepts, or _Unexplained). The TEMPLATE is written from
    the layout, rule for rule (go_template); the tests render it in a Go template interpreter to hold it so."""
    checked = 0
    for probe in (*DERIVATION_PROBES, *CHECK_PROBES):
        for roles in (probe, probe + "a") if probe[-1] != "a" else (probe,):
            messages = _conversation(roles)
            if not _renders(rendering, messages):
                continue  # a conversation the template refuses (two system turns for Gemma) proves nothing
            if render_layout(layout, messages) != ollama_expected(rendering, messages):
                raise _Unexplained(f"no per-role layout reproduces the chat template on the conversation {roles!r}")
            checked += 1
    return checked


def _offers_tools(render: Callable[..., str]) -> bool:
    messages = _conversation("u")
    tool = {"type": "function", "function": {"name": "probe", "description": "probe", "parameters": {}}}
    try:
        with_tools = render(messages, add_generation_prompt=True, tools=[tool])
        return with_tools != render(messages, add_generation_prompt=True)
    except Exception:
        return True  # it reads tools and fails on ours: it has a notion of tools all the same


def _describe(layout: Layout) -> str:
    user = layout.prefix["user"] + "..." + layout.suffix["user"]
    return repr(user)[1:-1] + " for user turns"


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def jinja_renderer(chat_template: str, *, bos_token: str, eos_token: str) -> Callable[..., str]:
    """Render `chat_template` the way transformers' apply_chat_template does (sandboxed environment, trim_blocks,
    lstrip_blocks, loop controls, its `raise_exception`, `tojson`, `strftime_now`, `{% generation %}` blocks), with a
    clock we set so that a template that prints today's date can be told apart."""
    import json

    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant tokens for training; it prints its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Callable[[], str]) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    compiled = environment.from_string(chat_template)

    def render(
        messages: list[Message], *, add_generation_prompt: bool, now: datetime = JINJA_DATES[0], tools: Any = None
    ) -> str:
        return compiled.render(
            messages=messages,
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            strftime_now=lambda format: now.strftime(format),
        )

    return render


# --- Writing the Go template -------------------------------------------------------------------------------------


def go_string(text: str) -> str:
    """A Go interpreted string literal for `text` (only ASCII printables raw, so no quote or newline is bare)."""
    out = ['"']
    for char in text:
        if char in '"\\':
            out.append("\\" + char)
        elif char == "\n":
            out.append("\\n")
        elif char == "\t":
            out.append("\\t")
        elif char == "\r":
            out.append("\\r")
        elif char.isprintable():
            out.append(char)
        elif ord(char) <= 0xFFFF:
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(f"\\U{ord(char):08x}")
    out.append('"')
    return "".join(out)


def _print(text: str) -> str:
    return "{{ " + go_string(text) + " }}" if text else ""


def go_template(layout: Layout) -> str:
    """The layout over Ollama's .Messages. Literals are Go strings, so the layout's own spaces and newlines are
    never touched by the `{{-` that lays the template out on lines."""
    lines = []
    if layout.preamble:
        lines.append(
            '{{- if .Messages }}{{ if ne (index .Messages 0).Role "system" }}'
            + _print(layout.preamble)
            + "{{ end }}{{ end }}"
        )
    lines.append("{{- range $i, $_ := .Messages }}")
    lines.append("{{- $last := eq (len (slice $.Messages $i)) 1 }}")
    keyword = "if"
    for role in layout.roles:
        body = _print(layout.prefix[role]) + "{{ .Content }}"
        if role == "assistant":
            body += "{{ if not $last }}" + _print(layout.suffix[role]) + "{{ end }}" if layout.suffix[role] else ""
        else:
            body += _print(layout.suffix[role])
            body += "{{ if $last }}" + _print(layout.generation) + "{{ end }}" if layout.generation else ""
        lines.append(f'{{{{- {keyword} eq .Role "{role}" }}}}' + body)
        keyword = "else if"
    lines.append("{{- end }}")
    lines.append("{{- end }}")
    return "\n".join(lines)


# --- Reading and writing Modelfile values, as Ollama's parser does ----------------------------------------------

_COMMANDS = ("from", "license", "template", "system", "adapter", "draft", "renderer", "parser", "parameter")
_COMMANDS += ("message", "requires")
_ROLES_ALLOWED = ("system", "user", "assistant")


def parse_modelfile(text: str) -> dict[str, list[str]]:
    """Instruction -> values, in order, read as Ollama's parser/parser.go ParseFile reads a Modelfile.

    Keys are the instructions in capitals ("FROM", "TEMPLATE", "SYSTEM", "MESSAGE"), and "PARAMETER <name>" for
    each parameter ("PARAMETER stop"). A file Ollama would refuse raises InvalidConfig.
    """
    commands: dict[str, list[str]] = {}
    state, buffer, name, role, line = "nil", "", "", "", 1

    def unquote(value: str) -> tuple[str, bool]:
        if value.startswith('"""'):
            if len(value) >= 6 and value.endswith('"""'):
                return value[3:-3], True
            return "", False
        if value.startswith('"'):
            if len(value) >= 2 and value.endswith('"'):
                return value[1:-1], True
            return "", False
        return value, True

    def fail(message: str) -> InvalidConfig:
        return InvalidConfig(f"Modelfile line {line}: {message}")

    if text.startswith("\ufeff"):
        text = text[1:]
    for char in text:
        if char in "\r\n":
            line += 1
        space, newline = char in " \t", char in "\r\n"
        # The state machine of parseRuneForState: (next state, the rune to keep or "").
        if state == "nil":
            after, kept = ("comment", "") if char == "#" else ("nil", "") if space or newline else ("name", char)
        elif state == "name":
            if char.isascii() and char.isalpha():
                after, kept = "name", char
            elif space:
                after, kept = "value", ""
            else:
                raise fail("command must be one of " + ", ".join(_COMMANDS))
        elif state == "value":
            after, kept = ("nil", char) if space or newline else ("value", char)
        elif state in ("parameter", "message"):
            ok = char.isascii() and (char.isalpha() or (state == "parameter" and (char.isdigit() or char == "_")))
            if ok:
                after, kept = state, char
            elif space:
                after, kept = "value", ""
            else:
                raise fail(f"unexpected {char!r} in a {state.upper()} name")
        else:  # comment
            after, kept = ("nil", "") if newline else ("comment", "")

        if after != state:
            if state == "name":
                if buffer.lower() not in _COMMANDS:
                    raise fail("command must be one of " + ", ".join(_COMMANDS))
                name = buffer.lower()
                if name == "parameter":
                    after = "parameter"
                elif name == "message":
                    after = "message"
            elif state == "parameter":
                name = "parameter " + buffer
            elif state == "message":
                if buffer not in _ROLES_ALLOWED:
                    raise fail('message role must be one of "system", "user", or "assistant"')
                role = buffer
            elif state == "value":
                value, ok = unquote(buffer.strip())
                if not ok or space:
                    buffer += kept
                    continue
                if role:
                    value, role = f"{role}: {value}", ""
                key = "PARAMETER " + name[len("parameter ") :] if name.startswith("parameter ") else name.upper()
                commands.setdefault(key, []).append(value)
            buffer, state = "", after
        if kept and kept.isprintable():
            buffer += kept

    if state == "value":
        value, ok = unquote(buffer.strip())
        if not ok:
            raise fail("unexpected end of file: a quoted value is not closed")
        if role:
            value = f"{role}: {value}"
        key = "PARAMETER " + name[len("parameter ") :] if name.startswith("parameter ") else name.upper()
        commands.setdefault(key, []).append(value)
    elif state not in ("nil", "comment"):
        raise fail("unexpected end of file")
    if "FROM" not in commands:
        raise InvalidConfig("Modelfile has no FROM line")
    return commands


def _value(value: str, what: str, forms: Sequence[str]) -> str:
    """`value` written so that Ollama's parser reads it back exactly: the first of `forms` (bare, "double",
    \"\"\"triple\"\"\") that does. The parser has no escapes, so a newline or quote is kept inside the quotes."""
    for form in forms:
        written = {"bare": value, "double": f'"{value}"', "triple": f'"""{value}"""'}[form]
        try:
            read = parse_modelfile(f"FROM x\nSYSTEM {written}\n").get("SYSTEM", [])
        except InvalidConfig:
            continue
        if read == [value]:
            return written
    unreadable = [char for char in value if not char.isprintable() and char not in " \t\r\n"]
    why = f"Ollama's parser drops {unreadable[0]!r}" if unreadable else "no quoting reads back exactly"
    raise InvalidConfig(f"{what} cannot be written in a Modelfile: {why}")
