"""The GPU catalog (numbers, names, filters) and local detection."""

from __future__ import annotations

import json
import os
import re
import sys
import tomllib
import types
from importlib import resources

import pytest

from conftest import run_cli
from lorafit import hardware, render
from lorafit.errors import LorafitError, UnknownGpu
from lorafit.hardware import GpuSpec, catalog, custom, detect, detected_gpu, gpus, resolve

MIB = 2**20

NAMES = sorted(catalog())
NVIDIA = [name for name in NAMES if catalog()[name].kind != "apple"]

REQUIRED = [
    "RTX 3060 12GB",
    "RTX 3060 Ti",
    "RTX 3070",
    "RTX 3070 Ti",
    "RTX 3080 10GB",
    "RTX 3080 12GB",
    "RTX 3090",
    "RTX 3090 Ti",
    "RTX 4060",
    "RTX 4060 Ti 8GB",
    "RTX 4060 Ti 16GB",
    "RTX 4070",
    "RTX 4070 Super",
    "RTX 4070 Ti Super",
    "RTX 4080",
    "RTX 4090",
    "RTX 5060 Ti 8GB",
    "RTX 5060 Ti 16GB",
    "RTX 5070",
    "RTX 5070 Ti",
    "RTX 5080",
    "RTX 5090",
    "RTX A4000",
    "RTX A5000",
    "RTX A6000",
    "RTX 6000 Ada",
    "RTX PRO 6000 Blackwell",
    "RTX PRO 6000 Blackwell Max-Q",
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
    "GH200",
    "B200",
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
    assert 1 <= gpu.fp16_tflops <= 2500  # a B200: 2250 dense
    assert gpu.bf16_tflops in (0, gpu.fp16_tflops)  # dense bf16 runs at the fp16 rate where it exists
    assert 50 <= gpu.bandwidth_gbs <= 10_000
    assert 10 <= gpu.board_power_w <= 1000
    if gpu.price_usd is not None:
        assert 200 <= gpu.price_usd <= 50_000
    if gpu.rent_usd_per_hour is not None:
        assert 0.05 <= gpu.rent_usd_per_hour <= 10
        assert gpu.rent_usd_per_hour * 24 * 365 < 5 * (gpu.price_usd or 50_000)


@pytest.mark.parametrize("name", NVIDIA)
def test_nvidia_memory_is_what_nvidia_smi_reports(name: str) -> None:
    """memory_gib is a whole number of MiB / 1024, the MiB figure the source quotes."""
    gpu = catalog()[name]
    mib = gpu.memory_gib * 1024
    assert abs(mib - round(mib)) < 0.52  # three decimals of GiB hold a whole number of MiB
    assert f"nvidia-smi total {round(mib)} MiB" in gpu.source


def test_every_entry_states_the_size_it_is_sold_as() -> None:
    """Set in the file, not filled in by the fallback for plans saved before the field existed."""
    text = resources.files("lorafit").joinpath("catalog/gpus.toml").read_text()
    for entry in tomllib.loads(text)["gpu"]:
        assert isinstance(entry.get("memory_gb"), int), entry["name"]


@pytest.mark.parametrize("name", NAMES)
def test_the_size_as_sold_and_nvidia_smi_agree(name: str) -> None:
    """A card sold as N GB reports a few MiB under N GiB; ECC on by default (datacenter) costs about 6 %."""
    gpu = catalog()[name]
    share = gpu.memory_gib / gpu.memory_gb
    if gpu.kind == "apple":
        assert share == 1
    elif gpu.kind == "datacenter":
        assert 0.93 <= share <= 1
    else:  # GeForce and workstation cards, ECC off
        assert 0.99 <= share <= 1
    stated = re.search(r"(\d+)\s?GB", " ".join([gpu.name, *gpu.aliases]))
    if stated:  # the first size a name states ("RTX 5060 Ti 16GB", "A100-80GB") is the size as sold
        assert int(stated.group(1)) == gpu.memory_gb


def test_bf16_is_zero_exactly_where_the_hardware_lacks_it() -> None:
    without = {name for name in NAMES if not catalog()[name].supports_bf16}
    assert without == {"T4", "V100 16GB", "V100 32GB"}
    pre_ampere = {name for name in NAMES if catalog()[name].architecture in ("volta", "turing")}
    assert without == pre_ampere
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
        ("5090", "RTX 5090"),
        ("RTX 5060 Ti 16GB", "RTX 5060 Ti 16GB"),
        ("5060 ti", "RTX 5060 Ti 8GB"),
        ("rtx 5060 ti 8gb", "RTX 5060 Ti 8GB"),
        ("5070", "RTX 5070"),
        ("RTX 5070 Ti", "RTX 5070 Ti"),
        ("4070 super", "RTX 4070 Super"),
        ("4060 8gb", "RTX 4060"),
        ("3060 ti", "RTX 3060 Ti"),
        ("RTX-3070", "RTX 3070"),
        ("3070ti", "RTX 3070 Ti"),
        ("3090 ti", "RTX 3090 Ti"),
        ("rtx pro 6000", "RTX PRO 6000 Blackwell"),
        ("RTX PRO 6000 Max-Q", "RTX PRO 6000 Blackwell Max-Q"),
        ("b200", "B200"),
        ("gh200", "GH200"),
        ("L4", "L4"),
    ],
)
def test_a_gpu_resolves_by_the_names_people_type(asked: str, found: str) -> None:
    assert resolve(asked).name == found


