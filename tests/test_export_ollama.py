"""The Ollama Modelfile: what `ollama create` reads back from it, and whether its TEMPLATE renders conversations the
way the model's own chat template does (rendered by transformers, not by the module under test)."""

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from go_template import render_template
from lorafit.errors import InvalidConfig, LorafitError
from lorafit.export.ollama import Modelfile, modelfile, parse_modelfile, write_modelfile
from lorafit.train.demo import CHAT_TEMPLATE as DEMO_TEMPLATE

DATA = Path(__file__).parent / "data"
GGUF = "run-q4_k_m.gguf"


def chat_template(name: str) -> str:
    return (DATA / "chat_templates" / name).read_text(encoding="utf-8")


# name -> (chat template, stop tokens the converter passes, BOS llama.cpp adds itself)
DERIVABLE = {
    "demo": (DEMO_TEMPLATE, ["<|end|>"], None),
    "qwen2.5": (chat_template("qwen2_5.jinja"), ["<|im_end|>", "<|endoftext|>"], None),
    "llama3": (chat_template("llama3_instruct.jinja"), ["<|eot_id|>", "<|end_of_text|>"], "<|begin_of_text|>"),
    "gemma": (chat_template("gemma.jinja"), ["<end_of_turn>", "<eos>"], "<bos>"),
}
FALLBACK = {
    "mistral-tools": (chat_template("mistral_tools.jinja"), ["</s>"], "<s>"),
    "gemma3": (chat_template("gemma3.jinja"), ["<end_of_turn>"], "<bos>"),
    "llama3.2": (chat_template("llama3_2.jinja"), ["<|eot_id|>"], "<|begin_of_text|>"),
}

# Conversations the derivation never saw: other lengths, non-ASCII text, newlines and quotes inside messages.
SYSTEM = {"role": "system", "content": "Eres un asistente útil; responde en español."}
TURNS = [
    {"role": "user", "content": "¿Cuál es la capital de Portugal?"},
    {"role": "assistant", "content": 'A capital é Lisboa — "a cidade das sete colinas".'},
    {"role": "user", "content": "E a população?\nResponda em português, por favor."},
]
UNSEEN = {
    "three turns": TURNS,
    "five turns": [*TURNS, {"role": "assistant", "content": "Cerca de 545 mil habitantes."}, TURNS[0]],
    "system first": [SYSTEM, *TURNS],
    "assistant continued": [*TURNS, {"role": "assistant", "content": "Segundo o censo de 2021,"}],
}


def reference(template: str, messages: list[dict], bos: str | None, eos: str) -> str:
    """What the model was trained on, by transformers itself; a final assistant message is continued."""
    render = pytest.importorskip("transformers.utils.chat_template_utils").render_jinja_template
    continued = messages[-1]["role"] == "assistant"
    rendered, _ = render(
        [messages],
        chat_template=template,
        add_generation_prompt=not continued,
        continue_final_message=continued,
        bos_token=bos or "",
        eos_token=eos,
    )
    return rendered[0]


def build(key: str, table: dict = DERIVABLE, **options) -> Modelfile:
    template, stops, bos = table[key]
    return modelfile(Path("/models/run") / GGUF, chat_template=template, stop_tokens=stops, bos_token=bos, **options)


@pytest.mark.parametrize("name", DERIVABLE)
def test_derived_template_reads_back_and_renders_as_the_chat_template(name: str) -> None:
    template, stops, bos = DERIVABLE[name]
    result = build(name, name="lorafit-demo")
    read = parse_modelfile(result.text)

    assert result.template
    assert read["FROM"] == [f"./{GGUF}"]
    assert read["PARAMETER stop"] == stops
    [go] = read["TEMPLATE"]
    for label, messages in UNSEEN.items():
        if name == "gemma" and messages[0]["role"] == "system":
            continue  # Gemma's template refuses a system message
        expected = reference(template, messages, bos, stops[0])
        if bos:  # llama.cpp adds the BOS itself: the TEMPLATE must not
            assert expected.startswith(bos)
            expected = expected[len(bos) :]
        assert render_template(go, messages) == expected, label


def test_demo_template_rendering_by_hand() -> None:
    """The demo's template is simple enough to write its rendering out: <|role|>content<|end|>, then the prompt."""
    [go] = parse_modelfile(build("demo", name="demo").text)["TEMPLATE"]
    messages = [SYSTEM, TURNS[0]]
    expected = f"<|system|>{SYSTEM['content']}<|end|><|user|>{TURNS[0]['content']}<|end|><|assistant|>"
    assert render_template(go, messages) == expected


