"""The patches a dry run sets on torch while the engine runs on fake tensors: `patched` sets and undoes
them, `engine_stubs` are the engine's own (the dry run's module docstring lists why each is needed).
Every private torch name they reach comes from dryrun/torch_internals.py, where a test checks it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining.stage import PipelineStage
from torch.nn.attention.bias import causal_lower_right

from ..models import layers, moe
from ..parallel import expert
from .torch_internals import InferenceMode, _disable_current_modes, ddp, schedules, unset_fake_temporarily


class _ShapedGroupedMM(torch.autograd.Function):
    """A grouped GEMM's shapes and saved tensors for fake operands (no values to compute)."""

    @staticmethod
    def forward(ctx: Any, x_tk: Any, w_ekn: Any, offsets_e: Any) -> Any:  # type: ignore[override]
        ctx.save_for_backward(x_tk, w_ekn)
        return x_tk.new_empty(x_tk.shape[0], w_ekn.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_tn: Any) -> Any:  # type: ignore[override]
        x_tk, w_ekn = ctx.saved_tensors
        return torch.empty_like(x_tk), torch.empty_like(w_ekn), None


_GROUPED_MM = moe._grouped_mm


def _fp32_grouped_mm(x_tk: Any, w_ekn: Any, offsets_e: Any) -> Any:
    if x_tk.dtype == torch.bfloat16:
        return _GROUPED_MM(x_tk, w_ekn, offsets_e)
    return _ShapedGroupedMM.apply(x_tk, w_ekn, offsets_e)


def _real_lower_right(*size: int) -> Any:
    with _disable_current_modes():
        return causal_lower_right(*size)


def engine_stubs(device_type: str, holder: dict[str, Any]) -> list[tuple[Any, str, Any]]:
    """What the engine does on the host that a fake tensor cannot answer, replaced for the dry run:

    - DeviceMesh.__init__ runs outside the fake mode: a mesh's rank table is real host data, and FSDP2
      over tensor-parallel parameters builds a new mesh inside the fake mode (`DeviceMesh._concatenate`).
    - DDP's `_verify_param_shape_across_processes` compares every rank's parameter shapes through a
      raw pointer (C++); a dry run simulates one rank, so there is nothing to compare.
    - DDP's one-time bucket rebuild before the second forward (buckets re-cut in the order the first
      backward produced gradients) broadcasts an index tensor it fills through a raw pointer: skipped,
      the buckets keep their construction order and the same total size.
    - pipelining's `_warmup_p2p` agrees on static or dynamic stage shapes by multiplying votes over
      send/recv and reading the product on the host: its messages are sent, and the read is answered
      with this rank's vote (every rank builds its stages alike, so the local vote is the product).
    - on CUDA, DDP's runtime statistics need the CUDA timer of libtorch_cuda: skipped (logging only).
    - causal context-parallel attention's `causal_lower_right` bias (models/layers.py) is a tensor
      subclass that holds no data; made inside the dispatch modes (the fake mode, the trace) its empty
      tensor is already theirs and torch refuses it: made outside them, then SDPA dispatches on it
      with fake q, k and v as on a device.
    - expert parallelism reads each MoE layer's row counts on the host to size its all-to-all
      (parallel/expert.py): a fake count has no value, so the read is answered as for balanced
      routing, every expert getting rows / num_experts of each rank's rows (the read and the
      all-to-all of the counts are still recorded). Zero, the trace's default answer, would send no
      row anywhere and leave the layer's output short of its input.
    - so does the loop of one GEMM per expert (models/moe.py `_expert_rows`: fp16, or widths the grouped
      GEMM refuses), which reads each expert's rows to split its input.
    - the experts' grouped GEMM (models/moe.py `_grouped_mm`): torch 2.13's fake kernel takes bf16 only;
      fp32 gets a function with its output, saved tensors and gradients' shapes (`_ShapedGroupedMM`).
    """

    mesh_init = DeviceMesh.__init__

    def real_mesh_init(self: Any, *args: Any, **kwargs: Any) -> None:
        with unset_fake_temporarily():
            mesh_init(self, *args, **kwargs)

    warmup = schedules._PipelineSchedule._warmup_p2p

    def local_vote(self: Any, stages: Any, has_backward: Any, p2p_done: Any) -> Any:

        trace = holder.get("trace")
        if trace is None or not all(isinstance(st, PipelineStage) for st in stages):
            return warmup(self, stages, has_backward, p2p_done)
        static = all(not InferenceMode.needs_dynamic(st._user_meta, has_backward) for st in stages)
        trace.read_value = 1 if static else 0  # the vote's product, as every rank votes alike
        try:
            return warmup(self, stages, has_backward, p2p_done)  # its sends and receives happen
        finally:
            trace.read_value = None

    stubs: list[tuple[Any, str, Any]] = [
        *_moe_stubs(holder),
        (layers, "causal_lower_right", _real_lower_right),
        (DeviceMesh, "__init__", real_mesh_init),
        (ddp, "_verify_param_shape_across_processes", lambda *args, **kwargs: None),
        (dist.Reducer, "_rebuild_buckets", lambda self: False),
        (schedules._PipelineSchedule, "_warmup_p2p", local_vote),
    ]
    if device_type == "cuda":
        stubs.append((dist.Logger, "set_runtime_stats_and_log", lambda self: None))
    return stubs


def _moe_stubs(holder: dict[str, Any]) -> list[tuple[Any, str, Any]]:
    """The mixture-of-experts stubs of `engine_stubs` (its docstring says why each is there)."""
    return [
        (moe, "_grouped_mm", _fp32_grouped_mm),
        (moe, "_expert_rows", _read_as_balanced(holder, moe._expert_rows)),
        (expert, "_exchange_counts", _read_as_balanced(holder, expert._exchange_counts)),
    ]


def _read_as_balanced(holder: dict[str, Any], fn: Any) -> Any:
    """fn(counts, rows, ...), a function that reads an MoE layer's per-expert row counts on the host,
    with that read answered (in a dry run) as balanced routing: rows / experts each."""

    def answered(counts: Any, rows: int, *args: Any) -> Any:
        trace = holder.get("trace")
        if trace is None:
            return fn(counts, rows, *args)
        trace.read_value = _balanced_share(rows, counts.numel())
        try:
            return fn(counts, rows, *args)
        finally:
            trace.read_value = None

    return answered


def _balanced_share(rows: int, experts: int) -> int:
    """Each expert's rows under balanced routing, the dry run's answer to a read of the counts."""
    if rows % experts:
        raise ValueError(
            f"a dry run of a mixture of experts assumes balanced routing: the {rows} rows of a rank "
            f"must split evenly over the {experts} experts"
        )
    return rows // experts


@contextlib.contextmanager
def patched(stubs: list[tuple[Any, str, Any]]) -> Iterator[None]:
    """Each (object, attribute, replacement) set for the block, the original back after it."""
    saved = [(obj, name, obj.__dict__.get(name), name in obj.__dict__) for obj, name, _ in stubs]
    try:
        for obj, name, new in stubs:
            setattr(obj, name, new)
        yield
    finally:
        for obj, name, old, had in reversed(saved):
            if had:
                setattr(obj, name, old)
            else:
                delattr(obj, name)
