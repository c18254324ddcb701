"""Live tensor bytes on CPU (metrics/live_tensor_bytes.py): the peak counts what exists from the first
step on, including tensors freed before the end, and nothing allocated before the window."""

from __future__ import annotations

import torch

from scalable_transformer.metrics.live_tensor_bytes import TRACKED_STEPS, TensorBytesTracker


def test_cpu_tracker_sees_the_peak_of_the_window() -> None:
    tracker = TensorBytesTracker(torch.device("cpu"))
    tracker.start()
    kept = torch.ones(2**20)  # 4 MiB, made before the window and alive through it
    before = torch.ones(4 * 2**20)  # 16 MiB, freed before the window: must not count
    del before
    tracker.step_started(1)
    transient = torch.ones(2 * 2**20)  # 8 MiB, freed inside the window
    del transient
    tracker.step_started(TRACKED_STEPS + 1)  # stops profiling
    after = torch.ones(8 * 2**20)  # 32 MiB after the window: must not count
    peak = tracker.peak()
    assert peak is not None
    # the running total counts what the profiler saw allocated: kept (4 MiB) + transient (8 MiB)
    assert 12 * 2**20 <= peak < 13 * 2**20, peak
    del kept, after
