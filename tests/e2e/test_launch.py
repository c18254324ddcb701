"""`stx launch` as a user runs it: real processes through torchrun's agent, in a temporary directory.

Every run has a hard subprocess timeout: a launcher that hangs is a failure, not a slow test.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from scalable_transformer.launch.local import worker_threads

STX = str(Path(sys.executable).with_name("stx"))
TIMEOUT = 180  # seconds; every run here takes well under a minute on 2 busy cores
STARTED = "stx launch: 2 processes on node"
FAULTS = str(Path(__file__).parents[1] / "faults.py")  # printed just before the ranks are started


def tiny_train(run_dir: Path, train_iters: int = 5) -> list[str]:
    return [
        "train",
        "tiny-gpt",
        f"train.train_iters={train_iters}",
        "logging.log_interval=1",
        "train.eval_interval=0",
        "train.eval_iters=1",
        f"logging.run_dir={run_dir}",
        "model.num_layers=1",
        "train.micro_batch_size=2",
        "logging.tensorboard=false",
    ]


def run(argv: list[str], cwd: Path, **env: str | None) -> tuple[subprocess.CompletedProcess, float]:
    """Run argv with this session's environment (STX_CACHE_DIR from conftest) updated by `env`
    (None: unset); returns the process and its wall time in seconds."""
    full_env = dict(os.environ)
    for key, value in env.items():
        if value is None:
            full_env.pop(key, None)
        else:
            full_env[key] = value
    start = time.monotonic()
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT, env=full_env)
    return proc, time.monotonic() - start


def report(stderr: str) -> str:
    """The launcher's failure report: from its first line to the end."""
    assert "stx launch: rank " in stderr, stderr[-3000:]
    return stderr[stderr.index("stx launch: rank ") :]


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_train_and_rank0_output_is_shown(tmp_path):
    proc, _ = run([STX, "launch", "-n", "2", *tiny_train(tmp_path / "runs")], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "iteration      5/     5" in proc.stdout
    assert proc.stdout.count("run directory") == 1  # rank 0's stdout only (the default)
    assert STARTED in proc.stderr


@pytest.mark.slow
@pytest.mark.distributed
def test_a_failing_rank_brings_the_job_down_and_is_named(tmp_path):
    proc, _ = launch_faulty(tmp_path, "1:2", *tiny_train(tmp_path / "runs"))
    assert proc.returncode == 1, proc.stderr[-3000:]
    text = report(proc.stderr)
    assert text.startswith("stx launch: rank 1 failed with exit code 1")
    assert "RuntimeError: injected failure on rank 1 at iteration 2" in text
    assert "faults.py" in text and "in on_step_start" in text  # the traceback's innermost frame


@pytest.mark.slow
@pytest.mark.distributed
def test_the_other_ranks_are_stopped_when_one_fails(tmp_path):
    """Rank 1 fails at iteration 1; rank 0 alone would train 100k iterations (hours): the job must end
    as soon as the agent has stopped rank 0."""
    proc, seconds = launch_faulty(tmp_path, "1:1", *tiny_train(tmp_path / "runs", train_iters=100_000))
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert report(proc.stderr).startswith("stx launch: rank 1 failed with exit code 1")
    assert seconds < 120, f"took {seconds:.0f} s"


# A rank that ignores SIGTERM and never returns (what a rank stuck in an NCCL collective can look
# like), while its peer fails: the agent must escalate to SIGKILL, after its fixed 30 s grace. stx
# commands cannot be made to do that on purpose, so the ranks run this script through the launcher.
STUCK_RANK = """
import os, signal, sys, time
ready = sys.argv[1]
if os.environ["RANK"] == "0":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    open(ready, "w").close()
    while True:
        time.sleep(1)
while not os.path.exists(ready):
    time.sleep(0.05)
sys.exit("rank 1 gives up: peer unreachable")
"""

LAUNCH_SCRIPT = """
import sys
from scalable_transformer.launch.local import LaunchOptions, launch
opts = LaunchOptions(nproc_per_node=2, ranks_output={ranks_output!r})
sys.exit(launch(opts, [sys.executable, "-u", *sys.argv[1:]]))
"""


def launch_faulty(tmp_path: Path, fail_at: str, *train_args: str):
    """`train_args` on 2 ranks through the launcher, with the test-only callback that makes rank R
    raise at iteration I (`tests/faults.py --fail-at R:I`)."""
    launcher = LAUNCH_SCRIPT.format(ranks_output="0")
    return run([sys.executable, "-c", launcher, FAULTS, "--fail-at", fail_at, *train_args], tmp_path)


def launch_script(tmp_path: Path, source: str, *args: str, ranks_output: str = "0", **env: str | None):
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(source))
    launcher = LAUNCH_SCRIPT.format(ranks_output=ranks_output)
    return run([sys.executable, "-c", launcher, str(script), *args], tmp_path, **env)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_rank_that_ignores_sigterm_is_killed(tmp_path):
    proc, seconds = launch_script(tmp_path, STUCK_RANK, str(tmp_path / "ready"))
    assert proc.returncode == 1, proc.stderr[-3000:]
    text = report(proc.stderr)
    assert text.startswith("stx launch: rank 1 failed with exit code 1")
    assert "rank 1 gives up: peer unreachable" in text  # no error file: the tail of its stderr
    assert "rank 0 was killed by signal SIGKILL" in text
    assert seconds < 90, f"took {seconds:.0f} s"


