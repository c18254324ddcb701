"""The planner's GPU time model against published end-to-end training throughput (issue 22).

Reads benchmarks/data/gpu_validation/*.csv (validation only: nothing there fits a constant; the built-in
profiles come from benchmarks/data/gpu_kernels via benchmarks/build_gpu_profiles.py), predicts each row
with `stx plan CONFIG ... --device D --nodes K --gpus-per-node 8 --no-probe --json` (the CLI itself,
in process) and writes benchmarks/results/plan_gpu_validation.md: per row predicted vs published
throughput (tokens/s per GPU, TFLOP/s per GPU, or 1 / iteration time) and the error, the median
|error|, the share within 25%, and the Spearman rank correlation within each table's layouts of one model.

    python benchmarks/plan_gpu_validation.py                   # every row, ~1 min
    python benchmarks/plan_gpu_validation.py --limit 3 --output /tmp/v.md
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

DATA = ROOT / "benchmarks" / "data" / "gpu_validation"
OUTPUT = ROOT / "benchmarks" / "results" / "plan_gpu_validation.md"
# Layout cells a source leaves empty, filled by stated assumptions (docs/PLANNER.md#gpu-validation)
NARAYANAN_TP_MAX = 8  # Megatron keeps tensor parallelism inside an 8-GPU node; pp = model-parallel / tp
MEGATRON_VOCAB = 51200  # the README's GPT vocabulary (Korthikanti's transcription omits it)


@dataclass
class Row:
    source: str
    table: str
    model: str
    label: str
    args: list[str]
    metric: str  # "tokens/s/GPU", "TFLOP/s/GPU" (hardware or model FLOPs) or "1/iteration s"
    published: float
    predicted: float | None = None
    note: str = ""
    gpus: int = 0
    seq: int = 0  # llm-foundry and MosaicGPT rows: sequence length and micro-batch (code-base table)
    micro_batch: int = 0
    params: float | None = None  # the planned model's parameters (stx plan --json), for the error classes
    moe: bool = False  # a mixture-of-experts model: its own error class (plan/validation_error.py)
    skip: str = ""  # why the row is listed but not planned (the source leaves a needed cell open)

    @property
    def error(self) -> float | None:
        return None if self.predicted is None else self.predicted / self.published - 1


def _device(gpu: str) -> str | None:
    g = gpu.lower().replace(" ", "")
    if "a100" in g:
        return "a100-40gb" if "40gb" in g else "a100-80gb"
    if "h100" in g:
        return "h100-sxm"
    return None


def _zero(text: str) -> str:
    t = text.lower()
    if "full_shard" in t or "fully sharded" in t:
        return "3"
    if "shard_grad_op" in t:
        return "2"
    return "0"


def _recompute(text: str) -> str:
    t = text.lower()
    if t in ("true", "full"):
        return "full"
    return "selective" if t.startswith("selective") else "none"


def _base_args(r: dict, layers: str, hidden: str, heads: str, seq: str, vocab: str) -> list[str]:
    out = [
        f"model.num_layers={layers}",
        f"model.hidden_size={hidden}",
        f"model.num_attention_heads={heads}",
        f"model.seq_length={seq}",
        f"model.max_position_embeddings={seq}",
        f"model.vocab_size={vocab}",
        "model.make_vocab_size_divisible_by=128",
    ]
    if r.get("ffn_hidden"):
        out.append(f"model.ffn_hidden_size={r['ffn_hidden']}")
    if r.get("kv_heads") and r["kv_heads"] != heads:
        out.append(f"model.num_query_groups={r['kv_heads']}")
    return out


def _layout(
    tp: int, pp: int, dp: int, mb: int, gbs: int, zero: str, rec: str, sp: bool, v: int = 1
) -> list[str]:
    out = [
        f"parallel.tp={tp}",
        f"parallel.pp={pp}",
        f"parallel.dp={dp}",
        f"parallel.zero_stage={zero}",
        f"parallel.activation_checkpointing={rec}",
        f"train.micro_batch_size={mb}",
        f"train.global_batch_size={gbs}",
        f"parallel.sequence_parallel={'true' if sp and tp > 1 else 'false'}",
    ]
    if v > 1:
        out += ["parallel.pipeline_schedule=interleaved-1f1b", f"parallel.virtual_pipeline_stages={v}"]
    return out


# llm-foundry's attention kernel per table. The A100 tables (mosaicml/examples release/v0.0.4, April
# 2023) and the H100 tables (llm-foundry v0.3.0, October 2023) ran submit_benchmarks.py's default
# `--attn_impl triton` (the sweep.sh of both sets no other): Triton FlashAttention (2022). The large-scale
# H100 table (5e85bd62, January 2024) sets it per model in sweep.py: `flash` (FlashAttention-2, the
# gpu-flash2 install) for 1b, 3b, 7b and 70b, `triton` for 13b and 30b.
LARGE_SCALE_FLASH = {"MPT-1b", "MPT-3b", "MPT-7b", "MPT-70b"}


def _foundry_attention(r: dict) -> str:
    return "flash" if "Large Scale" in r["table"] and r["model"] in LARGE_SCALE_FLASH else "triton"


def _foundry(r: dict) -> Row | None:
    if "fp8" in r["precision"]:
        return None  # fp8 training is not a precision the planner models
    args = ["gpt-13b", *_base_args(r, r["layers"], r["hidden"], r["heads"], r["seq_len"], r["vocab"])]
    # Composer's FSDP reduce-scatters every micro-batch's gradients into the shards (no no_sync
    # accumulation of unsharded gradients): our reduce_each_micro_batch
    args += ["model.add_bias_linear=false", "train.precision=bf16", "parallel.reduce_each_micro_batch=true"]
    n = int(r["n_gpus"])
    args += _layout(1, 1, n, int(r["micro_batch"]), int(r["global_batch_seqs"]), _zero(r["zero_or_fsdp"]),
                    _recompute(r["activation_checkpointing"]), False)  # fmt: skip
    args += ["--attention-kernel", _foundry_attention(r)]
    label = f"{n} GPUs, mb {r['micro_batch']}, seq {r['seq_len']}, {r['zero_or_fsdp']}"
    label += f", AC {r['activation_checkpointing']}"
    return Row(
        "llm-foundry", r["table"], r["model"], label, args, "tokens/s/GPU", float(r["tokens_per_s_per_gpu"]),
        seq=int(r["seq_len"]), micro_batch=int(r["micro_batch"]),
    )  # fmt: skip


def _mosaicgpt(r: dict) -> Row:
    """mosaicml/examples MosaicGPT, February 2023 (release 0.0.3): Composer 0.12 / torch 1.13 FSDP, the
    yaml's `attn_impl: flash` (FlashAttention 1), linear and LayerNorm biases, learned positions, the
    vocabulary padded to a multiple of 16 (sweep.sh). Where the per-GPU batch is not a multiple of the
    micro-batch the run's last micro-batch was smaller; it is planned as GradAccum full micro-batches."""
    args = ["gpt-13b", *_base_args(r, r["layers"], r["hidden"], r["heads"], r["seq_len"], r["vocab"])]
    # the CSV's vocabulary is the run's (padded to 16 or not): no further padding
    args = [a.replace("divisible_by=128", "divisible_by=1") for a in args]
    args += ["model.add_bias_linear=true", "train.precision=bf16", "parallel.reduce_each_micro_batch=true"]
    # FSDP mixed_precision DEFAULT as Composer's prepare_fsdp_module of late 2022 maps it: fp32 parameters
    # gathered (autocast casts them), gradients reduced in the autocast dtype (gpu_validation/README.md)
    args += ["parallel.fsdp_param_dtype=fp32", "parallel.grad_reduce_dtype=bf16"]
    n, mb, accum = int(r["n_gpus"]), int(r["micro_batch"]), int(r["grad_accum"])
    args += _layout(1, 1, n, mb, mb * accum * n, _zero(r["zero_or_fsdp"]),
                    _recompute(r["activation_checkpointing"]), False)  # fmt: skip
    args += ["--attention-kernel", "flash1"]
    per_gpu = int(r["global_batch_seqs"]) // n
    label = f"{n} GPUs, mb {mb} x {accum}, batch {r['global_batch_seqs']}, seq {r['seq_len']}"
    label += f", AC {r['activation_checkpointing']}"
    note = "" if per_gpu == mb * accum else f"{per_gpu} seqs/GPU published, planned as {accum} x {mb}"
    published = float(r["tokens_per_s_per_gpu"])
    return Row("mosaicgpt-2023-02", r["table"], r["model"], label, args, "tokens/s/GPU", published,
               note=note, seq=int(r["seq_len"]), micro_batch=mb)  # fmt: skip


