"""The terms of the memory model, measured by tracing: what docs/exact.md quotes, next to memory.py's figure.

    python -m lorafit.trace.terms [MODEL] [--seq-len N] [--micro-batch B]

For one model and a few settings, traces the real step at depths 2 and 3 and reads off, per token:
the bytes one decoder layer keeps for backward, the loss/logits transient, the extra of backward through a
(recomputed) layer, QLoRA's dequantisation transient, and the optimizer step's temporaries - each next to
the analytic term of `lorafit.memory` for the same settings. Differences between two traced depths cancel
everything but one layer; differences between two phases of one trace cancel everything but that phase.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lorafit import memory
from lorafit.models import ModelSpec, resolve
from lorafit.schema import Settings
from lorafit.trace.api import StepTrace, runtime_options, trace_runtime, trace_step
from lorafit.trace.tracker import ACTIVATIONS, Phase
from lorafit.units import BYTES_PER_GIB

STEP, MICRO = 2, 1  # read everything off the second step (optimizer states exist), first micro-batch


@dataclass(frozen=True)
class Terms:
    """Measured bytes per token (except the optimizer step, in bytes) and the analytic figure for each."""

    saved_per_layer: float
    saved_per_layer_analytic: float
    loss_transient: float
    loss_transient_analytic: float
    layer_backward: float
    layer_backward_analytic: float
    forward_layer_transient: float
    dequant_analytic: float
    optimizer_step_temp: float
    optimizer_step_temp_analytic: float


def _start(trace: StepTrace, stage: str, layer: int | None = None, micro: int = MICRO) -> int:
    return trace.phase_starts[Phase(STEP, micro, stage, layer)].total_bytes


def _peak(trace: StepTrace, stage: str, layer: int | None = None, micro: int = MICRO) -> int:
    return trace.phase_peaks[Phase(STEP, micro, stage, layer)].total_bytes


def _saved(trace: StepTrace) -> int:
    return trace.phase_starts[Phase(STEP, MICRO, "backward: loss")].by_category[ACTIVATIONS]


def measure_terms(spec: ModelSpec, settings: Settings, runtime: memory.Runtime = memory.Runtime()) -> Terms:
    options = runtime_options(runtime)
    two, three = trace_step(spec, settings, 2, **options), trace_step(spec, settings, 3, **options)
    tokens = settings.tokens_per_micro_batch
    last = three.num_layers - 1
    if settings.grad_ckpt:
        backward = _peak(three, "backward: recompute", last) - _start(three, "backward: layer", last)
        backward_analytic = memory.recompute_bytes(spec, settings, runtime)
    else:
        backward = _peak(three, "backward: layer", last) - _start(three, "backward: layer", last)
        backward_analytic = memory.grad_buffer_bytes(spec, settings)
    per_layer_analytic = (
        memory.checkpoint_bytes_per_layer(spec, settings, runtime)
        if settings.grad_ckpt
        else memory.activation_bytes_per_layer(spec, settings, runtime)
    )
    forward_layer = _peak(three, "forward: layer", last) - _start(three, "forward: layer", last)
    step_micro = 0
    optimizer = _peak(three, "optimizer step", micro=step_micro) - _start(three, "optimizer step", micro=step_micro)
    return Terms(
        saved_per_layer=(_saved(three) - _saved(two)) / tokens,
        saved_per_layer_analytic=per_layer_analytic / tokens,
        loss_transient=(_peak(three, "backward: loss") - _start(three, "forward: LM head")) / tokens,
        loss_transient_analytic=memory.logits_bytes(spec, settings, runtime) / tokens,
        layer_backward=backward / tokens,
        layer_backward_analytic=backward_analytic / tokens,
        forward_layer_transient=forward_layer / tokens,
        dequant_analytic=memory.dequant_bytes(spec, settings) / tokens,
        optimizer_step_temp=optimizer,
        optimizer_step_temp_analytic=memory.optimizer_step_temp_bytes(spec, settings, runtime),
    )


SETTINGS = {
    "qlora, checkpointing": {"method": "qlora", "grad_ckpt": True},
    "qlora": {"method": "qlora", "grad_ckpt": False},
    "qlora, dropout 0": {"method": "qlora", "grad_ckpt": False, "lora_dropout": 0.0},
    "qlora, q/v targets": {"method": "qlora", "grad_ckpt": False, "lora_targets": "qv"},
    "lora, checkpointing": {"method": "lora", "quant": "none", "grad_ckpt": True},
    "lora": {"method": "lora", "quant": "none", "grad_ckpt": False},
    "full, checkpointing": {"method": "full", "quant": "none", "grad_ckpt": True},
    "full": {"method": "full", "quant": "none", "grad_ckpt": False},
}


def dequant_transient(in_features: int, out_features: int, double_quant: bool = True) -> int:
    """Bytes a 4-bit linear allocates for its own forward, above its input and output: the weight dequantised
    to bf16 (and, double-quantised, the fp32 absmax rebuilt from the nested one). Fake tensors, 16 tokens."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lorafit.trace.standins import Linear4bitStandIn
    from lorafit.trace.tracker import PARAMETERS, LiveTensorTracker

    with FakeTensorMode():
        layer = Linear4bitStandIn(
            in_features,
            out_features,
            False,
            torch.bfloat16,
            weight_dtype=torch.bfloat16,
            compress_statistics=double_quant,
        )
        x = torch.empty(1, 16, in_features, dtype=torch.bfloat16, requires_grad=True)
        tracker = LiveTensorTracker()
        for tensor in [*layer.parameter_tensors(), x]:
            tracker.track(tensor, PARAMETERS)
        before = tracker.live_bytes
        with tracker:
            out = layer(x)
        return tracker.peak[1].total_bytes - before - out.untyped_storage().nbytes()


