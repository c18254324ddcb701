"""Measurement as its own component: what the trainer's steps did, read on the host only at logging
steps, and the one place a log record is built.

The step keeps its numbers on the device. `StepLedger` holds each step's metric sums (this rank's
shares of the step's losses) and its global gradient norm as tensors; at a logging step (or before a
checkpoint is saved) it reduces every pending step over the data- and pipeline-parallel groups in one
all-reduce per group and reads them with one `.tolist()`: the only host synchronization of the
interval's accounting. `StepClock` times steps with CUDA events on a GPU (read at the same point) and
`time.perf_counter` on a CPU. `Measurement` owns them, the phase timers, the memory tracker and the
communication recorders, builds the interval's record and writes it to the sinks.

torchtitan and Megatron were read for the approach (device-side token counts, `.item()` only at
logging steps, timers that synchronize only when asked); the bookkeeping is ours because it serves
our record (per-phase min/max over ranks, stragglers, skipped and non-finite steps).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..config.schema import ResolvedConfig
from ..metrics.flops import FlopsCount, throughput_metrics
from ..metrics.peak_memory import MemoryTracker
from ..metrics.sinks import LogRecord, Sinks
from ..metrics.timers import Timers, minmax_over_ranks
from ..models import MOE_METRICS
from ..parallel.comm import KINDS
from ..parallel.dims import ParallelDims
from ..parallel.distributed import all_reduce_floats, collective_device
from ..parallel.grads import local

# Megatron's timer names. PHASES are disjoint: with the untimed rest (callbacks, the log record) they
# add up to the step time. NESTED run inside the phase named (Megatron prints them side by side too).
PHASES = (
    "forward-compute",
    "backward-compute",
    "all-grads-sync",  # the exposed part of the gradient reduction: after backward compute, until ready
    "forward-backward",  # a pipeline schedule's step (pp > 1): compute, P2P waits, gradient reductions
    "metrics-all-reduce",  # waiting for the step's token count over dp (a lagging rank is waited for here)
    "embedding-grads-all-reduce",  # tied word-embedding copies of the first and last stage (pp > 1)
    "layernorm-grads-all-reduce",  # sequence parallel: the norms' gradients summed over the tp ranks
    "zero-grad",
    "optimizer",
    "batch-generator",
)
NESTED = {
    "pipeline-p2p-wait": "forward-backward",
    "optimizer-unscale-and-check-inf": "optimizer",
    "optimizer-clip-main-grad": "optimizer",
    "optimizer-inner-step": "optimizer",
}
WAITS = (
    "all-grads-sync",
    "metrics-all-reduce",
    "embedding-grads-all-reduce",
    "layernorm-grads-all-reduce",
    "pipeline-p2p-wait",
)
STRAGGLER_MARGIN = 0.10  # a rank busier than the median of the ranks by more than this is flagged
LOSS_KEYS = ("loss", "lm_loss", "mlm_loss", "binary_loss", "grad_norm", *MOE_METRICS, "moe_load_imbalance")


@dataclass
class StepResult:
    """One optimizer step as the step left it: device tensors, not read on the host."""

    metrics: dict[str, torch.Tensor]  # this rank's metric sums over the micro-batches (shares of the mean)
    grad_norm: torch.Tensor  # the global gradient norm (every rank has the same)
    skipped: bool  # no update: an fp16 overflow, or a non-finite step under train.on_nonfinite=skip
    lr: float  # the learning rate this step's update used
    nonfinite: bool = False  # skipped because its gradient norm was inf/nan (not an fp16 overflow)
    # MoE: assignments routed to each expert [MoE layers, experts], this rank's, summed over micro-batches
    expert_tokens: torch.Tensor | None = None

    @property
    def loss(self) -> torch.Tensor:
        return self.metrics["loss"]


@dataclass
class StepValues:
    """One step's figures on the host: metrics summed over every rank, as the log averages them."""

    iteration: int
    metrics: dict[str, float]
    grad_norm: float
    skipped: bool
    nonfinite: bool

    @property
    def loss(self) -> float:
        return self.metrics["loss"]


