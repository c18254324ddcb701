"""`stx sweep SWEEP.yaml`: run a grid of layouts, each as its own `stx launch` job, and store every result.

A sweep file:

    base: tiny-gpt                 # preset or config path (relative to the sweep file)
    overrides: [model.num_layers=1]
    axes:                          # cartesian product; any config key (dotted or alias) or nproc
      nproc: [1, 2]
      parallel.zero_stage: [0, 3]
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
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import hashlib
import itertools
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console

from ..config.load import load_config, preset_names, to_yaml
from ..config.schema import Config
from ..config.validate import resolve
from ..errors import ConfigError, SweepError
from .results import STATUSES, ResultsStore

KEYS = {
    "base": "preset name or config path",
    "overrides": "list of key=value strings applied to every member",
    "axes": "mapping of config key (or nproc) to a list of values",
    "steps": "training iterations per member (int >= 1)",
    "warmup_steps": "iterations excluded from the throughput median (int >= 0)",
    "timeout_seconds": "seconds per member (number > 0)",
    "repeats": "runs per member (int >= 1)",
    "memory_limit_mb": "address-space limit per process in MiB (int > 0), or null",
    "filters": "list of conditions {key: value or [values]}; matching members are left out",
    "limits": "list of {when: condition, timeout_seconds: N, memory_limit_mb: M}",
    "store": "path of the results store (SQLite)",
    "name": "name of the sweep in the store (default: the file's stem)",
}

OOM_PATTERNS = [
    r"CUDA out of memory",
    r"OutOfMemoryError",
    r"\bMemoryError\b",
    r"Cannot allocate memory",
    r"std::bad_alloc",
    r"can't allocate memory",
    r"failed to allocate",
    r"Out of memory",
    r"Killed by the OOM killer",
]
_OOM_RE = re.compile("|".join(OOM_PATTERNS), re.IGNORECASE)
# How `stx launch` names a rank killed by SIGKILL ("rank 1 was killed by signal SIGKILL (exit code -9)"),
# and torchelastic's own wording ("Signal 9 (SIGKILL) received by PID").
_SIGKILL_RE = re.compile(r"killed by signal SIGKILL|Signal 9 \(SIGKILL\)|exitcode\s*:\s*-9\b|exit code -9\b")


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

    @property
    def directory(self) -> Path:
        return self.path.parent


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

    @property
    def run_name(self) -> str:
        slug = re.sub(r"[^A-Za-z0-9_.=+-]+", "_", self.label)[:60]
        return f"{slug}-n{self.nproc}-{self.config_hash[:10]}-r{self.repeat}"


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


def load_sweep(path: str | Path) -> SweepSpec:
    """Read and check a sweep file; every error names the file and the key."""
    path = Path(path)
    if not path.is_file():
        raise SweepError(f"{path}: no such sweep file")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise SweepError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise SweepError(f"{path}: a sweep file is a mapping with the keys {', '.join(KEYS)}")
    for key in data:
        if key not in KEYS:
            raise _err(path, key, f"unknown key; valid keys: {', '.join(KEYS)}")
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
    overrides = data.get("overrides") or []
    if not isinstance(overrides, list) or not all(isinstance(o, str) and "=" in o for o in overrides):
        raise _err(path, "overrides", f"must be {KEYS['overrides']}, got {overrides!r}")
    axes_raw = data.get("axes") or {}
    if not isinstance(axes_raw, dict):
        raise _err(path, "axes", f"must be {KEYS['axes']}")
    axes: dict[str, list[str]] = {}
    for k, v in axes_raw.items():
        if not isinstance(v, list) or not v:
            raise _err(path, f"axes.{k}", f"must be a non-empty list of values, got {v!r}")
        axes[str(k)] = [fmt_value(x) for x in v]
    for n in axes.get("nproc", []):
        if not n.isdigit() or int(n) < 1:
            raise _err(path, "axes.nproc", f"process counts are integers >= 1, got {n!r}")
    # Unknown config keys fail here, before anything runs (load_config names the nearest valid key).
    for k, vs in axes.items():
        if k != "nproc":
            try:
                load_config(base, [*overrides, f"{k}={vs[0]}"])
            except ConfigError as e:
                raise _err(path, f"axes.{k}", str(e)) from e
    keys = list(axes)
    filters = data.get("filters") or []
    if not isinstance(filters, list):
        raise _err(path, "filters", f"must be {KEYS['filters']}")
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
    )


def _label(base: str, point: dict[str, str], cfg: Config | None) -> str:
    """The report row: 'tiny-gpt hidden_size=32 tp=2 zero3+offload'; dp and nproc are the columns."""
    name = Path(base).stem if base not in preset_names() else base
    parts = [name]
    parts += [f"{k.split('.')[-1]}={v}" for k, v in point.items() if k != "nproc" and "parallel" not in k]
    if cfg is None:
        parts += [f"{k.split('.')[-1]}={v}" for k, v in point.items() if "parallel" in k]
        return " ".join(parts)
    p = cfg.parallel
    parts += [
        f"tp={p.tp}",
        f"pp={p.pp}",
        f"zero{p.zero_stage}" + ("+offload" if p.offload_optimizer or p.offload_param else ""),
    ]
    if p.sequence_parallel:
        parts.append("sp")
    if p.activation_checkpointing != "none":
        parts.append(f"recompute={p.activation_checkpointing}")
    return " ".join(parts)


def config_hash(cfg: Config, nproc: int, steps: int) -> str:
    """Identity of a member: the resolved config without where its run directory goes, plus nproc and
    steps. Stable across processes and machines (a sha256 of sorted YAML)."""
    neutral = dataclasses.replace(
        cfg, logging=dataclasses.replace(cfg.logging, run_dir="", run_name=None, tensorboard_dir=None)
    )
    text = json.dumps({"config": to_yaml(neutral), "nproc": nproc, "steps": steps}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _invalid_hash(spec: SweepSpec, overrides: list[str], nproc: int) -> str:
    text = json.dumps(
        {"base": spec.base, "overrides": sorted(overrides), "nproc": nproc, "steps": spec.steps}
    )
    return "invalid-" + hashlib.sha256(text.encode()).hexdigest()[:12]


def common_overrides(spec: SweepSpec) -> list[str]:
    return [*spec.overrides, f"train.train_iters={spec.steps}", f"logging.warmup_iters={spec.warmup_steps}"]


def expand(spec: SweepSpec) -> tuple[list[Member], int]:
    """Every member of the grid (x repeats) and how many the filters left out."""
    keys = list(spec.axes)
    members, filtered = [], 0
    for values in itertools.product(*(spec.axes[k] for k in keys)) if keys else [()]:
        point = dict(zip(keys, values, strict=True))
        if any(f.matches(point) for f in spec.filters):
            filtered += 1
            continue
        nproc = int(point.get("nproc", "1"))
        overrides = [f"{k}={v}" for k, v in point.items() if k != "nproc"]
        cfg: Config | None = None
        reason = None
        try:
            loaded = load_config(spec.base, [*common_overrides(spec), *overrides])
        except ConfigError as e:
            loaded, reason = None, str(e)
        if loaded is not None:
            try:
                cfg = resolve(loaded, world_size=nproc)
            except ConfigError as e:
                reason = str(e)
        digest = config_hash(cfg, nproc, spec.steps) if cfg else _invalid_hash(spec, overrides, nproc)
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
                )
            )
    return members, filtered


def classify(returncode: int | None, output: str, timed_out: bool) -> str:
    """ok / oom / timeout / crashed from how the job ended and the end of its output."""
    if timed_out:
        return "timeout"
    if returncode == 0:
        return "ok"
    if _OOM_RE.search(output) or returncode in (-9, 137) or _SIGKILL_RE.search(output):
        # SIGKILL that we did not send (we only kill on timeout) is the kernel's OOM killer.
        return "oom"
    return "crashed"


def tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _error_tail(text: str) -> str:
    """The launcher's failure report when there is one (it names the rank and the exception)."""
    idx = text.rfind("stx launch: rank")
    return tail(text[idx:] if idx >= 0 else text, 30)


