"""Resume as a user does it: `stx train` killed with SIGKILL mid-run (or during a save), then run again
with checkpoint.load=auto, must continue exactly as the run that was never interrupted: the same
learning rates and samples, the same losses to within the float32 ulp that two processes of the
same run occasionally differ by (LOSS_ULPS) (one process, CPU fp32, dropout on: the RNG states are
restored too)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow

ITERS = 12
ARGS = [
    "train",
    "tiny-gpt",
    "model.num_layers=2",
    "model.hidden_size=32",
    "model.num_attention_heads=2",
    "model.seq_length=32",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    f"train.train_iters={ITERS}",
    "train.eval_interval=0",
    "train.eval_iters=1",
    "logging.log_interval=1",
    "logging.tensorboard=false",
    "logging.warmup_iters=0",
]


def command(*overrides: str) -> list[str]:
    return [sys.executable, "-m", "scalable_transformer.cli", *ARGS, *overrides]


FAULTS = str(Path(__file__).parents[1] / "faults.py")


def stx(cwd: Path, *overrides: str, exit_in_save: int | None = None) -> subprocess.CompletedProcess:
    argv = command(*overrides)
    if exit_in_save is not None:  # the same run through the test-only fault-injection callbacks
        argv = [sys.executable, FAULTS, "--exit-in-save", str(exit_in_save), *ARGS, *overrides]
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=600)


def records(run_dir: Path) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["iteration"]: r for r in map(json.loads, lines) if r["kind"] == "train"}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("uninterrupted")
    proc = stx(tmp, "logging.run_name=full")
    assert proc.returncode == 0, proc.stderr
    return records(tmp / "runs" / "full")


# A CPU run's fp32 loss can differ by one float32 ulp from the same run's in another process, about
# once in 20 test runs, at one iteration (iteration 12: 9.008994102478027 vs 9.008993148803711), in
# the uninterrupted run as well as in a resumed one: never in 184 plain runs and 45 kill-and-resume
# cycles outside pytest (idle and loaded machine). Anything resume gets wrong (RNG, optimizer state,
# schedule, data position) moves the losses by far more, and lr and samples must match exactly.
LOSS_ULPS = 2


def assert_same_steps(got: dict[int, dict], want: dict[int, dict]) -> None:
    for it, r in got.items():
        w = want[it]
        assert (r["lr"], r["consumed_samples"]) == (w["lr"], w["consumed_samples"]), f"iteration {it}"
        ulps = abs(r["loss"] - w["loss"]) / float(np.spacing(np.float32(w["loss"])))
        assert ulps <= LOSS_ULPS, f"iteration {it}: loss {r['loss']!r} vs {w['loss']!r} ({ulps:.0f} ulps)"


def test_sigkill_mid_run_then_resume_is_bitwise(tmp_path, uninterrupted):
    save = tmp_path / "ckpt"
    run = [f"checkpoint.save={save}", "checkpoint.save_interval=2"]
    proc = subprocess.Popen(
        command(*run, "logging.run_name=killed"),
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300
    while not (save / "iter_0000004").exists():  # two saves behind it: killed mid-run, mid-interval
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before it was killed"
        time.sleep(0.02)
    time.sleep(0.15)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    latest = int((save / "latest").read_text().strip().removeprefix("iter_"))
    assert 4 <= latest < ITERS

    resumed = stx(tmp_path, *run, "checkpoint.load=auto", "logging.run_name=resumed")
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {save / f'iter_{latest:07d}'}" in resumed.stdout
    got = records(tmp_path / "runs" / "resumed")
    assert sorted(got) == list(range(latest + 1, ITERS + 1))
    assert_same_steps(got, uninterrupted)
    assert_same_steps(records(tmp_path / "runs" / "killed"), uninterrupted)


def test_kill_during_a_save_leaves_the_previous_checkpoint(tmp_path, uninterrupted):
    save = tmp_path / "ckpt"
    run = [f"checkpoint.save={save}", "checkpoint.save_interval=2", "checkpoint.keep_last_n=2"]
    # rank 0 dies inside the iteration-6 save: shards written, checkpoint not yet published
    died = stx(tmp_path, *run, "logging.run_name=died", exit_in_save=6)
    assert died.returncode == 17, died.stderr
    assert (save / "latest").read_text() == "iter_0000004\n"
    assert (save / ".tmp-iter_0000006").is_dir() and not (save / "iter_0000006").exists()
    assert sorted(p.name for p in save.glob("iter_*")) == ["iter_0000002", "iter_0000004"]

    info = subprocess.run(
        [sys.executable, "-m", "scalable_transformer.cli", "checkpoint", "info", str(save)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert info.returncode == 0 and "iteration: 4 (16 consumed samples)" in info.stdout, info.stderr

    resumed = stx(tmp_path, *run, "checkpoint.load=auto", "logging.run_name=resumed")
    assert resumed.returncode == 0, resumed.stderr
    got = records(tmp_path / "runs" / "resumed")
    assert sorted(got) == list(range(5, ITERS + 1))
    assert_same_steps(got, uninterrupted)
    # keep_last_n = 2 and the killed save's leftovers are gone
    assert sorted(p.name for p in save.iterdir()) == ["iter_0000010", "iter_0000012", "latest"]
