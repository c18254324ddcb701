"""Every torch internal the package touches (a private module, function or attribute), named in one
place, with what breaks when torch changes it. Checked with torch 2.13.0 (the version pyproject.toml
pins); tests/unit/test_torch_compat.py checks that each one still exists with the signature used
here and fails with "torch X changed <name>: <what to update>".

Routed through this module (call these functions, never the internal):

  pipeline_p2p_wait_wrapped  torch.distributed.pipelining.schedules._wait_batch_p2p(work), the
                             module-level function every schedule calls to wait on its send/recv
                             batches; there is no public seam. If renamed, or no longer looked up as a
                             module global, parallel/comm.py's pipeline-p2p-wait timer reads 0.
  pipeline_action            torch.distributed.pipelining.schedules._ComputationType[name]: the keys of
                             a multi-stage schedule's public `register_custom_function` (parallel/
                             pipeline.py skips the backward actions of an evaluation schedule).
  PipelineSchedule           torch.distributed.pipelining.schedules._PipelineSchedule, the schedules'
                             common base, for type annotations only.
  checkpoint_wrapped         torch.distributed.algorithms._checkpoint.checkpoint_wrapper
                             .checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                             checkpoint_fn=...), what torchtitan uses too; activation checkpointing
                             (parallel/apply.py) fails to apply without it. Its wrapper puts
                             `_checkpoint_wrapped_module` into parameter names: parallel/init.py's
                             `_WRAPPER_PARTS` and checkpoint/manager.py strip it (with torch.compile's
                             `_orig_mod` and FSDP1's `_fsdp_wrapped_module`).
  flatten_mesh               DeviceMesh._flatten(mesh_dim_name): one dimension over several of a mesh's
                             (hybrid sharding's dp_replicate x dp_shard as "dp", what torchtitan does),
                             reachable from the root mesh by name. Without it parallel/dims.py cannot
                             name the data-parallel group of an HSDP layout (parallel.dp_shard < dp).
  replicate                  torch.distributed._composable.replicate_with_fsdp.replicate(module, *,
                             mesh, mp_policy): ZeRO-0 with tensor parallel (parallel/apply.py).
  all_to_all_autograd        torch.distributed._functional_collectives.all_to_all_single_autograd(input,
                             output_split_sizes, input_split_sizes, group): the token all-to-all of
                             expert parallelism (parallel/expert.py), whose backward is the reverse
                             all-to-all; torch.distributed.nn.functional.all_to_all_single (public)
                             does the same on gloo but warns that it is deprecated in its favour.
  unset_fake_temporarily     torch._subclasses.fake_tensor.unset_fake_temporarily(): building on the
                             meta device inside a dry run's FakeTensorMode (parallel/init.py).
  is_wrapper_tensor / wrapped_tensor
                             torch.utils._python_dispatch.is_traceable_wrapper_subclass(t) and the
                             subclass protocol's t.__tensor_flatten__() (its inner tensors' attribute
                             names): torchao's float8 weight wrapper under FSDP2 and its float8
                             training tensors (train.fp8) hold their storage inside. If they go,
                             metrics/peak_memory.py cannot count a float8 run's weights and
                             parallel/tensor.py's SavedShards would slice a float8 tensor.
  is_persistent_buffer       nn.Module._non_persistent_buffers_set: moving buffers off the parameters'
                             device keeps their persistence (parallel/init.py, CPU offload).
  fsdp_mixed_precision       FSDPModule._get_fsdp_state()._mp_policy: the dtype a pipeline stage sends
                             (parallel/pipeline.py); torch exposes no getter.
  init_optimizer_state       torch.distributed.checkpoint.state_dict._init_optim_state(optim): a fresh
                             optimizer's state tensors (a zero-lr step) so that DCP loads a ZeRO-1
                             shard in place (checkpoint/manager.py).
  profiler_allocation_tag    torch._C._profiler._EventType.Allocation, the tag of an allocation in
                             `profile.profiler.kineto_results.experimental_event_tree()` (itself
                             experimental): metrics/live_tensor_bytes.py's CPU tensor-byte peak.
  sdpa_dispatch              torch._fused_sdp_choice(q, k, v, attn_mask, dropout_p, is_causal): the
                             SDPBackend index scaled_dot_product_attention would dispatch to for
                             those inputs; stx calibrate records it (the kernel `stx plan` times on
                             a GPU). torch exposes no public query. If it goes, profiles record none
                             and the plan times SDPA's flash kernel.
  record_cuda_memory_history / stop_cuda_memory_history / dump_cuda_memory_snapshot
                             torch.cuda.memory._record_memory_history(enabled, max_entries=...) and
                             _dump_snapshot(filename): logging.profile_memory's snapshot
                             (train/callbacks.py). Underscored, though torch's memory docs teach
                             them.

A public seam used with an interface torch does not export: FSDPModule.set_custom_all_gather /
set_custom_reduce_scatter take a `Comm` (allocate(size, *, dtype, device), __call__(output_tensor,
input_tensor, group, [op,] async_op)) that only torch.distributed.fsdp._fully_shard._fsdp_api defines.
parallel/comm.py implements that interface with public collectives (dist.all_gather_single,
dist.reduce_scatter_single: what FSDP2's defaults call) instead of importing it; the test compares
the two signatures.

Used in place and only listed here (the test checks them too):

  parallel/expert.py         nn.Module._parameters (the expert weights swapped for their local shards
                             during the experts' own forward, as torch.func.functional_call does)
  parallel/grads.py          DTensor._local_tensor (a gradient's local shard without a DTensor op),
                             torch._foreach_mul_ (the clip's in-place scale; torch's own clip uses it)
  train/loss_scale.py        torch._amp_foreach_non_finite_check_and_unscale_ (what GradScaler calls)
  launch/local.py            torch.distributed.elastic's LocalElasticAgent subclassed: _monitor_workers,
                             _pcontext, _remaining_restarts, SubprocessContext.subprocess_handlers;
                             torch.distributed.launcher.api.LocalElasticAgent swapped for the launch
  dryrun/dry_run.py, dryrun/dry_run_trace.py (the dry run is built on torch's fake-tensor machinery, so
  this is inherent): torch._subclasses.fake_tensor (FakeTensorMode, FakeTensor,
  unset_fake_temporarily), torch.utils._python_dispatch.TorchDispatchMode, torch.utils._pytree
  .tree_leaves, torch._guards.detect_fake_mode, torch.distributed._tools.mod_tracker.ModTracker,
  torch.testing._internal.distributed.fake_pg.FakeStore (the fake process group),
  torch._C._current_autograd_node, torch._C._distributed_c10d._create_work_from_future,
  torch.distributed.tensor._sharding_prop.ShardingPropagator._propagate_tensor_meta_non_cached
  (patched), torch.distributed.pipelining.schedules._PipelineSchedule._warmup_p2p (patched),
  torch.distributed.pipelining._utils.InferenceMode.needs_dynamic and PipelineStage._user_meta,
  torch.nn.parallel.distributed._verify_param_shape_across_processes, dist.Reducer._rebuild_buckets
  (stubbed), DTensor._local_tensor, OpOverload._opname, ScriptObject._type()
  dryrun/fake_cuda.py          torch._C._ensureCUDADeviceGuardSet, C++ symbols of libc10 / libtorch_cpu by
                             mangled name and CUDAHooksInterface's vtable slots (a CUDA device on a
                             CPU-only build, for GPU dry runs); a moved symbol fails the install with
                             ctypes' error naming it, a changed guard or vtable with its RuntimeError.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

if TYPE_CHECKING:
    from torch.distributed.pipelining.schedules import _PipelineSchedule as PipelineSchedule
else:
    PipelineSchedule = Any  # for annotations only: type checkers see torch's class

__all__ = [
    "PipelineSchedule",
    "all_to_all_autograd",
    "checkpoint_wrapped",
    "dump_cuda_memory_snapshot",
    "fsdp_mixed_precision",
    "init_optimizer_state",
    "is_persistent_buffer",
    "pipeline_action",
    "pipeline_p2p_wait_wrapped",
    "profiler_allocation_tag",
    "record_cuda_memory_history",
    "replicate",
    "stop_cuda_memory_history",
    "unset_fake_temporarily",
]

# ---------------------------------------------------------------- pipelining


@contextlib.contextmanager
def pipeline_p2p_wait_wrapped(wrap: Callable[[Callable[[Any], Any]], Callable[[Any], Any]]) -> Iterator[None]:
    """While the block runs, every pipeline schedule waits on its P2P batches through
    `wrap(original_wait)`; the original is put back after."""
    # at use: a torch that moves it breaks this seam (and its test), not every importer
    from torch.distributed.pipelining import schedules

    original = schedules._wait_batch_p2p
    schedules._wait_batch_p2p = wrap(original)  # type: ignore[assignment]
    try:
        yield
    finally:
        schedules._wait_batch_p2p = original  # type: ignore[assignment]


def pipeline_action(name: str) -> Any:
    """The schedule action called `name` (FORWARD, FULL_BACKWARD, BACKWARD_INPUT, ...)."""
    # at use: a torch that moves it breaks this seam (and its test), not every importer
    from torch.distributed.pipelining.schedules import _ComputationType

    return _ComputationType[name]


# ---------------------------------------------------------------- wrappers


def checkpoint_wrapped(module: nn.Module, checkpoint_fn: Callable[..., Any] | None = None) -> nn.Module:
    """`module` wrapped for non-reentrant activation checkpointing (torch.utils.checkpoint, or
    `checkpoint_fn` in its place)."""
    # at use: a torch that moves it breaks this seam (and its test), not every importer
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )

    impl = CheckpointImpl.NO_REENTRANT
    if checkpoint_fn is None:
        return checkpoint_wrapper(module, checkpoint_impl=impl)
    return checkpoint_wrapper(module, checkpoint_impl=impl, checkpoint_fn=checkpoint_fn)


def flatten_mesh(mesh: Any, name: str) -> Any:
    """`mesh` (a sub-mesh of several dimensions) as one dimension called `name` of its root mesh."""
    return mesh._flatten(name)


def unflatten_mesh(mesh: Any, sizes: tuple[int, ...], names: tuple[str, ...]) -> Any:
    """A 1-D mesh as several dimensions (`sizes`, `names`), its ranks in order: a 2-D mesh over a
    flattened dimension and another, which slicing the root mesh would give only by the deprecated
    slicing of a flattened dimension."""
    return mesh._unflatten(0, sizes, names)


def replicate(module: nn.Module, *, mesh: Any, mp_policy: Any) -> Any:
    """torch's FSDP2-based `replicate` (DDP semantics over DTensor parameters) applied to `module`."""
    # at use: a torch that moves it breaks this seam (and its test), not every importer
    from torch.distributed._composable.replicate_with_fsdp import replicate as fsdp_replicate

    return fsdp_replicate(module, mesh=mesh, mp_policy=mp_policy)


