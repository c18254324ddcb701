"""Tensor parallelism in Megatron's layout, with optional sequence parallelism, on DTensor.

Legend: b batch, s sequence, h hidden, v padded vocabulary, t = tensor-parallel size; "local" is
a plain tensor holding this rank's part, DTensor layouts are written Replicate / Shard(d).

The plan (`tensor_parallel_plan`), per module name as the family's spec names them
(`ModelSpec.tensor_parallel`; BERT's and GPT's shown); "SP only" entries exist only with
sequence_parallel:
  embedding.word             RowwiseParallel: vocab rows Shard(0); ids Replicate in, output Replicate
                             (masked lookup + all-reduce). position/tokentype/norm stay plain (replicated).
  embedding                  SP only: PrepareModuleOutput Replicate -> Shard(1) (a local slice, no
                             communication); the whole module, because positions are added after the lookup.
  layers.<i>.norm1/norm2     SP only: SequenceParallel (weights Replicate, run on the local Shard(1)).
  layers.<i>.attention       SP only: PrepareModuleInput x Shard(1) -> Replicate (all-gather).
  layers.<i>.attention.qkv   ColwiseParallel: weight/bias Shard(0), i.e. whole key/value groups (each
                             with its query heads; a group is one head without grouped-query attention).
                             t > groups (t a multiple of them; multi-query attention): ReplicatedGroups,
                             weight/bias Replicate, each rank keeps its query heads and their group.
  layers.<i>.attention.q_norm / k_norm
                             model.qk_norm = head only: SequenceParallel on the head dim (weights Replicate,
                             run on the rank's local heads as Shard(1) of [b, n, s, d]): each rank's weight
                             gradient is its heads' Partial sum, reduced with SP's norm gradients
                             (parallel/grads.py reduce_partial_grads). full is refused under tp > 1.
  layers.<i>.attention.proj  RowwiseParallel: weight Shard(1); output Replicate (all-reduce), with SP
                             Shard(1) (reduce-scatter).
  layers.<i>.mlp             SP only: PrepareModuleInput x Shard(1) -> Replicate (all-gather).
  layers.<i>.mlp.up          ColwiseParallel (geglu gate/value columns interleave, so pairs stay together).
  layers.<i>.mlp.down        RowwiseParallel like attention.proj.
  layers.<i>.mlp (MoE)       a mixture-of-experts block's MoELayer instead of the two above: its input a
                             Replicate DTensor (gathered under SP by the entry above; without SP
                             PrepareModuleInput Replicate -> Replicate); its shared expert, if any,
                             .up / .down as mlp.up / mlp.down; the router replicated (plain); the
                             routed experts split over tp by parallel/expert.py (w_up Shard(2), w_down
                             Shard(1): each rank 1/t of every expert, like a dense MLP). Every rank
                             routes all the tokens (so routing, aux losses and dropped assignments are
                             the same on every rank); the routed output's partial sums are all-reduced
                             (SP: reduce-scattered) by `moe_tensor_parallel`'s seams, which also sum
                             the top-k weights' gradients over tp, so the router's gradient is whole
                             and equal on every rank. The shared expert reduces its own output.
  final_norm                 SP only: SequenceParallel, then PrepareModuleOutput Shard(1) -> Replicate.
  layers.<last>              SP only, post-LN models (no final_norm) on the model's last stage:
                             PrepareModuleOutput Shard(1) -> Replicate.
  output / lm_head.decoder   ColwiseParallel, for its weight only: Shard(0) like the tied word embedding
                             (the model reads .weight; the module's forward never runs).
  lm_head.bias               distributed as Shard(0) (BERT's per-token output bias [v]).
  logits / lm_head.logits    PrepareModuleInput x -> Replicate DTensor (use_local_output=False), so
                             F.linear with the Shard(0) weight gives logits Shard(-1) [b, s, v/t local],
                             consumed by cross-entropy under `loss_parallel()`.
ALiBi slopes (a plain list in attention.core) are cut to the rank's query heads.
Everything else (rotary tables, BERT's lm_head dense/norm, pooler, binary_head) stays plain and is
computed redundantly on every tp rank from the replicated stack output.

Between blocks the residual stream is a plain tensor: [b, s, h] replicated without SP, the local
sequence shard [b, s/t, h] with SP (so dropout runs on the shard). Pipeline stage boundaries carry
exactly that: without SP every stage sends and receives replicated [b, s, h]; with SP the first
stage's embedding output and every boundary between stages carry the local [b, s/t, h] shard, and
only the stage holding the model's end gathers back to [b, s, h] (after final_norm, or after its last
block for post-LN models) before the heads, which also lets BERT's pooler read x[:, 0].

Requirements the caller (config validation, parallel/dims.py) guarantees: heads, key/value groups
(model.num_query_groups) or t a multiple of the groups, ffn_hidden_size and the padded vocabulary
divisible by t; with SP, the sequence length divisible by t (DTensor.from_local assumes even shards).
The plan is applied to a meta-device model as to a materialized one: on meta, parallel/init.py fills
each rank's shards afterwards with values that depend only on the seed and the parameter name (identical
replicas, the single-process values). Dropout: replicated activations draw the same mask on every tp
rank; the head shards (attention dropout) and, with SP, the sequence shards draw from per-tp-rank
streams (parallel/rng.py), as Megatron's tensor- parallel RNG tracker does.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from ..models import PLAIN_LOSS_OPS, LossOps, spec_for
from ..models.layers import Attention, CoreAttention
from ..models.moe import MoELayer, TensorParallelMoE
from ..models.spec import TensorParallelNames
from .float8_training import float8_tp_style
from .torch_compat import is_wrapper_tensor


def _child(module: nn.Module, name: str) -> nn.Module | None:
    child = getattr(module, name, None)
    return child if isinstance(child, nn.Module) else None


def _blocks(module: nn.Module) -> list[tuple[str, nn.Module]]:
    layers = _child(module, "layers")
    return [] if layers is None else list(layers.named_children())


def _names(module: nn.Module) -> TensorParallelNames | None:
    """The family's tensor-parallel names, from the model config the module carries (models and
    their pipeline stages do); None for a bare container of blocks."""
    cfg = getattr(module, "cfg", None)
    return None if cfg is None else spec_for(cfg).tensor_parallel


class ReplicatedGroups(ParallelStyle):
    """The fused qkv projection when the tensor-parallel size t exceeds the key/value groups g (t a
    multiple of g): weight and bias Replicate, so every rank computes all columns and keeps its n / t
    query heads and the one group serving them, laid out as a single group [q of n/t heads | k | v]
    (apply_tensor_parallel sets the attention's heads_per_group to n / t). Each rank's loss uses other
    columns, so the column gradients are partial sums: the redistribute before
    `to_local(grad_placements=Partial)` all-reduces them in backward, and the replicated weight's
    gradient is the full one, Replicate, on every rank (without it the gradient would be a Partial
    DTensor that FSDP and the optimizer do not reduce). Megatron refuses t > g; vLLM replicates
    key/value heads the same way for inference."""

    def __init__(self, groups: int, heads_per_group: int, head_dim: int) -> None:
        super().__init__()
        self.groups, self.heads_per_group, self.head_dim = groups, heads_per_group, head_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # torch annotates input_fn/output_fn as returning None, yet uses what they return (as
        # ColwiseParallel's do)
        return distribute_module(
            module,
            device_mesh,
            self._replicate,
            self._input,  # type: ignore[arg-type]
            self._output,  # type: ignore[arg-type]
        )

    @staticmethod
    def _replicate(name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        for local, param in list(module.named_parameters(recurse=False)):
            # from_local: the values are identical on every rank already (seeded per name), or meta
            replicated = DTensor.from_local(param.data, device_mesh, [Replicate()], run_check=False)
            module.register_parameter(local, nn.Parameter(replicated, param.requires_grad))

    @staticmethod
    def _input(module: nn.Module, inputs: tuple, device_mesh: DeviceMesh) -> DTensor:
        x = inputs[0]
        if isinstance(x, DTensor):
            return x
        return DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)

    def _output(self, module: nn.Module, y: DTensor, device_mesh: DeviceMesh) -> torch.Tensor:
        t, d, r = device_mesh.size(), self.head_dim, self.heads_per_group
        ranks_per_group = t // self.groups
        group, part = divmod(device_mesh.get_local_rank(), ranks_per_group)
        local_heads = r // ranks_per_group
        start = group * (r + 2) * d
        y_local = y.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()])
        q_cols = y_local[..., start + part * local_heads * d : start + (part + 1) * local_heads * d]
        kv_cols = y_local[..., start + r * d : start + (r + 2) * d]
        return torch.cat([q_cols, kv_cols], dim=-1)


def _attention_groups(block: nn.Module) -> tuple[Attention, int]:
    """A block's attention module and its number of key/value groups (from the qkv width; before
    apply_tensor_parallel changes heads_per_group)."""
    attention = block.get_submodule("attention")
    assert isinstance(attention, Attention)
    group_rows = (attention.heads_per_group + 2) * attention.head_dim
    return attention, _rows_cols(block, "attention.qkv")[0] // group_rows


def tensor_parallel_plan(
    module: nn.Module, sequence_parallel: bool, tp: int = 1
) -> list[tuple[str, ParallelStyle]]:
    """(submodule name, style) pairs in application order for the children `module` has (a whole
    model or a pipeline stage) on `tp` ranks. A name may appear twice: final_norm gets two hooks under
    SP. A module without a model config (`.cfg`) gets the blocks' entries only."""
    sp = sequence_parallel
    names = _names(module)
    # With SP, row-parallel outputs are reduce-scattered onto the sequence dim instead of all-reduced.
    stream = Shard(1) if sp else Replicate()
    plan: list[tuple[str, ParallelStyle]] = []
    if names is not None and _has(module, names.word_embedding):
        # Replicate out of the lookup: positions/token types are added to the full [b, s, h] after it.
        plan.append(
            (names.word_embedding, RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
        )
        if sp and getattr(module, "has_embedding", True):  # a tied copy alone computes no embedding
            plan.append(
                (
                    names.embedding,
                    PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1)),
                )
            )
    blocks = _blocks(module)
    for name, block in blocks:
        prefix = f"layers.{name}"
        attention, groups = _attention_groups(block)
        qkv_style: ParallelStyle = (
            ColwiseParallel()
            if groups % tp == 0
            else ReplicatedGroups(groups, attention.heads_per_group, attention.head_dim)
        )
        if sp:
            plan += [
                (f"{prefix}.norm1", SequenceParallel(use_local_output=True)),
                (f"{prefix}.norm2", SequenceParallel(use_local_output=True)),
                (
                    f"{prefix}.attention",
                    PrepareModuleInput(
                        input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
                    ),
                ),
                (
                    f"{prefix}.mlp",
                    PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()),
                ),
            ]
        plan += [
            (f"{prefix}.attention.qkv", qkv_style),
            *_qk_norm_plan(f"{prefix}.attention", attention),
            (f"{prefix}.attention.proj", RowwiseParallel(output_layouts=stream)),
        ]
        plan += _mlp_plan(block, prefix, sp, stream)
    if names is None:
        return plan
    if sp and _has(module, names.final_norm):
        gather = PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate())
        plan += [(names.final_norm, SequenceParallel()), (names.final_norm, gather)]
    elif sp and blocks and _ends_model(module, blocks[-1][0]):
        gather = PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate())
        plan.append((f"layers.{blocks[-1][0]}", gather))
    # The untied output matrices only need their weight sharded like the tied word embedding.
    for name in names.untied_outputs:
        if _has(module, name):
            plan.append((name, ColwiseParallel()))
    # x arrives as a plain replicated tensor; weight (and bias, by keyword) are already DTensors.
    to_logits = PrepareModuleInput(
        input_layouts=(Replicate(), None),
        desired_input_layouts=(Replicate(), None),
        input_kwarg_layouts={},
        desired_input_kwarg_layouts={},
        use_local_output=False,
    )
    if _has(module, names.logits):
        plan.append((names.logits, to_logits))
    return plan


