"""Several GPUs, the pieces: where a process stands among the training processes, what the machines can
run, which checkpoints resume on other GPUs, an out-of-memory error among several processes, and the accelerate
(and DeepSpeed) config the plan chose. `launch` starts the processes; `worker` is the module each one runs.

transformers' Trainer takes DDP, FSDP or DeepSpeed from the `ACCELERATE_*`, `FSDP_*` variables accelerate's
launcher sets from the config (`TrainingArguments` reads `ACCELERATE_USE_DEEPSPEED`, the `Accelerator`
`ACCELERATE_USE_FSDP` and the `FSDP_*` plugin fields).

Without a GPU the processes run on the CPU over gloo, with data parallelism only. accelerate's own CPU type
(`MULTI_CPU`) starts several processes only through mpirun; the config therefore names the multi-GPU type with
`use_cpu: true`, so that torchrun (inside `accelerate launch`) starts the processes, and each, finding no GPU,
sets up accelerate's multi-CPU state over gloo (`TrainingArguments(use_cpu=True)`).

An out-of-memory error in one of several processes cannot be recovered the way one process recovers (halve
the micro-batch and go on): the other processes are inside the gradient exchange of the same step, waiting for
this one, so there is no point at which all of them could agree and retry. The process that ran out stops the
run with one line that names the micro-batch to resume with; torchrun then stops the others. The pre-flight
before step 1 does agree (every process measures, all take the smallest micro-batch that fits).

torch is imported inside the functions.
"""

from __future__ import annotations

import json
import math
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from lorafit import memory
from lorafit.errors import InvalidConfig, TrainError
from lorafit.files import write_atomic
from lorafit.train import checkpoints, guard

if TYPE_CHECKING:
    from lorafit.options import TrainConfig
    from lorafit.schema import Estimate, Settings

LAUNCH_KEYS = ("node_rank", "main_address", "main_port")  # where a run is started from, not what it trains
ACCELERATE_CONFIG = "accelerate_config.yaml"
DEEPSPEED_CONFIG = "deepspeed.json"
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
