"""The planner on the scenarios people ask about, with every verdict checked against the numbers behind it.

Nothing here is a typed-in copy of the planner's output: a verdict is checked against the estimate and the
card's memory, a suggestion by estimating it again, a cost by the relations hours x price and tokens / speed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import run_cli
from lorafit import costs, hardware, memory, models, options, search, timing
from lorafit import plan as planner
from lorafit.cli import main
from lorafit.errors import InvalidConfig, LorafitError
from lorafit.hardware import GpuSpec
from lorafit.schema import Plan, PlanRequest, Settings

DEFAULT_RUN_TOKENS = 15_000_000 * 3  # the Alpaca-sized default: 15M tokens per epoch, three epochs


def ask(
    model: str = "llama-2-7b", gpu: str | GpuSpec | None = None, pinned: dict[str, Any] | None = None, **fields: Any
) -> PlanRequest:
    card = hardware.resolve(gpu) if isinstance(gpu, str) else gpu
    step = {name: fields.pop(name) for name in list(fields) if name in Settings.model_fields}
    return PlanRequest(model=models.resolve(model), gpu=card, fixed=(pinned or {}) | step, **fields)


def usable_gib(gpu: GpuSpec, headroom: float = 0.1) -> float:
    return gpu.memory_gib * gpu.usable_fraction * (1 - headroom)


def assert_verdict_follows_from_the_estimate(plan: Plan) -> None:
    assert plan.gpu is not None
    assert plan.fits == (plan.estimate.peak_device_gib <= usable_gib(plan.gpu, plan.estimate.headroom))


def re_estimate(plan: Plan, **changes: object) -> float:
    """The device peak of the plan's settings with some changed, from the estimator directly."""
    settings = plan.settings.model_copy(update=changes)
    return memory.estimate(plan.model, Settings.model_validate(settings.model_dump())).peak_device_gib


@pytest.fixture(scope="module")
def on_4090() -> Plan:
    return planner.make_plan(ask(gpu="RTX 4090"))


@pytest.fixture(scope="module")
def on_4060ti() -> Plan:
    return planner.make_plan(ask(gpu="RTX 4060 Ti 16GB"))


@pytest.fixture(scope="module")
def full_on_4090() -> Plan:
    return planner.make_plan(ask(gpu="RTX 4090", method="full"))


# --- 7B QLoRA on consumer cards -------------------------------------------------------------------------------
def test_7b_qlora_fits_a_4090_with_room(on_4090: Plan) -> None:
    assert on_4090.fits and on_4090.method == "qlora" and on_4090.quant == "nf4"
    assert_verdict_follows_from_the_estimate(on_4090)
    assert on_4090.estimate.peak_device_gib < usable_gib(on_4090.gpu)
    assert on_4090.micro_batch * on_4090.grad_accum == on_4090.batch_size == 16
    # room: with checkpointing the card takes a typical micro-batch of 4 or more (the fastest plan may instead
    # spend that memory on skipping the recomputation)
    assert largest_checkpointed_micro_batch("RTX 4090") >= 4


def largest_checkpointed_micro_batch(card: str) -> int:
    fitting = [
        batch
        for batch in (1, 2, 4, 8, 16)
        if planner.make_plan(ask(gpu=card, pinned={"grad_ckpt": True, "micro_batch": batch})).fits
    ]
    return max(fitting, default=0)


def test_7b_qlora_on_a_16gb_card_needs_checkpointing_and_a_smaller_micro_batch(on_4090: Plan, on_4060ti: Plan) -> None:
    assert on_4060ti.fits and on_4060ti.grad_ckpt
    assert_verdict_follows_from_the_estimate(on_4060ti)
    assert largest_checkpointed_micro_batch("RTX 4060 Ti 16GB") < largest_checkpointed_micro_batch("RTX 4090")
    # without checkpointing not even micro-batch 1 fits
    assert re_estimate(on_4060ti, grad_ckpt=False, micro_batch=1) > usable_gib(on_4060ti.gpu)
    # and the next bigger micro-batch does not fit either
    assert re_estimate(on_4060ti, micro_batch=2 * on_4060ti.micro_batch) > usable_gib(on_4060ti.gpu)


SAVERS_OFF = {"loss": "full", "offload_embeddings": False, "offload_activations": False, "expandable_segments": False}


@pytest.mark.parametrize("card", ["RTX 4060", "8GB"])
def test_7b_qlora_on_an_8gb_card_without_the_savers(card: str) -> None:
    gpu = hardware.custom(8) if card == "8GB" else hardware.resolve(card)
    plan = planner.make_plan(ask(gpu=gpu, pinned=SAVERS_OFF))
    assert_verdict_follows_from_the_estimate(plan)
    # 8 GB is the edge for a 4-bit 7B at 2048 tokens: only the smallest step comes close, in either case
    assert plan.micro_batch == 1 and plan.grad_ckpt and plan.grad_accum == 16
    assert re_estimate(plan, micro_batch=2) > usable_gib(gpu)
    assert abs(plan.estimate.peak_device_gib - usable_gib(gpu)) < 0.2 * usable_gib(gpu)
    if plan.fits:
        assert not plan.suggestions
    else:
        assert plan.optimizer == "paged_adamw_8bit"  # the smallest candidate, reported with what would fit
        assert plan.suggestions
        for suggestion in plan.suggestions:
            target = gpu if suggestion.gpu == gpu.name else hardware.resolve(suggestion.gpu)
            assert memory.estimate(plan.model, suggestion.settings, target).fits, suggestion.change


