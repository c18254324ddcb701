"""Parameter counts and FLOPs of mixture-of-experts models (issue 43): total and active parameters
against a hand count and the published Mixtral-8x7B / OLMoE-1B-7B figures; each FLOPs convention
against a hand count of the active experts, and the Megatron-LM and torchtitan conventions against
their sources' own functions (the upstream text at the commits metrics/flops.py names, read from a
snapshot as tests/unit/test_flops_upstream.py does; skipped without one)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import types

import pytest
import torch
from test_flops_upstream import SAMPLES, _file_text, _segment, megatron_args
from torch import nn

from scalable_transformer.config.load import load_config
from scalable_transformer.config.model_shapes import (
    active_params,
    block_params,
    expert_numel,
    moe_layers,
    norm_numel,
    qkv_width,
    stage_params,
    total_params,
    vocab,
)
from scalable_transformer.config.schema import ModelConfig
from scalable_transformer.config.validate import resolve
from scalable_transformer.metrics.flops import CONVENTIONS, ModelShape, flops_per_iteration

# Mixtral-8x7B (mistralai/Mixtral-8x7B-v0.1 config.json): Llama-shaped, 8 experts of 14336, top-2,
# vocabulary 32000, untied. OLMoE-1B-7B (allenai/OLMoE-1B-7B-0924): 16 layers x 2048, 16 heads, 64
# experts of 1024, top-8, vocabulary 50304, untied; its q/k norms (2 x 2048 per layer, 65536 in all:
# 0.001% of N) are not a model option here.
MIXTRAL = ("mixtral-8x7b", [])  # the shipped preset
OLMOE = [
    "model.num_layers=16",
    "model.hidden_size=2048",
    "model.num_attention_heads=16",
    "model.num_query_groups=16",
    "model.ffn_hidden_size=1024",
    "model.num_experts=64",
    "model.moe_router_topk=8",
    "model.vocab_size=50304",
    "model.rope_scaling=false",
    "model.seq_length=4096",
    "model.max_position_embeddings=4096",
]
# small enough to count by hand: 4 layers, every other one MoE after the first dense one
SMALL = [
    "model.num_layers=4",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.ffn_hidden_size=96",
    "model.num_experts=4",
    "model.moe_router_topk=2",
    "model.moe_ffn_hidden_size=32",
    "model.moe_shared_expert_size=48",
    "model.moe_layer_freq=2",
    "model.vocab_size=256",
    "model.seq_length=128",
    "model.max_position_embeddings=128",
    "model.rope_scaling=false",
]


def _model(overrides: list[str] | tuple[str, list[str]]) -> ModelConfig:
    """A Llama-8B variant given by overrides, or (preset, overrides)."""
    preset, rest = overrides if isinstance(overrides, tuple) else ("llama-8b", overrides)
    return resolve(load_config(preset, rest)).model


def test_small_moe_parameters_by_hand():
    m = _model(SMALL)
    assert moe_layers(m) == [0, 2]  # layer % 2 == 0
    h, v = 64, 256
    attention = h * (4 + 2 * 2) * 16 + h * h  # qkv: 4 query heads and 2 x 2 k/v heads of 16; proj
    dense_mlp = h * 2 * 96 + 96 * h  # swiglu up (gate and value) and down, no biases
    expert = h * 2 * 32 + 32 * h
    shared = h * 2 * 48 + 48 * h
    router = h * 4
    norms = 2 * h  # two RMSNorms
    moe_layer = attention + router + shared + 4 * expert + norms
    dense_layer = attention + dense_mlp + norms
    total = 2 * moe_layer + 2 * dense_layer + v * h + v * h + h  # embedding, untied head, final norm
    assert total_params(m) == total
    # a token runs through 2 of the 4 experts in each of the 2 MoE layers
    assert active_params(m) == total - 2 * 2 * expert
    assert expert_numel(m) == expert
    assert block_params(m, moe=True).experts == 4 * expert
    # the pipeline stages hold the layers they are given, MoE or not
    first, second = (stage_params(m, 1, 2, r) for r in (0, 1))
    assert first.moe_layers == second.moe_layers == 1 and first.experts == 4 * expert
    assert first.blocks + second.blocks == 2 * moe_layer + 2 * dense_layer
    assert first.block == moe_layer  # the largest FSDP unit


def test_mixtral_and_olmoe_published_totals_and_active_parameters():
    mixtral, olmoe = _model(MIXTRAL), _model(OLMOE)
    # Mixtral's paper: 46.7B total, 12.9B active (13B in its text; 12.9B on its model card)
    assert round(total_params(mixtral) / 1e9, 1) == 46.7
    assert round(active_params(mixtral) / 1e9, 1) == 12.9
    # OLMoE's paper: 6.9B total, 1.3B active (1.28B without its q/k norms)
    assert round(total_params(olmoe) / 1e9, 1) == 6.9
    assert round(active_params(olmoe) / 1e9, 1) == 1.3


def _hand_mlp_flops_per_token(m: ModelConfig) -> float:
    """Forward + backward FLOPs of the MLPs of every layer for one token: 6 per matrix parameter a
    token runs through (a dense MLP; in an MoE layer the top-k experts and the shared expert)."""
    h, f = m.hidden_size, m.ffn_hidden_size
    assert f is not None and m.moe_ffn_hidden_size is not None
    dense = 3 * h * f
    moe = m.moe_router_topk * 3 * h * m.moe_ffn_hidden_size + 3 * h * m.moe_shared_expert_size
    n_moe = len(moe_layers(m))
    return 6 * ((m.num_layers - n_moe) * dense + n_moe * moe)


def test_every_convention_counts_the_active_experts():
    """Changing only the idle experts' count (num_experts 4 -> 8 at top-2) changes no convention's
    FLOPs but the router's (megatron) and megatron-deepspeed-2022's (none: it sees no experts);
    changing top-k changes every convention but megatron-deepspeed-2022's by the hand count."""
    m = _model(SMALL)
    more_experts = dataclasses.replace(m, num_experts=8)
    top3 = dataclasses.replace(m, moe_router_topk=3)
    s, h = m.seq_length, m.hidden_size
    expert_tokens = 6 * 3 * h * 32 * s  # one more active expert per MoE layer, forward + backward, one sample
    for convention in CONVENTIONS:
        base, wide, deep = (
            flops_per_iteration(ModelShape.from_config(x), 1, convention).model_flops
            for x in (m, more_experts, top3)
        )
        if convention == "megatron-deepspeed-2022":
            assert base == wide == deep
            continue
        # the router: h x E per token, 6 h (8 - 4) more FLOPs per token per MoE layer in the 6N
        # conventions (a parameter each) and in ours; Megatron-LM's formulas count no router
        router = 0 if convention.startswith("megatron-lm") else 6 * h * 4 * 2 * s
        assert wide - base == pytest.approx(router, rel=1e-9), convention
        n_moe = m.num_layers if convention == "megatron-lm-2024" else 2
        assert deep - base == pytest.approx(n_moe * expert_tokens, rel=1e-9), convention


