"""What a run writes and prints: the warnings at its start, its directory, the banner lines, the
sinks, summary.json and the closing lines.

Only the main rank writes; every rank takes part in the summary's per-rank gathers. `run.py` calls
`open_outputs` before training and `write_summary` after it.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from ..config.load import to_yaml
from ..config.schema import Config, ResolvedConfig
from ..files import write_atomic
from ..metrics.device_specs import PeakInfo, cpu_precision_warning
from ..metrics.environment import environment
from ..metrics.flops import FlopsCount, throughput_metrics
from ..metrics.sinks import ConsoleSink, JsonlSink, LogRecord, Sink, TensorBoardSink, percent
from ..models import MOE_METRICS
from ..models.registry import hf_unsupported
from ..parallel.dims import ParallelDims
from .build import Place, RunModel
from .checkpointing import Resume
from .measurement import STRAGGLER_MARGIN, gather_floats
from .resilience import stop_message
from .trainer import Callback, History, Trainer

SUBMITTED_MARKER = ".stx-submit"  # launch.batch.MARKER_NAME (launch sits above train)


def make_run_dir(cfg: ResolvedConfig, continuing: bool = False) -> Path:
    """A new directory under logging.run_dir; an existing run is never overwritten. Existing
    directories used as they are: one `stx submit` prepared for this run (its batch script and
    `.stx-submit` marker, no config.yaml yet), and, when `continuing` (the run resumes from a
    checkpoint), the run named by logging.run_name or, without one, the run of this `stx launch`
    (its restarts): its next segment (metrics appended)."""
    # under `stx launch` the stamp is the launch's (launch.local.RUN_STAMP_ENV), the same for restarts
    stamp = os.environ.get("STX_RUN_STAMP") or f"{dt.datetime.now():%Y%m%d-%H%M%S}"
    name = cfg.logging.run_name or f"{cfg.model.type}-{stamp}"
    parent = Path(cfg.logging.run_dir)
    path, n = parent / name, 1
    if (path / SUBMITTED_MARKER).is_file() and not (path / "config.yaml").exists():
        return path
    if (
        continuing
        and (cfg.logging.run_name or "STX_RUN_STAMP" in os.environ)
        and (path / "config.yaml").is_file()
    ):
        return path
    while path.exists():
        n += 1
        path = parent / f"{name}-{n}"
    path.mkdir(parents=True)
    return path


def read_previous_summary(run_dir: Path) -> dict[str, Any] | None:
    """The summary.json a continued run directory holds from its earlier segments (None: none, or
    unreadable: then this segment starts the list again rather than failing the run)."""
    try:
        return json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def write_json(path: Path, data: Any) -> None:
    """Atomically (files.write_atomic), so a reader never sees half a file."""
    write_atomic(path, json.dumps(data, indent=2, default=str) + "\n")


Predict = Callable[[Config, int, str], dict]


@dataclasses.dataclass(frozen=True)
class RunOutputs:
    """Where the run writes (rank 0; other ranks: no directory, no sinks) and the device peak its
    MFU and HFU are relative to."""

    run_dir: Path | None
    sinks: list[Sink]
    peak: PeakInfo


def open_outputs(
    cfg: ResolvedConfig, at: Place, resume: Resume | None, model: RunModel, peak: PeakInfo
) -> RunOutputs:
    """Rank 0: the run directory (reopened when continuing a resumed run) with its sinks, and the
    banner."""
    if not at.dims.is_main:
        return RunOutputs(None, [], peak)
    run_dir, sinks = open_run_dir(cfg, at.console, continuing=resume is not None)
    print_banner(at.console, cfg, model.num_params, at.device, at.dims.world_size, model.flops, peak)
    return RunOutputs(run_dir, sinks, peak)


def print_warnings(cfg: ResolvedConfig, at: Place) -> None:
    """Rank 0, before anything is built: what the precision will cost on this CPU (its check may
    measure GEMMs, so it runs before the seed is set) and why the checkpoints could not be exported."""
    if not at.dims.is_main:
        return
    slow_precision = cpu_precision_warning(cfg.train.precision) if at.device.type == "cpu" else None
    if slow_precision is not None:
        at.console.print(f"[bold yellow]warning[/]: {slow_precision}")
    no_export = export_warning(cfg)
    if no_export is not None:
        at.console.print(f"[bold yellow]warning[/]: {no_export}", markup=False)


def export_warning(cfg: ResolvedConfig) -> str | None:
    """Why the checkpoints this run saves could not leave as a Hugging Face model (None: they can,
    or nothing is saved): said at the start, not discovered at `stx export` after training."""
    reasons = hf_unsupported(cfg.model) if cfg.checkpoint.save else []
    if not reasons:
        return None
    return (
        f"checkpoint.save = {cfg.checkpoint.save}, but no Hugging Face architecture holds this model, so "
        "`stx export --format hf` will refuse its checkpoints: " + " | ".join(reasons)
    )


def open_run_dir(cfg: ResolvedConfig, console: Console, continuing: bool = False) -> tuple[Path, list[Sink]]:
    """Create (or, `continuing`, reopen: see make_run_dir) the run directory with config.yaml and
    env.json, and the sinks that log into it."""
    run_dir = make_run_dir(cfg, continuing)
    (run_dir / "config.yaml").write_text(to_yaml(cfg), encoding="utf-8")
    write_json(run_dir / "env.json", environment())
    sinks: list[Sink] = [ConsoleSink(console), JsonlSink(run_dir / "metrics.jsonl")]
    if cfg.logging.tensorboard:
        sinks.append(TensorBoardSink(Path(cfg.logging.tensorboard_dir or run_dir / "tensorboard")))
    console.print(f"[bold]run directory[/]: {run_dir}")
    return run_dir, sinks


def print_banner(
    console: Console,
    cfg: ResolvedConfig,
    num_params: int,
    device: Any,
    world: int,
    flops: FlopsCount,
    peak: Any,
) -> None:
    """The run's opening lines: model, layout, and the FLOPs convention and peak behind every figure."""
    console.print(
        f"model: {cfg.model.type}, {num_params:,} parameters, {cfg.model.num_layers} layers x "
        f"{cfg.model.hidden_size} hidden, seq {cfg.model.seq_length}, vocab {cfg.model.vocab_size}; "
        f"device {device}, precision {cfg.train.precision}; global batch {cfg.train.global_batch_size}"
        f" = micro {cfg.train.micro_batch_size} x accumulation "
        f"{cfg.train.gradient_accumulation_steps} x dp {cfg.parallel.dp}"
    )
    bubble = cfg.parallel.pipeline_bubble
    console.print(
        f"layout: {world} process(es), {cfg.parallel.layout_label}"
        + (f"; pipeline bubble {100 * bubble:.1f}% of a step (theoretical)" if bubble is not None else "")
    )
    console.print(
        f"TFLOPs/MFU/HFU: FLOPs convention '{flops.convention}' "
        f"({flops.model_flops / 1e9:.2f} model GFLOPs, {flops.hardware_flops / 1e9:.2f} hardware "
        f"GFLOPs per iteration) over {world} device(s); peak {peak.flops_per_second / 1e12:.3f} "
        f"TFLOP/s per device from {peak.source}"
        + (
            f"; FP8 run: MFU also against the fp8 peak, {fp8_peak_text(peak)}"
            if cfg.train.fp8 != "none"
            else ""
        )
    )


