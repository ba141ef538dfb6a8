"""`lorafit export RUN --to merged`: the adapter folded into the base, as a plain transformers model folder.

The merge streams: one tensor of the base is read from its memory-mapped shard, B @ A is added in fp32, the sum
is written in the base's dtype and freed before the next, so a 7B merge holds one weight matrix in memory, not
the model twice. The output keeps the base's shard layout (same names, dtypes and shapes), which lets each shard's
header be written before its data. Everything is written into a hidden staging folder beside the output and
renamed onto the output's name only when complete: an interrupted export never leaves a half model there.

The merged model is then checked against base + adapter run by peft (an independent implementation of the same
sum): their logits on a few texts must agree within a tolerance set by the weights' dtype.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lorafit.errors import ExportError
from lorafit.export.output import check_output, staged
from lorafit.export.source import RunSource, safetensors_header, weight_files
from lorafit.files import default_mode, write_atomic
from lorafit.models import from_config_json
from lorafit.train.build import quiet_libraries
from lorafit.train.chat import load_tokenizer
from lorafit.train.model_files import auto_model_class, config_model_type

if TYPE_CHECKING:
    import torch

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
)
SHARD_BYTES = 4 * 2**30  # shards of a dequantised base (the others keep the base's own layout)
# The logits of the merged model against base + adapter: the merged weights are rounded once to the stored
# dtype, so the allowed difference follows that dtype's precision (relative to the largest logit).
LOGIT_TOLERANCE = {"F32": 1e-4, "BF16": 3e-2, "F16": 4e-3}
SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


@dataclass(frozen=True)
class LogitsCheck:
    max_abs_diff: float | None
    tolerance: float | None
    texts: int
    skipped: str = ""  # why the check did not run (not enough memory for two copies of the model)

    @property
    def passed(self) -> bool:
        return self.skipped != "" or (self.max_abs_diff is not None and self.max_abs_diff <= (self.tolerance or 0))


@dataclass(frozen=True)
class Merged:
    folder: Path
    bytes: int
    dequantised: bool
    check: LogitsCheck | None


# --- a safetensors writer that streams ---------------------------------------------------------------------------
def write_streamed(path: Path, entries: list[tuple[str, str, list[int]]], tensor: Callable[[str], torch.Tensor]) -> int:
    """Write a safetensors file whose header is known up front: `entries` (name, dtype, shape) in file order, each
    tensor produced by `tensor(name)` just before it is written. The safetensors library needs every tensor of a
    file in memory at once; the format itself (a little-endian u64 header length, a JSON header, the raw bytes)
    needs only the shapes."""
    import torch

    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape in entries:
        size = _DTYPE_BYTES[dtype] * _count(shape)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)) + encoded)
        for name, dtype, shape in entries:
            value = tensor(name)
            if list(value.shape) != shape or _SAFETENSORS_OF[value.dtype] != dtype:
                raise ExportError(f"internal: {name} came out {value.dtype} {list(value.shape)}, not {dtype} {shape}")
            handle.write(value.contiguous().view(torch.uint8).numpy().tobytes())
        handle.flush()
        os.fsync(handle.fileno())
    os.chmod(path, default_mode())
    return offset + 8 + len(encoded)


_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def _count(shape: list[int]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


class _DtypeNames(dict):
    """torch dtype -> safetensors dtype name, built on first use (no torch at import time)."""

    def __missing__(self, key: Any) -> str:
        import torch

        names = {
            torch.float64: "F64",
            torch.float32: "F32",
            torch.float16: "F16",
            torch.bfloat16: "BF16",
            torch.int64: "I64",
            torch.int32: "I32",
            torch.int16: "I16",
            torch.int8: "I8",
            torch.uint8: "U8",
            torch.bool: "BOOL",
        }
        self.update(names)
        return names[key]


_SAFETENSORS_OF = _DtypeNames()


# --- the merge -------------------------------------------------------------------------------------------------
def merged_tensors(source: RunSource, shard: Path) -> Iterator[tuple[str, str, list[int], Callable[[], torch.Tensor]]]:
    """(name, dtype, shape, produce) for each tensor of one base shard, the adapted ones merged: W + s * B @ A in
    fp32, rounded once to W's dtype."""
    from safetensors import safe_open

    header = safetensors_header(shard)
    adapter = source.adapter
    names = sorted(header, key=lambda name: header[name]["data_offsets"][0])

    def produce(name: str) -> Callable[[], torch.Tensor]:
        def load() -> torch.Tensor:
            with safe_open(shard, framework="pt") as base:
                weight = base.get_tensor(name)
            if adapter is not None and name in adapter.saved:  # trained in full (modules_to_save)
                with safe_open(adapter.path, framework="pt") as lora:
                    return lora.get_tensor(adapter.saved[name]).to(weight.dtype)
            if adapter is None or name not in adapter.pairs:
                return weight
            a_name, b_name = adapter.pairs[name]
            with safe_open(adapter.path, framework="pt") as lora:
                lora_a, lora_b = lora.get_tensor(a_name).float(), lora.get_tensor(b_name).float()
            if name in adapter.expert_slices:
                _, expert, part, experts = adapter.expert_slices[name]
                delta = one_expert_delta(lora_a, lora_b, expert, part, experts)
                return (weight.float() + adapter.scales[name] * delta).to(weight.dtype)
            if weight.dim() == 3:
                delta = expert_delta(lora_a, lora_b, weight.shape, source.experts_transposed)
                return (weight.float() + adapter.scales[name] * delta).to(weight.dtype)
            merged = weight.float().addmm_(lora_b, lora_a, alpha=adapter.scales[name])
            return merged.to(weight.dtype)

        return load

    for name in names:
        yield name, header[name]["dtype"], list(header[name]["shape"]), produce(name)


