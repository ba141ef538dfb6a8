"""Fixtures shared by every test."""

import importlib.util
import json
import random
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from lorafit.hardware import GpuSpec
from lorafit.hardware import resolve as resolve_gpu
from lorafit.models import ModelSpec, resolve
from lorafit.schema import Settings

ROOT = Path(__file__).resolve().parents[1]


def tiny_spec(name: str = "llama-2-7b", **changes: int | bool) -> ModelSpec:
    """A 2-layer model of the named architecture: hidden 128, 4 heads of 32, 2 key/value heads (what the
    tracer's tests run at)."""
    shape = dict(
        num_hidden_layers=2,
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=512,
    )
    return resolve(name).scaled(**(shape | changes))


def build_on_meta(spec: ModelSpec) -> Any:
    """The real transformers model for `spec`, with no memory behind its tensors."""
    import torch

    from lorafit.train.build import hf_config
    from lorafit.train.model_files import auto_model_class

    # Parameter shapes do not depend on the attention kernel; eager is the one every architecture has
    # (transformers 5 has no SDPA path for Gemma-2).
    config = hf_config(spec, Settings(method="lora", quant="none", attn="eager"))
    with torch.device("meta"):
        return auto_model_class(config.model_type).from_config(config)


def packed_4bit(model: Any) -> dict[str, int]:
    """What transformers' bitsandbytes quantizer packs into 4-bit Linears (in place, as QLoRA loads the model):
    each packed module's weight elements, by module name."""
    import bitsandbytes as bnb
    from transformers import BitsAndBytesConfig
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear
    from transformers.quantizers.base import get_keys_to_not_convert

    packed = replace_with_bnb_linear(
        model,
        modules_to_not_convert=get_keys_to_not_convert(model),
        quantization_config=BitsAndBytesConfig(load_in_4bit=True),
    )
    return {n: m.in_features * m.out_features for n, m in packed.named_modules() if isinstance(m, bnb.nn.Linear4bit)}


def lora_trained(spec: ModelSpec, settings: Settings) -> dict[str, int]:
    """What peft trains when it wraps the model of `spec` (built on the meta device) in lorafit's LoRA config for
    `settings`: each trainable parameter's element count, by name."""
    from peft import get_peft_model

    from lorafit.train.build import lora_config

    model = get_peft_model(build_on_meta(spec), lora_config(spec, settings))
    return {name: p.numel() for name, p in model.named_parameters() if p.requires_grad}


def load_script(relative: str) -> ModuleType:
    """A script of the repository (bench/..., tools/...) imported as a module under its file's name, registered
    in sys.modules so that dataclasses and pickling inside it resolve."""
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    """A TCP port on 127.0.0.1 free a moment ago, for a test's process group or server to listen on."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def bench_module(name: str) -> Iterator[ModuleType]:
    """A bench/ script imported by name with bench/ on sys.path while the caller holds it (bench/ is a folder of
    scripts that import each other, not a package): `yield from` it in a fixture."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "bench"))


OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
# huggingface_hub and datasets read those variables once, when first imported: a module imported before the
# fixture runs (at collection, say) gets its flags set directly.
OFFLINE_FLAGS = {
    "huggingface_hub.constants": ("HF_HUB_OFFLINE",),
    "datasets.config": ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"),
}


