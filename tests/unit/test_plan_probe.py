"""The CPU depth probe's arithmetic (plan/probe.py): which depths it runs, how it reads a run's phase
timers, how it extrapolates them, and that a failed probe leaves the rate model's figure with the
reason. The probe runs themselves: tests/e2e/test_plan_probe_e2e.py."""

from __future__ import annotations

import pytest

from scalable_transformer.calibrate.this_machine import cpu_cluster
from scalable_transformer.config.load import load_config
from scalable_transformer.plan import probe as probe_mod
from scalable_transformer.plan.probe import DepthProbe, ProbeError, extrapolate, probe_depths, probe_overrides
from scalable_transformer.plan.search import RATE_MODEL, plan_config, prepare


def _cfg(*overrides: str, world: int = 1):
    return prepare(load_config("tiny-gpt", list(overrides)), world)


@pytest.mark.parametrize(
    ("overrides", "world", "layers", "per_chunk"),
    [
        (["model.num_layers=12"], 1, [1, 4], 12),
        (["model.num_layers=4"], 1, [1, 3], 4),
        (["model.num_layers=12", "parallel.pp=2", "train.gradient_accumulation_steps=4"], 2, [2, 8], 6),
        (
            [
                "model.num_layers=12",
                "parallel.pp=2",
                "parallel.pipeline_schedule=interleaved-1f1b",
                "parallel.virtual_pipeline_stages=2",
                "train.gradient_accumulation_steps=4",
            ],
            2,
            [4, 8],
            3,
        ),
        # two layers per chunk or fewer: the config's own depth is the probe
        (["model.num_layers=4", "parallel.pp=2", "train.gradient_accumulation_steps=4"], 2, [4], 2),
    ],
)
def test_probe_depths_keep_whole_chunks_and_stay_shallower(
    overrides: list[str], world: int, layers: list[int], per_chunk: int
) -> None:
    cfg = _cfg(*overrides, world=world)
    assert probe_depths(cfg) == (layers, per_chunk)
    chunks = cfg.parallel.pp * cfg.parallel.virtual_pipeline_stages
    assert all(n % chunks == 0 for n in layers)


def _probe(layers: int, step: float, **phases: float) -> DepthProbe:
    return DepthProbe(layers, step, phases, None, "stx launch ...")


def test_extrapolate_is_linear_in_layers_per_chunk_and_its_parts_sum_to_the_step() -> None:
    # compute 0.10 + 0.05 per layer, optimizer 0.02 + 0.01 per layer, 0.03 s untimed per step
    a = _probe(1, 0.10 + 0.05 + 0.02 + 0.01 + 0.03, compute=0.15, optimizer=0.03)
    b = _probe(4, 0.10 + 0.20 + 0.02 + 0.04 + 0.03, compute=0.30, optimizer=0.06)
    out = extrapolate([a, b], chunks=1, per_chunk=12)
    assert out["compute"] == pytest.approx(0.10 + 0.05 * 12)
    assert out["optimizer"] == pytest.approx(0.02 + 0.01 * 12)
    assert out["other"] == pytest.approx(0.03)
    assert sum(out.values()) == pytest.approx(0.70 + 0.14 + 0.03)


def test_extrapolate_counts_layers_per_chunk_and_never_lets_depth_speed_a_step_up() -> None:
    # pp 2: probes at 2 and 8 layers = 1 and 4 per chunk; a phase measured lower at depth (noise)
    a = _probe(2, 0.5, compute=0.3, pipeline_wait=0.2)
    b = _probe(8, 0.9, compute=0.6, pipeline_wait=0.15)
    out = extrapolate([a, b], chunks=2, per_chunk=6)
    assert out["compute"] == pytest.approx(0.3 + 0.1 * 5)
    assert out["pipeline_wait"] == pytest.approx(0.2)  # slope clamped at 0, not extrapolated down
    assert out["other"] == pytest.approx(0.5 + 0.4 / 3 * 5 - 0.8 - 0.2)


