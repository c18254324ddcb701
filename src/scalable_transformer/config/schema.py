"""Typed configuration: one dataclass per section, a docstring under every field.

Every field carries metadata read by the loader and by `stx config docs`:
  doc      -- what the field means, with units
  choices  -- the valid values of a string field
  aliases  -- Megatron-LM / GPT-NeoX / DeepSpeed names that set this field (kebab or snake case)

`None` means "derive it": the loader fills derived values (see `config.load.resolve`), so a
resolved config never holds a `None` where a number is needed.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError


def opt(
    default: Any,
    doc: str,
    *,
    choices: tuple[str, ...] = (),
    aliases: tuple[str, ...] = (),
    ge: float | None = None,
    gt: float | None = None,
    lt: float | None = None,
    le: float | None = None,
) -> Any:
    """A config field with its documentation and its value rule attached (bounds as pydantic names
    them: ge >=, gt >, lt <, le <=; None (derive) always passes). Numbers must also be finite."""
    bounds = {k: v for k, v in (("ge", ge), ("gt", gt), ("lt", lt), ("le", le)) if v is not None}
    return field(
        default=default, metadata={"doc": doc, "choices": choices, "aliases": aliases, "bounds": bounds}
    )


# The FLOPs conventions metrics/flops.py computes (one formula each), by the name logging.flops_convention
# takes: defined here, where the config's choices live, so the two cannot drift apart.
FLOPS_CONVENTIONS: tuple[str, ...] = (
    "megatron",
    "megatron-deepspeed-2022",
    "megatron-lm",
    "megatron-lm-2024",
    "torchtitan",
    "llm-foundry",
    "mosaic",
    "6n",
)


@dataclass
class ModelConfig:
    type: str = opt(
        "bert",
        "Model family: a Megatron-style BERT (MLM + binary head) or a causal GPT.",
        choices=("bert", "gpt"),
    )
    num_layers: int = opt(2, "Number of transformer layers.", aliases=("num-layers",), gt=0)
    hidden_size: int = opt(128, "Transformer hidden size.", aliases=("hidden-size",), gt=0)
    num_attention_heads: int = opt(
        2,
        "Number of attention heads; must divide hidden_size unless kv_channels sets the head size.",
        aliases=("num-attention-heads",),
        gt=0,
    )
    num_query_groups: int | None = opt(
        None,
        "Key/value heads (grouped-query attention): each group of num_attention_heads / num_query_groups "
        "query heads shares one key and one value head; 1 is multi-query attention. Default "
        "num_attention_heads (plain multi-head attention). Must divide num_attention_heads.",
        aliases=("num-query-groups", "num_key_value_heads", "num-kv-heads"),
        gt=0,
    )
    kv_channels: int | None = opt(
        None,
        "Attention head size d when it is not hidden_size / num_attention_heads: the q/k/v projections "
        "give num_attention_heads x d (keys and values num_query_groups x d) features and the output "
        "projection reads num_attention_heads x d (Qwen3-30B-A3B: hidden 2048, 32 heads, d 128). "
        "Default hidden_size / num_attention_heads (Megatron --kv-channels, HF head_dim).",
        aliases=("kv-channels", "head_dim"),
        gt=0,
    )
    qk_norm: str = opt(
        "none",
        "Normalise queries and keys after their projection, before rotary positions, with model.norm's "
        "kind: head = one norm over each head's d features, its weight [d] shared by the heads (Megatron "
        "--qk-layernorm, Qwen3, HF q_norm/k_norm of head_dim); full = one norm over all of q's "
        "num_attention_heads x d features and one over k's num_query_groups x d (OLMoE, OLMo-2; not "
        "under parallel.tp > 1).",
        choices=("none", "head", "full"),
    )
    ffn_hidden_size: int | None = opt(
        None,
        "MLP inner size; default 4 * hidden_size, or with activation = swiglu Llama's 2/3 of it (the "
        "parameters of an ungated 4 * hidden_size MLP), rounded up to a multiple of ffn_multiple_of.",
        aliases=("ffn-hidden-size",),
        gt=0,
    )
    ffn_multiple_of: int = opt(
        1,
        "Round a derived ffn_hidden_size up to a multiple of this (Llama's multiple_of, 256 there); an "
        "ffn_hidden_size given explicitly is used as it is.",
        gt=0,
    )
    seq_length: int = opt(
        128,
        "Sequence length of every training sample, in tokens.",
        aliases=("seq-length", "encoder-seq-length"),
        gt=0,
    )
    max_position_embeddings: int | None = opt(
        None,
        "Size of the position table; default seq_length. Must be >= seq_length.",
        aliases=("max-position-embeddings",),
        gt=0,
    )
    vocab_size: int | None = opt(
        None,
        "Tokenizer vocabulary size before padding; default: taken from the tokenizer.",
        gt=0,
    )
    make_vocab_size_divisible_by: int = opt(
        128,
        "Pad the vocabulary to a multiple of this (Megatron), for efficient GEMMs.",
        aliases=("make-vocab-size-divisible-by",),
        gt=0,
    )
    layernorm_epsilon: float = opt(
        1e-5,
        "Epsilon of every LayerNorm/RMSNorm.",
        aliases=("layernorm-epsilon", "rms-norm-epsilon"),
        gt=0,
    )
    hidden_dropout: float = opt(
        0.1, "Dropout probability on hidden states.", aliases=("hidden-dropout",), ge=0, lt=1
    )
    attention_dropout: float = opt(
        0.1,
        "Dropout probability on attention weights.",
        aliases=("attention-dropout",),
        ge=0,
        lt=1,
    )
    init_method_std: float = opt(
        0.02,
        "Std of the normal init of weights (output layers scaled by 1/sqrt(2*num_layers), as Megatron).",
        aliases=("init-method-std",),
        ge=0,
    )
    activation: str = opt(
        "gelu",
        "MLP activation. openai-gelu is the tanh approximation; geglu a gated GELU; swiglu a gated SiLU "
        "(Llama, Megatron --swiglu). Gated MLPs have three matrices (gate, value, down).",
        choices=("gelu", "openai-gelu", "geglu", "swiglu"),
    )
    add_bias_linear: bool = opt(
        True,
        "Biases on the linear layers of every transformer block (qkv, proj, MLP); false as in Llama "
        "(Megatron --disable-bias-linear). Norms keep theirs (RMSNorm has none).",
        aliases=("add-bias-linear",),
    )
    norm: str = opt("layernorm", "Normalisation layer.", choices=("layernorm", "rmsnorm"))
    position_embedding_type: str = opt(
        "learned",
        "Position encoding. alibi: no position table, a per-head linear bias on attention scores "
        "(BLOOM, MPT, NeoX pos_emb: alibi).",
        choices=("learned", "sinusoidal", "rotary", "alibi"),
        aliases=("pos-emb",),
    )
    rotary_percent: float = opt(
        1.0,
        "Fraction of each head's dimensions rotary positions rotate (rotary only); the rest pass "
        "unchanged. GPT-NeoX/Pythia 0.25 (NeoX rotary_pct, HF partial_rotary_factor, Megatron "
        "--rotary-percent).",
        aliases=("rotary_pct", "rotary-percent", "partial_rotary_factor"),
        gt=0,
        le=1,
    )
    parallel_residual: bool = opt(
        False,
        "GPT-J/GPT-NeoX block: attention and MLP read the same block input (each through its own "
        "norm) and both outputs are added to the residual at once (NeoX gpt_j_residual, HF "
        "use_parallel_residual).",
        aliases=("gpt_j_residual", "use_parallel_residual"),
    )
    add_qkv_bias: bool | None = opt(
        None,
        "Biases on the query/key/value projection; default add_bias_linear. true with "
        "add_bias_linear = false is Qwen2's attention (Megatron --add-qkv-bias).",
        aliases=("add-qkv-bias",),
    )
    add_mlp_bias: bool | None = opt(
        None,
        "Biases on the MLP's two projections; default add_bias_linear. true with add_bias_linear = "
        "false is what GPT-NeoX builds when use_bias_in_mlp is left at its default with attention "
        "biases off (its llama2/ configs); HF Llama's mlp_bias.",
        aliases=("add-mlp-bias", "use_bias_in_mlp", "mlp_bias"),
    )
    sliding_window: int | None = opt(
        None,
        "Causal attention sees at most this many tokens back, itself included (Mistral's "
        "sliding_window; Megatron --window-size LEFT,0 is LEFT + 1); None: the whole sequence. The "
        "megatron FLOPs convention counts attention over the window, the others as their sources do "
        "(docs/METRICS.md).",
        aliases=("sliding-window",),
        gt=0,
    )
    reset_position_ids: bool = opt(
        False,
        "GPT, packed samples: positions restart after every end-of-document token (Megatron "
        "--reset-position-ids); the data loader passes each token's document.",
        aliases=("reset-position-ids",),
    )
    reset_attention_mask: bool = opt(
        False,
        "GPT, packed samples: a token attends to the earlier tokens of its own document only (a "
        "block-causal mask: Megatron --reset-attention-mask, torchtitan's document masking).",
        aliases=("reset-attention-mask",),
    )
    rotary_base: int = opt(
        10000,
        "Base of the rotary frequencies (rotary only; Llama 3: 500000).",
        aliases=("rotary-base",),
        gt=0,
    )
    rope_scaling: bool = opt(
        False,
        "Llama 3.1's rotary frequency scaling (rotary only): wavelengths longer than 8192 positions are "
        "stretched by rope_scaling_factor, shorter than 2048 kept, smoothly in between.",
        aliases=("use-rope-scaling",),
    )
    rope_scaling_factor: float = opt(
        8.0, "Stretch of the long wavelengths under rope_scaling.", aliases=("rope-scaling-factor",), ge=1
    )
    tie_word_embeddings: bool = opt(True, "Share the input embedding with the output (LM) layer.")
    num_experts: int = opt(
        0,
        "Mixture of experts (GPT only): routed experts per MoE layer; 0 = every layer has a dense MLP. "
        "Each expert is an MLP of moe_ffn_hidden_size with the model's activation (Mixtral, OLMoE: "
        "SwiGLU); a token goes to moe_router_topk of them (Megatron --num-experts, HF "
        "num_local_experts, DeepSeek n_routed_experts, NeoX moe_num_experts).",
        aliases=("num-experts", "num_local_experts", "n_routed_experts", "moe_num_experts"),
        ge=0,
    )
    moe_router_topk: int = opt(
        2,
        "MoE: experts each token is routed to (token choice; Megatron --moe-router-topk, HF "
        "num_experts_per_tok, NeoX moe_top_k).",
        aliases=("moe-router-topk", "num_experts_per_tok", "moe_top_k"),
        gt=0,
    )
    moe_ffn_hidden_size: int | None = opt(
        None,
        "MoE: inner size of each routed expert's MLP; default ffn_hidden_size (Megatron "
        "--moe-ffn-hidden-size, HF moe_intermediate_size, Mixtral's intermediate_size).",
        aliases=("moe-ffn-hidden-size", "moe_intermediate_size"),
        gt=0,
    )
    moe_router_score: str = opt(
        "softmax",
        "MoE: router score of each expert from its logit: softmax over the experts (Mixtral, OLMoE) or "
        "sigmoid (DeepSeek-V3); the top-k scores weight the experts' outputs (Megatron "
        "--moe-router-score-function).",
        choices=("softmax", "sigmoid"),
        aliases=("moe-router-score-function", "scoring_func"),
    )
    moe_router_load_balancing: str = opt(
        "aux_loss",
        "MoE: how the router keeps the experts' load even. aux_loss: the load-balancing loss "
        "(moe_aux_loss_coeff); sinkhorn: in training each token's experts are the top-k of the "
        "Sinkhorn-balanced logits, weighted by their moe_router_score scores, no loss (GPT-NeoX's dMoE and "
        "Megatron's sinkhorn router, which score sigmoid for top-1 and softmax otherwise, not "
        "renormalised: their imports set that); none: plain top-k, no loss (NeoX's topk router). "
        "Megatron --moe-router-load-balancing-type.",
        choices=("aux_loss", "sinkhorn", "none"),
        aliases=("moe-router-load-balancing-type",),
    )
    moe_norm_topk_prob: bool = opt(
        True,
        "MoE: rescale each token's top-k scores to sum to 1 (Mixtral and Megatron's default: softmax "
        "after top-k); false keeps the scores as they are (OLMoE, Qwen-MoE: HF norm_topk_prob).",
        aliases=("norm_topk_prob",),
    )
    moe_aux_loss_coeff: float = opt(
        0.01,
        "MoE: weight of the load-balancing loss (Switch/GShard: E x sum over experts of the share of "
        "routed tokens x the mean router probability, per MoE layer), added to the training loss "
        "(Megatron --moe-aux-loss-coeff, HF router_aux_loss_coef); 0 turns it off.",
        aliases=("moe-aux-loss-coeff", "router_aux_loss_coef", "moe_loss_coeff"),
        ge=0,
    )
    moe_z_loss_coeff: float = opt(
        0.0,
        "MoE: weight of the router z-loss (ST-MoE: mean squared logsumexp of the router logits), which "
        "keeps router logits small (Megatron --moe-z-loss-coeff, OLMoE router_z_loss_coef 0.001).",
        aliases=("moe-z-loss-coeff", "router_z_loss_coef"),
        ge=0,
    )
    moe_capacity_factor: float | None = opt(
        None,
        "MoE: each expert takes at most capacity_factor x (tokens x topk / num_experts) tokens of a "
        "micro-batch, the rest of its assignments are dropped (counted in the log); None = dropless "
        "(Megatron --moe-expert-capacity-factor).",
        aliases=("moe-expert-capacity-factor", "capacity_factor"),
        gt=0,
    )
    moe_shared_expert_size: int = opt(
        0,
        "MoE: inner size of an always-on shared expert MLP added to every MoE layer's output "
        "(DeepSeek: n_shared_experts x moe_intermediate_size; Megatron "
        "--moe-shared-expert-intermediate-size); 0 = none.",
        aliases=("moe-shared-expert-intermediate-size", "shared_expert_intermediate_size"),
        ge=0,
    )
    moe_layer_freq: int = opt(
        1,
        "MoE: layer i (from 0) is an MoE layer when i % moe_layer_freq == 0 and i >= moe_first_k_dense; "
        "the others keep a dense MLP of ffn_hidden_size (1: every layer, 2: every other; Megatron "
        "--moe-layer-freq).",
        aliases=("moe-layer-freq",),
        gt=0,
    )
    moe_first_k_dense: int = opt(
        0,
        "MoE: the first k layers keep dense MLPs (DeepSeek first_k_dense_replace).",
        aliases=("first_k_dense_replace", "moe-first-k-dense"),
        ge=0,
    )
    apply_residual_connection_post_layernorm: bool = opt(
        False,
        "Post-LN block ordering of the original BERT (LayerNorm after the residual add); default is pre-LN.",
        aliases=("apply-residual-connection-post-layernorm",),
    )
    bert_binary_head: bool = opt(
        True, "BERT only: add the NSP/SOP binary classification head.", aliases=("bert-binary-head",)
    )
    num_tokentypes: int = opt(2, "BERT only: number of token-type (segment) embeddings.", ge=0)


@dataclass
class ParallelConfig:
    dp: int = opt(
        -1, "Data-parallel size; -1 = world_size / (cp * tp * pp).", aliases=("data-parallel-size",)
    )
    tp: int = opt(
        1, "Tensor-parallel size.", aliases=("tensor-model-parallel-size", "model-parallel-size"), ge=1
    )
    pp: int = opt(
        1,
        "Pipeline-parallel size.",
        aliases=("pipeline-model-parallel-size", "pipe-parallel-size"),
        ge=1,
    )
    cp: int = opt(
        1,
        "Context-parallel size: each sample's sequence is split over this many ranks (two load-balanced "
        "chunks each, i and 2cp-1-i of 2cp), keys and values all-gathered in every attention layer; "
        "parameters are replicated over cp and their gradients reduced over dp x cp (Megatron "
        "context-parallel-size, torchtitan context_parallel_degree).",
        aliases=("context-parallel-size", "context_parallel_degree", "context-parallel-degree"),
        ge=1,
    )
    ep: int = opt(
        1,
        "Expert-parallel size (MoE only): the routed experts are split over this many ranks, carved "
        "out of the dp x cp ranks (which hold replicas of everything else); tokens reach their "
        "experts by all-to-all and come back the same way. Must divide model.num_experts and dp x cp "
        "(Megatron expert-model-parallel-size, torchtitan expert_parallel_degree).",
        aliases=("expert-model-parallel-size", "expert_parallel_degree", "expert-parallel-degree"),
        ge=1,
    )
    zero_stage: int = opt(
        0,
        "ZeRO stage: 0 DDP, 1 optimizer state sharded (ZeroRedundancyOptimizer), 2 + gradients "
        "(FSDP2, parameters kept after forward), 3 + parameters (FSDP2, resharded after forward).",
    )
    dp_shard: int = opt(
        -1,
        "ZeRO-2/3: the data-parallel ranks each parameter, gradient and optimizer state is sharded "
        "over; dp / dp_shard such groups hold replicas and all-reduce their sharded gradients (HSDP: "
        "FSDP2 on a replicate x shard mesh, so every all-gather stays within dp_shard ranks, e.g. one "
        "node). -1 = dp: shard over every data-parallel rank (torchtitan "
        "data_parallel_shard_degree, DeepSpeed MiCS mics_shard_size).",
        aliases=("data_parallel_shard_degree", "data-parallel-shard-degree", "dp-shard"),
    )
    offload_optimizer: bool = opt(
        False,
        "ZeRO-2/3: keep the sharded fp32 parameters, gradients and optimizer state in host memory and "
        "step the optimizer there (FSDP2 CPUOffloadPolicy, which offloads parameters too).",
    )
    offload_param: bool = opt(
        False, "ZeRO-3: keep the sharded parameters in host memory between uses (FSDP2 CPUOffloadPolicy)."
    )
    grad_reduce_dtype: str = opt(
        "fp32",
        "Dtype gradients are reduced in across data-parallel ranks (Megatron "
        "--accumulate-allreduce-grads-in-fp32 = fp32); bf16/fp16 halve the traffic.",
        choices=("fp32", "bf16", "fp16"),
    )
    fsdp_param_dtype: str = opt(
        "auto",
        "ZeRO-2/3 under train.precision = bf16/fp16: dtype FSDP2 all-gathers parameters in. auto = the "
        "compute dtype (half the gather bytes; sharded fp32 master weights and optimizer state stay "
        "fp32, gradients are reduced in grad_reduce_dtype), fp32 = gather fp32 and let autocast cast.",
        choices=("auto", "fp32"),
    )
    sequence_parallel: bool = opt(
        False,
        "Tensor parallel: also split norms and dropout along the sequence (Megatron --sequence-parallel).",
        aliases=("sequence-parallel",),
    )
    pipeline_schedule: str = opt(
        "1f1b",
        "Pipeline schedule (torch.distributed.pipelining): gpipe, 1f1b, interleaved-1f1b (needs "
        "virtual_pipeline_stages > 1), looped-bfs, zero-bubble (interleaved), zbv (zero-bubble V, "
        "2 stages per rank).",
        choices=("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "zero-bubble", "zbv"),
    )
    virtual_pipeline_stages: int = opt(
        1,
        "Model chunks (stages) per pipeline rank; > 1 for interleaved schedules.",
        aliases=("virtual-pipeline-model-parallel-size",),
        ge=1,
    )
    pipeline_layers: str | None = opt(
        None,
        "Transformer layers per pipeline stage, comma-separated (e.g. '3,5'); default: even split.",
    )
    timeout_minutes: float = opt(
        10.0,
        "Collective timeout: a rank waiting longer than this fails the job instead of hanging.",
        aliases=("distributed-timeout-minutes",),
        gt=0,
    )
    activation_checkpointing: str = opt(
        "none",
        "Recompute activations in backward: none, full (every checkpoint_num_layers layers) "
        "or selective (attention core only). Counts towards HFU, not MFU.",
        choices=("none", "full", "selective"),
    )
    checkpoint_num_layers: int = opt(
        1,
        "Layers per activation-checkpointed chunk (full mode).",
        aliases=("checkpoint-num-layers",),
        ge=1,
    )
    distribute_saved_activations: bool = opt(
        False,
        "Full recompute with tp > 1: each tensor-parallel rank keeps 1/tp of every checkpointed layer "
        "input and the layer all-gathers it before recomputing (Megatron "
        "--distribute-saved-activations, DeepSpeed partition_activations). Sequence parallelism "
        "already shards those inputs.",
        aliases=("distribute-checkpointed-activations", "partition_activations"),
    )
    cpu_checkpointing: bool = opt(
        False,
        "Full recompute: keep the checkpointed layer inputs in host memory and copy each back before "
        "its layer is recomputed (DeepSpeed cpu_checkpointing; NeoX checkpoint_in_cpu).",
        aliases=("checkpoint_in_cpu",),
    )
    reduce_each_micro_batch: bool = opt(
        False,
        "ZeRO-2/3 with gradient accumulation: reduce-scatter every micro-batch's gradients into the "
        "sharded gradients (DeepSpeed's behaviour; 1/dp of the gradient memory, one reduce-scatter per "
        "micro-batch) instead of accumulating unsharded gradients and reducing once per step. A "
        "DeepSpeed zero_optimization block with stage 2 or 3 sets it.",
    )
    compile: bool = opt(False, "Wrap each transformer block in torch.compile (cold start 10-30 s).")


@dataclass
class OptimConfig:
    optimizer: str = opt(
        "adam",
        "adam/adamw: Adam with decoupled weight decay (Megatron's and DeepSpeed's "
        "'adam' are AdamW); sgd: SGD with momentum.",
        choices=("adam", "adamw", "sgd"),
    )
    adam_w_mode: bool = opt(
        True, "Decoupled weight decay (AdamW). False = L2 added to the gradient (torch.optim.Adam)."
    )
    lr: float = opt(1e-4, "Peak learning rate.", ge=0)
    min_lr: float = opt(0.0, "Floor of the decayed learning rate.", aliases=("min-lr",), ge=0)
    weight_decay: float = opt(
        0.01,
        "Decoupled weight decay; never applied to biases and norm weights.",
        aliases=("weight-decay",),
        ge=0,
    )
    adam_beta1: float = opt(0.9, "Adam beta1.", aliases=("adam-beta1",), ge=0, lt=1)
    adam_beta2: float = opt(0.999, "Adam beta2.", aliases=("adam-beta2",), ge=0, lt=1)
    adam_eps: float = opt(1e-8, "Adam epsilon.", aliases=("adam-eps",), gt=0)
    sgd_momentum: float = opt(0.9, "SGD momentum.", aliases=("sgd-momentum",), ge=0)
    clip_grad: float = opt(
        1.0,
        "Clip the global gradient 2-norm to this; 0 disables.",
        aliases=("clip-grad",),
        ge=0,
    )
    scheduler: str = opt(
        "megatron",
        "megatron: warmup then decay (lr_decay_style); warmup_lr: DeepSpeed's WarmupLR "
        "(warmup from warmup_min_lr to lr, then constant); warmup_decay_lr: DeepSpeed's WarmupDecayLR "
        "(WarmupLR's warmup, then linear decay to warmup_min_lr at lr_decay_iters).",
        choices=("megatron", "warmup_lr", "warmup_decay_lr"),
    )
    lr_decay_style: str = opt(
        "linear",
        "Decay after warmup (megatron scheduler).",
        choices=("constant", "linear", "cosine"),
        aliases=("lr-decay-style",),
    )
    lr_decay_iters: int | None = opt(
        None,
        "Iterations over which lr decays to min_lr, counted from 0; default train_iters.",
        aliases=("lr-decay-iters",),
        gt=0,
    )
    lr_warmup_iters: int = opt(0, "Linear warmup length in iterations.", aliases=("lr-warmup-iters",), ge=0)
    lr_warmup_fraction: float | None = opt(
        None,
        "Warmup as a fraction of lr_decay_iters; overrides lr_warmup_iters.",
        aliases=("lr-warmup-fraction", "warmup"),
        ge=0,
        le=1,
    )
    warmup_min_lr: float = opt(0.0, "WarmupLR: lr at iteration 0.")
    warmup_type: str = opt("log", "WarmupLR: shape of the warmup curve.", choices=("log", "linear"))


@dataclass
class DataConfig:
    path: str | None = opt(
        None,
        "Megatron indexed dataset prefix (PREFIX.bin + PREFIX.idx), or a weighted blend in Megatron's syntax "
        "'0.3 PREFIX_A 0.7 PREFIX_B'. None = the embedded Python-documentation corpus.",
        aliases=("data-path",),
    )
    tokenizer: str = opt(
        "embedded",
        "'embedded' = WordPiece trained on the bundled corpus (cached in the user cache dir); or a path to a "
        "HF tokenizer.json, a BERT vocab.txt, or a directory holding GPT-2 vocab.json + merges.txt.",
    )
    vocab_file: str | None = opt(
        None,
        "Megatron's vocab file (BERT vocab.txt or GPT-2 vocab.json); sets the tokenizer.",
        aliases=("vocab-file",),
    )
    merge_file: str | None = opt(
        None, "GPT-2 BPE merges.txt that goes with vocab_file.", aliases=("merge-file",)
    )
    tokenizer_type: str | None = opt(
        None,
        "Megatron tokenizer type when loading a vocab file; default: inferred from the files.",
        choices=("BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer", "HFTokenizer"),
        aliases=("tokenizer-type",),
    )
    tokenizer_vocab_size: int = opt(8192, "Vocabulary size when training the embedded tokenizer.")
    whole_word_masking: bool = opt(False, "BERT: mask whole words (all ## pieces of a word together).")
    split: str = opt("949,50,1", "Train/valid/test proportions, by document.", aliases=("split",))
    mask_prob: float = opt(
        0.15,
        "BERT: fraction of tokens selected for masking (80/10/10).",
        aliases=("mask-prob",),
        ge=0,
        lt=1,
    )
    short_seq_prob: float = opt(
        0.1,
        "BERT: probability of a shorter-than-max sample.",
        aliases=("short-seq-prob",),
        ge=0,
        lt=1,
    )
    eod_mask_loss: bool = opt(
        False,
        "GPT: no loss where the input token is an end-of-document token (predicting the next document's "
        "first token from the last one's end; Megatron and GPT-NeoX --eod-mask-loss).",
        aliases=("eod-mask-loss",),
    )
    binary_head_task: str = opt(
        "nsp", "BERT binary head task: next-sentence (nsp) or sentence-order (sop).", choices=("nsp", "sop")
    )
    num_workers: int = opt(
        0,
        "DataLoader worker processes (0 = in the training process).",
        aliases=("num-workers",),
        ge=0,
    )


@dataclass
class TrainConfig:
    train_iters: int = opt(300, "Number of optimizer steps.", aliases=("train-iters",), gt=0)
    micro_batch_size: int = opt(
        16,
        "Samples per device per forward/backward.",
        aliases=("micro-batch-size", "batch-size", "train_micro_batch_size_per_gpu"),
        gt=0,
    )
    gradient_accumulation_steps: int | None = opt(
        None,
        "Micro-batches per optimizer step; default global_batch_size / (micro_batch_size * dp).",
        aliases=("gradient-accumulation-steps",),
        gt=0,
    )
    global_batch_size: int | None = opt(
        None,
        "Samples per optimizer step = micro_batch_size * gradient_accumulation_steps * dp.",
        aliases=("global-batch-size", "train_batch_size"),
        gt=0,
    )
    derive_micro_batch_size: bool = opt(
        False,
        "Derive micro_batch_size when resolving, as global_batch_size / (gradient_accumulation_steps "
        "(default 1) x dp), as DeepSpeed does for a config giving train_batch_size without "
        "train_micro_batch_size_per_gpu (a DeepSpeed file sets it).",
    )
    seed: int = opt(
        1234, "Seed of python, numpy and torch RNGs; same seed gives the same losses.", aliases=("seed",)
    )
    precision: str = opt(
        "fp32",
        "Compute dtype: fp32, bf16 (autocast), fp16 (autocast + dynamic loss scaling).",
        choices=("fp32", "bf16", "fp16"),
    )
    fp8: str = opt(
        "none",
        "FP8 training of the transformer blocks' linear layers (torchao float8; the embeddings and the "
        "output layer compute in train.precision, which must be bf16): none, tensorwise (one dynamic "
        "scale per tensor; under ZeRO-2/3 the weights are all-gathered in float8) or rowwise (one scale "
        "per row; weights all-gathered in bf16). Needs model.hidden_size, model.ffn_hidden_size and the "
        "attention widths divisible by 16 (the float8 GEMM's rule).",
        choices=("none", "tensorwise", "rowwise"),
        aliases=("float8_recipe_name",),
    )
    loss_scale: float | None = opt(None, "fp16: static loss scale; None = dynamic.", aliases=("loss-scale",))
    initial_scale_power: int = opt(16, "fp16: dynamic loss scale starts at 2**initial_scale_power.")
    loss_scale_window: int = opt(
        1000, "fp16: steps without overflow before the scale doubles.", aliases=("loss-scale-window",)
    )
    hysteresis: int = opt(
        2, "fp16: overflowing steps tolerated before the dynamic scale is halved.", aliases=("hysteresis",)
    )
    min_loss_scale: float = opt(
        1.0, "fp16: the dynamic scale never drops below this.", aliases=("min-loss-scale",)
    )
    device: str = opt("auto", "auto = cuda when available, else cpu.", choices=("auto", "cpu", "cuda"))
    eval_interval: int = opt(
        100,
        "Run evaluation every this many iterations (0 = only at the end).",
        aliases=("eval-interval",),
        ge=0,
    )
    eval_iters: int = opt(
        10, "Validation micro-batches per evaluation (0 = no evaluation).", aliases=("eval-iters",), ge=0
    )
    exit_interval: int | None = opt(
        None, "Stop after an iteration divisible by this.", aliases=("exit-interval",)
    )
    on_nonfinite: str = opt(
        "stop",
        "bf16/fp32: what a step whose loss or gradient norm is inf/nan does: stop (the run ends naming "
        "the step at the next logging step or checkpoint save, which is not written, so the last good "
        "checkpoint stays the one checkpoint.load=auto picks; nothing is read from the device between) "
        "or skip (no update, no schedule step, counted; reads the gradient norm every step). fp16's "
        "loss scaler skips overflowing steps either way.",
        choices=("stop", "skip"),
    )
    max_skipped_steps: int = opt(
        10,
        "on_nonfinite=skip: the run stops once this many steps of this job were skipped as non-finite.",
        ge=0,
    )
    loss_spike_factor: float = opt(
        10.0,
        "A step whose loss exceeds this factor times the median of the last 100 steps' losses is "
        "logged as a loss spike (Megatron's spiky-loss check); 0 = off.",
        ge=0,
    )
    stop_check_interval: int = opt(
        1,
        "Steps between the checks whether any rank caught SIGTERM/SIGUSR1 (then every rank stops after "
        "the same step, saves and exits 75). Each check is one all-reduce of a host int over all ranks.",
        gt=0,
    )
    hang_timeout_seconds: float | None = opt(
        None,
        "Watchdog: when no step completes on a rank for this long, every rank that can writes its "
        "stacks into <run dir>/hang and the job exits non-zero naming the rank(s) that stopped "
        "progressing. Default: 20x the median step time, bounded to 300-3600 s (before the first "
        "steps: parallel.timeout_minutes); 0 = off.",
        ge=0,
    )


@dataclass
class LoggingConfig:
    log_interval: int = opt(
        10,
        "Print and record metrics every this many iterations.",
        aliases=("log-interval", "steps_per_print"),
        gt=0,
    )
    run_dir: str = opt("runs", "Parent directory of run directories.")
    run_name: str | None = opt(None, "Run directory name; default <model>-<timestamp>.")
    tensorboard: bool = opt(True, "Write TensorBoard event files into the run directory.")
    tensorboard_dir: str | None = opt(
        None, "TensorBoard directory; default <run dir>/tensorboard.", aliases=("tensorboard-dir",)
    )
    flops_convention: str = opt(
        "megatron",
        "FLOPs convention for TFLOPs, MFU and HFU, named by the code it reproduces (docs/METRICS.md): "
        "megatron (Megatron-DeepSpeed's 2022 formula, generalised here to GQA, gated MLPs, any F and "
        "sliding windows; the default), megatron-deepspeed-2022, megatron-lm (current, causal attention "
        "halved), megatron-lm-2024 (before the halving), torchtitan, llm-foundry (MPT), mosaic "
        "(MosaicML's published table), 6n (PaLM/nanoGPT).",
        choices=FLOPS_CONVENTIONS,
    )
    device_name: str | None = opt(
        None,
        "Name in the peak-FLOPs table (e.g. a100-80gb); default: detected. "
        "On CPU the peak is a measured GEMM rate.",
    )
    peak_tflops: float | None = opt(None, "Override the peak dense TFLOPs per device used for MFU/HFU.", gt=0)
    warmup_iters: int = opt(
        3, "Iterations excluded from throughput statistics (compile, allocator warm-up).", ge=0
    )
    track_tensor_bytes: bool = opt(
        False,
        "CPU: measure live tensor bytes per rank (peak over the first 3 steps, torch.profiler's "
        "allocation events; slows those steps) into summary.json's peak_tensor_bytes_per_rank. On "
        "GPU always measured (torch.cuda.max_memory_allocated).",
    )
    timers_sync: bool = opt(
        False,
        "Synchronize the device at every phase timer's start and stop, so that per-phase times are "
        "device times (a host synchronization per call; overlap between phases is lost). Off: on a GPU "
        "the phase times are the host's enqueue times and only the iteration time is a device time "
        "(CUDA events, read at logging steps); on a CPU both are the same.",
        aliases=("wall_clock_breakdown",),
    )
    timing_log_level: int = opt(
        2,
        "Which phase timers run (Megatron's --timing-log-level): 0 none (iteration time only), 1 the "
        "disjoint phases of a step (forward-compute, backward-compute, all-grads-sync, optimizer, ...), "
        "2 also the nested ones (optimizer parts, pipeline-p2p-wait).",
        ge=0,
        le=2,
    )
    telemetry: bool = opt(
        True,
        "Sample device telemetry in a background thread: GPU utilisation, power, energy, memory, clocks "
        "(NVML / amdsmi), CPU utilisation and RAPL energy (psutil, /sys/class/powercap).",
    )
    telemetry_interval: float = opt(0.5, "Seconds between telemetry samples.", gt=0, le=60)
    profile_start_step: int | None = opt(
        None,
        "First iteration of a torch.profiler window (YAML: `profile: {start_step: 5, end_step: 7, "
        "ranks: [0], memory: false}`); None = no profiling. Profiled steps are left out of throughput.",
        ge=1,
    )
    profile_end_step: int | None = opt(
        None, "Last iteration of the profiler window (inclusive); default start_step.", ge=1
    )
    profile_ranks: str = opt(
        "0", "Ranks that write a Chrome trace of the window: comma-separated (YAML: a list), or 'all'."
    )
    profile_memory: bool = opt(
        False,
        "On CUDA, also record a memory snapshot of the window (torch.cuda.memory._dump_snapshot, for "
        "https://pytorch.org/memory_viz); the profiler's own memory columns on CPU.",
    )


@dataclass
class CheckpointConfig:
    save: str | None = opt(
        None,
        "Directory to save checkpoints into (SAVE/iter_0000100/, SAVE/latest); saved every save_interval "
        "iterations and at the end of training. Sharded (torch.distributed.checkpoint), atomic.",
        aliases=("save",),
    )
    load: str | None = opt(
        None,
        "Checkpoint to resume from: a save directory (its latest checkpoint), one iter_XXXXXXX directory, "
        "or 'auto' = the latest complete checkpoint in checkpoint.save (start fresh when there is none). "
        "Any layout may load any other layout's checkpoint.",
        aliases=("load",),
    )
    save_interval: int | None = opt(
        None,
        "Iterations between saves; None = only at the end of training.",
        aliases=("save-interval",),
        ge=1,
    )
    keep_last_n: int | None = opt(
        None,
        "Keep only the newest N checkpoints (older ones deleted once a newer one is complete); None = all.",
        aliases=("keep-last-n-checkpoints", "keep-last-n"),
        ge=1,
    )
    no_save_optim: bool = opt(False, "Save weights without the optimizer state.", aliases=("no-save-optim",))
    no_save_rng: bool = opt(False, "Save without the RNG states.", aliases=("no-save-rng",))
    no_load_optim: bool = opt(
        False,
        "Resume with a fresh optimizer state (the schedule position is loaded).",
        aliases=("no-load-optim",),
    )
    no_load_rng: bool = opt(False, "Do not restore the RNG states on load.", aliases=("no-load-rng",))
    finetune: bool = opt(
        False,
        "Load the weights only: iteration 0, consumed samples 0, fresh optimizer and schedule.",
        aliases=("finetune",),
    )
    init_from_hf: str | None = opt(
        None,
        "Start from the weights of a local Hugging Face GPT2LMHeadModel / LlamaForCausalLM / "
        "MistralForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM / MixtralForCausalLM / OlmoeForCausalLM / "
        "Qwen3MoeForCausalLM / GPTNeoXForCausalLM / BertForPreTraining / "
        "MegatronBertForPreTraining directory "
        "(iteration 0, fresh optimizer); model.* must match it: `stx config from-hf DIR` prints the "
        "settings.",
    )


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


class _Frozen:
    """Assignment raises once `freeze` has run: a resolved config is read-only, so no module can change
    what another already checked (dataclasses.replace makes an unfrozen copy to resolve again)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_frozen"):
            raise dataclasses.FrozenInstanceError(
                f"cannot set {name!r}: a resolved config is frozen; make a changed copy with "
                "dataclasses.replace and resolve it again"
            )
        super().__setattr__(name, value)


