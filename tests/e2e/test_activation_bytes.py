"""Per-layer activation bytes of the real engine, by dry run at gpt-13b shapes (tp 8, seq 2048, bf16),
against Korthikanti et al. 2022 adapted to our attention and dtypes (plan/memory_model.py
`layer_activation_bytes`; with the paper's choices it is the paper's formula, test_plan.py checks
that): flash attention on CUDA, SDPA's math path on CPU with attention dropout (the a s^2 terms)."""

from __future__ import annotations

import pytest

from scalable_transformer.config.load import load_config
from scalable_transformer.config.validate import resolve
from scalable_transformer.dryrun.dry_run import saved_bytes_per_layer
from scalable_transformer.plan.memory_model import (
    activation_model,
    config_layer_bytes,
    kept_input_fraction,
    layer_activation_bytes,
)

pytestmark = pytest.mark.slow

SHAPE = [
    "model.seq_length=2048",
    "train.precision=bf16",
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
]
CASES = {
    "no TP, no recompute": (1, "cuda", []),
    "TP": (8, "cuda", ["parallel.tp=8"]),
    "TP + SP": (8, "cuda", ["parallel.tp=8", "parallel.sequence_parallel=true"]),
    "TP + SP + selective": (
        8,
        "cuda",
        ["parallel.tp=8", "parallel.sequence_parallel=true", "parallel.activation_checkpointing=selective"],
    ),
    "TP + full": (8, "cuda", ["parallel.tp=8", "parallel.activation_checkpointing=full"]),
    "TP + full, distributed": (
        8,
        "cuda",
        [
            "parallel.tp=8",
            "parallel.activation_checkpointing=full",
            "parallel.distribute_saved_activations=true",
        ],
    ),
    "TP, math path (CPU, dropout)": (
        8,
        "cpu",
        ["parallel.tp=8", "model.attention_dropout=0.1", "model.hidden_dropout=0.1"],
    ),
}


def model_bytes(cfg, device: str) -> float:
    m, p = cfg.model, cfg.parallel
    base = layer_activation_bytes(
        cfg.train.micro_batch_size, m.seq_length, m.hidden_size, m.num_attention_heads,
        m.ffn_hidden_size, p.tp, p.sequence_parallel, p.activation_checkpointing,
        activation_model(cfg, device),
    )  # fmt: skip
    return base * kept_input_fraction(cfg, device)  # 1 unless full recompute keeps less of the input


@pytest.mark.parametrize("name", list(CASES))
def test_per_layer_bytes_match_the_adapted_formula(name):
    world, device, overrides = CASES[name]
    cfg = resolve(load_config("gpt-13b", [*SHAPE, *overrides]), world)
    measured = saved_bytes_per_layer(cfg, world, device)
    want = model_bytes(cfg, device)
    assert measured == pytest.approx(want, rel=0.10), (
        f"{name}: {measured / 2**20:.1f} vs {want / 2**20:.1f} MiB"
    )


LLAMA_CASES = {
    "Llama (SwiGLU, RMSNorm, GQA), TP": (8, ["parallel.tp=8"]),
    "Llama, TP + SP": (8, ["parallel.tp=8", "parallel.sequence_parallel=true"]),
}


@pytest.mark.parametrize("name", list(LLAMA_CASES))
def test_llama_layer_bytes_match_the_formula(name):
    """The gated MLP keeps the up projection's output, the activated gate and their product; RMSNorm
    keeps its fp32 input (CUDA's fused kernel); grouped-query attention smaller keys and values."""
    world, overrides = LLAMA_CASES[name]
    cfg = resolve(load_config("llama-8b", [*SHAPE, *overrides]), world)
    measured = saved_bytes_per_layer(cfg, world, "cuda")
    want = config_layer_bytes(cfg, cfg.parallel.activation_checkpointing, activation_model(cfg, "cuda"))
    assert measured == pytest.approx(want, rel=0.05), (
        f"{name}: {measured / 2**20:.1f} vs {want / 2**20:.1f} MiB"
    )


QWEN3_CASES = {  # Qwen3-30B-A3B's attention: 32 heads of 128 on a 2048 hidden, per-head q/k norms
    "head size 128 on 2048, q/k norms per head, TP": (8, ["model.qk_norm=head", "parallel.tp=8"]),
    "q/k norms over all heads (OLMoE), no TP": (1, ["model.qk_norm=full"]),
}


@pytest.mark.parametrize("name", list(QWEN3_CASES))
def test_head_size_and_qk_norm_layer_bytes_match_the_formula(name):
    """model.kv_channels widens q, k, v and the attention output to n d; the q/k norms keep q and k in
    fp32 (input, normalised output, one more on the flash path) and one more copy of q."""
    world, overrides = QWEN3_CASES[name]
    shape = ["model.hidden_size=2048", "model.num_attention_heads=32", "model.kv_channels=128"]
    cfg = resolve(load_config("llama-8b", [*SHAPE, *shape, *overrides]), world)
    measured = saved_bytes_per_layer(cfg, world, "cuda")
    want = config_layer_bytes(cfg, cfg.parallel.activation_checkpointing, activation_model(cfg, "cuda"))
    assert measured == pytest.approx(want, rel=0.05), (
        f"{name}: {measured / 2**20:.1f} vs {want / 2**20:.1f} MiB"
    )
