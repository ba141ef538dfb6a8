"""This host's CPU as a "card" for the time model: its matmul rate and memory bandwidth, measured here.

`lorafit measure --cpu` and `make bench-time-cpu` set the time model's estimate beside steps measured on the
CPU; the catalog has no entry for a CPU, so the figures the model divides by are measured in this process, with
torch's current thread count, by a few short micro-benchmarks (about a second, most of it bitsandbytes'
import), once per process.

The measured rates are stored so that the time model reads them back unchanged:
- `timing.achievable_matmul_flops(card, "fp32")` is `fp16_tflops / 2 x matmul_tflops / bf16_tflops`, so
  `fp16_tflops` holds twice the measured fp32 rate (the CPU has no fp16 training: lorafit refuses it there) and
  `matmul_tflops` equals `bf16_tflops`, the measured bf16 rate (a share of 1: the rate is the measurement);
- `timing.achievable_bytes_per_second(card)` is `bandwidth_gbs x BANDWIDTH_SHARE`, so `bandwidth_gbs` holds the
  measured copy rate over BANDWIDTH_SHARE;
- `dequant_gbs` and `quant_matmul_slowdown` hold bitsandbytes' 4-bit dequantisation rate and matmul slowdown as
  measured here (timing.dequant_bytes_per_second, timing.quant_matmul_slowdown): the GPU's figures do not carry
  over. A training step's profile (`python bench/time_structure_cpu.py --profile qlora`) shows the CPU's QLoRA
  running the same aten::mm time as LoRA (980 against 964 ms), plus the dequantisation (about 5 % of the step),
  where a GPU's 4-bit layers run QUANT_MATMUL_SLOWDOWN times slower.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import date
from functools import cache

from lorafit import hardware, memory, timing
from lorafit.hardware import GpuSpec
from lorafit.schema import Settings
from lorafit.train import build
from lorafit.units import DTYPE_BYTES

# Side of the square matmuls timed: 2 x 1024^3 = 2.1 GFLOP, 5-20 ms on a few cores, large enough that the
# rate is the kernel's, not the call's; a decoder's projections of a 0.1-1B model are of this order.
MATMUL_SIDE = 1024
# Bytes of the tensor copied to time the memory: 256 MiB, eight times a large L3 cache, so the copy streams
# from memory rather than from cache.
COPY_BYTES = 256 * 2**20
# Repeats of each micro-benchmark after one warm-up; the fastest is kept (other processes on a shared host only
# ever slow a run down, so the fastest is the closest to what the hardware sustains).
REPEATS = 5
# 4-bit weights dequantised in turn to time the dequantisation: 16 of 1024 x 1024 (8 MiB packed, 64 MiB out), as
# a step dequantises its projections one after another, each read from memory rather than from the last call's
# cache; and the tokens of the matmul timed on one of them with and without the 4-bit path.
DEQUANT_WEIGHTS = 16
QUANT_MATMUL_TOKENS = 256
# lorafit's QLoRA on the CPU (NF4, double-quantised, fp32 compute): the bytes per weight the dequantisation rate
# is counted in, as timing.dequant_seconds counts them.
CPU_QLORA = Settings(method="qlora", quant="nf4", precision="fp32")
# The CPU's board power is not measured; a desktop or one-socket-share figure, used only for the electricity
# cost of a CPU run, which no comparison relies on.
CPU_POWER_W = 65.0


def _fastest(run: Callable[[], object], repeats: int = REPEATS) -> float:
    """Seconds of the fastest of `repeats` calls of `run`, after one untimed call."""
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def matmul_flops_per_second(dtype_name: str, side: int = MATMUL_SIDE) -> float:
    """FLOP/s of a side x side x side matmul in `dtype_name` ("fp32" or "bf16") on this CPU."""
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    a = torch.randn(side, side).to(dtype)
    b = torch.randn(side, side).to(dtype)
    return 2 * side**3 / _fastest(lambda: torch.mm(a, b))


def copy_bytes_per_second(size_bytes: int = COPY_BYTES) -> float:
    """Bytes/s a streaming copy moves (read plus write) between two fp32 tensors of `size_bytes` each."""
    import torch

    source = torch.ones(size_bytes // 4)
    target = torch.empty_like(source)
    return 2 * size_bytes / _fastest(lambda: target.copy_(source))


def quantized_rates(side: int = MATMUL_SIDE) -> tuple[float, float] | None:
    """(bytes/s, slowdown) of bitsandbytes' 4-bit path in fp32 on this CPU, as lorafit's QLoRA runs it there:
    the bytes per second its NF4 double-quantised dequantisation moves (what timing.dequant_seconds counts per
    weight: packed weight and state in, the nested absmax's traffic, the fp32 weight out), and its matmul
    (bitsandbytes' MatMul4Bit: dequantise, then torch's linear) over a plain linear on the same weight, less the
    dequantisation, at least 1. None without bitsandbytes."""
    build.quiet_libraries()  # bitsandbytes logs, when imported, about a CPU kernel it would download
    try:
        import bitsandbytes.functional as bnb_functional
        from bitsandbytes import matmul_4bit
    except ImportError:
        return None
    import torch

    weight = torch.randn(side, side)
    # one fp32 weight at a time: the process keeps no large freed block that later allocations would reuse
    packed = [
        bnb_functional.quantize_4bit(
            weight if i == 0 else torch.randn(side, side), quant_type="nf4", compress_statistics=True
        )
        for i in range(DEQUANT_WEIGHTS)
    ]
    for _, state in packed:
        state.dtype = torch.float32  # the compute dtype (bitsandbytes sets it from the model's compute dtype)

    def dequantise_each() -> None:
        for weight_4bit, state in packed:  # each output freed before the next, as a step frees it after its matmul
            bnb_functional.dequantize_4bit(weight_4bit, state)

    seconds = _fastest(dequantise_each)
    weight_bytes = memory.quantized_weight_bytes(1, CPU_QLORA) + DTYPE_BYTES["fp32"] + timing.DOUBLE_QUANT_BYTES
    moved = side * side * weight_bytes
    inputs = torch.randn(QUANT_MATMUL_TOKENS, side)
    first_4bit, first_state = packed[0]
    plain = _fastest(lambda: torch.nn.functional.linear(inputs, weight))
    quantized = _fastest(lambda: matmul_4bit(inputs, first_4bit.t(), first_state))
    one_dequant = _fastest(lambda: bnb_functional.dequantize_4bit(first_4bit, first_state))
    return DEQUANT_WEIGHTS * moved / seconds, max(1.0, (quantized - one_dequant) / plain)


@cache
def cpu_card() -> GpuSpec:
    """This CPU as a GpuSpec the time model (timing.micro_batch_time, step_time) divides by: its fp32 and bf16
    matmul rates and its copy bandwidth measured now, with torch's current threads, and the host's RAM as its
    memory. Measured once per process (about half a second)."""
    import torch

    threads = torch.get_num_threads()
    fp32 = matmul_flops_per_second("fp32")
    bf16 = matmul_flops_per_second("bf16")
    bandwidth = copy_bytes_per_second()
    quantized = quantized_rates()
    ram_gib = hardware.detect(use_torch=False).ram_gib or 1.0
    return GpuSpec(
        name=f"CPU ({threads} threads)",
        kind="workstation",  # not "apple" (no wired limit) nor "consumer" (no GeForce links); none is a CPU
        architecture=f"cpu {os.uname().machine}",
        memory_gb=ram_gib,
        memory_gib=ram_gib,
        bf16_tflops=bf16 / 1e12,
        fp16_tflops=2 * fp32 / 1e12,  # tflops("fp32") is fp16_tflops / 2: the measured fp32 rate
        matmul_tflops=bf16 / 1e12,  # a share of 1: the bf16 rate is the measurement itself
        bandwidth_gbs=bandwidth / 1e9 / timing.BANDWIDTH_SHARE,  # achievable_bytes_per_second gives `bandwidth`
        dequant_gbs=quantized[0] / 1e9 if quantized else None,
        quant_matmul_slowdown=quantized[1] if quantized else None,
        board_power_w=CPU_POWER_W,
        source=(
            f"measured by lorafit on this host: {threads} threads, {MATMUL_SIDE}-square fp32 and bf16 matmuls, "
            f"a {COPY_BYTES // 2**20} MiB copy, bitsandbytes' 4-bit dequantisation and matmul"
        ),
        as_of=date.today().isoformat(),
    )
