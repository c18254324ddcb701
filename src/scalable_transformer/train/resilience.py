"""Faults a run survives or ends cleanly: stop signals (a scheduler's time limit, a preemption),
non-finite losses and gradients, loss spikes.

Stop signals: SIGTERM or SIGUSR1 (Slurm's `--signal=USR1@SECONDS`, PBS's kill grace, `kill`) while
training only set a flag; every rank finishes the step it is in, the ranks agree on the step to stop
after, the trainer's callbacks save the final checkpoint, and `stx` exits with EXIT_RESUMABLE. The
agreement is one MAX all-reduce of a host int (gloo) every `train.stop_check_interval` steps, issued
asynchronously after a check step and read at the next one, so it runs behind a step's compute: a
signal caught in step k stops the run after the first check step at least `interval` steps later. Outside
`Trainer.fit` the signals keep their CLI meaning (stop now, 128 + signal).
"""

from __future__ import annotations

import math
import signal
import statistics
import threading
from collections import deque
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from ..errors import NonFiniteError

EXIT_RESUMABLE = 75  # sysexits.h EX_TEMPFAIL: stopped on purpose after a checkpoint; resume to continue
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopSignals:
    """Catches STOP_SIGNALS while active (a context manager) and says, at the same iterations on every
    rank, whether any rank caught one. `world`: a process group over every rank (None: one process)."""

    def __init__(self, world: Any = None, check_interval: int = 1) -> None:
        self.world, self.check_interval = world, check_interval
        self.caught: int = 0  # the first signal caught on this rank (0: none)
        self._previous: dict[int, Any] = {}
        self._pending: tuple[Any, torch.Tensor] | None = None  # the all-reduce issued at the last check

    def _catch(self, signum: int, frame: FrameType | None) -> None:
        self.caught = self.caught or signum

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # signal handlers live there only
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._catch)
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self._pending is not None and exc_type is None:  # every rank issued it: complete it
            self._pending[0].wait()
        self._pending = None

    def agreed(self, iteration: int) -> str | None:
        """After `iteration` completed on every rank: the name of the signal that stops the run, or None.
        A collective on check iterations (every rank calls this after every step)."""
        if iteration % self.check_interval:
            return None
        if self.world is None or dist.get_world_size(self.world) == 1:
            return signal.Signals(self.caught).name if self.caught else None
        decided = 0
        if self._pending is not None:  # issued at the last check: normally done behind the steps since
            work, flag = self._pending
            work.wait()
            decided = int(flag.item())
        # a host tensor: on "cuda:nccl,cpu:gloo" this is gloo, so it never waits on the GPU queue
        flag = torch.tensor([self.caught], dtype=torch.int64)
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.world, async_op=True), flag)
        return signal.Signals(decided).name if decided else None


def exit_status(summary: dict[str, Any]) -> int:
    """`stx train`'s exit status for a finished run's summary: 0, EXIT_RESUMABLE after a stop signal
    with a checkpoint saved, 128 + the signal when nothing was saved to resume from."""
    name = summary.get("stopped_by_signal")
    if not name:
        return 0
    return EXIT_RESUMABLE if summary.get("resume_from") else 128 + signal.Signals[name].value


def stop_message(summary: dict[str, Any], train_iters: int) -> str:
    """What the run says when a stop signal ended it."""
    head = (
        f"stopped by {summary['stopped_by_signal']} after iteration {summary['final_iteration']} "
        f"of {train_iters}"
    )
    if summary.get("resume_from"):
        return (
            f"{head}: checkpoint saved in {summary['resume_from']}; the same command with "
            f"checkpoint.load=auto continues it (exit status {EXIT_RESUMABLE}: stopped to be resumed)"
        )
    return f"{head}: nothing saved (checkpoint.save is not set), so this run cannot be resumed"


def nonfinite_message(iteration: int, loss: float, grad_norm: float) -> str:
    parts = [f"the loss is {loss}"] if not math.isfinite(loss) else []
    if not math.isfinite(grad_norm):
        parts.append(f"the gradient norm is {grad_norm}")
    return f"iteration {iteration}: " + " and ".join(parts)


class NonFiniteSteps:
    """train.on_nonfinite for bf16/fp32 steps: `check` returns True when the step's update must be
    skipped, raises NonFiniteError when the run must stop. The trainer calls it with the global
    gradient norm (and the loss summed over ranks when it has it), so every rank decides the same:
    under `skip` at the step itself (one host read), under `stop` when the steps are read (logging
    steps, checkpoint saves)."""

    def __init__(self, policy: str, max_skipped: int) -> None:
        self.policy, self.max_skipped = policy, max_skipped
        self.skipped: list[int] = []  # iterations skipped as non-finite in this job

    def check(self, iteration: int, loss: float, grad_norm: float) -> bool:
        if math.isfinite(loss) and math.isfinite(grad_norm):
            return False
        what = nonfinite_message(iteration, loss, grad_norm)
        if self.policy == "stop":
            raise NonFiniteError(
                f"{what} (train.on_nonfinite = stop): stopped at the first read of the steps after it "
                "(a logging step or a checkpoint save, which is not written). The last checkpoint saved "
                "before it is the one checkpoint.load=auto resumes from; train.on_nonfinite=skip skips "
                "such steps instead"
            )
        self.skipped.append(iteration)
        if len(self.skipped) > self.max_skipped:
            raise NonFiniteError(
                f"{what}: {len(self.skipped)} steps skipped as non-finite in this job (iterations "
                f"{self.skipped[:10]}{'...' if len(self.skipped) > 10 else ''}), more than "
                f"train.max_skipped_steps = {self.max_skipped}: stopped before its update"
            )
        return True


class LossSpikes:
    """Megatron's spiky-loss check: a step's loss above `factor` x the median of the last `window`
    finite losses (once `min_history` are known) is a spike. factor 0: off."""

    def __init__(self, factor: float, window: int = 100, min_history: int = 10) -> None:
        self.factor, self.min_history = factor, min_history
        self.recent: deque[float] = deque(maxlen=window)

    def check(self, loss: float) -> float | None:
        """The median the loss was compared with when it is a spike, else None."""
        if not self.factor or not math.isfinite(loss):
            return None
        median = statistics.median(self.recent) if len(self.recent) >= self.min_history else None
        self.recent.append(loss)
        if median is not None and loss > self.factor * median:
            return median
        return None
