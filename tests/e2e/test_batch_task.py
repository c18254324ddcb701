"""One task of a `stx submit --requeue` job (launch/batch.py, `resumable_task`), run by real bash as
srun or mpiexec runs it: a scheduler signals every process of the task, the shell survives, the
command stops itself, and its 75 becomes 0 plus a note (so that srun's --kill-on-bad-exit does not take
the first rank to stop for a failure). Other exit statuses pass through."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from scalable_transformer.launch.batch import resumable_task

TIMEOUT = 60
# What `stx train` does on SIGUSR1 during training: finish, save, exit 75.
STOPS_ON_USR1 = """
import signal, sys, time
got = []
signal.signal(signal.SIGUSR1, lambda signum, frame: got.append(signum))
open(sys.argv[1], "w").close()
while not got:
    time.sleep(0.05)
sys.exit(75)
"""


def task(command: str, note: Path) -> subprocess.Popen:
    return subprocess.Popen(
        ["bash", "-c", resumable_task(command)],
        env={**os.environ, "STX_STOPPED": str(note)},
        start_new_session=True,  # its own process group, as a task is
    )


def test_a_task_stopped_by_a_signal_to_all_its_processes_reports_0_and_leaves_the_note(tmp_path):
    ready, note = tmp_path / "ready", tmp_path / "note"
    proc = task(shlex.join([sys.executable, "-c", STOPS_ON_USR1, str(ready)]), note)
    try:
        deadline = time.monotonic() + TIMEOUT
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGUSR1)  # as Slurm's --signal: the shell and the command
        assert proc.wait(timeout=TIMEOUT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert note.is_file()


def test_other_exit_statuses_pass_through_and_75_stays_without_a_note(tmp_path):
    note = tmp_path / "note"
    assert task("exit 3", note).wait(timeout=TIMEOUT) == 3
    assert task("true", note).wait(timeout=TIMEOUT) == 0
    assert not note.exists()
    assert task("exit 75", tmp_path / "missing" / "note").wait(timeout=TIMEOUT) == 75  # cannot note it
