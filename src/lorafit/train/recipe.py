"""`lorafit train`, the recipe: config -> plan -> data -> model -> guarded Trainer -> the output folder.

Read top to bottom it is the whole run. The components it calls: `lorafit.data` (loaders and checks),
`lorafit.plan` / `lorafit.memory` (settings), `build` (model set-up shared with the trace), `examples`
(templates and answer masks), `trainer` (the Trainer with atomic checkpoints), `guard` (out-of-memory),
`checkpoints` (the run folder), `report` (loss curve and model card).
"""

from __future__ import annotations

import contextlib
import gc
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from rich.console import Console

from lorafit import memory
from lorafit.errors import DataError, InvalidConfig, TrainError
from lorafit.files import ordinary_mode, write_atomic
from lorafit.schema import Plan, Settings
from lorafit.train import checkpoints, examples, report
from lorafit.train.config import TrainConfig, check_batch_fits
from lorafit.units import gib

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from lorafit.hardware import GpuSpec
    from lorafit.models import ModelSpec
    from lorafit.schema import TokenProfile
    from lorafit.train.distributed import Processes

METRICS = "metrics.jsonl"


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


@checkpoints.one_line_run_errors
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
    `processes`: this process among several (`distributed.main`): rank 0 alone writes the run folder, and its
    decisions are every process's. `plan`: the launcher's plan, used instead of planning again."""
    from lorafit.train import distributed

    console = console or Console(highlight=False)
    processes = processes or distributed.ONE_PROCESS
    started = time.perf_counter()
    if dry_run:
        return _dry_run(config, resume=resume, overwrite=overwrite, console=console, build_model=build_model)

    # 1. Inputs that can be checked without torch: fail in a second, not after loading a model.
    model_dir, data_path, eval_path = _inputs(config, check_model=build_model is None)
    train_rows, eval_rows, data_format = _load_data(config, data_path, eval_path)

    # 2. The output folder: a fresh run, the same run again (resume), or another run (refuse).
    output_dir = Path(config.output_dir).expanduser()
    fingerprint = _fingerprint(config, model_dir, data_path, eval_path)
    start = _open_folder(
        config,
        output_dir,
        fingerprint,
        model_dir,
        data_path,
        eval_path,
        resume,
        overwrite,
        build_model,
        processes,
        console,
    )
    if start.mode == "finished":
        return None
    metrics_path = output_dir / METRICS
    spec = _model_spec(model_dir)

    # 3. Libraries, device, tokenizer, data.
    _quiet_libraries()
    import torch

    on_cuda = torch.cuda.is_available()
    if not on_cuda:
        torch.set_flush_denormal(True)  # tiny values in CPU matmuls are 10-100x slower unflushed
    tokenizer, encoded, encoded_eval, profile = _tokenized(
        config, model_dir, train_rows, eval_rows, data_format, data_path, console
    )

    # 4. Settings: the plan for this device, the user's settings pinned; a resumed run keeps its own. With
    # several processes rank 0's plan (the launcher's) is every process's.
    if processes.is_main:
        saved_plan = plan or (_saved_plan(output_dir) if start.mode == "resume" else None)
        plan = resolve_plan(
            config, spec, profile, encoded.lengths, saved_plan=saved_plan, on_cuda=on_cuda, console=console
        )
        plan = for_processes(plan, config, on_cuda)
        if saved_plan is not None and not processes.launched and start.checkpoint is not None:
            distributed.check_resume(saved_plan.settings, plan.settings, start.checkpoint)
    plan = _same_plan_everywhere(processes.broadcast(plan), plan)
    settings = plan.settings
    _check_device(settings, on_cuda, spec, launched=processes.launched)
    if not processes.launched:  # the launcher showed it
        from lorafit.render import show_plan

        show_plan(plan, console)
    train_set = examples.cut(encoded, settings.seq_len)
    eval_set = examples.cut(encoded_eval, settings.seq_len)
    if train_set.truncated or train_set.dropped:
        console.print(
            f"seq_len {settings.seq_len}: {train_set.truncated} rows cut, {train_set.dropped} dropped "
            "(no answer token left)"
        )
    if not train_set.input_ids:
        raise DataError(f"no training row has an answer token within seq_len {settings.seq_len}")

    # 5. The model, set up by the code the --exact trace runs too.
    from lorafit.train import build, savers

    build.check_settings(spec, settings)
    savers.use_allocator_settings(settings, on_cuda)
    model = _load_model(model_dir, spec, settings, config, on_cuda)
    total, trainable = build.parameter_counts(model)
    console.print(f"model: {spec.name}, {total:,} parameters, {trainable:,} trained ({settings.method})")

    # 6. Everything needed to resume or to reproduce goes to disk before step 1.
    if processes.is_main:
        _save_run(output_dir, config, plan, fingerprint, start.saved, status="training")
        if start.mode == "resume" and start.checkpoint is not None:
            checkpoints.keep_metrics_until(metrics_path, checkpoints.checkpoint_step(start.checkpoint) or 0)

    # 7. Train, out-of-memory guarded.
    outcome = _train_guarded(
        config, spec, plan, model, tokenizer, train_set, eval_set, output_dir, start, on_cuda, console, processes
    )
    plan, trainer = outcome.plan, outcome.trainer
    settings = plan.settings

    # 8. The output folder a person uses (rank 0 writes it; sharded weights are gathered by all first).
    eval_before = outcome.eval_before if start.mode == "fresh" else (start.saved or {}).get("eval_before")
    state_dict = _gathered_weights(trainer)
    if not processes.is_main:
        return RunResult(
            output_dir,
            plan,
            trainer.state.global_step,
            None,
            eval_before,
            None,
            trainer.model,
            tokenizer,
            eval_rows,
            eval_set,
        )
    result = _write_outputs(
        config,
        plan,
        trainer,
        model,
        tokenizer,
        model_dir,
        data_path,
        output_dir,
        len(train_set.input_ids),
        len(eval_set.input_ids),
        eval_before,
        started,
        console,
        state_dict,
    )
    return RunResult(
        output_dir,
        plan,
        trainer.state.global_step,
        result["train_loss"],
        eval_before,
        result["eval_after"],
        trainer.model,
        tokenizer,
        eval_rows,
        eval_set,
    )


def _dry_run(
    config: TrainConfig,
    *,
    resume: bool,
    overwrite: bool,
    console: Console,
    build_model: Callable[[Path], None] | None,
) -> None:
    """What `run` checks and decides before it loads the model, with nothing written: the inputs, the output
    folder (fresh, resumed or refused), the tokenized data, the plan for this device and the resolved config."""
    import tempfile

    from lorafit.render import show_plan
    from lorafit.train import build

    model_dir, data_path, eval_path = _inputs(config, check_model=build_model is None)
    train_rows, eval_rows, data_format = _load_data(config, data_path, eval_path)
    output_dir = Path(config.output_dir).expanduser()
    fingerprint = _fingerprint(config, model_dir, data_path, eval_path)
    inputs = _reads(model_dir, data_path, eval_path, built=build_model is not None)
    start = checkpoints.begin(output_dir, fingerprint, resume=resume, overwrite=overwrite, inputs=inputs, dry_run=True)
    if start.mode == "finished":
        console.print(f"dry run: {start.note}")
        return None
    checkpoints.check_writable(output_dir)
    _quiet_libraries()
    import torch

    with tempfile.TemporaryDirectory(prefix="lorafit-dry-run-") as scratch:
        if build_model is not None:
            model_dir = Path(scratch) / model_dir.name  # the demo's base model, built where nothing stays
            build_model(model_dir)
        _check_model(model_dir, config)
        spec = _model_spec(model_dir)
        _, encoded, _, profile = _tokenized(config, model_dir, train_rows, eval_rows, data_format, data_path, console)
    saved_plan = _saved_plan(output_dir) if start.mode == "resume" else None
    plan = resolve_plan(
        config,
        spec,
        profile,
        encoded.lengths,
        saved_plan=saved_plan,
        on_cuda=torch.cuda.is_available(),
        console=console,
    )
    on_cuda = torch.cuda.is_available()
    asked = plan.settings
    plan = for_processes(plan, config, on_cuda)
    _check_device(plan.settings, plan.device == "cuda", spec, launched=True)
    build.check_settings(spec, plan.settings)
    show_plan(plan, console)
    console.print("resolved config (`lorafit train` would run exactly this):")
    console.print(yaml.safe_dump(resolved_config(config, plan).model_dump(mode="json"), sort_keys=False), end="")
    if config.n_gpus * config.nodes > 1:
        from lorafit.train import distributed

        topology = distributed.Topology.of(config, on_cuda)
        if not on_cuda:
            console.print(distributed.cpu_note(asked, topology))
        console.print(f"accelerate config (`lorafit train` would write it to {output_dir}):")
        console.print(distributed.describe(plan.settings, config, topology), end="", markup=False)
    what = start.note or ("resume" if start.mode == "resume" else f"a fresh run in {output_dir}")
    console.print(f"dry run: {what}; nothing was written")


@dataclass(frozen=True)
class Prepared:
    """What a launch of several processes starts from: the run folder opened and the plan made."""

    output_dir: Path
    mode: str  # fresh or resume
    plan: Plan  # as the processes run it (`for_processes`)
    asked: Settings  # the plan's settings before that (what a CPU run says it does not apply)


@checkpoints.one_line_run_errors
def prepare_launch(
    config: TrainConfig,
    *,
    resume: bool,
    overwrite: bool,
    console: Console,
    build_model: Callable[[Path], None] | None,
    writes: bool = True,
) -> Prepared | None:
    """`run` up to the plan, for `distributed.launch`: the inputs checked, the folder opened as `run` opens it
    (None: it holds this run finished), the data tokenized and the plan made and shown; no model is loaded.
    `writes` False (a node other than 0): the run folder is only read."""
    model_dir, data_path, eval_path = _inputs(config, check_model=build_model is None)
    train_rows, eval_rows, data_format = _load_data(config, data_path, eval_path)
    output_dir = Path(config.output_dir).expanduser()
    fingerprint = _fingerprint(config, model_dir, data_path, eval_path)
    inputs = _reads(model_dir, data_path, eval_path, built=build_model is not None)
    start = checkpoints.begin(
        output_dir, fingerprint, resume=resume, overwrite=overwrite, inputs=inputs, dry_run=not writes
    )
    if start.note:
        console.print(start.note)
    if start.mode == "finished":
        return None
    if writes:
        _set_up_folder(output_dir, fingerprint, start, model_dir, config, build_model)
    elif build_model is not None:
        build_model(model_dir)  # an input of this node's processes
    spec = _model_spec(model_dir)
    _quiet_libraries()
    import torch

    from lorafit.render import show_plan
    from lorafit.train import build

    on_cuda = torch.cuda.is_available()
    _, encoded, _, profile = _tokenized(config, model_dir, train_rows, eval_rows, data_format, data_path, console)
    saved_plan = _saved_plan(output_dir) if start.mode == "resume" else None
    plan = resolve_plan(config, spec, profile, encoded.lengths, saved_plan=saved_plan, on_cuda=on_cuda, console=console)
    asked = plan.settings
    plan = for_processes(plan, config, on_cuda)
    if saved_plan is not None and start.checkpoint is not None:
        from lorafit.train import distributed

        distributed.check_resume(saved_plan.settings, plan.settings, start.checkpoint)
    _check_device(plan.settings, on_cuda, spec, launched=True)
    build.check_settings(spec, plan.settings)
    show_plan(plan, console)
    return Prepared(output_dir, start.mode, plan, asked)


def _open_folder(
    config: TrainConfig,
    output_dir: Path,
    fingerprint: dict[str, Any],
    model_dir: Path,
    data_path: Path,
    eval_path: Path | None,
    resume: bool,
    overwrite: bool,
    build_model: Callable[[Path], None] | None,
    processes: Processes,
    console: Console,
) -> checkpoints.RunStart:
    """Fresh, resumed or finished: rank 0 decides and sets the folder up, the other processes take its decision."""
    start = None
    if processes.is_main:
        inputs = _reads(model_dir, data_path, eval_path, built=build_model is not None)
        start = checkpoints.begin(output_dir, fingerprint, resume=resume, overwrite=overwrite, inputs=inputs)
        if start.note and not processes.launched:  # a launched run: the launcher said it
            console.print(start.note)
        if start.mode != "finished":
            _set_up_folder(output_dir, fingerprint, start, model_dir, config, build_model)
    start = processes.broadcast(start)
    if start.mode != "finished" and build_model is not None and not processes.is_main:
        _check_model(model_dir, config)  # built by rank 0
    return start


def _set_up_folder(
    output_dir: Path,
    fingerprint: dict[str, Any],
    start: checkpoints.RunStart,
    model_dir: Path,
    config: TrainConfig,
    build_model: Callable[[Path], None] | None,
) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    if start.mode == "fresh":
        (output_dir / METRICS).unlink(missing_ok=True)
        checkpoints.write_run_file(output_dir, {"fingerprint": fingerprint, "status": "started"})
    if build_model is not None:
        _quiet_libraries()
        build_model(model_dir)
        _check_model(model_dir, config)
    if start.mode == "fresh":  # what the adapter is trained against: `lorafit export` refuses another base
        saved = checkpoints.read_run_file(output_dir) or {}
        checkpoints.write_run_file(output_dir, saved | {"base_digest": checkpoints.model_digest(model_dir)})


# --- inputs -------------------------------------------------------------------------------------------------
def _inputs(config: TrainConfig, *, check_model: bool) -> tuple[Path, Path, Path | None]:
    """The model directory and data files, checked without torch: fail in a second, not after loading."""
    if config.model is None:
        raise InvalidConfig("no model: set `model:` in the config or pass --model DIR (a local model directory)")
    if config.data is None:
        raise InvalidConfig("no data: set `data:` in the config or pass --data FILE")
    model_dir = Path(config.model).expanduser().resolve()
    data_path = Path(config.data).expanduser()
    eval_path = Path(config.eval_data).expanduser() if config.eval_data else None
    for path in (data_path, eval_path):
        if path is not None and not path.exists():
            raise DataError(f"no dataset at {path}")
    if check_model:
        from lorafit import options

        _check_model(model_dir, config)
        # what the model alone rules out (its positions, tied embeddings, attention kernels), before any write
        options.check_against(config.pinned_settings(), _model_spec(model_dir))
    return model_dir, data_path, eval_path


def _fingerprint(config: TrainConfig, model_dir: Path, data_path: Path, eval_path: Path | None) -> dict[str, Any]:
    from lorafit.train.distributed import LAUNCH_KEYS

    data_files = [data_path] + ([eval_path] if eval_path else [])
    same_run = {key: value for key, value in config.fingerprint().items() if key not in LAUNCH_KEYS}
    return same_run | {"model": str(model_dir), "data_sha256": checkpoints.data_digest(data_files)}


def _reads(model_dir: Path, data_path: Path, eval_path: Path | None, *, built: bool) -> tuple[Path, ...]:
    """What the run reads, which --overwrite must never delete (the demo's base is rebuilt, so not that)."""
    return tuple(path for path in (data_path, eval_path, None if built else model_dir) if path is not None)


def _tokenized(
    config: TrainConfig,
    model_dir: Path,
    train_rows: list[list[dict[str, Any]]],
    eval_rows: list[list[dict[str, Any]]],
    data_format: str | None,
    data_path: Path,
    console: Console,
) -> tuple[PreTrainedTokenizerBase, examples.Encoded, examples.Encoded, TokenProfile]:
    """The model's tokenizer (with a chat template and a pad token) and the data encoded with it."""
    tokenizer = _load_tokenizer(model_dir, config)
    if examples.ensure_chat_template(tokenizer):
        console.print("the tokenizer has no chat template: using 'role: content' turns (saved with the adapter)")
    examples.ensure_pad_token(tokenizer)
    raw_text = data_format == "text"
    encoded = examples.encode(train_rows, tokenizer, raw_text=raw_text, train_on_prompt=config.train_on_prompt)
    encoded_eval = examples.encode(eval_rows, tokenizer, raw_text=raw_text, train_on_prompt=config.train_on_prompt)
    return tokenizer, encoded, encoded_eval, examples.token_profile(encoded, str(data_path), model_dir.name)


def _check_model(model_dir: Path, config: TrainConfig) -> None:
    from lorafit.train.build import check_model_dir

    if not model_dir.is_dir():
        raise TrainError(f"no model directory {model_dir}; pass a local Hugging Face model directory")
    check_model_dir(model_dir, allow_pickle=config.allow_pickle)


def _model_spec(model_dir: Path) -> ModelSpec:
    from lorafit.models import from_config_json

    return from_config_json(model_dir, name=model_dir.name)


def _quiet_libraries() -> None:
    """Our own progress bar and messages only (the one place is `build.quiet_libraries`, shared with --exact)."""
    from lorafit.train.build import quiet_libraries

    quiet_libraries()


def _load_tokenizer(model_dir: Path, config: TrainConfig) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(
            model_dir, local_files_only=True, trust_remote_code=config.trust_remote_code
        )
    except (OSError, ValueError, TypeError) as error:
        raise TrainError(f"cannot load the tokenizer from {model_dir}: {str(error).splitlines()[0]}") from None


def _load_data(
    config: TrainConfig, data_path: Path, eval_path: Path | None
) -> tuple[list[list[dict[str, Any]]], list[list[dict[str, Any]]], str | None]:
    """Train and eval conversations: the eval file, or a seeded share of the data held out."""
    from lorafit.data import load_conversations

    rows = load_conversations(data_path, config.data_format, config.data_mapping or None)
    if eval_path is not None:
        eval_rows = load_conversations(eval_path, config.data_format, config.data_mapping or None)
        check_batch_fits(config, len(rows))
        return list(rows), list(eval_rows), rows.format
    count = int(config.eval_split) if config.eval_split >= 1 else round(len(rows) * config.eval_split)
    if count >= len(rows) and config.eval_split:
        raise DataError(
            f"eval_split {config.eval_split:g} holds out {count} of the data's {len(rows)} rows, leaving none to "
            "train on; use a share below 1 or fewer rows"
        )
    count = min(max(count, 1), len(rows) - 1) if config.eval_split and len(rows) >= 2 else 0
    order = list(range(len(rows)))
    random.Random(config.seed).shuffle(order)
    held = set(order[:count])
    train = [row for index, row in enumerate(rows) if index not in held]
    held_out = [row for index, row in enumerate(rows) if index in held]
    check_batch_fits(config, len(train))
    return train, held_out, rows.format


# --- settings -------------------------------------------------------------------------------------------------
def resolve_plan(
    config: TrainConfig,
    spec: ModelSpec,
    profile: TokenProfile,
    lengths: list[int],
    *,
    saved_plan: Plan | None,
    on_cuda: bool,
    console: Console,
    gpu: GpuSpec | None = None,
) -> Plan:
    """The settings this run uses, as a Plan. Fresh: `lorafit plan` for the detected device with the user's
    settings pinned, every automatic choice (device, GPU, precision, batching) made there and recorded. Resumed:
    the run's saved plan. Where a setting then differs from the plan's (a user override), the memory is
    estimated again by the planner (`plan.with_settings`)."""
    from lorafit import hardware, options
    from lorafit.plan import make_plan, resolve_seq_len, with_settings
    from lorafit.schema import PlanRequest

    pinned = config.pinned_settings()
    device = "cuda" if on_cuda else "cpu"
    gpu = gpu if gpu is not None else (hardware.detected_gpu() if on_cuda else None)
    if saved_plan is not None:  # (a fresh plan checks the pinned settings itself)
        options.check_against(pinned, spec, gpu, on_cpu=not on_cuda)
        plan = saved_plan
    else:
        fixed = pinned | {"method": config.method, "seq_len": config.seq_len}
        if config.n_gpus > 1 and config.nodes == 1:
            # train picks no shard for one machine's GPUs: the step is searched unsharded (the user's shard is applied
            # to the chosen one below), or for an offload under the user's shard or ZeRO-3
            fixed["shard"] = pinned.get("shard", "zero3") if config.offload != "none" else "none"
        request = PlanRequest(
            model=spec,
            gpu=gpu,
            device=device,
            fixed=Settings.given(fixed),
            batch_size=config.effective_batch_size,
            tokens=profile,
            epochs=config.epochs,
            headroom=config.headroom,
            batching=config.batching,
            host_ram_gib=hardware.available_ram_gib() if on_cuda else None,
        )
        seq_len = resolve_seq_len(request)
        plan = make_plan(request, truncated_rows=sum(1 for length in lengths if length > seq_len))
    chosen = plan.settings.model_dump() | pinned | {"method": config.method}
    if "shard" not in pinned and chosen["n_gpus"] * chosen["nodes"] == 1 and chosen["offload"] == "none":
        chosen["shard"] = "none"  # a run resumed on one GPU after several: nothing left to shard
    return with_settings(plan, Settings.model_validate(chosen))


def _check_device(settings: Settings, on_cuda: bool, spec: ModelSpec, *, launched: bool = False) -> None:
    """What this machine cannot run: offloads that the free host RAM cannot hold, or several GPUs in one process
    (`lorafit train` starts the processes: `distributed.launch`)."""
    if on_cuda:
        from lorafit import hardware

        problem = memory.host_saver_problem(spec, settings, hardware.available_ram_gib())
        if problem:
            raise TrainError(problem)
    if settings.n_gpus * settings.nodes > 1 and not launched:
        raise TrainError(
            f"recipe.run trains in this process; n_gpus {settings.n_gpus} x nodes {settings.nodes} is started by "
            "`lorafit train` (lorafit.train.distributed.launch)"
        )


def for_processes(plan: Plan, config: TrainConfig, on_cuda: bool) -> Plan:
    """The plan as several processes run it: on the CPU data-parallel with nothing offloaded; over several nodes
    with an accumulation every node can share (`distributed.split_over_nodes`). One process: the plan as it is."""
    if config.n_gpus * config.nodes == 1:
        return plan
    from lorafit.plan import with_settings
    from lorafit.train import distributed

    settings = plan.settings
    if not on_cuda:
        settings = distributed.cpu_settings(settings)
    settings = distributed.split_over_nodes(settings, config.nodes)
    distributed.check_offload(settings)
    return with_settings(plan, settings)


def _same_plan_everywhere(main_plan: Plan, own: Plan | None) -> Plan:
    """Rank 0's plan, refused where this node's launcher wrote its accelerate config for other settings."""
    if own is None or own is main_plan:
        return main_plan
    keys = ("shard", "offload", "precision", "micro_batch", "grad_accum")
    differ = [key for key in keys if getattr(own.settings, key) != getattr(main_plan.settings, key)]
    if differ:
        shown = ", ".join(
            f"{key} {getattr(own.settings, key)} (node 0: {getattr(main_plan.settings, key)})" for key in differ
        )
        raise TrainError(
            f"this node planned other settings than node 0: {shown}; pin them (--{differ[0].replace('_', '-')} "
            f"{getattr(main_plan.settings, differ[0])}) and run the same command on every node"
        )
    return main_plan


def _saved_plan(output_dir: Path) -> Plan | None:
    path = output_dir / "plan.json"
    return Plan.load(path) if path.is_file() else None


# --- model ----------------------------------------------------------------------------------------------------
def _load_model(
    model_dir: Path, spec: ModelSpec, settings: Settings, config: TrainConfig, on_cuda: bool
) -> PreTrainedModel:
    import torch
    from transformers import set_seed

    from lorafit.train import build

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
@dataclass
class Outcome:
    trainer: Any
    plan: Plan
    eval_before: float | None


def _train_guarded(
    config: TrainConfig,
    spec: ModelSpec,
    plan: Plan,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    train_set: examples.Encoded,
    eval_set: examples.Encoded,
    output_dir: Path,
    start: checkpoints.RunStart,
    on_cuda: bool,
    console: Console,
    processes: Processes,
) -> Outcome:
    """Trainer.train, with the pre-flight before step 1 and the halve-and-continue retry on out-of-memory.
    Several processes agree on the pre-flight's micro-batch; an out-of-memory error mid-run stops them
    (`distributed.out_of_memory`)."""
    import torch
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from lorafit.plan import with_settings
    from lorafit.train import guard
    from lorafit.train.trainer import LorafitTrainer, RunCallback, StepWatch, TokenCountingCollator

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
        from transformers import TrainingArguments

        from lorafit.train import hf_args

        arguments = TrainingArguments(
            **hf_args.training_kwargs(config, settings, output_dir=str(staging), on_cuda=on_cuda, eval_steps=eval_steps)
        )
        callback = RunCallback(
            output_dir / METRICS, console, watch, lambda: holder["trainer"], writes=processes.is_main
        )
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
            saved = checkpoints.read_run_file(output_dir) or {}
            checkpoints.write_run_file(output_dir, saved | {"eval_before": eval_before})
    if on_cuda and (trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled):
        console.print(
            f"pre-flight memory check skipped: with shard {settings.shard} the weights and optimizer states are "
            "split when training starts, after the point where the pre-flight measures"
        )
    elif on_cuda:
        longest = max(train_list, key=lambda row: len(row["input_ids"]))
        checked = guard.preflight(trainer, longest, settings, guard.CudaProbe(config.headroom))
        if processes.several:  # every process takes the smallest micro-batch that fits on all of them
            from lorafit.train import distributed

            checked = distributed.agree(checked, settings, processes)
        console.print(
            f"pre-flight: {guard.PREFLIGHT_STEPS} steps at micro-batch {checked.settings.micro_batch} "
            f"x {len(longest['input_ids'])} tokens peaked at {gib(checked.peak_bytes):.2f} GiB of "
            f"{gib(checked.budget_bytes):.2f} GiB (plan: {plan.estimate.peak_reserved_gib:.2f} GiB)"
        )
        if checked.settings != settings:
            settings = checked.settings
            plan = with_settings(plan, settings)
            _save_plan(output_dir, plan)
            console.print(
                f"pre-flight: micro-batch {settings.micro_batch} x grad-accum {settings.grad_accum} fits; using that"
            )
            trainer = make_trainer(settings)
    else:
        console.print("pre-flight memory check skipped: it measures CUDA memory and this run is on the CPU")

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
                from lorafit.train import distributed

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
            _save_plan(output_dir, plan)
            trainer.optimizer = None
            del trainer
            gc.collect()
            if on_cuda:
                torch.cuda.empty_cache()
            trainer = make_trainer(settings)


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
def _save_plan(output_dir: Path, plan: Plan) -> None:
    write_atomic(output_dir / "plan.json", plan.to_json())
    write_atomic(output_dir / "plan.yaml", plan.to_yaml())


def resolved_config(config: TrainConfig, plan: Plan) -> TrainConfig:
    """The config with every setting filled in from the plan: rerunning it needs no planning."""
    from lorafit.train.config import SETTINGS_KEYS

    settings = plan.settings.model_dump()
    return config.model_copy(update={key: settings[key] for key in SETTINGS_KEYS} | {"batch_size": plan.batch_size})


def _save_run(
    output_dir: Path,
    config: TrainConfig,
    plan: Plan,
    fingerprint: dict[str, Any],
    saved: dict[str, Any] | None,
    status: str,
    **extra: Any,
) -> None:
    _save_plan(output_dir, plan)
    resolved = resolved_config(config, plan).model_dump(mode="json")
    write_atomic(output_dir / "config.yaml", yaml.safe_dump(resolved, sort_keys=False))
    current = checkpoints.read_run_file(output_dir) or saved or {}
    kept = {key: value for key, value in current.items() if key in ("eval_before", "base_digest")}
    checkpoints.write_run_file(output_dir, kept | {"fingerprint": fingerprint, "status": status} | extra)


def _write_outputs(
    config: TrainConfig,
    plan: Plan,
    trainer: Any,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    model_dir: Path,
    data_path: Path,
    output_dir: Path,
    rows: int,
    eval_rows: int,
    eval_before: float | None,
    started: float,
    console: Console,
    state_dict: dict[str, Any] | None = None,
) -> dict[str, Any]:
    with contextlib.suppress(OSError):
        checkpoints.staging_root(output_dir).rmdir()  # empty once every checkpoint is published
    metrics = report.read_metrics(output_dir / METRICS)
    losses = [record["loss"] for record in metrics if "loss" in record]
    evals = [record["eval_loss"] for record in metrics if "eval_loss" in record]
    train_loss = losses[-1] if losses else None
    eval_after = evals[-1] if evals else None
    if state_dict is None:
        trainer.model.save_pretrained(output_dir)
    else:  # the weights several processes held in shards, gathered
        trainer.model.save_pretrained(output_dir, state_dict=state_dict)
    tokenizer.save_pretrained(output_dir)
    ordinary_mode(output_dir)
    if config.method != "full":
        _point_adapter_at(output_dir, model_dir)
    seconds = time.perf_counter() - started
    speeds = [record["tokens_per_s"] for record in metrics if "tokens_per_s" in record]
    tokens_per_s = speeds[-1] if speeds else 0.0
    report.plot_loss(
        metrics, output_dir / "loss.png", f"{output_dir.name}: {plan.model.name}, {config.method}", eval_before
    )
    card = report.model_card(
        run_name=str(output_dir),
        base_model=str(model_dir),
        method=config.method,
        plan=plan,
        data=str(data_path),
        rows=rows,
        eval_rows=eval_rows,
        steps=trainer.state.global_step,
        train_loss=train_loss,
        eval_before=eval_before,
        eval_after=eval_after,
        seconds=seconds,
        tokens_per_s=tokens_per_s,
    )
    write_atomic(output_dir / "README.md", card)
    fingerprint = (checkpoints.read_run_file(output_dir) or {}).get("fingerprint", {})
    _save_run(
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
    return {"train_loss": train_loss, "eval_after": eval_after}


def _point_adapter_at(output_dir: Path, model_dir: Path) -> None:
    """adapter_config.json names the base by absolute path, so PeftModel.from_pretrained finds it anywhere."""
    import json

    path = output_dir / "adapter_config.json"
    data = json.loads(path.read_text())
    data["base_model_name_or_path"] = str(model_dir)
    write_atomic(path, json.dumps(data, indent=2, sort_keys=True))
