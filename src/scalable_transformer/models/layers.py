"""Building blocks shared by BERT and GPT: embeddings, attention, MLP, transformer block, init.

Shape legend: b batch, s sequence, h hidden, n heads (local: tensor parallel may give fewer),
g key/value groups (local too), r query heads per group, d head dim, f MLP inner size, v padded
vocabulary, p max positions.

Block contract, relied on by parallel/ (activation checkpointing, FSDP, pipeline stages):
    TransformerBlock.forward(x_bsh, attention_mask_b11s_or_None, rotary_or_None) -> x_bsh
where the mask is boolean (True = may attend) and rotary is the (cos_sd, sin_sd) pair from
`RotaryEmbedding`. `block.attention.core` is the softmax(QK^T)V part alone, so selective
checkpointing can recompute just it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from scalable_transformer.config.model_shapes import (
    attention_width,
    gated_mlp,
    is_moe_layer,
    mlp_bias,
    qkv_bias,
    qkv_width,
    query_groups,
)
from scalable_transformer.config.rules import check_model, head_dim
from scalable_transformer.config.schema import ModelConfig, check_section
from scalable_transformer.models.context_parallel import ContextParallel, context_parallel_mask
from scalable_transformer.models.moe import GroupedExperts, MoELayer

_CHOICES = {
    "activation": ("gelu", "openai-gelu", "geglu", "swiglu"),
    "norm": ("layernorm", "rmsnorm"),
    "qk_norm": ("none", "head", "full"),
    "position_embedding_type": ("learned", "sinusoidal", "rotary", "alibi"),
}


def check_model_config(cfg: ModelConfig) -> None:
    """Raise ValueError naming the field if cfg is unresolved or cannot build a model. The rules
    themselves live in config/ (field bounds in the schema, the rest in `config.rules.check_model`);
    this is the check for models built from a config that never went through `resolve`."""
    for name in ("vocab_size", "ffn_hidden_size", "max_position_embeddings"):
        if getattr(cfg, name) is None:
            raise ValueError(f"model.{name} is None: resolve the config (config.validate.resolve) first")
    for name, choices in _CHOICES.items():
        if getattr(cfg, name) not in choices:
            raise ValueError(f"model.{name}={getattr(cfg, name)!r} is not one of {choices}")
    check_section("model", cfg)
    check_model(cfg)


def make_norm(cfg: ModelConfig, features: int | None = None) -> nn.Module:
    """model.norm's kind over `features` (default hidden_size) with model.layernorm_epsilon."""
    size = cfg.hidden_size if features is None else features
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(size, eps=cfg.layernorm_epsilon)
    return nn.LayerNorm(size, eps=cfg.layernorm_epsilon)


# Llama 3.1's rotary scaling constants (Megatron hard-codes the same; only the factor is an option).
LLAMA3_LOW_FREQ_FACTOR, LLAMA3_HIGH_FREQ_FACTOR, LLAMA3_ORIGINAL_POSITIONS = 1.0, 4.0, 8192


def llama3_scaled(inv_freq: torch.Tensor, factor: float) -> torch.Tensor:
    """Llama 3.1's frequency scaling: wavelengths above original/low_freq_factor are divided by
    `factor`, those below original/high_freq_factor kept, and the band between interpolated."""
    low_wavelen = LLAMA3_ORIGINAL_POSITIONS / LLAMA3_LOW_FREQ_FACTOR
    high_wavelen = LLAMA3_ORIGINAL_POSITIONS / LLAMA3_HIGH_FREQ_FACTOR
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (LLAMA3_ORIGINAL_POSITIONS / wavelen - LLAMA3_LOW_FREQ_FACTOR) / (
        LLAMA3_HIGH_FREQ_FACTOR - LLAMA3_LOW_FREQ_FACTOR
    )
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _frequencies(dim: int, base: float, positions: int, llama3_factor: float | None = None) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if llama3_factor is not None:
        inv_freq = llama3_scaled(inv_freq, llama3_factor)
    return torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq)  # [p, dim/2]