def test_parts_that_add_up_to_more_than_the_median_step_are_scaled_to_it() -> None:
    a = _probe(1, 0.30, compute=0.30, optimizer=0.06)
    b = _probe(3, 0.50, compute=0.50, optimizer=0.10)
    out = extrapolate([a, b], chunks=1, per_chunk=5)
    assert sum(out.values()) == pytest.approx(0.70)  # the step's line, not the parts'
    assert out["compute"] / out["optimizer"] == pytest.approx(0.70 / 0.14)
    assert "other" not in out


def test_one_probe_is_taken_as_it_is() -> None:
    only = _probe(4, 0.5, compute=0.4, optimizer=0.05)
    assert extrapolate([only], chunks=2, per_chunk=2) == pytest.approx(
        {"compute": 0.4, "optimizer": 0.05, "other": 0.05}
    )


def test_phases_from_a_summary_split_the_pipeline_wait_out_of_forward_backward() -> None:
    summary = {
        "phase_time_ms_median": {
            "forward-backward": 900.0,
            "pipeline-p2p-wait": 300.0,
            "embedding-grads-all-reduce": 20.0,
            "optimizer": 60.0,
            "optimizer-inner-step": 50.0,  # inside "optimizer": not counted twice
            "zero-grad": 2.0,
        }
    }
    assert probe_mod._phases(summary) == pytest.approx(
        {"compute": 0.6, "pipeline_wait": 0.3, "dp_communication": 0.02, "optimizer": 0.06, "other": 0.002}
    )


def test_probe_overrides_are_keys_the_config_accepts(tmp_path) -> None:
    cfg = load_config(
        "tiny-bert",
        ["checkpoint.save=/somewhere", "train.eval_iters=5", *probe_overrides(3, 10, 3, tmp_path)],
    )
    assert cfg.model.num_layers == 3 and cfg.train.train_iters == 10 and cfg.logging.warmup_iters == 3
    assert cfg.checkpoint.save is None and cfg.train.eval_iters == 0 and cfg.logging.run_dir == str(tmp_path)
    assert cfg.train.device == "cpu"


def test_a_failed_probe_leaves_the_rate_model_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args, **kwargs):
        raise ProbeError("probe at 1 layers exited 1: out of memory")

    monkeypatch.setattr(probe_mod, "run_probe", fail)
    cfg = load_config("tiny-gpt", ["model.num_layers=12"])
    cluster = cpu_cluster(1, cfg.train.precision)
    rate = plan_config(cfg, cluster)
    probed = plan_config(cfg, cluster, probe=True, remeasure=True)
    assert rate.time_method == RATE_MODEL
    assert probed.time.total == pytest.approx(rate.time.total)
    assert probed.time_method.startswith(RATE_MODEL) and "out of memory" in probed.time_method
    assert probed.to_dict()["time_method"] == probed.time_method


def test_probe_step_time_runs_the_depths_then_serves_them_from_the_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    monkeypatch.setenv("STX_CACHE_DIR", str(tmp_path))
    ran: list[int] = []

    def fake_run(cfg, world_size, num_layers, **kwargs):
        ran.append(num_layers)
        return _probe(num_layers, 0.2 + 0.1 * num_layers, compute=0.1 + 0.1 * num_layers, optimizer=0.05)

    monkeypatch.setattr(probe_mod, "run_probe", fake_run)
    deep = _cfg("model.num_layers=12")
    first = probe_mod.probe_step_time(deep, 1)
    assert ran == [1, 4] and first.total == pytest.approx(0.2 + 0.1 * 12)
    assert (
        first.method == "measured: the engine at 1 and 4 layer(s) on 1 process(es), extrapolated to 12 layers"
    )
    again = probe_mod.probe_step_time(deep, 1)
    assert ran == [1, 4] and again.breakdown == pytest.approx(first.breakdown)  # from the cache
    probe_mod.probe_step_time(deep, 1, remeasure=True)
    assert ran == [1, 4, 1, 4]
    probe_mod.probe_step_time(deep, 2)  # another process count is another measurement
    assert ran[-2:] == [1, 4]
    shallow = probe_mod.probe_step_time(_cfg("model.num_layers=2"), 1)
    assert (
        ran[-1] == 2
        and shallow.method == "measured: the engine at the config's own 2 layer(s) on 1 process(es)"
    )
