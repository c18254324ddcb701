"""The training loop and the training step, nothing else (builders live in `train/run.py`)."""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config.schema import Config, need
from ..metrics.flops import FlopsCount, throughput_metrics
from ..metrics.memory import MemoryTracker
from ..metrics.sinks import Sinks
from ..metrics.timers import Timers
from ..models import spec_for
from ..parallel.distributed import all_reduce_floats, env_rank
from ..parallel.grads import clip_grads, grad_norm, local
from ..parallel.tensor import loss_ops, loss_parallel_context
from .loss_scale import build_loss_scaler

Batch = dict[str, torch.Tensor]
PHASES = ("forward-compute", "backward-compute", "forward-backward", "optimizer", "batch-generator")


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    skipped: bool
    lr: float  # the learning rate this step's update used
    metrics: dict[str, float]


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
    skipped_iterations: int = 0


def autocast_context(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device.type, dtype=dtype)


@dataclass
class Layout:
    """The distributed context of a step: process groups and the pipeline runner (None = plain run)."""

    dp: int = 1
    tp: int = 1
    dp_group: Any = None  # None: no data parallelism (or no process group at all)
    pp_group: Any = None
    pipeline: Any = None  # parallel.pipeline.PipelineRunner when pp > 1
    grad_norm_excluded: set[int] = field(default_factory=set)


