"""The speed and the ETA of `lorafit train` (train/progress.py), on synthetic timelines worked out by hand."""

from __future__ import annotations

import pytest

from lorafit.train.progress import Timeline, evals_left


def steps(timeline: Timeline, first: int, last: int, start: float, seconds: float, tokens: tuple[int, int]) -> float:
    """Steps first..last ending `seconds` apart after `start`, each of `tokens` (all, trained); the end time."""
    now = start
    for step in range(first, last + 1):
        now += seconds
        timeline.tokens_all += tokens[0]
        timeline.tokens_trained += tokens[1]
        timeline.step_done(step, now, timeline.tokens_all, timeline.tokens_trained)
    return now


def test_after_a_resume_the_eta_uses_only_the_steps_trained_since() -> None:
    """Resumed at step 50 of 100, an hour after the original start: the 50 steps before the resume and that
    hour do not enter the speed; the two warm-up steps (10 s each) do not either; the rest take 2 s each."""
    timeline = Timeline(warmup_steps=2)
    timeline.training_started(3600.0, first_step=50, max_steps=100)
    now = steps(timeline, 51, 52, 3600.0, 10.0, (100, 30))  # warm-up
    assert timeline.time_left().label() == "eta ?"  # nothing measured, no estimate (the CPU)
    steps(timeline, 53, 60, now, 2.0, (100, 30))
    left = timeline.time_left()
    assert (left.seconds, left.basis) == (pytest.approx(40 * 2.0), "measured")
    speed = timeline.speed()  # 8 steps x 100 tokens in 16 s
    assert (speed.tokens_per_s_all, speed.tokens_per_s_trained) == (pytest.approx(50.0), pytest.approx(15.0))
    assert speed.label() == "50 tok/s (all), 15 tok/s (trained)"


def test_the_eta_counts_the_evaluations_still_to_come() -> None:
    """40 steps, an evaluation every 10: one before training (6 s), then after steps 10, 20, 30 and 40."""
    timeline = Timeline(eval_steps=10, warmup_steps=2)
    timeline.eval_done(6.0)  # before training: counts for the time per evaluation only
    timeline.training_started(0.0, first_step=0, max_steps=40)
    now = steps(timeline, 1, 2, 0.0, 3.5, (64, 20))  # warm-up, ends at 7 s
    now = steps(timeline, 3, 10, now, 1.0, (64, 20))  # 1 s a step, ends at 15 s
    # 30 steps x 1 s + 4 evaluations (10 is due now, then 20, 30, 40) x 6 s
    assert timeline.time_left().seconds == pytest.approx(30 * 1.0 + 4 * 6.0)
    now += 4.0  # the evaluation of step 10 takes 4 s
    timeline.eval_done(4.0)
    steps(timeline, 11, 11, now, 1.0, (64, 20))
    assert timeline.seconds_per_step() == pytest.approx(1.0)  # the evaluation is not step time
    # 29 steps x 1 s + 3 evaluations x (6 + 4) / 2 s
    assert timeline.time_left().seconds == pytest.approx(29 * 1.0 + 3 * 5.0)
    assert timeline.speed().tokens_per_s_all == pytest.approx(64.0)


def test_before_steps_are_measured_the_plan_estimate_is_shown_and_says_so() -> None:
    timeline = Timeline(estimate_s_per_step=3.0, warmup_steps=2)
    timeline.training_started(0.0, first_step=0, max_steps=10)
    steps(timeline, 1, 1, 0.0, 30.0, (10, 5))  # a slow first step does not make the estimate measured
    left = timeline.time_left()
    assert (left.seconds, left.basis, left.label()) == (27.0, "estimate", "eta 27s (estimate)")
    steps(timeline, 2, 4, 30.0, 5.0, (10, 5))
    assert timeline.time_left().label() == "eta 30s (measured)"  # 6 steps x 5 s


@pytest.mark.parametrize(
    ("step", "max_steps", "eval_steps", "evaluated", "expected"),
    [
        (0, 25, 10, 0, 3),  # 10, 20 and the last step, 25
        (20, 25, 10, 10, 2),  # 20 not yet run, 25
        (20, 25, 10, 20, 1),
        (25, 25, 10, 25, 0),
        (30, 30, 10, 20, 1),  # the last step is a multiple: evaluated once
        (5, 30, None, None, 0),
    ],
)
def test_evaluations_left(step: int, max_steps: int, eval_steps: int | None, evaluated: int, expected: int) -> None:
    assert evals_left(step, max_steps, eval_steps, evaluated) == expected


def test_the_pre_flight_shows_the_plan_estimate_per_step_labelled_as_the_estimate() -> None:
    """A planned GPU run: the tokens of an average step (effective batch x mean row length) at the plan's
    tokens/s; the CPU, which the time model does not cover, gets no figure."""
    from lorafit import hardware, models
    from lorafit.plan import make_plan
    from lorafit.schema import PlanRequest
    from lorafit.train.recipe import planned_seconds_per_step, time_line

    plan = make_plan(PlanRequest(model=models.resolve("smollm2-135m"), gpu=hardware.resolve("RTX 4090")))
    lengths = [100, 300]  # a mean of 200 tokens a row
    seconds = planned_seconds_per_step(plan, lengths)
    assert seconds == pytest.approx(plan.batch_size * 200 / plan.tokens_per_s)
    line = time_line(seconds, plan.tokens_per_s)
    assert "per step by the plan's estimate" in line and f"{plan.tokens_per_s:,.0f} tok/s" in line
    cpu = plan.model_copy(update={"tokens_per_s": 0.0})
    assert planned_seconds_per_step(cpu, lengths) is None
    assert time_line(None, 0.0).startswith("time: no planned speed")


def test_steps_that_become_several_times_slower_are_told_once_with_why() -> None:
    """Warm-up, then 4 steps of 2 s, then steps of 25 s (a GPU spilling into host memory): the third slow step
    in a row trips the warning, which is not repeated; an evaluation between steps is not a slow step."""
    timeline = Timeline(warmup_steps=2)
    timeline.training_started(0.0, first_step=0, max_steps=100)
    now = steps(timeline, 1, 2, 0.0, 10.0, (100, 30))
    now = steps(timeline, 3, 6, now, 2.0, (100, 30))
    timeline.eval_done(60.0)  # an evaluation of a minute before step 7
    now = steps(timeline, 7, 7, now + 60.0, 2.0, (100, 30))
    assert timeline.slowdown() is None
    now = steps(timeline, 8, 9, now, 25.0, (100, 30))
    assert timeline.slowdown() is None  # two slow steps: not yet
    now = steps(timeline, 10, 10, now, 25.0, (100, 30))
    told = timeline.slowdown()
    assert told is not None and "12x as long" in told and "25.0s vs 2.0s" in told and "shared system memory" in told
    steps(timeline, 11, 12, now, 25.0, (100, 30))
    assert timeline.slowdown() is None  # said once
