"""Materialize a model that was built and parallelized on the meta device: only this rank's shards.

`build_parallel_model` (train/build.py) builds the model under `torch.device("meta")` (shapes, no
storage), prunes it to this rank's pipeline stages and applies tensor parallelism and FSDP2 /
replicate there, so every parameter is already its final DTensor (or plain tensor) with this rank's
local shape. `materialize` then allocates the local storage (`nn.Module.to_empty`) and fills it.

Values: parameter `name` starts as `models.layers.initial_value(rule, shape, seed, name)`, a full
fp32 tensor drawn from a generator seeded by (seed, name) alone, so every layout (1 process, ZeRO-3,
tp, pp, any mix) starts from bitwise the same weights. The local shard is cut out of that full tensor
with `distribute_tensor(full, mesh, placements, src_data_rank=None)`: with no source rank it slices
locally without communication, and it knows every placement FSDP2 and TP produce (Shard, Replicate
and the `_StridedShard` of FSDP2 over TP). So a rank holds its own shards plus one full parameter at a
time, and the full tensors are produced on the CPU (never a whole model on the device).

Weighed against torch's own routes: `DTensor` random ops (`nn.init.normal_` on a DTensor under the
offset-based RNG tracker) would never build a full parameter, but their values depend on the mesh
(the tracker's offsets follow the shard layout, and FSDP2's flat shard is not one of them), so
layouts would not start identically; `torch.distributed.checkpoint`-style broadcasting from rank 0
needs rank 0 to hold the model. Generating per name and slicing costs each rank the time to draw
the whole model's random numbers, which is cheap next to training.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ..config.schema import ModelConfig
from ..models.layers import init_rules, initial_value, reset_derived_buffers
from .torch_compat import is_persistent_buffer, unset_fake_temporarily

# Name parts that wrappers applied by parallel/apply.py insert into parameter names (activation
# checkpointing, torch.compile); the canonical name is the plain model's (= the checkpoint key).
_WRAPPER_PARTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})


@contextlib.contextmanager
def meta_device() -> Iterator[None]:
    """Build modules here: shapes on the meta device, no storage. A dry run (`stx plan --dry-run`)
    builds inside a FakeTensorMode, which is paused here: a meta tensor has no data to fake, and a
    fake one carries the mode's weakrefs, which stop `to_empty` from swapping it for its storage."""
    with unset_fake_temporarily(), torch.device("meta"):
        yield


def canonical_name(name: str) -> str:
    """A parameter's name in the plain model: wrapper parts removed."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


def is_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of `model` is still on the meta device (has no storage)."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def copy_full_into(param: torch.Tensor, full: torch.Tensor, mask: torch.Tensor | None = None) -> None:
    """Write this rank's part of the full value `full` into `param` (a plain tensor or a DTensor of any
    placement), without communication: every rank must pass the same `full`. With a boolean `mask`
    (shaped like `full`) only the elements it selects are written."""
    with torch.no_grad():
        if isinstance(param, DTensor):
            local = param.to_local()
            mesh, placements = param.device_mesh, param.placements
            shard = distribute_tensor(full.to(local.device), mesh, placements, src_data_rank=None).to_local()
            if mask is None:
                local.copy_(shard)
            else:
                keep = distribute_tensor(mask.to(local.device), mesh, placements, src_data_rank=None)
                local[keep.to_local()] = shard[keep.to_local()]
        elif mask is None:
            param.copy_(full)
        else:
            param[mask] = full[mask].to(param.device)


def fill_parameters(model: nn.Module, value: Callable[[str, torch.Size], torch.Tensor | None]) -> list[str]:
    """For each parameter, `value(canonical name, full shape)` -> its full value (or None: leave it),
    copied into this rank's shard. One full value is alive at a time. Returns the names filled."""
    filled = []
    for name, param in model.named_parameters():
        key = canonical_name(name)
        full = value(key, param.shape)  # a DTensor's .shape is the global shape
        if full is not None:
            copy_full_into(param, full)
            filled.append(key)
        del full
    return filled


_M_TRIM_THRESHOLD = -1  # glibc mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
LARGE_BLOCK_BYTES = 64 * 1024
# The mmap threshold for the training steps: glibc's ceiling for its own dynamic threshold on 64-bit
# (DEFAULT_MMAP_THRESHOLD_MAX, the state a default process settles in) where the steps gather
# nothing; 8 MiB under FSDP2, whose larger per-parameter gradients and gathers must leave the RSS
# when freed (measured below, `step_allocation`).
REPLICA_STEP_BLOCK_BYTES = 32 * 2**20
FSDP_STEP_BLOCK_BYTES = 8 * 2**20


@functools.cache  # find_library runs `ldconfig -p` in a child process: 4 per run_training, 0.07-0.7 s
def _libc() -> Any:
    name = ctypes.util.find_library("c")
    try:
        return None if name is None else ctypes.CDLL(name)
    except OSError:
        return None