def _at_depth(spec: ModelSpec, settings: Settings, measure: Callable[[StepTrace], float], **options: Any) -> float:
    """`measure` of traces at depths 2 and 3, extended along its line to the model's depth."""
    two, three = (measure(trace_step(spec, settings, n, **options)) for n in (2, 3))
    return two + (three - two) * (spec.num_hidden_layers - 2)


def forgotten(spec: ModelSpec, tokens: int = 2048) -> dict[str, float]:
    """What the real code path costs that back-of-the-envelope calculators leave out, in GiB at the model's
    full depth, micro-batch 1 x `tokens`; each is a difference of two traces or of two moments of one."""
    gib = BYTES_PER_GIB
    start, lm_head = Phase(1, 1, "batch"), Phase(STEP, MICRO, "forward: LM head")
    loss, step = Phase(STEP, MICRO, "backward: loss"), Phase(STEP, 0, "optimizer step")
    qlora = Settings(method="qlora", seq_len=tokens, grad_ckpt=False)
    full = Settings(method="full", quant="none", seq_len=tokens, grad_ckpt=True)

    def params(trace: StepTrace) -> float:
        return trace.phase_starts[start].total_bytes

    def saved(trace: StepTrace) -> float:
        return trace.phase_starts[loss].by_category[ACTIVATIONS]

    def loss_transient(trace: StepTrace) -> float:
        return trace.phase_peaks[loss].total_bytes - trace.phase_starts[lm_head].total_bytes

    def step_temp(trace: StepTrace) -> float:
        return trace.phase_peaks[step].total_bytes - trace.phase_starts[step].total_bytes

    def states_over_8bit(trace: StepTrace) -> float:
        return trace.phase_starts[step].by_category["optimizer_states"] - 2 * trace.trainable_params * (1 + 4 / 256)

    largest = max(((i, o) for _, i, o, _ in spec.layer_linears()), key=lambda dims: dims[0] * dims[1])
    loss_bytes = _at_depth(spec, qlora, loss_transient)
    return {
        "peft prepare_model_for_kbit_training upcast": (
            _at_depth(spec, qlora, params, kbit_upcast=True) - _at_depth(spec, qlora, params)
        )
        / gib,
        "loss and logits transient": loss_bytes / gib,
        "  the same, bytes per token per vocabulary entry": loss_bytes / tokens / spec.vocab_size,
        "LoRA dropout copies and masks (dropout 0.05 vs 0)": (
            _at_depth(spec, qlora, saved) - _at_depth(spec, qlora.model_copy(update={"lora_dropout": 0.0}), saved)
        )
        / gib,
        "QLoRA dequantised weight, largest linear": dequant_transient(*largest) / gib,
        "foreach AdamW step temporaries (full fine-tuning)": _at_depth(spec, full, step_temp, fused_optimizer=False)
        / gib,
        "fused AdamW step temporaries (full fine-tuning)": _at_depth(spec, full, step_temp) / gib,
        "32-bit states under 8-bit AdamW (full fine-tuning)": _at_depth(
            spec, full.model_copy(update={"optimizer": "adamw_8bit"}), states_over_8bit
        )
        / gib,
    }


