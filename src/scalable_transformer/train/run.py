"""Named builders and `run_training`: config in, run directory and summary out. Wiring only.

The data flow is one way: config -> ParallelDims -> tokenizer/data -> model -> parallelize ->
optimizer -> Trainer.fit (callbacks: checkpoints) -> sinks and summary.json (`train/outputs.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import shutil
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from rich.console import Console

from ..config.rules import layout_label
from ..config.schema import Config, ResolvedConfig
from ..config.validate import resolve
from ..data.loader import build_datasets, build_loader, eval_batches
from ..data.tokenizers import load_tokenizer
from ..errors import ConfigError
from ..metrics.device_specs import cpu_precision_warning, resolve_peak
from ..metrics.flops import step_flops
from ..metrics.sinks import Sink, Sinks
from ..models import build_model, count_parameters
from ..parallel.apply import parallelize
from ..parallel.dims import ParallelDims
from ..parallel.distributed import env_world_size, init_distributed, shutdown_distributed
from .checkpointing import attach_checkpoints, open_resume
from .measurement import STRAGGLER_MARGIN, Measurement, gather_floats
from .optim import build_optimizer, build_scheduler
from .outputs import (
    open_run_dir,
    pipeline_bubble,
    print_banner,
    print_done,
    read_previous_summary,
    segment_record,
    summarize,
    with_segment,
    write_json,
)
from .resilience import stop_message
from .tensor_bytes_callback import TensorBytesCallback, tensor_bytes_tracker
from .trainer import Callback, Trainer
from .watchdog import HangWatchdog


def select_device(cfg: Config) -> torch.device:
    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device = cuda, but no CUDA device is available; use auto or cpu")
    if cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@contextlib.contextmanager
def rank_zero_first(dims: ParallelDims):
    """Rank 0 runs the block first (building caches: tokenizer, index mappings, CPU peak), then the
    others, which then read what rank 0 wrote instead of racing it."""
    distributed = dims.mesh is not None and dims.world_size > 1
    if distributed and not dims.is_main:
        dist.barrier()
    yield
    if distributed and dims.is_main:
        dist.barrier()


Predict = Callable[[Config, int, str], dict]


def run_training(
    cfg: Config,
    console: Console | None = None,
    callbacks: Sequence[Callback] = (),
    predict: Predict | None = None,
) -> tuple[Path | None, dict]:
    """Train as the config says; return the run directory (None on ranks other than 0) and the summary.

    Under a launcher (WORLD_SIZE > 1) every rank calls this; the layout is checked before any
    process group work, and the process group is torn down on the way out, also after an error.
    `callbacks` join the trainer's (see `train.trainer.Callback`). `predict(resolved config, world
    size, device type)` gives summary.json's `prediction` (or `prediction_error`): `stx train` passes
    the planner's (calibrate/this_machine.py `run_prediction`), which this layer does not import.
    """
    start = time.perf_counter()
    console = console or Console(highlight=False, soft_wrap=True)
    device = select_device(cfg)
    world = env_world_size()
    # Layout checks that need no tokenizer run first, so a bad layout fails before anything starts.
    sizes = resolve(cfg, world)
    needs_group = world > 1 or cfg.parallel.zero_stage >= 2
    created = init_distributed(device, cfg.parallel.timeout_minutes, needed=needs_group)
    try:
        dims = ParallelDims.build(sizes, device.type)  # the one topology object of this run
        return _run(cfg, console, device, dims, start, callbacks, predict)
    finally:
        shutdown_distributed(created)
        if device.type == "cpu":  # the steps' allocation setting ends with them (parallel/init.py)
            from ..parallel.init import end_step_allocation

            end_step_allocation()


@dataclasses.dataclass
class BuiltRun:
    """What `_build` makes from the resolved config: the trainer and what the summary needs of the run."""

    trainer: Trainer
    run_dir: Path | None
    flops: Any
    peak: Any
    num_params: int
    tracker: Any
    watchdog: HangWatchdog | None
    callbacks: list[Callback]


def _run(
    raw: Config,
    console: Console,
    device: torch.device,
    dims: ParallelDims,
    start: float,
    callbacks: Sequence[Callback],
    predict: Predict | None = None,
) -> tuple[Path | None, dict]:
    cfg, tokenizer = _resolved(raw, dims)
    resume = open_resume(cfg)  # a bad checkpoint or save directory fails here, before anything runs
    built = _build(cfg, tokenizer, resume, console, device, dims, callbacks)
    trainer, run_dir = built.trainer, built.run_dir
    try:
        attach_checkpoints(cfg, trainer, resume, console if dims.is_main else None, dims.is_main)
    except BaseException:  # e.g. a checkpoint of another shape: the run never started, so no directory
        trainer.sinks.close()
        if run_dir is not None:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    if trainer.iteration >= cfg.train.train_iters:
        if dims.is_main:
            console.print(
                f"nothing to train: already at iteration {trainer.iteration} of {cfg.train.train_iters}"
            )
        trainer.sinks.close()
        return run_dir, {"iterations": 0, "resumed_at_iteration": trainer.iteration}
    first_iteration = trainer.iteration + 1
    try:
        history = trainer.fit()
    finally:
        trainer.sinks.close()
        if built.watchdog is not None:  # also after a failure: no thread or heartbeat left behind
            built.watchdog.close()
    return _finish(cfg, built, history, console, dims, start, first_iteration, predict)


def _resolved(raw: Config, dims: ParallelDims) -> tuple[ResolvedConfig, Any]:
    """The tokenizer (rank 0 builds or reads it first) and the config resolved once, for this world
    size, with the tokenizer's vocabulary size."""
    d = raw.data
    with rank_zero_first(dims):
        tokenizer = load_tokenizer(
            d.tokenizer,
            d.tokenizer_vocab_size,
            vocab_file=d.vocab_file,
            merge_file=d.merge_file,
            tokenizer_type=d.tokenizer_type,
        )
    if raw.model.vocab_size is None:
        raw = dataclasses.replace(raw, model=dataclasses.replace(raw.model, vocab_size=tokenizer.vocab_size))
    elif raw.model.vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"model.vocab_size ({raw.model.vocab_size}) is smaller than the tokenizer's "
            f"vocabulary ({tokenizer.vocab_size}); remove it to use the tokenizer's size"
        )
    return resolve(raw, world_size=dims.world_size), tokenizer


def _build(
    cfg: ResolvedConfig,
    tokenizer: Any,
    resume: Any,
    console: Console,
    device: torch.device,
    dims: ParallelDims,
    callbacks: Sequence[Callback],
) -> BuiltRun:
    """Data, model, optimizer, measurement and callbacks of the run, from the resolved config."""
    with rank_zero_first(dims):
        train_ds, valid_ds, _ = build_datasets(cfg, tokenizer)
        peak = resolve_peak(
            device.type, cfg.train.precision, cfg.logging.device_name, cfg.logging.peak_tflops
        )
        _print_warnings(cfg, console, device, dims)
    train_loader = build_loader(
        train_ds,
        cfg.train.micro_batch_size,
        consumed_samples=resume.consumed_samples if resume is not None else 0,
        seed=cfg.train.seed,
        dp_rank=dims.dp_rank,
        dp_size=dims.dp,
        num_workers=cfg.data.num_workers,
    )

    def valid_batches():
        return eval_batches(valid_ds, cfg.train.micro_batch_size, cfg.train.eval_iters)

    set_seed(cfg.train.seed)  # right before init: nothing above may shift the weights or dropout masks
    tracker = tensor_bytes_tracker(cfg, device)  # before the model: its tensors are counted
    callbacks = [*callbacks, TensorBytesCallback(tracker)] if tracker is not None else list(callbacks)
    model, pipeline = build_parallel_model(cfg, dims, device)
    num_params = count_parameters(cfg.model)
    zero_group = dims.dp_group if cfg.parallel.zero_stage == 1 else None
    optimizer = build_optimizer(model, cfg.optim, zero_group=zero_group)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.train_iters)
    flops = step_flops(cfg, num_params)
    run_dir: Path | None = None
    sinks: list[Sink] = []
    if dims.is_main:
        run_dir, sinks = open_run_dir(cfg, console, continuing=resume is not None)
        print_banner(console, cfg, num_params, device, dims.world_size, flops, peak)
    callbacks = [*callbacks, *observers(cfg, device, dims, run_dir)]
    watchdog = hang_watchdog(cfg, dims, run_dir)
    if watchdog is not None:
        callbacks.append(watchdog)
    if dims.is_main and console.is_terminal:  # a live bar; plain log lines in files and pipes
        from .progress import ProgressCallback

        callbacks.append(ProgressCallback(console, cfg.train.train_iters))
    measurement = Measurement(cfg, device, dims, flops, peak.flops_per_second, Sinks(sinks))
    trainer = Trainer(
        cfg,
        model,
        optimizer,
        scheduler,
        iter(train_loader),
        valid_batches,
        measurement,
        dims,
        pipeline,
        callbacks,
    )
    return BuiltRun(trainer, run_dir, flops, peak, num_params, tracker, watchdog, callbacks)


def _print_warnings(cfg: ResolvedConfig, console: Console, device: torch.device, dims: ParallelDims) -> None:
    if not dims.is_main:
        return
    slow_precision = cpu_precision_warning(cfg.train.precision) if device.type == "cpu" else None
    if slow_precision is not None:
        console.print(f"[bold yellow]warning[/]: {slow_precision}")
    no_export = export_warning(cfg)
    if no_export is not None:
        console.print(f"[bold yellow]warning[/]: {no_export}", markup=False)


def _finish(
    cfg: ResolvedConfig,
    built: BuiltRun,
    history: Any,
    console: Console,
    dims: ParallelDims,
    start: float,
    first_iteration: int,
    predict: Predict | None = None,
) -> tuple[Path | None, dict]:
    """summary.json (written once, by rank 0) and the closing lines; every rank takes part in the
    per-rank gathers."""
    world, device = dims.world_size, built.trainer.device
    per_rank_peak = gather_per_rank(history.peak_memory_bytes, dims)
    summary = summarize(
        cfg, history, built.flops, built.peak, built.num_params, time.perf_counter() - start, world
    )
    summary["peak_memory_bytes_per_rank"] = per_rank_peak
    summary["run_peak_memory_bytes_per_rank"] = gather_per_rank(history.run_peak_memory_bytes, dims)
    summary["model_state_bytes_per_rank"] = {
        part: gather_per_rank(history.model_state_bytes.get(part, 0), dims)
        for part in ("parameters", "gradients", "optimizer")
    }
    summary["peak_tensor_bytes_per_rank"] = peak_tensor_bytes(built.tracker, device, per_rank_peak, dims)
    summary["layout"] = layout_label(cfg)
    summary["world_size"] = world
    summary["pipeline_bubble_theoretical"] = pipeline_bubble(cfg)
    summary["final_iteration"] = built.trainer.iteration
    wall = time.perf_counter() - start
    segment = segment_record(time.time() - wall, wall, first_iteration, history)
    if history.stopped_by and cfg.checkpoint.save:
        summary["resume_from"] = cfg.checkpoint.save
    run_dir = built.run_dir
    if run_dir is None:
        return None, summary
    summary.update(with_segment(read_previous_summary(run_dir), segment))
    summary.update(step_prediction(cfg, history, world, device, predict))
    write_json(run_dir / "summary.json", summary)
    print_done(console, summary, run_dir, history.peak_memory_method)
    print_observations(console, summary, built.callbacks)
    if history.stopped_by:
        console.print(f"[bold yellow]{stop_message(summary, cfg.train.train_iters)}[/]")
    return run_dir, summary


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


def observers(cfg: ResolvedConfig, device: torch.device, dims: ParallelDims, run_dir: Path | None) -> list:
    """The measuring callbacks the config asks for: device telemetry, a profiler window."""
    out: list[Callback] = []
    if cfg.logging.telemetry:
        from .telemetry_callback import TelemetryCallback

        out.append(TelemetryCallback(device, cfg.logging.telemetry_interval))
    lg = cfg.logging
    if lg.profile_start_step is not None:
        from ..config.rules import profile_ranks
        from .profiler_window import ProfileCallback

        shared = share_run_dir(run_dir, dims)
        out.append(
            ProfileCallback(
                lg.profile_start_step,
                lg.profile_end_step or lg.profile_start_step,
                profile_ranks(lg.profile_ranks, dims.world_size),
                lg.profile_memory,
                None if shared is None else shared / "profile",
            )
        )
    return out


def hang_watchdog(cfg: ResolvedConfig, dims: ParallelDims, run_dir: Path | None) -> HangWatchdog | None:
    """The hang watchdog of this rank (None: train.hang_timeout_seconds = 0)."""
    timeout = cfg.train.hang_timeout_seconds
    if timeout == 0:
        return None
    shared = share_run_dir(run_dir, dims)
    return HangWatchdog(timeout, 60 * cfg.parallel.timeout_minutes, shared, dims.rank, dims.world_size)


def share_run_dir(run_dir: Path | None, dims: ParallelDims) -> Path | None:
    """Rank 0's run directory on every rank (they write their traces into it)."""
    if dims.world_size == 1 or dims.mesh is None:
        return run_dir
    box = [None if run_dir is None else str(run_dir)]
    dist.broadcast_object_list(box, src=0)
    return None if box[0] is None else Path(box[0])


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


def export_warning(cfg: ResolvedConfig) -> str | None:
    """Why the checkpoints this run saves could not leave as a Hugging Face model (None: they can,
    or nothing is saved): said at the start, not discovered at `stx export` after training."""
    from ..models.registry import hf_unsupported

    reasons = hf_unsupported(cfg.model) if cfg.checkpoint.save else []
    if not reasons:
        return None
    return (
        f"checkpoint.save = {cfg.checkpoint.save}, but no Hugging Face architecture holds this model, so "
        "`stx export --format hf` will refuse its checkpoints: " + " | ".join(reasons)
    )


def build_parallel_model(
    cfg: ResolvedConfig, dims: ParallelDims, device: torch.device
) -> tuple[torch.nn.Module, Any]:
    """The model, split into this rank's pipeline stages when pp > 1, each parallelized.
    Returns (the module to train, the PipelineRunner or None).

    Built on the meta device: pruning to stages, tensor parallelism and FSDP2 / replicate happen on
    shapes only, then `parallelize` materializes this rank's shards (parallel/init.py, values a
    function of train.seed and the parameter name) and `init_from_hf` streams into them. No rank holds
    the whole model unless its layout keeps whole replicas (ZeRO-0/1 without tp/pp)."""
    if device.type == "cpu":  # host memory: freed full parameters and FSDP2 buffers must leave the RSS
        from ..parallel.init import return_large_frees_to_the_os

        return_large_frees_to_the_os()
    from ..parallel.init import meta_device

    pipelined = dims.mesh is not None and dims.pp > 1
    with meta_device():
        model = build_model(cfg.model)
        if pipelined:
            from ..parallel.pipeline import split_model

            stages = split_model(model, cfg, dims.pp_rank)  # the last stage's tied copy: on meta too
    if not pipelined:
        modules = [parallelize(model, cfg, dims, device)]
        runner = None
    else:
        from ..parallel.pipeline import PipelineRunner

        modules = [parallelize(stage, cfg, dims, device) for stage in stages]
        runner = PipelineRunner(modules, dims, cfg, device, cfg.train.gradient_accumulation_steps)
    del model  # the meta-device whole: only the parallelized modules hold storage
    if dims.pp > 1:  # dropout: pipeline stages must not repeat each other's masks (parallel/rng.py)
        from ..parallel.rng import stage_seed

        torch.manual_seed(stage_seed(cfg.train.seed, dims.pp_rank))
    if cfg.checkpoint.init_from_hf:
        from ..checkpoint.hf_import import load_hf_weights

        for module in modules:
            load_hf_weights(module, cfg.model, cfg.checkpoint.init_from_hf)
    if device.type == "cpu":  # the steps' allocations: see step_allocation
        from ..parallel.init import step_allocation

        step_allocation(fsdp=cfg.parallel.zero_stage >= 2)
    if runner is None:
        return modules[0], None
    return torch.nn.ModuleList(modules), runner
