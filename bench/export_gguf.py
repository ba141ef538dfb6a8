"""`make bench-export`: lorafit's GGUF writer against llama.cpp's own converter, on a TinyLlama-1.1B-shaped model.

1. Builds, in bench/out/export-gguf/, TinyLlama-1.1B's shape (22 layers, hidden 2048, intermediate 5632, 32 heads,
   4 KV heads, head_dim 64, rope_theta 10000, untied) with random bf16 weights and the demo's byte-level BPE (its
   vocabulary is as large as the demo corpus allows, and the embedding has that many rows). The model is kept
   and reused by later runs.
2. Converts it to f16 with `lorafit.export.gguf.write_gguf`, and with llama.cpp's convert_hf_to_gguf.py from the
   llama-cpp-python source distribution of the installed version (fetched with `pip download` once, run with its
   own gguf-py), each in a fresh subprocess: wall time, CPU time and peak RSS (getrusage of that child).
   llama.cpp's converter names the pre-tokenizer by hashing token ids, which no hash of its list matches for a
   vocabulary trained here, so it runs through a wrapper whose `get_vocab_base_pre` answers "gpt-2" - the
   pre-tokenizer lorafit identifies for this tokenizer by behaviour.
3. Compares the two files with gguf-py's GGUFReader: every tensor (name, shape, type, bytes; the largest absolute
   difference of any that differ), every metadata key except the general.* naming keys (listed apart), and, where
   llama-cpp-python is installed, what llama.cpp itself reads from each file (special tokens, add-BOS, the token
   ids of a probe text) - so a metadata difference shows whether it changes anything.
4. Prints the figures and writes them to bench/results/export-gguf.json (--tiny: bench/out/). The project's goal:
   identical tensors, faster than llama.cpp's converter, peak RSS under a quarter of the model's size. Exits 1 only
   if tensors differ.

With --family, another catalog model's shape (--tiny only): Qwen3-MoE, Mixtral and gpt-oss with 4 experts (2 a
token), Gemma 3, Mistral Small 3.1 and Qwen2.5-VL with a 2-layer vision tower (lorafit writes their language
model; llama.cpp's converter, given the same folder, writes the text model too) - the same tensor and metadata
comparison.

    python bench/export_gguf.py [--tiny] [--family PRESET] [--json FILE] [--workdir DIR] [--keep]
                                [--llama-cpp-version V]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from lorafit.files import write_atomic
from lorafit.models import ModelSpec, catalog

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"
RESULT = ROOT / "bench" / "results" / "export-gguf.json"
CATALOG_MODEL = "tinyllama-1.1b"
# --family: the GGUF families beyond the dense ones, each at the --tiny shape
MOE_FAMILIES = ("qwen3-30b-a3b", "mixtral-8x7b", "gpt-oss-20b")
FAMILIES = (CATALOG_MODEL, *MOE_FAMILIES, "gemma-3-4b", "mistral-small-3.1-24b", "qwen2.5-vl-7b", "qwen3-vl-8b")
TINY_EXPERTS = {"num_local_experts": 4, "num_experts_per_tok": 2}
TINY_VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
               "image_size": 28}  # fmt: skip
REQUESTED_VOCAB = 32000  # TinyLlama's; the demo corpus yields fewer merges, and the model gets the tokenizer's size
TINY = {"hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64}  # fmt: skip
# llama-cpp-python whose sdist vendors the converter, when none is installed to take the version from
LLAMA_CPP_PYTHON = "0.3.36"
# Keys that name the file rather than describe the model: each converter derives them its own way
NAMING_KEYS = ("general.name", "general.basename", "general.finetune", "general.size_label", "general.version")
DERIVED_KEYS = ("GGUF.kv_count",)  # the reader's count of the keys, which differs whenever the keys do
PRE_TOKENIZER = "gpt-2"
GOAL_RSS_FRACTION = 0.25

# Prefixed to every measured child: at exit it writes its own peak RSS (VmHWM, KiB) where measure() reads it
PEAK_HOOK = """
import atexit as _atexit, os as _os
def _write_peak():
    try:
        with open("/proc/self/status") as status:
            kib = next(line.split()[1] for line in status if line.startswith("VmHWM:"))
        with open(_os.environ["BENCH_PEAK_FILE"], "w") as out:
            out.write(kib)
    except (OSError, KeyError, StopIteration):
        pass