def _mlp_plan(
    block: nn.Module, prefix: str, sp: bool, stream: Shard | Replicate
) -> list[tuple[str, ParallelStyle]]:
    """A block's MLP: the dense one column- then row-parallel; a mixture of experts (MoELayer) gets its
    input as a Replicate DTensor (gathered under SP by the entry above; without SP a local wrap) and
    its shared expert, if any, the dense MLP's plan. The routed experts are sharded by
    parallel/expert.py and run through `TensorParallelMoE` (`moe_tensor_parallel`)."""
    mlp = block.get_submodule("mlp")
    if not isinstance(mlp, MoELayer):
        return [
            (f"{prefix}.mlp.up", ColwiseParallel()),
            (f"{prefix}.mlp.down", RowwiseParallel(output_layouts=stream)),
        ]
    plan: list[tuple[str, ParallelStyle]] = []
    if not sp:
        plan.append(
            (
                f"{prefix}.mlp",
                PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Replicate()),
            )
        )
    if mlp.shared_expert is not None:
        plan += [
            (f"{prefix}.mlp.shared_expert.up", ColwiseParallel()),
            (f"{prefix}.mlp.shared_expert.down", RowwiseParallel(output_layouts=stream)),
        ]
    return plan


def _qk_norm_plan(prefix: str, attention: Attention) -> list[tuple[str, ParallelStyle]]:
    """model.qk_norm = head: q_norm and k_norm run on the rank's local heads, a Shard(1) of [b, n, s, d]
    (their weights Replicate, their gradients Partial over tp); none without per-head norms."""
    if attention.qk_norm != "head":
        return []
    return [
        (f"{prefix}.{norm}", SequenceParallel(sequence_dim=1, use_local_output=True))
        for norm in ("q_norm", "k_norm")
    ]


