"""`stx plan --calibrate-from`: the op-class corrections refitted from stored runs (plan/refit.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scalable_transformer.plan.refit import (
    BOUNDS,
    CLASSES,
    MIN_RUNS,
    RunSample,
    corrected_step,
    equations,
    median_error,
    refit_corrections,
)


def sample(scale: float, truth: dict[str, float], used: dict[str, float] | None = None) -> RunSample:
    """A run whose prediction (made with `used` corrections) splits its phases over the op classes in
    shape-dependent proportions, measured as if the true multipliers were `truth`."""
    used = used or dict.fromkeys(CLASSES, 1.0)
    att = scale**1.5
    raw = {
        "forward": {"gemm": 0.3 * scale, "attention": 0.05 * att, "memory_bound": 0.1, "overhead": 0.02},
        "backward": {"gemm": 0.6 * scale, "attention": 0.1 * att, "memory_bound": 0.2, "overhead": 0.03},
        "optimizer": {"memory_bound": 0.05 * scale, "overhead": 0.01},
    }
    classes = {ph: {c: s * used[c] for c, s in by.items()} for ph, by in raw.items()}
    timers = {"forward": "forward-compute", "backward": "backward-compute", "optimizer": "optimizer"}
    phases_ms = {timers[ph]: 1000 * sum(s * truth[c] for c, s in by.items()) for ph, by in raw.items()}
    prediction = {
        "step_seconds": sum(sum(by.values()) for by in classes.values()),
        "classes": classes,
        "corrections": used,
        "kind": "cpu",
    }
    return RunSample(prediction, phases_ms, sum(phases_ms.values()) / 1000)


TRUTH = {"gemm": 1.8, "attention": 0.7, "memory_bound": 2.5, "overhead": 1.2, "communication": 1.0}


def test_the_refit_recovers_the_multipliers_the_runs_were_measured_with() -> None:
    runs = [sample(s, TRUTH) for s in (0.5, 1.0, 2.0, 4.0, 8.0)]
    new, notes = refit_corrections(runs, dict.fromkeys(CLASSES, 1.0))
    for c in ("gemm", "attention", "memory_bound", "overhead"):
        assert new[c] == pytest.approx(TRUTH[c], rel=1e-3), c
    # no run has communication: it is not fitted and keeps its multiplier, with a note saying so
    assert new["communication"] == 1.0 and any(n.startswith("communication: kept") for n in notes)
    assert median_error(runs) > 0.4 and median_error(runs, new) == pytest.approx(0.0, abs=1e-3)


def test_predictions_made_with_other_corrections_are_undone_first() -> None:
    used = {"gemm": 2.0, "attention": 1.0, "memory_bound": 0.5, "overhead": 1.0, "communication": 1.0}
    runs = [sample(s, TRUTH, used) for s in (0.5, 1.0, 2.0, 4.0)]
    new, _ = refit_corrections(runs, used)
    assert new["gemm"] == pytest.approx(1.8, rel=1e-3) and new["memory_bound"] == pytest.approx(2.5, rel=1e-3)
    assert corrected_step(runs[0].prediction, new) == pytest.approx(runs[0].step_seconds, rel=1e-3)


def test_multipliers_stay_within_their_bounds_and_need_enough_runs() -> None:
    far = dict(TRUTH, gemm=20.0)  # 20x slower GEMMs than the profile says: clamped at the upper bound
    runs = [sample(s, far) for s in (0.5, 1.0, 2.0, 4.0)]
    new, notes = refit_corrections(runs, dict.fromkeys(CLASSES, 1.0))
    assert new["gemm"] == BOUNDS[1] and any("gemm" in n and "bound" in n for n in notes)
    assert all(BOUNDS[0] <= v <= BOUNDS[1] for v in new.values())
    with pytest.raises(ValueError, match=f"at least {MIN_RUNS} runs"):
        refit_corrections(runs[: MIN_RUNS - 1], dict.fromkeys(CLASSES, 1.0))


def test_tensor_parallel_runs_match_forward_and_backward_together() -> None:
    run = sample(1.0, TRUTH)
    run.prediction["classes"]["tp_communication"] = {"communication": 0.1}
    phases = dict(run.phases_ms, **{"forward-compute": 500.0, "backward-compute": 900.0})
    eqs = equations(run.prediction, phases)
    # one equation for the compute timers (forward + backward + tp collectives), one for the optimizer
    assert len(eqs) == 2
    compute, measured = eqs[0]
    assert measured == pytest.approx(1.4)
    assert compute[CLASSES.index("communication")] == pytest.approx(0.1)


PROFILE = {
    "format": 1,
    "name": "refit test machine",
    "kind": "cpu",
    "source": "written by the test",
    "fingerprint": {"device_name": "Test CPU", "processes": 1, "threads_per_process": 1},
    "peak_tflops": {"fp32": 0.1},
    "device_memory_gb": 8.0,
    "host_link_gbps": 10.0,
    "gemm": [{"dtype": "fp32", "m": 64, "n": 64, "k": 64, "tflops": 0.02}],
    "attention": [
        {"kernel": "math", "dtype": "fp32", "batch": 4, "heads": 4, "seq_len": 128, "head_dim": 64,
         "causal": True, "pass": "fwd", "tflops": 0.01},
    ],
    "memory_bound": {"bandwidth_gbps": 12.0, "op_overhead_us": 9.0},
    "collectives": [],
}  # fmt: skip


def test_stx_plan_calibrate_from_writes_a_profile_that_hardware_takes(tmp_path: Path, capsys) -> None:
    import yaml

    from scalable_transformer.bench.results import ResultsStore
    from scalable_transformer.cli import main
    from scalable_transformer.plan.hardware_profile import load_profile

    profile_path = tmp_path / "cpu.yaml"
    profile_path.write_text(yaml.safe_dump(PROFILE))
    store_path = tmp_path / "r.sqlite"
    with ResultsStore(store_path) as store:
        for i, s in enumerate((0.5, 1.0, 2.0, 4.0)):
            run = sample(s, TRUTH)
            store.put(
                {
                    "config_hash": f"h{i}",
                    "status": "ok",
                    "label": f"run {i}",
                    "nproc": 1,
                    "prediction_json": json.dumps(dict(run.prediction, profile=PROFILE["name"])),
                    "measured_step_seconds": run.step_seconds,
                    "summary_json": json.dumps({"phase_time_ms_median": run.phases_ms}),
                }
            )
    out = tmp_path / "refit.yaml"
    argv = ["plan", "tiny-gpt", "--hardware", str(profile_path), "--world-size", "1", "--no-probe"]
    assert main([*argv, "--calibrate-from", str(store_path), "--output", str(out)]) == 0
    text = capsys.readouterr().out
    assert "refit from 4 run(s)" in text and "gemm 1 -> 1.8" in text
    assert "corrections in use: gemm 1.8, attention 0.7, memory_bound 2.5, overhead 1.2" in text
    refit = load_profile(out)
    assert refit.corrections["gemm"] == pytest.approx(1.8, rel=1e-3)
    assert refit.corrections_source["runs"] == 4
    assert main([*argv[:3], str(out), *argv[4:]]) == 0  # --hardware takes the refitted profile
    assert "corrections in use: gemm 1.8" in capsys.readouterr().out
    # too few runs: an error naming the store and the minimum
    with ResultsStore(store_path) as store:
        store.conn.execute("DELETE FROM results WHERE config_hash IN ('h0', 'h1')")
        store.conn.commit()
    assert main([*argv, "--calibrate-from", str(store_path)]) != 0
    assert f"2 usable run(s) for the profile 'refit test machine', a refit needs at least {MIN_RUNS}" in (
        capsys.readouterr().err
    )


FIXTURES = Path(__file__).parent.parent / "fixtures" / "refit"


def fixture_store(name: str, path: Path) -> list[RunSample]:
    """A results store of the runs in tests/fixtures/refit/NAME.json (a sweep on this CPU, written by
    benchmarks/refit_fixture.py), and the same runs as refit samples."""
    from scalable_transformer.bench.results import ResultsStore

    runs = json.loads((FIXTURES / f"{name}.json").read_text())["runs"]
    with ResultsStore(path) as store:
        for i, run in enumerate(runs):
            store.put(
                {
                    "config_hash": f"{name}{i}",
                    "status": "ok",
                    "label": run["label"],
                    "nproc": run["nproc"],
                    "prediction_json": json.dumps(run["prediction"]),
                    "measured_step_seconds": run["measured_step_seconds"],
                    "iteration_seconds_iqr": run["iteration_seconds_iqr"],
                    "summary_json": json.dumps({"phase_time_ms_median": run["phase_time_ms_median"]}),
                }
            )
    return [RunSample(r["prediction"], r["phase_time_ms_median"], r["measured_step_seconds"]) for r in runs]


@pytest.mark.parametrize("fit, judged", [("fit", "heldout"), ("heldout", "fit")])
def test_calibrate_from_this_cpus_sweep_lowers_the_error_on_the_next_sweep(
    tmp_path: Path, fit: str, judged: str
) -> None:
    """Fitted on one sweep of tiny GPTs on this CPU, judged on the other sweep's shapes (and the other
    way round); figures when written: 60.2% -> 54.8% and 41.5% -> 37.9% median |error|."""
    from scalable_transformer.bench.refit_store import samples_from_store

    fit_store = tmp_path / "fit.sqlite"
    fixture_store(fit, fit_store)
    heldout = fixture_store(judged, tmp_path / "judged.sqlite")
    samples, _ = samples_from_store(fit_store, "no such profile", "cpu")
    assert len(samples) >= MIN_RUNS
    new, _ = refit_corrections(samples, dict.fromkeys(CLASSES, 1.0))
    before, after = median_error(heldout), median_error(heldout, new)
    assert after < before - 0.02


def test_runs_predict_with_the_profile_the_environment_names(tmp_path: Path, monkeypatch) -> None:
    """$STX_HARDWARE_PROFILE: the runs' predictions name the profile --calibrate-from refits; a bad
    file is reported in the summary, not raised."""
    import yaml

    from scalable_transformer.calibrate.this_machine import run_prediction
    from scalable_transformer.config.load import load_config
    from scalable_transformer.config.validate import resolve
    from scalable_transformer.plan.refit import PROFILE_ENV

    path = tmp_path / "cpu.yaml"
    path.write_text(yaml.safe_dump(PROFILE))
    cfg = resolve(load_config("tiny-gpt", ["model.num_layers=1"]), world_size=1)
    monkeypatch.setenv(PROFILE_ENV, str(path))
    from scalable_transformer.errors import StxWarning

    with pytest.warns(StxWarning, match="measured on other hardware"):  # 'Test CPU' is not this one
        prediction = run_prediction(cfg, 1, "cpu")["prediction"]
    assert prediction["profile"] == PROFILE["name"] and prediction["step_seconds"] > 0
    assert set(prediction["classes"]) >= {"forward", "backward", "optimizer"}
    assert prediction["corrections"] == dict.fromkeys(CLASSES, 1.0)
    monkeypatch.setenv(PROFILE_ENV, str(tmp_path / "missing.yaml"))
    out = run_prediction(cfg, 1, "cpu")
    assert set(out) == {"prediction_error"} and "missing.yaml" in out["prediction_error"]


def test_a_cpu_run_predicts_from_cached_rates_only(tmp_path: Path, monkeypatch) -> None:
    """Without a profile, a CPU run's prediction uses only rates earlier plans cached: on an empty
    cache it says how to get them and measures nothing (the cache stays empty)."""
    from scalable_transformer.calibrate.this_machine import run_prediction
    from scalable_transformer.config.load import load_config
    from scalable_transformer.config.validate import resolve
    from scalable_transformer.metrics import cpu_rates
    from scalable_transformer.plan.refit import PROFILE_ENV

    monkeypatch.delenv(PROFILE_ENV, raising=False)
    monkeypatch.setenv("STX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_rates, "_MEASURED", {})
    cfg = resolve(load_config("tiny-gpt", ["model.num_layers=1"]), world_size=1)
    out = run_prediction(cfg, 1, "cpu")
    assert set(out) == {"prediction_error"}
    assert "not measured yet" in out["prediction_error"] and "stx plan" in out["prediction_error"]
    assert not list((tmp_path / "cache").glob("*.json"))


def test_a_refit_predicts_each_run_again_on_the_profile_it_refits(tmp_path: Path) -> None:
    """The corrections multiply the class seconds of the profile they go into: a run's stored
    prediction came from the profile as it was (here 9 us per op), so against a profile that has
    since changed (27 us) the run is predicted again from its stored config. Stored predictions
    stand only where no config is stored."""
    import copy

    from scalable_transformer.bench.refit_store import samples_from_store
    from scalable_transformer.bench.results import ResultsStore
    from scalable_transformer.config.load import load_config, to_yaml
    from scalable_transformer.config.validate import resolve
    from scalable_transformer.plan.cluster import profile_cluster
    from scalable_transformer.plan.hardware_profile import profile_from_dict
    from scalable_transformer.plan.refit import prediction_record

    slower = copy.deepcopy(PROFILE)
    slower["memory_bound"]["op_overhead_us"] = 27.0
    then, now = (profile_cluster(profile_from_dict(p)) for p in (PROFILE, slower))
    cfg = load_config("tiny-gpt", ["model.num_layers=1", "train.micro_batch_size=2"])
    stored = prediction_record(resolve(cfg, 1), then)
    path = tmp_path / "r.sqlite"
    with ResultsStore(path) as store:
        for i, config_yaml in enumerate((to_yaml(cfg), None)):
            store.put(
                {
                    "config_hash": f"h{i}",
                    "status": "ok",
                    "label": f"run {i}",
                    "nproc": 1,
                    "config_yaml": config_yaml,
                    "prediction_json": json.dumps(stored),
                    "measured_step_seconds": 2 * stored["step_seconds"],
                    "summary_json": json.dumps({"phase_time_ms_median": {"forward-compute": 1.0}}),
                }
            )
    (again, kept), notes = samples_from_store(path, PROFILE["name"], "cpu", now)
    assert again.prediction == prediction_record(resolve(cfg, 1), now)
    assert again.prediction["step_seconds"] > stored["step_seconds"]  # three times the op cost
    assert kept.prediction == stored and notes == [
        "1 run(s) keep their stored prediction: their config could not be predicted again"
    ]
    plain, _ = samples_from_store(path, PROFILE["name"], "cpu")
    assert [s.prediction for s in plain] == [stored, stored]
