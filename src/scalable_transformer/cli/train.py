"""`stx train [CONFIG] [key=value ...]`."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import signal
import threading
from collections.abc import Iterator
from typing import Any

from ..calibrate.this_machine import run_prediction
from ..config.load import load_config
from ..parallel.cluster_env import apply_cluster_env
from ..train.resilience import exit_status
from ..train.run import run_training
from ..train.trainer import Callback, Trainer
from .parsers import split_config_args


@dataclasses.dataclass(frozen=True)
class TrainOptions:
    """config: preset name or YAML path (None: the embedded default); overrides: key=value strings."""

    config: str | None
    overrides: tuple[str, ...] = ()

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TrainOptions:
        config, overrides = split_config_args(args.items)
        return cls(config, tuple(overrides))


def run(args: argparse.Namespace) -> int:
    opts = TrainOptions.from_args(args)
    # Started by srun / mpiexec rather than torchrun: RANK, WORLD_SIZE... from their variables.
    apply_cluster_env()
    cfg = load_config(opts.config, list(opts.overrides))
    with usr1_outside_training() as early:
        _, summary = run_training(cfg, callbacks=[early.callback()], predict=run_prediction)
    return exit_status(summary)


class EarlyStopRequest:
    """SIGUSR1 while `stx train` is not training (Trainer.fit handles it there): kept instead of
    killing the process, its default action. One caught before the first step stops the run after
    that step, with its checkpoint, as during training: a scheduler's `--signal=USR1@...` may come
    while a job still starts (Slurm sends it up to a minute early). One caught after the last step
    (a second request while the final checkpoint is written) changes nothing."""

    def __init__(self) -> None:
        self.signum = 0

    def __call__(self, signum: int, frame: object) -> None:
        self.signum = self.signum or signum

    def callback(self) -> Any:
        """The trainer callback that hands a request caught before the first step to the trainer."""

        request = self

        class HandOver(Callback):
            def on_step_start(self, trainer: Trainer) -> None:
                if request.signum:
                    trainer.stop_signals.caught = trainer.stop_signals.caught or request.signum
                    request.signum = 0

        return HandOver()


@contextlib.contextmanager
def usr1_outside_training() -> Iterator[EarlyStopRequest]:
    early = EarlyStopRequest()
    if threading.current_thread() is not threading.main_thread():  # handlers live there only
        yield early
        return
    previous = signal.signal(signal.SIGUSR1, early)
    try:
        yield early
    finally:
        signal.signal(signal.SIGUSR1, previous)
