"""Megatron's command-line dialect (Megatron-LM and Megatron-DeepSpeed) for `stx config import`: the
arguments of the line that runs `pretrain_*.py`, each carried to a key of ours, ignored with its
reason, or refused; Megatron's defaults where the command line is silent.

ONE table, `MEGATRON_ARGS`, holds every Megatron argument that this import treats beyond what the loader
already maps (schema aliases, and the Megatron names a config file of ours may use too:
`MEGATRON_FILE_SWITCHES` / `_IGNORED` / `_REFUSED` here, which load.py's tables are built from). An
argument in neither is refused: an unknown argument might be a model shape or a layout
(`--num-experts`), and dropping one silently imports another model. Training-recipe arguments with no
equivalent (a decoupled embedding learning rate, a batch-size ramp) are ignored with their reason,
listed in the imported file; model shape and layout arguments are carried or refused, never ignored.

A value the script cannot give without running (a `$1`, a command substitution: shell_script.py) is
never guessed: on a path argument (data, checkpoint, tokenizer files) it is listed as not carried; on
any other argument it is an error naming the argument and the variable.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import PurePosixPath
from typing import Any

from ..errors import ConfigError
from . import deepspeed_json
from .shell_script import MARK, Script

# Megatron-LM's defaults (megatron/training/arguments.py, megatron/training/config/training_config.py)
# where ours differ, applied where no source sets the key: key -> (value, Megatron's argument).
MEGATRON_DEFAULTS: dict[str, tuple[Any, str]] = {
    "logging.log_interval": (100, "--log-interval"),
    "train.eval_iters": (100, "--eval-iters"),
}
# Megatron's --initial-loss-scale default 2**32 (ours 2**16), for fp16 runs
FP16_INITIAL_SCALE_POWER = 32

# Arguments naming files of the machine the script ran on (or the run's tokenizer): their values are
# written as comments, and a value the script leaves to its caller ($1) is listed as not carried.
PATH_ARGS = {
    "data_path",
    "vocab_file",
    "merge_file",
    "save",
    "load",
    "tensorboard_dir",
    "tokenizer_model",
    "data_cache_path",
    "deepspeed_config",
    "wandb_save_dir",
    "train_data_path",
    "valid_data_path",
    "test_data_path",
}


# Megatron's names a config file of ours may use too (the loader, load.py, builds its tables from these):
# switches (name -> (our key, value when true, value when false or None: nothing)), the values of two
# options spelled differently here, names accepted and ignored with why (they choose a kernel, a launcher
# or a debugging aid, not what is trained), and names refused with why.
MEGATRON_FILE_SWITCHES: dict[str, tuple[str, Any, Any]] = {
    "openai_gelu": ("model.activation", "openai-gelu", None),
    "swiglu": ("model.activation", "swiglu", None),
    "disable_bias_linear": ("model.add_bias_linear", False, True),
    "untie_embeddings_and_output_weights": ("model.tie_word_embeddings", False, True),
    "checkpoint_activations": ("parallel.activation_checkpointing", "full", "none"),
}
POSITION_EMBEDDING_NAMES = {"rope": "rotary", "learned_absolute": "learned"}
NORMALIZATION_NAMES = {"layernorm": "layernorm", "rmsnorm": "rmsnorm"}
_FILE_FUSION = "is a CUDA kernel-fusion switch (same numerics unfused)"
_ACT_CKPT = "places checkpointed activations (parallel.activation_checkpointing decides what is recomputed)"
_RETRIEVAL = "belongs to Megatron's ICT/REALM retrieval pretraining (not pretraining BERT/GPT)"
_RESUMED_SCHEDULE = (
    "chooses where a resumed schedule comes from (the schedule is a function of the config and the "
    "iteration, so both give the same)"
)
_AUTORESUME = "is NVIDIA's cluster autoresume (resume with checkpoint.load=auto)"
_PROFILING = "is a profiling switch (stx reports per-phase timers)"
MEGATRON_FILE_IGNORED: dict[str, str] = {
    **dict.fromkeys(("local_rank", "deepspeed_mpi", "world_size", "rank"), "is set by the launcher"),
    **dict.fromkeys(
        (
            "scaled_upper_triang_masked_softmax_fusion",
            "scaled_masked_softmax_fusion",
            "masked_softmax_fusion",
            "bias_gelu_fusion",
            "bias_dropout_fusion",
        ),
        _FILE_FUSION,
    ),
    **dict.fromkeys(("deepspeed_activation_checkpointing", "contigious_checkpointing"), _ACT_CKPT),
    **dict.fromkeys(
        (
            "ict_head_size",
            "ict_load",
            "bert_load",
            "titles_data_path",
            "query_in_block_prob",
            "use_one_sent_docs",
            "report_topk_accuracies",
            "faiss_use_gpu",
            "block_data_path",
            "indexer_batch_size",
            "indexer_log_interval",
        ),
        _RETRIEVAL,
    ),
    "group_query_attention": "switches Megatron's model.num_query_groups on (set the number of groups)",
    "onnx_safe": "is an ONNX-export workaround (stx export writes Hugging Face checkpoints)",
    "distributed_backend": "picks the collective backend (gloo on CPU, nccl on GPU, chosen by the device)",
    "ddp_impl": "picks Megatron's DDP implementation (parallel.zero_stage picks ours)",
    "lazy_mpu_init": "is a Megatron initialisation-order switch",
    "use_cpu_initialization": "places weight initialisation (weights are built on the CPU and moved)",
    "mmap_warmup": "pre-reads the dataset (indexed datasets are memory-mapped on demand)",
    "data_impl": "picks the dataset format (Megatron's mmap format is the one read here)",
    "adlr_autoresume": _AUTORESUME,
    "adlr_autoresume_interval": _AUTORESUME,
    "synchronize_each_layer": _PROFILING,
    "profile_backward": _PROFILING,
    "override_lr_scheduler": _RESUMED_SCHEDULE,
    "use_checkpoint_lr_scheduler": _RESUMED_SCHEDULE,
    "attention_softmax_in_fp32": "is on anyway (autocast runs softmax in fp32)",
    "apply_query_key_layer_scaling": "is an fp16 overflow workaround, needless with softmax in fp32",
    "fp16_lm_cross_entropy": "would compute the loss in fp16 (the loss is computed in fp32)",
    **dict.fromkeys(("fp32_allreduce", "accumulate_allreduce_grads_in_fp32"), deepspeed_json.ALLREDUCE_DTYPE),
}
MEGATRON_FILE_REFUSED: dict[str, str] = {
    "num_unique_layers": "layers sharing weights are not supported; every layer has its own",
    "param_sharing_style": "layers sharing weights are not supported; every layer has its own",
    "cpu_optimizer": "set parallel.offload_optimizer: true (with parallel.zero_stage 2 or 3) to step the "
    "optimizer on the CPU",
}


@dataclasses.dataclass(frozen=True)
class Rule:
    """How one Megatron argument is treated: ignore (why), refuse (why, unless the value is `accept`),
    or handle (a function of the value and every argument, returning loader keys -> values)."""

    kind: str  # ignore | refuse | handle
    why: str = ""
    accept: tuple[Any, ...] = ()
    handle: Callable[[Any, dict[str, Any]], dict[str, Any]] | None = None


def _ignore(why: str) -> Rule:
    return Rule("ignore", why)


def _refuse(why: str, accept: tuple[Any, ...] = ()) -> Rule:
    return Rule("refuse", why, accept)


def _handle(fn: Callable[[Any, dict[str, Any]], dict[str, Any]]) -> Rule:
    """fn(value, every argument) -> loader keys -> values; {WHY: reason} when nothing is carried."""
    return Rule("handle", handle=fn)


WHY = "_why"  # a handler's key for "accepted, nothing to carry: why"


_KERNEL = "picks a kernel or Megatron's implementation of the same model (no effect on what is trained)"
_FUSION = "is a CUDA kernel-fusion switch (same numerics unfused)"
_OVERLAP = "overlaps communication with compute: a speed setting, the same training"
_FP8_DELAYED = (
    "tunes Transformer Engine's delayed scaling (an amax history): train.fp8 = tensorwise scales each "
    "tensor from its current amax (torchao has no delayed scaling)"
)
_FP8_RECIPES = {"tensorwise": "tensorwise", "delayed": "tensorwise"}
_DATA_LOADING = "is a data-loading switch of Megatron's loader (the same samples)"
_HOUSEKEEPING = "is memory housekeeping of Megatron's loop"
_TOKENIZER = "names the original run's tokenizer: set data.tokenizer"
_MOE_KERNEL = "selects a kernel for the experts (a grouped GEMM here): the same math"
_RAMP = (
    "ramps the global batch size up over the first samples, which is not supported: the imported run "
    "trains at --global-batch-size from its first step"
)


def _samples_to_iters(key: str, name: str) -> Callable[[Any, dict[str, Any]], dict[str, Any]]:
    """Megatron's sample-based schedule as iterations: samples // global batch (Megatron's own
    train_iters = train_samples // global_batch_size, without a batch ramp)."""

    def handle(value: Any, args: dict[str, Any]) -> dict[str, Any]:
        batch = args.get("global_batch_size")
        if not isinstance(batch, int):
            raise ConfigError(
                f"--{name} counts samples; converting it to iterations needs --global-batch-size, which "
                "the command line does not give (Megatron's default depends on the world size)"
            )
        if not isinstance(value, int):
            raise ConfigError(f"--{name} must be a whole number of samples, got {value!r}")
        return {key: max(1, value // batch) if key != "lr_warmup_iters" else value // batch}

    return handle


def _split(value: Any, args: dict[str, Any]) -> dict[str, Any]:
    """Megatron reads --split as the numbers in it (re.findall of [.0-9]+), so '99,1,0' with its quotes,
    as a script's array element gives it, is 99,1,0."""
    numbers = re.findall(r"[.0-9]+", str(value))
    return {"split": ",".join(numbers) if numbers else value}


def _rotary_percent(value: Any, args: dict[str, Any]) -> dict[str, Any]:
    if not _rotary(args):
        return {WHY: "read only with rope"}
    return {"rotary_percent": value}  # Megatron rotates int(head_dim x percent) leading channels, as here


def _vocab_multiple(value: Any, args: dict[str, Any]) -> dict[str, Any]:
    """Megatron pads the vocabulary to a multiple of this x --tensor-model-parallel-size; here the
    multiple is one number (model.make_vocab_size_divisible_by), so it is carried multiplied."""
    tp = args.get("tensor_model_parallel_size", 1)
    return {
        "make_vocab_size_divisible_by": value * tp
        if isinstance(value, int) and isinstance(tp, int)
        else value
    }


def _window_size(value: Any, args: dict[str, Any]) -> dict[str, Any]:
    """Megatron's --window-size is flash-attention's (left, right) pair: a query sees `left` tokens back
    and `right` ahead, itself too. A causal window (left, 0) is sliding_window = left + 1 here (which
    counts the token itself); a window that looks ahead has no equivalent."""
    numbers = [int(n) for n in re.findall(r"-?\d+", str(value))]
    if len(numbers) != 2 or numbers[0] < 0 or numbers[1] != 0:
        raise ConfigError(
            f"--window-size {value!r}: only a causal window (LEFT,0) imports (model.sliding_window = "
            "LEFT + 1, the token itself included); Megatron reads it as flash-attention's (left, right)"
        )
    return {"sliding_window": numbers[0] + 1}


def _rotary(args: dict[str, Any]) -> bool:
    return str(args.get("position_embedding_type", "")).lower() == "rope" or bool(
        args.get("use_rotary_position_embeddings")
    )


def _fp8_format(value: Any, args: dict[str, Any]) -> dict[str, Any]:
    """--fp8-format hybrid (e4m3 inputs and weights, e5m2 gradients: torchao's float8 formats) turns
    FP8 on with --fp8-recipe's scaling: tensorwise (current per-tensor scaling) is train.fp8 =
    tensorwise; delayed (Megatron's default: per-tensor scales from an amax history) is carried as
    tensorwise too, the same GEMMs and granularity with the scale from the current amax. Refused:
    e4m3 gradients, and the block-scaled recipes (mxfp8, blockwise), which have no equivalent here."""
    if value != "hybrid":
        raise ConfigError(
            f"--fp8-format {value}: FP8 here is torchao's float8 training, which casts the output "
            "gradients to e5m2 and the rest to e4m3 (Megatron's hybrid); --fp8-format e4m3 (e4m3 "
            "gradients) has no equivalent: use --fp8-format hybrid, or drop it to train in --bf16"
        )
    recipe = args.get("fp8_recipe", "delayed")
    if recipe not in _FP8_RECIPES:
        raise ConfigError(
            f"--fp8-recipe {recipe}: its block scaling has no equivalent in torchao's float8 training "
            "(train.fp8 = tensorwise or rowwise); use --fp8-recipe tensorwise (or delayed, carried as "
            "tensorwise), or drop --fp8-format to train in --bf16"
        )
    return {"fp8": _FP8_RECIPES[recipe]}


def _fp8_recipe(value: Any, args: dict[str, Any]) -> dict[str, Any]:
    if args.get("fp8") is None and args.get("fp8_format") is None:
        return {WHY: "Megatron reads it only with --fp8-format (FP8 is off)"}
    return {WHY: "carried with --fp8-format as train.fp8"}


def _kv_channels(value: Any, args: dict[str, Any]) -> dict[str, Any]:
    """The head size: carried as model.kv_channels, left unset when it is Megatron's default
    (--hidden-size / --num-attention-heads), so the imported config reads as one written here."""
    hidden, heads = args.get("hidden_size"), args.get("num_attention_heads")
    if isinstance(hidden, int) and isinstance(heads, int) and value * heads == hidden:
        return {
            WHY: "equals --hidden-size / --num-attention-heads, the default head size (model.kv_channels)"
        }
    return {"kv_channels": value}


def _qk_layernorm(value: Any, args: dict[str, Any]) -> dict[str, Any]:
    """Megatron's --qk-layernorm: one norm of the model's kind over each head's features, q and k."""
    return {"qk_norm": "head"} if value else {}


def _group_query_attention(value: Any, args: dict[str, Any]) -> dict[str, Any]:
    """Megatron reads --num-query-groups only with --group-query-attention, whose default is 1."""
    return {"num_query_groups": args.get("num_query_groups", 1)} if value else {}


def _num_query_groups(value: Any, args: dict[str, Any]) -> dict[str, Any]:
    if args.get("group_query_attention"):
        return {}  # carried by --group-query-attention
    return {WHY: "Megatron reads it only with --group-query-attention (plain multi-head attention here)"}


def _no_position_embedding(value: Any, args: dict[str, Any]) -> dict[str, Any]:
    """Megatron's --no-position-embedding drops the learned position table: nothing to drop under
    rotary positions (Megatron's own Mixtral and Llama scripts pass both); alone, a model without
    positions, which is not built here."""
    if not value or _rotary(args):
        return {WHY: "rotary positions have no learned position table to turn off"}
    raise ConfigError(
        "--no-position-embedding without --position-embedding-type rope: a model with no position "
        "information is not built here (rotary, learned, sinusoidal or ALiBi positions)"
    )


def _moe_pre_softmax(value: Any, args: dict[str, Any]) -> dict[str, Any]:
    """Megatron's softmax before top-k keeps the top-k scores as they are; its default (softmax after
    top-k) is a softmax over the chosen logits, i.e. the top-k scores renormalised. Its sinkhorn router
    reads neither (_moe_load_balancing)."""
    if args.get("moe_router_load_balancing_type") == "sinkhorn":
        return {
            WHY: "Megatron's sinkhorn router weights by its own scores (--moe-router-load-balancing-type)"
        }
    return {"model": {"moe_norm_topk_prob": not value}}


def _moe_load_balancing(value: Any, args: dict[str, Any]) -> dict[str, Any]:
    """Megatron's sinkhorn router (transformer/moe/router.py sinkhorn_load_balancing) weights the chosen
    experts by sigmoid scores for top-1 and softmax scores otherwise, not renormalised."""
    model: dict[str, Any] = {"moe_router_load_balancing": value}
    if value == "sinkhorn":
        topk = int(args.get("moe_router_topk", 2))
        model.update(moe_router_score="sigmoid" if topk == 1 else "softmax", moe_norm_topk_prob=False)
    return {"model": model}


def _sequence_parallel(value: Any, args: dict[str, Any]) -> dict[str, Any]:
    """Megatron turns sequence parallelism off at tensor-model-parallel-size 1 (arguments.py)."""
    if args.get("tensor_model_parallel_size", 1) > 1:
        return {"sequence_parallel": value}
    return {WHY: "Megatron turns sequence parallelism off at tensor-model-parallel-size 1"}


def _distributed_optimizer(value: Any, args: dict[str, Any]) -> dict[str, Any]:
    return {"parallel": {"zero_stage": 1}} if value else {}


def _grad_reduce_in_bf16(value: Any, args: dict[str, Any]) -> dict[str, Any]:
    return {"parallel": {"grad_reduce_dtype": "bf16"}} if value else {}


def _use_rotary(value: Any, args: dict[str, Any]) -> dict[str, Any]:
    return {"model": {"position_embedding_type": "rotary"}} if value else {}


def _recompute(value: Any, args: dict[str, Any]) -> dict[str, Any]:
    """--recompute-granularity full|selective with --recompute-method uniform and --recompute-num-layers."""
    method = args.get("recompute_method")
    if value == "selective":
        return {"parallel": {"activation_checkpointing": "selective"}}
    if value != "full":
        raise ConfigError(f"--recompute-granularity {value!r}: Megatron's choices are full and selective")
    if method not in (None, "uniform"):
        raise ConfigError(
            f"--recompute-method {method}: recomputing only the first layers of each stage is not "
            "supported; uniform (every --recompute-num-layers layers) is"
        )
    return {
        "parallel": {
            "activation_checkpointing": "full",
            "checkpoint_num_layers": args.get("recompute_num_layers", 1),
        }
    }


def _recompute_part(value: Any, args: dict[str, Any]) -> dict[str, Any]:
    if "recompute_granularity" not in args:
        raise ConfigError("--recompute-method / --recompute-num-layers need --recompute-granularity full")
    return {}  # carried by --recompute-granularity


def _virtual_stage_layers(value: Any, args: dict[str, Any]) -> dict[str, Any]:
    layers, pp = args.get("num_layers"), args.get("pipeline_model_parallel_size", 1)
    if not isinstance(layers, int) or layers % (pp * value):
        raise ConfigError(
            f"--num-layers-per-virtual-pipeline-stage {value}: --num-layers ({layers}) is not a multiple "
            f"of {value} x pipeline size {pp}"
        )
    return {"virtual_pipeline_stages": layers // (pp * value)}


def _profile(value: Any, args: dict[str, Any]) -> dict[str, Any]:
    """Megatron profiles iterations [start, end): ours names the last one (inclusive)."""
    if not value:
        return {}
    start, end = args.get("profile_step_start", 10), args.get("profile_step_end", 12)
    ranks = args.get("profile_ranks", 0)
    return {
        "logging": {
            "profile_start_step": start,
            "profile_end_step": max(start, end - 1),
            "profile_ranks": str(ranks).replace(" ", ","),
        }
    }


def _with_profile(value: Any, args: dict[str, Any]) -> dict[str, Any]:
    return {} if args.get("profile") else {WHY: "Megatron reads it only with --profile"}


def _lr_warmup_init(value: Any, args: dict[str, Any]) -> dict[str, Any]:
    if value != 0:
        raise ConfigError(f"--lr-warmup-init {value}: the warmup here starts at a learning rate of 0")
    return {WHY: "0: the warmup starts at 0, as here"}


def _deepspeed_config(value: Any, args: dict[str, Any]) -> dict[str, Any]:
    return {}  # read by foreign_configs.py when the script writes the file, else listed as a path


MEGATRON_ARGS: dict[str, Rule] = {
    # model shape: Megatron's current names
    "kv_channels": _handle(_kv_channels),
    "qk_layernorm": _handle(_qk_layernorm),
    "rotary_percent": _handle(_rotary_percent),
    "window_size": _handle(_window_size),
    "make_vocab_size_divisible_by": _handle(_vocab_multiple),
    "window_attn_skip_freq": _refuse(
        "mixes full-attention layers into a sliding-window model: every layer here has the same attention"
    ),
    "group_query_attention": _handle(_group_query_attention),
    "num_query_groups": _handle(_num_query_groups),
    "use_rotary_position_embeddings": _handle(_use_rotary),  # Megatron-DeepSpeed's name for rope
    "apply_layernorm_1p": _ignore(
        "parametrises the norm weights as 1 + w: the same function, and with no weight decay on norm "
        "weights (as here) the same Adam updates"
    ),
    "no_query_key_layer_scaling": _ignore("turns query-key layer scaling off: off here (softmax in fp32)"),
    # mixture of experts: --num-experts, --moe-router-topk, --expert-model-parallel-size,
    # --moe-ffn-hidden-size, --moe-aux-loss-coeff, ... are schema aliases (model.num_experts, ...)
    "no_position_embedding": _handle(_no_position_embedding),
    "moe_router_pre_softmax": _handle(_moe_pre_softmax),
    "moe_router_load_balancing_type": _handle(_moe_load_balancing),
    "moe_token_drop_policy": _refuse(
        "drops by position in the micro-batch: under a capacity factor each expert here keeps its "
        "highest-scored assignments (probs)",
        accept=("probs",),
    ),
    "moe_grouped_gemm": _ignore(_MOE_KERNEL),
    "moe_permute_fusion": _ignore(_MOE_KERNEL),
    "moe_token_dispatcher_type": _ignore(
        "picks how tokens reach their experts (all-to-all here under parallel.ep): the same tokens and math"
    ),
    "moe_pad_expert_input_to_capacity": _ignore(
        "pads each expert's input to its capacity: done here whenever a capacity factor is set"
    ),
    "moe_router_dtype": _ignore("sets the router's dtype: the router computes in fp32 here"),
    # layout
    "sequence_parallel": _handle(_sequence_parallel),
    "use_distributed_optimizer": _handle(_distributed_optimizer),
    "num_layers_per_virtual_pipeline_stage": _handle(_virtual_stage_layers),
    "recompute_granularity": _handle(_recompute),
    "recompute_method": _handle(_recompute_part),
    "recompute_num_layers": _handle(_recompute_part),
    "recompute_activations": _handle(
        lambda v, a: {"parallel": {"activation_checkpointing": "selective"}} if v else {}
    ),
    # precision, optimizer, schedule
    "grad_reduce_in_bf16": _handle(_grad_reduce_in_bf16),
    "train_samples": _handle(_samples_to_iters("train_iters", "train-samples")),
    "lr_decay_samples": _handle(_samples_to_iters("lr_decay_iters", "lr-decay-samples")),
    "lr_warmup_samples": _handle(_samples_to_iters("lr_warmup_iters", "lr-warmup-samples")),
    "lr_warmup_init": _handle(_lr_warmup_init),
    "decoupled_lr": _ignore(
        "sets a separate learning rate for the embedding and output layers, which is not supported: "
        "they train at optim.lr here"
    ),
    "decoupled_min_lr": _ignore("goes with --decoupled-lr (not supported: optim.min_lr applies)"),
    "step_batch_size_schedule": _ignore(_RAMP),
    "rampup_batch_size": _ignore(_RAMP),
    "calculate_per_token_loss": _ignore(
        "averages the loss over tokens instead of micro-batches: every sample here has seq_length "
        "tokens, so both give the same mean"
    ),
    **dict.fromkeys(("fp8", "fp8_format"), _handle(_fp8_format)),
    "fp8_recipe": _handle(_fp8_recipe),
    **dict.fromkeys(
        ("fp8_margin", "fp8_interval", "fp8_amax_history_len", "fp8_amax_compute_algo"), _ignore(_FP8_DELAYED)
    ),
    "fp8_wgrad": _ignore(
        "computes the weight gradients in FP8 (Megatron's default, and torchao's tensorwise recipe's)"
    ),
    "fp8_param_gather": _ignore(
        "all-gathers FP8 parameters: here a tensorwise run under ZeRO-2/3 all-gathers its weights in "
        "float8 (torchao), with ZeRO-0/1 there is no parameter all-gather"
    ),
    # kernels, implementations, overlap, housekeeping
    **dict.fromkeys(
        ("attention_backend", "use_mcore_models", "transformer_impl", "use_flash_attn", "use_legacy_models"),
        _ignore(_KERNEL),
    ),
    **dict.fromkeys(
        (
            "cross_entropy_loss_fusion",
            "no_masked_softmax_fusion",
            "no_bias_gelu_fusion",
            "no_bias_swiglu_fusion",
            "no_bias_dropout_fusion",
            "no_rope_fusion",
            "no_gradient_accumulation_fusion",
            "no_persist_layer_norm",
        ),
        _ignore(_FUSION),
    ),
    **dict.fromkeys(
        (
            "overlap_grad_reduce",
            "overlap_param_gather",
            "tp_comm_overlap",
            "no_async_tensor_model_parallel_allreduce",
        ),
        _ignore(_OVERLAP),
    ),
    **dict.fromkeys(("manual_gc", "manual_gc_interval", "empty_unused_memory_level"), _ignore(_HOUSEKEEPING)),
    "exit_duration_in_mins": _ignore(
        "is the job's time limit (stx train stops and saves on the scheduler's SIGTERM)"
    ),
    # data, tokenizer, checkpoints, logging
    "split": _handle(_split),
    "mock_data": _ignore("trains on synthetic tokens: set data.path (default: the embedded corpus)"),
    "data_cache_path": _ignore("is a cache folder on the original machine"),
    "tokenizer_model": _ignore(_TOKENIZER),
    "tiktoken_pattern": _ignore(_TOKENIZER),
    **dict.fromkeys(
        ("no_create_attention_mask_in_dataloader", "no_mmap_bin_files", "num_dataset_builder_threads"),
        _ignore(_DATA_LOADING),
    ),
    "ckpt_format": _ignore(
        "picks Megatron's checkpoint format (checkpoints here are torch.distributed.checkpoint, the "
        "library of Megatron's torch_dist)"
    ),
    "log_throughput": _ignore("stx logs throughput at every log_interval anyway"),
    "profile": _handle(_profile),
    "profile_step_start": _handle(_with_profile),
    "profile_step_end": _handle(_with_profile),
    "profile_ranks": _handle(_with_profile),
    "deepspeed": _ignore(
        "runs Megatron-DeepSpeed's DeepSpeed engine: its --deepspeed_config is read when the script "
        "writes it (else give it with --deepspeed)"
    ),
    "deepspeed_config": _handle(_deepspeed_config),
}

# Whole families, by prefix: reporting switches.
PREFIX_RULES: dict[str, Rule] = {
    "log_": _ignore("is a logging/reporting switch (stx logs its own metrics)"),
    "wandb_": _ignore("is a Weights & Biases setting (stx logs to TensorBoard and JSON)"),
    "tensorboard_log_": _ignore("is a logging/reporting switch (stx logs its own metrics)"),
    "tensorboard_queue_size": _ignore("is a logging/reporting switch (stx logs its own metrics)"),
}


def megatron_rule(name: str, known: Callable[[str], bool] = lambda name: False) -> Rule | None:
    """The table's rule for a Megatron argument (snake case), or None: the loader maps it (`known`), or
    nothing does. The prefix rules apply only to names the loader does not map (--log-interval is ours)."""
    if name in MEGATRON_ARGS:
        return MEGATRON_ARGS[name]
    if known(name):
        return None
    return next((rule for prefix, rule in PREFIX_RULES.items() if name.startswith(prefix)), None)


@dataclasses.dataclass
class Translated:
    """What the import does with a command line's arguments: `mapping` (loader keys -> values, for
    `foreign_configs._add`), `ignored` (flag, value, why), `not_carried` (flag, value, why: paths the
    script leaves to its caller), `defaults` (key -> (value, why): Megatron's, where nothing sets it)."""

    mapping: dict[str, Any] = dataclasses.field(default_factory=dict)
    ignored: list[tuple[str, Any, str]] = dataclasses.field(default_factory=list)
    not_carried: list[tuple[str, Any, str]] = dataclasses.field(default_factory=list)
    defaults: dict[str, tuple[Any, str]] = dataclasses.field(default_factory=dict)

    def not_carried_has(self, flag: str) -> bool:
        return any(f == flag for f, _, _ in self.not_carried)


def _merge(mapping: dict[str, Any], new: dict[str, Any]) -> None:
    for key, value in new.items():
        if isinstance(value, dict):
            mapping.setdefault(key, {}).update(value)
        else:
            mapping[key] = value


def translate_megatron_args(
    flags: dict[str, Any], source: str, script: Script | None, known: Callable[[str], bool]
) -> Translated:
    """Every argument carried, ignored with its reason, or refused (a ConfigError naming it and the
    source). `flags`: Megatron names (kebab or snake) -> values; `known`: whether the loader maps a key."""
    args = {name.replace("-", "_"): value for name, value in flags.items()}
    out = Translated()
    for name, value in args.items():
        flag = f"--{name.replace('_', '-')}"
        needs = script.unknowns_in(str(value)) if script is not None and MARK in str(value) else []
        if needs:
            if name in PATH_ARGS or name in ("tokenizer_type", "save_interval"):
                shown = script.readable(str(value)) if script is not None else value
                out.not_carried.append((flag, shown, f"needs {'; '.join(needs)}"))
                continue
            raise ConfigError(
                f"{source}: {flag} needs {'; '.join(needs)}: its value is known only when the script "
                "runs; set it in the script (or give the argument with --megatron-args)"
            )
        rule = megatron_rule(name, known)
        if rule is None:
            if not known(name):
                raise ConfigError(
                    f"{source}: Megatron argument {flag} is not known here: neither carried nor known to be "
                    "safe to ignore (it might change the model or its layout), so the import stops"
                )
            _merge(out.mapping, {flag[2:]: value})
            continue
        _apply_rule(out, rule, name, flag, value, args, source)
    return out


def _apply_rule(
    out: Translated, rule: Rule, name: str, flag: str, value: Any, args: dict[str, Any], source: str
) -> None:
    if rule.kind == "ignore":
        if value not in (False, None):
            out.ignored.append((flag, value, rule.why))
        return
    if rule.kind == "refuse":
        if value not in (False, None, *rule.accept):
            raise ConfigError(f"{source}: {flag} {value!r}: {rule.why}")
        return
    assert rule.handle is not None
    try:
        new = rule.handle(value, args)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    why = new.pop(WHY, None)
    if why is not None and value not in (False, None):
        out.ignored.append((flag, value, why))
    _merge(out.mapping, new)


def megatron_defaults(args: dict[str, Any]) -> dict[str, tuple[Any, str]]:
    """Megatron's defaults, where they differ from ours, for a command line that is silent on them:
    key -> (value, why); the caller applies each where no source set the key."""
    args = {name.replace("-", "_"): value for name, value in args.items()}
    names = set(args)
    out = {
        path: (value, f"Megatron's default ({flag} not given)")
        for path, (value, flag) in MEGATRON_DEFAULTS.items()
        if flag[2:].replace("-", "_") not in names
    }
    if args.get("fp16") is True and "initial_loss_scale" not in names:
        out["train.initial_scale_power"] = (
            FP16_INITIAL_SCALE_POWER,
            "Megatron's default --initial-loss-scale 2**32",
        )
    tp = args.get("tensor_model_parallel_size", 1)
    if isinstance(tp, int) and tp > 1 and "make_vocab_size_divisible_by" not in names:
        divisible = 128
        out["model.make_vocab_size_divisible_by"] = (
            divisible * tp,
            f"Megatron pads the vocabulary to a multiple of --make-vocab-size-divisible-by ({divisible}) x "
            f"--tensor-model-parallel-size ({tp})",
        )
    if (
        args.get("swiglu") is True
        and "ffn_hidden_size" not in names
        and isinstance(args.get("hidden_size"), int)
    ):
        ffn = int((4 * args["hidden_size"] * 2 / 3) / 64) * 64  # Megatron's rule for --swiglu
        out["model.ffn_hidden_size"] = (ffn, "Megatron's default for --swiglu: int(4 h 2/3 / 64) x 64")
    return out


def family_of_entry(entry: str, line: int, source: str) -> str:
    """The model family of a Megatron entry script (pretrain_gpt.py -> gpt, pretrain_bert.py -> bert)."""
    name = PurePosixPath(entry).name
    families = {"pretrain_gpt.py": "gpt", "pretrain_bert.py": "bert"}
    if name not in families:
        raise ConfigError(
            f"{source}:{line}: the entry point '{name}' is not one this import reads: pretrain_gpt.py (gpt) "
            "or pretrain_bert.py (bert)"
        )
    return families[name]
