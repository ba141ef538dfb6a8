"""One training process among several: `python -m lorafit.train.worker LAUNCH_DIR`, as `accelerate launch`
(started by `launch.launch`) runs it. It joins the process group, reads the launcher's config and plan, and runs
`recipe.run` (the demo: `demo.train_demo`) as this rank; it stops with its launcher, however that ends.

torch and accelerate are imported inside the functions.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from lorafit.errors import LorafitError
from lorafit.files import write_atomic
from lorafit.options import TrainConfig
from lorafit.schema import Plan
from lorafit.train import build, demo, recipe
from lorafit.train.distributed import Processes
from lorafit.train.launch import ERROR_PREFIX, LAUNCHER_PID, PAYLOAD

PR_SET_PDEATHSIG = 1  # linux/prctl.h: the signal this process gets when its parent ends
WATCH_SECONDS = 0.5  # how often a process without prctl checks its parent


def die_with_launcher() -> None:
    """End this process when the launcher that started it ends. A launcher killed outright (SIGKILL, the
    kernel's out-of-memory killer) cannot stop its workers; left running, they would go on writing a run
    folder that is no longer held, while a rerun opens it. On Linux the kernel sends SIGKILL when the parent
    (the launcher: torchrun's agent runs inside it) ends, by prctl PR_SET_PDEATHSIG; elsewhere a thread
    watches for the parent to change. A launcher that ended before this ran ends this process now."""
    parent = os.getppid()
    if not _parent_death_signal(signal.SIGKILL):
        threading.Thread(target=_watch_parent, args=(parent,), name="lorafit-launcher-watch", daemon=True).start()
    launcher = os.environ.get(LAUNCHER_PID, "")
    if launcher.isdigit() and not _running(int(launcher)):
        os.kill(os.getpid(), signal.SIGKILL)


def _parent_death_signal(signal_number: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signal_number), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(WATCH_SECONDS)
    os.kill(os.getpid(), signal.SIGKILL)


def _running(pid: int) -> bool:
    """Whether process `pid` runs: a zombie (ended, not yet reaped by its own parent) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc: it exists
    return state not in ("Z", "X")


def join() -> Processes:
    """Join the process group accelerate's launcher set up (NCCL on GPUs, gloo on the CPU), on this process's GPU."""
    import torch
    from accelerate import PartialState

    state = PartialState(cpu=not torch.cuda.is_available())
    return Processes(rank=state.process_index, world_size=state.num_processes, local_rank=state.local_process_index)


def main(argv: list[str] | None = None) -> None:
    """One training process: `python -m lorafit.train.worker LAUNCH_DIR`, as `accelerate launch` starts it."""
    die_with_launcher()
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
