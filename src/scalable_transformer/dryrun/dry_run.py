"""`stx plan --dry-run`: the real engine at the target world size, on fake tensors, in a child process
(each simulated rank in a process of its own forked from it).

For one representative rank of every memory class of a layout (each pipeline rank; under ZeRO-1 also
the data-parallel rank whose optimizer shard is largest), the dry run joins a fake process group of
the target world size as that rank, builds the topology (`ParallelDims`, its DeviceMesh), then inside
`FakeTensorMode` builds the model on the meta device, parallelizes and materializes it
(`train.build.build_parallel_model`), builds the optimizer and schedule, and runs `Trainer.fit` for two
steps: the step with its micro-batches or pipeline schedule, gradient clipping, loss scaling and the
optimizer step, the second one a logging step. No tensor holds data and collectives return at once,
so a 175B model on 64 ranks costs seconds and a few GB of Python objects.

A step of many micro-batches is not simulated whole: its figures are affine in the micro-batch count
once the schedule repeats, so the dry run simulates two short steps and continues each figure
(`shortened_accumulation`, `extrapolated`); the output says how many it simulated and extrapolated.

`dryrun/dry_run_trace.py` observes it: live tensor bytes per rank and where their peak is, the
collectives per step and every host read of a device value. docs/PLANNER.md#dry-runs says what a dry
run exercises and what it cannot (kernel workspaces, allocator caching, NCCL's own buffers).

The fake process group is torch's test backend (`torch.testing._internal.distributed.fake_pg`), the
only place torch ships it; `fake_process_group` is the one place that imports it.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import multiprocessing
import os
import pickle
import resource
import signal
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..config.load import load_config, to_yaml
from ..config.rules import INTERLEAVED_SCHEDULES, V_SHAPED_SCHEDULES
from ..config.schema import Config
from ..config.validate import resolve
from ..errors import StxError
from ..metrics.flops import step_flops
from ..models import count_parameters, spec_for
from ..parallel import distributed
from ..parallel.dims import ParallelDims
from ..plan.search import predict, prepare
from ..train.build import (
    RunData,
    build_measurement,
    build_optimizer_and_scheduler,
    build_parallel_model,
    build_trainer,
)
from .dry_run_trace import DryRunTrace
from .engine_stubs import engine_stubs, patched
from .fake_cuda import fake_cuda
from .local_step import step_on_local_shards
from .torch_internals import FakeStore, FakeTensorMode, ModTracker

# the first step (lazy initialisation: optimizer states, the pipeline schedule's warm-up), then a plain
# step (what every step between logging steps does: its collectives and host syncs are reported) and a
# logging step
DRY_RUN_STEPS = 3
PLAIN_STEP = 2
NO_PEAK = 1e30  # FLOP/s: a dry run's step takes no time, so its MFU means nothing (and must not warn)


class DryRunError(StxError):
    """The engine failed inside a dry run (the analytic prediction stands)."""


@dataclass
class RankDryRun:
    rank: int
    stage: int  # pipeline rank
    peak_memory_bytes: int
    memory_breakdown_bytes: dict[str, int]
    peak_at: dict[str, Any]
    collectives: list[dict[str, Any]]
    host_syncs: list[dict[str, Any]]
    host_syncs_per_step: int
    zero1_shard_numel: list[int] | None = None  # ZeRO-1: elements of the optimizer shard per dp rank
    saved_for_backward_bytes: int = 0  # the first micro-batch's forward, alive at its backward
    micro_batches: int = 1  # per step, as the config trains them
    simulated: tuple[int, ...] = ()  # micro-batches per step of each simulation (one: all of them)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "stage": self.stage,
            "peak_memory_bytes": self.peak_memory_bytes,
            "memory_breakdown_bytes": self.memory_breakdown_bytes,
            "peak_at": self.peak_at,
            "saved_for_backward_bytes": self.saved_for_backward_bytes,
            "micro_batches": micro_batch_counts(self.micro_batches, self.simulated),
        }


@dataclass
class DryRun:
    """What `--json` prints as `layouts[i].dry_run`."""

    ranks: list[RankDryRun]
    seconds: float
    device: str
    world_size: int
    notes: list[str] = field(default_factory=list)

    @property
    def peak_memory_bytes(self) -> int:
        return max(r.peak_memory_bytes for r in self.ranks)

    def to_dict(self) -> dict[str, Any]:
        first = self.ranks[0]
        return {
            "peak_memory_bytes": self.peak_memory_bytes,
            "micro_batches": micro_batch_counts(first.micro_batches, first.simulated),
            "ranks": [r.to_dict() for r in self.ranks],
            # rank 0's collectives in a step without logging (every simulated rank's: ranks_detail)
            "collectives": first.collectives,
            "host_syncs_per_step": first.host_syncs_per_step,
            "host_syncs": first.host_syncs,
            "seconds": self.seconds,
            "device": self.device,
            "world_size": self.world_size,
            "notes": self.notes,
            "ranks_detail": [
                {"rank": r.rank, "collectives": r.collectives, "host_syncs": r.host_syncs} for r in self.ranks
            ],
        }


# ------------------------------------------------------------------ the fake process group


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int) -> Iterator[None]:
    """The default process group as torch's fake backend: every collective returns at once."""
    if FakeStore is None:  # pragma: no cover - depends on the torch build
        raise DryRunError(
            f"this torch ({torch.__version__}) has no fake process group "
            "(torch.testing._internal.distributed.fake_pg): dry runs need it"
        )
    if dist.is_initialized():
        raise DryRunError("a dry run needs a process without a process group (one is already initialized)")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------ one rank


