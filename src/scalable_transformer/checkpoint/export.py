"""`stx export CHECKPOINT --format hf --output DIR`: a checkpoint as a Hugging Face `transformers` model.

GPT-shaped models (learned positions, LayerNorm, pre-LN, GELU) become `GPT2LMHeadModel`; post-LN BERTs
with learned positions, GELU and tied embeddings become `BertForPreTraining`. Our fused QKV
is laid out per head ([q_d | k_d | v_d] for each head, Megatron's layout, so tensor parallelism splits
whole heads); GPT-2's `c_attn` is [q | k | v] over all heads, and its Conv1D weights are stored
transposed ([in, out]). The vocabulary is exported padded, as trained. Other architectures get an
error that says which setting has no equivalent. The reverse, initialising from a Hugging Face
model, is `hf_import.py` (`checkpoint.init_from_hf`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from ..config.schema import ModelConfig
from ..models import build_model, padded_vocab_size
from .manager import CheckpointError, _quiet_single_process, find_checkpoint, read_metadata


def load_model(checkpoint: str) -> tuple[torch.nn.Module, ModelConfig, dict[str, Any]]:
    """The plain model of a checkpoint (any layout it was written with), in this process."""
    import torch.distributed.checkpoint as dcp

    path = find_checkpoint(checkpoint, None)
    if path is None:
        raise CheckpointError(f"{checkpoint}: no checkpoint")
    meta = read_metadata(path)
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    cfg = ModelConfig(**{k: v for k, v in meta["model"].items() if k in names})
    model = build_model(cfg)
    sd = model.state_dict()
    with _quiet_single_process():
        dcp.load({"model": sd}, checkpoint_id=str(path))
    model.load_state_dict(sd)
    return model.eval(), cfg, meta


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


def bert_unsupported(cfg: ModelConfig) -> list[str]:
    """Why a BERT has no BertForPreTraining equivalent (empty: it has one)."""
    reasons = []
    if cfg.position_embedding_type != "learned":
        reasons.append(
            f"model.position_embedding_type = {cfg.position_embedding_type} (BERT learns positions)"
        )
    if cfg.norm != "layernorm":
        reasons.append(f"model.norm = {cfg.norm} (BERT uses LayerNorm)")
    if cfg.activation not in ("gelu", "openai-gelu"):
        reasons.append(f"model.activation = {cfg.activation} (BERT has an ungated MLP)")
    if not cfg.apply_residual_connection_post_layernorm:
        reasons.append(
            "pre-LN blocks (Megatron's default); BertForPreTraining is post-LN: "
            "model.apply_residual_connection_post_layernorm = true"
        )
    if not cfg.tie_word_embeddings:
        reasons.append("model.tie_word_embeddings = false (BertForPreTraining ties its decoder)")
    return reasons


def to_bert(model: torch.nn.Module, cfg: ModelConfig) -> Any:
    """A transformers BertForPreTraining holding `model`'s weights (post-LN BERT only)."""
    from transformers import BertConfig, BertForPreTraining

    reasons = bert_unsupported(cfg)
    if reasons:
        raise CheckpointError("no Hugging Face equivalent for this model: " + "; ".join(reasons))
    assert cfg.vocab_size is not None and cfg.max_position_embeddings is not None
    h, n = cfg.hidden_size, cfg.num_attention_heads
    d = h // n
    hf_cfg = BertConfig(
        vocab_size=padded_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by),
        hidden_size=h,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=n,
        intermediate_size=cfg.ffn_hidden_size or 4 * h,
        hidden_act="gelu" if cfg.activation == "gelu" else "gelu_new",
        max_position_embeddings=cfg.max_position_embeddings,
        type_vocab_size=max(cfg.num_tokentypes, 1),
        layer_norm_eps=cfg.layernorm_epsilon,
        hidden_dropout_prob=cfg.hidden_dropout,
        attention_probs_dropout_prob=cfg.attention_dropout,
    )
    hf = BertForPreTraining(hf_cfg)
    ours = model.state_dict()
    sd = dict(hf.state_dict())  # keeps HF's own tensors where we have none (pooler without binary head)
    e = "bert.embeddings."
    sd |= {
        e + "word_embeddings.weight": ours["embedding.word.weight"],
        e + "position_embeddings.weight": ours["embedding.position.weight"],
        e + "LayerNorm.weight": ours["embedding.norm.weight"],
        e + "LayerNorm.bias": ours["embedding.norm.bias"],
        "cls.predictions.transform.dense.weight": ours["lm_head.dense.weight"],
        "cls.predictions.transform.dense.bias": ours["lm_head.dense.bias"],
        "cls.predictions.transform.LayerNorm.weight": ours["lm_head.norm.weight"],
        "cls.predictions.transform.LayerNorm.bias": ours["lm_head.norm.bias"],
        "cls.predictions.decoder.weight": ours["embedding.word.weight"],
        "cls.predictions.bias": ours["lm_head.bias"],
    }
    if "cls.predictions.decoder.bias" in sd:
        sd["cls.predictions.decoder.bias"] = ours["lm_head.bias"]
    if "embedding.tokentype.weight" in ours:
        sd[e + "token_type_embeddings.weight"] = ours["embedding.tokentype.weight"]
    else:
        sd[e + "token_type_embeddings.weight"] = torch.zeros_like(sd[e + "token_type_embeddings.weight"])
    if "pooler.weight" in ours:
        sd |= {
            "bert.pooler.dense.weight": ours["pooler.weight"],
            "bert.pooler.dense.bias": ours["pooler.bias"],
            "cls.seq_relationship.weight": ours["binary_head.weight"],
            "cls.seq_relationship.bias": ours["binary_head.bias"],
        }
    for i in range(cfg.num_layers):
        o, t = f"layers.{i}.", f"bert.encoder.layer.{i}."
        q_w, k_w, v_w = ours[o + "attention.qkv.weight"].view(n, 3, d, h).unbind(1)
        q_b, k_b, v_b = ours[o + "attention.qkv.bias"].view(n, 3, d).unbind(1)
        sd |= {
            t + "attention.self.query.weight": q_w.reshape(h, h),
            t + "attention.self.query.bias": q_b.reshape(h),
            t + "attention.self.key.weight": k_w.reshape(h, h),
            t + "attention.self.key.bias": k_b.reshape(h),
            t + "attention.self.value.weight": v_w.reshape(h, h),
            t + "attention.self.value.bias": v_b.reshape(h),
            t + "attention.output.dense.weight": ours[o + "attention.proj.weight"],
            t + "attention.output.dense.bias": ours[o + "attention.proj.bias"],
            t + "attention.output.LayerNorm.weight": ours[o + "norm1.weight"],
            t + "attention.output.LayerNorm.bias": ours[o + "norm1.bias"],
            t + "intermediate.dense.weight": ours[o + "mlp.up.weight"],
            t + "intermediate.dense.bias": ours[o + "mlp.up.bias"],
            t + "output.dense.weight": ours[o + "mlp.down.weight"],
            t + "output.dense.bias": ours[o + "mlp.down.bias"],
            t + "output.LayerNorm.weight": ours[o + "norm2.weight"],
            t + "output.LayerNorm.bias": ours[o + "norm2.bias"],
        }
    hf.load_state_dict({k: v.contiguous() for k, v in sd.items()})
    return hf.eval()


