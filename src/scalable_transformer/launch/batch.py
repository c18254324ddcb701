"""Batch jobs on Slurm and PBS: the script we write, its submission, and the job's state later.

`stx submit` and a sweep with `executor: slurm|pbs` both come here. The script is written into
the run directory (`job.sh`, with `.stx-submit` beside it so that `stx train` writes its outputs
into that same directory) and holds everything the job does, so a user can read it, edit it and
resubmit it by hand. Inside the job every rank is started by the scheduler's own launcher (`srun`,
`mpiexec`) and finds its rank, world size and master address itself (`parallel/cluster_env.py`).

Failure: `srun --kill-on-bad-exit=1` and MPICH/PALS `mpiexec` stop every rank as soon as one exits
non-zero and print which task (= rank) on which node failed first; the script exits non-zero.

Requeue (`stx submit --requeue`): the ranks get SIGUSR1 `grace_seconds` before the time limit
(Slurm's `--signal=USR1@SECONDS`; PBS has no such option: `timeout` sends it to mpiexec, which passes
it on), every rank finishes its step, saves and exits 75 (train/resilience.py), and the script
submits the same script again as a new job that starts when this one has ended and resumes with
`checkpoint.load=auto`, until the run is complete. A job that ends otherwise (a crash, a kill, no
newer checkpoint) ends the chain. Each task reports its 75 as 0 plus a note file: srun's
--kill-on-bad-exit takes any non-zero exit for a failure, and the first rank to exit 75 would get the
others killed while they still write their outputs (measured on the test Slurm: 2 of 6 stops ended
143 instead of 75).

Weighed: submitit (Slurm) submits a pickled Python callable through its own generated script, not a
command line the user can read and resubmit, and reads job states from `sacct`, which needs
slurmdbd (without it every finished job is UNKNOWN). Here: `sbatch --parsable`, and states from
`squeue` / `scontrol show job`, `sacct` only as the last resort. PBS: `qsub`, `qstat -x -f`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..errors import LaunchError, UsageError
from .launcher import JobSpec, JobState

SCHEDULERS = ("slurm", "pbs")
LAUNCHERS = ("srun", "torchrun")
SCRIPT_NAME = "job.sh"
MARKER_NAME = ".stx-submit"  # a run directory prepared by stx submit (train/outputs.py reuses it)
LOG_NAME = "job.log"
COMMAND_TIMEOUT = 60  # seconds for one sbatch / squeue / qsub call
STOPPED_NAME = ".stx-stopped"  # touched by every task that stopped to be resumed (--requeue)
RESUMABLE = 75  # train.resilience.EXIT_RESUMABLE (that module imports torch; stx submit does not)
# Seconds before the time limit that the ranks are asked to stop: enough for a large model to
# finish its step and write its checkpoint. Slurm may send the signal up to a minute earlier still.
DEFAULT_SIGNAL_GRACE = 180


@dataclasses.dataclass(frozen=True)
class Requeue:
    """--requeue: continue the run in new jobs until it is complete. checkpoint_dir: checkpoint.save,
    absolute (its `latest` says whether a job saved anything newer); script: the batch script's
    absolute path (each job submits it again); grace_seconds: how long before the time limit the
    ranks get SIGUSR1."""

    checkpoint_dir: Path
    script: Path
    grace_seconds: int = DEFAULT_SIGNAL_GRACE


@dataclasses.dataclass(frozen=True)
class BatchOptions:
    """What the batch script asks the scheduler for. gpus_per_node is also the ranks per node;
    request_gpus False leaves the GPU request out (CPU partitions). time_seconds None: the queue's
    default limit. env: variables exported in the script; env_file: a file sourced by it."""

    scheduler: str
    nodes: int = 1
    gpus_per_node: int = 1
    time_seconds: float | None = None
    partition: str | None = None  # Slurm partition / PBS queue
    account: str | None = None
    container: str | None = None  # a command prefix: "apptainer exec --nv IMAGE"
    env_file: str | None = None
    env: tuple[tuple[str, str], ...] = ()
    request_gpus: bool = True
    memory_limit_mb: int | None = None  # ulimit -v of every rank
    # Slurm: "srun" starts every rank itself (one task per GPU); "torchrun" starts one
    # `stx launch` per node (torchrun's agent, static rendezvous at rank 0's node) that starts them.
    launcher: str = "srun"
    requeue: Requeue | None = None

    def __post_init__(self) -> None:
        if self.scheduler not in SCHEDULERS:
            raise UsageError(f"--scheduler must be one of {', '.join(SCHEDULERS)}, got {self.scheduler!r}")
        if self.nodes < 1:
            raise UsageError(f"--nodes must be >= 1, got {self.nodes}")
        if self.gpus_per_node < 1:
            raise UsageError(
                f"--gpus-per-node must be >= 1 (it is also the ranks per node), got {self.gpus_per_node}"
            )
        if self.time_seconds is not None and self.time_seconds <= 0:
            raise UsageError(f"--time must be > 0, got {self.time_seconds} s")
        if self.launcher not in LAUNCHERS:
            raise UsageError(f"--launcher must be one of {', '.join(LAUNCHERS)}, got {self.launcher!r}")
        if self.launcher == "torchrun" and self.scheduler != "slurm":
            raise UsageError("--launcher torchrun is for Slurm (srun starts one stx launch per node)")
        if self.env_file is not None and not Path(self.env_file).is_file():
            raise UsageError(f"--env-file {self.env_file}: no such file")
        if self.requeue is not None:
            grace = self.requeue.grace_seconds
            if not 0 < grace <= 65535:  # Slurm's --signal takes 0..65535 s; 0 would leave no time
                raise UsageError(f"--signal-grace must be in 1..65535 seconds, got {grace}")
            if self.time_seconds is not None and grace >= self.time_seconds:
                raise UsageError(
                    f"--signal-grace {grace} s must be shorter than the time limit (--time: "
                    f"{self.time_seconds:.0f} s), or the ranks are asked to stop before they start"
                )
            if self.scheduler == "pbs" and self.time_seconds is None:
                raise UsageError(
                    "--requeue with --scheduler pbs needs --time: the script itself signals the ranks "
                    "--signal-grace seconds before that limit (PBS has no --signal)"
                )


def parse_time(text: str) -> float:
    """A time limit as schedulers write it ('2:00:00', '30:00' = 30 min, '45' = 45 min,
    '1-12:00:00' = 1.5 days) -> seconds."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text.strip())
    if not m:
        raise UsageError(f"--time {text!r}: expected MINUTES, MM:SS, HH:MM:SS or D-HH:MM:SS")
    days, a, b, c = (int(x) if x else None for x in m.groups())
    if c is not None:
        seconds = (a or 0) * 3600 + (b or 0) * 60 + c
    elif b is not None:
        seconds = (a or 0) * 60 + b
    else:
        seconds = (a or 0) * 60
    seconds += (days or 0) * 86400
    if seconds <= 0:
        raise UsageError(f"--time {text!r}: must be > 0")
    return float(seconds)