def test_megatron_counts_mlps_as_the_hand_count():
    """Ours (megatron): the MoE model minus the same model with dense MLPs everywhere is the MLP
    difference and the routers, counted by hand."""
    m = _model(SMALL)
    assert m.ffn_hidden_size is not None
    s, h = m.seq_length, m.hidden_size
    ours = flops_per_iteration(ModelShape.from_config(m), 1, "megatron").model_flops
    dense_model = dataclasses.replace(m, num_experts=0, moe_shared_expert_size=0)
    dense = flops_per_iteration(ModelShape.from_config(dense_model), 1, "megatron").model_flops
    hand = (_hand_mlp_flops_per_token(m) - 6 * m.num_layers * 3 * h * m.ffn_hidden_size) * s
    hand += 6 * h * m.num_experts * 2 * s  # the router of the 2 MoE layers
    assert ours - dense == pytest.approx(hand, rel=1e-12)


# -- the sources' own functions -------------------------------------------------------------------------

MOE_SHAPES = {"mixtral-8x7b": MIXTRAL, "small-moe": SMALL}


def _moe_args(m: ModelConfig):
    args = megatron_args(m, SAMPLES)
    pattern = [1 if i in moe_layers(m) else 0 for i in range(m.num_layers)]
    args.num_experts = m.num_experts
    args.moe_router_topk = m.moe_router_topk
    args.moe_ffn_hidden_size = m.moe_ffn_hidden_size
    args.moe_shared_expert_intermediate_size = m.moe_shared_expert_size or None
    args.moe_layer_freq = pattern if sum(pattern) < m.num_layers else 1
    return args


@functools.cache
def _megatron_source(commit: str):
    namespace: dict = {}
    text = _file_text("NVIDIA/Megatron-LM", commit, "megatron/training/training.py")
    exec(compile(_segment(text, "num_floating_point_operations")[0], "training.py", "exec"), namespace)
    if commit.startswith("d98e8a6"):
        helpers = _file_text(
            "NVIDIA/Megatron-LM",
            commit,
            "megatron/core/models/gpt/experimental_attention_variant_module_specs.py",
        )
        for name in (
            "GDN_ATTENTION_VARIANTS",
            "_DEPRECATED_ATTENTION_VARIANT_ALIASES",
            "is_gated_delta_net_variant",
            "is_linear_attention_variant",
        ):
            exec(compile(_segment(helpers, name)[0], "specs.py", "exec"), namespace)
        namespace["is_hybrid_model"] = lambda args: False
    return namespace["num_floating_point_operations"]