def fp8_peak_text(peak: PeakInfo) -> str:
    """The float8 peak an FP8 run's second MFU divides by, or why there is none."""
    if peak.fp8_flops_per_second > 0:
        return f"{peak.fp8_flops_per_second / 1e12:.3f} TFLOP/s per device from {peak.fp8_source}"
    return peak.fp8_source or "none"


def summarize(
    cfg: ResolvedConfig,
    history: History,
    flops,
    peak,
    num_params: int,
    wall_seconds: float,
    num_devices: int = 1,
) -> dict:
    """Median throughput over the post-warm-up window, plus the losses and memory of the run."""
    times = history.iteration_seconds
    global_batch = cfg.train.global_batch_size
    warmup = history.warmup_iterations(cfg.logging.warmup_iters)
    first = history.first_iteration
    # profiled iterations (the profiler slows them) are left out as well, unless nothing else is left
    excluded = history.excluded_iterations
    kept = [t for i, t in enumerate(times) if i >= warmup and first + i not in excluded]
    window = kept or times[warmup:]
    median = statistics.median(window)
    perf = throughput_metrics(flops, median, num_devices, peak.flops_per_second)
    phases: dict[str, float] = {}
    # per-phase times: the intervals that began after the warm-up (a first interval's mean carries
    # the first step's one-off costs: lazily built optimizer state, allocator growth), else those
    # that ended after it, else all; never the profiled ones where others are left
    last_warmup = history.last_warmup_iteration(cfg.logging.warmup_iters)
    timed = [r for r in history.records if not r.get("profiled_steps")] or history.records
    records = (
        [r for r in timed if r.get("first_iteration", r["iteration"]) > last_warmup]
        or [r for r in timed if r["iteration"] > last_warmup]
        or history.records
    )
    for name in records[0].phase_ms if records else {}:
        phases[name] = statistics.median(r.phase_ms[name] for r in records if name in r.phase_ms)
    return {
        "iterations": len(times),
        "global_batch_size": global_batch,
        "seq_length": cfg.model.seq_length,
        "num_parameters": num_params,
        "warmup_iterations_excluded": warmup,
        "median_iteration_seconds": median,
        "samples_per_second": global_batch / median,
        "tokens_per_second": global_batch * cfg.model.seq_length / median,
        "tflops_per_device": perf["tflops_per_device"],
        "mfu": perf["mfu"],
        "hfu": perf["hfu"],
        "flops_convention": flops.convention,
        "model_flops_per_iteration": flops.model_flops,
        "hardware_flops_per_iteration": flops.hardware_flops,
        "peak_flops_per_device": peak.flops_per_second,
        "peak_flops_source": peak.source,
        **_fp8_summary(cfg, flops, median, num_devices, peak),
        "phase_time_ms_median": phases,
        "peak_memory_bytes": history.peak_memory_bytes,
        "peak_memory_method": history.peak_memory_method,
        "run_peak_memory_bytes": history.run_peak_memory_bytes,
        **_moe_summary(history),
        "first_logged_train_loss": history.first_logged_loss,
        "final_train_loss": history.last_logged_loss,
        "final_valid": history.last_valid,
        "skipped_iterations": history.skipped_iterations,
        "nonfinite_skipped_iterations": history.nonfinite_iterations,
        "loss_spikes": history.loss_spikes,
        "stopped_by_signal": history.stopped_by,
        "profiled_iterations_excluded": sorted(history.excluded_iterations),
        "wall_seconds": wall_seconds,
        **communication_summary(records),
        **straggler_summary(history),
        **history.summary_extra,
    }


