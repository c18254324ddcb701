"""The named builders of a training run, each from the resolved config: the device, the tokenizer's
vocabulary, the data, the parallel model, the optimizer and its schedule, the callbacks and the
trainer with its measurement. `train/run.py` calls them in the recipe's order; the dry run builds
its engine through the same ones (`build_parallel_model`, `build_optimizer_and_scheduler`,
`build_measurement`, `build_trainer`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from rich.console import Console

from ..checkpoint.hf_import import load_hf_weights
from ..config.schema import Config, ResolvedConfig
from ..config.validate import with_vocabulary
from ..data.loader import build_datasets, build_loader, eval_batches
from ..data.tokenizers import load_tokenizer
from ..errors import ConfigError
from ..metrics.device_specs import PeakInfo, resolve_fp8_peak, resolve_peak
from ..metrics.flops import FlopsCount, step_flops
from ..metrics.live_tensor_bytes import TensorBytesTracker
from ..metrics.sinks import Sink, Sinks
from ..models import build_model, count_parameters
from ..parallel.apply import parallelize
from ..parallel.dims import ParallelDims
from ..parallel.init import meta_device, return_large_frees_to_the_os, step_allocation
from ..parallel.pipeline import PipelineRunner, split_model
from ..parallel.rng import stage_seed
from .callbacks import ProfileCallback, ProgressCallback, TelemetryCallback, TensorBytesCallback
from .checkpointing import Resume
from .measurement import Measurement
from .optim import build_optimizer, build_scheduler
from .trainer import Batch, Callback, Trainer
from .watchdog import HangWatchdog


@dataclasses.dataclass(frozen=True)
class Place:
    """Where a run runs: the console it prints to (rank 0), its device, its topology and the time it
    started (the summary's wall time counts from there)."""

    console: Console
    device: torch.device
    dims: ParallelDims
    start: float


@dataclasses.dataclass(frozen=True)
class RunData:
    """The training micro-batches and the validation batches (a fresh list per evaluation).
    `train_batches` is iterated when the trainer is built, not before: a DataLoader draws its base
    seed from torch's generator then, which must come after the model's initialization."""

    train_batches: Iterable[Batch]
    valid_batches: Callable[[], Sequence[Batch]]


@dataclasses.dataclass(frozen=True)
class RunModel:
    """This rank's parallelized model, with what the banner and summary say of the whole model."""

    module: torch.nn.Module  # the module to train (a ModuleList of this rank's stages when pp > 1)
    pipeline: PipelineRunner | None  # the pipeline schedule of those stages (None: pp = 1)
    num_params: int  # of the whole (unsharded) model
    flops: FlopsCount  # per iteration, in the configured convention
    tracker: TensorBytesTracker | None  # live tensor bytes on a CPU (logging.track_tensor_bytes)


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


def with_tokenizer(
    cfg: ResolvedConfig, configured_vocab: int | None, dims: ParallelDims
) -> tuple[ResolvedConfig, Any]:
    """The tokenizer (rank 0 builds or reads it first) and the config with its vocabulary
    (`configured_vocab`: model.vocab_size as given, None: the tokenizer's size)."""
    d = cfg.data
    with rank_zero_first(dims):
        tokenizer = load_tokenizer(
            d.tokenizer,
            d.tokenizer_vocab_size,
            vocab_file=d.vocab_file,
            merge_file=d.merge_file,
            tokenizer_type=d.tokenizer_type,
        )
    return with_vocabulary(cfg, configured_vocab, tokenizer.vocab_size), tokenizer


def build_data(cfg: ResolvedConfig, tokenizer: Any, resume: Resume | None, dims: ParallelDims) -> RunData:
    """This rank's training batches (continuing after a resumed checkpoint's samples) and the
    validation batches; rank 0 builds the datasets' index caches first."""
    with rank_zero_first(dims):
        train_ds, valid_ds, _ = build_datasets(cfg, tokenizer)
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

    return RunData(train_loader, valid_batches)


def device_peak(cfg: ResolvedConfig, at: Place) -> PeakInfo:
    """The peak FLOP/s of one device that MFU and HFU divide by (rank 0 measures a CPU's first)."""
    lg = cfg.logging
    with rank_zero_first(at.dims):
        peak = resolve_peak(at.device.type, cfg.train.precision, lg.device_name, lg.peak_tflops)
    if cfg.train.fp8 == "none":
        return peak
    # an FP8 run reports MFU against both: the bf16 peak (its precision) and the float8 one
    fp8 = resolve_fp8_peak(at.device.type, lg.device_name, lg.peak_tflops)
    return dataclasses.replace(peak, fp8_flops_per_second=fp8.flops_per_second, fp8_source=fp8.source)


def build_run_model(cfg: ResolvedConfig, at: Place) -> RunModel:
    """The seed set right before initialization, the tensor-bytes tracker started before the model
    (its tensors are counted), then this rank's parallel model."""
    set_seed(cfg.train.seed)  # nothing above may shift the weights or dropout masks
    tracker = tensor_bytes_tracker(cfg, at.device)
    module, pipeline = build_parallel_model(cfg, at.dims, at.device)
    num_params = count_parameters(cfg.model)
    return RunModel(module, pipeline, num_params, step_flops(cfg, num_params), tracker)


def build_parallel_model(
    cfg: ResolvedConfig, dims: ParallelDims, device: torch.device
) -> tuple[torch.nn.Module, PipelineRunner | None]:
    """The model, split into this rank's pipeline stages when pp > 1, each parallelized.
    Returns (the module to train, the PipelineRunner or None).

    Built on the meta device: pruning to stages, tensor parallelism and FSDP2 / replicate happen on
    shapes only, then `parallelize` materializes this rank's shards (parallel/init.py, values a
    function of train.seed and the parameter name) and `init_from_hf` streams into them. No rank holds
    the whole model unless its layout keeps whole replicas (ZeRO-0/1 without tp/pp)."""
    if device.type == "cpu":  # host memory: freed full parameters and FSDP2 buffers must leave the RSS
        return_large_frees_to_the_os()
    pipelined = dims.mesh is not None and dims.pp > 1
    with meta_device():
        model = build_model(cfg.model)
        if pipelined:
            stages = split_model(model, cfg, dims.pp_rank)  # the last stage's tied copy: on meta too
    if not pipelined:
        modules = [parallelize(model, cfg, dims, device)]
        runner = None
    else:
        modules = [parallelize(stage, cfg, dims, device) for stage in stages]
        runner = PipelineRunner(modules, dims, cfg, device, cfg.train.gradient_accumulation_steps)
    del model  # the meta-device whole: only the parallelized modules hold storage
    if dims.pp > 1:  # dropout: pipeline stages must not repeat each other's masks (parallel/rng.py)
        torch.manual_seed(stage_seed(cfg.train.seed, dims.pp_rank))
    if cfg.checkpoint.init_from_hf:
        for module in modules:
            load_hf_weights(module, cfg.model, cfg.checkpoint.init_from_hf)
    if device.type == "cpu":  # the steps' allocations: see step_allocation
        step_allocation(fsdp=cfg.parallel.zero_stage >= 2)
    if runner is None:
        return modules[0], None
    return torch.nn.ModuleList(modules), runner


def build_optimizer_and_scheduler(
    cfg: ResolvedConfig, model: torch.nn.Module, dims: ParallelDims
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """The optimizer over the model's parameters (ZeRO-1: its state sharded over dp, x cp under context
    parallelism) and its lr schedule."""
    zero_group = dims.grad_group if cfg.parallel.zero_stage == 1 else None
    optimizer = build_optimizer(model, cfg.optim, zero_group=zero_group)
    return optimizer, build_scheduler(optimizer, cfg.optim, cfg.train.train_iters)


def build_callbacks(
    cfg: ResolvedConfig, at: Place, run_dir: Path | None, given: Sequence[Callback], tracker: Any
) -> list[Callback]:
    """The trainer's callbacks, in the order they run: the caller's, the tensor-bytes tracker's, the
    measuring ones the config asks for, the hang watchdog, and a live progress bar in a terminal
    (plain log lines in files and pipes). The checkpoint saves join when checkpoints are attached."""
    callbacks = [*given, TensorBytesCallback(tracker)] if tracker is not None else list(given)
    callbacks += observers(cfg, at.device, at.dims, run_dir)
    watchdog = hang_watchdog(cfg, at.dims, run_dir)
    if watchdog is not None:
        callbacks.append(watchdog)
    if at.dims.is_main and at.console.is_terminal:
        callbacks.append(ProgressCallback(at.console, cfg.train.train_iters))
    return callbacks


def build_measurement(
    cfg: ResolvedConfig,
    device: torch.device,
    dims: ParallelDims,
    flops: FlopsCount,
    peak_flops_per_second: float,
    sinks: list[Sink],
    fp8_peak_flops_per_second: float = 0.0,
) -> Measurement:
    """The run's timers, step clock, memory tracker and step ledger, writing to `sinks`; MFU against
    `peak_flops_per_second` (FLOP/s per device) and, for a train.fp8 run, against
    `fp8_peak_flops_per_second` as well (0.0: no float8 peak, its MFU is None)."""
    measurement = Measurement(cfg, device, dims, flops, peak_flops_per_second, Sinks(sinks))
    measurement.fp8_peak_flops = fp8_peak_flops_per_second
    return measurement


def build_trainer(
    cfg: ResolvedConfig,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    data: RunData,
    measurement: Measurement,
    dims: ParallelDims,
    pipeline: PipelineRunner | None,
    callbacks: Sequence[Callback],
) -> Trainer:
    """The trainer over the built parts."""
    return Trainer(
        cfg,
        model,
        optimizer,
        scheduler,
        iter(data.train_batches),
        data.valid_batches,
        measurement,
        dims,
        pipeline,
        callbacks,
    )


def tensor_bytes_tracker(cfg: ResolvedConfig, device: torch.device) -> TensorBytesTracker | None:
    """A started tracker when this CPU run measures live tensor bytes (logging.track_tensor_bytes).
    On CUDA none is needed: the trainer's peak allocated bytes (torch.cuda.max_memory_allocated over
    every log interval) are the live tensor bytes, and the summary records those."""
    if device.type == "cuda" or not cfg.logging.track_tensor_bytes:
        return None
    tracker = TensorBytesTracker(device)
    tracker.start()
    return tracker


def observers(cfg: ResolvedConfig, device: torch.device, dims: ParallelDims, run_dir: Path | None) -> list:
    """The measuring callbacks the config asks for: device telemetry, a profiler window."""
    out: list[Callback] = []
    lg = cfg.logging
    if lg.telemetry:
        out.append(TelemetryCallback(device, lg.telemetry_interval))
    if lg.profile_start_step is not None:
        shared = share_run_dir(run_dir, dims)
        out.append(
            ProfileCallback(
                lg.profile_start_step,
                lg.profile_end_step or lg.profile_start_step,
                list(lg.profiled_ranks),
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
