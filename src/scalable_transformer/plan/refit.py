"""Predictions that learn: the planner's step time stored beside every run's measurement
(`prediction_record`; calibrate/this_machine.py `run_prediction` builds the cluster), and the
op-class corrections of a hardware profile refitted from stored runs
(`refit_corrections`, `stx plan --calibrate-from`).

The refit matches each run's measured phase timers against the prediction's seconds per phase and op
class (`StepTime.classes`) and solves a bounded least-squares problem for one multiplier per op class;
docs/PLANNER.md ("Prediction error and refits") states the bounds and the minimum number of runs.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

import numpy as np

from ..config.schema import Config
from .speed import step_time


def prediction_record(cfg: Config, cluster: Any) -> dict[str, Any]:
    """{step_seconds, breakdown, classes, hardware, cluster} of `plan.speed.step_time` for a resolved
    config on a cluster (seconds per optimizer step; classes: phase -> op class -> seconds, empty when
    the time model does not split by op class)."""

    st = step_time(cfg, cluster)
    profile = getattr(cluster, "profile", None)
    hardware = f"{profile.name} ({profile.source})" if profile is not None else cluster.source
    classes = getattr(st, "classes", None) or {}
    return {
        "step_seconds": st.total,
        "breakdown": dict(st.breakdown),
        "classes": {phase: dict(parts) for phase, parts in classes.items()},
        "hardware": hardware,
        "cluster": cluster.name,
        "kind": cluster.kind,
        "cpu_share": cluster.cpu_share if cluster.kind == "cpu" else None,
        "corrections": dict(profile.corrections) if profile is not None else None,
        "profile": profile.name if profile is not None else None,
    }


PROFILE_ENV = "STX_HARDWARE_PROFILE"


# --- refitting the op-class corrections from stored runs -------------------------------------------

CLASSES = ("gemm", "attention", "memory_bound", "overhead", "communication")
# A multiplier stays within [0.25, 4]: a class 4x faster or slower than the profile's kernel rates is a
# sign of a wrong profile (re-run stx calibrate), not something a multiplier should absorb.
BOUNDS = (0.25, 4.0)
MIN_RUNS = 3  # runs (ok, with a per-class prediction, measurement not in doubt) a refit needs
# a class is fitted only where it is at least this share of the predicted seconds of the runs used;
# below it the measurements say nothing about it and it keeps the multiplier it had
MIN_CLASS_SHARE = 0.02
# measured timer (Megatron's names, train/measurement.py) -> the predicted phases it times; the
# tensor-parallel collectives run inside forward and backward compute, so with them (or a pipeline)
# forward and backward are matched together
TIMER_PHASES: dict[str, tuple[str, ...]] = {
    "forward-compute": ("forward",),
    "backward-compute": ("backward",),
    "all-grads-sync": ("grads_sync",),
    "optimizer": ("optimizer", "offload"),
}
JOINT_COMPUTE = ("forward", "backward", "tp_communication", "pipeline_bubble", "pipeline_p2p")
JOINT_TIMERS = ("forward-compute", "backward-compute", "forward-backward")


@dataclasses.dataclass(frozen=True)
class RunSample:
    """One stored run for a refit: its prediction (summary.json `prediction`), its measured phase
    timers (ms per step, medians) and its measured median step (seconds)."""

    prediction: dict[str, Any]
    phases_ms: dict[str, float]
    step_seconds: float


def corrected_step(prediction: dict[str, Any], corrections: dict[str, float]) -> float:
    """The prediction's seconds per step had it been made with `corrections` instead of its own."""
    raw = _raw_classes(prediction)
    used = prediction.get("corrections") or {}
    change = sum(
        s * (float(corrections.get(c, 1.0)) - float(used.get(c, 1.0)))
        for by in raw.values()
        for c, s in by.items()
    )
    return float(prediction["step_seconds"]) + change


def _raw_classes(prediction: dict[str, Any]) -> dict[str, dict[str, float]]:
    """The prediction's seconds per phase and class before the corrections it was made with."""
    used = prediction.get("corrections") or {}
    return {
        phase: {c: s / float(used.get(c, 1.0) or 1.0) for c, s in by_class.items()}
        for phase, by_class in (prediction.get("classes") or {}).items()
    }


