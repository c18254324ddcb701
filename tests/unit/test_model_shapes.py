"""config/model_shapes.py, the one torch-free shape module, against the modules models/ builds: the
parameters by part, per pipeline stage and per tensor-parallel rank (the DTensor plan of
parallel/tensor.py on torch's fake process group, so one process stands for rank 0 of 2), and the
FLOPs shape built from a config."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from scalable_transformer.config.model_shapes import (
    ModelShape,
    block_params,
    parameter_parts,
    stage_params,
    total_params,
)
from scalable_transformer.config.rules import stage_layer_counts
from scalable_transformer.config.schema import ModelConfig
from scalable_transformer.dryrun.dry_run import fake_process_group
from scalable_transformer.metrics.flops import flops_per_iteration
from scalable_transformer.models import build_model, count_parameters, spec_for
from scalable_transformer.parallel.tensor import apply_tensor_parallel

LLAMA = dict(activation="swiglu", norm="rmsnorm", add_bias_linear=False, position_embedding_type="rotary")
MODELS = {
    "gpt": dict(type="gpt"),
    "llama-gqa": dict(type="gpt", num_query_groups=2, **LLAMA),
    "llama-mqa": dict(type="gpt", num_query_groups=1, **LLAMA),  # tp=2: the qkv is replicated
    "bert": dict(type="bert"),
    "bert-post-ln": dict(type="bert", apply_residual_connection_post_layernorm=True, bert_binary_head=False),
}
CASES = [(name, tied) for name in MODELS for tied in (True, False)]


def tiny(name: str, tied: bool) -> ModelConfig:
    base: dict = dict(
        num_layers=4,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        seq_length=8,
        max_position_embeddings=8,
        vocab_size=100,
        make_vocab_size_divisible_by=8,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tie_word_embeddings=tied,
    )
    base.update(MODELS[name])
    return ModelConfig(**base)


def local_numel(module: torch.nn.Module) -> int:
    """Parameters this rank holds: a DTensor's local shard, a plain tensor whole."""
    return sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in module.parameters())


def first_block(stage: torch.nn.Module) -> torch.nn.Module:
    return next(iter(stage.layers.children()))


def stages(cfg: ModelConfig, pp: int) -> list[torch.nn.Module]:
    """The model cut into pp pipeline stages as the engine cuts it (an even split)."""
    spec, model = spec_for(cfg), build_model(cfg)
    if pp == 1:
        return [model]
    counts = stage_layer_counts(cfg.num_layers, pp, None)
    starts = [sum(counts[:r]) for r in range(pp)]
    return [
        spec.stage(model, range(start, start + n), first=r == 0, last=r == pp - 1)
        for r, (start, n) in enumerate(zip(starts, counts, strict=True))
    ]


@pytest.mark.parametrize(("name", "tied"), CASES)
def test_parts_and_total_equal_the_built_model(name: str, tied: bool) -> None:
    cfg = tiny(name, tied)
    model = build_model(cfg)
    parts = parameter_parts(cfg)
    assert total_params(cfg) == sum(parts.values()) == count_parameters(cfg) == local_numel(model)
    assert parts["layers"] == sum(local_numel(block) for block in model.layers)
    block, counted = model.layers[0], block_params(cfg)
    assert counted.attention == local_numel(block.attention)
    assert counted.mlp == local_numel(block.mlp)
    assert counted.norms == local_numel(block.norm1) + local_numel(block.norm2)
    assert counted.total == local_numel(block)


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize(("name", "tied"), CASES)
def test_stage_params_equal_each_stage_on_one_tp_rank(name: str, tied: bool, pp: int) -> None:
    """stage_params(tp=1) against the pipeline stages' numel, stage_params(tp=2) against rank 0's
    shards of the same stages (a tied last stage holds its own copy of the word embedding)."""
    cfg = tiny(name, tied)
    for r, stage in enumerate(stages(cfg, pp)):
        counted = stage_params(cfg, 1, pp, r)
        assert counted.total == local_numel(stage), f"pp rank {r}, tp=1"
        assert counted.block == local_numel(first_block(stage))
    with fake_process_group(0, 2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        for r, stage in enumerate(stages(cfg, pp)):
            apply_tensor_parallel(stage, mesh["tp"], sequence_parallel=False)
            counted = stage_params(cfg, 2, pp, r)
            block = first_block(stage)
            assert counted.total == local_numel(stage), f"pp rank {r}, tp=2"
            assert counted.block == local_numel(block)
            assert block_params(cfg, 2).attention == local_numel(block.attention)
            assert block_params(cfg, 2).mlp == local_numel(block.mlp)


@pytest.mark.parametrize(("name", "tied"), CASES)
def test_flops_shape_from_the_config(name: str, tied: bool) -> None:
    cfg = tiny(name, tied)
    shape = ModelShape.from_config(cfg, tp=2)
    gated, groups = cfg.activation == "swiglu", cfg.num_query_groups or cfg.num_attention_heads
    assert (shape.num_layers, shape.hidden_size, shape.seq_length, shape.ffn) == (4, 32, 8, 64)
    assert shape.vocab_size == 112  # 100 rounded up to a multiple of 8 * tp
    assert shape.num_params == count_parameters(cfg)
    assert (shape.gated_mlp, shape.kv_heads_ratio) == (gated, groups / 4)
    given = ModelShape.from_config(cfg, num_params=1234)
    assert given.num_params == 1234 and given.vocab_size == 104
    assert flops_per_iteration(given, 2, "6n").model_flops == (6 * 1234 + 12 * 4 * 32 * 8) * 2 * 8
