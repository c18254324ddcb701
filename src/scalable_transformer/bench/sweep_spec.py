"""The sweep file: its keys, their checks, and `SweepSpec`, what `load_sweep` makes of it.

The format is documented in `bench/sweep.py`; every error names the file and the key.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from ..config.load import load_config, preset_names, yaml_error_line
from ..errors import ConfigError, SweepError

KEYS = {
    "base": "preset name or config path",
    "overrides": "list of key=value strings applied to every member",
    "axes": "mapping of config key (or nproc, nodes) to a list of values",
    "members": "list of mappings {config key, nproc or nodes: value}: explicit members instead of axes",
    "steps": "training iterations per member (int >= 1)",
    "warmup_steps": "iterations excluded from the throughput median (int >= 0)",
    "timeout_seconds": "seconds per member (number > 0)",
    "repeats": "runs per member (int >= 1)",
    "memory_limit_mb": "address-space limit per process in MiB (int > 0), or null",
    "filters": "list of conditions {key: value or [values]}; matching members are left out",
    "limits": "list of {when: condition, timeout_seconds: N, memory_limit_mb: M}",
    "store": "path of the results store (SQLite)",
    "name": "name of the sweep in the store (default: the file's stem)",
    "executor": "where members run: local (stx launch on this node), slurm or pbs (one batch job each)",
    "dry_run": "dry-run each member's layout on fake tensors before it runs and store its peak memory per "
    "device beside the prediction (true/false, default true; docs/PLANNER.md#dry-runs)",
    "executor_options": "mapping for slurm/pbs: partition (or queue), account, container, env_file, "
    "env (mapping), gpus (request one GPU per process; default true), poll_seconds",
}
EXECUTORS = ("local", "slurm", "pbs")
EXECUTOR_OPTIONS = ("partition", "queue", "account", "container", "env_file", "env", "gpus", "poll_seconds")
# Axes that are not config keys: processes per node, and nodes (a scheduler's job only).
JOB_AXES = ("nproc", "nodes")


@dataclasses.dataclass
class Condition:
    values: dict[str, list[str]]  # key -> accepted values (formatted as in overrides)

    def matches(self, point: dict[str, str]) -> bool:
        return all(point.get(k) in vs for k, vs in self.values.items())


@dataclasses.dataclass
class Limit:
    when: Condition
    timeout_seconds: float | None
    memory_limit_mb: int | None


@dataclasses.dataclass
class SweepSpec:
    path: Path
    name: str
    base: str
    overrides: list[str]
    axes: dict[str, list[str]]
    steps: int
    warmup_steps: int
    timeout_seconds: float
    repeats: int
    memory_limit_mb: int | None
    filters: list[Condition]
    limits: list[Limit]
    store: Path
    executor: str = "local"
    executor_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    members: list[dict[str, str]] = dataclasses.field(default_factory=list)
    dry_run: bool = True

    @property
    def directory(self) -> Path:
        return self.path.parent


def fmt_value(value: Any) -> str:
    """A YAML value as a key=value override writes it (true/false, numbers, strings)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return str(value)


def _err(path: Path, key: str, msg: str) -> SweepError:
    return SweepError(f"{path}: '{key}': {msg}")


def _condition(path: Path, key: str, value: Any, axis_keys: list[str]) -> Condition:
    if not isinstance(value, dict) or not value:
        raise _err(path, key, f"must be a non-empty mapping of axis key to value(s), got {value!r}")
    values = {}
    for k, v in value.items():
        if k not in axis_keys:
            raise _err(path, f"{key}.{k}", f"not an axis; axes are: {', '.join(axis_keys)}")
        values[k] = [fmt_value(x) for x in (v if isinstance(v, list) else [v])]
    return Condition(values)


def _number(path: Path, data: dict, key: str, default: Any, kind: type, minimum: float) -> Any:
    value = data.get(key, default)
    if value is None and key == "memory_limit_mb":
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (kind is int and value != int(value))
    ):
        raise _err(path, key, f"must be {KEYS[key]}, got {value!r}")
    if value < minimum or (minimum == 0 and key in ("timeout_seconds", "memory_limit_mb") and value <= 0):
        raise _err(path, key, f"must be {KEYS[key]}, got {value!r}")
    return kind(value)


