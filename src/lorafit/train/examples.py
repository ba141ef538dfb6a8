"""Conversations -> token ids and labels: the chat template applied, the loss on the answer tokens only.

Which tokens are the answer is read off the template itself: the text of `messages[:i]` with the generation
prompt is a prefix of the text of `messages[:i + 1]`, and what the latter adds is assistant turn i (its end
of turn marker included, so the model learns to stop). Token offsets map those character spans to tokens,
so it works for any fast tokenizer and any prefix-stable template without `{% generation %}` markers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lorafit.data.chat_text import adds_special_tokens, render, row_text
from lorafit.data.profile import profile_of_lengths
from lorafit.errors import DataError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from lorafit.schema import TokenProfile

IGNORE_INDEX = -100


@dataclass
class Encoded:
    """Token ids and labels of every kept row, and what happened to the others."""

    input_ids: list[list[int]] = field(default_factory=list)
    labels: list[list[int]] = field(default_factory=list)
    truncated: int = 0  # rows cut at seq_len
    dropped: int = 0  # rows with no answer token left after the cut

    @property
    def lengths(self) -> list[int]:
        return [len(ids) for ids in self.input_ids]

    @property
    def answer_tokens(self) -> int:
        return sum(sum(1 for label in labels if label != IGNORE_INDEX) for labels in self.labels)


def ensure_pad_token(tokenizer: PreTrainedTokenizerBase) -> None:
    """Padding positions are masked out of attention and loss, so any token can stand in for a missing pad."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    tokenizer.padding_side = "right"


def answer_spans(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], full: str
) -> list[tuple[int, int]]:
    """The character spans of the assistant turns in `full`, the rendered conversation (`row_text`)."""
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:index], True) if index else ""
        upto = render(tokenizer, messages[: index + 1], False)
        if not (full.startswith(upto) and upto.startswith(before)):
            return _last_answer_span(tokenizer, messages, full)
        spans.append((len(before), len(upto)))
    return spans


def _last_answer_span(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], full: str
) -> list[tuple[int, int]]:
    """Templates that rewrite earlier turns (some drop past reasoning) are prefix-stable for the last one."""
    before = render(tokenizer, messages[:-1], True)
    if messages[-1]["role"] != "assistant" or not full.startswith(before):
        raise DataError(
            "the tokenizer's chat template renders turns differently depending on what follows them, so the "
            "answer tokens cannot be found; set train_on_prompt: true to train on every token"
        )
    return [(len(before), len(full))]


def encode(
    conversations: Sequence[list[dict[str, Any]]],
    tokenizer: PreTrainedTokenizerBase,
    *,
    raw_text: bool = False,
    train_on_prompt: bool = False,
) -> Encoded:
    """Token ids and labels (-100 outside the answers, unless `train_on_prompt`), uncut: `cut()` applies
    the sequence length, which the plan picks from these lengths.

    `raw_text`: rows of the `text` format (one assistant message each) are tokenized as they are, plus EOS,
    and every token is trained on."""
    if not conversations:
        return Encoded()
    if not getattr(tokenizer, "is_fast", False):
        raise DataError("lorafit needs a fast tokenizer (tokenizer.json) to find the answer tokens")
    texts: list[str] = []
    all_spans: list[list[tuple[int, int]]] = []
    for messages in conversations:
        try:
            text = row_text(tokenizer, messages, raw_text)
            spans = [(0, len(text))] if raw_text or train_on_prompt else answer_spans(tokenizer, messages, text)
        except DataError:
            raise
        except Exception as error:  # the template is user code (jinja); its refusal names the row
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise DataError(f"row {len(texts)}: the chat template rejects it: {reason}") from None
        texts.append(text)
        all_spans.append(spans)
    batch = tokenizer(
        texts,
        add_special_tokens=adds_special_tokens(raw_text),
        return_offsets_mapping=True,
        return_attention_mask=False,
    )
    result = Encoded()
    for ids, offsets, spans in zip(batch["input_ids"], batch["offset_mapping"], all_spans, strict=True):
        labels = [
            token if _inside(start, end, spans) else IGNORE_INDEX
            for token, (start, end) in zip(ids, offsets, strict=True)
        ]
        result.input_ids.append(list(ids))
        result.labels.append(labels)
    return result


def cut(encoded: Encoded, seq_len: int) -> Encoded:
    """Rows cut at `seq_len`; a row left with no answer token to learn from is dropped (and counted)."""
    result = Encoded()
    for ids, labels in zip(encoded.input_ids, encoded.labels, strict=True):
        if len(ids) > seq_len:
            result.truncated += 1
            ids, labels = ids[:seq_len], labels[:seq_len]
        if all(label == IGNORE_INDEX for label in labels[1:]):
            result.dropped += 1
            continue
        result.input_ids.append(ids)
        result.labels.append(labels)
    return result


def _inside(start: int, end: int, spans: list[tuple[int, int]]) -> bool:
    """A token belongs to a span if it starts inside it (special tokens added by the tokenizer have (0, 0))."""
    if start == end == 0:
        return False
    return any(low <= start < high for low, high in spans)


def token_profile(encoded: Encoded, source: str, tokenizer_name: str) -> TokenProfile:
    """The planner's view of the data, measured on the exact tokens the trainer renders (before the cut). The
    plan is saved in the run folder, which is shared: an absolute `source` is named by its file name."""
    shown = Path(source).name if Path(source).is_absolute() else source
    return profile_of_lengths(encoded.lengths, shown, answer_tokens=encoded.answer_tokens, tokenizer=tokenizer_name)
