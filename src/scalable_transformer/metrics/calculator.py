"""`stx flops`: TFLOPs per device, MFU and HFU of a measured throughput, under every convention.

The model comes from a config (`--config PRESET_OR_PATH`) or an explicit shape; the throughput is
samples/s, tokens/s, or an iteration time with its global batch; the peak comes from the device
table, a measured CPU peak (`--device cpu`) or `--peak-tflops`. Without a peak only TFLOPs are shown.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from typing import Any

from .flops import CONVENTIONS, RECOMPUTE_MODES, ModelShape, flops_per_iteration, throughput_metrics
from .hardware import DTYPES, PEAK_TFLOPS, normalize_dtype, resolve_peak

_SHAPE_FLAGS = ("num_layers", "hidden_size", "seq_length", "vocab_size", "ffn_hidden_size")


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


def estimate_num_params(
    num_layers: int,
    hidden_size: int,
    seq_length: int,
    vocab_size: int,
    ffn_hidden_size: int | None = None,
    gated_mlp: bool = False,
) -> int:
    """Parameter count of a Megatron-style transformer with biases, two norms per layer, a tied word
    embedding and a learned position table of seq_length rows: 12*L*h^2 + 13*L*h + V*h + s*h + 2h
    for F = 4h. An estimate: model heads (BERT's LM transform, pooler) are not included."""
    h = hidden_size
    f = ffn_hidden_size if ffn_hidden_size is not None else 4 * h
    up = 2 * f if gated_mlp else f
    block = (4 * h * h + 4 * h) + (h * up + up) + (f * h + h) + 4 * h
    return num_layers * block + vocab_size * h + seq_length * h + 2 * h


def _resolve_config(spec: str, overrides: list[str], devices: int) -> tuple[Any, int | None]:
    """(resolved config, global batch per step or None if the config cannot tell for `devices`)."""
    from scalable_transformer.config.load import load_config

    try:
        from scalable_transformer.config.validate import resolve
    except ImportError:  # older layout: resolve lived next to load_config
        from scalable_transformer.config.load import resolve  # type: ignore[attr-defined,no-redef]
    raw = load_config(spec, overrides)
    try:
        cfg = resolve(raw, world_size=devices)
        return cfg, cfg.train.global_batch_size
    except ValueError:
        if devices == 1:
            raise
    # The config may not (yet) accept this many processes; the model shape does not depend on it, but
    # a derived global batch would be the one of a single process, so only an explicit one is kept.
    return resolve(raw, world_size=1), raw.train.global_batch_size


def calculate(args: argparse.Namespace) -> dict[str, Any]:
    """The numbers `stx flops` prints, as a JSON-ready dict. Raises ValueError on bad input."""
    given_shape = [name for name in _SHAPE_FLAGS if getattr(args, name, None) is not None]
    devices = args.devices if args.devices is not None else 1
    if devices < 1:
        raise ValueError(f"--devices must be >= 1, got {devices}")
    cfg, config_batch = None, None
    if args.config is not None:
        if given_shape:
            raise ValueError(
                f"--config and explicit shape flags ({', '.join(given_shape)}) are exclusive; "
                "change the config with --override model.KEY=VALUE"
            )
        cfg, config_batch = _resolve_config(args.config, list(args.override), devices)
        if args.params is not None:
            n, n_source = args.params, "given (--params)"
        else:
            from scalable_transformer.models import count_parameters

            n, n_source = count_parameters(cfg.model), f"counted from the model of {args.config}"
        shape = ModelShape.from_config(cfg.model, n, tp=cfg.parallel.tp)
    else:
        missing = [f"--{name.replace('_', '-')}" for name in _SHAPE_FLAGS[:4] if getattr(args, name) is None]
        if missing:
            raise ValueError(f"give --config, or an explicit shape: missing {', '.join(missing)}")
        if args.override:
            raise ValueError("--override needs --config")
        from scalable_transformer.models import padded_vocab_size

        vocab = padded_vocab_size(args.vocab_size, args.make_vocab_size_divisible_by)
        if args.params is not None:
            n, n_source = args.params, "given (--params)"
        else:
            n = estimate_num_params(
                args.num_layers, args.hidden_size, args.seq_length, vocab, args.ffn_hidden_size
            )
            n_source = "estimated: 12*L*h^2 + 13*L*h + V*h + s*h (pass --params for the exact count)"
        shape = ModelShape(args.num_layers, args.hidden_size, args.seq_length, vocab, n, args.ffn_hidden_size)

    recompute = args.activation_checkpointing or (cfg.parallel.activation_checkpointing if cfg else "none")
    dtype = normalize_dtype(args.dtype or (cfg.train.precision if cfg else "bf16"))
    global_batch = args.global_batch_size or (config_batch if cfg else None)
    if global_batch is not None and global_batch < 1:
        raise ValueError(f"--global-batch-size must be >= 1, got {global_batch}")

    if args.iteration_time is not None:
        if not args.iteration_time > 0:
            raise ValueError(f"--iteration-time must be > 0 seconds, got {args.iteration_time}")
        if global_batch is None:
            raise ValueError("--iteration-time needs --global-batch-size (or a config that sets it)")
        samples_per_second = global_batch / args.iteration_time
    elif args.tokens_per_second is not None:
        samples_per_second = args.tokens_per_second / shape.seq_length
    else:
        samples_per_second = args.samples_per_second
    if not samples_per_second > 0:
        raise ValueError(f"throughput must be > 0, got {samples_per_second} samples/s")
    iteration_seconds = global_batch / samples_per_second if global_batch is not None else None

    device = args.device or (cfg.logging.device_name if cfg else None)
    override = (
        args.peak_tflops if args.peak_tflops is not None else (cfg.logging.peak_tflops if cfg else None)
    )
    peak = None
    if device is not None or override is not None:
        device_type = "cpu" if (device or "").lower() == "cpu" else "cuda"
        peak = resolve_peak(device_type, dtype, None if device_type == "cpu" else device, override)

    # FLOPs are linear in samples, so one second of work at the measured rate gives the same rates
    # as one step of the global batch; per-step FLOPs are reported only when the batch is known.
    conventions = CONVENTIONS if args.convention == "all" else (args.convention,)
    rows, notes = [], []
    for convention in conventions:
        per_second = flops_per_iteration(shape, samples_per_second, convention, recompute)
        per_sample = flops_per_iteration(shape, 1, convention, recompute)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            metrics = throughput_metrics(
                per_second, 1.0, devices, peak.flops_per_second if peak else None, allow_over_100=True
            )
        notes += [str(w.message) for w in caught]
        rows.append(
            {
                **metrics,
                "model_flops_per_sample": per_sample.model_flops,
                "hardware_flops_per_sample": per_sample.hardware_flops,
                "model_flops_per_iteration": per_sample.model_flops * global_batch if global_batch else None,
                "hardware_flops_per_iteration": per_sample.hardware_flops * global_batch
                if global_batch
                else None,
            }
        )
    return {
        "shape": shape.to_dict(),
        "num_params_source": n_source,
        "samples_per_second": samples_per_second,
        "tokens_per_second": samples_per_second * shape.seq_length,
        "global_batch_size": global_batch,
        "iteration_seconds": iteration_seconds,
        "devices": devices,
        "dtype": dtype,
        "activation_checkpointing": recompute,
        "peak": None
        if peak is None
        else {"tflops_per_device": peak.flops_per_second / 1e12, "source": peak.source},
        "results": rows,
        "warnings": notes,
    }


def _render(result: dict[str, Any]) -> None:
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
        result = calculate(args)
    except (ValueError, ImportError) as error:
        print(f"stx flops: error: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _render(result)
    return 0
