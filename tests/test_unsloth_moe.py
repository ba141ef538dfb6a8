"""`--stack unsloth` for the families it loads through FastModel: gpt-oss, Qwen3-MoE (4-bit experts) and Gemma 3.

Expected figures are worked out from the model's shapes and bitsandbytes' NF4 layout, not read from the estimator.
"""

from __future__ import annotations

import json

import pytest

from conftest import bench_module, run_cli
from lorafit import hardware, memory, timing
from lorafit.models import resolve
from lorafit.schema import Settings

STEP = dict(method="qlora", micro_batch=1, seq_len=2048, lora_dropout=0.0, optimizer="adamw_8bit", double_quant=True)
# NF4 with double quantisation: half a byte a weight, one uint8 absmax per 64 weights, one fp32 per 256 absmax
NF4_DQ_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)


def expert_weights(name: str) -> int:
    """Every layer's experts: gate_up (2 x width x hidden) and down (width x hidden) for each expert."""
    spec = resolve(name)
    width = spec.moe_intermediate_size or spec.intermediate_size
    return spec.num_hidden_layers * spec.num_local_experts * 3 * width * spec.hidden_size


def weights(name: str, stack: str) -> float:
    step = Settings(stack=stack, **STEP)
    return memory.weights_bytes(resolve(name), step, memory.stack_runtime(step))


@pytest.mark.parametrize("name", ["gpt-oss-20b", "qwen3-30b-a3b", "mixtral-8x7b"])
def test_unsloth_stores_the_moe_experts_in_4_bit_where_the_hf_stacks_keep_them_16_bit(name: str) -> None:
    """transformers' bitsandbytes integration packs nn.Linear only; Unsloth's load packs the experts too."""
    saved = weights(name, "lorafit") - weights(name, "unsloth")
    assert saved == pytest.approx(expert_weights(name) * (2 - NF4_DQ_BYTES), rel=1e-9)
    assert weights(name, "trl") == weights(name, "lorafit")


def test_unsloth_holds_one_layers_dequantised_experts_for_its_grouped_matmuls() -> None:
    """gpt-oss-20b: 32 experts of 2880 x 5760 and 2880 x 2880 in bf16, where the HF stacks dequantise one
    linear at a time."""
    spec = resolve("gpt-oss-20b")
    unsloth = Settings(stack="unsloth", **STEP)
    assert memory.dequant_bytes(spec, unsloth, memory.stack_runtime(unsloth)) == 32 * 3 * 2880 * 2880 * 2
    lorafit = Settings(stack="lorafit", **STEP)
    assert memory.dequant_bytes(spec, lorafit, memory.stack_runtime(lorafit)) < 2880 * 5760 * 2 + 1


def test_unsloth_dequantises_every_expert_each_pass() -> None:
    spec, gpu = resolve("qwen3-30b-a3b"), hardware.resolve("RTX 4090")
    seconds = {s: timing.dequant_seconds(spec, Settings(stack=s, **STEP), gpu) for s in ("unsloth", "lorafit")}
    assert seconds["unsloth"] > 10 * seconds["lorafit"]  # the experts are ~99% of the packed weights


def test_a_dense_family_unsloth_loads_through_fastmodel_runs_without_its_triton_kernels() -> None:
    """Gemma 3 and the image-text Qwen2.5-VL get Unsloth's checkpointing and fused loss but transformers' own
    modules: the same layer saves what it saves without the kernels, where Gemma 2 and Qwen2.5 (FastLanguageModel)
    save less with them."""
    step = Settings(stack="unsloth", **STEP)
    runtime = memory.stack_runtime(step)
    plain = runtime.model_copy(update={"triton_kernels": False})
    for name, same in (("gemma-3-12b", True), ("gemma-2-9b", False), ("qwen2.5-vl-7b", True), ("qwen2.5-7b", False)):
        spec = resolve(name)
        kept = memory.activation_bytes_per_layer(spec, step, runtime)
        assert (kept == memory.activation_bytes_per_layer(spec, step, plain)) is same


def test_unsloth_leaves_the_vision_tower_16_bit() -> None:
    """Its 4-bit load skips vision_tower (SKIP_QUANTIZATION_MODULES); Gemma 3's SigLIP tower has 27 layers of
    q, k, v, out (1152 x 1152) and fc1, fc2 (1152 x 4304)."""
    siglip = 27 * (4 * 1152 * 1152 + 2 * 1152 * 4304)
    extra = weights("gemma-3-12b", "unsloth") - weights("gemma-3-12b", "lorafit")
    assert extra == pytest.approx(siglip * (2 - NF4_DQ_BYTES), rel=1e-9)


@pytest.mark.parametrize(
    ("model", "less"), [("openai/gpt-oss-20b", True), ("Qwen/Qwen3-30B-A3B", True), ("google/gemma-3-12b-it", None)]
)
def test_stack_unsloth_resolves_these_families_and_its_moe_steps_need_less_than_trl(
    model: str, less: bool | None, capsys
) -> None:
    """The MoEs: 4-bit experts outweigh everything else. Gemma 3 (dense): resolved; which needs less depends on
    the card (Unsloth's loss chunks take up to half the free memory), so only that it is estimated."""
    peaks = {}
    for stack in ("unsloth", "trl"):
        args = ["estimate", "--model", model, "--method", "qlora", "--stack", stack, "--micro-batch", "1", "--json"]
        code, out, err = run_cli(args, capsys)
        assert code == 0, err
        peaks[stack] = json.loads(out)["peak_device_gib"]
    if less is not None:
        assert (peaks["unsloth"] < peaks["trl"]) is less


