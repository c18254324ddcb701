"""Faults a run survives or ends cleanly (issue 25), as a user meets them through `stx train`:
a stop signal on one rank (a time limit, a preemption) stops every rank after the same step with a
checkpoint and exit status 75, and the resumed run's losses equal the uninterrupted run's bit for bit;
a non-finite step stops the run naming it (the last good checkpoint is the one load=auto picks) or is
skipped and counted. Faults come from tests/faults.py's callbacks (a real signal, a nan forward)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scalable_transformer.train.watchdog import EXIT_HUNG

pytestmark = pytest.mark.slow

FAULTS = str(Path(__file__).parents[1] / "faults.py")
ITERS = 10
ARGS = [
    "tiny-gpt",
    "model.num_layers=1",
    "model.hidden_size=32",
    "model.num_attention_heads=2",
    "model.seq_length=32",
    "train.micro_batch_size=2",
    f"train.train_iters={ITERS}",
    "train.eval_interval=0",
    "train.eval_iters=1",
    "logging.log_interval=1",
    "logging.tensorboard=false",
    "logging.warmup_iters=0",
]


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def train(
    cwd: Path, faults: list[str], overrides: list[str], world: int = 1
) -> list[subprocess.CompletedProcess]:
    """`stx train` through tests/faults.py on `world` ranks started as srun starts them (RANK,
    WORLD_SIZE, MASTER_ADDR/PORT per process, no launcher in between)."""
    argv = [sys.executable, FAULTS, *faults, "train", *ARGS, *overrides]
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        if world > 1:
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(
            subprocess.Popen(
                argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        out.append(subprocess.CompletedProcess(argv, p.returncode, stdout, stderr))
    return out


def losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["iteration"]: r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"}


def test_a_stop_signal_on_one_rank_stops_all_after_one_step_and_resumes_bitwise(tmp_path: Path) -> None:
    common = ["parallel.zero_stage=3", "checkpoint.save=ckpt", f"logging.run_dir={tmp_path / 'runs'}"]
    full = train(tmp_path, [], [*common, "checkpoint.save=full-ckpt", "logging.run_name=full"], world=2)
    assert [p.returncode for p in full] == [0, 0], full[0].stderr[-2000:] + full[1].stderr[-2000:]

    # rank 1 alone catches SIGUSR1 at the start of iteration 4: the check after it is read after
    # iteration 5 (it runs behind a step), so both stop after 5, save and exit 75
    stopped = train(tmp_path, ["--signal-at", "1:4:SIGUSR1"], [*common, "logging.run_name=run"], world=2)
    assert [p.returncode for p in stopped] == [75, 75], stopped[0].stderr[-2000:] + stopped[1].stderr[-2000:]
    assert "stopped by SIGUSR1 after iteration 5 of 10" in stopped[0].stdout
    assert "checkpoint.load=auto" in stopped[0].stdout
    assert (tmp_path / "ckpt" / "iter_0000005").is_dir()
    run_dir = tmp_path / "runs" / "run"
    part = json.loads((run_dir / "summary.json").read_text())
    assert part["stopped_by_signal"] == "SIGUSR1" and part["final_iteration"] == 5

    # the same command with load=auto continues the run in its directory: a second segment
    resumed = train(tmp_path, [], [*common, "checkpoint.load=auto", "logging.run_name=run"], world=2)
    assert [p.returncode for p in resumed] == [0, 0], resumed[0].stderr[-2000:]
    assert "continuing at iteration 5" in resumed[0].stdout
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["full", "run"]
    assert losses(run_dir) == losses(tmp_path / "runs" / "full")  # bit for bit: JSON floats compare exactly
    summary = json.loads((run_dir / "summary.json").read_text())
    spans = [(s["first_iteration"], s["last_iteration"], s["stopped_by"]) for s in summary["segments"]]
    assert spans == [(1, 5, "SIGUSR1"), (6, 10, None)]
    assert 0 < summary["goodput"] < 1

    report = subprocess.run(
        [sys.executable, "-m", "scalable_transformer.cli", "report", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert report.returncode == 0, report.stderr
    assert "| 1 | - | 0 | 1-5 | SIGUSR1 |" in report.stdout
    assert "| 2 | - | 0 | 6-10 | finished |" in report.stdout
    assert "goodput: " in report.stdout


def test_a_stop_signal_after_the_last_step_ends_a_complete_run_not_a_resumable_one(tmp_path: Path) -> None:
    """A time limit's SIGUSR1 that lands in the last step: the run is complete (exit 0, its summary a
    finished segment). Before, it exited 75 "to be resumed", and in a --requeue chain (CI saw it) the
    next job found nothing to train and ended the chain without a segment of its own."""
    common = ["checkpoint.save=ckpt", f"logging.run_dir={tmp_path}", "logging.run_name=last"]
    (run,) = train(tmp_path, ["--signal-at", f"0:{ITERS}:SIGUSR1"], common)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "stopped by" not in run.stdout
    summary = json.loads((tmp_path / "last" / "summary.json").read_text())
    assert summary["stopped_by_signal"] is None and "resume_from" not in summary
    assert [(s["last_iteration"], s["stopped_by"]) for s in summary["segments"]] == [(ITERS, None)]


def test_a_nonfinite_step_stops_the_run_naming_it_and_auto_resumes_from_the_last_good_save(
    tmp_path: Path,
) -> None:
    common = ["checkpoint.save=ckpt", "checkpoint.save_interval=2", f"logging.run_dir={tmp_path}"]
    (run,) = train(tmp_path, ["--nonfinite-at", "5"], [*common, "logging.run_name=nan"])
    assert run.returncode == 3, run.stderr[-2000:]
    assert "stx: stopped: iteration 5: the loss is nan" in run.stderr
    assert "train.on_nonfinite = stop" in run.stderr
    assert "Traceback" not in run.stderr
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("iter_*")) == ["iter_0000002", "iter_0000004"]

    (again,) = train(tmp_path, [], [*common, "checkpoint.load=auto", "logging.run_name=again"])
    assert again.returncode == 0, again.stderr[-2000:]
    assert "iter_0000004" in again.stdout and "continuing at iteration 4" in again.stdout


def test_a_skipped_nonfinite_step_is_counted_and_the_run_finishes(tmp_path: Path) -> None:
    overrides = ["train.on_nonfinite=skip", f"logging.run_dir={tmp_path}", "logging.run_name=skip"]
    (run,) = train(tmp_path, ["--nonfinite-at", "5"], overrides)
    assert run.returncode == 0, run.stderr[-2000:]
    summary = json.loads((tmp_path / "skip" / "summary.json").read_text())
    assert summary["nonfinite_skipped_iterations"] == [5]
    assert summary["skipped_iterations"] == 1
    assert "skipped (non-finite): 1" in run.stdout
    after = losses(tmp_path / "skip")
    assert all(v == v for i, v in after.items() if i != 5)  # no nan reached the weights
    # the watchdog leaves nothing behind in a run that did not hang
    assert not (tmp_path / "skip" / "hang").exists() and not (tmp_path / "skip" / ".watchdog").exists()


def test_a_rank_that_stops_ends_the_job_with_both_stacks_and_its_name(tmp_path: Path) -> None:
    timeout = 10
    overrides = [
        f"train.hang_timeout_seconds={timeout}",
        f"logging.run_dir={tmp_path}",
        "logging.run_name=hang",
    ]
    argv = [sys.executable, FAULTS, "--signal-at", "1:3:SIGSTOP", "train", *ARGS, *overrides]
    port, procs = free_port(), []
    for rank in range(2):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank), "LOCAL_RANK": str(rank)}
        env.update(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, PYTHONUNBUFFERED="1")
        procs.append(
            subprocess.Popen(
                argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    try:
        assert procs[0].stdout is not None
        for line in procs[0].stdout:  # rank 1 stops itself at the start of iteration 3
            if line.lstrip().startswith("iteration      2/"):
                break
        hung_at = time.monotonic()
        errs = [p.communicate(timeout=timeout + 120)[1] for p in procs]
        ended = time.monotonic() - hung_at
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode != 0 for p in procs)
    assert procs[0].returncode == EXIT_HUNG, errs[0][-2000:]
    assert ended < timeout + 30, ended
    assert "stx: hang: rank 0 made no progress" in errs[0]
    assert "rank 1: no heartbeat for" in errs[0]
    stacks = {p.name: p.read_text() for p in (tmp_path / "hang" / "hang").glob("*.txt")}
    assert sorted(stacks) == ["rank-0.txt", "rank-1.txt"]
    assert "all_reduce" in stacks["rank-0.txt"] or "wait" in stacks["rank-0.txt"]  # rank 0 waits for rank 1
    assert "faults.py" in stacks["rank-1.txt"]  # rank 1 stopped in the test's callback
    assert max(losses(tmp_path / "hang")) == 2  # nothing carried the job on once it hung


LAUNCH = """
import sys
from scalable_transformer.launch.local import LaunchOptions, launch
opts = LaunchOptions(nproc_per_node=2, max_restarts=int(sys.argv[1]))
sys.exit(launch(opts, [sys.executable, "-u", *sys.argv[2:]]))
"""


def test_a_restarted_rank_resumes_from_the_last_checkpoint_in_the_same_run(tmp_path: Path) -> None:
    def launch(max_restarts: int, faults: list[str], *overrides: str) -> subprocess.CompletedProcess:
        argv = [sys.executable, "-c", LAUNCH, str(max_restarts), FAULTS, *faults, "train", *ARGS, *overrides]
        return subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=600)

    full = launch(0, [], "parallel.zero_stage=3", f"logging.run_dir={tmp_path / 'full'}")
    assert full.returncode == 0, full.stderr[-3000:]
    # rank 1 raises at iteration 7 of the first attempt; checkpoints every 2 iterations; default run name
    overrides = ["parallel.zero_stage=3", "checkpoint.save=ckpt", "checkpoint.save_interval=2"]
    restarted = launch(1, ["--fail-at", "1:7"], *overrides, f"logging.run_dir={tmp_path / 'restarted'}")
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert "injected failure on rank 1 at iteration 7" in restarted.stderr
    assert "continuing at iteration 6" in restarted.stdout
    (run_dir,) = (tmp_path / "restarted").iterdir()  # the restart continued the first attempt's directory
    (full_dir,) = (tmp_path / "full").iterdir()
    assert losses(run_dir) == losses(full_dir)  # iterations 1-6 from the first attempt, 7-10 restored
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [(s["restart"], s["first_iteration"]) for s in summary["segments"]] == [(1, 7)]
