"""`make bench-tokens`: how far the chat-template token estimate (catalog/chat_templates.toml, data/tokens.py's
TemplateEstimate) is from each family's real tokenizer and chat template, on generated chat rows.

The real tokenizers are the vocab-only GGUF files llama.cpp ships in its models/ folder (the tokenizer of the
checkpoint convert_hf_to_gguf_update.py names for each), loaded by transformers' GGUF reader; the real templates
are llama.cpp's copies of the checkpoints' chat templates (models/templates/, tests/test-chat-template.cpp).
`make bench-tokens` takes both from the llama-cpp-python sdist on PyPI. The real count goes through lorafit's
trainer path (data/chat_text.py), so "real" is what `lorafit train` would count with that tokenizer.

The rows: 2,000 conversations of 1 to 3 user/assistant exchanges, a third with a system message, their text cut
from the docstrings of the standard library (data/estimate.py's English corpus), seeded. Nothing is fitted on
them: every row is a check row. Writes catalog/token_accuracy.toml, which `lorafit plan --data` quotes; a family
whose tokenizer llama.cpp does not ship gets a line saying so instead of a figure.

    python bench/token_estimate.py --llama-cpp DIR [--rows 2000] [--no-write]
"""

from __future__ import annotations

import argparse
import codecs
import random
import re
import sys
from datetime import date
from pathlib import Path

from lorafit.data.estimate import english_corpus
from lorafit.data.formats import Messages
from lorafit.data.template_cost import TemplateCost, templates
from lorafit.data.tokens import TemplateEstimate, TokenizerCounter

ACCURACY = Path(__file__).resolve().parents[1] / "src" / "lorafit" / "catalog" / "token_accuracy.toml"
SEED = 0
# The checkpoint each vocab-only GGUF was made from (llama.cpp convert_hf_to_gguf_update.py, the same sdist)
VOCAB_SOURCE = {
    "ggml-vocab-llama-bpe.gguf": "Meta-Llama-3-8B's tokenizer",
    "ggml-vocab-qwen2.gguf": "Qwen1.5-7B's tokenizer, the BPE Qwen2.5 and Qwen3 kept",
    "ggml-vocab-phi-3.gguf": "Phi-3-mini-4k-instruct's tokenizer",
    "ggml-vocab-llama-spm.gguf": "Llama-2-7b-hf's tokenizer",
}
# Tokens a family's tokenizer adds over the checkpoint its GGUF was made from: Qwen3's reasoning markers are
# single added tokens (151667, 151668 of https://huggingface.co/Qwen/Qwen3-0.6B/blob/main/tokenizer_config.json)
ADDED_TOKENS = {"qwen3": ["<think>", "</think>"]}


def chat_rows(count: int, seed: int = SEED) -> list[Messages]:
    """Conversations of 1-3 exchanges, a third with a system message, of English text of 20-1,500 characters."""
    corpus = english_corpus()
    rng = random.Random(seed)

    def text(low: int, high: int) -> str:
        return rng.choice(corpus)[: rng.randint(low, high)].strip() or "yes"

    rows = []
    for _ in range(count):
        messages: Messages = []
        if rng.random() < 1 / 3:
            messages.append({"role": "system", "content": text(20, 200)})
        for _ in range(rng.randint(1, 3)):
            messages.append({"role": "user", "content": text(20, 600)})
            messages.append({"role": "assistant", "content": text(20, 1500)})
        rows.append(messages)
    return rows


def template_text(llama_cpp: Path, reference: str) -> str:
    """A template file of llama.cpp's models/ folder, or `tests/test-chat-template.cpp#NAME`: the template_str
    of that test case (a C string literal)."""
    if "#" not in reference:
        return (llama_cpp / "models" / reference).read_text(encoding="utf-8")
    file, name = reference.split("#")
    source = (llama_cpp / file).read_text(encoding="utf-8")
    match = re.search(
        r'\.name=\s*\*/\s*"' + re.escape(name) + r'",\s*/\*\s*\.template_str=\s*\*/\s*"((?:[^"\\]|\\.)*)"', source
    )
    if match is None:
        raise SystemExit(f"no test case {name!r} in {file}")
    text = codecs.decode(match.group(1), "unicode_escape")
    # llama.cpp's tests always ask for the generation prompt, and its copy of Llama 3's template writes it
    # unconditionally; the checkpoint's own template writes it only when asked (a training row never asks)
    prompt = "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    if text.endswith(prompt):
        text = text.removesuffix(prompt) + "{% if add_generation_prompt %}" + prompt + "{% endif %}"
    return text


