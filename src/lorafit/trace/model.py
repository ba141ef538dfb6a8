"""The model a trace runs: built from its config, with fake tensors, through the trainer's own set-up.

`fake_model` does what `build.load_model` + `build.prepare` do for `lorafit train`, minus reading weights:
transformers builds the architecture from the config in the compute dtype, transformers' own bitsandbytes
quantizer picks and replaces the linears to quantise (the stand-in takes each one's place, holding the packed
storage instead of quantising real weights), and `build.prepare` adds checkpointing and the LoRA adapters.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from lorafit.errors import LorafitError
from lorafit.train import build, model_files

if TYPE_CHECKING:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import PreTrainedModel

    from lorafit.models import ModelSpec
    from lorafit.schema import Settings


def at_depth(spec: ModelSpec, num_layers: int) -> ModelSpec:
    """The same architecture with `num_layers` decoder layers (the trace extrapolates over depth)."""
    if num_layers == spec.num_hidden_layers:
        return spec
    if spec.latent is not None and spec.latent.first_k_dense_replace >= num_layers:
        dense = spec.latent.first_k_dense_replace
        raise LorafitError(
            f"--exact traces {num_layers} blocks and extrapolates; {spec.name}'s first {dense} are dense, so the trace "
            "would not see its experts: the estimate without --exact counts them"
        )
    return spec.model_copy(update={"num_hidden_layers": num_layers, "published_params": None})


def fake_model(
    spec: ModelSpec, settings: Settings, fake_mode: FakeTensorMode, *, kbit_upcast: bool = False
) -> tuple[PreTrainedModel, int]:
    """The prepared training model with fake tensors, and its parameter count before quantisation."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers.initialization import no_init_weights

    config = build.checked_hf_config(spec, settings)
    # a vision tower's initialisers (SigLIP's truncated normal) read values, which fake tensors do not hold; the
    # values are never used, so they are left uninitialised
    skip_init = no_init_weights() if spec.vision is not None else contextlib.nullcontext()
    try:
        with fake_mode, skip_init:
            auto_class = model_files.auto_model_class(config.model_type)
            model = auto_class.from_config(config, dtype=build.compute_dtype(settings))
            if spec.vision is not None:
                model.tie_weights()  # part of the init_weights that no_init_weights skipped
    except (
        ValueError,
        TypeError,
        KeyError,
        AttributeError,
        IndexError,
        RuntimeError,
        ImportError,
        StrictDataclassError,
    ) as error:
        raise build.setup_error(spec, "transformers cannot build it from its config", error) from None
    total_params = model.num_parameters()
    if settings.quant == "nf4":
        quantize_4bit(model, settings, fake_mode)
    elif settings.quant == "int8":
        raise LorafitError("--exact models 4-bit (--quant nf4) bases; LLM.int8 (--quant int8) is not traced yet")
    model.train()  # from_pretrained returns eval mode; the Trainer switches to train mode
    with fake_mode, _swappable_fake_parameters(fake_mode), _copyable_fake_tensors():
        if kbit_upcast:
            from peft import prepare_model_for_kbit_training

            model = prepare_model_for_kbit_training(
                model,
                use_gradient_checkpointing=settings.grad_ckpt,
                gradient_checkpointing_kwargs={"use_reentrant": False},
            )
        model = build.checked_prepare(model, spec, settings)
    return model, total_params


@contextlib.contextmanager
def _swappable_fake_parameters(fake_mode: FakeTensorMode) -> Iterator[None]:
    """Let `module.to(...)` convert fake parameters (peft moves each new adapter to its base layer's device).

    nn.Module swaps fake parameters in place with torch.utils.swap_tensors, which refuses a tensor that has
    weak references, and FakeTensorMode's converter memo holds one to every fake parameter. The memo only
    caches real-to-fake conversions, which building a model from its config never needs."""
    original = torch.utils.swap_tensors

    def swap_tensors(first: torch.Tensor, second: torch.Tensor) -> None:
        fake_mode.fake_tensor_converter.meta_converter.tensor_memo.clear()
        original(first, second)

    torch.utils.swap_tensors = swap_tensors
    try:
        yield
    finally:
        torch.utils.swap_tensors = original


@contextlib.contextmanager
def _copyable_fake_tensors() -> Iterator[None]:
    """Let copy.deepcopy copy a fake tensor as a clone in the same fake mode (peft's modules_to_save, which
    train_embeddings turns on, deep-copies the embedding and the head). torch's Tensor.__deepcopy__ would
    deep-copy a FakeTensor's slots too, the FakeTensorMode and its dispatch cache among them: a second mode
    whose cache entries outlive their tensors and crash the process later."""
    from torch._subclasses.fake_tensor import FakeTensor

    def deepcopy(self: torch.Tensor, memo: dict[int, Any]) -> torch.Tensor:
        copied = self.detach().clone().requires_grad_(self.requires_grad)
        if getattr(self, "_is_param", False):
            copied._is_param = True  # type: ignore[attr-defined]  # what nn.Parameter marks on a subclass
        memo[id(self)] = copied
        return copied

    FakeTensor.__deepcopy__ = deepcopy  # type: ignore[method-assign]
    try:
        yield
    finally:
        del FakeTensor.__deepcopy__


