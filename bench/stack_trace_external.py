"""`make bench-stacks-external`: LLaMA-Factory's and torchtune's own training steps, traced, against lorafit's
estimate under `--stack NAME`.

Each stack is installed at its pinned version without its dependencies into bench/out/<name> (the project's
torch / transformers / peft / bitsandbytes / trl cover what the step imports; `make bench-stacks-external` does
it) and put on sys.path here only. Each case saves a small random-init Llama model (and a word-level tokenizer)
to a temporary folder and runs two optimizer steps of the stack's own entry point on this machine's CPU, real
tensors and real bitsandbytes 4-bit, under lorafit's LiveTensorTracker, and prints the traced peak of live
tensor bytes beside `memory.estimate(spec, settings, runtime=memory.stack_runtime(settings, device="cpu"))`:

- llama-factory 0.9.5: `llamafactory.train.tuner.run_exp` with `stage=sft, finetuning_type=lora` (its loader,
  `prepare_model_for_training`, `init_adapter`, `CustomSeq2SeqTrainer`), its defaults for everything lorafit's
  Settings do not name;
- torchtune 0.6.1 (torchao 0.10.0): recipes/lora_finetune_single_device.py, its `setup()` and `train()`, with
  the components of llama2/7B_qlora_single_device.yaml at the case's shape, and nn.CrossEntropyLoss or (cases
  marked chunked-loss) its configs' CEWithChunkedOutputLoss.

axolotl 0.19.0 is not traced: its schema turns on its own LoRA kernels (`lora_mlp_kernel`, `lora_qkv_kernel`,
`lora_o_kernel`, utils/schemas/config.py) for every single-GPU LoRA/QLoRA run, and they dequantise NF4 through
CUDA (`torch._C._cuda_getCurrentRawStream`, kernels/quantize.py) and run Triton kernels: neither runs on the
CPU, nor under fake tensors.

Optional dependencies a step never runs are stood in for by empty modules or names (`stub_modules`); each is
listed where it is made.

    python bench/stack_trace_external.py [--stacks llama-factory,torchtune] [--cases PATTERN] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import importlib.machinery
import json
import os
import sys
import tempfile
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from lorafit import memory, stacks  # noqa: E402
from lorafit.models import ModelSpec  # noqa: E402
from lorafit.schema import Settings  # noqa: E402
from stack_trace import STEPS, finish, result_row, save_random_model, small, watch  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "stacks-external.json"
OUT = ROOT / "bench" / "out"
StackName = Literal["llama-factory", "torchtune"]


@dataclass(frozen=True)
class Case:
    stack: StackName
    model: str
    spec: ModelSpec
    settings: Settings

    @property
    def name(self) -> str:
        s = self.settings
        return (
            f"{self.stack} {self.model} {s.method} b{s.micro_batch}x{s.seq_len} {'ckpt' if s.grad_ckpt else 'no-ckpt'}"
            + (" chunked-loss" if s.loss == "chunked" else "")
        )


def settings(method: str, micro_batch: int, seq_len: int, grad_ckpt: bool, stack: str) -> Settings:
    quant = "nf4" if method == "qlora" else "none"
    return Settings(
        method=method, quant=quant, micro_batch=micro_batch, seq_len=seq_len, grad_ckpt=grad_ckpt, stack=stack
    )


SHAPES = (
    ("small-a", small(256, 2, 4096, 704), (2, 256)),
    ("small-b", small(320, 3, 32768, 896, heads=5, kv_heads=5), (1, 384)),
    # a small vocabulary: the layers, not the loss, make the peak
    ("small-c", small(256, 4, 512, 704), (2, 512)),
)


def nf4_fits_torchao(spec: ModelSpec) -> bool:
    """torchao's NF4Tensor double-quantises the absmax in blocks of 256: every quantised weight needs a multiple of
    64 x 256 elements (small-b's 320 x 320 has not)."""
    return all(n_in * n_out % (64 * 256) == 0 for _, n_in, n_out, _ in spec.layer_linears())


def cases() -> list[Case]:
    found = []
    for stack in ("llama-factory", "torchtune"):
        for label, spec, (micro_batch, seq_len) in SHAPES:
            for method in ("qlora", "lora"):
                if stack == "torchtune" and method == "qlora" and not nf4_fits_torchao(spec):
                    continue
                for ckpt in (True, False):
                    found.append(Case(stack, label, spec, settings(method, micro_batch, seq_len, ckpt, stack)))
                    if stack == "torchtune":  # its configs' CEWithChunkedOutputLoss
                        full = settings(method, micro_batch, seq_len, ckpt, stack)
                        chunked = full.model_copy(update={"loss": "chunked"})
                        found.append(Case(stack, label, spec, chunked))
    return found


# --- stand-ins for optional dependencies ----------------------------------------------------------------------
def stub_modules(*names: str) -> None:
    """Empty modules for optional packages that a stack imports at module level but its training step never
    calls; a spec, so that `importlib.util.find_spec` answers as for an installed package."""
    for name in names:
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__spec__ = importlib.machinery.ModuleSpec(name, None)
            sys.modules[name] = module


def stub_names(module: types.ModuleType, *names: str) -> None:
    """Empty classes for names a stack imports from a package that no longer has them (only other recipes use them)."""
    for name in names:
        if not hasattr(module, name):
            setattr(module, name, type(name, (), {}))


def on_path(name: str) -> Path:
    folder = OUT / name
    if not folder.is_dir():
        raise SystemExit(f"{name} is not installed in {folder}: run `make bench-stacks-external`")
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    return folder


# --- the traced train() ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Traced:
    peak_bytes: int
    phase: str
    breakdown: dict[str, int]


@contextlib.contextmanager
def traced_hf_train(trainer_class: type, tracker: Any) -> Iterator[None]:
    """Run `trainer_class.train` (a transformers Trainer the stack builds itself) under the tracker, labelled as
    bench/stack_trace.py labels lorafit's and TRL's."""
    import torch

    original = trainer_class.train

    def train(self: Any, *args: Any, **kwargs: Any) -> Any:
        watch(self, tracker)
        with tracker, torch.autograd.graph.saved_tensors_hooks(tracker.pack_saved, lambda tensor: tensor):
            return original(self, *args, **kwargs)

    trainer_class.train = train
    try:
        yield
    finally:
        trainer_class.train = original


def word_tokenizer(vocab_size: int) -> Any:
    """A whitespace word-level tokenizer over the model's whole vocabulary: 't17 t3' is two tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size - 3)}
    vocab |= {"<bos>": vocab_size - 3, "<eos>": vocab_size - 2, "<pad>": vocab_size - 1}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<pad>"
    )


def words(case: Case, count: int, seed: int) -> str:
    import random

    rng = random.Random(seed)
    return " ".join(f"t{rng.randint(0, case.spec.vocab_size - 4)}" for _ in range(count))


# --- LLaMA-Factory -------------------------------------------------------------------------------------------
LLAMA_FACTORY = "llamafactory==0.9.5"


def run_llama_factory(case: Case, model_dir: Path, work: Path, tracker: Any) -> None:
    """`llamafactory-cli train` on an alpaca-style data set whose rows are longer than cutoff_len, so that every
    row is cut to exactly seq_len tokens (a multiple of 8: its collator pads to one)."""
    os.environ["DISABLE_VERSION_CHECK"] = "1"  # it pins transformers<=5.6, trl<=0.24; the SFT path runs on ours
    on_path("llamafactory")
    import trl

    # trl 1.x dropped these; llamafactory imports them for its reward-model and PPO stages only
    stub_names(trl, "AutoModelForCausalLMWithValueHead", "PPOConfig", "PPOTrainer")
    stub_modules("torchaudio")  # imported by its multimodal plugin, used only for audio inputs
    from llamafactory.model.model_utils import checkpointing
    from llamafactory.train.sft.trainer import CustomSeq2SeqTrainer
    from llamafactory.train.tuner import run_exp

    s = case.settings
    data = work / "data"
    data.mkdir()
    rows = [
        {"instruction": words(case, s.seq_len, 2 * i), "input": "", "output": words(case, s.seq_len, 2 * i + 1)}
        for i in range(STEPS * s.micro_batch)
    ]
    (data / "toy.json").write_text(json.dumps(rows))
    (data / "dataset_info.json").write_text(json.dumps({"toy": {"file_name": "toy.json"}}))
    args = dict(
        stage="sft",
        do_train=True,
        model_name_or_path=str(model_dir),
        dataset="toy",
        dataset_dir=str(data),
        template="empty",
        cutoff_len=s.seq_len,
        finetuning_type="lora",
        lora_target=",".join(case.spec.lora_target_names(s.lora_targets)),
        lora_rank=s.lora_r,
        lora_alpha=s.lora_alpha,
        lora_dropout=s.lora_dropout,
        quantization_bit=4 if s.quant == "nf4" else None,
        quantization_method="bnb",
        double_quantization=s.double_quant,
        disable_gradient_checkpointing=not s.grad_ckpt,
        bf16=True,
        per_device_train_batch_size=s.micro_batch,
        gradient_accumulation_steps=1,
        max_steps=STEPS,
        output_dir=str(work / "out"),
        overwrite_output_dir=True,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        logging_steps=1000,
        preprocessing_num_workers=None,
        dataloader_num_workers=0,
        seed=0,
        plot_loss=False,
    )
    with traced_hf_train(CustomSeq2SeqTrainer, tracker), layer_as_bound_method(checkpointing):
        run_exp({k: v for k, v in args.items() if v is not None})


@contextlib.contextmanager
def layer_as_bound_method(checkpointing: types.ModuleType) -> Iterator[None]:
    """llamafactory 0.9.5 finds the layer a checkpointed call belongs to as `func.func.__self__`: transformers up
    to 5.6 passed `partial(layer.__call__, ...)`; 5.25 passes `partial(Layer.forward, layer, ...)`. Hand its
    checkpointing function the same call as a bound method, so that its own code runs unchanged."""
    from functools import partial

    make = checkpointing.get_custom_gradient_checkpointing_func

    def get_custom_gradient_checkpointing_func(gradient_checkpointing_func: Any) -> Any:
        custom = make(gradient_checkpointing_func)

        def bound(func: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(func, partial) and not hasattr(func.func, "__self__") and func.args:
                func = partial(types.MethodType(func.func, func.args[0]), *func.args[1:], **func.keywords)
            return custom(func, *args, **kwargs)

        return bound

    checkpointing.get_custom_gradient_checkpointing_func = get_custom_gradient_checkpointing_func
    try:
        yield
    finally:
        checkpointing.get_custom_gradient_checkpointing_func = make


# --- torchtune -----------------------------------------------------------------------------------------------
TORCHTUNE = "torchtune==0.6.1 torchao==0.10.0"


class ToyTokenizer:
    """What the recipe reads from its tokenizer (the data set comes tokenized): the pad id."""

    def __init__(self, vocab_size: int) -> None:
        self.pad_id = vocab_size - 1


def toy_dataset(tokenizer: ToyTokenizer, rows: int, seq_len: int, vocab_size: int) -> list[dict[str, list[int]]]:
    """`rows` tokenized rows of exactly seq_len tokens, every label scored (torchtune's SFT row format)."""
    import random

    rng = random.Random(0)
    data = []
    for _ in range(rows):
        tokens = [rng.randint(0, vocab_size - 2) for _ in range(seq_len)]
        data.append({"tokens": tokens, "labels": list(tokens)})
    return data


def run_torchtune(case: Case, model_dir: Path, work: Path, tracker: Any) -> None:
    """recipes/lora_finetune_single_device.py: its `setup()` from a config like llama2/7B_qlora_single_device.yaml
    (the model builder at the case's shape, the HF checkpoint in model_dir, the AdamW it names), then `train()`
    for two steps. The end-of-epoch checkpoint save is left out: it is not the step."""
    on_path("torchtune")
    import importlib.util

    import torch
    from omegaconf import OmegaConf

    # recipes/ is not a package (its __init__ refuses imports): load the recipe file itself, as `tune run` does
    path = OUT / "torchtune" / "recipes" / "lora_finetune_single_device.py"
    found = importlib.util.spec_from_file_location("lora_finetune_single_device", path)
    recipe_module = importlib.util.module_from_spec(found)
    found.loader.exec_module(recipe_module)
    LoRAFinetuneRecipeSingleDevice = recipe_module.LoRAFinetuneRecipeSingleDevice  # noqa: N806

    from lorafit.trace.step import watch_gradients, watch_optimizer
    from lorafit.trace.tracker import PARAMETERS, Phase

    spec, s = case.spec, case.settings
    targets = set(spec.lora_target_names(s.lora_targets))
    attn = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "o_proj": "output_proj"}
    this = "stack_trace_external"
    cfg = OmegaConf.create(
        dict(
            output_dir=str(work / "out"),
            model=dict(
                _component_="torchtune.models.llama2._component_builders.lora_llama2",
                lora_attn_modules=[name for hf, name in attn.items() if hf in targets],
                apply_lora_to_mlp=bool(targets & {"gate_proj", "up_proj", "down_proj"}),
                apply_lora_to_output=False,
                vocab_size=spec.vocab_size,
                num_layers=spec.num_hidden_layers,
                num_heads=spec.num_attention_heads,
                num_kv_heads=spec.num_key_value_heads,
                embed_dim=spec.hidden_size,
                max_seq_len=s.seq_len,
                intermediate_dim=spec.intermediate_size,
                norm_eps=1e-6,
                lora_rank=s.lora_r,
                lora_alpha=s.lora_alpha,
                lora_dropout=s.lora_dropout,
                quantize_base=s.quant == "nf4",
            ),
            tokenizer=dict(_component_=f"{this}.ToyTokenizer", vocab_size=spec.vocab_size),
            checkpointer=dict(
                _component_="torchtune.training.FullModelHFCheckpointer",
                checkpoint_dir=str(model_dir),
                checkpoint_files=["model.safetensors"],
                recipe_checkpoint=None,
                output_dir=str(work / "out"),
                model_type="LLAMA2",
            ),
            resume_from_checkpoint=False,
            save_adapter_weights_only=False,
            dataset=dict(
                _component_=f"{this}.toy_dataset",
                rows=STEPS * s.micro_batch,
                seq_len=s.seq_len,
                vocab_size=spec.vocab_size,
            ),
            seed=0,
            shuffle=False,
            batch_size=s.micro_batch,
            # llama2/7B_qlora_single_device.yaml
            optimizer=dict(_component_="torch.optim.AdamW", fused=True, weight_decay=0.01, lr=3e-4),
            lr_scheduler=dict(
                _component_="torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup", num_warmup_steps=1
            ),
            loss=dict(
                _component_="torchtune.modules.loss.CEWithChunkedOutputLoss"
                if s.loss == "chunked"
                else "torch.nn.CrossEntropyLoss"
            ),
            epochs=1,
            max_steps_per_epoch=STEPS,
            gradient_accumulation_steps=1,
            clip_grad_norm=None,
            compile=False,
            metric_logger=dict(_component_="torchtune.training.metric_logging.DiskLogger", log_dir=str(work / "logs")),
            log_every_n_steps=1,
            log_peak_memory_stats=False,
            device="cpu",
            dtype="bf16",
            enable_activation_checkpointing=s.grad_ckpt,
            enable_activation_offloading=False,
            profiler=dict(_component_="torchtune.training.setup_torch_profiler", enabled=False),
        )
    )
    recipe = LoRAFinetuneRecipeSingleDevice(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.save_checkpoint = lambda epoch: None
    model, optimizer = recipe._model, recipe._optimizer
    for tensor in [*model.parameters(), *model.buffers()]:
        tracker.track(tensor, PARAMETERS)
    watch_gradients(model, tracker)
    watch_optimizer(optimizer, tracker)
    step = [0]
    loss_step = recipe._loss_step

    def counted_loss_step(batch: dict[str, Any]) -> Any:
        step[0] += 1
        tracker.set_phase(Phase(step[0], 1, "forward"))
        tracker.start_forward()
        loss = loss_step(batch)
        tracker.retag_forward_leftovers()
        tracker.set_phase(Phase(step[0], 1, "backward"))
        return loss

    optimizer_step = optimizer.step

    def labelled_step(*args: Any, **kwargs: Any) -> Any:
        tracker.set_phase(Phase(step[0], 0, "optimizer step"))
        return optimizer_step(*args, **kwargs)

    recipe._loss_step = counted_loss_step
    optimizer.step = labelled_step
    with tracker, torch.autograd.graph.saved_tensors_hooks(tracker.pack_saved, lambda tensor: tensor):
        recipe.train()
    recipe.cleanup()


RUNNERS = {"llama-factory": run_llama_factory, "torchtune": run_torchtune}


def trace(case: Case) -> Traced:
    import torch

    from lorafit.trace.tracker import LiveTensorTracker
    from lorafit.train import build

    build.quiet_libraries()
    torch.manual_seed(0)
    tracker = LiveTensorTracker()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir = save_random_model(case, work / "model")
        word_tokenizer(case.spec.vocab_size).save_pretrained(model_dir)
        RUNNERS[case.stack](case, model_dir, work, tracker)
    phase, snapshot = tracker.peak
    return Traced(snapshot.total_bytes, phase.describe(case.spec.num_hidden_layers), dict(snapshot.by_category))


def estimate(case: Case) -> tuple[float, str, dict[str, float]]:
    """lorafit's analytic allocated peak for the case under `--stack`, its phase and parts."""
    stack = stacks.catalog()[case.stack]
    if stack.offered:
        runtime = memory.stack_runtime(case.settings, device="cpu")
    else:  # --stack refuses it; its facts as traced, to show how far they are
        runtime = memory.Runtime(**stack.facts(case.settings.quant != "none"), device="cpu")
    parts, phase = memory.breakdown(case.spec, case.settings, runtime)
    return sum(parts.values()), phase, parts


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stacks", default=",".join(RUNNERS))
    parser.add_argument("--cases", default="*", help="a glob over the case names")
    parser.add_argument("--json", type=Path, default=RESULTS)
    parser.add_argument("--parts", action="store_true", help="also print the traced and estimated parts")
    args = parser.parse_args(argv)
    wanted = [c for c in cases() if c.stack in args.stacks.split(",") and fnmatch.fnmatch(c.name, args.cases)]
    print("each stack's own training step on the CPU, traced, against lorafit's estimate under --stack")
    print(f"{'stack':13} {'model':8} {'settings':30} {'traced':>10} {'estimate':>10} {'error':>7}  phases")
    results = []
    mib = 2**20
    for case in wanted:
        started = time.perf_counter()
        traced = trace(case)
        predicted, phase, parts = estimate(case)
        error = 100 * (predicted - traced.peak_bytes) / traced.peak_bytes
        s = case.settings
        shown = f"{s.method} {s.micro_batch}x{s.seq_len} {'ckpt' if s.grad_ckpt else 'no-ckpt'}"
        shown += " chunked" if s.loss == "chunked" else ""
        print(
            f"{case.stack:13} {case.model:8} {shown:30} {traced.peak_bytes / mib:6.2f} MiB"
            f" {predicted / mib:6.2f} MiB {error:+6.2f}%  {traced.phase} / {phase}",
            flush=True,
        )
        if args.parts:
            print("   traced:", {k: round(v / mib, 3) for k, v in traced.breakdown.items()})
            print("   lorafit:", {k: round(v / mib, 3) for k, v in parts.items() if v})
        results.append(
            result_row(
                case,
                spec=case.spec.model_dump(mode="json"),
                settings=s.model_dump(mode="json"),
                device="cpu",
                traced=traced,
                predicted=predicted,
                phase=phase,
                error=error,
                started=started,
            )
        )
    return finish(results, args.json)


if __name__ == "__main__":
    main()