def test_llama3_template_leaves_the_bos_to_llama_cpp() -> None:
    result = build("llama3", name="llama3-tuned")
    [go] = parse_modelfile(result.text)["TEMPLATE"]
    assert "<|begin_of_text|>" not in go
    assert render_template(go, TURNS[:1]) == (
        "<|start_header_id|>user<|end_header_id|>\n\n¿Cuál es la capital de Portugal?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert "strips spaces" in result.note  # its `| trim` is a difference the user is told about


def test_qwen_keeps_its_default_system_prompt_and_tells_about_tools() -> None:
    result = build("qwen2.5", name="qwen-tuned")
    [go] = parse_modelfile(result.text)["TEMPLATE"]
    assert render_template(go, TURNS[:1]).startswith(
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
    )
    assert "You are Qwen" not in render_template(go, [SYSTEM, TURNS[0]])
    assert "tool calls" in result.note and "\n" not in result.note


def test_system_prompt_is_written_and_rendered_first() -> None:
    template, stops, _ = DERIVABLE["qwen2.5"]
    prompt = 'Responde sempre em português.\nNunca uses "gírias".'
    read = parse_modelfile(build("qwen2.5", name="qwen-tuned", system=prompt).text)
    assert read["SYSTEM"] == [prompt]
    # Ollama puts the SYSTEM prompt in front of a conversation that has none.
    messages = [{"role": "system", "content": prompt}, *TURNS]
    assert render_template(read["TEMPLATE"][0], messages) == reference(template, messages, None, stops[0])


def test_system_prompt_refused_where_the_template_has_no_system_role() -> None:
    assert "no system role" in build("gemma", name="gemma-tuned").note
    with pytest.raises(InvalidConfig, match="no system role"):
        build("gemma", name="gemma-tuned", system="Sé breve.")


@pytest.mark.parametrize(
    ("name", "reason"),
    [("mistral-tools", "system prompt"), ("gemma3", "folds the system prompt"), ("llama3.2", "today's date")],
)
def test_templates_that_cannot_be_derived_fall_back_to_the_embedded_one(name: str, reason: str) -> None:
    template, stops, bos = FALLBACK[name]
    result = build(name, FALLBACK, name="fallback")
    read = parse_modelfile(result.text)

    assert not result.template
    assert "TEMPLATE" not in read
    assert read["FROM"] == [f"./{GGUF}"] and read["PARAMETER stop"] == stops
    assert reason in result.note and "tokenizer.chat_template" in result.note and "\n" not in result.note


def test_no_chat_template_says_so() -> None:
    result = modelfile(Path(GGUF), chat_template=None, stop_tokens=["</s>"], bos_token=None, name="base")
    assert not result.template and "no chat template" in result.note
    assert parse_modelfile(result.text)["PARAMETER stop"] == ["</s>"]


def test_stop_tokens_are_deduplicated_and_read_back_exactly() -> None:
    awkward = ["<|im_end|>", "<|im_end|>", 'say "hi"', 'ends in "', '""starts with quotes', "two\nlines", " spaced "]
    result = modelfile(Path(GGUF), chat_template=None, stop_tokens=[*awkward, ""], bos_token=None, name="x")
    assert parse_modelfile(result.text)["PARAMETER stop"] == list(dict.fromkeys(awkward))


def test_a_stop_token_ollama_cannot_read_is_refused() -> None:
    with pytest.raises(InvalidConfig, match="stop token"):
        modelfile(Path(GGUF), chat_template=None, stop_tokens=["<bell>\a"], bos_token=None, name="x")


@pytest.mark.parametrize("name", ["has space", "-leading-dash", "a/b/c", "x" * 81, ""])
def test_bad_model_names_are_refused(name: str) -> None:
    with pytest.raises(InvalidConfig) as error:
        modelfile(Path(GGUF), chat_template=None, stop_tokens=[], bos_token=None, name=name)
    assert error.value.exit_code == 2 and "\n" not in str(error.value)


def test_create_command_points_at_the_modelfile_beside_the_gguf(tmp_path: Path) -> None:
    folder = tmp_path / "my run"
    result = modelfile(folder / GGUF, chat_template=None, stop_tokens=[], bos_token=None, name="me/tuned:q4")
    assert shlex.split(result.create_command) == ["ollama", "create", "me/tuned:q4", "-f", str(folder / "Modelfile")]


def test_write_modelfile_writes_beside_the_gguf_and_replaces(tmp_path: Path) -> None:
    (tmp_path / GGUF).write_bytes(b"GGUF")
    (tmp_path / "Modelfile").write_text("FROM old\n")
    result = build("demo", name="demo")
    path = write_modelfile(tmp_path, result)
    assert path == tmp_path / "Modelfile"
    assert path.read_text(encoding="utf-8") == result.text
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left


def test_write_modelfile_refuses_a_folder_without_the_gguf(tmp_path: Path) -> None:
    with pytest.raises(LorafitError, match=GGUF):
        write_modelfile(tmp_path, build("demo", name="demo"))
    assert not (tmp_path / "Modelfile").exists()


# --- The Modelfile reader follows Ollama's parser ---------------------------------------------------------------


def test_parse_modelfile_reads_ollama_syntax() -> None:
    text = (
        "# a comment\n"
        "FROM ./model.gguf\n"
        'TEMPLATE """{{ .Prompt }}\n'
        '  second line """\n'
        'PARAMETER stop "<|end|>"\n'
        "parameter num_ctx 4096\n"
        "SYSTEM a bare value with spaces\n"
        'MESSAGE user "hola"\n'
    )
    assert parse_modelfile(text) == {
        "FROM": ["./model.gguf"],
        "TEMPLATE": ["{{ .Prompt }}\n  second line "],
        "PARAMETER stop": ["<|end|>"],
        "PARAMETER num_ctx": ["4096"],
        "SYSTEM": ["a bare value with spaces"],
        "MESSAGE": ["user: hola"],
    }


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("PARAMETER stop x\n", "no FROM"),
        ("FROM x\nRUN y\n", "command must be one of"),
        ('FROM x\nSYSTEM """never closed\n', "not closed"),
        ("FROM x\nMESSAGE robot hi\n", "message role"),
    ],
)
def test_parse_modelfile_refuses_what_ollama_refuses(text: str, message: str) -> None:
    with pytest.raises(InvalidConfig, match=message):
        parse_modelfile(text)


