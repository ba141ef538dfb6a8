"""`lorafit train --demo`: a tiny Llama-style model built here, fine-tuned with QLoRA on bundled data, on the CPU.

Nothing is downloaded. The tokenizer is a byte-level BPE trained with `tokenizers` on the bundled guide to the
(made up) Lantern Isles; the model is a catalog Llama shrunk to 2 layers of width 128 with random weights. The
task is a small fact table asked in five phrasings (demo/make_instructions.py): one phrasing of every fact is
held out, so the check is honest - the held-out questions are worded in a way the model never saw for that
fact. A random model cannot know the facts; after fine-tuning the held-out eval loss falls by more than
`REQUIRED_DROP` and the greedy answer takes the trained format, mostly with the right value.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from rich.console import Console
from rich.table import Table

from lorafit.files import fsync_dir, ordinary_mode, write_atomic
from lorafit.models import ModelSpec, catalog
from lorafit.schema import Plan, Settings
from lorafit.train import launch, model_files, recipe
from lorafit.train.build import hf_config
from lorafit.train.chat import answer
from lorafit.train.config import TrainConfig, validate
from lorafit.train.distributed import Processes
from lorafit.train.examples import IGNORE_INDEX, Encoded
from lorafit.train.recipe import RunResult

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

DEMO_OUTPUT = "runs/demo"
REQUIRED_DROP = 0.5  # the held-out eval loss must fall by at least half
SPECIAL_TOKENS = ["<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{%- for message in messages -%}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)
# A pretrained LM head has large weights; a random one at the usual std 0.02 caps the logits near +-2.5 at
# width 128, too flat for any token to become likely. This std lets the adapters make an answer confident.
LM_HEAD_STD = 0.1


def demo_file(name: str) -> Path:
    return Path(str(resources.files("lorafit").joinpath("demo", name)))


def tiny_spec(
    vocab_size: int,
    hidden_size: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    max_positions: int = 512,
) -> ModelSpec:
    """The catalog's Llama-3.2-1B shrunk, as litgpt's Config.from_name(..., n_layer=2) shrinks a preset."""
    return catalog()["llama-3.2-1b"].scaled(
        name="lantern-tiny",
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden_size // heads,
        vocab_size=vocab_size,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
    )


def build_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerBase:
    """A byte-level BPE trained on `texts`, with the demo's chat template and special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|end|>", pad_token="<|pad|>", model_max_length=512
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_model(
    model_dir: Path,
    tokenizer: PreTrainedTokenizerBase,
    spec: ModelSpec,
    seed: int = 0,
    lm_head_std: float = LM_HEAD_STD,
    dtype: str = "float32",
) -> None:
    """Random weights from a fixed seed, saved with the tokenizer as a Hugging Face model directory.

    `dtype` ("bfloat16", "float16") builds and saves in that type directly, so a full-size model for a benchmark
    never exists in fp32 next to its 16-bit copy."""
    import torch
    from transformers.utils import logging as hf_logging

    attn = "sdpa" if "sdpa" in spec.attention_implementations else spec.attention_implementations[0]  # gpt-oss
    config = hf_config(spec, Settings(method="full", quant="none", precision="fp32", attn=attn))
    for layer in {id(config): config, id(config.get_text_config()): config.get_text_config()}.values():
        layer.pad_token_id = tokenizer.pad_token_id  # an image-text model's text_config as well
        layer.eos_token_id = tokenizer.eos_token_id
        layer.bos_token_id = None
    torch.manual_seed(seed)
    model = model_files.auto_model_class(config.model_type).from_config(config, dtype=getattr(torch, dtype))
    torch.nn.init.normal_(model.lm_head.weight, std=lm_head_std)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model_dir.mkdir(parents=True, exist_ok=True)
    hf_logging.disable_progress_bar()
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)


