"""`stx plan --device cpu` measures the step time of one layout with depth probes (plan/probe.py): two
short runs of the engine at 1 and 3 layers, extrapolated to the config's 4, cached for the next plan."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from scalable_transformer.calibrate.this_machine import cpu_cluster
from scalable_transformer.config.load import load_config
from scalable_transformer.plan import probe as probe_mod
from scalable_transformer.plan.search import plan_config

STX = str(Path(sys.executable).with_name("stx"))
CONFIG = ["tiny-gpt", "model.num_layers=4", "model.seq_length=64", "train.micro_batch_size=2"]


@pytest.mark.slow
def test_stx_plan_probes_a_cpu_layout_and_caches_it(monkeypatch: pytest.MonkeyPatch) -> None:
    run = subprocess.run(
        [STX, "plan", *CONFIG, "--world-size", "2", "--device", "cpu", "--remeasure", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    (layout,) = json.loads(run.stdout)["layouts"]
    assert layout["time_method"].startswith("measured: the engine at 1 and 3 layer(s) on 2 process(es)")
    parts = layout["time_breakdown_seconds"]
    assert parts["compute"] > 0 and parts["optimizer"] > 0
    assert layout["step_seconds"] == pytest.approx(sum(v for k, v in parts.items() if k != "dp_overlapped"))
    assert layout["samples_per_second"] == pytest.approx(2 * 2 / layout["step_seconds"])

    # the next plan of the same config reads the probes from the cache: no run (one would fail here)
    def no_run(*args, **kwargs):
        raise AssertionError("the probe ran again instead of reading the cache")

    monkeypatch.setattr(probe_mod, "run_probe", no_run)
    cfg = load_config(CONFIG[0], CONFIG[1:])
    again = plan_config(cfg, cpu_cluster(2, cfg.train.precision), probe=True)
    assert again.time.total == pytest.approx(layout["step_seconds"])
    # a different config is not served from it
    other = load_config(CONFIG[0], [*CONFIG[1:], "train.micro_batch_size=1"])
    with pytest.raises(AssertionError, match="ran again"):
        plan_config(other, cpu_cluster(2, other.train.precision), probe=True)
