"""Two freshly sampled small layouts on every run (issue 41): each validates, plans, dry-runs and
trains without a crash, so what passes is the engine on any valid layout, not on a list of them.

The seed is random and printed (pytest shows it with the failure); `STX_LAYOUT_SEED=N` draws the same
two layouts again. A failure names the layout and the command that failed, to paste as a reproducer.
The dry run's peak is not held to the measured one here: benchmarks/layout_oracles.py records how far
apart they are (benchmarks/results/layout_oracles-small.md) and they are not yet close on every layout.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from scalable_transformer.config.load import load_config
from scalable_transformer.config.validate import resolve
from scalable_transformer.plan.layout_sampler import SampledLayout, sample_layouts

pytestmark = pytest.mark.slow

STX = str(Path(sys.executable).with_name("stx"))
SEED = int(os.environ.get("STX_LAYOUT_SEED") or secrets.randbelow(2**31))
# short runs of the drawn layout: two steps, no evaluation, no files beyond the run directory
RUN = ["train.train_iters=2", "logging.log_interval=2", "train.eval_interval=0", "train.eval_iters=0"]
RUN += ["logging.tensorboard=false", "model.vocab_size=16384"]


def _stx(argv: list[str], layout: SampledLayout, cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run([STX, *argv], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (
        f"layout {layout.name} (STX_LAYOUT_SEED={SEED}): `stx {shlex.join(argv)}` exited "
        f"{proc.returncode}\n{proc.stdout[-1500:]}\n{proc.stderr[-3000:]}"
    )
    return proc


@pytest.mark.parametrize("index", [0, 1])
def test_a_sampled_small_layout_validates_plans_dry_runs_and_trains(index: int, tmp_path: Path) -> None:
    print(f"layout seed {SEED} (reproduce: STX_LAYOUT_SEED={SEED})")
    layout = sample_layouts("small", 1, SEED, start=index)[0]
    print(layout.text())
    cfg = resolve(load_config(layout.base, [*layout.overrides, *RUN]), layout.world_size)
    assert cfg.parallel.dp * cfg.parallel.cp * cfg.parallel.tp * cfg.parallel.pp == layout.world_size

    plan = _stx([*layout.plan_argv(RUN), "--no-probe", "--dry-run", "--json"], layout, tmp_path)
    row = json.loads(plan.stdout)["layouts"][0]
    assert row["peak_memory_bytes"] > 0
    dry = row["dry_run"]
    assert "error" not in dry, (
        f"layout {layout.name} (STX_LAYOUT_SEED={SEED}): dry run failed: {dry['error']}"
    )
    assert dry["world_size"] == layout.world_size and dry["peak_memory_bytes"] > 0

    _stx(
        [*layout.train_argv(RUN), f"logging.run_dir={tmp_path}", "logging.run_name=sampled"], layout, tmp_path
    )
    records = [json.loads(line) for line in (tmp_path / "sampled" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r["kind"] == "train"]
    assert losses and all(0 < loss < 30 for loss in losses), losses
