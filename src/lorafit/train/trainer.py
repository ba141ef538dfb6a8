"""transformers.Trainer with what lorafit adds: a sampler seeded per epoch, atomic checkpoints, the OOM
fault hook, a token count for tokens/s, and the callbacks that write metrics.jsonl and draw the progress bar.

This module imports torch and transformers at the top: only `recipe.run` imports it, inside the function.
"""

from __future__ import annotations

import errno
import json
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_pt_utils import get_length_grouped_indices

from lorafit.errors import TrainError
from lorafit.train import checkpoints
from lorafit.train.guard import InjectedOom, RandomState, capture_random_state, restore_random_state

TOKENS_KEY = "num_tokens"  # added by TokenCountingCollator, removed before the forward pass


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
    """Wraps a collator and records how many real (non-pad) tokens each batch holds, without a device sync."""

    def __init__(self, inner: Callable[[list[dict[str, Any]]], dict[str, Any]]) -> None:
        self.inner = inner

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        batch = dict(self.inner(features))
        batch[TOKENS_KEY] = sum(len(feature["input_ids"]) for feature in features)
        return batch


class StepWatch:
    """What the out-of-memory retry needs to know: the random state at the start of the current step, and
    whether the optimizer was in the middle of its update."""

    def __init__(self) -> None:
        self.random_state: RandomState | None = None
        self.in_optimizer_step = False


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
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.run_dir = Path(run_dir)
        self.lengths = lengths
        self.group_by_length = group_by_length
        self.keep = keep
        self.fault = fault
        self.watch = watch
        self.tokens_trained = 0
        self._micro_batches_in_step = 0
        self._step_of_micro_batches = -1

    def _get_train_sampler(self, train_dataset: Any = None) -> torch.utils.data.Sampler:
        group = self.args.train_batch_size * self.args.gradient_accumulation_steps if self.group_by_length else None
        return EpochSampler(self.lengths, self.args.seed, group)

    def training_step(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        if self._step_of_micro_batches != self.state.global_step:
            self._step_of_micro_batches, self._micro_batches_in_step = self.state.global_step, 0
        self._micro_batches_in_step += 1
        self.fault.check(
            self.state.global_step + 1,
            last_micro_batch=self._micro_batches_in_step == self.args.gradient_accumulation_steps,
        )
        tokens = inputs.pop(TOKENS_KEY, 0)
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.tokens_trained += int(tokens)
        return loss

    def prediction_step(self, model: Any, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        inputs.pop(TOKENS_KEY, None)
        return super().prediction_step(model, inputs, *args, **kwargs)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """Write into checkpoints/.staging, then publish with an atomic rename. A failed save (a full disk)
        deletes the staged copy and stops the run with one line; the previous checkpoint is untouched."""
        step = self.state.global_step
        staged = Path(self.args.output_dir) / f"{checkpoints.PREFIX}{step}"
        shutil.rmtree(staged, ignore_errors=True)
        for callback in self.callback_handler.callbacks:
            if isinstance(callback, RunCallback):
                callback.flush()  # the metrics of this step are on disk before its checkpoint is
        try:
            super()._save_checkpoint(model, trial)
            checkpoints.publish(staged, self.run_dir, step, self.keep)
        except OSError as error:
            shutil.rmtree(staged, ignore_errors=True)
            previous = checkpoints.latest_checkpoint(self.run_dir)
            kept = f"{previous.name} is intact" if previous else "there is no earlier checkpoint"
            reason = "no space left on device" if error.errno == errno.ENOSPC else (error.strerror or str(error))
            raise TrainError(
                f"cannot write checkpoint-{step} ({reason}); {kept}: free space and rerun the same command to resume"
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


class RunCallback(TrainerCallback):
    """metrics.jsonl (one line per logged step, eval_loss merged into its step's line), the progress bar
    with loss, tokens/s and ETA, and the step bookkeeping the out-of-memory retry reads."""

    def __init__(
        self, metrics_path: Path, console: Console, watch: StepWatch, trainer_ref: Callable[[], LorafitTrainer]
    ) -> None:
        self.metrics_path = Path(metrics_path)
        self.console = console
        self.watch = watch
        self.trainer_ref = trainer_ref
        self.pending: dict[str, Any] | None = None
        self.progress: Progress | None = None
        self.task: Any = None
        self.started = 0.0
        self.first_step = 0
        self.last_loss: float | None = None
        self.last_eval: float | None = None
        self.next_plain_report = 0.0

    # --- metrics.jsonl ------------------------------------------------------------------------------------
    def flush(self) -> None:
        if self.pending is None:
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
            record["tokens_per_s"] = round(self._tokens_per_s(), 1)
            record["elapsed_s"] = round(time.perf_counter() - self.started, 3)
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
                with open(self.metrics_path, "a") as handle:
                    handle.write(json.dumps({"step": step, "eval_loss": self.last_eval}) + "\n")
        self._show(state)

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
        if state.global_step >= state.max_steps:
            control.should_log = True  # the last step always gets its line
        self._show(state)

    # --- progress -----------------------------------------------------------------------------------------
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.started = time.perf_counter()
        self.first_step = state.global_step
        if self.console.is_terminal:
            self.progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[stats]}"),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
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

    def _tokens_per_s(self) -> float:
        elapsed = time.perf_counter() - self.started
        return self.trainer_ref().tokens_trained / elapsed if elapsed > 0 else 0.0

    def _stats(self, state: TrainerState) -> str:
        parts = []
        if self.last_loss is not None:
            parts.append(f"loss {self.last_loss:.4f}")
        if self.last_eval is not None:
            parts.append(f"eval {self.last_eval:.4f}")
        parts.append(f"{self._tokens_per_s():,.0f} tok/s")
        return "  ".join(parts)

    def _show(self, state: TrainerState, final: bool = False) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=state.global_step, stats=self._stats(state))
            return
        # Not a terminal (a log file, CI): a plain line every few seconds and at the end.
        now = time.perf_counter()
        if not final and now < self.next_plain_report:
            return
        self.next_plain_report = now + 5.0
        done = state.global_step - self.first_step
        left = state.max_steps - state.global_step
        elapsed = now - self.started
        eta = f"{elapsed / done * left:.0f}s" if done else "?"
        self.console.print(f"step {state.global_step}/{state.max_steps}  {self._stats(state)}  eta {eta}")
