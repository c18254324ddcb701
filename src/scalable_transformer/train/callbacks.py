"""The built-in callbacks that watch a run (see `train.trainer.Callback`).

- `TelemetryCallback`: device telemetry. The sampler (metrics/device_sampler.py) runs from the first
  step to the end of `fit`; each log record gets the interval's figures; the summary gets per-rank
  medians and maxima, energy per sample and per token, and the reasons for any figure that is None.
  Energy per sample sums the devices of every rank (GPU counters), or, on CPU, the RAPL packages of
  every node once (local rank 0 reads them: the packages are shared by the node's ranks), over the
  post-warm-up log intervals.
- `ProfileCallback`: logging.profile_*: a torch.profiler window over iterations start..end
  (inclusive) on the selected ranks, a Chrome trace per rank in <run dir>/profile/, optionally a CUDA
  memory snapshot, and at the end the top-operator table with compute / communication / idle shares
  (metrics/trace_analysis.py). Every rank leaves the window's iterations out of the throughput
  statistics (the profiler slows the profiled ranks, and through the collectives the others):
  `History.excluded_iterations`.
- `ProgressCallback`: a live progress line in a terminal (rich): iteration, elapsed, ETA, loss,
  samples/s. Only when the console is a terminal: in a log file or a pipe the per-interval log lines
  are the progress (a redrawn bar would fill the file with control characters). The log lines print
  above the bar, through the same console.
- `TensorBytesCallback`: feeds `metrics.live_tensor_bytes.TensorBytesTracker` the step boundaries.

The hang watchdog (`train/watchdog.py`) is a callback too; it keeps its own module: a thread, signals
and files of its own.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import Progress

from ..metrics.device_sampler import GPU_FIELDS, Telemetry
from ..metrics.live_tensor_bytes import TensorBytesTracker
from ..metrics.sinks import LogRecord, progress_columns
from ..metrics.trace_analysis import analyze_trace, format_table
from ..parallel.distributed import all_reduce_floats
from ..parallel.torch_compat import (
    dump_cuda_memory_snapshot,
    record_cuda_memory_history,
    stop_cuda_memory_history,
)
from .trainer import Callback, History, StepResult, Trainer

SUMMARY_FIELDS = (*GPU_FIELDS, "cpu_process_util", "cpu_system_util", "cpu_power_w")


class TelemetryCallback(Callback):
    def __init__(self, device: Any, period: float = 0.5, telemetry: Telemetry | None = None) -> None:
        index = device.index or 0 if device.type == "cuda" else 0
        self.telemetry = telemetry or Telemetry(device.type, index, period)
        self.local_main = int(os.environ.get("LOCAL_RANK", "0")) == 0
        self.records: list[tuple[int, dict[str, Any], float | None]] = []  # (iteration, figures, energy)
        self.started = False
        self.last_samples = 0

    def on_step_start(self, trainer: Trainer) -> None:
        if not self.started:
            self.telemetry.start()
            self.started = True
            self.last_samples = trainer.consumed_samples

    def on_log(self, trainer: Trainer, record: LogRecord) -> None:
        figures = self.telemetry.interval() if self.started else {}
        record.scalars.update({k: v for k, v in figures.items() if v is not None or k in GPU_FIELDS})
        samples = trainer.consumed_samples - self.last_samples
        self.last_samples = trainer.consumed_samples
        energy = self._job_energy(trainer, figures)
        if energy is not None and samples > 0:
            record["energy_j_per_sample"] = energy / samples
            record["energy_j_per_token"] = energy / (samples * trainer.cfg.model.seq_length)
        self.records.append((trainer.iteration, figures, energy))

    def _job_energy(self, trainer: Trainer, figures: dict[str, Any]) -> float | None:
        """Joules of the whole job in this interval: every rank's device, or every node's CPU
        packages once; None unless every rank (node) could measure it. All ranks call this."""
        device = figures.get("device_energy_j")
        cpu = figures.get("cpu_energy_j") if self.local_main else None
        values = [device or 0.0, float(device is not None), cpu or 0.0, float(cpu is not None)]
        values.append(float(self.local_main))
        if trainer.dims.world_size > 1:
            values = all_reduce_floats(values)
        world = trainer.dims.world_size
        if values[1] == world:
            return values[0]
        if values[3] and values[3] == values[4]:
            return values[2]
        return None

    def on_fit_end(self, trainer: Trainer, history: History) -> None:
        if self.started:
            self.telemetry.stop()
        last_warmup = history.last_warmup_iteration(trainer.cfg.logging.warmup_iters)
        window = [r for r in self.records if r[0] > last_warmup] or self.records
        own: dict[str, tuple[float, float]] = {}
        for key in SUMMARY_FIELDS:
            values = [fig[key] for _, fig, _ in window if fig.get(key) is not None]
            own[key] = (statistics.median(values), max(values)) if values else (math.nan, math.nan)
        per_rank = self._gather(trainer, own)
        samples = trainer.global_batch * sum(
            r[0] - prev for r, prev in zip(window, [self._previous(r[0]) for r in window], strict=True)
        )
        energies = [e for _, _, e in window]
        energy = sum(e for e in energies if e is not None) if energies and None not in energies else None
        summary: dict[str, Any] = {
            "telemetry_source": self.telemetry.source,
            "telemetry_notes": [*self.telemetry.reasons.values(), *self.telemetry.errors],
            "telemetry_per_rank": per_rank,
            "energy_joules": energy,
            "energy_j_per_sample": None if energy is None or not samples else energy / samples,
            "energy_j_per_token": None
            if energy is None or not samples
            else energy / (samples * trainer.cfg.model.seq_length),
        }
        # one figure per field for tables: the median over ranks of each rank's median (memory: the max)
        for key in SUMMARY_FIELDS:
            medians = [m for m in per_rank[key]["median"] if m is not None]
            maxima = [m for m in per_rank[key]["max"] if m is not None]
            if key.startswith("device_memory"):
                summary[key] = max(maxima) if maxima else None
            else:
                summary[key] = statistics.median(medians) if medians else None
        history.summary_extra.update(summary)

    def _previous(self, iteration: int) -> int:
        earlier = [r[0] for r in self.records if r[0] < iteration]
        return max(earlier) if earlier else 0

    def _gather(self, trainer: Trainer, own: dict[str, tuple[float, float]]) -> dict[str, Any]:
        """{field: {"median": [per rank], "max": [per rank]}} (None where a rank had no value)."""
        world, rank = trainer.dims.world_size, trainer.dims.rank
        keys = list(own)
        slots = [0.0] * (2 * len(keys) * world)
        for i, key in enumerate(keys):
            median, high = own[key]
            slots[(2 * i) * world + rank] = median
            slots[(2 * i + 1) * world + rank] = high
        if world > 1:
            slots = all_reduce_floats(slots)  # NaN (no value) stays NaN in the sum
        out: dict[str, Any] = {}
        for i, key in enumerate(keys):
            medians = slots[2 * i * world : (2 * i + 1) * world]
            maxima = slots[(2 * i + 1) * world : (2 * i + 2) * world]
            out[key] = {
                "median": [None if math.isnan(v) else v for v in medians],
                "max": [None if math.isnan(v) else v for v in maxima],
            }
        return out


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


class ProgressCallback(Callback):
    def __init__(self, console: Console, total: int) -> None:
        self.console, self.total = console, total
        self.progress: Progress | None = None
        self.task: Any = None

    def on_step_start(self, trainer: Trainer) -> None:
        if self.progress is None:
            self.progress = Progress(*progress_columns("iterations"), console=self.console, transient=True)
            self.task = self.progress.add_task("training", total=self.total, status="")
            self.progress.update(self.task, completed=trainer.iteration)
            self.progress.start()

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        if self.progress is not None:  # the loss shown is the last logged one: a step's stays on the device
            self.progress.update(self.task, completed=trainer.iteration)

    def on_log(self, trainer: Trainer, record: LogRecord) -> None:
        if self.progress is not None:
            status = f"loss {record['loss']:.4f} | {record['samples_per_second']:.2f} samples/s"
            self.progress.update(self.task, completed=trainer.iteration, status=status)

    def on_fit_end(self, trainer: Trainer, history: History) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


class TensorBytesCallback(Callback):
    def __init__(self, tracker: TensorBytesTracker) -> None:
        self.tracker = tracker
        self.steps = 0

    def on_step_start(self, trainer: Trainer) -> None:
        self.steps += 1
        self.tracker.step_started(self.steps)
