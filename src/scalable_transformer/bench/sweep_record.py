"""Record: the results-store rows of a sweep's members (and the summary fields they copy).

A row is the member's identity and layout columns (`base_record`) merged with how it ended:
`invalid_record` for a member the config rules rejected, `result_record` for one that ran.
"""

from __future__ import annotations

import datetime as dt
import json
import warnings
from pathlib import Path
from typing import Any

from ..config.load import to_yaml
from ..config.schema import Config
from ..metrics.device_specs import detect_device_name
from ..plan.cluster import table_cluster
from ..plan.search import predict
from .sweep_spec import SweepSpec
from .sweep_types import Member


def now() -> str:
    """The current UTC time as the store keeps it (ISO 8601, seconds)."""
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def loop_seconds(run_dir: Path) -> float | None:
    """The sum of the training iterations' times, from metrics.jsonl (per-interval mean x interval)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    total, prev = 0.0, 0
    for line in path.read_text(encoding="utf-8").splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "train" and "iteration_time_ms" in rec:
            total += rec["iteration_time_ms"] / 1000 * (rec["iteration"] - prev)
            prev = rec["iteration"]
    return total or None


def record_from_summary(summary: dict[str, Any], cfg: Config | None) -> dict[str, Any]:
    """Result columns from a summary.json (and the resolved config for the layout columns)."""
    per_rank = summary.get("peak_memory_bytes_per_rank") or (
        [summary["peak_memory_bytes"]] if summary.get("peak_memory_bytes") else []
    )
    rec: dict[str, Any] = {
        k: summary.get(k)
        for k in (
            "samples_per_second",
            "tokens_per_second",
            "tflops_per_device",
            "mfu",
            "hfu",
            "flops_convention",
            "peak_flops_per_device",
            "seq_length",
            "global_batch_size",
            "layout",
        )
    }
    rec["num_parameters"] = summary.get("num_parameters")
    rec["peak_memory_bytes_max"] = max(per_rank) if per_rank else None
    tensor_bytes = [v for v in summary.get("peak_tensor_bytes_per_rank") or [] if v is not None]
    rec["peak_tensor_bytes_max"] = max(tensor_bytes) if tensor_bytes else None
    rec["summary_json"] = json.dumps(summary)
    rec["prediction_json"] = json.dumps(summary["prediction"]) if summary.get("prediction") else None
    rec["measured_step_seconds"] = summary.get("median_iteration_seconds")
    rec["iteration_seconds_iqr"] = summary.get("iteration_seconds_iqr")
    rec.update(telemetry_columns(summary))
    if cfg is not None:
        rec.update(config_columns(cfg))
    return rec


TELEMETRY_COLUMNS = (
    "device_util",
    "device_power_w",
    "device_power_limit_w",
    "device_memory_used_bytes",
    "device_memory_total_bytes",
    "cpu_process_util",
    "cpu_system_util",
    "energy_j_per_sample",
    "energy_j_per_token",
    "pipeline_bubble_measured",
    "straggler_rank",
)


def telemetry_columns(summary: dict[str, Any]) -> dict[str, Any]:
    """The telemetry and communication columns of a run's summary (absent keys: NULL)."""
    rec = {k: summary.get(k) for k in TELEMETRY_COLUMNS}
    notes = summary.get("telemetry_notes")
    rec["telemetry_note"] = "; ".join(notes) if notes else None
    phases = summary.get("phase_time_ms_median") or {}
    rec["grad_sync_ms"] = phases.get("all-grads-sync")
    comm = summary.get("comm_time_ms_median") or {}
    rec["comm_ms"] = sum(comm.values()) if comm else None
    return rec


def config_columns(cfg: Config) -> dict[str, Any]:
    p, t = cfg.parallel, cfg.train
    return {
        "model": cfg.model.type,
        "seq_length": cfg.model.seq_length,
        "global_batch_size": t.global_batch_size,
        "micro_batch_size": t.micro_batch_size,
        "gradient_accumulation_steps": t.gradient_accumulation_steps,
        "zero_stage": p.zero_stage,
        "tp": p.tp,
        "pp": p.pp,
        "dp": p.dp,
        "offload": int(bool(p.offload_optimizer or p.offload_param)),
        "activation_checkpointing": p.activation_checkpointing,
        "precision": t.precision,
        "config_yaml": to_yaml(cfg),
    }