def all_to_all_autograd(
    x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: Any
) -> torch.Tensor:
    """Rows of `x` (input_splits[i] of them to rank i of `group`) exchanged: output_splits[i] rows from
    rank i come back, in rank order; differentiable (its backward sends the gradients back)."""
    # at use: a torch that moves it breaks this seam (and its test), not every importer
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    return all_to_all_single_autograd(x, output_splits, input_splits, group)


def fsdp_mixed_precision(module: Any) -> Any | None:
    """The MixedPrecisionPolicy `fully_shard` gave `module`; None when it is not an FSDP2 module."""
    state_getter = getattr(module, "_get_fsdp_state", None)
    return None if state_getter is None else state_getter()._mp_policy


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create `optimizer`'s state tensors without changing its parameters (a step with zero lr)."""
    # at use: a torch that moves it breaks this seam (and its test), not every importer
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    _init_optim_state(optimizer)


# ---------------------------------------------------------------- fake tensors, modules


def unset_fake_temporarily() -> contextlib.AbstractContextManager[Any]:
    """A context in which no FakeTensorMode is active (the dry run's is paused)."""
    # at use: a torch that moves it breaks this seam (and its test), not every importer
    from torch._subclasses.fake_tensor import unset_fake_temporarily as unset

    return unset()


def is_wrapper_tensor(t: torch.Tensor) -> bool:
    """Whether `t` is a tensor subclass that wraps inner tensors (torchao's float8 tensors)."""
    return bool(is_traceable_wrapper_subclass(t))