def dry_run_config(cfg: Config) -> Config:
    """The config a dry run trains: DRY_RUN_STEPS steps, the last logged, no evaluation, nothing
    written, no weights read (the run has no data to put them in)."""
    t, lg, c = cfg.train, cfg.logging, cfg.checkpoint
    return dataclasses.replace(
        cfg,
        train=dataclasses.replace(t, exit_interval=DRY_RUN_STEPS, eval_iters=0, eval_interval=0),
        logging=dataclasses.replace(
            lg,
            log_interval=DRY_RUN_STEPS,
            tensorboard=False,
            telemetry=False,
            track_tensor_bytes=False,
            profile_start_step=None,
            profile_end_step=None,
        ),
        checkpoint=dataclasses.replace(c, save=None, load=None, init_from_hf=None),
    )


def fake_batches(cfg: Config, device: Any) -> Iterator[dict[str, Any]]:
    """Endless micro-batches of the family's keys and shapes, as the data loader collates them
    (int64 [b, s]; BERT's nsp_labels [b]), made under the fake mode when the trainer asks."""

    shapes = spec_for(cfg.model).micro_batch_shapes(cfg.model, cfg.train.micro_batch_size)
    while True:
        yield {k: torch.zeros(shape, dtype=torch.int64, device=device) for k, shape in shapes.items()}


def _group_names(dims: Any) -> dict[str, str]:

    world = dist.group.WORLD
    names: dict[str, str] = {str(world.group_name): "world"} if world is not None else {}
    if dims.mesh is not None:
        for dim in ("pp", "dp", "cp", "tp"):
            names[str(dims.sub_mesh(dim).get_group().group_name)] = dim
        for dim in ("dp_replicate", "dp_shard") if dims.hybrid else ():  # HSDP's two halves of dp
            names[str(dims.mesh[dim].get_group().group_name)] = dim
        if dims.cp > 1:  # gradients are reduced over dp x cp
            names.setdefault(str(dims.grad_group.group_name), "dp_cp")
        if dims.hsdp_cp_mesh is not None:  # HSDP with cp: FSDP2 shards over dp_shard x cp, its own groups
            for dim in ("dp_replicate", "dp_shard_cp"):
                names.setdefault(str(dims.hsdp_cp_mesh[dim].get_group().group_name), dim)
        if dims.expert_mesh is not None:  # expert parallelism: tokens over ep, expert gradients over edp
            # (and under tp the expert mesh's own tp group: the same ranks as tp, the experts' norm)
            for dim in dims.expert_mesh.mesh_dim_names:
                names.setdefault(str(dims.expert_mesh[dim].get_group().group_name), dim)
    return names


