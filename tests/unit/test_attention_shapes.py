"""model.kv_channels (a head size apart from hidden_size / num_attention_heads: Qwen3's head_dim) and
model.qk_norm (q/k norms per head: Qwen3, Megatron --qk-layernorm; or over the whole projection: OLMoE):
the rules name the keys, the torch-free counts equal the built modules, the published presets count
their published parameters, Megatron's arguments carry them. (Logits against transformers:
test_hf_olmoe_qwen3.py; training and export: test_architectures.py; tp: tests/distributed/
test_tensor_parallel.py.)"""

from __future__ import annotations

import pytest
import torch

from scalable_transformer.config.load import load_config
from scalable_transformer.config.megatron_args import translate_megatron_args
from scalable_transformer.config.model_shapes import (
    ModelShape,
    active_params,
    block_params,
    qkv_width,
    total_params,
)
from scalable_transformer.config.schema import ModelConfig
from scalable_transformer.config.validate import resolve
from scalable_transformer.errors import ConfigError
from scalable_transformer.metrics.flops import CONVENTIONS, flops_per_iteration
from scalable_transformer.models import build_model, count_parameters
from scalable_transformer.models.layers import Attention


def tiny(**overrides) -> ModelConfig:
    base = dict(
        type="gpt", num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=96, seq_length=16, max_position_embeddings=16, vocab_size=128,
        position_embedding_type="rotary", norm="rmsnorm", activation="swiglu", add_bias_linear=False,
    )  # fmt: skip
    return ModelConfig(**(base | overrides))


def test_the_head_size_sets_the_projections_and_the_hand_count():
    m = tiny(kv_channels=24)  # q: 4 heads x 24 = 96 features from 64, k and v: 2 groups x 24
    attention = Attention(m, causal=True)
    assert tuple(attention.qkv.weight.shape) == (4 * 24 + 2 * 2 * 24, 64) == (qkv_width(m), 64)
    assert tuple(attention.proj.weight.shape) == (64, 96)
    assert block_params(m).attention == 64 * 192 + 96 * 64
    assert count_parameters(m) == total_params(m)
    x = torch.randn(2, 16, 64)
    assert attention(x, None, None).shape == (2, 16, 64)


@pytest.mark.parametrize("norm", ["rmsnorm", "layernorm"])
@pytest.mark.parametrize(("qk_norm", "per_norm"), [("head", (24, 24)), ("full", (96, 48))])
def test_q_k_norms_have_their_width_and_are_counted(norm, qk_norm, per_norm):
    m = tiny(kv_channels=24, qk_norm=qk_norm, norm=norm)
    attention = Attention(m, causal=True)
    assert (attention.q_norm.weight.numel(), attention.k_norm.weight.numel()) == per_norm
    per = 1 if norm == "rmsnorm" else 2  # LayerNorm: weight and bias
    assert block_params(m).norms == 2 * 64 * per + sum(per_norm) * per
    assert count_parameters(m) == total_params(m)
    for tp in (1, 2):  # the q/k norms are replicated over tp: the planner's per-rank count has them whole
        assert block_params(m, tp).norms == block_params(m).norms


def test_full_q_k_norm_normalises_every_heads_features_together():
    """qk_norm full is one RMSNorm over all of a position's q features (OLMoE), head one per head."""
    torch.manual_seed(0)
    for qk_norm in ("head", "full"):
        attention = Attention(tiny(qk_norm=qk_norm), causal=True)
        q_bnsd, k_bgsd = torch.randn(2, 4, 16, 16) * 3, torch.randn(2, 2, 16, 16) * 3
        q, _ = attention._norm_qk(q_bnsd, k_bgsd)
        rms_per_head = q.pow(2).mean(-1).sqrt()
        rms_per_position = q.transpose(1, 2).flatten(2).pow(2).mean(-1).sqrt()
        if qk_norm == "head":
            torch.testing.assert_close(rms_per_head, torch.ones_like(rms_per_head), atol=1e-4, rtol=0)
        else:
            torch.testing.assert_close(rms_per_position, torch.ones_like(rms_per_position), atol=1e-4, rtol=0)
            assert (rms_per_head - 1).abs().max() > 0.01  # per head it is not normalised