@pytest.fixture(scope="session")
def a100() -> GpuSpec:
    """The catalog's A100 80GB, the card the time model's tests work out by hand."""
    return resolve_gpu("A100 80GB")


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    """The demo corpus's BPE tokenizer (1,024 tokens), built once for the export tests' tiny models."""
    from lorafit.train import demo

    return demo.build_tokenizer(demo.corpus(), vocab_size=1024)


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make an accidental download fail loudly instead of fetching a model or data set."""
    for variable in OFFLINE_VARIABLES:
        monkeypatch.setenv(variable, "1")
    for module_name, flags in OFFLINE_FLAGS.items():
        if (module := sys.modules.get(module_name)) is not None:
            for flag in flags:
                monkeypatch.setattr(module, flag, True)


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `lorafit ARGS`, run in this process."""
    from lorafit.cli import main

    try:
        main(args)
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def refused(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """`lorafit ARGS` refused as bad input is: exit 2, nothing on stdout and one `lorafit: error:` line on stderr
    (never a traceback); that line."""
    code, out, err = run_cli(args, capsys)
    assert code == 2 and not out and err.count("\n") == 1 and err.startswith("lorafit: error: "), (code, out, err)
    return err


def run_train(tmp_path: Path, rows: list[dict], capsys: pytest.CaptureFixture[str], *flags: str) -> Path:
    """`lorafit train` of the model folder tmp_path/model on `rows` (written as JSONL) with `flags`: the run
    folder, after asserting the command succeeded."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    run = tmp_path / "run"
    args = ["train", "--model", str(tmp_path / "model"), "--data", str(data), "--output-dir", str(run), *flags]
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    return run


WORDS = ["the", "keeper", "paints", "a", "tower", "red", "while", "otters", "steal", "fish"]


def word_rows(count: int, answer: str | None = None) -> list[dict]:
    """`count` seeded rows of six random words, each answered `answer` or six more random words."""
    rng = random.Random(0)
    return [
        {
            "instruction": " ".join(rng.choices(WORDS, k=6)),
            "input": "",
            "output": answer or " ".join(rng.choices(WORDS, k=6)),
        }
        for _ in range(count)
    ]


def train_tiny(
    tmp_path: Path, spec_of: Callable[[int], ModelSpec], capsys: pytest.CaptureFixture[str], *flags: str
) -> tuple[Path, ModelSpec]:
    """`lorafit train` for two steps of micro-batch 2 on a tiny random model (`spec_of(vocabulary size)` of a
    tokenizer trained here) and 16 counting rows: the run folder and the model's spec, after asserting the
    command succeeded."""
    from lorafit.train.demo import build_model, build_tokenizer, corpus

    tokenizer = build_tokenizer(corpus(), vocab_size=512)
    spec = spec_of(len(tokenizer))
    build_model(tmp_path / "model", tokenizer, spec, seed=0)
    rows = [{"instruction": f"count to {n}", "input": "", "output": " ".join(["one"] * n)} for n in range(1, 17)]
    return run_train(tmp_path, rows, capsys, *flags, "--max-steps", "2", "--micro-batch", "2"), spec


def adapter_names(run: Path) -> list[str]:
    """The tensor names of a finished run's adapter, after asserting that it logged metrics and no NaN loss."""
    from safetensors import safe_open

    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert metrics and all(row.get("loss", 1.0) == row.get("loss", 1.0) for row in metrics)  # no NaN
    with safe_open(run / "adapter_model.safetensors", "pt") as adapter:
        return list(adapter.keys())


def merged_changes(tmp_path: Path, capsys: pytest.CaptureFixture[str], *flags: str) -> tuple[str, set[str]]:
    """`lorafit export` of the run tmp_path/run `--to merged` into tmp_path/merged (with `flags`), asserting it
    succeeded and wrote every tensor of the base tmp_path/model again: its stdout, and the names of the tensors
    the merge changed."""
    import torch
    from safetensors import safe_open

    merged_dir = tmp_path / "merged"
    code, out, err = run_cli(["export", str(tmp_path / "run"), "--to", "merged", "-o", str(merged_dir), *flags], capsys)
    assert code == 0, err
    with (
        safe_open(tmp_path / "model" / "model.safetensors", "pt") as base,
        safe_open(merged_dir / "model.safetensors", "pt") as merged,
    ):
        names = list(base.keys())
        assert set(merged.keys()) == set(names)
        return out, {name for name in names if not torch.equal(base.get_tensor(name), merged.get_tensor(name))}


def randomize_lora_b(run: Path) -> None:
    """A seeded random B for every adapter of a run (a trained step leaves it near zero): a real update of every
    adapted weight for a merge or an export to show."""
    import torch
    from safetensors.torch import load_file, save_file

    weights = load_file(run / "adapter_model.safetensors")
    generator = torch.Generator().manual_seed(0)
    for key, tensor in weights.items():
        if ".lora_B." in key:
            weights[key] = torch.randn(tensor.shape, generator=generator) * 0.05
    save_file(weights, run / "adapter_model.safetensors", metadata={"format": "pt"})


def export_checked(run: Path, output: Path, capsys: pytest.CaptureFixture[str], full: str, *quants: str) -> dict:
    """`lorafit export RUN --to gguf` at `full` (and `quants`), asserting the export's own llama.cpp check of the
    `full` file (greedy tokens, logits within tolerance, tokenizer) and a top-1 agreement above one half for each
    of `quants`: the report."""
    flags = [flag for quant in (full, *quants) for flag in ("--quant", quant)]
    code, out, err = run_cli(["export", str(run), "--to", "gguf", "-o", str(output), *flags, "--json"], capsys)
    assert code == 0, err
    report = json.loads(out)
    checked = report["verify"][full]
    assert checked["greedy_match"] is True and checked["max_abs_logit_diff"] <= checked["logit_tolerance"]
    assert checked["tokenizer_match"] is True
    assert all(report["verify"][quant]["top1_agreement"] > 0.5 for quant in quants)
    return report
