"""The GPU catalog (numbers, names, filters) and local detection."""

from __future__ import annotations

import os
import re
import sys
import types

import pytest

from lorafit import hardware
from lorafit.errors import LorafitError, UnknownGpu
from lorafit.hardware import GpuSpec, catalog, custom, detect, gpus, resolve

NAMES = sorted(catalog())
NVIDIA = [name for name in NAMES if catalog()[name].kind != "apple"]

REQUIRED = [
    "RTX 3060 12GB",
    "RTX 3080 10GB",
    "RTX 3080 12GB",
    "RTX 3090",
    "RTX 4060",
    "RTX 4060 Ti 8GB",
    "RTX 4060 Ti 16GB",
    "RTX 4070",
    "RTX 4070 Ti Super",
    "RTX 4080",
    "RTX 4090",
    "RTX 5080",
    "RTX 5090",
    "RTX A4000",
    "RTX A5000",
    "RTX A6000",
    "RTX 6000 Ada",
    "A40",
    "L4",
    "L40S",
    "T4",
    "V100 16GB",
    "V100 32GB",
    "A10G",
    "A100 40GB",
    "A100 80GB",
    "H100 SXM",
    "H200",
]


def test_catalog_has_the_gpus_people_train_on() -> None:
    assert set(REQUIRED) <= set(NAMES)
    apple = sorted(int(re.search(r"(\d+)GB", name).group(1)) for name in NAMES if catalog()[name].kind == "apple")
    assert apple == [16, 24, 32, 48, 64, 96, 128, 192]


@pytest.mark.parametrize("name", NAMES)
def test_every_entry_has_a_source_a_date_and_sane_numbers(name: str) -> None:
    gpu = catalog()[name]
    assert len(gpu.source) > 40
    assert re.fullmatch(r"20\d\d-(0[1-9]|1[0-2])", gpu.as_of)
    assert 4 <= gpu.memory_gib <= 200
    assert 1 <= gpu.fp16_tflops <= 2000
    assert gpu.bf16_tflops in (0, gpu.fp16_tflops)  # dense bf16 runs at the fp16 rate where it exists
    assert 50 <= gpu.bandwidth_gbs <= 6000
    assert 10 <= gpu.board_power_w <= 1000
    if gpu.price_usd is not None:
        assert 200 <= gpu.price_usd <= 50_000
    if gpu.rent_usd_per_hour is not None:
        assert 0.05 <= gpu.rent_usd_per_hour <= 10
        assert gpu.rent_usd_per_hour * 24 * 365 < 5 * (gpu.price_usd or 50_000)


@pytest.mark.parametrize("name", NVIDIA)
def test_nvidia_memory_is_what_nvidia_smi_reports(name: str) -> None:
    """memory_gib is a whole number of MiB / 1024, and no more than the nominal size on the box."""
    gpu = catalog()[name]
    mib = gpu.memory_gib * 1024
    assert abs(mib - round(mib)) < 0.52  # three decimals of GiB hold a whole number of MiB
    assert f"nvidia-smi total {round(mib)} MiB" in gpu.source
    nominal = re.search(r"(\d+)\s?GB", " ".join([gpu.name, *gpu.aliases]))
    if nominal:
        assert 0.9 * int(nominal.group(1)) <= gpu.memory_gib <= int(nominal.group(1))


def test_bf16_is_zero_exactly_where_the_hardware_lacks_it() -> None:
    without = {name for name in NAMES if not catalog()[name].supports_bf16}
    assert without == {"T4", "V100 16GB", "V100 32GB"}
    assert resolve("t4").tflops("bf16") == resolve("t4").fp16_tflops  # falls back to fp16


def test_apple_entries_count_only_the_default_gpu_wired_limit() -> None:
    for name in NAMES:
        gpu = catalog()[name]
        if gpu.kind == "apple":
            assert 0.6 <= gpu.usable_fraction <= 0.8
            assert "iogpu.wired_limit_mb" in gpu.source
        else:
            assert gpu.usable_fraction == 1.0


