"""Launching on a real (private, two-node) Slurm, over ssh and with MPICH's mpiexec: every path
trains dp=2 ZeRO-3 with the losses of the local two-process run; sweeps run as batch jobs; a
failure on node 2 ends the job. The cluster comes from conftest.py; runs are tiny (seq 32, one
layer, a few iterations) because both "nodes" share this machine's cores."""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scalable_transformer.launch.batch import SchedulerLauncher

# `make test` runs these in a pytest of their own, after the others; under `pytest -n N --dist loadgroup`
# the xdist_group keeps them on one worker, since they share one session's daemons and ports
pytestmark = [
    pytest.mark.cluster,
    pytest.mark.slow,
    pytest.mark.distributed,
    pytest.mark.xdist_group("cluster"),
]

STX = str(Path(sys.executable).with_name("stx"))
TIMEOUT = 240  # seconds for any one command here
TINY = [
    "tiny-gpt",
    "model.num_layers=1",
    "model.seq_length=32",
    "train.micro_batch_size=2",
    "train.eval_interval=0",
    "train.eval_iters=1",
    "logging.tensorboard=false",
    "logging.log_interval=1",
    "parallel.zero_stage=3",
]
ITERS = 4


def train_args(run_dir: Path, name: str, iters: int = ITERS) -> list[str]:
    return [*TINY, f"train.train_iters={iters}", f"logging.run_dir={run_dir}", f"logging.run_name={name}"]


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [rec["loss"] for rec in map(json.loads, lines) if rec.get("kind") == "train"]


def run(argv: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        argv, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT, env={**os.environ, **env}
    )


def wait_job(job_id: str, timeout: float = TIMEOUT) -> str:
    """The job's final Slurm state (fails the test past timeout seconds)."""
    launcher = SchedulerLauncher("slurm")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = launcher.state(job_id)
        if state.finished:
            return state.state
        time.sleep(0.5)
    subprocess.run(["scancel", job_id], check=False)
    raise AssertionError(f"job {job_id} did not end in {timeout} s")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cluster) -> list[float]:
    """Losses of the same training as two local processes (`stx launch -n 2`)."""
    tmp = tmp_path_factory.mktemp("reference")
    proc = run([STX, "launch", "-n", "2", "train", *train_args(tmp / "runs", "local")], tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = losses(tmp / "runs" / "local")
    assert len(found) == ITERS
    return found


def submit_two_nodes(tmp_path, name: str, **train_kw) -> str:
    """`stx submit` to the 2-node test Slurm (1 GPU per node, 5 minutes); the job id it printed."""
    cmd = [STX, "submit", "--scheduler", "slurm", "--nodes", "2", "--gpus-per-node", "1", "--time", "5"]
    proc = run([*cmd, "train", *train_args(tmp_path / "runs", name, **train_kw)], tmp_path)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1]


def test_stx_submit_slurm_two_nodes_trains_like_the_local_run(tmp_path, cluster, reference):
    job_id = submit_two_nodes(tmp_path, "submitted")
    run_dir = tmp_path / "runs" / "submitted"
    assert (run_dir / "job.sh").is_file()  # the batch script lives in the run directory
    state = wait_job(job_id)
    log = (run_dir / "job.log").read_text()
    assert state == "COMPLETED", log[-3000:]
    assert f"job {job_id} on n[1-2]" in log
    assert losses(run_dir) == pytest.approx(reference, rel=1e-6)
    assert not (tmp_path / "runs" / "submitted-2").exists()  # one run directory: the prepared one


def test_srun_inside_an_allocation_trains_like_the_local_run(tmp_path, cluster, reference):
    # No MASTER_ADDR / RANK: every rank reads SLURM_PROCID..., and n1's NodeAddr from scontrol.
    env = {
        k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
    }
    cmd = ["salloc", "-N", "2", "--ntasks-per-node=1", "--gpus-per-node=1", "-t", "5"]
    cmd += ["srun", "--kill-on-bad-exit=1", STX, "train", *train_args(tmp_path / "runs", "srun")]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert losses(tmp_path / "runs" / "srun") == pytest.approx(reference, rel=1e-6)


