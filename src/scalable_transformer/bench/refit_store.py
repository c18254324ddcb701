"""`stx plan --calibrate-from STORE`: the runs of a results store a refit can use, and the hardware
profile refitted from them (the fit itself is plan/refit.py's; reading the store is bench's)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from typing import Any

from ..config.load import apply_assignments, assignments_from_mapping, parse_yaml
from ..config.schema import Config
from ..config.validate import resolve
from ..errors import UsageError
from ..plan.cluster import with_nodes
from ..plan.hardware_profile import save_profile
from ..plan.refit import (
    BOUNDS,
    CLASSES,
    MIN_RUNS,
    RunSample,
    median_error,
    prediction_record,
    refit_corrections,
)
from .prediction_error import measured_seconds, measurement_in_doubt, suspects
from .results import ResultsStore


def samples_from_store(
    store_path: Any, profile_name: str, kind: str, cluster: Any = None
) -> tuple[list[RunSample], list[str]]:
    """(prediction, measured phase ms) of the store's ok runs predicted with the profile named
    `profile_name` (else, when none names it, with any profile of this `kind`), leaving out runs
    whose measurement `stx report` puts in doubt; and notes on what was left out.

    With `cluster` (the one being refitted), each run's prediction is made again from its stored
    config on that cluster: the corrections multiply the class seconds of the profile they go into.
    The stored ones came from the profile as it was when the run ended; refitted against those, an
    H200 refit learned the overhead class x2.97 on a 4 us op cost and applied it to the 12 us that
    replaced it: +29% on held-out runs instead of -10%."""
    with ResultsStore(store_path, create=False) as store:
        rows = [r for r in store.rows("status = 'ok'") if r.get("prediction_json")]
    flagged = suspects(rows)
    usable, notes = [], []
    doubt = {r["id"] for r in rows if measurement_in_doubt(flagged.get(r["id"], []))}
    if doubt:
        notes.append(f"{len(doubt)} run(s) left out: their measurement is suspect (stx report says why)")
    for r in rows:
        prediction = json.loads(r["prediction_json"])
        phases = (json.loads(r["summary_json"] or "{}")).get("phase_time_ms_median") or {}
        step = measured_seconds(r)
        if r["id"] in doubt or not prediction.get("classes") or not phases or not step:
            continue
        usable.append((RunSample(prediction, phases, step), r))
    named = [u for u in usable if u[0].prediction.get("profile") == profile_name]
    if not named:
        named = [u for u in usable if u[0].prediction.get("kind") == kind]
        if named:
            notes.append(f"no run names the profile {profile_name!r}; using the {len(named)} {kind} run(s)")
    if cluster is None:
        return [sample for sample, _ in named], notes
    again, kept = [], 0
    for sample, row in named:
        prediction = _predicted_again(row, cluster)
        if prediction is None:
            kept += 1
        again.append(dataclasses.replace(sample, prediction=prediction or sample.prediction))
    if kept:
        notes.append(f"{kept} run(s) keep their stored prediction: their config could not be predicted again")
    return again, notes


def _predicted_again(row: dict[str, Any], cluster: Any) -> dict[str, Any] | None:
    """The run's prediction on `cluster` (its nodes and processes), from its stored config; None when
    that cannot be made (no config stored, or it no longer loads)."""
    if not row.get("config_yaml") or not row.get("nproc"):
        return None
    try:
        cfg = apply_assignments(
            Config(), assignments_from_mapping(parse_yaml(row["config_yaml"], "store"), "store")
        )
        nodes, world = int(row.get("nnodes") or 1), int(row["nproc"])
        return prediction_record(resolve(cfg, world), with_nodes(cluster, nodes, max(1, world // nodes)))
    except Exception:  # a stored config from another version: its stored prediction stands
        return None


def refit_cluster(cluster: Any, store_path: Any, output: Any = None) -> tuple[Any, list[str]]:
    """`stx plan --calibrate-from STORE [--output PROFILE]`: the cluster with its profile's corrections
    refitted from the store's runs on this hardware, and the lines to print; with `output` the refitted
    profile is written there (atomically) for `--hardware`."""
    profile = cluster.profile
    if profile is None:
        raise UsageError(
            "--calibrate-from refits a hardware profile's corrections: give --hardware PROFILE "
            "(stx calibrate writes one) or a device with a built-in profile"
        )
    samples, notes = samples_from_store(store_path, profile.name, profile.kind, cluster)
    if len(samples) < MIN_RUNS:
        raise UsageError(
            f"--calibrate-from {store_path}: {len(samples)} usable run(s) for the profile {profile.name!r}, "
            f"a refit needs at least {MIN_RUNS} (ok runs whose summary has a per-class prediction and "
            "phase timers, measurement not suspect)" + "".join(f"; {n}" for n in notes)
        )
    new, fit_notes = refit_corrections(samples, profile.corrections)
    when = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    source = {
        "store": str(store_path),
        "runs": len(samples),
        "date": when,
        "previous": dict(profile.corrections),
    }
    refit = dataclasses.replace(profile, corrections=new, corrections_source=source)
    lines = [
        f"refit from {len(samples)} run(s) in {store_path}: "
        + ", ".join(f"{c} {profile.correction(c):.3g} -> {new[c]:.3g}" for c in CLASSES),
        f"median |error| of those runs' step time: {median_error(samples):.1%} before, "
        f"{median_error(samples, new):.1%} after (bounds {BOUNDS[0]:g}..{BOUNDS[1]:g} per class)",
        *notes,
        *fit_notes,
    ]
    if output:
        save_profile(refit, output)
        lines.append(f"refitted profile written: {output} (use it with --hardware {output})")
    return dataclasses.replace(cluster, profile=refit), lines
