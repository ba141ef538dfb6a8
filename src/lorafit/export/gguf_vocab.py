"""The tokenizer of a transformers model folder as llama.cpp reads it: the vocabulary, merges, special tokens, and
the llama.cpp pre-tokenizer whose splits of a probe text equal the Hugging Face one's (catalog/gguf.toml)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lorafit.errors import ExportError
from lorafit.export.gguf_catalog import gguf_catalog

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Probe for the pre-tokenizer: contractions in both cases, digit runs, whitespace runs and newlines, punctuation,
# accented Latin (Spanish, Portuguese), CJK, emoji - where the known pre-tokenizers differ from one another.
PRETOKENIZER_PROBE = (
    "Hello world! I'M here, you're THERE; we'll've 'tis. 1 12 123 1234 12345678 3.14159\n\n"
    "  indented   text\t\ttabs\r\nWindows line\n   \n¿Dónde está la estación? Não há coração sem ação, "
    "señor. 你好世界 こんにちは 🦙🚀 camelCaseWords HTTPServer x=a+b*(c-d)/e; $100 #tag @user "
    "   trailing spaces   "
)


# --- tokenizer ----------------------------------------------------------------------------------------------
@dataclass
class Vocabulary:
    model: str  # tokenizer.ggml.model: "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    pre: str | None
    tokens: list[str]
    types: list[int]
    scores: list[float] | None = None
    merges: list[str] = field(default_factory=list)
    special: dict[str, int] = field(default_factory=dict)  # bos, eos, eot, pad, unk -> id
    add_bos: bool = False
    add_eos: bool = False
    add_space_prefix: bool | None = None
    chat_template: str | None = None

    def stop_tokens(self) -> list[str]:
        """The text of each token that ends generation: EOS first (the Modelfile renders with it), end of turn."""
        ids = dict.fromkeys(self.special[key] for key in ("eos", "eot") if key in self.special)
        return [self.tokens[i] for i in ids]


def _pieces(text: str, expressions: list[str]) -> list[str]:
    """Split `text` as llama.cpp's BPE pre-tokenizer does: each expression splits every piece the previous one
    made; the text between matches stays a piece of its own."""
    import regex

    pieces = [text]
    for expression in expressions:
        pattern = regex.compile(expression)
        split: list[str] = []
        for piece in pieces:
            start = 0
            for match in pattern.finditer(piece):
                if match.start() > start:
                    split.append(piece[start : match.start()])
                if match.end() > match.start():
                    split.append(match.group(0))
                start = match.end()
            if start < len(piece):
                split.append(piece[start:])
        pieces = split
    return pieces


@cache
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte-to-character table, which byte-level BPE vocabularies are written in: printable bytes stand
    for themselves, the others are moved to code points from 256 on, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in table:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def _byte_level(piece: str) -> str:
    alphabet = _byte_alphabet()
    return "".join(alphabet[byte] for byte in piece.encode())


def identify_pretokenizer(backend: Any, ignore_merges: bool) -> str:
    """The llama.cpp pre-tokenizer that splits the probe exactly as `backend` (a `tokenizers.Tokenizer`) does."""
    text = PRETOKENIZER_PROBE
    if backend.normalizer is not None:
        normalized = backend.normalizer.normalize_str(text)
        if normalized != text:
            raise ExportError("the tokenizer normalises text in a way llama.cpp does not; cannot write it as GGUF")
    if backend.pre_tokenizer is None:
        raise ExportError("the byte-level tokenizer has no pre-tokenizer; llama.cpp has no equivalent")
    theirs = [piece for piece, _ in backend.pre_tokenizer.pre_tokenize_str(text)]
    for name, entry in gguf_catalog()["pretokenizers"].items():
        ours = [_byte_level(piece) for piece in _pieces(text, entry["regex"])]
        if ours == theirs and entry["ignore_merges"] == ignore_merges:
            return name
    raise ExportError(
        "the tokenizer's pre-tokenizer splits text unlike every llama.cpp pre-tokenizer lorafit knows "
        f"({', '.join(gguf_catalog()['pretokenizers'])}); a GGUF written with a guess would tokenize differently"
    )


def _end_of_turn(tokenizer: PreTrainedTokenizerBase, special_ids: set[int]) -> int | None:
    """The special token the chat template writes right after an assistant reply."""
    if not tokenizer.chat_template:
        return None
    marker = "lorafit-reply-marker"
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}], tokenize=False
        )
    except Exception:  # a template that needs tools or a system turn: no end-of-turn from it
        return None
    after = text.split(marker, 1)[1] if marker in text else ""
    ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
    return next((i for i in ids if i in special_ids), None)


def read_vocabulary(model_dir: Path, vocab_rows: int) -> Vocabulary:
    """Everything llama.cpp's tokenizer needs, from tokenizer.json and the tokenizer's behaviour."""
    import gguf
    from transformers import AutoTokenizer

    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise ExportError(f"{model_dir} has no tokenizer.json; lorafit writes GGUF from a fast tokenizer")
    data = json.loads(path.read_text())
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as error:
        raise ExportError(f"cannot load the tokenizer in {model_dir}: {str(error).splitlines()[0]}") from None
    backend = tokenizer.backend_tokenizer
    model = data.get("model") or {}
    added = {entry["id"]: entry for entry in data.get("added_tokens", [])}
    vocab: dict[str, int] = model.get("vocab") or {}
    if model.get("type") != "BPE" or not isinstance(vocab, dict):
        raise ExportError(f"a {model.get('type')} tokenizer; lorafit writes BPE and SentencePiece-BPE vocabularies")
    by_id = {index: token for token, index in vocab.items()} | {i: e["content"] for i, e in added.items()}
    size = max(vocab_rows, max(by_id) + 1)
    sentencepiece = bool(model.get("byte_fallback")) or any(t.startswith("▁") for t in list(vocab)[:2000])
    tokens, types = [], []
    T = gguf.TokenType
    for index in range(size):
        token = by_id.get(index)
        if token is None:
            tokens.append(f"[PAD{index}]")
            types.append(T.UNUSED)
        elif index in added:
            tokens.append(token)
            types.append(T.CONTROL if added[index].get("special") else T.USER_DEFINED)
        elif sentencepiece and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            tokens.append(token)
            types.append(T.BYTE)
        else:
            tokens.append(token)
            types.append(T.NORMAL)
    merges = [merge if isinstance(merge, str) else " ".join(merge) for merge in model.get("merges", [])]
    special = {
        key: value
        for key, value in {
            "bos": tokenizer.bos_token_id,
            "eos": tokenizer.eos_token_id,
            "pad": tokenizer.pad_token_id,
            "unk": tokenizer.unk_token_id,
        }.items()
        if isinstance(value, int) and 0 <= value < size
    }
    special_ids = {i for i, t in enumerate(types) if t == T.CONTROL}
    eot = _end_of_turn(tokenizer, special_ids)
    if eot is not None:
        special["eot"] = eot
    if "unk" in special and types[special["unk"]] in (T.CONTROL, T.NORMAL):
        types[special["unk"]] = T.UNKNOWN if sentencepiece else types[special["unk"]]
    probe = tokenizer("a", add_special_tokens=True)["input_ids"]
    vocabulary = Vocabulary(
        model="llama" if sentencepiece else "gpt2",
        pre=None,
        tokens=tokens,
        types=[int(t) for t in types],
        merges=merges,
        special=special,
        add_bos="bos" in special and bool(probe) and probe[0] == special["bos"],
        add_eos="eos" in special and bool(probe) and probe[-1] == special["eos"],
        chat_template=tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None,
    )
    if sentencepiece:
        rank = {merge.replace(" ", ""): -float(i) for i, merge in reversed(list(enumerate(merges)))}
        vocabulary.scores = [rank.get(token, 0.0) for token in tokens]
        vocabulary.merges = []
        first = tokenizer.convert_ids_to_tokens(tokenizer("hello", add_special_tokens=False)["input_ids"])
        vocabulary.add_space_prefix = bool(first) and first[0].startswith("▁")
    else:
        vocabulary.pre = identify_pretokenizer(backend, bool(model.get("ignore_merges", False)))
    return vocabulary