def base_record(spec: SweepSpec, m: Member) -> dict[str, Any]:
    """What identifies a member and its layout, whatever its outcome."""
    rec: dict[str, Any] = {
        "config_hash": m.config_hash,
        "repeat": m.repeat,
        "source": "stx",
        "sweep": spec.name,
        "label": m.label,
        "nproc": m.nproc * m.nodes,  # processes of the job; the report shows nodes*per-node
        "nnodes": m.nodes,
        "steps": spec.steps,
        "overrides_json": json.dumps(dict(kv.split("=", 1) for kv in m.overrides)),
    }
    if m.cfg is not None:
        rec.update(config_columns(m.cfg))
        rec.update(prediction_columns(m.cfg, m.nproc, dry_run=spec.dry_run))
    return rec


_PREDICTIONS: dict[tuple[str, int, bool], dict[str, Any]] = {}


def prediction_columns(cfg: Config, nproc: int, dry_run: bool = False) -> dict[str, Any]:
    """The planner's prediction for a member (stx plan on this machine: the detected GPU's table
    entry, or this CPU measured), so the report can put it next to the measurement; with `dry_run`
    also the dry run's peak memory per device (the engine on fake tensors, dryrun/dry_run.py). A
    planning problem is reported as a warning and leaves the columns empty; it never stops a sweep."""
    key = (to_yaml(cfg), nproc, dry_run)
    if key in _PREDICTIONS:
        return _PREDICTIONS[key]
    try:
        # here, not at the top: measuring this CPU takes torch (2-4 s to import, measured), which
        # `stx sweep --dry-run` never needs
        from ..calibrate.this_machine import cpu_cluster

        cluster = None
        if cfg.train.device != "cpu":
            # Here, not at the top: torch costs 5 s to import (measured) and `stx sweep --dry-run` and
            # CPU members never need it.
            import torch

            if torch.cuda.is_available():
                name = cfg.logging.device_name or detect_device_name()
                cluster = table_cluster(name, 1, nproc) if name else None
        if cluster is None:
            cluster = cpu_cluster(nproc, cfg.train.precision)
        plan = predict(cfg, cluster)
        if dry_run:
            # here, not at the top: dryrun/ imports torch (5-8 s, measured); only a sweep with dry_run: true
            from ..dryrun.dry_run import verify

            plan = verify(plan, cfg, cluster)  # a failed dry run is recorded in plan_json, not raised
        columns = {
            "predicted_peak_memory_bytes": plan.peak_memory_bytes,
            "predicted_step_seconds": plan.time.total,
            "predicted_samples_per_second": plan.samples_per_second,
            "predicted_fits": int(plan.fits),
            "plan_json": json.dumps(plan.to_dict()),
            "dry_run_peak_memory_bytes": (plan.dry_run or {}).get("peak_memory_bytes"),
        }
    except Exception as e:  # a prediction is an aid: report it, never fail the sweep for it
        warnings.warn(f"stx plan could not predict this member: {e}", RuntimeWarning, stacklevel=2)
        columns = {}
    _PREDICTIONS[key] = columns
    return columns


def invalid_record(spec: SweepSpec, m: Member, env_json: str) -> dict[str, Any]:
    """The row of a member that never runs: its config breaks a rule (the reason is the error)."""
    return base_record(spec, m) | {
        "status": "invalid",
        "error": m.invalid_reason,
        "env_json": env_json,
        "finished_at": now(),
    }


def result_record(outcome: dict[str, Any], m: Member) -> dict[str, Any]:
    """outcome (status, error, times, run_dir: what execute reports) plus, for an ok member, the
    numbers of its summary.json and loop time, and the environment its ranks recorded."""
    record = dict(outcome)
    run_dir = Path(outcome["run_dir"])
    if record["status"] == "ok":
        summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
        record.update(record_from_summary(summary, m.cfg))
        loop = loop_seconds(run_dir)
        record["loop_seconds"] = loop
        record["overhead_seconds"] = record["wall_seconds"] - loop if loop is not None else None
    env_path = run_dir / "env.json"
    if env_path.is_file():
        record["env_json"] = env_path.read_text(encoding="utf-8")
    return record
