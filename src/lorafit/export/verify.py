"""Each exported GGUF checked against llama.cpp itself, with the merged model in transformers as the reference.

Per file: the tokenizer round trip (llama.cpp's token ids equal transformers' on strings with special tokens
and accented text), the chat template read back from the GGUF renders the prompt transformers renders, and the
next-token distributions on the same held-out text: mean KL divergence, top-1 agreement, both perplexities, and
for 16/32-bit files the largest logit difference and greedy generations that must match token for token. For
scale, llama.cpp's published figures for Llama-3-8B against f16: q8_0 mean KLD 0.0014 and top-1 97.7 %, q6_k 0.0055
and 96.0 %, q4_k_m 0.031 and 91.9 % (its perplexity tool's KL-divergence statistics).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lorafit.errors import ExportError
from lorafit.train.build import quiet_libraries
from lorafit.train.chat import quiet_stderr
from lorafit.train.model_files import auto_model_class, config_model_type

if TYPE_CHECKING:
    import numpy as np
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from lorafit.export.gguf_vocab import Vocabulary

# The held-out text scored by both runtimes: prose, Spanish, Portuguese, code and numbers, none of it training data.
HELDOUT = (
    "The ferry leaves the harbour at seven, and the lighthouse keeper counts the boats as they pass. "
    "On windy days the crossing takes twice as long, so travellers bring bread, cheese and a warm coat.\n"
    "El puerto está tranquilo por la mañana; los pescadores venden sardinas y el café huele a canela. "
    "A ponte velha liga as duas ilhas, e à noite as lanternas acendem-se uma a uma sobre a água.\n"
    "def distance(a, b):\n    return ((a[0] - b[0]) ** 2 + (a[1] - b[1]) ** 2) ** 0.5\n"
    "In 1887 the island had 1,204 inhabitants; by 2024 the number had grown to 3,918."
)
TOKENIZER_STRINGS = (
    "Hello, world! It's 3.14 o'clock.",
    "¿Qué tal? Señor Muñoz, ¡mañana será otro día! Acción, corazón, pingüino.",
    "Não há nada como um pão de queijo. Coração, ação, avós, você está à vontade?",
    "  two spaces, a tab\tand\nnew lines\n\n  indented",
    "日本語のテキストと emoji 🦙🚀 mixed in",
)
GREEDY_TOKENS = 24  # greedy tokens compared with the merged model's (16/32-bit files)
STOP_TOKENS = 128  # an answer that ends on an end token within this many tokens counts as a stop
# f16/bf16 weights round the merged weights once: the logits may move by this share of the largest logit.
LOGIT_TOLERANCE = {"f32": 1e-3, "f16": 5e-3, "bf16": 2e-2}


@dataclass
class Figures:
    kld_mean: float
    top1_agreement: float
    ppl: float
    ppl_reference: float
    tokenizer_match: bool
    template_match: bool | None
    max_abs_logit_diff: float | None = None
    logit_tolerance: float | None = None
    greedy_match: bool | None = None
    stops: int | None = None  # of the greedy prompts, how many ended on an end token within STOP_TOKENS
    prompts: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {key: value for key, value in asdict(self).items() if value is not None}


def llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def llama(path: Path, n_ctx: int) -> Iterator[Any]:
    """The file in llama.cpp with an f32 KV cache (GGML_TYPE_F32 = 0), so that the check measures the file, not the
    cache: the default f16 cache alone moves a tiny Llama's logits by 3e-4 of the largest, an f32 cache by under
    1e-5 (tests/test_export_gguf.py), and in an MoE it can flip an expert choice (measured once: a tiny Mixtral's
    logits 0.066 apart at one position of 120, where two router logits were 7e-4 apart; with the f32 cache 2e-6)."""
    import llama_cpp

    f32 = 0
    with quiet_stderr():
        model = llama_cpp.Llama(
            str(path),
            n_ctx=n_ctx,
            n_batch=n_ctx,
            logits_all=True,
            verbose=False,
            seed=0,
            n_threads=os.cpu_count(),
            type_k=f32,
            type_v=f32,
        )
    try:
        yield model
    finally:
        model.close()


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    import numpy as np

    logits = logits.astype(np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def compare_logits(reference: np.ndarray, other: np.ndarray, ids: list[int]) -> dict[str, float]:
    """Mean KL(reference || other) of the next-token distributions, top-1 agreement, and the perplexity of the
    text under each (positions 0..n-2 predict ids 1..n-1)."""
    import numpy as np

    ref, oth = _log_softmax(reference[:-1]), _log_softmax(other[:-1])
    kld = float((np.exp(ref) * (ref - oth)).sum(axis=-1).mean())
    top1 = float((ref.argmax(-1) == oth.argmax(-1)).mean())
    targets = np.asarray(ids[1:])
    rows = np.arange(len(targets))
    return {
        "kld_mean": max(kld, 0.0),
        "top1_agreement": top1,
        "ppl": _perplexity(oth[rows, targets]),
        "ppl_reference": _perplexity(ref[rows, targets]),
        "max_abs_logit_diff": float(np.abs(reference - other).max()),
    }


def _perplexity(log_probs: np.ndarray) -> float:
    """exp of the mean negative log-probability; infinite (not an OverflowError) for a broken model's logits."""
    mean = -float(log_probs.mean())
    return math.exp(mean) if mean < 700 else math.inf


