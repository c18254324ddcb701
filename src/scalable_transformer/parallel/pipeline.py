"""Pipeline parallelism: cut a plain model into stage modules and run them with torch.distributed.pipelining.

Shape legend: b micro-batch, s sequence (local: sequence parallel splits it over tp), h hidden,
v padded vocabulary, n micro-batches of a step.

Stages. `split_model` prunes a full model (built on the meta device; parallel/init.py fills it) down to this
rank's stages: each is the model itself with the parts it does not hold removed (the family's
`ModelSpec.stage`, models/stage.py). Stage i holds transformer layers [start_i, start_i + count_i) in
an nn.ModuleDict keyed by the global layer index, so parameter names (checkpoint keys) are the full
model's in every layout. The last stage of a tied model holds its own copy of the word embedding
under the same key (`embedding.word.weight`, Megatron's scheme); `PipelineRunner.sync_tied_grads`
sums the copies' gradients, so they stay identical under the optimizer.

How the batch travels (the family's `ModelSpec.pipeline` names the keys). Stage 0 gets the model
inputs (input_ids, BERT's token_type_ids) as the schedule's positional args: they are split into
micro-batches and used on the first stage only. Inputs every block needs (BERT's attention mask) are
keyword arguments of every stage: the schedule splits kwargs like args and hands each stage its
micro-batch's slice (`forward_one_chunk` passes kwargs to every stage, first or not), nothing is sent
between ranks, and kwargs never get gradients sent back. (Passing the mask through as a stage output
would add a P2P send per boundary and a non-differentiable tensor to the backward protocol.) The last
stage's loss gets the schedule's `target`, which is tensor-split like the args, so the spec packs
the labels into one tensor (BERT: labels [b, s] and nsp_labels [b] as [b, s + 1]). Each rank calls
the schedule with the same whole-step batch; the split is exact because micro-batches are
concatenated in order and all have the same size.

Shapes between stages are static: [micro_batch_size, seq_length (/ cp with context parallelism, / tp
with sequence parallelism), hidden] in the stage's output dtype (fp32 under autocast, FSDP2's
param_dtype under its mixed precision). So PipelineStage skips its runtime shape inference, which
would run an extra forward and backward of the first micro-batch and call the loss once more.

Schedules run with scale_grads=False (2.13 defaults to dividing gradients by the micro-batch
count; our losses are already shares of the step's mean). Evaluation uses its own forward-only
schedule for any number of batches (see `PipelineRunner._schedule`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from ..config.rules import (
    SINGLE_STAGE_SCHEDULES,
    V_SHAPED_SCHEDULES,
    stage_ids,
    stage_layer_counts,
    stage_rank,
)
from ..config.schema import Config
from ..models import spec_for
from .comm import CommRecorder, pipeline_wait_timing
from .dims import ParallelDims
from .distributed import all_reduce_floats, collective_device
from .grads import local
from .tensor import loss_ops, loss_parallel_context
from .torch_compat import fsdp_mixed_precision, pipeline_action

if TYPE_CHECKING:
    from .torch_compat import PipelineSchedule

Batch = dict[str, torch.Tensor]

SCHEDULES: dict[str, type[PipelineSchedule]] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved-1f1b": ScheduleInterleaved1F1B,
    "looped-bfs": ScheduleLoopedBFS,
    "zero-bubble": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
}
SINGLE_STAGE = SINGLE_STAGE_SCHEDULES
V_SHAPED = V_SHAPED_SCHEDULES


def _skip_action(action: Any, ctx: Any) -> None:
    """Stands in for backward actions when a multi-stage schedule runs forward only."""


# placement (which rank holds which stage) is a layout rule: config.rules.stage_ids / stage_rank


# ---------------------------------------------------------------- stage modules


def _tensors_only(module: nn.Module, args: Any, output: Any) -> Any:
    """Forward hook of a last stage: pipelining's stage outputs must be tensors, so a model's None
    outputs (BERT without a binary head) are dropped, and a lone tensor is sent bare. The family's
    `pipeline.outputs_from_stage` restores the model's form for the loss."""
    if not isinstance(output, tuple):
        return output
    tensors = tuple(t for t in output if t is not None)
    return tensors[0] if len(tensors) == 1 else tensors