def real_counter(llama_cpp: Path, cost: TemplateCost, loaded: dict[str, object]) -> TokenizerCounter:
    """The family's tokenizer (read from llama.cpp's GGUF by transformers) with its real chat template."""
    import copy

    from transformers import AutoTokenizer

    if cost.vocab not in loaded:
        loaded[cost.vocab] = AutoTokenizer.from_pretrained(llama_cpp / "models", gguf_file=cost.vocab)
    tokenizer = copy.deepcopy(loaded[cost.vocab])
    if cost.name in ADDED_TOKENS:
        tokenizer.add_special_tokens({"additional_special_tokens": ADDED_TOKENS[cost.name]})
    tokenizer.chat_template = template_text(llama_cpp, cost.template_file)
    return TokenizerCounter(tokenizer, cost.vocab)


def measure(rows: list[Messages], real: TokenizerCounter, cost: TemplateCost) -> dict[str, float | int]:
    import numpy as np

    counted = real.count(rows, "messages")
    errors = [c.error for c in counted if c.error]
    if errors:
        raise SystemExit(f"{cost.name}: the real template refuses a generated row: {errors[0]}")
    truth = np.array([c.total for c in counted], dtype=np.float64)
    guess = np.array([c.total for c in TemplateEstimate(cost).count(rows, "messages")], dtype=np.float64)
    # the template's own tokens, real (the row less its messages' text tokenized alone) against the table's
    text = iter(real.lengths([m["content"] for row in rows for m in row], raw_text=False))
    around = [c.total - sum(next(text) for _ in row) for c, row in zip(counted, rows, strict=True)]
    table = [cost.tokens([m["role"] for m in row]) for row in rows]
    return {
        "rows": len(rows),
        "total_error": round(float((guess.sum() - truth.sum()) / truth.sum()), 4),
        "longest_error": round(float((guess.max() - truth.max()) / truth.max()), 4),
        "p99_error": round(float((np.percentile(guess, 99) - np.percentile(truth, 99)) / np.percentile(truth, 99)), 4),
        "row_error": round(float(np.mean(np.abs(guess - truth) / truth)), 4),
        "template_tokens_error": round(float(np.mean(np.subtract(table, around))), 2),
    }


def toml_text(results: dict[str, dict], version: str) -> str:
    lines = [
        "# The chat-template token estimate's error against each family's real tokenizer and chat template",
        "# (catalog/chat_templates.toml; data/tokens.py TemplateEstimate), on generated chat rows (all check rows,",
        "# nothing fitted): total_error and longest_error are (estimate - real) / real of the dataset's total and",
        "# longest row, p99_error the same of its 99th percentile length, row_error the mean of |estimate - real| /",
        "# real over rows; template_tokens_error the mean of (table - real) tokens the template adds to a row (real:",
        "# the row's tokens less its messages' text tokenized alone).",
        f"# Written by `make bench-tokens` (bench/token_estimate.py) on {date.today():%Y-%m-%d},",
        f"# with llama.cpp's vocab-only GGUFs and templates of the llama-cpp-python {version} sdist; lorafit plan",
        "# quotes it.",
        "",
    ]
    for name, entry in results.items():
        lines.append(f'[family."{name}"]')
        for key, value in entry.items():
            lines.append(f'{key} = "{value}"' if isinstance(value, str) else f"{key} = {value}")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp's source folder (the sdist's)")
    parser.add_argument("--version", default="0.3.36", help="the llama-cpp-python sdist it came from")
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--no-write", action="store_true", help="print only; leave the catalog file as it is")
    args = parser.parse_args()
    rows = chat_rows(args.rows)
    results: dict[str, dict] = {}
    loaded: dict[str, object] = {}
    print(f"{'family':<10} {'tokenizer':<28} {'total':>7} {'longest':>8} {'p99':>7} {'row':>6} {'template':>9}")
    for name, cost in templates().items():
        if not cost.vocab:
            why = f"llama.cpp ships no vocabulary of {cost.template}'s tokenizer, and lorafit downloads no model"
            results[name] = {"rows": 0, "why": why}
            print(f"{name:<10} {'-':<28} not measured: {why}")
            continue
        entry = measure(rows, real_counter(args.llama_cpp, cost, loaded), cost)
        results[name] = {"tokenizer": f"{VOCAB_SOURCE.get(cost.vocab, cost.vocab)} (llama.cpp's {cost.vocab})"} | entry
        print(
            f"{name:<10} {cost.vocab:<28} {entry['total_error']:>+7.1%} {entry['longest_error']:>+8.1%} "
            f"{entry['p99_error']:>+7.1%} {entry['row_error']:>6.1%} {entry['template_tokens_error']:>+9.2f}"
        )
        sys.stdout.flush()
    if not args.no_write:
        ACCURACY.write_text(toml_text(results, args.version), encoding="utf-8")
        print(f"wrote {ACCURACY}")


if __name__ == "__main__":
    main()
