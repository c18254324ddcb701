"""The results store: one SQLite file holding every sweep member and every imported log.

Each write is one transaction in WAL mode, so a sweep killed at any moment leaves the file with the
members finished so far and nothing half-written. A `meta` table names the application and the
schema version; any other SQLite file (or any non-SQLite file) is refused with a clear message.
"""

from __future__ import annotations

import contextlib
import csv
import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import StoreError

APP_ID = "scalable-transformer-results"
# 2: prediction_json, measured_step_seconds, iteration_seconds_iqr (issue 22); a version-1 store opened
# for writing gains them (empty for its old rows) and is marked version 2; its rows are kept
SCHEMA_VERSION = 2
STATUSES = ("ok", "oom", "timeout", "crashed", "invalid")

# (column, SQL type): the flat metric columns are copies of summary.json values, so reports and
# exports need no JSON parsing; the full summary, config and environment are kept as text as well.
COLUMNS: list[tuple[str, str]] = [
    ("config_hash", "TEXT NOT NULL"),
    ("repeat", "INTEGER NOT NULL DEFAULT 0"),
    ("source", "TEXT NOT NULL DEFAULT 'stx'"),  # stx | megatron | deepspeed
    ("sweep", "TEXT"),
    ("label", "TEXT"),  # the layout label of a report row: 'tiny-gpt tp=2 zero3+offload'
    ("model", "TEXT"),
    ("status", "TEXT NOT NULL"),
    ("error", "TEXT"),
    ("nproc", "INTEGER"),  # processes (devices) of the job
    ("nnodes", "INTEGER DEFAULT 1"),
    ("layout", "TEXT"),
    ("overrides_json", "TEXT"),  # the member's own key=value overrides (sweep axes), as a JSON object
    ("config_yaml", "TEXT"),  # the resolved config
    ("env_json", "TEXT"),  # the environment fingerprint (stx env)
    ("summary_json", "TEXT"),  # summary.json of the run (or the parsed log)
    ("samples_per_second", "REAL"),
    ("tokens_per_second", "REAL"),
    ("tflops_per_device", "REAL"),
    ("mfu", "REAL"),
    ("hfu", "REAL"),
    ("flops_convention", "TEXT"),
    ("peak_flops_per_device", "REAL"),
    # imported logs: TFLOPs/device recomputed from samples/s with the named convention, and 1 when the
    # logged figure disagrees with it by more than 10% (0 agrees, NULL not checkable)
    ("tflops_recomputed", "REAL"),
    ("tflops_mismatch", "INTEGER"),
    ("peak_memory_bytes_max", "REAL"),  # the largest per-rank peak
    ("seq_length", "INTEGER"),
    ("num_parameters", "INTEGER"),
    ("global_batch_size", "INTEGER"),
    ("micro_batch_size", "INTEGER"),
    ("gradient_accumulation_steps", "INTEGER"),
    ("zero_stage", "INTEGER"),
    ("tp", "INTEGER"),
    ("pp", "INTEGER"),
    ("dp", "INTEGER"),
    ("offload", "INTEGER"),
    ("activation_checkpointing", "TEXT"),
    ("precision", "TEXT"),
    ("steps", "INTEGER"),
    ("wall_seconds", "REAL"),  # the member as a job: launcher start to exit
    ("loop_seconds", "REAL"),  # the sum of the training iterations' times
    ("overhead_seconds", "REAL"),  # wall - loop: launcher, process start, init, evaluation, teardown
    # the planner's prediction for the member (stx plan on the sweep's hardware; issue 13) and the
    # measured live tensor bytes it is compared with (summary.json peak_tensor_bytes_per_rank, largest)
    ("predicted_peak_memory_bytes", "REAL"),
    ("predicted_step_seconds", "REAL"),
    ("predicted_samples_per_second", "REAL"),
    ("predicted_fits", "INTEGER"),
    ("plan_json", "TEXT"),
    # the dry run's peak live tensor bytes per device (stx plan --dry-run; the largest simulated rank)
    ("dry_run_peak_memory_bytes", "REAL"),
    ("peak_tensor_bytes_max", "REAL"),
    ("run_dir", "TEXT"),
    ("started_at", "TEXT"),
    ("finished_at", "TEXT"),
    ("scheduler", "TEXT"),  # slurm | pbs for a member run as a batch job (NULL: stx launch here)
    ("job_id", "TEXT"),  # its job id
    # device telemetry (metrics/device_sampler.py): medians over ranks of each rank's median; memory the max;
    # NULL where it was not measured (GPU fields on a CPU run), with the reason in telemetry_note
    ("device_util", "REAL"),  # fraction of time a kernel ran (NVML) / GFX activity (amdsmi)
    ("device_power_w", "REAL"),
    ("device_power_limit_w", "REAL"),
    ("device_memory_used_bytes", "REAL"),  # as nvidia-smi shows it: the whole device, all processes
    ("device_memory_total_bytes", "REAL"),
    ("cpu_process_util", "REAL"),  # fraction of the CPUs the rank may use
    ("cpu_system_util", "REAL"),
    ("energy_j_per_sample", "REAL"),
    ("energy_j_per_token", "REAL"),
    ("telemetry_note", "TEXT"),
    # measured communication and balance (train/trainer.py)
    ("grad_sync_ms", "REAL"),  # exposed gradient synchronisation per step (Megatron's all-grads-sync)
    ("comm_ms", "REAL"),  # all measured collectives per step (they may overlap compute)
    ("pipeline_bubble_measured", "REAL"),
    ("straggler_rank", "INTEGER"),
    # the run's own prediction (summary.json `prediction`: step_seconds, breakdown and classes per part,
    # the hardware assumed; plan/refit.py) beside its measured median step time and the interquartile
    # range of its iteration times (the within-run noise `stx report` judges repeats against)
    ("prediction_json", "TEXT"),
    ("measured_step_seconds", "REAL"),
    ("iteration_seconds_iqr", "REAL"),
]
COLUMN_NAMES = [c for c, _ in COLUMNS]


