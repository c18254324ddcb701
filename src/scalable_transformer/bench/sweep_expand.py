"""Expand: the members of a sweep, planned from its `SweepSpec` without running anything, their
identity (`config_hash`), and which of them a store does not hold yet (`to_run`)."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
from pathlib import Path

from ..config.load import load_config, preset_names, to_yaml
from ..config.rules import layout_label
from ..config.schema import Config
from ..config.validate import resolve
from ..errors import ConfigError
from .prediction_error import suspects
from .results import STATUSES, ResultsStore
from .sweep_spec import JOB_AXES, SweepSpec, common_overrides
from .sweep_types import Member


def _label(base: str, point: dict[str, str], cfg: Config | None) -> str:
    """The report row: 'tiny-gpt hidden_size=32 tp=2 pp=1 zero3+offload' (the other axes' values, then
    the layout label without dp); dp and nproc are the columns."""
    name = Path(base).stem if base not in preset_names() else base
    parts = [name]
    parts += [
        f"{k.split('.')[-1]}={v}" for k, v in point.items() if k not in JOB_AXES and "parallel" not in k
    ]
    if cfg is None:
        parts += [f"{k.split('.')[-1]}={v}" for k, v in point.items() if "parallel" in k]
        return " ".join(parts)
    return " ".join([*parts, layout_label(cfg, with_dp=False)])


def config_hash(cfg: Config, nproc: int, steps: int, nodes: int = 1) -> str:
    """Identity of a member: the resolved config without where its run directory goes, plus nproc
    (per node), nodes and steps. Stable across processes and machines (a sha256 of sorted YAML);
    one node hashes as before nodes existed, so older stores still match."""
    neutral = dataclasses.replace(
        cfg, logging=dataclasses.replace(cfg.logging, run_dir="", run_name=None, tensorboard_dir=None)
    )
    identity: dict[str, object] = {"config": to_yaml(neutral), "nproc": nproc, "steps": steps}
    if nodes != 1:
        identity["nodes"] = nodes
    text = json.dumps(identity, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _invalid_hash(spec: SweepSpec, overrides: list[str], nproc: int, nodes: int = 1) -> str:
    identity: dict[str, object] = {
        "base": spec.base,
        "overrides": sorted(overrides),
        "nproc": nproc,
        "steps": spec.steps,
    }
    if nodes != 1:
        identity["nodes"] = nodes
    text = json.dumps(identity)
    return "invalid-" + hashlib.sha256(text.encode()).hexdigest()[:12]


def expand(spec: SweepSpec) -> tuple[list[Member], int]:
    """Every member of the grid (x repeats) and how many the filters left out."""
    keys = list(spec.axes)
    members, filtered = [], 0
    if spec.members:  # an explicit list (e.g. written by `stx plan --search --emit-sweep`)
        points = [dict(m) for m in spec.members]
    else:
        points = [
            dict(zip(keys, values, strict=True))
            for values in (itertools.product(*(spec.axes[k] for k in keys)) if keys else [()])
        ]
    for point in points:
        if any(f.matches(point) for f in spec.filters):
            filtered += 1
            continue
        nproc = int(point.get("nproc", "1"))
        nodes = int(point.get("nodes", "1"))
        overrides = [f"{k}={v}" for k, v in point.items() if k not in JOB_AXES]
        cfg: Config | None = None
        reason = None
        try:
            loaded = load_config(spec.base, [*common_overrides(spec), *overrides])
        except ConfigError as e:
            loaded, reason = None, str(e)
        if loaded is not None:
            try:
                cfg = resolve(loaded, world_size=nproc * nodes)
            except ConfigError as e:
                reason = str(e)
        digest = (
            config_hash(cfg, nproc, spec.steps, nodes)
            if cfg
            else _invalid_hash(spec, overrides, nproc, nodes)
        )
        timeout, memory = spec.timeout_seconds, spec.memory_limit_mb
        for rule in spec.limits:
            if rule.when.matches(point):
                timeout = rule.timeout_seconds if rule.timeout_seconds is not None else timeout
                memory = rule.memory_limit_mb if rule.memory_limit_mb is not None else memory
                break
        for repeat in range(spec.repeats):
            members.append(
                Member(
                    point=point,
                    nproc=nproc,
                    repeat=repeat,
                    overrides=overrides,
                    label=_label(spec.base, point, cfg or loaded),
                    config_hash=digest,
                    cfg=cfg,
                    invalid_reason=reason,
                    timeout_seconds=timeout,
                    memory_limit_mb=memory,
                    nodes=nodes,
                )
            )
    return members, filtered


def to_run(
    members: list[Member],
    stored: dict[tuple[str, int], str],
    retry_failed: bool,
    rerun: frozenset[tuple[str, int]] = frozenset(),
) -> list[Member]:
    """The valid members the store does not hold yet (any final status counts as done), plus, with
    retry_failed, those stored as oom / timeout / crashed, plus the (config_hash, repeat) in `rerun`
    (the suspect measurements, --retry-suspect)."""
    todo = []
    for m in members:
        status = stored.get((m.config_hash, m.repeat))
        again = (retry_failed and status != "ok") or (m.config_hash, m.repeat) in rerun
        if m.invalid_reason or (status in STATUSES and not again):
            continue
        todo.append(m)
    return todo


def suspect_members(store: ResultsStore, spec: SweepSpec) -> frozenset[tuple[str, int]]:
    """(config_hash, repeat) of this sweep's stored results whose measurement `stx report` flags as
    suspect (bench/prediction_error.py, default thresholds)."""
    rows = store.rows("sweep = ?", (spec.name,))
    flagged = suspects(rows)
    return frozenset((r["config_hash"], r["repeat"]) for r in rows if r["id"] in flagged)
