"""The calibration job (`stx calibrate`): this process's place in it, the time budget of each section,
and how a point is timed (the median of its repeats: see calibrate/calibration.py's docstring).
"""

from __future__ import annotations

import contextlib
import os
import socket
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..parallel.distributed import env_world_size, init_distributed, shutdown_distributed

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


SECTIONS = ("gemm", "attention", "memory_bound", "model_layer", "collectives", "fsdp_unit", "tp_layer")


# seconds per section: the whole run stays under 3 minutes on 2 busy CPU cores with process startup
BUDGET_SECONDS = {
    "gemm": 40.0, "attention": 30.0, "memory_bound": 8.0, "model_layer": 8.0, "collectives": 40.0,
    "fsdp_unit": 15.0, "tp_layer": 15.0,
}  # fmt: skip


QUICK_BUDGET_SECONDS = {
    "gemm": 4.0, "attention": 3.0, "memory_bound": 1.5, "model_layer": 1.5, "collectives": 4.0,
    "fsdp_unit": 2.0, "tp_layer": 4.0,
}  # fmt: skip


# the FSDP unit point: this many blocks, each at most this many parameters (a GPU model's blocks are
# scaled down: the fixed cost per unit is what it measures, and plain + sharded copies must fit)
FSDP_UNITS = 4


FSDP_UNIT_MAX_PARAMS = 16 * 2**20


MAX_REPEATS = 20


COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")


MESSAGE_SIZES = tuple(4 * 2**10 * 4**i for i in range(9))  # 4 KiB .. 64 MiB, x4 apart


QUICK_MESSAGE_SIZES = (4 * 2**10, 256 * 2**10, 4 * 2**20)


@dataclass
class Job:
    """This process's place in the calibration job: its device (cuda:LOCAL_RANK, or cpu), rank, world
    size, each rank's host name, and the budgets it runs under (`quick`: a tenth). The helpers below
    combine figures over the default process group (or `group`); with one process they return them."""

    device: torch.device
    rank: int = 0
    world: int = 1
    quick: bool = False
    hosts: list[str] = field(default_factory=list)  # hostname per rank

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def budget(self, section: str) -> float:
        return (QUICK_BUDGET_SECONDS if self.quick else BUDGET_SECONDS)[section]

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def reduce(self, values: list[float], op: Any = None, group: Any = None) -> list[float]:
        """values combined over the ranks (of `group`): SUM by default, or dist.ReduceOp.MAX."""
        if self.world == 1:
            return list(values)
        where = self.device if self.cuda else torch.device("cpu")
        t = torch.tensor(values, dtype=torch.float64, device=where)
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=group)
        return t.tolist()

    def agree(self, go: bool, group: Any = None) -> bool:
        """True when every rank says go: the ranks take the same branch, so collectives stay matched."""
        return self.reduce([0.0 if go else 1.0], dist.ReduceOp.MAX, group)[0] == 0.0

    def mean(self, values: list[float]) -> list[float]:
        return [v / self.world for v in self.reduce(values)]


def median_seconds(job: Job, fn: Callable[[], Any], seconds: float, repeats: int = MAX_REPEATS) -> float:
    """Seconds of the median of up to `repeats` calls of fn within about `seconds`, at least 3 when
    they fit in it (after one warm-up call, not counted): CUDA events on a GPU, perf_counter on a CPU."""
    fn()
    job.sync()
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    for i in range(max(1, repeats)):
        if job.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            took = start.elapsed_time(end) / 1000
        else:
            t0 = time.perf_counter()
            fn()
            took = time.perf_counter() - t0
        times.append(took)
        # at least 3 calls unless one alone takes the time given: the median of 3 sets aside one
        # call that met a preemption
        if time.perf_counter() > deadline and (i >= 2 or took > seconds):
            break
    return statistics.median(times)


class Section:
    """A section's budget: `go()` before each point (agreed by all ranks), a progress line at the end."""

    def __init__(self, job: Job, name: str, points: int, say: Callable[[str], None]) -> None:
        self.job, self.name, self.points, self.say = job, name, max(1, points), say
        self.budget = job.budget(name)
        self.start = time.perf_counter()
        self.done = 0

    def per_point(self) -> float:
        """Seconds of repeats each point may spend: the budget left shared by the points left."""
        left = self.budget - (time.perf_counter() - self.start)
        return max(0.0, left) / max(1, self.points - self.done) * 0.8

    def go(self) -> bool:
        """Whether the next point runs: within budget on every rank (the first point always runs)."""
        within = self.done == 0 or time.perf_counter() - self.start < self.budget
        return self.job.agree(within)

    def finish(self, what: str) -> None:
        took = time.perf_counter() - self.start
        skipped = self.points - self.done
        note = f"; {skipped} point(s) skipped: budget spent" if skipped > 0 else ""
        self.say(f"calibrate: {self.name}: {what} in {took:.1f} s (budget {self.budget:.0f} s){note}")


def _tflops(flops: float, seconds: float) -> float:
    return _figure(flops / max(seconds, 1e-12) / 1e12)


def _figure(x: float) -> float:
    """x to 4 significant digits (a profile stays readable; timing noise is larger than that)."""
    return float(f"{x:.4g}")


@contextlib.contextmanager
def calibration_job(device: torch.device, quick: bool, timeout_minutes: float) -> Iterator[Job]:
    """The job this process belongs to (the launcher's RANK / WORLD_SIZE, see cli/calibrate.py), its
    process group started here and torn down on the way out (also after an error)."""

    world = env_world_size()
    created = init_distributed(device, timeout_minutes, needed=world > 1)
    try:
        job = Job(device, int(os.environ.get("RANK", "0")), world, quick)
        hosts: list[Any] = [None] * world
        if world > 1:
            dist.all_gather_object(hosts, socket.gethostname())
        else:
            hosts = [socket.gethostname()]
        job.hosts = [str(h) for h in hosts]
        yield job
    finally:
        shutdown_distributed(created)


def calibration_device() -> torch.device:
    """cuda:LOCAL_RANK where CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")
