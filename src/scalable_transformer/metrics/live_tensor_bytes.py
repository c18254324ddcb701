"""Live tensor bytes per rank, peak over the first training steps: what the planner predicts.

GPU: `torch.cuda.max_memory_allocated` (the caching allocator counts every tensor byte), which the
trainer already records per log interval (train/outputs.py takes it). CPU has no allocator counter, so
this tracker runs torch.profiler with
`profile_memory=True`: c10's CPU allocator then reports every allocation and free with its address and
size, and the peak is the largest sum of live blocks from the first step's start on, replayed by
address (`peak_from_profile` says why not the events' own running total). Chosen over a TorchDispatchMode that
follows op outputs: the profiler sees every allocation (temporaries inside kernels, the autograd
engine's gradient buffers, collective buffers) where a dispatch mode sees op outputs only, and it needs
no bookkeeping of storage lifetimes in Python. Its cost (first start 5-10 s, then a few microseconds
per op) is why it is opt-in (`logging.track_tensor_bytes`) and why it stops after `TRACKED_STEPS`
steps, which reach the steady state (optimizer state exists from the end of step 1): the steps timed
for throughput (after `logging.warmup_iters`, default 3) run without it.

Profiling starts before the model is built, so parameters, gradients and optimizer state are counted;
tensors made earlier (datasets, tokenizer) are not, and neither are their frees.
"""

from __future__ import annotations

import bisect
import logging
from typing import Any, NamedTuple

import torch
from torch.profiler import ProfilerActivity, profile

from ..parallel.torch_compat import profiler_allocation_tag

TRACKED_STEPS = 3
_MARK = "stx::tensor-bytes-window"
_log = logging.getLogger(__name__)


class TensorBytesTracker:
    """CPU: start() before the model is built, step_started(i) before step i (1-based), peak() at
    the end."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._profiler: Any = None
        self._peak: int | None = None
        self._failed: str | None = None

    def start(self) -> None:
        try:
            self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._profiler.start()
        except Exception as e:  # a measuring problem is reported, never fatal
            self._failed = f"torch.profiler could not start: {e}"
            self._profiler = None

    def step_started(self, step: int) -> None:
        """Called before step `step` (1 = the first of this run)."""
        if self._profiler is None:
            return
        if step == 1:
            with torch.profiler.record_function(_MARK):
                pass
        elif step == TRACKED_STEPS + 1:
            self._finish()

    def _finish(self) -> None:
        prof, self._profiler = self._profiler, None
        try:
            prof.stop()
            self._peak = peak_from_profile(prof)
        except Exception as e:
            self._failed = f"reading the memory profile failed: {e}"

    def peak(self) -> int | None:
        """Peak live tensor bytes from the first step's start (None if not measured)."""
        if self._profiler is not None:
            self._finish()
        if self._failed:
            _log.warning("peak tensor bytes not measured: %s", self._failed)
        return self._peak


def peak_from_profile(prof: Any) -> int | None:
    """Peak live bytes after the window mark, replayed from the CPU allocation events.

    Not the largest `total_allocated` the events carry: c10 reports an allocation or a free to the
    profiler only on threads the profiler tracks, and a collective's buffers are often freed on the
    process group's worker thread (gloo's) when it drops the finished work, after the caller dropped
    its own references; those frees never show, and the counter keeps them for good (measured on 2
    gloo ranks: 2-8 MB after 20 reduce-scatters, varying by rank and run). `replay_allocations` puts
    them back; see there."""
    allocation = profiler_allocation_tag()
    results = prof.profiler.kineto_results
    allocations: list[Allocation] = []
    worker_ends: list[tuple[int, int]] = []  # (thread, end) of every top-level event
    mark: int | None = None
    stack: list[tuple[Any, int | None]] = []
    for root in results.experimental_event_tree():
        worker_ends.append((root.start_tid, root.end_time_ns))
        stack.append((root, None))
    while stack:
        event, collective_end = stack.pop()
        if event.tag == allocation:
            fields = event.extra_fields
            if fields.device.type == "cpu":
                allocations.append(
                    Allocation(
                        event.start_time_ns,
                        int(fields.ptr),
                        int(fields.alloc_size),
                        event.start_tid,
                        collective_end,
                    )
                )
            continue
        if event.name == _MARK:
            mark = event.start_time_ns if mark is None else min(mark, event.start_time_ns)
        if collective_end is None and event.name.startswith(_COLLECTIVE_PREFIXES):
            collective_end = event.end_time_ns  # the outermost collective call
        stack.extend((child, collective_end) for child in event.children)
    if mark is None:
        return None
    return replay_allocations(allocations, worker_ends, mark)