def equations(prediction: dict[str, Any], phases_ms: dict[str, float]) -> list[tuple[list[float], float]]:
    """(seconds per class, measured seconds) for each measured timer group of one run: what the
    corrections multiply and what they should add up to."""
    raw = _raw_classes(prediction)

    def row(phases: tuple[str, ...]) -> list[float]:
        return [sum(raw.get(ph, {}).get(c, 0.0) for ph in phases) for c in CLASSES]

    joint = any(raw.get(ph) for ph in JOINT_COMPUTE[2:]) or "forward-backward" in phases_ms
    groups: list[tuple[tuple[str, ...], tuple[str, ...]]] = []
    if joint:
        groups.append((JOINT_TIMERS, JOINT_COMPUTE))
    for timer, phases in TIMER_PHASES.items():
        if not (joint and timer in JOINT_TIMERS):
            groups.append(((timer,), phases))
    out = []
    for timers, phases in groups:
        measured = [phases_ms[t] / 1000 for t in timers if t in phases_ms]
        predicted = row(phases)
        if measured and sum(predicted) > 0:
            out.append((predicted, sum(measured)))
    return out


def _bounded_least_squares(a: Any, b: Any, x0: Any, free: Any) -> Any:
    """min |A x - b|^2 with BOUNDS on the free entries of x (the others stay at x0): projected
    coordinate descent, exact on each coordinate and convergent for this convex problem."""

    x = np.array(x0, dtype=float)
    norms = (a * a).sum(axis=0)
    for _ in range(2000):
        before = x.copy()
        for j in np.flatnonzero(free):
            if norms[j] > 0:
                step = a[:, j] @ (a @ x - b) / norms[j]
                x[j] = min(BOUNDS[1], max(BOUNDS[0], x[j] - step))
        if np.max(np.abs(x - before)) < 1e-10:
            break
    return x


def _system(samples: list[RunSample]) -> tuple[Any, Any]:
    """Rows (seconds per class) and right-hand sides (measured seconds) of every run's timer groups
    and of its whole step, each divided by the run's measured step so every run counts alike."""

    rows, rhs = [], []
    for sample in samples:
        t = sample.step_seconds
        for pred, measured in equations(sample.prediction, sample.phases_ms):
            rows.append([v / t for v in pred])
            rhs.append(measured / t)
        raw = _raw_classes(sample.prediction)
        used = sample.prediction.get("corrections") or {}
        per_class = [sum(by.get(c, 0.0) for by in raw.values()) for c in CLASSES]
        # what the prediction holds besides its classes (zero when the classes are the whole step)
        rest = float(sample.prediction["step_seconds"]) - sum(
            s * float(used.get(c, 1.0)) for c, s in zip(CLASSES, per_class, strict=True)
        )
        rows.append([v / t for v in per_class])
        rhs.append((t - rest) / t)
    return np.array(rows), np.array(rhs)


def refit_corrections(
    samples: list[RunSample], current: dict[str, float]
) -> tuple[dict[str, float], list[str]]:
    """New corrections (op class -> multiplier) from stored runs, and notes on what was fitted: the
    least absolute deviations (iteratively reweighted bounded least squares) of the runs' timer
    groups and whole steps, relative to each run's step, so one disturbed phase moves the fit less
    than it would squared; classes under MIN_CLASS_SHARE keep `current`."""

    if len(samples) < MIN_RUNS:
        raise ValueError(
            f"a refit needs at least {MIN_RUNS} runs with a per-class prediction, got {len(samples)}"
        )
    a, b = _system(samples)
    if not a.size or a.sum() <= 0:
        raise ValueError("no run's prediction splits its seconds by op class: nothing to refit")
    share = a.sum(axis=0) / a.sum()
    free = share >= MIN_CLASS_SHARE
    x0 = np.array([float(current.get(c, 1.0)) for c in CLASSES])
    x = _bounded_least_squares(a, b, np.where(free, np.clip(x0, *BOUNDS), x0), free)
    for _ in range(100):  # least absolute deviations: weights 1 / |residual|
        weight = np.sqrt(1.0 / np.maximum(np.abs(a @ x - b), 1e-4))
        x = _bounded_least_squares(a * weight[:, None], b * weight, x, free)
    notes = []
    for j, c in enumerate(CLASSES):
        if not free[j]:
            notes.append(f"{c}: kept {x0[j]:.3g} ({share[j]:.1%} of predicted seconds: too few to fit)")
        elif x[j] in BOUNDS:
            notes.append(f"{c}: {x[j]:.3g}, at its bound {BOUNDS[0]:g}..{BOUNDS[1]:g}")
    return {c: float(x[j]) for j, c in enumerate(CLASSES)}, notes


def median_error(samples: list[RunSample], corrections: dict[str, float] | None = None) -> float:
    """Median |predicted / measured - 1| of the runs' steps (with `corrections`: as refitted)."""

    return statistics.median(
        abs(
            (corrected_step(s.prediction, corrections) if corrections else s.prediction["step_seconds"])
            / s.step_seconds
            - 1
        )
        for s in samples
    )
