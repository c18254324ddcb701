"""Parameter counts of the model as models/ builds it, per pipeline stage and per tensor-parallel
rank, without torch (tests/unit/test_plan.py checks them against the built modules). In config/, as
the family rules a torch-free caller (the planner) needs: only models/ and config/ look at model.type.

Legend: h hidden, f MLP inner size, v padded vocabulary, t tensor-parallel size, n attention heads,
g key/value groups, d head dim.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .rules import padded_vocab_size, stage_ids, stage_layer_counts
from .schema import ModelConfig


@dataclass(frozen=True)
class StageParams:
    """Parameters held by one pipeline rank (all its virtual stages) on one tensor-parallel rank.

    blocks        parameters of the transformer blocks (local shards), in total
    block         parameters of one block (local shard): an FSDP2 unit
    layers        number of blocks
    root          parameters outside the blocks (embedding, heads, final norm; local shards)
    first, last   whether the rank holds the model's embedding / head
    """

    blocks: int
    block: int
    layers: int
    root: int
    first: bool
    last: bool

    @property
    def total(self) -> int:
        return self.blocks + self.root


GATED_ACTIVATIONS = ("geglu", "swiglu")


def gated_mlp(m: ModelConfig) -> bool:
    """Whether the MLP has a gate matrix beside its value matrix (up projects to 2 f)."""
    return m.activation in GATED_ACTIVATIONS


def query_groups(m: ModelConfig) -> int:
    """g: key/value heads (num_query_groups, which defaults to the number of heads)."""
    return m.num_query_groups or m.num_attention_heads


def qkv_width(m: ModelConfig) -> int:
    """Output features of the fused qkv projection: n query heads and g key and value heads, (n + 2 g) d."""
    return (m.num_attention_heads + 2 * query_groups(m)) * (m.hidden_size // m.num_attention_heads)


def default_ffn_hidden_size(m: ModelConfig) -> int:
    """The derived MLP inner size: 4 h, or Llama's int(2/3 * 4 h) with swiglu (the parameters of an
    ungated 4 h MLP), rounded up to a multiple of model.ffn_multiple_of."""
    f = 4 * m.hidden_size
    if m.activation == "swiglu":
        f = int(2 * f / 3)
    return -(-f // m.ffn_multiple_of) * m.ffn_multiple_of


def norm_numel(m: ModelConfig) -> int:
    return m.hidden_size * (1 if m.norm == "rmsnorm" else 2)


def vocab(m: ModelConfig) -> int:
    assert m.vocab_size is not None
    return padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by)


def block_numel(m: ModelConfig, tp: int = 1) -> int:
    """One TransformerBlock on one tp rank: qkv and up column-sharded (weight and bias), proj and
    down row-sharded (weight; bias replicated), norms replicated. Biases only with add_bias_linear.
    With more tp ranks than key/value groups the qkv projection is replicated (parallel/tensor.py)."""
    assert m.ffn_hidden_size is not None
    h, f, qkv = m.hidden_size, m.ffn_hidden_size, qkv_width(m)
    up = 2 * f if gated_mlp(m) else f
    bias = 1 if m.add_bias_linear else 0
    qkv_numel = h * qkv + bias * qkv
    replicated = qkv_numel if query_groups(m) % tp else 0
    sharded = qkv_numel - replicated + h * h + (h * up + bias * up) + f * h
    return sharded // tp + replicated + bias * 2 * h + 2 * norm_numel(m)


def embedding_numel(m: ModelConfig, tp: int = 1) -> int:
    """Word embedding (vocabulary rows sharded), learned positions, token types, post-LN norm."""
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


def head_numel(m: ModelConfig, tp: int = 1, with_tied_copy: bool = False) -> int:
    """Final norm and output head (BERT: dense + norm + per-token bias [+ binary head]); the untied
    output matrix, or the tied word-embedding copy a later pipeline stage holds, sharded over tp."""
    h, v = m.hidden_size, vocab(m)
    final_norm = 0 if m.apply_residual_connection_post_layernorm else norm_numel(m)
    output = v * h // tp if (not m.tie_word_embeddings or with_tied_copy) else 0
    if m.type == "bert":
        head = (h * h + h) + norm_numel(m) + v // tp + output
        if m.bert_binary_head:
            head += (h * h + h) + (2 * h + 2)
        return final_norm + head
    return final_norm + output


def total_params(m: ModelConfig) -> int:
    """N: every parameter once (a tied embedding once), tp = 1; equals models.count_parameters."""
    return embedding_numel(m) + m.num_layers * block_numel(m) + head_numel(m)


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
        m.num_attention_heads, m.num_query_groups, m.add_bias_linear,
        m.max_position_embeddings, m.position_embedding_type, m.num_tokentypes, m.norm, m.activation,
        m.apply_residual_connection_post_layernorm, m.tie_word_embeddings, m.bert_binary_head,
        tp, pp, pp_rank, virtual, schedule, pipeline_layers,
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
    block = block_numel(m, tp)
    return StageParams(blocks=layers * block, block=block, layers=layers, root=root, first=first, last=last)


def family_options(m: ModelConfig) -> ModelConfig:
    """`m` without the options its family does not have (as resolve drops them): no binary head on GPT."""
    return dataclasses.replace(m, bert_binary_head=m.bert_binary_head and m.type == "bert")
