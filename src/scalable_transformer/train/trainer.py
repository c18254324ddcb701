"""The training loop and the training step, nothing else (builders live in `train/build.py`).

Extension points: `callbacks` (checkpoint saves, test fault injection, future telemetry) see the
step end, each evaluation and the end of `fit`; the loop's own state (iteration, consumed samples)
goes in and out through `state_dict` / `load_state_dict` (torch's Stateful protocol), so the
checkpointer never pokes at fields.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from ..config.schema import ResolvedConfig
from ..errors import StxWarning
from ..metrics.peak_memory import model_state_bytes
from ..metrics.sinks import LogRecord
from ..models import MoEStep, spec_for
from ..parallel.comm import recorders
from ..parallel.context import split_batch
from ..parallel.dims import ParallelDims
from ..parallel.distributed import all_reduce_floats, collective_device
from ..parallel.float8_training import float8_all_gathers, refresh_float8_scales
from ..parallel.grads import clip_grads, grad_norm, local, reduce_partial_grads
from ..parallel.tensor import loss_ops, loss_parallel_context
from .loss_scale import build_loss_scaler
from .measurement import History, Measurement, StepResult, StepValues
from .resilience import LossSpikes, NonFiniteSteps, StopSignals

Batch = dict[str, torch.Tensor]
__all__ = ["Batch", "Callback", "History", "StepResult", "Trainer", "step_normalizers"]


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
        """After every optimizer step (the iteration counter already advanced). `result` holds device
        tensors: reading one on the host makes the step wait for the device; figures read at logging
        steps come to `on_log`."""

    def on_evaluate(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        """After each evaluation, with its metrics."""

    def on_fit_end(self, trainer: Trainer, history: History) -> None:
        """Once, after the last step of `fit` (also after an exit_interval stop)."""

    def on_checkpoint_staged(self, trainer: Trainer, iteration: int) -> None:
        """A checkpoint's shards are written on every rank and it is not yet published."""

    def on_log(self, trainer: Trainer, record: LogRecord) -> None:
        """Every log interval on every rank, before the record goes to the sinks: add fields to it
        (telemetry). Every rank calls it at the same iterations, so collectives are allowed."""


