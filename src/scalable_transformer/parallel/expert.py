"""Expert parallelism: every `GroupedExperts` keeps E / ep experts and trades tokens by all-to-all.

Shape legend: t token-expert rows (sorted by expert), h hidden; E experts of the layer, e = E / ep the
experts this rank holds, r the ep ranks.

Weights: w_up and w_down become DTensors sharded on dim 0 (`Shard(0)`) over the ep mesh, rank i holding
experts [i e, (i + 1) e). DTensors, not plain local slices, so that torch.distributed.checkpoint
reshards them between layouts (an ep2 checkpoint loads into one process and back), `parallel/init.py`
cuts each rank's slice out of the name-seeded full value (every layout starts from the same weights),
the gradient norm sums their squares over ep (`parallel/grads.py`) and FSDP2 / replicate stack
their data-parallel placement on top (torchtitan's layout: experts sharded over ep and over edp).
Under tensor parallelism each expert is split like a dense MLP (`TP_SHARD_DIMS`: w_up Shard(2),
w_down Shard(1)) and the weights are DTensors over the (ep, tp) mesh, or the tp mesh alone without
expert parallelism (Megatron-core's default expert tensor parallel size, tp). Every tp rank routes the
same tokens (parallel/tensor.py, models/moe.py `TensorParallelMoE`), so with ep the all-to-all runs
among the ranks of one tp index (ep is carved out of dp x cp), each sending its whole token set, and
its output rows are partial sums over tp that the MoE layer reduces after the combine.

Forward (the MoE layer calls `experts(x_th, counts_E)` with its own tokens for all E experts, as
without expert parallelism; the bound forward below wraps the module's own):
  1. all-to-all of the counts: each rank learns how many rows every rank sends to each of its experts;
  2. the split sizes are read on the host: THE one device-to-host sync per MoE layer and micro-batch
     that dropless expert parallelism needs (the all-to-all's sizes are host integers; torchtitan's
     dispatcher does the same). Both count vectors come back in one read;
  3. all-to-all of the rows (autograd-aware: its backward is the reverse all-to-all);
  4. the rows arrive rank-major ((r0: e0, e1, ...), (r1: e0, e1, ...)); they are put expert-major,
     the local experts run on their local weight shards, and the rows go back rank-major;
  5. all-to-all back: the caller gets each row's expert output in the order it sent them.
Rows are re-sorted with split + cat (views and one copy each way, no index tensor to build or move).
The wrapper is the module instance's own forward rather than a pair of forward hooks: the exchange,
the experts' math on the local shards and the way back are one call (the local weights put back in a
`finally`), with no state carried from a pre-hook to a hook.

Gradients: each rank's expert weights receive the gradient of every ep rank's tokens (through the
all-to-all's backward); the ranks holding the same experts (edp) then sum them. So the expert gradient
is reduced over edp only, divided by dp x cp like every other gradient: see `divide_expert_gradients`.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from ..models.moe import GroupedExperts
from .torch_compat import all_to_all_autograd

EXPERT_WEIGHTS = ("w_up", "w_down")
# the dimension tensor parallelism splits: w_up [e, h, up] by columns (gate/value pairs interleave, so
# a contiguous slice keeps them together), w_down [e, f, h] by rows; each rank's output is a partial sum
TP_SHARD_DIMS = {"w_up": 2, "w_down": 1}


def expert_modules(model: nn.Module) -> list[GroupedExperts]:
    """The routed-experts modules of `model` (one per MoE layer), in module order."""
    return [m for m in model.modules() if isinstance(m, GroupedExperts)]


def expert_shard_placement(model: nn.Module, shard_ranks: int) -> Callable[[nn.Parameter], Shard | None]:
    """FSDP2's `shard_placement_fn` for `model`'s expert weights over `shard_ranks` ranks: FSDP2's
    default dim 0 where the experts this rank holds split evenly over them, else the first of dims 1
    and 2 (h or f) that does. On dim 0, 1 local expert over 8 shard ranks (Mixtral with ep 8 on 64
    ranks) leaves one rank holding the whole expert and seven holding padding of its size (torchtitan
    shards experts on dim 1 for the same reason). Where no dim splits evenly (4 experts of h 128 over
    3 ranks) dim 0 it is, padded, the one dim on which FSDP2 takes uneven shards."""
    experts = {id(p) for m in expert_modules(model) for p in m.parameters(recurse=False)}

    def place(param: nn.Parameter) -> Shard | None:
        if id(param) not in experts:
            return None
        shape = (param.to_local() if isinstance(param, DTensor) else param).shape
        if shape[0] % shard_ranks == 0:
            return None
        even = [dim for dim in (1, 2) if shape[dim] % shard_ranks == 0]
        return Shard(even[0]) if even else None

    return place


def apply_expert_parallel(model: nn.Module, mesh: Any) -> list[GroupedExperts]:
    """Shard every GroupedExperts of `model` over `mesh`, whose dimensions are named "ep" and/or "tp":
    experts over "ep" (`Shard(0)`, tokens moved to them around the forward: module doc), each
    expert's inner dimension over "tp" (`TP_SHARD_DIMS`: w_up's columns, w_down's rows, as a dense
    MLP's up and down). Works on the meta device (before materialization) and on real weights (every
    rank must then hold the same full weights: each keeps its slice). Returns the modules changed;
    the model is unchanged when it has none."""
    names = tuple(mesh.mesh_dim_names)
    ep = mesh.size(names.index("ep")) if "ep" in names else 1
    tp = mesh.size(names.index("tp")) if "tp" in names else 1
    modules = expert_modules(model)
    for module in modules:
        experts, inner = module.w_down.shape[0], module.w_down.shape[1]
        if experts % ep:
            raise ValueError(f"{experts} experts cannot be split evenly over {ep} expert-parallel ranks")
        if inner % tp:
            raise ValueError(
                f"the experts' inner size {inner} cannot be split evenly over {tp} tensor-parallel ranks"
            )
        for name in EXPERT_WEIGHTS:
            full = getattr(module, name)
            placements = [Shard(0) if dim == "ep" else Shard(TP_SHARD_DIMS[name]) for dim in names]
            # no source rank: each rank slices its own shard, no communication (on meta: shapes only)
            shard = distribute_tensor(full.detach(), mesh, placements, src_data_rank=None)
            module.register_parameter(name, nn.Parameter(shard, requires_grad=full.requires_grad))
        compute = type(module).forward  # the experts' own math, run on the local shards
        if ep > 1:
            ep_mesh = mesh if mesh.ndim == 1 else mesh["ep"]
            forward = _expert_parallel_forward(compute, ep_mesh.get_group(), ep)
        else:
            forward = _local_forward(compute)
        # this instance's forward wraps its class's (FSDP2 later swaps the class, not the instance's)
        module.forward = types.MethodType(forward, module)  # type: ignore[method-assign]
    return modules


def divide_expert_gradients(unit: Any, grad_ranks: int, shard_ranks: int) -> None:
    """Make an FSDP2 / replicate unit over the edp ranks divide its experts' summed gradients by
    dp x cp (`grad_ranks`), as every other gradient is. An expert's gradient already sums the tokens of
    its ep ranks, so the wrappers' default (dividing by the edp ranks only) would leave it ep times the
    single-process gradient (torchtitan sets the same factor on its expert units). `shard_ranks`: the
    ranks the unit reduce-scatters over (1 for replicate)."""
    unit.set_gradient_divide_factor(float(grad_ranks))
    if shard_ranks > 1:
        # reduce-scatter with SUM, then divide: a divide factor other than the group size otherwise
        # selects PREMUL_SUM, which gloo refuses ("Cannot use ReduceOp.PREMUL_SUM with Gloo"). Not over
        # one rank: torch 2.13 then divides in its copy in place of the reduce-scatter and, with
        # sums forced, again after it (checked: the gradient came out 1 / dp x cp too small).
        unit.set_force_sum_reduction_for_comms(True)


def _expert_parallel_forward(
    compute: Callable[..., torch.Tensor], group: Any, ep: int
) -> Callable[[GroupedExperts, torch.Tensor, torch.Tensor], torch.Tensor]:
    def forward(module: GroupedExperts, x_th: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        plan = _exchange_counts(counts_E, x_th.shape[0], group, ep)
        received_th = all_to_all_autograd(x_th, plan.recv_splits, plan.send_splits, group)
        local_th = _reorder(received_th, plan.recv_rows, ep, plan.local_experts)
        with _local_weights(module):
            if sum(plan.local_rows) > 0:
                y_th = compute(module, local_th, plan.local_counts_e)
            else:
                y_th = _without_rows(module, local_th)
        y_back_th = _reorder(y_th, plan.local_rows, plan.local_experts, ep)
        return all_to_all_autograd(y_back_th, plan.send_splits, plan.recv_splits, group)

    return forward


def _local_forward(
    compute: Callable[..., torch.Tensor],
) -> Callable[[GroupedExperts, torch.Tensor, torch.Tensor], torch.Tensor]:
    """Without expert parallelism (tensor parallelism only): every rank's rows, its weight shards."""

    def forward(module: GroupedExperts, x_th: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        with _local_weights(module):
            return compute(module, x_th, counts_E)

    return forward


class _Plan:
    """One call's all-to-all plan: row counts on the host (lists) and the local counts on the device."""

    def __init__(
        self, sent_E: list[int], received_re: list[int], local_counts_e: torch.Tensor, ep: int
    ) -> None:
        e = len(sent_E) // ep
        self.local_experts = e
        self.send_splits = [sum(sent_E[r * e : (r + 1) * e]) for r in range(ep)]
        self.recv_splits = [sum(received_re[r * e : (r + 1) * e]) for r in range(ep)]
        self.recv_rows = received_re  # rank-major: (from rank r, local expert j) at r * e + j
        # expert-major: (local expert j, from rank r) at j * ep + r
        self.local_rows = [received_re[r * e + j] for j in range(e) for r in range(ep)]
        self.local_counts_e = local_counts_e


def _exchange_counts(counts_E: torch.Tensor, rows: int, group: Any, ep: int) -> _Plan:
    """All-to-all of the per-expert row counts, then both read on the host in one transfer; `rows`
    (this rank's, x_th's first dimension) must be what the counts add up to."""
    with torch.no_grad():
        sent_E = counts_E.to(torch.int64)
        received_re = torch.empty_like(sent_E)
        # rank r receives from every rank the counts of r's experts: [E] -> [ep, e], rank-major
        dist.all_to_all_single(received_re, sent_E, group=group)
        local_counts_e = received_re.view(ep, -1).sum(0)
        # THE host sync of dropless expert parallelism (module doc): the all-to-all needs host sizes
        both = torch.cat([sent_E, received_re]).tolist()
    experts = sent_E.numel()
    if sum(both[:experts]) != rows:
        raise ValueError(
            f"the experts were called with {rows} rows but counts adding up to {sum(both[:experts])} "
            f"({both[:experts]}): counts_e[i] must be the rows of expert i, every row counted once"
        )
    return _Plan(both[:experts], both[experts:], local_counts_e, ep)


def _without_rows(module: GroupedExperts, x_th: torch.Tensor) -> torch.Tensor:
    """The output when no row reached this rank's experts (skewed routing, small micro-batches):
    torch 2.13's grouped GEMM fails in backward on zero rows ("Invalid strides/sizes"), so the experts
    do not run. The output still depends on the (empty) rows and the weights, so that this rank's
    backward runs the rows' all-to-all like every other ep rank (a rank that skipped it would leave the
    others waiting) and gives the weights (zero) gradients, the same set on every edp rank."""
    touch = x_th.sum() + module.w_up.sum() + module.w_down.sum()
    return x_th.new_zeros(0, module.w_down.shape[-1]) + 0 * touch


def _reorder(rows_th: torch.Tensor, sizes: list[int], outer: int, inner: int) -> torch.Tensor:
    """Rows in blocks ordered (outer, inner), sizes[o * inner + i] rows each, as (inner, outer)."""
    blocks = torch.split(rows_th, sizes, dim=0)
    return torch.cat([blocks[o * inner + i] for i in range(inner) for o in range(outer)], dim=0)


@contextlib.contextmanager
def _local_weights(module: nn.Module) -> Iterator[None]:
    """The module's DTensor weights as their local shards for the duration of its own forward (its
    math is plain-tensor math); `to_local` is differentiable, so the shards' gradients reach the
    DTensor parameters (or FSDP2's unsharded ones) as DTensor gradients."""
    saved = {name: module._parameters[name] for name in EXPERT_WEIGHTS}
    try:
        for name, param in saved.items():
            if isinstance(param, DTensor):
                module._parameters[name] = param.to_local()  # type: ignore[assignment]
        yield
    finally:
        module._parameters.update(saved)
