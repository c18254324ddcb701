"""Execute: run one sweep member through a `Launcher` and say how it ended (ok / oom / timeout / crashed).

The member becomes a `JobSpec` (`stx train BASE OVERRIDES...` on nproc processes, its run directory
under the sweep's runs/); where and how the processes start is the launcher's business.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

from ..launch.launcher import JobSpec, Launcher
from .sweep_record import now
from .sweep_spec import SweepSpec, common_overrides
from .sweep_types import Member

OOM_PATTERNS = [
    r"CUDA out of memory",
    r"OutOfMemoryError",
    r"\bMemoryError\b",
    r"Cannot allocate memory",
    r"std::bad_alloc",
    r"can't allocate memory",
    r"failed to allocate",
    r"Out of memory",
    r"Killed by the OOM killer",
]
_OOM_RE = re.compile("|".join(OOM_PATTERNS), re.IGNORECASE)
# How `stx launch` names a rank killed by SIGKILL ("rank 1 was killed by signal SIGKILL (exit code -9)"),
# and torchelastic's own wording ("Signal 9 (SIGKILL) received by PID").
_SIGKILL_RE = re.compile(r"killed by signal SIGKILL|Signal 9 \(SIGKILL\)|exitcode\s*:\s*-9\b|exit code -9\b")


def classify(returncode: int | None, output: str, timed_out: bool) -> str:
    """ok / oom / timeout / crashed from how the job ended and the end of its output."""
    if timed_out:
        return "timeout"
    if returncode == 0:
        return "ok"
    if _OOM_RE.search(output) or returncode in (-9, 137) or _SIGKILL_RE.search(output):
        # SIGKILL that we did not send (we only kill on timeout) is the kernel's OOM killer.
        return "oom"
    return "crashed"


def tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _error_tail(text: str) -> str:
    """The launcher's failure report when there is one (it names the rank and the exception)."""
    idx = text.rfind("stx launch: rank")
    return tail(text[idx:] if idx >= 0 else text, 30)


def runs_directory(spec: SweepSpec) -> Path:
    """Where the members' run directories and logs go: runs/ beside the sweep file."""
    return spec.directory / "runs"


def member_job(spec: SweepSpec, member: Member) -> JobSpec:
    """The `stx train` job of a member; its run directory is runs/RUN_NAME."""
    return JobSpec(
        subcommand="train",
        args=(
            spec.base,
            *common_overrides(spec),
            *member.overrides,
            f"logging.run_dir={runs_directory(spec)}",
            f"logging.run_name={member.run_name}",
        ),
        nproc=member.nproc,
        memory_limit_mb=member.memory_limit_mb,
        nnodes=member.nodes,
    )


def run_member(spec: SweepSpec, member: Member, launcher: Launcher) -> dict[str, Any]:
    """Run one member; returns its outcome: status, error, wall_seconds, started_at, finished_at,
    run_dir (the numbers of an ok member are read from run_dir by `sweep_record.result_record`)."""
    runs = runs_directory(spec)
    run_dir = runs / member.run_name
    if run_dir.exists():  # a rerun (--retry-failed, or a member interrupted last time) starts clean
        shutil.rmtree(run_dir)
    runs.mkdir(parents=True, exist_ok=True)
    started = now()
    log_path = runs / f"{member.run_name}.log"
    result = launcher.launch(member_job(spec, member), log_path, member.timeout_seconds)
    output = result.output
    status = classify(result.returncode, output, result.timed_out)
    if status == "ok" and not (run_dir / "summary.json").is_file():
        status = "crashed"
        output += "\n(the job exited 0 but wrote no summary.json)"
    timed_out = f"timed out after {member.timeout_seconds:g} s\n" if result.timed_out else ""
    return {
        "status": status,
        "error": None if status == "ok" else timed_out + _error_tail(output),
        "wall_seconds": result.wall_seconds,
        "started_at": started,
        "finished_at": now(),
        "run_dir": str(run_dir),
    }
