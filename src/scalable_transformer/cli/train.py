"""`stx train [CONFIG] [key=value ...]`."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import signal
import threading
from collections.abc import Iterator

from ..calibrate.this_machine import run_prediction
from ..config.load import load_config
from ..parallel.cluster_env import apply_cluster_env
from ..train.resilience import exit_status
from ..train.run import run_training
from ..train.trainer import Callback, Trainer
from . import EarlyStopRequest
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
    with usr1_outside_training(getattr(args, "early_stop", None)) as early:
        _, summary = run_training(cfg, callbacks=[hand_over(early)], predict=run_prediction)
    return exit_status(summary)


def hand_over(request: EarlyStopRequest) -> Callback:
    """The trainer callback that hands a stop request caught before the first step to the trainer."""

    class HandOver(Callback):
        def on_step_start(self, trainer: Trainer) -> None:
            if request.signum:
                trainer.stop_signals.caught = trainer.stop_signals.caught or request.signum
                request.signum = 0

    return HandOver()


@contextlib.contextmanager
def usr1_outside_training(early: EarlyStopRequest | None = None) -> Iterator[EarlyStopRequest]:
    """SIGUSR1 kept as `early` (the one `stx`'s entry installed before this module was imported, which
    may already hold a request) while the block runs."""
    early = early or EarlyStopRequest()
    if threading.current_thread() is not threading.main_thread():  # handlers live there only
        yield early
        return
    previous = signal.signal(signal.SIGUSR1, early)
    try:
        yield early
    finally:
        signal.signal(signal.SIGUSR1, previous)
