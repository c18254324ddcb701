"""Hugging Face OLMoE, Qwen3-MoE and Qwen3: q/k norms (model.qk_norm: full for OLMoE, head for Qwen3) and
a head size of its own (model.kv_channels, Qwen3's head_dim). A random transformers model imports with
its logits and exports back (transformers -> stx -> transformers); what has no equivalent is refused by
name."""

from __future__ import annotations

import pytest
import torch

from scalable_transformer.checkpoint.hf_import import load_hf_weights, model_overrides_from_hf
from scalable_transformer.config.load import load_config
from scalable_transformer.config.validate import resolve
from scalable_transformer.errors import CheckpointError
from scalable_transformer.models import build_model
from scalable_transformer.models.gpt import hf as gpt_hf
from scalable_transformer.models.registry import hf_mapping_for_type, hf_unsupported

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

TRAIN = ["model.seq_length=32", "train.micro_batch_size=2", "train.global_batch_size=2"]
COMMON = dict(
    vocab_size=500, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=32, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=None,
    eos_token_id=None, pad_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
)  # fmt: skip
MOE = dict(num_experts=4, num_experts_per_tok=2)
HF_MODELS = {
    "olmoe": lambda: transformers.OlmoeForCausalLM(
        transformers.OlmoeConfig(**COMMON, **MOE, intermediate_size=32, norm_topk_prob=False)
    ),
    # head_dim 24: q projects 64 -> 96 features, the output projection reads 96
    "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(
            **COMMON,
            **MOE,
            head_dim=24,
            intermediate_size=48,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[0],
        )
    ),
    "qwen3": lambda: transformers.Qwen3ForCausalLM(
        transformers.Qwen3Config(**COMMON, head_dim=24, intermediate_size=48)
    ),
}
WANT = {
    "olmoe": {"qk_norm": "full", "num_experts": 4, "moe_norm_topk_prob": False, "moe_ffn_hidden_size": 32},
    "qwen3_moe": {
        "qk_norm": "head",
        "kv_channels": 24,
        "num_experts": 4,
        "moe_norm_topk_prob": True,
        "moe_first_k_dense": 1,
        "moe_layer_freq": 1,
        "ffn_hidden_size": 48,
        "moe_ffn_hidden_size": 32,
    },
    "qwen3": {"qk_norm": "head", "kv_channels": 24},
}


def _random(name: str, path):
    """A transformers model with random weights, its norms too (transformers starts them at one, where a
    q/k norm mapped to the wrong tensor would not show), experts and router as large as trained ones."""
    torch.manual_seed(0)
    hf = HF_MODELS[name]().eval()
    with torch.no_grad():
        for key, param in hf.named_parameters():
            if "norm" in key:
                param.uniform_(0.5, 1.5)
            elif "experts" in key:
                param.normal_(0.0, 0.2)
            elif key.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)
    hf.save_pretrained(path)
    return hf


@pytest.mark.parametrize("name", list(HF_MODELS))
def test_a_random_model_goes_through_stx_and_back_with_its_logits(name, tmp_path):
    hf = _random(name, tmp_path / name)
    settings = model_overrides_from_hf(tmp_path / name)
    assert settings.items() >= WANT[name].items()
    cfg = resolve(load_config(None, [*TRAIN, *(f"model.{k}={v}" for k, v in settings.items())])).model
    mapping = hf_mapping_for_type(name)
    assert mapping is not None and mapping.unsupported(cfg) == [] and hf_unsupported(cfg) == []
    model = build_model(cfg).eval()
    load_hf_weights(model, cfg, tmp_path / name)
    ids = torch.randint(0, 500, (2, 32), generator=torch.Generator().manual_seed(1))
    mapping.to_hf(model, cfg).save_pretrained(tmp_path / "back")  # as `stx export --format hf` writes
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32).eval()
    assert type(again).__name__ == type(hf).__name__
    with torch.no_grad():
        want = hf(ids).logits
        ours = model(ids)[..., :500]
        back = again(ids).logits[..., :500]
    diffs = [(ours - want).abs().max().item(), (back - want).abs().max().item()]
    print(f"{name}: max |stx - HF| = {diffs[0]:.2e}, max |HF -> stx -> HF - HF| = {diffs[1]:.2e}")
    assert max(diffs) <= 1e-4
    assert want.std() > 0.1  # logits that a wrong norm, head size or expert order would change


def test_a_qwen3_moe_layer_pattern_without_an_equivalent_is_refused_naming_its_keys(tmp_path):
    transformers.Qwen3MoeConfig(**COMMON, **MOE, head_dim=24, decoder_sparse_step=2).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match=r"decoder_sparse_step = 2, mlp_only_layers = \[\].*\[1\]"):
        model_overrides_from_hf(tmp_path)


def test_olmoe_clip_qkv_is_refused_naming_it(tmp_path):
    transformers.OlmoeConfig(**COMMON, **MOE, intermediate_size=32, clip_qkv=8.0).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match=r"clip_qkv = 8.0"):
        model_overrides_from_hf(tmp_path)


def test_architectures_without_q_k_norms_or_head_size_refuse_models_with_them():
    olmoe = resolve(load_config("tiny-moe", ["model.qk_norm=full"])).model
    assert "model.qk_norm = full (Mixtral has no q/k norm)" in gpt_hf.mixtral_unsupported(olmoe)
    assert gpt_hf.olmoe_unsupported(olmoe) == []
    head = resolve(load_config("llama-tiny", ["model.qk_norm=head"])).model
    assert "model.qk_norm = head (Llama has no q/k norm)" in gpt_hf.llama_unsupported(head)
    assert "model.qk_norm = head (OLMoE has a q/k norm over all heads)" in gpt_hf.olmoe_unsupported(head)
    wide = resolve(load_config("tiny-gpt", ["model.kv_channels=48"])).model
    assert any("model.kv_channels = 48 (GPT-2's head size" in r for r in gpt_hf.gpt2_unsupported(wide))
