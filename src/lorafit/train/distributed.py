"""Several GPUs: the accelerate config the plan chose, the launch through accelerate's own launcher, and the
worker processes, each running the same recipe on its share of the data.

`lorafit train ... --n-gpus N` (and `--nodes M --node-rank R --main-address A`) checks the machine, opens the
run folder and makes the plan as a one-GPU run does, then writes `accelerate_config.yaml` (and, for ZeRO,
`deepspeed.json`) into the run folder, prints it, and runs `accelerate launch --config_file <it> -m
lorafit.train.distributed <launch folder>`. Every worker runs `recipe.run` with the launcher's plan; rank 0
alone writes the run folder. transformers' Trainer takes DDP, FSDP or DeepSpeed from the `ACCELERATE_*`,
`FSDP_*` variables accelerate's launcher sets from the config (`TrainingArguments` reads
`ACCELERATE_USE_DEEPSPEED`, the `Accelerator` `ACCELERATE_USE_FSDP` and the `FSDP_*` plugin fields).

Without a GPU the processes run on the CPU over gloo, with data parallelism only. accelerate's own CPU type
(`MULTI_CPU`) starts several processes only through mpirun; the config therefore names the multi-GPU type with
`use_cpu: true`, so that torchrun (inside `accelerate launch`) starts the processes, and each, finding no GPU,
sets up accelerate's multi-CPU state over gloo (`TrainingArguments(use_cpu=True)`).

An out-of-memory error in one of several processes cannot be recovered the way one process recovers (halve
the micro-batch and go on): the other processes are inside the gradient exchange of the same step, waiting for
this one, so there is no point at which all of them could agree and retry. The process that ran out stops the
run with one line that names the micro-batch to resume with; torchrun then stops the others. The pre-flight
before step 1 does agree (every process measures, all take the smallest micro-batch that fits).

torch, accelerate and transformers are imported inside the functions.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from lorafit import memory
from lorafit.errors import InvalidConfig, LorafitError, TrainError
from lorafit.files import write_atomic

if TYPE_CHECKING:
    from collections.abc import Callable

    from rich.console import Console

    from lorafit.options import TrainConfig
    from lorafit.schema import Estimate, Settings

ENTRY = "lorafit.train.distributed"  # the module `accelerate launch -m` runs in every process
LAUNCH_KEYS = ("node_rank", "main_address", "main_port")  # where a run is started from, not what it trains
ACCELERATE_CONFIG = "accelerate_config.yaml"
DEEPSPEED_CONFIG = "deepspeed.json"
PAYLOAD = "launch.json"  # in the launch folder: the config, the plan and the switches every worker runs
ERROR_PREFIX = "error-rank"  # in the launch folder: the one line a worker stopped with
SHARDED = ("zero2", "zero3", "fsdp")  # the shards that split optimizer state (and, but zero2, weights) over GPUs
MIXED_PRECISION = {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}  # Settings.precision -> accelerate's
DISTRIBUTED_TYPE = {"none": "MULTI_GPU", "ddp": "MULTI_GPU", "zero2": "DEEPSPEED", "zero3": "DEEPSPEED"}
DISTRIBUTED_TYPE["fsdp"] = "FSDP"


# --- where this process stands ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Topology:
    """The machines of one run: `n_gpus` processes on each of `nodes` machines, this one `node_rank`."""

    n_gpus: int = 1
    nodes: int = 1
    node_rank: int = 0
    main_address: str | None = None
    main_port: int = 29500
    on_cuda: bool = True

    @property
    def world_size(self) -> int:
        return self.n_gpus * self.nodes

    @classmethod
    def of(cls, config: TrainConfig, on_cuda: bool) -> Topology:
        return cls(
            n_gpus=config.n_gpus,
            nodes=config.nodes,
            node_rank=config.node_rank or 0,
            main_address=config.main_address,
            main_port=config.main_port,
            on_cuda=on_cuda,
        )


@dataclass(frozen=True)
class Processes:
    """This process among the training processes. Rank 0 alone writes the run folder; `broadcast` hands its
    decisions (fresh or resumed, the plan) to the others. The default is the one process of a one-GPU run."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    launch_dir: Path | None = None  # set in a launched worker

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def several(self) -> bool:
        return self.world_size > 1

    @property
    def launched(self) -> bool:
        return self.launch_dir is not None

    def barrier(self) -> None:
        if self.several:
            import torch.distributed as dist

            dist.barrier()

    def broadcast(self, value: Any) -> Any:
        """Rank 0's `value`, on every process."""
        if not self.several:
            return value
        import torch.distributed as dist

        box = [value if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def smallest(self, value: int) -> int:
        """The smallest `value` any process has."""
        if not self.several:
            return value
        import torch
        import torch.distributed as dist

        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        tensor = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        return int(tensor.item())


ONE_PROCESS = Processes()


def needs_launch(config: TrainConfig) -> bool:
    """Several processes asked for, and this is not already one of them."""
    return (config.n_gpus > 1 or config.nodes > 1) and not in_worker()


def in_worker() -> bool:
    return "LOCAL_RANK" in os.environ and os.environ.get("LORAFIT_LAUNCHED") == "1"


# --- what the machine can run --------------------------------------------------------------------------------
def check_topology(topology: Topology, gpus: list[tuple[str, int]]) -> None:
    """Refuse, in one line naming the nearest choice that works, what these machines cannot run. `gpus`: the
    visible GPUs as (name, total bytes); none means the processes run on the CPU."""
    if topology.node_rank >= topology.nodes:
        if topology.nodes == 1:
            raise InvalidConfig(
                f"node_rank {topology.node_rank} needs nodes > {topology.node_rank}: use --node-rank 0 on one "
                f"node, or --nodes {topology.node_rank + 1} or more"
            )
        raise InvalidConfig(
            f"node_rank {topology.node_rank}: the {topology.nodes} nodes are ranked 0 to {topology.nodes - 1}; "
            f"use --node-rank {topology.nodes - 1} (or --nodes {topology.node_rank + 1})"
        )
    if topology.nodes > 1 and not topology.main_address:
        raise InvalidConfig(
            f"nodes {topology.nodes}: every node connects to node 0, so pass --main-address with node 0's address "
            "(the same on every node; on node 0 too)"
        )
    if not gpus:
        return  # CPU processes: any number
    if topology.n_gpus > len(gpus):
        names = ", ".join(sorted({name for name, _ in gpus}))
        raise InvalidConfig(
            f"n_gpus {topology.n_gpus}: this machine has {len(gpus)} GPU{'s' if len(gpus) > 1 else ''} ({names}); "
            f"use --n-gpus {len(gpus)}"
        )
    used = gpus[: topology.n_gpus]
    kinds = {(name, round(total / 2**30)) for name, total in used}
    if len(kinds) > 1:
        groups: dict[tuple[str, int], list[int]] = {}
        for index, (name, total) in enumerate(gpus):
            groups.setdefault((name, round(total / 2**30)), []).append(index)
        (name, memory), indices = max(groups.items(), key=lambda item: len(item[1]))
        shown = " and ".join(f"{n} {m} GiB" for n, m in sorted(kinds))
        raise InvalidConfig(
            f"n_gpus {topology.n_gpus}: the GPUs differ ({shown}), and one plan fits one kind of GPU; use "
            f"CUDA_VISIBLE_DEVICES={','.join(map(str, indices))} --n-gpus {min(len(indices), topology.n_gpus)} "
            f"(the {len(indices)} x {name})"
        )


def check_host_ram(estimate: Estimate, available_gib: float | None, topology: Topology) -> None:
    """Refuse, before any process starts, a run whose host-memory peak (every process loading its copy of the
    model, or the offloaded states) this machine does not have free: it would be killed while loading."""
    needed = estimate.host_ram_gib
    if available_gib is None or needed is None or needed <= available_gib:
        return
    parts = ", ".join(
        f"{name.replace('_', ' ')} {value:.1f}" for name, value in estimate.host_ram_breakdown_gib.items()
    )
    fewer = f"--n-gpus {topology.n_gpus // 2} on more machines" if topology.n_gpus > 1 else "a machine with more RAM"
    raise InvalidConfig(
        f"host RAM: the {topology.n_gpus} processes on this machine need {needed:.1f} GiB ({parts}) and "
        f"{available_gib:.1f} GiB is free; free memory, or use {fewer}"
    )


def visible_gpus() -> list[tuple[str, int]]:
    """(name, total memory in bytes) of each GPU torch sees, in CUDA order."""
    import torch

    if not torch.cuda.is_available():
        return []
    found = []
    for index in range(torch.cuda.device_count()):
        properties = torch.cuda.get_device_properties(index)
        found.append((properties.name, int(properties.total_memory)))
    return found


def applied_shard(settings: Settings, topology: Topology) -> str:
    """The shard that runs: the plan's on GPUs, data parallelism (ddp) on the CPU."""
    if not topology.on_cuda or settings.shard == "none":
        return "ddp"
    return settings.shard


def cpu_note(settings: Settings, topology: Topology) -> str:
    """The one line a run without a GPU says about what it runs instead."""
    note = f"no GPU: {topology.world_size} CPU processes over gloo (DDP)"
    if settings.shard in SHARDED or settings.offload != "none":
        note += "; sharding needs GPUs and is not applied"
    return note


def cpu_settings(settings: Settings) -> Settings:
    """What CPU processes run of `settings`: data parallelism, nothing offloaded (they are in host memory)."""
    return settings.model_copy(update={"shard": "ddp" if settings.n_gpus > 1 else "none", "offload": "none"})


def split_over_nodes(settings: Settings, nodes: int) -> Settings:
    """Settings whose accumulation every node's processes can share: `batch_size` is micro_batch x grad_accum x
    n_gpus (per node, as the planner counts), so each of the `nodes` machines runs grad_accum / nodes micro-batches
    a step. Where nodes does not divide grad_accum the micro-batch is cut and the accumulation grows to match
    (same effective batch, less memory); where that cannot be, one line says which batch sizes work."""
    if nodes == 1 or settings.grad_accum % nodes == 0:
        return settings
    needed = nodes // math.gcd(settings.grad_accum, nodes)  # the factor the accumulation must grow by
    if settings.micro_batch % needed:
        per_gpu = settings.micro_batch * settings.grad_accum
        raise InvalidConfig(
            f"nodes {nodes}: each GPU would take {per_gpu}/{nodes} sequences a step (batch_size "
            f"{per_gpu * settings.n_gpus} over {settings.n_gpus} GPUs x {nodes} nodes); use a batch_size that is "
            f"a multiple of {settings.n_gpus * nodes}"
        )
    return settings.model_copy(
        update={"micro_batch": settings.micro_batch // needed, "grad_accum": settings.grad_accum * needed}
    )


# --- resuming on other GPUs ----------------------------------------------------------------------------------
ENGINE = {"none": "ddp", "ddp": "ddp", "zero2": "deepspeed", "zero3": "deepspeed", "fsdp": "fsdp"}
ENGINE_TITLES = {"ddp": "whole (one GPU or DDP)", "deepspeed": "DeepSpeed's ZeRO partitions", "fsdp": "FSDP's sharded"}


def engine_of(settings: Settings) -> str:
    """Who writes the optimizer state of a checkpoint: DeepSpeed for zero2/zero3 (and ZeRO-Offload on one GPU),
    FSDP (torch.distributed.checkpoint), or the Trainer itself, whole, for one GPU and DDP."""
    return ENGINE[settings.shard]


def check_resume(saved: Settings, resumed: Settings, checkpoint: Path) -> None:
    """Refuse, in one line naming the settings that resume, a checkpoint the engine cannot load on these GPUs.
    Whole states (one GPU, DDP) load on any number; FSDP's go through torch.distributed.checkpoint, which
    reshards to the new number; DeepSpeed loads its ZeRO partitions only on as many GPUs as wrote them
    (deepspeed 0.19.8 runtime/engine.py `_load_zero_checkpoint`, without a universal checkpoint). Across
    engines the optimizer state is in another format, which the Trainer would skip rather than load."""
    before, after = engine_of(saved), engine_of(resumed)
    saved_world = saved.n_gpus * saved.nodes
    topology = f"--n-gpus {saved.n_gpus}" + (f" --nodes {saved.nodes}" if saved.nodes > 1 else "")
    shard = f"--shard {saved.shard}" + (f" --offload {saved.offload}" if saved.offload != "none" else "")
    if before != after:
        same = shard if before != "ddp" else "--shard ddp (or none on one GPU)"
        raise InvalidConfig(
            f"resume: {checkpoint.name} holds the optimizer state {ENGINE_TITLES[before]}, and this run would "
            f"load it as {ENGINE_TITLES[after]}; resume with {same}" + (f" {topology}" if before == "deepspeed" else "")
        )
    if before == "deepspeed" and resumed.n_gpus * resumed.nodes != saved_world:
        raise InvalidConfig(
            f"resume: {checkpoint.name} holds DeepSpeed ZeRO partitions for {saved_world} GPU"
            f"{'s' if saved_world > 1 else ''}, and DeepSpeed loads them only on as many; resume with {topology}"
        )


# --- out of memory among several processes ---------------------------------------------------------------
def agree(checked: Any, settings: Settings, processes: Processes) -> Any:
    """The pre-flight's result every process uses: the smallest micro-batch that fits on all of them (each
    process measured its own GPU; the halvings of one start follow one chain, so the smallest is on every one)."""
    from dataclasses import replace

    from lorafit.train import guard

    micro_batch = processes.smallest(checked.settings.micro_batch)
    agreed = settings
    while agreed.micro_batch > micro_batch:
        smaller = guard.smaller(agreed)
        if smaller is None:
            break
        agreed = smaller
    return replace(checked, settings=agreed)


def out_of_memory(step: int, settings: Settings, processes: Processes, output_dir: Path) -> TrainError:
    """The one line for an out-of-memory error in one of several processes: the others wait inside the
    gradient exchange of this step, so they cannot all halve the micro-batch and go on, as one process does;
    the run stops, and the line names the settings to resume with."""
    from lorafit.train import checkpoints, guard

    where = f"process {processes.rank} of {processes.world_size}"
    smaller = guard.smaller(settings)
    if smaller is None:
        one = guard.out_of_memory_at_one(step, settings)
        return TrainError(f"{one} ({where})")
    newest = checkpoints.latest_checkpoint(output_dir)
    flags = f"--micro-batch {smaller.micro_batch} --grad-accum {smaller.grad_accum}"
    go_on = f"--resume {flags} to go on from {newest.name}" if newest else f"{flags} (no checkpoint yet: starts over)"
    return TrainError(
        f"out of memory in step {step} at micro-batch {settings.micro_batch} ({where}): several processes cannot "
        f"halve the micro-batch mid-run, so the run stopped; rerun with {go_on}, the same effective batch"
    )


# --- the configs -----------------------------------------------------------------------------------------------
def check_offload(settings: Settings) -> None:
    """The offloads DeepSpeed and FSDP have: optimizer states with ZeRO-2, -3 or FSDP; weights with ZeRO-3 or FSDP."""
    if settings.offload == "none" or settings.n_gpus == 1:
        return
    if settings.shard not in SHARDED:
        raise InvalidConfig(
            f"offload {settings.offload} needs a sharded run (shard zero2, zero3 or fsdp); use shard zero3 or "
            "offload none"
        )
    if settings.offload == "params" and settings.shard == "zero2":
        raise InvalidConfig(
            "offload params: ZeRO-2 keeps every weight on every GPU; use shard zero3 (or offload optimizer)"
        )


def deepspeed_config(settings: Settings, config: TrainConfig, topology: Topology) -> dict[str, Any]:
    """The DeepSpeed JSON for shard zero2 / zero3, with the batch, clipping and precision the Trainer runs
    (written out, not "auto", so that a mismatch with the plan is refused by transformers rather than changed)."""
    accumulation = settings.grad_accum // topology.nodes
    zero: dict[str, Any] = {"stage": 3 if settings.shard == "zero3" else 2, "overlap_comm": True}
    zero["contiguous_gradients"] = True
    # the buckets are allocated whole (memory.communication_buffer_bytes): a tenth of DeepSpeed's default
    zero["reduce_bucket_size"] = memory.DEEPSPEED_BUCKET_ELEMENTS
    if settings.shard == "zero2":
        zero["allgather_bucket_size"] = memory.DEEPSPEED_BUCKET_ELEMENTS
    if settings.shard == "zero3":
        zero["stage3_gather_16bit_weights_on_model_save"] = True  # the final save gets whole weights
    if settings.offload in ("optimizer", "params"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if settings.offload == "params":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    data: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": settings.micro_batch,
        "gradient_accumulation_steps": accumulation,
        "train_batch_size": settings.micro_batch * accumulation * topology.world_size,
        "gradient_clipping": config.max_grad_norm,
        "bf16": {"enabled": settings.precision == "bf16"},
        "fp16": {"enabled": settings.precision == "fp16"},
        "zero_optimization": zero,
        "steps_per_print": 2**31 - 1,  # lorafit prints its own progress
        "wall_clock_breakdown": False,
    }
    if settings.offload != "none":
        # An offloaded optimizer steps on the CPU with DeepSpeed's own Adam; a client (torch) optimizer is refused
        # there. The values are the Trainer's (TrainingArguments' AdamW defaults).
        data["optimizer"] = {
            "type": "AdamW",
            "params": {
                "lr": config.learning_rate,
                "betas": [0.9, 0.999],
                "eps": 1e-8,
                "weight_decay": config.weight_decay,
            },
        }
    return data


def accelerate_config(settings: Settings, topology: Topology, deepspeed_file: Path | None = None) -> dict[str, Any]:
    """The accelerate config (`accelerate launch --config_file`) for `settings` on `topology`, as the keys of
    `accelerate.commands.config.config_args.ClusterConfig`."""
    shard = applied_shard(settings, topology)
    data: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "distributed_type": DISTRIBUTED_TYPE[shard],
        "enable_cpu_affinity": False,
        "gpu_ids": "all",
        "machine_rank": topology.node_rank,
        "main_training_function": "main",
        "num_machines": topology.nodes,
        "num_processes": topology.world_size,  # all machines together; each starts num_processes / num_machines
        "rdzv_backend": "static",
        "same_network": True,
        "main_process_port": topology.main_port,
        "use_cpu": not topology.on_cuda,
    }
    if topology.nodes > 1:
        data["main_process_ip"] = topology.main_address
    if shard in ("zero2", "zero3"):
        # DeepSpeed takes precision from its own JSON: accelerate refuses a mixed_precision next to the file.
        data["deepspeed_config"] = {
            "deepspeed_config_file": str(deepspeed_file),
            "deepspeed_multinode_launcher": "standard",  # torchrun on every node, as for DDP and FSDP
            "zero3_init_flag": False,  # the model is loaded before the Trainer exists; ZeRO-3 partitions it then
        }
    else:
        data["mixed_precision"] = MIXED_PRECISION[settings.precision]
    if shard == "fsdp":
        data["fsdp_config"] = {
            "fsdp_version": 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",  # the model's decoder layers (_no_split_modules)
            "fsdp_reshard_after_forward": True,
            # FSDP has no optimizer-only offload: its CPU offload moves the weights, their gradients and the
            # optimizer step to host memory, which also covers `offload optimizer`.
            "fsdp_offload_params": settings.offload != "none",
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_cpu_ram_efficient_loading": False,
            "fsdp_activation_checkpointing": False,  # lorafit's own grad_ckpt (build.prepare) checkpoints
        }
    return data


@dataclass(frozen=True)
class WrittenConfig:
    accelerate_file: Path
    deepspeed_file: Path | None
    text: str  # what is printed: the YAML and, for ZeRO, the JSON


def write_configs(folder: Path, settings: Settings, config: TrainConfig, topology: Topology) -> WrittenConfig:
    """accelerate_config.yaml (and deepspeed.json) in `folder`, and the text that shows them."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    deepspeed_file = None
    shown = ""
    if applied_shard(settings, topology) in ("zero2", "zero3"):
        deepspeed_file = (folder / DEEPSPEED_CONFIG).absolute()
        text = json.dumps(deepspeed_config(settings, config, topology), indent=2) + "\n"
        write_atomic(deepspeed_file, text)
        shown = f"\n{deepspeed_file.name}:\n{text}"
    accelerate_file = (folder / ACCELERATE_CONFIG).absolute()
    text = yaml.safe_dump(accelerate_config(settings, topology, deepspeed_file), sort_keys=True)
    write_atomic(accelerate_file, text)
    return WrittenConfig(accelerate_file, deepspeed_file, f"{text}{shown}")


def describe(settings: Settings, config: TrainConfig, topology: Topology) -> str:
    """The configs a launch would write, as text (the dry run prints it)."""
    with tempfile.TemporaryDirectory(prefix="lorafit-configs-") as scratch:
        return write_configs(Path(scratch), settings, config, topology).text


# --- the launch ------------------------------------------------------------------------------------------------
def launch(
    config: TrainConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    dry_run: bool = False,
    console: Console,
    build_model: Callable[[Path], None] | None = None,
    demo: bool = False,
) -> int:
    """Check the machines, open the run folder and plan (as `recipe.run` does), write and print the accelerate
    config, and run the workers through `accelerate launch`. Returns the exit code of the run."""
    from lorafit.train import recipe
    from lorafit.train.build import quiet_libraries

    quiet_libraries()
    import torch

    on_cuda = torch.cuda.is_available()
    topology = Topology.of(config, on_cuda)
    check_topology(topology, visible_gpus() if on_cuda else [])
    if dry_run:
        recipe.run(config, resume=resume, overwrite=overwrite, dry_run=True, console=console, build_model=build_model)
        return 0
    prepared = recipe.prepare_launch(
        config,
        resume=resume,
        overwrite=overwrite,
        console=console,
        build_model=build_model,
        writes=topology.node_rank == 0,
    )
    if prepared is None:
        return 0  # finished: nothing to train
    plan = prepared.plan
    if on_cuda:
        from lorafit.hardware import available_ram_gib

        check_host_ram(plan.estimate, available_ram_gib(), topology)
    else:
        console.print(cpu_note(prepared.asked, topology))
    launch_dir = Path(tempfile.mkdtemp(prefix="lorafit-launch-"))
    try:
        # node 0 keeps the config with the run; another node's run folder is not written (rank 0 writes it)
        folder = prepared.output_dir if topology.node_rank == 0 else launch_dir
        written = write_configs(folder, plan.settings, config, topology)
        payload = {
            "config": config.model_dump(mode="json"),
            "plan": json.loads(plan.to_json()),
            "resume": resume,
            "demo": demo,
        }
        write_atomic(launch_dir / PAYLOAD, json.dumps(payload))
        console.print(f"accelerate config ({written.accelerate_file}):")
        console.print(written.text, end="", markup=False)
        where = f" on node {topology.node_rank} of {topology.nodes} ({topology.world_size} in all)"
        console.print(
            f"launching {topology.n_gpus} processes{where if topology.nodes > 1 else ''}: accelerate launch "
            f"--config_file {written.accelerate_file} -m {ENTRY}",
            markup=False,
        )
        code = _accelerate_launch(written.accelerate_file, launch_dir, topology)
        problems = _worker_errors(launch_dir)
        if problems:
            raise TrainError(problems[0])
        if code < 0:  # killed: by the kernel's out-of-memory killer, say
            from lorafit.train import checkpoints

            name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
            hint = checkpoints.resume_hint(prepared.output_dir)
            raise TrainError(f"a training process was killed ({name}); {hint}")
        if code not in (0, 1, 130):
            raise TrainError(f"a training process stopped with exit code {code}; its messages are above")
        return code
    finally:
        shutil.rmtree(launch_dir, ignore_errors=True)


def _accelerate_launch(config_file: Path, launch_dir: Path, topology: Topology) -> int:
    """`accelerate launch --config_file F -m lorafit.train.distributed DIR`, run in this process, so that a
    failed worker comes back as its exit code (its one line is in DIR) instead of torchrun's report."""
    from accelerate.commands.launch import launch_command, launch_command_parser

    arguments = launch_command_parser().parse_args(["--config_file", str(config_file), "-m", ENTRY, str(launch_dir)])
    threads = max(1, (os.cpu_count() or 1) // topology.n_gpus)
    environment = {"LORAFIT_LAUNCHED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads))}
    if not topology.on_cuda:  # DeepSpeed, imported by the libraries in a worker, otherwise warns that it found no GPU
        environment["DS_ACCELERATOR"] = os.environ.get("DS_ACCELERATOR", "cpu")
    with _quiet_launcher(), _environment(environment):
        try:
            launch_command(arguments)
        except SystemExit as stop:
            return stop.code if isinstance(stop.code, int) else 1
        except Exception as error:
            failure = getattr(error, "get_first_failure", None)
            if failure is None:
                raise
            _, first = failure()
            return int(first.exitcode) if first.exitcode else 1  # negative: the signal that killed it
    return 0


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _quiet_launcher() -> Iterator[None]:
    """torchrun's elastic agent logs every start and, for a failed worker, a report; the worker said it in one
    line already. Its loggers set their own level (from LOGLEVEL) when created, so each is set here."""
    import warnings

    import torch.distributed.run  # noqa: F401 - creates the elastic agent's loggers

    saved = os.environ.get("LOGLEVEL")
    os.environ["LOGLEVEL"] = "CRITICAL"
    loggers = [
        logging.getLogger(name)
        for name in list(logging.root.manager.loggerDict)
        if name.startswith(("torch.distributed", "accelerate"))
    ]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
        if saved is None:
            os.environ.pop("LOGLEVEL", None)
        else:
            os.environ["LOGLEVEL"] = saved


def _worker_errors(launch_dir: Path) -> list[str]:
    """The one-line errors the workers stopped with, rank order, each once."""
    lines: list[str] = []
    for path in sorted(launch_dir.glob(f"{ERROR_PREFIX}*.txt"), key=lambda p: int(p.stem[len(ERROR_PREFIX) :])):
        line = path.read_text().strip()
        if line and line not in lines:
            lines.append(line)
    return lines


# --- a worker --------------------------------------------------------------------------------------------------
def join() -> Processes:
    """Join the process group accelerate's launcher set up (NCCL on GPUs, gloo on the CPU), on this process's GPU."""
    import torch
    from accelerate import PartialState

    state = PartialState(cpu=not torch.cuda.is_available())
    return Processes(rank=state.process_index, world_size=state.num_processes, local_rank=state.local_process_index)


def main(argv: list[str] | None = None) -> None:
    """One training process: `python -m lorafit.train.distributed LAUNCH_DIR`, as `accelerate launch` starts it."""
    from rich.console import Console

    from lorafit.train.build import quiet_libraries

    launch_dir = Path((sys.argv[1:] if argv is None else argv)[0])
    payload = json.loads((launch_dir / PAYLOAD).read_text())
    quiet_libraries()
    processes = join()
    processes = Processes(processes.rank, processes.world_size, processes.local_rank, launch_dir)
    # rank 0 speaks for the run; the other processes say nothing
    console = Console(highlight=False, soft_wrap=True, quiet=not processes.is_main)
    code = 0
    try:
        code = _work(payload, processes, console)
    except LorafitError as error:
        line = str(error).splitlines()[0] if str(error) else type(error).__name__
        write_atomic(launch_dir / f"{ERROR_PREFIX}{processes.rank}.txt", line + "\n")
        code = 2
    except KeyboardInterrupt:
        code = 130
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        os._exit(code)  # now: the other processes may be waiting in a collective that will never come
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    # and out without the interpreter's teardown, where a library thread still joinable aborts the process
    # ("terminate called without an active exception", SIGABRT) after a run that has finished and been saved
    logging.shutdown()
    os._exit(0)


def _work(payload: dict[str, Any], processes: Processes, console: Console) -> int:
    from lorafit.options import TrainConfig
    from lorafit.schema import Plan
    from lorafit.train import recipe

    config = TrainConfig.model_validate(payload["config"])
    plan = Plan.model_validate(payload["plan"])
    if payload["demo"]:
        from lorafit.train import demo

        learned = demo.train_demo(
            config, resume=payload["resume"], overwrite=False, console=console, processes=processes, plan=plan
        )
        return 0 if learned else 1
    recipe.run(config, resume=payload["resume"], console=console, processes=processes, plan=plan)
    return 0


if __name__ == "__main__":
    main()
