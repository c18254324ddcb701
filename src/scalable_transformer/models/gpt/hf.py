"""GPT <-> Hugging Face `GPT2LMHeadModel` (the export mapping; checkpoint/hf_import.py runs it backwards).

GPT-shaped models (learned positions, LayerNorm, pre-LN, GELU) only. Our fused QKV is laid out per
head ([q_d | k_d | v_d] for each head, Megatron's layout, so tensor parallelism splits whole heads);
GPT-2's `c_attn` is [q | k | v] over all heads, and its Conv1D weights are stored transposed
([in, out]). The vocabulary is exported padded, as trained.
"""

from __future__ import annotations

from typing import Any

import torch

from scalable_transformer.config.model_shapes import is_moe_layer, mlp_bias, moe_ffn
from scalable_transformer.config.rules import head_dim, padded_vocab_size
from scalable_transformer.config.schema import ModelConfig
from scalable_transformer.errors import CheckpointError
from scalable_transformer.models.hf_shape import (
    GPT,
    Needs,
    block_form,
    classic_block,
    mismatches,
    pre_ln,
    refuse,
)
from scalable_transformer.models.layers import (
    LLAMA3_HIGH_FREQ_FACTOR,
    LLAMA3_LOW_FREQ_FACTOR,
    LLAMA3_ORIGINAL_POSITIONS,
)


def gpt2_unsupported(cfg: ModelConfig) -> list[str]:
    """Why a model has no GPT2LMHeadModel equivalent (empty: it has one)."""
    needs = [GPT, *classic_block("GPT-2", "learned", "linear layers have"), pre_ln("GPT-2")]
    return mismatches(cfg, [*needs, *block_form("GPT-2", cfg)], one_kv_head_per_head="GPT-2")


def to_gpt2(model: torch.nn.Module, cfg: ModelConfig) -> Any:
    """A transformers GPT2LMHeadModel holding `model`'s weights."""
    from transformers import GPT2Config, GPT2LMHeadModel  # optional dependency (the bench extra)

    refuse(gpt2_unsupported(cfg))
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
        "make_vocab_size_divisible_by": 1,  # the vocabulary as the file has it
    }


# ------------------------------------------------------------------------------------ LlamaForCausalLM
# Our fused qkv rows are per key/value group [q of its r heads | k | v]; Llama's q_proj, k_proj and
# v_proj hold all heads' rows in head order. Our gated up-projection interleaves gate and value rows
# (so a column-parallel split keeps pairs together); Llama's gate_proj / up_proj are separate. Both use
# rotate-half RoPE over the whole head dimension, so q and k need no permutation.


def _llama_block(name: str) -> list[Needs]:
    return [
        GPT,
        Needs("position_embedding_type", ("rotary",), f"{name} uses rotary"),
        Needs("norm", ("rmsnorm",), f"{name} uses RMSNorm"),
        Needs("activation", ("swiglu",), f"{name}'s MLP is SwiGLU"),
        pre_ln(name),
    ]


def llama_unsupported(cfg: ModelConfig) -> list[str]:
    """Why a model has no LlamaForCausalLM equivalent (empty: it has one)."""
    return mismatches(cfg, [*_llama_block("Llama"), *block_form("Llama", cfg, mlp_bias=True, head_size=True)])


def mistral_unsupported(cfg: ModelConfig) -> list[str]:
    """Why a model has no MistralForCausalLM equivalent (empty: it has one): Llama's block without
    biases, with a sliding window (or none) on every layer."""
    needs = [
        *_llama_block("Mistral"),
        Needs("rope_scaling", (False,), "Mistral has no Llama 3.1 scaling"),
        Needs("add_bias_linear", (False,), "Mistral's linear layers have no biases"),
        *block_form("Mistral", cfg, window=True, head_size=True),
    ]
    return mismatches(cfg, needs)


def qwen2_unsupported(cfg: ModelConfig) -> list[str]:
    """Why a model has no Qwen2ForCausalLM equivalent (empty: it has one): Llama's block with biases on
    q/k/v only, and a sliding window on every layer or none."""
    needs = [
        *_llama_block("Qwen2"),
        Needs("rope_scaling", (False,), "Qwen2 here has no Llama 3.1 scaling"),
        Needs("add_bias_linear", (False,), "Qwen2's output and MLP projections have no biases"),
        *block_form("Qwen2", cfg, window=True, qkv_bias=(True,)),
    ]
    return mismatches(cfg, needs)


