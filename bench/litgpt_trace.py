"""`make bench-litgpt`: litgpt's own training step, traced, against the published LGC rows and lorafit's estimate.

The LGC rows of bench/calibration are litgpt 0.4.x fine-tuning runs (finetune/lora.py, Lightning's
BitsandbytesPrecision, bitsandbytes 0.42 as litgpt pinned it in 2024). This runs that step's code - litgpt's GPT,
its LoRA layers, `lm_head_chunk_size=128`, `chunked_cross_entropy` and the loop of `fit()` - on fake tensors of
each row's real shape (nothing is computed, every allocation is counted) under lorafit's LiveTensorTracker, and
prints three figures per row: the published peak, the trace's peak, and lorafit's analytic estimate with the
Settings and Runtime bench/calibration_rows.py gives that row. The trace against the publication checks that the
trace is the step that was measured; lorafit against the trace checks the litgpt terms of `Runtime`
(docs/memory-model.md, "litgpt's step"). `--layers` and `--scale` trace shallower and narrower models of the same
architectures, to check the terms away from the rows' shapes.

bitsandbytes 0.42's MatMul4Bit is stood in for (the installed bitsandbytes no longer keeps the layer input): it
dequantises to fp16 (Lightning quantises from an fp16 copy), casts to the compute dtype, and keeps its input as
a ctx attribute for backward, as 0.42 did.

litgpt is not a dependency of lorafit; `make bench-litgpt` installs the pinned versions into bench/out/litgpt.

    python bench/litgpt_trace.py [--rows LGC-02,...] [--layers N] [--scale K] [--seq-len N] [--json PATH]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import types
from collections import defaultdict
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from lorafit.memory import GIB, breakdown
from lorafit.models import ModelSpec
from lorafit.schema import Settings
from lorafit.trace.model import cuda_kernel_choices, parameter_tensors
from lorafit.trace.step import PAGED_MIN_NUMEL, watch_gradients
from lorafit.trace.tracker import (
    OPTIMIZER_STATES,
    PAGED_OPTIMIZER_STATES,
    PARAMETERS,
    TEMPORARIES,
    LiveTensorTracker,
    Phase,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from calibration_rows import DEFAULT_CSV, Mapping, Row, map_row, read_rows, resolve_model  # noqa: E402

LITGPT_DIR = Path(__file__).resolve().parent / "out" / "litgpt"
LM_HEAD_CHUNK = 128  # finetune/lora.py: model(input_ids, lm_head_chunk_size=128)


# litgpt's config name for each LGC row's model (finetune/<model>/<method>.yaml at the rows' commit)
LITGPT_CONFIGS = {
    "LGC-01": "Llama-2-7b-hf",
    "LGC-02": "Llama-2-7b-hf",
    "LGC-03": "Llama-3-8B",
    "LGC-04": "Llama-3-8B",
    "LGC-06": "Mistral-7B-v0.1",
    "LGC-07": "Mistral-7B-v0.1",
    "LGC-09": "gemma-7b",
    "LGC-10": "gemma-2-9b",
    "LGC-12": "tiny-llama-1.1b",
    "LGC-14": "Llama-3.2-1B",
    "LGC-15": "Llama-3.2-3B",
    "LGC-16": "Llama-3.2-3B",
}
LORA_FLAGS = {"q_proj": "query", "k_proj": "key", "v_proj": "value", "o_proj": "projection"}


@dataclass(frozen=True)
class Case:
    """One LGC row as bench/memory_accuracy.py reads it: its model, Settings and Runtime, and litgpt's names."""

    row: Row
    mapping: Mapping
    litgpt_name: str

    @property
    def lora_head(self) -> bool:
        return "head" in self.row.raw["lora_targets"]


def cases(csv_path: Path, wanted: set[str] | None) -> list[Case]:
    found = []
    for row in read_rows(csv_path):
        if row.id in LITGPT_CONFIGS and (wanted is None or row.id in wanted):
            spec = resolve_model(row.model)
            if isinstance(spec, str):
                raise SystemExit(f"{row.id}: {spec}")
            found.append(Case(row, map_row(row, spec), LITGPT_CONFIGS[row.id]))
    return found


# --- litgpt, imported without its package __init__ (which pulls in its CLI, tokenizer and API) -----------------
def import_litgpt_lora() -> types.ModuleType:
    if "litgpt.lora" in sys.modules:
        return sys.modules["litgpt.lora"]
    if str(LITGPT_DIR) not in sys.path:
        sys.path.insert(0, str(LITGPT_DIR))
    found = importlib.util.find_spec("litgpt")
    if found is None:
        raise SystemExit(f"litgpt is not installed in {LITGPT_DIR}: run `make bench-litgpt`")
    package = types.ModuleType("litgpt")
    package.__path__ = list(found.submodule_search_locations)
    sys.modules["litgpt"] = package
    import litgpt.lora

    return litgpt.lora