def _flag(path: Path, data: dict, key: str, default: bool) -> bool:
    value = data.get(key, default)
    if not isinstance(value, bool):
        raise _err(path, key, f"must be {KEYS[key]}, got {value!r}")
    return value


def _read(path: Path) -> dict[str, Any]:
    """The sweep file's mapping, its keys known."""
    if not path.is_file():
        raise SweepError(f"{path}: no such sweep file")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise SweepError(yaml_error_line(e, str(path))) from None
    if not isinstance(data, dict):
        raise SweepError(f"{path}: a sweep file is a mapping with the keys {', '.join(KEYS)}")
    for key in data:
        if key not in KEYS:
            raise _err(path, key, f"unknown key; valid keys: {', '.join(KEYS)}")
    return data


def _base(path: Path, data: dict[str, Any]) -> str:
    """A preset name, or the config file's absolute path (given relative to the sweep file)."""
    base = data.get("base", "tiny-bert")
    if not isinstance(base, str):
        raise _err(path, "base", f"must be a preset name ({', '.join(preset_names())}) or a config path")
    if base not in preset_names():
        candidate = path.parent / base
        if not candidate.is_file():
            raise _err(
                path, "base", f"{base!r} is neither a preset ({', '.join(preset_names())}) nor a config file"
            )
        base = str(candidate.resolve())
    return base


def _members(path: Path, data: dict[str, Any]) -> tuple[list[dict[str, str]], dict[str, Any]]:
    """The explicit members (none when the file gives axes), and the data with the axes they span."""
    members_raw = data.get("members")
    members: list[dict[str, str]] = []
    if members_raw is None:
        return members, data
    if not isinstance(members_raw, list) or not members_raw:
        raise _err(path, "members", f"must be a non-empty {KEYS['members']}, got {members_raw!r}")
    for i, member in enumerate(members_raw):
        if not isinstance(member, dict) or not member:
            raise _err(path, f"members[{i}]", f"must be a mapping of config key to value, got {member!r}")
        members.append({str(k): fmt_value(v) for k, v in member.items()})
    if "axes" in data:
        raise _err(path, "members", "give either axes (a grid) or members (a list), not both")
    # the members' keys act as the axes: filters, limits and the report's columns see them
    data = {**data, "axes": {k: sorted({m[k] for m in members if k in m}) for m in members for k in m}}
    return members, data


def _axes(path: Path, data: dict[str, Any]) -> dict[str, list[str]]:
    """Axis key -> its values as overrides write them; process and node counts are integers >= 1."""
    axes_raw = data.get("axes")
    if not isinstance(axes_raw, dict) or not axes_raw:
        # a sweep without axes has nothing to compare (use stx train for one run)
        raise _err(
            path, "axes", f"must be a non-empty {KEYS['axes']}, e.g. {{nproc: [1, 2]}}; got {axes_raw!r}"
        )
    axes: dict[str, list[str]] = {}
    for k, v in axes_raw.items():
        if not isinstance(v, list) or not v:
            raise _err(path, f"axes.{k}", f"must be a non-empty list of values, got {v!r}")
        axes[str(k)] = [fmt_value(x) for x in v]
    for axis in JOB_AXES:
        for n in axes.get(axis, []):
            if not n.isdigit() or int(n) < 1:
                what = "process" if axis == "nproc" else "node"
                raise _err(path, f"axes.{axis}", f"{what} counts are integers >= 1, got {n!r}")
    return axes


def _executor(path: Path, data: dict[str, Any], axes: dict[str, list[str]]) -> tuple[str, dict[str, Any]]:
    """The executor and its options (env_file made absolute, relative to the sweep file)."""
    executor = data.get("executor", "local")
    if executor not in EXECUTORS:
        raise _err(path, "executor", f"must be one of {', '.join(EXECUTORS)}, got {executor!r}")
    if executor == "local" and any(n != "1" for n in axes.get("nodes", [])):
        raise _err(
            path, "axes.nodes", "more than one node needs a scheduler: set executor: slurm or executor: pbs"
        )
    executor_options = data.get("executor_options") or {}
    if not isinstance(executor_options, dict):
        raise _err(path, "executor_options", f"must be a {KEYS['executor_options']}")
    for k in executor_options:
        if k not in EXECUTOR_OPTIONS:
            raise _err(path, f"executor_options.{k}", f"unknown option; valid: {', '.join(EXECUTOR_OPTIONS)}")
    if executor_options and executor == "local":
        raise _err(path, "executor_options", "only for executor: slurm or pbs")
    env_file = executor_options.get("env_file")
    if env_file is not None:
        resolved_env_file = (path.parent / str(env_file)).resolve()
        if not resolved_env_file.is_file():
            raise _err(path, "executor_options.env_file", f"{env_file}: no such file")
        executor_options = {**executor_options, "env_file": str(resolved_env_file)}
    return executor, executor_options


