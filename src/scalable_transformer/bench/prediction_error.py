"""How far the planner's step time was from each stored measurement, and which measurements cannot be
right.

Prediction error = predicted / measured seconds per step - 1, per result; the summary gives the median
and 90th percentile of |error| and the Spearman rank correlation of predicted and measured throughput
over the layouts (1: the planner ranked the layouts in the measured order).

A measurement is *suspect* when
- it is more than `far_factor` (default 2x) from its prediction, either way;
- it is a repeat of a member slower than the member's fastest repeat by more than the noise: the
  relative spread exceeds `repeat_noise` (default 3) within-run interquartile ranges of the iteration
  time and `repeat_floor` (default 10%); interference on a shared machine only ever slows a run down,
  so the slower repeats are the suspect ones;
- it is the smaller device count of a layout whose scaling efficiency to the next count is above
  100% + `scaling_tolerance` (default 5%): more than linear speed-up says the smaller run was slowed.
Suspect rows are marked in the tables, left out of the error statistics where the measurement itself
is in doubt (repeats, scaling) and drawn apart in the plots; `stx sweep --retry-suspect` runs them again.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
from collections.abc import Iterable
from typing import Any

import numpy as np

from .results import loads


@dataclasses.dataclass(frozen=True)
class SuspectOptions:
    """Thresholds of the suspect checks (module docstring): factors and fractions, no units."""

    far_factor: float = 2.0
    repeat_noise: float = 3.0
    repeat_floor: float = 0.10
    scaling_tolerance: float = 0.05

    def __post_init__(self) -> None:
        if not self.far_factor > 1.0:
            raise ValueError(f"the suspect factor must be above 1 (2 = twice or half), got {self.far_factor}")


# reasons that put the measurement itself in doubt (left out of the error statistics)
MEASUREMENT_REASONS = ("repeats disagree", "scaling")


def predicted_seconds(row: dict[str, Any]) -> float | None:
    """Seconds per step the planner predicted: the run's own prediction (summary.json), else the
    sweep's stx plan column."""
    prediction = loads(row.get("prediction_json")) or {}
    value = prediction.get("step_seconds", row.get("predicted_step_seconds"))
    return float(value) if value else None


def measured_seconds(row: dict[str, Any]) -> float | None:
    """The measured median seconds per step; older rows: global batch / samples per second."""
    if row.get("measured_step_seconds"):
        return float(row["measured_step_seconds"])
    sps, gbs = row.get("samples_per_second"), row.get("global_batch_size")
    return gbs / sps if sps and gbs else None


def _ok(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if r["status"] == "ok" and measured_seconds(r)]


def _far(rows: list[dict[str, Any]], opts: SuspectOptions, out: dict[int, list[str]]) -> None:
    for r in rows:
        pred, meas = predicted_seconds(r), measured_seconds(r)
        if pred and meas and not (1 / opts.far_factor <= meas / pred <= opts.far_factor):
            out.setdefault(r["id"], []).append(
                f"far from its prediction: measured {meas:.4g} s/step, predicted {pred:.4g} s/step "
                f"({meas / pred:.2f}x; limit {opts.far_factor:g}x either way)"
            )


def _repeats(rows: list[dict[str, Any]], opts: SuspectOptions, out: dict[int, list[str]]) -> None:
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(r["config_hash"], []).append(r)
    for members in groups.values():
        if len(members) < 2:
            continue
        times = {r["id"]: measured_seconds(r) or 0.0 for r in members}
        fastest = min(times.values())
        iqrs = [
            r["iteration_seconds_iqr"] / times[r["id"]] for r in members if r.get("iteration_seconds_iqr")
        ]
        noise = max(iqrs) if iqrs else 0.0
        limit = max(opts.repeat_noise * noise, opts.repeat_floor)
        for r in members:
            spread = times[r["id"]] / fastest - 1
            if spread > limit:
                out.setdefault(r["id"], []).append(
                    f"repeats disagree: repeat {r['repeat']} is {spread:.0%} slower than the fastest repeat "
                    f"(limit {limit:.0%}: {opts.repeat_noise:g} x the within-run IQR {noise:.0%}, "
                    f"at least {opts.repeat_floor:.0%})"
                )


def _scaling(rows: list[dict[str, Any]], opts: SuspectOptions, out: dict[int, list[str]]) -> None:
    """Scaling efficiency between consecutive device counts of one layout, from the median throughput
    of the repeats not already in doubt."""
    by_label: dict[str, dict[int, list[dict[str, Any]]]] = {}
    for r in rows:
        if r.get("samples_per_second") and not any(
            reason.startswith("repeats") for reason in out.get(r["id"], [])
        ):
            by_label.setdefault(r["label"], {}).setdefault(int(r.get("nproc") or 1), []).append(r)
    for label, counts in by_label.items():
        xs = sorted(counts)
        sps = {x: statistics.median(r["samples_per_second"] for r in counts[x]) for x in xs}
        for a, b in itertools.pairwise(xs):
            efficiency = (sps[b] / sps[a]) / (b / a)
            if efficiency > 1 + opts.scaling_tolerance:
                for r in counts[a]:
                    out.setdefault(r["id"], []).append(
                        f"scaling: efficiency {efficiency:.0%} from {a} to {b} devices of '{label}' "
                        f"(above {1 + opts.scaling_tolerance:.0%}): this {a}-device run was likely slowed"
                    )