@pytest.mark.parametrize("card", ["RTX 4060", "8GB"])
def test_7b_qlora_fits_an_8gb_card_with_the_savers(card: str) -> None:
    gpu = hardware.custom(8) if card == "8GB" else hardware.resolve(card)
    plan = planner.make_plan(ask(gpu=gpu))
    assert plan.fits
    assert_verdict_follows_from_the_estimate(plan)
    on = search.savers_on(plan.settings)
    assert on
    # every saver it turned on is needed: the same step without it does not fit
    for name in on:
        assert re_estimate(plan, **{name: SAVERS_OFF[name]}) > usable_gib(gpu), name
    assert re_estimate(plan, **SAVERS_OFF) > usable_gib(gpu)
    assert re_estimate(plan, micro_batch=2 * plan.micro_batch) > usable_gib(gpu)


# --- tight fits and the other trainers ----------------------------------------------------------------------------
def test_a_job_whose_leanest_step_leaves_less_than_the_memory_models_error_is_tight() -> None:
    """Llama-3.1-8B QLoRA on an 8 GB card: micro-batch 1 with every saver (the leanest step) leaves < 5.1 % of the
    usable memory; the plan says tight and names changes that leave that much more room, each by its own
    estimate."""
    gpu = hardware.custom(8)
    plan = planner.make_plan(ask("llama-3.1-8b", gpu=gpu))
    usable = usable_gib(gpu)
    assert plan.fits and plan.micro_batch == 1
    assert usable - plan.estimate.peak_device_gib < planner.TIGHT_SHARE * usable
    assert plan.verdict == "tight"
    assert plan.suggestions
    roomier = plan.estimate.headroom + planner.TIGHT_SHARE
    for suggestion in plan.suggestions:
        target = gpu if suggestion.gpu == gpu.name else hardware.resolve(suggestion.gpu)
        assert memory.estimate(plan.model, suggestion.settings, target, roomier).fits, suggestion.change


def test_a_comfortable_fit_is_not_tight_and_a_miss_is_no(on_4090: Plan, full_on_4090: Plan) -> None:
    # micro-batch 1 without checkpointing fills the card, but checkpointing leaves plenty: not tight
    assert on_4090.leanest_peak_gib is not None and on_4090.leanest_peak_gib < 0.5 * usable_gib(on_4090.gpu)
    assert on_4090.verdict == "fits" and not on_4090.suggestions
    assert full_on_4090.verdict == "no"
    assert planner.make_plan(ask()).verdict is None  # no GPU, no verdict


def test_the_plan_says_which_trainers_fit_the_job() -> None:
    """On 8 GB the job fits only with lorafit's trainer (its savers); each other trainer's figure is its own
    smallest step, and the verdict follows from it."""
    gpu = hardware.custom(8)
    plan = planner.make_plan(ask("llama-3.1-8b", gpu=gpu))
    by_stack = {fit.stack: fit for fit in plan.trainers}
    assert set(by_stack) == {s.name for s in planner.stacks.offered()} - {"lorafit"}
    for fit in plan.trainers:
        assert fit.fits == (fit.peak_device_gib <= usable_gib(gpu))
    assert not by_stack["trl"].fits and by_stack["trl"].peak_device_gib > plan.estimate.peak_device_gib
    # trl's smallest step: micro-batch 1 with checkpointing, as the planner would try it
    trl = Settings.model_validate(plan.settings.model_dump() | {"stack": "trl", **SAVERS_OFF, "kbit_prep": None})
    assert by_stack["trl"].peak_device_gib <= memory.estimate(plan.model, trl, gpu).peak_device_gib + 1e-6


def test_the_trainers_line_only_when_the_trainer_changes_the_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(["plan", "--model", "llama-3.1-8b", "--vram", "8"], capsys)
    out = " ".join(out.split())
    assert code == 0 and "fits, tightly, on 8 GB GPU" in out
    plan = planner.make_plan(ask("llama-3.1-8b", gpu=hardware.custom(8)))
    usable = usable_gib(hardware.custom(8))
    trl = next(fit for fit in plan.trainers if fit.stack == "trl")
    assert f"trainers: fits with lorafit's own trainer ({plan.estimate.peak_device_gib:.2f} of {usable:.2f} GiB)" in out
    assert "; not with " in out and f"trl ({trl.peak_device_gib:.2f} GiB)" in out
    code, out, _ = run_cli(["plan", "--model", "llama-3.1-8b", "--gpu", "RTX 4090"], capsys)
    out = " ".join(out.split())
    assert code == 0 and "trainers:" not in out and "tight" not in out


# --- 7B full fine-tuning ----------------------------------------------------------------------------------------
def test_7b_full_fine_tuning_does_not_fit_a_4090(full_on_4090: Plan) -> None:
    assert not full_on_4090.fits
    assert_verdict_follows_from_the_estimate(full_on_4090)
    # even the smallest configuration: bf16 weights and gradients alone are 2 x 2 bytes x 6.74B > 24 GiB
    assert full_on_4090.estimate.peak_device_gib > hardware.resolve("RTX 4090").memory_gib
    assert any("does not fit" in reason for reason in full_on_4090.reasons)


def test_every_suggestion_fits_by_its_own_estimate(full_on_4090: Plan) -> None:
    assert full_on_4090.suggestions
    for suggestion in full_on_4090.suggestions:
        gpu = hardware.resolve(suggestion.gpu)
        again = memory.estimate(full_on_4090.model, suggestion.settings, gpu, full_on_4090.estimate.headroom)
        assert again.fits, suggestion.change
        assert again == suggestion.estimate