def _summarize_collectives(calls: list[Any], step: int) -> list[dict[str, Any]]:
    counts: Counter = Counter()
    sizes: Counter = Counter()
    for c in calls:
        if c.step == step:
            counts[(c.group, c.kind)] += 1
            sizes[(c.group, c.kind)] += c.bytes
    return [
        {"group": g, "kind": k, "count": counts[(g, k)], "bytes": sizes[(g, k)]} for g, k in sorted(counts)
    ]


def _summarize_reads(reads: list[Any], step: int) -> list[dict[str, Any]]:
    counts = Counter(r.where for r in reads if r.step == step)
    logging = step % DRY_RUN_STEPS == 0  # dry_run_config logs every DRY_RUN_STEPS steps
    return [{"where": w, "logging_step": logging, "count": n} for w, n in sorted(counts.items())]


def run_rank(
    cfg: Config,
    world_size: int,
    rank: int,
    device_type: str,
    devices_per_node: int = 8,
    local_step: bool = True,
) -> RankDryRun:
    """Dry-run `rank` of a resolved config on a fake process group of `world_size` (`local_step`: the
    optimizer steps the local shards of DTensor parameters, dryrun/local_step.py)."""

    cfg = resolve(dry_run_config(cfg), world_size)
    holder: dict[str, Any] = {}  # the trace, once it exists: torch.cuda.synchronize() is a host sync

    def device_sync() -> None:
        if "trace" in holder:
            holder["trace"]._host_read(None)

    simulated = [(distributed, "SIMULATED_BACKEND", "nccl" if device_type == "cuda" else "gloo")]
    with (
        fake_process_group(rank, world_size),
        patched(engine_stubs(device_type, holder) + simulated),
        _target_device(device_type, rank, devices_per_node, device_sync) as device,
    ):
        dims = ParallelDims.build(cfg, device.type)  # the mesh outside the fake mode (it reads ranks)
        backend = "nccl" if device.type == "cuda" else "gloo"
        trace = DryRunTrace(_group_names(dims), backend=backend, device_type=device.type)
        holder["trace"] = trace
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        try:
            with fake, trace, _module_tracker(cfg) as modules, warnings.catch_warnings():
                # model_state_bytes dedupes storages by data_ptr, which fake tensors only warn about
                warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
                trace.module_tracker = modules
                model, pipeline = build_parallel_model(cfg, dims, device)
                optimizer, scheduler = build_optimizer_and_scheduler(cfg, model, dims)  # type: ignore[arg-type]
                if local_step:
                    step_on_local_shards(optimizer)
                flops = step_flops(cfg, count_parameters(cfg.model))
                measurement = build_measurement(cfg, device, dims, flops, NO_PEAK, [])  # type: ignore[arg-type]
                data = RunData(fake_batches(cfg, device), list)
                trainer = build_trainer(
                    cfg,  # type: ignore[arg-type]
                    model,
                    optimizer,
                    scheduler,
                    data,
                    measurement,
                    dims,
                    pipeline,
                    [_StepMarker(trace)],  # type: ignore[list-item]
                )
                trainer.timers = _PhaseTimers(trace, trainer.timers)  # type: ignore[assignment]
                trace.phase = "train"
                trainer.fit()
                _tag_model_states(trace, model, optimizer)
        except StxError:
            raise
        except Exception as e:
            where = trace.phase + (f" ({trace.where_module()})" if trace.where_module() else "")
            raise DryRunError(
                f"rank {rank}: the engine failed in phase {where} of step {trace.step}: {_what_failed(e)}"
            ) from e
        peak = trace.peak
        plain_step, logging_step = PLAIN_STEP, DRY_RUN_STEPS
        plain = _summarize_reads(trace.host_reads, plain_step)
        return RankDryRun(
            rank=rank,
            stage=dims.pp_rank,
            peak_memory_bytes=peak.bytes,
            memory_breakdown_bytes=trace.breakdown_at_peak(),
            peak_at={"phase": peak.phase, "module": peak.module, "op": peak.op, "step": peak.step},
            collectives=_summarize_collectives(trace.collectives, plain_step),
            host_syncs=plain + _summarize_reads(trace.host_reads, logging_step),
            host_syncs_per_step=sum(r["count"] for r in plain),
            zero1_shard_numel=_zero1_partition(optimizer) if cfg.parallel.zero_stage == 1 else None,
            saved_for_backward_bytes=trace.saved_for_backward(),
            micro_batches=cfg.train.gradient_accumulation_steps,
            simulated=(cfg.train.gradient_accumulation_steps,),
        )


