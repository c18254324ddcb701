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
        "llm-foundry", r["table"], r["model"], label, args, "tokens/s/GPU", float(r["tokens_per_s_per_gpu"])
    )


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
    "megatron_korthikanti2022_table5.csv": _korthikanti,
    "megatron_narayanan2021_table1.csv": _narayanan,
    "megatron_core_h100_2024.csv": _megatron_core,
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
                out.append((row, device, int(r["n_gpus"])))
                if limit and sum(1 for o in out if o[0].source == row.source) >= limit:
                    break
    return out


def predict(row: Row, device: str, gpus: int) -> None:
    from scalable_transformer.cli import main

    nodes, per_node = (gpus // 8, 8) if gpus >= 8 else (1, gpus)
    argv = ["plan", *row.args, "--device", device, "--nodes", str(nodes), "--gpus-per-node", str(per_node)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main([*argv, "--no-probe", "--json"])
    if code != 0:
        row.note = (row.note + "; " if row.note else "") + f"stx plan exit {code}"
        return
    layout = json.loads(out.getvalue())["layouts"][0]
    seconds = layout["step_seconds"]
    if row.metric == "tokens/s/GPU":
        row.predicted = layout["tokens_per_second"] / gpus
    elif row.metric == "1/iteration s":
        row.predicted = 1 / seconds
        row.note += f"; {seconds:.2f} s predicted"
    elif row.metric == "TFLOP/s/GPU (model)":
        row.predicted = layout["tflops_per_device"]
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
    lines += ["", MISSES]
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


MISSES = """## Where the model still misses and why

The model is calibrated on kernel data only (benchmarks/data/gpu_kernels: public kernel benchmarks and
`stx calibrate` on one H100 and one H200); no constant was tuned on these tables. Each llm-foundry row
is planned with the attention kernel its run took (`--attention-kernel`, from the publisher's scripts:
`triton` for the A100 and H100 tables, `flash` or `triton` per model in the large-scale table); every
other row with SDPA's flash kernel. It is close on Megatron's tables (A100: median -1% to -3%; H100:
-14%) and on llm-foundry's up to seq 8192 (A100 -6% to +1%, H100 -5% to +7%); the large-scale H100
rows are +17.5% (median), torchtitan's +49%.

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
- **Communication overlapped with compute is free in the model**: FSDP's all-gathers and
  reduce-scatters hide behind compute, but NCCL kernels take SMs and HBM bandwidth from the GEMMs they
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
  published 1058 -> 1007 tokens/s/GPU), the model hides the extra inter-node time behind compute. It
  predicts a flat line, so the rank correlation of a 5% spread is meaningless (-1.00).
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
    print(
        f"{summary['predicted']}/{summary['rows']} rows: median |error| {summary['median_abs_error']:.1%}, "
        f"within 25% {summary['within_25']:.0%}, Spearman median {summary['spearman_median']:.2f}; "
        f"wrote {args.output}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
