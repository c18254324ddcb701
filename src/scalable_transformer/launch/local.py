"""`stx launch`: N processes on this node through torchrun's own agent (`elastic_launch`).

Each rank runs `python -u -m scalable_transformer.cli SUBCOMMAND ARGS...`; the agent sets RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT. Rendezvous is picked as torchrun picks it: one
node and no --master-port -> c10d on localhost:0 (torchrun --standalone), so the agent's store takes
a free port and two jobs at once never collide; otherwise static at MASTER_ADDR:MASTER_PORT with
this node's rank.

Failures: with max_restarts=0, the first rank to exit non-zero makes the agent SIGTERM the others
(and SIGKILL those still alive 30 s later: torch's fixed grace on this path, which
TORCH_ELASTIC_SHUTDOWN_TIMEOUT does not change) and raise ChildFailedError. We name the root-cause
rank, its exit code, its exception and traceback tail (from the error.json that `@record` in cli's
`__main__` writes, else the tail of its stderr) and exit 1.

Stop requests (a scheduler's `--signal=USR1@...`, its time limit, `kill`): SIGUSR1 and SIGTERM to
`stx launch` are passed on to every rank, which finish their step, save and exit 75
(train/resilience.py); when every rank exited 75, so does `stx launch` (a batch script then continues
the run in a new job). torch's agent would instead SIGTERM the ranks at once (SIGTERM) or die and
leave them running (SIGUSR1: the default action), and it stops the other ranks as soon as the first
one exits non-zero: a rank that exits 75 a moment before the others (they agreed on the step and the
checkpoint is saved; they are writing their outputs) would get them killed, so here the others get
RESUMABLE_WAIT seconds to exit as well. A second SIGTERM stops every rank now, as torch does.

Output: rank 0's stdout straight through (every rank's, prefixed `[rankN]:`, with ranks_output
"all"); every rank's stderr, prefixed. What is not shown goes to files under the log directory
(a temporary one, removed at exit, unless log_dir is given).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import logging
import os
import signal
import sys
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch.distributed.launcher.api as launcher_api
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, ProcessFailure, SignalException, Std
from torch.distributed.elastic.multiprocessing.api import SubprocessContext
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from ..train.resilience import EXIT_RESUMABLE, STOP_SIGNALS  # the ranks stop on these

RANKS_OUTPUT = ("0", "all")
DEFAULT_MASTER_PORT = 29500  # torchrun's, for static rendezvous
STATIC_RUN_ID = "stx"  # static rendezvous: every node must use the same run id (torchrun uses "none")
TRACEBACK_FRAMES = 4  # frames of the failing rank's traceback in the report
STDERR_LINES = 12  # lines of its stderr when it left no error file
RUN_STAMP_ENV = "STX_RUN_STAMP"  # train/outputs.py reads it (launch sits above train)
LOG_PREFIX = "[rank${rank}]:"  # torchrun's template syntax: global rank of the line's process
AGENT_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"  # torch's agent still stops every rank at once on these
RESUMABLE_WAIT = 60.0  # seconds the other ranks get to exit once one exited 75 (they save before that)


@dataclasses.dataclass(frozen=True)
class LaunchOptions:
    """What `stx launch` takes besides the command; ValueError on a bad value (before any process starts)."""

    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    max_restarts: int = 0
    monitor_interval: float = 0.1  # seconds between the agent's polls: how fast a failure is noticed
    log_dir: str | None = None
    ranks_output: str = "0"  # whose stdout is shown: "0" (rank 0) or "all"

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1:
            raise ValueError(f"--nproc-per-node must be >= 1, got {self.nproc_per_node}")
        if self.nnodes < 1:
            raise ValueError(f"--nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"--node-rank must be in 0..{self.nnodes - 1} (--nnodes {self.nnodes}), got {self.node_rank}"
            )
        if self.nnodes > 1 and not self.master_addr:
            raise ValueError(
                f"--nnodes {self.nnodes} needs --master-addr: the address of node 0, reachable from all nodes"
            )
        if self.master_port is not None and not 1 <= self.master_port <= 65535:
            raise ValueError(f"--master-port must be in 1..65535, got {self.master_port}")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if not self.monitor_interval > 0:
            raise ValueError(f"--monitor-interval must be > 0 seconds, got {self.monitor_interval}")
        if self.ranks_output not in RANKS_OUTPUT:
            raise ValueError(
                f"--ranks-output must be one of {', '.join(RANKS_OUTPUT)}, got {self.ranks_output!r}"
            )


def stx_command(subcommand: str, args: Sequence[str]) -> list[str]:
    """The command line of one rank: `stx SUBCOMMAND ARGS...` in this interpreter, unbuffered."""
    return [sys.executable, "-u", "-m", "scalable_transformer.cli", subcommand, *args]


def worker_threads(nproc_per_node: int) -> int:
    """Threads per rank so that the ranks together use this machine's cores once."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // nproc_per_node)


