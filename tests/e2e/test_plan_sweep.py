"""The loop closed (issue 13): a 2-process sweep of tiny GPTs records `stx plan`'s prediction next to
each member's measured live tensor bytes and throughput, and `stx report` shows them with the error."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from scalable_transformer.bench.report import parse_markdown_table

STX = str(Path(sys.executable).with_name("stx"))

SWEEP = textwrap.dedent(
    """\
    base: tiny-gpt
    overrides: [model.num_layers=4, model.hidden_size=256, model.num_attention_heads=4, model.seq_length=128,
      model.vocab_size=16384, train.micro_batch_size=4, train.eval_interval=0, train.eval_iters=1,
      logging.tensorboard=false, logging.track_tensor_bytes=true]
    members:
      - {nproc: 2, parallel.zero_stage: 0}
      - {nproc: 2, parallel.zero_stage: 3}
    steps: 4
    warmup_steps: 3
    timeout_seconds: 400
    """
)


@pytest.mark.slow
def test_sweep_records_the_plan_and_report_compares(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(SWEEP)
    run = subprocess.run(
        [STX, "sweep", str(sweep)], capture_output=True, text=True, timeout=1200, cwd=tmp_path
    )
    assert run.returncode == 0, run.stderr[-3000:]
    conn = sqlite3.connect(tmp_path / "results.sqlite")
    conn.row_factory = sqlite3.Row
    rows = [dict(r) for r in conn.execute("SELECT * FROM results")]
    conn.close()
    assert len(rows) == 2 and all(r["status"] == "ok" for r in rows)
    for r in rows:
        assert r["predicted_peak_memory_bytes"] > 0 and r["predicted_samples_per_second"] > 0
        assert r["peak_tensor_bytes_max"] > 0 and r["plan_json"]
        # the target, met on every layout of benchmarks/plan_accuracy.py (this model is its
        # GPT). Not yet on models whose activations are small next to their states (2 layers, seq 64,
        # micro-batch 2: ZeRO-3 39% under): docs/PLANNER.md, "What is not modelled".
        assert abs(r["predicted_peak_memory_bytes"] / r["peak_tensor_bytes_max"] - 1) < 0.10, r["label"]
        # the dry run of the member's layout (the engine on fake tensors), stored beside both
        assert abs(r["dry_run_peak_memory_bytes"] / r["peak_tensor_bytes_max"] - 1) < 0.05, r["label"]

    report = subprocess.run([STX, "report", str(tmp_path / "results.sqlite")], capture_output=True, text=True)
    assert report.returncode == 0, report.stderr
    section = report.stdout.split("# Planned vs measured (stx plan)", 1)[1]
    table = parse_markdown_table(section)
    header, body = table[0], table[1:]
    assert header[:7] == [
        "layout",
        "devices",
        "predicted GiB/dev",
        "dry-run GiB/dev",
        "measured GiB/dev (tensors)",
        "memory error",
        "dry-run error",
    ]
    assert len(body) == 2
    for line in body:
        assert line[5].endswith("%") and line[6].endswith("%") and line[9].endswith("%")
