"""The architectures imported configs name (issue 40): GPT-J/NeoX parallel residual, partial rotary,
q/k/v bias (Qwen2), sliding-window attention (Mistral), ALiBi (BLOOM, MPT, NeoX pos_emb alibi).

The engine against transformers' own classes (random weights, configs written by transformers'
config classes): a Hugging Face model imports with its logits and exports back to them; the rules
refuse the combinations that have no meaning, naming the keys."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from scalable_transformer.checkpoint.export import hf_mapping
from scalable_transformer.checkpoint.hf_import import load_hf_weights, model_overrides_from_hf
from scalable_transformer.config.load import load_config
from scalable_transformer.config.schema import ModelConfig
from scalable_transformer.config.validate import resolve
from scalable_transformer.errors import CheckpointError
from scalable_transformer.models import build_model, count_parameters
from scalable_transformer.models.layers import alibi_slopes, apply_rotary, rotary_for

transformers = pytest.importorskip("transformers")


def tiny(**overrides) -> ModelConfig:
    base = dict(
        type="gpt",
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=48,
        seq_length=16,
        max_position_embeddings=16,
        vocab_size=101,
        make_vocab_size_divisible_by=1,
    )
    return ModelConfig(**(base | overrides))


# ---------------------------------------------------------------- rules


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"rotary_percent": 0.5}, r"model.rotary_percent \(0.5\).*position_embedding_type is learned"),
        # head dim 8 x 0.3 = 2.4 -> 2 channels: fine; x 0.2 = 1.6 -> 1: odd
        ({"position_embedding_type": "rotary", "rotary_percent": 0.2}, r"int\(head dim 8 x .*0.2\) = 1"),
        (
            {"parallel_residual": True, "apply_residual_connection_post_layernorm": True},
            "model.parallel_residual.*apply_residual_connection_post_layernorm",
        ),
        ({"type": "bert", "sliding_window": 4}, "model.sliding_window = 4 is built for causal GPT"),
        ({"type": "bert", "position_embedding_type": "alibi"}, "model.position_embedding_type = alibi"),
    ],
)
def test_meaningless_combinations_are_refused_naming_the_keys(overrides, named):
    with pytest.raises(ValueError, match=named):
        build_model(tiny(**overrides))


@pytest.mark.parametrize(
    "overrides",
    [
        {"add_bias_linear": False, "add_qkv_bias": True},
        {"add_bias_linear": True, "add_qkv_bias": False},
        {"parallel_residual": True, "position_embedding_type": "rotary", "rotary_percent": 0.25},
        {"sliding_window": 3, "position_embedding_type": "alibi"},
        {"add_bias_linear": False, "add_mlp_bias": True},
        {"add_bias_linear": True, "add_mlp_bias": False, "activation": "swiglu"},
    ],
)
def test_parameter_count_is_the_built_models(overrides):
    cfg = tiny(**overrides)
    model = build_model(cfg)
    assert count_parameters(cfg) == sum(p.numel() for p in model.parameters())
    qkv = model.layers[0].attention.qkv
    assert (qkv.bias is not None) == (
        cfg.add_qkv_bias if cfg.add_qkv_bias is not None else cfg.add_bias_linear
    )
    assert (model.layers[0].attention.proj.bias is not None) == cfg.add_bias_linear
    mlp = cfg.add_mlp_bias if cfg.add_mlp_bias is not None else cfg.add_bias_linear
    assert (model.layers[0].mlp.up.bias is not None) == (model.layers[0].mlp.down.bias is not None) == mlp


# ---------------------------------------------------------------- the engine's pieces


def test_partial_rotary_rotates_the_leading_channels_only():
    cfg = tiny(
        position_embedding_type="rotary", rotary_percent=0.25, hidden_size=64
    )  # head dim 16: 4 rotated
    rotary = rotary_for(cfg)
    assert rotary is not None
    cos, sin = rotary(8)
    assert cos.shape == (8, 4)
    x = torch.randn(1, 2, 8, 16)
    y = apply_rotary(x, cos, sin)
    assert torch.equal(y[..., 4:], x[..., 4:])
    assert not torch.allclose(y[..., 1:, :4], x[..., 1:, :4])  # position 0 is not rotated
    # the rotated part is plain RoPE over 4 channels
    full = apply_rotary(x[..., :4], cos, sin)
    assert torch.equal(y[..., :4], full)


def _logits_when_token_changes(cfg: ModelConfig, position: int) -> torch.Tensor:
    """|logits change| at every position when the token at `position` changes."""
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    ids = torch.randint(0, 101, (1, cfg.seq_length), generator=torch.Generator().manual_seed(0))
    other = ids.clone()
    other[0, position] = (ids[0, position] + 1) % 101
    with torch.no_grad():
        return (model(ids) - model(other)).abs().amax(-1)[0]


@pytest.mark.parametrize("window", [1, 3, 16])
def test_sliding_window_sees_window_tokens_itself_included(window):
    cfg = tiny(sliding_window=window, num_layers=1, position_embedding_type="rotary")
    change = _logits_when_token_changes(cfg, 5)
    # one layer: query i sees keys i - window < j <= i, so token 5 reaches positions 5 .. 5 + window - 1
    seen = (change > 0).nonzero().flatten().tolist()
    assert seen == list(range(5, min(5 + window, cfg.seq_length)))


def test_parallel_residual_is_attention_plus_mlp_of_the_same_input():
    cfg = tiny(parallel_residual=True, position_embedding_type="rotary", rotary_percent=0.5)
    block = build_model(cfg).layers[0].eval()
    rotary = rotary_for(cfg)
    assert rotary is not None
    x = torch.randn(2, 16, 32)
    with torch.no_grad():
        want = x + block.attention(block.norm1(x), None, rotary(16)) + block.mlp(block.norm2(x))
        torch.testing.assert_close(block(x, None, rotary(16)), want, rtol=1e-6, atol=1e-6)


def test_alibi_slopes_follow_the_paper_for_any_head_count():
    assert alibi_slopes(8) == [2.0 ** -(i + 1) for i in range(8)]
    # 12 heads: the 8 of 8 heads, then every other one of 16 heads' (2^-0.5, 2^-1.5, ...)
    assert alibi_slopes(12) == [2.0 ** -(i + 1) for i in range(8)] + [2.0 ** -(i + 0.5) for i in range(4)]


def test_alibi_bias_falls_with_distance_by_each_heads_slope():
    cfg = tiny(position_embedding_type="alibi")
    model = build_model(cfg).eval()
    assert model.embedding.position is None and model.rotary is None
    bias = model.layers[0].attention.core.bias(5, torch.device("cpu"), torch.float32)
    assert bias.shape == (4, 5, 5)
    for head, slope in enumerate([2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8]):  # 4 heads: 2^(-8/4 (i + 1))
        torch.testing.assert_close(bias[head, 4, :], slope * torch.tensor([-4.0, -3.0, -2.0, -1.0, 0.0]))
    assert torch.isinf(bias[:, 0, 1:]).all()  # causal


# ---------------------------------------------------------------- Hugging Face, both ways

COMMON = dict(
    vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64
)


def _neox(parallel: bool, rotary_pct: float):
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": rotary_pct}
    return transformers.GPTNeoXForCausalLM(
        transformers.GPTNeoXConfig(
            **COMMON,
            intermediate_size=96,
            use_parallel_residual=parallel,
            rope_parameters=rope,
            tie_word_embeddings=False,
        )
    )


HF_MODELS = {
    "pythia": lambda: _neox(True, 0.25),
    "neox-sequential": lambda: _neox(False, 0.5),
    "mistral-window-8": lambda: transformers.MistralForCausalLM(
        transformers.MistralConfig(**COMMON, intermediate_size=96, num_key_value_heads=2, sliding_window=8)
    ),
    # NeoX's llama2/ configs as NeoX builds them: attention without biases, the MLP with them
    "llama-mlp-bias": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            **COMMON, intermediate_size=96, num_key_value_heads=2, attention_bias=False, mlp_bias=True
        )
    ),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(**COMMON, intermediate_size=96, num_key_value_heads=2)
    ),
    "qwen2-window-8": lambda: transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(
            **COMMON,
            intermediate_size=96,
            num_key_value_heads=2,
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=0,
        )
    ),
}
WANT = {
    "pythia": {"parallel_residual": True, "rotary_percent": 0.25},
    "neox-sequential": {"parallel_residual": False, "rotary_percent": 0.5},
    "mistral-window-8": {"sliding_window": 8, "add_bias_linear": False},
    "llama-mlp-bias": {"add_bias_linear": False, "add_mlp_bias": True},
    "qwen2": {"add_qkv_bias": True, "add_bias_linear": False, "sliding_window": None},
    "qwen2-window-8": {"add_qkv_bias": True, "sliding_window": 8},
}


def random_hf(name: str, path):
    """A transformers model of family `name` with random weights (biases too: transformers starts
    them at zero), saved under path."""
    torch.manual_seed(0)
    hf = HF_MODELS[name]().eval()
    with torch.no_grad():
        for key, param in hf.named_parameters():
            if key.endswith("bias"):
                param.normal_(0.0, 0.1)
    hf.save_pretrained(path)
    return hf


def settings_overrides(settings: dict) -> list[str]:
    return [f"model.{k}={'null' if v is None else v}" for k, v in settings.items()]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(HF_MODELS))
def test_hf_model_imports_with_its_logits_and_exports_back(name, tmp_path):
    hf = random_hf(name, tmp_path / name)
    settings = model_overrides_from_hf(tmp_path / name)
    assert settings.items() >= WANT[name].items()
    cfg = resolve(load_config(None, [*settings_overrides(settings), "model.seq_length=32"])).model
    model = build_model(cfg).eval()
    load_hf_weights(model, cfg, tmp_path / name)
    ids = torch.randint(0, 500, (2, 32), generator=torch.Generator().manual_seed(1))
    exported = hf_mapping(cfg).to_hf(model, cfg)
    assert type(exported).__name__ == type(hf).__name__
    with torch.no_grad():
        want = hf(ids).logits
        ours, back = model(ids), exported(ids).logits
    print(
        f"{name}: max |ours - HF| = {(ours - want).abs().max():.2e}, exported {(back - want).abs().max():.2e}"
    )
    assert ours.shape == want.shape  # the vocabulary as the file has it: 500, not padded
    torch.testing.assert_close(ours, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(back, want, rtol=0, atol=1e-5)


def test_qwen2_with_a_window_on_some_layers_is_refused_naming_it(tmp_path):
    transformers.Qwen2Config(
        **COMMON, intermediate_size=96, use_sliding_window=True, sliding_window=8, max_window_layers=1
    ).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match=r"layer_types = .*max_window_layers = 1 of 2"):
        model_overrides_from_hf(tmp_path)


NO_EQUIVALENT = {
    "olmo2": (
        lambda: transformers.Olmo2Config(**COMMON, intermediate_size=96),
        r"'olmo2'.*post_feed",
    ),
    "bloom": (
        lambda: transformers.BloomConfig(vocab_size=500, hidden_size=64, n_layer=2),
        "word_embeddings_layernorm",
    ),
    "mpt": (lambda: transformers.MptConfig(vocab_size=500, d_model=64, n_layers=2), r"norm_f: bias None"),
}


@pytest.mark.parametrize(("config", "named"), list(NO_EQUIVALENT.values()), ids=list(NO_EQUIVALENT))
def test_families_without_an_equivalent_block_are_refused_naming_the_setting(config, named, tmp_path):
    config().save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match=named):
        model_overrides_from_hf(tmp_path)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"sliding_window": 8}, "model.sliding_window = 8"),
        ({"parallel_residual": True}, "model.parallel_residual = true"),
        ({"position_embedding_type": "alibi"}, "model.position_embedding_type = alibi"),
        ({"add_mlp_bias": False}, "model.add_mlp_bias = false"),  # GPT-2's MLP bias is its other layers'
    ],
)
def test_export_of_a_shape_no_family_holds_names_the_setting(overrides, named):
    from scalable_transformer.models import spec_for

    cfg = tiny(**overrides)
    reasons = [reason for m in spec_for(cfg).hf for reason in m.unsupported(cfg)]
    assert any(named in reason for reason in reasons), reasons
    with pytest.raises(CheckpointError, match=named):
        hf_mapping(cfg)


@pytest.mark.slow
def test_hf_configs_import_with_the_files_vocabulary_and_transformers_parameter_counts(tmp_path):
    """GPT-2 small, BERT-base, Pythia-160M, Mistral-7B and Qwen2's default as transformers' config
    classes write them: our count is the one transformers builds (GPT-2: 124,439,808, Pythia-160M:
    162,322,944, their published sizes), not Megatron's padded vocabulary."""
    from scalable_transformer.cli.config import config_from_hf

    pythia_160m = transformers.GPTNeoXConfig(
        vocab_size=50304, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
        intermediate_size=3072, max_position_embeddings=2048, use_parallel_residual=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        tie_word_embeddings=False,
    )  # fmt: skip
    counts = {}
    for name, config, cls in [
        ("gpt2", transformers.GPT2Config(), transformers.GPT2LMHeadModel),
        ("bert", transformers.BertConfig(), transformers.BertForPreTraining),
        ("pythia-160m", pythia_160m, transformers.GPTNeoXForCausalLM),
        ("mistral-7b", transformers.MistralConfig(), transformers.MistralForCausalLM),  # v0.1's defaults
        ("qwen2", transformers.Qwen2Config(), transformers.Qwen2ForCausalLM),
    ]:
        config.save_pretrained(tmp_path / name)
        model = config_from_hf(tmp_path / name)["model"]
        cfg = resolve(load_config(None, settings_overrides(model))).model
        with torch.device("meta"):
            built = sum(p.numel() for p in cls(config).parameters())
        counts[name] = count_parameters(cfg)
        assert counts[name] == built, name
    assert counts["gpt2"] == 124_439_808
    assert counts["pythia-160m"] == 162_322_944  # EleutherAI's published count (issue 40)