# the ops of a collective call: c10d's ProcessGroup ops (c10d::allreduce_, c10d::_reduce_scatter_base_,
# ...) and the functional collectives that wrap them (_c10d_functional::all_reduce, ...)
_COLLECTIVE_PREFIXES = ("c10d::", "_c10d_functional::")


class Allocation(NamedTuple):
    """One CPU allocation event: size < 0 is a free. `collective_end`: the end of the collective call
    it happened in (None outside one)."""

    time: int
    address: int
    size: int
    thread: int
    collective_end: int | None = None


def replay_allocations(
    allocations: list[Allocation], worker_ends: list[tuple[int, int]], mark: int
) -> int | None:
    """Peak of the live bytes from `mark` on, replaying the allocation events with the frees the
    profiler cannot see put back.

    A block whose free never shows was freed on an untracked thread. Two rules date that free:
    - its address is allocated again while it is still marked live: it was freed before that;
    - it was allocated inside a collective call (a c10d ProcessGroup op or a functional collective:
      gloo's staging copies of the input, the collective's output): such a block dies when the last of
      the caller and the backend's worker drops it, and a free the profiler missed is the worker's,
      which drops its work when the work's event on the worker thread ends. It is taken as freed at the
      end of the first top-level event on another thread (`worker_ends`: (thread, end) of the
      top-level events) that ends after the collective call, the earliest such time (if no other
      thread has an event then, the first rule alone applies).
    Measured on 2-4 gloo ranks (tensor parallel with and without sequence parallelism, ZeRO-2 and -3):
    of the collective blocks whose address came back, none came back before that time; the blocks
    allocated elsewhere have their frees seen. A free missed by both rules keeps its block counted."""
    events = sorted(allocations, key=lambda a: a.time)
    # pass 1: which blocks are never seen freed (their address reused while live, or live at the end)
    live: dict[int, int] = {}
    unseen: list[int] = []
    for i, a in enumerate(events):
        if a.size > 0:
            if a.address in live:
                unseen.append(live.pop(a.address))
            live[a.address] = i
        elif a.size < 0:
            live.pop(a.address, None)
    unseen.extend(live.values())
    # the worker's release of the collective blocks among them
    ends: dict[int, list[int]] = {}
    for thread, end in worker_ends:
        ends.setdefault(thread, []).append(end)
    for thread_ends in ends.values():
        thread_ends.sort()
    releases: list[tuple[int, int]] = []  # (time, block index)
    for i in unseen:
        a = events[i]
        if a.collective_end is None:
            continue
        after = [
            thread_ends[j]
            for thread, thread_ends in ends.items()
            if thread != a.thread
            and (j := bisect.bisect_left(thread_ends, a.collective_end)) < len(thread_ends)
        ]
        if after:
            releases.append((min(after), i))
    releases.sort()
    # pass 2: the replay, a release freeing its block if that block is still the one at its address
    at: dict[int, int] = {}  # address -> index of the live block there
    total, peak, r = 0, None, 0
    for i, a in enumerate(events):
        while r < len(releases) and releases[r][0] <= a.time:
            block = events[releases[r][1]]
            if at.get(block.address) == releases[r][1]:
                del at[block.address]
                total -= block.size
            r += 1
        if a.size > 0:
            old = at.pop(a.address, None)
            if old is not None:
                total -= events[old].size  # freed out of sight before now
            at[a.address] = i
            total += a.size
        elif a.size < 0:
            old = at.pop(a.address, None)
            if old is not None:
                total -= events[old].size
        if a.time >= mark and (peak is None or total > peak):
            peak = total
    return peak
