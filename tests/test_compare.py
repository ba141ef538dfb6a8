"""`lorafit plan --compare` shares its work between cards (each step validated and estimated once, the verdict
given per card; only the fewest-GPU suggestions worked out for a card that does not fit alone) and must still
answer exactly what planning each card alone answers."""

from __future__ import annotations

from typing import Any

import pytest

from lorafit import hardware, memory, models, search
from lorafit import plan as planner
from lorafit.schema import Plan, PlanRequest, Settings

# Under $0.30/hour the catalog rents a 16 GB card and three 24 GB ones: few enough to plan every card alone in a
# test, small enough that a 70B or a 7B full fine-tune needs several of each.
CAP = 0.3


def ask(model: str, **fixed: Any) -> PlanRequest:
    return PlanRequest(model=models.resolve(model), fixed=fixed)


def each_card_alone(request: PlanRequest, monkeypatch: pytest.MonkeyPatch) -> dict[str, Plan]:
    """The comparison as it was before it shared work: every step validated and estimated on its own card, every
    suggestion of a card that does not fit worked out, and several_of's pick among them."""
    with monkeypatch.context() as patched:
        patched.setattr(
            search, "estimate_on", lambda spec, settings, gpu, headroom: memory.estimate(spec, settings, gpu, headroom)
        )
        patched.setattr(search, "settings_of", lambda values: Settings(**values))
        plans = {}
        for gpu in hardware.gpus(max_price_hour=CAP):
            plan = planner.make_plan(request.model_copy(update={"gpu": gpu}), details=False)
            plans[gpu.name] = plan if plan.fits else planner.several_of(request, plan, gpu)
    return plans


@pytest.mark.parametrize(
    "request_",
    [ask("llama-2-70b"), ask("llama-2-7b", method="full"), ask("llama-2-13b", method="lora", offload="optimizer")],
    ids=["70b qlora", "7b full", "13b lora, optimizer offloaded"],
)
def test_the_comparison_is_each_card_planned_alone(request_: PlanRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    compared = planner.compare(request_, max_price_hour=CAP)
    alone = each_card_alone(request_, monkeypatch)
    assert {plan.gpu.name: plan for plan in compared} == alone
    assert any(plan.fits and plan.settings.n_gpus > 1 for plan in compared)  # the several-GPU rows are exercised
    fitting = [plan for plan in compared if plan.fits]
    assert [plan.hours for plan in fitting] == sorted(plan.hours for plan in fitting)


def test_a_verdict_on_the_line_is_the_estimators() -> None:
    """Estimates are shared between cards with their figures rounded; a card whose usable memory is within the
    rounding of the peak still gets the estimator's own verdict."""
    spec, settings = models.resolve("llama-2-7b"), Settings(method="qlora", quant="nf4")
    exact = memory.estimate(spec, settings)
    headroom = 0.1
    like = hardware.resolve("RTX 4090")
    verdicts = set()
    for shift in (-2e-4, -5e-5, -2e-5, -1e-6, 0.0, 1e-6, 2e-5, 5e-5, 2e-4):  # GiB of usable memory off the peak
        usable = exact.peak_device_gib + shift
        card = like.model_copy(update={"memory_gib": usable / like.usable_fraction / (1 - headroom)})
        verdicts.add(memory.estimate(spec, settings, card, headroom).fits)
        assert search.estimate_on(spec, settings, card, headroom) == memory.estimate(spec, settings, card, headroom)
    assert verdicts == {True, False}  # the cards straddle the line