def format_time(seconds: float) -> str:
    """HH:MM:SS, rounded up to the second (both schedulers read it)."""
    total = math.ceil(seconds)
    return f"{total // 3600:02d}:{total % 3600 // 60:02d}:{total % 60:02d}"


def rank_command(job: JobSpec, container: str | None) -> list[str]:
    """What every rank runs: `stx SUBCOMMAND ARGS` in this interpreter (in the container: the
    image's python3, which must have scalable-transformer installed)."""
    python = [*shlex.split(container), "python3"] if container else [sys.executable]
    return [*python, "-u", "-m", "scalable_transformer.cli", job.subcommand, *job.args]


def node_launch_command(job: JobSpec, opts: BatchOptions) -> str:
    """--launcher torchrun: what srun runs once per node, `stx launch` with this node's rank."""
    python = [*shlex.split(opts.container), "python3"] if opts.container else [sys.executable]
    head = shlex.join(
        [*python, "-u", "-m", "scalable_transformer.cli", "launch", "-n", str(opts.gpus_per_node)]
    )
    head += f" --nnodes {opts.nodes}" + ' --node-rank "$SLURM_NODEID" --master-addr "$MASTER_ADDR"'
    head += ' --master-port "$MASTER_PORT" '
    return head + shlex.join([job.subcommand, *job.args])


def _exports(opts: BatchOptions, workdir: Path) -> list[str]:
    lines = [f"cd {shlex.quote(str(workdir))}"]
    if opts.env_file:
        lines += [f"set -a; source {shlex.quote(str(Path(opts.env_file).resolve()))}; set +a"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in opts.env]
    # One thread per rank unless the user said otherwise: N ranks per node would oversubscribe it.
    lines += ['export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"']
    if opts.memory_limit_mb:
        lines += [f"ulimit -v {opts.memory_limit_mb * 1024}  # KiB of address space per rank"]
    return lines


