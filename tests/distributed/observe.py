"""A real training run observed by the dry run's trace (`DryRunTrace`) during one step (the first, or
the dry run's plain step: the second).

On real tensors the trace records and fakes nothing: collectives (group, kind, bytes), storage lifetimes
and what the first micro-batch keeps for its backward. The parameters, made before it starts, are
adopted so that views of them are not taken for new storage.
"""

from __future__ import annotations

import io
from typing import Any


def observed_run(config: str, overrides: list[str], step: int = 1) -> tuple[Any, dict[str, Any]]:
    """(the trace of iteration `step`, summary.json's dict) of `stx train config overrides` in this
    process."""
    from rich.console import Console

    from scalable_transformer.config.load import load_config
    from scalable_transformer.dryrun.dry_run import _group_names
    from scalable_transformer.dryrun.dry_run_trace import DryRunTrace
    from scalable_transformer.train.run import run_training
    from scalable_transformer.train.trainer import Callback

    class FirstStep(Callback):
        def __init__(self) -> None:
            self.trace: DryRunTrace | None = None

        def on_step_start(self, trainer) -> None:
            if trainer.iteration == step - 1:
                self.trace = DryRunTrace(_group_names(trainer.dims), backend="gloo", device_type="cpu")
                self.trace.step, self.trace.phase = step, "forward-compute"
                self.trace.adopt(list(trainer.model.parameters()), "parameters")
                self.trace.__enter__()

        def on_step_end(self, trainer, result) -> None:
            if trainer.iteration == step and self.trace is not None:
                self.trace.__exit__(None, None, None)

    observer = FirstStep()
    _, summary = run_training(
        load_config(config, overrides), Console(file=io.StringIO()), callbacks=[observer]
    )
    assert observer.trace is not None
    return observer.trace, summary