def split_model(model: nn.Module, cfg: Config, pp_rank: int) -> list[nn.Module]:
    """This rank's stage modules (the model's own class with parts removed, in model order).

    `model` is normally on the meta device: the stages share its submodules (no copy) except the tied
    output copy of the word embedding on the last stage, and `parallelize` materializes them with
    values that depend on the seed and parameter name only, so they are the single-process model's.
    """
    p, m = cfg.parallel, cfg.model
    spec = spec_for(m)
    num_stages = p.pp * p.virtual_pipeline_stages
    counts = stage_layer_counts(m.num_layers, num_stages, p.pipeline_layers if num_stages > 1 else None)
    starts = [sum(counts[:i]) for i in range(num_stages)]
    stages = []
    for s in stage_ids(p.pp, pp_rank, p.virtual_pipeline_stages, p.pipeline_schedule):
        last = s == num_stages - 1
        stage = spec.stage(model, range(starts[s], starts[s] + counts[s]), first=s == 0, last=last)
        if last:
            stage.register_forward_hook(_tensors_only)
        stages.append(stage)
    return stages


# ---------------------------------------------------------------- the runner


def _unwrap(module: nn.Module) -> nn.Module:
    """The stage module under a DDP wrapper (FSDP2 and TP modify modules in place)."""
    return module.module if isinstance(module, DistributedDataParallel) else module


def _output_dtype(stage: nn.Module) -> torch.dtype:
    """dtype of the hidden states a stage sends: FSDP2's mixed-precision output/param dtype when
    set, else the parameters' dtype (autocast keeps the residual stream in the parameter dtype)."""
    module = _unwrap(stage)
    policy = fsdp_mixed_precision(module)
    if policy is not None and (policy.output_dtype is not None or policy.param_dtype is not None):
        return policy.output_dtype or policy.param_dtype
    for param in module.parameters():
        if param.is_floating_point():
            return param.dtype
    return torch.float32


