"""A sweep on a batch scheduler (`executor: slurm|pbs`): every member one batch job, all submitted
at once (the scheduler runs them as nodes free up), then watched until each has ended.

Job ids go into the store's `sweep_jobs` table the moment they are known, so a sweep that is
stopped (Ctrl-C, `kill`, a lost login session) and run again re-attaches to its queued or running
jobs instead of submitting them twice; stopping the sweep never cancels its jobs. A member's
outcome comes from the scheduler's final state:

    COMPLETED (with a summary.json)                      -> ok
    TIMEOUT                                              -> timeout
    OUT_OF_MEMORY, or an out-of-memory message in the log -> oom
    FAILED, NODE_FAIL, CANCELLED, PREEMPTED, ...         -> crashed (the error names the state)
    UNKNOWN (the scheduler forgot the job)               -> ok if it wrote summary.json, else crashed
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sqlite3
import time
from pathlib import Path
from typing import Any

from ..errors import LaunchError
from ..launch.batch import SchedulerLauncher
from ..launch.launcher import BatchLauncher, JobState
from .results import ResultsStore
from .sweep_execute import _OOM_RE, member_job, runs_directory, tail
from .sweep_expand import expand, suspect_members, to_run
from .sweep_present import SweepConsole
from .sweep_record import base_record, invalid_record, now, result_record
from .sweep_spec import SweepSpec
from .sweep_types import Member, SweepOptions, SweepOutcome

JOBS_SCHEMA = """CREATE TABLE IF NOT EXISTS sweep_jobs (
    id INTEGER PRIMARY KEY,
    sweep TEXT,
    config_hash TEXT NOT NULL,
    repeat INTEGER NOT NULL,
    label TEXT,
    scheduler TEXT NOT NULL,
    job_id TEXT NOT NULL,
    run_dir TEXT,
    log_path TEXT,
    submitted_at TEXT,
    state TEXT
)"""
DEFAULT_POLL_SECONDS = 2.0


@dataclasses.dataclass
class Submitted:
    """A member's batch job as the sweep_jobs table holds it."""

    member: Member
    job_id: str
    run_dir: Path
    log_path: Path
    submitted_at: str
    t0: float  # time.monotonic() when this sweep first saw it


def jobs_table(conn: sqlite3.Connection) -> None:
    with conn:
        conn.execute(JOBS_SCHEMA)


def latest_job(conn: sqlite3.Connection, config_hash: str, repeat: int) -> sqlite3.Row | None:
    """The last job submitted for a member, if any."""
    return conn.execute(
        "SELECT * FROM sweep_jobs WHERE config_hash=? AND repeat=? ORDER BY id DESC LIMIT 1",
        (config_hash, repeat),
    ).fetchone()


def outcome_of(state: JobState, scheduler: str, job: Submitted) -> dict[str, Any]:
    """status, error, times and run_dir of an ended job (what `sweep_record.result_record` takes)."""
    output = job.log_path.read_text(encoding="utf-8", errors="replace") if job.log_path.is_file() else ""
    has_summary = (job.run_dir / "summary.json").is_file()
    s = state.state
    if s in ("COMPLETED", "UNKNOWN") and has_summary:
        status = "ok"
    elif s == "TIMEOUT":
        status = "timeout"
    elif s in ("CANCELLED", "PREEMPTED", "NODE_FAIL", "BOOT_FAIL", "DEADLINE"):
        status = "crashed"
    elif s == "OUT_OF_MEMORY" or _OOM_RE.search(output):
        status = "oom"
    else:
        status = "crashed"
    error = None
    if status != "ok":
        code = "" if state.exit_code is None else f", exit code {state.exit_code}"
        head = f"{scheduler} job {job.job_id} ended {s}{code}"
        if s == "COMPLETED":
            head += " but wrote no summary.json"
        if s == "UNKNOWN":
            head = f"{scheduler} no longer knows job {job.job_id} and it wrote no summary.json"
        idx = output.rfind("srun: error:")
        error = head + "\n" + tail(output[idx:] if idx >= 0 else output, 30)
    wall = state.elapsed_seconds if state.elapsed_seconds is not None else time.monotonic() - job.t0
    return {
        "status": status,
        "error": error,
        "wall_seconds": wall,
        "started_at": job.submitted_at,
        "finished_at": now(),
        "run_dir": str(job.run_dir),
    }


def run_batch_sweep(
    spec: SweepSpec,
    options: SweepOptions,
    launcher: BatchLauncher | None = None,
    present: SweepConsole | None = None,
) -> SweepOutcome:
    """Submit every member still to run (or re-attach to its job), then poll until all have ended,
    storing each outcome as soon as it is known."""
    launcher = launcher or SchedulerLauncher(spec.executor, spec.executor_options)
    poll = float(spec.executor_options.get("poll_seconds", DEFAULT_POLL_SECONDS))
    present = present or SweepConsole()
    members, filtered = expand(spec)
    store_path = options.store or spec.store
    present.plan(spec, members, filtered, store_path)
    # Here, not at the top: metrics.environment imports torch (5 s measured cold), which `stx sweep
    # --dry-run` (it imports this module through sweep.py) never needs.
    from ..metrics.environment import environment

    env_json = json.dumps(environment())
    outcome = SweepOutcome()
    with ResultsStore(store_path) as store:
        jobs_table(store.conn)
        for m in members:
            if m.invalid_reason:
                store.put(invalid_record(spec, m, env_json))
        stored = store.statuses()
        rerun = suspect_members(store, spec) if options.retry_suspect else frozenset()
        todo = to_run(members, stored, options.retry_failed, rerun)
        invalid = sum(1 for m in members if m.invalid_reason)
        present.to_run(len(todo), len(members) - invalid - len(todo))
        runs = runs_directory(spec)
        runs.mkdir(parents=True, exist_ok=True)
        active: list[Submitted] = []
        t_start = time.perf_counter()
        try:
            for m in todo:
                prev = latest_job(store.conn, m.config_hash, m.repeat)
                if prev is not None and (m.config_hash, m.repeat) not in stored:
                    active.append(_reattach(prev, m, launcher, present))
                else:
                    active.append(_submit(spec, m, runs, launcher, store, present))
            _watch(spec, active, launcher, store, env_json, outcome, present, poll)
        except KeyboardInterrupt:
            present.note(
                f"sweep stopped; {len(active)} job(s) stay queued or running "
                f"({', '.join(j.job_id for j in active) or 'none'}): run the sweep again to re-attach"
            )
            outcome.interrupted = True
            return outcome
        present.summary(len(todo), time.perf_counter() - t_start, outcome.counts, store_path)
    return outcome