def _ends_model(module: nn.Module, last_block: str) -> bool:
    """Whether the block named last_block is the model's last, by its global index (the module
    carries the model config: models do, and stages built from one keep it)."""
    num_layers = getattr(getattr(module, "cfg", None), "num_layers", None)
    return isinstance(num_layers, int) and last_block.isdigit() and int(last_block) == num_layers - 1


def _has(module: nn.Module, name: str) -> bool:
    """Whether `module` holds a submodule at dotted `name` (a removed part is None: not held)."""
    try:
        return module.get_submodule(name) is not None
    except AttributeError:
        return False


def _rows_cols(module: nn.Module, name: str) -> tuple[int, int]:
    """(out, in) features of the Linear / (rows, dim) of the Embedding at `name`."""
    weight = module.get_submodule(name).weight
    assert isinstance(weight, torch.Tensor)
    return weight.shape[0], weight.shape[1]


def _check_divisible(module: nn.Module, tp: int) -> None:
    sizes: list[tuple[str, int]] = []
    for name, block in _blocks(module):
        attention, groups = _attention_groups(block)
        sizes.append((f"layers.{name} attention heads", groups * attention.heads_per_group))
        if groups % tp and tp % groups:
            raise ValueError(
                f"tensor parallel over {tp} ranks: layers.{name} has {groups} key/value groups; tp must "
                "divide them or be a multiple of them"
            )
        mlp = block.get_submodule("mlp")
        if isinstance(mlp, MoELayer):
            sizes.append((f"layers.{name}.mlp.experts inner size", mlp.experts.w_down.shape[1]))
            if mlp.shared_expert is not None:
                down = _rows_cols(block, "mlp.shared_expert.down")[1]
                sizes.append((f"layers.{name}.mlp.shared_expert.down input features", down))
        else:
            sizes.append((f"layers.{name}.mlp.down input features", _rows_cols(block, "mlp.down")[1]))
    names = _names(module)
    for name in () if names is None else (names.word_embedding, *names.untied_outputs):
        if _has(module, name):
            sizes.append((f"{name} vocabulary rows", _rows_cols(module, name)[0]))
    for name, size in sizes:
        if size % tp:
            raise ValueError(f"tensor parallel over {tp} ranks: {name} = {size} is not divisible by {tp}")


