"""GPUs: the catalog (catalog/gpus.toml, every figure with a source and a date) and local detection."""

from __future__ import annotations

import difflib
import math
import os
import platform
import re
import tomllib
from functools import cache
from importlib import resources
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from lorafit.errors import UnknownGpu
from lorafit.messages import say
from lorafit.units import BYTES_PER_MIB, gib, gib_to_bytes

GpuKind = Literal["consumer", "workstation", "datacenter", "apple"]


class GpuSpec(BaseModel):
    """One accelerator as the planner sees it: memory to fit into, throughput to divide by, prices to pay."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    aliases: list[str] = []
    kind: GpuKind
    architecture: str
    memory_gb: float = Field(gt=0, description="memory as the card is sold ('24 GB'); a card sold as N GB has N GiB")
    memory_gib: float = Field(gt=0, description="total device memory as nvidia-smi reports it, in GiB")
    bf16_tflops: float = Field(ge=0, description="dense bf16 tensor-core TFLOP/s (0: no bf16 support)")
    fp16_tflops: float = Field(gt=0, description="dense fp16 tensor-core TFLOP/s, fp32 accumulate")
    bandwidth_gbs: float = Field(gt=0, description="memory bandwidth, GB/s")
    matmul_tflops: float | None = Field(
        default=None,
        gt=0,
        description="sustained dense bf16 (fp16 without bf16) matmul TFLOP/s, measured; None: not published",
    )
    host_link_gbs: float | None = Field(
        default=None, gt=0, description="link to host memory (PCIe, NVLink-C2C), GB/s per direction; None: unknown"
    )
    dequant_gbs: float | None = Field(
        default=None,
        gt=0,
        description="GB/s a 4-bit dequantisation moves (packed weight and state in, compute-dtype weight out), "
        "measured; None: the memory's streaming rate",
    )
    quant_matmul_slowdown: float | None = Field(
        default=None,
        gt=0,
        description="a 4/8-bit base's matmul over the same matmul on a resident weight, beyond the "
        "dequantisation, measured; None: timing.QUANT_MATMUL_SLOWDOWN",
    )
    board_power_w: float = Field(gt=0)
    price_usd: float | None = Field(default=None, description="typical street or launch price")
    rent_usd_per_hour: float | None = Field(default=None, description="typical on-demand cloud price, USD")
    usable_fraction: float = Field(
        default=1.0, gt=0, le=1, description="share of memory a training process may take (Apple: wired limit)"
    )
    source: str
    as_of: str

    @model_validator(mode="before")
    @classmethod
    def _size_as_sold_of_an_older_plan(cls, data: object) -> object:
        """A plan saved before `memory_gb` existed holds only nvidia-smi's figure: it stands in for the size."""
        if isinstance(data, dict) and "memory_gib" in data and "memory_gb" not in data:
            return {**data, "memory_gb": data["memory_gib"]}
        return data

    @property
    def supports_bf16(self) -> bool:
        return self.bf16_tflops > 0

    def usable_gib(self, headroom: float) -> float:
        """The memory a plan may fill: the share a process may take, less the headroom kept free. The one fits
        rule of the project: an estimate fits when its device figure is at most this."""
        return self.memory_gib * self.usable_fraction * (1 - headroom)

    def tflops(self, precision: str) -> float:
        """Dense tensor TFLOP/s for the compute dtype; fp32 training runs on TF32, about half the fp16 rate."""
        if precision == "bf16" and self.supports_bf16:
            return self.bf16_tflops
        if precision == "fp32":
            return self.fp16_tflops / 2
        return self.fp16_tflops


def _key(name: str) -> str:
    """Normalise 'NVIDIA GeForce RTX 4090', 'rtx4090' and 'RTX-4090' to one key."""
    name = name.lower().replace("nvidia", "").replace("geforce", "")
    return re.sub(r"[^a-z0-9]+", "", name)


@cache
def catalog() -> dict[str, GpuSpec]:
    text = resources.files("lorafit").joinpath("catalog/gpus.toml").read_text()
    return {entry["name"]: GpuSpec.model_validate(entry) for entry in tomllib.loads(text)["gpu"]}