def expert_delta(lora_a: torch.Tensor, lora_b: torch.Tensor, shape: Any, transposed: bool) -> torch.Tensor:
    """B A for every expert of a fused 3-D parameter, as peft's ParamWrapper.get_delta_weight: A holds r rows per
    expert ((experts x r) x in), B r columns per expert (out x (r x experts)); the result is experts x out x in,
    or experts x in x out where transformers stores the experts transposed (gpt-oss)."""
    import torch

    experts = shape[0]
    a = lora_a.reshape(experts, -1, lora_a.shape[-1])
    b = lora_b.reshape(lora_b.shape[0], -1, experts)
    return torch.einsum("o r e, e r i -> e i o" if transposed else "o r e, e r i -> e o i", b, a)


def one_expert_delta(lora_a: torch.Tensor, lora_b: torch.Tensor, expert: int, part: int, experts: int) -> torch.Tensor:
    """Expert `expert`'s B A of a fused experts x out x in parameter saved per expert (the layout of
    `expert_delta`): `part` 0 / 1 are the gate and up halves of gate_up_proj's rows, -1 all of them."""
    a = lora_a.reshape(experts, -1, lora_a.shape[-1])[expert]  # r x in
    b = lora_b.reshape(lora_b.shape[0], -1, experts)[:, :, expert]  # out x r
    delta = b @ a
    if part < 0:
        return delta
    half = delta.shape[0] // 2
    return delta[:half] if part == 0 else delta[half:]


def needed_bytes(source: RunSource) -> int:
    if source.quantized_base:
        return 4 * parameters_of(source.model_dir) + 2**20
    return sum(path.stat().st_size for path in weight_files(source.model_dir)) + 2**20


