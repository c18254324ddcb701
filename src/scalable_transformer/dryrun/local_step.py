"""A dry run's optimizer step on the local shards of DTensor parameters.

The project's optimizers (AdamW, Adam, SGD; train/optim.py) are elementwise, and each param group
holds one kind of tensor: plain, or DTensors of one mesh and placement (`split_by_tensor_kind`). On
such a group DTensor runs every foreach op as the same op on the local shards, with no collective,
after working out the output placements: the local step allocates the same storages and issues the
same (no) collectives. Working them out is what costs: torch 2.13's sharding propagation of a foreach
op is quadratic in its list's length (each element's strategy rescans the whole argument list:
`_propagate_use_strided_shard_flag`, `_translate_list_op_schema`), and it is not cached across steps,
because Adam's per-step scalars (bias corrections, step sizes) are part of the key. bert-175b at
ZeRO-3 on 64 ranks spent half of its dry run there (cProfile: 529 of 1,006 s, 3 steps).

So a dry run points each such group at its parameters' local tensors for the step (their gradients
the local tensors of the DTensor gradients) and back after it. A group whose gradients are not
placed as its parameters (DTensor would redistribute them: collectives) keeps the DTensor step.
The optimizer state is then plain tensors of the local shapes, the same bytes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .torch_internals import local_tensor


def _local_ready(p: torch.Tensor) -> bool:
    """A DTensor parameter whose gradient (if any) is a DTensor of the same mesh and placements."""
    if not isinstance(p, DTensor):
        return False
    g = p.grad
    return g is None or (
        isinstance(g, DTensor) and g.placements == p.placements and g.device_mesh == p.device_mesh
    )


def step_on_local_shards(optimizer: torch.optim.Optimizer) -> None:
    """Make every later `optimizer.step()` run on local shards (see the module docstring); under
    ZeRO-1 the wrapped optimizer's step (`ZeroRedundancyOptimizer.optim`), whose broadcasts stay."""
    inner = getattr(optimizer, "optim", optimizer)
    swapped: list[tuple[dict[str, Any], list[torch.Tensor]]] = []

    def to_local(opt: Any, args: Any, kwargs: Any) -> None:
        for group in opt.param_groups:
            params = group["params"]
            if not params or not all(_local_ready(p) for p in params):
                continue
            shards = [local_tensor(p) for p in params]  # stable objects: the state's keys
            for p, shard in zip(params, shards, strict=True):
                shard.grad = None if p.grad is None else local_tensor(p.grad)
            swapped.append((group, params))
            group["params"] = shards

    def back(opt: Any, args: Any, kwargs: Any) -> None:
        for group, params in swapped:
            for shard in group["params"]:
                shard.grad = None  # no second reference: zero_grad frees the gradients
            group["params"] = params
        swapped.clear()

    inner.register_step_pre_hook(to_local)
    inner.register_step_post_hook(back)
