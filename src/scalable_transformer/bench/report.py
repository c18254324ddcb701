"""`stx report`: the tables users keep by hand (layout x device count), a wide MosaicML-style table,
and plots, from a results store.

Every figure names its unit; TFLOPs, MFU and HFU name their FLOPs convention and the peak they divide by.
"""

from __future__ import annotations

import base64
import csv
import html
import io
import json
import statistics
import tempfile
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import UsageError
from .prediction_error import (
    SuspectOptions,
    error_stats,
    error_table,
    stats_text,
    suspect_lines,
    suspects,
)
from .results import COLUMN_NAMES, ResultsStore, loads

# value key -> (column in the store, unit shown in a cell, scale applied to the stored value)
VALUES: dict[str, tuple[str, str, float]] = {
    "samples_per_second": ("samples_per_second", "samples/s", 1.0),
    "tokens_per_second": ("tokens_per_second", "tokens/s", 1.0),
    "tflops_per_device": ("tflops_per_device", "TFLOPs/dev", 1.0),
    "mfu": ("mfu", "% MFU", 100.0),
    "hfu": ("hfu", "% HFU", 100.0),
    "peak_memory": ("peak_memory_bytes_max", "GiB/dev peak", 1 / 2**30),
    "overhead_seconds": ("overhead_seconds", "s overhead", 1.0),
    "energy_per_sample": ("energy_j_per_sample", "J/sample", 1.0),
    "energy_per_token": ("energy_j_per_token", "J/token", 1.0),
    "grad_sync": ("grad_sync_ms", "ms grad sync/step", 1.0),
    "comm": ("comm_ms", "ms comm/step", 1.0),
}


def _pair(
    rows: list[dict[str, Any]], used: str, total: str, scale: float, digits: int, unit: str
) -> str | None:
    """'34.6/39.6 GiB': the medians of two columns (the second left out when unknown)."""
    a, b = _median(rows, used), _median(rows, total)
    if a is None:
        return None
    return f"{a * scale:.{digits}f}" + ("" if b is None else f"/{b * scale:.{digits}f}") + f" {unit}"


def _utilisation(rows: list[dict[str, Any]]) -> str | None:
    """The device's utilisation ('79%'); on a CPU run this process's CPU utilisation ('12% CPU')."""
    gpu, cpu = _median(rows, "device_util"), _median(rows, "cpu_process_util")
    if gpu is not None:
        return f"{100 * gpu:.0f}%"
    return None if cpu is None else f"{100 * cpu:.0f}% CPU"


# cells of two columns, as the users write them: '34.6/39.6 GiB', '140/400 W', '79%'
COMPOUND: dict[str, tuple[str, Callable[[list[dict[str, Any]]], str | None]]] = {
    "device_memory": (
        "device memory used/total (GiB)",
        lambda rows: _pair(
            rows, "device_memory_used_bytes", "device_memory_total_bytes", 1 / 2**30, 1, "GiB"
        ),
    ),
    "power": (
        "power/limit (W)",
        lambda rows: _pair(rows, "device_power_w", "device_power_limit_w", 1.0, 0, "W"),
    ),
    "util": ("utilisation (%)", _utilisation),
}
# the users' table cell: samples/s, TFLOPs/dev, device memory, power, utilisation
USERS_CELL = ["samples_per_second", "tflops_per_device", "device_memory", "power", "util"]
ALIASES = {
    "samples": "samples_per_second",
    "samples/s": "samples_per_second",
    "tokens": "tokens_per_second",
    "tokens/s": "tokens_per_second",
    "tflops": "tflops_per_device",
    "tflops/dev": "tflops_per_device",
    "peak_memory_bytes_max": "peak_memory",
    "memory": "peak_memory",
}
FAILED = {"oom": "OOM", "timeout": "timeout", "crashed": "crashed", "invalid": "invalid"}


def devices(row: dict[str, Any]) -> str:
    """The users' column: '1*8' (nodes * processes per node) for several nodes or a batch job (a
    scheduler's job is counted in nodes even when it has one), else the process count."""
    nnodes = row.get("nnodes") or 1
    nproc = row.get("nproc")
    if nproc is None:
        return "?"
    return f"{nnodes}*{nproc // nnodes}" if nnodes > 1 or row.get("scheduler") else str(nproc)


def total_devices(row: dict[str, Any]) -> int:
    return int(row.get("nproc") or 1)


