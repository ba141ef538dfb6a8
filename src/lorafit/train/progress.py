"""The speed and the time left of a training run, from what this process has measured.

Tokens are counted two ways, both reported: all tokens (prompt and answer, no padding: what other trainers
call tokens/s) and trained tokens (the answer tokens the loss is computed on).

The time left is the measured seconds per step times the steps left, plus the measured seconds per evaluation
times the evaluations still to come. Only this process's own steps are measured (a resumed run never divides
by steps trained before the resume), the first WARMUP_STEPS of them are left out (they include one-off costs:
the optimizer's state, lazy initialisation, the allocator growing), and evaluation time is taken out of the
step time and counted on its own. Until steps are measured, the plan's estimate stands in, labelled so.
A run whose steps suddenly take several times as long as its first measured ones is told why, once (slowdown):
on Windows NVIDIA's driver spills an over-full GPU into shared system memory instead of failing (one report:
26 s to 309 s a step), elsewhere another process on the GPU or a throttled card does the same.
No torch here: the trainer's callback feeds it times and counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

WARMUP_STEPS = 2  # "the first step or two, which include warm-up" (issue 26); step 3 on is measured
# A slowdown: SLOW_STEPS steps in a row each SLOWDOWN times the median of the first BASELINE_STEPS measured ones.
# Steps of one run vary by tens of percent (batches of different lengths), a spill to host memory by ~10x.
BASELINE_STEPS = 3
SLOW_STEPS = 3
SLOWDOWN = 3.0


@dataclass(frozen=True)
class Speed:
    tokens_per_s_all: float
    tokens_per_s_trained: float

    def label(self) -> str:
        return f"{self.tokens_per_s_all:,.0f} tok/s (all), {self.tokens_per_s_trained:,.0f} tok/s (trained)"


@dataclass(frozen=True)
class TimeLeft:
    seconds: float | None  # None: nothing measured and no estimate
    basis: str  # "measured" or "estimate"

    def label(self) -> str:
        return f"eta {duration(self.seconds)} ({self.basis})" if self.seconds is not None else "eta ?"


def duration(seconds: float) -> str:
    """42s, 3m05s, 2h07m: short enough for a progress line."""
    whole = round(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


def seconds(value: float) -> str:
    """0.4s, 12.3s, 3m05s: a step's time."""
    return f"{value:.1f}s" if value < 60 else duration(value)


def evals_left(step: int, max_steps: int, eval_steps: int | None, evaluated_step: int | None) -> int:
    """Evaluations still to run once `step` has ended: one every eval_steps and one at the last step
    (transformers' DefaultFlowCallback evaluates at the end of a step-based schedule), the one at `step` itself
    included unless it already ran (`evaluated_step`)."""
    if not eval_steps or step > max_steps:
        return 0
    later = max_steps // eval_steps - step // eval_steps  # the multiples of eval_steps after `step`
    if max_steps % eval_steps and step < max_steps:
        later += 1  # the one at the last step
    due_now = (step % eval_steps == 0 or step == max_steps) and evaluated_step != step
    return later + int(due_now)


@dataclass
class _Mark:
    """Where the warm-up ended: the clock, the evaluation seconds and the token counts then."""

    time: float
    eval_seconds: float
    tokens_all: int
    tokens_trained: int