def merge(
    source: RunSource, output: Path, *, overwrite: bool, check: bool = True, notes: list[str] | None = None
) -> Merged:
    """Merge the run into `output` (a transformers model folder) and check its logits against base + adapter."""
    output = Path(output).expanduser()
    check_output(output, kind="merged", overwrite=overwrite, needed_bytes=needed_bytes(source), keep=source.folders)
    with staged(output, "merged", notes) as staging:
        written = write_model(source, staging)
        logits = check_logits(source, staging) if check and source.adapter is not None else None
        if logits is not None and not logits.passed:
            raise ExportError(
                f"the merged model's logits differ from base + adapter by {logits.max_abs_diff:.3g} (allowed "
                f"{logits.tolerance:.3g}); nothing was written"
            )
    return Merged(output, written, source.quantized_base, logits)


def write_model(source: RunSource, folder: Path) -> int:
    """The merged weights, config, generation config and tokenizer files into `folder`; the bytes written."""
    if source.quantized_base:
        written = _write_dequantised(source, folder)
    else:
        written = 0
        shards = weight_files(source.model_dir)
        for shard in shards:
            tensors = list(merged_tensors(source, shard))
            producers = {name: produce for name, _, _, produce in tensors}
            entries = [(name, dtype, shape) for name, dtype, shape, _ in tensors]
            written += write_streamed(folder / shard.name, entries, lambda name, made=producers: made[name]())
        index = source.model_dir / "model.safetensors.index.json"
        if index.is_file():
            shutil.copyfile(index, folder / index.name)
    _write_config(source, folder)
    for name in TOKENIZER_FILES:
        for origin in dict.fromkeys((source.tokenizer_dir, source.model_dir)):
            if (origin / name).is_file():
                shutil.copyfile(origin / name, folder / name)
                break
    for path in folder.iterdir():
        os.chmod(path, default_mode())
    return written


def _stored_dtype(model_dir: Path) -> str:
    """The dtype a quantised checkpoint computes in (its config's dtype), bf16 where it names none."""
    config = json.loads((model_dir / "config.json").read_text())
    name = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16").removeprefix("torch.")
    return name if name in ("float32", "float16", "bfloat16") else "bfloat16"


def _write_config(source: RunSource, folder: Path) -> None:
    config = json.loads((source.model_dir / "config.json").read_text())
    config.pop("quantization_config", None)
    if source.quantized_base:
        config["dtype"] = _stored_dtype(source.model_dir)
        config.pop("torch_dtype", None)
    write_atomic(folder / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation = source.model_dir / "generation_config.json"
    if generation.is_file():
        shutil.copyfile(generation, folder / generation.name)


def parameters_of(model_dir: Path) -> int:
    return from_config_json(model_dir / "config.json").num_params


def _write_dequantised(source: RunSource, folder: Path) -> int:
    """A base stored in 4 or 8 bits has no 16-bit weights: dequantise each layer (bitsandbytes, through peft's
    helper) to the dtype the checkpoint computes in, add the adapter there, and write shards of SHARD_BYTES."""
    import torch
    from peft.utils.integrations import dequantize_bnb_weight
    from safetensors import safe_open

    quiet_libraries()
    dtype = getattr(torch, _stored_dtype(source.model_dir))
    auto_class = auto_model_class(config_model_type(source.model_dir))
    model = auto_class.from_pretrained(source.model_dir, local_files_only=True, dtype=dtype)
    tensors: dict[str, torch.Tensor] = {}
    for module_name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if weight is None or module_name + ".weight" in tensors:
            continue
        if type(weight).__name__ in ("Params4bit", "Int8Params"):
            state = getattr(weight, "quant_state", None) or getattr(module, "state", None)
            tensors[module_name + ".weight"] = dequantize_bnb_weight(weight, state=state).to(dtype)
    for name, value in model.state_dict().items():
        if name not in tensors and value.dtype.is_floating_point:
            tensors[name] = value.to(dtype)
    adapter = source.adapter
    if adapter is not None:
        with safe_open(adapter.path, framework="pt") as lora:
            for name, (a_name, b_name) in adapter.pairs.items():
                expected = (adapter.shapes[b_name][0], adapter.shapes[a_name][1])
                if name not in tensors or tuple(tensors[name].shape) != expected:
                    raise ExportError(
                        f"the base model in {source.model_dir} differs from the one the adapter was trained on "
                        f"({name} is missing or not {list(expected)})"
                    )
                lora_a, lora_b = lora.get_tensor(a_name).float(), lora.get_tensor(b_name).float()
                tensors[name] = tensors[name].float().addmm_(lora_b, lora_a, alpha=adapter.scales[name]).to(dtype)
            for name, copy in adapter.saved.items():  # trained in full (modules_to_save)
                if name in tensors:
                    tensors[name] = lora.get_tensor(copy).to(dtype)
    del model
    shards: list[list[str]] = [[]]
    size = 0
    for name, value in tensors.items():
        nbytes = value.numel() * value.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    written = 0
    weight_map: dict[str, str] = {}
    for number, names in enumerate(shards, 1):
        file = "model.safetensors" if len(shards) == 1 else f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        entries = [(name, _SAFETENSORS_OF[dtype], list(tensors[name].shape)) for name in names]
        written += write_streamed(folder / file, entries, tensors.__getitem__)
        weight_map |= dict.fromkeys(names, file)
    if len(shards) > 1:
        index = {"metadata": {"total_size": written}, "weight_map": weight_map}
        write_atomic(folder / "model.safetensors.index.json", json.dumps(index, indent=2))
    return written


# --- the check ------------------------------------------------------------------------------------------------
CHECK_TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "¿Dónde está la biblioteca? Está cerca del río, ao lado da estação.",
    "def add(a, b):\n    return a + b  # 42",
)