def test_window_and_qkv_bias_settings_export_to_their_family():
    assert hf_mapping(tiny_llama(sliding_window=4)).hf_class == "MistralForCausalLM"
    assert hf_mapping(tiny_llama(add_qkv_bias=True)).hf_class == "Qwen2ForCausalLM"
    assert hf_mapping(tiny_llama()).hf_class == "LlamaForCausalLM"
    neox = tiny(position_embedding_type="rotary", rotary_percent=0.25, parallel_residual=True)
    assert hf_mapping(neox).hf_class == "GPTNeoXForCausalLM"


def tiny_llama(**overrides) -> ModelConfig:
    llama = dict(position_embedding_type="rotary", norm="rmsnorm", activation="swiglu", add_bias_linear=False)
    return dataclasses.replace(tiny(**llama), **overrides)


# ---------------------------------------------------------------- the planner


@pytest.mark.slow
def test_planner_counts_the_parallel_residuals_one_saved_norm_input_as_the_dry_run_measures():
    """Both norms of a parallel-residual block read the block input: one saved tensor instead of the
    sequential block's two (x and x + attention). The planner's per-layer activation bytes drop by what
    the engine, run on fake tensors, saves less."""
    from scalable_transformer.dryrun import dry_run as dry
    from scalable_transformer.plan.memory_model import activation_model, config_layer_bytes

    base = [
        "model.num_layers=4", "model.hidden_size=256", "model.num_attention_heads=4",
        "model.ffn_hidden_size=1024", "model.seq_length=512", "model.max_position_embeddings=512",
        "model.position_embedding_type=rotary", "train.micro_batch_size=4", "train.global_batch_size=4",
    ]  # fmt: skip
    measured, predicted = {}, {}
    for parallel in (False, True):
        cfg = resolve(load_config("tiny-gpt", [*base, f"model.parallel_residual={parallel}"]), 1)
        rank = dry.dry_run(cfg, 1, "cpu").to_dict()["ranks"][0]
        measured[parallel] = rank["memory_breakdown_bytes"]["activations"]
        predicted[parallel] = 4 * config_layer_bytes(cfg, "none", activation_model(cfg, "cpu"))
    saved, foreseen = measured[False] - measured[True], predicted[False] - predicted[True]
    print(f"parallel residual saves {saved / 2**20:.2f} MiB measured, {foreseen / 2**20:.2f} MiB predicted")
    assert saved > 0 and abs(foreseen - saved) <= 0.1 * saved