def test_full_fine_tuning_suggestions_include_qlora_and_zero3(full_on_4090: Plan) -> None:
    methods = {s.settings.method for s in full_on_4090.suggestions}
    assert "qlora" in methods
    sharded = [s for s in full_on_4090.suggestions if s.settings.n_gpus > 1]
    assert sharded and all(s.settings.shard == "zero3" and s.gpu == "RTX 4090" for s in sharded)
    assert all(s.settings.method == "full" for s in sharded)  # the user's method, split over cards
    assert f"{sharded[0].settings.n_gpus}x" in sharded[0].change


# --- 70B QLoRA ---------------------------------------------------------------------------------------------------
def test_70b_qlora_on_a_24gb_card_needs_several_gpus_or_a_bigger_one() -> None:
    plan = planner.make_plan(ask("llama-2-70b", gpu="RTX 4090"))
    assert not plan.fits
    assert_verdict_follows_from_the_estimate(plan)
    # the 4-bit base alone (about 0.52 B x 69B) is bigger than the card: no setting on one 4090 helps
    assert plan.estimate.breakdown_gib["weights"] > usable_gib(plan.gpu)
    bigger = [s for s in plan.suggestions if s.settings.n_gpus == 1]
    assert bigger and all(s.gpu != "RTX 4090" and hardware.resolve(s.gpu).memory_gib > 24 for s in bigger)
    assert all("more memory" in s.change for s in bigger)
    # lorafit's trainer loads the 4-bit base in host memory and FSDP shards it over several 4090s; TRL under
    # accelerate loads it whole onto every GPU first, so several 4090s do not help it
    several = [s for s in plan.suggestions if s.settings.n_gpus > 1]
    assert several and all(s.gpu == "RTX 4090" and s.settings.shard == "fsdp" for s in several)
    trl = planner.make_plan(ask("llama-2-70b", gpu="RTX 4090", pinned={"stack": "trl"}))
    assert not [s for s in trl.suggestions if s.settings.n_gpus > 1]
    assert any("loads the nf4 base whole" in reason for reason in trl.reasons)
    for suggestion in plan.suggestions + trl.suggestions:
        assert memory.estimate(plan.model, suggestion.settings, hardware.resolve(suggestion.gpu)).fits


@pytest.mark.parametrize("card", ["A100 80GB", "H100 SXM"])
def test_70b_qlora_fits_an_80gb_card(card: str) -> None:
    plan = planner.make_plan(ask("llama-3.1-70b", gpu=card))
    assert plan.fits and not plan.suggestions
    assert_verdict_follows_from_the_estimate(plan)
    assert plan.grad_ckpt
    assert re_estimate(plan, grad_ckpt=False, micro_batch=1) > usable_gib(plan.gpu)


# --- time and cost -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("card", ["RTX 4090", "A40"])
def test_a_rented_qlora_run_costs_hours_times_price(card: str) -> None:
    plan = planner.make_plan(ask(gpu=card))
    gpu = hardware.resolve(card)
    assert plan.hours == pytest.approx(DEFAULT_RUN_TOKENS / plan.tokens_per_s / 3600, rel=1e-3)
    assert plan.cost_cloud_usd == pytest.approx(plan.hours * gpu.rent_usd_per_hour, abs=0.01)
    assert plan.cost_local_usd == pytest.approx(plan.hours * gpu.board_power_w / 1000 * plan.kwh_price, abs=0.01)
    # the rule of thumb says $2-8 for a whole 7B QLoRA run rented: the computed figure (Alpaca-sized data, three
    # epochs) is the same order of magnitude, within a factor of two of that range
    assert 1 <= plan.cost_cloud_usd <= 16


def test_break_even_is_the_card_price_over_what_renting_costs_more(on_4090: Plan) -> None:
    gpu = on_4090.gpu
    assert on_4090.cost_cloud_usd > on_4090.cost_local_usd
    expected = gpu.price_usd / (on_4090.cost_cloud_usd - on_4090.cost_local_usd)
    assert on_4090.break_even_runs == pytest.approx(expected, rel=0.01)


def test_cost_scales_with_the_data_and_the_epochs() -> None:
    base = planner.make_plan(ask(gpu="RTX 4090", tokens_per_epoch=1_000_000, epochs=1))
    more = planner.make_plan(ask(gpu="RTX 4090", tokens_per_epoch=2_000_000, epochs=3))
    assert more.settings == base.settings
    # hours are rounded to 3 decimals: six times base's rounding (6 x 0.0005) and more's own (0.0005)
    assert more.hours == pytest.approx(6 * base.hours, abs=0.0035)
    assert base.hours == pytest.approx(1_000_000 / base.tokens_per_s / 3600, abs=5e-4)


def test_unrentable_card_has_no_cloud_cost(on_4060ti: Plan) -> None:
    assert on_4060ti.gpu.rent_usd_per_hour is None
    assert on_4060ti.cost_cloud_usd is None and on_4060ti.break_even_runs is None
    assert on_4060ti.cost_local_usd > 0


