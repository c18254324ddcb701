"""Device telemetry wired into training: the sampler (metrics/device_sampler.py) runs from the first step to
the end of `fit`; each log record gets the interval's figures; the summary gets per-rank medians and
maxima, energy per sample and per token, and the reasons for any figure that is None.

Energy per sample sums the devices of every rank (GPU counters), or, on CPU, the RAPL packages of
every node once (local rank 0 reads them: the packages are shared by the node's ranks), over the
post-warm-up log intervals.
"""

from __future__ import annotations

import math
import os
import statistics
from typing import Any

from ..metrics.device_sampler import GPU_FIELDS, Telemetry
from ..metrics.sinks import LogRecord
from ..parallel.distributed import all_reduce_floats
from .trainer import Callback, History, Trainer

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