@pytest.mark.parametrize("name", list(MOE_SHAPES))
@pytest.mark.parametrize(
    ("convention", "commit"),
    [
        ("megatron-lm", "d98e8a64ddf34856e74b24714e3bedb2f5a39553"),
        ("megatron-lm-2024", "ed7db1d2b3e03378c88d50707b181b485882b030"),
    ],
)
def test_megatron_lm_conventions_equal_their_source_on_moe_models(name, convention, commit):
    m = _model(MOE_SHAPES[name])
    if convention == "megatron-lm-2024" and len(moe_layers(m)) < m.num_layers:
        pytest.skip("the 2024 text has no layer pattern: it counts every layer as MoE (asserted in ours)")
    source = _megatron_source(commit)(_moe_args(m), SAMPLES)
    ours = flops_per_iteration(ModelShape.from_config(m), SAMPLES, convention).model_flops
    assert ours == pytest.approx(source, rel=1e-12)


class _MoEBlock(nn.Module):
    """One block laid out as torchtitan's MoE decoders name it: attention, moe.router,
    moe.routed_experts (3-D), moe.shared_experts, norms."""

    def __init__(self, m: ModelConfig, moe: bool) -> None:
        super().__init__()
        h = m.hidden_size
        f = m.ffn_hidden_size or 4 * h
        self.attention = nn.ModuleDict(
            {"qkv": nn.Linear(h, qkv_width(m), bias=False), "wo": nn.Linear(h, h, bias=False)}
        )
        self.norms = nn.Parameter(torch.empty(2 * norm_numel(m)))
        if moe:
            fe, fs = m.moe_ffn_hidden_size or f, m.moe_shared_expert_size
            self.moe = nn.Module()
            self.moe.router = nn.Linear(h, m.num_experts, bias=False)
            self.moe.routed_experts = nn.ParameterList(
                [torch.empty(m.num_experts, h, 2 * fe), torch.empty(m.num_experts, fe, h)]
            )
            if fs:
                self.moe.shared_experts = nn.ParameterList([torch.empty(h, 2 * fs), torch.empty(fs, h)])
        else:
            self.feed_forward = nn.ParameterList([torch.empty(h, 2 * f), torch.empty(f, h)])


class _MoEDecoder(nn.Module):
    def __init__(self, m: ModelConfig) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab(m), m.hidden_size)
        self.layers = nn.ModuleList(_MoEBlock(m, i in moe_layers(m)) for i in range(m.num_layers))
        self.norm = nn.Parameter(torch.empty(norm_numel(m)))
        self.output = nn.Linear(m.hidden_size, vocab(m), bias=False)


@pytest.mark.parametrize("name", list(MOE_SHAPES))
def test_torchtitan_equals_its_moe_source(name):
    m = _model(MOE_SHAPES[name])
    text = _file_text(
        "pytorch/torchtitan", "b5bcd76c66d0acb1a08b176d9639425bc55e0b2a", "torchtitan/models/utils.py"
    )
    namespace: dict = {"nn": nn, "logger": logging.getLogger("torchtitan"), "Decoder": types.SimpleNamespace}
    exec(compile(_segment(text, "get_moe_model_nparams_and_flops")[0], "utils.py", "exec"), namespace)
    with torch.device("meta"):
        model = _MoEDecoder(m)
    layers = [
        types.SimpleNamespace(
            attention=True,
            moe=types.SimpleNamespace(
                num_experts=m.num_experts, router=types.SimpleNamespace(top_k=m.moe_router_topk)
            )
            if i in moe_layers(m)
            else None,
        )
        for i in range(m.num_layers)
    ]
    config = types.SimpleNamespace(layers=layers, enable_weight_tying=False)
    head_dims = 2 * (m.hidden_size // m.num_attention_heads)
    nparams, per_token = namespace["get_moe_model_nparams_and_flops"](
        config, model, m.num_attention_heads, head_dims, m.seq_length
    )
    assert nparams == total_params(m)
    ours = flops_per_iteration(ModelShape.from_config(m), SAMPLES, "torchtitan").model_flops
    assert ours == pytest.approx(per_token * m.seq_length * SAMPLES, rel=1e-12)


def test_a_given_n_keeps_the_idle_experts_out():
    """`stx flops` passes the counted N, `--params` another: the active N is that N without the idle
    experts, so the 6N conventions count the same active work (issue 43: the calculator first counted
    every expert when it passed the counted N)."""
    m = _model(MIXTRAL)
    counted = ModelShape.from_config(m, total_params(m))
    assert counted.active_n == active_params(m) == ModelShape.from_config(m).active_n
    assert ModelShape.from_config(m, total_params(m) - 1000).active_n == active_params(m) - 1000
    for convention in CONVENTIONS:
        assert flops_per_iteration(counted, 1, convention) == flops_per_iteration(
            ModelShape.from_config(m), 1, convention
        )