@pytest.mark.parametrize(
    ("device_name", "mib"),
    [  # the name NVML/torch report, and the total MiB nvidia-smi prints next to it
        ("NVIDIA GeForce RTX 3060", 12288),
        ("NVIDIA GeForce RTX 3060 Ti", 8192),
        ("NVIDIA GeForce RTX 3070", 8192),
        ("NVIDIA GeForce RTX 3070 Ti", 8192),
        ("NVIDIA GeForce RTX 3090", 24576),
        ("NVIDIA GeForce RTX 3090 Ti", 24564),
        ("NVIDIA GeForce RTX 4070 SUPER", 12282),
        ("NVIDIA GeForce RTX 4090", 24564),
        ("NVIDIA GeForce RTX 4080", 16376),
        ("NVIDIA GeForce RTX 5070", 12227),
        ("NVIDIA GeForce RTX 5070 Ti", 16303),
        ("NVIDIA GeForce RTX 5080", 16303),
        ("NVIDIA GeForce RTX 5090", 32607),
        ("NVIDIA RTX A6000", 49140),
        ("NVIDIA RTX 6000 Ada Generation", 49140),
        ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", 97887),
        ("NVIDIA RTX PRO 6000 Blackwell Server Edition", 97887),
        ("NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition", 97887),
        ("NVIDIA A10G", 23028),
        ("NVIDIA L4", 23034),
        ("NVIDIA L40", 46068),
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
        ("NVIDIA GH200 480GB", 97871),
        ("NVIDIA B200", 183359),
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
def test_gpus_filters_by_the_size_as_sold_and_sorts_smallest_first() -> None:
    big = gpus(min_vram_gb=40)
    names = [gpu.name for gpu in big]
    assert "A100 40GB" in names and "H200" in names and "RTX 4090" not in names
    assert "A40" in names  # sold as 48 GB, 44.99 GiB with ECC on
    assert "Apple M-series 64GB" in names  # 48 GB usable of 64
    assert "Apple M-series 48GB" not in names  # 36 GB usable
    assert all(gpu.memory_gb * gpu.usable_fraction >= 40 for gpu in big)
    assert [gpu.memory_gib for gpu in big] == sorted(gpu.memory_gib for gpu in big)
    assert len(gpus()) == len(catalog())


def test_min_vram_24_keeps_every_card_sold_as_24_gb() -> None:
    """nvidia-smi shows 23.99 GiB on an RTX 4090 or A5000, and 22.49 on an L4 (ECC): all are "24 GB" cards."""
    names = {gpu.name for gpu in gpus(min_vram_gb=24)}
    assert {"RTX 4090", "RTX A5000", "RTX 3090", "RTX 3090 Ti", "L4", "A10G", "RTX 5090"} <= names
    assert not {"RTX 4080", "RTX 5080", "RTX 4060 Ti 16GB", "T4"} & names


def test_gpus_filters_by_rental_price() -> None:
    cheap = gpus(max_price_hour=0.5)
    assert {"RTX 3090", "RTX 4090", "L4"} <= {gpu.name for gpu in cheap}
    assert all(gpu.rent_usd_per_hour is not None and gpu.rent_usd_per_hour <= 0.5 for gpu in cheap)
    assert "H100 SXM" not in {gpu.name for gpu in cheap}
    assert [gpu.name for gpu in gpus(min_vram_gb=70, max_price_hour=1.5)] == ["A100 80GB", "A100 80GB PCIe"]


def test_the_gpus_command_filters_on_the_size_as_sold(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, out, err = run_cli(["gpus", "--min-vram", "24", "--json"], capsys)
    assert code == 0, err
    names = {row["name"] for row in json.loads(out)}
    assert {"RTX 4090", "RTX A5000"} <= names and "RTX 4080" not in names
    monkeypatch.setattr(render.console, "width", 160)  # a terminal wide enough for every column
    code, out, _ = run_cli(["gpus", "--min-vram", "24"], capsys)
    row = next(line for line in out.splitlines() if "RTX 4090" in line)
    assert code == 0 and "24 GB" in row and "23.99 GiB" in row  # the size as sold and nvidia-smi's figure


def test_custom_gpu_has_the_memory_asked_for_in_gigabytes() -> None:
    gpu = custom(16)
    assert gpu.name == "16 GB GPU"
    assert gpu.memory_gib == pytest.approx(16) and gpu.memory_gb == 16  # cards sold as "16 GB" have 16 GiB
    assert gpu.bf16_tflops == resolve("4090").bf16_tflops and gpu.rent_usd_per_hour is None
    like_a100 = custom(40, like=resolve("a100"))
    assert like_a100.fp16_tflops == 312 and like_a100.memory_gib == pytest.approx(40)
    assert isinstance(gpu, GpuSpec)
    assert custom(2048).memory_gib == 2048  # the largest accepted


@pytest.mark.parametrize("vram", [0, -8, float("nan"), float("inf"), float("-inf"), 2049, 1e9])
def test_custom_gpu_refuses_memory_no_gpu_has(vram: float) -> None:
    with pytest.raises(UnknownGpu, match="--vram is the GPU's memory in GB as sold"):
        custom(vram)


@pytest.mark.parametrize("vram", ["nan", "inf", "0", "-8", "4096"])
def test_a_bad_vram_is_one_line_and_exit_2(vram: str, capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("estimate", "plan"):
        code, out, err = run_cli([command, "--model", "llama-2-7b", "--vram", vram], capsys)
        assert code == 2 and out == ""
        assert err.startswith("lorafit: error: ") and err.count("\n") == 1, err
        assert "--vram" in err and "Traceback" not in err


def test_a_plan_saved_before_the_size_as_sold_existed_still_reads() -> None:
    """Run folders hold the GpuSpec as JSON; one written without memory_gb reads with nvidia-smi's figure."""
    old = resolve("4090").model_dump(mode="json")
    del old["memory_gb"]
    gpu = GpuSpec.model_validate(old)
    assert gpu.memory_gb == gpu.memory_gib == resolve("4090").memory_gib
    assert GpuSpec.model_validate_json(resolve("4090").model_dump_json()) == resolve("4090")


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


def fake_nvml(
    monkeypatch: pytest.MonkeyPatch, init: object, name: str = "NVIDIA GeForce RTX 4090", mib: int = 24564
) -> None:
    """A stand-in `pynvml` module with one GPU (an RTX 4090 unless told), as the NVIDIA bindings report it."""
    memory = types.SimpleNamespace(total=mib * MIB, free=(mib - 500) * MIB)
    module = types.SimpleNamespace(
        nvmlInit=init,
        nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetHandleByIndex=lambda index: index,
        nvmlDeviceGetName=lambda handle: name.encode(),
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


# --- detected_gpu(): the one way the CLI and the trainer see the local GPU -----------------------------------
def one_gpu(name: str, mib: int) -> list[hardware.DetectedGpu]:
    """What `_nvml_gpus` returns on a machine with that GPU (the same path NVML's figures take)."""
    return [hardware._detected(name, mib * MIB, (mib - 500) * MIB)]


@pytest.mark.parametrize(
    ("device_name", "mib", "entry"),
    [
        ("NVIDIA GeForce RTX 4090", 24564, "RTX 4090"),
        ("NVIDIA GeForce RTX 4090", 24576, "RTX 4090"),  # an older driver's total
        ("NVIDIA GeForce RTX 5060 Ti", 16311, "RTX 5060 Ti 16GB"),  # one NVML name for two sizes
        ("NVIDIA GeForce RTX 5060 Ti", 8151, "RTX 5060 Ti 8GB"),
        ("NVIDIA GeForce RTX 4060 Ti", 16380, "RTX 4060 Ti 16GB"),
        ("NVIDIA GeForce RTX 4060 Ti", 8188, "RTX 4060 Ti 8GB"),
        ("NVIDIA GeForce RTX 4070 SUPER", 12282, "RTX 4070 Super"),
        ("NVIDIA B200", 183359, "B200"),
    ],
)
def test_a_detected_catalog_gpu_is_its_entry(
    device_name: str, mib: int, entry: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hardware, "_nvml_gpus", lambda: one_gpu(device_name, mib))
    assert detected_gpu() == catalog()[entry]
    assert detect().gpus[0].catalog_name == entry  # what `lorafit detect` prints


def test_a_gpu_not_in_the_catalog_is_known_by_its_detected_name_and_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hardware, "_nvml_gpus", lambda: one_gpu("NVIDIA RTX PRO 4500 Blackwell", 32607))
    gpu = detected_gpu()
    assert gpu is not None and gpu.name == "NVIDIA RTX PRO 4500 Blackwell"
    assert gpu.memory_gib == 32607 / 1024  # exactly what was detected, in GiB
    assert gpu.usable_gib(0.1) == 32607 / 1024 * 0.9
    assert gpu.price_usd is None and gpu.rent_usd_per_hour is None
    assert "32607 MiB" in gpu.source and detect().gpus[0].catalog_name is None


def test_a_known_card_with_other_memory_keeps_its_throughput_and_its_real_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An RTX A6000 with ECC switched on reports 46068 MiB, not the catalog's 49140."""
    monkeypatch.setattr(hardware, "_nvml_gpus", lambda: one_gpu("NVIDIA RTX A6000", 46068))
    gpu = detected_gpu()
    assert gpu is not None and gpu.memory_gib == 46068 / 1024
    assert gpu.bf16_tflops == resolve("A6000").bf16_tflops and gpu.name == "NVIDIA RTX A6000"


def test_detected_gpu_falls_back_to_torch_and_can_leave_it_out(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(hardware, "_nvml_gpus", lambda: None)  # no pynvml
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(name="NVIDIA H100 PCIe"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (80000 * MIB, 81559 * MIB))
    assert detected_gpu() == catalog()["H100 PCIe"]
    assert detected_gpu(use_torch=False) is None


def test_detected_gpu_without_a_gpu_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hardware, "_nvml_gpus", lambda: [])
    monkeypatch.setattr(hardware, "_torch_gpus", lambda: [])
    assert detected_gpu() is None


def test_detected_gpu_reads_a_real_nvml_module(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_nvml(monkeypatch, init=lambda: None, name="NVIDIA GeForce RTX 5060 Ti", mib=16311)
    assert detected_gpu(use_torch=False) == catalog()["RTX 5060 Ti 16GB"]