# Values `resolve` derives from the keys, carried by the resolved sections so no module outside
# config/ recomputes them. Attributes, not dataclass fields: no config file sets them, and
# config.yaml, `stx config show` and the config reference (fields only) leave them out.


class _ModelDerived(_Frozen):
    padded_vocab_size: (
        int | None
    )  # word-embedding rows: Megatron's padding (None until the vocabulary is known)


class _ParallelDerived(_Frozen):
    layout_label: str  # THE layout label of a run (rules.layout_label)
    pipeline_bubble: float | None  # the theoretical idle share of a pipeline step (None: pp = 1)
    stage_layer_counts: list[int]  # transformer layers of each of the pp x virtual stages


class _DataDerived(_Frozen):
    split_fractions: tuple[float, float, float]  # data.split as train, valid, test fractions


class _LoggingDerived(_Frozen):
    profiled_ranks: list[int]  # the ranks the profiler window runs on (empty without a window)


@dataclass
class ResolvedModelConfig(ModelConfig, _ModelDerived):
    num_query_groups: int = 0  # derived: never None once resolved
    ffn_hidden_size: int = 0  # derived: never None once resolved
    max_position_embeddings: int = 0


@dataclass
class ResolvedParallelConfig(ParallelConfig, _ParallelDerived):
    pass