_atexit.register(_write_peak)
"""
# The floor under both peaks: Python with what both converters import, converting nothing
CHILD_IMPORTS = """
import gguf, numpy, safetensors, torch, transformers
"""
CHILD_LORAFIT = """
import sys
from pathlib import Path
from lorafit.export.gguf import write_gguf
write_gguf(Path(sys.argv[1]), Path(sys.argv[2]), "f16")
"""
# llama.cpp's converter, unchanged but for the pre-tokenizer's name (see the module docstring); it must use its own
# gguf-py, which PYTHONPATH puts first
CHILD_LLAMA_CPP = """
import runpy, sys
from pathlib import Path
script = Path(sys.argv[1])
sys.path[:0] = [str(script.parent), str(script.parent / "gguf-py")]
import gguf
assert Path(gguf.__file__).resolve().is_relative_to((script.parent / "gguf-py").resolve()), gguf.__file__
from conversion import base
pre_tokenizer = sys.argv[2]
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre_tokenizer
sys.argv = [str(script), *sys.argv[3:]]
runpy.run_path(str(script), run_name="__main__")
"""
# What llama.cpp reads from a file's vocabulary: one JSON line on stdout (its log goes to stderr)
CHILD_BEHAVIOUR = """
import json, sys
import llama_cpp
llama_cpp.llama_backend_init()
params = llama_cpp.llama_model_default_params()
params.vocab_only = True
model = llama_cpp.llama_model_load_from_file(sys.argv[1].encode(), params)
if not model:
    sys.exit("llama.cpp could not load " + sys.argv[1])