# --- names ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("asked", "found"),
    [
        ("4090", "RTX 4090"),
        ("rtx 4090", "RTX 4090"),
        ("RTX-4090", "RTX 4090"),
        ("NVIDIA GeForce RTX 4090", "RTX 4090"),
        ("GeForce RTX 3090", "RTX 3090"),
        ("a100", "A100 80GB"),
        ("A100-80GB", "A100 80GB"),
        ("a100 40gb", "A100 40GB"),
        ("h100", "H100 SXM"),
        ("H100 PCIe", "H100 PCIe"),
        ("h200", "H200"),
        ("l40s", "L40S"),
        ("v100", "V100 16GB"),
        ("3060", "RTX 3060 12GB"),
        ("4060 ti", "RTX 4060 Ti 8GB"),
        ("rtx 4060 ti 16gb", "RTX 4060 Ti 16GB"),
        ("4070 ti super", "RTX 4070 Ti Super"),
        ("a6000", "RTX A6000"),
        ("6000 ada", "RTX 6000 Ada"),
        ("apple 64gb", "Apple M-series 64GB"),
    ],
)
def test_a_gpu_resolves_by_the_names_people_type(asked: str, found: str) -> None:
    assert resolve(asked).name == found


@pytest.mark.parametrize(
    ("device_name", "mib"),
    [  # the name NVML/torch report, and the total MiB nvidia-smi prints next to it
        ("NVIDIA GeForce RTX 3060", 12288),
        ("NVIDIA GeForce RTX 3090", 24576),
        ("NVIDIA GeForce RTX 4090", 24564),
        ("NVIDIA GeForce RTX 4080", 16376),
        ("NVIDIA GeForce RTX 5080", 16303),
        ("NVIDIA GeForce RTX 5090", 32607),
        ("NVIDIA RTX A6000", 49140),
        ("NVIDIA RTX 6000 Ada Generation", 49140),
        ("NVIDIA A10G", 23028),
        ("NVIDIA L4", 23034),
        ("NVIDIA L40S", 46068),
        ("Tesla T4", 15360),
        ("Tesla V100-SXM2-16GB", 16160),
        ("Tesla V100-SXM2-32GB", 32768),
        ("NVIDIA A100-SXM4-40GB", 40960),
        ("NVIDIA A100-SXM4-80GB", 81920),
        ("NVIDIA A100 80GB PCIe", 81920),
        ("NVIDIA H100 80GB HBM3", 81559),
        ("NVIDIA H100 PCIe", 81559),
        ("NVIDIA H200", 143771),
    ],
)
def test_the_name_a_driver_reports_finds_the_card_with_that_memory(device_name: str, mib: int) -> None:
    assert round(resolve(device_name).memory_gib * 1024) == mib


def test_no_two_gpus_share_a_name() -> None:
    owner: dict[str, str] = {}
    for gpu in catalog().values():
        for label in [gpu.name, *gpu.aliases]:
            key = hardware._key(label)
            assert owner.setdefault(key, gpu.name) == gpu.name, f"{label!r} names {owner[key]} and {gpu.name}"


def test_an_unknown_gpu_suggests_close_names() -> None:
    with pytest.raises(UnknownGpu) as error:
        resolve("RTX 4900")
    message = str(error.value)
    assert "did you mean" in message and "RTX 4090" in message and "--vram" in message
    assert isinstance(error.value, LorafitError) and error.value.exit_code == 2


def test_a_name_like_nothing_still_gets_a_one_line_error() -> None:
    with pytest.raises(UnknownGpu, match="no GPU 'potato'"):
        resolve("potato")


