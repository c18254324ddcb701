"""The cluster pieces that need no daemon: environment discovery, hostfiles, batch scripts, time
limits, sweep-file keys and the scheduler-state mapping. (The real runs: tests/cluster/.)"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest

from scalable_transformer.bench.sweep_batch import Submitted, outcome_of
from scalable_transformer.bench.sweep_spec import load_sweep
from scalable_transformer.bench.sweep_types import Member
from scalable_transformer.cli import main
from scalable_transformer.errors import LaunchError, SweepError, UsageError
from scalable_transformer.launch.batch import (
    DEFAULT_SIGNAL_GRACE,
    RESUMABLE,
    BatchOptions,
    Requeue,
    environment_exports,
    parse_time,
    pbs_script,
    slurm_script,
)
from scalable_transformer.launch.hostfile import node_command, parse_hostfile, root_cause, select_hosts
from scalable_transformer.launch.launcher import JobSpec, JobState
from scalable_transformer.parallel.cluster_env import (
    apply_cluster_env,
    discover,
    read_node_file,
    slurm_node_layout,
)


def test_torchrun_variables_are_left_alone():
    assert discover({"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_STEP_ID": "0"}) is None
    assert discover({}) is None


def test_srun_task_with_a_resolvable_first_node():
    env = {
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "3",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_JOB_NODELIST": "localhost,gpu-[02-04]",
        "SLURM_JOB_ID": "123456",
    }
    found = discover(env)
    assert found is not None
    assert (found.source, found.rank, found.world_size, found.local_rank) == ("slurm", 3, 8, 1)
    assert (found.master_addr, found.master_port) == ("localhost", 20000 + 123456 % 20000)


def test_a_batch_script_is_not_a_rank():
    # sbatch's own shell has SLURM_PROCID=0 but no step: `stx train` there is a single process
    assert discover({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "n1"}) is None


def test_mpi_variables_win_over_the_allocation(tmp_path):
    nodes = tmp_path / "nodes"
    nodes.write_text("hostA\nhostA\nhostB\n")
    env = {
        "PMI_RANK": "2",
        "PMI_SIZE": "4",
        "MPI_LOCALRANKID": "0",
        "PBS_NODEFILE": str(nodes),
        "PBS_JOBID": "789.server",
        "SLURM_PROCID": "0",
        "SLURM_STEP_ID": "0",
        "SLURM_NTASKS": "1",
    }
    environ = dict(env)
    found = apply_cluster_env(environ)
    assert found is not None and found.source == "mpich"
    assert environ["RANK"] == "2" and environ["WORLD_SIZE"] == "4" and environ["LOCAL_RANK"] == "0"
    assert environ["MASTER_ADDR"] == "hostA" and environ["MASTER_PORT"] == str(20000 + 789)
    assert read_node_file(str(nodes)) == ["hostA", "hostB"]


def test_openmpi_and_pals():
    ompi = discover(
        {
            "OMPI_COMM_WORLD_RANK": "1",
            "OMPI_COMM_WORLD_SIZE": "2",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        }
    )
    assert ompi is not None and (ompi.source, ompi.rank, ompi.master_addr) == ("openmpi", 1, "127.0.0.1")
    pals = discover({"PALS_RANKID": "5", "PALS_LOCAL_RANKID": "1", "PMI_SIZE": "8", "MASTER_ADDR": "x0"})
    assert pals is not None and (pals.source, pals.rank, pals.world_size, pals.local_rank) == (
        "cray-pals",
        5,
        8,
        1,
    )


def test_missing_variables_say_what_to_set():
    with pytest.raises(LaunchError, match="PMI_SIZE"):
        discover({"PMI_RANK": "0"})
    with pytest.raises(LaunchError, match="MASTER_ADDR"):
        discover({"PMI_RANK": "0", "PMI_SIZE": "2"})
    with pytest.raises(LaunchError, match=r"not in 0\.\.1"):
        discover({"PMI_RANK": "2", "PMI_SIZE": "2", "MASTER_ADDR": "h"})


def test_hostfile_include_exclude(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# cluster\nw0 slots=4\nw1 slots=4  # second\n")
    hosts = parse_hostfile(path)
    assert hosts == {"w0": 4, "w1": 4}
    assert [(h.name, h.slots) for h in select_hosts(hosts, include="w1:0,2@w0:1,3")] == [
        ("w0", (1, 3)),
        ("w1", (0, 2)),
    ]
    assert [h.name for h in select_hosts(hosts, exclude="w0")] == ["w1"]
    picked = select_hosts(hosts, include="w0:1,3@w1:0,2")
    command = node_command(picked[0], 0, 2, "w0", 29500, [("NCCL_SOCKET_IFNAME", "ib0")], [], ["train"])
    assert "CUDA_VISIBLE_DEVICES=1,3" in command and "NCCL_SOCKET_IFNAME=ib0" in command
    assert "--node-rank 0" in command and "--master-addr w0" in command
    with pytest.raises(LaunchError, match="same number of processes"):
        select_hosts(hosts, include="w0:1@w1")
    with pytest.raises(LaunchError, match="'w9' is not in the hostfile"):
        select_hosts(hosts, include="w9")
    path.write_text("w0 slots=4\nw1 4\n")
    with pytest.raises(LaunchError, match=r"hosts:2: 'w1 4': expected 'HOST slots=N'"):
        parse_hostfile(path)


def test_time_limits():
    assert parse_time("2:00:00") == 7200
    assert parse_time("30:00") == 1800
    assert parse_time("45") == 2700
    assert parse_time("1-12:00:00") == 1.5 * 86400
    with pytest.raises(UsageError, match="HH:MM:SS"):
        parse_time("2h")


def test_batch_scripts(tmp_path):
    job = JobSpec("train", ("gpt-1b", "optim.lr=3e-4"), nproc=4, nnodes=2)
    opts = BatchOptions(
        "slurm",
        nodes=2,
        gpus_per_node=4,
        time_seconds=7200,
        partition="gpu",
        account="proj",
        container="apptainer exec --nv img.sif",
        env=(("NCCL_SOCKET_IFNAME", "ib0"),),
    )
    text = slurm_script(job, opts, "stx-run", tmp_path / "job.log", tmp_path)
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=4",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --time=02:00:00",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=proj",
        "export NCCL_SOCKET_IFNAME=ib0",
    ):
        assert line in text.splitlines()
    assert (
        "srun --kill-on-bad-exit=1 apptainer exec --nv img.sif python3 -u -m scalable_transformer.cli "
        in text
    )
    pbs = pbs_script(
        job, BatchOptions("pbs", nodes=2, gpus_per_node=4, partition="debug"), "stx-run", tmp_path, tmp_path
    )
    assert "#PBS -l select=2:ncpus=4:mpiprocs=4:ngpus=4" in pbs and "#PBS -q debug" in pbs
    assert 'mpiexec -n $((nnodes * 4)) --ppn 4 --hostfile "$PBS_NODEFILE"' in pbs
    with pytest.raises(UsageError, match="--scheduler must be one of slurm, pbs"):
        BatchOptions("lsf")
    per_node = slurm_script(
        job, BatchOptions("slurm", nodes=2, gpus_per_node=4, launcher="torchrun"), "n", tmp_path, tmp_path
    )
    assert "srun --kill-on-bad-exit=1 --ntasks-per-node=1 bash -c 'exec " in per_node
    assert 'launch -n 4 --nnodes 2 --node-rank "$SLURM_NODEID" --master-addr "$MASTER_ADDR"' in per_node
    with pytest.raises(UsageError, match="--launcher torchrun is for Slurm"):
        BatchOptions("pbs", launcher="torchrun")


def test_requeue_scripts(tmp_path):
    job = JobSpec("train", ("gpt-1b", "checkpoint.save=ckpt", "checkpoint.load=auto"), nproc=4, nnodes=2)
    requeue = Requeue(checkpoint_dir=tmp_path / "ckpt", script=tmp_path / "run" / "job.sh")
    opts = BatchOptions("slurm", nodes=2, gpus_per_node=4, time_seconds=7200, requeue=requeue)
    text = slurm_script(job, opts, "stx-run", tmp_path / "run" / "job.log", tmp_path)
    lines = text.splitlines()
    assert f"#SBATCH --signal=USR1@{DEFAULT_SIGNAL_GRACE}" in lines  # not B:USR1: the ranks get it
    assert "#SBATCH --open-mode=append" in lines  # one log for the chain
    task = next(line for line in lines if line.startswith("srun --kill-on-bad-exit=1 bash -c "))
    assert task.endswith("|| status=$?") and "checkpoint.load=auto" in task
    assert f'if [ "$s" -eq {RESUMABLE} ]; then touch "$STX_STOPPED" && s=0; fi' in task
    assert f"export STX_STOPPED={tmp_path / 'run' / '.stx-stopped'}" in lines
    assert f"resumed_from=$(cat {tmp_path / 'ckpt'}/latest 2>/dev/null || true)" in lines
    assert (
        "next=$(sbatch --parsable --export=ALL,STX_CHAIN_JOB=$((chain + 1)) "
        f'--dependency=afterany:"$SLURM_JOB_ID" {tmp_path / "run" / "job.sh"}) || {{'
    ) in lines
    assert not [line for line in lines if "scontrol requeue" in line and not line.startswith("#")]
    per_node = slurm_script(
        job, dataclasses.replace(opts, launcher="torchrun"), "n", tmp_path / "run" / "job.log", tmp_path
    )
    assert "srun --kill-on-bad-exit=1 --ntasks-per-node=1 bash -c 'trap : USR1 TERM; " in per_node
    assert "'\"'\"'$SLURM_NODEID'\"'\"'" not in per_node  # the node's variables stay for its shell
    plain = slurm_script(job, dataclasses.replace(opts, requeue=None), "n", tmp_path / "job.log", tmp_path)
    assert "--signal" not in plain and "STX_STOPPED" not in plain and "--open-mode" not in plain

    pbs_opts = BatchOptions("pbs", nodes=2, gpus_per_node=4, time_seconds=3600, requeue=requeue)
    pbs = pbs_script(job, pbs_opts, "stx-run", tmp_path / "run" / "job.log", tmp_path)
    assert f"timeout --preserve-status --signal=USR1 {3600 - DEFAULT_SIGNAL_GRACE}s mpiexec -n " in pbs
    assert (
        f'next=$(qsub -W depend=afterany:"$PBS_JOBID" -v STX_CHAIN_JOB=$((chain + 1)) '
        f"-o {tmp_path / 'run' / 'job'}.$((chain + 1)).log {tmp_path / 'run' / 'job.sh'}) || {{"
    ) in pbs.splitlines()


def test_requeue_option_errors_name_the_option_and_the_valid_values(tmp_path):
    requeue = Requeue(checkpoint_dir=tmp_path, script=tmp_path / "job.sh", grace_seconds=60)
    with pytest.raises(
        UsageError, match=r"--signal-grace 60 s must be shorter than the time limit \(--time: 60 s\)"
    ):
        BatchOptions("slurm", time_seconds=60, requeue=requeue)
    with pytest.raises(UsageError, match=r"--signal-grace must be in 1\.\.65535 seconds, got 0"):
        BatchOptions("slurm", requeue=dataclasses.replace(requeue, grace_seconds=0))
    with pytest.raises(UsageError, match="--requeue with --scheduler pbs needs --time"):
        BatchOptions("pbs", requeue=requeue)
    assert BatchOptions("slurm", requeue=requeue).requeue == requeue  # no --time: the partition's limit


SUBMIT = ["submit", "--scheduler", "slurm", "--nodes", "2", "--time", "1:00:00", "--dry-run"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--requeue", "train", "tiny-gpt"], "--requeue needs checkpoint.save (e.g. checkpoint.save=ckpt)"),
        (
            ["--requeue", "train", "tiny-gpt", "checkpoint.save=c", "checkpoint.load=other"],
            "checkpoint.load=other would be replaced: leave it out",
        ),
        (
            [
                "--requeue",
                "train",
                "tiny-gpt",
                "checkpoint.save=c",
                "checkpoint.load=auto",
                "checkpoint.finetune=true",
            ],
            "set checkpoint.finetune=false",
        ),
        (["--signal-grace", "60", "train", "tiny-gpt"], "--signal-grace goes with --requeue"),
        (
            ["--requeue", "--signal-grace", "3600", "train", "tiny-gpt", "checkpoint.save=c"],
            "--signal-grace 3600 s must be shorter than the time limit (--time: 3600 s)",
        ),
    ],
)
def test_submit_requeue_usage_errors(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.chdir(tmp_path)
    assert main([*SUBMIT, *argv]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert not any(tmp_path.iterdir())  # nothing written


def test_submit_dry_run_requeue_shows_the_script(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = ["--requeue", "--signal-grace", "300", "train", "tiny-gpt", "checkpoint.save=ckpt"]
    assert main([*SUBMIT, *argv, "logging.run_name=r"]) == 0
    out = capsys.readouterr().out
    assert "#SBATCH --signal=USR1@300" in out.splitlines()
    assert "logging.run_name=r checkpoint.load=auto; s=$?;" in out  # every job resumes (or starts fresh)
    assert f'--dependency=afterany:"$SLURM_JOB_ID" {tmp_path / "runs" / "r" / "job.sh"})' in out
    assert f"cat {tmp_path / 'ckpt'}/latest" in out
    assert not any(tmp_path.iterdir())


def test_the_scripts_resumable_status_is_the_trainers():
    from scalable_transformer.train.resilience import EXIT_RESUMABLE

    assert RESUMABLE == EXIT_RESUMABLE


def _sweep(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text("base: tiny-gpt\n" + body)
    return path


def test_sweep_executor_keys(tmp_path):
    spec = load_sweep(
        _sweep(tmp_path, "axes: {nodes: [1, 2]}\nexecutor: slurm\nexecutor_options: {partition: p}\n")
    )
    assert spec.executor == "slurm" and spec.axes["nodes"] == ["1", "2"]
    with pytest.raises(SweepError, match=r"'axes\.nodes': more than one node needs a scheduler"):
        load_sweep(_sweep(tmp_path, "axes: {nodes: [1, 2]}\n"))
    with pytest.raises(SweepError, match="'executor': must be one of local, slurm, pbs, got 'lsf'"):
        load_sweep(_sweep(tmp_path, "axes: {nproc: [1]}\nexecutor: lsf\n"))
    with pytest.raises(SweepError, match=r"'executor_options\.partiton': unknown option"):
        load_sweep(_sweep(tmp_path, "axes: {nproc: [1]}\nexecutor: slurm\nexecutor_options: {partiton: p}\n"))


@pytest.mark.parametrize(
    ("state", "log", "summary", "status"),
    [
        ("COMPLETED", "", True, "ok"),
        ("COMPLETED", "", False, "crashed"),
        ("TIMEOUT", "", False, "timeout"),
        ("OUT_OF_MEMORY", "", False, "oom"),
        ("FAILED", "torch.OutOfMemoryError: CUDA out of memory", False, "oom"),
        ("FAILED", "srun: error: n2: task 1: Exited with exit code 1", False, "crashed"),
        ("CANCELLED", "", False, "crashed"),
        ("NODE_FAIL", "", False, "crashed"),
        ("PREEMPTED", "", False, "crashed"),
        ("UNKNOWN", "", True, "ok"),
    ],
)
def test_scheduler_states_map_to_sweep_statuses(tmp_path, state, log, summary, status):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    if summary:
        (run_dir / "summary.json").write_text("{}")
    (tmp_path / "job.log").write_text(log)
    member = Member({}, 1, 0, [], "x", "h", None, None, 60, None)
    job = Submitted(member, "42", run_dir, tmp_path / "job.log", "t", time.monotonic())
    outcome = outcome_of(JobState(state, 1), "slurm", job)
    assert outcome["status"] == status
    if status != "ok":
        assert f"slurm job 42 ended {state}" in outcome["error"] or "no longer knows" in outcome["error"]


def test_the_host_whose_rank_failed_on_its_own_is_named():
    tails = [
        ["RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer."],
        ["stx launch: rank 1 was killed by signal SIGKILL (exit code -9)"],
    ]
    assert root_cause({0: 1, 1: 1}, tails) == 1  # host 0 was seen first, but only lost its peer
    assert root_cause({1: 1}, tails) == 1
    assert root_cause({0: 1}, [tails[0], []]) == 0


def test_one_launcher_per_node_under_srun():
    step = {
        "SLURM_STEP_ID": "0",
        "SLURM_NODEID": "1",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_NODELIST": "localhost,other",
        "SLURM_JOB_ID": "7",
    }
    assert slurm_node_layout(step) == (2, 1, "localhost", 20007)
    assert slurm_node_layout({**step, "SLURM_STEP_NUM_TASKS": "16"}) is None  # one task per GPU: ranks
    assert slurm_node_layout({**step, "RANK": "0"}) is None
    assert slurm_node_layout({k: v for k, v in step.items() if k != "SLURM_STEP_ID"}) is None


def test_export_of_an_unset_variable_is_an_error(monkeypatch):
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    monkeypatch.delenv("NCCL_IB_HCA", raising=False)
    assert environment_exports(["NCCL_SOCKET_IFNAME"]) == (("NCCL_SOCKET_IFNAME", "ib0"),)
    with pytest.raises(UsageError, match="--export NCCL_IB_HCA: not set"):
        environment_exports(["NCCL_SOCKET_IFNAME", "NCCL_IB_HCA"])


class FakeScheduler:
    """A `BatchLauncher` that runs nothing: submit writes the member's summary.json at once; the
    states come from a script (job id -> states, one per poll, the last repeated)."""

    scheduler = "slurm"

    def __init__(self, states: dict[str, list[str]]) -> None:
        self.states = states
        self.submitted: list[str] = []
        self.polls = 0

    def submit(self, job: JobSpec, run_dir: Path, log_path: Path, time_limit_seconds: float) -> str:
        job_id = str(100 + len(self.submitted))
        self.submitted.append(job_id)
        run_dir.mkdir(parents=True)
        (run_dir / "summary.json").write_text('{"samples_per_second": 1.0}')
        log_path.write_text("")
        return job_id

    def state(self, job_id: str) -> JobState:
        self.polls += 1
        queue = self.states[job_id]
        return JobState(queue.pop(0) if len(queue) > 1 else queue[0], 0, 1.0)

    def cancel(self, job_id: str) -> None:
        pass


class Interrupting(FakeScheduler):
    def state(self, job_id: str) -> JobState:
        raise KeyboardInterrupt  # the sweep is stopped while its jobs are queued


@pytest.mark.slow
def test_a_restarted_batch_sweep_reattaches_instead_of_resubmitting(tmp_path):
    from scalable_transformer.bench.results import ResultsStore
    from scalable_transformer.bench.sweep_batch import run_batch_sweep, sweep_status
    from scalable_transformer.bench.sweep_types import SweepOptions

    spec = load_sweep(
        _sweep(
            tmp_path,
            "axes: {nodes: [1, 2]}\nsteps: 2\nexecutor: slurm\nexecutor_options: {poll_seconds: 0}\n",
        )
    )
    first = Interrupting({})
    outcome = run_batch_sweep(spec, SweepOptions(spec.path), launcher=first)
    assert outcome.interrupted and first.submitted == ["100", "101"]
    second = FakeScheduler({"100": ["PENDING", "RUNNING", "COMPLETED"], "101": ["RUNNING", "TIMEOUT"]})
    outcome = run_batch_sweep(spec, SweepOptions(spec.path), launcher=second)
    assert second.submitted == []  # re-attached to 100 and 101
    assert outcome.counts == {"ok": 1, "timeout": 1}
    with ResultsStore(spec.store) as store:
        rows = {(r["nnodes"], r["nproc"]): (r["status"], r["job_id"], r["scheduler"]) for r in store.rows()}
    assert rows == {(1, 1): ("ok", "100", "slurm"), (2, 2): ("timeout", "101", "slurm")}
    assert [(r["job_id"], r["state"]) for r in sweep_status(spec.store)] == [
        ("100", "COMPLETED -> ok"),
        ("101", "TIMEOUT -> timeout"),
    ]
    third = FakeScheduler({})
    run_batch_sweep(spec, SweepOptions(spec.path), launcher=third)
    assert third.submitted == [] and third.polls == 0  # everything stored: nothing to do
