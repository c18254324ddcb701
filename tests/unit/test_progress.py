"""The live progress display: a rich bar in a terminal (training: iterations, ETA, loss, samples/s;
sweeps: members done/total, ETA), only the plain log lines otherwise."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
from rich.console import Console

from scalable_transformer.bench.sweep_present import SweepConsole
from scalable_transformer.config.load import load_config


def _run(tmp_path, terminal: bool) -> str:
    from scalable_transformer.train.run import run_training

    out = io.StringIO()
    console = Console(file=out, force_terminal=terminal, width=200, highlight=False, soft_wrap=True)
    overrides = [
        "train.train_iters=4",
        "logging.log_interval=2",
        "train.eval_interval=0",
        "train.eval_iters=1",
        "model.num_layers=1",
        "model.hidden_size=32",
        "model.num_attention_heads=2",
        "model.seq_length=16",
        "train.micro_batch_size=2",
        f"logging.run_dir={tmp_path}",
        "logging.tensorboard=false",
        "logging.telemetry=false",
    ]
    run_training(load_config("tiny-gpt", overrides), console)
    return out.getvalue()


@pytest.mark.slow
def test_training_bar_in_a_terminal_plain_lines_otherwise(tmp_path):
    live = _run(tmp_path / "tty", terminal=True)
    assert "training" in live and "iterations" in live and "ETA" in live
    assert "samples/s" in live and "loss " in live
    plain = _run(tmp_path / "file", terminal=False)
    assert "ETA" not in plain and "\x1b[" not in plain
    assert "iteration      4/     4" in plain  # the log lines are the progress


def _member(label: str) -> SimpleNamespace:
    return SimpleNamespace(label=label, nproc=2, repeat=0)


@pytest.mark.parametrize("terminal", [True, False])
def test_sweep_bar_counts_members(terminal):
    out = io.StringIO()
    present = SweepConsole(
        Console(file=out, force_terminal=terminal, width=200, markup=False, highlight=False)
    )
    present.to_run(2, 0)
    for i, label in enumerate(("zero0", "zero3")):
        present.starting(i, 2, _member(label), 1.0, 5.0 if i else None)  # type: ignore[arg-type]
        present.finished(
            {"status": "ok", "wall_seconds": 1.0, "samples_per_second": 3.0, "overhead_seconds": 0.5}
        )
    present.summary(2, 2.0, {"ok": 2}, "store.sqlite")  # type: ignore[arg-type]
    text = out.getvalue()
    assert "[1/2 done] running zero3" in text  # the plain lines, always
    assert ("members" in text and "ETA" in text and "running zero3" in text) == terminal
    assert present.progress is None  # stopped at the end