def segment_record(
    started_at: float, wall_seconds: float, first_iteration: int, history: History
) -> dict[str, Any]:
    """This job's part of the run (a segment): which job, when, which iterations, how it ended, and
    its wall time against its train-step time (seconds; times as UTC ISO 8601)."""

    def iso(t: float) -> str:
        return dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat(timespec="milliseconds")

    return {
        "job_id": os.environ.get("SLURM_JOB_ID") or os.environ.get("PBS_JOBID"),
        "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "started_at": iso(started_at),
        "ended_at": iso(started_at + wall_seconds),
        "first_iteration": first_iteration,
        "last_iteration": first_iteration + len(history.iteration_seconds) - 1,
        "stopped_by": history.stopped_by,
        "wall_seconds": wall_seconds,
        "step_seconds": sum(history.iteration_seconds),
    }


def with_segment(previous: dict[str, Any] | None, segment: dict[str, Any]) -> dict[str, Any]:
    """The run's segments so far (those of the summary.json this job continues, then this one) and
    goodput = productive train-step time / wall time from the first segment's start to the last's end.
    A segment's steps past the iteration the next one resumed from were redone: not productive. Time
    lost splits into between segments (queueing, restarts, jobs that crashed before writing a summary),
    inside them (start-up, evaluation, checkpoints) and redone steps."""
    segments = [*((previous or {}).get("segments") or []), segment]
    productive = redone = 0.0
    for i, s in enumerate(segments):
        done = s["last_iteration"] - s["first_iteration"] + 1
        kept = done
        if i + 1 < len(segments):
            kept = max(0, min(done, segments[i + 1]["first_iteration"] - s["first_iteration"]))
        share = s["step_seconds"] * kept / done if done > 0 else 0.0
        productive += share
        redone += s["step_seconds"] - share
    first = dt.datetime.fromisoformat(segments[0]["started_at"])
    last = dt.datetime.fromisoformat(segments[-1]["ended_at"])
    in_jobs = sum(s["wall_seconds"] for s in segments)
    wall = max((last - first).total_seconds(), in_jobs)  # the stamps are rounded to milliseconds
    inside = sum(s["wall_seconds"] - s["step_seconds"] for s in segments)
    return {
        "segments": segments,
        "goodput": productive / wall if wall > 0 else None,
        "run_wall_seconds": wall,
        "productive_step_seconds": productive,
        "lost_seconds": {
            "between_segments": wall - in_jobs,
            "inside_segments": inside,
            "redone_steps": redone,
        },
    }


