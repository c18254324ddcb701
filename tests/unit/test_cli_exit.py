"""How an `stx` process ends: a process that started a process group keeps its exit status, output
and atexit callbacks but skips the interpreter's teardown (where torch's leftover gloo threads
aborted finished ranks); any other command exits as Python does."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

CHILD = textwrap.dedent(
    """
    import atexit, sys, threading, time
    from pathlib import Path
    from scalable_transformer.cli import entry

    out = Path(sys.argv[1])
    start_group, outcome = sys.argv[2] == "group", sys.argv[3]

    class Teardown:  # its __del__ runs only in the interpreter's module teardown
        def __del__(self):
            (out / "teardown").write_text("ran")

    keep = Teardown()

    def late_writer():
        time.sleep(0.2)
        (out / "thread").write_text("joined")

    def run():
        if start_group:
            import torch
            from scalable_transformer.parallel.distributed import init_distributed, shutdown_distributed

            created = init_distributed(torch.device("cpu"), 1.0, needed=True)
            shutdown_distributed(created)
        atexit.register(lambda: (out / "atexit").write_text("ran"))
        threading.Thread(target=late_writer).start()
        sys.stdout.write("buffered output")  # no newline, no flush: a pipe's buffer at exit
        if outcome == "raise":
            raise RuntimeError("boom from the command")
        if outcome == "usage":
            sys.exit(2)
        return 3

    entry(run)
    """
)


def run_child(tmp_path: Path, group: str, outcome: str) -> subprocess.CompletedProcess:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    return subprocess.run(
        [sys.executable, str(script), str(tmp_path), group, outcome],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("group", ["group", "none"])
def test_exit_status_output_threads_and_atexit_survive(tmp_path: Path, group: str) -> None:
    proc = run_child(tmp_path, group, "return")
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "buffered output"
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "thread").read_text() == "joined"
    # With a process group the native teardown is skipped; without one, Python tears down as usual.
    assert (tmp_path / "teardown").exists() == (group == "none")


@pytest.mark.slow
@pytest.mark.parametrize("group", ["group", "none"])
def test_an_uncaught_error_and_a_usage_exit_keep_their_status(tmp_path: Path, group: str) -> None:
    proc = run_child(tmp_path, group, "raise")
    assert proc.returncode == 1
    assert "RuntimeError: boom from the command" in proc.stderr
    assert (tmp_path / "atexit").exists()
    assert run_child(tmp_path, group, "usage").returncode == 2
