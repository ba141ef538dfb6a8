"""transformers.Trainer with what lorafit adds: a sampler seeded per epoch, atomic checkpoints, the OOM
fault hook, token counts for tokens/s (all tokens and trained answer tokens), and the callbacks that write
metrics.jsonl and draw the progress bar with its measured ETA (`progress.Timeline`).

Losses do not depend on how a batch is split into micro-batches: a training step's loss is the mean over all
answer tokens of its effective batch (transformers passes `num_items_in_batch`), the logged loss is the mean
of the steps since the previous line (kept with each checkpoint, so a resumed run logs the same means), and
the eval loss is the mean over all answer tokens of the eval set, not a mean of per-batch means.

This module imports torch and transformers at the top: only `recipe.run` imports it, inside the function.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_pt_utils import get_length_grouped_indices

from lorafit.errors import TrainError
from lorafit.files import write_atomic
from lorafit.train import checkpoints, failures, guard, savers
from lorafit.train.examples import IGNORE_INDEX
from lorafit.train.guard import InjectedOom, RandomState, capture_random_state, restore_random_state
from lorafit.train.progress import Speed, Timeline

if TYPE_CHECKING:
    from lorafit.schema import Settings

TOKENS_KEY = "num_tokens"  # added by TokenCountingCollator, removed before the forward pass
TRAINED_TOKENS_KEY = "num_trained_tokens"  # likewise: the answer tokens the loss is computed on
UNLOGGED_LOSSES = "lorafit-unlogged-losses.json"  # in a checkpoint: step losses not yet in a metrics line


class EpochSampler(torch.utils.data.Sampler[int]):
    """A random order drawn from (seed + epoch) alone, so a resumed run sees exactly the order of an
    uninterrupted one. With `group_size`, rows of similar length are put together (transformers' length
    grouping over mega-batches of 50 effective batches), so padding to the longest in a batch wastes little."""

    def __init__(self, lengths: list[int], seed: int, group_size: int | None) -> None:
        self.lengths = lengths
        self.seed = seed
        self.group_size = group_size
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        if self.group_size:
            return iter(get_length_grouped_indices(self.lengths, self.group_size, generator=generator))
        return iter(torch.randperm(len(self.lengths), generator=generator).tolist())


class TokenCountingCollator:
    """Wraps a collator and records how many real (non-pad) tokens each batch holds, and how many of them the
    loss is computed on (labelled answer tokens after the causal shift), from the lists: no device sync."""

    def __init__(self, inner: Callable[[list[dict[str, Any]]], dict[str, Any]]) -> None:
        self.inner = inner

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        batch = dict(self.inner(features))
        batch[TOKENS_KEY] = sum(len(feature["input_ids"]) for feature in features)
        batch[TRAINED_TOKENS_KEY] = sum(_scored(list(feature["labels"])) for feature in features)
        return batch


def _scored(labels: list[int]) -> int:
    """The labels the causal loss scores: all but the first (no position predicts it) that are not ignored.
    list.count runs in C, so a long row costs no Python loop."""
    shifted = labels[1:]
    return len(shifted) - shifted.count(IGNORE_INDEX)


def pop_counts(batch: dict[str, Any]) -> tuple[int, int]:
    """(all, trained) tokens of a batch, taken out of it before it reaches the model."""
    return int(batch.pop(TOKENS_KEY, 0)), int(batch.pop(TRAINED_TOKENS_KEY, 0))


class StepWatch:
    """What outlives one Trainer (the out-of-memory retry builds another): the random state at the start of
    the current step, whether the optimizer was in the middle of its update, and the loss of each finished
    step not yet logged."""

    def __init__(self) -> None:
        self.random_state: RandomState | None = None
        self.in_optimizer_step = False
        self.unlogged_losses: dict[int, torch.Tensor | float] = {}


class LorafitTrainer(Trainer):
    def __init__(
        self,
        *args: Any,
        run_dir: Path,
        lengths: list[int],
        group_by_length: bool,
        keep: int,
        fault: InjectedOom,
        watch: StepWatch,
        settings: Settings,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.settings = settings
        self.run_dir = Path(run_dir)
        self.lengths = lengths
        self.group_by_length = group_by_length
        self.keep = keep
        self.fault = fault
        self.watch = watch
        self.tokens_all = 0  # this process's tokens since training began in it: every real token
        self.tokens_trained = 0  # and the answer tokens the loss is computed on
        self.tokens_every_process: tuple[int, int] | None = None  # both, summed over processes at a logged line
        self._micro_batches_in_step = 0
        self._step_of_micro_batches = -1
        self._step_loss: torch.Tensor | None = None

    def _get_train_sampler(self, train_dataset: Any = None) -> torch.utils.data.Sampler:
        """Every process draws the same order (accelerate deals its micro-batches out in turn); rows are grouped
        by length over the effective batch of all processes, so N processes train the batches one does."""
        group = self.args.train_batch_size * self.args.gradient_accumulation_steps * self.args.world_size
        return EpochSampler(self.lengths, self.args.seed, group if self.group_by_length else None)

    # --- the run: resume, the end, an interrupt ----------------------------------------------------------
    def train(self, resume_from_checkpoint: str | None = None, **kwargs: Any) -> Any:
        """Trainer.train, with the unlogged step losses of the checkpoint restored, and Ctrl-C answered with
        where the run stopped and how to go on (the exit code stays that of an interrupt)."""
        self.watch.unlogged_losses = _read_unlogged(resume_from_checkpoint)
        try:
            return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
        except KeyboardInterrupt as interrupt:
            callback = self._run_callback()
            if callback is not None:
                callback.close()
            console = callback.console if callback is not None else Console(highlight=False)
            newest = checkpoints.latest_checkpoint(self.run_dir)
            if not self.state.max_steps:  # still setting up
                where = "interrupted before the first step"
            else:
                where = f"interrupted after step {self.state.global_step} of {self.state.max_steps}"
                where += ", before the first checkpoint" if newest is None else ""
            go_on = f"rerun the same command to resume from {newest.name}" if newest else "rerunning starts over"
            console.print(f"{where}: {go_on}")
            raise failures.ReportedInterrupt from interrupt

    def _init_training_state(
        self,
        max_steps: int,
        num_update_steps_per_epoch: int,
        num_train_epochs: int,
        resume_from_checkpoint: str | None,
        trial: Any,
    ) -> tuple[int, int]:
        """The Trainer always runs one step after resuming, even from the checkpoint of the last step (it
        checks for the end after a step); a run resumed there has nothing left to train."""
        epochs_trained, steps_trained = super()._init_training_state(
            max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
        )
        if self.state.global_step >= max_steps:
            return num_train_epochs, 0  # no epoch left to run
        return epochs_trained, steps_trained

    def _run_callback(self) -> RunCallback | None:
        return next((c for c in self.callback_handler.callbacks if isinstance(c, RunCallback)), None)

    # --- steps and losses ----------------------------------------------------------------------------------
    def training_step(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        if self._step_of_micro_batches != self.state.global_step:
            self._step_of_micro_batches, self._micro_batches_in_step = self.state.global_step, 0
            self._step_loss = None
        self._micro_batches_in_step += 1
        self.fault.check(
            self.state.global_step + 1,
            last_micro_batch=self._micro_batches_in_step == self.args.gradient_accumulation_steps,
        )
        tokens_all, tokens_trained = pop_counts(inputs)
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.tokens_all += tokens_all
        self.tokens_trained += tokens_trained
        # Each micro-batch's loss is its share of the step's (normalised by the step's answer tokens), so
        # their sum is the step's loss; kept as a tensor until it is logged, so no device sync per step.
        self._step_loss = loss if self._step_loss is None else self._step_loss + loss
        if self._micro_batches_in_step == self.current_gradient_accumulation_steps:
            self.watch.unlogged_losses[self.state.global_step + 1] = self._step_loss
        return loss

    def compute_loss(
        self, model: Any, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        """With the chunked loss or activation offload on, the decoder and the loss run through
        `savers.micro_batch_loss`, under the autocast accelerate puts around the model's own forward; the
        loss is normalised as transformers normalises it (by the step's answer tokens, across processes)."""
        if return_outputs or not savers.uses_own_loss(self.settings):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        with self.accelerator.autocast():
            loss = savers.micro_batch_loss(model, inputs, self.settings, num_items_in_batch=num_items_in_batch)
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:  # as Trainer.compute_loss
            processes = self.accelerator.num_processes // self.get_tp_size()
            loss = loss * (processes if self.args.n_gpu <= 1 else self.args.n_gpu)
        return loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """The logged training loss is the mean of the step losses since the previous line, also across an
        out-of-memory retry or a resume (the Trainer's own counts only the steps since it started)."""
        if "loss" in logs and self.watch.unlogged_losses:
            step_losses = self.step_losses()
            self._stop_if_diverged(step_losses)
            losses = list(step_losses.values())
            logs = logs | {"loss": sum(losses) / len(losses)}
            self.watch.unlogged_losses = {}
        if "loss" in logs:
            self._stop_if_diverged({self.state.global_step: float(logs["loss"])})
        if "loss" in logs and self.args.world_size > 1:  # the tokens of every process, for tokens/s
            counts = torch.tensor([self.tokens_all, self.tokens_trained], dtype=torch.float64, device=self.args.device)
            summed = self.accelerator.reduce(counts, reduction="sum").tolist()
            self.tokens_every_process = (int(summed[0]), int(summed[1]))
        super().log(logs, start_time)

    def _stop_if_diverged(self, losses: dict[int, float]) -> None:
        """A loss that is no longer a number (or infinite) stops the run in one line, before that step is
        logged or checkpointed: nothing after it can be trained from, and the run is not finished."""
        diverged = guard.diverged(losses, self.args.learning_rate)
        if diverged is None:
            return
        callback = self._run_callback()
        if callback is not None:
            callback.close()
        raise diverged

    def step_losses(self) -> dict[int, float]:
        """The loss of each finished step not yet logged. With several processes each holds its share of a
        step's loss (its answer tokens over the step's, across processes, times their number, as transformers
        scales it), so the step's loss is their mean: every process calls this together."""
        if self.args.world_size == 1:
            return {step: float(value) for step, value in self.watch.unlogged_losses.items()}
        steps = sorted(self.watch.unlogged_losses)
        if not steps:
            return {}
        device = self.args.device  # a resumed run's first losses are floats read back, the others tensors
        losses = [torch.as_tensor(self.watch.unlogged_losses[step]).detach() for step in steps]
        values = torch.stack([loss.to(device).double().reshape(()) for loss in losses])
        return dict(zip(steps, self.accelerator.reduce(values, reduction="mean").tolist(), strict=True))

    def evaluate(
        self, eval_dataset: Any = None, ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval"
    ) -> dict[str, float]:
        """The eval loss as the mean over every answer token of the eval set. The Trainer's is a mean of
        per-batch means, which changes with the eval batch (the micro-batch, halved after out of memory)."""
        model = self.model
        model.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.args.device)
        tokens = 0
        started = time.perf_counter()
        with torch.no_grad():
            for batch, counted in self._eval_batches(eval_dataset):
                pop_counts(batch)
                inputs = self._prepare_inputs(batch)
                count = int((inputs["labels"][..., 1:] != IGNORE_INDEX).sum())  # the causal shift drops position 0
                if not count:
                    continue
                with self.compute_loss_context_manager():
                    loss = self.compute_loss(model, inputs)  # the mean over this batch's answer tokens
                if counted:
                    total += loss.detach().double() * count
                    tokens += count
        if self.args.world_size > 1:
            both = torch.stack([total, torch.tensor(float(tokens), dtype=torch.float64, device=total.device)])
            total, summed = self.accelerator.reduce(both, reduction="sum")
            tokens = int(summed.item())
        metrics = {
            f"{metric_key_prefix}_loss": (total / tokens).item() if tokens else float("nan"),
            f"{metric_key_prefix}_runtime": round(time.perf_counter() - started, 4),
        }
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def _eval_batches(self, eval_dataset: Any = None) -> Iterator[tuple[dict[str, Any], bool]]:
        """(batch, counted) pairs. One process: the Trainer's eval batches. Several: the same batches (the eval
        rows in order, micro_batch at a time), dealt out in turn, so that the sum over all processes is one
        process's sum; a process short of a batch runs one more, not counted, because with sharded weights
        every forward pass needs every process."""
        if self.args.world_size == 1:
            for batch in self.get_eval_dataloader(eval_dataset):
                yield batch, True
            return
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        size = self.args.per_device_eval_batch_size
        chunks = [list(range(start, min(start + size, len(dataset)))) for start in range(0, len(dataset), size)]
        mine = chunks[self.args.process_index :: self.args.world_size]
        for index in range(-(-len(chunks) // self.args.world_size)):
            rows = mine[index] if index < len(mine) else chunks[0]
            yield self.data_collator([dataset[row] for row in rows]), index < len(mine)

    def prediction_step(self, model: Any, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        pop_counts(inputs)
        return super().prediction_step(model, inputs, *args, **kwargs)

    # --- checkpoints ---------------------------------------------------------------------------------------
    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """Write into checkpoints/.staging, then publish with an atomic rename. A failed save (a full disk:
        torch, safetensors and Python each report it their own way) deletes the staged copy and stops the run
        with one line; the previous checkpoint is untouched."""
        step = self.state.global_step
        staged = Path(self.args.output_dir) / f"{checkpoints.PREFIX}{step}"
        main = self.args.process_index == 0
        if main:
            shutil.rmtree(staged, ignore_errors=True)
        self.accelerator.wait_for_everyone()  # no process writes into the folder before it is cleared
        callback = self._run_callback()
        losses = self.step_losses()
        self._stop_if_diverged(losses)  # a step between two logged lines: its weights are no checkpoint
        try:
            if callback is not None:
                callback.flush()  # the metrics of this step are on disk before its checkpoint is
            super()._save_checkpoint(model, trial)  # every process: its RNG state, its optimizer shard
            # rank 0 publishes once every process has written its part
            self.accelerator.wait_for_everyone()
            if main:
                unlogged = {str(key): value for key, value in losses.items() if key <= step}
                write_atomic(staged / UNLOGGED_LOSSES, json.dumps(unlogged))
                checkpoints.publish(staged, self.run_dir, step, self.keep)
            self.accelerator.wait_for_everyone()  # every process finds the checkpoint published
        except Exception as error:
            reason = failures.write_failure(error, staged)
            if reason is None:
                raise
            checkpoints.discard_staged(staged)
            raise TrainError(
                f"cannot write checkpoint-{step} in {checkpoints.checkpoint_root(self.run_dir)}: {reason}; "
                f"{checkpoints.resume_hint(self.run_dir, failures.fix_for(reason))}"
            ) from None

    def save_after_oom(self) -> Path:
        """Checkpoint the last good step (the random state as that step left it) and return it."""
        current = capture_random_state()
        if self.watch.random_state is not None:
            restore_random_state(self.watch.random_state)
        self.model.zero_grad(set_to_none=True)
        self._save_checkpoint(self.model, None)
        restore_random_state(current)
        return checkpoints.checkpoint_root(self.run_dir) / f"{checkpoints.PREFIX}{self.state.global_step}"


def _read_unlogged(checkpoint: str | None) -> dict[int, float]:
    """The step losses a checkpoint saved that no metrics line holds yet (none for a fresh start)."""
    if checkpoint is None:
        return {}
    try:
        data = json.loads((Path(checkpoint) / UNLOGGED_LOSSES).read_text())
    except (OSError, ValueError):
        return {}  # a checkpoint of an earlier lorafit: the first line after it averages the steps since
    return {int(key): float(value) for key, value in data.items()} if isinstance(data, dict) else {}


class RunCallback(TrainerCallback):
    """metrics.jsonl (one line per logged step, eval_loss merged into its step's line), the progress bar
    with loss, tokens/s (all and trained) and the ETA, and the step bookkeeping the out-of-memory retry reads.
    `estimate_s_per_step`: the plan's time per step, shown (labelled) until steps are measured."""

    def __init__(
        self,
        metrics_path: Path,
        console: Console,
        watch: StepWatch,
        trainer_ref: Callable[[], LorafitTrainer],
        writes: bool = True,
        estimate_s_per_step: float | None = None,
    ) -> None:
        self.metrics_path = Path(metrics_path)
        self.writes = writes  # False in the processes other than rank 0, which alone writes metrics.jsonl
        self.console = console
        self.watch = watch
        self.trainer_ref = trainer_ref
        self.timeline = Timeline(estimate_s_per_step=estimate_s_per_step)
        self.pending: dict[str, Any] | None = None
        self.progress: Progress | None = None
        self.task: Any = None
        self.last_loss: float | None = None
        self.last_eval: float | None = None
        self.next_plain_report = 0.0
        self.printed_step: int | None = None  # of the last plain progress line

    # --- metrics.jsonl ------------------------------------------------------------------------------------
    def flush(self) -> None:
        if self.pending is None:
            return
        if not self.writes:
            self.pending = None
            return
        with open(self.metrics_path, "a") as handle:
            handle.write(json.dumps(self.pending) + "\n")
        self.pending = None

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        if not self.trainer_ref().is_in_train:
            return  # an evaluation before training: the caller reports it, it is not a step of the curve
        logs = logs or {}
        step = state.global_step
        if "loss" in logs:
            self.flush()
            self.last_loss = float(logs["loss"])
            record: dict[str, Any] = {"step": step, "loss": self.last_loss}
            for key in ("learning_rate", "grad_norm", "epoch"):
                if key in logs:
                    record[key] = float(logs[key])
            speed = self.speed()
            left = self.timeline.time_left()
            record["tokens_per_s_all"] = round(speed.tokens_per_s_all, 1)
            record["tokens_per_s_trained"] = round(speed.tokens_per_s_trained, 1)
            record["tokens_per_s"] = record["tokens_per_s_all"]  # the key of earlier versions (all real tokens)
            record["elapsed_s"] = round(time.perf_counter() - (self.timeline.started or 0.0), 3)
            record["eta_s"] = round(left.seconds, 1) if left.seconds is not None else None
            record["eta_basis"] = left.basis
            self.pending = record
            if not control.should_evaluate:
                self.flush()
        elif "eval_loss" in logs:
            self.last_eval = float(logs["eval_loss"])
            if self.pending is not None and self.pending["step"] == step:
                self.pending["eval_loss"] = self.last_eval
                self.flush()
            else:
                self.flush()
                self.pending = {"step": step, "eval_loss": self.last_eval}
                self.flush()
        self._show(state)

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        metrics = kwargs.get("metrics") or {}
        if "eval_runtime" in metrics:
            self.timeline.eval_done(float(metrics["eval_runtime"]))

    # --- step bookkeeping ---------------------------------------------------------------------------------
    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.watch.random_state = capture_random_state()
        self.watch.in_optimizer_step = False

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.watch.in_optimizer_step = True

    def on_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.watch.in_optimizer_step = False

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        trainer = self.trainer_ref()
        self.timeline.step_done(state.global_step, time.perf_counter(), trainer.tokens_all, trainer.tokens_trained)
        if self.writes and (slower := self.timeline.slowdown()):
            self.console.print(f"[yellow]warning[/yellow]: {slower}")
        if state.global_step >= state.max_steps:
            control.should_log = True  # the last step always gets its line
        self._show(state)

    # --- progress -----------------------------------------------------------------------------------------
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        by_steps = args.eval_strategy == "steps" and args.eval_steps
        self.timeline.eval_steps = int(args.eval_steps) if by_steps and args.eval_steps else None
        self.timeline.training_started(time.perf_counter(), state.global_step, state.max_steps)
        if self.console.is_terminal:
            self.progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[stats]}"),
                TimeElapsedColumn(),
                console=self.console,
                transient=False,
            )
            self.progress.start()
            self.task = self.progress.add_task("train", total=state.max_steps, completed=state.global_step, stats="")

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.flush()
        self._show(state, final=True)
        self.close()

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

    def speed(self) -> Speed:
        """This process's measured speed; with several processes, that of all of them (their token counts
        are summed at each logged line; until the first, every process is taken to train as many)."""
        speed = self.timeline.speed()
        trainer = self.trainer_ref()
        if trainer.args.world_size == 1:
            return speed
        every = trainer.tokens_every_process
        scale_all = every[0] / trainer.tokens_all if every and trainer.tokens_all else trainer.args.world_size
        scale_trained = (
            every[1] / trainer.tokens_trained if every and trainer.tokens_trained else trainer.args.world_size
        )
        return Speed(speed.tokens_per_s_all * scale_all, speed.tokens_per_s_trained * scale_trained)

    def _stats(self) -> str:
        parts = []
        if self.last_loss is not None:
            parts.append(f"loss {self.last_loss:.4f}")
        if self.last_eval is not None:
            parts.append(f"eval {self.last_eval:.4f}")
        parts.append(self.speed().label())
        parts.append(self.timeline.time_left().label())
        return "  ".join(parts)

    def _show(self, state: TrainerState, final: bool = False) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=state.global_step, stats=self._stats())
            return
        # Not a terminal (a log file, CI): a plain line every few seconds, and the last step's once, at the end.
        now = time.perf_counter()
        if final and self.printed_step == state.global_step:
            return
        if not final and (now < self.next_plain_report or state.global_step >= state.max_steps):
            return
        self.printed_step = state.global_step
        self.next_plain_report = now + 5.0
        self.console.print(f"step {state.global_step}/{state.max_steps}  {self._stats()}")
