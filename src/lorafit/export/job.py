"""One export, from a run folder to the files people run: checked up front, written under a hidden name, verified,
then renamed into place. Nothing half-written ever sits under the output's name.

`--to merged` writes a transformers folder. `--to gguf` merges into a hidden folder inside the staging area,
writes the 16-bit or q8_0 files from it directly, makes the K-quants with llama.cpp's quantizer from a 16-bit one,
loads each file in llama.cpp and compares it with the merged model (unless --no-verify), and writes an Ollama
Modelfile beside the smallest file with --ollama.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lorafit.data import load_conversations
from lorafit.errors import ExportError, LorafitError
from lorafit.export import gguf as gguf_writer
from lorafit.export import merge, verify
from lorafit.export import ollama as ollama_files
from lorafit.export.output import check_output, staged
from lorafit.export.source import RunSource, open_run, weight_files
from lorafit.options import GgufType
from lorafit.train.chat import quiet_stderr, run_folder
from lorafit.train.config import run_config

# Bytes per weight of each GGUF type, for the disk check before writing (K-quant mixes at their largest share).
BYTES_PER_WEIGHT = {
    "f32": 4.0,
    "f16": 2.0,
    "bf16": 2.0,
    "q8_0": 1.07,
    "q6_k": 0.83,
    "q5_k_m": 0.72,
    "q5_k_s": 0.70,
    "q4_k_m": 0.62,
    "q4_k_s": 0.58,
    "q3_k_m": 0.50,
}


@dataclass
class ExportResult:
    files: dict[str, Path] = field(default_factory=dict)
    verify: dict[str, dict[str, Any]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        files = {key: str(path) for key, path in self.files.items()}
        return {"files": files, "verify": self.verify, "notes": self.notes}


def export_merged(run_dir: Path, output: Path, *, overwrite: bool) -> ExportResult:
    source = open_run(run_dir)
    result = ExportResult()
    merged = merge.merge(source, Path(output), overwrite=overwrite, notes=result.notes)
    result.files = {"merged": merged.folder}
    if source.quantized_base:
        result.notes.append(
            f"the base in {source.model_dir} is stored quantised: its weights were dequantised before "
            "merging (a 16-bit base would give a better merged model)"
        )
    if merged.check is not None:
        check = merged.check
        if check.skipped:
            result.notes.append(f"logits check skipped: {check.skipped}")
        else:
            result.verify["merged"] = {"max_abs_logit_diff": check.max_abs_diff, "tolerance": check.tolerance}
    return result


def export_gguf(
    run_dir: Path,
    output: Path,
    types: list[GgufType],
    *,
    overwrite: bool,
    check: bool,
    ollama: bool,
    progress: Callable[[str], None] = lambda _: None,
) -> ExportResult:
    types = list(dict.fromkeys(types or ["f16"]))
    output = Path(output).expanduser()
    source = open_run(run_dir)
    # an unsupported family fails here, before the merge
    arch = gguf_writer.architecture(source.model_dir, dequantised=source.quantized_base)
    k_quants = [t for t in types if t not in gguf_writer.DIRECT]
    have_llama_cpp = verify.llama_cpp_available() if k_quants or check else False
    if k_quants and not have_llama_cpp:
        raise ExportError(
            f"--quant {k_quants[0]} is made by llama.cpp's quantizer: pip install 'lorafit[gguf]' "
            "(builds llama-cpp-python), or choose f16, bf16 or q8_0"
        )
    if not check:
        unchecked = "not verified (--no-verify)"
    elif not have_llama_cpp:
        check, unchecked = False, "not verified: llama-cpp-python is not installed (pip install 'lorafit[gguf]')"
    parameters = merge.parameters_of(source.model_dir)
    intermediate = None if any(t in ("f16", "bf16") for t in types) or not k_quants else "f16"
    needed = int(sum(BYTES_PER_WEIGHT[t] for t in types) * parameters)
    needed += int(2 * parameters) if intermediate else 0
    needed += 0 if source.adapter is None else sum(path.stat().st_size for path in weight_files(source.model_dir))
    check_output(output, kind="gguf", overwrite=overwrite, needed_bytes=needed, keep=source.folders)
    result = ExportResult()
    with staged(output, "gguf", result.notes) as staging:
        merged_dir = source.run_dir
        if source.adapter is not None or source.quantized_base:
            merged_dir = staging / ".merged"
            merged_dir.mkdir()
            progress("merging the adapter into the base")
            merge.write_model(source, merged_dir)
        stem = run_name(source)
        written: dict[str, Path] = {}
        vocabulary = None
        for file_type in [t for t in types if t in gguf_writer.DIRECT] + ([intermediate] if intermediate else []):
            target = staging / (f"{stem}-{file_type}.gguf" if file_type in types else f".{stem}-{file_type}.gguf")
            progress(f"writing {target.name.lstrip('.')}")
            vocabulary = gguf_writer.write_gguf(merged_dir, target, file_type, name=stem).vocabulary
            written[file_type] = target
        sixteen = next(written[t] for t in ("f16", "bf16", "f32", "q8_0") if t in written)
        for file_type in k_quants:
            target = staging / f"{stem}-{file_type}.gguf"
            progress(f"quantizing to {target.name} (llama.cpp)")
            with quiet_stderr():
                gguf_writer.quantize(sixteen, target, file_type)
            written[file_type] = target
        if intermediate:
            written.pop(intermediate).unlink()
        assert vocabulary is not None
        if check:
            progress("checking each file in llama.cpp against the merged model")
            figures = verify.verify(merged_dir, {t: written[t] for t in types}, vocabulary, heldout_rows(source))
            problems = verify.failures(figures)
            if problems:
                raise ExportError(f"the GGUF export failed its check, nothing was written: {problems[0]}")
            result.verify = {t: figures[t].as_dict() for t in types}
        else:
            result.notes.append(unchecked)
        if ollama:
            # one Modelfile, for the smallest file: the one that runs on the smallest card
            smallest = min(types, key=lambda t: written[t].stat().st_size)
            final = output / written[smallest].name  # the Modelfile names it relatively; the command, where it ends
            result.notes.append(_write_modelfile(staging, final, vocabulary, stem))
        if merged_dir != source.run_dir:
            shutil.rmtree(merged_dir)
    if arch.entry.get("text_config"):
        result.notes.append(
            f"the GGUF holds the language model only, not the {arch.model_type} vision tower and projector: "
            f"llama.cpp's convert_hf_to_gguf.py --mmproj writes them from `lorafit export {source.run_dir} --to merged`"
        )
    result.files = {t: output / written[t].name for t in types}
    if ollama:
        result.files["modelfile"] = output / ollama_files.MODELFILE_NAME
    return result


def heldout_rows(source: RunSource, rows: int = 24) -> list[list[dict[str, str]]]:
    """The first held-out conversations of the run (its eval data, else its data), read with the run's own
    format and mapping; none when the files moved or the run left no config."""
    try:
        config = run_config(run_folder(source.run_dir))
        path = config.get("eval_data") or config.get("data")
        loaded = load_conversations(Path(path), config.get("data_format"), config.get("data_mapping") or None)
        return [list(row) for row, _ in zip(loaded, range(rows), strict=False)]
    except (OSError, ValueError, TypeError, AttributeError, LorafitError):
        return []


def run_name(source: RunSource) -> str:
    return run_folder(source.run_dir).resolve().name or "model"


def _write_modelfile(folder: Path, gguf_path: Path, vocabulary: gguf_writer.Vocabulary, name: str) -> str:
    bos = vocabulary.tokens[vocabulary.special["bos"]] if vocabulary.add_bos and "bos" in vocabulary.special else None
    modelfile = ollama_files.modelfile(
        gguf_path,
        chat_template=vocabulary.chat_template,
        stop_tokens=vocabulary.stop_tokens(),
        bos_token=bos,
        name=name,
    )
    ollama_files.write_modelfile(folder, modelfile)
    return f"Modelfile for {gguf_path.name}: {modelfile.note}; run: {modelfile.create_command}"
