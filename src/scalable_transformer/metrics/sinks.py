"""Where metrics go: the console (rich, Megatron-style lines), a JSONL file and TensorBoard events.

A training interval's record is a `LogRecord`: scalars by name with the unit in the name
(`samples_per_second`, `peak_memory_bytes`) and the per-phase and per-collective times as maps, so no
sink parses names back. Its `flat()` form is what metrics.jsonl and TensorBoard hold, as before
(`time_ms/forward-compute`, `comm_ms/all_reduce`, `time_ms_max/optimizer`). Evaluation records are flat
dicts of scalars.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from .device_sampler import short as short_telemetry

# the maps of a LogRecord and the prefix each has in the flat form
TIME_MAPS = {
    "phase_ms": "time_ms",
    "phase_ms_min": "time_ms_min",
    "phase_ms_max": "time_ms_max",
    "comm_ms": "comm_ms",
    "comm_ms_min": "comm_ms_min",
    "comm_ms_max": "comm_ms_max",
}


@dataclass
class LogRecord:
    """One training log interval. Scalars are read and added by name (`record["loss"]`, callbacks add
    telemetry fields); times are per iteration, in milliseconds."""

    scalars: dict[str, Any] = field(default_factory=dict)
    phase_ms: dict[str, float] = field(default_factory=dict)  # each timed phase (train.measurement.PHASES)
    phase_ms_min: dict[str, float] = field(default_factory=dict)  # its min over ranks
    phase_ms_max: dict[str, float] = field(default_factory=dict)  # its max over ranks
    comm_ms: dict[str, float] = field(default_factory=dict)  # each collective kind's measured time
    comm_ms_min: dict[str, float] = field(default_factory=dict)
    comm_ms_max: dict[str, float] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        return self.scalars[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self.scalars[key] = value

    def __contains__(self, key: object) -> bool:
        return key in self.scalars

    def get(self, key: str, default: Any = None) -> Any:
        return self.scalars.get(key, default)

    def flat(self) -> dict[str, Any]:
        """metrics.jsonl's and TensorBoard's form: the scalars, then `<prefix>/<name>` for each time."""
        out = dict(self.scalars)
        for attr, prefix in TIME_MAPS.items():
            for name, value in getattr(self, attr).items():
                out[f"{prefix}/{name}"] = value
        return out


def _flat(record: dict[str, Any] | LogRecord) -> dict[str, Any]:
    return record.flat() if isinstance(record, LogRecord) else record


class Sink(Protocol):
    def write(self, kind: str, step: int, record: dict[str, Any] | LogRecord) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """One JSON object per line: {"kind": "train"|"valid", "iteration": n, ...}; flushed per record."""

    def __init__(self, path: Path):
        self.path = path
        self._file = path.open("a", encoding="utf-8")

    def write(self, kind: str, step: int, record: dict[str, Any] | LogRecord) -> None:
        flat = _flat(record)
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in flat.items()}
        self._file.write(json.dumps({"kind": kind, "iteration": step, **clean}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    """Scalars under `<kind>/<name>`, as Megatron's TensorBoard writer does."""

    def __init__(self, log_dir: Path):
        # Here, not at the top: tensorboard costs 0.7 s to import (measured); only runs logging to it pay.
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, kind: str, step: int, record: dict[str, Any] | LogRecord) -> None:
        for name, value in _flat(record).items():
            if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
                self._writer.add_scalar(f"{kind}/{name}", value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def percent(fraction: float | None) -> str:
    """A utilisation (fraction of the peak) as "12.34%", or "n/a" when it is unknown (no peak, or a
    figure above 100% that was recorded as null)."""
    if fraction is None or not math.isfinite(fraction):
        return "n/a"
    return f"{100 * fraction:.2f}%"


def _fmt_bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


_COMPONENTS = (("mlm_loss", "lm loss"), ("binary_loss", "binary loss"))  # as Megatron's BERT log line


def _moe_parts(r: dict[str, Any] | LogRecord) -> list[str]:
    """An MoE model's router figures: aux and z losses (coefficient-weighted, mean over MoE layers),
    assignments dropped per step by the capacity factor, the worst layer's max/mean tokens per expert."""
    if "moe_aux_loss" not in r:
        return []
    return [
        f"moe aux loss: {r['moe_aux_loss']:.4E}",
        f"moe z loss: {r['moe_z_loss']:.4E}",
        f"moe dropped tokens/step: {r['moe_dropped_tokens']:.0f}",
        f"moe load imbalance (max/mean): {r['moe_load_imbalance']:.2f}",
    ]


class ConsoleSink:
    """Megatron-style one-line-per-interval console output, with units on every figure."""

    def __init__(self, console: Console | None = None):
        self.console = console or Console(highlight=False, soft_wrap=True)

    def write(self, kind: str, step: int, record: dict[str, Any] | LogRecord) -> None:
        r = record
        if kind == "valid":
            parts = [f"validation at iteration {step}", f"loss: {r['loss']:.4E}", f"ppl: {r['ppl']:.3f}"]
            if "mlm_accuracy" in r:
                parts.append(f"MLM acc: {100 * r['mlm_accuracy']:.2f}%")
            if "binary_accuracy" in r:
                parts.append(f"binary acc: {100 * r['binary_accuracy']:.2f}%")
            self.console.print("[bold cyan] " + " | ".join(parts) + "[/]")
            return
        parts = [
            f"iteration {step:>6d}/{r['train_iters']:>6d}",
            f"consumed samples: {r['consumed_samples']:>9d}",
            f"lr: {r['lr']:.3E}",
            f"loss: {r['loss']:.4E}",
            # the parts only when there are two of them (BERT with its binary head)
            *(f"{name}: {r[key]:.4E}" for key, name in _COMPONENTS if key in r and "binary_loss" in r),
            f"grad norm: {r['grad_norm']:.3f}",
            *_moe_parts(r),
            f"samples/s: {r['samples_per_second']:.2f}",
            f"tokens/s: {r['tokens_per_second']:.0f}",
            f"TFLOPs/dev: {r['tflops_per_device']:.3f}",
            # an FP8 run's MFU against the bf16 and the float8 peak, each named
            *(
                (f"MFU (bf16 peak): {percent(r.get('mfu'))}", f"MFU (fp8 peak): {percent(r['mfu_fp8'])}")
                if "mfu_fp8" in r
                else (f"MFU: {percent(r.get('mfu'))}",)
            ),
            f"HFU: {percent(r.get('hfu'))}",
            f"peak mem ({r.get('peak_memory_kind', 'allocated')}): {_fmt_bytes(r['peak_memory_bytes'])}",
        ]
        nonfinite = r.get("nonfinite_iterations") or 0
        if (r.get("skipped_iterations") or 0) > nonfinite:
            parts.append(f"skipped (overflow): {r['skipped_iterations'] - nonfinite}")
        if nonfinite:
            parts.append(f"skipped (non-finite): {nonfinite}")
        if "loss_scale" in r:
            parts.append(f"loss scale: {r['loss_scale']:.1f}")
        typed = r if isinstance(r, LogRecord) else LogRecord(scalars=dict(r))
        timers = [f"{name}: {ms:.2f}" for name, ms in typed.phase_ms.items()]
        if r.get("straggler_rank") is not None:
            parts.append(f"straggler: rank {r['straggler_rank']}")
        if r.get("pipeline_bubble_measured") is not None:
            parts.append(f"pipeline bubble (measured): {100 * r['pipeline_bubble_measured']:.1f}%")
        devices = short_telemetry(typed.scalars)
        if devices:
            parts.append(devices)
        line = " | ".join(parts)
        if timers:
            line += " | time (ms) | " + " | ".join(timers)
        comm = [f"{kind}: {ms:.2f}" for kind, ms in typed.comm_ms.items()]
        if comm:
            line += " | comm (ms) | " + " | ".join(comm)
        self.console.print(" " + line)

    def close(self) -> None:
        pass


def progress_columns(unit: str) -> list[Any]:
    """The columns of the live progress bars (training, sweeps): "<what> [bar] 12/400 <unit> 0:00:31
    ETA 0:10:02 <status>"."""
    return [
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(unit),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        TextColumn("{task.fields[status]}"),
    ]


class Sinks:
    """Fan a record out to every configured sink."""

    def __init__(self, sinks: list[Sink]):
        self.sinks = sinks

    def write(self, kind: str, step: int, record: dict[str, Any] | LogRecord) -> None:
        for sink in self.sinks:
            sink.write(kind, step, record)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
