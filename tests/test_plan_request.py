"""The request a plan answers: the step settings the user fixed, in one typed Settings, and `lorafit train` on
several GPUs planned for the batch it was given."""

from __future__ import annotations

from unittest import mock

import pytest

from lorafit import hardware, models, options
from lorafit.schema import Plan, TokenProfile
from lorafit.train import setup

PROFILE = TokenProfile(
    source="rows", rows=1000, total_tokens=1_000_000, mean=1000, p50=1000, p95=1500, p99=1900, max=2000
)


def train_plan(values: dict[str, object], gpu: str) -> Plan:
    """The plan `lorafit train` makes for these config values on a CUDA machine with this GPU."""
    config = options.validate("train", {"model": "some/dir"} | values)
    with mock.patch.object(hardware, "available_ram_gib", return_value=512.0):
        return setup.resolve_plan(
            config,
            models.resolve("llama-3.1-8b"),
            PROFILE,
            [1000] * 10,
            saved_plan=None,
            on_cuda=True,
            console=None,  # type: ignore[arg-type]
            gpu=hardware.resolve(gpu),
        )


@pytest.mark.parametrize("n_gpus", [1, 2, 4])
def test_train_on_several_gpus_steps_the_batch_it_plans(n_gpus: int) -> None:
    """`train --n-gpus N --batch-size 16`: 16 sequences an optimizer step over all the GPUs, as plan.json says
    (the accumulation was planned as for one GPU: N x 16 sequences a step)."""
    plan = train_plan({"n_gpus": n_gpus, "batch_size": 16}, "RTX 4090")
    assert plan.batch_size == 16
    assert plan.settings.micro_batch * plan.settings.grad_accum * plan.settings.n_gpus == 16
    assert (plan.settings.n_gpus, plan.settings.shard) == (n_gpus, "none")  # train chooses no shard on one machine


def test_a_train_run_that_does_not_fit_gets_its_suggestions() -> None:
    """LoRA of an 8B model on an 8 GB card: the plan says it does not fit and what would (the search of more GPUs
    kept the run's own single GPU and crashed on `shard zero3 needs n_gpus > 1`)."""
    plan = train_plan({"method": "lora"}, "RTX 4060 Ti 8GB")
    assert not plan.fits
    assert any(s.n_gpus > 1 for s in plan.suggestions) and any("QLoRA" in s.change for s in plan.suggestions)