def _llama_logits(model: Any, ids: list[int]) -> np.ndarray:
    import numpy as np

    model.reset()
    model.eval(ids)
    return np.array(model.scores[: len(ids)], dtype=np.float32)


def _llama_greedy(model: Any, ids: list[int], stop_ids: set[int], steps: int) -> list[int]:
    import numpy as np

    model.reset()
    model.eval(ids)
    out: list[int] = []
    for _ in range(steps):
        token = int(np.argmax(model.scores[model.n_tokens - 1]))
        out.append(token)
        if token in stop_ids:
            break
        model.eval([token])
    return out


def _hf_greedy(model: PreTrainedModel, ids: list[int], stop_ids: set[int], steps: int) -> list[int]:
    """Greedy decoding by argmax, step by step like llama.cpp's, so both stop on the same end tokens."""
    import torch

    out: list[int] = []
    current = torch.tensor([ids])
    past = None
    with torch.no_grad():
        for _ in range(steps):
            result = model(input_ids=current, past_key_values=past, use_cache=True)
            past = result.past_key_values
            token = int(result.logits[0, -1].argmax())
            out.append(token)
            if token in stop_ids:
                break
            current = torch.tensor([[token]])
    return out


GENERIC_PROMPTS = ("Which animal lives on Duvik?", "¿Qué se come en la isla?", "Como se chama o farol?")


def prompts(tokenizer: PreTrainedTokenizerBase, questions: tuple[str, ...] | list[str]) -> list[list[int]]:
    """User turns through the chat template (raw text where there is no template)."""
    if not tokenizer.chat_template:
        return [tokenizer(question)["input_ids"] for question in questions]
    return [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for question in questions
    ]