def rendezvous(opts: LaunchOptions) -> tuple[str, str, str, dict[str, Any]]:
    """(backend, endpoint, run id, backend configs), chosen as torchrun chooses them."""
    if opts.nnodes == 1 and opts.master_port is None:
        return "c10d", "localhost:0", uuid.uuid4().hex, {}
    endpoint = f"{opts.master_addr or '127.0.0.1'}:{opts.master_port or DEFAULT_MASTER_PORT}"
    return "static", endpoint, STATIC_RUN_ID, {"rank": opts.node_rank}


def launch(opts: LaunchOptions, command: Sequence[str]) -> int:
    """Run `command` (executable, then arguments) as opts.nproc_per_node ranks on this node.

    Returns the launcher's exit code: 0 when every rank succeeded, EXIT_RESUMABLE (75) when every
    rank stopped to be resumed, 1 when one failed (reported on stderr), 128 + N when the launcher was
    stopped by signal N (and its ranks did not all stop to be resumed).
    """
    backend, endpoint, run_id, rdzv_configs = rendezvous(opts)
    stops = StopRequests()
    with (
        _log_root(opts.log_dir) as log_root,
        _worker_env(opts.nproc_per_node) as threads,
        _run_stamp(),
        _stop_requests_passed_on(stops),
    ):
        config = LaunchConfig(
            min_nodes=opts.nnodes,
            max_nodes=opts.nnodes,
            nproc_per_node=opts.nproc_per_node,
            run_id=run_id,
            rdzv_backend=backend,
            rdzv_endpoint=endpoint,
            rdzv_configs=rdzv_configs,
            max_restarts=opts.max_restarts,
            monitor_interval=opts.monitor_interval,
            logs_specs=_logs_specs(opts, log_root),
            log_line_prefix_template=LOG_PREFIX,
            signals_to_handle=AGENT_SIGNALS,
        )
        print(
            f"stx launch: {opts.nproc_per_node} processes on node {opts.node_rank} of {opts.nnodes} "
            f"(rendezvous {backend} {endpoint}, OMP_NUM_THREADS={threads})"
            + (f"; logs in {log_root}" if opts.log_dir else ""),
            file=sys.stderr,
            flush=True,
        )
        # The agent substitutes ${local_rank} in arguments (and turns $$ into $): escape every $ so
        # the command reaches the ranks untouched.
        args = [arg.replace("$", "$$") for arg in command[1:]]
        # torch's SubprocessHandler closes its log files only for the ranks it had to stop; the
        # others' are collected with the agent (here, or with the exception that references it).
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            try:
                elastic_launch(config, command[0])(*args)
            except ChildFailedError as e:
                if all_resumable(e.failures, opts.nproc_per_node):
                    print(
                        f"stx launch: all {opts.nproc_per_node} ranks stopped to be resumed "
                        f"(exit status {EXIT_RESUMABLE})",
                        file=sys.stderr,
                        flush=True,
                    )
                    return EXIT_RESUMABLE
                print(failure_report(e.failures, log_root, run_id), file=sys.stderr, flush=True)
                if stops.signum:
                    print(f"stx launch: stopped by {signal.Signals(stops.signum).name}", file=sys.stderr)
                    return 128 + stops.signum
                return 1
            except SignalException as e:
                print(
                    f"stx launch: stopped by {signal.Signals(e.sigval).name}; every rank was terminated",
                    file=sys.stderr,
                )
                return 128 + int(e.sigval)
            except RendezvousError as e:
                print(f"stx launch: error: rendezvous at {endpoint} failed: {e}", file=sys.stderr)
                return 1
    return 0


def all_resumable(failures: dict[int, ProcessFailure], nproc_per_node: int) -> bool:
    """Every rank of this node exited EXIT_RESUMABLE (stopped after a saved checkpoint)."""
    codes = [f.exitcode for f in failures.values()]
    return len(codes) == nproc_per_node and all(code == EXIT_RESUMABLE for code in codes)