@dataclass
class ResolvedOptimConfig(OptimConfig, _Frozen):
    lr_decay_iters: int = 0


@dataclass
class ResolvedDataConfig(DataConfig, _DataDerived):
    pass


@dataclass
class ResolvedTrainConfig(TrainConfig, _Frozen):
    gradient_accumulation_steps: int = 0
    global_batch_size: int = 0


@dataclass
class ResolvedLoggingConfig(LoggingConfig, _LoggingDerived):
    pass


@dataclass
class ResolvedCheckpointConfig(CheckpointConfig, _Frozen):
    pass


@dataclass
class ResolvedConfig(Config, _Frozen):
    """What `config.validate.resolve` returns: every derived value filled (typed without None, except
    model.vocab_size before a tokenizer is read), every rule checked, frozen. Parallel dp is >= 1.
    The sections also carry the values derived from the keys (model.padded_vocab_size,
    parallel.layout_label, parallel.pipeline_bubble, parallel.stage_layer_counts,
    data.split_fractions, logging.profiled_ranks): attributes, not keys."""

    model: ResolvedModelConfig = field(default_factory=ResolvedModelConfig)
    parallel: ResolvedParallelConfig = field(default_factory=ResolvedParallelConfig)
    optim: ResolvedOptimConfig = field(default_factory=ResolvedOptimConfig)
    data: ResolvedDataConfig = field(default_factory=ResolvedDataConfig)
    train: ResolvedTrainConfig = field(default_factory=ResolvedTrainConfig)
    logging: ResolvedLoggingConfig = field(default_factory=ResolvedLoggingConfig)
    checkpoint: ResolvedCheckpointConfig = field(default_factory=ResolvedCheckpointConfig)