# --- filters and custom GPUs ------------------------------------------------------------------------------
def test_gpus_filters_by_usable_memory_and_sorts_smallest_first() -> None:
    big = gpus(min_vram_gib=40)
    names = [gpu.name for gpu in big]
    assert "A100 40GB" in names and "H200" in names and "RTX 4090" not in names
    assert "Apple M-series 64GB" in names  # 48 GiB usable of 64
    assert "Apple M-series 48GB" not in names  # 36 GiB usable
    assert all(gpu.memory_gib * gpu.usable_fraction >= 40 for gpu in big)
    assert [gpu.memory_gib for gpu in big] == sorted(gpu.memory_gib for gpu in big)
    assert len(gpus()) == len(catalog())


def test_gpus_filters_by_rental_price() -> None:
    cheap = gpus(max_price_hour=0.5)
    assert {"RTX 3090", "RTX 4090", "L4"} <= {gpu.name for gpu in cheap}
    assert all(gpu.rent_usd_per_hour is not None and gpu.rent_usd_per_hour <= 0.5 for gpu in cheap)
    assert "H100 SXM" not in {gpu.name for gpu in cheap}
    assert [gpu.name for gpu in gpus(min_vram_gib=70, max_price_hour=1.5)] == ["A100 80GB", "A100 80GB PCIe"]


def test_custom_gpu_has_the_memory_asked_for_in_gigabytes() -> None:
    gpu = custom(16)
    assert gpu.name == "16 GB GPU"
    assert gpu.memory_gib == pytest.approx(16)  # cards sold as "16 GB" have 16 GiB
    assert gpu.bf16_tflops == resolve("4090").bf16_tflops and gpu.rent_usd_per_hour is None
    like_a100 = custom(40, like=resolve("a100"))
    assert like_a100.fp16_tflops == 312 and like_a100.memory_gib == pytest.approx(40)
    assert isinstance(gpu, GpuSpec)


@pytest.mark.parametrize("vram", [0, -8])
def test_custom_gpu_refuses_no_memory(vram: float) -> None:
    with pytest.raises(UnknownGpu, match="--vram must be positive"):
        custom(vram)


# --- detect() ---------------------------------------------------------------------------------------------
def test_detect_never_fails_and_reports_cpu_and_ram() -> None:
    import torch

    machine = detect()
    if not torch.cuda.is_available() and machine.how == "torch":  # no NVML and no CUDA: this CI machine
        assert machine.gpus == []
    assert machine.cpu_cores == os.cpu_count()
    assert machine.ram_gib == pytest.approx(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30)
    assert machine.ram_gib > 0.5 and machine.cpu


def test_detect_on_a_machine_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    machine = detect()
    assert machine.gpus == [] and machine.how == "torch"
    assert machine.cpu_cores >= 1 and machine.ram_gib > 0.5


def test_detect_with_neither_nvml_nor_torch_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    machine = detect(use_torch=False)
    assert machine.gpus == [] and machine.how.startswith("none")


def fake_nvml(monkeypatch: pytest.MonkeyPatch, init: object) -> None:
    """A stand-in `pynvml` module with one RTX 4090, as the NVIDIA bindings report it."""
    memory = types.SimpleNamespace(total=24564 * 2**20, free=20000 * 2**20)
    module = types.SimpleNamespace(
        nvmlInit=init,
        nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetHandleByIndex=lambda index: index,
        nvmlDeviceGetName=lambda handle: b"NVIDIA GeForce RTX 4090",
        nvmlDeviceGetMemoryInfo=lambda handle: memory,
    )
    monkeypatch.setitem(sys.modules, "pynvml", module)


def test_detect_reads_nvml_and_names_the_catalog_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_nvml(monkeypatch, init=lambda: None)
    machine = detect()
    assert machine.how == "nvml"
    (gpu,) = machine.gpus
    assert gpu.catalog_name == "RTX 4090"
    assert gpu.memory_gib == pytest.approx(resolve("4090").memory_gib, abs=1e-3)


def test_detect_survives_an_nvml_without_a_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_driver() -> None:
        raise RuntimeError("NVML Shared Library Not Found")

    fake_nvml(monkeypatch, init=no_driver)
    assert detect(use_torch=False).gpus == []
