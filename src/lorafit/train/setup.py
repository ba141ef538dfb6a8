"""The one set-up of a run: the inputs checked, the run folder opened, the data tokenized and the plan made.

Every way a run starts goes through `prepare`: `recipe.run` in one process, the launcher of several processes
(`launch.launch`), each process it starts (`worker`), and `--dry-run`. Its `Role` says what differs: who
holds and writes the run folder, who shows the plan, and where the plan comes from. `prepare` stops before the
model is loaded: what follows (model, training, outputs) is `recipe.run`'s.
"""

from __future__ import annotations

import contextlib
import enum
import random
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from rich.console import Console

from lorafit import hardware, memory, options
from lorafit.data import load_conversations
from lorafit.data.chat_text import ensure_chat_template
from lorafit.errors import DataError, InvalidConfig, TrainError
from lorafit.models import ModelSpec, from_config_json
from lorafit.plan import make_plan, resolve_seq_len, with_settings
from lorafit.render import show_plan
from lorafit.schema import Device, Plan, PlanRequest, Settings
from lorafit.train import build, distributed, examples, runfolder
from lorafit.train.config import TrainConfig, check_batch_fits
from lorafit.train.distributed import ONE_PROCESS, Processes, Topology

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from lorafit.hardware import GpuSpec
    from lorafit.schema import TokenProfile

Rows = list[list[dict[str, Any]]]  # conversations, each a list of messages


class Role(enum.Enum):
    """Where `prepare` runs."""

    ONE_PROCESS = "one process"  # `recipe.run`: holds and writes the folder, plans, shows the plan, trains here
    LAUNCHER = "launcher"  # node 0's `lorafit train --n-gpus N`: holds and writes the folder, plans, shows it
    OTHER_NODE = "other node"  # the launcher on a node other than 0: reads the folder (node 0 writes it)
    WORKER = "worker"  # a launched process: rank 0 writes the folder; the launcher's plan, shown by it
    DRY_RUN = "dry run"  # decides everything, writes nothing

    @property
    def writes(self) -> bool:
        """Whether this role sets the run folder up (among workers, rank 0 alone)."""
        return self in (Role.ONE_PROCESS, Role.LAUNCHER, Role.WORKER)

    @property
    def holds(self) -> bool:
        """Whether this role holds the folder's lock: the process that lives as long as the run (a worker's
        launcher holds it for the workers)."""
        return self in (Role.ONE_PROCESS, Role.LAUNCHER)


@dataclass(frozen=True)
class RunRequest:
    """What a run is asked to do: the config and the switches of `lorafit train`."""

    config: TrainConfig
    resume: bool = False
    overwrite: bool = False
    build_model: Callable[[Path], None] | None = None  # the demo: builds (or completes) its base model first

    @property
    def output_dir(self) -> Path:
        return Path(self.config.output_dir).expanduser()


@dataclass(frozen=True)
class Inputs:
    """What the run reads: the model folder, the data files, and their conversations split into train and eval."""

    model_dir: Path
    data_path: Path
    eval_path: Path | None
    train_rows: Rows
    eval_rows: Rows
    data_format: str | None


@dataclass(frozen=True)
class SetUp:
    """A run ready to load its model: what `prepare` checked, opened, tokenized and decided."""

    request: RunRequest
    inputs: Inputs
    fingerprint: dict[str, Any]
    start: runfolder.RunStart
    spec: ModelSpec
    tokenizer: PreTrainedTokenizerBase
    encoded: examples.Encoded
    encoded_eval: examples.Encoded
    plan: Plan  # as the processes run it (`for_processes`)
    asked: Settings  # the plan's settings before that (what a CPU launch says it does not apply)
    on_cuda: bool

    @property
    def config(self) -> TrainConfig:
        return self.request.config

    @property
    def output_dir(self) -> Path:
        return self.request.output_dir


def prepare(
    request: RunRequest,
    role: Role,
    *,
    console: Console,
    held: contextlib.ExitStack,
    processes: Processes = ONE_PROCESS,
    plan: Plan | None = None,
    scratch: Path | None = None,
) -> SetUp | None:
    """The run up to loading the model; None where the folder holds this run finished (nothing changes).
    The inputs are checked first, without torch: fail in a second, not after loading a model. `held` keeps the
    folder's lock (`Role.holds`) until the caller closes it. `processes`: a worker among the others. `plan`: a
    worker's, the launcher's plan. `scratch`: where a dry run builds the demo's base model, so nothing stays."""
    config = request.config
    inputs = check_inputs(request)
    fingerprint = runfolder.fingerprint(config, inputs.model_dir, inputs.data_path, inputs.eval_path)
    if role.holds:
        held.enter_context(runfolder.hold(request.output_dir))
    start = _open_folder(request, role, inputs, fingerprint, console, processes)
    if start.mode == "finished":
        return None
    if role is Role.DRY_RUN and request.build_model is not None and scratch is not None:
        inputs = replace(inputs, model_dir=scratch / inputs.model_dir.name)
        build.quiet_libraries()
        request.build_model(inputs.model_dir)
        check_model(inputs.model_dir, config)
    spec = model_spec(inputs.model_dir)
    build.quiet_libraries()
    import torch

    on_cuda = torch.cuda.is_available()
    tokenizer, encoded, encoded_eval, profile = tokenized(config, inputs, console)

    def planned(saved: Plan | None) -> Plan:
        return resolve_plan(config, spec, profile, encoded.lengths, saved_plan=saved, on_cuda=on_cuda, console=console)

    plan, asked = _plan(request, role, start, processes, plan, planned, on_cuda)
    check_device(plan.settings, on_cuda, spec, launched=role is not Role.ONE_PROCESS)
    build.check_settings(spec, plan.settings)
    if role is not Role.WORKER:  # the launcher showed it
        show_plan(plan, console)
    return SetUp(request, inputs, fingerprint, start, spec, tokenizer, encoded, encoded_eval, plan, asked, on_cuda)