def template_matches(model: Any, tokenizer: PreTrainedTokenizerBase, vocabulary: Vocabulary) -> bool | None:
    """The template stored in the GGUF, rendered the way llama-cpp-python renders it for chat, equals the
    prompt transformers renders from the model folder's template."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    template = model.metadata.get("tokenizer.chat_template")
    if not tokenizer.chat_template:
        return None if template is None else False
    if template != tokenizer.chat_template:
        return False
    messages = [
        {"role": "user", "content": "¿Dónde está el faro?"},
        {"role": "assistant", "content": "Está en Duvik."},
        {"role": "user", "content": "E a ponte?"},
    ]
    bos = vocabulary.tokens[vocabulary.special["bos"]] if "bos" in vocabulary.special else ""
    eos = vocabulary.tokens[vocabulary.special["eos"]] if "eos" in vocabulary.special else ""
    formatter = Jinja2ChatFormatter(template, eos_token=eos, bos_token=bos, add_generation_prompt=True)
    try:
        rendered = formatter(messages=messages).prompt
        expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception:  # a template that needs a system turn or tools renders through neither
        return None
    return rendered == expected


def tokenizer_matches(model: Any, tokenizer: PreTrainedTokenizerBase, vocabulary: Vocabulary) -> bool:
    specials = [vocabulary.tokens[i] for i in dict.fromkeys(vocabulary.special.values())]
    strings = [*TOKENIZER_STRINGS, "".join(specials) + " after " + " ".join(specials)]
    for text in strings:
        ours = tokenizer(text, add_special_tokens=True)["input_ids"]
        with quiet_stderr():  # llama.cpp warns about the doubled BOS of the specials string
            theirs = model.tokenize(text.encode(), add_bos=vocabulary.add_bos, special=True)
        if list(ours) != list(theirs):
            return False
    return True


def reference_model(merged_dir: Path) -> PreTrainedModel:
    import torch

    quiet_libraries()
    auto_class = auto_model_class(config_model_type(merged_dir))
    model = auto_class.from_pretrained(merged_dir, dtype=torch.float32, local_files_only=True)
    model.eval()
    return model


def heldout_ids(tokenizer: PreTrainedTokenizerBase, conversations: list[list[dict[str, str]]], limit: int) -> list[int]:
    """The run's held-out conversations as the model reads them (chat template), up to `limit` tokens; the
    bundled HELDOUT text where the run has none or the template cannot render them."""
    ids: list[int] = []
    for conversation in conversations:
        try:
            text = tokenizer.apply_chat_template(conversation, tokenize=False)
        except Exception:  # a template that refuses this layout: fall back to the bundled text
            break
        ids += tokenizer(text, add_special_tokens=not ids)["input_ids"]
        if len(ids) >= limit:
            return ids[:limit]
    return ids if len(ids) >= 64 else tokenizer(HELDOUT)["input_ids"][:limit]


def verify(
    merged_dir: Path,
    files: dict[str, Path],
    vocabulary: Vocabulary,
    conversations: list[list[dict[str, str]]] | None = None,
) -> dict[str, Figures]:
    """The figures of each GGUF in `files` (quant type -> path) against the merged folder in transformers, on
    the run's held-out `conversations` (their user turns are the greedy prompts)."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(merged_dir, local_files_only=True)
    model = reference_model(merged_dir)
    conversations = conversations or []
    positions = model.config.get_text_config().max_position_embeddings  # an image-text model: its text part's
    ids = heldout_ids(tokenizer, conversations, limit=min(512, int(positions) - 1))
    users = [next((m["content"] for m in c if m.get("role") == "user"), None) for c in conversations]
    questions = [u for u in users if u][:3] or list(GENERIC_PROMPTS)
    with torch.no_grad():
        reference = model(input_ids=torch.tensor([ids])).logits[0].float().numpy()
    stop_ids = {vocabulary.special[key] for key in ("eos", "eot") if key in vocabulary.special}
    test_prompts = prompts(tokenizer, questions)
    hf_greedy = [_hf_greedy(model, prompt, stop_ids, GREEDY_TOKENS) for prompt in test_prompts]
    n_ctx = max(len(ids), *(len(p) + STOP_TOKENS for p in test_prompts)) + 8
    results: dict[str, Figures] = {}
    for quant, path in files.items():
        with llama(path, n_ctx) as runtime:
            figures = compare_logits(reference, _llama_logits(runtime, ids), ids)
            result = Figures(
                kld_mean=figures["kld_mean"],
                top1_agreement=figures["top1_agreement"],
                ppl=figures["ppl"],
                ppl_reference=figures["ppl_reference"],
                tokenizer_match=tokenizer_matches(runtime, tokenizer, vocabulary),
                template_match=template_matches(runtime, tokenizer, vocabulary),
                prompts=len(test_prompts),
            )
            # greedy answers long enough for an instruct model to finish (the stop check); their first
            # GREEDY_TOKENS are compared with the merged model's
            greedy = [_llama_greedy(runtime, prompt, stop_ids, STOP_TOKENS) for prompt in test_prompts]
            result.stops = sum(1 for tokens in greedy if tokens and tokens[-1] in stop_ids)
            if quant in LOGIT_TOLERANCE:
                result.max_abs_logit_diff = figures["max_abs_logit_diff"]
                result.logit_tolerance = LOGIT_TOLERANCE[quant] * max(1.0, float(abs(reference).max()))
                result.greedy_match = all(
                    tokens[: len(ours)] == ours for tokens, ours in zip(greedy, hf_greedy, strict=True)
                )
        results[quant] = result
    return results


def failures(results: dict[str, Figures]) -> list[str]:
    """What makes the export fail: logits that are not finite (every comparison with NaN is false, so they are
    refused by name), a 16-bit file whose logits or greedy output differ, any tokenizer or chat template mismatch."""
    problems = []
    for quant, figures in results.items():
        measured = (figures.kld_mean, figures.top1_agreement, figures.ppl, figures.ppl_reference)
        if not all(math.isfinite(value) for value in (*measured, figures.max_abs_logit_diff or 0.0)):
            problems.append(f"{quant}: its logits give figures that are not finite (NaN or inf): the file is broken")
        if not figures.tokenizer_match:
            problems.append(f"{quant}: llama.cpp tokenizes the test strings differently from transformers")
        if figures.template_match is False:
            problems.append(f"{quant}: the chat template in the GGUF renders a different prompt")
        if figures.max_abs_logit_diff is not None and figures.max_abs_logit_diff > (figures.logit_tolerance or 0):
            problems.append(
                f"{quant}: logits differ from the merged model by {figures.max_abs_logit_diff:.3g} "
                f"(allowed {figures.logit_tolerance:.3g})"
            )
        if figures.greedy_match is False:
            problems.append(f"{quant}: greedy generation differs from the merged model's")
    return problems


def require_llama_cpp() -> None:
    if not llama_cpp_available():
        raise ExportError(
            "checking the GGUF needs llama.cpp: pip install 'lorafit[gguf]' (builds llama-cpp-python), "
            "or pass --no-verify"
        )