@contextlib.contextmanager
def eager_data_checks() -> Iterator[None]:
    """Give the answers eager code reads from the data, which fake tensors do not have.

    transformers looks at position_ids to detect several sequences packed into one row; with a fake tensor it
    cannot look, assumes packing and builds a 4-D mask, which turns off grouped-query attention in SDPA
    (k and v get repeated to every head) and costs a (batch, 1, seq, seq) mask. The trace's batches are one
    sequence per row, so the answer is 'not packed', as eager code finds on the same batch."""
    from torch._subclasses.fake_tensor import is_fake
    from transformers import masking_utils

    original = masking_utils.find_packed_sequence_indices

    def find_packed_sequence_indices(position_ids: torch.Tensor) -> torch.Tensor | None:
        return None if is_fake(position_ids) else original(position_ids)

    masking_utils.find_packed_sequence_indices = find_packed_sequence_indices
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


@contextlib.contextmanager
def cuda_kernel_choices() -> Iterator[None]:
    """Run the CUDA side of the ATen functions that pick their kernel by device and differ in what they keep.

    The trace's tensors are on the CPU device, but the step it predicts runs on a GPU. `F.dropout` is the one
    that matters: on CUDA it runs the fused `native_dropout`, which keeps a bool mask (1 byte per element); on
    the CPU it multiplies by a noise tensor of the input's dtype and keeps that (4 bytes for peft's fp32
    casts). ATen's `dropout` takes the fused kernel on CUDA for 0 < p < 1 and a non-empty input."""
    original = torch.nn.functional.dropout

    def dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
        if training and 0 < p < 1 and input.numel() > 0 and not inplace:
            return torch.native_dropout(input, p, True)[0]
        return original(input, p, training, inplace)

    torch.nn.functional.dropout = dropout
    torch.nn.functional.scaled_dot_product_attention = _sdpa_unequal_value_dims(original_sdpa := _SDPA)
    torch.is_autocast_enabled = _autocast_seen_as_cuda(original_enabled := torch.is_autocast_enabled)
    try:
        yield
    finally:
        torch.nn.functional.dropout = original
        torch.nn.functional.scaled_dot_product_attention = original_sdpa
        torch.is_autocast_enabled = original_enabled


_SDPA = torch.nn.functional.scaled_dot_product_attention


def _autocast_seen_as_cuda(is_enabled: Any) -> Any:
    """`torch.is_autocast_enabled()` without a device asks about CUDA's autocast, and peft's bitsandbytes LoRA
    layers ask it to decide whether to cast their input to the adapter dtype (tuners/lora/bnb.py). The trace's
    autocast is the CPU's, which on the GPU would be CUDA's: the question without a device answers for it."""

    def enabled(device_type: str | None = None) -> bool:
        return bool(is_enabled("cpu" if device_type is None else device_type))

    return enabled


def _sdpa_unequal_value_dims(sdpa: Any) -> Any:
    """DeepSeek's latent attention has values narrower than queries and keys (v_head_dim 128, q/k 192): the CPU
    picks the math kernel for that (sdp_utils_cpp.cpp check_head_dim_size_cpp wants all three equal), which keeps
    the score matrix, while CUDA runs the memory-efficient kernel, which allows a different value width
    (cuda/sdp_utils.cpp check_head_dim_size_mem_efficient) and keeps the output and an fp32 logsumexp."""

    def picked(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: Any = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        **kwargs: Any,
    ) -> Any:
        if query.shape[-1] == value.shape[-1] or kwargs.get("enable_gqa"):
            return sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, **kwargs)
        bias = attn_mask
        if bias is not None and bias.dtype == torch.bool:
            bias = torch.zeros_like(bias, dtype=query.dtype).masked_fill(~bias, float("-inf"))
        efficient = torch.ops.aten._scaled_dot_product_efficient_attention
        return efficient(query, key, value, bias, True, dropout_p, is_causal, scale=scale)[0]

    return picked


def quantize_4bit(model: PreTrainedModel, settings: Settings, fake_mode: FakeTensorMode) -> None:
    """What from_pretrained(quantization_config=...) does to the module tree, with stand-ins for the weights.

    transformers' Bnb4BitHfQuantizer chooses the modules (everything but the LM head and the modules the
    model keeps in fp32) and makes unloaded meta-device Linear4bit layers; each is swapped for a stand-in
    with the same settings and storage. The bookkeeping from_pretrained does after loading follows."""
    import bitsandbytes as bnb
    from transformers.quantizers import AutoHfQuantizer

    from lorafit.trace.standins import Linear4bitStandIn

    quantizer = AutoHfQuantizer.from_config(build.quantization_config(settings), pre_quantized=False)
    quantizer.preprocess_model(model, device_map={"": "cpu"})  # meta-device skeletons: real, empty tensors
    weight_dtype = build.compute_dtype(settings)
    with fake_mode:
        for name, module in list(model.named_modules()):
            if isinstance(module, bnb.nn.Linear4bit) and not isinstance(module, Linear4bitStandIn):
                model.set_submodule(name, Linear4bitStandIn.like(module, weight_dtype))
    model.hf_quantizer = quantizer
    quantizer.postprocess_model(model)


def parameter_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Parameters, buffers and 4-bit quantisation states: everything the model holds before a step."""
    tensors: list[torch.Tensor] = list(model.parameters()) + list(model.buffers())
    for param in model.parameters():
        state = getattr(param, "quant_state", None)
        if state is not None:
            from lorafit.trace.standins import quant_state_tensors

            tensors += quant_state_tensors(state)
    return tensors
