"""The `Launcher` protocol: how a sweep (or any caller) starts one multi-process `stx` job and waits.

A job is an `stx` command run as `nproc` processes; the launcher decides where and how (this node
through `stx launch`, later a Slurm or PBS allocation, a hostfile), writes the job's combined output
to a log file, stops the whole job past its timeout, and reports how it ended. It does not judge the
outcome (ok / oom / crashed): that is the caller's, from the return code and the output.

Nothing here imports torch: planning and recording a sweep must not pay for it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """One `stx SUBCOMMAND ARGS...` job on `nproc` processes."""

    subcommand: str
    args: tuple[str, ...]
    nproc: int = 1
    memory_limit_mb: int | None = None  # address space per process (MiB); None = unlimited


@dataclasses.dataclass(frozen=True)
class LaunchResult:
    """How a job ended. returncode: the job's exit status (negative: killed by that signal), None if
    unknown; with timed_out it is whatever the stopped job returned and means nothing. output: the
    job's combined stdout and stderr, as the log file holds it."""

    returncode: int | None
    output: str
    timed_out: bool
    wall_seconds: float  # from start to the end of the job (or of its killing), seconds


class Launcher(Protocol):
    """Starts a job, waits for it up to timeout_seconds, and returns how it ended.

    The job's combined output goes to log_path (created or truncated). env holds extra environment
    variables for the job (on top of the caller's own). On KeyboardInterrupt (Ctrl-C, or SIGTERM
    turned into it by the caller) the launcher stops the job before re-raising, so nothing is
    left running behind an interrupted caller.
    """

    def launch(
        self,
        job: JobSpec,
        log_path: Path,
        timeout_seconds: float,
        env: Mapping[str, str] | None = None,
    ) -> LaunchResult: ...
