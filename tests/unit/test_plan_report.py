"""`stx report`'s "Planned vs measured" table (bench/report.py) from stored predictions."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from scalable_transformer.bench.report import build_report, parse_markdown_table
from scalable_transformer.bench.results import ResultsStore


def row(**kw):
    base = {"config_hash": "h1", "repeat": 0, "status": "ok", "label": "tiny-gpt tp=1 pp=1 zero0", "nproc": 2}
    return base | kw


def test_report_shows_predicted_vs_measured_with_the_error(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite"
    with ResultsStore(path) as store:
        mib = 2**20
        plan_ok = {
            "predicted_peak_memory_bytes": 220 * mib,
            "predicted_samples_per_second": 8.0,
            "dry_run_peak_memory_bytes": 190 * mib,
        }
        plan_oom = {"predicted_peak_memory_bytes": 900 * mib, "predicted_samples_per_second": 5.0}
        store.put(row(samples_per_second=10.0, peak_tensor_bytes_max=200 * mib, predicted_fits=1, **plan_ok))
        store.put(
            row(
                config_hash="h2", label="tiny-gpt tp=1 pp=1 zero3", status="oom", predicted_fits=0, **plan_oom
            )
        )
        store.put(row(config_hash="h3", label="no prediction", samples_per_second=3.0))
    text = build_report(path, ["label"], ["devices"], ["samples_per_second"], tmp_path / "out")
    section = text.split("# Planned vs measured (stx plan)", 1)[1]
    table = parse_markdown_table(section)
    body = {line[0]: line for line in table[1:]}
    assert set(body) == {"tiny-gpt tp=1 pp=1 zero0", "tiny-gpt tp=1 pp=1 zero3"}  # no prediction: no row
    ok = body["tiny-gpt tp=1 pp=1 zero0"]
    # predicted, dry run, measured, their errors; samples/s predicted, measured, error; fit
    assert ok[2:7] == ["0.215", "0.186", "0.195", "+10.0%", "-5.0%"]
    assert ok[9] == "-20.0%" and ok[10] == "fits"
    oom = body["tiny-gpt tp=1 pp=1 zero3"]
    assert oom[3] == "-" and oom[4] == "-" and oom[5] == "-" and oom[10] == "OOM" and oom[11] == "OOM"
    assert (tmp_path / "out" / "plan_vs_measured.csv").is_file()


def test_the_memory_error_leaves_the_devices_reserve_out_of_the_prediction(tmp_path: Path) -> None:
    """Live tensor bytes against live tensor bytes: on a GPU the plan's peak holds a 2 GiB reserve for
    the CUDA context and allocator slack, which no tensor measures (on an H200 it was the whole error)."""
    path = tmp_path / "r.sqlite"
    gib = 2**30
    breakdown = {"parameters": 3 * gib, "activations": 5 * gib, "reserve": 2 * gib}
    with ResultsStore(path) as store:
        store.put(
            row(
                samples_per_second=10.0,
                peak_tensor_bytes_max=8 * gib,
                predicted_peak_memory_bytes=10 * gib,
                predicted_samples_per_second=10.0,
                plan_json=json.dumps({"memory_breakdown_bytes": breakdown}),
            )
        )
    text = build_report(path, ["label"], ["devices"], ["samples_per_second"], tmp_path / "out")
    table = parse_markdown_table(text.split("# Planned vs measured (stx plan)", 1)[1])
    assert table[1][2:6] == ["10.000", "-", "8.000", "+0.0%"]  # shown with its reserve, compared without


def test_old_stores_gain_the_plan_columns(tmp_path: Path) -> None:
    """A store written before the planner existed opens with the new columns added (ADD COLUMN)."""
    path = tmp_path / "old.sqlite"
    with ResultsStore(path) as store:
        store.put(row(samples_per_second=1.0))
    conn = sqlite3.connect(path)
    conn.execute("ALTER TABLE results DROP COLUMN predicted_peak_memory_bytes")
    conn.commit()
    conn.close()
    with ResultsStore(path) as store:
        assert store.rows()[0]["predicted_peak_memory_bytes"] is None
