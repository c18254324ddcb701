"""benchmarks/step_vs_bare.py run as a user runs it, at toy sizes: it must produce a complete report.

Timings on a shared 2-core machine mean nothing at this size, so nothing here looks at them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "step_vs_bare.py"


@pytest.mark.slow
def test_step_vs_bare_writes_a_complete_report_for_both_models(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--model",
            "both",
            "--repeats",
            "1",
            "--steps-per-repeat",
            "2",
            "--warmup",
            "0",
            "--micro-batch-size",
            "2",
            "model.num_layers=1",
            "model.seq_length=32",
            "--output",
            str(tmp_path / "svb-{model}.md"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ.copy(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for model in ("bert", "gpt"):
        text = (tmp_path / f"svb-{model}.md").read_text()
        assert f"# step_vs_bare: {model}" in text
        assert "step_vs_bare.py" in text and "model.num_layers=1" in text  # the command line
        assert "| variant | what | median (ms) |" in text
        for row in ("| A | ours", "| B | bare", "| C | HF", "| A/B |", "| A/C |"):
            assert row in text, row
        assert "ours <= 1.02x bare" in text and "ours not slower than HF" in text
        # A and B start from the same weights on the same batch, so their first losses must agree.
        assert "loss agreement" in text and "PASS" in text.split("loss agreement", 1)[1].splitlines()[0]
        assert "## Resolved config" in text and "num_layers: 1" in text and "seq_length: 32" in text
        assert "## Environment" in text and '"torch_threads"' in text and '"cpu_model"' in text
        assert "FLOPs convention for MFU/HFU: `megatron`" in text and "measured CPU fp32 GEMM peak" in text
        assert f"{model}: A " in proc.stdout


@pytest.mark.slow
def test_zero_memory_measures_the_zero_formulas(tmp_path):
    """benchmarks/zero_memory.py at toy size: each rank's measured model states are the ZeRO formula's."""
    out = tmp_path / "zm.md"
    script = SCRIPT.with_name("zero_memory.py")
    args = ["--config", "tiny-gpt", "--dps", "2", "--stages", "1", "3", "--seq-length", "32"]
    proc = subprocess.run(
        [sys.executable, str(script), *args, "--output", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env=os.environ.copy(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[1:-1]]
        for line in out.read_text().splitlines()
        if line.startswith("| 1 | 2 |") or line.startswith("| 3 | 2 |")
    }
    assert set(rows) == {"1", "3"}, out.read_text()
    # ZeRO-3 shards everything evenly (FSDP2 pads dim 0, a few bytes): measured / formula is 1.000
    assert rows["3"][5] == "1.000", rows["3"]
    # ZeRO-1 (ZeroRedundancyOptimizer) gives each rank whole parameters' state, so the two ranks differ,
    # but between them they hold it once: on 2 ranks their mean is the formula's value
    low, _, high = rows["1"][5].partition("-")
    assert abs((float(low) + float(high or low)) / 2 - 1) < 0.005, rows["1"]
    assert "## Environment" in out.read_text() and "stx launch" in out.read_text()


@pytest.mark.slow
def test_stop_check_cost_writes_its_table(tmp_path):
    """benchmarks/stop_check_cost.py at toy size: a row per rank count, three variants, the environment."""
    out = tmp_path / "stop.md"
    script = SCRIPT.with_name("stop_check_cost.py")
    args = ["--ranks", "2", "--steps", "12", "--step-ms", "1", "--output", str(out)]
    proc = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ.copy(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| 2 |"))
    a, b, c = (float(x) for x in row.split("|")[2:5])
    assert a > 0 and b > 0 and c > 0
    assert "## Environment" in text and "stop_check_cost.py --ranks 2" in text


def test_cross_entropy_benchmark_reports_both_allocator_settings():
    """benchmarks/cross_entropy.py at toy size: a row per allocator setting with both timings."""
    script = SCRIPT.with_name("cross_entropy.py")
    args = ["--rows", "8", "--vocab", "64", "--repeats", "1", "--iters", "1", "--warmup", "0"]
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [
        line.split("|")[1:-1]
        for line in proc.stdout.splitlines()
        if line.startswith("| heap") or line.startswith("| fsdp")
    ]
    assert [r[0].strip() for r in rows] == ["heap", "fsdp"], proc.stdout
    assert all(float(cell) > 0 for r in rows for cell in r[1:]), proc.stdout
