"""GPT-NeoX's config dialect for `stx config import --neox`: the YAML/JSON files `deepy.py train.py a.yml
b.yml` reads, read as NeoX reads them (merged key by key, `-` and `_` alike, a key in two files an error),
the DeepSpeed sections as DeepSpeed parses them (config/deepspeed_json.py), and the model NeoX builds
from them: always a GPT (NeoX trains decoders only), its MLP width with NeoX's own rounding, its
vocabulary padded as NeoX pads it.

ONE table, `NEOX_ARGS`, holds every argument of NeoX's current reference (configs/neox_arguments.md of
EleutherAI/gpt-neox, and the fields of megatron/neox_arguments/*.py the page does not list): carried to
keys of ours, ignored with its reason, or refused (with the values that ask for nothing and pass).
A key in no row is not a NeoX argument: NeoX itself refuses the file (`NeoXArgs(**config)`), and so
does the import. Model shape and layout arguments are carried or refused, never ignored.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from pathlib import Path, PurePosixPath
from typing import Any

from ..errors import ConfigError
from . import deepspeed_json

SOURCE = (
    "EleutherAI/gpt-neox configs/neox_arguments.md and megatron/neox_arguments/*.py at ea7aefd8 (2026-05-19)"
)


@dataclasses.dataclass(frozen=True)
class Rule:
    """carried (detail: the keys it sets), ignored (detail: why) or refused (detail: why; `accept`: the
    values that ask for nothing, NeoX's default among them, which pass)."""

    kind: str
    detail: str
    accept: tuple[Any, ...] = ()


def _c(detail: str) -> Rule:
    return Rule("carried", detail)


def _i(why: str) -> Rule:
    return Rule("ignored", why)


def _r(why: str, *accept: Any) -> Rule:
    return Rule("refused", why, (None, False, *accept))


_FUSION = "chooses a fused CUDA kernel (the same numerics unfused)"
_LAUNCHER = "is a launcher setting (stx launch / torchrun decide the processes)"
_MONITOR = "is a monitoring backend (stx logs to its run directory; TensorBoard: logging.tensorboard_dir)"
_TEXTGEN = "is a text-generation or evaluation setting (stx pretrains)"
_DERIVED = "is derived by NeoX from other arguments (derived here too)"
_PATHS = "names data files of the machine the run came from"
_RL = "is a post-training (DPO/KTO/RM/REINFORCE) setting; train_impl decides, and only 'normal' imports"
_MUP = "applies only with use_mup (refused)"
_MAMBA = "applies to Mamba layers only (attention_config 'mamba' is refused)"
_RWKV = "applies to RWKV layers only (attention_config 'rwkv' is refused)"
_TE = "chooses Transformer Engine's implementation of the same layer (its FP8 is not built: train.precision)"
_DS = "DeepSpeed's section, read as DeepSpeed reads it (docs/CONFIG.md, the DeepSpeed table)"
_SCALE = "is the Megatron loss-scaling argument; NeoX scales by DeepSpeed's fp16 block (read there)"
_LOGGING = "is an extra logging or profiling aid (stx logs its own figures every log_interval)"
_INIT = (
    "picks NeoX's weight initialisation; here weights are normal(0, init_method_std) with output layers "
    "scaled by 1/sqrt(2 num_layers) (NeoX's normal / scaled_normal): the same model, another start"
)
_NOT_CARRIED_PATHS = (
    "train_data_paths", "valid_data_paths", "test_data_paths", "train_data_weights", "valid_data_weights",
    "test_data_weights",
)  # fmt: skip

NEOX_ARGS: dict[str, Rule] = {
    # NeoXArgsLRScheduler
    "lr_decay_style": _c("optim.lr_decay_style (constant, linear, cosine; exponential refused)"),
    "lr_decay_iters": _c("optim.lr_decay_iters"),
    "lr_decay_fraction": _c("optim.lr_decay_iters = floor(train_iters x fraction), as NeoX derives it"),
    "min_lr": _c("optim.min_lr"),
    "warmup": _c("optim.lr_warmup_fraction (of the decay iterations, as NeoX's AnnealingLR)"),
    "override_lr_scheduler": _i(
        "chooses where a resumed schedule comes from (the schedule is a function of "
        "the config and the iteration, so both give the same)"
    ),
    "use_checkpoint_lr_scheduler": _i("chooses where a resumed schedule comes from (the same schedule)"),
    # NeoXArgsLogging
    **dict.fromkeys(
        (
            "use_wandb",
            "wandb_group",
            "wandb_team",
            "wandb_project",
            "wandb_host",
            "wandb_init_all_ranks",
            "wandb_run_name",
            "use_comet",
            "comet_workspace",
            "comet_project",
            "comet_experiment_name",
            "comet_experiment",
            "comet_tags",
            "comet_others",
        ),
        _i(_MONITOR),
    ),
    "git_hash": _i("records NeoX's source version"),
    "log_dir": _i("is NeoX's folder for its stdout/stderr copies (stx writes into logging.run_dir)"),
    "tensorboard_dir": _c("logging.tensorboard_dir (a path: written as a comment)"),
    "log_interval": _c("logging.log_interval"),
    **dict.fromkeys(
        (
            "log_grad_pct_zeros",
            "log_param_norm",
            "log_grad_norm",
            "log_optimizer_states",
            "log_gradient_noise_scale",
            "gradient_noise_scale_n_batches",
            "gradient_noise_scale_cpu_offload",
            "memory_profiling",
            "memory_profiling_path",
            "profile",
            "profile_step_start",
            "profile_step_stop",
            "peak_theoretical_tflops",
        ),
        _i(_LOGGING),
    ),
    # NeoXArgsMoE
    "moe_num_experts": _c("model.num_experts (> 1: NeoX's dropless MoE, megatron/model/moe.py)"),
    "moe_expert_interval": _c("model.moe_layer_freq (layer i from 0 is MoE when i % interval == 0)"),
    "moe_top_k": _c("model.moe_router_topk"),
    "moe_router_type": _c(
        "model.moe_router_load_balancing (sinkhorn: sinkhorn; topk: none) and model.moe_router_score "
        "(sinkhorn: sigmoid for top-1, else softmax; topk: softmax)"
    ),
    "moe_lbl_in_fp32": _i("casts a load-balancing loss NeoX's dMoE does not compute; routing here is fp32"),
    "moe_jitter_eps": _r(
        "multiplies the router's input by uniform noise in training (topk router), which is not built "
        "here: leave moe_jitter_eps unset"
    ),
    # NeoXArgsModel
    "precision": _c("train.precision (fp16, bfloat16: bf16, fp32)"),
    "num_layers": _c("model.num_layers"),
    "hidden_size": _c("model.hidden_size"),
    "intermediate_size": _c("model.ffn_hidden_size, with NeoX's rounding (gated: 2/3 of it, halved)"),
    "mlp_multiple_of": _c("model.ffn_hidden_size (NeoX rounds the MLP width up to a multiple of it)"),
    "expansion_factor": _c("model.ffn_hidden_size (expansion_factor x hidden_size, then NeoX's rounding)"),
    "num_attention_heads": _c("model.num_attention_heads"),
    "num_kv_heads": _c("model.num_query_groups"),
    "seq_length": _c("model.seq_length"),
    "sliding_window_width": _c(
        "model.sliding_window = width + 1 under flash attention (flash-attn's "
        "window (width, -1): width tokens back and the token itself); NeoX's "
        "global attention ignores it"
    ),
    "max_position_embeddings": _c("model.max_position_embeddings"),
    "norm": _c(
        "model.norm (layernorm, rmsnorm; te_* the same norms; scalenorm and non_parametric_layernorm refused)"
    ),
    "layernorm_fusion": _i(_FUSION),
    "rmsnorm_fusion": _i(_FUSION),
    "use_qk_layernorm": _r(
        "NeoX's q/k norm is one norm over [heads per tensor-parallel rank, head dim] shared by q and k (what "
        "it normalises depends on the tp size); model.qk_norm's head and full norms give q and k their own"
    ),
    "layernorm_epsilon": _c("model.layernorm_epsilon (norm layernorm)"),
    "rms_norm_epsilon": _c("model.layernorm_epsilon (norm rmsnorm)"),
    "scalenorm_epsilon": _i("applies to norm scalenorm only (refused)"),
    "pos_emb": _c("model.position_embedding_type (learned, rotary, sinusoidal, alibi; rpe and none refused)"),
    "rpe_num_buckets": _i("applies to pos_emb rpe only (refused)"),
    "rpe_max_distance": _i("applies to pos_emb rpe only (refused)"),
    "opt_pos_emb_offset": _r("offset learned positions (OPT's) are not built here", 0),
    "no_weight_tying": _c("model.tie_word_embeddings (negated)"),
    "attention_config": _c(
        "nothing when every layer is global or flash attention (the same dense "
        "attention; flash is a kernel); other attention types, Mamba and RWKV refused"
    ),
    "sparsity_config": _i("configures sparse attention types of attention_config (refused there)"),
    "num_unique_layers": _r("layers sharing weights are not supported; every layer has its own"),
    "param_sharing_style": _i("applies only with num_unique_layers (refused)"),
    "make_vocab_size_divisible_by": _c(
        "model.make_vocab_size_divisible_by = it x model_parallel_size (NeoX pads to that multiple)"
    ),
    "activation": _c(
        "model.activation (gelu, geglu, swiglu; gelu with bias_gelu_fusion: openai-gelu, "
        "NeoX's fused kernel being the tanh approximation; others refused)"
    ),
    "use_flashattn_swiglu": _i(_FUSION),
    "scaled_upper_triang_masked_softmax_fusion": _i(_FUSION),
    "scaled_masked_softmax_fusion": _i(_FUSION),
    "bias_gelu_fusion": _c(
        "model.activation: gelu becomes openai-gelu (the fused kernel is the tanh "
        "approximation); otherwise a kernel choice"
    ),
    "bias_dropout_fusion": _i(_FUSION),
    "rope_fusion": _i(_FUSION),
    "fused_kernels_build_path": _i(_FUSION),
    "fp16_lm_cross_entropy": _i("would compute the loss in fp16 (the loss is computed in fp32)"),
    "init_method_std": _c("model.init_method_std"),
    "apply_query_key_layer_scaling": _i(
        "is an fp16 overflow workaround that scales scores and unscales "
        "them in the softmax (the same attention)"
    ),
    "use_cpu_initialization": _i("places weight initialisation (weights are built on the CPU and moved)"),
    "attention_softmax_in_fp32": _i("is on anyway (autocast runs softmax in fp32)"),
    "rotary_pct": _c("model.rotary_percent"),
    "rotary_emb_base": _c("model.rotary_base"),
    "rotary_save_freqs_buffer": _i("chooses whether checkpoints hold the rotary frequencies (recomputed)"),
    "init_method": _i(_INIT),
    "output_layer_init_method": _i(_INIT),
    "gmlp_attn_dim": _i("applies to gMLP layers only (attention_config 'gmlp' is refused)"),
    "gpt_j_residual": _c("model.parallel_residual"),
    "gpt_j_tied": _r(
        "one norm shared by attention and MLP in a parallel-residual block is not built here "
        "(each has its own, as NeoX's default and GPT-NeoX-20B)"
    ),
    "use_bias_in_norms": _i(
        "is read nowhere by NeoX's model (megatron/model): its LayerNorms keep their "
        "bias, RMSNorm has none, as here"
    ),
    "use_bias_in_attn_linear": _c("model.add_bias_linear"),
    "use_bias_in_mlp": _c("model.add_mlp_bias (where it differs from use_bias_in_attn_linear)"),
    "soft_prompt_tuning": _r("soft prompt tuning is not supported (stx pretrains every weight)"),
    **dict.fromkeys(
        (
            "mamba_selective_scan_fusion",
            "mamba_causal_conv_fusion",
            "mamba_inner_func_fusion",
            "mamba_selective_fp32_params",
            "mamba_use_bias_in_conv",
            "mamba_use_bias_in_linears",
        ),
        _i(_MAMBA),
    ),
    "output_layer_parallelism": _r(
        "only 'column' (the output layer split by vocabulary rows, as here) is built", "column"
    ),
    **dict.fromkeys(("dim_att", "head_size", "ffn_dim"), _i(_RWKV)),
    **dict.fromkeys(
        (
            "te_columnparallel",
            "te_rowparallel",
            "te_layernorm_mlp",
            "te_mha",
            "te_fp8_format",
            "te_fp8_wgrad",
            "te_fp8_amax_history_len",
            "te_fp8_amax_compute_algo",
            "te_fp8_margin",
            "te_fp8_mha",
        ),
        _i(_TE),
    ),
    "z_loss": _r("the z-loss term (log-partition penalty) is not built: the loss is cross entropy", 0, 0.0),
    # NeoXArgsOptimizer
    "optimizer_type": _i("is derived by NeoX from optimizer.type (read there)"),
    "use_bnb_optimizer": _r("bitsandbytes' 8-bit Adam is not supported (optimizer state is fp32 here)"),
    **dict.fromkeys(
        (
            "zero_stage",
            "zero_reduce_scatter",
            "zero_contiguous_gradients",
            "zero_reduce_bucket_size",
            "zero_allgather_bucket_size",
        ),
        _i("is derived by NeoX from zero_optimization (read there)"),
    ),
    "lr": _i("is derived by NeoX from optimizer.params.lr (read there)"),
    # NeoXArgsOther
    "distributed_backend": _i(
        "picks the collective backend (gloo on CPU, nccl on GPU, chosen by the device)"
    ),
    **dict.fromkeys(
        ("local_rank", "rank", "world_size", "global_num_gpus", "deepspeed_mpi", "deepspeed_slurm"),
        _i("is set by the launcher"),
    ),
    "lazy_mpu_init": _i("is a Megatron initialisation-order switch"),
    "short_seq_prob": _c("data.short_seq_prob"),
    "eod_mask_loss": _c("data.eod_mask_loss"),
    "adlr_autoresume": _i("is NVIDIA's cluster autoresume (resume with checkpoint.load=auto)"),
    "adlr_autoresume_interval": _i("is NVIDIA's cluster autoresume (resume with checkpoint.load=auto)"),
    "seed": _c("train.seed"),
    "onnx_safe": _i("is an ONNX-export workaround (stx export writes Hugging Face checkpoints)"),
    **dict.fromkeys(
        (
            "deepscale",
            "deepscale_config",
            "user_script",
            "iteration",
            "do_train",
            "do_valid",
            "do_test",
            "save_iters",
            "is_pipe_parallel",
            "padded_vocab_size",
            "batch_size",
            "clip_grad",
            "dynamic_loss_scale",
            "config_files",
        ),
        _i(_DERIVED),
    ),
    # NeoXArgsParallelism
    "pipe_parallel_size": _c("parallel.pp (0, NeoX's unwrapped sequential model, is 1 stage)"),
    "model_parallel_size": _c("parallel.tp"),
    "pipe_partition_method": _r(
        "only NeoX's partition by transformer layers (an equal number per stage, as here) is built",
        "type:transformer|mlp",
        "type:transformer",
    ),
    "sequence_parallel": _c("parallel.sequence_parallel"),
    # NeoXArgsTextgen
    **dict.fromkeys(
        (
            "text_gen_type",
            "precompute_model_name",
            "temperature",
            "top_p",
            "top_k",
            "return_logits",
            "maximum_tokens",
            "prompt_end",
            "sample_input_file",
            "sample_output_file",
            "num_samples",
            "recompute",
            "eval_results_prefix",
            "eval_tasks",
        ),
        _i(_TEXTGEN),
    ),
    # NeoXArgsTokenizer
    "tokenizer_type": _c("data.tokenizer_type (written as a comment with the vocabulary file)"),
    # NeoXArgsTraining
    "data_path": _c("data.path (a path: written as a comment)"),
    "use_shared_fs": _i("tells NeoX whether ranks share the dataset index files"),
    **dict.fromkeys(
        _NOT_CARRIED_PATHS,
        _i(
            _PATHS + ": set data.path (one corpus, split by data.split; "
            "train_data_paths is listed with the paths)"
        ),
    ),
    **dict.fromkeys(
        (
            "train_label_data_paths",
            "train_reward_data_paths",
            "test_label_data_paths",
            "test_reward_data_paths",
            "valid_label_data_paths",
            "valid_reward_data_paths",
            "pos_train_data_paths",
            "neg_train_data_paths",
            "pos_train_label_data_paths",
            "neg_train_label_data_paths",
            "pos_valid_data_paths",
            "neg_valid_data_paths",
            "pos_valid_label_data_paths",
            "neg_valid_label_data_paths",
            "pos_test_data_paths",
            "neg_test_data_paths",
            "pos_test_label_data_paths",
            "neg_test_label_data_paths",
            "dpo_fp32",
            "dpo_reference_free",
            "dpo_beta",
            "kto_fp32",
            "kto_desirable_weight",
            "kto_undesirable_weight",
            "kto_beta",
            "fp32_reinforce",
            "kl_div_beta",
            "kl_impl",
            "reinforce_leave_one_out",
            "online_dataserver_ips",
            "online_dataserver_ports",
            "serve_model_weights",
            "weight_server_port",
        ),
        _i(_RL),
    ),
    "weight_by_num_documents": _r("weighting several corpora is not supported: one corpus, data.path"),
    "weighted_sampler_alpha": _i("applies only with weight_by_num_documents (refused)"),
    "data_impl": _i("picks the dataset format (Megatron's mmap format is the one read here)"),
    "pack_impl": _r("only 'packed' (samples span documents, as here) is built", "packed"),
    "dataset_impl": _r("only 'gpt2' (language-model pretraining) is built", "gpt2"),
    "train_impl": _r(
        "only 'normal' (language-model pretraining) is built; DPO, RM and KTO are not", "normal"
    ),
    "allow_chopped": _i("applies to pairwise (DPO/RM) datasets only"),
    "mmap_warmup": _i("pre-reads the dataset (indexed datasets are memory-mapped on demand)"),
    "save": _c("checkpoint.save (a path: written as a comment)"),
    "s3_path": _i("uploads checkpoints to S3 (stx writes them to checkpoint.save)"),
    "s3_chunk_size": _i("uploads checkpoints to S3 (stx writes them to checkpoint.save)"),
    "load": _c("checkpoint.load (a path: written as a comment)"),
    "checkpoint_validation_with_forward_pass": _i(
        "checks a saved checkpoint by a forward pass (stx checks CRCs)"
    ),
    "checkpoint_scale": _i(
        "'log' adds saves at powers of checkpoint_factor (stx saves every checkpoint.save_interval)"
    ),
    "checkpoint_factor": _c("checkpoint.save_interval"),
    "extra_save_iters": _i("saves at extra iterations (stx saves every checkpoint.save_interval)"),
    "no_save_optim": _c("checkpoint.no_save_optim"),
    "no_save_rng": _c("checkpoint.no_save_rng"),
    "no_load_optim": _c("checkpoint.no_load_optim"),
    "no_load_rng": _c("checkpoint.no_load_rng"),
    "finetune": _c("checkpoint.finetune"),
    "train_iters": _c("train.train_iters"),
    "train_epochs": _r("training for a number of epochs is not supported: give train_iters"),
    "eval_iters": _c("train.eval_iters"),
    "keep_last_n_checkpoints": _c("checkpoint.keep_last_n"),
    "eval_interval": _c("train.eval_interval"),
    "split": _c("data.split"),
    "vocab_file": _c(
        "data.vocab_file (a path: written as a comment) and model.vocab_size from its "
        "tokenizer (KNOWN_VOCABULARIES, or --vocab-size)"
    ),
    "merge_file": _c("data.merge_file (a path: written as a comment)"),
    "num_workers": _c("data.num_workers"),
    "exit_interval": _c("train.exit_interval"),
    "attention_dropout": _c("model.attention_dropout"),
    "hidden_dropout": _c("model.hidden_dropout"),
    "weight_decay": _c("optim.weight_decay"),
    "checkpoint_activations": _c("parallel.activation_checkpointing (true: full, false: none)"),
    "checkpoint_num_layers": _c("parallel.checkpoint_num_layers"),
    "deepspeed_activation_checkpointing": _i(
        "places checkpointed activations (parallel.activation_checkpointing decides what is recomputed)"
    ),
    "contiguous_checkpointing": _i("is a DeepSpeed buffer knob with no equivalent here"),
    "checkpoint_in_cpu": _c("parallel.cpu_checkpointing (with checkpoint_activations)"),
    "synchronize_each_layer": _i("is a profiling switch (stx reports per-phase timers)"),
    "profile_backward": _i("is a profiling switch (stx reports per-phase timers)"),
    "partition_activations": _c(
        "parallel.distribute_saved_activations (with checkpoint_activations; otherwise it places nothing)"
    ),
    **dict.fromkeys(("hysteresis", "loss_scale", "loss_scale_window", "min_scale"), _i(_SCALE)),
    "char_level_ppl": _i(_LOGGING),
    "use_mup": _r("muP parametrisation is not supported"),
    **dict.fromkeys(
        (
            "coord_check",
            "save_base_shapes",
            "base_shapes_file",
            "mup_init_scale",
            "mup_attn_temp",
            "mup_output_temp",
            "mup_embedding_mult",
            "mup_rp_embedding_mult",
            "mup_width_scale",
        ),
        _i(_MUP),
    ),
    # NeoXArgsDeepspeedConfig: the sections NeoX hands to DeepSpeed
    "deepspeed": _i("is always on in NeoX (stx is not built on DeepSpeed; its sections are read)"),
    **dict.fromkeys(
        (
            "train_batch_size",
            "train_micro_batch_size_per_gpu",
            "gradient_accumulation_steps",
            "optimizer",
            "scheduler",
            "prescale_gradients",
            "gradient_predivide_factor",
            "sparse_gradients",
            "fp16",
            "bf16",
            "amp",
            "gradient_clipping",
            "zero_optimization",
            "curriculum_learning",
            "wall_clock_breakdown",
            "dump_state",
            "flops_profiler",
            "communication_data_type",
            "autotuning",
            "activation_checkpointing",
            "sparse_attention",
            "data_efficiency",
            "tensorboard",
            "wandb",
            "csv_monitor",
            "elasticity",
            "comms_logger",
            "compression_training",
            "checkpoint",
            "data_types",
        ),
        _c(_DS),
    ),
    "fp32_allreduce": _i(deepspeed_json.ALLREDUCE_DTYPE),
    "deepspeed_extra_args": _c("more DeepSpeed sections, read as the ones above"),
    "steps_per_print": _i("is DeepSpeed's own print interval (NeoX logs every log_interval, read there)"),
    "curriculum_seqlen": _r(
        "NeoX's curriculum sequence length is not supported: every sample is trained at full length", 0
    ),
    # NeoXArgsDeepspeedRunner
    **dict.fromkeys(
        (
            "hostfile",
            "include",
            "exclude",
            "num_nodes",
            "num_gpus",
            "master_port",
            "master_addr",
            "launcher",
            "force_multi",
            "autotuning_run",
            "no_ssh_check",
            "comment",
            "account",
        ),
        _i(_LAUNCHER),
    ),
}

# GPT-NeoX's own names a config file of ours may use (the names of NeoX's older reference, which stx
# configs accept beside Megatron's; load.py builds its tables from these): switches (name -> (our key,
# value when true, value when false or None: nothing)), names accepted and ignored, names refused.
NEOX_FILE_SWITCHES: dict[str, tuple[str, Any, Any]] = {
    "geglu": ("model.activation", "geglu", None),
    "rms_norm": ("model.norm", "rmsnorm", None),
    "no_weight_tying": ("model.tie_word_embeddings", False, True),
    "sinusoidal_pos_emb": ("model.position_embedding_type", "sinusoidal", None),
}
NEOX_FILE_IGNORED: dict[str, str] = {
    **dict.fromkeys(
        ("hostfile", "include", "exclude", "num_nodes", "num_gpus", "master_port", "master_addr", "launcher"),
        _LAUNCHER,
    ),
    "cpu_torch_adam": "chooses the CPU Adam kernel (torch's AdamW runs on the CPU here)",
}
_RPE = (
    "relative position embeddings are not supported; model.position_embedding_type: learned, sinusoidal "
    "or rotary"
)
NEOX_FILE_REFUSED: dict[str, str] = {
    "onebitadam": "1-bit Adam (DeepSpeed's compressed communication) is not supported; use optim.optimizer "
    "adam or adamw",
    **dict.fromkeys(("rpe", "rpe_causal", "rpe_num_buckets", "rpe_max_distance"), _RPE),
    "sparsity": "sparse attention is not supported; attention is dense",
}

# Vocabulary sizes (before padding) of the tokenizers NeoX's configs name by file, for a config that
# names only a tokenizer file: file name -> (tokens, where the number comes from).
KNOWN_VOCABULARIES: dict[str, tuple[int, str]] = {
    "20B_tokenizer.json": (
        50277,
        "GPT-NeoX-20B's tokenizer (also Pythia's): 50,277 tokens (NeoX's own log on loading it: 'padded "
        "vocab (size: 50277) with 27 dummy tokens (new size: 50304)')",
    ),
    "gpt2-vocab.json": (50257, "GPT-2's BPE vocabulary: 50,257 tokens (OpenAI's encoder.json)"),
}
# NeoX's CharLevelTokenizer has a fixed vocabulary (megatron/tokenizer/tokenizer.py: vocab_size 512)
CHAR_LEVEL_VOCABULARY = 512

# NeoX's defaults (megatron/neox_arguments/neox_args.py) where ours differ, applied where the files are
# silent: key of ours -> (value, NeoX's argument and default).
NEOX_DEFAULTS: dict[str, tuple[Any, str]] = {
    "model.hidden_dropout": (0.0, "hidden_dropout 0.0"),
    "model.attention_dropout": (0.0, "attention_dropout 0.0"),
    "optim.weight_decay": (0.1, "weight_decay 0.1"),
    "optim.lr_decay_style": ("linear", "lr_decay_style linear"),
    "optim.lr_warmup_fraction": (0.01, "warmup 0.01"),
    "optim.min_lr": (0.0, "min_lr 0.0"),
    "optim.clip_grad": (1.0, "gradient_clipping 1.0"),
    "train.seed": (1234, "seed 1234"),
    "train.eval_iters": (100, "eval_iters 100"),
    "train.eval_interval": (1000, "eval_interval 1000"),
    "train.precision": ("fp32", "precision: fp32 without an fp16/bf16 block"),
    "logging.log_interval": (100, "log_interval 100"),
    "data.split": ("969,30,1", "split '969, 30, 1'"),
    "parallel.zero_stage": (0, "zero_optimization.stage 0"),
}

_SHAPE = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")
_GATED = {"geglu": "geglu", "swiglu": "swiglu"}
_GATED_REFUSED = ("reglu", "bilinear", "glu")
_NORMS = {
    "layernorm": "layernorm",
    "rmsnorm": "rmsnorm",
    "te_layernorm": "layernorm",
    "te_rmsnorm": "rmsnorm",
}
_POS_EMB = ("learned", "rotary", "sinusoidal", "alibi")
_DENSE_ATTENTION = ("global", "flash")
_NON_TRANSFORMER = {
    "mamba": "Mamba (selective state-space) layers",
    "rwkv": "RWKV (linear recurrence) layers",
}


def _key(key: Any) -> str:
    return str(key).strip().replace("-", "_")


# --------------------------------------------------------------------------- reading the files


def merge_neox_files(files: list[tuple[dict[str, Any], str]]) -> dict[str, Any]:
    """Several NeoX files as `deepy.py train.py a.yml b.yml` merges them (NeoXArgs.from_ymls): keys
    with `-` read as `_`; a file repeating a key an earlier file gave is an error. NeoX compares the
    key as the later file spells it with the merged names, so `tokenizer-type` after `tokenizer_type`
    passes and replaces it, as there."""
    merged: dict[str, Any] = {}
    first: dict[str, str] = {}
    for data, name in files:
        if not isinstance(data, dict):
            raise ConfigError(f"{name}: a NeoX config is a YAML/JSON mapping of argument names to values")
        for key, value in data.items():
            if str(key) in merged:
                raise ConfigError(
                    f"{name}: '{key}' is also given in {first[str(key)]}; NeoX refuses a key in two "
                    "files (ValueError in NeoXArgs.from_ymls): keep it in one"
                )
            merged[_key(key)] = value
            first[_key(key)] = name
    return merged


# --------------------------------------------------------------------------- translating


@dataclasses.dataclass
class NeoxImport:
    """What a NeoX config sets: `values` (key of ours -> value, in order), `paths` (keys of ours naming
    files of the original machine -> value), `ignored` ((NeoX key, value, why)), `notes` (defaults taken,
    values derived)."""

    values: dict[str, Any] = dataclasses.field(default_factory=dict)
    ignored: list[tuple[str, Any, str]] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)


