"""`stx report`'s prediction error and suspect flags (bench/prediction_error.py) on a constructed store,
the store's schema migration, --retry-suspect's member selection, and the prediction a run stores."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
from pathlib import Path

import pytest

from scalable_transformer.bench.prediction_error import (
    SuspectOptions,
    error_stats,
    spearman,
    suspects,
)
from scalable_transformer.bench.report import build_report, parse_markdown_table
from scalable_transformer.bench.results import COLUMNS, SCHEMA_VERSION, ResultsStore
from scalable_transformer.bench.sweep import load_sweep
from scalable_transformer.bench.sweep_expand import expand, suspect_members, to_run


def row(config_hash: str, label: str, nproc: int, step: float, predicted: float, **kw):
    """An ok result: `step` measured and `predicted` seconds per step at global batch 8."""
    prediction = {"step_seconds": predicted, "breakdown": {"compute": predicted}, "classes": {}}
    return {
        "config_hash": config_hash,
        "repeat": 0,
        "status": "ok",
        "sweep": "s",
        "label": label,
        "nproc": nproc,
        "global_batch_size": 8,
        "samples_per_second": 8 / step,
        "measured_step_seconds": step,
        "iteration_seconds_iqr": 0.02 * step,
        "prediction_json": json.dumps(prediction),
    } | kw


def constructed_store(path: Path) -> None:
    """Layout 'a' at 1 and 2 processes: the 1-process run 7x slow (328% scaling efficiency); layout
    'b' with two repeats 60% apart (within-run IQR 2%); layout 'c' 5x its prediction; 'd' and 'e'
    trustworthy, within 10-20% of their predictions."""
    with ResultsStore(path) as store:
        store.put(row("a1", "a", 1, step=7.0 * 0.61, predicted=0.6))
        store.put(row("a2", "a", 2, step=0.65, predicted=0.6))
        store.put(row("b1", "b", 2, step=1.0, predicted=1.1))
        store.put(row("b1", "b", 2, step=1.6, predicted=1.1, repeat=1))
        store.put(row("c1", "c", 2, step=2.5, predicted=0.5))
        store.put(row("d1", "d", 2, step=2.0, predicted=2.2))
        store.put(row("e1", "e", 2, step=3.0, predicted=2.4))
        store.put({"config_hash": "f1", "repeat": 0, "status": "oom", "label": "f", "nproc": 2, "sweep": "s"})


def reasons_by_label(path: Path) -> dict[tuple[str, int, int], list[str]]:
    with ResultsStore(path, create=False) as store:
        rows = store.rows()
    flagged = suspects(rows)
    return {(r["label"], r["nproc"], r["repeat"]): flagged[r["id"]] for r in rows if r["id"] in flagged}


def test_suspect_flags_scaling_repeats_and_far_measurements(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite"
    constructed_store(path)
    flagged = reasons_by_label(path)
    assert set(flagged) == {("a", 1, 0), ("b", 2, 1), ("c", 2, 0)}
    # the 1-process run is 7x slow: 4.27 s/step against 0.65 at 2 processes -> 328% efficiency
    (scaling,) = [r for r in flagged[("a", 1, 0)] if r.startswith("scaling")]
    assert "328%" in scaling and "from 1 to 2 devices" in scaling
    assert any(r.startswith("far from its prediction") for r in flagged[("a", 1, 0)])  # 7.1x too
    (repeat,) = flagged[("b", 2, 1)]
    assert repeat.startswith("repeats disagree: repeat 1 is 60% slower")
    (far,) = flagged[("c", 2, 0)]
    assert "5.00x" in far
    # a larger factor lets 'c' (5x) pass; a factor of at most 1 is refused
    with ResultsStore(path, create=False) as store:
        rows = store.rows()
    loose = suspects(rows, SuspectOptions(far_factor=6.0))
    assert not any(r["label"] == "c" and r["id"] in loose for r in rows)
    with pytest.raises(ValueError, match="above 1"):
        SuspectOptions(far_factor=1.0)


def test_repeats_within_their_noise_are_not_flagged(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite"
    with ResultsStore(path) as store:
        # 8% apart, but each run's iterations spread 5% (IQR): 3 x 5% = 15% > 8%
        store.put(row("b1", "b", 2, step=1.0, predicted=1.0, iteration_seconds_iqr=0.05))
        store.put(row("b1", "b", 2, step=1.08, predicted=1.0, repeat=1, iteration_seconds_iqr=0.054))
    assert reasons_by_label(path) == {}


def test_error_statistics_leave_out_doubtful_measurements() -> None:
    rows = [
        row("d1", "d", 2, step=2.0, predicted=2.2) | {"id": 1},  # +10%
        row("e1", "e", 2, step=3.0, predicted=2.4) | {"id": 2},  # -20%
        row("c1", "c", 2, step=2.5, predicted=0.5) | {"id": 3},  # -80%: far, still counted
        row("b1", "b", 2, step=1.6, predicted=1.1) | {"id": 4},  # repeats disagree: left out
    ]
    flagged = {3: ["far from its prediction: ..."], 4: ["repeats disagree: ..."]}
    stats = error_stats(rows, flagged)
    assert stats.n == 3 and stats.layouts == 3
    assert stats.median_abs == pytest.approx(0.2)
    assert stats.p90_abs == pytest.approx(0.2 + 0.8 * (0.8 - 0.2))  # numpy's linear percentile
    # measured samples/s: d 4.0, e 2.67, c 3.2; predicted: d 3.64, e 3.33, c 16 -> ranks differ
    assert stats.spearman == pytest.approx(0.5)


def test_spearman_by_hand() -> None:
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ties take their mean rank: ranks (1, 2.5, 2.5, 4) against (1, 2, 3, 4)
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486832980505138)
    assert spearman([1, 2], [1, 2]) is None
    assert spearman([1, 1, 1], [1, 2, 3]) is None


def test_report_marks_suspects_and_states_the_error(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite"
    constructed_store(path)
    text = build_report(path, ["label"], ["devices"], ["samples_per_second"], tmp_path / "out")
    table = {line[0]: line for line in parse_markdown_table(text)[1:]}
    assert table["a"][1].endswith("[suspect]")  # the 1-process cell: its only measurement is suspect
    assert not table["a"][2].endswith("]")
    assert table["b"][2] == "8.00 samples/s (1 suspect left out)"  # the median of the trusted repeat
    section = text.split("# Prediction error", 1)[1]
    errors = parse_markdown_table(section)
    assert errors[0][-1] == "suspect" and len(errors) == 1 + 7
    assert "median |error|" in section and "P90 |error|" in section and "Spearman" in section
    suspect_section = text.split("# Suspect measurements", 1)[1]
    assert "a @ 1 device(s), repeat 0: scaling: efficiency 328%" in suspect_section
    assert (tmp_path / "out" / "throughput_scaling.png").stat().st_size > 0
    csv_rows = (tmp_path / "out" / "prediction_error.csv").read_text().splitlines()
    assert csv_rows[0].startswith("layout,devices,repeat,predicted s/step") and len(csv_rows) == 8


def test_a_version_1_store_is_migrated_without_losing_rows(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    new = {"prediction_json", "measured_step_seconds", "iteration_seconds_iqr"}
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
    conn.executemany(
        "INSERT INTO meta VALUES (?, ?)",
        [("application", "scalable-transformer-results"), ("schema_version", "1")],
    )
    cols = ", ".join(f'"{c}" {t}' for c, t in COLUMNS if c not in new)
    conn.execute(f"CREATE TABLE results (id INTEGER PRIMARY KEY, {cols}, UNIQUE(config_hash, repeat))")
    conn.execute(
        "INSERT INTO results (config_hash, repeat, status, label, nproc, samples_per_second, "
        "predicted_step_seconds, global_batch_size) VALUES ('h', 0, 'ok', 'old', 2, 4.0, 1.5, 8)"
    )
    conn.commit()
    conn.close()
    with ResultsStore(path, create=False) as store:  # a reader leaves the file alone
        (old,) = store.rows()
        assert "prediction_json" not in old
    text = build_report(path, ["label"], ["devices"], ["samples_per_second"], None)
    assert "| old | 2 | 0 | 1.5 | 2 | -25.0% | - |" in text  # predicted_step_seconds, 8 / 4.0 measured
    with ResultsStore(path) as store:  # a writer migrates
        (migrated,) = store.rows()
        assert migrated["samples_per_second"] == 4.0 and migrated["prediction_json"] is None
        version = store.conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0]
    assert int(version) == SCHEMA_VERSION == 2


def test_retry_suspect_reruns_the_flagged_members_only(tmp_path: Path) -> None:
    sweep = tmp_path / "s.yaml"
    sweep.write_text("base: tiny-gpt\naxes: {nproc: [1, 2]}\nrepeats: 2\n")
    spec = load_sweep(sweep)
    members, _ = expand(spec)
    one, two = members[0].config_hash, members[2].config_hash
    with ResultsStore(tmp_path / "r.sqlite") as store:
        store.put(row(one, "m", 1, step=1.0, predicted=1.0, sweep=spec.name))
        store.put(row(one, "m", 1, step=1.8, predicted=1.0, sweep=spec.name, repeat=1))  # slow repeat
        store.put(row(two, "m", 2, step=0.53, predicted=0.5, sweep=spec.name))  # within noise
        store.put(row(two, "m", 2, step=0.5, predicted=0.5, sweep=spec.name, repeat=1))
        store.put(row("x", "m", 2, step=2.0, predicted=0.5, sweep="other"))  # far, another sweep
        rerun = suspect_members(store, spec)
        stored = store.statuses()
    assert rerun == {(one, 1)}
    assert to_run(members, stored, retry_failed=False) == []
    assert [(m.config_hash, m.repeat) for m in to_run(members, stored, False, rerun)] == [(one, 1)]


def test_a_run_stores_the_prediction_or_says_why_not() -> None:
    from scalable_transformer.calibrate.this_machine import run_prediction
    from scalable_transformer.config.load import load_config
    from scalable_transformer.config.validate import resolve
    from scalable_transformer.plan.cluster import table_cluster
    from scalable_transformer.plan.refit import prediction_record
    from scalable_transformer.plan.speed import step_time

    cfg = resolve(load_config("tiny-gpt", ["parallel.zero_stage=3"]), world_size=8)
    cluster = table_cluster("a100-40gb", 1, 8)
    record = prediction_record(cfg, cluster)
    want = step_time(cfg, cluster)
    assert record["step_seconds"] == pytest.approx(want.total)
    assert record["breakdown"] == pytest.approx(want.breakdown)
    assert record["kind"] == "gpu" and cluster.profile is not None  # the built-in A100 profile
    assert record["hardware"] == f"{cluster.profile.name} ({cluster.profile.source})"
    assert record["profile"] == cluster.profile.name and set(record["classes"]) >= {"forward", "backward"}
    json.dumps(record)  # summary.json and the store keep it as JSON
    import torch

    if not torch.cuda.is_available():
        out = run_prediction(cfg, 8, "cuda")
        assert set(out) == {"prediction_error"} and "no CUDA device" in out["prediction_error"]


def test_the_options_reach_the_sweep_and_the_report(tmp_path: Path) -> None:
    import argparse

    from scalable_transformer.cli import parsers
    from scalable_transformer.cli import report as report_cli
    from scalable_transformer.cli import sweep as sweep_cli
    from scalable_transformer.errors import UsageError

    parser = argparse.ArgumentParser()
    parsers.register_sweep(parser.add_subparsers())
    assert sweep_cli.sweep_options(parser.parse_args(["sweep", "s.yaml", "--retry-suspect"])).retry_suspect
    args = parsers.report_parsers()["table"].parse_args(["r.sqlite", "--suspect-factor", "3"])
    assert report_cli.table_options(args).suspect_factor == 3.0
    path = tmp_path / "r.sqlite"
    constructed_store(path)
    bad = report_cli.table_options(args)
    with pytest.raises(UsageError, match="--suspect-factor: the suspect factor must be above 1"):
        report_cli.table(dataclasses.replace(bad, store=path, suspect_factor=0.5))


class TimedLauncher:
    """A `Launcher` that starts nothing and writes the summary a run of `seconds[repeat]` per step
    would (its prediction 1 s/step), so run_sweep stores it."""

    def __init__(self, seconds: dict[int, float]) -> None:
        self.seconds = seconds
        self.jobs: list[str] = []

    def launch(self, job, log_path, timeout_seconds, env=None):
        from scalable_transformer.launch.launcher import LaunchResult

        args = dict(a.split("=", 1) for a in job.args if "=" in a)
        run_dir = Path(args["logging.run_dir"]) / args["logging.run_name"]
        self.jobs.append(run_dir.name)
        step = self.seconds[int(run_dir.name.rsplit("-r", 1)[1])]
        run_dir.mkdir(parents=True)
        summary = {
            "samples_per_second": 8 / step,
            "global_batch_size": 8,
            "median_iteration_seconds": step,
            "iteration_seconds_iqr": 0.01 * step,
            "prediction": {"step_seconds": 1.0, "breakdown": {"compute": 1.0}, "classes": {}},
        }
        (run_dir / "summary.json").write_text(json.dumps(summary))
        log_path.write_text("done\n")
        return LaunchResult(0, "done\n", False, 1.0)


def test_sweep_retry_suspect_runs_the_slow_repeat_again(tmp_path: Path) -> None:
    import io

    from rich.console import Console

    from scalable_transformer.bench.sweep import run_sweep
    from scalable_transformer.bench.sweep_present import SweepConsole
    from scalable_transformer.bench.sweep_types import SweepOptions

    sweep = tmp_path / "s.yaml"
    sweep.write_text("base: tiny-gpt\naxes: {nproc: [1]}\nrepeats: 2\nsteps: 2\ndry_run: false\n")
    spec = load_sweep(sweep)
    present = SweepConsole(Console(file=io.StringIO(), markup=False))
    first = TimedLauncher({0: 1.0, 1: 1.5})  # repeat 1 is 50% slower, its noise 1%
    run_sweep(spec, SweepOptions(sweep), launcher=first, present=present)
    assert len(first.jobs) == 2
    again = TimedLauncher({0: 1.0, 1: 1.02})
    run_sweep(spec, SweepOptions(sweep), launcher=again, present=present)
    assert again.jobs == []  # nothing missing: a plain rerun runs nothing
    run_sweep(spec, SweepOptions(sweep, retry_suspect=True), launcher=again, present=present)
    assert [name.rsplit("-", 1)[1] for name in again.jobs] == ["r1"]
    with ResultsStore(spec.store, create=False) as store:
        assert sorted(r["measured_step_seconds"] for r in store.rows()) == [1.0, 1.02]
        assert suspects(store.rows()) == {}
