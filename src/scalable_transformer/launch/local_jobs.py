"""`LocalLauncher`: a job as `stx launch -n N SUBCOMMAND ...` in a child process on this node.

The child is the launcher of `launch/local.py` (torchrun's agent), which starts and supervises the
ranks. This module only starts that child, bounds it (memory limit, timeout), and makes sure that
neither a timeout nor the caller's death leaves ranks behind. It imports no torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import psutil

from .launcher import JobSpec, LaunchResult


def launch_command(job: JobSpec) -> list[str]:
    """The child's command line: `stx launch -n NPROC SUBCOMMAND ARGS...` in this interpreter."""
    return [
        sys.executable,
        "-m",
        "scalable_transformer.cli",
        "launch",
        "-n",
        str(job.nproc),
        job.subcommand,
        *job.args,
    ]


STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


class LocalLauncher:
    """Runs each job through `stx launch` on this node (the `Launcher` protocol)."""

    def launch(
        self,
        job: JobSpec,
        log_path: Path,
        timeout_seconds: float,
        env: Mapping[str, str] | None = None,
    ) -> LaunchResult:
        cmd = launch_command(job)
        t0 = time.perf_counter()
        timed_out = False
        with open(log_path, "w", encoding="utf-8") as log:
            log.write("$ " + " ".join(cmd[3:]) + "\n")  # as the user would type it after `stx`
            log.flush()
            # Ctrl-C / SIGTERM held back while forking: Python runs its at-fork handlers (logging's
            # lock release) then, and a KeyboardInterrupt raised inside one is printed and dropped,
            # so the sweep went on as if never interrupted. Held, it is raised when unblocked below.
            held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
            try:
                proc = subprocess.Popen(
                    cmd,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                    env=None if env is None else {**os.environ, **env},
                    preexec_fn=_child_setup(job.memory_limit_mb),
                )
            except BaseException:
                signal.pthread_sigmask(signal.SIG_SETMASK, held)
                raise
            try:
                signal.pthread_sigmask(signal.SIG_SETMASK, held)  # a signal held back is raised here
                proc.wait(timeout=timeout_seconds)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_tree(proc)
            except BaseException:  # Ctrl-C / SIGTERM of the caller: stop the job, then let it go on
                _kill_tree(proc)
                raise
        wall = time.perf_counter() - t0
        output = log_path.read_text(encoding="utf-8", errors="replace")
        return LaunchResult(proc.returncode, output, timed_out, wall)


def _child_setup(mb: int | None) -> Callable[[], None]:
    """Run in the job's launcher between fork and exec: the memory limit (inherited by every rank),
    and on Linux SIGTERM when the caller itself dies (even by SIGKILL), which the launcher answers by
    stopping its ranks, so a killed sweep leaves no job running behind it."""

    def apply() -> None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # held back in the caller only
        if mb is not None:
            limit = mb * 2**20
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        if sys.platform.startswith("linux"):
            pr_set_pdeathsig = 1
            ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGTERM)

    return apply


def _kill_tree(proc: subprocess.Popen) -> None:
    """Stop the launcher and every rank: torchrun starts the ranks in their own sessions, so the
    process group of the launcher does not reach them; the process tree does."""
    try:
        procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=5)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    proc.wait()