@dataclass
class Timeline:
    """Step ends and evaluations of this process, on one clock (seconds, any origin)."""

    eval_steps: int | None = None
    estimate_s_per_step: float | None = None  # the plan's, until steps are measured
    warmup_steps: int = WARMUP_STEPS
    first_step: int = 0  # the global step this process trains from: 0, or the step of the checkpoint it resumed
    max_steps: int = 0
    started: float | None = None  # when training began in this process
    eval_seconds: float = 0.0  # every evaluation of this process, the one before training included
    evals: int = 0
    training_eval_seconds: float = 0.0  # those after training began
    evaluated_step: int | None = None  # the step of the last evaluation
    last_step: int = 0
    last_time: float = 0.0
    tokens_all: int = 0  # this process's, since training began in it
    tokens_trained: int = 0
    mark: _Mark | None = field(default=None, repr=False)
    step_seconds: list[float] = field(default_factory=list, repr=False)  # each measured step, evaluations out
    slowdown_told: bool = False
    _eval_seconds_then: float = field(default=0.0, repr=False)

    def training_started(self, now: float, first_step: int, max_steps: int) -> None:
        """Training begins (or resumes) in this process at global step `first_step`."""
        self.started = self.last_time = now
        self.first_step = self.last_step = self.evaluated_step = first_step
        self.max_steps = max_steps

    def eval_done(self, seconds: float) -> None:
        """An evaluation took `seconds`; one before training counts for the time per evaluation only."""
        self.eval_seconds += seconds
        self.evals += 1
        if self.started is not None:
            self.training_eval_seconds += seconds
            self.evaluated_step = self.last_step

    def step_done(self, step: int, now: float, tokens_all: int, tokens_trained: int) -> None:
        """A step ended at `now`; the token counts are this process's totals since training began in it."""
        if self.mark is not None:
            evals = self.training_eval_seconds - self._eval_seconds_then
            self.step_seconds.append((now - self.last_time - evals) / max(step - self.last_step, 1))
        self.last_step, self.last_time = step, now
        self._eval_seconds_then = self.training_eval_seconds
        self.tokens_all, self.tokens_trained = tokens_all, tokens_trained
        if self.mark is None and step - self.first_step >= self.warmup_steps:
            self.mark = _Mark(now, self.training_eval_seconds, tokens_all, tokens_trained)

    def slowdown(self) -> str | None:
        """Once, when the last SLOW_STEPS steps each took SLOWDOWN x the first measured ones: the line saying so."""
        first, last = self.step_seconds[:BASELINE_STEPS], self.step_seconds[BASELINE_STEPS:][-SLOW_STEPS:]
        if self.slowdown_told or len(first) < BASELINE_STEPS or len(last) < SLOW_STEPS:
            return None
        usual = sorted(first)[BASELINE_STEPS // 2]
        if usual <= 0 or min(last) < SLOWDOWN * usual:
            return None
        self.slowdown_told = True
        return (
            f"steps now take {min(last) / usual:.0f}x as long as the first ones ({seconds(min(last))} vs "
            f"{seconds(usual)}): the GPU is likely out of memory and spilling into shared system memory (Windows' "
            "driver does this instead of failing) or shared with another process; a smaller --micro-batch or the "
            "memory savers (--offload-activations) bring it back"
        )

    @property
    def measured_steps(self) -> int:
        """Steps timed after the warm-up."""
        return max(0, self.last_step - self.first_step - self.warmup_steps) if self.mark else 0

    def _window(self) -> tuple[float, int, int]:
        """Training seconds (evaluations out) and tokens since the warm-up ended, or, before that, since
        training began in this process."""
        if self.measured_steps and self.mark is not None:
            since = self.mark
        else:
            since = _Mark(self.started if self.started is not None else self.last_time, 0.0, 0, 0)
        seconds = (self.last_time - since.time) - (self.training_eval_seconds - since.eval_seconds)
        return seconds, self.tokens_all - since.tokens_all, self.tokens_trained - since.tokens_trained

    def seconds_per_step(self) -> float | None:
        """Measured training seconds per step after the warm-up; None before a step is measured."""
        if not self.measured_steps:
            return None
        return self._window()[0] / self.measured_steps

    def speed(self) -> Speed:
        seconds, tokens_all, tokens_trained = self._window()
        if seconds <= 0:
            return Speed(0.0, 0.0)
        return Speed(tokens_all / seconds, tokens_trained / seconds)

    def seconds_per_eval(self) -> float | None:
        return self.eval_seconds / self.evals if self.evals else None

    def time_left(self) -> TimeLeft:
        """Steps left x seconds per step (measured, else the estimate) + evaluations to come x seconds each."""
        per_step, basis = self.seconds_per_step(), "measured"
        if per_step is None:
            per_step, basis = self.estimate_s_per_step, "estimate"
        if per_step is None:
            return TimeLeft(None, basis)
        evals = evals_left(self.last_step, self.max_steps, self.eval_steps, self.evaluated_step)
        return TimeLeft(per_step * (self.max_steps - self.last_step) + (self.seconds_per_eval() or 0.0) * evals, basis)
