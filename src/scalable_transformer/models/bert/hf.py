"""BERT <-> Hugging Face (the export mappings; checkpoint/hf_import.py runs them backwards): post-LN
BERTs to `BertForPreTraining`, pre-LN ones (Megatron's default) to `MegatronBertForPreTraining`
(model_type megatron-bert: norms before attention and MLP, one after the last layer, none after the
embeddings). Learned positions, GELU and tied embeddings only; the fused QKV is split per head into
query/key/value. The vocabulary is exported padded, as trained.
"""

from __future__ import annotations

from typing import Any

import torch

from scalable_transformer.config.rules import padded_vocab_size
from scalable_transformer.config.schema import ModelConfig
from scalable_transformer.models.hf_shape import Needs, block_form, classic_block, mismatches, refuse


def _bert_shape_unsupported(cfg: ModelConfig) -> list[str]:
    """What neither BertForPreTraining nor MegatronBertForPreTraining can hold."""
    needs = classic_block("BERT", "learned", "linear layers have")
    needs.append(Needs("tie_word_embeddings", (True,), "BERT ties its decoder"))
    return mismatches(cfg, [*needs, *block_form("BERT", cfg)], one_kv_head_per_head="BERT")


def bert_unsupported(cfg: ModelConfig) -> list[str]:
    """Why a BERT has no BertForPreTraining equivalent (empty: it has one)."""
    reasons = _bert_shape_unsupported(cfg)
    if not cfg.apply_residual_connection_post_layernorm:
        reasons.append(
            "pre-LN blocks (Megatron's default); BertForPreTraining is post-LN: "
            "model.apply_residual_connection_post_layernorm = true"
        )
    return reasons


def megatron_bert_unsupported(cfg: ModelConfig) -> list[str]:
    """Why a BERT has no MegatronBertForPreTraining equivalent (empty: it has one)."""
    reasons = _bert_shape_unsupported(cfg)
    if cfg.apply_residual_connection_post_layernorm:
        reasons.append("post-LN blocks (MegatronBertForPreTraining is pre-LN; BertForPreTraining holds them)")
    return reasons


def to_bert(model: torch.nn.Module, cfg: ModelConfig) -> Any:
    """A transformers BertForPreTraining holding `model`'s weights (post-LN BERT only)."""
    return _to_hf(model, cfg, pre_ln=False)


def to_megatron_bert(model: torch.nn.Module, cfg: ModelConfig) -> Any:
    """A transformers MegatronBertForPreTraining holding `model`'s weights (pre-LN BERT only)."""
    return _to_hf(model, cfg, pre_ln=True)


def _hf_config(config_class: Any, cfg: ModelConfig) -> Any:
    """The Hugging Face (Megatron)BertConfig of our model config; the vocabulary padded, as trained."""
    assert cfg.vocab_size is not None and cfg.max_position_embeddings is not None
    h = cfg.hidden_size
    return config_class(
        vocab_size=padded_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by),
        hidden_size=h,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        intermediate_size=cfg.ffn_hidden_size or 4 * h,
        hidden_act="gelu" if cfg.activation == "gelu" else "gelu_new",
        max_position_embeddings=cfg.max_position_embeddings,
        type_vocab_size=max(cfg.num_tokentypes, 1),
        layer_norm_eps=cfg.layernorm_epsilon,
        hidden_dropout_prob=cfg.hidden_dropout,
        attention_probs_dropout_prob=cfg.attention_dropout,
    )


def _outer_weights(ours: dict[str, torch.Tensor], sd: dict[str, Any], pre_ln: bool) -> dict[str, Any]:
    """HF's embeddings, final or embedding norm, MLM head, pooler and binary head from ours (`sd`: HF's
    own state dict, for the tensors we have no counterpart of)."""
    e = "bert.embeddings."
    out: dict[str, Any] = {}
    if pre_ln:  # the norm after the last layer; no norm after the embeddings
        out |= {
            "bert.encoder.ln.weight": ours["final_norm.weight"],
            "bert.encoder.ln.bias": ours["final_norm.bias"],
        }
    else:
        out |= {
            e + "LayerNorm.weight": ours["embedding.norm.weight"],
            e + "LayerNorm.bias": ours["embedding.norm.bias"],
        }
    out |= {
        e + "word_embeddings.weight": ours["embedding.word.weight"],
        e + "position_embeddings.weight": ours["embedding.position.weight"],
        "cls.predictions.transform.dense.weight": ours["lm_head.dense.weight"],
        "cls.predictions.transform.dense.bias": ours["lm_head.dense.bias"],
        "cls.predictions.transform.LayerNorm.weight": ours["lm_head.norm.weight"],
        "cls.predictions.transform.LayerNorm.bias": ours["lm_head.norm.bias"],
        "cls.predictions.decoder.weight": ours["embedding.word.weight"],
        "cls.predictions.bias": ours["lm_head.bias"],
    }
    if "cls.predictions.decoder.bias" in sd:
        out["cls.predictions.decoder.bias"] = ours["lm_head.bias"]
    if "embedding.tokentype.weight" in ours:
        out[e + "token_type_embeddings.weight"] = ours["embedding.tokentype.weight"]
    else:
        out[e + "token_type_embeddings.weight"] = torch.zeros_like(sd[e + "token_type_embeddings.weight"])
    if "pooler.weight" in ours:
        out |= {
            "bert.pooler.dense.weight": ours["pooler.weight"],
            "bert.pooler.dense.bias": ours["pooler.bias"],
            "cls.seq_relationship.weight": ours["binary_head.weight"],
            "cls.seq_relationship.bias": ours["binary_head.bias"],
        }
    return out