def _what_failed(error: BaseException) -> str:
    """The error's first line and, when it wraps another (torch's pipelining re-raises a stage's
    error as "[Stage 1] failed to run forward:" followed by its arguments), the innermost one's: the
    cause a user can act on."""

    def first_line(e: BaseException) -> str:
        return f"{type(e).__name__}: " + (str(e).strip().splitlines() or [""])[0][:400]

    root, seen = error, {id(error)}
    while (inner := root.__cause__ or root.__context__) is not None and id(inner) not in seen:
        root = inner
        seen.add(id(root))
    return first_line(error) if root is error else f"{first_line(error)} caused by {first_line(root)}"


def _tag_model_states(trace: Any, model: Any, optimizer: Any) -> None:
    """Storages that are the model's states at the end of the run; their earlier blocks share the tag."""
    params = list(model.parameters())
    trace.tag(params, "parameters", overwrite=True)
    trace.tag([p.grad for p in params if p.grad is not None], "gradients", overwrite=True)
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its shard's here
    trace.tag([list(s.values()) for s in inner.state.values()], "optimizer_state", overwrite=True)


def _zero1_partition(optimizer: Any) -> list[int] | None:
    partition = getattr(optimizer, "_partition_parameters", None)
    if partition is None:
        return None
    return [sum(p.numel() for group in groups for p in group["params"]) for groups in partition()]


class _StepMarker:
    """Tells the trace which step runs."""

    def __init__(self, trace: Any) -> None:
        self.trace = trace

    def on_step_start(self, trainer: Any) -> None:
        self.trace.step = trainer.iteration + 1

    def __getattr__(self, name: str) -> Any:  # the other Callback hooks: nothing to do
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)


class _PhaseTimers:
    """The trainer's Timers, also telling the trace which phase runs (the peak's `phase`)."""

    def __init__(self, trace: Any, timers: Any) -> None:
        self._trace, self._timers = trace, timers

    def __call__(self, name: str, level: int = 1) -> Any:
        return _PhaseTimer(self._trace, self._timers(name, level), name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._timers, name)


class _PhaseTimer:
    def __init__(self, trace: Any, timer: Any, name: str) -> None:
        self._trace, self._timer, self._name = trace, timer, name
        self._previous = ""

    def __enter__(self) -> Any:
        self._previous, self._trace.phase = self._trace.phase, self._name
        return self._timer.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        self._trace.phase = self._previous
        return self._timer.__exit__(*exc)


@contextlib.contextmanager
def _target_device(device_type: str, rank: int, devices_per_node: int, on_sync: Any) -> Iterator[Any]:
    """The device the simulated rank computes on; for CUDA the fake CUDA of dryrun/fake_cuda.py, with
    `on_sync` called at every torch.cuda.synchronize()."""

    if device_type == "cpu":
        yield torch.device("cpu")
        return
    if device_type != "cuda":
        raise DryRunError(f"dry runs simulate cpu or cuda devices, not {device_type!r}")

    index = rank % devices_per_node
    with fake_cuda(index, on_sync=on_sync):
        yield torch.device("cuda", index)


def _module_tracker(cfg: Config) -> Any:
    """torch's ModTracker (the module a peak or a failure happened in), or none for the zero-bubble
    schedules: its backward hooks ask autograd whether a node will run, which torch refuses inside
    torch.autograd.grad, where their split backward (input gradients first) runs. Those dry runs name
    no module for their peak."""
    split_backward = cfg.parallel.pp > 1 and cfg.parallel.pipeline_schedule in SPLIT_BACKWARD_SCHEDULES
    return contextlib.nullcontext() if split_backward else ModTracker()


# schedules whose backward of a stage's input runs under torch.autograd.grad (torch.distributed.pipelining's
# stage_backward_input): ScheduleInterleavedZeroBubble and ScheduleZBVZeroBubble
SPLIT_BACKWARD_SCHEDULES = ("zero-bubble", "zbv")