# --- The Go template interpreter agrees with Ollama ------------------------------------------------------------

OLLAMA_CASES = {
    "user": [{"role": "user", "content": "Hello, how are you?"}],
    "user-assistant-user": [
        {"role": "user", "content": "Hello, how are you?"},
        {"role": "assistant", "content": "I'm doing great. How can I help you today?"},
        {"role": "user", "content": "I'd like to show off how chat templating works!"},
    ],
}
OLLAMA_CASES["system-user-assistant-user"] = [
    {"role": "system", "content": "You are a helpful assistant."},
    *OLLAMA_CASES["user-assistant-user"],
]


@pytest.mark.parametrize("template", ["chatml", "llama3-instruct"])
@pytest.mark.parametrize("case", OLLAMA_CASES)
def test_render_template_matches_ollamas_own_renderings(template: str, case: str) -> None:
    folder = DATA / "ollama_templates"
    go = (folder / f"{template}.gotmpl").read_text(encoding="utf-8")
    expected = (folder / f"{template}.{case}.txt").read_text(encoding="utf-8")
    assert render_template(go, OLLAMA_CASES[case]) == expected


def test_render_template_joins_consecutive_messages_of_one_role_as_ollama_does() -> None:
    go = "{{ range .Messages }}[{{ .Role }}:{{ .Content }}]{{ end }}"
    go += "{{ if .System }}S={{ .System }}{{ else }}none{{ end }}"
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert render_template(go, messages) == "[user:a\n\nb]none"
    assert render_template(go, [{"role": "system", "content": "s"}]) == "[system:s]S=s"


def test_render_template_refuses_what_it_does_not_know() -> None:
    with pytest.raises(ValueError):
        render_template("{{ .Messages | len }}", [])
    with pytest.raises(ValueError):
        render_template("{{ if .Messages }}never closed", [])


def test_importing_the_module_loads_no_jinja() -> None:
    """The planner stays instant: jinja2 (and transformers) load only when a Modelfile is derived."""
    code = "import sys, lorafit.export.ollama; print('jinja2' in sys.modules, 'transformers' in sys.modules)"
    src = str(Path(__file__).parents[1] / "src")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": src})
    assert out.stdout.split() == ["False", "False"], out.stderr