vocab = llama_cpp.llama_model_get_vocab(model)
text = sys.argv[2].encode()
buffer = (llama_cpp.llama_token * (4 * len(text) + 8))()
count = llama_cpp.llama_tokenize(vocab, text, len(text), buffer, len(buffer), True, True)
print(json.dumps({
    "n_vocab": llama_cpp.llama_vocab_n_tokens(vocab),
    "vocab_type": llama_cpp.llama_vocab_type(vocab),
    "bos": llama_cpp.llama_vocab_bos(vocab), "eos": llama_cpp.llama_vocab_eos(vocab),
    "eot": llama_cpp.llama_vocab_eot(vocab), "pad": llama_cpp.llama_vocab_pad(vocab),
    "add_bos": bool(llama_cpp.llama_vocab_get_add_bos(vocab)),
    "add_eos": bool(llama_cpp.llama_vocab_get_add_eos(vocab)),
    "probe_token_ids": list(buffer[:count]),
}))
"""


# --- the model ----------------------------------------------------------------------------------------------
def model_spec(vocab_size: int, tiny: bool = False, family: str = CATALOG_MODEL) -> ModelSpec:
    """TinyLlama-1.1B (or `family`) from the catalog with the tokenizer's vocabulary (and, for --tiny, hidden 256 x
    2 layers; an MoE's 4 experts, an image-text model's 2-layer vision tower)."""
    spec = catalog()[family]
    shape: dict[str, Any] = dict(TINY) if tiny else {}
    if spec.is_moe:
        shape |= TINY_EXPERTS | ({"moe_intermediate_size": 128} if spec.moe_intermediate_size else {})
    if spec.vision is not None:
        shape["vision"] = spec.vision.model_copy(update=TINY_VISION).model_dump()
    untied = {"tie_word_embeddings": False} if family == CATALOG_MODEL else {}
    return spec.scaled(name=f"{family}-random{'-tiny' if tiny else ''}", vocab_size=vocab_size, **untied, **shape)


def build(model_dir: Path, tiny: bool = False, family: str = CATALOG_MODEL) -> ModelSpec:
    """Random bf16 weights and the demo tokenizer in `model_dir`, reused when an earlier run finished it."""
    from lorafit.train import demo

    marker = model_dir / "bench-model.json"
    if marker.is_file():
        return ModelSpec.model_validate(json.loads(marker.read_text()))
    shutil.rmtree(model_dir, ignore_errors=True)
    tokenizer = demo.build_tokenizer(demo.corpus(), REQUESTED_VOCAB)
    spec = model_spec(len(tokenizer), tiny, family)
    demo.build_model(model_dir, tokenizer, spec, dtype="bfloat16")
    config = json.loads((model_dir / "config.json").read_text())
    text = config.get("text_config", config)
    if "query_pre_attn_scalar" in text:  # Gemma 3 4B/12B's 1/sqrt(head_dim) at the shrunk head_dim (default: 256)
        text["query_pre_attn_scalar"] = text["head_dim"]
        write_atomic(model_dir / "config.json", json.dumps(config, indent=2))
    write_atomic(marker, spec.model_dump_json())
    return spec


def build_apart(model_dir: Path, tiny: bool = False, family: str = CATALOG_MODEL) -> ModelSpec:
    """`build` in a child, so that this process never holds the model (its peak would become the children's
    ru_maxrss floor, and the memory stays taken while they run)."""
    code = "import sys; sys.path.insert(0, sys.argv[1]); from export_gguf import build; from pathlib import Path; "
    code += "build(Path(sys.argv[2]), sys.argv[3] == 'tiny', sys.argv[4])"
    folder = str(Path(__file__).parent)
    subprocess.run([sys.executable, "-c", code, folder, str(model_dir), "tiny" * tiny, family], check=True)
    return build(model_dir, tiny, family)  # reads the spec the child recorded


def weights_bytes(model_dir: Path) -> int:
    return sum(path.stat().st_size for path in model_dir.glob("*.safetensors"))


def read_through(model_dir: Path) -> None:
    """Read the weights once, so that both converters find them in the page cache, not only the second."""
    for path in model_dir.glob("*.safetensors"):
        with path.open("rb") as handle:
            while handle.read(64 << 20):
                pass


# --- running and measuring ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Measured:
    seconds: float
    cpu_seconds: float
    peak_rss_bytes: int
    returncode: int
    peak_rss_source: str  # VmHWM (the child's own) or ru_maxrss
    stdout: str = ""
    stderr_tail: str = ""


def measure(code: str, args: list[str], env: dict[str, str] | None = None) -> Measured:
    """Run Python `code` with `args` in a fresh interpreter: wall time, CPU time and peak RSS.

    The peak is the child's VmHWM, which it writes at exit (PEAK_HOOK): the kernel's ru_maxrss of a child starts
    from its parent's peak (the mm that fork or vfork copies or shares), so it would report the bench's own peak
    whenever that is higher. Where /proc is missing, ru_maxrss it is."""
    import tempfile

    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, tempfile.TemporaryDirectory() as tmp:
        peak_file = Path(tmp) / "peak"
        env = (env or dict(os.environ)) | {"BENCH_PEAK_FILE": str(peak_file)}
        start = time.perf_counter()
        process = subprocess.Popen([sys.executable, "-c", PEAK_HOOK + code, *args], stdout=out, stderr=err, env=env)
        _, status, usage = os.wait4(process.pid, 0)
        seconds = time.perf_counter() - start
        process.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
        hwm_kib = int(peak_file.read_text()) if peak_file.is_file() else None
    kib = hwm_kib or (usage.ru_maxrss if sys.platform != "darwin" else usage.ru_maxrss // 1024)
    return Measured(
        seconds,
        usage.ru_utime + usage.ru_stime,
        kib * 1024,
        process.returncode,
        "VmHWM" if hwm_kib else "ru_maxrss",
        stdout,
        stderr[-3000:],
    )


def llama_cpp_version() -> str:
    try:
        return metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError:
        return LLAMA_CPP_PYTHON


def extracted_converter(version: str, dest: Path) -> Path | None:
    """convert_hf_to_gguf.py of that version where an earlier run extracted it into `dest`."""
    root = dest / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    script = root / "convert_hf_to_gguf.py"
    return script if script.is_file() and (root / "gguf-py" / "gguf").is_dir() else None


def llama_cpp_converter(version: str, dest: Path) -> Path:
    """convert_hf_to_gguf.py (with conversion/ and gguf-py/) from llama-cpp-python's sdist, fetched once by pip."""
    if script := extracted_converter(version, dest):
        return script
    dest.mkdir(parents=True, exist_ok=True)
    archive = dest / f"llama_cpp_python-{version}.tar.gz"
    if not archive.is_file():
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", f"llama-cpp-python=={version}", "--no-deps",
             "--no-binary", ":all:", "-d", str(dest)],
            check=True,
        )  # fmt: skip
    prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
    wanted = (prefix + "convert_hf_to_gguf.py", prefix + "conversion/", prefix + "gguf-py/")
    with tarfile.open(archive) as tar:
        members = [member for member in tar.getmembers() if member.name.startswith(wanted)]
        tar.extractall(dest, members=members, filter="data")
    if not (script := extracted_converter(version, dest)):
        raise SystemExit(f"{archive.name} has no vendor/llama.cpp/convert_hf_to_gguf.py with gguf-py beside it")
    return script