def _layer_weights(ours: dict[str, torch.Tensor], i: int, cfg: ModelConfig, pre_ln: bool) -> dict[str, Any]:
    """HF's tensors of layer i: our fused QKV split per head into query/key/value, the rest renamed."""
    h, n = cfg.hidden_size, cfg.num_attention_heads
    d = h // n
    o, t = f"layers.{i}.", f"bert.encoder.layer.{i}."
    q_w, k_w, v_w = ours[o + "attention.qkv.weight"].view(n, 3, d, h).unbind(1)
    q_b, k_b, v_b = ours[o + "attention.qkv.bias"].view(n, 3, d).unbind(1)
    out = {
        t + "attention.self.query.weight": q_w.reshape(h, h),
        t + "attention.self.query.bias": q_b.reshape(h),
        t + "attention.self.key.weight": k_w.reshape(h, h),
        t + "attention.self.key.bias": k_b.reshape(h),
        t + "attention.self.value.weight": v_w.reshape(h, h),
        t + "attention.self.value.bias": v_b.reshape(h),
        t + "attention.output.dense.weight": ours[o + "attention.proj.weight"],
        t + "attention.output.dense.bias": ours[o + "attention.proj.bias"],
        t + "intermediate.dense.weight": ours[o + "mlp.up.weight"],
        t + "intermediate.dense.bias": ours[o + "mlp.up.bias"],
        t + "output.dense.weight": ours[o + "mlp.down.weight"],
        t + "output.dense.bias": ours[o + "mlp.down.bias"],
    }
    norm1, norm2 = ("attention.ln", "ln") if pre_ln else ("attention.output.LayerNorm", "output.LayerNorm")
    for ours_name, hf_name in (("norm1", norm1), ("norm2", norm2)):
        out |= {
            t + f"{hf_name}.weight": ours[o + f"{ours_name}.weight"],
            t + f"{hf_name}.bias": ours[o + f"{ours_name}.bias"],
        }
    return out


def _to_hf(model: torch.nn.Module, cfg: ModelConfig, pre_ln: bool) -> Any:
    import transformers  # optional (the bench extra): only an export needs it

    refuse(megatron_bert_unsupported(cfg) if pre_ln else bert_unsupported(cfg))
    prefix = "MegatronBert" if pre_ln else "Bert"
    hf_cfg = _hf_config(getattr(transformers, f"{prefix}Config"), cfg)
    hf = getattr(transformers, f"{prefix}ForPreTraining")(hf_cfg)
    ours = model.state_dict()
    sd = dict(hf.state_dict())  # keeps HF's own tensors where we have none (pooler without binary head)
    sd |= _outer_weights(ours, sd, pre_ln)
    for i in range(cfg.num_layers):
        sd |= _layer_weights(ours, i, cfg, pre_ln)
    hf.load_state_dict({k: v.contiguous() for k, v in sd.items()})
    return hf.eval()


def overrides_from_megatron_bert(hf: Any) -> dict[str, Any]:
    """The model.* settings (as `key: value`) describing a Hugging Face MegatronBertConfig."""
    return overrides_from_hf(hf) | {"apply_residual_connection_post_layernorm": False}


def overrides_from_hf(hf: Any) -> dict[str, Any]:
    """The model.* settings (as `key: value`) describing a Hugging Face BertConfig."""
    return {
        "type": "bert",
        "num_layers": hf.num_hidden_layers,
        "hidden_size": hf.hidden_size,
        "num_attention_heads": hf.num_attention_heads,
        "ffn_hidden_size": hf.intermediate_size,
        "max_position_embeddings": hf.max_position_embeddings,
        "vocab_size": hf.vocab_size,
        "make_vocab_size_divisible_by": 1,  # the vocabulary as the file has it
        "activation": "gelu" if hf.hidden_act == "gelu" else "openai-gelu",
        "layernorm_epsilon": hf.layer_norm_eps,
        "num_tokentypes": hf.type_vocab_size,
        "position_embedding_type": "learned",
        "norm": "layernorm",
        "apply_residual_connection_post_layernorm": True,
        "tie_word_embeddings": True,
        "bert_binary_head": True,
    }
