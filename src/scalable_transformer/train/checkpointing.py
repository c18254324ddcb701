"""Checkpoints in a training run: open the checkpoint to resume from before anything starts, load it
into a built trainer, and save through the trainer's callbacks."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

from rich.console import Console

from ..checkpoint.manager import (
    LoadOptions,
    Resume,
    Saver,
    TrainState,
    check_save_dir,
    find_checkpoint,
    load_checkpoint,
    open_checkpoint,
    set_rng_state,
)
from ..config.load import to_yaml
from ..config.schema import ResolvedConfig
from ..metrics.environment import environment
from ..models import count_parameters
from .trainer import Callback, History, Trainer


def restarted_in_job() -> bool:
    """This process is a restart by `stx launch --max-restarts` (torch's elastic agent counts them):
    it resumes from the job's last checkpoint as if checkpoint.load were auto."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0


def open_resume(cfg: ResolvedConfig) -> Resume | None:
    """Check checkpoint.save is writable and checkpoint.load is a complete checkpoint, before any
    training: the checkpoint to continue from (None: start fresh)."""
    c = cfg.checkpoint
    if c.save:
        check_save_dir(c.save)
    load = c.load or ("auto" if c.save and restarted_in_job() else None)
    path = find_checkpoint(load, c.save) if load else None
    if path is None:
        return None
    return open_checkpoint(path, LoadOptions(not c.no_load_optim, not c.no_load_rng, c.finetune))


class CheckpointCallback(Callback):
    """Saves at checkpoint.save_interval and once when `fit` ends. `callbacks` are the trainer's
    others, told through `on_checkpoint_staged` when a save's shards are written but not published."""

    def __init__(self, saver: Saver) -> None:
        self.saver = saver

    def on_step_end(self, trainer: Trainer, result: Any) -> None:
        if self.saver.interval and trainer.iteration % self.saver.interval == 0:
            trainer.settle()  # the steps since the last read: a non-finite one stops the run unsaved
        self.saver.maybe_save(trainer)

    def on_fit_end(self, trainer: Trainer, history: History) -> None:
        trainer.settle()
        self.saver.save_final(trainer)


def attach_checkpoints(
    cfg: ResolvedConfig, trainer: Trainer, resume: Resume | None, console: Console | None, is_main: bool
) -> CheckpointCallback | None:
    """Load `resume` into the trainer's model, optimizer, schedule, scaler and loop position and restore
    the RNG; add the periodic saves to the trainer's callbacks. Returns that callback (None without
    checkpoint.save)."""
    c = cfg.checkpoint
    state = TrainState(
        trainer.model, trainer.optimizer, trainer.scheduler, trainer.scaler, trainer.pipeline is not None
    )
    if resume is not None:
        t0 = time.perf_counter()
        load_checkpoint(state, resume, LoadOptions(not c.no_load_optim, not c.no_load_rng, c.finetune))
        trainer.load_state_dict({"iteration": resume.iteration, "consumed_samples": resume.consumed_samples})
        if console is not None:
            console.print(
                f"[bold]resumed[/] from {resume.path} (saved at iteration {resume.meta['iteration']}, "
                f"layout {resume.meta['layout']}) in {time.perf_counter() - t0:.2f} s: continuing at "
                f"iteration {resume.iteration}, {resume.consumed_samples} consumed samples"
                + "".join(f"; {note}" for note in resume.notes)
            )
    callback = None
    if c.save:
        info = {
            "layout": cfg.parallel.layout_label,
            "parallel": dataclasses.asdict(cfg.parallel),
            "model": dataclasses.asdict(cfg.model),
            "num_parameters": count_parameters(cfg.model),
            "config_yaml": to_yaml(cfg),
            "environment": environment() if is_main else {},
        }
        others = list(trainer.callbacks)

        def staged(trainer: Any, iteration: int) -> None:
            for other in others:
                other.on_checkpoint_staged(trainer, iteration)

        saver = Saver(state, cfg, info, console, on_staged=staged)
        if resume is not None and not c.finetune:
            saver.last_saved = resume.iteration  # that checkpoint exists: do not write it again
        callback = CheckpointCallback(saver)
        trainer.callbacks.append(callback)
    if resume is not None and resume.rng is not None:  # last: nothing may draw numbers before step 1
        set_rng_state(resume.rng)
    return callback