def translate_neox(config: dict[str, Any], source: str, vocab_size: int | None = None) -> NeoxImport:
    """The keys of ours a merged NeoX config sets; ConfigError names `source`, the key and the value for
    anything NeoX would refuse, anything not built here, and a model whose shape the files leave open."""
    _refuse_non_transformer(config, source)
    out = NeoxImport()
    deepspeed: dict[str, Any] = {}
    for key, value in config.items():
        rule = NEOX_ARGS.get(key)
        if rule is None:
            near = difflib.get_close_matches(key, list(NEOX_ARGS), n=1, cutoff=0.6)
            hint = f"; did you mean '{near[0]}'?" if near else ""
            raise ConfigError(
                f"{source}: '{key}' is not a GPT-NeoX argument (NeoX refuses it too: NeoXArgs has no such "
                f"field){hint}"
            )
        if rule.kind == "refused" and value not in rule.accept:
            raise ConfigError(f"{source}: '{key}' = {value!r}: {rule.detail}")
        if rule.kind == "ignored" and value is not None:
            out.ignored.append((key, value, rule.detail))
        if rule.detail == _DS:
            deepspeed[key] = value
    if isinstance(config.get("deepspeed_extra_args"), dict):
        deepspeed.update(config["deepspeed_extra_args"])
    _model(config, source, out, vocab_size)
    _layout(config, source, out)
    _deepspeed(config, deepspeed, source, out)
    _training(config, source, out)
    for path, (value, why) in NEOX_DEFAULTS.items():
        if path not in out.values:
            out.values[path] = value
            out.notes.append(f"{path}: {value!r}: NeoX's default ({why})")
    return out