def dry_run(request: RunRequest, *, console: Console) -> None:
    """What a run checks and decides before it loads the model, with nothing written: the inputs, the output
    folder (fresh, resumed or refused), the tokenized data, the plan for this device and the resolved config."""
    config, output_dir = request.config, request.output_dir
    with contextlib.ExitStack() as held:
        scratch = Path(held.enter_context(tempfile.TemporaryDirectory(prefix="lorafit-dry-run-")))
        ready = prepare(request, Role.DRY_RUN, console=console, held=held, scratch=scratch)
    if ready is None:
        return
    console.print("resolved config (`lorafit train` would run exactly this):")
    resolved = runfolder.resolved_config(config, ready.plan).model_dump(mode="json")
    console.print(yaml.safe_dump(resolved, sort_keys=False), end="")
    if config.n_gpus * config.nodes > 1:
        topology = Topology.of(config, ready.on_cuda)
        if not ready.on_cuda:
            console.print(distributed.cpu_note(ready.asked, topology))
        console.print(f"accelerate config (`lorafit train` would write it to {output_dir}):")
        console.print(distributed.describe(ready.plan.settings, config, topology), end="", markup=False)
    start = ready.start
    what = start.note or ("resume" if start.mode == "resume" else f"a fresh run in {output_dir}")
    console.print(f"dry run: {what}; nothing was written")


# --- the run folder -------------------------------------------------------------------------------------------
def _open_folder(
    request: RunRequest,
    role: Role,
    inputs: Inputs,
    fingerprint: dict[str, Any],
    console: Console,
    processes: Processes,
) -> runfolder.RunStart:
    """Fresh, resumed or finished (`runfolder.begin`), and the folder set up where this role writes it.
    Among workers rank 0 decides and sets it up; the others take its decision."""
    config, output_dir = request.config, request.output_dir
    built = request.build_model is not None
    if role is Role.WORKER and not processes.is_main:
        start: runfolder.RunStart = processes.broadcast(None)
        if start.mode != "finished" and built:
            check_model(inputs.model_dir, config)  # built by rank 0
        return start
    reads = runfolder.reads(inputs.model_dir, inputs.data_path, inputs.eval_path, built=built)
    start = runfolder.begin(
        output_dir,
        fingerprint,
        resume=request.resume,
        overwrite=request.overwrite,
        inputs=reads,
        dry_run=not role.writes,
    )
    if role is Role.DRY_RUN:
        if start.mode == "finished":
            console.print(f"dry run: {start.note}")
        else:
            runfolder.check_writable(output_dir)
    elif start.note and role is not Role.WORKER:  # a worker's launcher said it
        console.print(start.note)
    if start.mode != "finished" and role.writes:
        _set_up_folder(request, inputs.model_dir, fingerprint, start)
    elif start.mode != "finished" and role is Role.OTHER_NODE and request.build_model is not None:
        request.build_model(inputs.model_dir)  # an input of this node's processes
    return processes.broadcast(start) if role is Role.WORKER else start


def _set_up_folder(request: RunRequest, model_dir: Path, fingerprint: dict[str, Any], start: Any) -> None:
    """A fresh run claims the folder; the demo's base model is built (or completed) into it."""
    output_dir = request.output_dir
    output_dir.mkdir(parents=True, exist_ok=True)
    if start.mode == "fresh":
        runfolder.start_fresh(output_dir, fingerprint)
    if request.build_model is not None:
        build.quiet_libraries()
        request.build_model(model_dir)
        check_model(model_dir, request.config)
    if start.mode == "fresh":
        runfolder.record_base(output_dir, model_dir)


# --- inputs -------------------------------------------------------------------------------------------------
def check_inputs(request: RunRequest) -> Inputs:
    """The model directory and data files, checked without torch, and the data read."""
    config = request.config
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
    if request.build_model is None:
        check_model(model_dir, config)
        # what the model alone rules out (its positions, tied embeddings, attention kernels), before any write
        options.check_against(config.pinned_settings(), model_spec(model_dir))
    train_rows, eval_rows, data_format = _load_data(config, data_path, eval_path)
    return Inputs(model_dir, data_path, eval_path, train_rows, eval_rows, data_format)