class StopRequests:
    """SIGTERM / SIGUSR1 to `stx launch`: passed on to every running rank (the first of them is kept
    in `signum`). Before any rank runs, or on a second SIGTERM, torch's agent stops every rank now."""

    def __init__(self) -> None:
        self.signum = 0
        self.worker_pids: Callable[[], list[int]] = list  # set by the agent once it exists

    def __call__(self, signum: int, frame: object) -> None:
        pids = self.worker_pids()
        if not pids or signum == self.signum == signal.SIGTERM:
            # what torch's own handler raises: the agent SIGTERMs its ranks and re-raises
            raise SignalException(
                f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum)
            )
        self.signum = self.signum or signum
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)


class ResumableAgent(LocalElasticAgent):
    """torch's agent, except that a rank exiting EXIT_RESUMABLE does not get the others stopped (for
    RESUMABLE_WAIT seconds) nor the ranks restarted, and that it tells `stops` its ranks' pids."""

    def __init__(self, *args: Any, stops: StopRequests, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        stops.worker_pids = self._worker_pids
        self._stopping_since: float | None = None

    def _worker_pids(self) -> list[int]:
        return list(self._pcontext.pids().values()) if self._pcontext is not None else []

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        context = self._pcontext
        if isinstance(context, SubprocessContext):
            codes = [handler.proc.poll() for handler in context.subprocess_handlers.values()]
            ended = [code for code in codes if code is not None]
            if ended and all(code == EXIT_RESUMABLE for code in ended):
                self._remaining_restarts = 0  # stopped to be resumed: the job ends here
                if len(ended) < len(codes):
                    self._stopping_since = self._stopping_since or time.monotonic()
                    if time.monotonic() - self._stopping_since < RESUMABLE_WAIT:
                        return RunResult(state=WorkerState.HEALTHY)
        return super()._monitor_workers(worker_group)


def _no_error_for_75(record: logging.LogRecord) -> bool:
    """Drops torch's ERROR line "failed (exitcode: 75) local_rank: ..." (ranks stopped to be resumed)."""
    args = record.args if isinstance(record.args, tuple) else ()
    return not (str(record.msg).startswith("failed (exitcode") and args[:1] == (EXIT_RESUMABLE,))


@contextlib.contextmanager
def _stop_requests_passed_on(stops: StopRequests) -> Iterator[None]:
    """`stops` handles STOP_SIGNALS, and elastic_launch builds a ResumableAgent (torch's launch_agent
    constructs `LocalElasticAgent` by its module-level name, which offers no other way in)."""
    previous: dict[signal.Signals, Any] = {}
    if threading.current_thread() is threading.main_thread():  # signal handlers live there only
        for sig in STOP_SIGNALS:
            previous[sig] = signal.signal(sig, stops)
    torch_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    torch_log.addFilter(_no_error_for_75)
    original = launcher_api.LocalElasticAgent
    launcher_api.LocalElasticAgent = functools.partial(ResumableAgent, stops=stops)  # type: ignore[assignment, misc]
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = original  # type: ignore[misc]
        torch_log.removeFilter(_no_error_for_75)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _logs_specs(opts: LaunchOptions, log_root: str) -> DefaultLogsSpecs:
    """Every rank's stderr is written to a file and tailed to ours with a prefix (tee), so a failure
    report can quote it; stdout is shown for rank 0 only (to the console directly, unprefixed) or,
    with "all", tee'd for every rank."""
    if opts.ranks_output == "all":
        return DefaultLogsSpecs(log_dir=log_root, tee=Std.ALL)
    shown = 0 if opts.node_rank == 0 else None  # global rank 0 is local rank 0 of node 0
    redirects = {r: Std.NONE if r == shown else Std.OUT for r in range(opts.nproc_per_node)}
    return DefaultLogsSpecs(log_dir=log_root, redirects=redirects, tee=Std.ERR)


@contextlib.contextmanager
def _log_root(log_dir: str | None) -> Iterator[str]:
    if log_dir:
        yield log_dir
        return
    with tempfile.TemporaryDirectory(prefix="stx-launch-") as tmp:
        yield tmp


@contextlib.contextmanager
def _worker_env(nproc_per_node: int) -> Iterator[str]:
    """OMP_NUM_THREADS for the ranks (the agent passes ours on), unless the user set it: without it
    every rank would start one thread per core and N ranks would oversubscribe the machine N times.
    This is the one place it is set: elastic_launch itself does not (torchrun's CLI sets 1)."""
    if "OMP_NUM_THREADS" in os.environ:
        yield os.environ["OMP_NUM_THREADS"]
        return
    os.environ["OMP_NUM_THREADS"] = str(worker_threads(nproc_per_node))
    try:
        yield os.environ["OMP_NUM_THREADS"]
    finally:
        del os.environ["OMP_NUM_THREADS"]


@contextlib.contextmanager
def _run_stamp() -> Iterator[None]:
    """RUN_STAMP_ENV for the ranks: the time of this launch, the default run directory's suffix, so
    the ranks that `--max-restarts` restarts continue the first attempt's run directory (a segment)
    instead of starting a new one."""
    if RUN_STAMP_ENV in os.environ:
        yield
        return
    os.environ[RUN_STAMP_ENV] = time.strftime("%Y%m%d-%H%M%S")
    try:
        yield
    finally:
        del os.environ[RUN_STAMP_ENV]


# ---------------------------------------------------------------------------- failure report


def failure_report(failures: dict[int, ProcessFailure], log_root: str, run_id: str) -> str:
    """Which rank failed first and why (exception, traceback tail), then the ranks brought down."""
    ordered = sorted(failures, key=lambda rank: _root_cause_key(rank, failures[rank]))
    root, root_failure = ordered[0], failures[ordered[0]]
    lines = [f"stx launch: rank {root} {_how(root_failure)}"]
    error = _recorded_error(root_failure)
    if error is not None:
        message, callstack = error
        lines.append(f"  {message}")
        tail = traceback_tail(callstack)
        if tail:
            lines.append("  traceback (innermost frames):")
            lines.extend(f"    {line}" for line in tail)
    else:
        stderr = _stderr_tail(root_failure, log_root, run_id)
        if stderr:
            lines.append(f"  its stderr (last {len(stderr)} lines):")
            lines.extend(f"    {line}" for line in stderr)
    others = []
    for rank in ordered[1:]:
        failure = failures[rank]
        error = _recorded_error(failure)
        detail = f": {_first_line(error[0])}" if error is not None else ""
        others.append(f"  rank {rank} {_how(failure)}{detail}")
    if others:
        lines.append("stx launch: the other ranks were stopped or failed after it:")
        lines.extend(others)
    return "\n".join(lines)


def _root_cause_key(rank: int, failure: ProcessFailure) -> tuple[int, float, int]:
    """A rank that exited with an error comes first, then one killed by a signal other than SIGTERM
    (a crash, the OOM killer), then SIGTERM (what the agent sends the survivors); within a tier the
    earliest. The error file's mtime orders ranks finer than ProcessFailure.timestamp (seconds)."""
    if failure.exitcode > 0:
        tier = 0
    elif failure.exitcode != -signal.SIGTERM:
        tier = 1
    else:
        tier = 2
    when = float(failure.timestamp)
    with contextlib.suppress(OSError):
        when = os.stat(failure.error_file).st_mtime
    return tier, when, rank


def traceback_tail(callstack: str, frames: int = TRACEBACK_FRAMES) -> list[str]:
    """The last `frames` frames of a formatted traceback and the exception lines after them,
    without Python 3.11's ^^^ position markers."""
    lines = [line for line in callstack.rstrip("\n").splitlines() if line.strip(" ^~")]
    starts = [i for i, line in enumerate(lines) if line.lstrip().startswith('File "')]
    return lines[starts[-frames] if len(starts) >= frames else 0 :][-4 * frames - 8 :]


def _how(failure: ProcessFailure) -> str:
    if failure.exitcode < 0:
        return f"was killed by signal {failure.signal_name()} (exit code {failure.exitcode})"
    return f"failed with exit code {failure.exitcode}"


def _recorded_error(failure: ProcessFailure) -> tuple[str, str] | None:
    """(exception type: message, traceback) from the rank's error.json, if `@record` wrote one."""
    message = failure.message
    if not isinstance(message, dict):
        return None
    extra = message.get("extraInfo", {})
    return str(message.get("message", "")), str(extra.get("py_callstack", ""))


def _stderr_tail(failure: ProcessFailure, log_root: str, run_id: str) -> list[str]:
    """Last lines of the rank's stderr.log (latest attempt); a rank without an error file (exit via
    sys.exit, a signal, a non-Python failure) has said why there, if anywhere."""
    pattern = os.path.join(
        glob.escape(log_root), f"{glob.escape(run_id)}_*", "attempt_*", str(failure.local_rank), "stderr.log"
    )
    # The newest file: a --log-dir may hold earlier jobs (the static run id is the same for all).
    paths = glob.glob(pattern)
    try:
        text = Path(max(paths, key=os.path.getmtime)).read_text(encoding="utf-8", errors="replace")
    except (ValueError, OSError):  # no file (max of nothing), or unreadable
        return []
    return [line for line in text.splitlines() if line.strip()][-STDERR_LINES:]


def _first_line(text: str, limit: int = 200) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."
