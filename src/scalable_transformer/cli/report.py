"""`stx report`: a run directory's segments and goodput; tables and plots from a results store; `export`
it; `import-log` Megatron/DeepSpeed logs.

The three forms have their own options (see REPORT_USAGE), so `stx report` takes the rest of the
command line and parses it here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from ..bench.log_import import import_log as import_one
from ..bench.prediction_error import SuspectOptions
from ..bench.report import build_report, parse_values
from ..bench.results import ResultsStore, StoreError
from ..bench.results import export as export_results
from ..bench.run_report import segments_report
from ..errors import UsageError
from .parsers import report_parsers


@dataclasses.dataclass(frozen=True)
class TableOptions:
    """`stx report [STORE]`: row and column keys, cell values, what is printed, where files go."""

    store: Path
    rows: tuple[str, ...]
    cols: tuple[str, ...]
    values: tuple[str, ...]
    format: str = "md"
    output: Path | None = None
    device_memory_gb: float | None = None  # GiB: the device memory line of the memory plot
    suspect_factor: float = 2.0  # a measurement this many times off its prediction, either way, is suspect


@dataclasses.dataclass(frozen=True)
class ExportOptions:
    """`stx report export`: every stored result to one csv or parquet file."""

    store: Path
    format: str
    output: str


@dataclasses.dataclass(frozen=True)
class ImportLogOptions:
    """`stx report import-log`: a Megatron or DeepSpeed training log as one stored result."""

    file: str  # as given: the summary line names it so
    format: str
    store: str
    label: str | None = None
    devices: int | None = None
    nnodes: int = 1
    seq_length: int | None = None  # tokens per sample, when the log does not say


def run(args: argparse.Namespace) -> int:

    parsers = report_parsers()
    rest = list(args.args)
    action = rest.pop(0) if rest and rest[0] in ("export", "import-log") else "table"
    sub_args = parsers[action].parse_args(rest)
    if action == "import-log":
        for option in ("devices", "nnodes", "seq_length"):
            value = getattr(sub_args, option)
            if value is not None and value < 1:
                flag = "--" + option.replace("_", "-")
                raise UsageError(f"stx report import-log {flag} must be an integer >= 1, got {value}")
    try:
        if action == "export":
            return run_export(ExportOptions(Path(sub_args.store), sub_args.format, sub_args.output))
        if action == "import-log":
            return run_import_log(
                ImportLogOptions(
                    sub_args.file,
                    sub_args.format,
                    sub_args.store,
                    sub_args.label,
                    sub_args.devices,
                    sub_args.nnodes,
                    sub_args.seq_length,
                )
            )
        if Path(sub_args.store).is_dir():  # a run directory: its segments and goodput
            print(segments_report(Path(sub_args.store)), end="")
            return 0
        return table(table_options(sub_args))
    except StoreError as e:
        print(f"stx report: error: {e}", file=sys.stderr)
        return 2


def table_options(args: argparse.Namespace) -> TableOptions:

    return TableOptions(
        store=Path(args.store),
        rows=tuple(k.strip() for k in args.rows.split(",")),
        cols=tuple(k.strip() for k in args.cols.split(",")),
        values=tuple(parse_values(args.value)),
        format=args.format,
        output=Path(args.output) if args.output else None,
        device_memory_gb=args.device_memory_gb,
        suspect_factor=args.suspect_factor,
    )


def table(opts: TableOptions) -> int:

    try:
        suspect = SuspectOptions(far_factor=opts.suspect_factor)
    except ValueError as e:
        raise UsageError(f"stx report --suspect-factor: {e}") from None
    out = build_report(
        opts.store,
        list(opts.rows),
        list(opts.cols),
        list(opts.values),
        opts.output,
        opts.format,
        opts.device_memory_gb,
        suspect=suspect,
    )
    print(out, end="")
    if opts.output:
        print(
            f"\nwritten: {opts.output}/table.md, wide.md, table.csv, wide.csv, report.html, *.png", flush=True
        )
    return 0


def run_export(opts: ExportOptions) -> int:

    with ResultsStore(opts.store, create=False) as store:
        n = export_results(store, opts.format, opts.output)
    print(f"{n} result(s) written to {opts.output} ({opts.format})")
    return 0


def run_import_log(opts: ImportLogOptions) -> int:
    record = import_one(
        Path(opts.file),
        fmt=opts.format,
        label=opts.label,
        devices=opts.devices,
        nnodes=opts.nnodes,
        seq_length=opts.seq_length,
        store_path=Path(opts.store),
    )
    sps, tf = record.get("samples_per_second"), record.get("tflops_per_device")
    print(
        f"imported {opts.file} as '{record['label']}' (source {opts.format}, "
        f"devices {record['nproc'] or '?'}): "
        + (f"{sps:.2f} samples/s" if sps is not None else "no throughput found")
        + (f", {tf:.2f} TFLOPs/dev" if tf is not None else "")
        + f" -> {opts.store}"
    )
    if record.get("tflops_mismatch"):
        print(f"warning: {json.loads(record['summary_json'])['tflops_check']}")
    return 0
