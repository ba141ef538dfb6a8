"""Counting tokens: a local Hugging Face tokenizer (with its chat template), or an estimate from characters.

Counting is batched through the Rust tokenizer (`encode_batch_fast`): a million rows take seconds, not hours.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Protocol

from lorafit.data.chat_text import ensure_chat_template, row_text, token_lengths
from lorafit.data.formats import Format, Messages, plain_text
from lorafit.data.template_cost import TemplateCost, accuracy_line, template_for, token_accuracy
from lorafit.errors import DataError
from lorafit.messages import say
from lorafit.models import ModelSpec, catalog

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# The character estimate: ~4 characters per token is the usual figure for English with a 32k-50k BPE vocab.
# CHAR_ESTIMATE_ERROR is its mean per-row relative error |estimate - count| / count on rows of 64 tokens or
# more (the rows that set the sequence length and the memory peak) against a byte-level BPE of 32,000 tokens
# trained with `tokenizers` on half of an English corpus every Python ships (standard-library docstrings and
# pydoc topics) and counted on the other half: 0.13 on Python 3.11. On all rows, short ones included, the mean
# is 0.20; the dataset's total is off by +6% and its p99 length by -3%. Measured by `make bench-data`
# (`python bench/data_stream.py --estimate-only` reruns only this); tests/test_data_tokens.py rechecks it.
CHARS_PER_TOKEN = 4.0
CHAR_ESTIMATE_ERROR = 0.13
CHAR_ESTIMATE_NAME = "chars"
# A model folder holds a tokenizer when it has either (AutoTokenizer reads tokenizer.json, or the slow files that
# tokenizer_config.json names)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class TokenCount(NamedTuple):
    """One row: all its tokens, the assistant's share of them, or why it could not be counted."""

    total: int
    answer: int
    error: str | None = None


class TokenCounter(Protocol):
    name: str | None  # None: an estimate
    estimate_error: float | None
    basis: str  # where the counts come from, in words (the plan quotes it)

    def count(self, conversations: Sequence[Messages], fmt: Format) -> list[TokenCount]: ...


@dataclass
class CharEstimate:
    """Tokens from characters, for planning before any tokenizer is at hand."""

    chars_per_token: float = CHARS_PER_TOKEN
    name: str | None = None
    estimate_error: float | None = CHAR_ESTIMATE_ERROR
    basis: str = (
        f"estimated at {CHARS_PER_TOKEN:g} characters a token, turns joined as 'role: content' (mean row error "
        f"{CHAR_ESTIMATE_ERROR:.0%}, make bench-data); pass a model folder with its tokenizer to count exactly"
    )

    def tokens(self, text: str) -> int:
        return math.ceil(len(text) / self.chars_per_token)

    def count(self, conversations: Sequence[Messages], fmt: Format) -> list[TokenCount]:
        counts = []
        for messages in conversations:
            total = self.tokens(plain_text(messages, fmt))
            answer = sum(self.tokens(m["content"]) for m in messages if m["role"] == "assistant")
            counts.append(TokenCount(total, min(answer, total)))
        return counts


class TemplateEstimate(CharEstimate):
    """The character estimate of each message's text plus the tokens the family's chat template adds around
    it (catalog/chat_templates.toml): for a catalog model, whose tokenizer is not at hand."""

    def __init__(self, cost: TemplateCost) -> None:
        super().__init__()
        self.cost = cost
        measured = token_accuracy().get(cost.name, {})
        self.estimate_error = measured.get("row_error") if measured.get("rows") else None
        self.basis = (
            f"estimated: {CHARS_PER_TOKEN:g} characters a token plus {cost.describe()}; "
            f"{accuracy_line(cost.name)}; pass a model folder with its tokenizer to count exactly"
        )

    def count(self, conversations: Sequence[Messages], fmt: Format) -> list[TokenCount]:
        if fmt == "text":  # raw text is not put through a chat template
            return super().count(conversations, fmt)
        counts = []
        for messages in conversations:
            text = [self.tokens(m["content"]) for m in messages]
            answer = sum(n for n, m in zip(text, messages, strict=True) if m["role"] == "assistant")
            total = sum(text) + self.cost.tokens([m["role"] for m in messages])
            counts.append(TokenCount(total, min(answer, total)))
        return counts


