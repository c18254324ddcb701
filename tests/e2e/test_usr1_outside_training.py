"""SIGUSR1 to `stx train` outside Trainer.fit (cli.EarlyStopRequest): one that comes while the run still
starts (a scheduler's --signal=USR1@... reaching a job that is importing torch or loading its
checkpoint) stops the run after
its first step, with the checkpoint and exit status 75; one that comes while the final checkpoint is
written (a second stop request) changes nothing. Before, SIGUSR1's default action killed the process
in both cases (measured: a second SIGUSR1 0.8 s after the first, during the final save, left exit
status -10 and no checkpoint; one during the imports ended the rank with exit status 138, which ended
a requeue chain)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ARGS = [
    "tiny-gpt",
    "model.num_layers=1",
    "model.hidden_size=32",
    "model.num_attention_heads=2",
    "model.seq_length=32",
    "train.micro_batch_size=2",
    "train.train_iters=10",
    "train.eval_interval=0",
    "train.eval_iters=1",
    "logging.log_interval=1",
    "logging.tensorboard=false",
    "checkpoint.save=ckpt",
]
# `stx train` as the CLI runs it, with SIGUSR1 sent to itself at one point outside training.
DRIVER = """
import os, signal, sys
import scalable_transformer.train.run as run_module
from scalable_transformer.cli import entry, main
from scalable_transformer.train.trainer import Callback

when, argv = sys.argv[1], sys.argv[2:]
original = run_module.run_training

class AfterFit(Callback):
    def on_fit_end(self, trainer, history):
        os.kill(os.getpid(), signal.SIGUSR1)

def with_signal(cfg, console=None, callbacks=(), predict=None):
    if when == "before":
        os.kill(os.getpid(), signal.SIGUSR1)  # before anything is built
        return original(cfg, console, callbacks, predict)
    return original(cfg, console, [*callbacks, AfterFit()], predict)

run_module.run_training = with_signal
if when == "importing":  # while `stx` imports the command's module (torch, the engine), before run_training
    import importlib
    import scalable_transformer.cli.parsers as parsers
    real_import = importlib.import_module

    def signalled_import(name, package=None):
        os.kill(os.getpid(), signal.SIGUSR1)
        return real_import(name, package)

    parsers.importlib = type("Importlib", (), {"import_module": staticmethod(signalled_import)})
entry(lambda: main(argv))
"""


def train(tmp_path: Path, when: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-c", DRIVER, when, "train", *ARGS, f"logging.run_dir={tmp_path}"]
    return subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("when", ["importing", "before"])
def test_sigusr1_before_training_stops_the_run_after_its_first_step(tmp_path, when):
    proc = train(tmp_path, when)
    assert proc.returncode == 75, proc.stderr[-3000:]
    assert "stopped by SIGUSR1 after iteration 1 of 10: checkpoint saved in ckpt" in proc.stdout
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "iter_0000001"


def test_sigusr1_after_training_changes_nothing(tmp_path):
    proc = train(tmp_path, "after")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "iter_0000010"
    (summary,) = tmp_path.glob("*/summary.json")
    assert json.loads(summary.read_text())["final_iteration"] == 10
