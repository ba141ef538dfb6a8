"""One training process among several: `python -m lorafit.train.worker LAUNCH_DIR`, as `accelerate launch`
(started by `launch.launch`) runs it. It joins the process group, reads the launcher's config and plan, and runs
`recipe.run` (the demo: `demo.train_demo`) as this rank.

torch and accelerate are imported inside the functions.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from lorafit.errors import LorafitError
from lorafit.files import write_atomic
from lorafit.options import TrainConfig
from lorafit.schema import Plan
from lorafit.train import build, demo, recipe
from lorafit.train.distributed import Processes
from lorafit.train.launch import ERROR_PREFIX, PAYLOAD


def join() -> Processes:
    """Join the process group accelerate's launcher set up (NCCL on GPUs, gloo on the CPU), on this process's GPU."""
    import torch
    from accelerate import PartialState

    state = PartialState(cpu=not torch.cuda.is_available())
    return Processes(rank=state.process_index, world_size=state.num_processes, local_rank=state.local_process_index)


def main(argv: list[str] | None = None) -> None:
    """One training process: `python -m lorafit.train.worker LAUNCH_DIR`, as `accelerate launch` starts it."""
    launch_dir = Path((sys.argv[1:] if argv is None else argv)[0])
    payload = json.loads((launch_dir / PAYLOAD).read_text())
    build.quiet_libraries()
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
    config = TrainConfig.model_validate(payload["config"])
    plan = Plan.model_validate(payload["plan"])
    if payload["demo"]:
        learned = demo.train_demo(
            config, resume=payload["resume"], overwrite=False, console=console, processes=processes, plan=plan
        )
        return 0 if learned else 1
    recipe.run(config, resume=payload["resume"], console=console, processes=processes, plan=plan)
    return 0


if __name__ == "__main__":
    main()