def _korthikanti(r: dict) -> Row:
    args = [
        "gpt-13b",
        *_base_args(r, r["layers"], r["hidden"], r["heads"], r["seq_len"], str(MEGATRON_VOCAB)),
    ]
    args += ["train.precision=fp16", "model.hidden_dropout=0.1", "model.attention_dropout=0.1"]
    tp, pp = int(r["tp"]), int(r["pp"])
    rec = _recompute(r["activation_checkpointing"])
    args += _layout(tp, pp, 1, int(r["micro_batch"]), int(r["global_batch_seqs"]), "0", rec,
                    r["sequence_parallel"] == "yes", int(r["pipeline_interleave"] or 1))  # fmt: skip
    label = f"t{tp} p{pp} v{r['pipeline_interleave']}, {rec}, SP {r['sequence_parallel']}"
    return Row("megatron-korthikanti2022", "Table 5", r["model"], label, args, "1/iteration s",
               1 / float(r["iteration_time_s"]), note=f"{r['iteration_time_s']} s published")  # fmt: skip


def _narayanan(r: dict) -> Row:
    mp = int(r["model_parallel_size"])
    tp = min(NARAYANAN_TP_MAX, mp)
    pp, heads = mp // tp, int(r["hidden"]) // 128
    args = ["gpt-13b", *_base_args(r, r["layers"], r["hidden"], str(heads), r["seq_len"], r["vocab"])]
    args += ["train.precision=fp16", "model.hidden_dropout=0.1", "model.attention_dropout=0.1"]
    args += _layout(tp, pp, int(r["dp"]), 1, int(r["global_batch_seqs"]), "0", "full", False)
    label = f"{r['n_gpus']} GPUs, mp {mp} (assumed t{tp} p{pp}, mb 1, full recompute, {heads} heads)"
    return Row("megatron-narayanan2021", "Table 1", r["model"], label, args, "TFLOP/s/GPU (hardware)",
               float(r["model_tflops_per_gpu"]))  # fmt: skip


def _megatron_core(r: dict) -> Row:
    args = ["gpt-13b", *_base_args(r, r["layers"], r["hidden"], r["heads"], r["seq_len"], r["vocab"])]
    args += ["train.precision=bf16"]
    tp, pp, dp = int(r["tp"]), int(r["pp"]), int(r["dp"])
    args += _layout(tp, pp, dp, 1, int(r["global_batch_seqs"]), "2", "none", True)
    label = f"{r['n_gpus']} GPUs t{tp} p{pp} d{dp}"
    label += " (assumed mb 1, no recompute, SP, distributed optimizer as ZeRO-2)"
    return Row("megatron-core-h100-2024", "model table", r["model"], label, args, "TFLOP/s/GPU (model)",
               float(r["model_tflops_per_gpu"]))  # fmt: skip


def _megatron_moe(r: dict) -> Row:
    """Megatron-Core's MoE README: Mixtral 8x7B bf16 on 64 H100 at its reference mapping. Planned as
    the README's example script builds the model (Llama-shaped, GQA, SwiGLU, RMSNorm, rope, untied),
    dropless with expert parallelism; the distributed optimizer as ZeRO-2 (as the megatron-core rows
    above), no recompute (the example sets none); VP is the virtual pipeline size (NeMo's naming)."""
    args = ["llama-8b", *_base_args(r, r["layers"], r["hidden"], r["heads"], r["seq_len"], r["vocab"])]
    args += ["model.rope_scaling=false", "train.precision=bf16", f"model.num_experts={r['num_experts']}"]
    args += [f"model.moe_router_topk={r['moe_topk']}", f"model.moe_ffn_hidden_size={r['moe_ffn_hidden']}"]
    tp, pp, dp, ep, v = (int(r[k]) for k in ("tp", "pp", "dp", "ep", "pipeline_interleave"))
    args += _layout(tp, pp, dp, int(r["micro_batch"]), int(r["global_batch_seqs"]), "2", "none", False, v)
    args += [f"parallel.ep={ep}"]
    label = f"{r['n_gpus']} GPUs t{tp} p{pp} v{v} ep{ep} d{dp}, {r['framework'].split(',')[0]}"
    label += " (assumed: ZeRO-2 for the distributed optimizer, no recompute)"
    metric = "TFLOP/s/GPU (model, megatron-lm-2024)"
    return Row("megatron-core-moe-h100-2024", "MoE README", r["model"], label, args, metric,
               float(r["model_tflops_per_gpu"]), moe=True)  # fmt: skip


