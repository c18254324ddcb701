"""Calibration sections `fsdp_unit` and `tp_layer` (world > 1): the fixed cost of an FSDP unit's
collective beyond its bytes (`measure_fsdp_unit`, `unit_overhead_us`) and of a tensor-parallel layer
beyond its GEMMs and collectives (`measure_tp_layer`, `tp_layer_overhead_us`).
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from ..config.schema import Config
from ..plan.speed import tp_layer_collectives
from .collective_rates import _smaller_group_sizes
from .kernels import model_dims
from .timing import FSDP_UNIT_MAX_PARAMS, FSDP_UNITS, MAX_REPEATS, Job, Section


@dataclass
class FsdpUnitTiming:
    """What the FSDP unit point measured: the extra seconds of a forward + backward of FSDP_UNITS
    blocks sharded one per unit (ZeRO-3: gathered in forward and again in backward, gradients
    reduce-scattered) over the same blocks unsharded, and the collectives FSDP2 issued in it as
    (op, bytes of the whole tensor)."""

    extra_seconds: float
    calls: list[tuple[str, int]]
    scope: str


def _unit_dims(cfg: Config) -> tuple[int, int, int]:
    """(rows, h, f) of the point's blocks: the micro-batch's tokens and the model's widths, both
    widths scaled down together when a block would exceed FSDP_UNIT_MAX_PARAMS."""
    d = model_dims(cfg)
    h, f = d["h"], d["f"]
    scale = min(1.0, (FSDP_UNIT_MAX_PARAMS / (4 * h * h + 2 * h * f)) ** 0.5)
    return d["b"] * d["s"], max(8, int(h * scale)), max(8, int(f * scale))


def measure_fsdp_unit(job: Job, cfg: Config, say=print) -> FsdpUnitTiming | None:
    """Time FSDP_UNITS transformer-sized blocks (an attention-sized pair of linears, 4 h^2, and the
    MLP's, 2 h f) forward and backward, plain and under FSDP2 (`fully_shard` per block, as
    parallel/apply.py shards a model), alternating, and count the collectives FSDP2 issues by
    wrapping torch.distributed's all_gather_single / reduce_scatter_single for one call. The
    planner's share of the difference, the collectives' bytes on this profile's curves, is taken
    out in `unit_overhead_us`; what is left is the fixed cost per unit collective (hooks, copy-in
    and copy-out, the ranks meeting). None with one process."""
    if job.world == 1:
        return None

    section = Section(job, "fsdp_unit", 1, say)
    rows, h, f = _unit_dims(cfg)
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)

    plain = nn.Sequential(*[nn.Sequential(_Pair(h, 2 * h), _Pair(h, f)) for _ in range(FSDP_UNITS)]).to(
        job.device
    )
    sharded = copy.deepcopy(plain)
    mesh = init_device_mesh(job.device.type, (job.world,))
    for unit in sharded:
        fully_shard(unit, mesh=mesh, reshard_after_forward=True)
    fully_shard(sharded, mesh=mesh, reshard_after_forward=True)
    x = torch.randn(rows, h, generator=gen).to(job.device)

    calls: list[tuple[str, int]] = []
    gather, scatter = dist.all_gather_single, dist.reduce_scatter_single

    def counted_gather(output: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append(("all_gather", output.numel() * output.element_size()))
        return gather(output, *args, **kwargs)

    def counted_scatter(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append(("reduce_scatter", input.numel() * input.element_size()))
        return scatter(output, input, *args, **kwargs)

    with (
        mock.patch.object(dist, "all_gather_single", counted_gather),
        mock.patch.object(dist, "reduce_scatter_single", counted_scatter),
    ):
        _train_call(sharded, x)()  # also FSDP2's lazy initialization, not timed
    extra = _paired_extra(job, _train_call(plain, x), _train_call(sharded, x), section.per_point())
    section.done += 1
    section.finish(
        f"{FSDP_UNITS} units of {sum(p.numel() for p in plain[0].parameters()):,} parameters, "
        f"{len(calls)} collectives, {extra * 1e3:.1f} ms more than unsharded per forward + backward"
    )
    scope = "inter_node" if len(set(job.hosts)) > 1 else "intra_node"
    return FsdpUnitTiming(extra, calls, scope)


def _train_call(model: Any, x: torch.Tensor) -> Callable[[], None]:
    """A forward and backward of `model` on x, its gradients dropped after (as a step's zero_grad)."""

    def call() -> None:
        model(x).sum().backward()
        x.grad = None
        for p in model.parameters():
            p.grad = None

    return call


def _paired_extra(job: Job, baseline: Callable[[], Any], test: Callable[[], Any], seconds: float) -> float:
    """Seconds `test` takes beyond `baseline`: each called once untimed, then alternately (the ranks
    starting each call together, as a step's collectives meet them) until `seconds` have passed, at
    least 3 and at most MAX_REPEATS pairs; the difference of the medians, averaged over the ranks.
    The ranks decide together whether to run another pair (`Job.agree`): their clocks cross the
    deadline at different calls, and a rank that stopped alone would leave its peers' collectives
    in `test` unmatched (4 ranks on 2 cores hung there for 10 minutes until gloo timed out)."""
    baseline()
    test()
    job.sync()
    times: tuple[list[float], list[float]] = ([], [])
    deadline = time.perf_counter() + seconds
    while job.agree(len(times[0]) < 3 or (time.perf_counter() < deadline and len(times[0]) < MAX_REPEATS)):
        for fn, out in zip((baseline, test), times, strict=True):
            job.reduce([0.0])
            t0 = time.perf_counter()
            fn()
            job.sync()
            out.append(time.perf_counter() - t0)
    return job.mean([statistics.median(times[1]) - statistics.median(times[0])])[0]


def unit_overhead_us(profile: Any, timing: FsdpUnitTiming, ranks: int) -> float:
    """The fixed cost of one FSDP unit collective (us) that `plan/speed.py` adds to each: the measured
    extra seconds less the collectives' bytes on the profile's own curves, per collective, at
    least 0 (a measurement noisier than the cost it looks for)."""
    if not timing.calls:
        return 0.0
    moved = sum(profile.collective_seconds(op, timing.scope, ranks, n) for op, n in timing.calls)
    return max(0.0, (timing.extra_seconds - moved) / len(timing.calls)) * 1e6


@dataclass
class TpLayerTiming:
    """The extra seconds of one tensor-parallel layer per micro-batch (forward + backward) over the
    same layer unsharded at its local widths, without and with sequence parallelism, on `ranks`
    ranks, and the collectives' tensor size (bytes of b s h)."""

    extra_seconds: dict[str, float]  # "tp" | "sp" -> seconds per layer
    ranks: int
    tensor_bytes: int
    scope: str = "intra_node"


def tp_group_sizes(job: Job) -> list[int]:
    """The tensor-parallel group sizes a layout can put inside a node: the powers of two from 2 to
    the ranks of a node, and that number itself. Empty when the nodes hold different numbers of
    ranks, ranks are not numbered node by node, or a node holds one rank."""
    nodes = sorted(set(job.hosts), key=job.hosts.index)
    per = job.world // len(nodes)
    if per < 2 or job.hosts != [h for h in nodes for _ in range(per)]:
        return []
    return [*_smaller_group_sizes([per]), per]


def _tp_mesh(job: Job, t: int) -> Any:
    """A 1-D mesh over each block of `t` consecutive ranks (inside a node: `tp_group_sizes`); every
    rank builds every block's group, so the blocks run side by side as a layout's do."""

    if t == job.world:
        return init_device_mesh(job.device.type, (t,))
    return init_device_mesh(job.device.type, (job.world // t, t), mesh_dim_names=("rest", "tp"))["tp"]


class _Pair(torch.nn.Module):
    """Two linears h -> w -> h with GELU between: an attention's qkv/out pair (w = 2 h: 4 h^2
    weights) or an MLP (w = f)."""

    def __init__(self, h: int, w: int) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(h, w), torch.nn.Linear(w, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


class _Layer(torch.nn.Module):
    """A pre-norm layer of the model's widths (its attention core left out: the heads split without
    communication), its linears `t` times narrower when `t` > 1 (a tensor-parallel rank's shapes)."""

    def __init__(self, h: int, f: int, t: int = 1) -> None:
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(h), torch.nn.LayerNorm(h)
        self.attention, self.mlp = _Pair(h, 2 * h // t), _Pair(h, f // t)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def _tp_plan(sp: bool) -> dict[str, Any]:
    """parallel/tensor.py's styles for a layer: column-parallel up, row-parallel down; with SP the
    norms on the sequence shard and the pairs' inputs gathered from it, their outputs scattered."""

    plan: dict[str, Any] = {}
    for pair in ("attention", "mlp"):
        plan[f"{pair}.up"] = ColwiseParallel()
        plan[f"{pair}.down"] = RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel()
        if sp:
            plan[pair] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    if sp:
        plan["norm1"] = plan["norm2"] = SequenceParallel(use_local_output=True)
    return plan


def measure_tp_layer(job: Job, cfg: Config, say=print) -> list[TpLayerTiming]:
    """At each tensor-parallel group size of a node (`tp_group_sizes`, the node's groups of that size
    side by side), time FSDP_UNITS layers (`_Layer`, the FSDP unit point's widths) forward and
    backward under torch's tensor-parallel styles as parallel/tensor.py applies them, without and
    with sequence parallelism, each against the same layers unsharded at one rank's widths,
    alternating. The collectives' bytes as the planner counts them are taken out in
    `tp_layer_overhead_us`; the rest is DTensor's cost per layer, and where processes share cores,
    the wait for a peer to be scheduled at each collective. Empty with one process or ranks that do
    not form per-node groups."""
    if job.world == 1:
        return []
    sizes = tp_group_sizes(job)
    if not sizes:
        say("calibrate: tp_layer: skipped: the nodes do not hold 2 or more ranks each, numbered by node")
        return []
    section = Section(job, "tp_layer", 2 * len(sizes), say)
    out: list[TpLayerTiming] = []
    for t in sizes:
        timing = _tp_layer_timing(job, cfg, t, section)
        if timing is None:
            break
        out.append(timing)
    figures = [
        f"{timing.ranks} ranks " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in timing.extra_seconds.items())
        for timing in out
    ]
    section.finish("per layer beyond its local GEMMs: " + "; ".join(figures))
    return out


def _tp_layer_timing(job: Job, cfg: Config, t: int, section: Section) -> TpLayerTiming | None:
    """The extra seconds per layer at group size `t`, "tp" and "sp" (those the budget allowed; None
    when it allowed neither)."""

    mesh = _tp_mesh(job, t)
    d = model_dims(cfg)
    _, h, f = _unit_dims(cfg)
    h, f = -(-h // t) * t, -(-f // t) * t  # the sharded widths divide evenly
    b, s = d["b"], max(t, d["s"] // t * t)
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    extra: dict[str, float] = {}
    for kind in ("tp", "sp"):
        if not section.go():
            break
        local = torch.nn.Sequential(*[_Layer(h, f, t) for _ in range(FSDP_UNITS)]).to(job.device)
        sharded = torch.nn.Sequential(*[_Layer(h, f) for _ in range(FSDP_UNITS)]).to(job.device)
        for layer in sharded:
            parallelize_module(layer, mesh, _tp_plan(kind == "sp"))
        x = torch.randn(b, s, h, generator=gen).to(job.device).requires_grad_()
        xs = x[:, : s // t].detach().clone().requires_grad_() if kind == "sp" else x
        seconds = _paired_extra(job, _train_call(local, x), _train_call(sharded, xs), section.per_point())
        extra[kind] = seconds / FSDP_UNITS
        section.done += 1
    if not extra:
        return None
    scope = "inter_node" if len(set(job.hosts)) > 1 and t == job.world else "intra_node"
    return TpLayerTiming(extra, t, b * s * h * 4, scope)


def tp_layer_overhead_us(profile: Any, timing: TpLayerTiming) -> dict[str, float]:
    """{"tp_layer_overhead_us", "sp_layer_overhead_us"}: each variant's extra seconds per layer less
    the layer's collectives as plan/speed.py counts them (`tp_layer_collectives`) on the profile's
    curves, at least 0."""

    out = {}
    for kind, extra in timing.extra_seconds.items():
        moved = sum(
            n * profile.collective_seconds(op, timing.scope, timing.ranks, timing.tensor_bytes)
            for op, n in tp_layer_collectives(kind == "sp", full=False)
        )
        out[f"{kind}_layer_overhead_us"] = max(0.0, extra - moved) * 1e6
    return out