def _key_value(row: dict[str, Any], key: str) -> str:
    if key == "devices":
        return devices(row)
    if key in row:
        value = row[key]
        return "" if value is None else str(value)
    overrides = loads(row.get("overrides_json")) or {}
    return str(overrides.get(key, ""))


def check_keys(rows: list[dict[str, Any]], keys: list[str], option: str) -> None:
    """Every row/column key is `devices`, a column of the store or a sweep axis of these rows: a typo
    would otherwise print a table with one blank label."""
    axes = sorted({k for r in rows for k in (loads(r.get("overrides_json")) or {})})
    for key in keys:
        if key != "devices" and key not in COLUMN_NAMES and key not in axes:
            axes_text = f"; sweep axes in this store: {', '.join(axes)}" if axes else ""
            raise UsageError(
                f"{option}: unknown key {key!r}; valid: devices, {', '.join(COLUMN_NAMES)}{axes_text}"
            )


def parse_values(spec: str) -> list[str]:
    out = []
    for raw in spec.split(","):
        if raw.strip().lower() == "users":  # the users' table cell
            out += USERS_CELL
            continue
        key = ALIASES.get(raw.strip().lower(), raw.strip())
        if key not in VALUES and key not in COMPOUND:
            valid = ", ".join([*VALUES, *COMPOUND, *ALIASES, "users"])
            raise ValueError(f"--value: unknown value {raw!r}; valid: {valid}")
        out.append(key)
    return out


def value_title(key: str) -> str:
    return COMPOUND[key][0] if key in COMPOUND else VALUES[key][1]


def fmt_number(x: float) -> str:
    """Two decimals from 0.1 up (as the users' tables), three significant digits below."""
    if x == 0 or abs(x) >= 0.1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def _median(rows: list[dict[str, Any]], column: str) -> float | None:
    values = [r[column] for r in rows if r.get(column) is not None]
    return statistics.median(values) if values else None


def cell(rows: list[dict[str, Any]], values: list[str], flagged: dict[int, list[str]] | None = None) -> str:
    """'1658.93 samples/s, 2.94 TFLOPs/dev' from the ok repeats (median), else the failure ('OOM').
    Suspect repeats (`flagged`: row id -> reasons) are left out while a trusted one remains; a cell of
    suspect measurements only is marked '[suspect]'."""
    ok = [r for r in rows if r["status"] == "ok"]
    mark = ""
    if flagged:
        trusted = [r for r in ok if r.get("id") not in flagged]
        if len(trusted) < len(ok):
            mark = f" ({len(ok) - len(trusted)} suspect left out)" if trusted else " [suspect]"
        ok = trusted or ok
    if not ok:
        statuses = {r["status"] for r in rows}
        for status in ("oom", "timeout", "crashed", "invalid"):
            if status in statuses:
                return FAILED[status]
        return ""
    parts = []
    for key in values:
        if key in COMPOUND:
            parts.append(COMPOUND[key][1](ok) or "-")
            continue
        column, unit, scale = VALUES[key]
        value = _median(ok, column)
        parts.append("-" if value is None else f"{fmt_number(value * scale)} {unit}")
    return ", ".join(parts) + mark


def grid(
    rows: list[dict[str, Any]],
    row_keys: list[str],
    col_keys: list[str],
    values: list[str],
    flagged: dict[int, list[str]] | None = None,
) -> tuple[list[str], list[list[str]]]:
    """Header and body of the layout x devices table."""

    def row_id(r: dict[str, Any]) -> str:
        return " ".join(_key_value(r, k) for k in row_keys)

    def col_id(r: dict[str, Any]) -> str:
        return " ".join(_key_value(r, k) for k in col_keys)

    def col_sort(c: str) -> tuple:
        try:
            return (0, eval_devices(c), c)
        except ValueError:
            return (1, 0, c)

    row_ids = list(dict.fromkeys(row_id(r) for r in rows))
    col_ids = sorted(dict.fromkeys(col_id(r) for r in rows), key=col_sort)
    corner = f"{' '.join(row_keys)} \\ {' '.join(col_keys)}"
    header = [corner, *col_ids]
    body = []
    for rid in row_ids:
        line = [rid]
        for cid in col_ids:
            members = [r for r in rows if row_id(r) == rid and col_id(r) == cid]
            line.append(cell(members, values, flagged) if members else "")
        body.append(line)
    return header, body


