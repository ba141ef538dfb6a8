"""The text the trainer tokenizes for one row, and how it tokenizes it: one implementation for `lorafit train`
(train/examples.py, which also finds the answer tokens in it) and for the token counts of `lorafit plan --data`
and `lorafit data check --tokenizer` (data/tokens.py), so the plan and the run count the same tokens row for row.

A chat row is the tokenizer's chat template applied to the whole conversation (its default system prompt, BOS
and end-of-turn markers included), tokenized without adding special tokens: the template writes them. A row of
the `text` format is its text plus EOS, tokenized with the tokenizer's own special tokens (its BOS).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# For tokenizers without a chat template (base models): 'role: content' turns, with the end-of-sequence token
# after each answer so that the model learns to stop.
PLAIN_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if not loop.first %}{{ '\\n\\n' }}{% endif -%}"
    "{{ message['role'] }}: {{ message['content'] }}"
    "{%- if message['role'] == 'assistant' %}{{ eos_token }}{% endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '\\n\\nassistant: ' }}{% endif -%}"
)


def ensure_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Give a template-less tokenizer the plain 'role: content' template; True if it had none."""
    if getattr(tokenizer, "chat_template", None):
        return False
    tokenizer.chat_template = PLAIN_CHAT_TEMPLATE
    return True


def render(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def row_text(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], raw_text: bool) -> str:
    """The text of one row as the trainer tokenizes it (`raw_text`: a row of the `text` format). The template
    is user code: its refusal (jinja raises many types) propagates to the caller, which names the row."""
    if raw_text:
        return "".join(message["content"] for message in messages) + (tokenizer.eos_token or "")
    return render(tokenizer, messages, False)


def adds_special_tokens(raw_text: bool) -> bool:
    """Whether the tokenizer adds its own BOS/EOS: only to raw text; a chat template writes them itself."""
    return raw_text


def token_lengths(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], raw_text: bool) -> list[int]:
    """The token count of each text, tokenized as the trainer tokenizes it; batched through the Rust tokenizer
    (`encode_batch_fast`, no offsets) where there is one, so a million rows take seconds."""
    if not texts:
        return []
    special = adds_special_tokens(raw_text)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return [len(encoding.ids) for encoding in backend.encode_batch_fast(list(texts), add_special_tokens=special)]
    encoded = tokenizer(list(texts), add_special_tokens=special, return_attention_mask=False)
    return [len(ids) for ids in encoded["input_ids"]]