def check_logits(source: RunSource, merged_dir: Path, texts: tuple[str, ...] = CHECK_TEXTS) -> LogitsCheck:
    """Logits of base + adapter (peft) and of the merged folder (plain transformers) on `texts`, one model in
    memory at a time, in fp32 where two fp32 copies fit in RAM, else in the stored dtype; skipped (with the
    reason) where not even that fits."""
    import torch
    from peft import PeftModel

    quiet_libraries()
    auto_class = auto_model_class(config_model_type(source.model_dir))
    stored = next(iter(safetensors_header(weight_files(merged_dir)[0]).values()))["dtype"]
    parameters = parameters_of(merged_dir)
    available = _available_ram()
    dtype = torch.float32
    if available is not None and parameters * 4 * 1.3 > available:
        dtype = getattr(torch, SAFETENSORS_DTYPES.get(stored, "bfloat16"))
        if parameters * dtype.itemsize * 1.3 > available:
            return LogitsCheck(
                None, None, 0, f"needs {parameters * dtype.itemsize * 1.3 / 1e9:.0f} GB of free RAM for the check"
            )
    tokenizer = load_tokenizer([source.tokenizer_dir, source.model_dir])
    batches = [tokenizer(text, return_tensors="pt") for text in texts]

    def logits_of(model: Any) -> list[torch.Tensor]:
        model.eval()
        with torch.no_grad():
            return [model(**batch).logits.float()[0] for batch in batches]

    base = auto_class.from_pretrained(source.model_dir, dtype=dtype, local_files_only=True)
    reference = logits_of(PeftModel.from_pretrained(base, source.run_dir))
    del base
    merged = logits_of(auto_class.from_pretrained(merged_dir, dtype=dtype, local_files_only=True))
    difference = max(float((a - b).abs().max()) for a, b in zip(reference, merged, strict=True))
    scale = max(1.0, max(float(a.abs().max()) for a in reference))
    # bitsandbytes' own 4-bit matmul on the CPU rounds its inputs (0.4 % per layer measured against the exact
    # dequantised weights), so a quantised base is held to the 16-bit tolerance whatever the stored dtype
    tolerance = LOGIT_TOLERANCE["BF16" if source.quantized_base else stored] * scale
    return LogitsCheck(difference, tolerance, len(texts))


def _available_ram() -> int | None:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        return None