def corpus() -> list[str]:
    """What the demo tokenizer learns from: the guide to the isles and the text of the questions and answers."""
    texts = [demo_file("lantern_isles.md").read_text()]
    for name in ("instructions.jsonl", "heldout.jsonl"):
        for line in demo_file(name).read_text().splitlines():
            texts += [message["content"] for message in json.loads(line)["messages"]]
    return texts


BASE_COMPLETE = "lorafit-demo-base.json"  # written last: a base folder without it was cut short


def build_demo_base(model_dir: Path, hidden_size: int = 128) -> None:
    """The demo's base model, built into a staging folder and renamed into place once complete, so that a
    kill or a full disk never leaves a half-written base that every later run would trip over. A base that
    an earlier lorafit left without the marker is rebuilt: it is made from a fixed seed, so it comes out the
    same. `hidden_size` 256 gives rows of whole K-quant blocks (the export tests)."""
    model_dir = Path(model_dir)
    if (model_dir / BASE_COMPLETE).is_file():
        return
    staging = model_dir.with_name(f".{model_dir.name}.building")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        tokenizer = build_tokenizer(corpus(), vocab_size=1024)
        build_model(staging, tokenizer, tiny_spec(len(tokenizer), hidden_size=hidden_size))
        write_atomic(staging / BASE_COMPLETE, json.dumps({"built_by": "lorafit train --demo"}))
        ordinary_mode(staging)  # safetensors writes 0600; the base is shared with the run as its other files are
        shutil.rmtree(model_dir, ignore_errors=True)  # an incomplete base, from before the marker or cut short
        staging.replace(model_dir)
        fsync_dir(model_dir.parent)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gives the space of a failed build back


def demo_config(overrides: dict[str, Any]) -> TrainConfig:
    """The bundled demo/train.yaml with the demo's model and data, and the user's flags on top."""
    data = yaml.safe_load(demo_file("train.yaml").read_text())
    output_dir = Path(overrides.get("output_dir") or data.get("output_dir") or DEMO_OUTPUT)
    data |= {
        "model": str(output_dir / "base-model"),
        "data": str(demo_file("instructions.jsonl")),
        "eval_data": str(demo_file("heldout.jsonl")),
        "eval_split": 0,
    }
    n_gpus = int(overrides.get("n_gpus") or 1)
    if n_gpus > 1 and "micro_batch" not in overrides:  # the same effective batch, shared by the processes
        per_process = data["batch_size"] // data["grad_accum"]
        if per_process % n_gpus == 0:
            data["micro_batch"] = per_process // n_gpus
        else:
            data.pop("micro_batch")
    return validate(data | overrides | {"output_dir": str(output_dir)}, "the demo config", from_flags=overrides)


# --- before / after -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Comparison:
    eval_before: float
    eval_after: float
    exact_before: int
    exact_after: int
    rows: int
    prompt: str
    reference: str
    answer_before: str
    answer_after: str

    @property
    def drop(self) -> float:
        return 1 - self.eval_after / self.eval_before

    @property
    def learned(self) -> bool:
        return self.drop >= REQUIRED_DROP and self.exact_after > self.exact_before


def exact_answers(model: PreTrainedModel, encoded: Encoded, pad_id: int, batch: int = 32) -> int:
    """Held-out rows whose every answer token is the model's top choice given the tokens before it: exactly
    the rows greedy decoding answers word for word, found with one forward pass per batch."""
    import torch

    correct = 0
    model.eval()
    for start in range(0, len(encoded.input_ids), batch):
        rows = encoded.input_ids[start : start + batch]
        labels = encoded.labels[start : start + batch]
        width = max(len(row) for row in rows)
        ids = torch.tensor([row + [pad_id] * (width - len(row)) for row in rows], device=model.device)
        mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows], device=model.device)
        target = torch.tensor([row + [IGNORE_INDEX] * (width - len(row)) for row in labels], device=model.device)
        with torch.no_grad():
            predicted = model(input_ids=ids, attention_mask=mask).logits.argmax(-1)
        hit = (predicted[:, :-1] == target[:, 1:]) | (target[:, 1:] == IGNORE_INDEX)
        correct += int(hit.all(dim=1).sum())
    return correct


