"""Tensor parallelism in Megatron's layout, with optional sequence parallelism, on DTensor.

Legend: b batch, s sequence, h hidden, v padded vocabulary, t = tensor-parallel size; "local" is
a plain tensor holding this rank's part, DTensor layouts are written Replicate / Shard(d).

The plan (`tensor_parallel_plan`), per module name; "SP only" entries exist only with
sequence_parallel:
  embedding.word             RowwiseParallel: vocab rows Shard(0); ids Replicate in, output Replicate
                             (masked lookup + all-reduce). position/tokentype/norm stay plain (replicated).
  embedding                  SP only: PrepareModuleOutput Replicate -> Shard(1) (a local slice, no
                             communication); the whole module, because positions are added after the lookup.
  layers.<i>.norm1/norm2     SP only: SequenceParallel (weights Replicate, run on the local Shard(1)).
  layers.<i>.attention       SP only: PrepareModuleInput x Shard(1) -> Replicate (all-gather).
  layers.<i>.attention.qkv   ColwiseParallel: weight/bias Shard(0), i.e. whole heads per rank.
  layers.<i>.attention.proj  RowwiseParallel: weight Shard(1); output Replicate (all-reduce), with SP
                             Shard(1) (reduce-scatter).
  layers.<i>.mlp             SP only: PrepareModuleInput x Shard(1) -> Replicate (all-gather).
  layers.<i>.mlp.up          ColwiseParallel (geglu gate/value columns interleave, so pairs stay together).
  layers.<i>.mlp.down        RowwiseParallel like attention.proj.
  final_norm                 SP only: SequenceParallel, then PrepareModuleOutput Shard(1) -> Replicate.
  layers.<last>              SP only, post-LN models (no final_norm) on the model's last stage:
                             PrepareModuleOutput Shard(1) -> Replicate.
  output / lm_head.decoder   ColwiseParallel, for its weight only: Shard(0) like the tied word embedding
                             (the model reads .weight; the module's forward never runs).
  lm_head.bias               distributed as Shard(0) (BERT's per-token output bias [v]).
  logits / lm_head.logits    PrepareModuleInput x -> Replicate DTensor (use_local_output=False), so
                             F.linear with the Shard(0) weight gives logits Shard(-1) [b, s, v/t local],
                             consumed by cross-entropy under `loss_parallel()`.
Everything else (rotary tables, BERT's lm_head dense/norm, pooler, binary_head) stays plain and is
computed redundantly on every tp rank from the replicated stack output.

Between blocks the residual stream is a plain tensor: [b, s, h] replicated without SP, the local
sequence shard [b, s/t, h] with SP (so dropout runs on the shard). Pipeline stage boundaries carry
exactly that: without SP every stage sends and receives replicated [b, s, h]; with SP the first
stage's embedding output and every boundary between stages carry the local [b, s/t, h] shard, and
only the stage holding the model's end gathers back to [b, s, h] (after final_norm, or after its last
block for post-LN models) before the heads, which also lets BERT's pooler read x[:, 0].

Requirements the caller (config validation, parallel/dims.py) guarantees: heads, ffn_hidden_size and
the padded vocabulary divisible by t; with SP, the sequence length divisible by t (DTensor.from_local
assumes even shards). Parameters left plain or Replicate (norms, position embeddings, heads) must be
identical on the tp ranks before this runs (build the model with the same seed everywhere); sharded
ones are scattered from tp rank 0. Dropout runs on plain tensors with the local RNG, so the tp ranks
must share a seed: replicated activations then get the same mask on every rank (as they must); the
head shards (attention dropout) and, with SP, the sequence shards draw the same masks as each other,
a correlation Megatron avoids with a separate tensor-parallel RNG stream.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
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

from ..models.layers import Attention

# Without a model config, a stage holding one of these children is taken to hold the model's end.
_HEAD_NAMES = ("final_norm", "logits", "lm_head", "output", "pooler", "binary_head")


def _child(module: nn.Module, name: str) -> nn.Module | None:
    child = getattr(module, name, None)
    return child if isinstance(child, nn.Module) else None


def _blocks(module: nn.Module) -> list[tuple[str, nn.Module]]:
    layers = _child(module, "layers")
    return [] if layers is None else list(layers.named_children())


def tensor_parallel_plan(module: nn.Module, sequence_parallel: bool) -> list[tuple[str, ParallelStyle]]:
    """(submodule name, style) pairs in application order for the children `module` has (a whole
    model or a pipeline stage). A name may appear twice: final_norm gets two hooks under SP."""
    sp = sequence_parallel
    # With SP, row-parallel outputs are reduce-scattered onto the sequence dim instead of all-reduced.
    stream = Shard(1) if sp else Replicate()
    plan: list[tuple[str, ParallelStyle]] = []
    if _child(module, "embedding") is not None:
        # Replicate out of the lookup: positions/token types are added to the full [b, s, h] after it.
        plan.append(
            ("embedding.word", RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
        )
        if sp:
            plan.append(
                (
                    "embedding",
                    PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1)),
                )
            )
    blocks = _blocks(module)
    for name, _ in blocks:
        prefix = f"layers.{name}"
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
            (f"{prefix}.attention.qkv", ColwiseParallel()),
            (f"{prefix}.attention.proj", RowwiseParallel(output_layouts=stream)),
            (f"{prefix}.mlp.up", ColwiseParallel()),
            (f"{prefix}.mlp.down", RowwiseParallel(output_layouts=stream)),
        ]
    if sp and _child(module, "final_norm") is not None:
        gather = PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate())
        plan += [("final_norm", SequenceParallel()), ("final_norm", gather)]
    elif sp and blocks and _ends_model(module, blocks[-1][0]):
        gather = PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate())
        plan.append((f"layers.{blocks[-1][0]}", gather))
    # The untied output matrices only need their weight sharded like the tied word embedding.
    if _child(module, "output") is not None:
        plan.append(("output", ColwiseParallel()))
    lm_head = _child(module, "lm_head")
    if lm_head is not None and _child(lm_head, "decoder") is not None:
        plan.append(("lm_head.decoder", ColwiseParallel()))
    # x arrives as a plain replicated tensor; weight (and bias, by keyword) are already DTensors.
    to_logits = PrepareModuleInput(
        input_layouts=(Replicate(), None),
        desired_input_layouts=(Replicate(), None),
        input_kwarg_layouts={},
        desired_input_kwarg_layouts={},
        use_local_output=False,
    )
    for name in ("logits", "lm_head.logits"):
        if _has(module, name):
            plan.append((name, to_logits))
    return plan


def _ends_model(module: nn.Module, last_block: str) -> bool:
    """Whether the block named last_block is the model's last: by its global index when the module
    carries the model config (models do; stages built from one keep it), else by the presence of a
    head (embedding-less middle stages have none)."""
    num_layers = getattr(getattr(module, "cfg", None), "num_layers", None)
    if isinstance(num_layers, int) and last_block.isdigit():
        return int(last_block) == num_layers - 1
    return any(_child(module, name) is not None for name in _HEAD_NAMES)


def _has(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


def _rows_cols(module: nn.Module, name: str) -> tuple[int, int]:
    """(out, in) features of the Linear / (rows, dim) of the Embedding at `name`."""
    weight = module.get_submodule(name).weight
    assert isinstance(weight, torch.Tensor)
    return weight.shape[0], weight.shape[1]


def _check_divisible(module: nn.Module, tp: int) -> None:
    sizes: list[tuple[str, int]] = []
    for name, block in _blocks(module):
        attention = block.get_submodule("attention")
        assert isinstance(attention, Attention)
        head_dim = attention.head_dim
        sizes.append(
            (f"layers.{name} attention heads", _rows_cols(block, "attention.qkv")[0] // (3 * head_dim))
        )
        sizes.append((f"layers.{name}.mlp.down input features", _rows_cols(block, "mlp.down")[1]))
    for name in ("embedding.word", "output", "lm_head.decoder"):
        if _has(module, name):
            sizes.append((f"{name} vocabulary rows", _rows_cols(module, name)[0]))
    for name, size in sizes:
        if size % tp:
            raise ValueError(f"tensor parallel over {tp} ranks: {name} = {size} is not divisible by {tp}")


def apply_tensor_parallel(module: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Shard `module` (a BERT/GPT model or a pipeline stage of one) in place over the 1-D `tp_mesh`
    as described in this module's docstring. A mesh of size 1 leaves the module untouched.

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
    for name, style in tensor_parallel_plan(module, sequence_parallel):
        parallelize_module(module, tp_mesh, {name: style})
    lm_head = _child(module, "lm_head")
    if lm_head is not None and isinstance(bias := getattr(lm_head, "bias", None), nn.Parameter):
        # Per-vocabulary-row output bias: sharded like the logits' columns, added locally.
        lm_head.register_parameter(
            "bias", nn.Parameter(distribute_tensor(bias.detach(), tp_mesh, [Shard(0)]), bias.requires_grad)
        )


def loss_parallel_context(tp: int) -> AbstractContextManager[None]:
    """Wrap forward + loss + backward in this: `loss_parallel()` when tp > 1 (cross-entropy on
    vocab-sharded logits without gathering them), else a no-op context."""
    return loss_parallel() if tp > 1 else contextlib.nullcontext()
