"""`stx launch -n 2 calibrate` as a user runs it: two gloo ranks measure, rank 0 writes the profile;
a rank that fails brings the job down. Hard subprocess timeouts: a hang is a failure."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from scalable_transformer.plan.hardware_profile import COLLECTIVE_OPS, load_profile

STX = str(Path(sys.executable).with_name("stx"))
TIMEOUT = 180
TINY = ["model.num_layers=1", "model.hidden_size=64", "model.num_attention_heads=2", "model.seq_length=32",
        "train.micro_batch_size=2", "model.vocab_size=512"]  # fmt: skip


def run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        argv, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT, env=dict(os.environ)
    )


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_measure_collectives_and_rank0_writes_a_profile_that_loads(tmp_path):
    out = tmp_path / "profiles" / "p.yaml"
    proc = run(
        [STX, "launch", "-n", "2", "calibrate", "tiny-gpt", *TINY, "--quick", "--output", str(out)], tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("calibrate: 2 process(es) on 1 node(s), cpu, fp32, threads per process ")
    assert proc.stdout.count("calibrate: gemm: ") == 1  # rank 0 speaks, once
    assert any(line.startswith("calibrate: all sections in ") for line in lines)
    profile = load_profile(out)
    assert profile.kind == "cpu" and profile.fingerprint["processes"] == 2
    assert {c.op for c in profile.collectives} == set(COLLECTIVE_OPS)
    assert {(c.scope, c.ranks) for c in profile.collectives} == {("intra_node", 2)}
    assert all(c.time_us > 0 and c.busbw_gbps > 0 for c in profile.collectives)
    assert profile.gemm and profile.attention
    # the model's own layer against its kernels' sum, every rank at once (the head too, budget allowing)
    assert "calibrate: model_layer: the model's own layer " in proc.stdout
    assert profile.layer_factors["layer"] > 0
    # the FSDP unit point: 4 units gathered in forward, again in backward, reduce-scattered
    assert "calibrate: fsdp_unit: 4 units of " in proc.stdout and " 12 collectives, " in proc.stdout
    assert profile.memory_bound.unit_overhead_us >= 0
    assert "ms per unit collective beyond its bytes" in proc.stdout
    # the tensor-parallel layer point, without and with sequence parallelism
    assert "calibrate: tp_layer: per layer beyond its local GEMMs: 2 ranks tp " in proc.stdout
    assert "calibrate: tp_layer: 2 ranks: " in proc.stdout
    assert "micro-batch beyond its GEMMs and collectives" in proc.stdout
    assert profile.memory_bound.tp_layer_overhead_us >= 0
    # the group sizes a node holds: 2 processes, one size, the memory_bound figure's own
    assert [p.ranks for p in profile.tp_layers] == [2]
    assert profile.tp_layers[0].tp_layer_overhead_us == profile.memory_bound.tp_layer_overhead_us
    assert not list(out.parent.glob(".*.tmp"))


# rank 1 fails in the middle of the measurements (its attention section raises); rank 0 runs on
RANK_FAILS = """
import os, sys
from scalable_transformer.cli import entry, main
from scalable_transformer.calibrate import calibration

def broken(*args, **kwargs):
    raise RuntimeError("injected failure in rank 1's attention section")

if os.environ["RANK"] == "1":
    calibration.measure_attention = broken
entry(lambda: main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.distributed
def test_a_rank_failing_mid_run_brings_the_calibration_down_with_a_nonzero_exit(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_FAILS)
    out = tmp_path / "p.yaml"
    launcher = (
        "import sys\nfrom scalable_transformer.launch.local import LaunchOptions, launch\n"
        "sys.exit(launch(LaunchOptions(nproc_per_node=2), [sys.executable, '-u', *sys.argv[1:]]))"
    )
    argv = [sys.executable, "-c", launcher, str(script), "calibrate", "tiny-gpt", *TINY, "--quick"]
    proc = run([*argv, "--output", str(out)], tmp_path)
    assert proc.returncode != 0
    assert "rank 1 failed with exit code 1" in proc.stderr, proc.stderr[-3000:]
    assert "injected failure in rank 1's attention section" in proc.stderr
    assert "calibrate: gemm: " in proc.stdout  # it failed in the middle, not before starting
    assert not out.exists()