def compare(result: RunResult) -> Comparison:
    """Base (adapter off) against fine-tuned (adapter on), on the held-out rows the run evaluated."""
    model, tokenizer = result.model, result.tokenizer
    first = result.eval_conversations[0]
    prompt, reference = first[0]["content"], first[-1]["content"]
    with model.disable_adapter():
        exact_before = exact_answers(model, result.eval_examples, tokenizer.pad_token_id)
        answer_before = answer(model, tokenizer, prompt, max_new_tokens=16)
    exact_after = exact_answers(model, result.eval_examples, tokenizer.pad_token_id)
    answer_after = answer(model, tokenizer, prompt, max_new_tokens=16)
    return Comparison(
        result.eval_before or float("nan"),
        result.eval_after or float("nan"),
        exact_before,
        exact_after,
        len(result.eval_examples.input_ids),
        prompt,
        reference,
        answer_before,
        answer_after,
    )


def show(comparison: Comparison, console: Console) -> None:
    table = Table(title="held-out questions (phrasings the model never saw for these facts)", header_style="bold")
    table.add_column("")
    table.add_column("before (base model)")
    table.add_column("after (QLoRA adapter)")
    table.add_row("eval loss", f"{comparison.eval_before:.3f}", f"{comparison.eval_after:.3f}")
    table.add_row(
        "answered exactly",
        f"{comparison.exact_before}/{comparison.rows}",
        f"{comparison.exact_after}/{comparison.rows}",
    )
    table.add_row(f"{comparison.prompt!r}", repr(comparison.answer_before), repr(comparison.answer_after))
    console.print(table)
    console.print(f"reference answer: {comparison.reference!r}")
    verdict = "[green]learned[/green]" if comparison.learned else "[red]did not learn[/red]"
    console.print(
        f"{verdict}: held-out eval loss fell by {comparison.drop:.1%} (the demo requires at least "
        f"{REQUIRED_DROP:.0%}) and exact answers went from {comparison.exact_before} to "
        f"{comparison.exact_after}"
    )


def run_demo(
    overrides: dict[str, Any], *, resume: bool, overwrite: bool, console: Console, dry_run: bool = False
) -> bool:
    """Train the demo and show what changed; False if it did not learn by the stated margin."""
    config = demo_config(overrides)
    console.rule("[bold]lorafit demo[/bold]: QLoRA on a tiny model, on the CPU")
    if launch.needs_launch(config):  # several processes, each running `train_demo` (`worker`)
        code = launch.launch(
            config,
            resume=resume,
            overwrite=overwrite,
            dry_run=dry_run,
            console=console,
            build_model=build_demo_base,
            demo=True,
        )
        if code == 130:
            raise KeyboardInterrupt
        return code == 0
    return train_demo(config, resume=resume, overwrite=overwrite, dry_run=dry_run, console=console)


def train_demo(
    config: TrainConfig,
    *,
    resume: bool,
    overwrite: bool,
    console: Console,
    dry_run: bool = False,
    processes: Processes | None = None,
    plan: Plan | None = None,
) -> bool:
    """The demo's run and its before / after comparison (by rank 0 alone, when several processes train it)."""
    result = recipe.run(
        config,
        resume=resume,
        overwrite=overwrite,
        dry_run=dry_run,
        console=console,
        build_model=build_demo_base,
        processes=processes,
        plan=plan,
    )
    if processes is not None and not processes.is_main:
        return True
    if result is None:  # a dry run, or the finished demo: nothing was trained, so there is nothing to compare
        if not dry_run:
            console.print(f'try it: lorafit chat {config.output_dir} --prompt "Which animal lives on Duvik?"')
        return True
    comparison = compare(result)
    show(comparison, console)
    console.print(f'try it: lorafit chat {config.output_dir} --prompt "Which animal lives on Duvik?"')
    return comparison.learned