def slurm_script(job: JobSpec, opts: BatchOptions, name: str, log_path: Path, workdir: Path) -> str:
    directives = [
        f"--job-name={name}",
        f"--nodes={opts.nodes}",
        f"--ntasks-per-node={opts.gpus_per_node}",
    ]
    if opts.request_gpus:
        directives.append(f"--gpus-per-node={opts.gpus_per_node}")
    if opts.time_seconds is not None:
        directives.append(f"--time={format_time(opts.time_seconds)}")
    if opts.partition:
        directives.append(f"--partition={opts.partition}")
    if opts.account:
        directives.append(f"--account={opts.account}")
    directives.append(f"--output={log_path}")
    if opts.requeue:
        # Not B:USR1: the ranks (every process of the job step) get it, the batch shell does not.
        directives += [f"--signal=USR1@{opts.requeue.grace_seconds}", "--open-mode=append"]
    return "\n".join(
        [
            "#!/bin/bash",
            *(f"#SBATCH {d}" for d in directives),
            "# Written by `stx submit` (scalable-transformer). One task per GPU; each task is one rank",
            "# of `stx train`, which reads SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID itself.",
            "set -euo pipefail",
            *_exports(opts, workdir),
            "# Rank 0 runs on the first node; its NodeAddr is the address the others can reach",
            "# (never `hostname -I`, which lists every interface).",
            'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            "MASTER_ADDR=$(scontrol show node \"$head_node\" -o | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')",
            'export MASTER_ADDR="${MASTER_ADDR:-$head_node}"',
            "export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))",
            'echo "stx submit: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST,'
            ' rank 0 at $MASTER_ADDR:$MASTER_PORT"',
            *_slurm_run(job, opts),
            "",
        ]
    )


def _slurm_run(job: JobSpec, opts: BatchOptions) -> list[str]:
    if opts.launcher == "srun":
        comment = ["# --kill-on-bad-exit: the first rank to fail stops all; srun names its task and node."]
        srun, task = "srun --kill-on-bad-exit=1", shlex.join(rank_command(job, opts.container))
    else:
        comment = [
            "# One `stx launch` per node (torchrun's agent starts the node's ranks and names a",
            "# failing one); --kill-on-bad-exit: the first node to fail stops the others.",
        ]
        srun, task = "srun --kill-on-bad-exit=1 --ntasks-per-node=1", node_launch_command(job, opts)
    if opts.requeue is None:
        if opts.launcher == "srun":
            return [*comment, f"{srun} {task}"]
        return [*comment, f"{srun} bash -c " + shlex.quote("exec " + task)]
    resubmit = (
        'sbatch --parsable --export=ALL,STX_CHAIN_JOB=$((chain + 1)) --dependency=afterany:"$SLURM_JOB_ID" '
        + shlex.quote(str(opts.requeue.script))
    )
    return [
        *_requeue_start(opts.requeue, "$SLURM_JOB_ID"),
        *comment,
        f"{srun} bash -c {shlex.quote(resumable_task(task))} || status=$?",
        *_requeue_end(opts.requeue, "$SLURM_JOB_ID", "srun", resubmit),
    ]


def resumable_task(command: str) -> str:
    """One task of a --requeue job: `command`, its exit status 75 reported as 0 plus the note file
    (see the module's docstring; no note written: 75 stays). The traps keep this shell alive when the
    scheduler signals every process of the task; the command gets the signal itself."""
    return (
        f'trap : USR1 TERM; {command}; s=$?; if [ "$s" -eq {RESUMABLE} ]; then touch "$STX_STOPPED" && '
        's=0; fi; exit "$s"'
    )


def _requeue_start(requeue: Requeue, job_id: str) -> list[str]:
    save = shlex.quote(str(requeue.checkpoint_dir))
    return [
        "# --requeue: the ranks stop on SIGUSR1 (sent --signal-grace seconds before the time limit),",
        "# save and exit 75; this job then submits this script again, which resumes the run from that",
        "# checkpoint (checkpoint.load=auto), until train.train_iters is reached.",
        "chain=${STX_CHAIN_JOB:-1}",
        f'echo "stx submit: job {job_id} is job $chain of the chain; SIGUSR1 to the ranks '
        f'{requeue.grace_seconds} s before the time limit"',
        f"export STX_STOPPED={shlex.quote(str(requeue.script.parent / STOPPED_NAME))}",
        'rm -f "$STX_STOPPED"',
        f"resumed_from=$(cat {save}/latest 2>/dev/null || true)",
        "status=0",
    ]