class SavedShards:
    """Saved-tensor hooks that keep 1/t of every tp-replicated activation autograd saves.

    With sequence parallelism, DTensor all-gathers the sequence-sharded norm output into a Replicate
    DTensor before each column-parallel linear (attention.qkv, mlp.up), and that linear saves the
    gathered [b, s, h] input for its weight gradient: whole on every rank, 2 x 2sbh per layer that
    Korthikanti et al. (2022) count as 1/t. As Megatron does, each rank keeps its 1/t slice (of the
    flattened tensor) instead and the slices are all-gathered again when backward needs them: one
    all-gather per such input in backward. Parameters are never touched.
    """

    def __init__(self, tp_mesh: DeviceMesh) -> None:
        self.mesh = tp_mesh
        self.group = tp_mesh.get_group()
        self.t = tp_mesh.size()
        self.rank = tp_mesh.get_local_rank()
        self._contexts: list[AbstractContextManager[None]] = []

    def pack(self, saved: torch.Tensor) -> object:
        if not (
            isinstance(saved, DTensor)
            and saved.device_mesh == self.mesh
            and all(p.is_replicate() for p in saved.placements)
            and not (saved.is_leaf and saved.requires_grad)
            # a float8 linear's saved input is a torchao float8 tensor (train.fp8): 1 byte a value
            # with its scale, kept whole (a slice of it would need the scale and a float8 all-gather)
            and not is_wrapper_tensor(saved.to_local())
        ):
            return saved
        flat = saved.to_local().reshape(-1)
        if flat.numel() % self.t:
            flat = F.pad(flat, (0, self.t - flat.numel() % self.t))
        # a copy: a view would keep the gathered tensor's whole storage alive
        return _Slice(flat.chunk(self.t)[self.rank].clone(), saved.shape)

    def unpack(self, packed: object) -> torch.Tensor:
        if not isinstance(packed, _Slice):
            return packed  # type: ignore[return-value]
        part = packed.part
        full = torch.empty(part.numel() * self.t, dtype=part.dtype, device=part.device)
        torch.distributed.all_gather_single(full, part, group=self.group)
        local = full[: packed.shape.numel()].view(packed.shape)
        return DTensor.from_local(local, self.mesh, [Replicate()], run_check=False)

    def enter(self, *_: object) -> None:
        context = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        context.__enter__()
        self._contexts.append(context)

    def exit(self, *_: object) -> None:
        self._contexts.pop().__exit__(None, None, None)

    def attach(self, module: nn.Module) -> None:
        """Active during every forward of `module` (also one that raises)."""
        module.register_forward_pre_hook(self.enter)
        module.register_forward_hook(self.exit, always_call=True)


