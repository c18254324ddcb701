"""Hugging Face Mixtral: a random transformers MixtralForCausalLM imports with its logits, exports back
(transformers -> stx -> transformers) with the same logits, and dense architectures refuse MoE models."""

from __future__ import annotations

import pytest
import torch

from scalable_transformer.checkpoint.hf_import import load_hf_weights, model_overrides_from_hf
from scalable_transformer.config.load import load_config
from scalable_transformer.config.validate import resolve
from scalable_transformer.models import build_model
from scalable_transformer.models.gpt import hf as gpt_hf
from scalable_transformer.models.registry import hf_unsupported

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

TRAIN = ["model.seq_length=32", "train.micro_batch_size=2", "train.global_batch_size=2"]


def _random_mixtral(tmp_path, **overrides):
    torch.manual_seed(0)
    settings = dict(
        vocab_size=500, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-5, tie_word_embeddings=False,
        num_local_experts=4, num_experts_per_tok=2, bos_token_id=None, eos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )  # fmt: skip
    settings.update(overrides)
    hf = transformers.MixtralForCausalLM(transformers.MixtralConfig(**settings)).eval()
    with torch.no_grad():  # experts' weights as large as a trained model's, so a wrong order shows
        for layer in hf.model.layers:
            layer.mlp.experts.gate_up_proj.normal_(0.0, 0.2)
            layer.mlp.experts.down_proj.normal_(0.0, 0.2)
            layer.mlp.gate.weight.normal_(0.0, 0.5)
    hf.save_pretrained(tmp_path / "mixtral")
    return hf, tmp_path / "mixtral"


def test_a_random_mixtral_goes_through_stx_and_back_with_its_logits(tmp_path):
    hf, path = _random_mixtral(tmp_path)
    settings = model_overrides_from_hf(path)
    assert settings["num_experts"] == 4 and settings["moe_router_topk"] == 2
    assert settings["moe_ffn_hidden_size"] == 32 and settings["moe_norm_topk_prob"] is True
    shape = [f"model.{k}={v}" for k, v in settings.items() if v is not None]  # None: the default
    cfg = resolve(load_config(None, [*TRAIN, *shape])).model
    assert hf_unsupported(cfg) == [] and gpt_hf.llama_unsupported(cfg) != []
    model = build_model(cfg).eval()
    load_hf_weights(model, cfg, path)
    ids = torch.randint(0, 500, (2, 32), generator=torch.Generator().manual_seed(1))
    gpt_hf.to_mixtral(model, cfg).save_pretrained(tmp_path / "back")  # as `stx export --format hf` writes
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(ids).logits
        ours = model(ids)[..., :500]
        back = again(ids).logits[..., :500]
    diffs = [(ours - want).abs().max().item(), (back - want).abs().max().item()]
    print(f"max |stx - HF| = {diffs[0]:.2e}, max |HF -> stx -> HF - HF| = {diffs[1]:.2e}")
    assert max(diffs) <= 1e-4
    assert want.std() > 0.1  # logits that a wrong gate/up order or expert transpose would change


def test_dense_architectures_refuse_an_moe_model_and_mixtral_names_what_it_lacks():
    moe = resolve(load_config("tiny-moe")).model
    for unsupported in (gpt_hf.llama_unsupported, gpt_hf.mistral_unsupported, gpt_hf.gpt2_unsupported):
        assert any("model.num_experts = 8" in r for r in unsupported(moe))
    assert gpt_hf.mixtral_unsupported(moe) == []
    shared = resolve(load_config("tiny-moe", ["model.moe_shared_expert_size=64"])).model
    assert gpt_hf.mixtral_unsupported(shared) == [
        "model.moe_shared_expert_size = 64 (Mixtral has no shared expert)"
    ]
    dense = resolve(load_config("llama-tiny")).model
    assert "model.num_experts = 0 (Mixtral is a mixture of experts)" in gpt_hf.mixtral_unsupported(dense)