def _check_axis_keys(path: Path, base: str, overrides: list[str], axes: dict[str, list[str]]) -> None:
    """Unknown config keys fail here, before anything runs (load_config names the nearest valid key)."""
    for k, vs in axes.items():
        if k not in JOB_AXES:
            try:
                load_config(base, [*overrides, f"{k}={vs[0]}"])
            except ConfigError as e:
                raise _err(path, f"axes.{k}", str(e)) from e


def _limits(path: Path, data: dict[str, Any], keys: list[str]) -> list[Limit]:
    """The per-member limit rules, in the file's order (the first matching rule wins)."""
    limits_raw = data.get("limits") or []
    if not isinstance(limits_raw, list):
        raise _err(path, "limits", f"must be {KEYS['limits']}")
    limits = []
    for i, rule in enumerate(limits_raw):
        where = f"limits[{i}]"
        if not isinstance(rule, dict) or "when" not in rule:
            raise _err(path, where, f"must be {KEYS['limits']}, got {rule!r}")
        extra = set(rule) - {"when", "timeout_seconds", "memory_limit_mb"}
        if extra:
            raise _err(
                path, where, f"unknown keys {sorted(extra)}; valid: when, timeout_seconds, memory_limit_mb"
            )
        limits.append(
            Limit(
                _condition(path, f"{where}.when", rule["when"], keys),
                _number(path, rule, "timeout_seconds", 1, float, 0) if "timeout_seconds" in rule else None,
                _number(path, rule, "memory_limit_mb", None, int, 0) if "memory_limit_mb" in rule else None,
            )
        )
    return limits


def load_sweep(path: str | Path) -> SweepSpec:
    """Read and check a sweep file; every error names the file and the key."""
    path = Path(path)
    data = _read(path)
    base = _base(path, data)
    overrides = data.get("overrides") or []
    if not isinstance(overrides, list) or not all(isinstance(o, str) and "=" in o for o in overrides):
        raise _err(path, "overrides", f"must be {KEYS['overrides']}, got {overrides!r}")
    members, data = _members(path, data)
    axes = _axes(path, data)
    executor, executor_options = _executor(path, data, axes)
    _check_axis_keys(path, base, overrides, axes)
    keys = list(axes)
    filters = data.get("filters") or []
    if not isinstance(filters, list):
        raise _err(path, "filters", f"must be {KEYS['filters']}")
    limits = _limits(path, data, keys)
    store = data.get("store", "results.sqlite")
    if not isinstance(store, str):
        raise _err(path, "store", f"must be {KEYS['store']}")
    return SweepSpec(
        path=path.resolve(),
        name=str(data.get("name", path.stem)),
        base=base,
        overrides=list(overrides),
        axes=axes,
        steps=_number(path, data, "steps", 20, int, 1),
        warmup_steps=_number(path, data, "warmup_steps", 3, int, 0),
        timeout_seconds=_number(path, data, "timeout_seconds", 1800, float, 0),
        repeats=_number(path, data, "repeats", 1, int, 1),
        memory_limit_mb=_number(path, data, "memory_limit_mb", None, int, 0),
        filters=[_condition(path, f"filters[{i}]", f, keys) for i, f in enumerate(filters)],
        limits=limits,
        store=(path.parent / store).resolve(),
        executor=executor,
        executor_options=dict(executor_options),
        members=members,
        dry_run=_flag(path, data, "dry_run", True),
    )


def common_overrides(spec: SweepSpec) -> list[str]:
    """The overrides of every member: the sweep's own, its step count and warm-up."""
    return [*spec.overrides, f"train.train_iters={spec.steps}", f"logging.warmup_iters={spec.warmup_steps}"]