def _reattach(prev: sqlite3.Row, m: Member, launcher: BatchLauncher, present: SweepConsole) -> Submitted:
    """The job an earlier call of this sweep submitted for `m` and did not see end."""
    job = Submitted(
        m,
        prev["job_id"],
        Path(prev["run_dir"]),
        Path(prev["log_path"]),
        prev["submitted_at"],
        time.monotonic(),
    )
    present.note(f"re-attached to {launcher.scheduler} job {job.job_id}: {m.label} ({_shape(m)})")
    return job


def _submit(
    spec: SweepSpec,
    m: Member,
    runs: Path,
    launcher: BatchLauncher,
    store: ResultsStore,
    present: SweepConsole,
) -> Submitted:
    """Submit `m` as a batch job in a clean run directory and note its id in sweep_jobs at once."""
    run_dir = runs / m.run_name
    if run_dir.exists():  # a rerun starts clean
        shutil.rmtree(run_dir)
    log_path = runs / f"{m.run_name}.log"
    job_id = launcher.submit(member_job(spec, m), run_dir, log_path, m.timeout_seconds)
    job = Submitted(m, job_id, run_dir, log_path, now(), time.monotonic())
    with store.conn:
        store.conn.execute(
            "INSERT INTO sweep_jobs (sweep, config_hash, repeat, label, scheduler, job_id,"
            " run_dir, log_path, submitted_at, state)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 'SUBMITTED')",
            (
                spec.name,
                m.config_hash,
                m.repeat,
                m.label,
                launcher.scheduler,
                job_id,
                str(run_dir),
                str(log_path),
                job.submitted_at,
            ),
        )
    present.note(
        f"submitted {launcher.scheduler} job {job_id}: {m.label} ({_shape(m)}, time limit "
        f"{m.timeout_seconds:g} s)"
    )
    return job


def _watch(
    spec: SweepSpec,
    active: list[Submitted],
    launcher: BatchLauncher,
    store: ResultsStore,
    env_json: str,
    outcome: SweepOutcome,
    present: SweepConsole,
    poll: float,
) -> None:
    """Poll the active jobs every `poll` seconds, storing each one's row as it ends and removing it
    from `active` (which then holds the jobs still queued or running, should the watch be stopped)."""
    while active:
        for job in list(active):
            state = launcher.state(job.job_id)
            with store.conn:
                store.conn.execute(
                    "UPDATE sweep_jobs SET state=? WHERE job_id=? AND scheduler=?",
                    (state.state, job.job_id, launcher.scheduler),
                )
            if not state.finished:
                continue
            record = result_record(outcome_of(state, launcher.scheduler, job), job.member)
            record.setdefault("env_json", env_json)
            record |= {"scheduler": launcher.scheduler, "job_id": job.job_id}
            store.put(base_record(spec, job.member) | record)
            outcome.counts[record["status"]] = outcome.counts.get(record["status"], 0) + 1
            present.note(f"job {job.job_id} ({job.member.label}, {_shape(job.member)}) ended {state.state}")
            present.finished(record)
            active.remove(job)
        if active:
            time.sleep(poll)


def _shape(m: Member) -> str:
    return f"{m.nodes} node(s) x {m.nproc} process(es)"


def sweep_status(store_path: Path) -> list[dict[str, Any]]:
    """Every batch job of the store's sweeps: sweep, member label, job id, scheduler, state (the
    stored outcome once recorded, else the scheduler's state now), submitted_at."""
    with ResultsStore(store_path, create=False) as store:
        tables = {r[0] for r in store.conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if "sweep_jobs" not in tables:
            return []
        rows = [dict(r) for r in store.conn.execute("SELECT * FROM sweep_jobs ORDER BY id")]
        results = {
            (r["job_id"], r["scheduler"]): r["status"]
            for r in store.conn.execute(
                "SELECT job_id, scheduler, status FROM results WHERE job_id IS NOT NULL"
            )
        }
    launchers: dict[str, SchedulerLauncher] = {}
    out = []
    for r in rows:
        status = results.get((r["job_id"], r["scheduler"]))
        if status is None:
            launcher = launchers.setdefault(r["scheduler"], SchedulerLauncher(r["scheduler"]))
            try:
                state = launcher.state(r["job_id"]).state
            except LaunchError as e:  # a scheduler command that fails: say so, list the rest
                state = f"? ({e})"
        else:
            state = f"{r['state']} -> {status}"
        out.append({**r, "state": state})
    return out
