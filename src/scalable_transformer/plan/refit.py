"""Predictions that learn: the planner's step time stored beside every run's measurement
(`run_prediction`), and the op-class corrections of a hardware profile refitted from stored runs
(`refit_corrections`, `stx plan --calibrate-from`).

The refit matches each run's measured phase timers against the prediction's seconds per phase and op
class (`StepTime.classes`) and solves a bounded least-squares problem for one multiplier per op class;
docs/PLANNER.md ("Prediction error and refits") states the bounds and the minimum number of runs.
"""

from __future__ import annotations

import os
from typing import Any

from ..config.schema import Config


def _gpu_cluster(world: int) -> Any:
    """The table device matching torch.cuda's device name, as nodes x LOCAL_WORLD_SIZE devices."""
    import torch

    from ..metrics.device_specs import detect_device_name
    from .cluster import table_cluster

    if not torch.cuda.is_available():
        raise ValueError("the run was on CUDA, but there is no CUDA device now; no prediction")
    name = detect_device_name()
    if name is None:
        raise ValueError(
            f"the GPU {torch.cuda.get_device_name()!r} is not in the device table "
            "(metrics/device_specs.py); no prediction"
        )
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return table_cluster(name, max(1, world // max(1, per_node)), min(per_node, world))


def _cpu_cluster_after_run(world: int, dtype: str) -> Any:
    """This CPU as `world` processes. The 1-minute load average read at the end of a run counts the
    run's own threads; they are taken out again so the share is what other work left the job."""
    import dataclasses

    from .cluster import cpu_cluster

    cluster = cpu_cluster(world, dtype)
    if cluster.load_average is None:
        return cluster
    cores = os.cpu_count() or 1
    own = world * cluster.threads
    others = max(0.0, cluster.load_average - own)
    return dataclasses.replace(cluster, cpu_share=min(1.0, cores / (others + own)))


def prediction_record(cfg: Config, cluster: Any) -> dict[str, Any]:
    """{step_seconds, breakdown, classes, hardware, cluster} of `plan.speed.step_time` for a resolved
    config on a cluster (seconds per optimizer step; classes: phase -> op class -> seconds, empty when
    the time model does not split by op class)."""
    from .speed import step_time

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
        "corrections": dict(profile.corrections) if profile is not None else None,
    }


def run_prediction(cfg: Config, world: int, device_type: str) -> dict[str, Any]:
    """{"prediction": {...}} for a finished run's resolved config on the hardware it ran on (this CPU
    as `world` processes, measured and cached; or the table GPU matching torch.cuda's device name), or
    {"prediction_error": "..."} saying why there is none. Never raises: a prediction is an aid."""
    try:
        if device_type == "cuda":
            cluster = _gpu_cluster(world)
        else:
            cluster = _cpu_cluster_after_run(world, cfg.train.precision)
        return {"prediction": prediction_record(cfg, cluster)}
    except Exception as e:  # reported in summary.json, never fatal
        return {"prediction_error": f"{type(e).__name__}: {e}"}
