"""`LocalLauncher`, the first `Launcher`: a real tiny training job through `stx launch -n 1`, and a job
stopped at its timeout with nothing left running."""

from __future__ import annotations

import json
import time
from pathlib import Path

import psutil
import pytest

from scalable_transformer.launch.launcher import JobSpec
from scalable_transformer.launch.local_jobs import LocalLauncher, launch_command


def tiny_job(run_dir: Path, name: str) -> JobSpec:
    return JobSpec(
        "train",
        (
            "tiny-gpt",
            "model.num_layers=1",
            "model.seq_length=32",
            "train.micro_batch_size=2",
            "train.train_iters=2",
            "train.eval_interval=0",
            "train.eval_iters=1",
            "logging.tensorboard=false",
            f"logging.run_dir={run_dir}",
            f"logging.run_name={name}",
        ),
        nproc=1,
        memory_limit_mb=3000,
    )


def test_launch_command_goes_through_stx_launch() -> None:
    cmd = launch_command(JobSpec("train", ("tiny-gpt", "a=$b"), nproc=3))
    assert cmd[1:] == ["-m", "scalable_transformer.cli", "launch", "-n", "3", "train", "tiny-gpt", "a=$b"]


@pytest.mark.slow
def test_a_tiny_member_runs_to_its_summary(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    result = LocalLauncher().launch(tiny_job(tmp_path, "m"), log, timeout_seconds=240, env={"STX_X": "1"})
    assert result.returncode == 0, result.output[-3000:]
    assert not result.timed_out and result.wall_seconds > 0
    assert result.output == log.read_text()
    assert result.output.startswith("$ launch -n 1 train tiny-gpt model.num_layers=1")
    assert "stx launch: 1 processes on node 0 of 1" in result.output
    summary = json.loads((tmp_path / "m" / "summary.json").read_text())
    assert summary["samples_per_second"] > 0


@pytest.mark.slow
def test_a_job_past_its_timeout_is_stopped_with_its_ranks(tmp_path: Path) -> None:
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    t0 = time.perf_counter()
    result = LocalLauncher().launch(tiny_job(tmp_path, "slow"), tmp_path / "slow.log", timeout_seconds=1.0)
    assert result.timed_out
    assert 1.0 <= result.wall_seconds < 30 and time.perf_counter() - t0 < 30
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before
    assert not (tmp_path / "slow" / "summary.json").exists()


# A Ctrl-C that arrives while the launcher forks: Python runs its at-fork handlers then, and a
# KeyboardInterrupt raised inside one is printed and dropped. Here the parent's at-fork handler sends
# the signal itself, so it always arrives in that window (the sweep e2e test hit it by chance).
CTRL_C_WHILE_FORKING = """
import os, signal, sys, time
from pathlib import Path
from scalable_transformer.launch import local_jobs
from scalable_transformer.launch.launcher import JobSpec

# a shell's background job (CI's) starts with SIGINT ignored: Ctrl-C's own handler, as in a terminal
signal.signal(signal.SIGINT, signal.default_int_handler)
local_jobs.launch_command = lambda job: [sys.executable, "-c", "import time; time.sleep(60)"]
os.register_at_fork(after_in_parent=lambda: os.kill(os.getpid(), signal.SIGINT))
t0 = time.monotonic()
try:
    local_jobs.LocalLauncher().launch(JobSpec("train", (), nproc=1), Path(sys.argv[1]), 120)
    print("not interrupted", round(time.monotonic() - t0, 1))
except KeyboardInterrupt:
    print("interrupted", round(time.monotonic() - t0, 1))
"""


def test_a_ctrl_c_while_the_job_is_forked_stops_it_instead_of_being_lost(tmp_path: Path) -> None:
    import subprocess
    import sys

    script = tmp_path / "ctrl_c.py"
    script.write_text(CTRL_C_WHILE_FORKING)
    before = {p.pid for p in psutil.process_iter()}
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "job.log")], capture_output=True, text=True, timeout=90
    )
    assert proc.stdout.startswith("interrupted "), proc.stdout + proc.stderr
    assert float(proc.stdout.split()[1]) < 30  # the 60 s job was stopped, not waited for
    sleeping = [p for p in psutil.process_iter(["pid", "cmdline"]) if p.pid not in before
                and "time.sleep(60)" in " ".join(p.info["cmdline"] or [])]  # fmt: skip
    assert not sleeping  # and nothing left running
