"""Pipeline parallelism: cut a plain model into stage modules and run them with torch.distributed.pipelining.

Shape legend: b micro-batch, s sequence (local: sequence parallel splits it over tp), h hidden,
v padded vocabulary, n micro-batches of a step.

Stages. `split_model` prunes a full model (built on every rank from the same seed) down to this
rank's stages. Stage i holds transformer layers [start_i, start_i + count_i) in an nn.ModuleDict keyed
by the global layer index, so parameter names (checkpoint keys) are the full model's in every layout.
The last stage of a tied model holds its own copy of the word embedding under the same key
(`embedding.word.weight`, Megatron's scheme); `PipelineRunner.sync_tied_grads` sums the copies'
gradients, so they stay identical under the optimizer.

How the batch travels. Stage 0 gets the model inputs (input_ids, BERT's token_type_ids) as the
schedule's positional args: they are split into micro-batches and used on the first stage only.
BERT's attention mask is needed by every block, so it is a keyword argument of every stage: the
schedule splits kwargs like args and hands each stage its micro-batch's slice (`forward_one_chunk`
passes kwargs to every stage, first or not), nothing is sent between ranks, and kwargs never get
gradients sent back. (Passing the mask through as a stage output would add a P2P send per boundary
and a non-differentiable tensor to the backward protocol.) The last stage's loss gets the schedule's
`target`, which is tensor-split like the args, so BERT packs labels [b, s] and nsp_labels [b] into
one [b, s + 1] tensor. Each rank calls the schedule with the same whole-step batch; the split is
exact because micro-batches are concatenated in order and all have the same size.

Shapes between stages are static: [micro_batch_size, seq_length (/ tp with sequence parallelism),
hidden] in the stage's output dtype (fp32 under autocast, FSDP2's param_dtype under its mixed
precision). So PipelineStage skips its runtime shape inference, which would run an extra forward
and backward of the first micro-batch and call the loss once more.

Schedules run with scale_grads=False (2.13 defaults to dividing gradients by the micro-batch
count; our losses are already shares of the step's mean). Evaluation uses its own forward-only
schedule for any number of batches (see `PipelineRunner._schedule`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

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
from torch.distributed.pipelining.schedules import _ComputationType, _PipelineSchedule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from ..config.schema import Config
from ..models import compute_loss, model_inputs, padded_vocab_size
from ..models.layers import run_blocks
from .dims import stage_layer_counts
from .distributed import all_reduce_floats, collective_device
from .grads import local
from .tensor import loss_parallel_context

Batch = dict[str, torch.Tensor]

SCHEDULES: dict[str, type[_PipelineSchedule]] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved-1f1b": ScheduleInterleaved1F1B,
    "looped-bfs": ScheduleLoopedBFS,
    "zero-bubble": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
}
SINGLE_STAGE = ("gpipe", "1f1b")
V_SHAPED = ("zbv",)


def _skip_action(action: Any, ctx: Any) -> None:
    """Stands in for backward actions when a multi-stage schedule runs forward only."""


# ---------------------------------------------------------------- placement


def stage_ids(pp: int, pp_rank: int, virtual: int, schedule: str) -> list[int]:
    """Global stage indices held by pipeline rank `pp_rank`, in model order.

    Loop placement (r, r + pp, r + 2 pp, ...) for every schedule but zbv, whose V places stages
    r and 2 pp - 1 - r on rank r (so rank 0 holds both the first and the last stage)."""
    if not 0 <= pp_rank < pp or virtual < 1:
        raise ValueError(
            f"stage_ids: need 0 <= pp_rank < pp and virtual >= 1, got {pp_rank}, {pp}, {virtual}"
        )
    if schedule in V_SHAPED:
        if virtual != 2:
            raise ValueError(
                f"pipeline_schedule = {schedule} places exactly 2 stages per rank, got {virtual}"
            )
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(virtual)]


def stage_rank(stage: int, pp: int, virtual: int, schedule: str) -> int:
    """The pipeline rank holding global stage `stage` (the inverse of `stage_ids`)."""
    for rank in range(pp):
        if stage in stage_ids(pp, rank, virtual, schedule):
            return rank
    raise ValueError(f"stage {stage} is not in a pipeline of {pp} x {virtual} stages")


# ---------------------------------------------------------------- stage modules


class TiedWordCopy(nn.Module):
    """The last stage's own copy of the word embedding: key `embedding.word.weight`, as on stage 0."""

    def __init__(self, word: nn.Embedding) -> None:
        super().__init__()
        self.word = copy.deepcopy(word)