class TokenizerCounter:
    """A real tokenizer, counting each row exactly as `lorafit train` tokenizes it (data/chat_text.py): through
    its chat template (default system prompt and turn markers included), or the trainer's 'role: content'
    template when it has none; raw text plus EOS. The answer share counts the assistant turns' own tokens."""

    estimate_error: float | None = None

    def __init__(self, tokenizer: PreTrainedTokenizerBase, name: str) -> None:
        self.tokenizer = tokenizer
        self.name = name
        had_template = not ensure_chat_template(tokenizer)
        template = "its chat template" if had_template else "lorafit's 'role: content' turns (it has no chat template)"
        self.basis = f"counted as lorafit train tokenizes them: the tokenizer of {name}, {template}"

    def lengths(self, texts: Sequence[str], raw_text: bool) -> list[int]:
        return token_lengths(self.tokenizer, texts, raw_text)

    def count(self, conversations: Sequence[Messages], fmt: Format) -> list[TokenCount]:
        raw_text = fmt == "text"
        texts: list[str | None] = []
        errors: list[str | None] = []
        for messages in conversations:
            try:
                texts.append(row_text(self.tokenizer, messages, raw_text))
                errors.append(None)
            except Exception as error:  # the template is user code (jinja raises many types): a row problem
                texts.append(None)
                errors.append(say("row.template", reason=_first_line(error)))
        totals = iter(self.lengths([text for text in texts if text is not None], raw_text))
        answers = [m["content"] for messages in conversations for m in messages if m["role"] == "assistant"]
        answer_lengths = iter(self.lengths(answers, False))
        counts = []
        for messages, text, error in zip(conversations, texts, errors, strict=True):
            answer = sum(next(answer_lengths) for m in messages if m["role"] == "assistant")
            if text is None:
                counts.append(TokenCount(0, 0, error))
            else:
                total = next(totals)
                counts.append(TokenCount(total, min(answer, total)))
        return counts


def load_counter(spec: str | None) -> TokenCounter:
    """`--tokenizer`: a tokenizer directory, a tokenizer.json, a catalog model or hub id already in the local
    Hugging Face cache, or `chars` (the estimate, also the default). Never downloads."""
    if spec is None or spec == CHAR_ESTIMATE_NAME:
        return CharEstimate()
    if not spec.strip():  # Path("") is the current directory: say what is missing instead
        raise DataError(
            "--tokenizer is empty; pass a tokenizer directory, a tokenizer.json file, a model in the local "
            f"Hugging Face cache, or `--tokenizer {CHAR_ESTIMATE_NAME}`"
        )
    path = Path(spec).expanduser()
    if path.is_dir():
        return TokenizerCounter(_from_pretrained(str(path), f"--tokenizer {spec}"), str(path))
    if path.is_file():
        if path.suffix != ".json":
            raise DataError(f"--tokenizer {spec}: expected a tokenizer directory or a tokenizer.json file")
        from transformers import PreTrainedTokenizerFast

        try:
            return TokenizerCounter(PreTrainedTokenizerFast(tokenizer_file=str(path)), str(path))
        except Exception as error:  # tokenizers raises plain Exception subclasses for bad files
            raise DataError(f"--tokenizer {spec}: cannot load it: {_first_line(error)}") from None
    hub_id = _preset_hub_id(spec)
    return TokenizerCounter(_from_pretrained(hub_id, f"--tokenizer {spec}"), hub_id)


def counter_for(model: str | None, tokenizer: str | None, spec: ModelSpec | None = None) -> TokenCounter:
    """The counter of `lorafit plan --data` (and of the page's dataset upload): `--tokenizer` where given;
    else, when `--model` is a local folder with a tokenizer, that folder's (the one `lorafit train` loads from
    it, so plan and run count alike); else the estimate with the chat template of the model's family, where
    catalog/chat_templates.toml has it (`spec`: the model `--model` resolved to); else the plain character
    estimate. transformers is imported only on the tokenizer paths."""
    if tokenizer is not None:
        return load_counter(tokenizer)
    folder = Path(model).expanduser() if model else None
    if folder is not None and folder.is_dir() and any((folder / name).is_file() for name in TOKENIZER_FILES):
        return TokenizerCounter(_from_pretrained(str(folder), f"the tokenizer of --model {model}"), str(folder))
    cost = template_for(model, spec.name if spec else None, spec.hf_id if spec else None)
    return TemplateEstimate(cost) if cost is not None else CharEstimate()


def _preset_hub_id(spec: str) -> str:
    for name, model in catalog().items():
        if spec.lower() in (name, (model.hf_id or "").lower()) and model.hf_id:
            return model.hf_id
    if "/" in spec:
        return spec
    raise DataError(
        f"--tokenizer {spec}: no such directory, and not a catalog model or hub id; pass a tokenizer "
        "directory "
        f"or `--tokenizer {CHAR_ESTIMATE_NAME}` for the estimate"
    )


def _from_pretrained(source: str, what: str) -> PreTrainedTokenizerBase:
    """`what`: the option the tokenizer came from, as the error names it."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source, local_files_only=True)
    except Exception as error:  # transformers raises OSError/ValueError/KeyError for bad dirs
        raise DataError(
            f"{what}: no usable local tokenizer ({_first_line(error)}); lorafit never downloads: pass "
            f"a directory with tokenizer.json, or `--tokenizer {CHAR_ESTIMATE_NAME}` for the estimate"
        ) from None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:200] if text else type(error).__name__