def test_time_model_by_hand() -> None:
    """7B QLoRA, micro-batch 8 x 2048 tokens, checkpointing, on an RTX 4090: each op of the micro-batch written
    out from its formula (tests/test_timing.py works each one on its own). The fitted constants are read by
    name; the 4090's figures (165 measured matmul TFLOP/s, 1008 GB/s) are the catalog's."""
    on_4090 = planner.make_plan(ask(gpu="RTX 4090", pinned={"grad_ckpt": True, "micro_batch": 8}))
    assert (on_4090.micro_batch, on_4090.grad_accum, on_4090.grad_ckpt) == (8, 2, True)
    tokens, seq, layers = 8 * 2048, 2048, 32
    layer_weights, head = 6738415616 - 2 * 32000 * 4096, 32000 * 4096  # llama-2-7b less embedding and head
    flops_rate, byte_rate = 165e12, 1008e9 * 0.85
    # forward, input gradients, recomputation (not of the head); the 4-bit layers QUANT_MATMUL_SLOWDOWN slower
    matmul = 2 * 3 * layer_weights * tokens / (flops_rate * timing.MATMUL_SHAPE_SHARE) * timing.QUANT_MATMUL_SLOWDOWN
    matmul += 2 * 2 * head * tokens / (flops_rate * timing.MATMUL_SHAPE_SHARE)
    attention = 2 * seq * 4096 * layers * tokens * (2 + 2.5) / (flops_rate * 0.6)  # sdpa, causal
    linears = layers * (4 * 4096 * 4096 + 3 * 4096 * 11008)
    # nf4 read, bf16 written, the nested absmax's fp32 traffic (15/64), 3 passes
    dequant = linears * (0.5 + 1 / 64 + 4 / (64 * 256) + 2 + 15 / 64) * 3 / byte_rate
    in_widths, out_widths = 6 * 4096 + 11008, 4 * 4096 + 2 * 11008 + 4096  # the 7 adapted linears of a layer
    # under CUDA's autocast peft's bitsandbytes layer casts nothing: dropout on the bf16 input (5) and lora_A's read
    # (2); lora_B, scaling and sum (12), peft's clone of the 4-bit output (4 bytes) in the two forwards; backward
    # as the forward
    adapters = tokens * layers * (2 * (7 * in_widths + 16 * out_widths) + 7 * in_widths + 12 * out_widths)
    adapters /= byte_rate
    elementwise = tokens * layers * 634368 * (2 + 3) / byte_rate  # norms, residuals, rotary, SwiGLU
    loss = tokens * 32000 * 42 / byte_rate  # with accelerate's fp32 copy of the logits
    launches = ((30 + 1 + 7 + 21 + 56) * 2 + 60 + 7 + 21 + 63) * layers * 4e-6
    compute = matmul + attention + dequant + adapters + elementwise + loss + launches
    lora_params = 32 * 16 * (4 * 8192 + 3 * (4096 + 11008))  # r=16 on q, k, v, o (4096 -> 4096) and the MLP
    # fused AdamW on fp32 adapters: read param, grad, two moments, write param and moments (28), clipping 3 x 4
    optimizer = lora_params * (28 + 12) / byte_rate
    expected = tokens / (compute + optimizer / 2)  # one optimizer step per 2 accumulated micro-batches
    assert on_4090.tokens_per_s == pytest.approx(expected, rel=1e-3)