def _refuse_non_transformer(config: dict[str, Any], source: str) -> None:
    """attention_config names each layer's block: global and flash are the same dense attention; Mamba,
    RWKV, gMLP and sparse or local attention are refused, naming the setting."""
    types = _attention_types(config.get("attention_config"), source)
    for kind in types:
        if kind in _NON_TRANSFORMER:
            raise ConfigError(
                f"{source}: 'attention_config' names '{kind}': {_NON_TRANSFORMER[kind]} are not transformer "
                "layers; only transformer models (attention_config global or flash) import"
            )
    other = [kind for kind in types if kind not in _DENSE_ATTENTION]
    if other:
        raise ConfigError(
            f"{source}: 'attention_config' names {', '.join(repr(k) for k in other)}: only dense attention "
            "(global, flash) is built here"
        )


def _attention_types(value: Any, source: str) -> list[str]:
    """The layer types of NeoX's attention_config ([[[types...], count | 'all'], ...])."""
    if value is None:
        return []
    try:
        types = [str(kind) for pattern, _ in value for kind in pattern]
    except (TypeError, ValueError):
        raise ConfigError(
            f"{source}: 'attention_config' must be a list of [[types...], layers] pairs as NeoX takes it "
            f"(e.g. [[['flash'], 24]]), got {value!r}"
        ) from None
    return list(dict.fromkeys(types))


