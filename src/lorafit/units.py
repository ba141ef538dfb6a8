"""Units, converted here and nowhere else: bytes, binary GiB / MiB, decimal GB, and bytes per element.

Memory is computed in bytes and shown in GiB (what nvidia-smi's MiB figure / 1024 and torch.cuda report).
A card sold as "24 GB" has 24 GiB of memory chips (nvidia-smi: 24564 MiB usable), so a size as sold is read
as GiB; decimal GB appear only where a source quotes bytes / 1e9 (disk, bandwidth in GB/s).
"""

from __future__ import annotations

BYTES_PER_GIB = 2**30
BYTES_PER_MIB = 2**20
BYTES_PER_GB = 10**9

# Bytes of one element of each storage dtype; nf4 packs two 4-bit codes in a byte.
DTYPE_BYTES: dict[str, float] = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1, "nf4": 0.5}


def gib(n_bytes: float) -> float:
    """Bytes -> GiB."""
    return n_bytes / BYTES_PER_GIB


def gib_to_bytes(n_gib: float) -> float:
    return n_gib * BYTES_PER_GIB


def gb(n_bytes: float) -> float:
    """Bytes -> decimal GB."""
    return n_bytes / BYTES_PER_GB