class PipelineStageModule(nn.Module):
    """Layers [first, last] of a BERT or GPT model, plus the embedding (first stage) and the heads
    (last stage), under the full model's attribute names.

    forward(inputs, token_type_ids=None, *, attention_mask=None):
      first stage: inputs = input_ids [b, s] (BERT: and token_type_ids [b, s]);
      later stages: inputs = hidden states x [b, s, h];
      attention_mask [b, s] (BERT, 1 = real token) is given to every stage.
    Returns x [b, s, h], or on the last stage the model's outputs: GPT logits [b, s, v]; BERT
    (mlm_logits [b, s, v], binary_logits [b, 2]), or mlm_logits alone without a binary head, since
    pipelining's stage outputs must be tensors (`model_outputs` restores the model's None).
    """

    def __init__(
        self,
        model: nn.Module,
        model_type: str,
        layer_ids: range,
        *,
        is_first: bool,
        is_last: bool,
        tied: bool,
    ) -> None:
        super().__init__()
        self.model_type, self.is_first, self.is_last = model_type, is_first, is_last
        self.cfg = getattr(model, "cfg", None)  # the ModelConfig: parallel/tensor.py reads num_layers
        # Later stages see no token ids; with sequence parallelism their input is a shard of the
        # sequence, so the rotary tables' length comes from here (pipelined shapes are static anyway).
        self.seq_length = None if self.cfg is None else self.cfg.seq_length
        if is_first:
            self.embedding = model.get_submodule("embedding")
        elif is_last and tied:
            self.embedding = TiedWordCopy(model.get_submodule("embedding.word"))  # type: ignore[arg-type]
        rotary = getattr(model, "rotary", None)
        # No parameters, non-persistent buffers: a private copy per stage keeps FSDP roots disjoint.
        self.rotary = copy.deepcopy(rotary) if rotary is not None else None
        layers = model.get_submodule("layers")
        self.layers = nn.ModuleDict({str(i): layers[i] for i in layer_ids})  # type: ignore[index]
        self.recompute_chunk = 0  # set by parallel.apply for chunked full recompute
        if is_last:
            self.final_norm = getattr(model, "final_norm", None)
            if model_type == "gpt":
                self.output = getattr(model, "output", None)
                self.logits = getattr(model, "logits", None)
            else:
                self.lm_head = model.get_submodule("lm_head")
                self.pooler = getattr(model, "pooler", None)
                self.binary_head = getattr(model, "binary_head", None)

    def forward(
        self,
        inputs: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        *,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.is_first:
            x_bsh = (
                self.embedding(inputs) if self.model_type == "gpt" else self.embedding(inputs, token_type_ids)
            )
        else:
            x_bsh = inputs
        seq = inputs.shape[1]
        if attention_mask is not None:
            seq = attention_mask.shape[1]
        elif not self.is_first and self.seq_length is not None:
            seq = self.seq_length
        mask_b11s = None if attention_mask is None else attention_mask[:, None, None, :].bool()
        rotary = None if self.rotary is None else self.rotary(seq)
        x_bsh = run_blocks(self.layers.values(), x_bsh, mask_b11s, rotary, self.recompute_chunk)
        if not self.is_last:
            return x_bsh
        if self.final_norm is not None:
            x_bsh = self.final_norm(x_bsh)
        tied = (
            self.get_submodule("lm_head").decoder is None
            if self.model_type == "bert"
            else self.output is None
        )
        word_vh = self.get_parameter("embedding.word.weight") if tied else None
        if self.model_type == "gpt":
            weight_vh = self.get_parameter("output.weight") if word_vh is None else word_vh
            return _output_logits(self.logits, x_bsh, weight_vh)
        mlm_logits_bsv = self.lm_head(x_bsh, word_vh)
        if self.pooler is None or self.binary_head is None:
            return mlm_logits_bsv
        return mlm_logits_bsv, self.binary_head(torch.tanh(self.pooler(x_bsh[:, 0])))


def _output_logits(logits: nn.Module | None, x_bsh: torch.Tensor, weight_vh: torch.Tensor) -> torch.Tensor:
    """The output matmul through the model's parameter-free `logits` module when it has one
    (tensor parallelism hooks it), else plain F.linear."""
    if logits is not None:
        return logits(x_bsh, weight_vh)
    return torch.nn.functional.linear(x_bsh, weight_vh)


def model_outputs(model_type: str, stage_output: Any) -> Any:
    """The last stage's output in the form `compute_loss` takes (the unsplit model's outputs)."""
    if model_type == "bert" and isinstance(stage_output, torch.Tensor):
        return stage_output, None
    return stage_output


def split_model(model: nn.Module, cfg: Config, pp_rank: int) -> list[nn.Module]:
    """This rank's stage modules (plain nn.Modules, in model order), pruned from `model`.

    Every rank must build `model` identically (same seed), so the stages' weights are exactly the
    single-process model's; the stages share the model's submodules (no copy) except the tied
    output copy of the word embedding on the last stage.
    """
    p, m = cfg.parallel, cfg.model
    num_stages = p.pp * p.virtual_pipeline_stages
    counts = stage_layer_counts(m.num_layers, num_stages, p.pipeline_layers if num_stages > 1 else None)
    starts = [sum(counts[:i]) for i in range(num_stages)]
    return [
        PipelineStageModule(
            model,
            m.type,
            range(starts[s], starts[s] + counts[s]),
            is_first=s == 0,
            is_last=s == num_stages - 1,
            tied=m.tie_word_embeddings,
        )
        for s in stage_ids(p.pp, pp_rank, p.virtual_pipeline_stages, p.pipeline_schedule)
    ]


# ---------------------------------------------------------------- the runner


def _unwrap(module: nn.Module) -> nn.Module:
    """The stage module under a DDP wrapper (FSDP2 and TP modify modules in place)."""
    return module.module if isinstance(module, DistributedDataParallel) else module


def _output_dtype(stage: nn.Module) -> torch.dtype:
    """dtype of the hidden states a stage sends: FSDP2's mixed-precision output/param dtype when
    set, else the parameters' dtype (autocast keeps the residual stream in the parameter dtype)."""
    module = _unwrap(stage)
    state_getter = getattr(module, "_get_fsdp_state", None)
    if state_getter is not None:
        policy = state_getter()._mp_policy
        if policy.output_dtype is not None or policy.param_dtype is not None:
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
        ids: list[int],
        cfg: Config,
        pp_group: Any,
        device: torch.device,
        num_microbatches: int,
    ) -> None:
        p, m = cfg.parallel, cfg.model
        if len(stages) != len(ids) or not stages:
            raise ValueError(f"PipelineRunner: {len(stages)} stage modules for stage ids {ids}")
        if p.pipeline_schedule not in SCHEDULES:
            raise ValueError(
                f"parallel.pipeline_schedule = {p.pipeline_schedule!r} is not one of {tuple(SCHEDULES)}"
            )
        if p.pipeline_schedule in SINGLE_STAGE and len(stages) != 1:
            raise ValueError(f"pipeline_schedule = {p.pipeline_schedule} runs one stage per rank, got {ids}")
        self.stages, self.ids, self.group, self.device = stages, ids, pp_group, device
        self.model_type = m.type
        self.schedule_name = p.pipeline_schedule
        self.pp, self.virtual = p.pp, p.virtual_pipeline_stages
        self.num_stages = p.pp * p.virtual_pipeline_stages
        self.num_microbatches = num_microbatches
        self.tp = p.tp
        self.has_first, self.has_last = 0 in ids, self.num_stages - 1 in ids
        self.pipeline_stages = [
            self._pipeline_stage(stage, index, cfg) for stage, index in zip(stages, ids, strict=True)
        ]
        self.metric_keys = _metric_keys(m.type, m.bert_binary_head)
        self._train_schedule: _PipelineSchedule | None = None
        # per-call state read by the loss function, which the schedule calls on the last stage
        self._normalizers: dict[str, int] = {}
        self._loss_multiplier = 1.0
        self._metrics: list[dict[str, torch.Tensor]] = []
        self._tied = m.tie_word_embeddings and self.num_stages > 1
        self._tied_on_one_rank, self._tied_numel, self._tied_dtype = self._tied_layout()

    # ------------------------------------------------------------ building

    def _pipeline_stage(self, stage: nn.Module, index: int, cfg: Config) -> PipelineStage:
        """A PipelineStage with static metadata (meta tensors: no memory, no shape-inference pass)."""
        m, t = cfg.model, cfg.train
        b, h = t.micro_batch_size, m.hidden_size
        seq = m.seq_length // self.tp if cfg.parallel.sequence_parallel else m.seq_length
        dtype = _output_dtype(stage)
        assert m.vocab_size is not None
        vocab = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by)

        def meta(*shape: int, dtype: torch.dtype = dtype, grad: bool = True) -> torch.Tensor:
            return torch.empty(shape, dtype=dtype, device="meta", requires_grad=grad)

        if index == 0:
            ids_bs = meta(b, m.seq_length, dtype=torch.long, grad=False)
            inputs: tuple[torch.Tensor, ...] = (ids_bs,) if m.type == "gpt" else (ids_bs, ids_bs)
        else:
            inputs = (meta(b, seq, h),)
        outputs: tuple[torch.Tensor, ...] = (meta(b, seq, h),)
        if index == self.num_stages - 1:  # never sent, but one entry per output tensor
            outputs = (meta(b, m.seq_length, vocab),)
            if m.type == "bert" and m.bert_binary_head:
                outputs += (meta(b, 2),)
        return PipelineStage(
            stage,
            index,
            self.num_stages,
            self.device,
            input_args=inputs,
            output_args=outputs,
            group=self.group,
        )

    def _schedule(self, n: int, *, train: bool) -> _PipelineSchedule:
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
        cls: Callable[..., _PipelineSchedule] = SCHEDULES[name]
        # scale_grads=False: each micro-batch's loss is already its share of the step's mean
        if name in SINGLE_STAGE:
            return cls(self.pipeline_stages[0], n, loss_fn=self._loss, scale_grads=False)
        schedule = cls(self.pipeline_stages, n, loss_fn=self._loss, scale_grads=False)
        if not train:
            for action in ("FULL_BACKWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT", "REDUCE_GRAD"):
                schedule.register_custom_function(  # type: ignore[attr-defined]
                    getattr(_ComputationType, action), _skip_action
                )
        return schedule

    # ------------------------------------------------------------ one step

    def _loss(self, stage_output: Any, target_bt: torch.Tensor) -> torch.Tensor:
        labels_bs = target_bt if self.model_type == "gpt" else target_bt[:, :-1]
        batch = {"labels": labels_bs}
        if self.model_type == "bert":
            batch["nsp_labels"] = target_bt[:, -1]
        loss, metrics = compute_loss(
            self.model_type, model_outputs(self.model_type, stage_output), batch, self._normalizers
        )
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

        inputs = model_inputs(self.model_type, {k: cat(k) for k in micro_batches[0]})
        args = inputs[:2] if self.has_first else ()
        kwargs: dict[str, Any] = {"attention_mask": inputs[2]} if self.model_type == "bert" else {}
        target = None
        if self.has_last:
            target = cat("labels")
            if self.model_type == "bert":
                target = torch.cat([target, cat("nsp_labels")[:, None].to(target.dtype)], dim=1)
        return args, kwargs, target

    def _reduce_metrics(self, n: int) -> dict[str, float]:
        """Metric sums over the step's micro-batches, summed over pp so every rank has them."""
        if self.has_last and len(self._metrics) != n:
            raise RuntimeError(f"the schedule scored {len(self._metrics)} micro-batches, expected {n}")
        sums = [0.0] * len(self.metric_keys)
        for metrics in self._metrics:  # in micro-batch order, as the unpipelined step sums them
            for i, key in enumerate(self.metric_keys):
                sums[i] += float(metrics[key])
        self._metrics = []
        sums = all_reduce_floats(sums, self.group)
        return dict(zip(self.metric_keys, sums, strict=True))

    def train_step(
        self, micro_batches: list[Batch], normalizers: dict[str, int], loss_multiplier: float
    ) -> dict[str, float]:
        """Forward and backward of all micro-batches (gradients accumulate in the stages' params).

        The loss backpropagated per micro-batch is compute_loss(...)[0] * loss_multiplier (the
        caller folds in the dp size that DDP/FSDP average over and the fp16 loss scale); the
        returned metrics are unscaled sums over the micro-batches, equal on every pipeline rank.
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
        args, kwargs, target = self._schedule_inputs(micro_batches)
        with loss_parallel_context(self.tp):
            self._train_schedule.step(*args, target=target, return_outputs=False, **kwargs)
        return self._reduce_metrics(len(micro_batches))

    @torch.no_grad()
    def evaluate(self, batches: list[Batch], normalizers: dict[str, int]) -> dict[str, float]:
        """Forward only over `batches` (any number); the metric sums of compute_loss on every rank."""
        for stage in self.stages:
            stage.eval()
        schedule = self._schedule(len(batches), train=False)
        # The evaluation schedule re-initialised the stages' buffers for its own micro-batch count:
        # the next train_step builds (and re-initialises) a fresh training schedule.
        self._train_schedule = None
        self._normalizers, self._loss_multiplier = normalizers, 1.0
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


def _metric_keys(model_type: str, binary_head: bool) -> list[str]:
    """The metric names compute_loss returns for this model, known on every rank (not only the last
    stage's) by scoring a one-token dummy batch."""
    logits_bsv = torch.zeros(1, 1, 2)
    batch = {"labels": torch.zeros(1, 1, dtype=torch.long), "nsp_labels": torch.zeros(1, dtype=torch.long)}
    outputs: Any = (
        logits_bsv if model_type == "gpt" else (logits_bsv, torch.zeros(1, 2) if binary_head else None)
    )
    _, metrics = compute_loss(model_type, outputs, batch, {"tokens": 1, "samples": 1})
    return sorted(metrics)
