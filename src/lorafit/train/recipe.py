"""`lorafit train`, the recipe: config -> plan -> data -> model -> guarded Trainer -> the output folder.

Read top to bottom it is the whole run. The components it calls: `setup` (the inputs, the run folder opened,
the data tokenized and the plan made: the one set-up every run shares), `build` (model set-up shared with the
trace), `examples` (templates and answer masks), `trainer` (the Trainer with atomic checkpoints), `guard`
(out-of-memory), `runfolder` and `checkpoints` (the run folder), `report` (loss curve and model card).
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from lorafit import memory
from lorafit.errors import DataError, TrainError
from lorafit.files import ordinary_mode, write_atomic
from lorafit.plan import with_settings
from lorafit.schema import Plan, Settings
from lorafit.train import (
    build,
    checkpoints,
    distributed,
    examples,
    guard,
    hf_args,
    progress,
    report,
    runfolder,
    savers,
    setup,
)
from lorafit.train.config import TrainConfig
from lorafit.train.distributed import ONE_PROCESS, Processes
from lorafit.train.runfolder import METRICS
from lorafit.train.setup import Role, RunRequest, SetUp
from lorafit.units import gib

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from lorafit.models import ModelSpec


@dataclass
class RunResult:
    """What a finished run leaves in memory for the caller (the demo compares before and after)."""

    output_dir: Path
    plan: Plan
    steps: int
    train_loss: float | None
    eval_before: float | None
    eval_after: float | None
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    eval_conversations: list[list[dict[str, Any]]]
    eval_examples: examples.Encoded


@runfolder.one_line_run_errors
def run(
    config: TrainConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    dry_run: bool = False,
    console: Console | None = None,
    build_model: Callable[[Path], None] | None = None,
    processes: Processes | None = None,
    plan: Plan | None = None,
) -> RunResult | None:
    """Train `config` into config.output_dir; None if the folder holds this run finished (nothing changes).
    `build_model(dir)` creates the base model first, or completes one a kill or a full disk cut short (the demo).
    `dry_run`: check and resolve everything, print the plan and the resolved config, write nothing, return None.
    `processes`: this process among several (`worker.main`): rank 0 alone writes the run folder, and its
    decisions are every process's. `plan`: the launcher's plan, used instead of planning again."""
    console = console or Console(highlight=False)
    processes = processes or ONE_PROCESS
    started = time.perf_counter()
    request = RunRequest(config, resume=resume, overwrite=overwrite, build_model=build_model)
    if dry_run:
        setup.dry_run(request, console=console)
        return None
    with contextlib.ExitStack() as held:  # the run folder is held until the run ends (a launcher holds it for many)
        role = Role.WORKER if processes.launched else Role.ONE_PROCESS
        ready = setup.prepare(request, role, console=console, held=held, processes=processes, plan=plan)
        if ready is None:
            return None
        return _train(ready, console, processes, started)


def _train(ready: SetUp, console: Console, processes: Processes, started: float) -> RunResult:
    """Everything after the set-up: the model, the guarded training and the output folder."""
    import torch

    if not ready.on_cuda:
        torch.set_flush_denormal(True)  # tiny values in CPU matmuls are 10-100x slower unflushed
    settings = ready.plan.settings
    train_set = examples.cut(ready.encoded, settings.seq_len)
    eval_set = examples.cut(ready.encoded_eval, settings.seq_len)
    if train_set.truncated or train_set.dropped:
        console.print(
            f"seq_len {settings.seq_len}: {train_set.truncated} rows cut, {train_set.dropped} dropped "
            "(no answer token left)"
        )
    if not train_set.input_ids:
        raise DataError(f"no training row has an answer token within seq_len {settings.seq_len}")

    # The model, set up by the code the --exact trace runs too.
    savers.use_allocator_settings(settings, ready.on_cuda)
    model = _load_model(ready.inputs.model_dir, ready.spec, settings, ready.config, ready.on_cuda)
    total, trainable = build.parameter_counts(model)
    console.print(f"model: {ready.spec.name}, {total:,} parameters, {trainable:,} trained ({settings.method})")

    # Everything needed to resume or to reproduce goes to disk before step 1.
    output_dir, start = ready.output_dir, ready.start
    if processes.is_main:
        runfolder.save_run(output_dir, ready.config, ready.plan, ready.fingerprint, start.saved, status="training")
        if start.mode == "resume" and start.checkpoint is not None:
            runfolder.keep_metrics_until(output_dir / METRICS, checkpoints.checkpoint_step(start.checkpoint) or 0)

    # Train, out-of-memory guarded.
    outcome = _train_guarded(ready, model, train_set, eval_set, console, processes)
    if start.mode != "fresh":  # the eval loss before training is the first start's
        outcome = replace(outcome, eval_before=(start.saved or {}).get("eval_before"))

    # The output folder a person uses (rank 0 writes it; sharded weights are gathered by all first).
    state_dict = _gathered_weights(outcome.trainer)
    if not processes.is_main:
        return _result(ready, outcome, eval_set, None, None)
    train_loss, eval_after = _write_outputs(ready, outcome, state_dict, train_set, eval_set, started, console)
    return _result(ready, outcome, eval_set, train_loss, eval_after)


def _result(
    ready: SetUp, outcome: Outcome, eval_set: examples.Encoded, train_loss: float | None, eval_after: float | None
) -> RunResult:
    trainer = outcome.trainer
    return RunResult(
        output_dir=ready.output_dir,
        plan=outcome.plan,
        steps=trainer.state.global_step,
        train_loss=train_loss,
        eval_before=outcome.eval_before,
        eval_after=eval_after,
        model=trainer.model,
        tokenizer=ready.tokenizer,
        eval_conversations=ready.inputs.eval_rows,
        eval_examples=eval_set,
    )


# --- model ----------------------------------------------------------------------------------------------------
def _load_model(
    model_dir: Path, spec: ModelSpec, settings: Settings, config: TrainConfig, on_cuda: bool
) -> PreTrainedModel:
    import torch
    from transformers import set_seed

    set_seed(config.seed)  # the adapters' random init: the same seed gives the same run
    device_map = load_device_map(settings, torch.cuda.current_device() if on_cuda else None)
    try:
        model = build.load_model(
            model_dir,
            settings,
            allow_pickle=config.allow_pickle,
            trust_remote_code=config.trust_remote_code,
            device_map=device_map,
        )
    except TrainError:
        raise
    except Exception as error:  # a corrupt weights file raises the safetensors / torch error types
        detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise TrainError(f"cannot load model from {model_dir}: {detail}") from None
    _one_cpu_weight_format(model)
    return build.checked_prepare(model, spec, settings)


def load_device_map(settings: Settings, gpu: int | None) -> dict[str, int | str] | None:
    """Where from_pretrained puts the weights. A 4/8-bit base is quantised where it is loaded: on this process's
    GPU, or, where FSDP shards it over several (memory.host_loads_the_base), in host memory, so that
    fully_shard moves it to the GPU one layer at a time and no GPU ever holds the whole base. A 16-bit base is
    built in host memory and moved by the Trainer (or the engine). `gpu`: this process's CUDA device, None on
    the CPU."""
    if gpu is None or settings.quant == "none":
        return None
    if memory.host_loads_the_base(settings, memory.stack_runtime(settings)):
        return {"": "cpu"}
    return {"": gpu}


def _one_cpu_weight_format(model: PreTrainedModel) -> None:
    """bitsandbytes repacks a 4-bit layer for its CPU inference kernel the first time the layer runs in eval
    mode, and training then continues on the repacked weights, whose rounding differs. A run that evaluated
    and a resumed one that has not would drift apart, so the trainer keeps the one format it loaded."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


