"""Test-only fault injection: `stx train` with callbacks that fail on purpose.

    python tests/faults.py [--fail-at RANK:ITER] [--exit-in-save ITER] train [CONFIG] [key=value ...]

--fail-at: that rank raises at the start of that (1-based) iteration (the launcher's crash tests).
--exit-in-save: rank 0 exits with status 17 inside that iteration's save, after every shard is
written and before the checkpoint is published (the resume tests' kill during a save).

The library has no fault-injection switch of its own: these are ordinary trainer callbacks, given to
`run_training` by this script. Run as a rank's command under `stx launch` or on its own.
"""

from __future__ import annotations

import argparse
import os
import sys

from scalable_transformer.config.load import load_config
from scalable_transformer.train.run import run_training
from scalable_transformer.train.trainer import Callback, Trainer


class FailAt(Callback):
    def __init__(self, rank: int, iteration: int) -> None:
        self.rank, self.iteration = rank, iteration

    def on_step_start(self, trainer: Trainer) -> None:
        if trainer.dims.rank == self.rank and trainer.iteration + 1 == self.iteration:
            raise RuntimeError(f"injected failure on rank {self.rank} at iteration {self.iteration}")


class ExitInSave(Callback):
    def __init__(self, iteration: int) -> None:
        self.iteration = iteration

    def on_checkpoint_staged(self, trainer: Trainer, iteration: int) -> None:
        if trainer.dims.rank == 0 and iteration == self.iteration:
            os._exit(17)  # a kill between writing the shards and publishing the checkpoint


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fail-at", help="RANK:ITERATION")
    parser.add_argument("--exit-in-save", type=int, help="ITERATION")
    parser.add_argument("command", choices=["train"])
    parser.add_argument("items", nargs="*")
    args = parser.parse_args(argv)
    callbacks: list[Callback] = []
    if args.fail_at:
        rank, iteration = (int(x) for x in args.fail_at.split(":"))
        callbacks.append(FailAt(rank, iteration))
    if args.exit_in_save is not None:
        callbacks.append(ExitInSave(args.exit_in_save))
    items = args.items
    spec, overrides = (items[0], items[1:]) if items and "=" not in items[0] else (None, items)
    run_training(load_config(spec, overrides), callbacks=callbacks)
    return 0


if __name__ == "__main__":
    # as `stx launch` runs ranks: an uncaught exception goes to torchelastic's error file
    from torch.distributed.elastic.multiprocessing.errors import record

    sys.exit(record(main)(sys.argv[1:]))
