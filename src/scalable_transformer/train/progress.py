"""A live progress line in a terminal (rich): iteration, elapsed, ETA, loss, samples/s.

Only when the console is a terminal: in a log file or a pipe the per-interval log lines are the
progress (a redrawn bar would fill the file with control characters). The log lines print above the
bar, through the same console.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import Progress

from ..metrics.sinks import LogRecord, progress_columns
from .trainer import Callback, History, StepResult, Trainer


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
