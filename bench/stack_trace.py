"""`make bench-stacks`: each stack's own training step, traced, against lorafit's estimate under `--stack NAME`.

`--stack trl` and `--stack peft-kbit` (src/lorafit/catalog/stacks.toml) describe other trainers' steps as
`memory.Runtime` facts. This runs each of those trainers itself - its own set-up and its own `train()`:

- trl: TRL's `SFTTrainer` with a peft `LoraConfig`, on a 4-bit bitsandbytes base (QLoRA) or a bf16 one (LoRA),
  SFTConfig's defaults (bf16, gradient checkpointing, adamw_torch_fused, the fused LM head of `add_fused_lm_head`);
- peft-kbit: transformers' `Trainer` after peft's `prepare_model_for_kbit_training` and `get_peft_model`, with
  `bf16=True` and gradient checkpointing (the recipe of the peft and transformers QLoRA guides);
- peft-kbit loop: the same preparation in the peft QLoRA scripts' plain PyTorch loop - non-reentrant checkpointing,
  `enable_input_require_grads`, `torch.optim.AdamW`, no autocast - against `--no-autocast --no-fused-optimizer`;

two optimizer steps of `Trainer.train()`, under lorafit's LiveTensorTracker, and prints the traced peak of live
tensor bytes beside `memory.estimate(spec, settings, runtime=memory.stack_runtime(settings))`.

Two kinds of case. `fake`: the real model shapes (Llama-2-7B, Llama-3.1-8B) on fake tensors (FakeTensorMode: shapes,
dtypes and storages, no data), every layer, the GPU's kernel choices stood in (dropout's bool mask, and for TRL's
fused head the Triton kernels and the fp32-output matmul it runs on CUDA, which allocate nothing). `cpu`: small
random-init Llama models, real tensors and real bitsandbytes 4-bit on this machine's CPU, the CPU's kernels
(a float dropout mask, TRL's torch fall-back for its Triton kernels), against `Runtime(device="cpu")`.

Fake tensors hold no values, so what eager code reads from the data is answered the way it comes out on the
trace's batches (`DataStandIns`): every label is scored (no padding), `.item()` is 1 and a condition is true.

    python bench/stack_trace.py [--stacks trl,peft-kbit] [--kind fake,cpu] [--cases PATTERN] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import json
import sys
import tempfile
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import liger_standins  # noqa: E402
from lorafit import memory  # noqa: E402
from lorafit.memory import GIB  # noqa: E402
from lorafit.models import ModelSpec, resolve  # noqa: E402
from lorafit.schema import Settings  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "stacks.json"
STEPS = 2  # the second step is the first with optimizer states


@dataclass(frozen=True)
class Case:
    stack: Literal["trl", "peft-kbit"]
    kind: Literal["fake", "cpu"]
    model: str  # a catalog name, or a label for a small shape
    spec: ModelSpec
    settings: Settings
    # peft-kbit's classic recipe in a plain PyTorch loop: prepare_model_for_kbit_training with non-reentrant
    # checkpointing, enable_input_require_grads, get_peft_model, torch.optim.AdamW, no autocast
    loop: bool = False

    @property
    def label(self) -> str:
        return f"{self.stack} loop" if self.loop else self.stack

    @property
    def name(self) -> str:
        s = self.settings
        return (
            f"{self.label} {self.kind} {self.model} {s.method} b{s.micro_batch}x{s.seq_len}"
            f" {'ckpt' if s.grad_ckpt else 'no-ckpt'}"
            + (" liger" if s.liger else "")
            + (" emb" if s.train_embeddings else "")
        )

    @property
    def estimate_settings(self) -> Settings:
        """The settings a user of this step passes: the plain loop runs without autocast, foreach AdamW."""
        if self.loop:
            return self.settings.model_copy(update={"stack": self.stack, "autocast": False, "fused_optimizer": False})
        return self.settings.model_copy(update={"stack": self.stack})

    @property
    def device(self) -> Literal["cuda", "cpu"]:
        return "cuda" if self.kind == "fake" else "cpu"


def small(hidden: int, layers: int, vocab: int, inter: int, heads: int = 4, kv_heads: int = 2) -> ModelSpec:
    """A random Llama-style shape for a real CPU step."""
    return resolve("llama-2-7b").scaled(
        hidden_size=hidden,
        num_hidden_layers=layers,
        vocab_size=vocab,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        intermediate_size=inter,
    )


def settings(method: str, micro_batch: int, seq_len: int, grad_ckpt: bool, liger: bool | None = None) -> Settings:
    quant = "nf4" if method == "qlora" else "none"
    return Settings(
        method=method, quant=quant, micro_batch=micro_batch, seq_len=seq_len, grad_ckpt=grad_ckpt, liger=liger
    )


def cases() -> list[Case]:
    found = []
    for stack in ("trl", "peft-kbit"):
        for name, (micro_batch, seq_len) in (("llama-2-7b", (1, 2048)), ("llama-3.1-8b", (4, 512))):
            spec = resolve(name)
            for method in ("qlora", "lora"):
                for ckpt in (True, False):
                    found.append(Case(stack, "fake", name, spec, settings(method, micro_batch, seq_len, ckpt)))
        found.append(Case(stack, "fake", "llama-3.1-8b", resolve("llama-3.1-8b"), settings("qlora", 1, 1024, True)))
        for label, spec, (micro_batch, seq_len) in (
            ("small-a", small(256, 2, 4096, 704), (2, 256)),
            ("small-b", small(320, 3, 32768, 896, heads=5, kv_heads=5), (1, 384)),
            ("small-c", small(512, 4, 2048, 1408, heads=8, kv_heads=2), (1, 1024)),
        ):
            for method in ("qlora", "lora"):
                for ckpt in (True, False):
                    found.append(Case(stack, "cpu", label, spec, settings(method, micro_batch, seq_len, ckpt)))
    found += [replace(case, settings=case.settings.model_copy(update={"liger": True})) for case in liger_cases(found)]
    # train_embeddings (modules_to_save: embed_tokens, lm_head) at fine-tune-llms-in-2025's step (TRL QLoRA 1 x 1024)
    found += [
        replace(case, settings=case.settings.model_copy(update={"train_embeddings": True}))
        for case in found
        if case.kind == "fake" and case.settings.micro_batch * case.settings.seq_len == 1024 and not case.settings.liger
    ]
    for name, (micro_batch, seq_len) in (("llama-2-7b", (1, 2048)), ("llama-3.1-8b", (4, 512))):
        for ckpt in (True, False):
            found.append(
                Case("peft-kbit", "fake", name, resolve(name), settings("qlora", micro_batch, seq_len, ckpt), True)
            )
    for ckpt in (True, False):
        spec = small(256, 2, 4096, 704)
        found.append(Case("peft-kbit", "cpu", "small-a", spec, settings("qlora", 2, 256, ckpt), True))
    return found


def liger_cases(found: list[Case]) -> list[Case]:
    """`--liger`: TRL's step with Liger's layer kernels, the Trainer's (peft-kbit) with its fused linear
    cross-entropy too, stood in by torch (bench/liger_standins.py), on the same shapes as the cases without them,
    the 1 x 1024 checkpointed fake one aside."""
    return [
        case
        for case in found
        if not (case.kind == "fake" and case.settings.micro_batch * case.settings.seq_len == 1024)
    ]


# --- what fake tensors cannot answer ------------------------------------------------------------------------
def data_standins() -> Any:
    """A TorchDispatchMode answering the ops that read values: `.item()` (and with it every `if tensor:`) is 1
    or true, and a boolean mask index selects every element - the trace's labels are all scored."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten

    def long_indices(mask: torch.Tensor) -> list[torch.Tensor]:
        """What `mask.nonzero().unbind(1)` gives for an all-true mask: one index tensor per masked dimension."""
        grids = torch.meshgrid(*(torch.arange(size) for size in mask.shape), indexing="ij")
        return [grid.reshape(-1) for grid in grids]

    def expand(indices: list[Any]) -> list[Any]:
        out = []
        for index in indices:
            if isinstance(index, torch.Tensor) and index.dtype == torch.bool:
                out += long_indices(index)
            else:
                out.append(index)
        return out

    class DataStandIns(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
            kwargs = kwargs or {}
            if func is aten._local_scalar_dense.default:
                dtype = args[0].dtype
                return True if dtype == torch.bool else 1.0 if dtype.is_floating_point else 1
            if func in (
                aten.index.Tensor,
                aten.index_put.default,
                aten.index_put_.default,
                aten._index_put_impl_.default,
            ):
                args = (args[0], expand(list(args[1])), *args[2:])
            return func(*args, **kwargs)

    return DataStandIns()


@contextlib.contextmanager
def masks_read_from_data() -> Iterator[None]:
    """transformers drops an all-ones attention mask (and skips the packed-sequence mask) after looking at its
    values, but it does not look at a fake tensor: it counts one as 'tracing' and builds the 4-D mask, which
    also turns off grouped-query attention in SDPA. Let it look (DataStandIns answers), as eager code does."""
    from transformers import masking_utils

    is_tracing = masking_utils.is_tracing
    masking_utils.is_tracing = lambda tensor=None: is_tracing(None)
    try:
        yield
    finally:
        masking_utils.is_tracing = is_tracing


@contextlib.contextmanager
def cuda_fused_head() -> Iterator[None]:
    """TRL's fused LM head as it runs on CUDA: `_use_triton` is true there, so the valid positions are gathered
    (`hidden_states[mask]`) and every logits tile is folded and turned into its gradient in place by Triton
    kernels, which allocate nothing; the fp32 accumulation of the gradient GEMMs is one `addmm(out_dtype=fp32)`.
    The stand-ins run the torch fall-back of those kernels where the tracker cannot see it."""
    from torch.utils._python_dispatch import _disable_current_modes
    from trl.kernels import chunked_logprob
    from trl.trainer import utils as trl_utils

    def unseen(function: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> None:
            with _disable_current_modes():
                function(*args, **kwargs)

        return run

    class Kernel:
        def __init__(self, fallback: Any) -> None:
            self.fallback = unseen(fallback)

        def __getitem__(self, grid: Any) -> Any:
            return self.fallback

    saved = {
        "use_triton": (chunked_logprob._use_triton, trl_utils._use_triton),
        "kernels": (chunked_logprob._forward_kernel, chunked_logprob._backward_kernel, chunked_logprob._addmm_fp32),
        "triton": getattr(chunked_logprob, "triton", None),
    }
    chunked_logprob._use_triton = trl_utils._use_triton = lambda device: True
    chunked_logprob._forward_kernel = Kernel(chunked_logprob._forward_tile)
    chunked_logprob._backward_kernel = Kernel(chunked_logprob._backward_tile)
    chunked_logprob._addmm_fp32 = unseen(saved["kernels"][2])
    if saved["triton"] is None:
        chunked_logprob.triton = types.SimpleNamespace(cdiv=lambda a, b: -(a // -b))
    try:
        yield
    finally:
        chunked_logprob._use_triton, trl_utils._use_triton = saved["use_triton"]
        chunked_logprob._forward_kernel, chunked_logprob._backward_kernel, chunked_logprob._addmm_fp32 = saved[
            "kernels"
        ]
        if saved["triton"] is None:
            del chunked_logprob.triton


@contextlib.contextmanager
def model_stays_put() -> Iterator[None]:
    """`module.to(device)` onto the device it is on is a no-op for real tensors (`param.data = param`), but
    nn.Module._apply swaps every fake parameter for a new one, which drops the attributes a 4-bit weight carries
    (its quant_state). The Trainer and accelerate move the model to `args.device` (the CPU, where the fake
    tensors are): leave it where it is, as real tensors do. A move that changes a dtype goes through."""
    import torch

    to = torch.nn.Module.to

    def stay(self: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is None and (device is None or device.type == "cpu"):
            return self
        return to(self, *args, **kwargs)

    torch.nn.Module.to = stay
    try:
        yield
    finally:
        torch.nn.Module.to = to


# --- the model, the data, the trainer -----------------------------------------------------------------------
def base_model(case: Case, fake_mode: Any, model_dir: Path | None) -> Any:
    """The base model as the stack receives it: from_pretrained with the bnb config (the real CPU cases), or
    the same module tree with fake tensors (transformers' own 4-bit quantizer, stand-ins for the packed weights)."""
    from lorafit.train import build

    if model_dir is not None:
        return build.load_model(model_dir, case.settings)
    from transformers import AutoModelForCausalLM

    from lorafit.trace.model import quantize_4bit

    config = build.checked_hf_config(case.spec, case.settings)
    with fake_mode:
        model = AutoModelForCausalLM.from_config(config, dtype=build.compute_dtype(case.settings))
    if case.settings.quant == "nf4":
        quantize_4bit(model, case.settings, fake_mode)
    return model


def tokenizer(vocab_size: int) -> Any:
    """A word-level tokenizer over the model's whole vocabulary (the data comes tokenized)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size - 2)} | {"<eos>": vocab_size - 2, "<pad>": vocab_size - 1}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>")


def dataset(case: Case) -> Any:
    """Tokenized rows of exactly seq_len tokens (no padding), enough for the steps."""
    import random

    from datasets import Dataset

    rng = random.Random(0)
    rows = STEPS * case.settings.micro_batch
    top = case.spec.vocab_size - 3
    return Dataset.from_dict(
        {"input_ids": [[rng.randint(0, top) for _ in range(case.settings.seq_len)] for _ in range(rows)]}
    )


def common_args(case: Case, output_dir: Path) -> dict[str, Any]:
    """What the bench sets beyond the stack's defaults: the batch, two steps, nothing written or reported."""
    return dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=case.settings.micro_batch,
        max_steps=STEPS,
        gradient_checkpointing=case.settings.grad_ckpt,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        dataloader_num_workers=0,
        seed=0,
    )


def make_trainer(case: Case, model: Any, output_dir: Path) -> Any:
    from peft import LoraConfig

    from lorafit.train import hf_args

    lora = LoraConfig(**hf_args.lora_kwargs(case.spec, case.settings))
    tok = tokenizer(case.spec.vocab_size)
    if case.stack == "trl":
        from trl import SFTConfig, SFTTrainer

        # SFTConfig's defaults: bf16, gradient checkpointing (here as the case says), adamw_torch_fused
        args = SFTConfig(max_length=case.settings.seq_len, **common_args(case, output_dir))
        return SFTTrainer(model=model, args=args, train_dataset=dataset(case), processing_class=tok, peft_config=lora)
    from peft import get_peft_model, prepare_model_for_kbit_training
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    if case.settings.quant != "none":
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=case.settings.grad_ckpt)
    model = get_peft_model(model, lora)
    args = TrainingArguments(bf16=True, **common_args(case, output_dir))
    collator = DataCollatorForLanguageModeling(tok, mlm=False)
    return Trainer(model=model, args=args, train_dataset=dataset(case), data_collator=collator)


# --- the traced run -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Traced:
    peak_bytes: int
    phase: str
    breakdown: dict[str, int]
    paged_bytes: int
    phase_peaks: dict[str, int]  # the highest moment of each phase of step 2


def watch(trainer: Any, tracker: Any) -> None:
    """Tell the tracker what is what as the Trainer runs: parameters now, gradients and optimizer states as
    they appear, each forward's leftovers as activations at its backward, and which phase is running."""
    from transformers import TrainerCallback

    from lorafit.trace.model import parameter_tensors
    from lorafit.trace.step import PhaseLabels, watch_gradients, watch_optimizer
    from lorafit.trace.tracker import PARAMETERS

    model = trainer.model
    for tensor in parameter_tensors(model):
        tracker.track(tensor, PARAMETERS)
    watch_gradients(model, tracker)
    labels = PhaseLabels(model, tracker)

    compute_loss = trainer.compute_loss

    def counted_loss(*args: Any, **kwargs: Any) -> Any:
        tracker.start_forward()
        loss = compute_loss(*args, **kwargs)
        tracker.retag_forward_leftovers()
        labels.set("backward: loss")
        return loss

    clip = trainer._clip_grad_norm

    def labelled_clip(*args: Any, **kwargs: Any) -> Any:
        labels.micro_batch = 0
        labels.set("gradient clipping")
        return clip(*args, **kwargs)

    class Labels(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            # accelerate's prepare reloads the optimizer's state dict, which replaces its state mapping
            watch_optimizer(getattr(trainer.optimizer, "optimizer", trainer.optimizer), tracker)

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            labels.step, labels.micro_batch = state.global_step + 1, 1
            labels.set("batch")

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            labels.set("optimizer step")

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            labels.set("zero grad")

    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # the bench prints its own line
    trainer.compute_loss = counted_loss
    trainer._clip_grad_norm = labelled_clip
    trainer.add_callback(Labels())


def plain_loop(case: Case, model: Any, tracker: Any) -> None:
    """peft's classic QLoRA recipe in a plain PyTorch loop (the peft QLoRA notebooks and many scripts): kbit
    preparation with non-reentrant checkpointing, enable_input_require_grads, get_peft_model,
    torch.optim.AdamW (foreach), no autocast; `run_training_steps` is that loop (forward, backward, clip, step)."""
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    from lorafit.trace.model import parameter_tensors
    from lorafit.trace.step import run_training_steps, token_batch
    from lorafit.trace.tracker import PARAMETERS
    from lorafit.train import hf_args

    ckpt = case.settings.grad_ckpt
    model = prepare_model_for_kbit_training(
        model, use_gradient_checkpointing=ckpt, gradient_checkpointing_kwargs={"use_reentrant": False}
    )
    model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(**hf_args.lora_kwargs(case.spec, case.settings)))
    model.train()
    for tensor in parameter_tensors(model):
        tracker.track(tensor, PARAMETERS)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    s = case.settings
    run_training_steps(
        model,
        optimizer,
        s,
        tracker,
        token_batch(case.spec.vocab_size, s.micro_batch, s.seq_len),
        steps=STEPS,
        autocast=False,
    )


def run(case: Case, model_dir: Path | None = None) -> Traced:
    """Two steps of the stack's own `train()` under the tracker: fake tensors (model_dir None) or the real
    model saved in `model_dir` on the CPU."""
    import datasets
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lorafit.trace.model import (
        _copyable_fake_tensors,
        _swappable_fake_parameters,
        cuda_kernel_choices,
        eager_data_checks,
    )
    from lorafit.trace.tracker import LiveTensorTracker
    from lorafit.train import build

    build.quiet_libraries()
    datasets.disable_progress_bars()
    torch.manual_seed(0)
    fake = model_dir is None
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else None
    cuda = case.device == "cuda"
    model = base_model(case, fake_mode, model_dir)
    tracker = LiveTensorTracker()
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        if fake:
            stack.enter_context(fake_mode)
            stack.enter_context(_swappable_fake_parameters(fake_mode))
            stack.enter_context(_copyable_fake_tensors())
            stack.enter_context(eager_data_checks())
            stack.enter_context(masks_read_from_data())
            stack.enter_context(model_stays_put())
        if case.loop:
            if cuda:
                stack.enter_context(cuda_kernel_choices())
            if fake:
                stack.enter_context(data_standins())
            plain_loop(case, model, tracker)
        else:
            trainer = make_trainer(case, model, Path(tmp))
            if case.settings.liger:
                stack.enter_context(liger_standins.liger_kernels(fused_loss=case.stack != "trl"))
            watch(trainer, tracker)
            if cuda:
                stack.enter_context(cuda_kernel_choices())
                if case.stack == "trl":
                    stack.enter_context(cuda_fused_head())
            stack.enter_context(tracker)
            if fake:
                stack.enter_context(data_standins())
            with torch.autograd.graph.saved_tensors_hooks(tracker.pack_saved, lambda tensor: tensor):
                trainer.train()
    phase, snapshot = tracker.peak
    return Traced(
        snapshot.total_bytes,
        phase.describe(case.spec.num_hidden_layers),
        dict(snapshot.by_category),
        tracker.paged_bytes,
        {
            p.describe(case.spec.num_hidden_layers): peak.total_bytes
            for p, peak in tracker.phase_peaks.items()
            if p.step == STEPS
        },
    )


def save_random_model(case: Case, folder: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    from lorafit.train import build

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(build.hf_config(case.spec, case.settings), dtype=torch.bfloat16)
    model.save_pretrained(folder)
    return folder


def trace(case: Case) -> Traced:
    if case.kind == "fake":
        return run(case)
    with tempfile.TemporaryDirectory() as tmp:
        return run(case, save_random_model(case, Path(tmp) / "model"))


def estimate_bytes(case: Case) -> tuple[float, str]:
    """lorafit's analytic allocated peak for the case under `--stack`, and its phase."""
    settings = case.estimate_settings
    runtime = memory.stack_runtime(settings, device=case.device)
    parts, phase = memory.breakdown(case.spec, settings, runtime)
    return sum(parts.values()), phase


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stacks", default="trl,peft-kbit")
    parser.add_argument("--kind", default="fake,cpu", help="fake (real shapes, fake tensors), cpu (small, real)")
    parser.add_argument("--cases", default="*", help="a glob over the case names")
    parser.add_argument("--json", type=Path, default=RESULTS)
    parser.add_argument("--parts", action="store_true", help="also print the traced and estimated parts")
    parser.add_argument("--layers", type=int, default=0, help="decoder layers of the fake cases (default: all)")
    args = parser.parse_args(argv)
    wanted = [
        case
        for case in cases()
        if case.stack in args.stacks.split(",")
        and case.kind in args.kind.split(",")
        and fnmatch.fnmatch(case.name, args.cases)
    ]
    print("each stack's own training step, traced, against lorafit's estimate under --stack (allocated peak)")
    print(f"{'stack':14} {'kind':4} {'model':13} {'settings':22} {'traced':>10} {'estimate':>10} {'error':>7}  phases")
    results = []
    if args.layers:
        wanted = [
            replace(case, spec=case.spec.scaled(num_hidden_layers=args.layers)) if case.kind == "fake" else case
            for case in wanted
        ]
    for case in wanted:
        started = time.perf_counter()
        traced = trace(case)
        predicted, phase = estimate_bytes(case)
        error = 100 * (predicted - traced.peak_bytes) / traced.peak_bytes
        s = case.settings
        shown = f"{s.method} {s.micro_batch}x{s.seq_len} {'ckpt' if s.grad_ckpt else 'no-ckpt'}" + (
            " liger" if s.liger else ""
        )
        unit, scale = ("GiB", GIB) if case.kind == "fake" else ("MiB", 2**20)
        print(
            f"{case.label:14} {case.kind:4} {case.model:13} {shown:22} {traced.peak_bytes / scale:6.3f} {unit}"
            f" {predicted / scale:6.3f} {unit} {error:+6.2f}%  {traced.phase} / {phase}",
            flush=True,
        )
        if args.parts:
            print("   traced:", {k: round(v / scale, 3) for k, v in traced.breakdown.items()})
            top = sorted(traced.phase_peaks.items(), key=lambda item: -item[1])[:8]
            print("   phases:", "; ".join(f"{p.split(': ', 1)[1]} {v / scale:.3f}" for p, v in top))
            settings = case.estimate_settings
            parts, _ = memory.breakdown(case.spec, settings, memory.stack_runtime(settings, device=case.device))
            print("   lorafit:", {k: round(v / scale, 3) for k, v in parts.items() if v})
        results.append(
            result_row(
                case,
                spec=case.spec.model_dump(mode="json") if case.kind == "cpu" else case.model,
                settings=s.model_dump(
                    mode="json",
                    include={"method", "quant", "micro_batch", "seq_len", "grad_ckpt", "liger", "train_embeddings"},
                ),
                device=case.device,
                traced=traced,
                predicted=predicted,
                phase=phase,
                error=error,
                started=started,
            )
            | {"kind": case.kind}
        )
    return finish(results, args.json)


def result_row(
    case: Any,
    *,
    spec: Any,
    settings: dict,
    device: str,
    traced: Any,
    predicted: float,
    phase: str,
    error: float,
    started: float,
) -> dict[str, Any]:
    """One case of bench/results/stacks*.json: the traced peak beside lorafit's estimate."""
    return dict(
        case=case.name,
        stack=case.label,
        model=case.model,
        spec=spec,
        settings=settings,
        device=device,
        traced_bytes=traced.peak_bytes,
        traced_phase=traced.phase,
        traced_breakdown_bytes=traced.breakdown,
        estimate_bytes=round(predicted),
        estimate_phase=phase,
        error_pct=round(error, 2),
        seconds=round(time.perf_counter() - started, 1),
    )


def finish(results: list[dict[str, Any]], path: Path | None) -> list[dict[str, Any]]:
    """Print the worst case and write the results (when asked to)."""
    if results:
        worst = max(results, key=lambda r: abs(r["error_pct"]))
        print(f"worst |error| {abs(worst['error_pct']):.2f}% over {len(results)} cases ({worst['case']})")
    if path and results:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
