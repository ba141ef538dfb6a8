"""`lorafit plan --data` with a local model folder counts the tokens `lorafit train` will see: the folder's own
tokenizer and chat template (its default system prompt included), through the trainer's own code."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from conftest import ROOT, run_cli, tiny_spec
from lorafit.data import load_conversations
from lorafit.data.chat_text import ensure_chat_template
from lorafit.train.examples import encode

# SmolLM2-Instruct's template in form: a default system prompt when the conversation has none, ChatML turns
SYSTEM = "You are a helpful AI assistant named Tiny, trained by nobody in particular"
TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\n" + SYSTEM + "<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
WORDS = [
    "the",
    "tide",
    "turns",
    "when",
    "the",
    "moon",
    "pulls",
    "on",
    "the",
    "sea",
    "and",
    "every",
    "fish",
    "swims",
    "home",
    "before",
    "the",
    "dark",
]


def model_folder(folder: Path, chat_template: str | None) -> Path:
    """config.json of a 2-layer Llama and a byte-level BPE trained here, saved as transformers saves one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps(tiny_spec().to_hf_config() | {"architectures": ["LlamaForCausalLM"]})
    )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))] * 10, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", bos_token="<|endoftext|>")
    fast.chat_template = chat_template
    fast.save_pretrained(folder)
    return folder


def chat_rows(path: Path, count: int) -> Path:
    rows = []
    for i in range(count):
        messages = [
            {"role": "user", "content": " ".join(WORDS[: 2 + i % 9])},
            {"role": "assistant", "content": " ".join(WORDS[i % 6 :])},
        ]
        if i % 4 == 0:  # a system turn of its own: no default prompt for this row
            messages.insert(0, {"role": "system", "content": "answer in one line"})
        if i % 5 == 0:
            messages += [{"role": "user", "content": "and then?"}, {"role": "assistant", "content": "home"}]
        rows.append(json.dumps({"messages": messages}))
    path.write_text("\n".join(rows) + "\n")
    return path


def trainer_lengths(folder: Path, data: Path) -> list[int]:
    """The lengths `lorafit train` encodes this data to: its tokenizer loading and its encode()."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    ensure_chat_template(tokenizer)
    return encode(list(load_conversations(data)), tokenizer).lengths


@pytest.mark.parametrize("template", [TEMPLATE, None], ids=["default-system-prompt", "no-template"])
def test_plan_counts_the_tokens_the_trainer_encodes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], template: str | None
) -> None:
    folder = model_folder(tmp_path / "model", template)
    data = chat_rows(tmp_path / "chat.jsonl", 72)
    expected = trainer_lengths(folder, data)

    code, out, err = run_cli(
        ["plan", "--model", str(folder), "--data", str(data), "--gpu", "rtx-4090", "--json"], capsys
    )
    assert code == 0, err
    tokens = json.loads(out)["tokens"]
    assert (tokens["rows"], tokens["total_tokens"], tokens["max"]) == (len(expected), sum(expected), max(expected))
    assert tokens["tokenizer"] == str(folder) and tokens["estimate_error"] is None
    assert "as lorafit train tokenizes them" in tokens["basis"]

    code, out, err = run_cli(["plan", "--model", str(folder), "--data", str(data), "--gpu", "rtx-4090"], capsys)
    assert code == 0, err
    said = " ".join(out.split())  # the console wraps long lines
    assert f"data: {len(expected)} rows, {sum(expected):,} tokens, longest row {max(expected)} (counted as" in said
    assert ("its chat template" if template else "'role: content' turns (it has no chat template)") in said


def test_a_folder_without_a_tokenizer_is_estimated_without_loading_transformers(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps(tiny_spec().to_hf_config() | {"architectures": ["LlamaForCausalLM"]})
    )
    data = chat_rows(tmp_path / "chat.jsonl", 8)
    script = (
        "import json, sys; from lorafit import answers; "
        f"plan = answers.plan({{'model': {str(folder)!r}, 'data': {str(data)!r}, 'gpu': 'rtx-4090'}}).plans[0]; "
        "print(json.dumps([plan.tokens.tokenizer, 'transformers' in sys.modules, 'torch' in sys.modules]))"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert json.loads(result.stdout) == [None, False, False]


# --- catalog models: the family's chat template, estimated --------------------------------------------------
def catalog_table(name: str) -> dict:
    return tomllib.loads((ROOT / "src" / "lorafit" / "catalog" / name).read_text())


def test_a_catalog_model_counts_its_familys_template_around_the_text(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """By hand, from the table: 4 characters a token of each message's text, the markers of each message, the
    default system turn when a row has none (Qwen2.5's), and nothing else."""
    data = chat_rows(tmp_path / "chat.jsonl", 40)
    qwen = catalog_table("chat_templates.toml")["template"]["qwen2.5"]
    expected = []
    for line in data.read_text().splitlines():
        messages = json.loads(line)["messages"]
        text = sum(math.ceil(len(m["content"]) / 4) for m in messages)
        system = 0 if messages[0]["role"] == "system" else qwen["default_system_tokens"]
        expected.append(text + qwen["tokens_per_message"] * len(messages) + system + qwen["fixed_tokens"])
    code, out, err = run_cli(["plan", "--model", "Qwen/Qwen2.5-7B-Instruct", "--data", str(data), "--json"], capsys)
    assert code == 0, err
    tokens = json.loads(out)["tokens"]
    assert (tokens["total_tokens"], tokens["max"]) == (sum(expected), max(expected))
    assert tokens["tokenizer"] is None and "the chat template of Qwen/Qwen2.5-7B-Instruct" in tokens["basis"]


def test_every_family_template_has_its_measured_error_and_the_plan_quotes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """catalog/token_accuracy.toml is bench-tokens' output for the families of chat_templates.toml: a family
    added or renamed without rerunning the bench fails here."""
    families = catalog_table("chat_templates.toml")["template"]
    measured = catalog_table("token_accuracy.toml")["family"]
    assert set(measured) == set(families)
    data = chat_rows(tmp_path / "chat.jsonl", 8)
    for name, model in (("llama-3.1", "llama-3.1-8b"), ("smollm2", "smollm2-135m")):
        code, out, err = run_cli(["plan", "--model", model, "--data", str(data), "--json"], capsys)
        assert code == 0, err
        basis, entry = json.loads(out)["tokens"]["basis"], measured[name]
        if entry["rows"]:
            assert f"total {entry['total_error']:+.1%}, longest row {entry['longest_error']:+.1%}" in basis
        else:  # no real tokenizer: said, with no figure
            assert f"its error is not measured: {entry['why']}" in basis
    assert not measured["smollm2"]["rows"] and measured["llama-3.1"]["rows"] >= 1000


def test_a_model_folder_with_a_broken_tokenizer_is_one_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = model_folder(tmp_path / "model", TEMPLATE)
    (folder / "tokenizer.json").write_text("{not json")
    data = chat_rows(tmp_path / "chat.jsonl", 4)
    code, out, err = run_cli(["plan", "--model", str(folder), "--data", str(data)], capsys)
    assert code == 2 and out == ""
    assert err.startswith(f"lorafit: error: the tokenizer of --model {folder}: no usable local tokenizer")
    assert "--tokenizer chars" in err and len(err.strip().splitlines()) == 1
    code, out, err = run_cli(["plan", "--model", str(folder), "--data", str(data), "--tokenizer", "chars"], capsys)
    assert code == 0, err