def wrapped_tensor(t: torch.Tensor) -> torch.Tensor:
    """The first inner tensor of a wrapper subclass, unwrapped all the way (the one holding the
    storage); `t` itself when it is no wrapper."""
    while is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
        t = getattr(t, names[0])
    return t


def is_persistent_buffer(module: nn.Module, name: str) -> bool:
    """Whether `module`'s own buffer `name` is saved in its state dict."""
    return name not in module._non_persistent_buffers_set


# ---------------------------------------------------------------- profiling


def profiler_allocation_tag() -> Any:
    """The tag of an allocation event in the profiler's experimental event tree."""
    # at use: a torch that moves it breaks this seam (and its test), not every importer
    from torch._C._profiler import _EventType

    return _EventType.Allocation


def record_cuda_memory_history(max_entries: int) -> None:
    """Start recording CUDA allocations with their stacks (the last `max_entries` events)."""
    torch.cuda.memory._record_memory_history(max_entries=max_entries)


def stop_cuda_memory_history() -> None:
    torch.cuda.memory._record_memory_history(enabled=None)


def dump_cuda_memory_snapshot(path: Path) -> None:
    """The recorded history as a pickle that pytorch.org/memory_viz opens."""
    torch.cuda.memory._dump_snapshot(str(path))


def sdpa_dispatch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, is_causal: bool
) -> Any:
    """The torch.nn.attention.SDPBackend scaled_dot_product_attention dispatches to for these inputs,
    or None when torch does not say."""
    # at use: a torch that moves it breaks this seam (and its test), not every importer
    from torch.nn.attention import SDPBackend

    choice = getattr(torch, "_fused_sdp_choice", None)
    if choice is None:
        return None
    try:
        return SDPBackend(int(choice(q, k, v, None, dropout_p, is_causal)))
    except (RuntimeError, ValueError, TypeError):
        return None