TRAIN = [
    "model.type=gpt", "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4",
    "model.seq_length=32", "model.position_embedding_type=rotary", "train.micro_batch_size=2",
    "train.global_batch_size=2", "train.train_iters=2", "train.eval_interval=0", "train.eval_iters=1",
    "logging.tensorboard=false",
]  # fmt: skip
LLAMA_BLOCK = ["model.norm=rmsnorm", "model.activation=swiglu", "model.add_bias_linear=false"]
TRAINED = {
    "GPTNeoXForCausalLM": [
        "model.parallel_residual=true", "model.rotary_percent=0.25", "model.tie_word_embeddings=false",
    ],
    "MistralForCausalLM": [*LLAMA_BLOCK, "model.num_query_groups=2", "model.sliding_window=8"],
    "Qwen2ForCausalLM": [*LLAMA_BLOCK, "model.add_qkv_bias=true", "model.sliding_window=8"],
    # a head size of its own (24, not 64 / 4) and per-head q/k norms, trained, then exported
    "Qwen3ForCausalLM": [
        *LLAMA_BLOCK, "model.num_query_groups=2", "model.kv_channels=24", "model.qk_norm=head",
    ],
    "OlmoeForCausalLM": [
        *LLAMA_BLOCK, "model.qk_norm=full", "model.num_experts=4", "model.moe_router_topk=2",
        "model.moe_ffn_hidden_size=32", "model.moe_norm_topk_prob=false", "model.tie_word_embeddings=false",
    ],
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("hf_class", list(TRAINED))
def test_trained_model_exports_to_its_family_with_our_logits(hf_class, tmp_path):
    """`stx export --format hf` of a trained checkpoint, read back by transformers' Auto class from the
    files: config.json carries the setting (partial_rotary_factor, sliding_window, ...)."""
    from scalable_transformer.checkpoint.export import export_hf, load_model
    from scalable_transformer.train.run import run_training

    ckpt = tmp_path / "ckpt"
    overrides = [
        *TRAIN,
        *TRAINED[hf_class],
        f"logging.run_dir={tmp_path / 'runs'}",
        f"checkpoint.save={ckpt}",
    ]
    run_training(load_config(None, overrides))
    out = export_hf(str(ckpt), str(tmp_path / "hf"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == hf_class
    ours, cfg, _ = load_model(str(ckpt))
    ids = torch.randint(0, cfg.vocab_size or 1, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (hf(ids).logits - ours(ids)).abs().max().item()
    print(f"{hf_class}: max |HF - ours| = {diff:.2e}")
    assert diff <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("heads", [4, 6])
def test_alibi_model_has_blooms_logits(heads):
    """ALiBi against an independent implementation: transformers' BloomForCausalLM (the paper's slopes,
    6 heads: not a power of two). BLOOM's block is ours with ALiBi (pre-LN, fused per-head qkv, tanh
    GELU, biases); it also normalizes the word embeddings, a per-token map, so our (untied) embedding
    table holds the normalized rows and our output matrix BLOOM's raw tied one."""
    torch.manual_seed(0)
    bloom_cfg = transformers.BloomConfig(vocab_size=500, hidden_size=96, n_layer=2, n_head=heads)
    bloom = transformers.BloomForCausalLM(bloom_cfg).eval()
    with torch.no_grad():
        for key, param in bloom.named_parameters():
            if key.endswith("bias"):
                param.normal_(0.0, 0.1)
    cfg = tiny(
        vocab_size=500, hidden_size=96, num_attention_heads=heads, ffn_hidden_size=384, seq_length=32,
        max_position_embeddings=32, position_embedding_type="alibi", activation="openai-gelu",
        tie_word_embeddings=False,
    )  # fmt: skip
    model = build_model(cfg).eval()
    t = bloom.transformer
    ours = {
        "embedding.word.weight": t.word_embeddings_layernorm(t.word_embeddings.weight),
        "output.weight": t.word_embeddings.weight,
        "final_norm.weight": t.ln_f.weight,
        "final_norm.bias": t.ln_f.bias,
    }
    names = {
        "norm1": "input_layernorm", "norm2": "post_attention_layernorm",
        "attention.qkv": "self_attention.query_key_value", "attention.proj": "self_attention.dense",
        "mlp.up": "mlp.dense_h_to_4h", "mlp.down": "mlp.dense_4h_to_h",
    }  # fmt: skip
    for i, block in enumerate(t.h):
        for our_name, bloom_name in names.items():
            for kind in ("weight", "bias"):
                ours[f"layers.{i}.{our_name}.{kind}"] = block.get_parameter(f"{bloom_name}.{kind}")
    ids = torch.randint(0, 500, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model.load_state_dict({k: v.detach().clone() for k, v in ours.items()})
        diff = (model(ids) - bloom(ids).logits).abs().max().item()
    print(f"{heads} heads: max |ours - BLOOM| = {diff:.2e}")
    assert diff <= 1e-5