def convert_lorafit(model_dir: Path, target: Path) -> Measured:
    return measure(CHILD_LORAFIT, [str(model_dir), str(target)])


def convert_llama_cpp(script: Path, model_dir: Path, target: Path) -> Measured:
    gguf_py = script.parent / "gguf-py"
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(gguf_py), os.environ.get("PYTHONPATH", "")])}
    args = [str(script), PRE_TOKENIZER, str(model_dir), "--outtype", "f16", "--outfile", str(target)]
    return measure(CHILD_LLAMA_CPP, args, env=env)


# --- comparing ----------------------------------------------------------------------------------------------
@dataclass
class TensorReport:
    equal: list[str] = field(default_factory=list)
    different: list[dict[str, Any]] = field(default_factory=list)  # name, what differs, max_abs_difference
    only_lorafit: list[str] = field(default_factory=list)
    only_llama_cpp: list[str] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return not (self.different or self.only_lorafit or self.only_llama_cpp)


def compare_tensors(lorafit_file: Path, llama_cpp_file: Path) -> TensorReport:
    """Every tensor of the two files: same name, shape, type and bytes; the largest |difference| where not."""
    import gguf
    import numpy as np

    ours = {tensor.name: tensor for tensor in gguf.GGUFReader(lorafit_file).tensors}
    theirs = {tensor.name: tensor for tensor in gguf.GGUFReader(llama_cpp_file).tensors}
    report = TensorReport([], [], sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours)))
    for name in [name for name in ours if name in theirs]:
        a, b = ours[name], theirs[name]
        shape_a, shape_b = [int(n) for n in a.shape], [int(n) for n in b.shape]
        if shape_a != shape_b or a.tensor_type != b.tensor_type:
            report.different.append(
                {"name": name, "lorafit": f"{a.tensor_type.name} {shape_a}", "llama_cpp": f"{b.tensor_type.name} "
                 f"{shape_b}", "max_abs_difference": None}
            )  # fmt: skip
            continue
        bytes_a, bytes_b = np.asarray(a.data).view(np.uint8), np.asarray(b.data).view(np.uint8)
        if np.array_equal(bytes_a, bytes_b):
            report.equal.append(name)
            continue
        values_a = gguf.quants.dequantize(np.asarray(a.data), a.tensor_type).astype(np.float64)
        values_b = gguf.quants.dequantize(np.asarray(b.data), b.tensor_type).astype(np.float64)
        differing = int(np.count_nonzero(bytes_a.reshape(-1) != bytes_b.reshape(-1)))
        report.different.append(
            {"name": name, "lorafit": f"{a.tensor_type.name} {shape_a}", "llama_cpp": "same type and shape",
             "differing_bytes": differing, "max_abs_difference": float(np.nanmax(np.abs(values_a - values_b)))}
        )  # fmt: skip
    return report


def field_value(reader_field: Any) -> Any:
    value = reader_field.contents()
    return value.tolist() if hasattr(value, "tolist") else value


def field_types(reader_field: Any) -> list[str]:
    return [kind.name for kind in reader_field.types]


@dataclass
class MetadataReport:
    only_lorafit: dict[str, Any] = field(default_factory=dict)
    only_llama_cpp: dict[str, Any] = field(default_factory=dict)
    different: dict[str, dict[str, Any]] = field(default_factory=dict)  # key -> lorafit, llama_cpp (value, types)
    naming: dict[str, dict[str, Any]] = field(default_factory=dict)  # not compared: key -> lorafit, llama_cpp
    equal: int = 0

    @property
    def identical(self) -> bool:
        return not (self.only_lorafit or self.only_llama_cpp or self.different)


def shorten(value: Any, limit: int = 120) -> Any:
    """Long values (token lists, chat templates) shown by their length and start, not whole."""
    if isinstance(value, list) and len(value) > 8:
        return f"[{len(value)} items: {', '.join(repr(item) for item in value[:4])}, ...]"
    text = repr(value)
    return value if len(text) <= limit else text[:limit] + "..."