RESOLVED_SECTIONS: dict[str, type] = {
    "model": ResolvedModelConfig,
    "parallel": ResolvedParallelConfig,
    "optim": ResolvedOptimConfig,
    "data": ResolvedDataConfig,
    "train": ResolvedTrainConfig,
    "logging": ResolvedLoggingConfig,
    "checkpoint": ResolvedCheckpointConfig,
}


def freeze(cfg: ResolvedConfig) -> ResolvedConfig:
    """Make cfg and its sections read-only (see `_Frozen`); returns cfg."""
    for section in SECTIONS:
        object.__setattr__(getattr(cfg, section), "_frozen", True)
    object.__setattr__(cfg, "_frozen", True)
    return cfg


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "optim": OptimConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "logging": LoggingConfig,
    "checkpoint": CheckpointConfig,
}


def section_fields(section: str) -> dict[str, dataclasses.Field]:
    """The fields of one section, by name."""
    return {f.name: f for f in dataclasses.fields(SECTIONS[section])}


_BOUND_TEXT = {"ge": ">=", "gt": ">", "lt": "<", "le": "<="}


def check_value(f: dataclasses.Field, value: Any, where: str) -> None:
    """A field's value rule (finite, within its bounds); raise ConfigError naming `where` and what
    would be valid. None (derive) passes."""
    if value is None or isinstance(value, bool) or not isinstance(value, int | float):
        return
    if not math.isfinite(value):
        raise ConfigError(f"{where} must be a finite number, got {value!r}")
    bounds = f.metadata.get("bounds", {})
    ok = {
        "ge": lambda b: value >= b,
        "gt": lambda b: value > b,
        "lt": lambda b: value < b,
        "le": lambda b: value <= b,
    }
    if not all(ok[k](b) for k, b in bounds.items()):
        low = [k for k in ("ge", "gt") if k in bounds]
        high = [k for k in ("le", "lt") if k in bounds]
        if low and high:  # an interval: [0, 1)
            valid = (
                f"in {'[' if low[0] == 'ge' else '('}{bounds[low[0]]:g}, "
                f"{bounds[high[0]]:g}{']' if high[0] == 'le' else ')'}"
            )
        else:
            valid = " and ".join(f"{_BOUND_TEXT[k]} {b:g}" for k, b in bounds.items())
        raise ConfigError(f"{where} must be {valid}, got {value!r}")


def check_section(section: str, values: Any) -> None:
    """Every field's value rule over one section (`values`: that section's dataclass)."""
    for f in dataclasses.fields(SECTIONS[section]):
        check_value(f, getattr(values, f.name), f"'{section}.{f.name}'")


def check_fields(cfg: Config) -> None:
    """Every field's value rule over a whole config (configs built in Python skip the loader)."""
    for section in SECTIONS:
        check_section(section, getattr(cfg, section))
