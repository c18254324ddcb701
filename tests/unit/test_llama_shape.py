"""The Llama shape as GPT options: grouped-query attention, SwiGLU, no linear biases, Llama 3.1 rotary
scaling, the derived FFN size, and the config errors that guard them."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from scalable_transformer.config.load import load_config
from scalable_transformer.config.model_shapes import block_numel as shapes_block_numel
from scalable_transformer.config.model_shapes import default_ffn_hidden_size
from scalable_transformer.config.schema import ModelConfig
from scalable_transformer.config.validate import resolve
from scalable_transformer.errors import ConfigError
from scalable_transformer.models import build_model, count_parameters
from scalable_transformer.models.layers import MLP, Attention, RotaryEmbedding, llama3_scaled


def tiny(**overrides) -> ModelConfig:
    base = dict(
        type="gpt",
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=40,
        seq_length=8,
        max_position_embeddings=12,
        vocab_size=101,
        make_vocab_size_divisible_by=64,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    base.update(overrides)
    return ModelConfig(**base)


def numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


GRID = list(
    itertools.product(
        ("bert", "gpt"), (None, 1, 2, 4), ("gelu", "geglu", "swiglu"), (True, False), (True, False)
    )
)


@pytest.mark.parametrize(("model_type", "groups", "activation", "bias", "tied"), GRID)
def test_parameter_count_is_exact(model_type, groups, activation, bias, tied):
    cfg = tiny(
        type=model_type, num_query_groups=groups, activation=activation, add_bias_linear=bias,
        tie_word_embeddings=tied,
    )  # fmt: skip
    model = build_model(cfg)
    assert count_parameters(cfg) == numel(model)
    assert shapes_block_numel(cfg) == numel(model.layers[0])


def test_gqa_block_shapes_and_no_biases():
    cfg = tiny(num_query_groups=2, activation="swiglu", add_bias_linear=False, norm="rmsnorm")
    block = build_model(cfg).layers[0]
    d = 32 // 4
    assert block.attention.qkv.weight.shape == ((4 + 2 * 2) * d, 32)
    assert block.mlp.up.weight.shape == (80, 32)
    names = [n for n, _ in block.named_parameters()]
    assert not [n for n in names if n.endswith("bias")], names


def _reference_attention(attention: Attention, x_bsh: torch.Tensor, n: int, g: int) -> torch.Tensor:
    """Causal attention written out: q heads 0..n-1, group j serving heads j*r..(j+1)*r-1."""
    b, s, h = x_bsh.shape
    d, r = h // n, n // g
    w = attention.qkv.weight.view(g, (r + 2) * d, h)
    wq = w[:, : r * d].reshape(n * d, h)
    wk, wv = w[:, r * d : (r + 1) * d].reshape(g * d, h), w[:, (r + 1) * d :].reshape(g * d, h)
    q = (x_bsh @ wq.T).view(b, s, n, d).transpose(1, 2)
    k = (x_bsh @ wk.T).view(b, s, g, d).transpose(1, 2).repeat_interleave(r, dim=1)
    v = (x_bsh @ wv.T).view(b, s, g, d).transpose(1, 2).repeat_interleave(r, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, h)
    return out @ attention.proj.weight.T


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_grouped_query_attention_matches_the_written_out_formula(groups):
    torch.manual_seed(0)
    cfg = tiny(num_query_groups=groups, add_bias_linear=False)
    attention = Attention(cfg, causal=True)
    x_bsh = torch.randn(2, 8, 32)
    expected = _reference_attention(attention, x_bsh, 4, groups)
    torch.testing.assert_close(attention(x_bsh, None, None), expected, atol=1e-5, rtol=1e-5)


def test_groups_equal_to_heads_is_plain_multi_head_attention():
    torch.manual_seed(0)
    plain, grouped = build_model(tiny()), build_model(tiny(num_query_groups=4))
    grouped.load_state_dict(plain.state_dict())
    ids = torch.randint(0, 101, (2, 8))
    assert torch.equal(plain(ids), grouped(ids))


def test_swiglu_is_silu_gate_times_value():
    torch.manual_seed(0)
    mlp = MLP(tiny(activation="swiglu"))
    x = torch.randn(2, 3, 32)
    y = x @ mlp.up.weight.T + mlp.up.bias
    gate, value = y[..., 0::2], y[..., 1::2]
    expected = (F.silu(gate) * value) @ mlp.down.weight.T + mlp.down.bias
    torch.testing.assert_close(mlp(x), expected)


def test_llama3_rotary_scaling_matches_transformers():
    rope_init = pytest.importorskip("transformers.modeling_rope_utils")
    from transformers import LlamaConfig

    hf = LlamaConfig(
        hidden_size=512, num_attention_heads=4, rope_theta=500000.0, max_position_embeddings=131072,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
    )  # fmt: skip
    expected, _ = rope_init.ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    base = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128))
    ours = llama3_scaled(base, 8.0)
    torch.testing.assert_close(ours, expected.float())
    assert not torch.equal(ours, base)  # the scaling changed the long wavelengths
    rotary = RotaryEmbedding(128, 500000.0, 16, llama3_factor=8.0)
    cos, _ = rotary(16)
    torch.testing.assert_close(cos[5, :64], torch.cos(5 * expected.float()))


def test_derived_ffn_size_follows_llama():
    # Llama 2 7B: hidden 4096, multiple_of 256 -> 11008
    llama2_7b = ["model.hidden_size=4096", "model.num_attention_heads=32", "model.ffn_multiple_of=256"]
    cfg = resolve(load_config(None, ["model.type=gpt", "model.activation=swiglu", *llama2_7b]))
    assert cfg.model.ffn_hidden_size == 11008
    assert (
        default_ffn_hidden_size(dataclasses.replace(cfg.model, activation="gelu", ffn_multiple_of=1)) == 16384
    )
    assert cfg.model.num_query_groups == 32  # defaults to the heads


@pytest.mark.parametrize(
    ("overrides", "keys"),
    [
        (
            ["model.num_attention_heads=4", "model.num_query_groups=3"],
            ("num_attention_heads", "num_query_groups"),
        ),
        (
            [
                "model.hidden_size=48",
                "model.num_attention_heads=6",
                "model.num_query_groups=3",
                "parallel.tp=2",
            ],
            ("num_query_groups", "tp"),
        ),
        (
            ["model.num_attention_heads=4", "model.num_query_groups=2", "parallel.tp=8"],
            ("num_attention_heads", "tp"),
        ),
        (["model.rope_scaling=true"], ("rope_scaling", "position_embedding_type")),
    ],
)
def test_bad_group_settings_name_both_keys(overrides, keys):
    cfg = load_config(None, ["model.type=gpt", "model.hidden_size=32", *overrides])
    with pytest.raises(ConfigError) as err:
        resolve(cfg, world_size=cfg.parallel.tp)
    for key in keys:
        assert key in str(err.value)


@pytest.mark.parametrize(("groups", "tp"), [(1, 2), (1, 4), (2, 4), (2, 2), (4, 2)])
def test_tp_dividing_or_multiple_of_the_groups_is_valid(groups, tp):
    cfg = load_config(
        None, ["model.type=gpt", "model.num_attention_heads=4", f"model.num_query_groups={groups}"]
    )
    cfg = resolve(dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, tp=tp)), world_size=tp)
    assert cfg.parallel.tp == tp


def test_neox_and_hf_names_set_the_groups():
    cfg = load_config(
        None, ["model.type=gpt", "num_key_value_heads=1", "swiglu=true", "disable_bias_linear=true"]
    )
    assert (cfg.model.num_query_groups, cfg.model.activation, cfg.model.add_bias_linear) == (
        1,
        "swiglu",
        False,
    )


# ---------------------------------------------------------------- FLOPs and the planner


@pytest.mark.parametrize(
    "overrides",
    [
        ["model.num_query_groups=2", "model.activation=swiglu", "model.add_bias_linear=false"],
        ["model.num_query_groups=1", "model.activation=gelu"],
        ["model.activation=geglu"],
    ],
)
def test_megatron_dense_term_is_six_flops_per_block_matrix_parameter(overrides):
    from scalable_transformer.metrics.flops import ModelShape, flops_per_iteration

    cfg = resolve(
        load_config(
            None, ["model.type=gpt", "model.hidden_size=64", "model.num_attention_heads=4", *overrides]
        )
    )
    m = cfg.model
    model = build_model(m)
    shape = ModelShape.from_config(m, count_parameters(m))
    s, h, L, v = m.seq_length, m.hidden_size, m.num_layers, shape.vocab_size
    matrices = sum(p.numel() for p in model.layers.parameters() if p.dim() == 2)
    per_sample = flops_per_iteration(shape, 1, "megatron").model_flops
    # the convention's attention core (12 s^2 L h, not halved for causal) and logit layer (4.5 s h V)
    assert per_sample - 12 * s * s * L * h - 4.5 * s * h * v == pytest.approx(6 * matrices * s, rel=1e-12)


def test_llama_8b_flops_at_seq_8192_by_hand():
    from scalable_transformer.metrics.flops import ModelShape, flops_per_iteration

    m = resolve(load_config("llama-8b", ["model.seq_length=8192"])).model
    n = count_parameters(m)
    assert n == 8_030_261_248  # Meta's published count for Llama 3.1 8B
    h, L, F, s, V = 4096, 32, 14336, 8192, 128256
    block = h * h + 2 * h * (8 * 128) + h * h + 3 * h * F  # q, k and v of 8 groups, o, SwiGLU's three
    assert block == 218_103_808
    shape = ModelShape.from_config(m, n)
    by_hand = {
        "megatron": 6 * L * block * s + 12 * s * s * L * h + 4.5 * s * h * V,
        "6n": (6 * n + 12 * L * h * s) * s,
        "mosaic": 3 * 2 * n * s + 2 * L * 2 * h * s * s,
    }
    for convention, flops in by_hand.items():
        assert flops_per_iteration(shape, 1, convention).model_flops == pytest.approx(flops, rel=1e-12)
    assert by_hand["megatron"] == pytest.approx(467_966.75e9, rel=1e-8)


def test_planner_searches_llama_8b_on_8_h100():
    from scalable_transformer.plan.cluster import table_cluster
    from scalable_transformer.plan.search import search_layouts

    results = search_layouts(load_config("llama-8b"), table_cluster("h100-80gb", 1, 8))
    fits = [r for r in results if r.fits]
    assert fits and len(fits) < len(results)
    assert {r.layout.tp for r in fits} >= {1, 2}