def _rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
    if not cfg.rope_scaling:
        return {"rope_type": "default", "rope_theta": float(cfg.rotary_base)}
    return {
        "rope_type": "llama3",
        "rope_theta": float(cfg.rotary_base),
        "factor": cfg.rope_scaling_factor,
        "low_freq_factor": LLAMA3_LOW_FREQ_FACTOR,
        "high_freq_factor": LLAMA3_HIGH_FREQ_FACTOR,
        "original_max_position_embeddings": LLAMA3_ORIGINAL_POSITIONS,
    }


def _llama_config(cfg: ModelConfig) -> dict[str, Any]:
    """The settings LlamaConfig, MistralConfig and Qwen2Config share, for cfg."""
    assert cfg.vocab_size is not None and cfg.max_position_embeddings is not None
    return dict(
        vocab_size=padded_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups or cfg.num_attention_heads,
        hidden_act="silu",
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.layernorm_epsilon,
        rope_parameters=_rope_parameters(cfg),
        attention_dropout=cfg.attention_dropout,
        tie_word_embeddings=cfg.tie_word_embeddings,
        initializer_range=cfg.init_method_std,
        bos_token_id=None,  # the family's ids are not in our vocabulary
        eos_token_id=None,
    )


def _llama_state_dict(model: torch.nn.Module, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our weights under Llama's names (Mistral's and Qwen2's are the same)."""
    h, n = cfg.hidden_size, cfg.num_attention_heads
    g = cfg.num_query_groups or n
    d, r = head_dim(cfg), n // g
    ours = model.state_dict()
    sd: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": ours["embedding.word.weight"],
        "model.norm.weight": ours["final_norm.weight"],
    }
    if not cfg.tie_word_embeddings:
        sd["lm_head.weight"] = ours["output.weight"]
    for i in range(cfg.num_layers):
        o, t = f"layers.{i}.", f"model.layers.{i}."
        sd |= {
            t + "input_layernorm.weight": ours[o + "norm1.weight"],
            t + "post_attention_layernorm.weight": ours[o + "norm2.weight"],
            t + "self_attn.o_proj.weight": ours[o + "attention.proj.weight"],
        }
        for norm in ("q_norm", "k_norm"):  # model.qk_norm (RMSNorm: a weight only)
            if o + f"attention.{norm}.weight" in ours:
                sd[t + f"self_attn.{norm}.weight"] = ours[o + f"attention.{norm}.weight"]
        if o + "mlp.down.weight" in ours:  # a dense MLP (an MoE layer's: _moe_state_dict)
            sd[t + "mlp.down_proj.weight"] = ours[o + "mlp.down.weight"]
        for kind, tail in [("weight", (h,)), ("bias", ())]:
            if o + f"attention.qkv.{kind}" in ours:
                qkv = ours[o + f"attention.qkv.{kind}"].view(g, (r + 2) * d, *tail)
                sd |= {
                    t + f"self_attn.q_proj.{kind}": qkv[:, : r * d].reshape(n * d, *tail),
                    t + f"self_attn.k_proj.{kind}": qkv[:, r * d : (r + 1) * d].reshape(g * d, *tail),
                    t + f"self_attn.v_proj.{kind}": qkv[:, (r + 1) * d :].reshape(g * d, *tail),
                }
            if o + f"mlp.up.{kind}" in ours:
                up = ours[o + f"mlp.up.{kind}"]
                sd |= {t + f"mlp.gate_proj.{kind}": up[0::2], t + f"mlp.up_proj.{kind}": up[1::2]}
        for theirs, mine in [("self_attn.o_proj", "attention.proj"), ("mlp.down_proj", "mlp.down")]:
            if o + mine + ".bias" in ours:
                sd[t + theirs + ".bias"] = ours[o + mine + ".bias"]
    return sd