def _load_data(config: TrainConfig, data_path: Path, eval_path: Path | None) -> tuple[Rows, Rows, str | None]:
    """Train and eval conversations: the eval file, or a seeded share of the data held out."""
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


def check_model(model_dir: Path, config: TrainConfig) -> None:
    if not model_dir.is_dir():
        raise TrainError(f"no model directory {model_dir}; pass a local Hugging Face model directory")
    build.check_model_dir(model_dir, allow_pickle=config.allow_pickle)


def model_spec(model_dir: Path) -> ModelSpec:
    return from_config_json(model_dir, name=model_dir.name)


def tokenized(
    config: TrainConfig, inputs: Inputs, console: Console
) -> tuple[PreTrainedTokenizerBase, examples.Encoded, examples.Encoded, TokenProfile]:
    """The model's tokenizer (with a chat template and a pad token) and the data encoded with it."""
    tokenizer = _load_tokenizer(inputs.model_dir, config)
    if ensure_chat_template(tokenizer):
        console.print("the tokenizer has no chat template: using 'role: content' turns (saved with the adapter)")
    examples.ensure_pad_token(tokenizer)
    raw_text = inputs.data_format == "text"
    train_on_prompt = config.train_on_prompt
    encoded = examples.encode(inputs.train_rows, tokenizer, raw_text=raw_text, train_on_prompt=train_on_prompt)
    encoded_eval = examples.encode(inputs.eval_rows, tokenizer, raw_text=raw_text, train_on_prompt=train_on_prompt)
    profile = examples.token_profile(encoded, str(inputs.data_path), inputs.model_dir.name)
    return tokenizer, encoded, encoded_eval, profile


def _load_tokenizer(model_dir: Path, config: TrainConfig) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(
            model_dir, local_files_only=True, trust_remote_code=config.trust_remote_code
        )
    except (OSError, ValueError, TypeError) as error:
        raise TrainError(f"cannot load the tokenizer from {model_dir}: {str(error).splitlines()[0]}") from None


# --- settings -------------------------------------------------------------------------------------------------
def _plan(
    request: RunRequest,
    role: Role,
    start: runfolder.RunStart,
    processes: Processes,
    given: Plan | None,
    planned: Callable[[Plan | None], Plan],
    on_cuda: bool,
) -> tuple[Plan, Settings]:
    """The plan this role runs, and its settings before `for_processes`. A resumed run keeps its saved plan; a
    worker takes the launcher's, and rank 0's is every worker's. `planned(saved)`: `resolve_plan` for this run's
    model and data, given the saved plan or None."""
    if role is Role.WORKER and not processes.is_main:
        main_plan: Plan = processes.broadcast(None)
        return same_plan_everywhere(main_plan, given), main_plan.settings
    config = request.config
    saved = given or (runfolder.saved_plan(request.output_dir) if start.mode == "resume" else None)
    plan = planned(saved)
    asked = plan.settings
    plan = for_processes(plan, config, on_cuda)
    if saved is not None and start.checkpoint is not None and role is not Role.WORKER:  # the launcher checked
        distributed.check_resume(saved.settings, plan.settings, start.checkpoint)
    if role is Role.WORKER:
        plan = same_plan_everywhere(processes.broadcast(plan), plan)
    return plan, asked


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
    pinned = config.pinned_settings()
    device: Device = "cuda" if on_cuda else "cpu"
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


def check_device(settings: Settings, on_cuda: bool, spec: ModelSpec, *, launched: bool = False) -> None:
    """What this machine cannot run: offloads that the free host RAM cannot hold, or several GPUs in one process
    (`lorafit train` starts the processes: `launch.launch`)."""
    if on_cuda:
        problem = memory.host_saver_problem(spec, settings, hardware.available_ram_gib())
        if problem:
            raise TrainError(problem)
    if settings.n_gpus * settings.nodes > 1 and not launched:
        raise TrainError(
            f"recipe.run trains in this process; n_gpus {settings.n_gpus} x nodes {settings.nodes} is started by "
            "`lorafit train` (lorafit.train.launch.launch)"
        )


def for_processes(plan: Plan, config: TrainConfig, on_cuda: bool) -> Plan:
    """The plan as several processes run it: on the CPU data-parallel with nothing offloaded; over several nodes
    with an accumulation every node can share (`distributed.split_over_nodes`). One process: the plan as it is."""
    if config.n_gpus * config.nodes == 1:
        return plan
    settings = plan.settings
    if not on_cuda:
        settings = distributed.cpu_settings(settings)
    settings = distributed.split_over_nodes(settings, config.nodes)
    distributed.check_offload(settings)
    return with_settings(plan, settings)


def same_plan_everywhere(main_plan: Plan, own: Plan | None) -> Plan:
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