def _requeue_end(requeue: Requeue, job_id: str, launcher: str, resubmit: str) -> list[str]:
    save = shlex.quote(str(requeue.checkpoint_dir))
    script = shlex.quote(str(requeue.script))
    return [
        "# 75: every rank stopped after saving: the next job continues, if this one saved a newer",
        "# checkpoint. 0: the run is complete. Anything else (a crash, a kill) ends the chain here.",
        f'if [ "$status" -eq 0 ] && [ -e "$STX_STOPPED" ]; then status={RESUMABLE}; fi',
        'rm -f "$STX_STOPPED"',
        'if [ "$status" -eq 0 ]; then',
        f'    echo "stx submit: job {job_id}: the run is complete"',
        "    exit 0",
        "fi",
        f'if [ "$status" -ne {RESUMABLE} ]; then',
        f'    echo "stx submit: job {job_id}: {launcher} ended with exit status $status:'
        ' the chain of jobs ends here" >&2',
        '    exit "$status"',
        "fi",
        f"latest=$(cat {save}/latest 2>/dev/null || true)",
        'if [ -z "$latest" ] || [ "$latest" = "$resumed_from" ]; then',
        f'    echo "stx submit: job {job_id} stopped without saving a checkpoint newer than'
        f' ${{resumed_from:-none}} in {requeue.checkpoint_dir}: not continued (no progress)" >&2',
        "    exit 1",
        "fi",
        # Not `scontrol requeue` (Slurm): it needs the cluster's JobRequeue, keeps the job id, and
        # holds the requeued job back (measured on the test Slurm: 122 s in PENDING, BeginTime).
        "# A new job that starts once this one has ended: works on any Slurm and PBS (Slurm's",
        "# `scontrol requeue` needs JobRequeue, keeps the job id and holds the job back 2 minutes).",
        f"next=$({resubmit}) || {{",
        f'    echo "stx submit: job {job_id}: submitting the next job failed; to continue, submit'
        f' {script} again" >&2',
        "    exit 1",
        "}",
        f'echo "stx submit: job {job_id} stopped to be resumed from $latest; job ${{next%%;*}}'
        ' continues the run when this one has ended"',
    ]


def pbs_script(job: JobSpec, opts: BatchOptions, name: str, log_path: Path, workdir: Path) -> str:
    select = f"select={opts.nodes}:ncpus={opts.gpus_per_node}:mpiprocs={opts.gpus_per_node}"
    if opts.request_gpus:
        select += f":ngpus={opts.gpus_per_node}"
    directives = [f"-N {name[:15]}", f"-l {select}", "-l place=scatter"]
    if opts.time_seconds is not None:
        directives.append(f"-l walltime={format_time(opts.time_seconds)}")
    if opts.partition:
        directives.append(f"-q {opts.partition}")
    if opts.account:
        directives.append(f"-A {opts.account}")
    directives += ["-j oe", f"-o {log_path}", "-V"]
    return "\n".join(
        [
            "#!/bin/bash",
            *(f"#PBS {d}" for d in directives),
            "# Written by `stx submit` (scalable-transformer). One rank per GPU, started by mpiexec",
            "# (MPICH hydra, Cray PALS); `stx train` reads PMI_RANK / PALS_RANKID itself.",
            "set -euo pipefail",
            *_exports(opts, workdir),
            "# Rank 0 runs on the first host of the node file.",
            'export MASTER_ADDR=$(head -n 1 "$PBS_NODEFILE")',
            "job_number=${PBS_JOBID:-0}; job_number=${job_number%%[!0-9]*}",
            "export MASTER_PORT=$((20000 + ${job_number:-0} % 20000))",
            'nnodes=$(sort -u "$PBS_NODEFILE" | wc -l)',
            'echo "stx submit: job ${PBS_JOBID:-} on $nnodes nodes, rank 0 at $MASTER_ADDR:$MASTER_PORT"',
            *_pbs_run(job, opts, log_path),
            "",
        ]
    )


