"""Test-only fault injection: `stx train` with callbacks that fail on purpose.

    python tests/faults.py [--fail-at RANK:ITER] [--signal-at RANK:ITER:SIGNAL] [--nonfinite-at ITER]
                           [--exit-in-save ITER] train [CONFIG] [key=value ...]

--fail-at: that rank raises at the start of that (1-based) iteration (the launcher's crash tests);
a rank restarted by `stx launch --max-restarts` does not.
--signal-at: that rank sends itself that signal (SIGUSR1, SIGTERM) at the start of that iteration.
--nonfinite-at ITER: that iteration's loss and gradients are nan on every rank (the model's output
is multiplied by nan in its forward).
--exit-in-save: rank 0 exits with status 17 inside that iteration's save, after every shard is
written and before the checkpoint is published (the resume tests' kill during a save).

The library has no fault-injection switch of its own: these are ordinary trainer callbacks, given to
`run_training` by this script. Run as a rank's command under `stx launch` or on its own.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from scalable_transformer.cli import entry
from scalable_transformer.cli import main as cli_main
from scalable_transformer.train.trainer import Callback, Trainer


class FailAt(Callback):
    def __init__(self, rank: int, iteration: int) -> None:
        self.rank, self.iteration = rank, iteration

    def on_step_start(self, trainer: Trainer) -> None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"  # restarts run on
        if trainer.dims.rank == self.rank and trainer.iteration + 1 == self.iteration and first_attempt:
            raise RuntimeError(f"injected failure on rank {self.rank} at iteration {self.iteration}")


class SignalAt(Callback):
    def __init__(self, rank: int, iteration: int, signum: int) -> None:
        self.rank, self.iteration, self.signum = rank, iteration, signum

    def on_step_start(self, trainer: Trainer) -> None:
        if trainer.dims.rank == self.rank and trainer.iteration + 1 == self.iteration:
            os.kill(os.getpid(), self.signum)
            if self.signum == signal.SIGSTOP:
                # resumed (by the peer's watchdog, SIGUSR2 then SIGCONT): stay here a while as a rank
                # stuck in this code would, so the stack dump that runs as it resumes names this frame
                # (CI saw the main thread already in the next callback when the dump ran)
                time.sleep(5)


class NonFiniteAt(Callback):
    """Multiplies the model's output by nan in the forward of that (1-based) iteration only, on every
    rank: that step's loss and gradients are nan, the weights before it are untouched."""

    def __init__(self, iteration: int) -> None:
        self.iteration = iteration
        self.hook = None

    def on_step_start(self, trainer: Trainer) -> None:
        if trainer.iteration + 1 == self.iteration:
            self.hook = trainer.model.register_forward_hook(lambda module, args, out: out * float("nan"))

    def on_step_end(self, trainer: Trainer, result: object) -> None:
        if self.hook is not None:
            self.hook.remove()
            self.hook = None


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
    parser.add_argument("--nonfinite-at", type=int, help="ITERATION")
    parser.add_argument("--signal-at", help="RANK:ITERATION:SIGNAL")
    parser.add_argument("command", choices=["train"])
    parser.add_argument("items", nargs="*")
    args = parser.parse_args(argv)
    callbacks: list[Callback] = []
    if args.fail_at:
        rank, iteration = (int(x) for x in args.fail_at.split(":"))
        callbacks.append(FailAt(rank, iteration))
    if args.signal_at:
        rank, iteration, name = args.signal_at.split(":")
        callbacks.append(SignalAt(int(rank), int(iteration), signal.Signals[name].value))
    if args.nonfinite_at is not None:
        callbacks.append(NonFiniteAt(args.nonfinite_at))
    if args.exit_in_save is not None:
        callbacks.append(ExitInSave(args.exit_in_save))
    # The command runs as `stx train` does (the CLI's error messages, exit statuses and exit path),
    # with the callbacks added to the trainer's.
    import scalable_transformer.train.run as run_module

    def with_faults(cfg, console=None, callbacks=(), predict=None):
        return original(cfg, console, [*callbacks, *injected], predict)

    original, injected = run_module.run_training, callbacks
    run_module.run_training = with_faults
    return cli_main(["train", *args.items])


if __name__ == "__main__":
    # as `stx launch` runs ranks: an uncaught exception goes to torchelastic's error file
    from torch.distributed.elastic.multiprocessing.errors import record

    entry(record(lambda: main(sys.argv[1:])))