PRINT_ENV = """
import json, os, sys
keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "STX_CACHE_DIR"]
print(json.dumps({"env": {k: os.environ.get(k) for k in keys}, "argv": sys.argv[1:]}))
"""


@pytest.mark.distributed
def test_each_rank_gets_the_torchrun_environment_and_its_arguments_untouched(tmp_path):
    arg = "a$$b${local_rank}$x"  # torch's agent would substitute ${local_rank} and turn $$ into $
    proc, _ = launch_script(tmp_path, PRINT_ENV, arg, ranks_output="all", OMP_NUM_THREADS=None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = {}
    for line in proc.stdout.splitlines():
        prefix, _, payload = line.partition(":")
        seen[prefix] = json.loads(payload)
    assert sorted(seen) == ["[rank0]", "[rank1]"]
    for rank in (0, 1):
        got = seen[f"[rank{rank}]"]
        assert got["argv"] == [arg]
        e = got["env"]
        assert (e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"]) == (str(rank), str(rank), "2")
        assert e["MASTER_ADDR"] and int(e["MASTER_PORT"]) > 0
        assert e["OMP_NUM_THREADS"] == str(worker_threads(2))
        assert e["STX_CACHE_DIR"] == os.environ["STX_CACHE_DIR"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-n", "0", "train"], "--nproc-per-node must be >= 1, got 0"),
        (["-n", "2"], "the following arguments are required: SUBCOMMAND"),
        (["-n", "2", "bogus"], "argument SUBCOMMAND: invalid choice: 'bogus'"),
    ],
)
def test_bad_input_is_an_error_before_any_process_starts(tmp_path, args, message):
    proc, _ = run([STX, "launch", *args], tmp_path)
    assert proc.returncode == 2
    assert "stx launch: error: " + message in proc.stderr
    assert STARTED not in proc.stderr and proc.stdout == ""


# A rank that stops to be resumed (as `stx train` does on SIGUSR1/SIGTERM): it writes which signal it
# got and exits 75; rank 0 takes 2 s longer (its outputs), and by then a SIGTERM would kill it, as it
# kills `stx train` after its last step. torch's agent would SIGTERM it as soon as rank 1 has exited.
STOPPING_RANK = """
import os, signal, sys, time
out, rank = sys.argv[1], os.environ["RANK"]
got = []
def stop(signum, frame):
    got.append(signum)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
signal.signal(signal.SIGUSR1, stop)
signal.signal(signal.SIGTERM, stop)
open(f"{out}.ready{rank}", "w").close()
while not got:
    time.sleep(0.05)
if rank == "0":
    time.sleep(2)
with open(f"{out}.{rank}", "w") as f:
    f.write(signal.Signals(got[0]).name)
sys.exit(75)
"""


def wait_for(paths: list[Path], proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not all(p.exists() for p in paths):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"{paths} not written in {TIMEOUT} s"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM], ids=["SIGUSR1", "SIGTERM"])
def test_a_stop_signal_reaches_every_rank_and_75_from_all_is_the_launchers_status(tmp_path, sig):
    script = tmp_path / "rank.py"
    script.write_text(STOPPING_RANK)
    out = tmp_path / "out"
    launcher = LAUNCH_SCRIPT.format(ranks_output="0")
    proc = subprocess.Popen(
        [sys.executable, "-c", launcher, str(script), str(out)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for([tmp_path / "out.ready0", tmp_path / "out.ready1"], proc)
        proc.send_signal(sig)  # to the launcher only: it passes it on
        _, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 75, err[-3000:]
    assert [(tmp_path / f"out.{rank}").read_text() for rank in (0, 1)] == [sig.name] * 2
    assert "stx launch: all 2 ranks stopped to be resumed (exit status 75)" in err


@pytest.mark.slow
@pytest.mark.distributed
def test_stx_launch_stopped_by_sigusr1_saves_and_exits_75(tmp_path):
    """What a Slurm job with --launcher torchrun and --requeue sees before its time limit."""
    argv = [STX, "launch", "-n", "2", *tiny_train(tmp_path / "runs", train_iters=100_000)]
    proc = subprocess.Popen(
        [*argv, "checkpoint.save=ckpt"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # rank 0's output; the launcher's own goes to stderr
            if "iteration      3/" in line:
                break
        proc.send_signal(signal.SIGUSR1)
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 75, err[-3000:]
    assert re.search(r"stopped by SIGUSR1 after iteration \d+ of 100000: checkpoint saved in ckpt", out), out
    assert (tmp_path / "ckpt" / "latest").read_text().startswith("iter_")
    assert "stx launch: all 2 ranks stopped to be resumed (exit status 75)" in err
