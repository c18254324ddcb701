"""logging.profile_*: a torch.profiler window over iterations start..end (inclusive) on the selected
ranks, a Chrome trace per rank in <run dir>/profile/, optionally a CUDA memory snapshot, and at the end
the top-operator table with compute / communication / idle shares (metrics/trace_analysis.py).

Every rank leaves the window's iterations out of the throughput statistics (the profiler slows the
profiled ranks, and through the collectives the others): `History.excluded_iterations`.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from ..metrics.trace_analysis import analyze_trace, format_table
from ..parallel.torch_compat import (
    dump_cuda_memory_snapshot,
    record_cuda_memory_history,
    stop_cuda_memory_history,
)
from .trainer import Callback, History, StepResult, Trainer


class ProfileCallback(Callback):
    def __init__(self, start: int, end: int, ranks: list[int], memory: bool, out_dir: Path | None) -> None:
        self.start, self.end, self.ranks, self.memory = start, end, ranks, memory
        self.out_dir = out_dir
        self.profiler: Any = None
        self.analysis: dict[str, Any] | None = None
        self.snapshot: Path | None = None
        self.step_range: Any = None

    def on_step_start(self, trainer: Trainer) -> None:
        step = trainer.iteration + 1
        if self.start <= step <= self.end:
            trainer.history.excluded_iterations.add(step)
        if self.profiler is not None:
            self._open_step(trainer)
        if step != self.start or trainer.dims.rank not in self.ranks or self.out_dir is None:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if trainer.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            if self.memory:
                record_cuda_memory_history(max_entries=100_000)
        self.profiler = torch.profiler.profile(activities=activities, profile_memory=self.memory)
        self.profiler.__enter__()
        self._open_step(trainer)

    def _open_step(self, trainer: Trainer) -> None:
        # one `ProfilerStep#N` range per iteration, as profiler.step() names them, from the start of
        # this iteration's step to the end of its callbacks
        self.step_range = torch.autograd.profiler.record_function(f"ProfilerStep#{trainer.iteration + 1}")
        self.step_range.__enter__()

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        if self.profiler is None:
            return
        self.step_range.__exit__(None, None, None)
        if trainer.iteration < self.end:
            return
        profiler, self.profiler = self.profiler, None
        profiler.__exit__(None, None, None)
        assert self.out_dir is not None
        self.out_dir.mkdir(parents=True, exist_ok=True)
        rank = trainer.dims.rank
        trace = self.out_dir / f"trace_rank{rank}.json"
        profiler.export_chrome_trace(str(trace))
        if trainer.device.type == "cuda" and self.memory:
            self.snapshot = self.out_dir / f"memory_snapshot_rank{rank}.pickle"
            dump_cuda_memory_snapshot(self.snapshot)
            stop_cuda_memory_history()
        try:
            self.analysis = analyze_trace(trace)
        except (OSError, ValueError, KeyError) as e:  # a measuring problem is reported, never fatal
            self.analysis = {"trace": str(trace), "error": f"{type(e).__name__}: {e}"}

    def on_fit_end(self, trainer: Trainer, history: History) -> None:
        if self.profiler is not None:  # the run ended inside the window (exit_interval)
            with contextlib.suppress(Exception):
                self.profiler.__exit__(None, None, None)
            self.profiler = None
        if self.analysis is not None:
            history.summary_extra["profile"] = {**self.analysis, "memory_snapshot": self.snapshot}

    def table(self) -> str | None:
        if self.analysis is None:
            return None
        if "error" in self.analysis:
            return f"profile: could not analyse {self.analysis['trace']}: {self.analysis['error']}"
        return format_table(self.analysis)