def test_speed_follows_the_work() -> None:
    spec, gpu = models.resolve("llama-2-7b"), hardware.resolve("A100 80GB")
    base = Settings(micro_batch=2, grad_accum=8)
    speed = timing.tokens_per_second
    assert speed(spec, base.model_copy(update={"grad_ckpt": False}), gpu) > speed(spec, base, gpu)  # no recompute
    lora_ = Settings(method="lora", quant="none", micro_batch=2, grad_accum=8)
    # with adapters in the compute dtype the LoRA path is the same over either base: LoRA has no dequantisation
    in_bf16 = {"fp32_adapters": False}
    assert speed(spec, lora_.model_copy(update=in_bf16), gpu) > speed(spec, base.model_copy(update=in_bf16), gpu)
    # with peft's fp32 adapters a 16-bit base's layers cast every input to fp32 and back (23 bytes an input
    # element, 12 an output one, in two forwards and backward), where the bitsandbytes layers under CUDA's autocast
    # cast nothing (7 bytes) but clone the base output (+4 in the forwards): bandwidth-bound, the bytes' ratio
    widths_in, widths_out = 6 * 4096 + 11008, 4 * 4096 + 2 * 11008 + 4096
    over_16bit = 3 * (23 * widths_in + 12 * widths_out)
    over_4bit = 2 * (7 * widths_in + 16 * widths_out) + 7 * widths_in + 12 * widths_out
    ratio = timing.lora_seconds(spec, lora_, gpu) / timing.lora_seconds(spec, base, gpu)
    assert ratio == pytest.approx(over_16bit / over_4bit, rel=1e-3)
    # the base's weight gradients cost more than LoRA's adapter path on the attention projections (the fit rows
    # FMS-01 and FMS-03 say the same); on all seven linears the eager fp32 adapter path costs about as much
    full_ = Settings(method="full", quant="none", micro_batch=2, grad_accum=8)
    attn_lora = lora_.model_copy(update={"lora_targets": "attn"})
    assert speed(spec, full_, gpu) < speed(spec, attn_lora, gpu)
    h100, rtx4090 = hardware.resolve("H100 SXM"), hardware.resolve("RTX 4090")
    assert speed(spec, base, h100) > speed(spec, base, gpu) > speed(spec, base, rtx4090)
    # bigger micro-batches use the GPU better, so tokens/s never falls
    by_batch = [speed(spec, Settings(micro_batch=b, grad_accum=16 // b), gpu) for b in (1, 2, 4, 8, 16)]
    assert by_batch == sorted(by_batch)
    # two GPUs: each runs half the accumulation; ZeRO-3's gathers of the packed base (4 GB per GPU a micro-batch,
    # 18 ms over NVLink 3) hide behind the micro-batch's 1.3 s of compute, so the speed doubles
    two = Settings(micro_batch=2, grad_accum=4, n_gpus=2, shard="zero3")
    half = Settings(micro_batch=2, grad_accum=4)
    assert speed(spec, two, gpu) == pytest.approx(2 * speed(spec, half, gpu), rel=0.01)


# --- the search ----------------------------------------------------------------------------------------------------
def test_micro_batches_are_powers_of_two_dividing_the_effective_batch() -> None:
    assert search._micro_batches(16, 1) == [16, 8, 4, 2, 1]
    assert search._micro_batches(16, 4) == [4, 2, 1]
    assert search._micro_batches(24, 1) == [24, 8, 4, 2, 1]  # the whole per-GPU batch is tried too
    found = search.candidates(ask(gpu="RTX 4090"), hardware.resolve("RTX 4090"), 2048)
    assert {c.settings.effective_batch for c in found} == {16}
    assert {c.settings.grad_ckpt for c in found} == {True, False}
    assert {c.settings.optimizer for c in found} == set(search.OPTIMIZERS["qlora"])


def test_the_plan_is_the_fastest_candidate_that_fits(on_4090: Plan) -> None:
    found = search.candidates(ask(gpu="RTX 4090"), on_4090.gpu, 2048)
    fitting = [c for c in found if c.estimate.fits]
    assert fitting and any(not c.estimate.fits for c in found)
    assert on_4090.tokens_per_s >= max(c.tokens_per_s for c in fitting) * (1 - search.SPEED_TIE) - 0.1


def test_an_8_bit_optimizer_only_when_32_bit_states_do_not_fit() -> None:
    # A40: 32-bit AdamW fits and is as fast (the 8-bit step saves well under 0.1%): keep AdamW
    roomy = planner.make_plan(ask(gpu="A40"))
    assert roomy.fits and roomy.optimizer == "adamw"
    # a card between the two needs: at micro-batch 1 with checkpointing only the 8-bit states fit
    spec = models.resolve("llama-2-7b")
    tight = Settings(micro_batch=1, grad_accum=16, grad_ckpt=True)
    need_32 = memory.estimate(spec, tight).peak_device_gib
    need_8 = memory.estimate(spec, tight.model_copy(update={"optimizer": "paged_adamw_8bit"})).peak_device_gib
    assert need_8 < need_32
    between = hardware.custom(1).model_copy(update={"memory_gib": (need_8 + need_32) / 2 / 0.9})
    plan = planner.make_plan(ask(gpu=between, pinned=SAVERS_OFF))
    assert plan.fits and plan.optimizer == "paged_adamw_8bit" and plan.micro_batch == 1
    assert any("32-bit AdamW would need" in reason for reason in plan.reasons)
    # with the savers free 32-bit AdamW fits again (a saver changes no number of the training, 8-bit states
    # do): the planner takes 8-bit states only where they make the step faster than any 32-bit one that fits
    free = planner.make_plan(ask(gpu=between))
    assert free.fits and search.savers_on(free.settings)
    found = search.candidates(ask(gpu=between), between, 2048)
    adamw = search.best([c for c in found if c.settings.optimizer == "adamw"])
    assert adamw is not None
    if free.optimizer != "adamw":
        assert free.tokens_per_s > adamw.tokens_per_s * (1 + search.SPEED_TIE)


def test_pinned_settings_are_respected() -> None:
    pinned = {
        "micro_batch": 2,
        "grad_ckpt": True,
        "optimizer": "paged_adamw_8bit",
        "lora_r": 64,
        "lora_alpha": 128,
        "lora_targets": "qv",
    }
    plan = planner.make_plan(ask(gpu="RTX 4090", pinned=pinned))
    for name, value in pinned.items():
        assert getattr(plan.settings, name) == value, name
    assert plan.grad_accum == 8  # the rest of the effective batch of 16
    # a pin that cannot fit is kept, and the plan says it does not fit
    stuck = planner.make_plan(ask(gpu="RTX 4090", pinned={"grad_ckpt": False, "micro_batch": 4}))
    assert not stuck.fits and stuck.grad_ckpt is False
    assert_verdict_follows_from_the_estimate(stuck)


# One value for each setting the planner declares it searches (options.SEARCHED), none of them its default.
PINS_OF_SEARCHED = {
    "micro_batch": 2,
    "grad_accum": 3,
    "grad_ckpt": False,
    "optimizer": "paged_adamw_8bit",
    "loss": "chunked",
    "offload_embeddings": True,
    "offload_activations": False,
    "expandable_segments": True,
}


def tried(request: PlanRequest, name: str) -> set:
    """The values the search tried for one setting (7B QLoRA on an RTX 4090: every saver can apply)."""
    gpu = hardware.resolve("RTX 4090")
    return {getattr(candidate.settings, name) for candidate in search.candidates(request, gpu, 2048)}


def test_the_search_is_what_options_declare(monkeypatch: pytest.MonkeyPatch) -> None:
    assert set(options.SEARCHED) == set(PINS_OF_SEARCHED)
    request = ask(gpu="RTX 4090")
    assert all(len(tried(request, name)) > 1 for name in options.SEARCHED)  # each one searched
    # a pinned searched setting takes its value alone
    for name, value in PINS_OF_SEARCHED.items():
        assert tried(ask(gpu="RTX 4090", pinned={name: value}), name) == {value}, name
    # taken out of the declaration, a setting is no longer searched: it keeps its default
    left_out = ("grad_ckpt", "optimizer", "loss", "expandable_segments")
    monkeypatch.setattr(options, "SEARCHED", tuple(name for name in options.SEARCHED if name not in left_out))
    for name in left_out:
        assert tried(request, name) == {options.BY_NAME[name].default}, name
    assert len(tried(request, "micro_batch")) > 1 and len(tried(request, "offload_activations")) > 1


def test_sequence_length_defaults_to_the_longest_row_and_is_capped() -> None:
    spec = models.resolve("llama-2-7b")
    assert planner.resolve_seq_len(ask()) == 2048
    assert planner.resolve_seq_len(ask(seq_len=512)) == 512
    with pytest.raises(InvalidConfig):
        planner.resolve_seq_len(ask(seq_len=spec.max_position_embeddings + 1))


# --- comparing GPUs ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def compared_13b() -> list[Plan]:
    return planner.compare(ask("llama-2-13b", method="lora"))


def test_compare_ranks_fitting_gpus_first_then_fastest(compared_13b: list[Plan]) -> None:
    fits = [plan.fits for plan in compared_13b]
    assert True in fits
    # a card too small for the job alone is ranked as the fewest of it that fit, sharded
    assert any(plan.fits and plan.settings.n_gpus > 1 for plan in compared_13b)
    assert fits == sorted(fits, reverse=True)  # every fitting plan before every other
    fitting = [plan for plan in compared_13b if plan.fits]
    assert [p.hours for p in fitting] == sorted(p.hours for p in fitting)
    rest = [plan for plan in compared_13b if not plan.fits]
    assert [p.estimate.peak_device_gib for p in rest] == sorted(p.estimate.peak_device_gib for p in rest)
    assert all(plan.gpu.kind != "apple" for plan in compared_13b)
    for plan in compared_13b:
        assert_verdict_follows_from_the_estimate(plan)


def test_cheapest_under_a_price_cap() -> None:
    plans = planner.compare(ask())
    for cap in (None, 1.0, 0.3):
        choice = planner.cheapest(plans, cap)
        allowed = [
            p
            for p in plans
            if p.fits and p.cost_cloud_usd is not None and (cap is None or p.gpu.rent_usd_per_hour <= cap)
        ]
        assert choice is not None
        assert choice.cost_cloud_usd == min(p.cost_cloud_usd for p in allowed)
        assert cap is None or choice.gpu.rent_usd_per_hour <= cap
    assert planner.cheapest(plans, 0.01) is None  # nothing rents that cheaply


# --- the Plan as a file --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["on_4090", "full_on_4090"])
def test_plan_round_trips_through_json_and_yaml(name: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    plan: Plan = request.getfixturevalue(name)
    assert Plan.model_validate(json.loads(plan.to_json())) == plan
    assert Plan.model_validate(yaml.safe_load(plan.to_yaml())) == plan
    plan.save(tmp_path)
    assert Plan.load(tmp_path / "plan.json") == plan
    assert Plan.load(tmp_path / "plan.yaml") == plan
    flat = json.loads(plan.to_json())
    assert flat["micro_batch"] == plan.settings.micro_batch and flat["fits"] == plan.fits


def test_a_plan_that_does_not_fit_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--model", "llama-2-70b", "--gpu", "RTX 4090", "--json"])
    assert exit_info.value.code == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["fits"] is False and printed["suggestions"]


def test_a_plan_for_a_cpu_run_shows_no_cuda_figures() -> None:
    from io import StringIO

    from rich.console import Console

    from lorafit import render
    from lorafit.models import catalog

    plan = planner.make_plan(PlanRequest(model=catalog()["llama-3.2-1b"], device="cpu"))
    assert plan.settings.precision == "fp32" and plan.device == "cpu" and plan.batching == "length_grouped"
    text = StringIO()
    render.show_plan(plan, Console(file=text, width=120))
    shown = text.getvalue()
    assert "training on the CPU" in shown and "CPU RAM" in shown
    assert "cuda context" not in shown and "nvidia-smi" not in shown and "reserved" not in shown


def test_on_the_cpu_checkpointing_is_off_when_the_step_fits_the_free_ram(monkeypatch) -> None:
    """On the CPU the step's memory is host RAM: a step that fits the RAM free now runs without recomputing the
    forward (a third more time); one that does not keeps checkpointing on, and the plan says why either way."""
    from lorafit.models import catalog

    request = PlanRequest(model=catalog()["llama-3.2-1b"], device="cpu")
    monkeypatch.setattr(hardware, "available_ram_gib", lambda: 64.0)
    roomy = planner.make_plan(request)
    assert not roomy.settings.grad_ckpt
    assert any("checkpointing off" in reason and "RAM free" in reason for reason in roomy.reasons)
    monkeypatch.setattr(hardware, "available_ram_gib", lambda: 0.5)
    tight = planner.make_plan(request)
    assert tight.settings.grad_ckpt
    assert tight.settings.micro_batch == roomy.settings.micro_batch
    assert any("checkpointing on" in reason for reason in tight.reasons)
    pinned = planner.make_plan(request.model_copy(update={"fixed": Settings(grad_ckpt=True)}))
    monkeypatch.setattr(hardware, "available_ram_gib", lambda: 64.0)
    assert planner.make_plan(request.model_copy(update={"fixed": Settings(grad_ckpt=True)})).settings.grad_ckpt
    assert pinned.settings.grad_ckpt


def test_other_settings_are_estimated_again_with_the_same_tokens_to_train() -> None:
    plan = planner.make_plan(ask(gpu="RTX 4090"))
    smaller = plan.settings.model_copy(update={"micro_batch": 1, "grad_accum": 16, "grad_ckpt": True})
    again = planner.with_settings(plan, smaller)
    assert again.settings == smaller
    assert again.estimate == memory.estimate(plan.model, smaller, plan.gpu, plan.estimate.headroom)
    assert again.tokens_per_s == round(timing.tokens_per_second(plan.model, smaller, plan.gpu), 1)
    assert again.tokens_per_s < plan.tokens_per_s  # checkpointing recomputes the forward pass
    # the same run: the tokens to train stay, so the hours grow as the speed falls
    assert again.hours * again.tokens_per_s == pytest.approx(plan.hours * plan.tokens_per_s, rel=1e-3)
    assert planner.with_settings(plan, plan.settings) is plan


# --- memory savers ----------------------------------------------------------------------------------------------
def test_no_saver_where_the_step_fits_without(on_4090: Plan) -> None:
    # on the 4090 the fastest step (no checkpointing) fits only with expandable segments, which cost no time
    assert search.savers_on(on_4090.settings) == ["expandable_segments"] and not on_4090.grad_ckpt
    plain = planner.make_plan(ask(gpu="RTX 4090", pinned={"expandable_segments": False, "loss": "full"}))
    assert plain.fits and plain.tokens_per_s < on_4090.tokens_per_s
    assert search.savers_on(planner.make_plan(ask(gpu="A40")).settings) == []


def test_savers_are_tried_only_where_they_apply() -> None:
    tight = hardware.custom(4)
    # tied embeddings are the LM head's weight: never offloaded
    tied = search.candidates(ask("qwen2.5-1.5b", gpu=tight), tight, 2048)
    assert models.resolve("qwen2.5-1.5b").tie_word_embeddings
    assert not any(c.settings.offload_embeddings for c in tied)
    assert any(c.settings.loss == "chunked" for c in tied)
    # full fine-tuning trains the embeddings; activations are offloaded only where they are checkpointed
    full = search.candidates(ask(gpu=tight, method="full"), tight, 2048)
    assert not any(c.settings.offload_embeddings for c in full)
    assert all(c.settings.grad_ckpt for c in full + tied if c.settings.offload_activations)
    # Apple's memory is the host's: nothing to offload to, no CUDA allocator
    apple = hardware.resolve("Apple M-series 16GB")
    on_apple = search.candidates(ask(gpu=apple), apple, 2048)
    assert not any(c.settings.offload_activations or c.settings.expandable_segments for c in on_apple)
    # no GPU: the savers stay at their defaults
    assert all(search.savers_on(c.settings) == [] for c in search.candidates(ask(), None, 2048))


def test_a_pinned_saver_is_kept() -> None:
    plan = planner.make_plan(ask(gpu="RTX 4090", pinned={"loss": "chunked", "expandable_segments": True}))
    assert plan.settings.loss == "chunked" and plan.settings.expandable_segments


@pytest.mark.parametrize("model", ["llama-3.1-8b", "qwen2.5-7b"])
def test_an_8b_qlora_at_2048_tokens_fits_8gb_with_the_savers(model: str) -> None:
    gpu = hardware.custom(8)
    plan = planner.make_plan(ask(model, gpu=gpu, method="qlora", seq_len=2048))
    assert_verdict_follows_from_the_estimate(plan)
    assert plan.fits
    # the savers of the 128k-152k vocabulary's logits, of the embeddings and of the reserve are needed (Qwen2.5-7B
    # then fits with a paged 8-bit optimizer instead of offloading its activations, which costs more time)
    assert {"loss", "offload_embeddings", "expandable_segments"} <= set(search.savers_on(plan.settings))
    without = planner.make_plan(ask(model, gpu=gpu, method="qlora", seq_len=2048, pinned=SAVERS_OFF))
    assert not without.fits
    assert plan.estimate.peak_device_gib < without.estimate.peak_device_gib - 3


def test_when_nothing_fits_the_longest_length_that_does_is_suggested() -> None:
    gpu = hardware.custom(7.5)
    request = ask("llama-3.1-8b", gpu=gpu, method="qlora", seq_len=2048)
    plan = planner.make_plan(request)
    assert not plan.fits
    shorter = [s for s in plan.suggestions if s.change.startswith("sequence length")]
    assert len(shorter) == 1
    length = shorter[0].settings.seq_len
    assert memory.estimate(plan.model, shorter[0].settings, gpu).fits
    # the longest: the next longer length tried does not fit with any settings
    lengths = planner.shorter_lengths(2048)
    position = lengths.index(length)
    longer = lengths[position - 1] if position else 2048  # the longest tried is right below the length asked
    assert search.best(search.candidates(request, gpu, longer)) is None


def test_shorter_lengths_are_powers_of_two_and_the_steps_between() -> None:
    assert planner.shorter_lengths(2048) == [1536, 1024, 768, 512, 384, 256, 192, 128]
    assert planner.shorter_lengths(1000) == [768, 512, 384, 256, 192, 128]
    assert planner.shorter_lengths(128) == []


def test_the_savers_make_an_8b_on_16gb_faster() -> None:
    # the chunked loss frees the memory of a bigger micro-batch, which uses the GPU better
    gpu = "RTX 4060 Ti 16GB"
    plan = planner.make_plan(ask("llama-3.1-8b", gpu=gpu))
    without = planner.make_plan(ask("llama-3.1-8b", gpu=gpu, pinned=SAVERS_OFF))
    assert plan.fits and without.fits
    assert plan.micro_batch > without.micro_batch and plan.tokens_per_s > without.tokens_per_s
    assert plan.hours < without.hours


def test_the_bigger_micro_batch_it_did_not_choose_is_compared_with_the_same_savers() -> None:
    """The reason names what micro-batch 2x needs with the chosen savers, not with savers it did not turn on."""
    plan = planner.make_plan(ask("llama-2-7b", gpu=hardware.custom(16)))
    bigger = plan.settings.model_copy(
        update={"micro_batch": 2 * plan.micro_batch, "grad_accum": plan.settings.grad_accum // 2}
    )
    need = memory.estimate(models.resolve("llama-2-7b"), bigger, hardware.custom(16)).peak_device_gib
    reason = next(r for r in plan.reasons if r.startswith(f"micro-batch {plan.micro_batch} x"))
    assert not search.savers_on(plan.settings) and need > usable_gib(hardware.custom(16))
    assert reason.endswith(f"micro-batch {2 * plan.micro_batch} would need {need:.1f} GiB")


def test_time_of_each_saver_by_hand() -> None:
    spec, gpu = models.resolve("llama-2-7b"), hardware.resolve("RTX 4060 Ti 16GB")  # PCIe 4.0 x8: 15.75 GB/s
    step = Settings(method="qlora", micro_batch=1, seq_len=2048, grad_ckpt=True)
    # the chunked loss runs the head's forward again: 2 x V x h FLOPs per token, at the card's measured 42.6
    # TFLOP/s (the head stays 16-bit over a 4-bit base)
    chunked = step.model_copy(update={"loss": "chunked"})
    head_again = 2 * 32000 * 4096 * 2048 / (42.6e12 * timing.MATMUL_SHAPE_SHARE)
    assert timing.step_seconds(spec, chunked, gpu) - timing.step_seconds(spec, step, gpu) == pytest.approx(head_again)
    # offloaded activations: 2 copies x 32 layers x 2048 tokens x 4096 x 2 bytes at 80% of the link, not hidden
    offloaded = step.model_copy(update={"offload_activations": True})
    copies = 2 * 32 * 2048 * 4096 * 2 / (15.75e9 * 0.8)
    assert timing.step_seconds(spec, offloaded, gpu) - timing.step_seconds(spec, step, gpu) == pytest.approx(copies)
    # offloaded embeddings: the micro-batch's rows, once
    rows = step.model_copy(update={"offload_embeddings": True})
    once = 2048 * 4096 * 2 / (15.75e9 * 0.8)
    assert timing.step_seconds(spec, rows, gpu) - timing.step_seconds(spec, step, gpu) == pytest.approx(once)
    # the allocator setting costs no time in the model
    expandable = step.model_copy(update={"expandable_segments": True})
    assert timing.step_seconds(spec, expandable, gpu) == timing.step_seconds(spec, step, gpu)


def test_plan_output_and_json_name_the_savers(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--model", "llama-2-7b", "--vram", "8", "--json"])
    assert exit_info.value.code == 0
    printed = json.loads(capsys.readouterr().out)
    chosen = [name for name in search.SAVERS if printed["settings"][name] == search.SAVER_ON[name]]
    assert printed["fits"] and chosen
    with pytest.raises(SystemExit):
        main(["plan", "--model", "llama-2-7b", "--vram", "8"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "savers:" in shown
    for name in chosen:
        assert f"{name}:" in shown or (name == "loss" and "loss chunked:" in shown), name


def test_a_rental_price_of_ones_own_prices_the_rented_run() -> None:
    catalog = planner.make_plan(ask(gpu="RTX 4090"))
    mine = planner.make_plan(ask(gpu="RTX 4090", rent_price=0.69))
    assert mine.settings == catalog.settings and mine.hours == catalog.hours
    assert mine.cost_cloud_usd == round(mine.hours * 0.69, 2) != catalog.cost_cloud_usd
    unlisted = planner.make_plan(ask(gpu="RTX 4060 Ti 16GB", rent_price=0.2))  # no rental price in the catalog
    assert planner.make_plan(ask(gpu="RTX 4060 Ti 16GB")).cost_cloud_usd is None
    assert unlisted.cost_cloud_usd == round(unlisted.hours * 0.2, 2)
    with pytest.raises(LorafitError, match="--compare prices each card"):
        planner.compare(ask(rent_price=1.0))


def test_the_plan_says_how_sure_its_time_is_and_what_it_is_for(capsys) -> None:
    """--json: hours with their likely range around them and the basis ("model"); the text names the tokens the
    hours are for and where they came from, and where the speed and the range come from."""
    import json

    code, out, _ = run_cli(["plan", "--model", "llama-3.1-8b", "--gpu", "RTX 4090", "--json"], capsys)
    assert code == 0
    plan = json.loads(out)
    low, high = plan["hours_range"]
    assert low < plan["hours"] < high and plan["time_basis"] == "model"
    assert plan["tokens_per_epoch"] == DEFAULT_RUN_TOKENS // 3
    assert plan["hours"] == pytest.approx(DEFAULT_RUN_TOKENS / plan["tokens_per_s"] / 3600, rel=1e-3)

    code, out, _ = run_cli(
        ["plan", "--model", "llama-3.1-8b", "--gpu", "RTX 4090", "--tokens-per-epoch", "2000000"], capsys
    )
    text = " ".join(out.split())
    assert code == 0 and "of 2,000,000 tokens (--tokens-per-epoch)" in text
    assert f"({low:.1f}-{high:.1f} h)" not in text  # another run, another range
    name, entry = costs.accuracy_of(hardware.resolve("RTX 4090"), 1)
    assert f"{entry['rows']} published runs ({name})" in text and "lorafit measure" in text