# ------------------------------------------------------------------ many micro-batches, few simulated


def shortened_accumulation(cfg: Config) -> tuple[int, int] | None:
    """The two micro-batch counts per step a dry run simulates instead of the config's, or None when
    simulating all of them costs no more.

    A step's micro-batches repeat: every figure the dry run reports is affine in their number n once
    the schedule's steady state is reached. Without pipelining the first micro-batch differs from the
    others (its backward allocates the accumulated gradients) and the last (the data-parallel
    gradient reduction runs there, ZeRO-1/2/3 alike), the middle ones are alike: from n = 2 on, each
    one more adds the same collectives, and the same bytes at the peak (its batch, loaded with the
    step's). A pipeline rank holds at most its schedule's in-flight micro-batches (1F1B: its stage
    count; interleaved: its warm-up of about 2 x pp chunks), and keeps a receive buffer, a loss and
    metrics per micro-batch of the step (affine in n again) once n fills the warm-up; GPipe and
    looped BFS keep every micro-batch's activations, affine from n = 2. Interleaved schedules need n
    to be a multiple of pp: the two counts are pp apart."""
    p, n = cfg.parallel, cfg.train.gradient_accumulation_steps or 1
    stages = p.pp * p.virtual_pipeline_stages
    first, stride = 3, 1
    if p.pp > 1 and p.pipeline_schedule in INTERLEAVED_SCHEDULES:
        first, stride = 3 * p.pp, p.pp
    elif p.pp > 1 and (p.pipeline_schedule == "1f1b" or p.pipeline_schedule in V_SHAPED_SCHEDULES):
        first = stages + 1
    second = first + stride
    if n <= first + second or (n - second) % stride:
        return None
    return first, second


def with_accumulation(cfg: Config, n: int) -> Config:
    """A resolved config with n micro-batches per step (the global batch to match)."""
    t = cfg.train
    train = dataclasses.replace(
        t,
        gradient_accumulation_steps=n,
        global_batch_size=t.micro_batch_size * n * cfg.parallel.dp,
        derive_micro_batch_size=False,
    )
    return dataclasses.replace(cfg, train=train)


def extrapolated(short: RankDryRun, long: RankDryRun, n: int) -> RankDryRun:
    """A rank's figures for n micro-batches per step from its simulations with fewer (`short` and
    `long`, see `shortened_accumulation`): each figure continued along the line through the two."""
    n1, n2 = short.micro_batches, long.micro_batches
    strides = (n - n2) // (n2 - n1)

    def line(a: int, b: int) -> int:
        return b + (b - a) * strides

    def by_key(
        rows_a: list[dict[str, Any]],
        rows_b: list[dict[str, Any]],
        keys: tuple[str, ...],
        values: tuple[str, ...],
    ) -> list[dict[str, Any]]:
        a = {tuple(r[k] for k in keys): r for r in rows_a}
        b = {tuple(r[k] for k in keys): r for r in rows_b}
        zero = dict.fromkeys(values, 0)
        rows = []
        for key in sorted(set(a) | set(b)):
            ra, rb = a.get(key, zero), b.get(key, zero)
            rows.append({**dict(zip(keys, key, strict=True)), **{v: line(ra[v], rb[v]) for v in values}})
        return [r for r in rows if any(r[v] for v in values)]

    breakdown_a, breakdown_b = short.memory_breakdown_bytes, long.memory_breakdown_bytes
    breakdown = {
        key: line(breakdown_a.get(key, 0), breakdown_b.get(key, 0))
        for key in [*breakdown_b, *(k for k in breakdown_a if k not in breakdown_b)]
    }
    syncs = by_key(short.host_syncs, long.host_syncs, ("where", "logging_step"), ("count",))
    return dataclasses.replace(
        long,
        peak_memory_bytes=line(short.peak_memory_bytes, long.peak_memory_bytes),
        memory_breakdown_bytes={k: v for k, v in breakdown.items() if v},
        collectives=by_key(short.collectives, long.collectives, ("group", "kind"), ("count", "bytes")),
        host_syncs=syncs,
        host_syncs_per_step=sum(s["count"] for s in syncs if not s["logging_step"]),
        micro_batches=n,
        simulated=(n1, n2),
    )


