"""`lorafit chat RUN_DIR --prompt ...`: load the base and the adapter a run wrote, and answer one prompt.

RUN_DIR is a run folder or one of its checkpoints (`RUN_DIR/checkpoints/checkpoint-N`); either way the base
is loaded the way the run trained it (the run's plan.json: 4-bit for QLoRA), so a checkpoint of the last
step answers exactly as the run folder does.

A prompt that does not fit the model's positions together with the answer is refused with the numbers, not
cut: cutting the start of a prompt silently changes the question.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from lorafit import options
from lorafit.errors import InvalidConfig, TrainError
from lorafit.schema import Plan, Settings
from lorafit.train import build, checkpoints
from lorafit.train.build import quiet_libraries

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """llama.cpp prints its load log on the C stderr; keep lorafit's output readable."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def check_generation(max_new_tokens: int, temperature: float) -> None:
    """Refuse what generate() would fail on late or deep inside (0 or negative tokens, a NaN temperature), with
    the bounds and the message `lorafit chat`'s flags have (lorafit.options)."""
    given = {"max_new_tokens": max_new_tokens, "temperature": temperature}
    options.validate("chat", given, from_flags=given)


def run_folder(path: Path) -> Path:
    """The run folder `path` belongs to: itself, or the run of a checkpoint folder (RUN/checkpoints/checkpoint-N)."""
    path = Path(path)
    if checkpoints.checkpoint_step(path) is not None and path.parent.name == checkpoints.CHECKPOINTS:
        return path.parent.parent
    return path


def run_settings(run_dir: Path) -> Settings:
    """The settings the run trained with (its plan.json, the run folder's for a checkpoint); a folder
    without one loads as 16-bit LoRA."""
    for folder in dict.fromkeys((Path(run_dir), run_folder(run_dir))):
        path = folder / "plan.json"
        if path.is_file():
            return Plan.load(path).settings
    return Settings(method="lora", quant="none", precision="fp32")


def check_folder(run_dir: Path) -> Path | None:
    """The adapter config of a run or checkpoint folder (None: a fully fine-tuned model), or one line why not."""
    if not run_dir.is_dir():
        raise TrainError(f"no run folder {run_dir}")
    if run_folder(run_dir) != run_dir and not checkpoints.is_complete(run_dir):
        newest = checkpoints.latest_checkpoint(run_folder(run_dir))
        other = f"; the newest complete one is {newest}" if newest else ""
        raise TrainError(f"{run_dir} is not a complete checkpoint (its save was cut short){other}")
    adapter = run_dir / "adapter_config.json"
    if adapter.is_file():
        return adapter
    if (run_dir / "config.json").is_file():
        return None
    newest = checkpoints.latest_checkpoint(run_dir)
    if newest is not None:
        raise TrainError(f"{run_dir} holds no adapter yet (training has not finished); chat with {newest}")
    raise TrainError(f"{run_dir} holds no adapter or model yet; train first (`lorafit train`)")


def base_dir_of(adapter: Path) -> Path:
    try:
        base_dir = Path(json.loads(adapter.read_text())["base_model_name_or_path"])
    except (OSError, ValueError, KeyError, TypeError):
        raise TrainError(f"{adapter} is not a readable adapter config (no base_model_name_or_path)") from None
    if not base_dir.is_dir():
        raise TrainError(
            f"the adapter's base model {base_dir} is not there; restore it or edit base_model_name_or_path in {adapter}"
        )
    return base_dir