class Embedding(nn.Module):
    """word + position (learned or sinusoidal) + token type, then (post-LN only) norm, then dropout."""

    sinusoid_ph: torch.Tensor | None

    def __init__(self, cfg: ModelConfig, vocab: int, num_tokentypes: int) -> None:
        super().__init__()
        assert cfg.max_position_embeddings is not None
        self.hidden_size = cfg.hidden_size
        self.max_positions = cfg.max_position_embeddings
        self.position_type = cfg.position_embedding_type
        self.word = nn.Embedding(vocab, cfg.hidden_size)
        self.position = (
            nn.Embedding(self.max_positions, cfg.hidden_size) if self.position_type == "learned" else None
        )
        self.tokentype = nn.Embedding(num_tokentypes, cfg.hidden_size) if num_tokentypes > 0 else None
        # Post-LN blocks end on a norm, so the stack's input must be normalized too (original BERT).
        self.norm = make_norm(cfg) if cfg.apply_residual_connection_post_layernorm else None
        self.dropout = nn.Dropout(cfg.hidden_dropout)
        # Non-persistent: derived from the config, so checkpoints and state-dict sharding never see it.
        sinusoid_ph = self._sinusoid() if self.position_type == "sinusoidal" else None
        self.register_buffer("sinusoid_ph", sinusoid_ph, persistent=False)

    def _sinusoid(self) -> torch.Tensor:
        angles = _frequencies(self.hidden_size, 10000.0, self.max_positions)
        return torch.cat([angles.sin(), angles.cos()], dim=-1)

    def reset_buffers(self) -> None:
        if self.sinusoid_ph is not None:
            self.sinusoid_ph = self._sinusoid().to(self.sinusoid_ph.device)

    def forward(
        self,
        input_ids_bs: torch.Tensor,
        token_type_ids_bs: torch.Tensor | None = None,
        positions_bs: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """positions_bs: each token's position (packed documents restart at 0); default 0..s-1."""
        seq = input_ids_bs.shape[1]
        if seq > self.max_positions:
            raise ValueError(f"sequence length {seq} > model.max_position_embeddings={self.max_positions}")
        x_bsh = self.word(input_ids_bs)
        if self.position is not None:
            positions = (
                torch.arange(seq, device=input_ids_bs.device) if positions_bs is None else positions_bs
            )
            x_bsh = x_bsh + self.position(positions)
        elif self.sinusoid_ph is not None:
            table = self.sinusoid_ph[:seq] if positions_bs is None else self.sinusoid_ph[positions_bs]
            x_bsh = x_bsh + table.to(x_bsh.dtype)
        if self.tokentype is not None:
            if token_type_ids_bs is None:
                token_type_ids_bs = torch.zeros_like(input_ids_bs)
            x_bsh = x_bsh + self.tokentype(token_type_ids_bs)
        if self.norm is not None:
            x_bsh = self.norm(x_bsh)
        return self.dropout(x_bsh)


class RotaryEmbedding(nn.Module):
    """cos/sin tables of rotate-half RoPE over the first `head_dim` channels of each head (all of them,
    or the rotary part under partial rotary: `rotary_dim`); no parameters. llama3_factor: Llama 3.1's
    frequency scaling with that factor (`llama3_scaled`), None for plain RoPE."""

    cos_pd: torch.Tensor
    sin_pd: torch.Tensor

    def __init__(
        self, head_dim: int, base: float, max_positions: int, llama3_factor: float | None = None
    ) -> None:
        super().__init__()
        self.head_dim, self.base, self.max_positions = head_dim, base, max_positions
        self.llama3_factor = llama3_factor
        cos_pd, sin_pd = self._tables()
        self.register_buffer("cos_pd", cos_pd, persistent=False)
        self.register_buffer("sin_pd", sin_pd, persistent=False)

    def _tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        angles = _frequencies(self.head_dim, self.base, self.max_positions, self.llama3_factor)
        angles_pd = torch.cat([angles, angles], dim=-1)  # rotate-half pairs channel i with i + d/2
        return angles_pd.cos(), angles_pd.sin()

    def reset_buffers(self) -> None:
        cos_pd, sin_pd = self._tables()
        self.cos_pd, self.sin_pd = cos_pd.to(self.cos_pd.device), sin_pd.to(self.sin_pd.device)

    def forward(
        self, seq: int, positions_bs: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The [s, d] tables of positions 0..s-1, or with positions_bs (packed documents) each token's
        row as [b, 1, s, d], broadcast over the heads."""
        if seq > self.max_positions:
            raise ValueError(f"sequence length {seq} > model.max_position_embeddings={self.max_positions}")
        if positions_bs is not None:
            return self.cos_pd[positions_bs].unsqueeze(1), self.sin_pd[positions_bs].unsqueeze(1)
        return self.cos_pd[:seq], self.sin_pd[:seq]


def rotary_for(cfg: ModelConfig) -> RotaryEmbedding | None:
    """The model's rotary tables (with Llama 3.1 scaling if configured), or None without rotary."""
    if cfg.position_embedding_type != "rotary":
        return None
    assert cfg.max_position_embeddings is not None
    factor = cfg.rope_scaling_factor if cfg.rope_scaling else None
    return RotaryEmbedding(rotary_dim(cfg), cfg.rotary_base, cfg.max_position_embeddings, factor)


def rotary_dim(cfg: ModelConfig) -> int:
    """Channels of each head that rotary positions rotate: int(head_dim * rotary_percent), the first
    ones (GPT-NeoX's rotary_ndims, HF GPTNeoX's and Megatron's rounding: truncated, not rounded)."""
    return int(head_dim(cfg) * cfg.rotary_percent)


def apply_rotary(x_bnsd: torch.Tensor, cos_sd: torch.Tensor, sin_sd: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE over the first cos_sd.shape[-1] channels; the rest pass unchanged."""
    rot = cos_sd.shape[-1]
    x_rot, x_pass = (x_bnsd, None) if rot == x_bnsd.shape[-1] else (x_bnsd[..., :rot], x_bnsd[..., rot:])
    x1, x2 = x_rot.chunk(2, dim=-1)
    rotated_bnsd = torch.cat([-x2, x1], dim=-1)
    out = x_rot * cos_sd.to(x_bnsd.dtype) + rotated_bnsd * sin_sd.to(x_bnsd.dtype)
    return out if x_pass is None else torch.cat([out, x_pass], dim=-1)


def alibi_slopes(heads: int) -> list[float]:
    """ALiBi's per-head slopes (Press et al. 2022; BLOOM, MPT and GPT-NeoX compute the same): for a
    power of two n, the geometric sequence 2^(-8/n), 2^(-16/n), ...; otherwise those of the largest
    power of two below n, then every other slope of twice that power for the remaining heads."""
    closest = 2 ** math.floor(math.log2(heads))
    slopes = [2.0 ** (-8.0 * (i + 1) / closest) for i in range(closest)]
    extra = [2.0 ** (-8.0 * (i + 1) / (2 * closest)) for i in range(2 * closest)][0::2]
    return slopes + extra[: heads - closest]


class CoreAttention(nn.Module):
    """softmax(q k^T / sqrt(d) + bias) v with dropout: the activation-heavy part (O(s^2) per head). k
    and v may have fewer heads (g groups, grouped-query attention): each serves n / g consecutive q
    heads. window: causal attention sees at most that many positions, itself included (Mistral's
    sliding window: key j is visible from query i when i - window < j <= i). slopes: ALiBi's slopes
    of the heads this module computes (tensor parallelism keeps each rank's heads', see
    parallel/tensor.py), a bias slope * (j - i) on the scores.

    Context parallelism (`context_parallel` set, models/context_parallel.py): q, k and v hold this
    rank's tokens; k and v of every cp rank are gathered (the g key/value heads only) and the mask,
    which the model then always passes, covers the local queries against all keys."""

    def __init__(
        self, dropout: float, causal: bool, window: int | None = None, slopes: list[float] | None = None
    ) -> None:
        super().__init__()
        self.dropout, self.causal, self.window = dropout, causal, window
        # plain lists, not buffers: derived from the config, on no device; `slopes` are the heads'
        # this module computes (all of them until tensor parallelism keeps a rank's, `keep_heads`)
        self.all_slopes = self.slopes = slopes
        self.context_parallel: ContextParallel | None = None  # set by parallel/context.py

    def keep_heads(self, start: int, stop: int) -> None:
        """Compute query heads start..stop-1 of the model's only (a tensor-parallel rank's)."""
        if self.all_slopes is not None:
            self.slopes = self.all_slopes[start:stop]

    def bias(self, s: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
        """The [s, s] boolean mask (True: may attend) or [n, s, s] additive bias of a sliding window
        or ALiBi, causality included; None for plain causal or full attention (SDPA's own is_causal
        is faster). A model computes it once per forward for all its blocks (`shared_bias`)."""
        if self.slopes is None and (self.window is None or self.window >= s):
            return None
        i_s1 = torch.arange(s, device=device).unsqueeze(1)
        j_1s = torch.arange(s, device=device).unsqueeze(0)
        allowed_ss = j_1s <= i_s1 if self.causal else torch.ones(s, s, dtype=torch.bool, device=device)
        if self.window is not None:
            allowed_ss = allowed_ss & (i_s1 - j_1s < self.window)
        if self.slopes is None:
            return allowed_ss
        slopes_n11 = torch.tensor(self.slopes, dtype=torch.float32, device=device).view(-1, 1, 1)
        bias_nss = slopes_n11 * (j_1s - i_s1).float()
        return bias_nss.masked_fill(~allowed_ss, float("-inf")).to(dtype)

    def forward(
        self, q_bnsd: torch.Tensor, k_bgsd: torch.Tensor, v_bgsd: torch.Tensor, mask_b11s: torch.Tensor | None
    ) -> torch.Tensor:
        """mask_b11s: a padding mask (BERT), or the model's `shared_bias`, which holds causality;
        None: this module's own bias (if any) is computed here."""
        if self.context_parallel is not None:
            # one collective for both: [2, b, g, s, d] gathered along the sequence
            kv_2bgSd = self.context_parallel.gather_sequence(torch.stack([k_bgsd, v_bgsd]), 3)
            k_bgsd, v_bgsd = kv_2bgSd.unbind(0)
            if mask_b11s is None:  # plain causal attention (context_parallel_inputs): no mask needed
                return self._causal_blocks(q_bnsd, k_bgsd, v_bgsd)
        elif mask_b11s is None:
            mask_b11s = self.bias(q_bnsd.shape[-2], q_bnsd.device, q_bnsd.dtype)
        # SDPA's enable_gqa rather than repeating k/v heads: 2-7% faster here (CPU fp32, fwd+bwd,
        # b4 n8 g2 s256 d64: 12.7 vs 13.0 ms; b2 n16 g4 s512: 51.5 vs 55.4 ms) and no copies.
        return F.scaled_dot_product_attention(
            q_bnsd,
            k_bgsd,
            v_bgsd,
            attn_mask=mask_b11s,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=self.causal and mask_b11s is None,
            enable_gqa=k_bgsd.shape[1] != q_bnsd.shape[1],
        )

    def _causal_blocks(
        self, q_bnsd: torch.Tensor, k_bgSd: torch.Tensor, v_bgSd: torch.Tensor
    ) -> torch.Tensor:
        """Causal context-parallel attention without a mask of global positions: each of this rank's
        two chunks (global chunk i of 2cp, c tokens) attends the keys up to its own end, (i + 1) c of
        them, lower-right aligned, so the masked half is skipped as on one rank and the rank's two
        chunks (i = r and 2cp-1-r) do equal work whatever r (config.model_shapes.causal_blocks_under_cp).
        On a GPU torch's `causal_lower_right` bias, which the flash and memory-efficient kernels take;
        on a CPU, whose kernels take no such bias (torch would materialize it in fp32 at every layer), an
        additive mask made once and shared by the layers (`ContextParallel.lower_right_mask`); the first
        chunk (i = 0) is plain causal."""
        cp = self.context_parallel
        assert cp is not None
        c = q_bnsd.shape[-2] // 2
        out = []
        for j, i in enumerate((cp.rank, 2 * cp.size - 1 - cp.rank)):
            keys = (i + 1) * c
            mask: Any = None
            if i > 0 and q_bnsd.device.type == "cpu":
                mask = cp.lower_right_mask(c, keys, q_bnsd.dtype, q_bnsd.device)
            elif i > 0:
                mask = causal_lower_right(c, keys)
            out.append(
                F.scaled_dot_product_attention(
                    q_bnsd[..., j * c : (j + 1) * c, :],
                    k_bgSd[..., :keys, :],
                    v_bgSd[..., :keys, :],
                    attn_mask=mask,
                    dropout_p=self.dropout if self.training else 0.0,
                    is_causal=i == 0,
                    enable_gqa=k_bgSd.shape[1] != q_bnsd.shape[1],
                )
            )
        return torch.cat(out, dim=-2)


class Attention(nn.Module):
    """Self-attention with n query heads of d features (model.kv_channels, default h / n) in g
    key/value groups. model.qk_norm adds q_norm and k_norm, applied after the projection and before
    rotary: `head` norms each head's d features (one [d] weight shared by the heads, q and k each),
    `full` all of q's n d features and all of k's g d (one norm each over the whole projection)."""

    def __init__(self, cfg: ModelConfig, causal: bool) -> None:
        super().__init__()
        self.head_dim = head_dim(cfg)
        self.heads_per_group = cfg.num_attention_heads // query_groups(cfg)
        # Columns are laid out per key/value group as [q of its r heads | k_d | v_d] (Megatron; with
        # one head per group the per-head [q_d | k_d | v_d]), so a column-parallel split gives each
        # tensor-parallel rank whole groups with their own q, k and v.
        self.qkv = nn.Linear(cfg.hidden_size, qkv_width(cfg), bias=qkv_bias(cfg))
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm != "none":
            full = cfg.qk_norm == "full"
            self.q_norm = make_norm(cfg, attention_width(cfg) if full else self.head_dim)
            self.k_norm = make_norm(cfg, query_groups(cfg) * self.head_dim if full else self.head_dim)
        slopes = alibi_slopes(cfg.num_attention_heads) if cfg.position_embedding_type == "alibi" else None
        self.core = CoreAttention(cfg.attention_dropout, causal, cfg.sliding_window, slopes)
        self.proj = nn.Linear(attention_width(cfg), cfg.hidden_size, bias=cfg.add_bias_linear)

    def _norm_qk(self, q_bnsd: torch.Tensor, k_bgsd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.qk_norm == "head":
            return self.q_norm(q_bnsd), self.k_norm(k_bgsd)
        # full: one norm over every head's features of a position (tp = 1: config.rules refuses more)
        q_bsx, k_bsx = q_bnsd.transpose(1, 2).flatten(2), k_bgsd.transpose(1, 2).flatten(2)
        q_bnsd = self.q_norm(q_bsx).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
        return q_bnsd, self.k_norm(k_bsx).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)

    def forward(
        self,
        x_bsh: torch.Tensor,
        mask_b11s: torch.Tensor | None,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        b, s, _ = x_bsh.shape
        d, r = self.head_dim, self.heads_per_group
        qkv_bsgx = self.qkv(x_bsh).view(b, s, -1, (r + 2) * d)
        q_bsgx, k_bsgd, v_bsgd = qkv_bsgx.split([r * d, d, d], dim=-1)
        q_bnsd = q_bsgx.reshape(b, s, -1, d).transpose(1, 2)
        k_bgsd, v_bgsd = k_bsgd.transpose(1, 2), v_bsgd.transpose(1, 2)
        if self.qk_norm != "none":
            q_bnsd, k_bgsd = self._norm_qk(q_bnsd, k_bgsd)
        if rotary is not None:
            q_bnsd, k_bgsd = apply_rotary(q_bnsd, *rotary), apply_rotary(k_bgsd, *rotary)
        if rotary is not None or self.qk_norm != "none":
            # rotated or normed q and k are new tensors, so v is copied out of the fused projection's
            # output too: attention keeps v for backward, and as a view it would keep that whole output
            # alive (3 sbh bytes instead of sbh/2 under Llama's grouped-query attention, 6 instead of 2
            # without it)
            v_bgsd = v_bsgd.contiguous().transpose(1, 2)
        out_bnsd = self.core(q_bnsd, k_bgsd, v_bgsd, mask_b11s)
        return self.proj(out_bnsd.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.ffn_hidden_size is not None
        self.activation = cfg.activation
        up = 2 * cfg.ffn_hidden_size if gated_mlp(cfg) else cfg.ffn_hidden_size
        self.up = nn.Linear(cfg.hidden_size, up, bias=mlp_bias(cfg))
        self.down = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size, bias=mlp_bias(cfg))

    def forward(self, x_bsh: torch.Tensor) -> torch.Tensor:
        y_bsf = self.up(x_bsh)
        if self.activation in ("geglu", "swiglu"):
            # Gate and value columns interleave, so a column-parallel split keeps the pairs together.
            gate_bsf, value_bsf = y_bsf.unflatten(-1, (-1, 2)).unbind(-1)
            act = F.silu if self.activation == "swiglu" else F.gelu
            y_bsf = act(gate_bsf) * value_bsf
        else:
            y_bsf = F.gelu(y_bsf, approximate="tanh" if self.activation == "openai-gelu" else "none")
        return self.down(y_bsf)


class Logits(nn.Module):
    """x @ weight^T (+ bias): the output layer's matmul as a parameter-free module (adds no state-dict
    keys), so that parallel/ can hook its inputs: tensor parallelism turns x into a DTensor here and
    gets vocabulary-sharded logits from the sharded weight. Pass the bias by keyword.

    Fp32 logits with a bias get it added in place rather than by F.linear, whose bias path returns a
    view of its 2-D result: the loss writes its log-softmax over logits that are not a view
    (models.spec.cross_entropy_sum), one [b, s, v] buffer instead of two. Other dtypes keep the
    GEMM's fused bias (and its single rounding)."""

    def forward(
        self, x_bsh: torch.Tensor, weight_vh: torch.Tensor, *, bias_v: torch.Tensor | None = None
    ) -> torch.Tensor:
        fp32 = x_bsh.dtype == weight_vh.dtype == torch.float32 and not torch.is_autocast_enabled(
            x_bsh.device.type
        )
        if bias_v is None or not fp32:
            return F.linear(x_bsh, weight_vh, bias_v)
        return F.linear(x_bsh, weight_vh).add_(bias_v)


def moe_or_mlp(cfg: ModelConfig, layer: int | None) -> nn.Module:
    """Block `layer`'s MLP: an MoELayer (with its shared expert, an MLP of moe_shared_expert_size)
    where config.model_shapes.is_moe_layer says so, else the dense MLP."""
    if layer is None or not is_moe_layer(cfg, layer):
        return MLP(cfg)
    size = cfg.moe_shared_expert_size
    shared = MLP(dataclasses.replace(cfg, ffn_hidden_size=size)) if size > 0 else None
    return MoELayer(cfg, layer, shared)


class TransformerBlock(nn.Module):
    """Pre-LN by default; post-LN (original BERT) when apply_residual_connection_post_layernorm;
    GPT-J/NeoX's parallel residual (x + attention(norm1(x)) + mlp(norm2(x))) when parallel_residual.
    `layer`: the block's index in the model, which decides whether `mlp` is a mixture of experts
    (models/moe.py MoELayer; None: always dense)."""

    def __init__(self, cfg: ModelConfig, causal: bool, layer: int | None = None) -> None:
        super().__init__()
        self.post_ln = cfg.apply_residual_connection_post_layernorm
        self.parallel_residual = cfg.parallel_residual
        self.norm1, self.norm2 = make_norm(cfg), make_norm(cfg)
        self.attention = Attention(cfg, causal)
        self.mlp = moe_or_mlp(cfg, layer)
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(
        self,
        x_bsh: torch.Tensor,
        mask_b11s: torch.Tensor | None = None,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if self.post_ln:
            x_bsh = self.norm1(x_bsh + self.dropout(self.attention(x_bsh, mask_b11s, rotary)))
            return self.norm2(x_bsh + self.dropout(self.mlp(x_bsh)))
        if self.parallel_residual:  # summed as GPT-NeoX and HF GPTNeoXLayer do: mlp + attention + x
            attention_bsh = self.dropout(self.attention(self.norm1(x_bsh), mask_b11s, rotary))
            return self.dropout(self.mlp(self.norm2(x_bsh))) + attention_bsh + x_bsh
        x_bsh = x_bsh + self.dropout(self.attention(self.norm1(x_bsh), mask_b11s, rotary))
        return x_bsh + self.dropout(self.mlp(self.norm2(x_bsh)))


def shared_bias(layers: nn.Module, seq: int, x_bsh: torch.Tensor) -> torch.Tensor | None:
    """The attention bias (sliding window, ALiBi) of a causal model's blocks, computed once for all of
    them (every block's is the same: one tensor for all blocks to save for backward, not one per block),
    in the dtype attention runs in (autocast's, if on); None when they need none."""
    core = next((m for m in layers.modules() if isinstance(m, CoreAttention)), None)
    if core is None:
        return None
    device = x_bsh.device
    dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else x_bsh.dtype
    return core.bias(seq, device, dtype)


def document_positions(document_ids_bs: torch.Tensor) -> torch.Tensor:
    """Each token's position within its document (0 at a document's first token) from the document
    ids of packed samples (non-decreasing along the sequence)."""
    index_bs = torch.arange(document_ids_bs.shape[1], device=document_ids_bs.device).expand_as(
        document_ids_bs
    )
    starts_bs = torch.ones_like(document_ids_bs, dtype=torch.bool)
    starts_bs[:, 1:] = document_ids_bs[:, 1:] != document_ids_bs[:, :-1]
    return index_bs - torch.where(starts_bs, index_bs, 0).cummax(dim=1).values


def document_mask(document_ids_bs: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Block-causal attention over packed documents: query i sees key j when j <= i in the same
    document, combined with the blocks' shared bias (a sliding window's [s, s] mask or ALiBi's
    [n, s, s] scores, causality included): a [b, 1, s, s] boolean mask or a [b, n, s, s] bias."""
    s = document_ids_bs.shape[1]
    causal_ss = torch.ones(s, s, dtype=torch.bool, device=document_ids_bs.device).tril()
    allowed_b1ss = ((document_ids_bs.unsqueeze(2) == document_ids_bs.unsqueeze(1)) & causal_ss).unsqueeze(1)
    if bias is None:
        return allowed_b1ss
    if bias.dtype == torch.bool:
        return allowed_b1ss & bias
    return bias.masked_fill(~allowed_b1ss, float("-inf"))


def context_parallel_inputs(
    cp: ContextParallel,
    layers: nn.Module,
    x: torch.Tensor,
    local_seq: int,
    *,
    document_ids_bs: torch.Tensor | None = None,
    padding_bs: torch.Tensor | None = None,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(positions [1 or b, s], attention mask or bias) of this rank's tokens, for every block of
    `layers` (whose attention modules must agree, as a model's do). The positions are global (with
    reset_position_ids: within each document, computed over the whole sequence); the mask is
    `context_parallel_mask` in the dtype attention runs in (autocast's, if on), or None for plain
    causal attention, which CoreAttention runs as causal blocks without one. x: the model's input
    (token ids, or a later pipeline stage's hidden states), for its device and floating dtype.
    The document ids and padding are this rank's [b, s] parts: gathered here."""
    device = x.device
    seq = local_seq * cp.size
    positions_s = cp.positions(local_seq, device)
    docs_bS = None if document_ids_bs is None else cp.gather_sequence(document_ids_bs, 1)
    padding_bS = None if padding_bs is None else cp.gather_sequence(padding_bs, 1)
    if docs_bS is not None and reset_position_ids:
        positions_bs = document_positions(docs_bS).index_select(1, positions_s)
    else:
        positions_bs = positions_s.unsqueeze(0)
    core = next((m for m in layers.modules() if isinstance(m, CoreAttention)), None)
    if core is None:
        raise ValueError("context parallelism needs attention layers (CoreAttention) in the model")
    documents = docs_bS if reset_attention_mask else None
    plain = core.window is None and core.slopes is None and documents is None and padding_bS is None
    if core.causal and plain:
        return positions_bs, None
    dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else x.dtype
    mask = context_parallel_mask(
        positions_s,
        seq,
        causal=core.causal,
        window=core.window,
        slopes=core.slopes,
        document_ids_bS=documents,
        padding_bS=padding_bS,
        dtype=dtype if dtype.is_floating_point else torch.float32,
    )
    return positions_bs, mask


def blocks_of(layers: nn.Module) -> Iterable[nn.Module]:
    """The blocks of a `layers` container in model order: an nn.ModuleList (whole model) or an
    nn.ModuleDict keyed by global index (pipeline stage, see models/stage.py)."""
    return layers.values() if isinstance(layers, nn.ModuleDict) else layers.children()


def rotary_length(
    inputs: torch.Tensor, has_embedding: bool, mask_bs: torch.Tensor | None, seq_length: int
) -> int:
    """Sequence length for the rotary tables. Without the embedding (a later pipeline stage) the
    input is hidden states, a sequence shard under sequence parallelism: take the mask's length, or
    the configured one (pipelined shapes are static)."""
    if mask_bs is not None:
        return mask_bs.shape[1]
    return inputs.shape[1] if has_embedding else seq_length


def run_blocks(
    blocks: Iterable[nn.Module],
    x_bsh: torch.Tensor,
    mask_b11s: torch.Tensor | None,
    rotary: tuple[torch.Tensor, torch.Tensor] | None,
    recompute_chunk: int = 0,
    checkpoint_fn: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """Run transformer blocks in order. recompute_chunk = k > 1: Megatron's uniform full recompute,
    each run of k consecutive blocks is one non-reentrant checkpoint (only every k-th block's input
    is kept; the k blocks are recomputed together in backward). 0 or 1: plain calls (per-block
    checkpointing, when configured, is a wrapper around each block instead). `checkpoint_fn(fn, x,
    *args)` checkpoints a chunk (default torch's non-reentrant checkpoint, which keeps x whole;
    parallel/recompute.py's keeps it distributed or in host memory)."""
    blocks = list(blocks)
    if rotary is not None:
        # in the dtype q and k come in, once for all blocks: cast inside each block, every block's
        # rotations would keep copies of their own for backward
        device = x_bsh.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x_bsh.dtype
        rotary = (rotary[0].to(dtype), rotary[1].to(dtype))
    if recompute_chunk <= 1 or not torch.is_grad_enabled():
        for block in blocks:
            x_bsh = block(x_bsh, mask_b11s, rotary)
        return x_bsh
    for start in range(0, len(blocks), recompute_chunk):
        chunk = blocks[start : start + recompute_chunk]
        if checkpoint_fn is None:
            x_bsh = torch.utils.checkpoint.checkpoint(
                _run_chunk, x_bsh, chunk, mask_b11s, rotary, use_reentrant=False
            )
        else:
            x_bsh = checkpoint_fn(_run_chunk, x_bsh, chunk, mask_b11s, rotary)
    return x_bsh


def _run_chunk(x_bsh, chunk, mask_b11s, rotary):
    for block in chunk:
        x_bsh = block(x_bsh, mask_b11s, rotary)
    return x_bsh


@dataclass(frozen=True)
class InitRule:
    """How one parameter starts: `normal` N(0, std), `zeros` or `ones`."""

    kind: str
    std: float = 0.0


def init_rules(model: nn.Module, cfg: ModelConfig) -> dict[str, InitRule]:
    """Parameter name (as `model.named_parameters()` gives it) -> its Megatron init rule: N(0, std)
    for Linear and Embedding weights, N(0, std / sqrt(2 L)) for the two residual output projections
    of every block (keeps the residual stream's variance independent of depth; in an MoE layer the
    experts' w_down and the shared expert's down), unit norm weights, zero biases; an MoE layer's
    router and experts' w_up N(0, std). Reads module types only, so it works on meta-device and
    parallelized models (the wrappers of parallel/ keep the wrapped modules' types)."""
    std = cfg.init_method_std
    out_std = std / math.sqrt(2.0 * cfg.num_layers)
    scaled: set[int] = set()  # ids: tensors compare elementwise, so they cannot be set members
    for module in model.modules():
        if isinstance(module, TransformerBlock):
            scaled.add(id(module.attention.proj.weight))
            dense = module.mlp.shared_expert if isinstance(module.mlp, MoELayer) else module.mlp
            if isinstance(dense, MLP):
                scaled.add(id(dense.down.weight))
    rules: dict[str, InitRule] = {}
    for module_name, module in model.named_modules():
        for local, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{local}" if module_name else local
            if isinstance(module, GroupedExperts):
                rules[name] = InitRule("normal", out_std if local == "w_down" else std)
            elif local == "weight" and isinstance(module, nn.Linear | nn.Embedding):
                rules[name] = InitRule("normal", out_std if id(param) in scaled else std)
            elif local == "weight" and isinstance(module, nn.LayerNorm | nn.RMSNorm):
                rules[name] = InitRule("ones")
            elif local == "bias":  # Linear, norm and per-token output biases (BERT's lm_head.bias)
                rules[name] = InitRule("zeros")
            else:
                raise ValueError(f"no init rule for parameter {name} of {type(module).__name__}")
    return rules


def parameter_seed(seed: int, name: str) -> int:
    """The generator seed of parameter `name`: a hash of (seed, name), so a parameter's initial value
    does not depend on which other parameters a process builds, or in which order."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def initial_value(rule: InitRule, shape: torch.Size | tuple[int, ...], seed: int, name: str) -> torch.Tensor:
    """The full fp32 initial value of parameter `name` (canonical, unwrapped name) on the CPU: a
    function of (seed, name, shape, rule) only, the same in every parallel layout."""
    if rule.kind == "zeros":
        return torch.zeros(shape)
    if rule.kind == "ones":
        return torch.ones(shape)
    generator = torch.Generator(device="cpu").manual_seed(parameter_seed(seed, name))
    return torch.empty(shape).normal_(0.0, rule.std, generator=generator)


def reset_derived_buffers(model: nn.Module) -> None:
    """Recompute the non-persistent tables (sinusoid, rotary cos/sin) in place on their device: after
    `to_empty` they hold garbage."""
    for module in model.modules():
        if isinstance(module, Embedding | RotaryEmbedding):
            module.reset_buffers()


def init_weights(model: nn.Module, cfg: ModelConfig, seed: int | None = None) -> None:
    """Initialise a whole (unsharded) model by `init_rules`, each parameter from its own generator
    (`initial_value`; seed None: the default generator's seed, `torch.initial_seed()`), and recompute
    the derived buffers. Parameters on the meta device are left alone (nothing to fill yet); sharded
    models are filled by parallel/init.py with the same values."""
    seed = torch.initial_seed() if seed is None else seed
    rules = init_rules(model, cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not param.is_meta:
                param.copy_(initial_value(rules[name], param.shape, seed, name))
    reset_derived_buffers(model)
