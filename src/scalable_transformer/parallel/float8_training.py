"""FP8 training (train.fp8): the transformer blocks' linear layers as torchao float8 linears.

Applied by `parallelize` first, on the plain (meta-device) model, before tensor parallelism and
FSDP2 see it, as torchtitan does: TP then shards the float8 linears with torchao's float8 styles
(tensorwise) and FSDP2 shards their weights like any other.

What is converted: every nn.Linear inside `layers.<i>` (qkv, proj, mlp.up, mlp.down). Not the
embeddings, not the output/logits projection (it reads the tied word embedding's weight, and its
low-precision error goes straight into the loss), not BERT's lm_head dense or heads: torchtitan and
OLMo-core leave the output layer in high precision too. The parameters stay ordinary fp32 tensors
(the optimizer's master weights), so a float8 run's checkpoint is the same state dict as a bf16 run's
and loads into one (and back).

Recipes (torchao's names):
  tensorwise  one dynamic scale per tensor (inputs, weights e4m3; output gradients e5m2). Under FSDP2
              the weights are all-gathered in float8 (`enable_fsdp_float8_all_gather`): half the bf16
              bytes, and the per-tensor scales for the next step's all-gather are computed in one pass
              after each optimizer step (`refresh_float8_scales`).
  rowwise     one scale per row (more accurate, e4m3 everywhere, on H100 a slower GEMM); torchao
              all-gathers its weights in the high-precision dtype (no float8 all-gather for rowwise),
              and its tensor-parallel styles assume tensorwise, so under tp the plain styles shard the
              float8 linears (each rank scales its local shard).
The config rules (config/rules.py) guarantee bf16 precision and dimensions divisible by 16.
On the CPU, tensorwise with sequence parallelism is refused (`check_float8_layout`: gloo cannot
all-gather the float8 gradients it gathers); everything else composes: FSDP2 (float8 all-gathers
too), TP with and without SP (rowwise), pipelines.
`torch.compile` compiles the converted blocks as any others (parallelize's order).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from ..errors import ConfigError

# torchao is imported only where a float8 model is made or used: importing it takes 0.5 s and, on a
# CPU build, prints two "Failed to load ... .so" lines (its CUDA kernels), in every process of every
# run (python -X importtime, torch 2.13 / torchao 0.18). Until it is imported no module can be a
# Float8Linear, which is how float8_tp_style and float8_all_gathers answer for bf16 models.
_FLOAT8 = "torchao.float8.float8_linear"

FP8_RECIPES = ("tensorwise", "rowwise")


def check_float8_layout(recipe: str, tp: int, sequence_parallel: bool, device: torch.device) -> None:
    """What the device's collectives cannot carry: under tensorwise with sequence parallelism,
    torchao's float8 TP styles cast the row-parallel linears' output gradients to float8 before
    DTensor all-gathers them along the sequence in backward, and gloo (the CPU backend) refuses float8
    tensors ("Invalid scalar type" in torchao's float8 cat after the all-gather; measured on 2 gloo
    ranks, torch 2.13 / torchao 0.18). NCCL carries them. Rowwise (plain TP styles: every collective
    in bf16, the float8 casts local) trains with sequence parallelism on gloo (measured), and FSDP2's
    float8 weight all-gathers work on gloo too: FSDP2 gathers into a byte buffer."""
    if recipe == "tensorwise" and tp > 1 and sequence_parallel and device.type == "cpu":
        raise ConfigError(
            f"train.fp8 = {recipe} with parallel.sequence_parallel on the CPU: sequence parallelism "
            "all-gathers the float8 output gradients of the row-parallel linears in backward, and gloo "
            "cannot all-gather float8 tensors; set parallel.sequence_parallel = false (tensor "
            "parallelism alone works), use train.fp8 = rowwise (its collectives stay bf16) or run on "
            "CUDA (NCCL)"
        )


def float8_linear_config(recipe: str, fsdp: bool) -> Any:
    """torchao's `Float8LinearConfig` of `recipe`; `fsdp`: the weights are sharded by FSDP2
    (ZeRO-2/3), so a tensorwise run all-gathers them in float8."""
    from torchao.float8 import Float8LinearConfig

    if recipe == "tensorwise":
        return Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp)
    if recipe == "rowwise":
        return Float8LinearConfig.from_recipe_name("rowwise")
    raise ValueError(f"train.fp8 = {recipe!r}: valid recipes are none, {', '.join(FP8_RECIPES)}")


def _in_blocks(module: nn.Module, fqn: str) -> bool:
    """The linears of the transformer blocks: `layers.<i>.…` (a pipeline stage keeps those names)."""
    return isinstance(module, nn.Linear) and fqn.startswith("layers.")


def convert_blocks_to_float8(model: nn.Module, recipe: str, fsdp: bool) -> list[str]:
    """Swap the blocks' nn.Linear for torchao's Float8Linear in place (before TP / FSDP are applied);
    returns the converted modules' names. Works on the meta device: weights are moved, not copied."""
    from torchao.float8 import convert_to_float8_training

    convert_to_float8_training(model, module_filter_fn=_in_blocks, config=float8_linear_config(recipe, fsdp))
    return [name for name, m in model.named_modules() if _is_float8(m)]


def _is_float8(module: nn.Module) -> bool:
    """Whether `module` is torchao's Float8Linear (never, while torchao is not imported)."""
    float8 = sys.modules.get(_FLOAT8)
    return float8 is not None and isinstance(module, float8.Float8Linear)


def float8_tp_style(module: nn.Module, style: ParallelStyle) -> ParallelStyle:
    """The tensor-parallel style for `module`: torchao's float8 Colwise/Rowwise styles (inputs cast to
    float8 before the all-gather, output gradients cast in backward) in place of torch's plain ones
    when `module` is a tensorwise float8 linear; `style` unchanged otherwise (rowwise float8 linears
    keep the plain styles, which torchao's float8 styles do not support)."""
    if not _is_float8(module) or not _tensorwise(module):
        return style
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    if type(style) is ColwiseParallel:
        return Float8ColwiseParallel(
            input_layouts=style.input_layouts[0],
            output_layouts=style.output_layouts[0],
            use_local_output=style.use_local_output,
        )
    if type(style) is RowwiseParallel:
        return Float8RowwiseParallel(
            input_layouts=style.input_layouts[0],
            output_layouts=style.output_layouts[0],
            use_local_output=style.use_local_output,
        )
    return style


def _tensorwise(module: Any) -> bool:
    return module.config == float8_linear_config("tensorwise", module.config.enable_fsdp_float8_all_gather)


def float8_all_gathers(model: nn.Module) -> bool:
    """Whether any float8 linear of `model` all-gathers its weight in float8 under FSDP2 (then the
    scales must be refreshed after each optimizer step: `refresh_float8_scales`)."""
    linears: list[Any] = [m for m in model.modules() if _is_float8(m)]
    return any(m.config.enable_fsdp_float8_all_gather for m in linears)


def refresh_float8_scales(model: nn.Module) -> None:
    """After an optimizer step: every float8-all-gathered weight's next scale (amax over its shards),
    for all of them in one all-reduce instead of one per weight at its all-gather (torchtitan's
    `precompute_float8_dynamic_scale_for_fsdp` call)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)
