"""Every private torch API the dry run uses, in one place (as parallel/torch_compat.py fences the
engine's): each name below with what breaks when torch moves, renames or changes it. The dry run's
modules import these names from here; tests/unit/test_dry_run_torch_internals.py checks that each one
still exists in the installed torch, so an upgrade that moves one fails there with the name and the
feature it breaks, not deep inside a dry run.

Names imported (the import fails loudly at `stx plan --dry-run` if torch moves one):
- `torch._subclasses.fake_tensor.FakeTensorMode`, `FakeTensor`, `unset_fake_temporarily`: the fake
  tensors the whole dry run computes on; `unset_fake_temporarily` builds the device mesh and answers
  host reads with real tensors.
- `torch.distributed._tools.mod_tracker.ModTracker`: the module a peak or a failure happened in.
- `torch.utils._python_dispatch.TorchDispatchMode`: the trace that counts live bytes, collectives and
  host reads (dryrun/dry_run_trace.py); `_disable_current_modes`: the modes set aside while causal
  context-parallel attention makes its `causal_lower_right` bias, a data-less tensor subclass that
  no mode may answer for (dryrun/engine_stubs.py).
- `torch.utils._pytree.tree_leaves`: the tensors among an op's arguments and outputs.
- `torch._guards.detect_fake_mode`: the trace finds the fake mode it runs inside.
- `torch.distributed.tensor._sharding_prop.ShardingPropagator`: its `_propagate_tensor_meta_non_cached`
  is paused while DTensor computes output metadata (no op of ours to count).
- `torch._C._distributed_c10d._create_work_from_future`: the work handle of a collective the trace
  completes itself.
- `torch.distributed.pipelining._utils.InferenceMode`: the pipeline's static-shape vote answered locally.
- `torch.testing._internal.distributed.fake_pg.FakeStore`: the fake process group (None when this
  torch build lacks it: the dry run then says so).

Attributes the dry run reads or replaces (`ATTRIBUTES`; checked by `missing`):
- `torch._C._current_autograd_node`: whether an op runs in backward (the peak's phase).
- `torch._C._ensureCUDADeviceGuardSet`: fake CUDA's device guard on a CPU-only build.
- `torch.ops.aten._scaled_dot_product_flash_attention` / `_scaled_dot_product_efficient_attention`:
  fake CUDA routes attention to the kernel a GPU picks (its saved bytes).
- `torch.cuda.amp.common.amp_definitely_not_available`: fake CUDA keeps autocast on.
- `torch.nn.parallel.distributed._verify_param_shape_across_processes`, `torch.distributed.Reducer.
  _rebuild_buckets`, `torch.distributed.Logger.set_runtime_stats_and_log`: DDP's checks and statistics
  that need real collectives or libtorch_cuda, stubbed.
- `torch.distributed.pipelining.schedules._PipelineSchedule._warmup_p2p` and a stage's `_user_meta`:
  the pipeline's shape vote, answered locally.
- `ShardingPropagator._propagate_tensor_meta_non_cached`: paused, as above.
- `DTensor._local_tensor` (`local_tensor`): the dry run's optimizer steps the local shards of DTensor
  parameters (dryrun/local_step.py), which must be the same tensor objects every step (the optimizer
  state's keys); `to_local()` makes a new view each call. parallel/grads.py reads it too, and
  tests/unit/test_torch_compat.py checks it.

Native symbols (`NATIVE_SYMBOLS`, ctypes into torch's libraries; dryrun/fake_cuda.py): c10's device
guard registry and the CUDAHooksInterface vtable and getter in libtorch_cpu. Without them a GPU
layout's dry run on a CPU-only build ends in C++ at the first backward.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.parallel.distributed as ddp
from torch._C._distributed_c10d import _create_work_from_future  # type: ignore[attr-defined]
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.distributed._tools.mod_tracker import ModTracker
from torch.distributed.pipelining import schedules
from torch.distributed.pipelining._utils import InferenceMode
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves

try:
    from torch.testing._internal.distributed.fake_pg import FakeStore
except ImportError:  # pragma: no cover - depends on the torch build; the dry run reports it
    FakeStore = None  # type: ignore[misc,assignment]

__all__ = [
    "FakeStore",
    "FakeTensor",
    "FakeTensorMode",
    "InferenceMode",
    "ModTracker",
    "ShardingPropagator",
    "TorchDispatchMode",
    "_create_work_from_future",
    "_disable_current_modes",
    "ddp",
    "detect_fake_mode",
    "schedules",
    "tree_leaves",
    "unset_fake_temporarily",
]

# (object, attribute, what breaks without it)
ATTRIBUTES: list[tuple[object, str, str]] = [
    (torch._C, "_current_autograd_node", "the dry run's phase of each op (forward or backward)"),
    (torch._C, "_ensureCUDADeviceGuardSet", "fake CUDA's device guard: GPU dry runs on a CPU-only build"),
    (torch.ops.aten, "_scaled_dot_product_flash_attention", "fake CUDA's flash attention (its saved bytes)"),
    (torch.ops.aten, "_scaled_dot_product_efficient_attention", "fake CUDA's memory-efficient attention"),
    (torch.cuda.amp.common, "amp_definitely_not_available", "autocast on fake CUDA (else fp32 activations)"),
    (ddp, "_verify_param_shape_across_processes", "DDP on the fake process group (stubbed check)"),
    (dist.Reducer, "_rebuild_buckets", "DDP's bucket rebuild on the fake process group (stubbed)"),
    (dist.Logger, "set_runtime_stats_and_log", "DDP's runtime statistics on fake CUDA (stubbed)"),
    (schedules._PipelineSchedule, "_warmup_p2p", "pipelining's shape vote, answered locally"),
    (InferenceMode, "needs_dynamic", "pipelining's shape vote, answered locally"),
    (ShardingPropagator, "_propagate_tensor_meta_non_cached", "DTensor metadata uncounted by the trace"),
]

# (library under torch/lib, symbol, what breaks without it)
NATIVE_SYMBOLS: list[tuple[str, str, str]] = [
    ("libc10.so", "_ZN3c104impl26device_guard_impl_registryE", "fake CUDA's device guard"),
    ("libtorch_cpu.so", "_ZN2at6detail12getCUDAHooksEv", "fake CUDA's hooks (isBuilt, hasPrimaryContext)"),
    ("libtorch_cpu.so", "_ZTVN2at18CUDAHooksInterfaceE", "fake CUDA's hooks vtable"),
]


def local_tensor(dtensor: Any) -> torch.Tensor:
    """A DTensor's local shard, the same object on every call (see the module docstring)."""
    return dtensor._local_tensor


def torch_library(name: str) -> ctypes.CDLL:
    """One of torch's shared libraries (torch/lib/NAME)."""
    return ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", name))


def missing() -> list[str]:
    """Each private API above that this torch lacks, with what breaks: empty when all are there."""
    gone = [
        f"{getattr(obj, '__name__', obj)}.{name}: {why}"
        for obj, name, why in ATTRIBUTES
        if not hasattr(obj, name)
    ]
    for lib, symbol, why in NATIVE_SYMBOLS:
        if torch.cuda.is_available():
            break  # a CUDA build needs no fake CUDA (dryrun/fake_cuda.py)
        try:
            getattr(torch_library(lib), symbol)
        except (OSError, AttributeError):
            gone.append(f"{lib}:{symbol}: {why}")
    if FakeStore is None:
        gone.append("torch.testing._internal.distributed.fake_pg.FakeStore: the dry run's fake process group")
    return gone