# Megatron-Bridge's MoE rows: FP8 is Transformer Engine's current scaling (fp8_cs: one scale per tensor
# from the current step), planned as torchao's tensorwise dynamic scaling; the benchmarks force-balance the
# router ("we force-balance the token distribution among experts"), or (25.09's tokendrop) pad every
# expert to a capacity factor of 1.0: both make the busiest expert's load the mean (imbalance 1).
BRIDGE_FP8 = "tensorwise"
BRIDGE_IMBALANCE = "1"


def _embedding_loss_split(layers: int, pp: int, v: int) -> list[str]:
    """Megatron's account_for_embedding_in_pipeline_split and account_for_loss_in_pipeline_split (set by
    Megatron-Bridge's Qwen3-235B recipes): the embedding and the loss count as one layer each, so where
    the layers do not split evenly over the pp x v virtual stages but layers + 2 does, the first and the
    last virtual stage hold one layer fewer (Qwen3-235B-A22B: 94 + 2 = 32 x 3)."""
    chunks = pp * v
    per, rest = divmod(layers + 2, chunks)
    if chunks == 1 or layers % chunks == 0 or rest:
        return []
    stages = [per - 1] + [per] * (chunks - 2) + [per - 1]
    return [f"parallel.pipeline_layers={','.join(map(str, stages))}"]


def _megatron_bridge_moe(r: dict) -> Row:
    """Megatron-Bridge's DGX-H100 MoE pre-training rows (Qwen3-30B-A3B, Qwen3-235B-A22B), planned as
    the Mixtral rows (Llama-shaped: GQA, SwiGLU experts, RMSNorm, rope, untied) with Qwen3's head size
    (`model.kv_channels`, 128 where hidden / heads is 64), the distributed optimizer as ZeRO-2, no
    recompute and etp 1 (the perf recipes), sequence parallelism with tp > 1 (Megatron-Bridge's
    default) and Qwen3's per-head q/k RMSNorm (`model.qk_norm=head`)."""
    args = ["llama-8b", *_base_args(r, r["layers"], r["hidden"], r["heads"], r["seq_len"], r["vocab"])]
    args += ["model.rope_scaling=false", "train.precision=bf16", f"model.num_experts={r['num_experts']}"]
    args += [f"model.moe_router_topk={r['moe_topk']}", f"model.moe_ffn_hidden_size={r['moe_ffn_hidden']}"]
    args += [f"model.kv_channels={r['kv_channels']}"]
    if r["qk_norm"] == "yes":
        args += ["model.qk_norm=head"]  # Megatron --qk-layernorm: one norm per head
    if "capacity factor 1.0" in r["dispatcher"]:
        args += ["model.moe_capacity_factor=1.0"]
    if r["precision"].startswith("fp8"):
        args += [f"train.fp8={BRIDGE_FP8}"]
    tp, pp, dp, ep, v = (int(r[k]) for k in ("tp", "pp", "dp", "ep", "pipeline_interleave"))
    args += _layout(tp, pp, dp, int(r["micro_batch"]), int(r["global_batch_seqs"]), "2", "none", True, v)
    args += _embedding_loss_split(int(r["layers"]), pp, v)
    args += [f"parallel.ep={ep}", "--moe-imbalance", BRIDGE_IMBALANCE]
    release = r["framework"].split("NeMo ")[-1].split(" ")[0]
    label = f"{r['n_gpus']} GPUs t{tp} p{pp} v{v} ep{ep} etp{r['etp']} d{dp}, mb {r['micro_batch']}, "
    label += f"gbs {r['global_batch_seqs']}, {r['precision'] or 'precision not stated'}, NeMo {release}"
    row = Row("megatron-bridge-moe-h100", f"NeMo {release}", r["model"], label, args, "tokens/s/GPU",
              float(r["tokens_per_s_per_gpu"]), moe=True)  # fmt: skip
    if not r["precision"]:
        row.skip = "not planned: the source does not state the precision (bf16 and fp8 share this layout)"
    return row


# Megatron-Core's MoE model zoo (yanring/Megatron-MoE-ModelZoo, which Megatron-LM's MoE README points
# to for its MoE recipes): block-wise FP8 (128 x 128 weight blocks), planned as torchao's rowwise scaling
# (the finer of the two; weights gathered in bf16)
ZOO_FP8 = "rowwise"