def _model(config: dict[str, Any], source: str, out: NeoxImport, vocab_size: int | None) -> None:
    missing = [key for key in _SHAPE if config.get(key) is None]
    if missing:
        raise ConfigError(
            f"{source}: no {', '.join(missing)}: NeoX requires the model's shape; give the files that "
            "hold it (several files merge: --neox model.yml setup.yml)"
        )
    v = out.values
    v["model.type"] = "gpt"
    out.notes.append("model.type: 'gpt': NeoX trains decoder-only language models")
    for key in (*_SHAPE, "max_position_embeddings", "init_method_std", "hidden_dropout", "attention_dropout"):
        if config.get(key) is not None:
            v[f"model.{key}"] = config[key]
    if config.get("num_kv_heads") is not None:
        v["model.num_query_groups"] = config["num_kv_heads"]
    v["model.tie_word_embeddings"] = not config.get("no_weight_tying", False)
    v["model.parallel_residual"] = bool(config.get("gpt_j_residual", False))
    _norm(config, source, v, out.ignored)
    _positions(config, source, out)
    _activation_and_mlp(config, source, out)
    _moe(config, source, out)
    _biases(config, v)
    v["model.vocab_size"] = _vocabulary(config, source, vocab_size, out)
    tp = max(1, int(config.get("model_parallel_size") or 1))
    divisible = config.get("make_vocab_size_divisible_by", 128)
    v["model.make_vocab_size_divisible_by"] = divisible * tp
    out.notes.append(
        f"model.make_vocab_size_divisible_by: {divisible * tp}: NeoX pads the vocabulary to a multiple of "
        f"make_vocab_size_divisible_by ({divisible}) x model_parallel_size ({tp})"
    )


