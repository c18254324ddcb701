"""What keeps a model from a Hugging Face architecture: its settings against the ones the class holds.

Each family's hf.py states, per architecture, the values it needs (`Needs`); `mismatches` names every
setting of a config outside them, in the form `stx config validate` and `stx export` print.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from scalable_transformer.config.schema import ModelConfig
from scalable_transformer.errors import CheckpointError


@dataclass(frozen=True)
class Needs:
    """One setting an architecture needs: `key` (a ModelConfig field) must be one of `values`; `why`
    says what the architecture has instead."""

    key: str
    values: tuple[Any, ...]
    why: str = ""


def _shown(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def mismatches(cfg: ModelConfig, needs: list[Needs], one_kv_head_per_head: str | None = None) -> list[str]:
    """`model.KEY = VALUE (why)` for each need cfg misses. one_kv_head_per_head: the architecture's
    name when it has no grouped-query attention (num_query_groups must equal the heads)."""
    reasons = []
    for need in needs:
        value = getattr(cfg, need.key)
        if value not in need.values:
            reasons.append(f"model.{need.key} = {_shown(value)}" + (f" ({need.why})" if need.why else ""))
    if one_kv_head_per_head and (cfg.num_query_groups or cfg.num_attention_heads) != cfg.num_attention_heads:
        reasons.append(
            f"model.num_query_groups = {cfg.num_query_groups} "
            f"({one_kv_head_per_head} has one key/value head per head)"
        )
    return reasons


def classic_block(name: str, positions: str, biases: str) -> list[Needs]:
    """The needs of a GPT-2/BERT/NeoX-style block: LayerNorm, an ungated GELU MLP, linear biases;
    positions 'learned' or 'rotary'."""
    how = "learns positions" if positions == "learned" else f"uses {positions}"
    return [
        Needs("position_embedding_type", (positions,), f"{name} {how}"),
        Needs("norm", ("layernorm",), f"{name} uses LayerNorm"),
        Needs("activation", ("gelu", "openai-gelu"), f"{name} has an ungated MLP"),
        Needs("add_bias_linear", (True,), f"{name}'s {biases} biases"),
    ]


GPT = Needs("type", ("gpt",))


def block_form(
    name: str,
    cfg: ModelConfig,
    parallel: bool = False,
    window: bool = False,
    qkv_bias: tuple[bool, ...] | None = None,
    rotary_percent: bool = False,
    mlp_bias: bool = False,
    moe: bool = False,
    head_size: bool = False,
    qk_norm: tuple[str, ...] = ("none",),
) -> list[Needs]:
    """The needs of the newer block settings, for an architecture that has (True) or lacks (False)
    the parallel residual, a sliding window, partial rotary, an MLP bias set apart from the other
    linear layers', mixture-of-experts MLPs (whose own settings the architecture checks: `moe`
    only lifts the dense-MLP need); qkv_bias: the q/k/v bias values it holds (None: only
    add_bias_linear's, the same bias on every linear layer); head_size: whether it has a head size of
    its own (HF head_dim: model.kv_channels) or only hidden_size / num_attention_heads; qk_norm: the
    model.qk_norm values it holds (its q_norm / k_norm: none, per head, over the whole projection)."""
    needs = []
    own_size = cfg.kv_channels is not None and cfg.kv_channels * cfg.num_attention_heads != cfg.hidden_size
    if own_size and not head_size:
        needs.append(
            Needs("kv_channels", (None,), f"{name}'s head size is hidden_size / num_attention_heads")
        )
    kinds = {"none": "no q/k norm", "head": "a q/k norm per head", "full": "a q/k norm over all heads"}
    needs.append(Needs("qk_norm", qk_norm, f"{name} has {' or '.join(kinds[q] for q in qk_norm)}"))
    if not moe:
        needs.append(Needs("num_experts", (0,), f"{name} has a dense MLP in every layer"))
    if not mlp_bias and cfg.add_mlp_bias not in (None, cfg.add_bias_linear):
        needs.append(
            Needs(
                "add_mlp_bias",
                (None, cfg.add_bias_linear),
                f"{name}'s MLP bias is that of its other linear layers",
            )
        )
    if not parallel:
        needs.append(Needs("parallel_residual", (False,), f"{name} blocks are sequential"))
    if not window:
        needs.append(Needs("sliding_window", (None,), f"{name} attends to the whole sequence"))
    if not rotary_percent:
        needs.append(Needs("rotary_percent", (1.0,), f"{name} rotates whole heads"))
    allowed = (cfg.add_bias_linear,) if qkv_bias is None else qkv_bias
    if (cfg.add_bias_linear if cfg.add_qkv_bias is None else cfg.add_qkv_bias) not in allowed:
        why = "its q/k/v bias is that of its other linear layers" if qkv_bias is None else ""
        needs.append(Needs("add_qkv_bias", allowed, why or f"{name}'s q/k/v bias is {_shown(allowed[0])}"))
    return needs


def pre_ln(name: str) -> Needs:
    return Needs("apply_residual_connection_post_layernorm", (False,), f"{name} is pre-LN")


def refuse(reasons: list[str], name: str = "Hugging Face") -> None:
    """Raise the export's error when `reasons` (from a `*_unsupported` checker) is not empty."""
    if reasons:
        raise CheckpointError(f"no {name} equivalent for this model: " + "; ".join(reasons))
