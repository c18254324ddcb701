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

A sweep is four steps, one module each: expand (`sweep_expand`: the members, planned from the sweep
file without running anything), execute (`sweep_execute`: one member through a `Launcher`), record
(`sweep_record`: the rows of the results store) and present (`sweep_present`: the console);
`run_sweep` composes them. The file format itself is checked in `sweep_spec`; the types they share
are in `sweep_types`. `sweep_batch` runs the members as batch jobs instead.
"""

from __future__ import annotations

import json
import time

from ..errors import SweepError
from ..launch.launcher import Launcher
from ..launch.local_jobs import LocalLauncher
from .results import ResultsStore
from .sweep_batch import run_batch_sweep
from .sweep_execute import OOM_PATTERNS, classify, run_member
from .sweep_expand import expand, suspect_members, to_run
from .sweep_present import SweepConsole
from .sweep_record import base_record, config_columns, invalid_record, record_from_summary, result_record
from .sweep_spec import KEYS, Condition, Limit, SweepSpec, common_overrides, fmt_value, load_sweep
from .sweep_types import SweepOptions, SweepOutcome

__all__ = [
    "KEYS",
    "OOM_PATTERNS",
    "Condition",
    "Limit",
    "SweepError",
    "SweepSpec",
    "classify",
    "common_overrides",
    "config_columns",
    "fmt_value",
    "load_sweep",
    "record_from_summary",
    "run_sweep",
]


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
        return run_batch_sweep(spec, options, present=present)
    if launcher is None:
        launcher = LocalLauncher()
    present = present or SweepConsole()
    members, filtered = expand(spec)
    store_path = options.store or spec.store
    present.plan(spec, members, filtered, store_path)
    if options.dry_run:
        present.dry_run(members)
        return SweepOutcome()
    # Here, not at the top: metrics.environment imports torch (5 s measured cold); --dry-run never needs it.
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
