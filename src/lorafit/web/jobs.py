"""`lorafit serve`'s GPU comparisons: each runs once per request, off the request loop, its rows kept as they come.

A comparison plans every catalog card (seconds, where a plan takes a few hundredths), so it runs in its own
thread pool: a plan request never queues behind one. It is kept by the validated request it answers
(`Comparisons.key`), so a page that changes only its GPU, its price cap or its language reads the same rows
again, and a second page asking the same question while the first is being answered reads the same job.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from lorafit.schema import Plan, PlanRequest


def workers() -> int:
    """The cores this process may run on: the size of each worker pool."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except AttributeError:  # macOS and Windows have no affinity mask
        return max(os.cpu_count() or 1, 1)


@dataclass
class Comparison:
    """One comparison's plans in the order they were planned; `error` ({"error", "field"}) where it failed."""

    plans: list[Plan] = field(default_factory=list)
    done: bool = False
    error: dict[str, Any] | None = None


class Comparisons:
    """The comparisons running or done, the last `keep` of them, by the request they answer."""

    def __init__(self, keep: int = 32) -> None:
        self.pool = ThreadPoolExecutor(max_workers=workers(), thread_name_prefix="lorafit-compare")
        self.keep = keep
        self.jobs: OrderedDict[str, Comparison] = OrderedDict()
        self.lock = threading.Lock()

    @staticmethod
    def key(request: PlanRequest) -> str:
        """What the comparison depends on: the validated request (the model, the data's token profile, the
        fixed settings and the job's), which holds no GPU and no price cap (the cap only picks the cheapest)."""
        return request.model_dump_json()

    def start(
        self, request: PlanRequest, rows: Callable[[], Iterable[Plan]], failed: Callable[[Exception], dict]
    ) -> Comparison:
        """The comparison of `request`: the one kept, else a new one planning `rows()` in the pool; `failed`
        turns an error into the page's {"error", "field"}."""
        key = self.key(request)
        with self.lock:
            if key in self.jobs:
                self.jobs.move_to_end(key)
                return self.jobs[key]
            job = self.jobs[key] = Comparison()
            while len(self.jobs) > self.keep:
                self.jobs.popitem(last=False)
        self.pool.submit(self._run, key, job, rows, failed)
        return job

    def _run(
        self, key: str, job: Comparison, rows: Callable[[], Iterable[Plan]], failed: Callable[[Exception], dict]
    ) -> None:
        try:
            for plan in rows():
                job.plans.append(plan)
        except Exception as error:  # kept for the pages reading it, not for the next asking
            try:
                job.error = failed(error)
            except Exception:
                line = str(error).splitlines()[0] if str(error) else ""
                job.error = {
                    "error": f"internal error ({type(error).__name__}: {line}); please report it",
                    "field": None,
                }
            with self.lock:
                if self.jobs.get(key) is job:
                    del self.jobs[key]
        finally:
            job.done = True

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