def micro_batch_counts(n: int, simulated: tuple[int, ...]) -> dict[str, Any]:
    """What `--json` says of a step's micro-batches: how many the step has, the counts the dry run
    simulated (one: all of them; two: the figures are continued along the line through both) and how
    many of the step's it did not simulate."""
    return {"per_step": n, "simulated": list(simulated), "extrapolated": n - max(simulated, default=n)}


# ------------------------------------------------------------------ a layout


def representative_ranks(cfg: Config) -> list[int]:
    """One global rank per pipeline rank (dp rank 0, tp rank 0): every memory class but ZeRO-1's
    uneven shards, which `dry_run` adds once it knows the partition."""
    p = cfg.parallel
    return [pp_rank * p.dp * p.tp for pp_rank in range(p.pp)]


def dry_run(
    cfg: Config,
    world_size: int,
    device_type: str = "cpu",
    devices_per_node: int = 8,
    fork_ranks: bool = False,
    shorten: bool = True,
) -> DryRun:
    """Dry-run a resolved config's layout on `world_size` fake ranks in this process (see the module
    docstring; `dry_run_isolated` runs it in a child, with `fork_ranks`: each rank in a child of that
    child, `_in_own_process`, one per CPU at a time, which only a process that has not run autograd
    may do). A step of many micro-batches is simulated with fewer (`shortened_accumulation`) unless
    `shorten` is False."""
    start = time.perf_counter()
    p = cfg.parallel

    counts = shortened_accumulation(cfg) if shorten else None
    layouts = [cfg] if counts is None else [with_accumulation(cfg, n) for n in counts]

    def simulate(ranks: list[int]) -> list[RankDryRun]:
        calls = [
            (run_rank, layout, world_size, rank, device_type, devices_per_node)
            for rank in ranks
            for layout in layouts
        ]
        done = _in_own_processes(calls, _parallel_ranks()) if fork_ranks else [c[0](*c[1:]) for c in calls]
        if counts is None:
            return done
        n = cfg.train.gradient_accumulation_steps or 1
        return [extrapolated(done[i], done[i + 1], n) for i in range(0, len(done), 2)]

    runs = simulate(representative_ranks(cfg))
    notes = []
    if p.zero_stage == 1 and p.dp > 1:
        extra = []
        for r in runs:
            shards = r.zero1_shard_numel or []
            if shards:
                heaviest = max(range(len(shards)), key=lambda i: shards[i])
                if heaviest != 0:
                    extra.append(r.rank + heaviest * p.tp)
                    notes.append(
                        f"ZeRO-1: dp rank {heaviest} of pipeline rank {r.stage} holds the largest optimizer "
                        f"shard ({shards[heaviest]:,} vs {shards[0]:,} elements on dp rank 0)"
                    )
        runs += simulate(extra)
    if counts is not None:
        n = cfg.train.gradient_accumulation_steps or 1
        notes.append(
            f"{n} micro-batches per step: simulated with {counts[0]} and with {counts[1]}, the other "
            f"{n - counts[1]} extrapolated (each adds the same collectives and bytes once the schedule "
            "repeats)"
        )
    return DryRun(runs, time.perf_counter() - start, device_type, world_size, notes)


def _parallel_ranks() -> int:
    """How many rank processes a dry run runs at once: one per CPU this process may use."""
    return max(1, len(os.sched_getaffinity(0)))


def _in_own_process(fn: Any, *args: Any) -> Any:
    """fn(*args) in a child forked from this process, which must not have run autograd (torch refuses
    autograd in a fork of a process that did) and runs no engine itself: torch keeps state
    across runs that a second rank must not see (DTensor reuses op specs whose mesh compares equal to
    the new rank's but holds the last rank's process groups: "Could not resolve the process group
    registered under the name 41" once a second pipeline rank with sequence parallelism ran in the
    same process). Its result, or the exception it raised, comes back pickled through a pipe."""
    return _in_own_processes([(fn, *args)], 1)[0]