# --- bitsandbytes 0.42's 4-bit linear, as Lightning's BitsandbytesPrecision("nf4") sets it up ---------------------
class MatMul4Bit042(torch.autograd.Function):
    """`bnb.matmul_4bit` at 0.42: `linear(A, dequantize_4bit(B, state).to(A.dtype).t())`, and `ctx.tensors = (A, B)`
    when a gradient is needed - an attribute, so the input lives as long as the graph, not until backward uses it."""

    @staticmethod
    def forward(ctx: Any, A: torch.Tensor, packed: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:  # noqa: N803
        weight = _dequantize(packed, shape).to(A.dtype)
        ctx.shape = shape
        ctx.tensors = (A, packed) if ctx.needs_input_grad[0] else (None, None)
        return torch.nn.functional.linear(A, weight)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        _, packed = ctx.tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None
        return torch.matmul(grad_output, _dequantize(packed, ctx.shape).to(grad_output.dtype)), None, None


def _dequantize(packed: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """A fresh fp16 weight of `shape` (the quantisation state's dtype under Lightning), as the CUDA kernel writes."""
    return torch.empty(shape, dtype=torch.float16).normal_(0.0, 0.02)


class Linear4bit042(torch.nn.Module):
    """nf4 without double quantisation (`bnb.nf4`): 4 bits per weight (packed in `weight`, as Params4bit) and an
    fp32 absmax per 64."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = torch.nn.Parameter(
            torch.zeros(out_features * in_features // 2, dtype=torch.uint8), requires_grad=False
        )
        self.absmax = torch.nn.Parameter(torch.zeros(out_features * in_features // 64), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return MatMul4Bit042.apply(x, self.weight, (self.out_features, self.in_features))


def quantize_linears(module: torch.nn.Module) -> None:
    """Lightning's `_convert_layers`: every nn.Linear (the LM head too: litgpt passes no ignore_modules)."""
    for name, child in module.named_children():
        if isinstance(child, torch.nn.Linear):
            setattr(module, name, Linear4bit042(child.in_features, child.out_features))
        else:
            quantize_linears(child)


# --- the model ----------------------------------------------------------------------------------------------
def narrowed(spec: ModelSpec, layers: int, scale: int) -> tuple[dict[str, int], ModelSpec]:
    """litgpt's config overrides and lorafit's spec for `spec` at `layers` layers (0: all), every width divided by
    `scale` (heads and head groups kept)."""
    layers = layers or spec.num_hidden_layers
    head = max(spec.head_size // scale, 8)
    small = spec.scaled(
        num_hidden_layers=layers,
        hidden_size=spec.hidden_size // scale,
        intermediate_size=spec.intermediate_size // scale,
        head_dim=head,
        vocab_size=spec.vocab_size // scale,
    )
    shape = dict(
        n_layer=layers,
        n_head=small.num_attention_heads,
        n_query_groups=small.num_key_value_heads,
        head_size=head,
        n_embd=small.hidden_size,
        intermediate_size=small.intermediate_size,
        padded_vocab_size=small.vocab_size,
        vocab_size=small.vocab_size,
    )
    return shape, small


def build_model(lora: types.ModuleType, case: Case, shape: dict[str, int], seq_len: int) -> torch.nn.Module:
    """finetune/lora.py: GPT under `fabric.init_module` in bf16, LoRA as the yaml says, quantised, frozen."""
    settings = case.mapping.settings
    adapted = set(case.mapping.spec.lora_target_names(settings.lora_targets))
    config = lora.Config.from_name(
        case.litgpt_name,
        **shape,
        lora_r=settings.lora_r,
        lora_alpha=2 * settings.lora_r,
        lora_dropout=settings.lora_dropout,
        lora_head=case.lora_head,
        lora_mlp=any(name in adapted for name in ("gate_proj", "up_proj", "down_proj")),
        **{f"lora_{flag}": name in adapted for name, flag in LORA_FLAGS.items()},
    )
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = lora.GPT(config)
    finally:
        torch.set_default_dtype(default)
    lora.mark_only_lora_as_trainable(model)
    if settings.quant == "nf4":
        quantize_linears(model)
    # fit(): the longest sequence of the data sets max_seq_length; that rebuilds the rope cache outside
    # init_module, in fp32
    model.max_seq_length = seq_len
    return model


# --- the loop of finetune/lora.py fit() -----------------------------------------------------------------------
class _StateTags(dict):
    def __init__(self, tracker: LiveTensorTracker, paged: bool) -> None:
        super().__init__()
        self._tracker, self._paged = tracker, paged

    def __setitem__(self, key: Any, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            paged = self._paged and value.numel() >= PAGED_MIN_NUMEL
            self._tracker.retag(value, PAGED_OPTIMIZER_STATES if paged else OPTIMIZER_STATES, only_from=(TEMPORARIES,))
        super().__setitem__(key, value)


def trace_case(case: Case, shape: dict[str, int], settings: Settings, steps: int = 2) -> tuple[Phase, int]:
    """Peak live bytes of `steps` optimizer steps of two micro-batches each (from the second on, a micro-batch
    of a longer accumulation sees the same tensors), as fit() runs them."""
    lora = import_litgpt_lora()
    import litgpt.utils

    quantized = settings.quant == "nf4"
    fake = FakeTensorMode()
    with fake:
        model = build_model(lora, case, shape, settings.seq_len)
    trainable = [p for p in model.parameters() if p.requires_grad]
    # LoRA: torch.optim.AdamW (foreach on CUDA); QLoRA: instantiate_bnb_optimizer's bnb PagedAdamW (32-bit),
    # whose big states live in managed memory; its step keeps no parameter-sized temporaries
    optimizer = torch.optim.AdamW(trainable, lr=2e-4, foreach=not quantized)
    tracker = LiveTensorTracker()
    optimizer.state = defaultdict(partial(_StateTags, tracker, quantized))
    for tensor in parameter_tensors(model):
        tracker.track(tensor, PARAMETERS)
    watch_gradients(model, tracker)

    def label(step: int, micro: int, stage: str) -> None:
        tracker.set_phase(Phase(step, micro, stage))

    accumulation = 2
    batch = (settings.micro_batch, settings.seq_len)
    with fake, tracker, cuda_kernel_choices():
        for step in range(1, steps + 1):
            for micro in range(1, accumulation + 1):
                label(step, micro, "forward")
                tracker.start_forward()
                input_ids = torch.randint(0, shape["padded_vocab_size"], batch)
                targets = torch.randint(0, shape["padded_vocab_size"], batch)
                # `logits` and `loss` are the loop's variables: the last micro-batch's stay alive until these
                # assignments replace them, after the next forward and loss
                logits = model(input_ids, lm_head_chunk_size=LM_HEAD_CHUNK)
                label(step, micro, "forward: loss")
                logits[-1] = logits[-1][..., :-1, :]
                loss = litgpt.utils.chunked_cross_entropy(logits, targets[..., 1:])
                tracker.retag_forward_leftovers()
                label(step, micro, "backward")
                (loss / accumulation).backward()
            label(step, 0, "optimizer step")
            optimizer.step()
            optimizer.zero_grad()
    del logits, loss
    phase, snapshot = tracker.peak
    return phase, snapshot.total_bytes


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--csv", type=Path, default=DEFAULT_CSV)
    parser.add_argument("--rows", help="comma-separated LGC row ids (default: all litgpt rows lorafit scores)")
    parser.add_argument("--layers", type=int, default=0, help="decoder layers (default: the model's own)")
    parser.add_argument("--scale", type=int, default=1, help="divide every width by this (default: real widths)")
    parser.add_argument("--seq-len", type=int, help="instead of the row's (Alpaca2k's longest batch, 512)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    as_run = args.layers == 0 and args.scale == 1 and args.seq_len is None
    results = []
    print(
        "the trace of litgpt's step and lorafit's analytic estimate of the same step (allocated peak)"
        + (
            "; the row's published figure beside them"
            if as_run
            else f"; {args.layers} layers, widths / {args.scale}: not comparable with the published figures"
        )
    )
    print(
        f"{'row':8} {'method':6} {'measured':>9} {'trace':>9} {'vs meas.':>9} {'lorafit':>9} {'vs trace':>9}"
        "  trace peak / lorafit phase"
    )
    for case in cases(args.csv, set(args.rows.split(",")) if args.rows else None):
        shape, spec = narrowed(case.mapping.spec, args.layers, args.scale)
        settings = case.mapping.settings
        if args.seq_len:
            settings = settings.model_copy(update={"seq_len": args.seq_len})
        phase, traced = trace_case(case, shape, settings)
        parts, lorafit_phase = breakdown(spec, settings, case.mapping.runtime)
        predicted = sum(parts.values())
        unit_name, unit = case.row.unit or ("GiB", GIB)
        measured = case.row.peak * unit if as_run and case.row.peak else None
        versus_measured = f"{100 * (traced - measured) / measured:+8.1f}%" if measured else f"{'-':>9}"
        error = 100 * (predicted - traced) / traced
        print(
            f"{case.row.id:8} {settings.method:6} "
            + (f"{measured / unit:6.2f} {unit_name:>2}" if measured else f"{'-':>9}")
            + f" {traced / unit:6.2f} {unit_name:>2} {versus_measured} {predicted / unit:6.2f} {unit_name:>2}"
            f" {error:+8.1f}%  {phase.describe()} / {lorafit_phase}"
        )
        results.append(
            dict(
                row=case.row.id,
                measured_bytes=measured,
                trace_bytes=traced,
                lorafit_bytes=predicted,
                lorafit_vs_trace_pct=round(error, 2),
                trace_phase=phase.describe(),
                lorafit_phase=lorafit_phase,
            )
        )
    errors = sorted(abs(r["lorafit_vs_trace_pct"]) for r in results)
    if errors:
        print(f"lorafit against the trace: worst |error| {errors[-1]:.1f}% over {len(errors)} rows")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