# --- training -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Outcome:
    """What training leaves: the Trainer, the plan it ended with (the guard may have halved the micro-batch) and
    the eval loss before step 1."""

    trainer: Any
    plan: Plan
    eval_before: float | None


def _train_guarded(
    ready: SetUp,
    model: PreTrainedModel,
    train_set: examples.Encoded,
    eval_set: examples.Encoded,
    console: Console,
    processes: Processes,
) -> Outcome:
    """Trainer.train, with the pre-flight before step 1 and the halve-and-continue retry on out-of-memory.
    Several processes agree on the pre-flight's micro-batch; an out-of-memory error mid-run stops them
    (`distributed.out_of_memory`)."""
    import torch
    from transformers import TrainingArguments
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from lorafit.train.trainer import LorafitTrainer, RunCallback, StepWatch, TokenCountingCollator  # torch

    config, plan, tokenizer = ready.config, ready.plan, ready.tokenizer
    output_dir, start, on_cuda = ready.output_dir, ready.start, ready.on_cuda

    train_list = [
        {"input_ids": ids, "labels": labels} for ids, labels in zip(train_set.input_ids, train_set.labels, strict=True)
    ]
    eval_order = sorted(range(len(eval_set.input_ids)), key=lambda i: len(eval_set.input_ids[i]))
    eval_list = [{"input_ids": eval_set.input_ids[i], "labels": eval_set.labels[i]} for i in eval_order]
    lengths = train_set.lengths
    collator = TokenCountingCollator(_collator(tokenizer, plan, on_cuda))
    eval_steps = (config.eval_steps or config.save_steps) if eval_list else None
    watch = StepWatch()
    fault = guard.injected_oom()
    staging = checkpoints.staging_root(output_dir)
    holder: dict[str, Any] = {}

    def make_trainer(settings: Settings) -> LorafitTrainer:
        arguments = TrainingArguments(
            **hf_args.training_kwargs(config, settings, output_dir=str(staging), on_cuda=on_cuda, eval_steps=eval_steps)
        )
        callback = RunCallback(
            output_dir / METRICS,
            console,
            watch,
            lambda: holder["trainer"],
            writes=processes.is_main,
            estimate_s_per_step=planned_seconds_per_step(plan, lengths),  # the plan as the settings now are
        )
        if "callback" in holder:  # a retry: the evaluations timed so far still say how long one takes
            earlier = holder["callback"].timeline
            callback.timeline.eval_seconds, callback.timeline.evals = earlier.eval_seconds, earlier.evals
        trainer = LorafitTrainer(
            model=model,
            args=arguments,
            train_dataset=train_list,
            eval_dataset=eval_list or None,
            data_collator=collator,
            processing_class=tokenizer,
            callbacks=[callback],
            run_dir=output_dir,
            lengths=lengths,
            group_by_length=plan.batching == "length_grouped",
            keep=config.save_total_limit,
            fault=fault,
            watch=watch,
            settings=settings,
        )
        trainer.remove_callback(PrinterCallback)
        trainer.remove_callback(ProgressCallback)
        holder["trainer"], holder["callback"] = trainer, callback
        return trainer

    settings = plan.settings
    resume_from = start.checkpoint
    trainer = make_trainer(settings)
    eval_before = None
    if start.mode == "fresh" and eval_list:
        eval_before = float(trainer.evaluate()["eval_loss"])
        console.print(f"eval loss before training: {eval_before:.4f} ({len(eval_list)} held-out rows)")
        if processes.is_main:
            runfolder.record_eval_before(output_dir, eval_before)
    if on_cuda and (trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled):
        console.print(
            f"pre-flight memory check skipped: with shard {settings.shard} the weights and optimizer states are "
            "split when training starts, after the point where the pre-flight measures"
        )
    elif on_cuda:
        longest = max(train_list, key=lambda row: len(row["input_ids"]))
        checked = guard.preflight(trainer, longest, settings, guard.CudaProbe(config.headroom))
        if processes.several:  # every process takes the smallest micro-batch that fits on all of them
            checked = distributed.agree(checked, settings, processes)
        console.print(
            f"pre-flight: {guard.PREFLIGHT_STEPS} steps at micro-batch {checked.settings.micro_batch} "
            f"x {len(longest['input_ids'])} tokens peaked at {gib(checked.peak_bytes):.2f} GiB of "
            f"{gib(checked.budget_bytes):.2f} GiB (plan: {plan.estimate.peak_reserved_gib:.2f} GiB)"
        )
        if checked.settings != settings:
            settings = checked.settings
            plan = with_settings(plan, settings)
            runfolder.save_plan(output_dir, plan)
            console.print(
                f"pre-flight: micro-batch {settings.micro_batch} x grad-accum {settings.grad_accum} fits; using that"
            )
            trainer = make_trainer(settings)
    else:
        console.print("pre-flight memory check skipped: it measures CUDA memory and this run is on the CPU")
    console.print(time_line(planned_seconds_per_step(plan, lengths), plan.tokens_per_s))

    while True:
        try:
            trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
            return Outcome(trainer, plan, eval_before)
        except Exception as error:
            holder["callback"].close()
            if not guard.is_out_of_memory(error):
                raise
            failed_step = trainer.state.global_step + 1
            if processes.several:
                raise distributed.out_of_memory(failed_step, settings, processes, output_dir) from None
            reduced = guard.smaller(settings)
            if reduced is None:
                raise guard.out_of_memory_at_one(failed_step, settings) from None
            if trainer.state.global_step == 0:
                resume_from = start.checkpoint
                where = "the start" if resume_from is None else resume_from.name
            elif watch.in_optimizer_step:
                resume_from = checkpoints.latest_checkpoint(output_dir)
                where = resume_from.name if resume_from else "the start"
            else:
                resume_from = trainer.save_after_oom()
                where = f"step {trainer.state.global_step}"
            console.print(
                f"[yellow]out of memory in step {failed_step} at micro-batch {settings.micro_batch}[/yellow]: "
                f"continuing from {where} with micro-batch {reduced.micro_batch} x grad-accum "
                f"{reduced.grad_accum} (same effective batch of {reduced.effective_batch})"
            )
            settings = reduced
            plan = with_settings(plan, settings)
            runfolder.save_plan(output_dir, plan)
            trainer.optimizer = None
            del trainer
            gc.collect()
            if on_cuda:
                torch.cuda.empty_cache()
            trainer = make_trainer(settings)