def _in_own_processes(calls: list[tuple[Any, ...]], width: int) -> list[Any]:
    """Each (fn, *args) of `calls` as `_in_own_process` runs it, up to `width` children at a time (the
    simulated ranks are independent); the results in the order of `calls`. An error stops the rest."""
    pending, results = list(calls), []
    running: list[tuple[int, int]] = []
    try:
        while pending or running:
            while pending and len(running) < width:
                running.append(_fork(*pending.pop(0)))
            results.append(_collect(*running.pop(0)))
    finally:
        for pid, read_fd in running:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
                os.close(read_fd)
                os.waitpid(pid, 0)
    return results


def _fork(fn: Any, *args: Any) -> tuple[int, int]:
    """Start fn(*args) in a forked child (see `_in_own_process`): its pid and the pipe to read."""
    read_fd, write_fd = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(read_fd)
        _die_with(parent)
        try:
            outcome: tuple[str, Any] = ("result", fn(*args))
        except BaseException as e:  # everything goes back to the parent, which raises it
            outcome = ("error", e if isinstance(e, StxError) else DryRunError(f"{type(e).__name__}: {e}"))
        with os.fdopen(write_fd, "wb") as pipe:
            pipe.write(pickle.dumps(outcome))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # no teardown (see _worker_main)
    os.close(write_fd)
    return pid, read_fd


def _collect(pid: int, read_fd: int) -> Any:
    """The result of a child `_fork` started (its exception raised here)."""
    with os.fdopen(read_fd, "rb") as pipe:
        data = pipe.read()
    _, status = os.waitpid(pid, 0)
    if not data:
        raise DryRunError(f"the dry run's process for one rank ended with status {status} and no result")
    kind, value = pickle.loads(data)
    if kind == "error":
        raise value
    return value


def _die_with(parent: int) -> None:
    """Have the kernel kill this process when its parent ends (prctl PR_SET_PDEATHSIG, Linux): a rank
    process must not outlive a dry run that was stopped (`stx plan` interrupted, or timed out)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent ended before the request was made
        os._exit(1)


_PR_SET_PDEATHSIG = 1  # linux/prctl.h

WORKER_TIMEOUT_SECONDS = 900
# Each dry run runs in a child forked from one server process that has imported torch and this module
# once: a fresh `python -c` child spent 5.7 s of a 7 s tiny dry run importing them (AMD EPYC), and a
# search dry-runs several layouts. The server only imports; it never runs the engine or fake CUDA.
_FORKS = multiprocessing.get_context("forkserver")


def dry_run_isolated(
    cfg: Config, world_size: int, device_type: str = "cpu", devices_per_node: int = 8
) -> dict[str, Any]:
    """`dry_run` in a child process, as `DryRun.to_dict()`: the fake process group, the patches of
    fake CUDA and whatever the engine leaves behind stay there, and a crash in the engine (fake CUDA
    reaches into libtorch) is an error here, not the end of `stx plan`. Adds the child's peak RSS."""

    multiprocessing.set_forkserver_preload([__name__])  # no effect once the server runs
    with tempfile.TemporaryDirectory(prefix="stx-dry-run-") as tmp:
        config_path, result_path = Path(tmp) / "config.yaml", Path(tmp) / "result.json"
        output_path = Path(tmp) / "output.txt"
        config_path.write_text(to_yaml(cfg), encoding="utf-8")
        args = [str(config_path), str(world_size), device_type, str(devices_per_node), str(result_path)]
        # the server holds the environment and directory it started in: the child takes this call's
        child = _FORKS.Process(
            target=_worker_main, args=(args, str(output_path), os.getcwd(), dict(os.environ)), daemon=True
        )
        child.start()
        child.join(WORKER_TIMEOUT_SECONDS)
        if child.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
            child.join()
            raise DryRunError(f"the dry run took over {WORKER_TIMEOUT_SECONDS} s and was stopped")
        if not result_path.exists():
            text = output_path.read_text(errors="replace") if output_path.exists() else ""
            tail = " | ".join(text.strip().splitlines()[-3:])
            raise DryRunError(f"the dry run's process ended with exit code {child.exitcode}: {tail}")
        result = json.loads(result_path.read_text(encoding="utf-8"))
    if "error" in result:
        raise DryRunError(result["error"])
    return result


