"""Valid layouts that once crashed in `stx train`, `stx plan` or its dry run (issue 41: a crash on a
valid layout is a bug, kept here once fixed). Each runs as a user ran it, through the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

STX = str(Path(sys.executable).with_name("stx"))


def test_the_default_bert_without_a_binary_head_trains_under_pipeline_parallelism(tmp_path: Path) -> None:
    """tiny-bert has no binary head, so its batches carry no nsp_labels; the pipeline's packed target
    read them anyway (KeyError: 'nsp_labels' in the last stage, found by a randomly drawn layout)."""
    argv = [STX, "launch", "-n", "2", "train", "tiny-bert", "parallel.pp=2"]
    argv += ["train.gradient_accumulation_steps=2", "train.train_iters=4", "train.eval_interval=2"]
    argv += ["logging.log_interval=2", "logging.tensorboard=false", f"logging.run_dir={tmp_path}"]
    argv += ["logging.run_name=pp2"]
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = (tmp_path / "pp2" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    train = [r for r in records if r["kind"] == "train"]
    valid = [r for r in records if r["kind"] == "valid"]
    assert [r["iteration"] for r in train] == [2, 4] and len(valid) == 2
    assert all(0 < r["loss"] < 20 for r in train + valid)  # an MLM loss alone: no binary term was added
    assert all("binary_loss" not in r for r in train + valid)