class PipelineRunner:
    """Runs this rank's stages under the configured torch.distributed.pipelining schedule.

    `stages` (from `split_model`, possibly wrapped by then: TP in place, activation checkpointing,
    FSDP2 `fully_shard` per block and per stage, or DDP) and their global `ids` (`stage_ids`).
    PipelineStage itself keeps DDP/FSDP from reducing gradients until a stage's last micro-batch
    (DDP `no_sync`, FSDP `set_requires_gradient_sync(False)` then one reduce-scatter at the end).
    """

    def __init__(
        self,
        stages: list[nn.Module],
        dims: ParallelDims,
        cfg: Config,
        device: torch.device,
        num_microbatches: int,
    ) -> None:
        """`stages`: this rank's stage modules (for `dims.stage_ids`, in that order); `dims` gives the
        stage ids and the pipeline process group."""
        p, m = cfg.parallel, cfg.model
        ids, pp_group = dims.stage_ids, dims.pp_group
        if len(stages) != len(ids) or not stages:
            raise ValueError(f"PipelineRunner: {len(stages)} stage modules for stage ids {ids}")
        if p.pipeline_schedule not in SCHEDULES:
            raise ValueError(
                f"parallel.pipeline_schedule = {p.pipeline_schedule!r} is not one of {tuple(SCHEDULES)}"
            )
        if p.pipeline_schedule in SINGLE_STAGE and len(stages) != 1:
            raise ValueError(f"pipeline_schedule = {p.pipeline_schedule} runs one stage per rank, got {ids}")
        self.stages, self.ids, self.group, self.device = stages, ids, pp_group, device
        self.spec = spec_for(m)
        self.schedule_name = p.pipeline_schedule
        self.pp, self.virtual = p.pp, p.virtual_pipeline_stages
        self.num_stages = p.pp * p.virtual_pipeline_stages
        self.num_microbatches = num_microbatches
        self.tp = p.tp
        self.has_first, self.has_last = 0 in ids, self.num_stages - 1 in ids
        self.pipeline_stages = [
            self._pipeline_stage(stage, index, cfg) for stage, index in zip(stages, ids, strict=True)
        ]
        self.metric_keys = sorted(self.spec.metric_names(m))
        self._eval_ops = loss_ops(p.tp)
        self._loss_ops = self._eval_ops.for_training()  # the one the loss function gets this call
        self._train_schedule: PipelineSchedule | None = None
        # per-call state read by the loss function, which the schedule calls on the last stage
        self._normalizers: dict[str, int] = {}
        self._loss_multiplier = 1.0
        self._metrics: list[dict[str, torch.Tensor]] = []
        self._tied = m.tie_word_embeddings and self.num_stages > 1
        self._tied_on_one_rank, self._tied_numel, self._tied_dtype = self._tied_layout()
        self.comm_recorder = CommRecorder()  # the schedule's send/recv waits (parallel/comm.py)

    # ------------------------------------------------------------ building

    def _pipeline_stage(self, stage: nn.Module, index: int, cfg: Config) -> PipelineStage:
        """A PipelineStage with static metadata (meta tensors: no memory, no shape-inference pass)."""
        t = cfg.train
        # context parallelism: every stage runs on this cp rank's seq_length / cp tokens
        m = dataclasses.replace(cfg.model, seq_length=cfg.model.seq_length // cfg.parallel.cp)
        b, h = t.micro_batch_size, m.hidden_size
        seq = m.seq_length // self.tp if cfg.parallel.sequence_parallel else m.seq_length
        dtype = _output_dtype(stage)

        def meta(*shape: int, dtype: torch.dtype = dtype, grad: bool = True) -> torch.Tensor:
            return torch.empty(shape, dtype=dtype, device="meta", requires_grad=grad)

        if index == 0:  # token ids (and token types) [b, s]
            keys = self.spec.pipeline.first_stage_keys
            inputs = tuple(meta(b, m.seq_length, dtype=torch.long, grad=False) for _ in keys)
        else:
            inputs = (meta(b, seq, h),)
        outputs: tuple[torch.Tensor, ...] = (meta(b, seq, h),)
        if index == self.num_stages - 1:  # never sent, but one entry per output tensor
            outputs = tuple(meta(*shape) for shape in self.spec.pipeline.last_stage_outputs(m, b))
        return PipelineStage(
            stage,
            index,
            self.num_stages,
            self.device,
            input_args=inputs,
            output_args=outputs,
            group=self.group,
        )

    def _schedule(self, n: int, *, train: bool) -> PipelineSchedule:
        """A schedule over n micro-batches.

        Evaluation (any n): GPipe for one stage per rank (1F1B needs n >= stages); for several,
        looped BFS in the loop placement (interleaved 1F1B needs n to be a multiple of its rounds)
        or ZBV in the V placement, with their backward actions replaced by no-ops: in 2.13 their
        `eval()` still runs them, and ZBV's then fails handing a gradient between the two stages
        of a rank (`get_local_bwd_output` asserts the stage has a backward).
        """
        name = self.schedule_name
        if not train:
            name = "gpipe" if name in SINGLE_STAGE else "zbv" if name in V_SHAPED else "looped-bfs"
        cls: Callable[..., PipelineSchedule] = SCHEDULES[name]
        # scale_grads=False: each micro-batch's loss is already its share of the step's mean
        if name in SINGLE_STAGE:
            return cls(self.pipeline_stages[0], n, loss_fn=self._loss, scale_grads=False)
        schedule = cls(self.pipeline_stages, n, loss_fn=self._loss, scale_grads=False)
        if not train:
            for action in ("FULL_BACKWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT", "REDUCE_GRAD"):
                schedule.register_custom_function(  # type: ignore[attr-defined]
                    pipeline_action(action), _skip_action
                )
        return schedule

    # ------------------------------------------------------------ one step

    def _loss(self, stage_output: Any, target: torch.Tensor) -> torch.Tensor:
        pipeline = self.spec.pipeline
        outputs, labels = pipeline.outputs_from_stage(stage_output), pipeline.unpack_target(target)
        loss, metrics = self.spec.loss(outputs, labels, self._normalizers, self._loss_ops)
        self._metrics.append(metrics)
        return loss * self._loss_multiplier

    def _schedule_inputs(
        self, micro_batches: list[Batch]
    ) -> tuple[tuple[torch.Tensor, ...], dict[str, Any], torch.Tensor | None]:
        """Positional args (first stage), kwargs (every stage) and target (last stage) of a step."""
        sizes = {int(b["input_ids"].shape[0]) for b in micro_batches}
        if len(sizes) != 1:
            raise ValueError(f"pipeline micro-batches must all have the same size, got sizes {sorted(sizes)}")

        def cat(key: str) -> torch.Tensor:
            return torch.cat([b[key] for b in micro_batches])

        whole = {k: cat(k) for k in micro_batches[0]}
        self.spec.inputs(whole)  # a KeyError naming what the batch lacks
        pipeline = self.spec.pipeline
        args = tuple(whole[k] for k in pipeline.first_stage_keys) if self.has_first else ()
        kwargs: dict[str, Any] = {kw: whole[key] for key, kw in pipeline.every_stage_kwargs}
        kwargs |= self.spec.optional_kwargs(whole)  # to every stage, as every_stage_kwargs
        target = pipeline.pack_target(whole) if self.has_last else None
        return args, kwargs, target

    def _metric_sums(self, n: int) -> dict[str, torch.Tensor]:
        """This rank's metric sums over the step's micro-batches, on the device: the last stage's
        scores, zeros elsewhere (and for a key the loss left out, such as accuracies in training).
        Nothing is read on the host; summing over pp (the zeros) is the caller's, when it reads."""
        if self.has_last and len(self._metrics) != n:
            raise RuntimeError(f"the schedule scored {len(self._metrics)} micro-batches, expected {n}")
        sums = {key: torch.zeros((), dtype=torch.float32, device=self.device) for key in self.metric_keys}
        for metrics in self._metrics:  # in micro-batch order, as the unpipelined step sums them
            for key in self.metric_keys:
                if key in metrics:
                    sums[key] = sums[key] + metrics[key]
        self._metrics = []
        return sums

    def _reduce_metrics(self, n: int) -> dict[str, float]:
        """Metric sums over the micro-batches, summed over pp so every rank has them (host floats)."""
        sums = self._metric_sums(n)
        local_sums = torch.stack([sums[key] for key in self.metric_keys]).tolist()  # one read
        values = all_reduce_floats(local_sums, self.group)
        return dict(zip(self.metric_keys, values, strict=True))

    def train_step(
        self, micro_batches: list[Batch], normalizers: dict[str, int], loss_multiplier: float
    ) -> dict[str, torch.Tensor]:
        """Forward and backward of all micro-batches (gradients accumulate in the stages' params).

        The loss backpropagated per micro-batch is the family's loss(...)[0] * loss_multiplier (the
        caller folds in the dp size that DDP/FSDP average over and the fp16 loss scale); the
        returned metrics are unscaled sums over the micro-batches as device tensors, the last stage's
        on its ranks and zeros on the others (a sum over pp gives every rank the step's values).
        Micro-batches must all have train.micro_batch_size sequences of model.seq_length tokens.
        Call `sync_tied_grads` before reading the gradients.
        """
        if len(micro_batches) != self.num_microbatches:
            raise ValueError(
                f"expected {self.num_microbatches} micro-batches per step, got {len(micro_batches)}"
            )
        for stage in self.stages:
            stage.train()
        if self._train_schedule is None:
            self._train_schedule = self._schedule(self.num_microbatches, train=True)
        self._normalizers, self._loss_multiplier = normalizers, loss_multiplier
        self._loss_ops = self._eval_ops.for_training()
        args, kwargs, target = self._schedule_inputs(micro_batches)
        with loss_parallel_context(self.tp), pipeline_wait_timing(self.comm_recorder):
            self._train_schedule.step(*args, target=target, return_outputs=False, **kwargs)
        return self._metric_sums(len(micro_batches))

    @torch.no_grad()
    def evaluate(self, batches: list[Batch], normalizers: dict[str, int]) -> dict[str, float]:
        """Forward only over `batches` (any number); the metric sums of the family's loss on every rank."""
        for stage in self.stages:
            stage.eval()
        schedule = self._schedule(len(batches), train=False)
        # The evaluation schedule re-initialised the stages' buffers for its own micro-batch count:
        # the next train_step builds (and re-initialises) a fresh training schedule.
        self._train_schedule = None
        self._normalizers, self._loss_multiplier = normalizers, 1.0
        self._loss_ops = self._eval_ops
        args, kwargs, target = self._schedule_inputs(batches)
        with loss_parallel_context(self.tp):
            schedule.eval(*args, target=target, **kwargs)
        return self._reduce_metrics(len(batches))

    # ------------------------------------------------------------ tied word embeddings

    def _tied_param(self, stage_index: int) -> nn.Parameter | None:
        """The word-embedding weight of global stage `stage_index` if this rank holds that stage."""
        if not self._tied or stage_index not in self.ids:
            return None
        module = _unwrap(self.stages[self.ids.index(stage_index)])
        return module.get_parameter("embedding.word.weight")

    def _tied_layout(self) -> tuple[bool, int, torch.dtype]:
        """(whether one rank holds both copies, numel and dtype of the local word-embedding gradient).
        Ranks without a copy (middle stages, pp > 2) contribute zeros of that size to the all-reduce,
        so when there are such ranks the size is agreed on once, here."""
        first_rank = stage_rank(0, self.pp, self.virtual, self.schedule_name)
        last_rank = stage_rank(self.num_stages - 1, self.pp, self.virtual, self.schedule_name)
        param = self._tied_param(0)
        param = self._tied_param(self.num_stages - 1) if param is None else param
        shard = None if param is None else local(param.detach())
        numel, dtype = (0, torch.float32) if shard is None else (shard.numel(), shard.dtype)
        if not self._tied or first_rank == last_rank or self.pp == 2:
            return first_rank == last_rank, numel, dtype
        dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
        code = [0, 0] if shard is None else [numel, dtypes.index(dtype)]
        shape = torch.tensor(code, dtype=torch.int64, device=collective_device(self.group))
        dist.all_reduce(shape, op=dist.ReduceOp.MAX, group=self.group)
        return False, int(shape[0]), dtypes[int(shape[1])]

    def sync_tied_grads(self) -> None:
        """Sum the word-embedding gradients of the first stage and the last stage's copy (all-reduce
        over the pipeline group; a local add when one rank holds both, as zbv places them)."""
        if not self._tied:
            return
        first, last = self._tied_param(0), self._tied_param(self.num_stages - 1)
        if self._tied_on_one_rank and first is None:
            return
        with torch.no_grad():
            grads = []
            for param in (first, last):
                if param is None:
                    continue
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                if isinstance(param.grad, DTensor) and param.grad.placements != param.placements:  # type: ignore[attr-defined]
                    # Tensor parallelism leaves the embedding lookup's gradient Replicate on a Shard(0)
                    # weight; the copies' local values must line up element by element.
                    param.grad = param.grad.redistribute(param.grad.device_mesh, param.placements)  # type: ignore[attr-defined]
                grads.append(local(param.grad))
            if first is not None and last is not None:
                grads[0].add_(grads[1])
                grads[1].copy_(grads[0])
                return
            buffer = (
                grads[0]
                if grads
                else torch.zeros(self._tied_numel, dtype=self._tied_dtype, device=self.device)
            )
            device = collective_device(self.group)
            staged = buffer if buffer.device == device else buffer.to(device)
            dist.all_reduce(staged, group=self.group)
            if staged is not buffer:
                buffer.copy_(staged)

    def grad_norm_excluded(self) -> set[int]:
        """id()s of the parameters whose gradients duplicate another stage's (the tied copy on the
        last stage), to leave out of the gradient norm. Call after the stages are wrapped."""
        if not self._tied:
            return set()
        copy_param = self._tied_param(self.num_stages - 1)
        return set() if copy_param is None else {id(copy_param)}