def _zoo_moe(r: dict) -> Row:
    """Megatron-MoE-ModelZoo's H100 rows: Mixtral 8x22B's expected TFLOPS (its script's comments) and
    Qwen3-235B-A22B's step times, planned as the Megatron-Core MoE rows (distributed optimizer as
    ZeRO-2, Megatron FSDP as ZeRO-3, sequence parallelism, etp 1) with each row's recompute ('norm, act'
    recomputes the layernorm and MoE activation only: planned as none) and the embedding/loss pipeline
    split; the busiest expert at the mean where the router is forced to balance or padded to capacity,
    the planner's default imbalance where the source does not say."""
    args = ["llama-8b", *_base_args(r, r["layers"], r["hidden"], r["heads"], r["seq_len"], r["vocab"])]
    args += ["model.rope_scaling=false", "train.precision=bf16", f"model.num_experts={r['num_experts']}"]
    args += [f"model.moe_router_topk={r['moe_topk']}", f"model.moe_ffn_hidden_size={r['moe_ffn_hidden']}"]
    head_size = int(r["kv_channels"]) * int(r["heads"]) != int(r["hidden"])
    if head_size:
        args += [f"model.kv_channels={r['kv_channels']}"]
    if r["qk_norm"] == "yes":
        args += ["model.qk_norm=head"]  # Megatron --qk-layernorm: one norm per head
    if r["precision"].startswith("fp8"):
        args += [f"train.fp8={ZOO_FP8}"]
    tp, pp, dp, ep, v, cp = (int(r[k]) for k in ("tp", "pp", "dp", "ep", "pipeline_interleave", "cp"))
    zero = "3" if "FSDP" in r["zero_or_fsdp"] else "2"
    rec = "full" if r["activation_checkpointing"] == "full" else "none"
    args += _layout(tp, pp, dp, int(r["micro_batch"]), int(r["global_batch_seqs"]), zero, rec, True, v)
    args += [*_embedding_loss_split(int(r["layers"]), pp, v), f"parallel.ep={ep}", f"parallel.cp={cp}"]
    if "force-load-balancing" in r["dispatcher"] or "capacity factor 1.0" in r["dispatcher"]:
        args += ["--moe-imbalance", BRIDGE_IMBALANCE]
    label = f"{r['n_gpus']} GPUs t{tp} p{pp} v{v} cp{cp} ep{ep} etp{r['etp']} d{dp}, mb {r['micro_batch']}, "
    label += f"seq {r['seq_len']}, {r['precision']}, recompute {r['activation_checkpointing']}, "
    label += r["dispatcher"]
    if r["iteration_time_s"]:
        derived = "iteration_time_s =" in r["derived_fields"]
        how = "derived from the published TFLOP/s" if derived else "published"
        row = Row("megatron-moe-modelzoo-h100", r["table"].split(" ", 1)[1], r["model"], label, args,
                  "1/iteration s", 1 / float(r["iteration_time_s"]), moe=True,
                  note=f"{r['iteration_time_s']} s {how}")  # fmt: skip
    else:
        row = Row("megatron-moe-modelzoo-h100", r["table"].split(" ", 1)[1], r["model"], label, args,
                  "TFLOP/s/GPU (model, megatron-lm)", float(r["model_tflops_per_gpu"]), moe=True)  # fmt: skip
    if head_size and not r["iteration_time_s"]:
        # TFLOPS by Megatron-LM's formula with kv_channels 128: the planner's FLOPs conventions count
        # attention at hidden / heads, so the figure cannot be turned into a step time here
        row.skip = "not planned: published only as TFLOP/s by Megatron-LM's formula with kv_channels 128"
    return row


def _torchtitan(r: dict) -> Row | None:
    if r["precision"] != "bf16" or r["seq_len"]:
        return None  # Float8 linears and context parallelism are not modelled
    args = ["llama-8b", "train.precision=bf16"]
    n = int(r["n_gpus"])
    args += _layout(1, 1, n, int(r["micro_batch"]), int(r["global_batch_seqs"]), "3",
                    _recompute(r["activation_checkpointing"]), False)  # fmt: skip
    label = f"{n} GPUs, {r['framework']}"
    return Row("torchtitan-h100-2024", r["table"].split(":")[0], r["model"], label, args, "tokens/s/GPU",
               float(r["tokens_per_s_per_gpu"]), note="seq 8192 assumed (train_configs default)")  # fmt: skip


READERS = {
    "llm_foundry_mpt.csv": _foundry,
    "mosaicml_examples_2023_02.csv": _mosaicgpt,
    "megatron_korthikanti2022_table5.csv": _korthikanti,
    "megatron_narayanan2021_table1.csv": _narayanan,
    "megatron_core_h100_2024.csv": _megatron_core,
    "megatron_core_moe_h100_2024.csv": _megatron_moe,
    "megatron_bridge_moe_h100.csv": _megatron_bridge_moe,
    "megatron_moe_modelzoo_h100.csv": _zoo_moe,
    "torchtitan_llama3_h100_2024.csv": _torchtitan,
}


def load_rows(limit: int | None = None) -> list[tuple[Row, str, int]]:
    """(row, device, GPUs) for every row the model can express."""
    out = []
    for name, reader in READERS.items():
        with open(DATA / name) as f:
            for r in csv.DictReader(f):
                row = reader(r)
                device = _device(r["gpu"])
                if row is None or device is None:
                    continue
                row.gpus = int(r["n_gpus"])
                out.append((row, device, row.gpus))
                if limit and sum(1 for o in out if o[0].source == row.source) >= limit:
                    break
    return out


def _params(row: Row, gpus: int) -> int:
    """The planned model's parameters, as `stx plan` counts them for its expected-error class."""
    from scalable_transformer.config.load import load_config
    from scalable_transformer.config.model_shapes import total_params
    from scalable_transformer.plan.search import prepare

    overrides = [a for a in row.args[1:] if "=" in a and not a.startswith("--")]
    return total_params(prepare(load_config(row.args[0], overrides), gpus).model)


def _sample_flops(row: Row, gpus: int, convention: str) -> float:
    """Model FLOPs of one sample of the row's model under `convention` (metrics/flops.py)."""
    from scalable_transformer.config.load import load_config
    from scalable_transformer.metrics.flops import ModelShape, flops_per_iteration
    from scalable_transformer.plan.search import prepare

    overrides = [a for a in row.args[1:] if "=" in a and not a.startswith("--")]
    model = prepare(load_config(row.args[0], overrides), gpus).model
    return flops_per_iteration(ModelShape.from_config(model), 1, convention).model_flops


