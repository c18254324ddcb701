"""The mixture-of-experts keys: Megatron/HF/NeoX names, derived sizes, and the rules that refuse
settings no MoE layer could build."""

from __future__ import annotations

import re

import pytest

from scalable_transformer.config.load import ConfigError, load_config
from scalable_transformer.config.model_shapes import moe_layers
from scalable_transformer.config.rules import layout_label
from scalable_transformer.config.validate import resolve


def test_peer_names_set_the_moe_keys_and_the_expert_size_is_derived():
    cfg = resolve(
        load_config(
            "tiny-gpt",
            ["num_local_experts=8", "num_experts_per_tok=2", "moe-layer-freq=2", "router_aux_loss_coef=0.02"],
        )
    )
    m = cfg.model
    assert (m.num_experts, m.moe_router_topk, m.moe_layer_freq, m.moe_aux_loss_coeff) == (8, 2, 2, 0.02)
    assert m.moe_ffn_hidden_size == m.ffn_hidden_size
    assert moe_layers(m) == list(range(0, m.num_layers, 2))


def test_expert_parallel_size_is_part_of_the_layout_label():
    overrides = ["model.num_experts=4", "expert-model-parallel-size=2"]
    cfg = resolve(load_config("tiny-gpt", overrides), world_size=2)
    assert cfg.parallel.ep == 2
    assert "ep=2" in layout_label(cfg)


@pytest.mark.parametrize(
    "overrides",
    [
        ["parallel.tp=2"],
        ["parallel.tp=2", "parallel.sequence_parallel=true"],
        ["parallel.tp=2", "parallel.ep=2"],
        ["parallel.tp=2", "parallel.ep=2", "parallel.zero_stage=3"],
    ],
    ids=["tp2", "tp2-sp", "ep2xtp2", "ep2xtp2-zero3"],
)
def test_mixture_of_experts_resolves_under_tensor_parallelism(overrides):
    """Refused until issue 43's tensor-parallel experts (parallel/expert.py, parallel/tensor.py)."""
    cfg = resolve(load_config("tiny-gpt", ["model.num_experts=4", *overrides]), world_size=4)
    assert (cfg.parallel.tp, cfg.parallel.dp) == (2, 2)


def test_an_all_moe_model_splits_over_tp_whatever_its_unused_dense_mlp_size():
    """Mixtral's derived dense ffn_hidden_size (10922) builds no layer, so it does not limit tp; the
    experts' 14336 does. A model with dense layers keeps the dense rule."""
    cfg = resolve(load_config("mixtral-8x7b", ["parallel.tp=8"]), world_size=8)
    assert cfg.model.ffn_hidden_size % 8 and cfg.model.moe_ffn_hidden_size % 8 == 0
    dense_too = [
        "model.num_experts=4",
        "model.moe_layer_freq=2",
        "model.ffn_hidden_size=330",
        "parallel.tp=4",
    ]
    with pytest.raises(ConfigError, match=re.escape("model.ffn_hidden_size (330) is not divisible")):
        resolve(load_config("tiny-moe", dense_too), world_size=4)


@pytest.mark.parametrize(
    ("overrides", "world", "says"),
    [
        (["parallel.ep=2"], 2, "model.num_experts is 0"),
        (["model.num_experts=3", "parallel.ep=2"], 2, "valid: 1, 3"),
        (["model.num_experts=4", "parallel.ep=4"], 2, "must divide parallel.dp x cp"),
        (["model.num_experts=4", "model.moe_router_topk=5"], 1, "valid: 1..4"),
        (["model.moe_capacity_factor=1.25"], 1, "model.num_experts is 0"),
        (["model.num_experts=4", "model.moe_first_k_dense=8"], 1, "no layer is an MoE layer"),
        (["model.type=bert", "model.num_experts=4"], 1, "GPT models only"),
        # tensor parallelism splits every expert's inner size (the routed ones and the shared one)
        (
            ["model.num_experts=4", "model.moe_ffn_hidden_size=33", "parallel.tp=2"],
            2,
            "moe_ffn_hidden_size (33)",
        ),
        (
            [
                "model.num_experts=4",
                "model.moe_ffn_hidden_size=32",
                "model.moe_shared_expert_size=33",
                "parallel.tp=2",
            ],
            2,
            "moe_shared_expert_size (33) is not divisible by parallel.tp (2)",
        ),
        (
            ["model.num_experts=4", "model.moe_router_load_balancing=sinkhorn", "parallel.cp=2"],
            2,
            "Sinkhorn balances the experts over the tokens a rank routes",
        ),
    ],
)
def test_moe_settings_that_cannot_build_are_refused_by_name(overrides, world, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        resolve(load_config("tiny-gpt", overrides), world_size=world)