def _norm(
    config: dict[str, Any], source: str, v: dict[str, Any], ignored: list[tuple[str, Any, str]]
) -> None:
    norm = str(config.get("norm", "layernorm"))
    if norm not in _NORMS:
        raise ConfigError(f"{source}: 'norm' = {norm!r} is not built here; valid: {', '.join(_NORMS)}")
    v["model.norm"] = _NORMS[norm]
    used, unused = (
        ("rms_norm_epsilon", "layernorm_epsilon")
        if _NORMS[norm] == "rmsnorm"
        else ("layernorm_epsilon", "rms_norm_epsilon")
    )
    v["model.layernorm_epsilon"] = config.get(used, 1e-8 if used == "rms_norm_epsilon" else 1e-5)
    if config.get(unused) is not None:
        ignored.append((unused, config[unused], f"NeoX's {norm} reads {used}"))


def _positions(config: dict[str, Any], source: str, out: NeoxImport) -> None:
    v = out.values
    pos = str(config.get("pos_emb", "learned"))
    if pos not in _POS_EMB:
        raise ConfigError(f"{source}: 'pos_emb' = {pos!r} is not built here; valid: {', '.join(_POS_EMB)}")
    v["model.position_embedding_type"] = pos
    if pos == "rotary":
        v["model.rotary_percent"] = config.get("rotary_pct", 1.0)
        v["model.rotary_base"] = config.get("rotary_emb_base", 10000)
    else:
        for key in ("rotary_pct", "rotary_emb_base"):
            if config.get(key) is not None:
                out.ignored.append((key, config[key], f"applies to pos_emb rotary only (this is {pos})"))
    width = config.get("sliding_window_width")
    if width is not None:
        if "flash" in _attention_types(config.get("attention_config"), source):
            if _attention_types(config.get("attention_config"), source) != ["flash"]:
                raise ConfigError(
                    f"{source}: 'sliding_window_width' with flash and global layers mixed: NeoX windows "
                    "only the flash layers, and one window for every layer is built here"
                )
            v["model.sliding_window"] = width + 1
            out.notes.append(
                f"model.sliding_window: {width + 1}: NeoX passes flash-attn window_size ({width}, -1): "
                f"{width} tokens back and the token itself"
            )
        else:
            out.ignored.append(
                (
                    "sliding_window_width",
                    width,
                    "NeoX windows flash attention only; these layers are global (attention_config)",
                )
            )