def planned_seconds_per_step(plan: Plan, lengths: list[int]) -> float | None:
    """The plan's time per optimizer step: the tokens of an average step (the effective batch of rows of the
    data's mean length) at the plan's tokens/s; None where the plan has no speed (training on the CPU)."""
    if not plan.tokens_per_s or not lengths:
        return None
    return plan.batch_size * (sum(lengths) / len(lengths)) / plan.tokens_per_s


def time_line(seconds_per_step: float | None, tokens_per_s: float) -> str:
    """The pre-flight's word on time: the plan's estimate until the run has measured its own speed."""
    measured = (
        f"the ETA uses this run's measured speed after {progress.WARMUP_STEPS} steps of warm-up, "
        "and counts the evaluations"
    )
    if seconds_per_step is None:  # the time model covers the catalog's GPUs, not the CPU
        return f"time: no planned speed for this device; {measured}"
    return (
        f"time: {progress.duration(seconds_per_step)} per step by the plan's estimate ({tokens_per_s:,.0f} tok/s, "
        f"all tokens); {measured}"
    )


def _gathered_weights(trainer: Any) -> dict[str, Any] | None:
    """Under FSDP or DeepSpeed each process holds a shard of the weights (ZeRO-2: of the optimizer): every
    process joins in gathering the whole state dict, which rank 0 saves. None: the model holds whole weights."""
    if not (trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled):
        return None
    return trainer.accelerator.get_state_dict(trainer.deepspeed if trainer.is_deepspeed_enabled else trainer.model)