def first_difference(a: Any, b: Any) -> str:
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"lengths {len(a)} and {len(b)}"
        index = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
        return f"item {index}: {a[index]!r} and {b[index]!r}"
    return ""


def compare_metadata(lorafit_file: Path, llama_cpp_file: Path) -> MetadataReport:
    """Every key of the two files, value and GGUF type; the naming keys apart, not counted as differences."""
    import gguf

    ours, theirs = gguf.GGUFReader(lorafit_file).fields, gguf.GGUFReader(llama_cpp_file).fields
    report = MetadataReport()
    for key in sorted(set(ours) | set(theirs)):
        if key in DERIVED_KEYS:
            continue
        a = field_value(ours[key]) if key in ours else None
        b = field_value(theirs[key]) if key in theirs else None
        if key in NAMING_KEYS:
            report.naming[key] = {"lorafit": a, "llama_cpp": b}
        elif key not in theirs:
            report.only_lorafit[key] = shorten(a)
        elif key not in ours:
            report.only_llama_cpp[key] = shorten(b)
        elif a != b or field_types(ours[key]) != field_types(theirs[key]):
            report.different[key] = {
                "lorafit": shorten(a),
                "llama_cpp": shorten(b),
                "types": [field_types(ours[key]), field_types(theirs[key])],
                "first_difference": first_difference(a, b),
            }
        else:
            report.equal += 1
    return report


