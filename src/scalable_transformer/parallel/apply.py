"""parallelize(): apply parallelism to a plain model (or pipeline stage) in one fixed, documented order.

Order (torchtitan's): float8 conversion -> tensor parallel -> expert parallel -> activation
checkpointing -> torch.compile -> FSDP/DDP. The float8 linears (train.fp8) replace the blocks'
nn.Linear before anything shards them; TP must see the (float8 or plain) Linear layers; checkpointing
must wrap whole blocks before compile traces them; FSDP/DDP wrap last so they shard/replicate the
final module structure.

Data parallelism by ZeRO stage, as DeepSpeed users name it:
  0  DistributedDataParallel (gradients all-reduced, everything replicated)
  1  DDP + torch's ZeroRedundancyOptimizer (optimizer state sharded; see `train/optim.py`)
  2  FSDP2 fully_shard per block and root, parameters kept unsharded after forward
  3  FSDP2 fully_shard, parameters resharded after forward (gathered again for backward)
Offload (ZeRO-2/3) is FSDP2's CPUOffloadPolicy. The wrappers average gradients over dp (dp x cp
under context parallelism, whose ranks hold the same parameters: `ParallelDims.grad_mesh`); the
trainer multiplies the loss by that many ranks so the step's gradient is the global token-weighted
mean. Context parallelism itself (parallel/context.py) is set on the model first.

Expert parallelism (parallel.ep > 1, a model with GroupedExperts) shards the routed experts over the
ep ranks (parallel/expert.py) after tensor parallelism and before activation checkpointing (with tp > 1
each expert's inner size is split over tp there too, the weights on the (ep, tp) mesh, or on the tp
mesh alone without ep); the data-
parallel wrapper then treats each experts module as its own unit over the edp ranks (those holding
the same experts), divided by dp x cp: FSDP2 `fully_shard` on the edp mesh for ZeRO-2/3 (torchtitan's
dp_shard_mod_ep), FSDP2-based `replicate` on it for ZeRO-0 (DDP cannot carry the DTensor weights, so
the rest of the model is replicated by `replicate` too, as under tensor parallelism). ZeRO-1 is
refused with it (config.rules.check_expert_parallel).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from ..config.schema import Config
from ..errors import ConfigError
from .comm import CommRecorder, instrument_fsdp, timed_ddp_hook
from .context import apply_context_parallel, context_parallel_for
from .dims import ParallelDims
from .expert import apply_expert_parallel, divide_expert_gradients, expert_modules, expert_shard_placement
from .float8_training import check_float8_layout, convert_blocks_to_float8
from .init import is_meta, materialize
from .recompute import checkpoint_function
from .rng import apply_dropout_streams
from .tensor import apply_tensor_parallel
from .torch_compat import checkpoint_wrapped, replicate

REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def fsdp_param_dtype(cfg: Config) -> torch.dtype | None:
    """The dtype FSDP2 gathers parameters in: the compute dtype of a bf16/fp16 run unless
    parallel.fsdp_param_dtype = fp32; None (the sharded parameters' fp32) otherwise."""
    if cfg.train.precision == "fp32" or cfg.parallel.fsdp_param_dtype == "fp32":
        return None
    return REDUCE_DTYPES[cfg.train.precision]


def blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, block) of the model's transformer blocks, in order; `layers` is an nn.ModuleList (full
    model) or an nn.ModuleDict keyed by the global layer index (pipeline stage)."""
    layers = model.get_submodule("layers")
    if not isinstance(layers, nn.ModuleList | nn.ModuleDict):
        raise TypeError(f"{type(model).__name__}.layers must hold the transformer blocks (ModuleList/Dict)")
    return list(layers.named_children())


def _replace_block(model: nn.Module, name: str, new: nn.Module) -> None:
    model.get_submodule("layers").register_module(name, new)


def apply_activation_checkpointing(
    model: nn.Module, mode: str, num_layers: int, checkpoint_fn: Callable[..., Any] | None = None
) -> None:
    """Recompute activations in backward (non-reentrant checkpointing).

    `full` wraps every block (checkpoint_num_layers = 1) or checkpoints chunks of checkpoint_num_layers
    consecutive blocks (Megatron's uniform method: fewer saved inputs, the chunk recomputed at once);
    `selective` wraps only the attention core of each block (the s^2 part whose activations are
    largest and cheapest to recompute). `checkpoint_fn(fn, x, *args)`: where full recompute keeps each
    region's input (parallel/recompute.py; None: torch's checkpoint, whole on the device).
    """
    if mode == "none":
        return
    wrapper_fn = None if checkpoint_fn is None else partial(_checkpoint_module, checkpoint_fn)
    setattr(model, "recompute_checkpoint", checkpoint_fn)  # noqa: B010 (read by models.layers.run_blocks)
    if mode == "full" and num_layers > 1:
        # Megatron's uniform method: the model runs its blocks in checkpointed chunks
        # (models.layers.run_blocks)
        if not hasattr(model, "recompute_chunk"):
            raise ConfigError(
                f"parallel.checkpoint_num_layers = {num_layers}: {type(model).__name__} does not run "
                "its blocks through models.layers.run_blocks, so chunked recompute is unavailable"
            )
        setattr(model, "recompute_chunk", num_layers)  # noqa: B010 (a plain int attribute)
        return
    for name, block in blocks(model):
        if mode == "full":
            _replace_block(
                model,
                name,
                checkpoint_wrapped(block, checkpoint_fn=wrapper_fn),
            )
        else:
            attention = block.get_submodule("attention")
            attention.core = checkpoint_wrapped(attention.get_submodule("core"))  # type: ignore[assignment]


def _checkpoint_module(
    checkpoint_fn: Callable[..., Any], module: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any
) -> Any:
    """The form `checkpoint_wrapped(checkpoint_fn=...)` calls: the module and its arguments."""
    return checkpoint_fn(module, x, *args, **kwargs)


def apply_compile(model: nn.Module) -> None:
    """Compile each block separately: identical blocks share one compiled graph, cold start stays short."""
    for name, block in blocks(model):
        _replace_block(model, name, torch.compile(block))  # type: ignore[arg-type]


def apply_fsdp(
    model: nn.Module, cfg: Config, dp_mesh: Any, device: torch.device, dims: ParallelDims | None = None
) -> None:
    """ZeRO-2/3: FSDP2 fully_shard on every block, then on the root (embeddings, heads); under expert
    parallelism (`dims.ep` > 1) first on every experts module over the edp ranks."""

    p = cfg.parallel
    offload = p.offload_optimizer or p.offload_param
    # pin_memory needs an accelerator; on a CPU-only host the default (True) raises
    policy = CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else OffloadPolicy()
    # Gathers in the compute dtype (half the bytes under bf16/fp16) while the shards, and so the
    # optimizer's master weights and state, stay fp32. Floating inputs of every FSDP module are cast
    # to it as well: CPU layer_norm rejects an fp32 input with bf16 weights, which autocast leaves be.
    mixed = MixedPrecisionPolicy(
        param_dtype=fsdp_param_dtype(cfg), reduce_dtype=REDUCE_DTYPES[p.grad_reduce_dtype]
    )
    kwargs = {
        "mesh": dp_mesh,
        "reshard_after_forward": p.zero_stage == 3,
        "offload_policy": policy,
        "mp_policy": mixed,
    }
    recorder = CommRecorder()  # measured all-gathers / reduce-scatters (parallel/comm.py)
    shard_ranks = dp_mesh.size(dp_mesh.ndim - 1)  # HSDP shards over its mesh's last dimension
    kwargs["shard_placement_fn"] = expert_shard_placement(model, shard_ranks)
    if dims is not None and dims.ep > 1:
        edp = dims.edp_mesh
        edp_kwargs = {**kwargs, "mesh": edp, "shard_placement_fn": expert_shard_placement(model, edp.size())}
        for experts in expert_modules(model):
            unit = fully_shard(experts, **edp_kwargs)
            divide_expert_gradients(unit, dims.grad_ranks, dims.edp_mesh.size())
            instrument_fsdp(unit, recorder)
    layers = blocks(model)
    # without pipeline stages, the units the backward needs first stay gathered from their forward
    keep_into_backward = p.zero_stage == 3 and p.pp == 1
    for i, (_, block) in enumerate(layers):
        # ZeRO-3, one pipeline stage: the last block's backward comes right after the loss, so its
        # parameters stay gathered from its forward instead of being all-gathered again (torchtitan
        # does the same). One block held through the loss: the peak gains at most one unit, never the
        # model. (A pipeline stage's last block waits for the next stage's backward: resharded.)
        keep = keep_into_backward and i == len(layers) - 1
        block_kwargs = {**kwargs, "reshard_after_forward": False} if keep else kwargs
        instrument_fsdp(fully_shard(block, **block_kwargs), recorder)
    # The root (embeddings, final norm, head) likewise: its backward starts at the logits, right after
    # the loss, so resharding it after the forward only gathers it again a moment later (torch's own
    # default for a root when reshard_after_forward is left unset). On tiny-gpt, whose root is 76% of
    # its parameters, it was 2 of the 10 all-gathers of a 2-micro-batch ZeRO-3 step (profiled).
    root_kwargs = {**kwargs, "reshard_after_forward": False} if keep_into_backward else kwargs
    instrument_fsdp(fully_shard(model, **root_kwargs), recorder)
    setattr(model, "comm_recorder", recorder)  # noqa: B010 (found by parallel.comm.recorders)


def apply_replicate(model: nn.Module, cfg: Config, dp_mesh: Any, dims: ParallelDims | None = None) -> None:
    """ZeRO-0 with tensor or expert parallel: DDP cannot replicate DTensor parameters, so use torch's
    FSDP2-based `replicate` (same all-reduce semantics, composes with DTensor) per block and on the
    root; under expert parallelism first on every experts module over the edp ranks."""

    mixed = MixedPrecisionPolicy(reduce_dtype=REDUCE_DTYPES[cfg.parallel.grad_reduce_dtype])
    if dims is not None and dims.ep > 1:
        for experts in expert_modules(model):
            unit = replicate(experts, mesh=dims.edp_mesh, mp_policy=mixed)
            divide_expert_gradients(unit, dims.grad_ranks, 1)
    for _, block in blocks(model):
        replicate(block, mesh=dp_mesh, mp_policy=mixed)
    replicate(model, mesh=dp_mesh, mp_policy=mixed)


def apply_ddp(model: nn.Module, cfg: Config, dp_group: Any, device: torch.device) -> nn.Module:
    """ZeRO-0/1: DistributedDataParallel over the data-parallel group (grad reduction dtype via comm hook)."""

    ddp = DistributedDataParallel(
        model,
        process_group=dp_group,
        device_ids=[device.index] if device.type == "cuda" else None,
        forward_sync_buffers=False,  # the models' buffers are derived tables, equal on every rank
        # gradients live in the all-reduce buckets instead of beside them: one copy of the gradients
        # (4 bytes/parameter fewer per rank, measured in benchmarks/zero_memory.py) and no bucket copy
        gradient_as_bucket_view=True,
    )
    inner = {
        "bf16": default_hooks.bf16_compress_hook,
        "fp16": default_hooks.fp16_compress_hook,
    }.get(cfg.parallel.grad_reduce_dtype, default_hooks.allreduce_hook)
    # torch's own hook, timed: each bucket's all-reduce from launch to completion (parallel/comm.py)
    recorder = CommRecorder()
    ddp.register_comm_hook((dp_group, recorder), timed_ddp_hook(inner))
    setattr(ddp, "comm_recorder", recorder)  # noqa: B010 (found by parallel.comm.recorders)
    return ddp


def parallelize(
    model: nn.Module, cfg: Config, dims: ParallelDims | None = None, device: torch.device | None = None
) -> nn.Module:
    """Apply the configured parallelism and memory options to `model`, in the order above.

    `dims`: the run's topology; without a mesh (or dims) a plain single-process run. A model built on
    the meta device is materialized here (parallel/init.py): only this rank's shards, name-seeded
    values. Returns the module to train (a DDP wrapper for ZeRO-0/1 with dp > 1; the same module
    otherwise).
    """
    p = cfg.parallel
    device = device or torch.device("cpu")
    mesh = None if dims is None else dims.mesh
    if cfg.train.fp8 != "none":
        check_float8_layout(cfg.train.fp8, p.tp, p.sequence_parallel, device)
        # first: TP must shard the float8 linears (with torchao's styles), FSDP2 their weights
        convert_blocks_to_float8(model, cfg.train.fp8, fsdp=mesh is not None and p.zero_stage >= 2)
    if dims is not None and mesh is not None and dims.cp > 1:
        apply_context_parallel(model, context_parallel_for(dims.cp_group, dims.cp, dims.cp_rank))
    if mesh is not None and p.tp > 1:
        # full recompute saves only block inputs, which SP already shards
        shard_saved = p.activation_checkpointing != "full"
        apply_tensor_parallel(model, mesh["tp"], p.sequence_parallel, shard_saved)
        apply_dropout_streams(model, mesh["tp"].get_local_rank(), p.sequence_parallel, device)
    if dims is not None and mesh is not None and dims.expert_weight_mesh is not None:
        # experts over ep and / or their inner dimension over tp (parallel/expert.py)
        apply_expert_parallel(model, dims.expert_weight_mesh)

    tp_group = mesh["tp"].get_group() if mesh is not None and p.tp > 1 else None
    stash = checkpoint_function(tp_group, p.distribute_saved_activations, p.cpu_checkpointing)
    apply_activation_checkpointing(model, p.activation_checkpointing, p.checkpoint_num_layers, stash)
    if p.compile:
        apply_compile(model)
    if dims is not None and mesh is not None and p.zero_stage >= 2:
        apply_fsdp(model, cfg, dims.fsdp_mesh, device, dims)
    elif dims is not None and mesh is not None and dims.grad_ranks > 1 and (p.tp > 1 or dims.ep > 1):
        apply_replicate(model, cfg, dims.grad_mesh, dims)
    # A meta-device model gets its local shards now: after FSDP2/replicate sharded it, before DDP,
    # which broadcasts real parameters when it is constructed.
    _materialize_if_meta(model, cfg, device)
    replicated = dims is not None and (p.tp > 1 or dims.ep > 1)  # by `replicate` above, not DDP
    if dims is not None and mesh is not None and p.zero_stage < 2 and dims.grad_ranks > 1 and not replicated:
        model = apply_ddp(model, cfg, dims.grad_group, device)
    return model


def _materialize_if_meta(model: nn.Module, cfg: Config, device: torch.device) -> None:

    if is_meta(model):
        p = cfg.parallel
        # FSDP2's CPUOffloadPolicy keeps the sharded parameters on the host and refuses to run
        # (at the first forward) when they were materialized on the GPU: found by `stx plan
        # --dry-run` of an offload layout on a CUDA device; buffers still belong on the device
        offloaded = p.zero_stage >= 2 and (p.offload_optimizer or p.offload_param)
        param_device = torch.device("cpu") if offloaded else device
        materialize(model, cfg.model, device, cfg.train.seed, param_device=param_device)