def _activation_and_mlp(config: dict[str, Any], source: str, out: NeoxImport) -> None:
    """The activation, and the MLP width NeoX builds (megatron/model/transformer.py ParallelMLP): the
    width I (intermediate_size, or expansion_factor x h, or 4 h); gated: int(2/3 I) for the gate and
    value together, int(2/3 I) // 2 into the down projection; each rounded up, to 2 x mlp_multiple_of
    and mlp_multiple_of. The two must agree (NeoX's down projection reads the gated output)."""
    activation = str(config.get("activation", "gelu"))
    gated = activation in _GATED or activation in _GATED_REFUSED
    if activation in _GATED:
        out.values["model.activation"] = _GATED[activation]
    elif activation == "gelu":
        fused = bool(config.get("bias_gelu_fusion")) and not config.get("onnx_safe")
        out.values["model.activation"] = "openai-gelu" if fused else "gelu"
        if fused:
            out.notes.append(
                "model.activation: 'openai-gelu': NeoX's fused bias-GeLU kernel (bias_gelu_fusion) "
                "computes the tanh approximation"
            )
    else:
        raise ConfigError(
            f"{source}: 'activation' = {activation!r} is not built here; valid: gelu, geglu, swiglu"
        )
    h = config["hidden_size"]
    if config.get("intermediate_size") is not None:
        width = config["intermediate_size"]
    elif config.get("expansion_factor") is not None:
        width = int(config["expansion_factor"] * h)
    else:
        width = 4 * h
    inner = width
    if gated:
        width = int(width * 2 / 3)
        inner = width // 2
    multiple = int(config.get("mlp_multiple_of", 1))
    width = 2 * multiple * -(-width // (2 * multiple))
    inner = multiple * -(-inner // multiple)
    if width != (2 * inner if gated else inner):
        raise ConfigError(
            f"{source}: NeoX's MLP would not build: its first projection is {width} wide and its second "
            f"reads {inner} (intermediate_size {config.get('intermediate_size')}, mlp_multiple_of "
            f"{multiple}, activation {activation})"
        )
    out.values["model.ffn_hidden_size"] = inner
    out.notes.append(
        f"model.ffn_hidden_size: {inner}: NeoX's MLP width (ParallelMLP) from intermediate_size "
        f"{config.get('intermediate_size')}, expansion_factor {config.get('expansion_factor')}, "
        f"mlp_multiple_of {multiple}, activation {activation}"
    )


def _moe(config: dict[str, Any], source: str, out: NeoxImport) -> None:
    """NeoX's dropless MoE (megatron/model/moe.py, moe_mlp.py, router.py): every layer i with
    i % moe_expert_interval == 0 routes each token to moe_top_k of moe_num_experts ungated expert MLPs
    without biases, each intermediate_size wide (or 4 h rounded up to a multiple of 256), weighted by
    the router's scores; no load-balancing loss, no capacity (megablocks' dropless kernels)."""
    experts = int(config.get("moe_num_experts") or 1)
    if experts <= 1:
        return
    v = out.values
    activation = str(config.get("activation", "gelu"))
    if activation in _GATED or activation in _GATED_REFUSED:
        raise ConfigError(
            f"{source}: 'activation' = {activation!r} with moe_num_experts = {experts}: NeoX's grouped "
            "experts (megatron/model/moe_mlp.py) size their first projection for an ungated activation "
            "and would feed half of it to a gated one; only gelu experts import"
        )
    h, topk = config["hidden_size"], int(config.get("moe_top_k", 1))
    width = config.get("intermediate_size") or 256 * -(-4 * h // 256)
    router = str(config.get("moe_router_type", "sinkhorn"))
    if router not in ("sinkhorn", "topk"):
        raise ConfigError(f"{source}: 'moe_router_type' = {router!r}: NeoX takes sinkhorn or topk")
    sinkhorn = router == "sinkhorn"
    v.update(
        {
            "model.num_experts": experts,
            "model.moe_router_topk": topk,
            "model.moe_layer_freq": int(config.get("moe_expert_interval", 1)),
            "model.moe_ffn_hidden_size": int(width),
            "model.moe_router_load_balancing": "sinkhorn" if sinkhorn else "none",
            "model.moe_router_score": "sigmoid" if sinkhorn and topk == 1 else "softmax",
            "model.moe_norm_topk_prob": False,
            "model.moe_aux_loss_coeff": 0.0,
        }
    )
    out.notes.append(
        f"model.moe_*: NeoX's dropless MoE: {experts} experts of width {width} "
        f"(intermediate_size {config.get('intermediate_size')}, else 4 h rounded up to 256), top-{topk}, "
        f"router {router} ({'Sinkhorn-balanced choice, scores ' if sinkhorn else 'plain top-k of '}"
        f"{v['model.moe_router_score']}, not renormalised), no load-balancing loss, no capacity"
    )


def _biases(config: dict[str, Any], v: dict[str, Any]) -> None:
    attn = bool(config.get("use_bias_in_attn_linear", True))
    mlp = bool(config.get("use_bias_in_mlp", True))
    v["model.add_bias_linear"] = attn
    if mlp != attn:  # NeoX's llama2/ configs: attention without biases, the MLP with NeoX's default ones
        v["model.add_mlp_bias"] = mlp


def _vocabulary(config: dict[str, Any], source: str, vocab_size: int | None, out: NeoxImport) -> int:
    """The tokenizer's vocabulary before padding: given (--vocab-size), or known by the tokenizer file
    the config names (KNOWN_VOCABULARIES); otherwise an error asking for it."""
    tokenizer = str(config.get("tokenizer_type", "GPT2BPETokenizer"))
    vocab_file = config.get("vocab_file")
    name = PurePosixPath(str(vocab_file)).name if vocab_file else None
    if vocab_size is not None:
        out.notes.append(f"model.vocab_size: {vocab_size}: given with --vocab-size")
        return vocab_size
    if tokenizer == "CharLevelTokenizer":
        out.notes.append(f"model.vocab_size: {CHAR_LEVEL_VOCABULARY}: NeoX's CharLevelTokenizer")
        return CHAR_LEVEL_VOCABULARY
    if name in KNOWN_VOCABULARIES:
        size, why = KNOWN_VOCABULARIES[name]
        out.notes.append(f"model.vocab_size: {size}: {why}")
        return size
    named = f"vocab_file '{vocab_file}'" if vocab_file else "no vocab_file"
    known = "; ".join(f"{k}: {n:,}" for k, (n, _) in KNOWN_VOCABULARIES.items())
    raise ConfigError(
        f"{source}: the model's vocabulary size comes from its tokenizer, and the files name "
        f"{tokenizer} with {named}: give the tokenizer's size with --vocab-size N (before padding; "
        f"Llama's and Mistral's tokenizer.model: 32000). Known tokenizer files: {known}"
    )


def _layout(config: dict[str, Any], source: str, out: NeoxImport) -> None:
    v = out.values
    v["parallel.tp"] = max(1, int(config.get("model_parallel_size") or 1))
    v["parallel.pp"] = max(1, int(config.get("pipe_parallel_size") or 0))
    if config.get("sequence_parallel") is not None:
        v["parallel.sequence_parallel"] = config["sequence_parallel"]
    recompute = bool(config.get("checkpoint_activations", False))
    v["parallel.activation_checkpointing"] = "full" if recompute else "none"
    if config.get("checkpoint_num_layers") is not None:
        v["parallel.checkpoint_num_layers"] = config["checkpoint_num_layers"]
    for key, path in (
        ("partition_activations", "parallel.distribute_saved_activations"),
        ("checkpoint_in_cpu", "parallel.cpu_checkpointing"),
    ):
        if config.get(key) is None:
            continue
        if recompute:
            v[path] = config[key]
        elif config[key]:
            out.ignored.append(
                (
                    key,
                    config[key],
                    "places the inputs full recompute keeps, and the files "
                    "do not recompute (checkpoint_activations false)",
                )
            )


def _deepspeed(config: dict[str, Any], sections: dict[str, Any], source: str, out: NeoxImport) -> None:
    """The DeepSpeed sections, read by deepspeed_json as DeepSpeed reads them, after NeoX's own keys in
    them: `fp16.fp16` / `bf16.bf16` (a repeat of enabled), `fp16.type` ('bfloat16': bf16 training in the
    DeeperSpeed Pythia ran on), bf16's loss-scale keys (DeepSpeed's bf16 reads only enabled); NeoX's
    `precision` decides with them as NeoX's calculate_derived does."""
    ds = {k: (dict(s) if isinstance(s, dict) else s) for k, s in sections.items()}
    precision = _precision(config, ds, source, out)
    if precision is not None:
        out.values["train.precision"] = precision
    if ds.get("train_batch_size") is not None or ds.get("train_micro_batch_size_per_gpu") is not None:
        if "gradient_accumulation_steps" not in ds:
            ds["gradient_accumulation_steps"] = 1
            out.notes.append(
                "train.gradient_accumulation_steps: 1: NeoX's default gradient_accumulation_steps"
            )
    else:
        out.notes.append(
            "the batch: the files give neither train_batch_size nor train_micro_batch_size_per_gpu "
            "(NeoX needs "
            "one: give the file that holds it), so the batch is this config's default"
        )
    zero = ds.get("zero_optimization")
    if isinstance(zero, dict) and not isinstance(zero.get("stage", 0), int):
        raise ConfigError(
            f"{source}: 'zero_optimization.stage' = {zero['stage']!r}: several stages are DeepSpeed "
            "autotuning's search space (autotuning is not run here); give one stage, 0 to 3"
        )
    translation = deepspeed_json.translate(ds, source)
    out.ignored += [(key, value, why) for key, (value, why) in translation.ignored.items()]
    for path, value in translation.assignments:
        if path == "train.precision":
            continue  # decided above, with NeoX's precision
        out.values[path] = value
    model_parallel = out.values.get("parallel.tp", 1) > 1 or out.values.get("parallel.pp", 1) > 1
    if out.values.get("parallel.zero_stage") == 1 and model_parallel:
        # ZeroRedundancyOptimizer shards neither DTensor (tp) parameters nor pipeline stages here; stage 2
        # shards the same optimizer state (gradients too): the same training, less memory
        out.values["parallel.zero_stage"] = 2
        out.values["parallel.reduce_each_micro_batch"] = out.values.get("parallel.pp", 1) == 1
        out.notes.append(
            "parallel.zero_stage: 2: the files' ZeRO-1 (optimizer state sharded over dp) with tp/pp > 1 is "
            "built here as ZeRO-2 (the same optimizer-state sharding, gradients sharded too: the same "
            "training, less memory); ZeroRedundancyOptimizer shards no tensor-parallel or pipelined model"
        )
    if out.values.get("parallel.pp", 1) > 1 and out.values.get("parallel.reduce_each_micro_batch"):
        out.values["parallel.reduce_each_micro_batch"] = False  # pipelining reduces once per step


def _precision(config: dict[str, Any], ds: dict[str, Any], source: str, out: NeoxImport) -> str | None:
    fp16: dict[str, Any] = ds["fp16"] if isinstance(ds.get("fp16"), dict) else {}
    bf16: dict[str, Any] = ds["bf16"] if isinstance(ds.get("bf16"), dict) else {}
    for block, name in ((fp16, "fp16"), (bf16, "bf16")):
        if name in block:
            out.ignored.append(
                (
                    f"{name}.{name}",
                    block.pop(name),
                    f"is NeoX's repeat of {name}.enabled (DeepSpeed reads enabled)",
                )
            )
    for key in ("loss_scale", "loss_scale_window", "initial_scale_power", "hysteresis", "min_loss_scale"):
        if key in bf16:
            out.ignored.append(
                (
                    f"bf16.{key}",
                    bf16.pop(key),
                    "DeepSpeed's bf16 has no loss scaling (it reads bf16.enabled only)",
                )
            )
    kind = fp16.pop("type", None)
    if kind is not None:
        out.ignored.append(("fp16.type", kind, "read into train.precision (see the notes)"))
    precision = {"fp16": "fp16", "bfloat16": "bf16", "fp32": "fp32", None: None}.get(
        config.get("precision"), "?"
    )
    if precision == "?":
        raise ConfigError(
            f"{source}: 'precision' = {config.get('precision')!r}: NeoX takes fp16, bfloat16 or fp32"
        )
    from_blocks = None
    if fp16.get("enabled"):
        from_blocks = "bf16" if str(kind).lower() in ("bfloat16", "bf16") else "fp16"
        if from_blocks == "bf16":
            out.notes.append(
                "train.precision: 'bf16': fp16.type 'bfloat16' trained in bf16 in the DeeperSpeed the "
                "Pythia configs were written for (today's DeeperSpeed no longer reads type)"
            )
    elif bf16.get("enabled"):
        from_blocks = "bf16"
    if precision is not None and from_blocks is not None and precision != from_blocks:
        raise ConfigError(
            f"{source}: 'precision' = {config.get('precision')!r} but the DeepSpeed block enables "
            f"{from_blocks}: NeoX refuses the conflict too (calculate_derived)"
        )
    for name, block in (("fp16", fp16), ("bf16", bf16)):
        if name in ds:
            ds[name] = block
    if precision == "bf16" and "bf16" not in ds:
        ds["bf16"] = {"enabled": True}  # what NeoX hands DeepSpeed for precision: bfloat16
    if precision == "fp16" and "fp16" not in ds:
        ds["fp16"] = {"enabled": True}
    if from_blocks == "bf16" and fp16.get("enabled"):
        # bf16 from fp16.type: the block's loss-scale keys scale nothing (bf16 trains unscaled)
        for key in [k for k in fp16 if k not in ("enabled", "auto_cast")]:
            out.ignored.append((f"fp16.{key}", fp16[key], "bf16 (fp16.type) trains without loss scaling"))
        ds["fp16"] = {k: val for k, val in fp16.items() if k == "auto_cast"}
    return precision or from_blocks


def _training(config: dict[str, Any], source: str, out: NeoxImport) -> None:
    v = out.values
    plain = {
        "train_iters": "train.train_iters", "eval_iters": "train.eval_iters",
        "eval_interval": "train.eval_interval", "exit_interval": "train.exit_interval", "seed": "train.seed",
        "log_interval": "logging.log_interval", "tensorboard_dir": "logging.tensorboard_dir",
        "lr_decay_iters": "optim.lr_decay_iters", "min_lr": "optim.min_lr",
        "warmup": "optim.lr_warmup_fraction", "weight_decay": "optim.weight_decay",
        "data_path": "data.path", "vocab_file": "data.vocab_file", "merge_file": "data.merge_file",
        "tokenizer_type": "data.tokenizer_type", "num_workers": "data.num_workers",
        "short_seq_prob": "data.short_seq_prob", "save": "checkpoint.save", "load": "checkpoint.load",
        "checkpoint_factor": "checkpoint.save_interval", "keep_last_n_checkpoints": "checkpoint.keep_last_n",
        "no_save_optim": "checkpoint.no_save_optim", "no_save_rng": "checkpoint.no_save_rng",
        "no_load_optim": "checkpoint.no_load_optim", "no_load_rng": "checkpoint.no_load_rng",
        "finetune": "checkpoint.finetune",
    }  # fmt: skip
    for key, path in plain.items():
        if config.get(key) is not None:
            v[path] = config[key]
    if config.get("data_path") is None and isinstance(config.get("train_data_paths"), list):
        v["data.path"] = " ".join(str(p) for p in config["train_data_paths"])  # a comment to set
    if isinstance(config.get("split"), str):
        v["data.split"] = ",".join(part.strip() for part in config["split"].split(","))
    style = config.get("lr_decay_style")
    if style is not None:
        if style not in ("constant", "linear", "cosine"):
            raise ConfigError(
                f"{source}: 'lr_decay_style' = {style!r} is not built here; valid: constant, linear, cosine"
            )
        v["optim.lr_decay_style"] = style
    fraction = config.get("lr_decay_fraction")
    if fraction is not None and config.get("lr_decay_iters") is None:
        if config.get("train_iters") is None:
            raise ConfigError(f"{source}: 'lr_decay_fraction' needs train_iters (NeoX multiplies them)")
        v["optim.lr_decay_iters"] = math.floor(config["train_iters"] * fraction)


def neox_args_markdown() -> str:
    """The table docs/CONFIG.md holds: every argument of NeoX's reference and what the import does."""
    lines = [
        f"Every argument of GPT-NeoX's configuration ({SOURCE}), as `stx config import --neox` reads it: "
        "**carried** to keys of ours, **ignored** (listed in the imported file) or **refused** (an error "
        "naming the key, unless the value asks for nothing: NeoX's default, false or null). A key in no "
        "row is not a NeoX argument: NeoX refuses the file, and so does the import.",
        "",
        "| argument | status | sets, or why |",
        "|---|---|---|",
    ]
    for key, rule in NEOX_ARGS.items():
        lines.append(f"| `{key}` | {rule.kind} | {rule.detail.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def read_neox_sources(paths: list[Path], parse: Any) -> tuple[dict[str, Any], str]:
    """(the merged config, a name for messages) of NeoX files given in order; `parse(text, name)` reads
    one file (the loader's strict YAML reader: JSON with comments is YAML)."""
    files = []
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"NeoX config '{path}' does not exist") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"NeoX config '{path}' cannot be read: {e}") from None
        files.append((parse(text, str(path)), str(path)))
    return merge_neox_files(files), " + ".join(str(p) for p in paths)


# Every parameter of GPT-NeoX's OLDER configuration reference (tests/fixtures/neox/neox-config-parameters.md,
# by origin: the DeepSpeed launcher, Megatron's command line, NeoX's own, the DeepSpeed config file): the
# names a config file of ours accepts as the loader treats them (foreign_configs.classify_foreign_key; a
# test fails on any name missing here or unclassified). NeoX's current arguments: NEOX_ARGS.
NEOX_PARAMETERS: dict[str, tuple[str, ...]] = {
    "DSL": (
        "hostfile",
        "include",
        "exclude",
        "num_nodes",
        "num_gpus",
        "master_port",
        "master_addr",
        "launcher",
    ),
    "Meg": (
        "num-layers",
        "num-unique-layers",
        "param-sharing-style",
        "hidden-size",
        "num-attention-heads",
        "max-position-embeddings",
        "make-vocab-size-divisible-by",
        "layernorm-epsilon",
        "apply-residual-connection-post-layernorm",
        "openai-gelu",
        "onnx-safe",
        "attention-dropout",
        "hidden-dropout",
        "weight-decay",
        "adam-beta1",
        "adam-beta2",
        "adam-eps",
        "batch-size",
        "checkpoint-activations",
        "distribute-checkpointed-activations",
        "checkpoint-num-layers",
        "train-iters",
        "log-interval",
        "exit-interval",
        "tensorboard-dir",
        "scaled-upper-triang-masked-softmax-fusion",
        "scaled-masked-softmax-fusion",
        "bias-gelu-fusion",
        "bias-dropout-fusion",
        "cpu-optimizer",
        "cpu_torch_adam",
        "seed",
        "init-method-std",
        "lr",
        "lr-decay-style",
        "lr-decay-iters",
        "min-lr",
        "warmup",
        "override-lr-scheduler",
        "use-checkpoint-lr-scheduler",
        "save",
        "save-interval",
        "no-save-optim",
        "no-save-rng",
        "load",
        "no-load-optim",
        "no-load-rng",
        "finetune",
        "apply-query-key-layer-scaling",
        "attention-softmax-in-fp32",
        "fp32-allreduce",
        "hysteresis",
        "loss-scale",
        "loss-scale-window",
        "min-scale",
        "fp16-lm-cross-entropy",
        "model-parallel-size",
        "pipe-parallel-size",
        "distributed-backend",
        "DDP-impl",
        "local_rank",
        "lazy-mpu-init",
        "use-cpu-initialization",
        "eval-iters",
        "eval-interval",
        "data-path",
        "split",
        "vocab-file",
        "merge-file",
        "seq-length",
        "mask-prob",
        "short-seq-prob",
        "mmap-warmup",
        "num-workers",
        "tokenizer-type",
        "data-impl",
        "reset-position-ids",
        "reset-attention-mask",
        "eod-mask-loss",
        "adlr-autoresume",
        "adlr-autoresume-interval",
        "ict-head-size",
        "ict-load",
        "bert-load",
        "titles-data-path",
        "query-in-block-prob",
        "use-one-sent-docs",
        "report-topk-accuracies",
        "faiss-use-gpu",
        "block-data-path",
        "indexer-batch-size",
        "indexer-log-interval",
        "deepspeed-activation-checkpointing",
        "partition-activations",
        "contigious-checkpointing",
        "checkpoint-in-cpu",
        "synchronize-each-layer",
        "profile-backward",
        "deepspeed_mpi",
    ),
    "NeoX": (
        "onebitadam",
        "geglu",
        "no-weight-tying",
        "sinusoidal-pos-emb",
        "rpe",
        "rpe-causal",
        "rpe-num-buckets",
        "rpe-max-distance",
        "sparsity",
        "rms-norm",
        "rms-norm-epsilon",
    ),
    "DSC": (
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "optimizer",
        "scheduler",
        "fp32_allreduce",
        "prescale_gradients",
        "gradient_predivide_factor",
        "sparse_gradients",
        "fp16",
        "amp",
        "gradient_clipping",
        "zero_optimization",
        "steps_per_print",
        "wall_clock_breakdown",
        "dump_state",
        "flops_profiler",
        "activation_checkpointing",
        "sparse_attention",
        "zero_allow_untested_optimizer",
    ),
}