def _mallopt(settings: dict[int, int]) -> bool:
    libc = _libc()
    try:
        return libc is not None and all(bool(libc.mallopt(key, value)) for key, value in settings.items())
    except AttributeError:
        return False


def return_large_frees_to_the_os() -> bool:
    """Make glibc serve every block of LARGE_BLOCK_BYTES or more from mmap, so freeing it unmaps it.

    By default glibc raises its mmap threshold up to 32 MB after each free of a mapped block, and then
    serves such blocks from the heap, where freed memory stays resident: materializing one full
    parameter after another, and FSDP2's per-block gathers and gradients, then ratchet the RSS up.
    Measured on gpt-1b ZeRO-3 over 4 CPU ranks: 5.07-5.17 GiB peak per rank by default, 4.47 GiB with
    this, 5.10 GiB with it only during construction (FSDP2's unsharded gradients below 32 MiB then
    fragment the heap in the steps). Its price is a system call and fresh zeroed pages per large
    allocation (benchmarks/mmap_threshold.py), so it holds for construction only: `step_allocation`
    sets the threshold the steps run with. Returns False where there is no glibc (nothing changes)."""
    return _mallopt({_M_MMAP_THRESHOLD: LARGE_BLOCK_BYTES})


def step_allocation(fsdp: bool) -> bool:
    """After construction, the threshold for the steps: blocks under it come from the heap again and
    stay there for the next step. With the construction's 64 KiB kept, every activation, logit and
    gradient buffer of every step was a fresh mapping (a page fault per page, zeroed): 2.5x the system
    time of a 2-process ZeRO-0 run of benchmarks/zero_vs_deepspeed.py (7.8-8.1 s against 3.1-4.5 s per
    run) and 20-30% of its throughput. Where nothing is gathered (ZeRO-0/1, tensor and pipeline
    shards) the threshold is glibc's own ceiling (trim threshold twice that, as glibc sets them):
    gpt-125m ZeRO-0 on 2 CPU ranks peaks at 2,893-2,905 MiB per rank against 2,733-2,734 with 64 KiB.
    Under FSDP2, 8 MiB. Each block at or above the threshold is a fresh mapping, faulted in page by
    page whenever it is written: an activation, a gathered unit or its gradient in every micro-batch.
    At 1 MiB (until 2026-11-26) that made a 2-process ZeRO-3 step of benchmarks/zero_vs_deepspeed.py
    (tiny-gpt, 1 thread per rank) 235 ms against 203 at 8 MiB and 172 at 32 MiB, its GEMMs and
    log-softmax up to 40% slower than the same ops under ZeRO-0 (a profile); peak RSS 441 / 485 / 518
    MiB per rank. On gpt-125m (seq 128, mb 2 x 2, 2 ranks) 8.47 / 8.20 / 7.26 s per step at 2,259 /
    2,451 / 3,535 MiB: above 8 MiB the gathered parameters' gradients stay resident in the heap
    (malloc_trim after every step kept 3,307 MiB: the excess is within the step). Earlier, gpt-125m
    ZeRO-3 (its own shape) peaked at 1,946 MiB with 1 MiB against 1,883 with 64 KiB and 1,986 with
    4 MiB; on 4 ranks at 1,489-1,500 MiB against 1,443-1,444 with 64 KiB.
    Returns False where there is no glibc (nothing changes)."""
    block = FSDP_STEP_BLOCK_BYTES if fsdp else REPLICA_STEP_BLOCK_BYTES
    return _mallopt({_M_MMAP_THRESHOLD: block, _M_TRIM_THRESHOLD: 2 * block})


def end_step_allocation() -> bool:
    """After the steps, in a process that goes on (a test session, a notebook, a sweep in-process):
    construction's threshold again, and the heap's free memory handed back (malloc_trim), so what the
    steps kept for reuse does not stay resident. Returns False where there is no glibc."""
    libc = _libc()
    try:
        return return_large_frees_to_the_os() and libc is not None and libc.malloc_trim(0) >= 0
    except AttributeError:
        return False


def materialize(
    model: nn.Module,
    cfg: ModelConfig,
    device: torch.device,
    seed: int,
    param_device: torch.device | None = None,
) -> nn.Module:
    """Allocate `model`'s local storage and initialise it with the name-seeded Megatron init (see the
    module docstring); recompute the derived buffers. Parameters go to `param_device` (default
    `device`; the host for FSDP2's CPU offload), buffers to `device`. Returns `model`."""
    param_device = param_device or device
    model.to_empty(device=param_device)
    if param_device != device:
        for module in model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                module.register_buffer(
                    name,
                    torch.empty_like(buffer, device=device),
                    persistent=is_persistent_buffer(module, name),
                )
    rules = {canonical_name(name): rule for name, rule in init_rules(model, cfg).items()}
    fill_parameters(model, lambda name, shape: initial_value(rules[name], shape, seed, name))
    reset_derived_buffers(model)
    return model
