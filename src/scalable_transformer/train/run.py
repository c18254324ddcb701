"""`run_training`: config in, run directory and summary out. The recipe, one call a step:

resolve -> dims -> data -> model -> optimizer -> callbacks -> fit -> summary.

The builders are in `train/build.py`, what a run writes in `train/outputs.py`, the loop and the step
in `train/trainer.py`.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console

from ..config.schema import Config, ResolvedConfig
from ..config.validate import resolve
from ..parallel.dims import ParallelDims
from ..parallel.distributed import env_world_size, init_distributed, shutdown_distributed
from ..parallel.init import end_step_allocation
from .build import (
    Place,
    build_callbacks,
    build_data,
    build_measurement,
    build_optimizer_and_scheduler,
    build_run_model,
    build_trainer,
    device_peak,
    select_device,
    with_tokenizer,
)
from .checkpointing import Resume, attach_checkpoints, open_resume
from .measurement import History
from .outputs import Predict, RunOutputs, open_outputs, print_warnings, write_summary
from .trainer import Callback, Trainer
from .watchdog import HangWatchdog


def run_training(
    cfg: Config,
    console: Console | None = None,
    callbacks: Sequence[Callback] = (),
    predict: Predict | None = None,
) -> tuple[Path | None, dict]:
    """Train as the config says; return the run directory (None on ranks other than 0) and the summary.

    Under a launcher (WORLD_SIZE > 1) every rank calls this; the config is resolved (every rule
    checked) before any process group work, and the process group is torn down on the way out, also
    after an error. `callbacks` join the trainer's (see `train.trainer.Callback`). `predict(resolved
    config, world size, device type)` gives summary.json's `prediction` (or `prediction_error`): `stx
    train` passes the planner's (calibrate/this_machine.py `run_prediction`), which this layer does not
    import.
    """
    start = time.perf_counter()
    console = console or Console(highlight=False, soft_wrap=True)
    device = select_device(cfg)
    world = env_world_size()
    resolved = resolve(cfg, world)  # once: a bad layout fails here, before anything starts
    needs_group = world > 1 or resolved.parallel.zero_stage >= 2
    created = init_distributed(device, resolved.parallel.timeout_minutes, needed=needs_group)
    try:
        dims = ParallelDims.build(resolved, device.type)  # the one topology object of this run
        at = Place(console, device, dims, start)
        return _recipe(resolved, cfg.model.vocab_size, at, callbacks, predict)
    finally:
        shutdown_distributed(created)
        if device.type == "cpu":  # the steps' allocation setting ends with them (parallel/init.py)
            end_step_allocation()


def _recipe(
    cfg: ResolvedConfig,
    configured_vocab: int | None,
    at: Place,
    given: Sequence[Callback],
    predict: Predict | None,
) -> tuple[Path | None, dict]:
    """From the resolved config and the run's topology to the summary, one builder a step."""
    cfg, tokenizer = with_tokenizer(cfg, configured_vocab, at.dims)  # the tokenizer's vocabulary
    resume = open_resume(cfg)  # a bad checkpoint or save directory fails here, before anything runs
    peak = device_peak(cfg, at)
    print_warnings(cfg, at)
    data = build_data(cfg, tokenizer, resume, at.dims)
    model = build_run_model(cfg, at)
    optimizer, scheduler = build_optimizer_and_scheduler(cfg, model.module, at.dims)
    outputs = open_outputs(cfg, at, resume, model, peak)
    callbacks = build_callbacks(cfg, at, outputs.run_dir, given, model.tracker)
    measurement = build_measurement(
        cfg, at.device, at.dims, model.flops, peak.flops_per_second, outputs.sinks, peak.fp8_flops_per_second
    )
    trainer = build_trainer(
        cfg, model.module, optimizer, scheduler, data, measurement, at.dims, model.pipeline, callbacks
    )
    if _fit(cfg, trainer, resume, at, outputs) is None:
        return outputs.run_dir, {"iterations": 0, "resumed_at_iteration": trainer.iteration}
    return write_summary(cfg, at, trainer, model, outputs, predict)


def _fit(
    cfg: ResolvedConfig, trainer: Trainer, resume: Resume | None, at: Place, outputs: RunOutputs
) -> History | None:
    """Resume into the trainer (checkpoint saves attached), train, and close the sinks and the
    watchdog (also after a failure). None: the checkpoint is already at train.train_iters."""
    try:
        attach_checkpoints(cfg, trainer, resume, at.console if at.dims.is_main else None, at.dims.is_main)
    except BaseException:  # e.g. a checkpoint of another shape: the run never started, so no directory
        trainer.sinks.close()
        if outputs.run_dir is not None:
            shutil.rmtree(outputs.run_dir, ignore_errors=True)
        raise
    if trainer.iteration >= cfg.train.train_iters:
        if at.dims.is_main:
            at.console.print(
                f"nothing to train: already at iteration {trainer.iteration} of {cfg.train.train_iters}"
            )
        trainer.sinks.close()
        return None
    try:
        return trainer.fit()
    finally:
        trainer.sinks.close()
        for callback in trainer.callbacks:  # no thread or heartbeat left behind
            if isinstance(callback, HangWatchdog):
                callback.close()