def resolve(name: str) -> GpuSpec:
    """A catalog name or alias, case- and punctuation-insensitive."""
    wanted = _key(name)
    by_key: dict[str, GpuSpec] = {}
    for spec in catalog().values():
        for label in [spec.name, *spec.aliases]:
            by_key.setdefault(_key(label), spec)
    if wanted in by_key:
        return by_key[wanted]
    close = difflib.get_close_matches(wanted, list(by_key), n=3, cutoff=0.5)
    names = sorted({by_key[key].name for key in close})
    if names:
        raise UnknownGpu(say("error.unknown_gpu_close", name=name, names=", ".join(names), setting_vram="--vram"))
    raise UnknownGpu(say("error.unknown_gpu", name=name, setting_vram="--vram"))


MAX_VRAM_GB = 2048  # no single accelerator comes near it: a larger --vram is a typo (MB for GB, say)
LIKE = "RTX 4090"  # whose throughput a GPU known only by its memory borrows


def custom(vram_gb: float, like: GpuSpec | None = None) -> GpuSpec:
    """A GPU known only by its memory (`--vram`); throughput borrowed from `like`, else from an RTX 4090.

    A card sold as "8 GB" has 8 GiB (nvidia-smi: 8188 MiB), so the number is read as binary gigabytes."""
    if not (math.isfinite(vram_gb) and 0 < vram_gb <= MAX_VRAM_GB):
        raise UnknownGpu(
            f"--vram is the GPU's memory in GB as sold, above 0 and at most {MAX_VRAM_GB}; got {vram_gb:g}"
        )
    return _by_memory(say("gpu.by_memory", gb=vram_gb), vram_gb, like, f"--vram {vram_gb:g}")


def _by_memory(name: str, memory_gib: float, like: GpuSpec | None, how: str) -> GpuSpec:
    """`like` (else the RTX 4090) with this name and memory, and no prices: they belong to the card borrowed."""
    base = like or catalog()[LIKE]
    return base.model_copy(
        update={
            "name": name,
            "aliases": [],
            "memory_gb": memory_gib,
            "memory_gib": memory_gib,
            "price_usd": None,
            "rent_usd_per_hour": None,
            "source": f"{how}; throughput of {base.name}",
        }
    )