def _worker_main(argv: list[str], output: str, cwd: str, environ: dict[str, str]) -> None:
    """The child of `dry_run_isolated`: config path, world size, device type, devices per node, and
    where to write the result (or {"error": ...}); its stdout and stderr go to `output`, where
    multiprocessing's bootstrap prints the traceback of any other exception."""

    _die_with(os.getppid())  # the fork server, which ends with the `stx plan` that started it
    os.setpgid(0, 0)  # its own process group: a timeout stops the rank processes it forks too
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environ)
    sink = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(sink, 1)
    os.dup2(sink, 2)
    config_path, world, device_type, per_node, result_path = argv
    try:
        cfg = resolve(load_config(config_path), int(world))
        out = dry_run(cfg, int(world), device_type, int(per_node), fork_ranks=True).to_dict()
        # each rank ran in a child of this process (_in_own_process): the largest of them and this
        peak_kib = max(
            resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
        )
        out["process_peak_rss_bytes"] = peak_kib * 1024
    except StxError as e:
        out = {"error": str(e)}
    Path(result_path).write_text(json.dumps(out), encoding="utf-8")
    # The result is written. Skip the interpreter's teardown: after a fake-CUDA run the autograd
    # engine's device thread outlives fake CUDA's guard, and destroying it at exit can abort in C++
    # ("terminate called without an active exception"), which would only add noise to stderr.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def saved_bytes_per_layer(cfg: Config, world_size: int, device_type: str = "cpu") -> float:
    """Bytes one transformer layer keeps for backward per micro-batch on rank 0, by dry run: what the
    first micro-batch keeps at its backward with 2 layers minus with 1 (all else cancels). cfg: a
    layout without pipelining (one stage holds both layers)."""
    runs = []
    for layers in (1, 2):
        one = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_layers=layers))
        runs.append(dry_run_isolated(one, world_size, device_type)["ranks"][0]["saved_for_backward_bytes"])
    return float(runs[1] - runs[0])


def verify(prediction: Any, cfg: Config, cluster: Any) -> Any:
    """`prediction` (plan/search.py) with its `dry_run` filled: the dry run of its layout on the
    cluster's world size, each simulated rank beside the analytic prediction for its pipeline rank.
    A dry run that fails inside the engine is reported in `dry_run["error"]`; the analytic result
    stands either way."""

    world = cluster.world_size
    device_type = "cpu" if cluster.kind == "cpu" else "cuda"
    candidate = prediction.layout.apply(prepare(cfg, world))
    layout_cfg = resolve(candidate, world)
    try:
        out = dry_run_isolated(layout_cfg, world, device_type, cluster.devices_per_node)
    except DryRunError as e:
        return dataclasses.replace(prediction, dry_run={"error": str(e), "device": device_type})
    # the dry run counts live tensor bytes: compare them with the prediction less its reserve (CUDA
    # context, allocator slack), which no tensor holds
    # a search predicts the first and last pipeline ranks only; the dry run simulates every one
    stages = prediction.stages
    balanced = layout_cfg.model.num_experts > 0 and cluster.moe_imbalance != 1.0
    if balanced:  # the dry run routes every expert the same rows: compared with the plan of that routing
        stages = predict(candidate, dataclasses.replace(cluster, moe_imbalance=1.0)).stages
        out["notes"].append(
            "the dry run routes tokens evenly over the experts; it is compared with the plan at imbalance "
            f"1.0, not the {cluster.moe_imbalance:g}x planned above (--moe-imbalance)"
        )
    elif len(stages) < prediction.layout.pp:
        stages = predict(candidate, cluster).stages
    predicted = {st.pp_rank: st.total - st.breakdown.get("reserve", 0) for st in stages}
    for entry in out["ranks"]:
        analytic = predicted.get(entry["stage"])
        entry["predicted_bytes"] = analytic
        entry["difference"] = None if not analytic else entry["peak_memory_bytes"] / analytic - 1
    analytic = max(predicted.values())
    out["predicted_peak_memory_bytes"] = analytic
    out["difference"] = out["peak_memory_bytes"] / analytic - 1 if analytic else None
    return dataclasses.replace(prediction, dry_run=out)
