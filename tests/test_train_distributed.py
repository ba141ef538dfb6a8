"""`lorafit train --n-gpus N`: the accelerate configs it writes, the launch, and what the processes train.

On this CPU-only machine `--n-gpus 2` runs two CPU processes over gloo (DDP) through `accelerate launch`; the
demo trains the same curve as one process with the same effective batch. Every accelerate config is read back
by accelerate's own launcher code and plugins, every DeepSpeed JSON by DeepSpeed's config class and by
transformers' DeepSpeed integration against the Trainer's arguments.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import free_port, run_cli
from lorafit.errors import InvalidConfig
from lorafit.options import TrainConfig
from lorafit.schema import Settings
from lorafit.train import checkpoints, distributed, launch
from lorafit.train.distributed import Topology

STEPS = ["--max-steps", "6", "--logging-steps", "1", "--eval-steps", "3", "--save-steps", "3"]
# Two processes train the micro-batches one process trains, each its half of the step's; DDP averages the
# gradients, which transformers scales by the step's answer tokens over both processes, so the update is the
# one-process update up to float32 rounding (the sum of two halves instead of one sum). Measured: at most 1e-7
# relative over 6 steps; a wrong normalisation or data order is off by 1e-3 or more.
RELATIVE = 1e-5


def lorafit(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`lorafit ARGS` in a fresh process (the launcher starts the training processes from it)."""
    return subprocess.run(
        [sys.executable, "-m", "lorafit.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ | (env or {}),
    )


def curve(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def close(ours: float, theirs: float, relative: float = RELATIVE) -> bool:
    return abs(ours - theirs) <= relative * abs(theirs)


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The demo, 6 steps, in two CPU processes."""
    out = tmp_path_factory.mktemp("distributed") / "two"
    done = lorafit(
        ["train", "--demo", "--n-gpus", "2", "--main-port", str(free_port()), "--output-dir", str(out), *STEPS]
    )
    assert done.returncode in (0, 1), done.stderr[-3000:]  # 1: six steps do not teach the facts, as the demo says
    return {"out": out, "stdout": done.stdout, "stderr": done.stderr}


def test_two_cpu_processes_train_the_one_process_curve(
    two_processes: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = two_processes["out"]
    assert "no GPU: 2 CPU processes over gloo (DDP)\n" in two_processes["stdout"]
    assert "accelerate launch --config_file" in two_processes["stdout"]
    assert two_processes["stderr"] == ""  # the other process says nothing, torchrun's agent neither
    assert (out / distributed.ACCELERATE_CONFIG).is_file() and (out / "adapter_model.safetensors").is_file()

    one = tmp_path / "one"  # the demo's own batch of 16 in one process, as 8 x 2 (the micro-batches of the two)
    code, _, err = run_cli(
        ["train", "--demo", "--output-dir", str(one), "--micro-batch", "8", "--grad-accum", "2", *STEPS], capsys
    )
    assert code in (0, 1), err
    ours, theirs = curve(out), curve(one)
    assert [line["step"] for line in ours] == [line["step"] for line in theirs] == [1, 2, 3, 4, 5, 6]
    for mine, reference in zip(ours, theirs, strict=True):
        assert close(mine["loss"], reference["loss"]), (mine, reference)
        assert close(mine["grad_norm"], reference["grad_norm"]), (mine, reference)
        assert ("eval_loss" in mine) == ("eval_loss" in reference)
        if "eval_loss" in mine:  # the eval rows split over the two processes, summed back over all answer tokens
            assert close(mine["eval_loss"], reference["eval_loss"])
    plan = json.loads((out / "plan.json").read_text())
    assert (plan["settings"]["n_gpus"], plan["settings"]["micro_batch"], plan["settings"]["shard"]) == (2, 8, "ddp")
    assert plan["batch_size"] == 16


def test_only_rank_0_writes_and_the_run_folder_holds_the_config(two_processes: dict[str, Any]) -> None:
    out = two_processes["out"]
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == len({json.loads(line)["step"] for line in lines}) == 6  # one writer: no line twice
    checkpoint = out / "checkpoints" / "checkpoint-6"
    assert sorted(path.name for path in checkpoint.glob("rng_state*")) == ["rng_state_0.pth", "rng_state_1.pth"]
    assert sorted(path.name for path in out.iterdir()) == sorted(
        [
            "README.md",
            "accelerate_config.yaml",
            "adapter_config.json",
            "adapter_model.safetensors",
            "base-model",
            "chat_template.jinja",
            "checkpoints",
            "config.yaml",
            "loss.png",
            "lorafit-run.json",
            "metrics.jsonl",
            "plan.json",
            "plan.yaml",
            "tokenizer.json",
            "tokenizer_config.json",
        ]
    )


def test_an_out_of_memory_stop_is_one_line_and_the_rerun_resumes_the_same_curve(
    two_processes: dict[str, Any], tmp_path: Path
) -> None:
    """Step 5 runs out of memory (injected in both processes, after checkpoint 3): the run stops with one line
    naming the settings to go on with; the same command again resumes from checkpoint 3 to the same curve."""
    out = tmp_path / "stopped"
    args = ["train", "--demo", "--n-gpus", "2", "--main-port", str(free_port()), "--output-dir", str(out), *STEPS]
    done = lorafit(args, env={"LORAFIT_FAULT_OOM_AT_STEP": "5"})
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr[-3000:]
    assert done.stderr.startswith("lorafit: error: out of memory in step 5 at micro-batch 8 (process 0 of 2)")
    assert "--resume --micro-batch 4 --grad-accum 2 to go on from checkpoint-3" in done.stderr
    assert not (out / "adapter_model.safetensors").exists()

    resumed = lorafit(args)
    assert resumed.returncode in (0, 1), resumed.stderr[-3000:]
    assert "resuming from checkpoint-3" in resumed.stdout
    ours, theirs = curve(out), curve(two_processes["out"])
    assert [line["step"] for line in ours] == [1, 2, 3, 4, 5, 6]
    for mine, reference in zip(ours, theirs, strict=True):
        assert close(mine["loss"], reference["loss"], 1e-6) and close(mine["grad_norm"], reference["grad_norm"], 1e-6)
        assert close(mine.get("eval_loss", 0.0), reference.get("eval_loss", 0.0), 1e-6)


def test_a_run_of_two_processes_resumes_on_one_with_the_same_curve(
    two_processes: dict[str, Any], tmp_path: Path
) -> None:
    """Checkpoints hold the whole adapter and optimizer state (DDP): a run stopped on 2 processes goes on in one,
    the accumulation taking over the other process's share of the effective batch."""
    out = tmp_path / "moved"
    stopped = lorafit(
        ["train", "--demo", "--n-gpus", "2", "--main-port", str(free_port()), "--output-dir", str(out), *STEPS],
        env={"LORAFIT_FAULT_OOM_AT_STEP": "5"},
    )
    assert stopped.returncode == 2, stopped.stderr[-3000:]
    one = lorafit(["train", "--demo", "--output-dir", str(out), *STEPS, "--resume"])
    assert one.returncode in (0, 1), one.stderr[-3000:]
    assert "resuming from checkpoint-3" in one.stdout
    ours, theirs = curve(out), curve(two_processes["out"])
    assert [line["step"] for line in ours] == [1, 2, 3, 4, 5, 6]
    for mine, reference in zip(ours, theirs, strict=True):
        assert close(mine["loss"], reference["loss"], 1e-6) and close(mine["grad_norm"], reference["grad_norm"], 1e-6)


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    """Running (not gone, and not a zombie left for a parent that does not reap it)."""
    try:
        stat = (Path("/proc") / str(pid) / "stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the processes in /proc")
def test_the_workers_end_with_a_killed_launcher_and_the_rerun_resumes(tmp_path: Path) -> None:
    """SIGKILL of `lorafit train --n-gpus 2` gives it no chance to stop its workers: they end with it, instead
    of training on (reparented to PID 1) into a folder the rerun then opens too. The same command resumes."""
    out = tmp_path / "killed"
    args = ["train", "--demo", "--n-gpus", "2", "--output-dir", str(out), *STEPS]
    launcher = subprocess.Popen(
        [sys.executable, "-m", "lorafit.cli", *args, "--main-port", str(free_port())],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    workers: list[int] = []
    try:
        marker = out / "checkpoints" / "checkpoint-3" / checkpoints.COMPLETE
        deadline = time.monotonic() + 300
        while not marker.exists():
            assert launcher.poll() is None, launcher.stderr.read()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.01)
        workers = children(launcher.pid)
        assert len(workers) == 2
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 5
        while any(alive(pid) for pid in workers):
            assert time.monotonic() < deadline, f"{[pid for pid in workers if alive(pid)]} outlived the launcher"
            time.sleep(0.05)
    finally:
        for pid in workers:  # (where they do outlive it)
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert not (out / "adapter_model.safetensors").exists(), "the workers trained on without their launcher"

    resumed = lorafit([*args, "--main-port", str(free_port())])
    assert resumed.returncode in (0, 1), resumed.stderr[-3000:]
    assert resumed.stderr == ""
    assert "resuming from checkpoint-" in resumed.stdout
    assert [line["step"] for line in curve(out)] == [1, 2, 3, 4, 5, 6]
    assert (out / "adapter_model.safetensors").is_file()


# --- the configs, read back by accelerate, DeepSpeed and transformers -----------------------------------------
SHARDS = [
    ("ddp", "none"),
    ("zero2", "none"),
    ("zero2", "optimizer"),
    ("zero3", "none"),
    ("zero3", "optimizer"),
    ("zero3", "params"),
    ("fsdp", "none"),
    ("fsdp", "optimizer"),
    ("fsdp", "params"),
]


def launcher_environment(config_file: Path) -> tuple[Any, Any, dict[str, str]]:
    """What `accelerate launch --config_file F` makes of F: its parsed arguments, the ClusterConfig it loaded
    (`load_config_from_file`, inside `_validate_launch_command`) and the variables it sets for the processes."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    arguments = launch_command_parser().parse_args(["--config_file", str(config_file), "-m", launch.ENTRY, "x"])
    arguments, loaded, precision_from_config = _validate_launch_command(arguments)
    if arguments.use_deepspeed:  # as accelerate's launch_command does before its DeepSpeed launcher
        fields = list(loaded.deepspeed_config) + (["mixed_precision"] if precision_from_config else [])
        arguments.deepspeed_fields_from_accelerate_config = ",".join(fields)
        _, environment = prepare_deepspeed_cmd_env(arguments)
    else:
        environment = prepare_multi_gpu_env(arguments)
    return arguments, loaded, {key: value for key, value in environment.items() if os.environ.get(key) != value}


@pytest.mark.parametrize("nodes", [1, 2])
@pytest.mark.parametrize(("shard", "offload"), SHARDS)
def test_every_accelerate_config_is_what_accelerate_and_deepspeed_read(
    shard: str, offload: str, nodes: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
    from accelerate.utils import DeepSpeedPlugin, DistributedType, FullyShardedDataParallelPlugin

    settings = Settings(
        n_gpus=4, nodes=nodes, shard=shard, offload=offload, precision="bf16", micro_batch=2, grad_accum=4
    )
    config = TrainConfig(
        n_gpus=4, nodes=nodes, node_rank=nodes - 1, main_address="10.0.0.1" if nodes > 1 else None, main_port=29777
    )
    topology = Topology.of(config, on_cuda=True)
    written = distributed.write_configs(tmp_path, settings, config, topology)
    assert isinstance(load_config_from_file(str(written.accelerate_file)), ClusterConfig)

    arguments, loaded, environment = launcher_environment(written.accelerate_file)
    assert (loaded.num_processes, loaded.num_machines, loaded.machine_rank) == (4 * nodes, nodes, nodes - 1)
    assert arguments.nproc_per_node == "4"  # torchrun starts n_gpus processes on each node
    if nodes > 1:
        assert arguments.rdzv_endpoint == "10.0.0.1:29777" and arguments.nnodes == "2" and arguments.node_rank == 1
    for key, value in environment.items():
        monkeypatch.setenv(key, value)

    if shard == "ddp":
        assert loaded.distributed_type == DistributedType.MULTI_GPU and written.deepspeed_file is None
        assert environment["ACCELERATE_MIXED_PRECISION"] == "bf16"
        assert "ACCELERATE_USE_FSDP" not in environment and "ACCELERATE_USE_DEEPSPEED" not in environment
    elif shard == "fsdp":
        assert loaded.distributed_type == DistributedType.FSDP
        plugin = FullyShardedDataParallelPlugin()  # from the FSDP_* variables, as the Trainer's Accelerator does
        assert plugin.fsdp_version == 2
        assert (plugin.cpu_offload is not None and type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy") == (
            offload != "none"
        )
        assert "SHARDED_STATE_DICT" in str(plugin.state_dict_type)
    else:
        assert loaded.distributed_type == DistributedType.DEEPSPEED
        plugin = DeepSpeedPlugin()  # from ACCELERATE_DEEPSPEED_CONFIG_FILE, refusing fields set twice
        zero = plugin.hf_ds_config.config["zero_optimization"]
        assert plugin.zero_stage == (3 if shard == "zero3" else 2)
        assert ("offload_optimizer" in zero) == (offload != "none")
        assert ("offload_param" in zero) == (offload == "params")
        check_deepspeed_json(written.deepspeed_file, settings, config, topology, monkeypatch)


def check_deepspeed_json(
    path: Path | None, settings: Settings, config: TrainConfig, topology: Topology, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DeepSpeed's own config class takes the JSON for this many processes, and transformers' DeepSpeed
    integration finds it agrees with the Trainer's arguments (a written value that differs is refused there)."""
    deepspeed_config = pytest.importorskip("deepspeed.runtime.config")  # the `multi` extra (make install has it)
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    from lorafit.train import hf_args

    assert path is not None
    data = json.loads(path.read_text())

    class DataParallel:  # the process group DeepSpeed would find at initialize
        @staticmethod
        def get_data_parallel_world_size() -> int:
            return topology.world_size

    monkeypatch.setattr(deepspeed_config.dist, "get_rank", lambda: 0)
    read = deepspeed_config.DeepSpeedConfig(str(path), mpu=DataParallel())
    assert read.train_micro_batch_size_per_gpu == settings.micro_batch
    assert read.gradient_accumulation_steps == settings.grad_accum // topology.nodes
    assert read.train_batch_size == settings.effective_batch  # batch_size: micro_batch x grad_accum x n_gpus
    assert read.zero_optimization_stage == (3 if settings.shard == "zero3" else 2)
    assert read.bfloat16_config.enabled and read.gradient_clipping == config.max_grad_norm
    offload = read.zero_config.offload_optimizer
    assert (offload is not None and offload.device == "cpu") == (settings.offload != "none")
    # the buckets DeepSpeed allocates whole are the ones the estimate counts (memory.communication_buffer_bytes)
    from lorafit import memory

    assert read.zero_config.reduce_bucket_size == memory.DEEPSPEED_BUCKET_ELEMENTS

    monkeypatch.setattr(TrainingArguments, "world_size", property(lambda self: topology.world_size))
    arguments = TrainingArguments(
        **hf_args.training_kwargs(config, settings, output_dir="unused", on_cuda=False, eval_steps=None)
    )
    integration = HfTrainerDeepSpeedConfig(data)
    integration.trainer_config_process(arguments)
    assert not integration.mismatches, integration.mismatches


def test_cpu_processes_get_a_data_parallel_config_and_say_so() -> None:
    from accelerate.commands.config.config_args import ClusterConfig

    settings = Settings(n_gpus=2, shard="zero3", offload="params", precision="fp32", micro_batch=8, grad_accum=1)
    topology = Topology(n_gpus=2, on_cuda=False)
    assert distributed.cpu_note(settings, topology) == (
        "no GPU: 2 CPU processes over gloo (DDP); sharding needs GPUs and is not applied"
    )
    data = distributed.accelerate_config(distributed.cpu_settings(settings), topology)
    assert (data["distributed_type"], data["use_cpu"], data["num_processes"]) == ("MULTI_GPU", True, 2)
    assert ClusterConfig(**data).use_cpu


def test_offloads_the_shard_does_not_have_are_refused() -> None:
    # the rules of lorafit.options refuse them for every command, before any config is written
    from lorafit.options import validate

    with pytest.raises(InvalidConfig, match="offload optimizer: shard ddp .* use shard zero2"):
        validate("train", {"n_gpus": 2, "shard": "ddp", "offload": "optimizer"})
    with pytest.raises(InvalidConfig, match="ZeRO-2 keeps every weight on every GPU; use shard zero3"):
        validate("train", {"n_gpus": 2, "shard": "zero2", "offload": "params"})


def test_a_train_config_with_an_offload_writes_the_engines_offload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`offload` is a train setting too: pinned in the config, it reaches the DeepSpeed JSON that DeepSpeed's
    own config class reads (offload_optimizer / offload_param on cpu)."""
    deepspeed_config = pytest.importorskip("deepspeed.runtime.config")
    config = TrainConfig(n_gpus=2, shard="zero3", offload="params", micro_batch=1, grad_accum=2)
    settings = Settings(precision="bf16", **config.pinned_settings())
    assert settings.offload == "params"
    written = distributed.write_configs(tmp_path, settings, config, Topology.of(config, on_cuda=True))
    assert written.deepspeed_file is not None
    zero = json.loads(written.deepspeed_file.read_text())["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == zero["offload_param"]["device"] == "cpu"

    class DataParallel:
        @staticmethod
        def get_data_parallel_world_size() -> int:
            return 2

    monkeypatch.setattr(deepspeed_config.dist, "get_rank", lambda: 0)
    read = deepspeed_config.DeepSpeedConfig(str(written.deepspeed_file), mpu=DataParallel())
    assert read.zero_config.offload_param.device == "cpu" and read.zero_config.offload_optimizer.device == "cpu"


def test_qlora_sharded_by_fsdp_or_zero3_stores_its_4_bit_weights_as_floats() -> None:
    from lorafit.train import hf_args

    def storage(**values: Any) -> str:
        return hf_args.bnb_kwargs(Settings(method="qlora", precision="bf16", **values))["bnb_4bit_quant_storage"]

    assert storage() == storage(n_gpus=2, shard="ddp") == storage(n_gpus=2, shard="zero2") == "uint8"
    assert storage(n_gpus=2, shard="fsdp") == storage(n_gpus=2, shard="zero3") == "bfloat16"


def test_several_nodes_share_the_accumulation() -> None:
    """batch_size = micro_batch x grad_accum x n_gpus; over 2 nodes each process runs half the accumulation."""
    settings = distributed.split_over_nodes(Settings(n_gpus=8, micro_batch=2, grad_accum=1), nodes=2)
    assert (settings.micro_batch, settings.grad_accum) == (1, 2)  # 1 x 2/2 per process x 16 processes = 16
    assert distributed.split_over_nodes(Settings(n_gpus=8, micro_batch=2, grad_accum=4), nodes=2).grad_accum == 4
    with pytest.raises(InvalidConfig, match="use a batch_size that is a multiple of 16"):
        distributed.split_over_nodes(Settings(n_gpus=8, micro_batch=1, grad_accum=1), nodes=2)


def test_a_dry_run_shows_the_accelerate_config_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    code, text, err = run_cli(
        ["train", "--demo", "--n-gpus", "2", "--shard", "zero3", "--dry-run", "--output-dir", str(out)], capsys
    )
    assert (code, err) == (0, "")
    assert "no GPU: 2 CPU processes over gloo (DDP); sharding needs GPUs and is not applied" in text
    assert "distributed_type: MULTI_GPU" in text and "num_processes: 2" in text
    assert "nothing was written" in text and not out.exists()


# --- bad input: one line, exit 2, nothing written ---------------------------------------------------------------
A100 = ("NVIDIA A100-SXM4-80GB", 85_899_345_920)
A100_40 = ("NVIDIA A100-SXM4-40GB", 42_949_672_960)
BAD_INPUTS = {
    "more GPUs than visible": (["--n-gpus", "4"], [A100, A100], "n_gpus 4: this machine has 2 GPUs"),
    "mismatched GPUs": (
        ["--n-gpus", "2"],
        [A100, A100_40, A100],
        "the GPUs differ (NVIDIA A100-SXM4-40GB 40 GiB and NVIDIA A100-SXM4-80GB 80 GiB)",
    ),
    "node rank past the nodes": (
        ["--n-gpus", "2", "--nodes", "2", "--node-rank", "2", "--main-address", "10.0.0.1"],
        [],
        "node_rank 2: the 2 nodes are ranked 0 to 1; use --node-rank 1",
    ),
    "node rank on one node": (["--n-gpus", "2", "--node-rank", "1"], [], "use --node-rank 0 on one node"),
    "several nodes without an address": (["--n-gpus", "2", "--nodes", "2"], [], "pass --main-address"),
    "shard on one GPU": (["--shard", "fsdp"], [], "shard fsdp needs n_gpus > 1"),
}
SUGGESTIONS = {"more GPUs than visible": "use --n-gpus 2", "mismatched GPUs": "CUDA_VISIBLE_DEVICES=0,2 --n-gpus 2"}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_multi_gpu_input_is_one_line_and_exit_2(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    flags, gpus, expected = BAD_INPUTS[case]
    if gpus:  # a CUDA machine with these GPUs
        import torch

        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(distributed, "visible_gpus", lambda: gpus)
    out = tmp_path / "run"
    code, _, err = run_cli(["train", "--demo", "--output-dir", str(out), *flags], capsys)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("lorafit: error:"), err
    assert expected in err
    assert SUGGESTIONS.get(case, "") in err
    assert not out.exists()


# --- where the base is loaded, and the host RAM it takes ---------------------------------------------------
@pytest.mark.parametrize(
    ("settings", "device_map"),
    [
        # FSDP over several GPUs: the 4-bit base in host memory, fully_shard moves it a layer at a time
        (Settings(method="qlora", n_gpus=2, shard="fsdp"), {"": "cpu"}),
        # ZeRO-3 moves a model it did not build whole to the GPU anyway: quantised there directly
        (Settings(method="qlora", n_gpus=2, shard="zero3"), {"": 3}),
        (Settings(method="qlora"), {"": 3}),
        (Settings(method="qlora", n_gpus=2, shard="ddp"), {"": 3}),
        # a 16-bit base is built in host memory and moved by the Trainer or the engine
        (Settings(method="lora", n_gpus=2, shard="fsdp"), None),
    ],
)
def test_a_quantised_base_is_loaded_where_the_estimate_says(settings: Settings, device_map: Any) -> None:
    from lorafit import memory, models
    from lorafit.train import recipe

    assert recipe.load_device_map(settings, gpu=3) == device_map
    assert recipe.load_device_map(settings, gpu=None) is None  # no GPU: everything is in host memory
    spec = models.resolve("llama-2-7b")
    runtime = memory.stack_runtime(settings)
    loading_on_gpu = memory.gpu_loading_bytes(spec, settings, runtime)
    assert memory.host_loads_the_base(settings, runtime) == (device_map == {"": "cpu"})
    if settings.quant != "none" and settings.shard in ("zero3", "fsdp"):
        assert (loading_on_gpu > 0) == (device_map != {"": "cpu"})


def test_a_run_whose_loading_the_host_ram_cannot_hold_is_refused_before_it_starts() -> None:
    from lorafit import hardware, memory, models

    settings = Settings(method="qlora", n_gpus=4, shard="fsdp", grad_ckpt=True)
    estimate = memory.estimate(models.resolve("llama-2-70b"), settings, hardware.resolve("RTX 4090"))
    needed = estimate.host_ram_gib
    assert needed > 4 * 35  # four processes, each its packed copy of the 70B base
    topology = Topology(n_gpus=4)
    distributed.check_host_ram(estimate, needed + 1, topology)
    distributed.check_host_ram(estimate, None, topology)  # unknown: not refused
    with pytest.raises(InvalidConfig) as refused:
        distributed.check_host_ram(estimate, 64.0, topology)
    line = str(refused.value)
    assert "\n" not in line and f"{needed:.1f} GiB" in line and "64.0 GiB is free" in line
    assert "model loading" in line and "--n-gpus 2 on more machines" in line


RESUMES = [
    # saved, resumed, refused with
    (dict(n_gpus=2, shard="ddp"), dict(n_gpus=1, shard="none"), None),  # whole states load anywhere
    (dict(n_gpus=4, shard="fsdp"), dict(n_gpus=2, shard="fsdp"), None),  # torch.distributed.checkpoint reshards
    (dict(n_gpus=2, shard="zero3"), dict(n_gpus=4, shard="zero3"), "resume with --n-gpus 2"),
    (dict(n_gpus=2, shard="zero2", nodes=2), dict(n_gpus=2, shard="zero2"), "resume with --n-gpus 2 --nodes 2"),
    (dict(n_gpus=2, shard="zero3"), dict(n_gpus=1, shard="none"), "resume with --shard zero3 --n-gpus 2"),
    # ZeRO-Offload on one GPU is DeepSpeed too
    (
        dict(n_gpus=1, shard="zero2", offload="optimizer"),
        dict(n_gpus=1, shard="none"),
        "--offload optimizer --n-gpus 1",
    ),
    (dict(n_gpus=2, shard="fsdp"), dict(n_gpus=2, shard="zero3"), "resume with --shard fsdp"),
    (dict(n_gpus=2, shard="ddp"), dict(n_gpus=2, shard="fsdp"), "resume with --shard ddp"),
]


@pytest.mark.parametrize(("saved", "resumed", "refused"), RESUMES)
def test_a_checkpoint_resumes_on_other_gpus_where_its_engine_can_load_it(
    saved: dict[str, Any], resumed: dict[str, Any], refused: str | None
) -> None:
    def settings(values: dict[str, Any]) -> Settings:
        return Settings(method="qlora", **values)

    checkpoint = Path("run/checkpoint-40")
    if refused is None:
        distributed.check_resume(settings(saved), settings(resumed), checkpoint)
        return
    with pytest.raises(InvalidConfig) as error:
        distributed.check_resume(settings(saved), settings(resumed), checkpoint)
    line = str(error.value)
    assert "\n" not in line and line.startswith("resume: checkpoint-40 holds") and refused in line
