"""`stx flops`: TFLOPs per device, MFU and HFU of a measured throughput (metrics/calculator.py)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from ..metrics.calculator import FlopsOptions, calculate


def flops_options(args: argparse.Namespace) -> FlopsOptions:
    """The calculator's options from the parsed `stx flops` arguments (every field has a flag)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(FlopsOptions)}
    values["override"] = tuple(values["override"])
    return FlopsOptions(**values)


def print_flops(result: dict[str, Any]) -> None:
    console = Console()
    shape, peak = result["shape"], result["peak"]
    console.print(
        f"model: L={shape['num_layers']} h={shape['hidden_size']} s={shape['seq_length']} "
        f"V={shape['vocab_size']} (padded) F={shape['ffn_hidden_size']} N={shape['num_params']:,} "
        f"[dim]({result['num_params_source']})[/dim]"
    )
    if "active_params" in shape:  # mixture of experts: what a token runs through (docs/METRICS.md)
        console.print(
            f"experts: {shape['moe_layers']} MoE layers of {shape['num_experts']} experts "
            f"(F={shape['moe_ffn_hidden_size']}), top-{shape['moe_topk']}, "
            f"shared F={shape['shared_expert_size']}; active N={shape['active_params']:,} per token"
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
    # The convention's whole name, however narrow the terminal: a figure without it means nothing.
    name_width = max(len(row["convention"]) for row in result["results"])
    table.add_column("convention", justify="left", no_wrap=True, min_width=name_width)
    for column in ("model\nTFLOP/s", "HW\nTFLOP/s", "MFU", "HFU", "model GFLOP\nper sample"):
        table.add_column(column, justify="right", overflow="fold")  # narrow terminals fold digits, never cut

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
