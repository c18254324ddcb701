"""`stx submit --requeue` on the real two-node test Slurm: 1-minute jobs stopped before their time limit
by Slurm's SIGUSR1 continue the run in new jobs until train.train_iters is reached, with the losses of
the run that was never interrupted, bit for bit, in one run directory. PBS (not installed here): its
requeue script is run by bash under MPICH's mpiexec as PBS would run it, up to the `qsub` of the next
job, which bash then cannot find.

Timing on the test Slurm (22.05; scripts/cluster/up.sh): slurmctld looks at time limits and --signal
every 30 s and sends the signal at the first look less than 30 + GRACE s before the limit (measured
with --signal=USR1@5 and --time=1: 29, 29, 47, 53 s into a job). A job that starts a few seconds
(d, 5-10 s) after its predecessor's signal is looked at 30 - d s in: with GRACE 15 it gets the signal
then, about 25 s in; with a GRACE below d it would get it 60 - d s in and end at about its limit
(measured with GRACE 1: state TIMEOUT for a job that handed over 0.3 s past its minute). Slurm kills a
job at the first look past its minute, at least 30 s after the signal.

The run directory and summary.json's "segments" and "goodput" (one segment per job) are written by
`stx train` when a resumed run continues in its directory."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
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
TINY = [
    "tiny-gpt",
    "model.num_layers=1",
    "model.hidden_size=32",
    "model.num_attention_heads=2",
    "model.seq_length=32",
    "train.micro_batch_size=2",
    "train.eval_interval=0",
    "train.eval_iters=1",
    "logging.tensorboard=false",
    "logging.log_interval=1",
]
# The runs are sized in seconds of training, at the speed `seconds_per_iteration` measures first (a
# fixed count broke when the step got faster: 900 iterations took 63 s at 0.07 s each, then 24 s at
# 0.027 s, and the first job finished the run). The first Slurm job trains at most 45 - 8 s (start-up),
# the next ones 25 - 8 s: 60 s of training are at least two stops (37 + 17 < 60), three or four jobs.
SLURM_TRAIN_SECONDS = 60
GRACE = 15  # the signal 15-45 s into the first job, about 25 s into the next ones
CHAIN_DEADLINE = 480  # seconds for the whole chain (measured: about 4 minutes)


@pytest.fixture(scope="module")
def seconds_per_iteration(tmp_path_factory) -> float:
    """The median iteration time of TINY on 2 local ranks, one thread each (as srun runs them), from a
    short `stx launch` run; it also builds the tokenizer and datasets into the session's cache."""
    cwd = tmp_path_factory.mktemp("speed")
    args = [*TINY, "train.train_iters=60", f"logging.run_dir={cwd}", "logging.run_name=speed"]
    proc = subprocess.run(
        [STX, "launch", "-n", "2", "train", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((cwd / "speed" / "summary.json").read_text())["median_iteration_seconds"]


def iterations_for(seconds: float, seconds_per_iteration: float) -> int:
    return max(100, round(seconds / seconds_per_iteration))


END_OF_CHAIN = ("the run is complete", "the chain of jobs ends here", "not continued", "next job failed")


def losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["iteration"]: r["loss"] for r in map(json.loads, lines) if r.get("kind") == "train"}


def reference(cwd: Path, iters: int) -> subprocess.Popen:
    """The uninterrupted run with srun's layout (2 ranks, one thread each), as a local `stx launch`,
    at the lowest CPU priority (the jobs' ranks come first). Returns once the run has built the
    tokenizer and datasets into the session's cache, which the jobs then read: two runs building
    them at once on an empty cache get different vocabularies (the tokenizer training is not
    deterministic: 10093 and 10089 tokens measured)."""
    args = [*TINY, f"train.train_iters={iters}", f"logging.run_dir={cwd / 'ref'}", "logging.run_name=ref"]
    out = cwd / "ref.out"
    with out.open("w") as sink:
        proc = subprocess.Popen(
            ["nice", "-n", "19", STX, "launch", "-n", "2", "train", *args],
            cwd=cwd,
            stdout=sink,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    deadline = time.monotonic() + 120
    while "\nmodel: " not in out.read_text(errors="replace"):  # its banner: the data are built
        assert proc.poll() is None, out.read_text()[-3000:]
        assert time.monotonic() < deadline, "the reference run did not start in 120 s"
        time.sleep(0.2)
    return proc


def chain_job_ids(log: str) -> list[str]:
    return re.findall(r"^stx submit: job (\d+) on n\[1-2\]", log, re.MULTILINE)


def test_requeue_continues_the_run_through_time_limits_bitwise_in_one_run_directory(
    tmp_path, cluster, seconds_per_iteration
):
    iters = iterations_for(SLURM_TRAIN_SECONDS, seconds_per_iteration)
    ref = reference(tmp_path, iters)
    runs = tmp_path / "runs"
    args = [*TINY, f"train.train_iters={iters}", "checkpoint.save=ckpt"]
    args += [f"logging.run_dir={runs}", "logging.run_name=chain"]
    cmd = [STX, "submit", "--scheduler", "slurm", "--nodes", "2", "--gpus-per-node", "1", "--no-gpu-request"]
    cmd += ["--requeue", "--time", "1", "--signal-grace", str(GRACE), "train", *args]
    log_path = runs / "chain" / "job.log"
    try:
        submit = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert submit.returncode == 0, submit.stderr
        assert "requeue: continues in new jobs" in submit.stdout
        deadline = time.monotonic() + CHAIN_DEADLINE
        log = ""
        while not any(end in log for end in END_OF_CHAIN):
            assert time.monotonic() < deadline, f"the chain did not end in {CHAIN_DEADLINE} s:\n{log[-3000:]}"
            time.sleep(1)
            log = log_path.read_text(errors="replace") if log_path.is_file() else ""
        ids = chain_job_ids(log)
        launcher = SchedulerLauncher("slurm")
        while not launcher.state(ids[-1]).finished:  # the last job is still leaving
            assert time.monotonic() < deadline + 60, f"job {ids[-1]} did not end"
            time.sleep(0.5)
        log = log_path.read_text(errors="replace")
    finally:
        queued = subprocess.run(["squeue", "-h", "-o", "%i %j"], capture_output=True, text=True).stdout
        for line in queued.splitlines():
            if line.split()[1:] == ["stx-chain"]:
                subprocess.run(["scancel", line.split()[0]], check=False)
    assert ref.wait(timeout=300) == 0, (tmp_path / "ref.out").read_text()[-3000:]

    assert "the run is complete" in log, log[-3000:]
    assert submit.stdout.strip().splitlines()[-1] == ids[0]
    assert len(ids) >= 3 and len(set(ids)) == len(ids), ids  # at least two stops, a new job id each
    stops = re.findall(r"stopped by SIGUSR1 after iteration (\d+) of", log)
    handed_over = re.findall(
        r"^stx submit: job (\d+) stopped to be resumed from iter_\d+; job (\d+)", log, re.M
    )
    assert len(stops) == len(ids) - 1 and handed_over == list(itertools.pairwise(ids)), log[-3000:]
    assert [SchedulerLauncher("slurm").state(i).state for i in ids] == ["COMPLETED"] * len(ids)
    assert "TIME LIMIT" not in log  # every job ended on its own before Slurm killed it
    assert [p.name for p in runs.iterdir()] == ["chain"]  # one run directory for the whole chain
    assert losses(runs / "chain") == losses(tmp_path / "ref" / "ref")  # bit for bit, every iteration

    summary = json.loads((runs / "chain" / "summary.json").read_text())
    segments = summary["segments"]
    assert [s["job_id"] for s in segments] == ids
    assert [s["stopped_by"] for s in segments] == ["SIGUSR1"] * (len(ids) - 1) + [None]
    assert [s["last_iteration"] for s in segments] == [*map(int, stops), iters]
    for before, after in itertools.pairwise(segments):
        # each job continues where the one before stopped (first_iteration: the resumed one or the next)
        assert after["first_iteration"] - before["last_iteration"] in (0, 1), segments
    assert 0 < summary["goodput"] <= 1


# 32 s of training: the first job (SIGUSR1 20 s in, after 5-10 s of start-up) cannot finish even on
# an idle machine; 3 jobs when idle, more on a loaded one (at most 12 are run).
PBS_TRAIN_SECONDS = 32


def test_pbs_requeue_script_stops_the_ranks_before_walltime_and_resumes_them(
    tmp_path, cluster, seconds_per_iteration
):
    """The PBS script (run by bash, as PBS runs it; mpiexec starts rank 1 on 127.0.0.2 over ssh) sends
    SIGUSR1 --signal-grace seconds before its walltime, sees every rank stop to be resumed and tries
    `qsub -W depend=afterany:$PBS_JOBID` of itself, which is not installed here: the script says so and
    fails. Run again as the next job would be, it resumes; until the run is complete."""
    if shutil.which("qsub"):
        pytest.skip(f"a real qsub is installed ({shutil.which('qsub')}): this test would submit to it")
    iters = iterations_for(PBS_TRAIN_SECONDS, seconds_per_iteration)
    ref = reference(tmp_path, iters)
    runs = tmp_path / "runs"
    args = [*TINY, f"train.train_iters={iters}", "checkpoint.save=ckpt"]
    args += [f"logging.run_dir={runs}", "logging.run_name=pbs"]
    cmd = [STX, "submit", "--scheduler", "pbs", "--nodes", "2", "--gpus-per-node", "1", "--no-gpu-request"]
    cmd += ["--requeue", "--time", "0:00:40", "--signal-grace", "20", "--dry-run", "train", *args]
    dry = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert dry.returncode == 0, dry.stderr
    script = tmp_path / "job.pbs"
    script.write_text(dry.stdout)
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("127.0.0.1\n127.0.0.2\n")
    outputs = []
    for job in range(1, 13):
        env = {**os.environ, "PBS_NODEFILE": str(nodefile), "PBS_JOBID": f"{100 + job}.pbs"}
        env.update(STX_CHAIN_JOB=str(job), PATH=os.environ["PATH"])
        proc = subprocess.run(
            ["bash", str(script)], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=240
        )
        outputs.append(proc.stdout + proc.stderr)
        if "the run is complete" in outputs[-1]:
            assert proc.returncode == 0, outputs[-1][-3000:]
            break
        assert proc.returncode == 1, outputs[-1][-3000:]
        assert f"stx submit: job {100 + job}.pbs is job {job} of the chain" in outputs[-1]
        assert "stopped by SIGUSR1 after iteration" in outputs[-1], outputs[-1][-3000:]
        assert "qsub: command not found" in outputs[-1]
        assert (
            f"submitting the next job failed; to continue, submit {runs / 'pbs' / 'job.sh'} again"
            in outputs[-1]
        )
    assert len(outputs) >= 2 and "the run is complete" in outputs[-1], outputs[-1][-3000:]
    assert ref.wait(timeout=300) == 0, (tmp_path / "ref.out").read_text()[-3000:]
    got: dict[int, float] = {}
    for run_dir in sorted(runs.iterdir()):  # one per job until the resumed run keeps its directory
        got.update(losses(run_dir))
    assert got == losses(tmp_path / "ref" / "ref")
