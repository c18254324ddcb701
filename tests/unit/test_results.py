"""The results store, sweep-file checks, member identity, status classification and report tables."""

from __future__ import annotations

import csv
import importlib.util
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from scalable_transformer.bench import report
from scalable_transformer.bench.results import SCHEMA_VERSION, ResultsStore, StoreError, export
from scalable_transformer.bench.sweep import SweepError, classify, load_sweep
from scalable_transformer.bench.sweep_expand import config_hash, expand, to_run
from scalable_transformer.config.load import load_config
from scalable_transformer.config.validate import resolve


def rec(**kw):
    base = {"config_hash": "h1", "repeat": 0, "status": "ok", "label": "tiny-gpt tp=1", "nproc": 1}
    return base | kw


# --- store -------------------------------------------------------------------------------------


def test_store_schema_version_and_idempotent_put(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite"
    with ResultsStore(path) as store:
        store.put(rec(samples_per_second=10.0))
        store.put(rec(samples_per_second=12.0))  # same (hash, repeat): replaced, not duplicated
        store.put(rec(repeat=1, samples_per_second=11.0))
        assert [r["samples_per_second"] for r in store.rows()] == [12.0, 11.0]
        assert store.statuses() == {("h1", 0): "ok", ("h1", 1): "ok"}
    with ResultsStore(path) as store:  # reopening keeps everything, schema untouched
        assert len(store.rows()) == 2
    meta = dict(sqlite3.connect(path).execute("SELECT key, value FROM meta").fetchall())
    assert meta["schema_version"] == str(SCHEMA_VERSION)


def test_store_rejects_bad_records(tmp_path: Path) -> None:
    with ResultsStore(tmp_path / "r.sqlite") as store:
        with pytest.raises(ValueError, match="status must be one of"):
            store.put(rec(status="fine"))
        with pytest.raises(ValueError, match="unknown result fields: bogus"):
            store.put(rec(bogus=1))


def test_interrupted_transaction_leaves_the_store_unchanged(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite"
    with ResultsStore(path) as store:
        store.put(rec())
        with pytest.raises(RuntimeError), store.transaction() as conn:
            conn.execute("INSERT INTO results (config_hash, repeat, status) VALUES ('h2', 0, 'ok')")
            raise RuntimeError("killed mid-write")
        assert [r["config_hash"] for r in store.rows()] == ["h1"]
    with ResultsStore(path) as store:
        assert [r["config_hash"] for r in store.rows()] == ["h1"]


def test_not_a_store_is_refused_clearly(tmp_path: Path) -> None:
    text = tmp_path / "notes.sqlite"
    text.write_text("hello, not a database\n" * 100)
    with pytest.raises(StoreError, match="not an SQLite database"):
        ResultsStore(text)
    other = tmp_path / "other.sqlite"
    sqlite3.connect(other).execute("CREATE TABLE t (x)").connection.commit()
    with pytest.raises(StoreError, match="not a results store of scalable-transformer"):
        ResultsStore(other)
    with pytest.raises(StoreError, match="no such results store"):
        ResultsStore(tmp_path / "missing.sqlite", create=False)


def test_export_csv_and_parquet(tmp_path: Path) -> None:
    with ResultsStore(tmp_path / "r.sqlite") as store:
        store.put(rec(samples_per_second=3.5))
        assert export(store, "csv", tmp_path / "r.csv") == 1
        with open(tmp_path / "r.csv") as f:
            rows = list(csv.DictReader(f))
        assert rows[0]["samples_per_second"] == "3.5" and rows[0]["status"] == "ok"
        if importlib.util.find_spec("pyarrow") is None:
            with pytest.raises(ValueError, match="needs the pyarrow package"):
                export(store, "parquet", tmp_path / "r.parquet")
        else:
            assert export(store, "parquet", tmp_path / "r.parquet") == 1


# --- sweep file, identity, classification ---------------------------------------------------------


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "sweep.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_sweep_expansion_filters_invalid_and_limits(tmp_path: Path) -> None:
    spec = load_sweep(
        write(
            tmp_path,
            """\
            base: tiny-gpt
            axes: {nproc: [1, 2], parallel.tp: [1, 2], train.micro_batch_size: [2, 4]}
            filters: [{train.micro_batch_size: 4, nproc: 2}]
            limits: [{when: {parallel.tp: 2}, timeout_seconds: 5, memory_limit_mb: 100}]
            repeats: 2
            steps: 3
            """,
        )
    )
    members, filtered = expand(spec)
    assert filtered == 2 and len(members) == 6 * 2
    invalid = {(m.nproc, m.point["parallel.tp"]) for m in members if m.invalid_reason}
    assert invalid == {(1, "2")}
    tp2 = [m for m in members if m.point["parallel.tp"] == "2"]
    assert all(m.timeout_seconds == 5 and m.memory_limit_mb == 100 for m in tp2)
    assert spec.store == (tmp_path / "results.sqlite").resolve()
    # repeats share the identity; different members do not
    assert len({(m.config_hash, m.repeat) for m in members}) == len(members)
    assert len({m.config_hash for m in members}) == 6


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("base: tiny-gpt\nstepz: 3\n", "'stepz': unknown key; valid keys: base, overrides"),
        ("axes: {nproc: [0]}\n", "'axes.nproc': process counts are integers >= 1"),
        ("axes: {model.num_layerz: [1]}\n", "'axes.model.num_layerz'"),
        ("axes: {nproc: [1]}\nfilters: [{parallel.tp: 2}]\n", "not an axis; axes are: nproc"),
        # axes are required (a sweep without them has nothing to compare, issue 11)
        ("axes: {nproc: [1]}\nsteps: 0\n", "'steps': must be training iterations per member"),
        ("axes: {nproc: [1]}\ntimeout_seconds: -1\n", "'timeout_seconds'"),
        ("base: nope\n", "'base': 'nope' is neither a preset"),
        ("axes: {nproc: 2}\n", "'axes.nproc': must be a non-empty list"),
    ],
)
def test_sweep_file_errors_name_file_and_key(tmp_path: Path, text: str, match: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(SweepError, match=match) as info:
        load_sweep(path)
    assert str(path) in str(info.value)


def test_config_hash_is_stable_and_ignores_run_directories() -> None:
    def cfg(*overrides: str):
        return resolve(load_config("tiny-gpt", list(overrides)), world_size=2)

    a = config_hash(cfg("model.num_layers=1"), 2, 5)
    assert a == config_hash(cfg("num-layers=1"), 2, 5)  # alias, same resolved config
    assert a == config_hash(
        cfg("model.num_layers=1", "logging.run_dir=/elsewhere", "logging.run_name=x"), 2, 5
    )
    assert a != config_hash(cfg("model.num_layers=2"), 2, 5)
    assert a != config_hash(cfg("model.num_layers=1"), 2, 6)
    assert len(a) == 20 and a == config_hash(cfg("model.num_layers=1"), 2, 5)


@pytest.mark.parametrize(
    ("code", "output", "timed_out", "status"),
    [
        (0, "done", False, "ok"),
        (1, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", False, "oom"),
        (
            1,
            "RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried to allocate 67108864",
            False,
            "oom",
        ),
        (1, "    raise MemoryError()\nMemoryError", False, "oom"),
        (1, "OSError: [Errno 12] Cannot allocate memory", False, "oom"),
        (-9, "", False, "oom"),  # SIGKILL we did not send: the kernel's OOM killer
        (
            1,
            "stx launch: rank 1 failed first (exitcode -9): Signal 9 (SIGKILL) received by PID 123",
            False,
            "oom",
        ),
        (1, "stx launch: rank 1 was killed by signal SIGKILL (exit code -9)", False, "oom"),
        (1, "stx launch: rank 0 was killed by signal SIGSEGV (exit code -11)", False, "crashed"),
        (1, "ValueError: bad dataset", False, "crashed"),
        (None, "", True, "timeout"),
        (-15, "CUDA out of memory", True, "timeout"),
    ],
)
def test_classify(code, output, timed_out, status) -> None:
    assert classify(code, output, timed_out) == status


# --- tables ------------------------------------------------------------------------------------


ROWS = [
    rec(
        config_hash="a",
        label="bert-345m tp=1 zero0",
        nproc=1,
        samples_per_second=44.7,
        tflops_per_device=2.941,
    ),
    rec(
        config_hash="b",
        label="bert-345m tp=1 zero0",
        nproc=8,
        samples_per_second=137.9,
        tflops_per_device=1.2,
    ),
    rec(
        config_hash="b",
        repeat=1,
        label="bert-345m tp=1 zero0",
        nproc=8,
        samples_per_second=139.9,
        tflops_per_device=1.4,
    ),
    rec(config_hash="c", label="bert-175b zero0", nproc=8, status="oom"),
    rec(config_hash="d", label="bert-175b zero0", nproc=32, nnodes=4, status="timeout"),
    rec(
        config_hash="e",
        label="bert-175b zero3+offload",
        nproc=32,
        nnodes=4,
        status="ok",
        samples_per_second=0.25,
        tflops_per_device=0.0123,
    ),
]


def full(rows):
    keys = ["source", "overrides_json", "nnodes", "summary_json", "mfu", "tokens_per_second"]
    return [{k: None for k in keys} | {"source": "stx", "nnodes": 1} | r for r in rows]


def test_users_table_cells_repeats_and_failures() -> None:
    header, body = report.grid(
        full(ROWS), ["label"], ["devices"], ["samples_per_second", "tflops_per_device"]
    )
    assert header == ["label \\ devices", "1", "8", "4*8"]
    table = {line[0]: line[1:] for line in body}
    assert table["bert-345m tp=1 zero0"] == [
        "44.70 samples/s, 2.94 TFLOPs/dev",
        "138.90 samples/s, 1.30 TFLOPs/dev",  # median of the two repeats
        "",
    ]
    assert table["bert-175b zero0"] == ["", "OOM", "timeout"]
    assert table["bert-175b zero3+offload"] == ["", "", "0.25 samples/s, 0.0123 TFLOPs/dev"]
    md = report.markdown(header, body)
    assert report.parse_markdown_table(md) == [header, *body]


def test_value_names_and_errors() -> None:
    assert report.parse_values("samples,tflops,mfu") == ["samples_per_second", "tflops_per_device", "mfu"]
    with pytest.raises(ValueError, match="unknown value 'speed'"):
        report.parse_values("speed")


def test_wide_table_and_report_files(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite"
    with ResultsStore(path) as store:
        for r in ROWS:
            store.put(
                r
                | {
                    "seq_length": 512,
                    "mfu": 0.5 if r["status"] == "ok" else None,
                    "tokens_per_second": (r.get("samples_per_second") or 0) * 512 or None,
                    "flops_convention": "megatron",
                    "peak_flops_per_device": 312e12,
                    "peak_memory_bytes_max": 2**30 if r["status"] == "ok" else None,
                }
            )
    text = report.build_report(path, ["label"], ["devices"], ["samples_per_second"], tmp_path / "out")
    assert "FLOPs convention 'megatron', peak 312.000 TFLOP/s per device" in text
    header, *body = report.parse_markdown_table((tmp_path / "out" / "wide.md").read_text().split("\n", 2)[2])
    assert header[:4] == ["model", "seq len", "MFU (%)", "HFU (%)"]
    first = dict(zip(header, body[0], strict=True))
    assert first["tokens/s"] == "22886.40" and first["devices"] == "1" and first["status"] == "ok"
    for name in (
        "table.md",
        "table.csv",
        "wide.csv",
        "report.html",
        "throughput_scaling.png",
        "mfu_by_layout.png",
    ):
        assert (tmp_path / "out" / name).stat().st_size > 0


def test_resume_runs_missing_members_and_retry_failed_reruns_failures(tmp_path: Path) -> None:
    spec = load_sweep(write(tmp_path, "base: tiny-gpt\naxes: {nproc: [1, 2], parallel.tp: [1, 2]}\n"))
    members, _ = expand(spec)
    valid = [m for m in members if not m.invalid_reason]
    assert len(valid) == 3
    assert to_run(members, {}, retry_failed=False) == valid
    stored = {(valid[0].config_hash, 0): "ok", (valid[1].config_hash, 0): "oom"}
    assert to_run(members, stored, retry_failed=False) == valid[2:]
    assert to_run(members, stored, retry_failed=True) == valid[1:]


def test_a_writer_killed_mid_transaction_leaves_a_valid_store(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite"
    with ResultsStore(path) as store:
        store.put(rec())
    # A separate process opens a transaction, writes, and is SIGKILLed before committing.
    code = textwrap.dedent(
        f"""
        import os, signal
        from scalable_transformer.bench.results import ResultsStore
        store = ResultsStore({str(path)!r})
        store.conn.execute("BEGIN")
        store.conn.execute("INSERT INTO results (config_hash, repeat, status) VALUES ('h2', 0, 'ok')")
        store.conn.execute("UPDATE results SET status = 'crashed' WHERE config_hash = 'h1'")
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], timeout=60)
    assert proc.returncode == -signal.SIGKILL
    with ResultsStore(path) as store:
        assert [(r["config_hash"], r["status"]) for r in store.rows()] == [("h1", "ok")]
        assert store.conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