def communication_summary(records: list[LogRecord]) -> dict[str, Any]:
    """Medians over the log intervals of the measured communication (comm_ms: totals, which overlap
    compute), of each phase's max over ranks, and of the measured pipeline bubble."""
    out: dict[str, Any] = {}
    for attr, name in (("comm_ms", "comm_time_ms_median"), ("phase_ms_max", "phase_time_ms_max_median")):
        keys = dict.fromkeys(k for r in records for k in getattr(r, attr))
        values = {
            k: statistics.median(getattr(r, attr)[k] for r in records if k in getattr(r, attr)) for k in keys
        }
        if values:
            out[name] = values
    bubbles = [
        r["pipeline_bubble_measured"] for r in records if r.get("pipeline_bubble_measured") is not None
    ]
    if bubbles:
        out["pipeline_bubble_measured"] = statistics.median(bubbles)
    return out


def straggler_summary(history: History) -> dict[str, Any]:
    """The straggler: the rank flagged (busiest beyond the margin) in at least half of the log
    intervals, at least two of them; None when no rank is consistently slower."""
    flags = history.stragglers
    if not flags:
        return {}
    counts: dict[int, int] = {}
    for rank in flags:
        if rank is not None:
            counts[rank] = counts.get(rank, 0) + 1
    rank, count = max(counts.items(), key=lambda kv: kv[1], default=(None, 0))
    consistent = rank is not None and count >= 2 and 2 * count >= len(flags)
    return {
        "straggler_rank": rank if consistent else None,
        "straggler_intervals": {"flagged": count, "of": len(flags)} if rank is not None else None,
    }


def _moe_summary(history: History) -> dict:
    """An MoE model's router figures of the last logged interval (means over its steps, as the log
    line shows them: `moe_aux_loss`, `moe_z_loss`, `moe_dropped_tokens` per step,
    `moe_load_imbalance`); nothing for a dense model."""
    last = history.records[-1] if history.records else None
    if last is None or "moe_aux_loss" not in last:
        return {}
    return {key: last[key] for key in (*MOE_METRICS, "moe_load_imbalance") if key in last}


def _fp8_summary(cfg: ResolvedConfig, flops, median: float, num_devices: int, peak) -> dict:
    """An FP8 run's MFU against the float8 peak (`mfu` is against the bf16 one) and that peak (FLOP/s
    per device; null where there is none, the source says why)."""
    if cfg.train.fp8 == "none":
        return {}
    fp8_peak = getattr(peak, "fp8_flops_per_second", 0.0) or None
    return {
        "fp8_recipe": cfg.train.fp8,
        "mfu_fp8": throughput_metrics(flops, median, num_devices, fp8_peak)["mfu"],
        "peak_flops_fp8_per_device": fp8_peak,
        "peak_flops_fp8_source": getattr(peak, "fp8_source", ""),
    }


def print_done(console: Console, summary: dict, run_dir: Path, memory_method: str) -> None:
    """The closing line: throughput, TFLOPs/MFU/HFU with their convention, losses, memory per rank."""
    per_rank = summary["peak_memory_bytes_per_rank"]
    run_peak = summary.get("run_peak_memory_bytes_per_rank", [])
    console.print(
        f"[bold green]done[/]: {summary['iterations']} iterations in {summary['wall_seconds']:.1f} s; "
        f"median {summary['samples_per_second']:.2f} samples/s, {summary['tokens_per_second']:.0f} tokens/s, "
        f"{summary['tflops_per_device']:.3f} TFLOPs/device, MFU {percent(summary['mfu'])}"
        + (
            f" of the bf16 peak and {percent(summary['mfu_fp8'])} of the fp8 peak, "
            if "mfu_fp8" in summary
            else ", "
        )
        + f"HFU {percent(summary['hfu'])} ({summary['flops_convention']} convention, "
        f"{summary['world_size']} device(s)) over iterations "
        f"{summary['warmup_iterations_excluded'] + 1}-{summary['iterations']}; train loss "
        f"{summary['first_logged_train_loss']:.4f} -> {summary['final_train_loss']:.4f}; peak memory per "
        f"rank {', '.join(f'{b / 2**20:.0f}' for b in per_rank)} MiB ({memory_method}), whole run "
        f"(initialization included) {', '.join(f'{b / 2**20:.0f}' for b in run_peak)} MiB; "
        f"summary: {run_dir / 'summary.json'}"
    )