class ResultsStore:
    """`with ResultsStore(path) as store:`; creates the file (and schema) when missing."""

    def __init__(self, path: str | Path, create: bool = True):
        self.path = Path(path)
        self.writable = create
        if not self.path.exists():
            if not create:
                raise StoreError(f"{self.path}: no such results store")
            self.path.parent.mkdir(parents=True, exist_ok=True)
        elif self.path.is_dir():
            raise StoreError(f"{self.path}: is a directory, not a results store (an .sqlite file)")
        elif not create and self.path.stat().st_size == 0:
            raise StoreError(f"{self.path}: an empty file, not a results store (stx sweep writes one)")
        try:
            if create:
                self.conn = sqlite3.connect(str(self.path), timeout=30)
            else:
                # Opening for reading must never modify the file: read-only at the SQLite level, and no
                # journal-mode switch (WAL is persistent in the file header).
                self.conn = sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro", uri=True, timeout=30)
            self.conn.row_factory = sqlite3.Row
            if create:
                self.conn.execute("PRAGMA journal_mode=WAL")
            self._init_schema()
        except sqlite3.DatabaseError as e:
            self.close_quietly()
            raise StoreError(
                f"{self.path}: not a results store of scalable-transformer (not an SQLite database: {e})"
            ) from e
        except StoreError:
            self.close_quietly()
            raise

    def close_quietly(self) -> None:
        if hasattr(self, "conn"):
            with contextlib.suppress(sqlite3.Error):
                self.conn.close()

    def _init_schema(self) -> None:
        tables = {r[0] for r in self.conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if not tables and not self.writable:
            raise StoreError(
                f"{self.path}: an empty SQLite database, not a results store (stx sweep writes one)"
            )
        if not tables:
            with self.conn:
                self.conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
                self.conn.executemany(
                    "INSERT INTO meta VALUES (?, ?)",
                    [("application", APP_ID), ("schema_version", str(SCHEMA_VERSION))],
                )
                cols = ", ".join(f'"{c}" {t}' for c, t in COLUMNS)
                self.conn.execute(
                    f"CREATE TABLE results (id INTEGER PRIMARY KEY, {cols}, UNIQUE(config_hash, repeat))"
                )
            return
        meta = {}
        if "meta" in tables:
            meta = dict(self.conn.execute("SELECT key, value FROM meta").fetchall())
        if meta.get("application") != APP_ID or "results" not in tables:
            raise StoreError(
                f"{self.path}: an SQLite file, but not a results store of scalable-transformer "
                f"(tables: {', '.join(sorted(tables))})"
            )
        version = int(meta.get("schema_version", 0))
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"{self.path}: results store schema version {version} is newer than this stx "
                f"understands ({SCHEMA_VERSION}); upgrade scalable-transformer"
            )
        # Columns added since the file was created are added empty (NULL) by writers, so old stores
        # keep working; readers (create=False) leave the file as it is and see the columns as missing.
        have = {r[1] for r in self.conn.execute("PRAGMA table_info(results)")}
        missing = [(c, t) for c, t in COLUMNS if c not in have]
        if (missing or version < SCHEMA_VERSION) and self.writable:
            with self.conn:  # one transaction: the columns and the new version together, or neither
                for column, kind in missing:
                    self.conn.execute(f'ALTER TABLE results ADD COLUMN "{column}" {kind}')
                self.conn.execute(
                    "INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),)
                )

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> ResultsStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """All writes inside commit together or not at all (an exception rolls them back)."""
        with self.conn:
            yield self.conn

    def put(self, record: dict[str, Any]) -> None:
        """Insert or replace the row of (config_hash, repeat): a rerun overwrites its earlier result."""
        unknown = set(record) - set(COLUMN_NAMES)
        if unknown:
            raise ValueError(f"unknown result fields: {', '.join(sorted(unknown))}")
        if record.get("status") not in STATUSES:
            raise ValueError(f"status must be one of {', '.join(STATUSES)}, got {record.get('status')!r}")
        keys = list(record)
        sql = (
            f"INSERT INTO results ({', '.join(chr(34) + k + chr(34) for k in keys)}) "
            f"VALUES ({', '.join('?' for _ in keys)}) ON CONFLICT(config_hash, repeat) DO UPDATE SET "
            + ", ".join(f'"{k}"=excluded."{k}"' for k in keys if k not in ("config_hash", "repeat"))
        )
        with self.transaction() as conn:
            conn.execute(sql, [record[k] for k in keys])

    def statuses(self) -> dict[tuple[str, int], str]:
        """(config_hash, repeat) -> status of every stored result."""
        rows = self.conn.execute("SELECT config_hash, repeat, status FROM results").fetchall()
        return {(r[0], r[1]): r[2] for r in rows}

    def rows(self, where: str = "", params: tuple = ()) -> list[dict[str, Any]]:
        sql = "SELECT * FROM results" + (f" WHERE {where}" if where else "") + " ORDER BY id"
        return [dict(r) for r in self.conn.execute(sql, params).fetchall()]


def export(store: ResultsStore, fmt: str, output: str | Path) -> int:
    """Write every result as CSV or Parquet; returns the number of rows."""
    rows = store.rows()
    columns = ["id", *COLUMN_NAMES]
    if fmt == "csv":
        with open(output, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            writer.writerows(rows)
        return len(rows)
    if fmt == "parquet":
        try:  # optional dependency (the parquet extra)
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError as e:
            raise ValueError(
                "--format parquet needs the pyarrow package, which is not installed "
                "(pip install pyarrow); --format csv needs nothing"
            ) from e
        table = pa.Table.from_pylist(rows) if rows else pa.table({c: [] for c in columns})
        pq.write_table(table, str(output))
        return len(rows)
    raise ValueError(f"--format must be csv or parquet, got {fmt!r}")


def loads(text: str | None) -> Any:
    return json.loads(text) if text else None
