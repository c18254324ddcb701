"""`stx train` stopped by SIGTERM (a scheduler's time limit, `kill`) says so and exits non-zero
(issue 11: it used to die without a word). During training the step in progress finishes first
(issue 25); with nothing to save the status is 128 + SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys


def test_sigterm_is_reported_and_exits_non_zero(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "scalable_transformer.cli",
            "train",
            "tiny-gpt",
            "train.train_iters=100000",
            "train.eval_interval=0",
            "logging.log_interval=1",
            f"logging.run_dir={tmp_path}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # wait until training runs (no sleeps: the run says when)
            if line.lstrip().startswith("iteration "):
                break
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM after iteration" in out
    assert "nothing saved (checkpoint.save is not set)" in out
    assert "Traceback" not in err