def load_tokenizer(folders: list[Path], *, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The tokenizer the run saved (with its chat template); the base model's if the folder has none."""
    from transformers import AutoTokenizer

    for folder in dict.fromkeys(folders):
        if (folder / "tokenizer_config.json").is_file() or (folder / "tokenizer.json").is_file():
            try:
                return AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=trust_remote_code)
            except (OSError, ValueError, TypeError) as error:
                raise TrainError(f"cannot load the tokenizer in {folder}: {_first_line(error)}") from None
    raise TrainError(f"no tokenizer in {folders[0]} nor in the base model; copy the run's tokenizer files there")


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def load(
    run_dir: Path, *, allow_pickle: bool = False, trust_remote_code: bool = False
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The trained model: base + adapter (loaded as it was trained, 4-bit for QLoRA), or the full model."""
    run_dir = Path(run_dir)
    adapter = check_folder(run_dir)
    quiet_libraries()
    import torch

    on_cuda = torch.cuda.is_available()
    if not on_cuda:
        torch.set_flush_denormal(True)
    settings = run_settings(run_dir)
    if not on_cuda and settings.precision != "fp32":
        settings = settings.model_copy(update={"precision": "fp32"})
    device_map = {"": torch.cuda.current_device()} if on_cuda else None
    base_dir = base_dir_of(adapter) if adapter is not None else run_dir
    tokenizer = load_tokenizer([run_dir, run_folder(run_dir), base_dir], trust_remote_code=trust_remote_code)
    try:
        if adapter is not None:
            from peft import PeftModel

            base = build.load_model(
                base_dir,
                settings,
                allow_pickle=allow_pickle,
                trust_remote_code=trust_remote_code,
                device_map=device_map,
            )
            model = PeftModel.from_pretrained(base, run_dir)
        else:
            plain = settings.model_copy(update={"quant": "none", "method": "full"})
            model = build.load_model(
                run_dir, plain, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code, device_map=device_map
            )
    except TrainError:
        raise
    except Exception as error:  # a corrupt weights file raises the safetensors / torch / peft error types
        raise TrainError(f"cannot load the model of {run_dir}: {_first_line(error)}") from None
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

    check_generation(max_new_tokens, temperature)
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    prompt_tokens = int(inputs["input_ids"].shape[1])
    positions = getattr(model.config, "max_position_embeddings", None)
    if positions and prompt_tokens + max_new_tokens > positions:
        room = positions - prompt_tokens
        fix = f"pass --max-new-tokens {room} or less, or shorten the prompt" if room > 0 else "shorten the prompt"
        raise InvalidConfig(
            f"the prompt is {prompt_tokens} tokens (chat template included) and --max-new-tokens asks for "
            f"{max_new_tokens} more, but the model reads at most {positions} positions: {fix}"
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
    return tokenizer.decode(output[0, prompt_tokens:], skip_special_tokens=True).strip()


def answer_gguf(path: Path, prompt: str, *, max_new_tokens: int = 64, temperature: float = 0.0) -> str:
    """The reply of an exported GGUF, run by llama.cpp with the chat template stored in the file (as Ollama and
    LM Studio run it); greedy at temperature 0."""
    check_generation(max_new_tokens, temperature)
    path = Path(path)
    if not path.is_file():
        raise TrainError(f"no GGUF file {path}")
    try:
        import llama_cpp
    except ImportError:
        raise TrainError("chatting with a GGUF needs llama.cpp: pip install 'lorafit[gguf]'") from None
    with quiet_stderr():
        try:
            model = llama_cpp.Llama(str(path), n_ctx=_gguf_context(path), verbose=False, seed=0)
        except ValueError:
            raise TrainError(f"llama.cpp cannot load {path}; is it a GGUF file?") from None
    try:
        positions = model.n_ctx()
        reply = model.create_chat_completion(
            [{"role": "user", "content": prompt}],
            max_tokens=min(max_new_tokens, positions),
            temperature=temperature,
            top_k=0 if temperature > 0 else 1,
            seed=0,
        )
    except ValueError as error:  # llama-cpp-python: "Requested tokens (N) exceed context window of M"
        if "exceed context window" not in str(error):
            raise
        raise InvalidConfig(
            f"the prompt does not fit the {positions} positions {path.name} runs with ({_first_line(error)}): "
            "shorten the prompt"
        ) from None
    finally:
        model.close()
    return str(reply["choices"][0]["message"]["content"] or "").strip()


def _gguf_context(path: Path, cap: int = 4096) -> int:
    """The context to run a GGUF with: its trained length, at most `cap` (a 128k context would reserve gigabytes
    of KV cache for one answer)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
        arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
        field = reader.fields.get(f"{arch}.context_length")
        trained = int(field.parts[-1][0]) if field is not None else cap
    except (OSError, ValueError, KeyError, IndexError):
        raise TrainError(f"{path} is not a readable GGUF file") from None
    return min(trained, cap)
