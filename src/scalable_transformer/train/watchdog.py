"""A hang watchdog on every rank: a job whose steps stop completing ends, with the stacks that say
where, instead of holding every device until the scheduler's time limit.

Each rank runs one daemon thread. It writes the rank's heartbeat (last completed iteration, host,
pid, time) into <run dir>/.watchdog/ every few seconds, and when no progress (a step started or
ended, an evaluation, a checkpoint) happened for the timeout it:
  1. writes every thread's Python stack (faulthandler) to <run dir>/hang/rank-N.txt;
  2. names the ranks that stopped progressing: those whose heartbeat went stale (the process is
     stopped, dead or stuck in C without the GIL) and those at the lowest completed iteration;
  3. asks the stale ranks on this host for their stacks too: every rank registered faulthandler on
     SIGUSR2 at start, writing to <run dir>/hang/rank-N.txt (opened then: a signal handler cannot
     open files; removed at the end when empty), and SIGCONT lets a stopped one write;
  4. exits the process with EXIT_HUNG, so the launcher (srun --kill-on-bad-exit, stx launch, mpiexec)
     ends the job.
Considered: torch's NCCL watchdog and flight recorder (TORCH_NCCL_TRACE_BUFFER_SIZE,
TORCH_NCCL_DUMP_ON_TIMEOUT) cover NCCL collectives only and fire at the collective timeout; this
covers every backend, the host code between collectives and the data loader, and names the ranks.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, TypeVar

from ..files import write_atomic
from .trainer import Callback

EXIT_HUNG = 124  # as timeout(1): the job was ended because it stopped making progress
DEFAULT_FACTOR = 20.0  # default timeout = this x the median step time, bounded by DEFAULT_BOUNDS
DEFAULT_BOUNDS = (300.0, 3600.0)
STEPS_FOR_DEFAULT = 3  # steps measured before the default is derived from them
T = TypeVar("T")


def default_timeout(step_seconds: list[float], before_steps: float) -> float:
    """train.hang_timeout_seconds unset: `before_steps` until STEPS_FOR_DEFAULT steps are measured
    (the first ones compile, warm caches and may wait for slow ranks), then DEFAULT_FACTOR x their
    median, within DEFAULT_BOUNDS."""
    if len(step_seconds) < STEPS_FOR_DEFAULT:
        return before_steps
    low, high = DEFAULT_BOUNDS
    return min(max(DEFAULT_FACTOR * statistics.median(step_seconds[-100:]), low), high)


class HangWatchdog(Callback):
    """`timeout`: seconds without progress before the job is ended (None: `default_timeout`);
    `run_dir`: rank 0's run directory, shared by all ranks (None: a rank without one writes to stderr)."""

    def __init__(
        self, timeout: float | None, before_steps: float, run_dir: Path | None, rank: int, world: int
    ) -> None:
        self.timeout, self.before_steps = timeout, before_steps
        self.run_dir, self.rank, self.world = run_dir, rank, world
        self.poll = 1.0 if timeout is None else max(0.2, min(5.0, timeout / 10))
        self.iteration = 0
        self.step_seconds: list[float] = []
        self._progress = time.monotonic()
        self._step_started: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stack_file: IO[str] | None = None
        self._warned: set[str] = set()

    # ------------------------------------------------------------------ progress, from the training thread

    def _tick(self) -> None:
        self._progress = time.monotonic()
        if self._thread is None:
            self._start()

    def on_step_start(self, trainer: Any) -> None:
        self._step_started = time.monotonic()
        self.iteration = trainer.iteration
        self._tick()

    def on_step_end(self, trainer: Any, result: Any) -> None:
        if self._step_started is not None:
            self.step_seconds.append(time.monotonic() - self._step_started)
        self.iteration = trainer.iteration
        self._tick()

    def on_evaluate(self, trainer: Any, metrics: dict[str, float]) -> None:
        self._tick()

    def on_checkpoint_staged(self, trainer: Any, iteration: int) -> None:
        self._tick()

    def on_fit_end(self, trainer: Any, history: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ the thread

    def _dir(self, name: str) -> Path | None:
        if self.run_dir is None:
            return None
        path = self.run_dir / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _in_dir(self, name: str, make: Callable[[Path], T]) -> T | None:
        """`make(directory)` in the run directory's `name`, made first. Another rank that ends removes
        the directory when it is empty (`close`), which can fall between our mkdir and our file: then
        it is made again. None without a run directory."""
        for attempt in range(3):
            path = self._dir(name)
            if path is None:
                return None
            try:
                return make(path)
            except FileNotFoundError:
                if attempt == 2:
                    raise
        return None

    def _start(self) -> None:
        # opened now: a signal handler cannot open files; removed if left empty. The watchdog is
        # no measurement, but it is not what the run is for either: a file it cannot write is
        # reported and the run goes on, watched without that file.
        try:
            self._stack_file = self._in_dir(
                "hang", lambda hang: (hang / f"rank-{self.rank}.txt").open("a", encoding="utf-8")
            )
        except OSError as e:
            self._warn(f"cannot open its stack file ({e}); a hang's stacks go to stderr")
        if self._stack_file is not None:
            faulthandler.register(signal.SIGUSR2, file=self._stack_file, all_threads=True, chain=False)
        self._heartbeat()  # now: a rank that stops before the first poll must still be found
        self._thread = threading.Thread(target=self._watch, name="stx-hang-watchdog", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop watching (the run ended, or failed); leaves no heartbeat or empty stack file behind."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._stack_file is not None:
            faulthandler.unregister(signal.SIGUSR2)
            self._stack_file.close()
            self._stack_file = None
        if self.run_dir is not None:
            beats = self.run_dir / ".watchdog"
            (beats / f"rank-{self.rank}.json").unlink(missing_ok=True)
            _rmdir_if_empty(beats)
            stacks = self.run_dir / "hang" / f"rank-{self.rank}.txt"
            if stacks.is_file() and stacks.stat().st_size == 0:
                stacks.unlink()
            _rmdir_if_empty(stacks.parent)

    def limit(self) -> float:
        return (
            self.timeout
            if self.timeout is not None
            else default_timeout(self.step_seconds, self.before_steps)
        )

    def _watch(self) -> None:
        while not self._stop.wait(self.poll):
            self._heartbeat()
            idle = time.monotonic() - self._progress
            if idle > self.limit():
                self._fire(idle)

    def _heartbeat(self) -> None:
        if self.run_dir is None:
            return
        beat = {
            "rank": self.rank,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "iteration": self.iteration,
            "written_at": time.time(),
        }
        try:
            self._in_dir(
                ".watchdog", lambda beats: write_atomic(beats / f"rank-{self.rank}.json", json.dumps(beat))
            )
        except OSError as e:  # the others may then name this rank as stopped: said here, once
            self._warn(f"cannot write its heartbeat ({e})")

    def _warn(self, what: str) -> None:
        """Print `what` once per kind (the text before its parenthesized detail) for this rank."""
        kind = what.split(" (")[0]
        if kind not in self._warned:
            self._warned.add(kind)
            print(f"stx: warning: the hang watchdog of rank {self.rank} {what}", file=sys.stderr, flush=True)

    def stalled_ranks(self) -> list[dict[str, Any]]:
        """Every other rank's heartbeat that is stale (no write for 3 polls + 2 s: the process is
        not running), or at a lower completed iteration than ours, with why."""
        beats = self._dir(".watchdog")
        if beats is None:
            return []
        now, out = time.time(), []
        for rank in range(self.world):
            try:
                beat = json.loads((beats / f"rank-{rank}.json").read_text(encoding="utf-8"))
            except (OSError, ValueError):
                if rank != self.rank:
                    out.append({"rank": rank, "why": "no heartbeat at all"})
                continue
            age = now - beat["written_at"]
            if age > 3 * self.poll + 2:
                out.append({**beat, "why": f"no heartbeat for {age:.1f} s (stopped, dead or stuck in C)"})
            elif beat["iteration"] < self.iteration:
                out.append({**beat, "why": f"behind, at iteration {beat['iteration']}"})
        return out

    def _fire(self, idle: float) -> None:
        iteration, stalled = self.iteration, self.stalled_ranks()
        where = "stderr"
        if self._stack_file is not None:
            self._stack_file.write(
                f"rank {self.rank}: no progress for {idle:.1f} s after iteration {iteration}\n"
            )
            self._stack_file.flush()
            faulthandler.dump_traceback(file=self._stack_file, all_threads=True)
            self._stack_file.flush()
            where = str(Path(self._stack_file.name).parent)
        else:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        named = "; ".join(f"rank {s['rank']}: {s['why']}" for s in stalled) or "none stale or behind"
        print(
            f"stx: hang: rank {self.rank} made no progress for {idle:.0f} s (limit {self.limit():.0f} s, "
            f"train.hang_timeout_seconds) after iteration {iteration}; ranks that stopped "
            f"progressing: {named}; stacks in {where}; ending the job (exit {EXIT_HUNG})",
            file=sys.stderr,
            flush=True,
        )
        here = socket.gethostname()
        for other in stalled:  # their stacks too, where this rank can reach them
            if other.get("host") == here and other.get("pid"):
                # SIGUSR2 first: a stopped process runs its handler (faulthandler) as SIGCONT resumes it,
                # before its own code; this rank ends at once so the resumed one cannot carry the job on.
                for sig in (signal.SIGUSR2, signal.SIGCONT):
                    with contextlib.suppress(OSError):
                        os.kill(other["pid"], sig)
        sys.stdout.flush()
        os._exit(EXIT_HUNG)  # from a thread: the main one is the one stuck


def _rmdir_if_empty(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.rmdir()
