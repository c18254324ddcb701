"""The model's shape arithmetic, once, without torch: parameter counts by part, per pipeline stage
and per tensor-parallel rank, and the shape the FLOPs formulas read (`ModelShape`). models/ counts
its parameters here (tests check them against the built modules: tests/unit/test_shapes.py),
metrics/ builds its FLOPs shape here, plan/ sizes stages here, bench/ recomputes logged FLOPs here.
In config/, below all of them, because the torch-free planner needs it; only models/ and config/
look at model.type.

Legend: h hidden, f MLP inner size, v padded vocabulary, t tensor-parallel size, n attention heads,
g key/value groups, d head dim.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .rules import head_dim, padded_vocab_size, stage_ids, stage_layer_counts
from .schema import ModelConfig


@dataclass(frozen=True)
class StageParams:
    """Parameters held by one pipeline rank (all its virtual stages) on one tensor-parallel rank.

    blocks        parameters of the transformer blocks (local shards), in total
    block         parameters of one block (local shard): an FSDP2 unit; the largest of the rank's
                  blocks (an MoE block, with all its routed experts, where the rank holds one)
    layers        number of blocks
    root          parameters outside the blocks (embedding, heads, final norm; local shards)
    first, last   whether the rank holds the model's embedding / head
    experts       routed-expert parameters among `blocks` (all num_experts of each MoE layer; expert
                  parallelism divides them by ep, the planner's business): 0 for a dense model
    expert_block  routed-expert parameters among `block` (one MoE layer's)
    moe_layers    how many of the rank's `layers` are MoE layers
    """

    blocks: int
    block: int
    layers: int
    root: int
    first: bool
    last: bool
    experts: int = 0
    expert_block: int = 0
    moe_layers: int = 0

    @property
    def total(self) -> int:
        return self.blocks + self.root


GATED_ACTIVATIONS = ("geglu", "swiglu")


def gated_mlp(m: ModelConfig) -> bool:
    """Whether the MLP has a gate matrix beside its value matrix (up projects to 2 f)."""
    return m.activation in GATED_ACTIVATIONS


def causal_attention(m: ModelConfig) -> bool:
    """Whether each position attends only to the ones before it (GPT) rather than to the whole
    sequence (BERT): the attention core's work and kernel choice depend on it."""
    return m.type == "gpt"


def causal_blocks_under_cp(m: ModelConfig) -> bool:
    """Whether context-parallel attention runs as lower-right causal blocks without a mask (each local
    chunk against the keys up to its end: the kernels skip the masked half, as causal attention does
    on one rank) rather than against every key under an explicit mask of global positions (packed
    documents, a sliding window, ALiBi, BERT's padding), whose masked half is computed too."""
    return (
        causal_attention(m)
        and not m.reset_attention_mask
        and m.sliding_window is None
        and m.position_embedding_type != "alibi"
    )


def lm_head_transform(m: ModelConfig) -> bool:
    """Whether the LM head transforms the hidden state (dense, GELU, norm: BERT's) before projecting
    it onto the vocabulary, rather than projecting the final norm's output directly (GPT's)."""
    return m.type == "bert"


def query_groups(m: ModelConfig) -> int:
    """g: key/value heads (num_query_groups, which defaults to the number of heads)."""
    return m.num_query_groups or m.num_attention_heads


def qkv_width(m: ModelConfig) -> int:
    """Output features of the fused qkv projection: n query heads and g key and value heads, (n + 2 g) d."""
    return (m.num_attention_heads + 2 * query_groups(m)) * head_dim(m)


def attention_width(m: ModelConfig) -> int:
    """n d: the query projection's output features, which the output projection reads (h unless
    model.kv_channels sets another head size)."""
    return m.num_attention_heads * head_dim(m)


def qk_norm_numel(m: ModelConfig) -> int:
    """Parameters of one layer's query and key norms (model.qk_norm, replicated over tp): none; head, two
    norms of d features; full, one of n d and one of g d. LayerNorm has weight and bias, RMSNorm a weight."""
    per = 1 if m.norm == "rmsnorm" else 2
    if m.qk_norm == "head":
        return per * 2 * head_dim(m)
    if m.qk_norm == "full":
        return per * (m.num_attention_heads + query_groups(m)) * head_dim(m)
    return 0


def qkv_bias(m: ModelConfig) -> bool:
    """Whether the query/key/value projection has biases: add_qkv_bias, default add_bias_linear."""
    return m.add_bias_linear if m.add_qkv_bias is None else m.add_qkv_bias


def mlp_bias(m: ModelConfig) -> bool:
    """Whether the MLP's projections have biases: add_mlp_bias, default add_bias_linear."""
    return m.add_bias_linear if m.add_mlp_bias is None else m.add_mlp_bias


def default_ffn_hidden_size(m: ModelConfig) -> int:
    """The derived MLP inner size: 4 h, or Llama's int(2/3 * 4 h) with swiglu (the parameters of an
    ungated 4 h MLP), rounded up to a multiple of model.ffn_multiple_of."""
    f = 4 * m.hidden_size
    if m.activation == "swiglu":
        f = int(2 * f / 3)
    return -(-f // m.ffn_multiple_of) * m.ffn_multiple_of


def is_moe_layer(m: ModelConfig, layer: int) -> bool:
    """Whether layer `layer` (0-based, of the whole model) has a mixture of experts instead of a dense
    MLP: model.num_experts > 0, at or after moe_first_k_dense, every moe_layer_freq-th (Megatron's
    pattern: layer % freq == 0)."""
    return m.num_experts > 0 and layer >= m.moe_first_k_dense and layer % m.moe_layer_freq == 0


def moe_layers(m: ModelConfig) -> list[int]:
    """The 0-based indices of the MoE layers (empty for a dense model)."""
    return [i for i in range(m.num_layers) if is_moe_layer(m, i)]


def moe_ffn(m: ModelConfig) -> int:
    """The routed experts' MLP inner size: model.moe_ffn_hidden_size, else ffn_hidden_size (as resolve
    fills it)."""
    f = m.moe_ffn_hidden_size if m.moe_ffn_hidden_size is not None else m.ffn_hidden_size
    assert f is not None, "resolve the config first"
    return f


def expert_numel(m: ModelConfig) -> int:
    """Parameters of one routed expert (models/moe.py GroupedExperts, no biases): w_up h x (2 f gated |
    f) and w_down f x h."""
    f = moe_ffn(m)
    return m.hidden_size * (2 * f if gated_mlp(m) else f) + f * m.hidden_size


def router_numel(m: ModelConfig) -> int:
    """The router of one MoE layer: a linear h -> num_experts without bias."""
    return m.hidden_size * m.num_experts


def shared_expert_numel(m: ModelConfig, tp: int = 1) -> int:
    """The always-on shared expert of one MoE layer on one tp rank: a dense MLP of
    moe_shared_expert_size (biases as the dense MLP's), sharded over tp as the dense MLP; 0 without one."""
    f = m.moe_shared_expert_size
    if not f:
        return 0
    up = 2 * f if gated_mlp(m) else f
    bias = 1 if mlp_bias(m) else 0
    return (m.hidden_size * up + bias * up) // tp + f * m.hidden_size // tp + bias * m.hidden_size


# Expert tensor parallelism: the routed experts' inner size f is split over the tp ranks like the dense
# MLP's (Megatron's default --expert-tensor-parallel-size = tp); the router is replicated. The planner's
# one assumption about how parallel/ composes experts with tp: change it here if that changes.
EXPERTS_SHARDED_OVER_TP = True


def expert_tp(tp: int) -> int:
    """The tp ranks each routed expert's f is split over (`EXPERTS_SHARDED_OVER_TP`)."""
    return tp if EXPERTS_SHARDED_OVER_TP else 1


def norm_numel(m: ModelConfig) -> int:
    """Parameters of one norm layer: LayerNorm has weight and bias, RMSNorm only a weight."""
    return m.hidden_size * (1 if m.norm == "rmsnorm" else 2)


def vocab(m: ModelConfig) -> int:
    """v: the padded vocabulary the model embeds (rows of the word embedding)."""
    assert m.vocab_size is not None
    return padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by)


@dataclass(frozen=True)
class BlockParams:
    """Parameters of one TransformerBlock on one tensor-parallel rank, by part (local shards).

    attention   the fused qkv projection and the output projection (weights and biases)
    mlp         the up projection (value, and gate when gated) and the down projection; in an MoE
                layer the router and the shared expert instead
    norms       the two norms and the query/key norms of model.qk_norm (replicated)
    experts     an MoE layer's routed experts (all num_experts; 0 in a dense layer)
    """

    attention: int
    mlp: int
    norms: int
    experts: int = 0

    @property
    def total(self) -> int:
        return self.attention + self.mlp + self.norms + self.experts


def block_params(m: ModelConfig, tp: int = 1, moe: bool = False) -> BlockParams:
    """One TransformerBlock on one tp rank: qkv and up column-sharded (weight and bias), proj and
    down row-sharded (weight; bias replicated), norms replicated. Biases as add_bias_linear says
    (attention's output), qkv_bias and mlp_bias.
    With more tp ranks than key/value groups the qkv projection is replicated (parallel/tensor.py).
    The layout rules (config/rules.py) make every sharded part divisible by tp.
    moe: the block of an MoE layer (`is_moe_layer`): the router (replicated), the shared expert and
    num_experts routed experts (split over `expert_tp(tp)`) instead of the dense MLP."""
    assert m.ffn_hidden_size is not None
    h, f, qkv = m.hidden_size, m.ffn_hidden_size, qkv_width(m)
    up = 2 * f if gated_mlp(m) else f
    bias = 1 if m.add_bias_linear else 0
    mlp = 1 if mlp_bias(m) else 0
    qkv_numel = h * qkv + (qkv if qkv_bias(m) else 0)
    qkv_local = qkv_numel if query_groups(m) % tp else qkv_numel // tp
    attention = qkv_local + attention_width(m) * h // tp + bias * h
    norms = 2 * norm_numel(m) + qk_norm_numel(m)
    if moe:
        return BlockParams(
            attention=attention,
            mlp=router_numel(m) + shared_expert_numel(m, tp),
            norms=norms,
            experts=m.num_experts * expert_numel(m) // expert_tp(tp),
        )
    return BlockParams(
        attention=attention,
        mlp=(h * up + mlp * up) // tp + f * h // tp + mlp * h,
        norms=norms,
    )


def block_numel(m: ModelConfig, tp: int = 1, moe: bool = False) -> int:
    """Parameters of one TransformerBlock (of an MoE layer when `moe`) on one tp rank (see `block_params`)."""
    return block_params(m, tp, moe).total


def layers_numel(m: ModelConfig, tp: int = 1) -> int:
    """Parameters of all num_layers blocks on one tp rank: dense and MoE layers as `is_moe_layer` says."""
    n_moe = len(moe_layers(m))
    return (m.num_layers - n_moe) * block_numel(m, tp) + n_moe * block_numel(m, tp, moe=True)


def active_params(m: ModelConfig) -> int:
    """Parameters one token runs through (tp = 1): every parameter but the routed experts a token is not
    sent to, i.e. total_params - (num_experts - moe_router_topk) x one expert per MoE layer. The router
    and the shared expert are active. Equals total_params for a dense model."""
    idle = (m.num_experts - m.moe_router_topk) * expert_numel(m) if m.num_experts else 0
    return total_params(m) - len(moe_layers(m)) * idle


def embedding_numel(m: ModelConfig, tp: int = 1) -> int:
    """Word embedding (vocabulary rows sharded), learned positions, token types (BERT), post-LN norm."""
    assert m.max_position_embeddings is not None
    h = m.hidden_size
    numel = vocab(m) * h // tp
    if m.position_embedding_type == "learned":
        numel += m.max_position_embeddings * h
    if m.type == "bert":
        numel += m.num_tokentypes * h
    if m.apply_residual_connection_post_layernorm:
        numel += norm_numel(m)
    return numel


def embedding_tables_numel(m: ModelConfig, tp: int = 1) -> int:
    """The embedding tables alone (word rows padded for `tp` ranks, learned positions, token types):
    `embedding_numel` without a post-LN embedding norm, unsharded."""
    assert m.vocab_size is not None
    h = m.hidden_size
    numel = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp) * h
    if m.position_embedding_type == "learned":  # unresolved: the table resolve gives, seq_length rows
        numel += (m.max_position_embeddings or m.seq_length) * h
    if m.type == "bert":
        numel += m.num_tokentypes * h
    return numel


def final_norm_numel(m: ModelConfig) -> int:
    """The norm after the last block (none in a post-LN model: its blocks end with their norm)."""
    return 0 if m.apply_residual_connection_post_layernorm else norm_numel(m)


def lm_head_numel(m: ModelConfig, tp: int = 1, with_tied_copy: bool = False) -> int:
    """The language-model head on one tp rank: the untied output matrix, or the tied word-embedding
    copy a later pipeline stage holds (sharded over tp); BERT adds its transform (dense + norm) and
    per-token output bias. A tied matrix on the embedding's own stage is counted in the embedding."""
    h, v = m.hidden_size, vocab(m)
    output = v * h // tp if (not m.tie_word_embeddings or with_tied_copy) else 0
    if m.type == "bert":
        return (h * h + h) + norm_numel(m) + v // tp + output
    return output


def binary_head_numel(m: ModelConfig) -> int:
    """BERT's pooler (dense h -> h) and NSP/SOP classifier (h -> 2), replicated; none without it."""
    h = m.hidden_size
    return (h * h + h) + (2 * h + 2) if m.type == "bert" and m.bert_binary_head else 0


def head_numel(m: ModelConfig, tp: int = 1, with_tied_copy: bool = False) -> int:
    """Everything after the blocks on one tp rank: final norm, LM head, binary head."""
    return final_norm_numel(m) + lm_head_numel(m, tp, with_tied_copy) + binary_head_numel(m)


def parameter_parts(m: ModelConfig) -> dict[str, int]:
    """Parameters by part (tp = 1, no pipeline): embedding, layers (num_layers blocks, dense and MoE),
    final_norm, lm_head, binary_head. A tied output matrix is counted once, in `embedding`. The values
    sum to `total_params(m)`; `block_params(m)` splits one layer into attention, MLP and norms."""
    return {
        "embedding": embedding_numel(m),
        "layers": layers_numel(m),
        "final_norm": final_norm_numel(m),
        "lm_head": lm_head_numel(m),
        "binary_head": binary_head_numel(m),
    }


def total_params(m: ModelConfig) -> int:
    """N: every parameter once (a tied embedding once), tp = 1; equals models.count_parameters."""
    return sum(parameter_parts(m).values())


def stage_params(
    m: ModelConfig,
    tp: int,
    pp: int,
    pp_rank: int,
    virtual: int = 1,
    schedule: str = "1f1b",
    pipeline_layers: str | None = None,
) -> StageParams:
    """What pipeline rank `pp_rank` holds (on one tp rank). Memoized on the values (the search asks
    for the same stages thousands of times)."""
    key = (
        m.type, m.num_layers, m.hidden_size, m.ffn_hidden_size, m.vocab_size, m.make_vocab_size_divisible_by,
        m.num_attention_heads, m.num_query_groups, m.add_bias_linear, m.add_qkv_bias, m.add_mlp_bias,
        m.max_position_embeddings, m.position_embedding_type, m.num_tokentypes, m.norm, m.activation,
        m.apply_residual_connection_post_layernorm, m.tie_word_embeddings, m.bert_binary_head,
        m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.moe_shared_expert_size, m.moe_layer_freq,
        m.moe_first_k_dense, m.kv_channels, m.qk_norm, tp, pp, pp_rank, virtual, schedule, pipeline_layers,
    )  # fmt: skip
    hit = _CACHE.get(key)
    if hit is None:
        if len(_CACHE) > 100_000:
            _CACHE.clear()
        hit = _CACHE[key] = _stage_params(m, tp, pp, pp_rank, virtual, schedule, pipeline_layers)
    return hit


_CACHE: dict[tuple, StageParams] = {}


def _stage_params(
    m: ModelConfig, tp: int, pp: int, pp_rank: int, virtual: int, schedule: str, pipeline_layers: str | None
) -> StageParams:
    stages = pp * virtual
    counts = stage_layer_counts(m.num_layers, stages, pipeline_layers)
    ids = stage_ids(pp, pp_rank, virtual, schedule) if pp > 1 else [0]
    layers = sum(counts[i] for i in ids)
    first, last = 0 in ids, stages - 1 in ids
    root = 0
    if first:
        root += embedding_numel(m, tp)
    if last:
        root += head_numel(m, tp, with_tied_copy=m.tie_word_embeddings and not first)
    starts = [sum(counts[:i]) for i in range(stages)]
    n_moe = sum(is_moe_layer(m, j) for i in ids for j in range(starts[i], starts[i] + counts[i]))
    dense, moe = block_params(m, tp), block_params(m, tp, moe=True) if n_moe else None
    blocks = (layers - n_moe) * dense.total + (n_moe * moe.total if moe else 0)
    return StageParams(
        blocks=blocks,
        block=moe.total if moe else dense.total,
        layers=layers,
        root=root,
        first=first,
        last=last,
        experts=n_moe * moe.experts if moe else 0,
        expert_block=moe.experts if moe else 0,
        moe_layers=n_moe,
    )


def family_options(m: ModelConfig) -> ModelConfig:
    """`m` without the options its family does not have (as resolve drops them): no binary head on GPT."""
    return dataclasses.replace(m, bert_binary_head=m.bert_binary_head and m.type == "bert")


@dataclass(frozen=True)
class ModelShape:
    """What the FLOPs formulas (metrics/flops.py) need to know about a transformer; build it from a
    config with `ModelShape.from_config`.

    vocab_size is the padded vocabulary (Megatron pads to a multiple of make_vocab_size_divisible_by
    * tp); num_params is the total parameter count N (a tied embedding counted once);
    ffn_hidden_size None means 4 * hidden_size; gated_mlp marks a GeGLU/SwiGLU MLP whose
    up-projection is h -> 2 * ffn_hidden_size; kv_heads_ratio is num_query_groups /
    num_attention_heads (grouped-query attention: K and V have that fraction of Q's features).
    The conventions counting 2*N per token see both through num_params. sliding_window is the
    attention window in tokens (None: every earlier position); embedding_params E counts the
    embedding tables (word, learned positions, token types) and tied_embeddings says whether the
    output matrix is the word table: torchtitan's convention counts N - E for an untied model.
    Mixture of experts: moe_layers of the num_layers layers (`is_moe_layer`) replace the dense MLP by
    a router (h -> num_experts), moe_topk routed experts per token (each an MLP of moe_ffn_hidden_size,
    gated as the dense MLP) and a shared expert of shared_expert_size (0: none); active_params is the
    N one token runs through (`active_params`; None: num_params, a dense model), what the conventions
    counting 6 N per token count for an MoE model. attention_width is n x d, the query heads' features
    (None: hidden_size); model.kv_channels makes it differ from h, and the attention terms read it.
    """

    num_layers: int
    hidden_size: int
    seq_length: int
    vocab_size: int
    num_params: int
    ffn_hidden_size: int | None = None
    gated_mlp: bool = False
    kv_heads_ratio: float = 1.0
    sliding_window: int | None = None
    embedding_params: int = 0
    tied_embeddings: bool = True
    moe_layers: int = 0
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn_hidden_size: int | None = None
    shared_expert_size: int = 0
    active_params: int | None = None
    attention_width: int | None = None

    def __post_init__(self) -> None:
        if not 0 < self.kv_heads_ratio <= 1:
            raise ValueError(f"ModelShape.kv_heads_ratio must be in (0, 1], got {self.kv_heads_ratio!r}")
        for name in ("num_layers", "hidden_size", "seq_length", "vocab_size", "num_params"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelShape.{name} must be a positive int, got {value!r}")
        if self.ffn_hidden_size is not None and (
            not isinstance(self.ffn_hidden_size, int) or self.ffn_hidden_size < 1
        ):
            raise ValueError(
                f"ModelShape.ffn_hidden_size must be a positive int or None, got {self.ffn_hidden_size!r}"
            )
        if self.sliding_window is not None and (
            not isinstance(self.sliding_window, int) or self.sliding_window < 1
        ):
            raise ValueError(
                f"ModelShape.sliding_window must be a positive int or None, got {self.sliding_window!r}"
            )
        if self.attention_width is not None and (
            not isinstance(self.attention_width, int) or self.attention_width < 1
        ):
            raise ValueError(
                f"ModelShape.attention_width must be a positive int or None, got {self.attention_width!r}"
            )
        if not isinstance(self.embedding_params, int) or self.embedding_params < 0:
            raise ValueError(
                f"ModelShape.embedding_params must be an int >= 0, got {self.embedding_params!r}"
            )
        if not 0 <= self.moe_layers <= self.num_layers:
            raise ValueError(
                f"ModelShape.moe_layers must be in 0..num_layers ({self.num_layers}), got {self.moe_layers!r}"
            )
        if self.moe_layers and not 1 <= self.moe_topk <= self.num_experts:
            raise ValueError(
                f"ModelShape.moe_topk must be in 1..num_experts ({self.num_experts}) with MoE layers, "
                f"got {self.moe_topk!r}"
            )

    @property
    def active_n(self) -> int:
        """N counted per token by the 6 N conventions: active_params for an MoE model, else num_params."""
        return self.num_params if self.active_params is None else self.active_params

    @property
    def expert_ffn(self) -> int:
        """The routed experts' MLP inner size (units: features): moe_ffn_hidden_size, else F."""
        return self.moe_ffn_hidden_size if self.moe_ffn_hidden_size is not None else self.ffn

    @property
    def attn(self) -> int:
        """The query heads' features n d (units: features): attention_width, else hidden_size."""
        return self.attention_width if self.attention_width is not None else self.hidden_size

    @property
    def ffn(self) -> int:
        """MLP inner size F (units: features)."""
        return self.ffn_hidden_size if self.ffn_hidden_size is not None else 4 * self.hidden_size

    @property
    def attended_keys(self) -> int:
        """Keys each query's attention row spans in a dense count: s, or the window when shorter."""
        return min(self.seq_length, self.sliding_window or self.seq_length)

    @classmethod
    def from_config(cls, m: ModelConfig, num_params: int | None = None, tp: int = 1) -> ModelShape:
        """Shape of a resolved ModelConfig; the vocabulary is padded as the model pads it (for `tp`
        tensor-parallel ranks). num_params is N, by default `total_params(m)` (which equals
        `models.count_parameters(m)`); pass another N to count with it (`stx flops --params`). An MoE
        model's active N is that N without the idle experts (num_experts - topk per MoE layer)."""
        if m.vocab_size is None:
            raise ValueError(
                "model.vocab_size is None: resolve the config first "
                "(config.validate.resolve) or set model.vocab_size"
            )
        n = int(total_params(m) if num_params is None else num_params)
        return cls(
            num_layers=m.num_layers,
            hidden_size=m.hidden_size,
            seq_length=m.seq_length,
            vocab_size=padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp),
            num_params=n,
            ffn_hidden_size=m.ffn_hidden_size,
            gated_mlp=gated_mlp(m),
            kv_heads_ratio=query_groups(m) / m.num_attention_heads,
            sliding_window=m.sliding_window,
            embedding_params=embedding_tables_numel(m, tp),
            tied_embeddings=m.tie_word_embeddings,
            moe_layers=len(moe_layers(m)),
            num_experts=m.num_experts,
            moe_topk=m.moe_router_topk if m.num_experts else 0,
            moe_ffn_hidden_size=moe_ffn(m) if m.num_experts else None,
            shared_expert_size=m.moe_shared_expert_size if m.num_experts else 0,
            active_params=active_params(m) + n - total_params(m) if m.num_experts else None,
            attention_width=attention_width(m) if attention_width(m) != m.hidden_size else None,
        )

    def to_dict(self) -> dict[str, Any]:
        """The shape as JSON (`stx flops --json`); the MoE fields only for a model with MoE layers."""
        d = {
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "seq_length": self.seq_length,
            "vocab_size": self.vocab_size,
            "num_params": self.num_params,
            "ffn_hidden_size": self.ffn,
            "gated_mlp": self.gated_mlp,
            "kv_heads_ratio": self.kv_heads_ratio,
            "sliding_window": self.sliding_window,
            "embedding_params": self.embedding_params,
            "tied_embeddings": self.tied_embeddings,
        }
        if self.attention_width is not None:
            d["attention_width"] = self.attention_width
        if self.moe_layers:
            d |= {
                "moe_layers": self.moe_layers,
                "num_experts": self.num_experts,
                "moe_topk": self.moe_topk,
                "moe_ffn_hidden_size": self.expert_ffn,
                "shared_expert_size": self.shared_expert_size,
                "active_params": self.active_n,
            }
        return d


def sized_model(
    num_layers: int,
    hidden_size: int,
    seq_length: int,
    vocab_size: int,
    ffn_hidden_size: int | None = None,
    make_vocab_size_divisible_by: int = 1,
) -> ModelConfig:
    """The model meant when only its sizes are known (`stx flops` without a config, a Megatron log):
    a Megatron-style GPT with biases, LayerNorm, a plain MLP of ffn_hidden_size (default 4 h), one
    key/value head per head, a tied word embedding and a learned position table of seq_length rows.
    Its `total_params` is 12*L*h^2 + 13*L*h + V*h + s*h + 2h for F = 4h (no BERT heads, no pooler)."""
    return ModelConfig(
        type="gpt",
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=1,  # the count does not depend on the heads; 1 divides every h
        ffn_hidden_size=ffn_hidden_size if ffn_hidden_size is not None else 4 * hidden_size,
        seq_length=seq_length,
        max_position_embeddings=seq_length,
        vocab_size=vocab_size,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        activation="gelu",
        add_bias_linear=True,
        norm="layernorm",
        position_embedding_type="learned",
        tie_word_embeddings=True,
        apply_residual_connection_post_layernorm=False,
        bert_binary_head=False,
    )
