"""The training loop and the training step, nothing else (builders live in `train/run.py`).

Extension points: `callbacks` (checkpoint saves, test fault injection, future telemetry) see the
step end, each evaluation and the end of `fit`; the loop's own state (iteration, consumed samples)
goes in and out through `state_dict` / `load_state_dict` (torch's Stateful protocol), so the
checkpointer never pokes at fields.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..config.schema import ResolvedConfig
from ..errors import StxWarning
from ..metrics.flops import FlopsCount, throughput_metrics
from ..metrics.peak_memory import MemoryTracker, model_state_bytes
from ..metrics.sinks import Sinks
from ..metrics.timers import Timers, minmax_over_ranks
from ..models import spec_for
from ..parallel.dims import ParallelDims
from ..parallel.distributed import all_reduce_floats
from ..parallel.grads import clip_grads, grad_norm, local
from ..parallel.tensor import loss_ops, loss_parallel_context
from .loss_scale import build_loss_scaler
from .resilience import LossSpikes, NonFiniteSteps, StopSignals

Batch = dict[str, torch.Tensor]
# Megatron's timer names. PHASES are disjoint: with the untimed rest (callbacks, the log record) they
# add up to the step time. NESTED run inside the phase named (Megatron prints them side by side too).
PHASES = (
    "forward-compute",
    "backward-compute",
    "all-grads-sync",  # the exposed part of the gradient reduction: after backward compute, until ready
    "forward-backward",  # a pipeline schedule's step (pp > 1): compute, P2P waits, gradient reductions
    "metrics-all-reduce",  # the step's token counts and losses over dp (a lagging rank is waited for here)
    "embedding-grads-all-reduce",  # tied word-embedding copies of the first and last stage (pp > 1)
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
WAITS = ("all-grads-sync", "metrics-all-reduce", "embedding-grads-all-reduce", "pipeline-p2p-wait")
STRAGGLER_MARGIN = 0.10  # a rank busier than the median of the ranks by more than this is flagged


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    skipped: bool  # no update: an fp16 overflow or a non-finite bf16/fp32 step (train.on_nonfinite=skip)
    lr: float  # the learning rate this step's update used
    metrics: dict[str, float]
    nonfinite: bool = False  # skipped because its loss or gradient norm was inf/nan (not an fp16 overflow)


@dataclass
class History:
    """Per-iteration wall times and the records the summary is computed from."""

    iteration_seconds: list[float] = field(default_factory=list)  # index i = iteration i + 1
    records: list[dict[str, Any]] = field(default_factory=list)  # one per log interval
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


def autocast_context(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device.type, dtype=dtype)


class Callback:
    """Hooks the trainer calls; override what you need. Time spent in them is not training time
    (it is left out of the interval's throughput)."""

    def on_step_start(self, trainer: Trainer) -> None:
        """Before every optimizer step (`trainer.iteration` is the number of steps done so far)."""

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        """After every optimizer step (the iteration counter already advanced)."""

    def on_evaluate(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        """After each evaluation, with its metrics."""

    def on_fit_end(self, trainer: Trainer, history: History) -> None:
        """Once, after the last step of `fit` (also after an exit_interval stop)."""

    def on_checkpoint_staged(self, trainer: Trainer, iteration: int) -> None:
        """A checkpoint's shards are written on every rank and it is not yet published."""

    def on_log(self, trainer: Trainer, record: dict[str, Any]) -> None:
        """Every log interval on every rank, before the record goes to the sinks: add fields to it
        (telemetry). Every rank calls it at the same iterations, so collectives are allowed."""


def gradient_sync(model: torch.nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    """Skip the data-parallel gradient reduction on all but the last micro-batch of a step (unless
    parallel.reduce_each_micro_batch: then ZeRO-2/3 reduce-scatter every micro-batch into the sharded
    gradients)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, FSDPModule):  # ZeRO-2/3
        model.set_requires_gradient_sync(sync)
    elif isinstance(model, DistributedDataParallel) and not sync:  # ZeRO-0/1
        return model.no_sync()
    return contextlib.nullcontext()


class Trainer:
    """Runs `train_iters` optimizer steps of `gradient_accumulation_steps` micro-batches each."""

    def __init__(
        self,
        cfg: ResolvedConfig,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        train_batches: Iterator[Batch],
        valid_batches,
        device: torch.device,
        sinks: Sinks,
        flops: FlopsCount,
        peak_flops_per_device: float,
        num_devices: int = 1,
        dims: ParallelDims | None = None,
        pipeline: Any = None,
        callbacks: Sequence[Callback] = (),
    ):
        """`dims`: the run's topology (None: a plain single process); `pipeline`: the
        parallel.pipeline.PipelineRunner of this rank's stages when pp > 1 (`model` is then the
        ModuleList of those stages)."""
        self.cfg, self.model, self.optimizer, self.scheduler = cfg, model, optimizer, scheduler
        self.train_batches, self.valid_batches = train_batches, valid_batches
        self.device, self.sinks, self.flops = device, sinks, flops
        self.peak_flops, self.num_devices = peak_flops_per_device, num_devices
        self.spec = spec_for(cfg.model)
        self.global_batch = cfg.train.global_batch_size
        self.accumulation = cfg.train.gradient_accumulation_steps
        sync = torch.cuda.synchronize if device.type == "cuda" and cfg.logging.timers_sync else None
        self.timers = Timers(sync)
        self.memory = MemoryTracker(device)
        self.scaler = build_loss_scaler(cfg.train)
        self.dims = dims or ParallelDims(dp=1, tp=1, pp=1)
        self.pipeline = pipeline
        self.grad_norm_excluded: set[int] = pipeline.grad_norm_excluded() if pipeline is not None else set()
        t = cfg.train
        self.nonfinite = NonFiniteSteps(t.on_nonfinite, t.max_skipped_steps)
        self.spikes = LossSpikes(t.loss_spike_factor)
        world = dist.group.WORLD if dist.is_initialized() else None
        self.stop_signals = StopSignals(world, t.stop_check_interval)
        self.callbacks = list(callbacks)
        self._sync = sync
        from ..parallel.comm import recorders

        self.comm = recorders(model) + ([pipeline.comm_recorder] if pipeline is not None else [])
        self.history = History()
        self.iteration = 0
        self.consumed_samples = 0
        self.last_lr = 0.0

    # ------------------------------------------------------------------ one step

    def _next_micro_batches(self) -> list[Batch]:
        with self.timers("batch-generator"):
            return [
                {k: v.to(self.device, non_blocking=True) for k, v in next(self.train_batches).items()}
                for _ in range(self.accumulation)
            ]

    def train_step(self, micro_batches: list[Batch]) -> StepResult:
        """Forward and backward every micro-batch, then one optimizer step on the accumulated gradient.

        Each micro-batch's loss is weighted by its share of the step's target tokens, so that
        accumulation over k micro-batches computes the same gradient as one batch k times larger.
        """
        if not self.model.training:  # after evaluate(); walking every module each step costs ~1 ms
            self.model.train()
        with self.timers("zero-grad"):
            self.optimizer.zero_grad(set_to_none=True)
        dims, pipeline = self.dims, self.pipeline
        # a collective only with dp > 1: one process has nothing to wait for
        counting = self.timers("metrics-all-reduce") if dims.dp_group is not None else None
        with counting or contextlib.nullcontext():
            normalizers = step_normalizers(micro_batches, dims.dp_group)
        # DDP/FSDP average gradients over dp; the losses are already shares of the global mean
        multiplier = float(dims.dp)
        if pipeline is not None:
            with self.timers("forward-backward"), autocast_context(self.cfg.train.precision, self.device):
                totals = pipeline.train_step(micro_batches, normalizers, multiplier * self.scaler.get_scale())
        else:
            totals = {}
            last = len(micro_batches) - 1
            for i, micro in enumerate(micro_batches):
                sync = i == last or self.cfg.parallel.reduce_each_micro_batch
                with gradient_sync(self.model, sync), loss_parallel_context(dims.tp):
                    with (
                        self.timers("forward-compute"),
                        autocast_context(self.cfg.train.precision, self.device),
                    ):
                        outputs = self.model(*self.spec.inputs(micro))
                        loss, metrics = self.spec.loss(outputs, micro, normalizers, loss_ops(dims.tp))
                    self._backward(self.scaler.scale(loss * multiplier))
                for k, v in metrics.items():
                    totals[k] = totals.get(k, 0.0) + float(v)
        if dims.dp_group is not None:
            keys = sorted(totals)
            with self.timers("metrics-all-reduce"):
                reduced = all_reduce_floats([totals[k] for k in keys], dims.dp_group)
            totals = dict(zip(keys, reduced, strict=True))
        if pipeline is not None:
            with self.timers("embedding-grads-all-reduce"):
                pipeline.sync_tied_grads()
        with self.timers("optimizer"):
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
            with self.timers("optimizer-unscale-and-check-inf"):
                found_inf = self.scaler.unscale_([local(p.grad) for p in params if p.grad is not None])
            with self.timers("optimizer-clip-main-grad"):
                norm = float(grad_norm(params, exclude=self.grad_norm_excluded, pp_group=dims.pp_group))
                # fp16's scaler decides its own skips; bf16/fp32 follow train.on_nonfinite (may raise)
                nonfinite = not found_inf and self.nonfinite.check(self.iteration + 1, totals["loss"], norm)
                if not found_inf and not nonfinite:
                    clip_grads(params, self.cfg.optim.clip_grad or math.inf, norm)
            lr = self.optimizer.param_groups[0]["lr"]
            # as Megatron and DeepSpeed: an overflowing fp16 step is skipped and does not advance the schedule
            if not found_inf and not nonfinite:
                with self.timers("optimizer-inner-step"):
                    self.optimizer.step()
                    self.scheduler.step()
            self.scaler.update(found_inf)
        skipped = found_inf or nonfinite
        loss = totals.pop("loss")
        return StepResult(
            loss=loss, grad_norm=norm, skipped=skipped, lr=lr, metrics=totals, nonfinite=nonfinite
        )

    def _backward(self, loss: torch.Tensor) -> None:
        """loss.backward(), split into `backward-compute` and `all-grads-sync`: the time the training
        thread waited for gradient collectives after the backward compute (parallel/comm.py)."""
        if self._sync is not None:
            self._sync()
        for recorder in self.comm:
            recorder.take_blocked()
        start = time.perf_counter()
        loss.backward()
        if self._sync is not None:
            self._sync()
        end = time.perf_counter()
        exposed = 0.0
        for recorder in self.comm:
            blocked = recorder.take_blocked()  # synchronous reduce-scatters (FSDP2 on CPU)
            launch = recorder.last_grad_launch  # DDP: the last bucket is launched when compute ends
            tail = end - launch if launch is not None and launch >= start else 0.0
            exposed += max(blocked, tail)
        exposed = min(exposed, end - start)
        self.timers.add("backward-compute", end - start - exposed)
        if self.comm:
            self.timers.add("all-grads-sync", exposed)

    # ------------------------------------------------------------------ evaluation

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Loss, perplexity (and MLM/binary accuracy for BERT) over eval_iters validation micro-batches."""
        self.model.eval()
        # Every rank evaluates the same batches: ZeRO-3 and pipeline stages need all ranks in each forward.
        batches = [{k: v.to(self.device) for k, v in b.items()} for b in self.valid_batches()]
        normalizers = step_normalizers(batches)
        totals: dict[str, float] = {}
        if self.pipeline is not None:
            with autocast_context(self.cfg.train.precision, self.device):
                totals = self.pipeline.evaluate(batches, normalizers)
        for batch in batches if self.pipeline is None else []:
            with autocast_context(self.cfg.train.precision, self.device), loss_parallel_context(self.dims.tp):
                outputs = self.model(*self.spec.inputs(batch))
                _, metrics = self.spec.loss(outputs, batch, normalizers, loss_ops(self.dims.tp))
            for k, v in metrics.items():
                totals[k] = totals.get(k, 0.0) + float(v)
        lm_key = self.spec.lm_metric
        result = {"loss": totals["loss"], lm_key: totals[lm_key], "ppl": math.exp(min(totals[lm_key], 50.0))}
        if "mlm_correct" in totals:
            result["mlm_accuracy"] = totals["mlm_correct"] / max(totals["mlm_count"], 1.0)
        if "binary_correct" in totals:
            result["binary_accuracy"] = totals["binary_correct"] / max(totals["binary_count"], 1.0)
        return result

    # ------------------------------------------------------------------ the loop

    def fit(self) -> History:
        """Train to train_iters, or until a stop signal (then `history.stopped_by` names it)."""
        h = self.history
        self.memory.reset_peak()
        # the callbacks' end (the final checkpoint) inside too: a second signal must not cut that save short
        with self.stop_signals:
            self._loop()
            h.run_peak_memory_bytes = self.memory.run_peak().peak_allocated_bytes
            for callback in self.callbacks:
                callback.on_fit_end(self, h)
        return h

    def _loop(self) -> None:
        cfg, h = self.cfg, self.history
        log_every, eval_every = cfg.logging.log_interval, cfg.train.eval_interval
        interval = Interval(start=time.perf_counter())
        interval_first = self.iteration + 1
        while self.iteration < cfg.train.train_iters:
            for callback in self.callbacks:
                callback.on_step_start(self)
            t0 = time.perf_counter()
            result = self.train_step(self._next_micro_batches())
            if self.device.type == "cuda":
                torch.cuda.synchronize()  # one sync per step: iteration time must include queued kernels
            h.iteration_seconds.append(time.perf_counter() - t0)
            self.iteration += 1
            self.consumed_samples += self.global_batch
            self.last_lr = result.lr
            self._note_faults(result)
            if not h.model_state_bytes:  # the optimizer state exists from the first step on
                h.model_state_bytes = model_state_bytes(self.model, self.optimizer)
            interval.add(result)
            interval.step_seconds += h.iteration_seconds[-1]
            h.stopped_by = self.stop_signals.agreed(self.iteration)  # every rank stops after the same step

            at_log = self.iteration % log_every == 0 or self.iteration == cfg.train.train_iters
            if at_log or h.stopped_by:
                record = self._train_record(interval)
                for callback in self.callbacks:
                    callback.on_log(self, record)
                if h.first_logged_loss is None:
                    h.first_logged_loss = record["loss"]
                h.last_logged_loss = record["loss"]
                profiled = sum(
                    1 for i in range(interval_first, self.iteration + 1) if i in h.excluded_iterations
                )
                if profiled:
                    record["profiled_steps"] = profiled  # slowed by the profiler: left out of the summary
                h.records.append({"iteration": self.iteration, **record})
                self.sinks.write("train", self.iteration, record)
                self.memory.reset_peak()
                interval = Interval(start=time.perf_counter())
                interval_first = self.iteration + 1

            # evaluation and callbacks (checkpoint saves) are not training throughput
            outside = time.perf_counter()
            at_end = self.iteration == cfg.train.train_iters
            if cfg.train.eval_iters and ((eval_every and self.iteration % eval_every == 0) or at_end):
                h.last_valid = self.evaluate()
                self.sinks.write("valid", self.iteration, h.last_valid)
                for callback in self.callbacks:
                    callback.on_evaluate(self, h.last_valid)
            for callback in self.callbacks:
                callback.on_step_end(self, result)
            interval.start += time.perf_counter() - outside
            if h.stopped_by or (cfg.train.exit_interval and self.iteration % cfg.train.exit_interval == 0):
                break

    def _note_faults(self, result: StepResult) -> None:
        """The finished step's skips, non-finite skip and loss spike, in the history (spikes also said)."""
        h = self.history
        h.skipped_iterations += result.skipped
        if result.nonfinite:
            h.nonfinite_iterations.append(self.iteration)
        median = self.spikes.check(result.loss)
        if median is None:
            return
        h.loss_spikes.append({"iteration": self.iteration, "loss": result.loss, "median": median})
        if self.dims.is_main:
            warnings.warn(
                f"loss spike at iteration {self.iteration}: {result.loss:.4f} > "
                f"{self.cfg.train.loss_spike_factor:g} x the median of the recent losses ({median:.4f})",
                StxWarning,
                stacklevel=1,
            )

    # ------------------------------------------------------------------ Stateful (checkpoints)

    def state_dict(self) -> dict[str, int]:
        """The loop's position: what a checkpoint needs besides model, optimizer, schedule and scaler."""
        return {"iteration": self.iteration, "consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.iteration = int(state["iteration"])
        self.consumed_samples = int(state["consumed_samples"])

    def _train_record(self, interval: Interval) -> dict[str, Any]:
        """Interval averages: losses over non-skipped steps, time over all steps since the last log."""
        cfg = self.cfg
        seconds = (time.perf_counter() - interval.start) / interval.iterations
        peak = self.memory.peak()
        self.history.peak_memory_bytes = max(self.history.peak_memory_bytes, peak.peak_allocated_bytes)
        self.history.peak_memory_method = peak.method
        perf = throughput_metrics(self.flops, seconds, self.num_devices, self.peak_flops)
        record: dict[str, Any] = {
            "train_iters": cfg.train.train_iters,
            "consumed_samples": self.consumed_samples,
            "lr": self.last_lr,
            **interval.means(),
            "samples_per_second": self.global_batch / seconds,
            "tokens_per_second": self.global_batch * cfg.model.seq_length / seconds,
            "iteration_time_ms": 1000 * seconds,
            "tflops_per_device": perf["tflops_per_device"],
            "mfu": perf["mfu"],
            "hfu": perf["hfu"],
            "peak_memory_bytes": peak.peak_allocated_bytes,
            "peak_memory_kind": "allocated" if self.device.type == "cuda" else "rss",
            "skipped_iterations": interval.skipped,
            "nonfinite_iterations": interval.nonfinite,
        }
        if self.scaler.is_enabled():
            record["loss_scale"] = self.scaler.get_scale()
        n = interval.iterations
        record["step_time_ms"] = 1000 * interval.step_seconds / n  # train_step alone, measured per step
        timed = [name for name in (*PHASES, *NESTED) if name in self.timers.names()]
        elapsed = self.timers.elapsed_ms(timed, normalizer=n, reset=True)
        comm: dict[str, float] = {}
        for recorder in self.comm:
            for kind, seconds in recorder.take().items():
                comm[kind] = comm.get(kind, 0.0) + 1000 * seconds / n
        if "pipeline-p2p-wait" in comm:  # the schedule's send/recv waits, a part of forward-backward
            elapsed["pipeline-p2p-wait"] = comm.pop("pipeline-p2p-wait")
        for name, ms in elapsed.items():
            record[f"time_ms/{name}"] = ms
        for kind, ms in comm.items():
            record[f"comm_ms/{kind}"] = ms
        if "pipeline-p2p-wait" in elapsed and elapsed.get("forward-backward"):
            record["pipeline_bubble_measured"] = elapsed["pipeline-p2p-wait"] / elapsed["forward-backward"]
        if self.dims.world_size > 1:  # every rank logs at the same iterations, so all take part
            from ..parallel.comm import KINDS

            names = [*PHASES, *NESTED, *(f"comm:{k}" for k in KINDS)]
            measured = {**elapsed, **{f"comm:{k}": v for k, v in comm.items()}}
            for name, (low, high) in minmax_over_ranks(measured, names).items():
                if name.startswith("comm:"):
                    key = name.split(":", 1)[1]
                    record[f"comm_ms_min/{key}"], record[f"comm_ms_max/{key}"] = low, high
                else:
                    record[f"time_ms_min/{name}"], record[f"time_ms_max/{name}"] = low, high
            busy = record["step_time_ms"] - sum(elapsed.get(name, 0.0) for name in WAITS)
            record["busy_ms"] = busy
            per_rank = gather_floats(busy, self.dims.rank, self.dims.world_size)
            record["busy_ms_per_rank"] = per_rank
            record["straggler_rank"] = straggler(per_rank)
            if self.iteration > self.cfg.logging.warmup_iters:
                self.history.stragglers.append(record["straggler_rank"])
        return record


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


LOSS_KEYS = ("loss", "lm_loss", "mlm_loss", "binary_loss", "grad_norm")


@dataclass
class Interval:
    """What happened since the last log line."""

    start: float
    iterations: int = 0
    skipped: int = 0
    nonfinite: int = 0  # of the skipped: non-finite bf16/fp32 steps (the others: fp16 overflows)
    sums: dict[str, float] = field(default_factory=dict)
    counted: int = 0  # non-skipped steps, the ones whose losses are averaged
    step_seconds: float = 0.0  # the interval's train_step times (batch generation included)

    def add(self, result: StepResult) -> None:
        self.iterations += 1
        self.skipped += result.skipped
        self.nonfinite += result.nonfinite
        if result.skipped:
            return
        self.counted += 1
        values = {"loss": result.loss, "grad_norm": result.grad_norm, **result.metrics}
        for key in LOSS_KEYS:
            if key in values:
                self.sums[key] = self.sums.get(key, 0.0) + values[key]

    def means(self) -> dict[str, float]:
        keys = [k for k in LOSS_KEYS if k in self.sums] or ["loss", "grad_norm"]
        return {k: self.sums[k] / self.counted if self.counted else math.nan for k in keys}


def step_normalizers(micro_batches: list[Batch], dp_group: Any = None) -> dict[str, int]:
    """Counts over the whole step (all data-parallel ranks) that each micro-batch's summed loss is
    divided by, so every rank's losses are shares of the one global mean."""
    labelled = sum(int((b["labels"] != -100).sum()) for b in micro_batches)
    samples = sum(int(b["input_ids"].shape[0]) for b in micro_batches)
    if dp_group is not None:
        labelled, samples = (int(x) for x in all_reduce_floats([labelled, samples], dp_group))
    return {"tokens": max(labelled, 1), "samples": samples}