def export_hf(checkpoint: str, output: str) -> Path:
    """Write `output/` (config.json, model.safetensors and, when the tokenizer is a HF one, its files)."""
    model, cfg, meta = load_model(checkpoint)
    hf = to_gpt2(model, cfg) if cfg.type == "gpt" else to_bert(model, cfg)
    out = Path(output)
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"--output {output} exists and is not empty; choose a new directory")
    hf.save_pretrained(out)
    _save_tokenizer(meta, out)
    return out


def _save_tokenizer(meta: dict[str, Any], out: Path) -> None:
    """The training tokenizer as a PreTrainedTokenizerFast, when it can be rebuilt here."""
    import yaml
    from transformers import PreTrainedTokenizerFast

    from ..data.tokenizers import load_tokenizer

    try:
        d = yaml.safe_load(meta["config_yaml"])["data"]
        tok = load_tokenizer(
            d["tokenizer"],
            d["tokenizer_vocab_size"],
            vocab_file=d.get("vocab_file"),
            merge_file=d.get("merge_file"),
            tokenizer_type=d.get("tokenizer_type"),
        )
    except Exception as e:  # the model is exported either way; say why the tokenizer is not
        (out / "TOKENIZER-NOT-EXPORTED.txt").write_text(f"the training tokenizer could not be loaded: {e}\n")
        return
    PreTrainedTokenizerFast(tokenizer_object=tok.hf).save_pretrained(out)