def test_hostfile_launcher_over_ssh_trains_like_the_local_run(tmp_path, cluster, reference):
    hosts = tmp_path / "hosts"
    hosts.write_text("# two ssh 'hosts' on loopback\n127.0.0.1 slots=1\n127.0.0.2 slots=1\n")
    env_file = tmp_path / "job.env"
    env_file.write_text("# every host sets these\nOMP_NUM_THREADS=1\n")
    proc = run(
        [
            STX,
            "launch",
            "--hostfile",
            str(hosts),
            "--env-file",
            str(env_file),
            "--master-port",
            free_port(),
            "train",
            *train_args(tmp_path / "runs", "ssh"),
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "127.0.0.2: " in proc.stderr + proc.stdout  # output of the second host, prefixed
    assert losses(tmp_path / "runs" / "ssh") == pytest.approx(reference, rel=1e-6)
    env = json.loads((tmp_path / "runs" / "ssh" / "env.json").read_text())["env"]
    assert env["OMP_NUM_THREADS"] == "1"  # from the env file (stx launch would set cores / 1)


def test_mpiexec_with_a_pbs_nodefile_trains_like_the_local_run(tmp_path, cluster, reference):
    proc = run(
        [
            STX,
            "submit",
            "--scheduler",
            "pbs",
            "--nodes",
            "2",
            "--gpus-per-node",
            "1",
            "--dry-run",
            "train",
            *train_args(tmp_path / "runs", "mpi"),
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    script = tmp_path / "job.pbs"
    script.write_text(proc.stdout)
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("127.0.0.1\n127.0.0.2\n")
    # The script PBS would run, as PBS runs it (its #PBS lines are comments to bash): MPICH's
    # mpiexec starts rank 1 on 127.0.0.2 over ssh (HYDRA_LAUNCHER_EXEC from conftest).
    proc = run(["bash", str(script)], tmp_path, PBS_NODEFILE=str(nodefile), PBS_JOBID="1234.pbs")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "rank 0 at 127.0.0.1:21234" in proc.stdout
    assert losses(tmp_path / "runs" / "mpi") == pytest.approx(reference, rel=1e-6)


def _sweep_file(path: Path, body: str) -> Path:
    path.write_text(
        "base: tiny-gpt\n"
        f"overrides: [{', '.join(TINY[1:])}]\n"
        "steps: 3\nwarmup_steps: 1\nexecutor: slurm\nexecutor_options: {poll_seconds: 0.5}\n" + body
    )
    return path


def _jobs(store: Path) -> list[tuple[str, str]]:
    """(job id, label) of every submission the sweep recorded."""
    if not store.is_file():
        return []
    with sqlite3.connect(store) as conn:
        try:
            return conn.execute("SELECT job_id, label FROM sweep_jobs ORDER BY id").fetchall()
        except sqlite3.OperationalError:  # no table yet
            return []


def _wait_for(predicate, timeout: float = 60, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_sweep_on_slurm_over_node_counts_reattaches_after_a_kill(tmp_path, cluster):
    sweep = _sweep_file(tmp_path / "nodes.yaml", "axes:\n  nodes: [1, 2]\ntimeout_seconds: 300\n")
    store = tmp_path / "results.sqlite"
    first = subprocess.Popen([STX, "sweep", str(sweep)], cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: len(_jobs(store)) == 2, what="two submissions")
        first.send_signal(signal.SIGKILL)  # the sweep dies; its jobs stay with Slurm
        first.wait(timeout=30)
        ids = [job_id for job_id, _ in _jobs(store)]
        queued = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout.split()
        assert set(ids) & set(queued), "no job of the killed sweep is queued or running any more"
        second = run([STX, "sweep", str(sweep)], tmp_path)
        assert second.returncode == 0, second.stderr[-3000:]
        assert second.stderr.count("re-attached to slurm job") >= 1
        assert "submitted slurm job" not in second.stderr
        assert [job_id for job_id, _ in _jobs(store)] == ids  # no job submitted twice
        with sqlite3.connect(store) as conn:
            rows = conn.execute(
                "SELECT nnodes, nproc, status, job_id FROM results ORDER BY nnodes"
            ).fetchall()
        assert rows == [(1, 1, "ok", ids[0]), (2, 2, "ok", ids[1])]
        report = run([STX, "report", str(store)], tmp_path)
        assert "| label \\ devices | 1*1 | 2*1 |" in report.stdout, report.stdout
        status = run([STX, "sweep", "status", str(store)], tmp_path)
        assert status.returncode == 0 and status.stdout.count("COMPLETED -> ok") == 2, status.stdout
    finally:
        if first.poll() is None:
            first.kill()
        for job_id, _ in _jobs(store):
            subprocess.run(["scancel", job_id], check=False)


def test_sweep_on_slurm_stores_timeout_and_cancelled_members(tmp_path, cluster):
    sweep = _sweep_file(
        tmp_path / "limits.yaml",
        "axes:\n  train.train_iters: [100000, 100001]\ntimeout_seconds: 600\n"
        "limits:\n  - {when: {train.train_iters: 100000}, timeout_seconds: 1}\n",
    )
    store = tmp_path / "results.sqlite"
    proc = subprocess.Popen(
        [STX, "sweep", str(sweep)], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        _wait_for(lambda: len(_jobs(store)) == 2, what="two submissions")
        cancel = next(job_id for job_id, label in _jobs(store) if "100001" in label)
        launcher = SchedulerLauncher("slurm")
        _wait_for(lambda: launcher.state(cancel).state == "RUNNING", what=f"job {cancel} running")
        subprocess.run(["scancel", cancel], check=True)
        _, err = proc.communicate(timeout=TIMEOUT)  # the other ends at its 1-minute Slurm limit
        assert proc.returncode == 0, err[-3000:]
        with sqlite3.connect(store) as conn:
            rows = dict(conn.execute("SELECT label, status || ' ' || coalesce(error, '') FROM results"))
        by_iters = {("100000" if "100000" in label else "100001"): v for label, v in rows.items()}
        assert by_iters["100000"].startswith("timeout slurm job"), by_iters
        assert "ended TIMEOUT" in by_iters["100000"]
        assert by_iters["100001"].startswith("crashed slurm job"), by_iters
        assert "ended CANCELLED" in by_iters["100001"]
    finally:
        if proc.poll() is None:
            proc.kill()
        for job_id, _ in _jobs(store):
            subprocess.run(["scancel", job_id], check=False)


def _rank_pid(job_id: str, rank: int) -> int | None:
    """The pid of the training process of `rank` in Slurm job job_id (from /proc/PID/environ)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if b"scalable_transformer" not in cmdline and b"stx" not in cmdline:
            continue
        if f"SLURM_JOB_ID={job_id}".encode() in environ and f"SLURM_PROCID={rank}".encode() in environ:
            return int(entry.name)
    return None


def test_a_rank_killed_on_node_2_ends_the_job_within_a_minute(tmp_path, cluster):
    job_id = submit_two_nodes(tmp_path, "killed", iters=100000)
    log = tmp_path / "runs" / "killed" / "job.log"
    try:
        _wait_for(lambda: log.is_file() and "iteration      2/" in log.read_text(), 120, "iteration 2")
        pid = _rank_pid(job_id, 1)
        assert pid is not None, "rank 1's process not found"
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        assert b"SLURMD_NODENAME=n2" in environ.split(b"\0")
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        state = wait_job(job_id, timeout=90)
        elapsed = time.monotonic() - t0
        text = log.read_text()
        assert state == "FAILED", text[-3000:]
        assert elapsed < 60, f"the job took {elapsed:.0f} s to end"
        first_error = next(line for line in text.splitlines() if line.startswith("srun: error:"))
        assert "n2: task 1" in first_error, text[-3000:]
    finally:
        subprocess.run(["scancel", job_id], check=False)
