"""`stx flops`: TFLOPs per device, MFU and HFU of a measured throughput (metrics/calculator.py)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from ..metrics.calculator import FlopsOptions, calculate
from ..metrics.device_specs import DTYPES, PEAK_TFLOPS
from ..metrics.flops import CONVENTIONS, RECOMPUTE_MODES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the `stx flops` options on parser."""
    model = parser.add_argument_group("model (a config, or an explicit shape)")
    model.add_argument(
        "--config", metavar="PATH_OR_PRESET", help="config YAML or preset name (e.g. bert-345m)"
    )
    model.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override, repeatable (e.g. model.seq_length=1024)",
    )
    model.add_argument("--num-layers", type=int)
    model.add_argument("--hidden-size", type=int)
    model.add_argument("--seq-length", type=int, help="tokens per sample")
    model.add_argument("--vocab-size", type=int, help="vocabulary before padding")
    model.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="pad the explicit --vocab-size to a multiple of this, as Megatron does (default 128)",
    )
    model.add_argument("--ffn-hidden-size", type=int, help="MLP inner size (default 4 * hidden size)")
    model.add_argument(
        "--params",
        type=int,
        metavar="N",
        help="parameter count N; overrides the counted (config) or estimated (shape) count",
    )

    speed = parser.add_argument_group("measured throughput (one of)")
    rate = speed.add_mutually_exclusive_group(required=True)
    rate.add_argument("--samples-per-second", type=float, help="global samples (sequences) per second")
    rate.add_argument("--tokens-per-second", type=float, help="global tokens per second")
    rate.add_argument(
        "--iteration-time",
        type=float,
        metavar="SECONDS",
        help="seconds per optimizer step (needs --global-batch-size or a config)",
    )
    speed.add_argument("--global-batch-size", type=int, help="samples per optimizer step")

    hw = parser.add_argument_group("hardware")
    hw.add_argument("--devices", type=int, help="devices that shared the work (default 1)")
    hw.add_argument(
        "--device",
        metavar="NAME",
        help=f"peak table entry ({', '.join(PEAK_TFLOPS)}) or 'cpu' to measure this CPU",
    )
    hw.add_argument(
        "--dtype",
        help=f"compute dtype of the matmuls: {', '.join(DTYPES)} "
        "(default: the config's precision, else bf16)",
    )
    hw.add_argument("--peak-tflops", type=float, help="dense peak TFLOP/s per device (overrides --device)")
    parser.add_argument(
        "--activation-checkpointing",
        choices=RECOMPUTE_MODES,
        help="recompute mode, counts towards HFU (default: the config's, else none)",
    )
    parser.add_argument(
        "--convention",
        choices=(*CONVENTIONS, "all"),
        default="all",
        help="FLOPs convention (default all: one row each)",
    )
    parser.add_argument("--json", action="store_true", help="print a machine-readable dict")


def flops_options(args: argparse.Namespace) -> FlopsOptions:
    """The calculator's options from the parsed `stx flops` arguments (every field has a flag)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(FlopsOptions)}
    values["override"] = tuple(values["override"])
    return FlopsOptions(**values)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("flops", help="TFLOPs/device, MFU and HFU from a model shape and a throughput")
    add_arguments(p)
    p.set_defaults(fn=run)


def print_flops(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    shape, peak = result["shape"], result["peak"]
    console.print(
        f"model: L={shape['num_layers']} h={shape['hidden_size']} s={shape['seq_length']} "
        f"V={shape['vocab_size']} (padded) F={shape['ffn_hidden_size']} N={shape['num_params']:,} "
        f"[dim]({result['num_params_source']})[/dim]"
    )
    step = (
        f", {result['global_batch_size']} samples/step = {result['iteration_seconds']:.4g} s/step"
        if result["global_batch_size"]
        else ""
    )
    console.print(
        f"throughput: {result['samples_per_second']:.4g} samples/s, "
        f"{result['tokens_per_second']:.4g} tokens/s{step}, on {result['devices']} device(s)"
    )
    console.print(f"activation checkpointing: {result['activation_checkpointing']} (counts towards HFU only)")
    if peak is None:
        console.print("peak: none given (--device NAME, --device cpu or --peak-tflops) -> no MFU/HFU")
    else:
        console.print(
            f"peak: {peak['tflops_per_device']:.4g} TFLOP/s per device, {result['dtype']} "
            f"[dim]({peak['source']})[/dim]"
        )
    table = Table(title="TFLOP/s per device (dense peak)")
    for column in ("convention", "model TFLOP/s/dev", "HW TFLOP/s/dev", "MFU", "HFU", "model GFLOP/sample"):
        table.add_column(column, justify="left" if column == "convention" else "right")

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:.1%}"

    for row in result["results"]:
        table.add_row(
            row["convention"],
            f"{row['tflops_per_device']:.2f}",
            f"{row['hw_tflops_per_device']:.2f}",
            pct(row["mfu"]),
            pct(row["hfu"]),
            f"{row['model_flops_per_sample'] / 1e9:,.1f}",
        )
    console.print(table)
    for note in result["warnings"]:
        console.print(f"[bold red]warning:[/bold red] {note}")


def run(args: argparse.Namespace) -> int:
    """Entry point of `stx flops`; returns the process exit code."""
    try:
        result = calculate(flops_options(args))
    except (ValueError, ImportError) as error:
        print(f"stx flops: error: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_flops(result)
    return 0
