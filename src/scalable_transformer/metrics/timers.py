"""Megatron-style named phase timers.

    timers = Timers(sync_fn=torch.cuda.synchronize)   # None on CPU
    timers("forward-compute").start(); ...; timers("forward-compute").stop()
    with timers("optimizer"):
        optimizer.step()
    timers.elapsed_ms(["forward-compute", "optimizer"], normalizer=log_interval)

Levels (Megatron's `--timing-log-level`, our `logging.timing_log_level`): a timer asked for with a
level above the registry's is a shared no-op, so a disabled timer costs one comparison. 0: no phase
timers (the iteration time is measured apart); 1: the disjoint phases of a step; 2: also the nested
ones (optimizer parts, pipeline waits).

Kernels run asynchronously on GPUs, so without a device sync a phase's wall time measures how long
it took to *launch* work (enqueue time), not to run it; `sync_fn` (`logging.timers_sync`) is called
at every start and stop so that per-phase numbers are device times, at the cost of a host
synchronization per call and of the overlap between phases. It is off by default, as in Megatron and
torchtitan: the step then never waits on the device for a timer.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any

import torch.distributed as dist

from ..parallel.distributed import all_reduce_floats


class _Timer:
    def __init__(self, name: str, sync_fn: Callable[[], None] | None, clock: Callable[[], float]) -> None:
        self.name = name
        self._sync_fn = sync_fn
        self._clock = clock
        self._elapsed = 0.0  # seconds accumulated by finished start/stop intervals
        self._started_at: float | None = None

    @property
    def running(self) -> bool:
        return self._started_at is not None

    def start(self) -> _Timer:
        if self._started_at is not None:
            raise RuntimeError(f"timer {self.name!r} is already running")
        if self._sync_fn is not None:
            self._sync_fn()
        self._started_at = self._clock()
        return self

    def stop(self) -> _Timer:
        if self._started_at is None:
            raise RuntimeError(f"timer {self.name!r} is not running")
        if self._sync_fn is not None:
            self._sync_fn()
        self._elapsed += self._clock() - self._started_at
        self._started_at = None
        return self

    def elapsed(self, reset: bool = True) -> float:
        """Accumulated seconds, including the running interval so far (a running timer keeps running)."""
        total = self._elapsed
        if self._started_at is not None:
            now = self._clock()
            total += now - self._started_at
            if reset:
                self._started_at = now
        if reset:
            self._elapsed = 0.0
        return total

    def __enter__(self) -> _Timer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class _NoTimer:
    """What a timer above the registry's level is: start, stop and `with` do nothing."""

    running = False

    def start(self) -> _NoTimer:
        return self

    def stop(self) -> _NoTimer:
        return self

    def __enter__(self) -> _NoTimer:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


NO_TIMER = _NoTimer()
MAX_LEVEL = 2


class Timers:
    """A registry of named timers; `timers(name)` creates the timer on first use; `timers(name, 2)`
    is a no-op unless the registry's level is 2."""

    def __init__(
        self,
        sync_fn: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        level: int = MAX_LEVEL,
    ) -> None:
        if not 0 <= level <= MAX_LEVEL:
            raise ValueError(f"timing level must be 0..{MAX_LEVEL}, got {level}")
        self._sync_fn = sync_fn
        self._clock = clock  # injectable for tests; seconds
        self.level = level
        self._timers: dict[str, _Timer] = {}

    def __call__(self, name: str, level: int = 1) -> _Timer | _NoTimer:
        if level > self.level:
            return NO_TIMER
        if name not in self._timers:
            self._timers[name] = _Timer(name, self._sync_fn, self._clock)
        return self._timers[name]

    def add(self, name: str, seconds: float, level: int = 1) -> None:
        """Add `seconds` measured elsewhere to timer `name` (created on first use), e.g. the part of a
        backward pass that waited for gradient communication; nothing above the registry's level."""
        timer = self(name, level)
        if isinstance(timer, _Timer):
            timer._elapsed += seconds

    def names(self) -> list[str]:
        """Timer names in first-use order."""
        return list(self._timers)

    def elapsed_ms(
        self, names: Iterable[str] | None = None, normalizer: float = 1, reset: bool = True
    ) -> dict[str, float]:
        """Milliseconds per `normalizer` (e.g. iterations in the logging interval) for each named timer
        (all timers when names is None), accumulated since the last reset; reset zeroes them."""
        if not normalizer > 0:
            raise ValueError(f"normalizer must be > 0, got {normalizer}")
        selected = list(self._timers) if names is None else list(names)
        unknown = [n for n in selected if n not in self._timers]
        if unknown:
            raise KeyError(f"unknown timer(s) {unknown}; known: {list(self._timers)}")
        return {n: self._timers[n].elapsed(reset=reset) * 1000.0 / normalizer for n in selected}


def minmax_over_ranks(
    elapsed: dict[str, float], names: Iterable[str], group: Any = None
) -> dict[str, tuple[float, float]]:
    """(min, max) over the ranks of `group` of each timer in `elapsed` (Megatron's `minmax` timer
    option): a straggler or an unbalanced pipeline stage shows as a wide spread. `names` is the same
    list on every rank (a rank that did not run a phase sends nothing for it). One all-reduce; every
    rank of the group must call it."""
    names = list(names)
    absent = -math.inf
    # max(x) and max(-x) = -min(x) in one MAX all-reduce; absent phases contribute -inf to both
    values = [elapsed.get(n, absent) for n in names] + [
        -elapsed[n] if n in elapsed else absent for n in names
    ]
    reduced = all_reduce_floats(values, group, op=_max_op())
    out = {}
    for i, name in enumerate(names):
        high, neg_low = reduced[i], reduced[len(names) + i]
        if math.isfinite(high):
            out[name] = (-neg_low, high)
    return out


def _max_op() -> Any:
    return dist.ReduceOp.MAX


def format_ms(elapsed: dict[str, float]) -> str:
    """Megatron's log line: 'time (ms) | forward-compute: 43.42 | optimizer: 24.05'."""
    return "time (ms) | " + " | ".join(f"{name}: {ms:.2f}" for name, ms in elapsed.items())