def gradient_sync(model: torch.nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    """Skip the data-parallel gradient reduction on all but the last micro-batch of a step (unless
    parallel.reduce_each_micro_batch: then ZeRO-2/3 reduce-scatter every micro-batch into the sharded
    gradients)."""
    if isinstance(model, FSDPModule):  # ZeRO-2/3
        model.set_requires_gradient_sync(sync)
    elif isinstance(model, DistributedDataParallel) and not sync:  # ZeRO-0/1
        return model.no_sync()
    return contextlib.nullcontext()


class Trainer:
    """Runs `train_iters` optimizer steps of `gradient_accumulation_steps` micro-batches each.

    Between logging steps nothing is read from the device on the host: losses, token counts and the
    gradient norm stay tensors (`train/measurement.py` reads them at logging steps and before a
    checkpoint). fp16's overflow check and train.on_nonfinite=skip read one flag per step: whether
    to update."""

    def __init__(
        self,
        cfg: ResolvedConfig,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        train_batches: Iterator[Batch],
        valid_batches: Callable[[], Sequence[Batch]],
        measurement: Measurement,
        dims: ParallelDims | None = None,
        pipeline: Any = None,
        callbacks: Sequence[Callback] = (),
    ):
        """`measurement`: the run's timers, clock, memory tracker, sinks and step ledger; `dims`: the
        run's topology (None: a plain single process); `pipeline`: the parallel.pipeline.PipelineRunner
        of this rank's stages when pp > 1 (`model` is then the ModuleList of those stages)."""
        self.cfg, self.model, self.optimizer, self.scheduler = cfg, model, optimizer, scheduler
        self.train_batches, self.valid_batches = train_batches, valid_batches
        self.measure = measurement
        self.device = measurement.device
        self.spec = spec_for(cfg.model)
        self.global_batch = cfg.train.global_batch_size
        self.accumulation = cfg.train.gradient_accumulation_steps
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
        measurement.attach_comm(recorders(model) + ([pipeline.comm_recorder] if pipeline is not None else []))
        self.timers = measurement.timers  # the dry run wraps it to name the phase that runs
        self.history = measurement.history
        self.sinks = measurement.sinks
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.float8_scales = float8_all_gathers(model)  # train.fp8 = tensorwise under FSDP2
        self.moe = MoEStep.of(model, cfg.model)  # the MoE layers this rank holds (None: dense model)
        self.iteration = 0
        self.consumed_samples = 0
        self.last_lr = 0.0

    # ------------------------------------------------------------------ one step

    def _next_micro_batches(self) -> list[Batch]:
        with self.timers("batch-generator"):
            return [
                self._context_share({k: v.to(self.device, non_blocking=True) for k, v in batch.items()})
                for batch in (next(self.train_batches) for _ in range(self.accumulation))
            ]

    def _context_share(self, batch: Batch) -> Batch:
        """This rank's share of a batch under context parallelism (its two chunks of every sequence:
        parallel/context.py); the batch itself otherwise."""
        return split_batch(batch, self.dims.cp, self.dims.cp_rank, self.cfg.model.seq_length)

    def _normalizers(self, micro_batches: list[Batch], group: Any, dp: int) -> tuple[dict[str, Any], Any]:
        """`step_normalizers` over `group`, with the binary head's share under context parallelism:
        only cp rank 0 holds each sample's first token (BERT's sentence-order head scores it)."""
        normalizers, counted = step_normalizers(micro_batches, group, dp)
        if self.dims.cp > 1:
            normalizers["binary_share"] = 1 if self.dims.cp_rank == 0 else 0
        return normalizers, counted

    def train_step(self, micro_batches: list[Batch]) -> StepResult:
        """Forward and backward every micro-batch, then one optimizer step on the accumulated gradient.

        Each micro-batch's loss is weighted by its share of the step's target tokens (counted over
        every data-parallel rank, on the device), so that accumulation over k micro-batches computes
        the same gradient as one batch k times larger. Returns device tensors: nothing here waits for
        the device, except the one flag fp16 (and train.on_nonfinite=skip) needs to decide the update.
        """
        if not self.model.training:  # after evaluate(); walking every module each step costs ~1 ms
            self.model.train()
        with self.timers("zero-grad"):
            self.optimizer.zero_grad(set_to_none=True)
        # tokens: over every rank holding a share of the step's sequences (dp x cp); samples: over dp
        normalizers, counted = self._normalizers(micro_batches, self.dims.grad_group, self.dims.dp)
        if self.moe is not None:  # the aux losses' gradient scale (models/moe.py: the convention)
            self.moe.begin(self.scaler.get_scale() if self.scaler.is_enabled() else 1.0, len(micro_batches))
        if self.pipeline is not None:
            metrics = self._pipeline_forward_backward(micro_batches, normalizers, counted)
            with self.timers("embedding-grads-all-reduce"):
                self.pipeline.sync_tied_grads()
        else:
            metrics = self._forward_backward(micro_batches, normalizers, counted)
        expert_tokens = None
        if self.moe is not None:  # device tensors, read with the step's losses at logging steps
            share = 1.0 / (len(micro_batches) * self.dims.grad_ranks)  # of the step's mean
            moe_metrics, expert_tokens = self.moe.end(share, self.device)
            metrics.update(moe_metrics)
        if self.dims.tp > 1 and (self.cfg.parallel.sequence_parallel or self.cfg.model.qk_norm == "head"):
            # the norms' Partial gradients (SP's, per-head q/k norms'), summed over the tensor-parallel
            # ranks in one all-reduce
            with self.timers("layernorm-grads-all-reduce"):
                reduce_partial_grads(self.params)
        with self.timers("optimizer"):
            norm, found_inf, nonfinite = self._unscale_and_clip(metrics["loss"])
            lr = self.optimizer.param_groups[0]["lr"]
            # as Megatron and DeepSpeed: a skipped step (fp16 overflow) does not advance the schedule
            if not found_inf and not nonfinite:
                with self.timers("optimizer-inner-step", 2):
                    self.optimizer.step()
                    self.scheduler.step()
                if self.float8_scales:  # the next step's float8 all-gathers' scales, in one pass
                    refresh_float8_scales(self.model)
            self.scaler.update(found_inf)
        skipped = found_inf or nonfinite
        return StepResult(metrics, norm, skipped, lr=lr, nonfinite=nonfinite, expert_tokens=expert_tokens)

    def _forward_backward(
        self, micro_batches: list[Batch], normalizers: dict[str, Any], counted: Callable[[], None]
    ) -> dict[str, torch.Tensor]:
        """Forward and backward of each micro-batch; the metric sums over them, on the device."""
        dims, precision = self.dims, self.cfg.train.precision
        ops = loss_ops(dims.tp).for_training()
        # DDP/FSDP average gradients over dp (x cp); the losses are global shares
        multiplier = float(dims.grad_ranks)
        totals: dict[str, torch.Tensor] = {}
        last = len(micro_batches) - 1
        for i, micro in enumerate(micro_batches):
            sync = i == last or self.cfg.parallel.reduce_each_micro_batch
            with gradient_sync(self.model, sync), loss_parallel_context(dims.tp):
                with self.timers("forward-compute"), autocast_context(precision, self.device):
                    outputs = self.model(*self.spec.inputs(micro), **self.spec.optional_kwargs(micro))
                if i == 0:
                    self._wait_for_count(counted)  # its all-reduce ran behind the first forward
                with self.timers("forward-compute"), autocast_context(precision, self.device):
                    loss, metrics = self.spec.loss(outputs, micro, normalizers, ops)
                self._backward(self.scaler.scale(loss * multiplier))
            accumulate(totals, metrics)
        return totals

    def _backward(self, loss: torch.Tensor) -> None:
        """loss.backward(), split into `backward-compute` and `all-grads-sync`: the time the training
        thread waited for gradient collectives after the backward compute (parallel/comm.py). On the
        host only: the device is synchronized only under logging.timers_sync."""
        sync, comm = self.measure.sync, self.measure.comm
        if sync is not None:
            sync()
        for recorder in comm:
            recorder.take_blocked()
        start = time.perf_counter()
        loss.backward()
        if sync is not None:
            sync()
        end = time.perf_counter()
        exposed = 0.0
        for recorder in comm:
            blocked = recorder.take_blocked()  # synchronous reduce-scatters (FSDP2 on CPU)
            launch = recorder.last_grad_launch  # DDP: the last bucket is launched when compute ends
            tail = end - launch if launch is not None and launch >= start else 0.0
            exposed += max(blocked, tail)
        exposed = min(exposed, end - start)
        self.timers.add("backward-compute", end - start - exposed)
        if comm:
            self.timers.add("all-grads-sync", exposed)

    def _pipeline_forward_backward(
        self, micro_batches: list[Batch], normalizers: dict[str, Any], counted: Callable[[], None]
    ) -> dict[str, torch.Tensor]:
        self._wait_for_count(counted)
        with self.timers("forward-backward"), autocast_context(self.cfg.train.precision, self.device):
            scale = float(self.dims.grad_ranks) * self.scaler.get_scale()
            return self.pipeline.train_step(micro_batches, normalizers, scale)

    def _wait_for_count(self, counted: Callable[[], None]) -> None:
        """Complete the step's token-count all-reduce (timed only when there is one: dp x cp > 1)."""
        if self.dims.grad_group is None:
            counted()
            return
        with self.timers("metrics-all-reduce"):
            counted()

    def _unscale_and_clip(self, loss: torch.Tensor) -> tuple[torch.Tensor, bool, bool]:
        """(the global gradient norm, fp16 overflow, non-finite under on_nonfinite=skip); clips the
        gradients on the device unless the step is skipped."""
        params = self.params
        with self.timers("optimizer-unscale-and-check-inf", 2):
            found_inf = self.scaler.unscale_([local(p.grad) for p in params if p.grad is not None])
        with self.timers("optimizer-clip-main-grad", 2):
            norm = grad_norm(params, exclude=self.grad_norm_excluded, pp_group=self.dims.pp_group)
            nonfinite = False
            if not found_inf and self.nonfinite.policy == "skip":
                # the update depends on it: read here, like fp16's overflow flag. The norm decides (it
                # is global, so every rank decides the same); the loss is this rank's, for the message
                local_loss, value = torch.stack([local(loss).float(), norm.to(loss.device)]).tolist()
                if not math.isfinite(value):
                    nonfinite = self.nonfinite.check(self.iteration + 1, local_loss, value)
            if not found_inf and not nonfinite:
                clip_grads(params, self.cfg.optim.clip_grad or math.inf, norm)
        return norm, found_inf, nonfinite

    # ------------------------------------------------------------------ evaluation

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Loss, perplexity (and MLM/binary accuracy for BERT) over eval_iters validation micro-batches."""
        self.model.eval()
        # Every rank evaluates the same batches: ZeRO-3 and pipeline stages need all ranks in each forward.
        batches = [
            self._context_share({k: v.to(self.device) for k, v in b.items()}) for b in self.valid_batches()
        ]
        cp_group = self.dims.cp_group  # context parallelism: the ranks share each batch's tokens
        normalizers, counted = self._normalizers(batches, cp_group, 1)
        counted()
        totals: dict[str, float] = {}
        if self.pipeline is not None:
            with autocast_context(self.cfg.train.precision, self.device):
                totals = self.pipeline.evaluate(batches, normalizers)
            if cp_group is not None:  # each cp rank's sums cover its tokens only
                totals = dict(zip(totals, all_reduce_floats(list(totals.values()), cp_group), strict=True))
        else:
            sums: dict[str, torch.Tensor] = {}
            for batch in batches:
                with (
                    autocast_context(self.cfg.train.precision, self.device),
                    loss_parallel_context(self.dims.tp),
                ):
                    outputs = self.model(*self.spec.inputs(batch), **self.spec.optional_kwargs(batch))
                    _, metrics = self.spec.loss(outputs, batch, normalizers, loss_ops(self.dims.tp))
                accumulate(sums, metrics)
            keys = sorted(sums)
            if keys:
                stacked = torch.stack([local(sums[k]).float() for k in keys])
                if cp_group is not None:  # each cp rank's sums cover its tokens only
                    staged = stacked.to(collective_device(cp_group))
                    dist.all_reduce(staged, group=cp_group)
                    stacked = staged
                totals = dict(zip(keys, stacked.tolist(), strict=True))
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
        h.first_iteration = self.iteration + 1
        self.measure.start_interval(self.iteration)
        # the callbacks' end (the final checkpoint) inside too: a second signal must not cut that save short
        with self.stop_signals:
            self._loop()
            h.run_peak_memory_bytes = self.measure.memory.run_peak().peak_allocated_bytes
            for callback in self.callbacks:
                callback.on_fit_end(self, h)
        return h

    def _loop(self) -> None:
        cfg, h, measure = self.cfg, self.history, self.measure
        log_every, eval_every = cfg.logging.log_interval, cfg.train.eval_interval
        while self.iteration < cfg.train.train_iters:
            for callback in self.callbacks:
                callback.on_step_start(self)
            measure.clock.start()
            result = self.train_step(self._next_micro_batches())
            measure.clock.stop()
            self.iteration += 1
            self.consumed_samples += self.global_batch
            self.last_lr = result.lr
            measure.step_done(self.iteration, result)
            if not h.model_state_bytes:  # the optimizer state exists from the first step on
                h.model_state_bytes = model_state_bytes(self.model, self.optimizer)
            stop = self.stop_signals.agreed(self.iteration)  # every rank stops after the same step
            # a signal agreed after the last step stops nothing: the run is complete, not to be resumed
            h.stopped_by = stop if self.iteration < cfg.train.train_iters else None
            if self.iteration % log_every == 0 or self.iteration == cfg.train.train_iters or h.stopped_by:
                self._log()
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
            measure.interval.start += time.perf_counter() - outside
            if h.stopped_by or (cfg.train.exit_interval and self.iteration % cfg.train.exit_interval == 0):
                break

    def settle(self) -> list[StepValues]:
        """Read the steps still on the device and act on what they show: skips, non-finite steps under
        train.on_nonfinite=stop (raises NonFiniteError), loss spikes. Called at logging steps and before
        a checkpoint is saved, so no checkpoint holds weights a non-finite step touched."""
        settled = self.measure.ledger.settle()
        for step in settled:
            self._note_faults(step)
        return settled

    def _log(self) -> None:
        """The interval's record: read its steps, build it, let callbacks add to it, write it."""
        h, measure = self.history, self.measure
        self.settle()
        steps = measure.read_steps()
        scale = self.scaler.get_scale() if self.scaler.is_enabled() else None
        record = measure.record(steps, self.consumed_samples, self.last_lr, scale)
        for callback in self.callbacks:
            callback.on_log(self, record)
        if h.first_logged_loss is None:
            h.first_logged_loss = record["loss"]
        h.last_logged_loss = record["loss"]
        first = measure.interval.first_iteration
        profiled = sum(1 for i in range(first, self.iteration + 1) if i in h.excluded_iterations)
        if profiled:
            record["profiled_steps"] = profiled  # slowed by the profiler: left out of the summary
        # the summary's own bookkeeping (the sinks write the record without them)
        bounds = {"iteration": self.iteration, "first_iteration": first}
        h.records.append(dataclasses.replace(record, scalars={**bounds, **record.scalars}))
        self.sinks.write("train", self.iteration, record)
        measure.start_interval(self.iteration)

    def _note_faults(self, step: StepValues) -> None:
        """A read step's skip, non-finite check (stop: raises) and loss spike, in the history."""
        h = self.history
        h.skipped_iterations += step.skipped
        if step.nonfinite:
            h.nonfinite_iterations.append(step.iteration)
        elif not step.skipped and self.nonfinite.policy == "stop":  # raises on a non-finite step
            self.nonfinite.check(step.iteration, step.loss, step.grad_norm)
        median = self.spikes.check(step.loss) if not step.skipped else None
        if median is None:
            return
        h.loss_spikes.append({"iteration": step.iteration, "loss": step.loss, "median": median})
        if self.dims.is_main:
            warnings.warn(
                f"loss spike at iteration {step.iteration}: {step.loss:.4f} > "
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


def accumulate(totals: dict[str, torch.Tensor], metrics: dict[str, torch.Tensor]) -> None:
    """Add a micro-batch's metric tensors to the running sums, on the device."""
    for k, v in metrics.items():
        totals[k] = totals[k] + v if k in totals else v


def step_normalizers(
    micro_batches: list[Batch], dp_group: Any = None, dp: int = 1
) -> tuple[dict[str, Any], Callable[[], None]]:
    """Counts over the whole step (all data-parallel ranks) that each micro-batch's summed loss is
    divided by, so every rank's losses are shares of the one global mean: {"tokens": labelled
    positions (a device tensor), "samples": sequences (every rank's micro-batches have the same size)}.

    The token count's all-reduce over `dp_group` is issued without waiting; the second value completes
    it (call it before the first loss: on a GPU it only orders the streams, on a CPU it waits)."""
    labelled = torch.stack([(b["labels"] != -100).sum() for b in micro_batches]).sum()
    samples = sum(int(b["input_ids"].shape[0]) for b in micro_batches) * dp
    if dp_group is None or dist.get_world_size(dp_group) == 1:
        return {"tokens": labelled.clamp(min=1), "samples": samples}, _nothing
    device = collective_device(dp_group)
    count = labelled if labelled.device == device else labelled.to(device)
    work = dist.all_reduce(count, group=dp_group, async_op=True)
    normalizers: dict[str, Any] = {"samples": samples}

    def counted() -> None:
        if "tokens" not in normalizers:
            work.wait()
            normalizers["tokens"] = count.to(labelled.device).clamp(min=1)

    return normalizers, counted


def _nothing() -> None:
    return None
