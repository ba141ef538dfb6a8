"""Several processes: `lorafit train ... --n-gpus N` (and `--nodes M --node-rank R --main-address A`) checks the
machine, holds and opens the run folder and makes the plan as a one-process run does (`setup.prepare`), writes
`accelerate_config.yaml` (and, for ZeRO, `deepspeed.json`) into the run folder, prints it, and runs
`accelerate launch --config_file <it> -m lorafit.train.worker <launch folder>` in this process. Every worker
runs `recipe.run` with the launcher's plan; rank 0 alone writes the run folder, which this process holds (the
lock) until the workers are done. A worker dies with this process (`worker.die_with_launcher`).

torch and accelerate are imported inside the functions.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from lorafit import hardware
from lorafit.errors import TrainError
from lorafit.files import write_atomic
from lorafit.train import build, checkpoints, distributed, runfolder, setup
from lorafit.train.distributed import Topology
from lorafit.train.setup import Role, RunRequest, SetUp

if TYPE_CHECKING:
    from rich.console import Console

    from lorafit.options import TrainConfig

ENTRY = "lorafit.train.worker"  # the module `accelerate launch -m` runs in every process
PAYLOAD = "launch.json"  # in the launch folder: the config, the plan and the switches every worker runs
ERROR_PREFIX = "error-rank"  # in the launch folder: the one line a worker stopped with
LAUNCHER_PID = "LORAFIT_LAUNCHER_PID"  # in a worker's environment: the process it dies with


def needs_launch(config: TrainConfig) -> bool:
    """Several processes asked for, and this is not already one of them."""
    return (config.n_gpus > 1 or config.nodes > 1) and not in_worker()


def in_worker() -> bool:
    return "LOCAL_RANK" in os.environ and os.environ.get("LORAFIT_LAUNCHED") == "1"


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
    """Check the machines, hold and open the run folder and plan (`setup.prepare`, as `recipe.run` does), write
    and print the accelerate config, and run the workers through `accelerate launch`. Returns the exit code of
    the run."""
    build.quiet_libraries()
    import torch

    on_cuda = torch.cuda.is_available()
    topology = Topology.of(config, on_cuda)
    distributed.check_topology(topology, distributed.visible_gpus() if on_cuda else [])
    request = RunRequest(config, resume=resume, overwrite=overwrite, build_model=build_model)
    if dry_run:
        _dry_run(request, console=console)
        return 0
    role = Role.LAUNCHER if topology.node_rank == 0 else Role.OTHER_NODE
    with contextlib.ExitStack() as held:  # node 0 holds the run folder until its workers are done
        prepared = _prepare(request, role=role, console=console, held=held)
        if prepared is None:
            return 0  # finished: nothing to train
        return _launch(prepared, topology, demo, console)


@runfolder.one_line_run_errors
def _prepare(request: RunRequest, *, role: Role, console: Console, held: contextlib.ExitStack) -> SetUp | None:
    """`setup.prepare` for the launcher: a failed write or Ctrl-C there ends as it does in `recipe.run`."""
    return setup.prepare(request, role, console=console, held=held)


@runfolder.one_line_run_errors
def _dry_run(request: RunRequest, *, console: Console) -> None:
    setup.dry_run(request, console=console)


def _launch(prepared: SetUp, topology: Topology, demo: bool, console: Console) -> int:
    """Write and print the configs, run `accelerate launch` and turn how the workers ended into an exit code."""
    config, plan = prepared.config, prepared.plan
    if topology.on_cuda:
        distributed.check_host_ram(plan.estimate, hardware.available_ram_gib(), topology)
    else:
        console.print(distributed.cpu_note(prepared.asked, topology))
    launch_dir = Path(tempfile.mkdtemp(prefix="lorafit-launch-"))
    try:
        # node 0 keeps the config with the run; another node's run folder is not written (rank 0 writes it)
        folder = prepared.output_dir if topology.node_rank == 0 else launch_dir
        written = distributed.write_configs(folder, plan.settings, config, topology)
        payload = {
            "config": config.model_dump(mode="json"),
            "plan": json.loads(plan.to_json()),
            "resume": prepared.request.resume,
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
            name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
            hint = checkpoints.resume_hint(prepared.output_dir)
            raise TrainError(f"a training process was killed ({name}); {hint}")
        if code not in (0, 1, 130):
            raise TrainError(f"a training process stopped with exit code {code}; its messages are above")
        return code
    finally:
        shutil.rmtree(launch_dir, ignore_errors=True)


def _accelerate_launch(config_file: Path, launch_dir: Path, topology: Topology) -> int:
    """`accelerate launch --config_file F -m lorafit.train.worker DIR`, run in this process, so that a failed
    worker comes back as its exit code (its one line is in DIR) instead of torchrun's report."""
    from accelerate.commands.launch import launch_command, launch_command_parser

    arguments = launch_command_parser().parse_args(["--config_file", str(config_file), "-m", ENTRY, str(launch_dir)])
    threads = max(1, (os.cpu_count() or 1) // topology.n_gpus)
    environment = {
        "LORAFIT_LAUNCHED": "1",
        LAUNCHER_PID: str(os.getpid()),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads)),
    }
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