def write_summary(
    cfg: ResolvedConfig,
    at: Place,
    trainer: Trainer,
    model: RunModel,
    outputs: RunOutputs,
    predict: Predict | None,
) -> tuple[Path | None, dict]:
    """summary.json (written once, by rank 0) and the closing lines; every rank takes part in the
    per-rank gathers. Returns the run directory (None on other ranks) and the summary."""
    history, dims, device, console = trainer.history, at.dims, at.device, at.console
    world = dims.world_size
    summary = summarize(
        cfg, history, model.flops, outputs.peak, model.num_params, time.perf_counter() - at.start, world
    )
    summary.update(per_rank_memory(history, model.tracker, device, dims))
    summary["layout"] = cfg.parallel.layout_label
    summary["world_size"] = world
    summary["pipeline_bubble_theoretical"] = cfg.parallel.pipeline_bubble
    summary["final_iteration"] = trainer.iteration
    wall = time.perf_counter() - at.start
    segment = segment_record(time.time() - wall, wall, history.first_iteration, history)
    if history.stopped_by and cfg.checkpoint.save:
        summary["resume_from"] = cfg.checkpoint.save
    run_dir = outputs.run_dir
    if run_dir is None:
        return None, summary
    summary.update(with_segment(read_previous_summary(run_dir), segment))
    summary.update(step_prediction(cfg, history, world, device, predict))
    write_json(run_dir / "summary.json", summary)
    print_done(console, summary, run_dir, history.peak_memory_method)
    print_observations(console, summary, trainer.callbacks)
    if history.stopped_by:
        console.print(f"[bold yellow]{stop_message(summary, cfg.train.train_iters)}[/]")
    return run_dir, summary


def per_rank_memory(
    history: History, tracker: Any, device: torch.device, dims: ParallelDims
) -> dict[str, Any]:
    """The summary's per-rank memory figures (every rank calls this: they are gathered)."""
    per_rank_peak = gather_per_rank(history.peak_memory_bytes, dims)
    return {
        "peak_memory_bytes_per_rank": per_rank_peak,
        "run_peak_memory_bytes_per_rank": gather_per_rank(history.run_peak_memory_bytes, dims),
        "model_state_bytes_per_rank": {
            part: gather_per_rank(history.model_state_bytes.get(part, 0), dims)
            for part in ("parameters", "gradients", "optimizer")
        },
        "peak_tensor_bytes_per_rank": peak_tensor_bytes(tracker, device, per_rank_peak, dims),
    }


def step_prediction(
    cfg: ResolvedConfig, history: Any, world: int, device: torch.device, predict: Predict | None
) -> dict[str, Any]:
    """The planner's step time for this run beside its measurement (`predict`, see `run_training`)
    and the spread of the measured iteration times (interquartile range after warm-up, seconds), the
    noise `stx report` compares repeats against."""
    out = predict(cfg, world, device.type) if predict is not None else {}
    times = list(history.iteration_seconds)
    window = times[cfg.logging.warmup_iters :] if len(times) > cfg.logging.warmup_iters else times
    if len(window) >= 4:
        q1, _, q3 = statistics.quantiles(window, n=4)
        out["iteration_seconds_iqr"] = q3 - q1
    return out


def peak_tensor_bytes(
    tracker: Any, device: torch.device, per_rank_peak: list[int], dims: ParallelDims
) -> list[int | None] | None:
    """Live tensor bytes per rank (what `stx plan` predicts): on CUDA the peak allocated bytes the
    trainer measured; on CPU the tracker's (None when not tracked; a rank that failed to measure: None)."""
    if device.type == "cuda":
        return list(per_rank_peak)
    if tracker is None:
        return None
    peak = tracker.peak()
    return [v if v >= 0 else None for v in gather_per_rank(-1 if peak is None else peak, dims)]


def print_observations(console: Console, summary: dict, callbacks: Sequence[Callback]) -> None:
    """After the closing line: the straggler, why a telemetry figure is missing, the profile table."""
    if summary.get("straggler_rank") is not None:
        flagged = summary["straggler_intervals"]
        console.print(
            f"[bold yellow]straggler[/]: rank {summary['straggler_rank']} was the busiest rank beyond "
            f"{100 * STRAGGLER_MARGIN:.0f}% of the median in {flagged['flagged']} of {flagged['of']} "
            "log intervals"
        )
    for note in summary.get("telemetry_notes") or []:
        console.print(f"telemetry: {note}")
    for callback in callbacks:
        table = getattr(callback, "table", None)
        text = table() if table is not None else None
        if text:
            console.print(text, markup=False)


def gather_per_rank(value: float, dims: ParallelDims) -> list[int]:
    """One number from every rank, in rank order (all ranks call this)."""
    if dims.world_size == 1 or dims.mesh is None:
        return [int(value)]
    return [int(v) for v in gather_floats(value, dims.rank, dims.world_size)]
