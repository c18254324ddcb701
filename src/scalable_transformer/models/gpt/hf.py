"""GPT <-> Hugging Face `GPT2LMHeadModel` (the export mapping; checkpoint/hf_import.py runs it backwards).

GPT-shaped models (learned positions, LayerNorm, pre-LN, GELU) only. Our fused QKV is laid out per
head ([q_d | k_d | v_d] for each head, Megatron's layout, so tensor parallelism splits whole heads);
GPT-2's `c_attn` is [q | k | v] over all heads, and its Conv1D weights are stored transposed
([in, out]). The vocabulary is exported padded, as trained.
"""

from __future__ import annotations

from typing import Any

import torch

from scalable_transformer.config.schema import ModelConfig
from scalable_transformer.errors import CheckpointError
from scalable_transformer.models.layers import padded_vocab_size


def gpt2_unsupported(cfg: ModelConfig) -> list[str]:
    """Why a model has no GPT2LMHeadModel equivalent (empty: it has one)."""
    reasons = []
    if cfg.type != "gpt":
        reasons.append(f"model.type = {cfg.type}")
    if cfg.position_embedding_type != "learned":
        reasons.append(
            f"model.position_embedding_type = {cfg.position_embedding_type} (GPT-2 learns positions)"
        )
    if cfg.norm != "layernorm":
        reasons.append(f"model.norm = {cfg.norm} (GPT-2 uses LayerNorm)")
    if cfg.activation not in ("gelu", "openai-gelu"):
        reasons.append(f"model.activation = {cfg.activation} (GPT-2 has an ungated MLP)")
    if cfg.apply_residual_connection_post_layernorm:
        reasons.append("model.apply_residual_connection_post_layernorm = true (GPT-2 is pre-LN)")
    if (cfg.num_query_groups or cfg.num_attention_heads) != cfg.num_attention_heads:
        reasons.append(
            f"model.num_query_groups = {cfg.num_query_groups} (GPT-2 has one key/value head per head)"
        )
    if not cfg.add_bias_linear:
        reasons.append("model.add_bias_linear = false (GPT-2's linear layers have biases)")
    return reasons


def to_gpt2(model: torch.nn.Module, cfg: ModelConfig) -> Any:
    """A transformers GPT2LMHeadModel holding `model`'s weights."""
    from transformers import GPT2Config, GPT2LMHeadModel

    reasons = gpt2_unsupported(cfg)
    if reasons:
        raise CheckpointError("no Hugging Face equivalent for this model: " + "; ".join(reasons))
    assert cfg.vocab_size is not None and cfg.max_position_embeddings is not None
    h, n = cfg.hidden_size, cfg.num_attention_heads
    d = h // n
    hf_cfg = GPT2Config(
        vocab_size=padded_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by),
        n_positions=cfg.max_position_embeddings,
        n_embd=h,
        n_layer=cfg.num_layers,
        n_head=n,
        n_inner=cfg.ffn_hidden_size,
        activation_function="gelu" if cfg.activation == "gelu" else "gelu_new",
        layer_norm_epsilon=cfg.layernorm_epsilon,
        resid_pdrop=cfg.hidden_dropout,
        embd_pdrop=cfg.hidden_dropout,
        attn_pdrop=cfg.attention_dropout,
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=None,  # GPT-2's 50256 is not in our vocabulary
        eos_token_id=None,
    )
    ours = model.state_dict()
    sd: dict[str, torch.Tensor] = {
        "transformer.wte.weight": ours["embedding.word.weight"],
        "transformer.wpe.weight": ours["embedding.position.weight"],
        "transformer.ln_f.weight": ours["final_norm.weight"],
        "transformer.ln_f.bias": ours["final_norm.bias"],
        "lm_head.weight": ours["embedding.word.weight" if cfg.tie_word_embeddings else "output.weight"],
    }
    for i in range(cfg.num_layers):
        o, t = f"layers.{i}.", f"transformer.h.{i}."
        # per-head [q|k|v] rows -> [all q | all k | all v]
        qkv_w = ours[o + "attention.qkv.weight"].view(n, 3, d, h).transpose(0, 1).reshape(3 * h, h)
        qkv_b = ours[o + "attention.qkv.bias"].view(n, 3, d).transpose(0, 1).reshape(3 * h)
        sd |= {
            t + "ln_1.weight": ours[o + "norm1.weight"],
            t + "ln_1.bias": ours[o + "norm1.bias"],
            t + "ln_2.weight": ours[o + "norm2.weight"],
            t + "ln_2.bias": ours[o + "norm2.bias"],
            t + "attn.c_attn.weight": qkv_w.t(),  # Conv1D: [in, out]
            t + "attn.c_attn.bias": qkv_b,
            t + "attn.c_proj.weight": ours[o + "attention.proj.weight"].t(),
            t + "attn.c_proj.bias": ours[o + "attention.proj.bias"],
            t + "mlp.c_fc.weight": ours[o + "mlp.up.weight"].t(),
            t + "mlp.c_fc.bias": ours[o + "mlp.up.bias"],
            t + "mlp.c_proj.weight": ours[o + "mlp.down.weight"].t(),
            t + "mlp.c_proj.bias": ours[o + "mlp.down.bias"],
        }
    hf = GPT2LMHeadModel(hf_cfg)
    missing, unexpected = hf.load_state_dict({k: v.contiguous() for k, v in sd.items()}, strict=False)
    missing = [k for k in missing if not k.endswith(".attn.bias") and not k.endswith(".masked_bias")]
    if missing or unexpected:
        raise CheckpointError(f"GPT-2 export: missing {missing}, unexpected {unexpected}")
    return hf.eval()


def overrides_from_hf(hf: Any) -> dict[str, Any]:
    """The model.* settings (as `key: value`) describing a Hugging Face GPT2Config."""
    return {
        "type": "gpt",
        "num_layers": hf.n_layer,
        "hidden_size": hf.n_embd,
        "num_attention_heads": hf.n_head,
        "ffn_hidden_size": hf.n_inner or 4 * hf.n_embd,
        "max_position_embeddings": hf.n_positions,
        "vocab_size": hf.vocab_size,
        "activation": "gelu" if hf.activation_function == "gelu" else "openai-gelu",
        "layernorm_epsilon": hf.layer_norm_epsilon,
        "position_embedding_type": "learned",
        "norm": "layernorm",
        "apply_residual_connection_post_layernorm": False,
        "tie_word_embeddings": bool(hf.tie_word_embeddings),
    }