def _load_exported(hf: Any, sd: dict[str, torch.Tensor], cfg: ModelConfig, name: str) -> Any:
    missing, unexpected = hf.load_state_dict({k: v.contiguous() for k, v in sd.items()}, strict=False)
    missing = [k for k in missing if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise CheckpointError(f"{name} export: missing {missing}, unexpected {unexpected}")
    return hf.eval()


def to_llama(model: torch.nn.Module, cfg: ModelConfig) -> Any:
    """A transformers LlamaForCausalLM holding `model`'s weights."""
    from transformers import LlamaConfig, LlamaForCausalLM  # optional dependency (the bench extra)

    refuse(llama_unsupported(cfg), "LlamaForCausalLM")
    hf_cfg = LlamaConfig(
        **_llama_config(cfg),
        head_dim=head_dim(cfg),
        attention_bias=cfg.add_bias_linear,
        mlp_bias=mlp_bias(cfg),
    )
    return _load_exported(LlamaForCausalLM(hf_cfg), _llama_state_dict(model, cfg), cfg, "Llama")


def to_mistral(model: torch.nn.Module, cfg: ModelConfig) -> Any:
    """A transformers MistralForCausalLM holding `model`'s weights."""
    from transformers import MistralConfig, MistralForCausalLM  # optional dependency (the bench extra)

    refuse(mistral_unsupported(cfg), "MistralForCausalLM")
    hf_cfg = MistralConfig(**_llama_config(cfg), head_dim=head_dim(cfg), sliding_window=cfg.sliding_window)
    return _load_exported(MistralForCausalLM(hf_cfg), _llama_state_dict(model, cfg), cfg, "Mistral")


def to_qwen2(model: torch.nn.Module, cfg: ModelConfig) -> Any:
    """A transformers Qwen2ForCausalLM holding `model`'s weights (a sliding window: on every layer)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM  # optional dependency (the bench extra)

    refuse(qwen2_unsupported(cfg), "Qwen2ForCausalLM")
    window = cfg.sliding_window
    hf_cfg = Qwen2Config(
        **_llama_config(cfg),
        use_sliding_window=window is not None,
        sliding_window=window,
        max_window_layers=0,  # the window, when set, on every layer
    )
    return _load_exported(Qwen2ForCausalLM(hf_cfg), _llama_state_dict(model, cfg), cfg, "Qwen2")


def _llama_overrides(hf: Any, name: str, rope_types: tuple[str, ...]) -> tuple[list[str], dict[str, Any]]:
    """(what has no equivalent, the model.* settings) shared by Llama, Mistral and Qwen2 configs."""
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type", "default")
    problems = []
    if hf.hidden_act != "silu":
        problems.append(f"hidden_act = {hf.hidden_act!r} (SwiGLU here is silu-gated)")
    if rope_type not in rope_types:
        problems.append(
            f"rope_parameters.rope_type = {rope_type!r} ({' or '.join(rope_types)} here for {name})"
        )
    if rope_type == "llama3":
        fixed = {
            "low_freq_factor": LLAMA3_LOW_FREQ_FACTOR,
            "high_freq_factor": LLAMA3_HIGH_FREQ_FACTOR,
            "original_max_position_embeddings": LLAMA3_ORIGINAL_POSITIONS,
        }
        problems += [
            f"rope_parameters.{k} = {rope.get(k)!r} (Llama 3.1's {v} here)"
            for k, v in fixed.items()
            if rope.get(k) != v
        ]
    size = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    theta = float(rope.get("rope_theta", 10000.0))
    if not theta.is_integer():
        problems.append(f"rope_parameters.rope_theta = {theta} (model.rotary_base is an integer)")
    settings = {
        "type": "gpt",
        "num_layers": hf.num_hidden_layers,
        "hidden_size": hf.hidden_size,
        "num_attention_heads": hf.num_attention_heads,
        "num_query_groups": hf.num_key_value_heads or hf.num_attention_heads,
        "ffn_hidden_size": hf.intermediate_size,
        "max_position_embeddings": hf.max_position_embeddings,
        "vocab_size": hf.vocab_size,
        "make_vocab_size_divisible_by": 1,  # the vocabulary as the file has it
        "activation": "swiglu",
        "layernorm_epsilon": hf.rms_norm_eps,
        "position_embedding_type": "rotary",
        "rotary_base": int(theta) if theta.is_integer() else 10000,
        "rope_scaling": rope_type == "llama3",
        **({"rope_scaling_factor": float(rope["factor"])} if rope_type == "llama3" else {}),
        "norm": "rmsnorm",
        "apply_residual_connection_post_layernorm": False,
        "tie_word_embeddings": bool(hf.tie_word_embeddings),
    }
    if size * hf.num_attention_heads != hf.hidden_size:  # a head size of its own (Qwen3, Mistral Nemo)
        settings["kv_channels"] = size
    return problems, settings


def _refuse_config(problems: list[str], name: str) -> None:
    if problems:
        raise CheckpointError(
            f"no equivalent here for this Hugging Face {name} config: " + "; ".join(problems)
        )


def overrides_from_llama(hf: Any) -> dict[str, Any]:
    """The model.* settings (as `key: value`) describing a Hugging Face LlamaConfig; CheckpointError
    naming the setting when it has no equivalent here."""
    problems, settings = _llama_overrides(hf, "Llama", ("default", "llama3"))
    _refuse_config(problems, "Llama")
    attention, mlp = bool(hf.attention_bias), bool(getattr(hf, "mlp_bias", False))
    apart = {"add_mlp_bias": mlp} if mlp != attention else {}  # else add_mlp_bias follows add_bias_linear
    return settings | {"add_bias_linear": attention} | apart


def overrides_from_mistral(hf: Any) -> dict[str, Any]:
    """The model.* settings describing a Hugging Face MistralConfig (no biases; its sliding window, or
    None); CheckpointError naming the setting when it has no equivalent here."""
    problems, settings = _llama_overrides(hf, "Mistral", ("default",))
    if getattr(hf, "layer_types", None) and len(set(hf.layer_types)) > 1:
        problems.append(f"layer_types = {hf.layer_types} (one attention kind on every layer here)")
    _refuse_config(problems, "Mistral")
    return settings | {"add_bias_linear": False, "sliding_window": hf.sliding_window}


def overrides_from_qwen2(hf: Any) -> dict[str, Any]:
    """The model.* settings describing a Hugging Face Qwen2Config (biases on q/k/v only; a sliding
    window only when every layer has it); CheckpointError naming the setting otherwise."""
    problems, settings = _llama_overrides(hf, "Qwen2", ("default",))
    kinds = set(hf.layer_types or ["full_attention"])
    if len(kinds) > 1 or not kinds <= {"full_attention", "sliding_attention"}:
        problems.append(
            f"layer_types = {hf.layer_types} (use_sliding_window with max_window_layers = "
            f"{hf.max_window_layers} of {hf.num_hidden_layers}: one attention kind on every layer here)"
        )
    _refuse_config(problems, "Qwen2")
    window = hf.sliding_window if kinds == {"sliding_attention"} else None
    return settings | {"add_bias_linear": False, "add_qkv_bias": True, "sliding_window": window}


# ------------------------------------------------------------------------------------ MixtralForCausalLM
# Mistral's attention with every MLP a mixture of experts (MixtralSparseMoeBlock): `mlp.gate` is our
# router; transformers 5 stores the experts fused, gate_up_proj [E, 2f, h] (all gate rows, then all up
# rows: chunk(2)) and down_proj [E, h, f], applied as x @ W^T; our w_up [E, h, 2f] interleaves gate and
# value columns and w_down [E, f, h] is applied as x @ W. Mixtral's router: softmax, top-k renormalised.


def _moe_needs(name: str, cfg: ModelConfig, norm_topk_prob: tuple[bool, ...]) -> list[Needs]:
    needs = [
        Needs("moe_layer_freq", (1,), f"{name} has experts in every layer"),
        Needs("moe_first_k_dense", (0,), f"{name} has experts in every layer"),
        Needs("moe_shared_expert_size", (0,), f"{name} has no shared expert"),
        Needs("moe_router_score", ("softmax",), f"{name}'s router scores are a softmax"),
        Needs("moe_norm_topk_prob", norm_topk_prob, ""),
    ]
    if cfg.num_experts == 0:
        needs.append(Needs("num_experts", (), f"{name} is a mixture of experts"))
    return needs


def mixtral_unsupported(cfg: ModelConfig) -> list[str]:
    """Why a model has no MixtralForCausalLM equivalent (empty: it has one): Mistral's block with a
    mixture of experts in every layer, top-k scores renormalised. A capacity factor is a training
    setting: Mixtral computes every assignment, as our model does without one."""
    needs = [
        *_llama_block("Mixtral"),
        Needs("rope_scaling", (False,), "Mixtral has no Llama 3.1 scaling"),
        Needs("add_bias_linear", (False,), "Mixtral's linear layers have no biases"),
        *block_form("Mixtral", cfg, window=True, moe=True, head_size=True),
        *_moe_needs("Mixtral", cfg, (True,)),
    ]
    return mismatches(cfg, needs)


def _moe_state_dict(model: torch.nn.Module, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The MoE layers' router and experts under Mixtral's (and OLMoE's) names."""
    ours = model.state_dict()
    sd: dict[str, torch.Tensor] = {}
    for i in range(cfg.num_layers):
        o, t = f"layers.{i}.mlp.", f"model.layers.{i}.mlp."
        if o + "router.weight" not in ours:
            continue
        w_up, w_down = ours[o + "experts.w_up"], ours[o + "experts.w_down"]  # [E, h, 2f], [E, f, h]
        sd |= {
            t + "gate.weight": ours[o + "router.weight"],
            t + "experts.gate_up_proj": torch.cat([w_up[..., 0::2], w_up[..., 1::2]], dim=-1).transpose(1, 2),
            t + "experts.down_proj": w_down.transpose(1, 2),
        }
    return sd


def to_mixtral(model: torch.nn.Module, cfg: ModelConfig) -> Any:
    """A transformers MixtralForCausalLM holding `model`'s weights."""
    from transformers import MixtralConfig, MixtralForCausalLM  # optional dependency (the bench extra)

    refuse(mixtral_unsupported(cfg), "MixtralForCausalLM")
    hf_cfg = MixtralConfig(
        **(_llama_config(cfg) | {"intermediate_size": cfg.moe_ffn_hidden_size}),
        head_dim=head_dim(cfg),
        sliding_window=cfg.sliding_window,
        num_local_experts=cfg.num_experts,
        num_experts_per_tok=cfg.moe_router_topk,
        router_aux_loss_coef=cfg.moe_aux_loss_coeff,
    )
    sd = _llama_state_dict(model, cfg) | _moe_state_dict(model, cfg)
    return _load_exported(MixtralForCausalLM(hf_cfg), sd, cfg, "Mixtral")


def overrides_from_mixtral(hf: Any) -> dict[str, Any]:
    """The model.* settings describing a Hugging Face MixtralConfig (Mistral's, with num_local_experts
    SwiGLU experts of intermediate_size in every layer, num_experts_per_tok per token, renormalised);
    router_aux_loss_coef is carried as model.moe_aux_loss_coeff as it is, not rescaled (transformers'
    Mixtral loss sums the k choices' shares, k x ours, over all layers' tokens at once; ours is
    Megatron's, per layer); router_jitter_noise (training noise) is refused when set."""
    problems, settings = _llama_overrides(hf, "Mixtral", ("default",))
    if getattr(hf, "router_jitter_noise", 0.0):
        problems.append(f"router_jitter_noise = {hf.router_jitter_noise} (no router noise here)")
    _refuse_config(problems, "Mixtral")
    return settings | {
        "add_bias_linear": False,
        "sliding_window": hf.sliding_window,
        "num_experts": hf.num_local_experts,
        "moe_router_topk": hf.num_experts_per_tok,
        "moe_ffn_hidden_size": hf.intermediate_size,
        "moe_router_score": "softmax",
        "moe_norm_topk_prob": True,
        "moe_aux_loss_coeff": float(hf.router_aux_loss_coef),
    }


# ------------------------------------------------------------------------------------ OlmoeForCausalLM
# OLMoE: Llama's block without biases, q_norm / k_norm RMSNorms over the whole q and k projections
# (model.qk_norm = full; its q_norm is hidden_size wide, so the head size is hidden_size / heads) and a
# mixture of experts in every layer: a softmax router whose top-k scores are renormalised only with
# norm_topk_prob (OLMoE-1B-7B: not), experts stored as Mixtral's (`_moe_state_dict`).


def olmoe_unsupported(cfg: ModelConfig) -> list[str]:
    """Why a model has no OlmoeForCausalLM equivalent (empty: it has one)."""
    needs = [
        *_llama_block("OLMoE"),
        Needs("rope_scaling", (False,), "OLMoE has no Llama 3.1 scaling"),
        Needs("add_bias_linear", (False,), "OLMoE here has no linear biases"),
        *block_form("OLMoE", cfg, moe=True, qk_norm=("full",)),
        *_moe_needs("OLMoE", cfg, (True, False)),
    ]
    return mismatches(cfg, needs)


def to_olmoe(model: torch.nn.Module, cfg: ModelConfig) -> Any:
    """A transformers OlmoeForCausalLM holding `model`'s weights."""
    from transformers import OlmoeConfig, OlmoeForCausalLM  # optional dependency (the bench extra)

    refuse(olmoe_unsupported(cfg), "OlmoeForCausalLM")
    hf_cfg = OlmoeConfig(
        **(_llama_config(cfg) | {"intermediate_size": cfg.moe_ffn_hidden_size}),
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.moe_router_topk,
        norm_topk_prob=cfg.moe_norm_topk_prob,
        router_aux_loss_coef=cfg.moe_aux_loss_coeff,
        pad_token_id=None,  # the family's ids are not in our vocabulary
    )
    sd = _llama_state_dict(model, cfg) | _moe_state_dict(model, cfg)
    return _load_exported(OlmoeForCausalLM(hf_cfg), sd, cfg, "OLMoE")


def overrides_from_olmoe(hf: Any) -> dict[str, Any]:
    """The model.* settings describing a Hugging Face OlmoeConfig (see `olmoe_unsupported`);
    router_aux_loss_coef is carried as model.moe_aux_loss_coeff; clip_qkv (clamping q, k and v) and
    attention biases are refused when set. OLMoE's z-loss is a training setting its config does not
    hold (model.moe_z_loss_coeff stays as configured)."""
    problems, settings = _llama_overrides(hf, "OLMoE", ("default",))
    if getattr(hf, "clip_qkv", None) is not None:
        problems.append(f"clip_qkv = {hf.clip_qkv} (q, k and v are not clamped here)")
    if getattr(hf, "attention_bias", False):
        problems.append("attention_bias = true (OLMoE here has no linear biases)")
    if "kv_channels" in settings:
        problems.append(f"head_dim = {settings['kv_channels']} (OLMoE's q_norm is hidden_size wide)")
    _refuse_config(problems, "OLMoE")
    return settings | {
        "add_bias_linear": False,
        "qk_norm": "full",
        "num_experts": hf.num_experts,
        "moe_router_topk": hf.num_experts_per_tok,
        "moe_ffn_hidden_size": hf.intermediate_size,
        "moe_router_score": "softmax",
        "moe_norm_topk_prob": bool(hf.norm_topk_prob),
        "moe_aux_loss_coeff": float(hf.router_aux_loss_coef),
    }


# ------------------------------------------------------------------------- Qwen3(Moe)ForCausalLM
# Qwen3: Llama's block without biases, a head size of its own (head_dim) and an RMSNorm over each head's
# q and k (model.qk_norm = head: q_norm / k_norm of head_dim). Qwen3-MoE replaces the MLP of its sparse
# layers by a mixture of experts (experts stored as Mixtral's); which layers are sparse it says with
# decoder_sparse_step and mlp_only_layers, here with moe_layer_freq and moe_first_k_dense.


def _qwen3_needs(name: str, cfg: ModelConfig, moe: bool) -> list[Needs]:
    return [
        *_llama_block(name),
        Needs("rope_scaling", (False,), f"{name} here has no Llama 3.1 scaling"),
        Needs("add_bias_linear", (False,), f"{name} here has no linear biases"),
        *block_form(name, cfg, moe=moe, head_size=True, qk_norm=("head",)),
    ]


def qwen3_unsupported(cfg: ModelConfig) -> list[str]:
    """Why a model has no Qwen3ForCausalLM equivalent (empty: it has one)."""
    return mismatches(cfg, _qwen3_needs("Qwen3", cfg, moe=False))


def qwen3_moe_unsupported(cfg: ModelConfig) -> list[str]:
    """Why a model has no Qwen3MoeForCausalLM equivalent (empty: it has one). Any pattern of MoE layers
    has one: the export lists the dense ones as mlp_only_layers."""
    needs = [
        *_qwen3_needs("Qwen3-MoE", cfg, moe=True),
        Needs("moe_shared_expert_size", (0,), "Qwen3-MoE has no shared expert"),
        Needs("moe_router_score", ("softmax",), "Qwen3-MoE's router scores are a softmax"),
    ]
    if cfg.num_experts == 0:
        needs.append(Needs("num_experts", (), "Qwen3-MoE is a mixture of experts"))
    return mismatches(cfg, needs)


def to_qwen3(model: torch.nn.Module, cfg: ModelConfig) -> Any:
    """A transformers Qwen3ForCausalLM holding `model`'s weights."""
    from transformers import Qwen3Config, Qwen3ForCausalLM  # optional dependency (the bench extra)

    refuse(qwen3_unsupported(cfg), "Qwen3ForCausalLM")
    hf_cfg = Qwen3Config(
        **_llama_config(cfg), head_dim=head_dim(cfg), attention_bias=False, use_sliding_window=False
    )
    return _load_exported(Qwen3ForCausalLM(hf_cfg), _llama_state_dict(model, cfg), cfg, "Qwen3")


def to_qwen3_moe(model: torch.nn.Module, cfg: ModelConfig) -> Any:
    """A transformers Qwen3MoeForCausalLM holding `model`'s weights (every dense layer in mlp_only_layers)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # optional dependency (the bench extra)

    refuse(qwen3_moe_unsupported(cfg), "Qwen3MoeForCausalLM")
    # Qwen3MoeConfig declares no head_dim; it keeps it as an attribute, which its attention reads
    own: dict[str, Any] = {"head_dim": head_dim(cfg)}
    hf_cfg = Qwen3MoeConfig(
        **_llama_config(cfg),
        **own,
        attention_bias=False,
        use_sliding_window=False,
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.moe_router_topk,
        moe_intermediate_size=moe_ffn(cfg),
        norm_topk_prob=cfg.moe_norm_topk_prob,
        router_aux_loss_coef=cfg.moe_aux_loss_coeff,
        decoder_sparse_step=1,
        mlp_only_layers=[i for i in range(cfg.num_layers) if not is_moe_layer(cfg, i)],
    )
    sd = _llama_state_dict(model, cfg) | _moe_state_dict(model, cfg)
    return _load_exported(Qwen3MoeForCausalLM(hf_cfg), sd, cfg, "Qwen3-MoE")


def _qwen3_overrides(hf: Any, name: str) -> dict[str, Any]:
    problems, settings = _llama_overrides(hf, name, ("default",))
    if getattr(hf, "attention_bias", False):
        problems.append(f"attention_bias = true ({name} here has no linear biases)")
    if getattr(hf, "use_sliding_window", False):
        problems.append(f"use_sliding_window = true ({name} here attends to the whole sequence)")
    _refuse_config(problems, name)
    return settings | {"add_bias_linear": False, "qk_norm": "head"}


def overrides_from_qwen3(hf: Any) -> dict[str, Any]:
    """The model.* settings describing a Hugging Face Qwen3Config (head_dim as model.kv_channels, per-head
    q/k norms); attention biases and sliding windows are refused."""
    return _qwen3_overrides(hf, "Qwen3")


def _moe_pattern(layers: int, sparse: list[int]) -> tuple[int, int] | None:
    """(moe_layer_freq, moe_first_k_dense) giving exactly the `sparse` layers of `layers`, or None."""
    for freq in range(1, layers + 1):
        for first in range(layers + 1):
            if [i for i in range(layers) if i >= first and i % freq == 0] == sparse:
                return freq, first
    return None


def overrides_from_qwen3_moe(hf: Any) -> dict[str, Any]:
    """The model.* settings describing a Hugging Face Qwen3MoeConfig: Qwen3's, with num_experts experts of
    moe_intermediate_size in its sparse layers (layer i unless in mlp_only_layers, and (i + 1) a multiple
    of decoder_sparse_step), carried as moe_layer_freq and moe_first_k_dense when they give the same
    layers, refused by name otherwise; norm_topk_prob and router_aux_loss_coef carried."""
    layers = hf.num_hidden_layers
    only = set(hf.mlp_only_layers or [])
    sparse = [i for i in range(layers) if i not in only and (i + 1) % hf.decoder_sparse_step == 0]
    pattern = _moe_pattern(layers, sparse) if hf.num_experts > 0 else None
    if pattern is None:
        raise CheckpointError(
            f"no equivalent here for this Hugging Face Qwen3-MoE config: decoder_sparse_step = "
            f"{hf.decoder_sparse_step}, mlp_only_layers = {sorted(only)}, num_experts = {hf.num_experts} "
            f"make layers {sparse} sparse; MoE layers here are those i >= model.moe_first_k_dense with i a "
            "multiple of model.moe_layer_freq"
        )
    return _qwen3_overrides(hf, "Qwen3-MoE") | {
        "num_experts": hf.num_experts,
        "moe_router_topk": hf.num_experts_per_tok,
        "moe_ffn_hidden_size": hf.moe_intermediate_size,
        "moe_router_score": "softmax",
        "moe_norm_topk_prob": bool(hf.norm_topk_prob),
        "moe_aux_loss_coeff": float(hf.router_aux_loss_coef),
        "moe_layer_freq": pattern[0],
        "moe_first_k_dense": pattern[1],
    }


# ------------------------------------------------------------------------------------ GPTNeoXForCausalLM
# Rotary GPTs with LayerNorm and an ungated GELU MLP (GPT-NeoX, Pythia): NeoX's fused query_key_value
# is laid out per head as [q_d | k_d | v_d], as ours is; its rotate-half RoPE over the first
# int(head_dim x partial_rotary_factor) channels is ours (model.rotary_percent); its parallel residual
# (use_parallel_residual, Pythia's) is model.parallel_residual.


def neox_unsupported(cfg: ModelConfig) -> list[str]:
    """Why a model has no GPTNeoXForCausalLM equivalent (empty: it has one)."""
    needs = [GPT, *classic_block("GPT-NeoX", "rotary", "MLP has"), pre_ln("GPT-NeoX")]
    needs.append(Needs("rope_scaling", (False,), "GPT-NeoX has no Llama 3.1 scaling"))
    needs += block_form("GPT-NeoX", cfg, parallel=True, rotary_percent=True)
    return mismatches(cfg, needs, one_kv_head_per_head="GPT-NeoX")


def to_neox(model: torch.nn.Module, cfg: ModelConfig) -> Any:
    """A transformers GPTNeoXForCausalLM holding `model`'s weights."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM  # optional dependency (the bench extra)

    refuse(neox_unsupported(cfg), "GPTNeoXForCausalLM")
    assert cfg.vocab_size is not None and cfg.max_position_embeddings is not None
    assert cfg.ffn_hidden_size is not None
    hf_cfg = GPTNeoXConfig(
        vocab_size=padded_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by),
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        intermediate_size=cfg.ffn_hidden_size,
        hidden_act="gelu" if cfg.activation == "gelu" else "gelu_new",
        max_position_embeddings=cfg.max_position_embeddings,
        layer_norm_eps=cfg.layernorm_epsilon,
        use_parallel_residual=cfg.parallel_residual,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": float(cfg.rotary_base),
            "partial_rotary_factor": cfg.rotary_percent,
        },
        attention_bias=True,
        attention_dropout=cfg.attention_dropout,
        hidden_dropout=cfg.hidden_dropout,
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=None,
    )
    ours = model.state_dict()
    sd: dict[str, torch.Tensor] = {
        "gpt_neox.embed_in.weight": ours["embedding.word.weight"],
        "gpt_neox.final_layer_norm.weight": ours["final_norm.weight"],
        "gpt_neox.final_layer_norm.bias": ours["final_norm.bias"],
    }
    if not cfg.tie_word_embeddings:
        sd["lm_head.weight"] = ours["output.weight"]
    names = {
        "norm1": "input_layernorm",
        "norm2": "post_attention_layernorm",
        "attention.qkv": "attention.query_key_value",
        "attention.proj": "attention.dense",
        "mlp.up": "mlp.dense_h_to_4h",
        "mlp.down": "mlp.dense_4h_to_h",
    }
    for i in range(cfg.num_layers):
        for ours_name, hf_name in names.items():
            for kind in ("weight", "bias"):
                sd[f"gpt_neox.layers.{i}.{hf_name}.{kind}"] = ours[f"layers.{i}.{ours_name}.{kind}"]
    hf = GPTNeoXForCausalLM(hf_cfg)
    missing, unexpected = hf.load_state_dict({k: v.contiguous() for k, v in sd.items()}, strict=False)
    missing = [k for k in missing if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise CheckpointError(f"GPT-NeoX export: missing {missing}, unexpected {unexpected}")
    return hf.eval()


def overrides_from_neox(hf: Any) -> dict[str, Any]:
    """The model.* settings (as `key: value`) describing a Hugging Face GPTNeoXConfig; CheckpointError
    naming the setting when it has no equivalent here."""
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    problems = []
    if rope.get("rope_type", "default") != "default":
        problems.append(f"rope_parameters.rope_type = {rope['rope_type']!r} (default here)")
    if hf.hidden_act not in ("gelu", "gelu_new"):
        problems.append(f"hidden_act = {hf.hidden_act!r} (gelu or gelu_new here)")
    if not hf.attention_bias:
        problems.append("attention_bias = false (the MLP has biases; model.add_bias_linear sets both)")
    theta = float(rope.get("rope_theta", 10000.0))
    if not theta.is_integer():
        problems.append(f"rope_parameters.rope_theta = {theta} (model.rotary_base is an integer)")
    if problems:
        raise CheckpointError(
            "no equivalent here for this Hugging Face GPT-NeoX config: " + "; ".join(problems)
        )
    return {
        "type": "gpt",
        "num_layers": hf.num_hidden_layers,
        "hidden_size": hf.hidden_size,
        "num_attention_heads": hf.num_attention_heads,
        "ffn_hidden_size": hf.intermediate_size,
        "max_position_embeddings": hf.max_position_embeddings,
        "vocab_size": hf.vocab_size,
        "activation": "gelu" if hf.hidden_act == "gelu" else "openai-gelu",
        "layernorm_epsilon": hf.layer_norm_eps,
        "position_embedding_type": "rotary",
        "rotary_base": int(theta),
        "rotary_percent": float(rope.get("partial_rotary_factor", 1.0)),
        "parallel_residual": bool(hf.use_parallel_residual),
        "norm": "layernorm",
        "add_bias_linear": True,
        "make_vocab_size_divisible_by": 1,  # the vocabulary as the file has it
        "apply_residual_connection_post_layernorm": False,
        "tie_word_embeddings": bool(hf.tie_word_embeddings),
    }
