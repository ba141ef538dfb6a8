"""Fixtures shared by every test."""

import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from lorafit.models import ModelSpec, resolve

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


def load_script(relative: str) -> ModuleType:
    """A script of the repository (bench/..., tools/...) imported as a module under its file's name, registered
    in sys.modules so that dataclasses and pickling inside it resolve."""
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
# huggingface_hub and datasets read those variables once, when first imported: a module imported before the
# fixture runs (at collection, say) gets its flags set directly.
OFFLINE_FLAGS = {
    "huggingface_hub.constants": ("HF_HUB_OFFLINE",),
    "datasets.config": ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"),
}


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
    data = tmp_path / "data.jsonl"
    rows = [{"instruction": f"count to {n}", "input": "", "output": " ".join(["one"] * n)} for n in range(1, 17)]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    run = tmp_path / "run"
    args = ["train", "--model", str(tmp_path / "model"), "--data", str(data), "--output-dir", str(run), *flags]
    code, _, err = run_cli([*args, "--max-steps", "2", "--micro-batch", "2"], capsys)
    assert code == 0, err
    return run, spec