def _pbs_run(job: JobSpec, opts: BatchOptions, log_path: Path) -> list[str]:
    g = opts.gpus_per_node
    mpiexec = f'mpiexec -n $((nnodes * {g})) --ppn {g} --hostfile "$PBS_NODEFILE"'
    task = shlex.join(rank_command(job, opts.container))
    if opts.requeue is None or opts.time_seconds is None:  # (BatchOptions requires --time with --requeue)
        return [f"{mpiexec} {task}"]
    stop_after = math.floor(opts.time_seconds - opts.requeue.grace_seconds)
    next_log = shlex.quote(str(log_path.with_suffix(""))) + ".$((chain + 1))" + shlex.quote(log_path.suffix)
    resubmit = (
        f'qsub -W depend=afterany:"$PBS_JOBID" -v STX_CHAIN_JOB=$((chain + 1)) -o {next_log} '
        + shlex.quote(str(opts.requeue.script))
    )
    return [
        *_requeue_start(opts.requeue, "${PBS_JOBID:-}"),
        "# PBS has no --signal: timeout sends SIGUSR1 to mpiexec, which passes it on to every rank.",
        f"timeout --preserve-status --signal=USR1 {stop_after}s {mpiexec} "
        f"bash -c {shlex.quote(resumable_task(task))} || status=$?",
        *_requeue_end(opts.requeue, "${PBS_JOBID:-}", "mpiexec", resubmit),
    ]


def write_script(
    job: JobSpec, opts: BatchOptions, run_dir: Path, log_path: Path, workdir: Path | None = None
) -> Path:
    """The batch script in run_dir (created), and the marker that lets `stx train` use run_dir."""
    run_dir.mkdir(parents=True, exist_ok=True)
    make = slurm_script if opts.scheduler == "slurm" else pbs_script
    text = make(job, opts, f"stx-{run_dir.name}"[:64], log_path, workdir or Path.cwd())
    path = run_dir / SCRIPT_NAME
    path.write_text(text, encoding="utf-8")
    path.chmod(0o755)
    (run_dir / MARKER_NAME).write_text(json.dumps({"scheduler": opts.scheduler}) + "\n", encoding="utf-8")
    return path


def _run(cmd: Sequence[str], what: str) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=COMMAND_TIMEOUT, check=False)
    except FileNotFoundError:
        raise LaunchError(f"{what}: `{cmd[0]}` is not installed on this machine (or not on PATH)") from None
    except subprocess.TimeoutExpired:
        raise LaunchError(f"{what}: `{shlex.join(cmd)}` did not answer in {COMMAND_TIMEOUT} s") from None
    if proc.returncode != 0:
        raise LaunchError(
            f"{what}: `{shlex.join(cmd)}` failed (exit {proc.returncode}): {proc.stderr.strip()}"
        )
    return proc.stdout


def submit_script(scheduler: str, script: Path) -> str:
    """Submit; the job id (Slurm: '123'; PBS: '123.server')."""
    if scheduler == "slurm":
        out = _run(["sbatch", "--parsable", str(script)], "submitting to Slurm")
        return out.strip().split(";")[0]
    return _run(["qsub", str(script)], "submitting to PBS").strip()


# ---------------------------------------------------------------------------------- job states


def _seconds(text: str) -> float | None:
    try:
        return parse_time(text)
    except UsageError:
        return None


def slurm_state(job_id: str) -> JobState:
    """squeue for a queued or running job; scontrol for one that ended (kept MinJobAge, 300 s by
    default); sacct (needs slurmdbd) after that; else UNKNOWN."""
    try:
        out = _run(["squeue", "-h", "-j", job_id, "-o", "%T|%M"], "asking Slurm")
    except LaunchError:
        out = ""  # squeue refuses ids it no longer holds ("Invalid job id specified")
    if out.strip():
        state, elapsed = out.strip().splitlines()[0].split("|", 1)
        if state in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING"):
            return JobState(state, None, _seconds(elapsed))
    try:
        out = _run(["scontrol", "show", "job", job_id, "-o"], "asking Slurm")
    except LaunchError:
        out = ""
    state_m = re.search(r"\bJobState=(\S+)", out)
    if state_m:
        code_m = re.search(r"\bExitCode=(\d+):(\d+)", out)
        run_m = re.search(r"\bRunTime=(\S+)", out)
        exit_code = None
        if code_m:  # EXIT:SIGNAL
            exit_code = int(code_m.group(1)) or (-int(code_m.group(2)) if int(code_m.group(2)) else 0)
        return JobState(state_m.group(1), exit_code, _seconds(run_m.group(1)) if run_m else None)
    try:
        out = _run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,ExitCode"], "asking Slurm")
    except LaunchError:
        out = ""
    if out.strip():
        acct_state, acct_code = out.strip().splitlines()[0].split("|")
        return JobState(acct_state.split()[0], int(acct_code.split(":")[0]) if acct_code else None)
    return JobState("UNKNOWN")