def predict(row: Row, device: str, gpus: int) -> None:
    from scalable_transformer.cli import main

    nodes, per_node = (gpus // 8, 8) if gpus >= 8 else (1, gpus)
    argv = ["plan", *row.args, "--device", device, "--nodes", str(nodes), "--gpus-per-node", str(per_node)]
    if row.skip:
        row.note = (row.note + "; " if row.note else "") + row.skip
        return
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([*argv, "--no-probe", "--json"])
    if code != 0:
        # the config's own message (e.g. a key this model cannot express yet) says why it is not planned
        why = err.getvalue().strip().splitlines()[-1:] or [""]
        row.note = (row.note + "; " if row.note else "") + f"stx plan exit {code}: {why[0]}".rstrip(": ")
        return
    layout = json.loads(out.getvalue())["layouts"][0]
    row.params = _params(row, gpus)
    seconds = layout["step_seconds"]
    if row.metric == "tokens/s/GPU":
        row.predicted = layout["tokens_per_second"] / gpus
    elif row.metric == "1/iteration s":
        row.predicted = 1 / seconds
        row.note += f"; {seconds:.2f} s predicted"
    elif row.metric == "TFLOP/s/GPU (model)":
        row.predicted = layout["tflops_per_device"]
    elif row.metric.startswith("TFLOP/s/GPU (model, "):
        # Megatron-Core's MoE figures count FLOPs with its own formula of the time (megatron-lm-2024: the
        # active experts, no router, no causal halving; megatron-lm: the current one, causal attention
        # halved): the planned samples/s at that convention's FLOPs
        convention = row.metric.removeprefix("TFLOP/s/GPU (model, ").rstrip(")")
        row.predicted = layout["samples_per_second"] * _sample_flops(row, gpus, convention) / gpus / 1e12
    else:  # hardware FLOPs: the model's FLOPs with the recompute's forward (Narayanan's formula)
        row.predicted = layout["tflops_per_device"] * 4 / 3
    if not layout["fits"]:
        row.note = (row.note + "; " if row.note else "") + "planner: does not fit"


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        for rank, i in enumerate(order):
            r[i] = float(rank)
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    den = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return num / den if den else float("nan")


def summarize(rows: list[Row]) -> dict:
    errors = [abs(r.error) for r in rows if r.error is not None]
    groups: dict[tuple[str, str, str], list[Row]] = {}
    for r in rows:
        if r.predicted is not None:
            groups.setdefault((r.source, r.table, r.model), []).append(r)
    rho = {
        k: spearman([r.predicted for r in g], [r.published for r in g])
        for k, g in groups.items()
        if len(g) >= 3
    }  # type: ignore[misc]
    return {
        "rows": len(rows),
        "predicted": len(errors),
        "median_abs_error": statistics.median(errors) if errors else float("nan"),
        "within_25": sum(e <= 0.25 for e in errors) / len(errors) if errors else float("nan"),
        "spearman": rho,
        "spearman_median": statistics.median(rho.values()) if rho else float("nan"),
    }


def write_report(rows: list[Row], summary: dict, path: Path, devices: dict[str, str]) -> None:
    from scalable_transformer.files import write_atomic

    lines = [
        "# GPU time model vs published training throughput (issue 22)",
        "",
        "Predictions: `stx plan ... --no-probe --json` with the built-in profiles (plan/profiles/*.yaml, "
        "from benchmarks/data/gpu_kernels only). Published: benchmarks/data/gpu_validation (never used to "
        "fit). Error = predicted / published - 1 on the throughput figure named per row.",
        "",
        f"Rows predicted: {summary['predicted']} of {summary['rows']}; median |error| "
        f"{summary['median_abs_error']:.1%} (target <= 15%); within 25%: {summary['within_25']:.0%} "
        f"(target >= 75%); Spearman within a table's layouts of one model (groups of >= 3): median "
        f"{summary['spearman_median']:.2f} (target >= 0.9).",
        "",
        "| source | GPU | rows | median error | median abs error | within 25% |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
        *_per_source(rows, devices),
        "",
        *_without_older_code(rows),
        "",
        *_moe_rows(rows),
        "",
        "| source | table | model | GPU | layout | metric | published | predicted | error | note |",
        "| --- | --- | --- | --- | --- | --- | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        pred = f"{r.predicted:,.4g}" if r.predicted is not None else "-"
        err = f"{r.error:+.0%}" if r.error is not None else "-"
        lines.append(
            f"| {r.source} | {r.table} | {r.model} | {devices[id(r)]} | {r.label} | {r.metric} | "
            f"{r.published:,.4g} | {pred} | {err} | {r.note.strip('; ')} |"
        )
    lines += [
        "",
        "## Rank correlation by table and model",
        "",
        "| source | table | model | Spearman |",
        "| --- | --- | --- | ---: |",
    ]
    for (src, table, model), rho in summary["spearman"].items():
        lines.append(f"| {src} | {table} | {model} | {rho:.2f} |")
    lines += [
        "",
        *_distributions(rows, devices),
        "",
        MOSAICGPT_2023_02,
        "",
        *_code_base(rows, devices),
        "",
        MISSES,
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, "\n".join(lines) + "\n")


def _per_source(rows: list[Row], devices: dict[int, str]) -> list[str]:
    groups: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        if r.error is not None:
            groups.setdefault((r.source, devices[id(r)]), []).append(r.error)
    return [
        f"| {src} | {dev} | {len(e)} | {statistics.median(e):+.0%} | "
        f"{statistics.median(abs(x) for x in e):.0%} | {sum(abs(x) <= 0.25 for x in e)}/{len(e)} |"
        for (src, dev), e in groups.items()
    ]


def _stats(errors: list[float], labels: list[str]) -> str:
    """median error | median |error| | 90th percentile |error| | worst (signed) and its layout."""
    ranked = sorted(abs(e) for e in errors)
    p90 = ranked[min(len(ranked) - 1, round(0.9 * (len(ranked) - 1)))]
    worst = max(range(len(errors)), key=lambda i: abs(errors[i]))
    return (
        f"{statistics.median(errors):+.1%} | {statistics.median(ranked):.1%} | {p90:.1%} | "
        f"{errors[worst]:+.1%} ({labels[worst]})"
    )


def _moe_rows(rows: list[Row]) -> list[str]:
    """The mixture-of-experts rows on their own (issue 43: median |error| <= 20% on published MoE runs
    the model was not fitted to): how many, how many planned, median and worst |error|, and why the
    others are not planned (each row's note, counted)."""
    moe = [r for r in rows if r.moe]
    if not moe:
        return []
    errors = [abs(r.error) for r in moe if r.error is not None]
    planned = (
        f"{len(errors)} planned, median |error| {statistics.median(errors):.1%}, worst {max(errors):.1%}"
        if errors
        else "none planned"
    )
    why: dict[str, int] = {}
    for r in moe:
        if r.error is None:
            reason = r.note.split("stx: config error: ")[-1].strip("; ").removeprefix("not planned: ")
            why[reason] = why.get(reason, 0) + 1
    out = [
        f"Mixture-of-experts rows (issue 43, target median |error| <= 20%): {len(moe)} published, {planned}."
        + "".join(f" Not planned ({n}): {reason}." for reason, n in why.items())
    ]
    return [*out, "", MOE_SOURCES]


MOE_SOURCES = """MoE sources (benchmarks/data/gpu_validation/README.md): Megatron-Core's MoE README
(Mixtral 8x7B bf16, 64 H100, MCore v0.8 and v0.9); Megatron-Core's MoE model zoo
(yanring/Megatron-MoE-ModelZoo, the recipes Megatron-LM's MoE README points to: Mixtral 8x22B on 128
H100, the expected TFLOP/s its script states for bf16 dropless, forced balance, block-wise fp8 and token
drop; Qwen3-235B-A22B on 256 H100, five bf16 layouts with step times, one with TFLOP/s (its step time
from the other five's TF x step) and eight long-context TFLOP/s figures); Megatron-Bridge's performance
summaries (DGX-H100 pre-training of Qwen3-30B-A3B and Qwen3-235B-A22B, NeMo containers 25.09 to 26.06:
every H100 row of these two models). What keeps rows unplanned on this branch (each row's note says
which): Qwen3's head size is 128 where hidden / heads is 64 (2048 / 32, 4096 / 64), so its rows pass
`model.kv_channels=128`, which the config does not take yet; every Mixtral 8x22B and Qwen3-235B-A22B row
runs tp 2 or 4 with etp 1, and MoE layers refuse tp > 1 until they have a tensor-parallel plan (after
that the planner splits each expert over tp, Megatron's default etp = tp, where these runs keep experts
whole: an etp term the planner lacks; and Megatron folds the expert-parallel group over the attention's
tp ranks, keeping ep 8 inside a node and allowing ep > dp x cp, where stx carves ep out of dp x cp at
stride tp (`_ep_seconds`): with tp > 1 these rows either cannot be expressed (ep 32 over t2 d16) or plan
their all-to-all across nodes); the long-context rows are TFLOP/s by Megatron's formula with
kv_channels, which the FLOPs conventions do not count. One model-zoo row (pp 32 x vp 3 = 96 virtual
stages for 94 layers) gives the first virtual stage only the embedding and the last only the loss;
`parallel.pipeline_layers` needs a layer in every stage, so that row will stay unplanned. FP8:
Megatron-Bridge's is Transformer Engine's current scaling, planned as `train.fp8=tensorwise`; the model
zoo's block-wise fp8 as `rowwise`. The H100 profile's fp8 GEMM point is mamf-finder's best (1402.6
TFLOP/s at 1024x9216x14336, 71% of the 1979 peak), the smaller shapes that point scaled, so at these
models' GEMMs the planner assumes 2.0-2.3x the bf16 rate measured at training shapes (565-696 TFLOP/s);
no fp8 GEMM was measured at training shapes. Routing: forced balance and capacity factor 1.0 with
padding are planned with `--moe-imbalance 1`; rows that do not say so, with the planner's default. The
published figure moves with the software at one layout (Qwen3-30B-A3B, 16 GPUs, t1 p2 v12 ep8: 5,113
tokens/s/GPU in NeMo 26.02, 9,058 in 26.02.01), which no layout model can follow. Not expressible, so
not recorded as rows: Megatron-Bridge's other DGX-H100 MoE rows, DeepSeek-V3 (MLA; 1 row), GPT-OSS-120B
(head size 64 at hidden 2880, attention sinks, alternating sliding-window attention, biased experts; 5
rows) and Nemotron-3-Nano (hybrid Mamba; 4 rows); the model zoo's Qwen3-Next-80B-A3B (gated delta net
layers). Not found: NVIDIA/NeMo's repository has no MoE row (the NeMo 2.0 docs-site tables of containers
25.02-25.07 list Mixtral 8x7B / 8x22B fp8 rows; their DGX-H100 sections were not in the stored copies,
so none is recorded), torchtitan publishes no MoE throughput (benchmarks/ and the model READMEs) and the
OLMoE paper was not available (no published layout found)."""


def _without_older_code(rows: list[Row]) -> list[str]:
    """The headline over the sources of a current code base: mosaicgpt-2023-02 runs an older, slower
    code base (below), which the time model does not model and which is not fitted away."""
    kept = [abs(r.error) for r in rows if r.error is not None and r.source not in OLDER_CODE]
    if not kept:
        return []
    within = sum(e <= 0.25 for e in kept) / len(kept)
    return [
        f"Without {', '.join(sorted(OLDER_CODE))} (an older code base, see below): {len(kept)} rows, median "
        f"|error| {statistics.median(kept):.1%}, within 25%: {within:.0%}."
    ]


OLDER_CODE = {"mosaicgpt-2023-02"}
EXPECTED_ERROR = ROOT / "src" / "scalable_transformer" / "plan" / "validation_errors.json"


def _error_class(row: Row, device: str) -> tuple[str, str, str] | None:
    """The class of a row as `stx plan` reads its expected error (validation_error.error_class; these
    tables' runs have 8 GPUs per node)."""
    from scalable_transformer.plan.validation_error import error_class

    return None if row.params is None else error_class(device, row.params, row.gpus, 8, row.moe)


def write_expected_error(rows: list[Row], devices: dict[int, str], path: Path = EXPECTED_ERROR) -> None:
    """plan/validation_errors.json: per class of layout the rows, median error and 90th percentile
    |error| of this report's rows (not the older code base's), which `stx plan` shows beside its step
    time (plan/validation_error.py)."""
    from scalable_transformer.files import write_atomic

    groups: dict[tuple[str, str, str], list[float]] = {}
    for r in rows:
        key = _error_class(r, devices[id(r)])
        if key is not None and r.error is not None and r.source not in OLDER_CODE:
            groups.setdefault(key, []).append(r.error)
    classes = []
    for (gpu, size, nodes), errs in sorted(groups.items()):
        ranked = sorted(abs(e) for e in errs)
        p90 = ranked[min(len(ranked) - 1, round(0.9 * (len(ranked) - 1)))]
        median = round(statistics.median(errs), 3)
        classes.append(
            {"gpu": gpu, "size": size, "nodes": nodes, "runs": len(errs), "median_error": median,
             "p90_abs_error": round(p90, 3)}
        )  # fmt: skip
    doc = {
        "generated_by": "benchmarks/plan_gpu_validation.py (do not edit; rerun the benchmark)",
        "classes": classes,
    }
    write_atomic(path, json.dumps(doc, indent=1) + "\n")


def _distributions(rows: list[Row], devices: dict[int, str]) -> list[str]:
    """Error distributions by source and model, and by source, GPU and GPU count."""
    by_model: dict[tuple, list[Row]] = {}
    by_gpus: dict[tuple, list[Row]] = {}
    for r in rows:
        if r.error is not None:
            by_model.setdefault((r.source, r.model), []).append(r)
            by_gpus.setdefault((r.source, devices[id(r)], r.gpus), []).append(r)
    head = "| rows | median error | median abs error | 90th pct abs error | worst (layout) |"
    out = ["## Error distributions by model and by GPU count", "",
           "| source | model " + head, "| --- | --- | ---: | ---: | ---: | ---: | --- |"]  # fmt: skip
    for (src, model), g in by_model.items():
        out.append(
            f"| {src} | {model} | {len(g)} | " + _stats([r.error for r in g], [r.label for r in g]) + " |"
        )  # type: ignore[misc]
    out += ["", "| source | GPU | GPUs " + head, "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for (src, dev, n), g in sorted(by_gpus.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        stats = _stats([r.error for r in g], [f"{r.model}, {r.label}" for r in g])  # type: ignore[misc]
        out.append(f"| {src} | {dev} | {n} | {len(g)} | {stats} |")
    return out


def _code_base(rows: list[Row], devices: dict[int, str]) -> list[str]:
    """The same model on the same 8 GPUs at seq 2048 in the two MosaicML publications: the published
    ratio (February 2023 / April 2023) against the predicted one, which holds what the planner knows
    of the two runs (micro-batch, recompute, FlashAttention 1 vs Triton, biases, gather dtype). What
    the prediction does not explain is the older code base."""
    pick: dict[tuple, dict[str, list[Row]]] = {}
    for r in rows:
        if r.predicted is None or r.gpus != 8 or r.seq != 2048 or not devices[id(r)].startswith("a100"):
            continue
        if r.source in ("mosaicgpt-2023-02", "llm-foundry"):
            size = r.model.split("-")[-1]
            pick.setdefault((size, devices[id(r)]), {}).setdefault(r.source, []).append(r)
    out = [
        "### The older code base: the same model and GPUs in February and April 2023",
        "",
        "| model | GPU | 2023-02 mb | tokens/s/GPU | llm-foundry mb | tokens/s/GPU | published ratio | "
        "predicted ratio | published / predicted |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    ratios = []
    for (size, dev), by in pick.items():
        if len(by) < 2:
            continue
        feb = max(by["mosaicgpt-2023-02"], key=lambda r: r.published)
        for apr in by["llm-foundry"]:
            pub, pred = feb.published / apr.published, feb.predicted / apr.predicted  # type: ignore[operator]
            ratios.append(pub / pred)
            out.append(
                f"| {size} | {dev} | {feb.micro_batch} | {feb.published:,.0f} | {apr.micro_batch} | "
                f"{apr.published:,.0f} | {pub:.2f} | {pred:.2f} | {pub / pred:.2f} |"
            )
    if ratios:
        median = statistics.median(ratios)
        out += ["", f"Median published / predicted: {median:.2f} over {len(ratios)} pairs: the February 2023 "
                f"code ran {1 - median:.0%} slower than its layout explains."]  # fmt: skip
    return out


MOSAICGPT_2023_02 = """## MosaicGPT, February 2023 (mosaicml/examples release 0.0.3): FSDP collective latency

Issue 41 planned 87 MosaicGPT runs of mosaicml/examples (A100 40/80GB, 8-64 GPUs) and found the model
too fast everywhere, worst for small models across nodes. `mosaicml_examples_2023_02.csv` transcribes
all 149 rows of those tables at d14a7c94 (the 139 rows under 30B at 8-64 GPUs and the ten 30B/70B
rows the README calls outdated). Each is planned as its run was: the yaml's `attn_impl: flash` is
FlashAttention 1 (flash-attn 0.2.8; `--attention-kernel flash1`, the FA2 README's A100 figures of it),
linear and LayerNorm biases, learned positions, the vocabulary padded to a multiple of 16, FSDP with
Composer 0.12's `mixed_precision: DEFAULT` (fp32 parameters gathered, gradients reduced in bf16) and
its per-micro-batch reduce-scatter. Where the per-GPU batch is not a multiple of the micro-batch the
run's last micro-batch was smaller; it is planned as GradAccum full ones. The issue's figures (87 runs,
39 of them 125M at +53%) are not reproduced: these tables hold 24 rows of 125M, and planned as the issue
says (no biases, Triton attention, before the change below) the 149 rows are +20% (median), 125M +27%,
16/32/64 GPUs +20/+25/+32%. Planned as above, before the change: +20.3% median, 90th percentile
30.5%, worst +58.8% (125M on 64 A100 40GB, micro-batch 4); A100 40GB by GPU count 8/16/32/64:
+20/+23/+25/+33%; by model 125M +26.5%, 350M +19.5%, 760M +23.9%, 1B +25.5%, 3B +18.3%, 7B +15.8%, 13B +7.3%
(after: +25.1%, +18.1%, +22.1%, +24.5%, +17.7%, +15.4%, +7.3%).

**Two effects, separated.** (1) The older code base: at 8 GPUs in one node the same model runs 13-23%
slower (median 17%) than in the April 2023 tables of the same hardware (the table below), beyond what
the planner knows differs between the two runs (7b and 13b on 80GB compare layouts with and without
recompute, and say little). That is torch 1.13 / Composer 0.12 against later releases, not a
time-model term, and it is not fitted: these rows stay about +19% (median) too fast. (2) What grows
with the GPU count: per published step time split into per-micro-batch and per-step parts (rows of one
layout at 2-4 gradient-accumulation counts), the per-micro-batch time grew over the 8-GPU one by 3.8,
5.4 and 11.0 ms on 16, 32 and 64 GPUs (MosaicGPT-125m, micro-batch 16, A100 40GB) where the model
added about nothing: it hid every FSDP collective behind compute. The growth tracks the latency of the
unit's ring collectives (n - 1 hops each; 38 of them per micro-batch), from the profile's own
collective data (nccl_collectives.csv: 43.8 us for the 8-GPU A100 all_reduce at 32 KB, scaled by
hops): 1.9, 5.7 and 13.3 ms. Only the bandwidth part hides: each FSDP unit's collective waits for the
compute before it on every rank (FSDP issues it at most one unit ahead), so its n - 1 ring steps
are on the critical path; NCCL's own tuning model (2.14, src/graph/tuning.cc: 3.4 us per NVLink and
9.6 us per network ring step, Simple protocol) gives 266 us for a 64-rank all-gather over 8 nodes
against 394 us from the profile.

**How the change was chosen** (2026-11-28): on the 149 rows of this table only (and the calibration
data), the criterion was the error's growth with the GPU count over the same layout's 8-GPU error,
not its level (the level is the code base). Candidates: (a) nothing hidden (every FSDP collective in
series with compute): removes the growth but also takes 5-14% off single-node predictions, i.e. would
fit away part of the code-base gap and contradicts the H100 trace of our engine, whose FSDP
communication overlaps; (b) only the latency in series: removes the growth (median 16/32/64-GPU
excess over the 8-GPU error +2.2/+5.4/+8.1% -> +1.4/+2.8/+0.6%; worst row +58.8% -> +34.5%) and moves
single-node predictions by under 1%. (b) was taken (`_dp_seconds`: every FSDP gather and scatter's
time at one byte is exposed, no new constant), then checked untouched on the other tables: llm-foundry
125M-350M on 16-64 GPUs median |error| 2.2% -> 1.6% (must show: <= 15%); llm-foundry's large-scale
H100 rows (128-512 GPUs, a later code base) +22/+26/+34% -> +16/+14/+11% (MPT-1b) and +19/+22/+28% ->
+13/+10/+6% (MPT-3b); the 240 rows of the other sources 7.2% -> 6.6% median |error|, 92% -> 95%
within 25%. Megatron-Core's rows (distributed optimizer planned as ZeRO-2, whose one bucketed
reduce-scatter per step the per-unit model does not describe) moved 1-4 points further slow."""


MISSES = """## Where the model still misses and why

The model is calibrated on kernel data only (benchmarks/data/gpu_kernels: public kernel benchmarks and
`stx calibrate` on one H100 and one H200); no constant was tuned on these tables. Each llm-foundry row
is planned with the attention kernel its run took (`--attention-kernel`, from the publisher's scripts:
`triton` for the A100 and H100 tables, `flash` or `triton` per model in the large-scale table); every
other row with SDPA's flash kernel (MosaicGPT 2023-02: FlashAttention 1, above). It is close on
Megatron's tables (A100: median -1% to -3%; H100: -15%) and on llm-foundry's up to seq 8192; the
large-scale H100 rows are +11% (median; +17.5% before the FSDP latency term), torchtitan's +47%.

- **Attention kernel, per run**: llm-foundry's benchmark script defaulted to `attn_impl: triton`, the
  Triton FlashAttention of 2022, which FlashAttention-2's README figures put at 68-80 TFLOP/s fwd+bwd
  on an A100 (causal, head dim 128, seq 2k-16k) where FA2 reaches 155-189. Planned with SDPA's flash
  kernel for every row, the model was +46% to +54% at 16k-64k and 17.1% off in median over all rows;
  with each run's kernel, 7.2%. No H100 figure of that kernel is published: its H100 points are the
  A100 figure scaled by FA2's H100 / A100 ratio (an assumption). Its figures end at 16k and are held
  flat beyond, and the 16k-64k rows now come out 12-15% slow.
- **GEMM efficiency**: H100 and H200 profiles hold GEMMs measured at training shapes (540-756 TFLOP/s
  at hidden 4096, 0.68-0.95 of mamf-finder's best shape); that took llm-foundry's H100 rows from +42%
  to +22%. The A100s have no measured surface: their best-shape point times the H100's measured share
  of its best, an assumption (their rows moved from +31/+33% to +15/+17%).
- **Communication overlapped with compute is free in the model**, but for each FSDP collective's
  latency (above): FSDP's all-gathers and reduce-scatters hide their bandwidth part behind compute,
  but NCCL kernels take SMs and HBM bandwidth from the GEMMs they
  overlap. A public characterization (Jain et al. 2025, arXiv 2507.03114: 4 A100s / H100s, GPT and
  LLaMA) measured compute 18.9% slower on average while overlapped (40% at most). If the
  hidden communication is about a tenth of the compute, as the model has it for 8-GPU MPT-7b, that adds
  about 2%: it is not in the model, and it does not explain the FSDP rows' gap.
- **Launch overhead**: 17.5 us per op measured on the H100 host (11.8 on the H200's), added in series
  with the kernels. On a GPU it mostly overlaps them (an H100 trace: 3 ms of idle GPU per step where 13
  ms were planned, gpt-7b at 4 layers). torchtitan's rows without torch.compile pay FSDP2's
  per-parameter Python that the model does not count; torch.compile variants are predicted as eager.
- **What the engine does that others do not**: the model predicts this engine. Its foreach AdamW moves
  92 bytes per parameter (measured on the H100 trace: 91); Megatron's fused distributed optimizer
  moves fewer, and our per-micro-batch weight casts and gradient accumulation (33 ms per step in the
  trace) are left out because Megatron's engine does not pay them.
- **Clocks and power**: torchtitan's H100s are 96 GB parts capped at 500 W, not 700 W SXM parts. GPUs
  under sustained load run below the boost clock that short kernel benchmarks reach.
- **Megatron's attention**: Megatron 2021/2022 ran unfused softmax attention. The planner models SDPA's
  flash kernel, so its selective-recompute rows come out faster than published (+15% to +38%).
- **Rank order at one shape**: where layouts differ only in GPU count (MPT-70b on 128/256/512 GPUs:
  published 1058 -> 1007 tokens/s/GPU) the model predicted a flat line (rank correlation -1.00) while
  it hid every collective; with their latency exposed it falls with the GPU count too (1162 -> 1135).
- **Unstated layouts** are assumed (Narayanan's tp/pp split and micro-batch, Megatron-Core's
  micro-batch, recompute and optimizer sharding, torchtitan's sequence length).
- **Memory**: the planner says "does not fit" for 65 of the llm-foundry rows, flagged in the notes
  column. It predicts our engine, whose loss materializes the whole micro-batch's fp32 log-softmax
  (MPT-7b, micro-batch 16 x 4096 tokens x 50k vocabulary: 26.1 GiB of "logits and loss" per GPU); the
  published runs fit, so their loss takes less memory. With Composer's per-micro-batch reduce-scatter
  mapped to `parallel.reduce_each_micro_batch=true` the count fell from 139 to 82; it is 65 in
  this report (2026-11-26). A chunked loss is not in the engine; the time model is unaffected."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, help="at most this many rows per source")
    ap.add_argument("--output", type=Path, default=OUTPUT)
    args = ap.parse_args(argv)
    loaded = load_rows(args.limit)
    devices = {}
    for row, device, gpus in loaded:
        predict(row, device, gpus)
        devices[id(row)] = device
    rows = [r for r, _, _ in loaded]
    summary = summarize(rows)
    write_report(rows, summary, args.output, devices)
    if args.output == OUTPUT and not args.limit:  # the full run writes what `stx plan` reads
        write_expected_error(rows, devices)
    print(
        f"{summary['predicted']}/{summary['rows']} rows: median |error| {summary['median_abs_error']:.1%}, "
        f"within 25% {summary['within_25']:.0%}, Spearman median {summary['spearman_median']:.2f}; "
        f"wrote {args.output}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
