"""bitsandbytes pieces rebuilt with the same storage, so they can hold fake tensors.

`bnb.nn.Params4bit` quantises real weights when it is moved to a device and cannot wrap a fake tensor, so a
4-bit layer cannot be built under `FakeTensorMode`. `Linear4bitStandIn` is a `bnb.nn.Linear4bit` whose packed
weight is a plain uint8 parameter carrying a hand-built `QuantState` of exactly the tensors
`bnb.functional.quantize_4bit` makes; everything after construction (its `forward`, `bnb.matmul_4bit`, the
`MatMul4Bit` autograd function and what it saves, peft's `lora.bnb.Linear4bit` wrapper) is bitsandbytes' and
peft's own code. tests/test_trace.py checks storage and saved tensors against a real quantised layer.
"""

from __future__ import annotations

import bitsandbytes as bnb
import torch
from bitsandbytes.functional import QuantState

NESTED_BLOCKSIZE = 256  # quantize_4bit(compress_statistics=True) quantises the absmax in blocks of 256
CODE_4BIT = 16  # entries of the NF4 / FP4 code book (get_4bit_type)
CODE_8BIT = 256  # entries of the dynamic map the nested absmax is quantised with (create_dynamic_map)


def packed_4bit_tensors(
    out_features: int,
    in_features: int,
    *,
    dtype: torch.dtype,
    blocksize: int = 64,
    quant_type: str = "nf4",
    compress_statistics: bool = True,
    quant_storage: torch.dtype = torch.uint8,
) -> tuple[torch.Tensor, QuantState]:
    """The packed weight and quantisation state `bnb.functional.quantize_4bit` returns for an
    (out_features x in_features) weight, with zeros for values.

    Packed: two 4-bit codes per byte, shape ((n + 1) // 2, 1). State: the 16-entry code book (fp32), one
    absmax per `blocksize` weights - fp32, or with double quantisation uint8 plus, per 256 of them, an fp32
    absmax, a 256-entry fp32 code book and one fp32 offset. The code books are zeros too: only their size
    matters here (their values would need real tensors to compute)."""
    n = out_features * in_features
    blocks = -(n // -blocksize)
    packed = torch.zeros(((n + 1) // (quant_storage.itemsize * 2), 1), dtype=quant_storage)
    code = torch.zeros(CODE_4BIT, dtype=torch.float32)
    shape = torch.Size((out_features, in_features))
    if not compress_statistics:
        absmax = torch.zeros(blocks, dtype=torch.float32)
        return packed, QuantState(
            absmax=absmax, shape=shape, code=code, blocksize=blocksize, quant_type=quant_type, dtype=dtype
        )
    nested_blocks = -(blocks // -NESTED_BLOCKSIZE)
    nested = QuantState(
        absmax=torch.zeros(nested_blocks, dtype=torch.float32),
        code=torch.zeros(CODE_8BIT, dtype=torch.float32),
        blocksize=NESTED_BLOCKSIZE,
        dtype=torch.float32,
    )
    state = QuantState(
        absmax=torch.zeros(blocks, dtype=torch.uint8),
        shape=shape,
        code=code,
        blocksize=blocksize,
        quant_type=quant_type,
        dtype=dtype,
        offset=torch.zeros((), dtype=torch.float32),
        state2=nested,
    )
    return packed, state


def quant_state_tensors(state: QuantState) -> list[torch.Tensor]:
    """Every tensor a QuantState keeps alive (the ones that count against GPU memory)."""
    tensors = [state.absmax, state.code]
    if state.offset is not None:
        tensors.append(state.offset)
    if state.state2 is not None:
        tensors += quant_state_tensors(state.state2)
    return [t for t in tensors if isinstance(t, torch.Tensor)]


class Linear4bitStandIn(bnb.nn.Linear4bit):
    """A `bnb.nn.Linear4bit` built from shapes: same parameter storage, same forward and backward."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        compute_dtype: torch.dtype | None,
        *,
        weight_dtype: torch.dtype,
        compress_statistics: bool = True,
        quant_type: str = "nf4",
        blocksize: int = 64,
        quant_storage: torch.dtype = torch.uint8,
    ) -> None:
        torch.nn.Module.__init__(self)  # bnb's __init__ would build a Params4bit, which fake tensors can't be
        self.in_features = in_features
        self.out_features = out_features
        packed, state = packed_4bit_tensors(
            out_features,
            in_features,
            dtype=weight_dtype,
            blocksize=blocksize,
            quant_type=quant_type,
            compress_statistics=compress_statistics,
            quant_storage=quant_storage,
        )
        self.weight = torch.nn.Parameter(packed, requires_grad=False)
        # The attributes Params4bit carries, which Linear4bit.forward and peft's dispatch read.
        self.weight.quant_state = state
        self.weight.blocksize = blocksize
        self.weight.compress_statistics = compress_statistics
        self.weight.quant_type = quant_type
        self.weight.quant_storage = quant_storage
        self.weight.bnb_quantized = True
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(out_features, dtype=weight_dtype))
        else:
            self.register_parameter("bias", None)
        self.compute_dtype = compute_dtype
        self.compute_type_is_set = compute_dtype is not None
        self.quant_state = state
        self.quant_storage = quant_storage
        self.support_avx512bf16_for_cpu = False  # the CPU inference repacking never runs in training

    @classmethod
    def like(cls, layer: bnb.nn.Linear4bit, weight_dtype: torch.dtype) -> Linear4bitStandIn:
        """A stand-in with the settings of an (unloaded, meta-device) Linear4bit that transformers made."""
        return cls(
            layer.in_features,
            layer.out_features,
            layer.bias is not None,
            layer.compute_dtype,
            weight_dtype=weight_dtype,
            compress_statistics=layer.weight.compress_statistics,
            quant_type=layer.weight.quant_type,
            blocksize=layer.weight.blocksize,
            quant_storage=layer.quant_storage,
        )

    def parameter_tensors(self) -> list[torch.Tensor]:
        return [self.weight, *quant_state_tensors(self.weight.quant_state)]