# PBS Pro's Exit_status for jobs it killed (pbs_error.h: JOB_EXEC_KILL_*) and its state letters.
_PBS_EXIT = {-27: "OUT_OF_MEMORY", -28: "OUT_OF_MEMORY", -29: "TIMEOUT", -11: "NODE_FAIL"}
_PBS_QUEUED = {
    "Q": "PENDING",
    "H": "PENDING",
    "W": "PENDING",
    "T": "PENDING",
    "B": "RUNNING",
    "R": "RUNNING",
    "E": "COMPLETING",
}


def pbs_state(job_id: str) -> JobState:
    """`qstat -x -f` (PBS Pro keeps finished jobs with -x): job_state and Exit_status mapped onto
    Slurm's names; an Exit_status above 256 is a signal (qdel sends SIGTERM: CANCELLED)."""
    try:
        out = _run(["qstat", "-x", "-f", job_id], "asking PBS")
    except LaunchError:
        return JobState("UNKNOWN")
    m = re.search(r"job_state = (\w)", out)
    if not m:
        return JobState("UNKNOWN")
    if m.group(1) in _PBS_QUEUED:
        return JobState(_PBS_QUEUED[m.group(1)])
    code_m = re.search(r"Exit_status = (-?\d+)", out)
    code = int(code_m.group(1)) if code_m else None
    if code == 0:
        return JobState("COMPLETED", 0)
    if code in _PBS_EXIT:
        return JobState(_PBS_EXIT[code], code)
    if code is not None and code >= 256:
        return JobState("CANCELLED" if code - 256 == 15 else "FAILED", -(code - 256))
    return JobState("FAILED", code)


class SchedulerLauncher:
    """The `BatchLauncher` of one scheduler: each job a batch script in its run directory."""

    def __init__(self, scheduler: str, options: Mapping[str, object] | None = None) -> None:
        if scheduler not in SCHEDULERS:
            raise UsageError(f"scheduler must be one of {', '.join(SCHEDULERS)}, got {scheduler!r}")
        self.scheduler = scheduler
        self.options = dict(options or {})

    def batch_options(self, job: JobSpec, time_limit_seconds: float) -> BatchOptions:
        o = self.options
        return BatchOptions(
            scheduler=self.scheduler,
            nodes=job.nnodes,
            gpus_per_node=job.nproc,
            time_seconds=time_limit_seconds,
            partition=_opt_str(o.get("partition") or o.get("queue")),
            account=_opt_str(o.get("account")),
            container=_opt_str(o.get("container")),
            env_file=_opt_str(o.get("env_file")),
            env=tuple((str(k), str(v)) for k, v in dict(o.get("env") or {}).items()),  # type: ignore[call-overload]
            request_gpus=bool(o.get("gpus", True)),
            memory_limit_mb=job.memory_limit_mb,
        )

    def submit(self, job: JobSpec, run_dir: Path, log_path: Path, time_limit_seconds: float) -> str:
        script = write_script(job, self.batch_options(job, time_limit_seconds), run_dir, log_path)
        job_id = submit_script(self.scheduler, script)
        (run_dir / MARKER_NAME).write_text(
            json.dumps({"scheduler": self.scheduler, "job_id": job_id}) + "\n", encoding="utf-8"
        )
        return job_id

    def state(self, job_id: str) -> JobState:
        return slurm_state(job_id) if self.scheduler == "slurm" else pbs_state(job_id)

    def cancel(self, job_id: str) -> None:
        _run(["scancel", job_id] if self.scheduler == "slurm" else ["qdel", job_id], "cancelling")


def _opt_str(value: object) -> str | None:
    return None if value is None else str(value)


def environment_exports(names: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """(name, value) of the listed variables (what `--export NAME` passes on); UsageError naming
    one that is not set here."""
    missing = [n for n in names if n not in os.environ]
    if missing:
        raise UsageError(f"--export {missing[0]}: not set in this shell (export it, or use --env-file)")
    return tuple((n, os.environ[n]) for n in names)