def compare(spec: ModelSpec, settings: Settings, runtime: memory.Runtime = memory.Runtime()) -> str:
    """One line: the traced peak (phase, categories) next to memory.py's (phase, parts), in GiB."""

    gib = BYTES_PER_GIB
    depth = trace_runtime(spec, settings, runtime)
    parts, phase = memory.breakdown(spec, settings, runtime)
    analytic = sum(parts.values())
    traced = ", ".join(f"{k} {v / gib:.3f}" for k, v in depth.breakdown.items() if v)
    modelled = ", ".join(f"{k} {v / gib:.3f}" for k, v in parts.items() if v)
    return (
        f"traced {depth.peak_bytes / gib:.3f} at {depth.peak_phase} [{traced}] | analytic {analytic / gib:.3f} "
        f"({analytic / depth.peak_bytes - 1:+.1%}) at {phase} [{modelled}]"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="llama-2-7b")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--forgotten", action="store_true", help="also measure what calculators forget")
    parser.add_argument("--compare", action="store_true", help="also compare each peak with memory.py's")
    parser.add_argument(
        "--no-autocast",
        action="store_true",
        help="a bf16 forward without autocast (stacks other than transformers' Trainer)",
    )
    args = parser.parse_args(argv)
    spec = resolve(args.model)
    runtime = memory.Runtime(autocast=not args.no_autocast)
    print(
        f"{spec.name}, micro-batch {args.micro_batch} x {args.seq_len} tokens"
        f"{', no autocast' if args.no_autocast else ''}; bytes per token (optimizer step: MiB), traced / memory.py"
    )
    header = (
        "settings",
        "saved/layer",
        "loss+logits",
        "layer backward",
        "fwd layer transient",
        "dequant",
        "optimizer step",
    )
    print(" | ".join(header))
    for label, overrides in SETTINGS.items():
        settings = Settings(seq_len=args.seq_len, micro_batch=args.micro_batch, **overrides)
        t = measure_terms(spec, settings, runtime)
        mib = 2**20
        cells = [
            label,
            f"{t.saved_per_layer:,.0f} / {t.saved_per_layer_analytic:,.0f}",
            f"{t.loss_transient:,.0f} / {t.loss_transient_analytic:,.0f}",
            f"{t.layer_backward:,.0f} / {t.layer_backward_analytic:,.0f}",
            f"{t.forward_layer_transient:,.0f}",
            f"{t.dequant_analytic:,.0f}",
            f"{t.optimizer_step_temp / mib:,.1f} / {t.optimizer_step_temp_analytic / mib:,.1f}",
        ]
        print(" | ".join(cells))
    if args.compare:
        print(f"\ntraced peak against memory.py, {spec.name}, micro-batch {args.micro_batch} x {args.seq_len}:")
        for label, overrides in SETTINGS.items():
            settings = Settings(seq_len=args.seq_len, micro_batch=args.micro_batch, **overrides)
            print(f"  {label}: {compare(spec, settings, runtime)}")
    if args.forgotten:
        print(f"\nwhat calculators forget, {spec.name}, micro-batch 1 x 2048 tokens, GiB (traced):")
        for label, value in forgotten(spec).items():
            print(f"  {label}: {value:,.3f}")


if __name__ == "__main__":
    main()