def behaviour(path: Path, probe: str) -> dict[str, Any] | None:
    """What llama.cpp reads from the file's vocabulary; None where llama-cpp-python is not installed."""
    try:
        metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError:
        return None
    result = subprocess.run(
        [sys.executable, "-c", CHILD_BEHAVIOUR, str(path), probe], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        return {"error": (result.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(result.stdout.strip().splitlines()[-1])


# --- the run ------------------------------------------------------------------------------------------------
def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


@dataclass(frozen=True)
class Repeats:
    """One converter's runs: the median wall and CPU time (the machine is shared), the highest peak RSS."""

    runs: list[Measured]

    @property
    def seconds(self) -> float:
        return statistics.median(run.seconds for run in self.runs)

    @property
    def cpu_seconds(self) -> float:
        return statistics.median(run.cpu_seconds for run in self.runs)

    @property
    def peak_rss_bytes(self) -> int:
        return max(run.peak_rss_bytes for run in self.runs)

    def to_json(self, file_bytes: int, model_bytes: int) -> dict[str, Any]:
        return {
            "seconds_median": self.seconds,
            "seconds_min": min(run.seconds for run in self.runs),
            "cpu_seconds_median": self.cpu_seconds,
            "peak_rss_bytes_max": self.peak_rss_bytes,
            "peak_rss_bytes_min": min(run.peak_rss_bytes for run in self.runs),
            "peak_rss_of_model": self.peak_rss_bytes / model_bytes,
            "file_bytes": file_bytes,
            "repeats": [measured_json(run) for run in self.runs],
        }


def measured_json(run: Measured) -> dict[str, Any]:
    return {key: value for key, value in asdict(run).items() if key not in ("stdout", "stderr_tail")}


def print_run(label: str, run: Repeats | Measured, file_bytes: int | None, model_bytes: int) -> None:
    spread = ""
    if isinstance(run, Repeats) and len(run.runs) > 1:
        low = min(r.peak_rss_bytes for r in run.runs)
        spread = f"  (wall {min(r.seconds for r in run.runs):.1f}-{max(r.seconds for r in run.runs):.1f} s, "
        spread += f"peak {gib(low)}-{gib(run.peak_rss_bytes)})"
    share = f"{run.peak_rss_bytes / model_bytes:>10.1%}{gib(file_bytes):>12}" if file_bytes else ""
    print(f"  {label:<14}{run.seconds:>9.1f} s{run.cpu_seconds:>9.1f} s{gib(run.peak_rss_bytes):>12}{share}{spread}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="hidden 256 x 2 layers: the whole path in seconds")
    parser.add_argument("--json", type=Path, help=f"default {RESULT.relative_to(ROOT)} (--tiny: bench/out/)")
    parser.add_argument("--workdir", type=Path, default=OUT / "export-gguf")
    parser.add_argument("--keep", action="store_true", help="keep the two GGUF files (the model is always kept)")
    parser.add_argument("--llama-cpp-version", default=llama_cpp_version())
    parser.add_argument("--repeat", type=int, default=3, help="runs of each converter, in alternating order")
    parser.add_argument("--family", choices=FAMILIES, default=CATALOG_MODEL, help="another shape (with --tiny)")
    args = parser.parse_args(argv)
    if args.family != CATALOG_MODEL and not args.tiny:
        parser.error("--family runs at the --tiny shape only")
    other = "" if args.family == CATALOG_MODEL else f"-{args.family}"
    json_path = args.json or (OUT / f"export-gguf{other}-tiny.json" if args.tiny else RESULT)
    work = args.workdir
    model_dir = work / (f"model{other}-tiny" if args.tiny else "model")

    from lorafit.export.gguf_vocab import PRETOKENIZER_PROBE

    script = llama_cpp_converter(args.llama_cpp_version, OUT / "llama-src")
    print(f"== {'tiny ' if args.tiny else ''}{args.family} shape, random bf16 weights, in {model_dir} ==")
    start = time.perf_counter()
    spec = build_apart(model_dir, args.tiny, args.family)
    model_bytes = weights_bytes(model_dir)
    print(
        f"  {spec.num_hidden_layers} layers, hidden {spec.hidden_size}, intermediate {spec.intermediate_size}, "
        f"{spec.num_attention_heads} heads / {spec.num_key_value_heads} KV, head_dim {spec.head_size}, vocab "
        f"{spec.vocab_size}: {gib(model_bytes)} of safetensors (ready in {time.perf_counter() - start:.0f} s)"
    )
    read_through(model_dir)
    ours, theirs = work / "lorafit-f16.gguf", work / "llama-cpp-f16.gguf"
    for path in (ours, theirs):
        path.unlink(missing_ok=True)

    print(f"\n== f16 conversion, each in a fresh subprocess ({os.cpu_count()} CPUs) ==")
    print(f"  llama.cpp's convert_hf_to_gguf.py from llama-cpp-python {args.llama_cpp_version}, its own gguf-py;")
    print(f'  run with get_vocab_base_pre replaced by "{PRE_TOKENIZER}" (its token-id hash knows no vocabulary')
    print(f'  trained here; lorafit identifies "{PRE_TOKENIZER}" for this tokenizer by behaviour)')
    imports = measure(CHILD_IMPORTS, [])
    converters = {
        "lorafit": lambda: convert_lorafit(model_dir, ours),
        "llama_cpp": lambda: convert_llama_cpp(script, model_dir, theirs),
    }
    measured: dict[str, list[Measured]] = {label: [] for label in converters}
    for repeat in range(max(1, args.repeat)):
        for label in list(converters)[:: 1 if repeat % 2 == 0 else -1]:
            (ours if label == "lorafit" else theirs).unlink(missing_ok=True)
            run = converters[label]()
            if run.returncode != 0:
                print(f"{label} failed (exit {run.returncode}):\n{run.stderr_tail}", file=sys.stderr)
                return 2
            measured[label].append(run)
    runs = {label: Repeats(values) for label, values in measured.items()}
    print(f"  {len(runs['lorafit'].runs)} runs of each, alternating which goes first: median times, highest peak")
    print(f"  {'':<14}{'wall':>11}{'CPU':>11}{'peak RSS':>12}{'of model':>10}{'file':>12}")
    print_run("lorafit", runs["lorafit"], ours.stat().st_size, model_bytes)
    print_run("llama.cpp", runs["llama_cpp"], theirs.stat().st_size, model_bytes)
    print_run("imports only", imports, None, model_bytes)
    speedup = runs["llama_cpp"].seconds / runs["lorafit"].seconds
    rss_fraction = runs["lorafit"].peak_rss_bytes / model_bytes
    print(f"  lorafit is {speedup:.2f}x llama.cpp's speed (wall); its peak RSS is {rss_fraction:.1%} of the model")

    tensors = compare_tensors(ours, theirs)
    print(f"\n== tensors: {len(tensors.equal)} identical, {len(tensors.different)} different ==")
    for entry in tensors.different:
        print(f"  {entry['name']}: lorafit {entry['lorafit']}, llama.cpp {entry['llama_cpp']}, "
              f"max |difference| {entry['max_abs_difference']}")  # fmt: skip
    for label, names in (("only lorafit", tensors.only_lorafit), ("only llama.cpp", tensors.only_llama_cpp)):
        if names:
            print(f"  {label}: {', '.join(names)}")

    keys = compare_metadata(ours, theirs)
    print(f"\n== metadata: {keys.equal} keys equal, {len(keys.different)} different, {len(keys.only_lorafit)} only in "
          f"lorafit's file, {len(keys.only_llama_cpp)} only in llama.cpp's ==")  # fmt: skip
    for key, values in keys.different.items():
        print(f"  differs  {key}: lorafit {values['lorafit']!r}, llama.cpp {values['llama_cpp']!r} "
              f"{values['first_difference']}".rstrip())  # fmt: skip
    for key, value in keys.only_lorafit.items():
        print(f"  only lorafit    {key} = {value!r}")
    for key, value in keys.only_llama_cpp.items():
        print(f"  only llama.cpp  {key} = {value!r}")
    print(f"  naming keys, not compared ({', '.join(NAMING_KEYS)}):")
    for key, values in keys.naming.items():
        print(f"    {key}: lorafit {values['lorafit']!r}, llama.cpp {values['llama_cpp']!r}")

    probe = PRETOKENIZER_PROBE + "<|user|>hi<|end|><|assistant|>"
    read = {"lorafit": behaviour(ours, probe), "llama_cpp": behaviour(theirs, probe)}
    if read["lorafit"] is not None:
        same = read["lorafit"] == read["llama_cpp"]
        print("\n== what llama.cpp reads from each file (vocabulary, special tokens, the probe's token ids) ==")
        print(f"  {'the same' if same else 'DIFFERENT'}: " + ", ".join(
            f"{key} {value}" for key, value in (read["lorafit"] or {}).items() if key != "probe_token_ids"
        ) + f", {len(read['lorafit'].get('probe_token_ids', []))} probe tokens")  # fmt: skip
        if not same:
            print(f"  llama.cpp's file: {read['llama_cpp']}")

    goals = {
        "identical_tensors": tensors.identical,
        "faster_than_llama_cpp": speedup > 1,
        "peak_rss_under_a_quarter_of_model": rss_fraction < GOAL_RSS_FRACTION,
    }
    labels = ("identical tensors", "faster than llama.cpp's converter", "peak RSS under a quarter of the model")
    print("\n== goals ==")
    for label, met in zip(labels, goals.values(), strict=True):
        print(f"  {'met    ' if met else 'NOT met'}  {label}")

    result = {
        "command": "python bench/export_gguf.py"
        + (" --tiny" if args.tiny else "")
        + (f" --family {args.family}" * bool(other)),
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "environment": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "cpu": platform.processor() or platform.machine(),
            "gguf_lorafit": metadata.version("gguf"),
            "llama_cpp_python_sdist": args.llama_cpp_version,
            "torch": metadata.version("torch"),
            "transformers": metadata.version("transformers"),
        },
        "model": spec.model_dump(
            include={
                "name",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "vocab_size",
                "tie_word_embeddings",
            }
        )  # fmt: skip
        | {"dtype": "bfloat16", "rope_theta": 10000.0, "safetensors_bytes": model_bytes},
        "llama_cpp_pre_tokenizer": f"get_vocab_base_pre replaced to return {PRE_TOKENIZER!r} (lorafit identifies it)",
        "runs": {
            label: run.to_json(path.stat().st_size, model_bytes)
            for (label, run), path in zip(runs.items(), (ours, theirs), strict=True)
        },
        "imports_only": measured_json(imports),
        "speedup_wall": speedup,
        "tensors": {
            "equal": len(tensors.equal),
            "different": tensors.different,
            "only_lorafit": tensors.only_lorafit,
            "only_llama_cpp": tensors.only_llama_cpp,
        },  # fmt: skip
        "metadata": asdict(keys) | {"not_compared": list(NAMING_KEYS + DERIVED_KEYS)},
        "llama_cpp_reads": read,
        "goals": goals,
    }
    json_path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(json_path, json.dumps(result, indent=2, default=str) + "\n")
    print(f"\nwrote {json_path}")
    if not args.keep:
        ours.unlink()
        theirs.unlink()
    return 0 if tensors.identical else 1


if __name__ == "__main__":
    sys.exit(main())