def _child_setup(mb: int | None):
    """Run in the member's launcher between fork and exec: the memory limit (inherited by every rank),
    and on Linux SIGTERM when the sweep itself dies (even by SIGKILL), which the launcher answers by
    stopping its ranks, so a killed sweep leaves no member running behind it."""

    def apply() -> None:
        if mb is not None:
            limit = mb * 2**20
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        if sys.platform.startswith("linux"):
            import ctypes

            pr_set_pdeathsig = 1
            ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGTERM)

    return apply


def _kill_tree(proc: subprocess.Popen) -> None:
    """Stop the launcher and every rank: torchrun starts the ranks in their own sessions, so the
    process group of the launcher does not reach them; the process tree does."""
    import psutil

    try:
        procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=5)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    proc.wait()


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
    rec["summary_json"] = json.dumps(summary)
    if cfg is not None:
        rec.update(config_columns(cfg))
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


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def _hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600:d}:{s % 3600 // 60:02d}:{s % 60:02d}"


def run_member(spec: SweepSpec, member: Member, console: Console) -> dict[str, Any]:
    """Run one member as `stx launch -n NPROC train ...`; return its result record."""
    runs = spec.directory / "runs"
    run_dir = runs / member.run_name
    log_path = runs / f"{member.run_name}.log"
    if run_dir.exists():  # a rerun (--retry-failed, or a member interrupted last time) starts clean
        shutil.rmtree(run_dir)
    runs.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "scalable_transformer.cli",
        "launch",
        "-n",
        str(member.nproc),
        "train",
        spec.base,
        *common_overrides(spec),
        *member.overrides,
        f"logging.run_dir={runs}",
        f"logging.run_name={member.run_name}",
    ]
    started = _now()
    t0 = time.perf_counter()
    timed_out = False
    with open(log_path, "w", encoding="utf-8") as log:
        log.write("$ " + " ".join(cmd[3:]) + "\n")
        log.flush()
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_child_setup(member.memory_limit_mb),
        )
        try:
            proc.wait(timeout=member.timeout_seconds)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_tree(proc)
        except BaseException:  # Ctrl-C / SIGTERM of the sweep: stop the member, do not record it
            _kill_tree(proc)
            raise
    wall = time.perf_counter() - t0
    output = log_path.read_text(encoding="utf-8", errors="replace")
    status = classify(proc.returncode, output, timed_out)
    summary_path = run_dir / "summary.json"
    if status == "ok" and not summary_path.is_file():
        status = "crashed"
        output += "\n(the job exited 0 but wrote no summary.json)"
    record: dict[str, Any] = {
        "status": status,
        "error": None
        if status == "ok"
        else (f"timed out after {member.timeout_seconds:g} s\n" if timed_out else "") + _error_tail(output),
        "wall_seconds": wall,
        "started_at": started,
        "finished_at": _now(),
        "run_dir": str(run_dir),
    }
    if status == "ok":
        summary = json.loads(summary_path.read_text(encoding="utf-8"))
        record.update(record_from_summary(summary, member.cfg))
        loop = loop_seconds(run_dir)
        record["loop_seconds"] = loop
        record["overhead_seconds"] = wall - loop if loop is not None else None
    env_path = run_dir / "env.json"
    if env_path.is_file():
        record["env_json"] = env_path.read_text(encoding="utf-8")
    return record