def test_the_rules_name_the_keys_and_what_is_valid():
    with pytest.raises(
        ConfigError, match=r"model.hidden_size \(64\).*model.num_attention_heads \(6\).*kv_channels"
    ):
        resolve(load_config("llama-tiny", ["model.hidden_size=64", "model.num_attention_heads=6"]))
    # with a head size of its own the heads need not divide the hidden size
    six = ["model.hidden_size=64", "model.num_attention_heads=6", "model.num_query_groups=2"]
    cfg = resolve(load_config("llama-tiny", [*six, "model.kv_channels=16"]))
    assert count_parameters(cfg.model) == total_params(cfg.model)
    with pytest.raises(ConfigError, match=r"int\(head dim 5 x model.rotary_percent 1.0\) = 5 must be even"):
        resolve(load_config("llama-tiny", ["model.kv_channels=5"]))
    with pytest.raises(
        ConfigError, match=r"'model.qk_norm' = 'rms' is not valid; choose one of: none, head, full"
    ):
        load_config("llama-tiny", ["model.qk_norm=rms"])
    with pytest.raises(ConfigError, match=r"model.qk_norm = full.*parallel.tp = 2.*none or head"):
        resolve(load_config("llama-tiny", ["model.qk_norm=full", "parallel.tp=2"]), world_size=2)
    resolve(load_config("llama-tiny", ["model.qk_norm=head", "parallel.tp=2"]), world_size=2)


def test_published_presets_count_their_published_parameters():
    # OLMoE paper (arXiv:2409.02060): 6.9B total, 1.3B active; HF allenai/OLMoE-1B-7B-0924 holds 6,919,161,856
    olmoe = resolve(load_config("olmoe-1b-7b")).model
    assert olmoe.qk_norm == "full"
    assert total_params(olmoe) == 6_919_161_856
    assert round(active_params(olmoe) / 1e9, 1) == 1.3
    # Qwen3-30B-A3B model card: 30.5B total, 3.3B active
    qwen = resolve(load_config("qwen3-30b-a3b")).model
    assert (qwen.kv_channels, qwen.qk_norm) == (128, "head")
    assert round(total_params(qwen) / 1e9, 1) == 30.5
    # 3,353,032,704 active: the card's "3.3B" truncates (rounded it would say 3.4B)
    assert 3.3e9 <= active_params(qwen) < 3.4e9


def test_qwen3_30b_a3b_builds_on_the_meta_device_with_the_counted_shapes():
    qwen = resolve(load_config("qwen3-30b-a3b")).model
    with torch.device("meta"):
        model = build_model(qwen)
    assert sum(p.numel() for p in model.parameters()) == total_params(qwen)
    attention = model.layers[0].attention
    assert tuple(attention.qkv.weight.shape) == ((32 + 2 * 4) * 128, 2048)
    assert tuple(attention.proj.weight.shape) == (2048, 32 * 128)
    assert tuple(attention.q_norm.weight.shape) == tuple(attention.k_norm.weight.shape) == (128,)


def test_attention_flops_follow_the_head_size():
    """Doubling d doubles the attention terms every convention but megatron-deepspeed-2022 counts (it
    reads no head size), and changes nothing else."""
    m, wide = tiny(kv_channels=16), tiny(kv_channels=32)
    s, n_l, h = m.seq_length, m.num_layers, m.hidden_size
    for convention in CONVENTIONS:
        a, b = (flops_per_iteration(ModelShape.from_config(x), 1, convention).model_flops for x in (m, wide))
        if convention == "megatron-deepspeed-2022":
            assert a == b
        else:
            assert b > a, convention
    # megatron-lm-2024 by hand: (1 + g/n + s/h) x n d / h of 12 B s L h^2
    lm = [
        flops_per_iteration(ModelShape.from_config(x), 1, "megatron-lm-2024").model_flops for x in (m, wide)
    ]
    assert lm[1] - lm[0] == pytest.approx(
        12 * s * n_l * h * h * (1 + 2 / 4 + s / h) * (128 - 64) / h, rel=1e-12
    )


def test_megatron_kv_channels_and_qk_layernorm_are_carried():
    flags = {"hidden-size": 2048, "num-attention-heads": 32, "kv-channels": 128, "qk-layernorm": True}
    out = translate_megatron_args(flags, "train.sh", None, known=lambda name: True)
    assert out.mapping["kv_channels"] == 128 and out.mapping["qk_norm"] == "head"
    same = translate_megatron_args({**flags, "kv-channels": 64}, "train.sh", None, known=lambda name: True)
    assert "kv_channels" not in same.mapping  # Megatron's default head size: nothing to carry
    assert any(flag == "--kv-channels" for flag, _, _ in same.ignored)
