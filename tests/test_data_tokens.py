"""Token counting with a real (locally trained) tokenizer and its chat template, and the character estimate's
measured error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lorafit.data.check import check
from lorafit.data.estimate import measure
from lorafit.data.tokens import CHAR_ESTIMATE_ERROR, CHARS_PER_TOKEN, load_counter
from lorafit.errors import DataError

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if 'FORBIDDEN' in m['content'] %}{{ raise_exception('this template refuses FORBIDDEN') }}{% endif %}"
    "<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}{% endfor %}"
)
WORDS = [
    "the",
    "model",
    "reads",
    "every",
    "token",
    "of",
    "the",
    "answer",
    "and",
    "learns",
    "from",
    "the",
    "words",
    "it",
    "sees",
    "in",
    "training",
]


def train_tokenizer(folder: Path, chat_template: str | None) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))] * 20
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    if chat_template:
        fast.chat_template = chat_template
    fast.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tokenizers_dir(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    return {
        "chat": train_tokenizer(root / "chat", CHAT_TEMPLATE),
        "plain": train_tokenizer(root / "plain", None),
    }


def conversations(count: int) -> list[list[dict]]:
    return [
        [
            {"role": "user", "content": " ".join(WORDS[: 3 + i % 7])},
            {"role": "assistant", "content": " ".join(WORDS[i % 5 :])},
        ]
        for i in range(count)
    ]


def write_messages(path: Path, convs: list[list[dict]]) -> Path:
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    return path


def test_counts_follow_the_chat_template(tmp_path: Path, tokenizers_dir: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    convs = conversations(700)
    report = check(write_messages(tmp_path / "a.jsonl", convs), tokenizer=str(tokenizers_dir["chat"]))
    tokenizer = AutoTokenizer.from_pretrained(tokenizers_dir["chat"])
    expected = [
        len(tokenizer(tokenizer.apply_chat_template(c, tokenize=False), add_special_tokens=False)["input_ids"])
        for c in convs
    ]
    answers = sum(len(tokenizer(c[1]["content"], add_special_tokens=False)["input_ids"]) for c in convs)
    assert report.tokens.tokenizer == str(tokenizers_dir["chat"]) and report.tokens.estimate_error is None
    assert report.tokens.total == sum(expected)
    assert report.tokens.max == max(expected)
    assert sorted(report.lengths) == sorted(expected)
    assert report.tokens.answer_token_share == pytest.approx(answers / sum(expected))


def test_without_a_template_turns_are_joined_as_role_colon_content(
    tmp_path: Path, tokenizers_dir: dict[str, Path]
) -> None:
    """As the trainer renders them: 'role: content' turns, EOS after each answer, no BOS added."""
    from transformers import AutoTokenizer

    convs = conversations(3)
    report = check(write_messages(tmp_path / "a.jsonl", convs), tokenizer=str(tokenizers_dir["plain"]))
    tokenizer = AutoTokenizer.from_pretrained(tokenizers_dir["plain"])
    joined = [f"user: {c[0]['content']}\n\nassistant: {c[1]['content']}</s>" for c in convs]
    expected = [len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in joined]
    assert sorted(report.lengths) == sorted(expected)
    by_file = check(
        write_messages(tmp_path / "b.jsonl", convs), tokenizer=str(tokenizers_dir["plain"] / "tokenizer.json")
    )
    # a bare tokenizer.json names no EOS token: the same turns, without it
    assert [length + 1 for length in by_file.lengths] == list(report.lengths)


def test_a_row_the_template_refuses_is_an_error_and_the_rest_still_count(
    tmp_path: Path, tokenizers_dir: dict[str, Path]
) -> None:
    convs = conversations(5)
    convs[3][1]["content"] = "FORBIDDEN words"
    report = check(write_messages(tmp_path / "a.jsonl", convs), tokenizer=str(tokenizers_dir["chat"]))
    assert report.valid_rows == 4 and len(report.lengths) == 4
    [problem] = report.problems
    assert (problem.row, problem.line, problem.severity) == (3, 4, "error")
    assert "rejected by the chat template: this template refuses FORBIDDEN" in problem.message


def test_raw_text_is_tokenized_as_is_even_with_a_template(tmp_path: Path, tokenizers_dir: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    path = tmp_path / "a.txt"
    path.write_text("the model reads every token\n")
    report = check(path, tokenizer=str(tokenizers_dir["chat"]))
    tokenizer = AutoTokenizer.from_pretrained(tokenizers_dir["chat"])
    # as the trainer tokenizes raw text: the tokenizer's BOS, the text, EOS
    assert report.tokens.total == len(tokenizer("the model reads every token</s>")["input_ids"])


@pytest.mark.parametrize("spec", ["no-such-tokenizer", "llama-2-7b", "someone/some-model"])
def test_a_tokenizer_that_is_not_here_is_a_one_line_error(
    spec: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-cache"))
    with pytest.raises(DataError, match="--tokenizer") as raised:
        load_counter(spec)
    assert "\n" not in str(raised.value)


def test_a_directory_without_a_tokenizer_is_refused(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    with pytest.raises(DataError, match="no usable local tokenizer"):
        load_counter(str(tmp_path / "model"))


def test_the_stored_estimate_error_holds_against_a_freshly_trained_bpe() -> None:
    """A smaller rerun of the measurement behind CHAR_ESTIMATE_ERROR (`make bench-data` does the full one)."""
    accuracy = measure(vocab_size=8000, max_files=200)
    assert accuracy.rows > 500
    assert abs(accuracy.chars_per_token - CHARS_PER_TOKEN) < 0.6
    assert accuracy.long_row_error <= CHAR_ESTIMATE_ERROR + 0.05
    assert abs(accuracy.total_error) < 0.15


@pytest.mark.parametrize("spec", ["", "  "])
def test_an_empty_tokenizer_option_says_so(spec: str) -> None:
    with pytest.raises(DataError, match="--tokenizer is empty; pass a tokenizer directory"):
        load_counter(spec)