def _collator(tokenizer: PreTrainedTokenizerBase, plan: Plan, on_cuda: bool) -> Any:
    from transformers import DataCollatorForSeq2Seq, DataCollatorWithFlattening

    if plan.batching == "padding_free":
        return DataCollatorWithFlattening(return_flash_attn_kwargs=plan.settings.attn == "flash")
    return DataCollatorForSeq2Seq(
        tokenizer,
        padding="longest",
        label_pad_token_id=examples.IGNORE_INDEX,
        pad_to_multiple_of=8 if on_cuda else None,
        return_tensors="pt",
    )


# --- outputs --------------------------------------------------------------------------------------------------
def _write_outputs(
    ready: SetUp,
    outcome: Outcome,
    state_dict: dict[str, Any] | None,
    train_set: examples.Encoded,
    eval_set: examples.Encoded,
    started: float,
    console: Console,
) -> tuple[float | None, float | None]:
    """The adapter (or model), tokenizer, loss curve, model card and the run file marked finished; returns the
    final train and eval losses. `state_dict`: the weights several processes held in shards, gathered."""
    config, plan, trainer, eval_before = ready.config, outcome.plan, outcome.trainer, outcome.eval_before
    output_dir, model_dir, data_path = ready.output_dir, ready.inputs.model_dir, ready.inputs.data_path
    runfolder.drop_empty_staging(output_dir)
    metrics = report.read_metrics(output_dir / METRICS)
    losses = [record["loss"] for record in metrics if "loss" in record]
    evals = [record["eval_loss"] for record in metrics if "eval_loss" in record]
    train_loss = losses[-1] if losses else None
    eval_after = evals[-1] if evals else None
    if state_dict is None:
        trainer.model.save_pretrained(output_dir)
    else:  # the weights several processes held in shards, gathered
        trainer.model.save_pretrained(output_dir, state_dict=state_dict)
    ready.tokenizer.save_pretrained(output_dir)
    ordinary_mode(output_dir)
    if config.method != "full":
        runfolder.point_adapter_at(output_dir, model_dir)
    seconds = time.perf_counter() - started
    speeds = [record for record in metrics if "tokens_per_s" in record]
    last_speed = speeds[-1] if speeds else {}
    speed = progress.Speed(
        last_speed.get("tokens_per_s_all", last_speed.get("tokens_per_s", 0.0)),
        last_speed.get("tokens_per_s_trained", 0.0),
    )
    report.plot_loss(
        metrics, output_dir / "loss.png", f"{output_dir.name}: {plan.model.name}, {config.method}", eval_before
    )
    finished = report.Finished(
        output_dir=output_dir,
        base_model=str(model_dir),
        data=str(data_path),
        rows=len(train_set.input_ids),
        eval_rows=len(eval_set.input_ids),
        steps=trainer.state.global_step,
        seconds=seconds,
        speed=speed,
        train_loss=train_loss,
        eval_before=eval_before,
        eval_after=eval_after,
    )
    card = report.model_card(finished, plan)
    write_atomic(output_dir / "README.md", card)
    fingerprint = (runfolder.read_run_file(output_dir) or {}).get("fingerprint", {})
    runfolder.save_run(
        output_dir,
        config,
        plan,
        fingerprint,
        {"eval_before": eval_before},
        status="finished",
        steps=trainer.state.global_step,
        train_loss=train_loss,
        eval_after=eval_after,
    )
    before = f"{eval_before:.4f} -> " if eval_before is not None else ""
    after = f", eval loss {before}{eval_after:.4f}" if eval_after is not None else ""
    loss_text = f", final loss {train_loss:.4f}" if train_loss is not None else ""
    console.print(f"[green]done[/green]: {trainer.state.global_step} steps in {seconds:.0f} s{loss_text}{after}")
    console.print(f"wrote {output_dir}: adapter/model, tokenizer, metrics.jsonl, loss.png, plan.json, README.md")
    return train_loss, eval_after