def test_gpt_oss_20b_fits_a_24_gb_card_only_under_unsloth(capsys) -> None:
    """The HF stacks keep its experts 16-bit (about 38 GiB); Unsloth's 4-bit experts fit the card."""
    fits = {}
    for stack in ("unsloth", "trl"):
        code, out, _ = run_cli(
            ["plan", "--model", "openai/gpt-oss-20b", "--gpu", "4090", "--stack", stack, "--json"], capsys
        )
        fits[stack] = json.loads(out)["fits"]
    assert fits == {"unsloth": True, "trl": False}


def test_unsloth_adds_lora_beside_the_experts_without_a_merged_weight() -> None:
    """peft's ParamWrapper keeps W + B A of every expert of a layer (Qwen3-30B-A3B: 128 x 3 x 2048 x 768 in bf16)
    for backward; Unsloth's separated LoRA does not."""
    spec = resolve("qwen3-30b-a3b")
    kept = {}
    for stack in ("unsloth", "trl"):
        step = Settings(stack=stack, lora_targets="experts", **STEP)
        kept[stack] = memory.activation_bytes_per_layer(spec, step, memory.stack_runtime(step))
    assert kept["trl"] - kept["unsloth"] >= 128 * 3 * 2048 * 768 * 2


def test_unsloth_does_not_scale_rope_for_the_families_it_loads_through_fastmodel(capsys) -> None:
    """FastModel leaves rope_scaling unused: past Qwen3-30B-A3B's 40,960 positions it is refused, while
    FastLanguageModel's Llama still scales."""
    base = ["estimate", "--method", "qlora", "--stack", "unsloth"]
    code, _, err = run_cli([*base, "--model", "qwen3-30b-a3b", "--seq-len", "65536"], capsys)
    assert code == 2 and err.count("\n") == 1 and "does not scale RoPE" in err and "unsloth" not in err.split(":")[-1]
    code, _, err = run_cli([*base, "--model", "llama-3.1-8b", "--seq-len", "262144"], capsys)
    assert code == 0, err


def test_unsloth_trains_gpt_oss_with_attention_that_keeps_no_score_matrix(capsys) -> None:
    """Its flex attention with sinks, counted as flash: transformers' gpt-oss has eager attention only under TRL."""
    attn, peak = {}, {}
    for stack in ("unsloth", "trl"):
        args = ["estimate", "--model", "gpt-oss-20b", "--method", "qlora", "--stack", stack, "--json"]
        code, out, err = run_cli([*args, "--micro-batch", "4"], capsys)
        assert code == 0, err
        attn[stack] = json.loads(out)["settings"]["attn"]
    assert attn == {"unsloth": "flash", "trl": "eager"}
    for kernel in ("flash", "eager"):
        args = ["estimate", "--model", "gpt-oss-20b", "--method", "qlora", "--stack", "unsloth", "--micro-batch", "4"]
        code, out, _ = run_cli([*args, "--attn", kernel, "--json"], capsys)
        peak[kernel] = json.loads(out)["peak_device_gib"]
    # eager keeps each layer's 4 x 64 x 2048 x 2048 attention probabilities (bf16) through its backward
    assert peak["eager"] - peak["flash"] > 4 * 64 * 2048 * 2048 * 2 / 2**30


@pytest.mark.parametrize("model", ["phi-3-mini", "phi-4"])
def test_a_family_lorafit_has_not_read_unsloths_step_for_is_refused_in_one_line(model: str, capsys) -> None:
    code, _, err = run_cli(["estimate", "--model", model, "--method", "qlora", "--stack", "unsloth"], capsys)
    assert code == 2 and err.count("\n") == 1 and "gpt_oss, qwen3_moe, mixtral, gemma3" in err, err


@pytest.fixture(scope="module")
def accuracy():
    yield from bench_module("memory_accuracy")


def test_the_unsloth_moe_rows_route_to_the_stack_with_4_bit_experts(accuracy) -> None:
    """USM-01..04 state their settings and are estimated as --stack unsloth; USM-05 (a README claim with no
    setting) is kept but cannot be compared. Their experts are 4-bit, but for USM-08: Unsloth 2026.4.4 predates
    unsloth_zoo's NF4 packing of fused experts (2026-05-15), so Gemma 4 26B-A4B's stayed 16-bit."""
    rows = {row.id: row for row in accuracy.read_rows(accuracy.DEFAULT_CSV) if row.id.startswith("USM-")}
    assert {row.raw["split"] for row in rows.values()} == {"check"} and len(rows) == 12
    for row_id in ("USM-01", "USM-02", "USM-03", "USM-04", "USM-05", "USM-08"):
        row = rows[row_id]
        spec = accuracy.resolve_model(row.raw["model"])
        if row_id == "USM-05":
            with pytest.raises(accuracy.Unmappable):
                accuracy.map_row(row, spec)
            continue
        mapping = accuracy.map_row(row, spec)
        assert mapping.settings.stack == "unsloth"
        assert mapping.runtime.quantized_experts == (row_id != "USM-08")