def gradient_sync(model: torch.nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    """Skip the data-parallel gradient reduction on all but the last micro-batch of a step."""
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
        cfg: Config,
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
        layout: Layout | None = None,
    ):
        self.cfg, self.model, self.optimizer, self.scheduler = cfg, model, optimizer, scheduler
        self.train_batches, self.valid_batches = train_batches, valid_batches
        self.device, self.sinks, self.flops = device, sinks, flops
        self.peak_flops, self.num_devices = peak_flops_per_device, num_devices
        self.spec = spec_for(cfg.model)
        self.global_batch = need(cfg.train.global_batch_size, "train.global_batch_size")
        self.accumulation = need(cfg.train.gradient_accumulation_steps, "train.gradient_accumulation_steps")
        sync = torch.cuda.synchronize if device.type == "cuda" and cfg.logging.timers_sync else None
        self.timers = Timers(sync)
        self.memory = MemoryTracker(device)
        self.scaler = build_loss_scaler(cfg.train)
        self.layout = layout or Layout()
        self.history = History()
        self.iteration = 0
        self.consumed_samples = 0
        self.last_lr = 0.0
        # called after every iteration (checkpoint saves); returns the seconds it took
        self.on_iteration_end: Callable[[Trainer], float] | None = None

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
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        layout = self.layout
        normalizers = step_normalizers(micro_batches, layout.dp_group)
        # DDP/FSDP average gradients over dp; the losses are already shares of the global mean
        multiplier = float(layout.dp)
        if layout.pipeline is not None:
            with self.timers("forward-backward"), autocast_context(self.cfg.train.precision, self.device):
                totals = layout.pipeline.train_step(
                    micro_batches, normalizers, multiplier * self.scaler.get_scale()
                )
        else:
            totals = {}
            last = len(micro_batches) - 1
            for i, micro in enumerate(micro_batches):
                with gradient_sync(self.model, i == last), loss_parallel_context(layout.tp):
                    with (
                        self.timers("forward-compute"),
                        autocast_context(self.cfg.train.precision, self.device),
                    ):
                        outputs = self.model(*self.spec.inputs(micro))
                        loss, metrics = self.spec.loss(outputs, micro, normalizers, loss_ops(layout.tp))
                    with self.timers("backward-compute"):
                        self.scaler.scale(loss * multiplier).backward()
                for k, v in metrics.items():
                    totals[k] = totals.get(k, 0.0) + float(v)
        if layout.dp_group is not None:
            keys = sorted(totals)
            totals = dict(
                zip(keys, all_reduce_floats([totals[k] for k in keys], layout.dp_group), strict=True)
            )
        with self.timers("optimizer"):
            if layout.pipeline is not None:
                layout.pipeline.sync_tied_grads()
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
            found_inf = self.scaler.unscale_([local(p.grad) for p in params if p.grad is not None])
            norm = float(grad_norm(params, exclude=layout.grad_norm_excluded, pp_group=layout.pp_group))
            lr = self.optimizer.param_groups[0]["lr"]
            # as Megatron and DeepSpeed: an overflowing fp16 step is skipped and does not advance the schedule
            if not found_inf:
                clip_grads(params, self.cfg.optim.clip_grad or math.inf, norm)
                self.optimizer.step()
                self.scheduler.step()
            self.scaler.update(found_inf)
        return StepResult(loss=totals.pop("loss"), grad_norm=norm, skipped=found_inf, lr=lr, metrics=totals)

    # ------------------------------------------------------------------ evaluation

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Loss, perplexity (and MLM/binary accuracy for BERT) over eval_iters validation micro-batches."""
        self.model.eval()
        # Every rank evaluates the same batches: ZeRO-3 and pipeline stages need all ranks in each forward.
        batches = [{k: v.to(self.device) for k, v in b.items()} for b in self.valid_batches()]
        normalizers = step_normalizers(batches)
        totals: dict[str, float] = {}
        if self.layout.pipeline is not None:
            with autocast_context(self.cfg.train.precision, self.device):
                totals = self.layout.pipeline.evaluate(batches, normalizers)
        for batch in batches if self.layout.pipeline is None else []:
            with (
                autocast_context(self.cfg.train.precision, self.device),
                loss_parallel_context(self.layout.tp),
            ):
                outputs = self.model(*self.spec.inputs(batch))
                _, metrics = self.spec.loss(outputs, batch, normalizers, loss_ops(self.layout.tp))
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
        cfg, h = self.cfg, self.history
        log_every, eval_every = cfg.logging.log_interval, cfg.train.eval_interval
        interval = Interval(start=time.perf_counter())
        self.memory.reset_peak()
        fail_at = injected_failure()
        while self.iteration < cfg.train.train_iters:
            if fail_at is not None and fail_at[1] == self.iteration + 1 and fail_at[0] == env_rank():
                raise RuntimeError(
                    f"injected failure (STX_FAIL_AT) on rank {fail_at[0]} at iteration {fail_at[1]}"
                )
            t0 = time.perf_counter()
            result = self.train_step(self._next_micro_batches())
            if self.device.type == "cuda":
                torch.cuda.synchronize()  # one sync per step: iteration time must include queued kernels
            h.iteration_seconds.append(time.perf_counter() - t0)
            self.iteration += 1
            self.consumed_samples += self.global_batch
            self.last_lr = result.lr
            h.skipped_iterations += result.skipped
            interval.add(result)

            if self.iteration % log_every == 0 or self.iteration == cfg.train.train_iters:
                record = self._train_record(interval)
                if h.first_logged_loss is None:
                    h.first_logged_loss = record["loss"]
                h.last_logged_loss = record["loss"]
                h.records.append({"iteration": self.iteration, **record})
                self.sinks.write("train", self.iteration, record)
                self.memory.reset_peak()
                interval = Interval(start=time.perf_counter())

            if (eval_every and self.iteration % eval_every == 0) or self.iteration == cfg.train.train_iters:
                eval_start = time.perf_counter()
                h.last_valid = self.evaluate()
                self.sinks.write("valid", self.iteration, h.last_valid)
                interval.start += time.perf_counter() - eval_start  # evaluation is not training throughput
            if self.on_iteration_end is not None:
                interval.start += self.on_iteration_end(self)  # saving is not training throughput
            if cfg.train.exit_interval and self.iteration % cfg.train.exit_interval == 0:
                break
        return h

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
        }
        if self.scaler.is_enabled():
            record["loss_scale"] = self.scaler.get_scale()
        phases = [name for name in PHASES if name in self.timers.names()]
        for name, ms in self.timers.elapsed_ms(phases, normalizer=interval.iterations, reset=True).items():
            record[f"time_ms/{name}"] = ms
        return record


LOSS_KEYS = ("loss", "lm_loss", "mlm_loss", "binary_loss", "grad_norm")


@dataclass
class Interval:
    """What happened since the last log line."""

    start: float
    iterations: int = 0
    skipped: int = 0
    sums: dict[str, float] = field(default_factory=dict)
    counted: int = 0  # non-skipped steps, the ones whose losses are averaged

    def add(self, result: StepResult) -> None:
        self.iterations += 1
        self.skipped += result.skipped
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


def injected_failure() -> tuple[int, int] | None:
    """STX_FAIL_AT="RANK:ITERATION" makes that rank raise at the start of that (1-based) iteration:
    the fault injection the launcher's crash tests use."""
    spec = os.environ.get("STX_FAIL_AT")
    if not spec:
        return None
    try:
        rank, iteration = (int(x) for x in spec.split(":"))
    except ValueError:
        raise ValueError(f"STX_FAIL_AT={spec!r}: expected RANK:ITERATION, e.g. 1:3") from None
    return rank, iteration


def step_normalizers(micro_batches: list[Batch], dp_group: Any = None) -> dict[str, int]:
    """Counts over the whole step (all data-parallel ranks) that each micro-batch's summed loss is
    divided by, so every rank's losses are shares of the one global mean."""
    labelled = sum(int((b["labels"] != -100).sum()) for b in micro_batches)
    samples = sum(int(b["input_ids"].shape[0]) for b in micro_batches)
    if dp_group is not None:
        labelled, samples = (int(x) for x in all_reduce_floats([labelled, samples], dp_group))
    return {"tokens": max(labelled, 1), "samples": samples}