class StepLedger:
    """Steps whose figures are still on the device, and those already read but not yet logged."""

    def __init__(self, dims: ParallelDims) -> None:
        # tp ranks hold the same losses; dp (and cp) ranks hold shares; pp: the last stage holds them,
        # others 0
        self.groups = [g for g in (dims.grad_group, dims.pp_group) if g is not None and _size(g) > 1]
        self.pending: list[tuple[int, StepResult]] = []
        self.read: list[StepValues] = []

    def add(self, iteration: int, result: StepResult) -> None:
        self.pending.append((iteration, result))

    def settle(self) -> list[StepValues]:
        """Read every pending step (one all-reduce per group, one host read); returns them. An MoE
        model's per-expert token counts travel in the same rows; each step gets `moe_load_imbalance`
        from them (`load_imbalance`)."""
        if not self.pending:
            return []
        keys = sorted(self.pending[0][1].metrics)
        rows = torch.stack(
            [torch.stack([local(r.metrics[k]).float() for k in keys]) for _, r in self.pending]
        )
        tokens = self.pending[0][1].expert_tokens
        if tokens is not None:
            counts = [local(r.expert_tokens).float().flatten() for _, r in self.pending]  # type: ignore[arg-type]
            rows = torch.cat([rows, torch.stack(counts).to(rows.device)], dim=1)
        for group in self.groups:
            device = collective_device(group)
            staged = rows if rows.device == device else rows.to(device)
            dist.all_reduce(staged, group=group)
            rows = staged
        norms = torch.stack([local(r.grad_norm).float().to(rows.device) for _, r in self.pending])
        flat = torch.cat([rows, norms[:, None]], dim=1).flatten().tolist()  # the one host read
        width = rows.shape[1] + 1
        settled = []
        for n, (i, r) in enumerate(self.pending):
            row = flat[n * width : (n + 1) * width]
            metrics = dict(zip(keys, row[: len(keys)], strict=True))
            if tokens is not None:
                metrics["moe_load_imbalance"] = load_imbalance(row[len(keys) : -1], tokens.shape[-1])
            settled.append(StepValues(i, metrics, row[-1], r.skipped, r.nonfinite))
        self.pending = []
        self.read.extend(settled)
        return settled

    def take(self) -> list[StepValues]:
        """Every step read since the last take (settling the pending ones first)."""
        self.settle()
        taken, self.read = self.read, []
        return taken


def _size(group: Any) -> int:
    return dist.get_world_size(group)


def load_imbalance(tokens: Sequence[float], experts: int) -> float:
    """The worst MoE layer's max / mean assignments per expert over a step (1.0: perfectly balanced;
    the worst layer, not the mean over layers, since the slowest expert of any layer holds the step
    up). `tokens`: the step's counts, layer by layer, `experts` per layer."""
    worst = 1.0
    for start in range(0, len(tokens), experts):
        layer = tokens[start : start + experts]
        mean = sum(layer) / experts
        if mean > 0:
            worst = max(worst, max(layer) / mean)
    return worst