def eval_devices(text: str) -> int:
    """'4*8' -> 32, '2' -> 2."""
    parts = text.split("*")
    if not all(p.strip().isdigit() for p in parts):
        raise ValueError(text)
    out = 1
    for p in parts:
        out *= int(p)
    return out


WIDE_COLUMNS = [
    "model",
    "seq len",
    "MFU (%)",
    "HFU (%)",
    "tokens/s",
    "tokens/s/device",
    "params",
    "global batch",
    "micro batch",
    "accumulation",
    "sharding",
    "activation checkpointing",
    "precision",
    "devices",
    "source",
    "status",
]


def wide(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """One line per result (repeats collapsed to their median), MosaicML's benchmark-table columns."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["label"], devices(r), r["source"]), []).append(r)
    body = []
    for (label, dev, source), members in groups.items():
        ok = [r for r in members if r["status"] == "ok"]
        first = (ok or members)[0]
        tps = _median(ok, "tokens_per_second")
        mfu, hfu = _median(ok, "mfu"), _median(ok, "hfu")
        zero = first.get("zero_stage")
        sharding = "-" if zero is None else f"zero{zero}" + ("+offload" if first.get("offload") else "")
        if first.get("tp") and first["tp"] > 1:
            sharding += f" tp={first['tp']}"
        if first.get("pp") and first["pp"] > 1:
            sharding += f" pp={first['pp']}"

        def num(x: Any) -> str:
            return "-" if x is None else str(x)

        body.append(
            [
                label,
                num(first.get("seq_length")),
                "-" if mfu is None else f"{100 * mfu:.2f}",
                "-" if hfu is None else f"{100 * hfu:.2f}",
                "-" if tps is None else fmt_number(tps),
                "-" if tps is None else fmt_number(tps / total_devices(first)),
                "-" if first.get("num_parameters") is None else f"{first['num_parameters'] / 1e6:.2f}M",
                num(first.get("global_batch_size")),
                num(first.get("micro_batch_size")),
                num(first.get("gradient_accumulation_steps")),
                sharding,
                num(first.get("activation_checkpointing")),
                num(first.get("precision")),
                dev,
                source,
                "ok" if ok else FAILED.get(members[0]["status"], members[0]["status"]),
            ]
        )
    return WIDE_COLUMNS, body


PLAN_COLUMNS = [
    "layout",
    "devices",
    "predicted GiB/dev",
    "dry-run GiB/dev",
    "measured GiB/dev (tensors)",
    "memory error",
    "dry-run error",
    "predicted samples/s",
    "measured samples/s",
    "throughput error",
    "predicted fit",
    "status",
]


def _fits(value: Any) -> str:
    return "-" if value is None else ("fits" if value else "OOM")


def predicted_tensor_bytes(row: dict[str, Any]) -> float | None:
    """The plan's peak per device without the device's reserve (CUDA context, allocator slack: in the
    fit decision, never in live tensor bytes), from its stored breakdown: what a measured peak of live
    tensor bytes is compared with. Measured on an H200 (benchmarks/results/gpu_check-h200.md), the
    reserve was the whole difference: 7 sweep members 5-25% over with it, within 1% without."""
    predicted = row.get("predicted_peak_memory_bytes")
    if predicted is None:
        return None
    try:
        reserve = json.loads(row.get("plan_json") or "{}")["memory_breakdown_bytes"].get("reserve", 0)
    except (ValueError, KeyError, TypeError, AttributeError):
        reserve = 0
    return predicted - (reserve or 0)


def plan_vs_measured(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]] | None:
    """`stx plan`'s prediction next to each measured member (repeats: medians), with the error
    (predicted / measured - 1); None when no row carries a prediction. Measured memory is the largest
    rank's peak live tensor bytes (summary.json peak_tensor_bytes_per_rank), compared with the plan's
    peak without the device's reserve (`predicted_tensor_bytes`)."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("predicted_peak_memory_bytes") is not None:
            groups.setdefault((r["label"], devices(r)), []).append(r)
    if not groups:
        return None

    def err(pred: float | None, meas: float | None) -> str:
        return "-" if pred is None or not meas else f"{pred / meas - 1:+.1%}"

    body = []
    for (label, dev), members in groups.items():
        ok = [r for r in members if r["status"] == "ok"]
        first = members[0]
        pred_mem, pred_sps = (
            first.get("predicted_peak_memory_bytes"),
            first.get("predicted_samples_per_second"),
        )
        dry_mem = first.get("dry_run_peak_memory_bytes")
        mem, sps = _median(ok, "peak_tensor_bytes_max"), _median(ok, "samples_per_second")
        body.append(
            [
                label,
                dev,
                "-" if pred_mem is None else f"{pred_mem / 2**30:.3f}",
                "-" if dry_mem is None else f"{dry_mem / 2**30:.3f}",
                "-" if mem is None else f"{mem / 2**30:.3f}",
                err(predicted_tensor_bytes(first), mem),
                err(dry_mem, mem),
                "-" if pred_sps is None else fmt_number(pred_sps),
                "-" if sps is None else fmt_number(sps),
                err(pred_sps, sps),
                _fits(first.get("predicted_fits")),
                "ok" if ok else FAILED.get(first["status"], first["status"]),
            ]
        )
    return PLAN_COLUMNS, body


def conventions_note(rows: list[dict[str, Any]]) -> str:
    """Which FLOPs convention(s) and peak(s) the TFLOPs/MFU/HFU figures use."""
    seen: dict[tuple, None] = {}
    for r in rows:
        if r["status"] != "ok" or (
            r.get("flops_convention") is None and r.get("peak_flops_per_device") is None
        ):
            continue
        summary = loads(r.get("summary_json")) or {}
        peak = r.get("peak_flops_per_device")
        key = (r.get("flops_convention"), peak, summary.get("peak_flops_source"))
        seen[key] = None
    if not seen:
        return ""
    parts = []
    for conv, peak, source in seen:
        peak_text = "peak unknown" if peak is None else f"peak {peak / 1e12:.3f} TFLOP/s per device"
        parts.append(
            f"FLOPs convention '{conv or 'as logged'}', {peak_text}" + (f" ({source})" if source else "")
        )
    return "TFLOPs/dev, MFU and HFU: " + "; ".join(parts) + "."


def markdown(header: list[str], body: list[list[str]]) -> str:
    def esc(s: str) -> str:
        return s.replace("|", "\\|")

    lines = ["| " + " | ".join(esc(h) for h in header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(esc(c) for c in row) + " |" for row in body]
    return "\n".join(lines) + "\n"


def to_csv(header: list[str], body: list[list[str]]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(header)
    writer.writerows(body)
    return buf.getvalue()


def _html_table(header: list[str], body: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    rows = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in body)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>"


# --- plots -------------------------------------------------------------------------------------


def _plt():
    # Here, not at the top: matplotlib costs 3 s to import (measured) and only plots need it; the
    # backend must be chosen before pyplot is imported.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_scaling(rows: list[dict[str, Any]], path: Path, flagged: dict[int, list[str]] | None = None) -> bool:
    """Samples/s against device count per layout, with ideal linear scaling from the smallest count
    and the scaling efficiency (measured / ideal) written at each larger count; a layout measured at
    one device count is a lone point (nothing to scale from). Suspect measurements (`flagged`) are
    drawn as red crosses and left out of the lines and efficiencies."""
    ok = [r for r in rows if r["status"] == "ok" and r.get("samples_per_second")]
    if not ok:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 5))
    doubtful = [r for r in ok if flagged and r.get("id") in flagged]
    ok = [r for r in ok if r not in doubtful]
    if doubtful:
        ax.scatter(
            [total_devices(r) for r in doubtful],
            [r["samples_per_second"] for r in doubtful],
            marker="x",
            color="red",
            label="suspect measurement (left out; see the report)",
        )
    by_label: dict[str, dict[int, list[float]]] = {}
    for r in ok:
        by_label.setdefault(r["label"], {}).setdefault(total_devices(r), []).append(r["samples_per_second"])
    for label, points in by_label.items():
        xs = sorted(points)
        ys = [statistics.median(points[x]) for x in xs]
        (line,) = ax.plot(xs, ys, marker="o", label=label)
        if len(xs) == 1:  # no smaller run of this layout to scale from: no efficiency to state
            continue
        ideal = [ys[0] * x / xs[0] for x in xs]
        ax.plot(xs, ideal, linestyle="--", color=line.get_color(), alpha=0.6)
        for x, y, i in zip(xs[1:], ys[1:], ideal[1:], strict=True):
            ax.annotate(f"{100 * y / i:.0f}%", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("devices (processes)")
    ax.set_ylabel("throughput (samples/s)")
    ax.set_title("Throughput vs devices (dashed: ideal linear scaling; % = scaling efficiency)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def plot_mfu(rows: list[dict[str, Any]], path: Path, flagged: dict[int, list[str]] | None = None) -> bool:
    """MFU per result; a suspect measurement's bar is hatched and its name says so."""
    ok = [r for r in rows if r["status"] == "ok" and r.get("mfu") is not None]
    if not ok:
        return False
    plt = _plt()
    doubtful = [r.get("id") in (flagged or {}) for r in ok]
    names = [
        f"{r['label']} @ {devices(r)} dev" + (" (suspect)" if d else "")
        for r, d in zip(ok, doubtful, strict=True)
    ]
    fig, ax = plt.subplots(figsize=(10, 2 + 0.4 * len(ok)))
    bars = ax.barh(names, [100 * r["mfu"] for r in ok])
    for bar, d in zip(bars, doubtful, strict=True):
        if d:
            bar.set_hatch("//")
            bar.set_alpha(0.4)
    ax.set_xlabel("MFU (%)")
    ax.set_title("MFU by layout\n" + textwrap.fill(conventions_note(ok), 100), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def plot_memory(rows: list[dict[str, Any]], path: Path, device_memory_gb: float | None) -> bool:
    ok = [r for r in rows if r["status"] == "ok" and r.get("peak_memory_bytes_max")]
    if not ok:
        return False
    plt = _plt()
    names = [f"{r['label']} @ {devices(r)} dev" for r in ok]
    fig, ax = plt.subplots(figsize=(10, 2 + 0.4 * len(ok)))
    ax.barh(names, [r["peak_memory_bytes_max"] / 2**30 for r in ok])
    if device_memory_gb:
        ax.axvline(
            device_memory_gb, color="red", linestyle="--", label=f"device memory {device_memory_gb:g} GiB"
        )
        ax.legend(fontsize=7)
    ax.set_xlabel("peak memory of the largest rank (GiB)")
    methods = {str((loads(r.get("summary_json")) or {}).get("peak_memory_method")) for r in ok} - {"None"}
    ax.set_title("Peak memory by layout\n" + textwrap.fill("; ".join(sorted(methods)), 100), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _device_memory_gb(rows: list[dict[str, Any]]) -> float | None:
    """The GPU memory of the recorded environment, when there was a GPU."""
    for r in rows:
        env = loads(r.get("env_json")) or {}
        for gpu in env.get("gpus") or env.get("cuda_devices") or []:
            if isinstance(gpu, dict):
                for key in ("total_memory_bytes", "memory_bytes", "total_memory"):
                    if gpu.get(key):
                        return float(gpu[key]) / 2**30
    return None


def build_report(
    store_path: Path,
    row_keys: list[str],
    col_keys: list[str],
    values: list[str],
    output: Path | None,
    fmt: str = "md",
    device_memory_gb: float | None = None,
    where: str = "",
    suspect: SuspectOptions | None = None,
) -> str:
    """The text to print (in `fmt`); with `output`, also table/wide as md + csv, report.html and PNGs."""
    with ResultsStore(store_path, create=False) as store:
        rows = store.rows(where)
    if not rows:
        raise ValueError(f"{store_path}: the store holds no results yet")
    check_keys(rows, row_keys, "--rows")
    check_keys(rows, col_keys, "--cols")
    flagged = suspects(rows, suspect)
    header, body = grid(rows, row_keys, col_keys, values, flagged)
    wheader, wbody = wide(rows)
    note = conventions_note(rows)
    title = f"{', '.join(value_title(v) for v in values)} by {' '.join(row_keys)} and {' '.join(col_keys)}"
    md = f"# {title}\n\n" + markdown(header, body) + (f"\n{note}\n" if note else "")
    md += prediction_section(rows, flagged)
    md_wide = "# All results\n\n" + markdown(wheader, wbody) + (f"\n{note}\n" if note else "")
    planned = plan_vs_measured(rows)
    if planned is not None:
        md_wide += (
            "\n# Planned vs measured (stx plan)\n\n"
            + markdown(*planned)
            + "\nError = predicted / measured - 1; memory is live tensor bytes per device (the largest "
            "rank), measured when logging.track_tensor_bytes is on (always on GPU). The predicted "
            "figure includes the device's reserve (CUDA context, allocator slack), as the fit decision "
            "does; its error is of the prediction without it, live tensor bytes against live tensor "
            "bytes. Dry run: the engine on fake tensors at the member's world size (stx plan "
            "--dry-run), its largest simulated rank, without a reserve.\n"
        )
    device_memory_gb = device_memory_gb or _device_memory_gb(rows)
    plots: list[tuple[str, Callable[[Path], bool]]] = [
        ("throughput_scaling.png", lambda p: plot_scaling(rows, p, flagged)),
        ("mfu_by_layout.png", lambda p: plot_mfu(rows, p, flagged)),
        ("memory_by_layout.png", lambda p: plot_memory(rows, p, device_memory_gb)),
    ]

    def draw(directory: Path) -> list[str]:
        """The plots as PNG files in `directory`; returned base64-encoded for the HTML page."""
        return [
            base64.b64encode((directory / name).read_bytes()).decode()
            for name, plot in plots
            if plot(directory / name)
        ]

    if output is not None:
        output.mkdir(parents=True, exist_ok=True)
        (output / "table.md").write_text(md, encoding="utf-8")
        (output / "wide.md").write_text(md_wide, encoding="utf-8")
        (output / "table.csv").write_text(to_csv(header, body), encoding="utf-8")
        (output / "wide.csv").write_text(to_csv(wheader, wbody), encoding="utf-8")
        if planned is not None:
            (output / "plan_vs_measured.csv").write_text(to_csv(*planned), encoding="utf-8")
        errors = error_table(rows, flagged, devices)
        if errors[1]:
            (output / "prediction_error.csv").write_text(to_csv(*errors), encoding="utf-8")
        page = _html_page(title, header, body, wheader, wbody, note, draw(output))
        (output / "report.html").write_text(page, encoding="utf-8")
    if fmt == "csv":
        return to_csv(header, body)
    if fmt == "html":
        if output is not None:
            return page
        with tempfile.TemporaryDirectory() as tmp:  # a self-contained page on stdout: plots inline
            return _html_page(title, header, body, wheader, wbody, note, draw(Path(tmp)))
    return md + "\n" + md_wide


def prediction_section(rows: list[dict[str, Any]], flagged: dict[int, list[str]]) -> str:
    """Markdown: predicted vs measured seconds per step per result, the error statistics, and the
    suspect measurements with their reasons (empty when no row has a prediction or a flag)."""
    header, body = error_table(rows, flagged, devices)
    text = ""
    if body:
        text += (
            "\n# Prediction error (stx plan's step time vs the measurement)\n\n"
            + markdown(header, body)
            + "\nError = predicted / measured - 1. "
            + stats_text(error_stats(rows, flagged))
            + " Results whose measurement is in doubt (repeats disagree, scaling above 100%) are left "
            "out of the statistics.\n"
        )
    lines = suspect_lines(rows, flagged, devices)
    if lines:
        text += (
            "\n# Suspect measurements (marked in the tables, left out of medians and plots; "
            "stx sweep --retry-suspect runs them again)\n\n" + "\n".join(lines) + "\n"
        )
    return text


def _html_page(
    title: str,
    header: list[str],
    body: list[list[str]],
    wheader: list[str],
    wbody: list[list[str]],
    note: str,
    images: list[str],
) -> str:
    imgs = "".join(f'<img alt="plot" src="data:image/png;base64,{b}">' for b in images)
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title><style>
body {{ font-family: sans-serif; margin: 2em; }}
table {{ border-collapse: collapse; margin-bottom: 1em; font-size: 0.9em; }}
th, td {{ border: 1px solid #bbb; padding: 4px 8px; text-align: right; }}
th:first-child, td:first-child {{ text-align: left; }}
th {{ background: #eee; }}
img {{ max-width: 100%; display: block; margin: 1em 0; }}
.note {{ color: #555; font-size: 0.9em; }}
</style></head><body>
<h1>{html.escape(title)}</h1>
{_html_table(header, body)}
<p class="note">{html.escape(note)}</p>
<h2>All results</h2>
{_html_table(wheader, wbody)}
{imgs}
</body></html>
"""


def parse_markdown_table(text: str) -> list[list[str]]:
    """The cells of the first markdown table in `text` (header first, separator dropped)."""
    rows = []
    for line in text.splitlines():
        if line.startswith("|"):
            if set(line) <= {"|", "-", ":", " "}:
                continue
            cells = [c.strip().replace("\\|", "|") for c in line.strip().strip("|").split(" | ")]
            rows.append(cells)
        elif rows:
            break
    return rows


def dumps(data: Any) -> str:
    return json.dumps(data, indent=2)