def to_run(members: list[Member], stored: dict[tuple[str, int], str], retry_failed: bool) -> list[Member]:
    """The valid members the store does not hold yet (any final status counts as done), plus, with
    retry_failed, those stored as oom / timeout / crashed."""
    todo = []
    for m in members:
        status = stored.get((m.config_hash, m.repeat))
        if m.invalid_reason or (status in STATUSES and not (retry_failed and status != "ok")):
            continue
        todo.append(m)
    return todo


def run_sweep(
    spec: SweepSpec,
    store_path: Path | None = None,
    retry_failed: bool = False,
    dry_run: bool = False,
    console: Console | None = None,
) -> int:
    """Plan, skip what the store already holds, run the rest; returns the exit status (0, or 130)."""
    console = console or Console(stderr=True, highlight=False, soft_wrap=True, markup=False)
    members, filtered = expand(spec)
    store_path = store_path or spec.store
    invalid = [m for m in members if m.invalid_reason]
    console.print(
        f"sweep {spec.name}: {len(members)} member(s) ({len(invalid)} invalid, {filtered} left out by "
        f"filters), {spec.steps} steps each, store {store_path}"
    )
    for m in invalid:
        if m.repeat == 0:
            console.print(f"  invalid: {m.label} (nproc {m.nproc}): {m.invalid_reason}")
    if dry_run:
        for m in members:
            if not m.invalid_reason:
                console.print(
                    f"  would run: {m.label} (nproc {m.nproc}, repeat {m.repeat}, timeout "
                    f"{m.timeout_seconds:g} s, memory limit {m.memory_limit_mb or '-'} MiB) [{m.config_hash}]"
                )
        return 0
    from .environment import environment

    env_json = json.dumps(environment())
    with ResultsStore(store_path) as store:
        invalid_records = [
            _base_record(spec, m)
            | {"status": "invalid", "error": m.invalid_reason, "env_json": env_json, "finished_at": _now()}
            for m in invalid
        ]
        for record in invalid_records:
            store.put(record)
        todo = to_run(members, store.statuses(), retry_failed)
        skipped = len(members) - len(invalid) - len(todo)
        console.print(f"to run: {len(todo)}; already in the store: {skipped}")
        t_start = time.perf_counter()
        durations: list[float] = []
        counts: dict[str, int] = {}
        try:
            for i, m in enumerate(todo):
                elapsed = time.perf_counter() - t_start
                eta = (sum(durations) / len(durations) * (len(todo) - i)) if durations else None
                console.print(
                    f"[{i}/{len(todo)} done] running {m.label} (nproc {m.nproc}, repeat {m.repeat}) | "
                    f"elapsed {_hms(elapsed)} | ETA {_hms(eta) if eta is not None else '?'}"
                )
                record = run_member(spec, m, console)
                durations.append(record["wall_seconds"])
                record.setdefault("env_json", env_json)
                store.put(_base_record(spec, m) | record)
                counts[record["status"]] = counts.get(record["status"], 0) + 1
                extra = ""
                if record["status"] == "ok":
                    extra = (
                        f": {record['samples_per_second']:.2f} samples/s, overhead "
                        f"{record['overhead_seconds'] or float('nan'):.1f} s"
                    )
                console.print(f"  -> {record['status']} in {record['wall_seconds']:.1f} s{extra}")
        except KeyboardInterrupt:
            console.print(
                f"sweep interrupted after {len(durations)} member(s); run it again to resume "
                "(finished members are skipped)"
            )
            return 130
        console.print(
            f"[{len(todo)}/{len(todo)} done] in {_hms(time.perf_counter() - t_start)}: "
            + (", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "nothing to run")
            + f"; store {store_path}"
        )
    return 0


def _base_record(spec: SweepSpec, m: Member) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "config_hash": m.config_hash,
        "repeat": m.repeat,
        "source": "stx",
        "sweep": spec.name,
        "label": m.label,
        "nproc": m.nproc,
        "nnodes": 1,
        "steps": spec.steps,
        "overrides_json": json.dumps(dict(kv.split("=", 1) for kv in m.overrides)),
    }
    if m.cfg is not None:
        rec.update(config_columns(m.cfg))
    return rec


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main_sweep(args: Any) -> int:
    spec = load_sweep(args.sweep)
    # SIGTERM (a scheduler, `kill`) stops the sweep like Ctrl-C: the running member is killed, not recorded.
    signal.signal(signal.SIGTERM, _interrupt)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    return run_sweep(
        spec,
        Path(args.store).resolve() if args.store else None,
        retry_failed=args.retry_failed,
        dry_run=args.dry_run,
    )
