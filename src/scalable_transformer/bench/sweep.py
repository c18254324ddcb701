"""`stx sweep SWEEP.yaml`: run a grid of layouts, each as its own `stx launch` job, and store every result.

A sweep file:

    base: tiny-gpt                 # preset or config path (relative to the sweep file)
    overrides: [model.num_layers=1]
    axes:                          # cartesian product; any config key (dotted or alias) or nproc
      nproc: [1, 2]
      parallel.zero_stage: [0, 3]
    # or, instead of axes, explicit members (what `stx plan --search --emit-sweep` writes):
    # members: [{nproc: 2, parallel.tp: 2}, {nproc: 2, parallel.zero_stage: 3}]
    steps: 5                       # train.train_iters of every member
    warmup_steps: 1                # logging.warmup_iters: excluded from the throughput median
    timeout_seconds: 600           # per member; the whole job is killed past it -> timeout
    repeats: 1
    memory_limit_mb: 4000          # RLIMIT_AS of every process of a member (optional)
    filters:                       # members matching any condition are left out
      - {nproc: 1, parallel.zero_stage: 3}
    limits:                        # per-member timeout / memory limit, first matching rule wins
      - {when: {parallel.zero_stage: 3}, timeout_seconds: 60}
    store: results.sqlite          # default: results.sqlite beside the sweep file

The identity of a member (what a restarted sweep skips) is a hash of its resolved config (run
directory names excluded), its process count and its step count; `repeat` tells repeats apart.

A sweep is four steps, one module each: expand (here: the members, planned from the sweep file
without running anything), execute (`sweep_execute`: one member through a `Launcher`), record
(`sweep_record`: the rows of the results store) and present (`sweep_present`: the console);
`run_sweep` composes them. The file format itself is checked in `sweep_spec`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import re
import time
from pathlib import Path

from ..config.load import load_config, preset_names, to_yaml
from ..config.rules import layout_label
from ..config.schema import Config
from ..config.validate import resolve
from ..errors import ConfigError, SweepError
from ..launch.launcher import Launcher
from .results import STATUSES, ResultsStore
from .sweep_execute import OOM_PATTERNS, classify, run_member
from .sweep_present import SweepConsole
from .sweep_record import base_record, config_columns, invalid_record, record_from_summary, result_record
from .sweep_spec import JOB_AXES, KEYS, Condition, Limit, SweepSpec, common_overrides, fmt_value, load_sweep

__all__ = [
    "KEYS",
    "OOM_PATTERNS",
    "Condition",
    "Limit",
    "Member",
    "SweepError",
    "SweepOptions",
    "SweepOutcome",
    "SweepSpec",
    "classify",
    "common_overrides",
    "config_columns",
    "config_hash",
    "expand",
    "fmt_value",
    "load_sweep",
    "record_from_summary",
    "run_sweep",
    "to_run",
]


@dataclasses.dataclass
class Member:
    point: dict[str, str]  # axis key -> value, as passed on the command line
    nproc: int
    repeat: int
    overrides: list[str]  # the axis overrides (without nproc)
    label: str
    config_hash: str
    cfg: Config | None  # resolved; None when invalid
    invalid_reason: str | None
    timeout_seconds: float
    memory_limit_mb: int | None
    nodes: int = 1  # the nodes axis (a scheduler's job); nproc is then processes per node

    @property
    def run_name(self) -> str:
        slug = re.sub(r"[^A-Za-z0-9_.=+-]+", "_", self.label)[:60]
        shape = f"n{self.nproc}" if self.nodes == 1 else f"N{self.nodes}n{self.nproc}"
        return f"{slug}-{shape}-{self.config_hash[:10]}-r{self.repeat}"


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
    from .prediction_error import suspects

    rows = store.rows("sweep = ?", (spec.name,))
    flagged = suspects(rows)
    return frozenset((r["config_hash"], r["repeat"]) for r in rows if r["id"] in flagged)


@dataclasses.dataclass(frozen=True)
class SweepOptions:
    """What `stx sweep` was asked: the sweep file, where to store (None: the sweep's store), whether
    to rerun members stored as oom / timeout / crashed, and whether to only list the plan."""

    sweep_file: Path
    store: Path | None = None
    retry_failed: bool = False
    dry_run: bool = False
    retry_suspect: bool = False


@dataclasses.dataclass
class SweepOutcome:
    """How a sweep call ended: the statuses of the members it ran, and whether it was interrupted."""

    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    interrupted: bool = False

    @property
    def exit_code(self) -> int:
        return 130 if self.interrupted else 0


def run_sweep(
    spec: SweepSpec,
    options: SweepOptions,
    launcher: Launcher | None = None,
    present: SweepConsole | None = None,
) -> SweepOutcome:
    """Plan, skip what the store already holds, run the rest one member at a time (each through
    launcher, default: `stx launch` on this node) and store every outcome as soon as it is known.
    With `executor: slurm|pbs` each member is a batch job instead (`sweep_batch.run_batch`)."""
    if spec.executor != "local" and not options.dry_run:
        from .sweep_batch import run_batch_sweep

        return run_batch_sweep(spec, options, present=present)
    if launcher is None:
        from ..launch.local_jobs import LocalLauncher

        launcher = LocalLauncher()
    present = present or SweepConsole()
    members, filtered = expand(spec)
    store_path = options.store or spec.store
    present.plan(spec, members, filtered, store_path)
    if options.dry_run:
        present.dry_run(members)
        return SweepOutcome()
    from ..metrics.environment import environment

    env_json = json.dumps(environment())
    outcome = SweepOutcome()
    with ResultsStore(store_path) as store:
        for m in members:
            if m.invalid_reason:
                store.put(invalid_record(spec, m, env_json))
        rerun = suspect_members(store, spec) if options.retry_suspect else frozenset()
        todo = to_run(members, store.statuses(), options.retry_failed, rerun)
        invalid = sum(1 for m in members if m.invalid_reason)
        present.to_run(len(todo), len(members) - invalid - len(todo))
        t_start = time.perf_counter()
        durations: list[float] = []
        try:
            for i, m in enumerate(todo):
                eta = (sum(durations) / len(durations) * (len(todo) - i)) if durations else None
                present.starting(i, len(todo), m, time.perf_counter() - t_start, eta)
                record = result_record(run_member(spec, m, launcher), m)
                durations.append(record["wall_seconds"])
                record.setdefault("env_json", env_json)
                store.put(base_record(spec, m) | record)
                outcome.counts[record["status"]] = outcome.counts.get(record["status"], 0) + 1
                present.finished(record)
        except KeyboardInterrupt:
            present.interrupted(len(durations))
            outcome.interrupted = True
            return outcome
        present.summary(len(todo), time.perf_counter() - t_start, outcome.counts, store_path)
    return outcome