class StepClock:
    """Each step's time, from before its batches to after its update: CUDA events on a GPU (recorded
    without waiting, read at logging steps, so the queued kernels are included), perf_counter on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._marks: list[tuple[Any, Any]] = []

    def _now(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        self._marks.append((self._now(), None))

    def stop(self) -> None:
        begin, _ = self._marks[-1]
        self._marks[-1] = (begin, self._now())

    def read(self) -> list[float]:
        """Seconds of each step timed since the last read (waits for the last one's kernels on a GPU)."""
        marks, self._marks = self._marks, []
        if not marks:
            return []
        if not self.cuda:
            return [end - begin for begin, end in marks]
        marks[-1][1].synchronize()
        return [begin.elapsed_time(end) / 1000.0 for begin, end in marks]


@dataclass
class History:
    """Per-iteration wall times and the records the summary is computed from."""

    iteration_seconds: list[float] = field(default_factory=list)  # index i = iteration first_iteration + i
    first_iteration: int = 1  # the first iteration this job ran (later than 1 after a resume)
    records: list[LogRecord] = field(
        default_factory=list
    )  # one per log interval, `iteration` among its scalars
    first_logged_loss: float | None = None
    last_logged_loss: float | None = None
    last_valid: dict[str, float] | None = None
    peak_memory_bytes: int = 0
    peak_memory_method: str = ""
    # whole-run high-water mark (bytes), initialization included: interval peaks are reset at each log
    run_peak_memory_bytes: int = 0
    # this rank's parameters / gradients / optimizer state after the first optimizer step (bytes)
    model_state_bytes: dict[str, int] = field(default_factory=dict)
    skipped_iterations: int = 0
    nonfinite_iterations: list[int] = field(default_factory=list)  # skipped as non-finite (on_nonfinite=skip)
    loss_spikes: list[dict[str, float]] = field(default_factory=list)  # {iteration, loss, median}
    stopped_by: str | None = None  # the signal that stopped the run early (StopSignals), after a checkpoint
    # iterations left out of the throughput statistics (profiled steps: the profiler slows them)
    excluded_iterations: set[int] = field(default_factory=set)
    # per log interval: the rank whose busy time (step minus communication waits) stood out, or None
    stragglers: list[int | None] = field(default_factory=list)
    # fields callbacks add to summary.json (telemetry, the profile table)
    summary_extra: dict[str, Any] = field(default_factory=dict)

    def warmup_iterations(self, warmup_iters: int) -> int:
        """How many of this job's first iterations the statistics leave out: `logging.warmup_iters`,
        or none when the job ran no more than that."""
        return warmup_iters if len(self.iteration_seconds) > warmup_iters else 0

    def last_warmup_iteration(self, warmup_iters: int) -> int:
        """The job's last warm-up iteration, counted as the trainer counts (from the resumed one on)."""
        return self.first_iteration + self.warmup_iterations(warmup_iters) - 1


@dataclass
class Interval:
    """What happened since the last log line, from the steps' host values."""

    start: float
    first_iteration: int
    iterations: int = 0
    step_seconds: float = 0.0  # the interval's train_step times (batch generation included)

    @staticmethod
    def means(steps: Sequence[StepValues]) -> dict[str, float]:
        """Losses and gradient norm averaged over the steps that updated the weights."""
        counted = [s for s in steps if not s.skipped]
        present = [k for k in LOSS_KEYS if k == "grad_norm" or (steps and k in steps[0].metrics)]
        keys = present or ["loss", "grad_norm"]

        def value(s: StepValues, key: str) -> float:
            return s.grad_norm if key == "grad_norm" else s.metrics[key]

        return {k: sum(value(s, k) for s in counted) / len(counted) if counted else math.nan for k in keys}


class Measurement:
    """Timers, the step clock, memory, communication recorders and the step ledger of one run, and the
    interval's log record built from them."""

    def __init__(
        self,
        cfg: ResolvedConfig,
        device: torch.device,
        dims: ParallelDims,
        flops: FlopsCount,
        peak_flops_per_device: float,
        sinks: Sinks,
    ) -> None:
        self.cfg, self.device, self.dims = cfg, device, dims
        self.flops, self.peak_flops, self.sinks = flops, peak_flops_per_device, sinks
        self.fp8_peak_flops = 0.0  # a train.fp8 run's float8 peak (build_measurement), 0.0: none
        log = cfg.logging
        self.sync: Callable[[], None] | None = (
            torch.cuda.synchronize if device.type == "cuda" and log.timers_sync else None
        )
        self.timers = Timers(self.sync, level=log.timing_log_level)
        self.clock = StepClock(device)
        self.memory = MemoryTracker(device)
        self.ledger = StepLedger(dims)
        self.comm: list[Any] = []  # parallel.comm recorders (DDP hook, FSDP2 comms, pipeline waits)
        self.history = History()
        self.interval = Interval(start=time.perf_counter(), first_iteration=1)

    def attach_comm(self, recorders: Sequence[Any]) -> None:
        self.comm = list(recorders)

    def start_interval(self, iteration: int) -> None:
        self.memory.reset_peak()
        self.interval = Interval(start=time.perf_counter(), first_iteration=iteration + 1)

    # ------------------------------------------------------------------ per step (no host reads)

    def step_done(self, iteration: int, result: StepResult) -> None:
        self.ledger.add(iteration, result)
        self.interval.iterations += 1

    # ------------------------------------------------------------------ at a logging step

    def read_steps(self) -> list[StepValues]:
        """The interval's steps on the host, and their times into the history (a host synchronization)."""
        seconds = self.clock.read()
        self.history.iteration_seconds.extend(seconds)
        self.interval.step_seconds += sum(seconds)
        return self.ledger.take()

    def record(
        self, steps: Sequence[StepValues], consumed_samples: int, lr: float, scale: float | None
    ) -> LogRecord:
        """The interval's log record: averages over its steps, rates, phase times, memory, spread."""
        cfg, n = self.cfg, max(self.interval.iterations, 1)
        seconds = (time.perf_counter() - self.interval.start) / n
        peak = self.memory.peak()
        h = self.history
        h.peak_memory_bytes = max(h.peak_memory_bytes, peak.peak_allocated_bytes)
        h.peak_memory_method = peak.method
        perf = throughput_metrics(self.flops, seconds, self.dims.world_size, self.peak_flops)
        gb = cfg.train.global_batch_size
        scalars: dict[str, Any] = {
            "train_iters": cfg.train.train_iters,
            "consumed_samples": consumed_samples,
            "lr": lr,
            **Interval.means(steps),
            "samples_per_second": gb / seconds,
            "tokens_per_second": gb * cfg.model.seq_length / seconds,
            "iteration_time_ms": 1000 * seconds,
            "tflops_per_device": perf["tflops_per_device"],
            "mfu": perf["mfu"],
            "hfu": perf["hfu"],
            **self._fp8_mfu(seconds),
            "peak_memory_bytes": peak.peak_allocated_bytes,
            "peak_memory_kind": "allocated" if self.device.type == "cuda" else "rss",
            "skipped_iterations": sum(s.skipped for s in steps),
            "nonfinite_iterations": sum(s.nonfinite for s in steps),
        }
        if scale is not None:
            scalars["loss_scale"] = scale
        scalars["step_time_ms"] = 1000 * self.interval.step_seconds / n  # train_step alone, per step
        elapsed, comm = self._phase_times(n)
        record = LogRecord(scalars=scalars, phase_ms=elapsed, comm_ms=comm)
        if "pipeline-p2p-wait" in elapsed and elapsed.get("forward-backward"):
            record["pipeline_bubble_measured"] = elapsed["pipeline-p2p-wait"] / elapsed["forward-backward"]
        if self.dims.world_size > 1:  # every rank logs at the same iterations, so all take part
            self._spread(record, elapsed, comm)
        return record

    def _fp8_mfu(self, seconds: float) -> dict[str, Any]:
        """A train.fp8 run's MFU against the float8 peak (`mfu` is against the bf16 one): None where
        the device has no float8 peak (a CPU); nothing for other runs."""
        if self.cfg.train.fp8 == "none":
            return {}
        world = self.dims.world_size
        peak = self.fp8_peak_flops or None
        return {"mfu_fp8": throughput_metrics(self.flops, seconds, world, peak)["mfu"]}

    def _phase_times(self, n: int) -> tuple[dict[str, float], dict[str, float]]:
        timed = [name for name in (*PHASES, *NESTED) if name in self.timers.names()]
        elapsed = self.timers.elapsed_ms(timed, normalizer=n, reset=True)
        comm: dict[str, float] = {}
        for recorder in self.comm:
            for kind, seconds in recorder.take().items():
                comm[kind] = comm.get(kind, 0.0) + 1000 * seconds / n
        if "pipeline-p2p-wait" in comm:  # the schedule's send/recv waits, a part of forward-backward
            elapsed["pipeline-p2p-wait"] = comm.pop("pipeline-p2p-wait")
        return elapsed, comm

    def _spread(self, record: LogRecord, elapsed: dict[str, float], comm: dict[str, float]) -> None:
        """Min/max of every phase over the ranks, each rank's busy time and the straggler among them."""
        names = [*PHASES, *NESTED, *(f"comm:{k}" for k in KINDS)]
        measured = {**elapsed, **{f"comm:{k}": v for k, v in comm.items()}}
        for name, (low, high) in minmax_over_ranks(measured, names).items():
            if name.startswith("comm:"):
                kind = name.removeprefix("comm:")
                record.comm_ms_min[kind], record.comm_ms_max[kind] = low, high
            else:
                record.phase_ms_min[name], record.phase_ms_max[name] = low, high
        busy = record["step_time_ms"] - sum(elapsed.get(name, 0.0) for name in WAITS)
        record["busy_ms"] = busy
        per_rank = gather_floats(busy, self.dims.rank, self.dims.world_size)
        record["busy_ms_per_rank"] = per_rank
        record["straggler_rank"] = straggler(per_rank)
        last = self.interval.first_iteration + self.interval.iterations - 1
        if last > self.history.first_iteration + self.cfg.logging.warmup_iters - 1:
            self.history.stragglers.append(record["straggler_rank"])


def gather_floats(value: float, rank: int, world_size: int, group: Any = None) -> list[float]:
    """One float from every rank of `group`, in rank order (one all-reduce; all ranks call it)."""
    slots = [0.0] * world_size
    slots[rank] = float(value)
    return all_reduce_floats(slots, group)


def straggler(busy_ms: list[float], margin: float = STRAGGLER_MARGIN) -> int | None:
    """The rank whose busy time (step time minus the time spent waiting in collectives) exceeds the
    median over ranks by more than `margin`, or None. Waiting is left out because the ranks a straggler
    holds up show its delay as their own longer steps (they wait for it in the next collective)."""
    if len(busy_ms) < 2:
        return None
    ranked = sorted(busy_ms)
    median = ranked[(len(ranked) - 1) // 2]  # the lower median: with 2 ranks, the faster one
    slowest = max(range(len(busy_ms)), key=lambda r: busy_ms[r])
    return slowest if busy_ms[slowest] > (1 + margin) * median and busy_ms[slowest] - median > 1.0 else None
