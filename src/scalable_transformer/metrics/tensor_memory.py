"""Live tensor bytes per rank, peak over the first training steps: what the planner predicts.

GPU: `torch.cuda.max_memory_allocated` (the caching allocator counts every tensor byte), which the
trainer already records per log interval (train/run.py takes it). CPU has no allocator counter, so
this tracker runs torch.profiler with
`profile_memory=True`: c10's CPU allocator then reports every allocation and free with the running
total of bytes allocated since profiling started (`total_allocated` of each allocation event), and the
peak is the largest total seen from the first step's start on. Chosen over a TorchDispatchMode that
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

import logging
from typing import Any

import torch

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
            from torch.profiler import ProfilerActivity, profile

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
    """Largest `total_allocated` over the CPU allocation events after the window mark."""
    from torch._C._profiler import _EventType

    results = prof.profiler.kineto_results
    allocations: list[tuple[int, int]] = []
    mark: int | None = None
    stack = list(results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.tag == _EventType.Allocation:
            fields = event.extra_fields
            if fields.device.type == "cpu":
                allocations.append((event.start_time_ns, int(fields.total_allocated)))
        elif event.name == _MARK:
            mark = event.start_time_ns if mark is None else min(mark, event.start_time_ns)
        stack.extend(event.children)
    if mark is None:
        return None
    values = [total for when, total in allocations if when >= mark]
    return max(values) if values else None
