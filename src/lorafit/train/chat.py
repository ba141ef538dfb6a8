"""`lorafit chat RUN_DIR --prompt ...`: load the base and the adapter a run wrote, and answer one prompt."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from lorafit.errors import TrainError

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from lorafit.schema import Settings


def run_settings(run_dir: Path) -> Settings:
    """The settings the run trained with (its plan.json); a folder without one loads as 16-bit LoRA."""
    from lorafit.schema import Plan, Settings

    path = run_dir / "plan.json"
    if path.is_file():
        return Plan.load(path).settings
    return Settings(method="lora", quant="none", precision="fp32")


def load(
    run_dir: Path, *, allow_pickle: bool = False, trust_remote_code: bool = False
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The trained model: base + adapter (loaded as it was trained, 4-bit for QLoRA), or the full model."""
    import torch
    from transformers import AutoTokenizer

    from lorafit.train import build
    from lorafit.train.recipe import _quiet_libraries

    run_dir = Path(run_dir)
    adapter = run_dir / "adapter_config.json"
    if not run_dir.is_dir():
        raise TrainError(f"no run folder {run_dir}")
    if not adapter.is_file() and not (run_dir / "config.json").is_file():
        raise TrainError(f"{run_dir} holds no adapter or model yet; train first (`lorafit train`)")
    _quiet_libraries()
    on_cuda = torch.cuda.is_available()
    if not on_cuda:
        torch.set_flush_denormal(True)
    settings = run_settings(run_dir)
    if not on_cuda and settings.precision != "fp32":
        settings = settings.model_copy(update={"precision": "fp32"})
    tokenizer = AutoTokenizer.from_pretrained(run_dir, local_files_only=True)
    device_map = {"": torch.cuda.current_device()} if on_cuda else None
    if adapter.is_file():
        from peft import PeftModel

        base_dir = Path(json.loads(adapter.read_text())["base_model_name_or_path"])
        if not base_dir.is_dir():
            raise TrainError(
                f"the adapter's base model {base_dir} is not there; restore it or edit "
                f"base_model_name_or_path in {adapter}"
            )
        base = build.load_model(
            base_dir, settings, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code, device_map=device_map
        )
        model = PeftModel.from_pretrained(base, run_dir)
    else:
        plain = settings.model_copy(update={"quant": "none", "method": "full"})
        model = build.load_model(
            run_dir, plain, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code, device_map=device_map
        )
    model.eval()
    return model, tokenizer


def answer(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompt: str,
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
) -> str:
    """The model's reply to one user turn, through the chat template it was trained with."""
    import torch

    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    inputs = {key: value.to(model.device) for key, value in inputs.items()}
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    with torch.no_grad():
        output = model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            **sampling,
        )
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()