def suspects(rows: list[dict[str, Any]], opts: SuspectOptions | None = None) -> dict[int, list[str]]:
    """Row id -> the reasons its measurement is suspect (rows need `id`, as ResultsStore.rows gives)."""
    opts = opts or SuspectOptions()
    ok = _ok(rows)
    out: dict[int, list[str]] = {}
    _far(ok, opts, out)
    _repeats(ok, opts, out)
    _scaling(ok, opts, out)
    return out


def measurement_in_doubt(reasons: list[str]) -> bool:
    return any(reason.startswith(MEASUREMENT_REASONS) for reason in reasons)


def spearman(a: list[float], b: list[float]) -> float | None:
    """Spearman's rank correlation (ties get their average rank); None below 3 points or when one
    side is constant."""
    if len(a) < 3:
        return None

    def ranks(values: list[float]) -> np.ndarray:
        x = np.asarray(values, dtype=float)
        order = np.argsort(x, kind="mergesort")
        r = np.empty(len(x))
        r[order] = np.arange(1, len(x) + 1)
        for v in np.unique(x):  # ties: the mean of their ranks
            tied = x == v
            r[tied] = r[tied].mean()
        return r

    ra, rb = ranks(a), ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return None
    return float(np.corrcoef(ra, rb)[0, 1])


@dataclasses.dataclass(frozen=True)
class ErrorStats:
    """Prediction error over the trusted results: count, median and 90th percentile of |error|
    (fractions), Spearman of predicted vs measured throughput over layouts, layouts compared."""

    n: int
    median_abs: float | None
    p90_abs: float | None
    spearman: float | None
    layouts: int


def error_stats(rows: list[dict[str, Any]], flagged: dict[int, list[str]]) -> ErrorStats:
    """Statistics of predicted / measured - 1 over ok rows with a prediction whose measurement is not
    in doubt (a row only far from its prediction counts: that may be the model's error)."""
    pairs: list[tuple[dict[str, Any], float, float]] = []  # row, predicted, measured s/step
    for r in _ok(rows):
        pred, meas = predicted_seconds(r), measured_seconds(r)
        if pred and meas and not measurement_in_doubt(flagged.get(r["id"], [])):
            pairs.append((r, pred, meas))
    errors = [abs(pred / meas - 1) for _, pred, meas in pairs]
    layouts: dict[tuple, list[tuple[dict[str, Any], float, float]]] = {}
    for pair in pairs:
        layouts.setdefault((pair[0]["label"], pair[0].get("nproc")), []).append(pair)
    pred_tp, meas_tp = [], []
    for members in layouts.values():  # throughput: samples per second (global batch / s per step)
        gbs = members[0][0].get("global_batch_size") or 1
        pred_tp.append(gbs / statistics.median(p for _, p, _ in members))
        meas_tp.append(gbs / statistics.median(m for _, _, m in members))
    return ErrorStats(
        n=len(errors),
        median_abs=float(np.median(errors)) if errors else None,
        p90_abs=float(np.percentile(errors, 90)) if errors else None,
        spearman=spearman(pred_tp, meas_tp),
        layouts=len(layouts),
    )


ERROR_COLUMNS = ["layout", "devices", "repeat", "predicted s/step", "measured s/step", "error", "suspect"]


def error_table(
    rows: list[dict[str, Any]], flagged: dict[int, list[str]], devices: Any
) -> tuple[list[str], list[list[str]]]:
    """One line per ok result with a prediction: predicted and measured seconds per step, the error
    and the suspect reasons (`devices`: the report's device-column function)."""
    body = []
    for r in _ok(rows):
        pred, meas = predicted_seconds(r), measured_seconds(r)
        if not pred or not meas:
            continue
        reasons = flagged.get(r["id"], [])
        body.append(
            [
                r["label"] or "",
                devices(r),
                str(r.get("repeat", 0)),
                f"{pred:.4g}",
                f"{meas:.4g}",
                f"{pred / meas - 1:+.1%}",
                "; ".join(reason.split(":")[0] for reason in reasons) or "-",
            ]
        )
    return ERROR_COLUMNS, body


def stats_text(stats: ErrorStats) -> str:
    if not stats.n:
        return "No trusted result with a prediction: no prediction error to state."
    rho = "n/a (fewer than 3 layouts)" if stats.spearman is None else f"{stats.spearman:.2f}"
    order = "" if stats.spearman is None else (" (same order)" if stats.spearman > 0.999 else "")
    return (
        f"Prediction error over {stats.n} trusted result(s): median |error| {stats.median_abs:.1%}, "
        f"P90 |error| {stats.p90_abs:.1%}; Spearman rank correlation of predicted vs measured "
        f"samples/s over {stats.layouts} layout(s): {rho}{order}."
    )


def suspect_lines(rows: list[dict[str, Any]], flagged: dict[int, list[str]], devices: Any) -> list[str]:
    """'- label @ 2 devices, repeat 0: reason' for every flagged row."""
    by_id = {r["id"]: r for r in rows}
    lines = []
    for rid, reasons in flagged.items():
        r = by_id[rid]
        for reason in reasons:
            lines.append(f"- {r['label']} @ {devices(r)} device(s), repeat {r.get('repeat', 0)}: {reason}")
    return lines
