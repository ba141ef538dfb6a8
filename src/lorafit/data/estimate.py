"""How good is "~4 characters per token"? Measured against a real byte-level BPE, on English that every Python
installation ships: the docstrings of the standard library and the reference topics in `pydoc_data`.

`make bench-data` (or `python bench/data_stream.py --estimate-only`) trains the BPE and prints the figures;
`CHAR_ESTIMATE_ERROR` in tokens.py records the result, and tests/test_data_tokens.py reruns a smaller version.
"""

from __future__ import annotations

import ast
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lorafit.data.tokens import CharEstimate, TokenizerCounter

# Rows shorter than this many real tokens are left out of `long_row_error`: their length never sets the memory
# peak or the sequence length, and one token of rounding is a large share of them.
LONG_ROW_TOKENS = 64
SKIPPED_STDLIB_DIRS = ("site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3")


def english_corpus(max_files: int | None = None, min_chars: int = 20) -> list[str]:
    """Docstrings of the standard library (sorted by file, so the list is the same on every run) and the
    paragraphs of pydoc's reference topics, each one row. `max_files` keeps a test quick."""
    root = Path(sysconfig.get_paths()["stdlib"])
    rows: list[str] = []
    files = [
        path
        for path in sorted(root.rglob("*.py"))
        if not any(part in SKIPPED_STDLIB_DIRS for part in path.relative_to(root).parts)
    ]
    for path in files[:max_files]:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                docstring = ast.get_docstring(node)
                if docstring and len(docstring) >= min_chars:
                    rows.append(docstring)
    if max_files is None:
        rows.extend(_pydoc_topics(min_chars))
    return rows


def _pydoc_topics(min_chars: int) -> list[str]:
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip pydoc_data
        return []
    paragraphs = []
    for name in sorted(topics):
        paragraphs += [part.strip() for part in topics[name].split("\n\n") if len(part.strip()) >= min_chars]
    return paragraphs


def train_bpe(texts: Sequence[str], vocab_size: int) -> TokenizerCounter:
    """A byte-level BPE (the GPT-2 / Llama-3 kind) trained on `texts`, wrapped as transformers loads it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(texts, trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    return TokenizerCounter(wrapped, f"byte-level-bpe-{vocab_size}")


@dataclass(frozen=True)
class EstimateAccuracy:
    rows: int
    chars_per_token: float  # measured: characters / real tokens over all rows
    mean_error: float  # mean over rows of |estimate - real| / real
    p95_error: float
    long_row_error: float  # the mean over rows of at least LONG_ROW_TOKENS real tokens
    total_error: float  # (estimated total - real total) / real total, signed
    p99_error: float  # (estimated p99 length - real p99 length) / real p99, signed


def measure_char_estimate(texts: Sequence[str], counter: TokenizerCounter) -> EstimateAccuracy:
    """How far the character estimate is from `counter` on these texts."""
    import numpy as np

    texts = [text for text in texts if text.strip()]
    real = np.array(counter.lengths(texts, raw_text=False), dtype=np.float64)
    estimate = CharEstimate()
    guessed = np.array([estimate.tokens(text) for text in texts], dtype=np.float64)
    chars = np.array([len(text) for text in texts], dtype=np.float64)
    keep = real > 0
    real, guessed, chars = real[keep], guessed[keep], chars[keep]
    errors = np.abs(guessed - real) / real
    long_rows = real >= LONG_ROW_TOKENS
    return EstimateAccuracy(
        rows=int(keep.sum()),
        chars_per_token=float(chars.sum() / real.sum()),
        mean_error=float(errors.mean()),
        p95_error=float(np.percentile(errors, 95)),
        long_row_error=float(errors[long_rows].mean()) if long_rows.any() else float("nan"),
        total_error=float((guessed.sum() - real.sum()) / real.sum()),
        p99_error=float((np.percentile(guessed, 99) - np.percentile(real, 99)) / np.percentile(real, 99)),
    )


def measure(vocab_size: int = 32000, max_files: int | None = None) -> EstimateAccuracy:
    """Train on the even rows of the corpus, measure on the odd ones."""
    corpus = english_corpus(max_files)
    return measure_char_estimate(corpus[1::2], train_bpe(corpus[0::2], vocab_size))