class _Slice:
    """This rank's slice of a saved tp-replicated tensor of `shape`."""

    def __init__(self, part: torch.Tensor, shape: torch.Size) -> None:
        self.part, self.shape = part, shape


def apply_tensor_parallel(
    module: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool, shard_saved: bool = True
) -> None:
    """Shard `module` (a BERT/GPT model or a pipeline stage of one) in place over the 1-D `tp_mesh`
    as described in this module's docstring. A mesh of size 1 leaves the module untouched.
    With sequence parallelism and `shard_saved`, the gathered inputs the column-parallel linears save
    are kept as 1/t slices (`SavedShards`); the caller turns that off under full recompute, whose
    checkpoints save only the (already sharded) block inputs and must own the saved-tensor hooks.

    Afterwards the logits are DTensors sharded on the vocabulary: run forward, loss and backward
    inside `loss_parallel_context(tp)`. Raises ValueError if heads, MLP width or vocabulary rows
    do not split evenly.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tensor_parallel needs a 1-D tensor-parallel mesh, got {tp_mesh.ndim}-D")
    tp = tp_mesh.size()
    if tp == 1:
        return
    _check_divisible(module, tp)
    plan = tensor_parallel_plan(module, sequence_parallel, tp)
    for name, style in plan:
        # a float8 linear (train.fp8 = tensorwise) gets torchao's float8 version of its style
        parallelize_module(module, tp_mesh, {name: float8_tp_style(module.get_submodule(name), style)})
    if sequence_parallel and shard_saved:
        saved = SavedShards(tp_mesh)
        for _, block in _blocks(module):
            saved.attach(block.get_submodule("attention"))
            saved.attach(block.get_submodule("mlp"))
    for _, block in _blocks(module):
        mlp = block.get_submodule("mlp")
        if isinstance(mlp, MoELayer):
            mlp.tensor_parallel = moe_tensor_parallel(tp_mesh, sequence_parallel)
    for name, style in plan:
        if isinstance(style, ReplicatedGroups):  # each rank now sees one group of n / t query heads
            attention = module.get_submodule(name.removesuffix(".qkv"))
            assert isinstance(attention, Attention)
            attention.heads_per_group = style.heads_per_group * style.groups // tp
    # Either style leaves rank r the query heads r n/t .. (r + 1) n/t - 1: ALiBi slopes follow them
    rank = tp_mesh.get_local_rank()
    for _, block in _blocks(module):
        for core in block.modules():
            if isinstance(core, CoreAttention) and core.all_slopes is not None:
                local = len(core.all_slopes) // tp
                core.keep_heads(rank * local, (rank + 1) * local)
    names = _names(module)
    if names is not None and names.output_bias is not None:
        owner_name, _, bias_name = names.output_bias.rpartition(".")
        owner = module.get_submodule(owner_name) if _has(module, owner_name) else None
        bias = None if owner is None else getattr(owner, bias_name, None)
        if owner is not None and isinstance(bias, nn.Parameter):
            # Per-vocabulary-row output bias: sharded like the logits' columns, added locally.
            owner.register_parameter(
                bias_name,
                nn.Parameter(distribute_tensor(bias.detach(), tp_mesh, [Shard(0)]), bias.requires_grad),
            )


# ---------------------------------------------------------------- mixture of experts
# Every tp rank routes the same tokens and holds 1 / t of every expert (models/moe.py
# `TensorParallelMoE`); these are its seams, Megatron's f / g operators written out.


def moe_tensor_parallel(tp_mesh: DeviceMesh, sequence_parallel: bool) -> TensorParallelMoE:
    """The seams of an MoE layer over `tp_mesh`: its input arrives as a Replicate DTensor (the plan's
    `mlp` entry), is used as the local whole tensor with a partial-sum gradient (so the routed
    experts', the router's and the shared expert's input gradients are reduced together, once: an
    all-reduce, or a reduce-scatter under SP, in the entry's backward), and the routed output's
    partial sums are all-reduced, or reduce-scattered onto the local sequence shard under SP."""
    group, t = tp_mesh.get_group(), tp_mesh.size()

    def enter(x_bsh: torch.Tensor) -> torch.Tensor:
        if not isinstance(x_bsh, DTensor):
            raise TypeError("a tensor-parallel MoE layer takes its input as a DTensor (the plan's mlp entry)")
        return x_bsh.to_local(grad_placements=[Partial()])

    def leave(y_bsh: torch.Tensor) -> torch.Tensor:
        if sequence_parallel:
            return _ReduceScatterSequence.apply(y_bsh, group, t)
        return _SumOverGroup.apply(y_bsh, group)

    return TensorParallelMoE(
        size=t,
        enter=enter,
        router_input=lambda x: _ScaleGrad.apply(x, 1.0 / t),
        combine_weights=lambda w: _SumGradOverGroup.apply(w, group),
        leave=leave,
    )


class _ScaleGrad(torch.autograd.Function):
    """Identity; the gradient times `scale`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad * ctx.scale, None


class _SumGradOverGroup(torch.autograd.Function):
    """Identity; the gradient summed over `group` (Megatron's copy_to_tensor_model_parallel_region)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None


class _SumOverGroup(torch.autograd.Function):
    """The sum over `group`; the gradient passes unchanged (reduce_from_tensor_model_parallel_region)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        total = x.contiguous().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


class _ReduceScatterSequence(torch.autograd.Function):
    """[b, s, h] summed over `group`, rank r keeping sequence chunk r [b, s / t, h] (SP's Shard(1));
    the backward all-gathers the chunks' gradients."""

    @staticmethod
    def forward(ctx: Any, x_bsh: torch.Tensor, group: Any, t: int) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.t = group, t
        x_sbh = x_bsh.transpose(0, 1).contiguous()
        out = x_sbh.new_empty(x_sbh.shape[0] // t, *x_sbh.shape[1:])
        dist.reduce_scatter_single(out, x_sbh, group=group)
        return out.transpose(0, 1).contiguous()

    @staticmethod
    def backward(ctx: Any, grad_bsh: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        g_sbh = grad_bsh.transpose(0, 1).contiguous()
        full = g_sbh.new_empty(g_sbh.shape[0] * ctx.t, *g_sbh.shape[1:])
        dist.all_gather_single(full, g_sbh, group=ctx.group)
        return full.transpose(0, 1), None, None


def loss_parallel_context(tp: int) -> AbstractContextManager[None]:
    """Wrap forward + loss + backward in this: `loss_parallel()` when tp > 1 (cross-entropy on
    vocab-sharded logits without gathering them), else a no-op context."""
    return loss_parallel() if tp > 1 else contextlib.nullcontext()


# ---------------------------------------------------------------- the loss seam
# Tensor parallelism hands the family's loss DTensor logits sharded on the vocabulary (n rows, v
# columns split over the tp ranks); the loss reduces over the vocabulary only through these two.


def vocab_parallel_cross_entropy_sum(
    logits: torch.Tensor, labels_n: torch.Tensor, ignore_index: int
) -> torch.Tensor:
    """Summed fp32 cross-entropy over the rows of logits [..., v] whose label is not ignore_index, as
    a plain scalar.

    Vocab-sharded DTensor logits must come inside `loss_parallel_context(tp)` (backward too): it
    computes the softmax with all-reduces of [n] maxima and sums instead of gathering the logits; the
    replicated DTensor result is returned as its local (full) value.
    """
    logits_nv = logits.reshape(labels_n.numel(), logits.shape[-1])
    loss = F.cross_entropy(logits_nv.float(), labels_n, ignore_index=ignore_index, reduction="sum")
    return loss.to_local() if isinstance(loss, DTensor) else loss


def vocab_parallel_argmax_rows(logits_nv: torch.Tensor, rows_n: torch.Tensor) -> torch.Tensor:
    """Vocabulary argmax [m] of the rows selected by the boolean mask rows_n (m = rows_n.sum()).

    For DTensor logits sharded evenly on the vocabulary, each rank takes its shard's (max, first
    argmax) of the selected rows and only those [m, 2] pairs are gathered; the first shard holding
    the overall max wins, so ties resolve to the lowest index, as torch.argmax does.
    """
    if not isinstance(logits_nv, DTensor):
        return logits_nv[rows_n].argmax(-1)
    placements = tuple(logits_nv.placements)
    if not all(p.is_replicate() or p.is_shard(1) for p in placements):
        raise ValueError(
            f"vocab_parallel_argmax_rows expects logits sharded on the vocabulary only, got {placements}"
        )
    local_mv = logits_nv.to_local()[rows_n]
    if logits_nv.shape[1] % local_mv.shape[1]:
        raise ValueError(
            f"vocab_parallel_argmax_rows needs evenly sharded logits, got {logits_nv.shape[1]} columns"
        )
    max_m, arg_m = local_mv.max(-1)
    # float64 holds any fp32/bf16 logit and any vocabulary index exactly
    pairs_m12 = torch.stack([max_m.double(), arg_m.double()], -1)[:, None, :]
    pairs_mt2 = DTensor.from_local(
        pairs_m12, logits_nv.device_mesh, placements, run_check=False
    ).full_tensor()
    shard_m = pairs_mt2[..., 0].argmax(-1)
    local_index_m = pairs_mt2[..., 1].gather(-1, shard_m[:, None]).squeeze(-1).long()
    return shard_m * local_mv.shape[1] + local_index_m


TP_LOSS_OPS = LossOps(
    cross_entropy_sum=vocab_parallel_cross_entropy_sum, argmax_rows=vocab_parallel_argmax_rows
)


def loss_ops(tp: int) -> LossOps:
    """The vocabulary reductions the family's loss should use: DTensor-aware ones when tp > 1."""
    return TP_LOSS_OPS if tp > 1 else PLAIN_LOSS_OPS
