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
    """One `stx SUBCOMMAND ARGS...` job on `nproc` processes per node on `nnodes` nodes."""

    subcommand: str
    args: tuple[str, ...]
    nproc: int = 1
    memory_limit_mb: int | None = None  # address space per process (MiB); None = unlimited
    nnodes: int = 1  # more than one: a batch scheduler's job (`BatchLauncher`)


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


# Scheduler job states (Slurm's names; PBS's are mapped onto them); the last seven are final.
PENDING_STATES = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING")
FINAL_STATES = ("COMPLETED", "FAILED", "TIMEOUT", "CANCELLED", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED")


@dataclasses.dataclass(frozen=True)
class JobState:
    """What a scheduler says of a job: state (a Slurm state name, or UNKNOWN when the scheduler has
    forgotten the job), its exit code when it ended (None if not known), and how long it ran (s)."""

    state: str
    exit_code: int | None = None
    elapsed_seconds: float | None = None

    @property
    def finished(self) -> bool:
        return self.state not in PENDING_STATES


class BatchLauncher(Protocol):
    """Submits a job to a batch scheduler and answers for it later, across restarts of the caller:
    a job is known by its id alone. `scheduler` names it (slurm, pbs) in the store."""

    scheduler: str

    def submit(self, job: JobSpec, run_dir: Path, log_path: Path, time_limit_seconds: float) -> str:
        """Write the batch script into run_dir, submit it, return the job id. The job's output goes
        to log_path; the scheduler ends it past time_limit_seconds (state TIMEOUT)."""
        ...

    def state(self, job_id: str) -> JobState: ...

    def cancel(self, job_id: str) -> None: ...