# --- interconnects (catalog/interconnects.toml) -----------------------------------------------------------
class Link(BaseModel):
    """One link that GPUs move data over: inside a machine (NVLink, PCIe) or between machines (the network)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    title: str
    gbs: float = Field(ge=0, description="GB/s per direction; 0: a share of the card's own PCIe link")
    per: Literal["gpu", "node"]
    via_host: bool = False
    host_share: float = Field(default=1.0, gt=0, le=1, description="share of host_link_gbs where gbs is 0")
    source: str
    as_of: str

    def gbs_for(self, gpu: GpuSpec, gpus_on_link: int = 1) -> float:
        """GB/s one GPU gets on this link: its own rate, the card's PCIe share, or its part of the node's NIC."""
        rate = self.gbs or self.host_share * (gpu.host_link_gbs or PCIE3_X16_GBS)
        return rate / gpus_on_link if self.per == "node" else rate


class LinkRule(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    gpus: list[str] = []
    kind: GpuKind | None = None
    within_node: str
    between_nodes: str
    source: str

    def matches(self, gpu: GpuSpec) -> bool:
        if self.gpus:
            return gpu.name in self.gpus
        return self.kind is None or self.kind == gpu.kind


PCIE3_X16_GBS = 15.75  # a card whose entry gives no host link: the slowest PCIe x16 of the catalog


@cache
def _interconnects() -> tuple[dict[str, Link], tuple[LinkRule, ...]]:
    text = resources.files("lorafit").joinpath("catalog/interconnects.toml").read_text()
    data = tomllib.loads(text)
    links = {entry["name"]: Link.model_validate(entry) for entry in data["link"]}
    rules = tuple(LinkRule.model_validate(entry) for entry in data["rule"])
    for rule in rules:
        for name in (rule.within_node, rule.between_nodes):
            if name not in links:
                raise ValueError(f"interconnects.toml: a rule names link {name!r}, which is not listed")
    return links, rules


def links() -> dict[str, Link]:
    return _interconnects()[0]


def links_of(gpu: GpuSpec) -> tuple[Link, Link]:
    """(inside a machine, between machines) for this GPU: the first rule of interconnects.toml that matches.
    A GPU known only by its memory (`--vram`, a detected card) takes the rule of the card it borrows from."""
    catalog_links, rules = _interconnects()
    for rule in rules:
        if rule.matches(gpu):
            return catalog_links[rule.within_node], catalog_links[rule.between_nodes]
    raise ValueError("interconnects.toml needs a last rule that matches every GPU")


def gpus(min_vram_gb: float = 0, max_price_hour: float | None = None) -> list[GpuSpec]:
    """The catalog filtered by memory and rental price, smallest memory first.

    `min_vram_gb` is the size as sold, so 24 keeps every "24 GB" card (nvidia-smi shows 23.99 GiB on most);
    for an Apple entry it is the share of its memory the GPU may take by default."""
    rows = [gpu for gpu in catalog().values() if gpu.memory_gb * gpu.usable_fraction >= min_vram_gb]
    if max_price_hour is not None:
        rows = [g for g in rows if g.rent_usd_per_hour is not None and g.rent_usd_per_hour <= max_price_hour]
    return sorted(rows, key=lambda gpu: (gpu.memory_gib, gpu.name))


# --- local detection ----------------------------------------------------------------------------------------
class DetectedGpu(BaseModel):
    name: str
    memory_gib: float
    free_gib: float | None = None
    catalog_name: str | None = None


class LocalMachine(BaseModel):
    gpus: list[DetectedGpu]
    cpu: str
    cpu_cores: int
    ram_gib: float | None
    how: str


def available_ram_gib() -> float | None:
    """RAM the kernel says a new allocation can have without swapping (MemAvailable); None where unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return gib(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _ram_gib() -> float | None:
    try:
        return gib(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


# Driver versions move nvidia-smi's total by a few MiB (an RTX 4090: 24564 or 24576); ECC on a workstation card
# takes 6 %. A detected card is its catalog entry only when the memory agrees within this share.
SAME_MEMORY = 0.02


def _catalog_entry(name: str, memory_gib: float) -> GpuSpec | None:
    """The catalog entry of a detected GPU, from its name and memory: NVML calls both RTX 4060 Ti cards "NVIDIA
    GeForce RTX 4060 Ti", so the size is tried with the name first. None when no entry has that memory."""
    for label in (f"{name} {round(memory_gib)}GB", name):
        try:
            spec = resolve(label)
        except UnknownGpu:
            continue
        if abs(spec.memory_gib - memory_gib) <= SAME_MEMORY * spec.memory_gib:
            return spec
    return None


def _detected(name: str, total_bytes: float, free_bytes: float) -> DetectedGpu:
    memory_gib = gib(total_bytes)
    entry = _catalog_entry(name, memory_gib)
    return DetectedGpu(
        name=name,
        memory_gib=memory_gib,
        free_gib=gib(free_bytes),
        catalog_name=entry.name if entry else None,
    )


def _nvml_gpus() -> list[DetectedGpu] | None:
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver: NVML raises its own error types
        return None
    found = []
    for index in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        name = pynvml.nvmlDeviceGetName(handle)
        name = name.decode() if isinstance(name, bytes) else name
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        found.append(_detected(name, memory.total, memory.free))
    return found


def _torch_gpus() -> list[DetectedGpu] | None:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return []
    found = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        free, total = torch.cuda.mem_get_info(index)
        found.append(_detected(props.name, total, free))
    return found


def detect(use_torch: bool = True) -> LocalMachine:
    """The local GPUs (NVML, else torch), CPU and RAM. Never fails: no GPU is an empty list."""
    found, how = _nvml_gpus(), "nvml"
    if found is None and use_torch:
        found, how = _torch_gpus(), "torch"
    if found is None:
        found, how = [], "none (neither NVML nor torch is installed)"
    cpu = platform.processor() or platform.machine()
    return LocalMachine(gpus=found, cpu=cpu, cpu_cores=os.cpu_count() or 1, ram_gib=_ram_gib(), how=how)


def detected_gpu(use_torch: bool = True) -> GpuSpec | None:
    """The first local GPU as the planner sees it, None without one: its catalog entry where the name and the
    memory match one, else a GPU known by the detected name and memory in GiB, with the throughput of the entry
    its name resolves to (an RTX A6000 with ECC on) or of the `custom` default."""
    found = detect(use_torch).gpus
    if not found:
        return None
    first = found[0]
    if first.catalog_name:
        return catalog()[first.catalog_name]
    try:
        like: GpuSpec | None = resolve(first.name)
    except UnknownGpu:
        like = None
    mib = round(gib_to_bytes(first.memory_gib) / BYTES_PER_MIB)
    return _by_memory(first.name, first.memory_gib, like, f"detected {first.name}, {mib} MiB")
