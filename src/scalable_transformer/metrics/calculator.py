"""`stx flops`: TFLOPs per device, MFU and HFU of a measured throughput, under every convention.

The model comes from a config (`--config PRESET_OR_PATH`) or an explicit shape; the throughput is
samples/s, tokens/s, or an iteration time with its global batch; the peak comes from the device
table, a measured CPU peak (`--device cpu`) or `--peak-tflops`. Without a peak only TFLOPs are shown.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from ..config.load import load_config
from ..config.model_shapes import ModelShape, sized_model, total_params
from ..config.schema import Config
from ..config.validate import resolve
from .device_specs import resolve_peak
from .device_table import normalize_dtype
from .flops import CONVENTIONS, convention_notes, flops_per_iteration, throughput_metrics

_SHAPE_FLAGS = ("num_layers", "hidden_size", "seq_length", "vocab_size", "ffn_hidden_size")


@dataclasses.dataclass(frozen=True)
class FlopsOptions:
    """The inputs of `calculate`: a model (config + overrides, or an explicit shape), one measured
    throughput (samples/s, tokens/s, or seconds per optimizer step with its global batch) and the
    hardware (device count, device name or measured CPU, dtype, or an explicit peak in TFLOP/s)."""

    config: str | None = None  # preset name or config path
    override: tuple[str, ...] = ()  # key=value config overrides (need config)
    num_layers: int | None = None
    hidden_size: int | None = None
    seq_length: int | None = None  # tokens per sample
    vocab_size: int | None = None  # before padding
    make_vocab_size_divisible_by: int = 128
    ffn_hidden_size: int | None = None  # default 4 * hidden_size
    params: int | None = None  # parameter count; default counted (config) or estimated (shape)
    samples_per_second: float | None = None  # global
    tokens_per_second: float | None = None  # global
    iteration_time: float | None = None  # seconds per optimizer step
    global_batch_size: int | None = None  # samples per optimizer step
    devices: int | None = None  # devices that shared the work (default 1)
    device: str | None = None  # peak table entry, or "cpu" to measure this CPU
    dtype: str | None = None  # default: the config's precision, else bf16
    peak_tflops: float | None = None  # dense peak TFLOP/s per device (overrides device)
    activation_checkpointing: str | None = None  # default: the config's, else none
    convention: str = "all"  # one of CONVENTIONS, or "all"


def _resolve_config(spec: str, overrides: list[str], devices: int) -> tuple[Any, int | None]:
    """(resolved config, global batch per step or None if the config cannot tell for `devices`)."""
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


def _model_from_config(
    opts: FlopsOptions, spec: str, devices: int
) -> tuple[Config, int | None, ModelShape, str]:
    """(the config `spec` resolved, its global batch or None, the model's shape, where its parameter
    count came from)."""
    cfg, config_batch = _resolve_config(spec, list(opts.override), devices)
    if opts.params is not None:
        n, n_source = opts.params, "given (--params)"
    else:
        n, n_source = total_params(cfg.model), f"counted from the model of {spec}"
    return cfg, config_batch, ModelShape.from_config(cfg.model, n, tp=cfg.parallel.tp), n_source


def _model_from_shape(opts: FlopsOptions) -> tuple[ModelShape, str]:
    """(the shape the flags give, where its parameter count came from); the flags are checked here."""
    layers, hidden, seq, raw_vocab = opts.num_layers, opts.hidden_size, opts.seq_length, opts.vocab_size
    if layers is None or hidden is None or seq is None or raw_vocab is None:
        missing = [f"--{name.replace('_', '-')}" for name in _SHAPE_FLAGS[:4] if getattr(opts, name) is None]
        raise ValueError(f"give --config, or an explicit shape: missing {', '.join(missing)}")
    if opts.override:
        raise ValueError("--override needs --config")
    # checked here, with the option names users typed (ModelShape's own check names its fields)
    for name in (*_SHAPE_FLAGS[:4], "ffn_hidden_size", "params", "make_vocab_size_divisible_by"):
        value = getattr(opts, name, None)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value}")
    divisible_by = opts.make_vocab_size_divisible_by
    model = sized_model(layers, hidden, seq, raw_vocab, opts.ffn_hidden_size, divisible_by)
    if opts.params is not None:
        n, n_source = opts.params, "given (--params)"
    else:
        n = total_params(model)
        n_source = "estimated: 12*L*h^2 + 13*L*h + V*h + s*h (pass --params for the exact count)"
    return ModelShape.from_config(model, n), n_source


def _samples_per_second(opts: FlopsOptions, global_batch: int | None, seq_length: int) -> float:
    """The one throughput given, as samples per second."""
    if opts.iteration_time is not None:
        if not opts.iteration_time > 0:
            raise ValueError(f"--iteration-time must be > 0 seconds, got {opts.iteration_time}")
        if global_batch is None:
            raise ValueError("--iteration-time needs --global-batch-size (or a config that sets it)")
        samples_per_second = global_batch / opts.iteration_time
    elif opts.tokens_per_second is not None:
        samples_per_second = opts.tokens_per_second / seq_length
    elif opts.samples_per_second is not None:
        samples_per_second = opts.samples_per_second
    else:
        raise ValueError("give one throughput: --samples-per-second, --tokens-per-second or --iteration-time")
    if not samples_per_second > 0:
        raise ValueError(f"throughput must be > 0, got {samples_per_second} samples/s")
    return samples_per_second


def _convention_rows(
    opts: FlopsOptions,
    shape: ModelShape,
    samples_per_second: float,
    recompute: str,
    devices: int,
    peak_flops: float | None,
    global_batch: int | None,
) -> tuple[list[dict[str, Any]], list[str]]:
    """One row per FLOPs convention asked for, and the warnings the rates raised (e.g. MFU over 100%)."""
    # FLOPs are linear in samples, so one second of work at the measured rate gives the same rates
    # as one step of the global batch; per-step FLOPs are reported only when the batch is known.
    conventions = CONVENTIONS if opts.convention == "all" else (opts.convention,)
    rows, notes = [], []
    for convention in conventions:
        per_second = flops_per_iteration(shape, samples_per_second, convention, recompute)
        per_sample = flops_per_iteration(shape, 1, convention, recompute)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            metrics = throughput_metrics(per_second, 1.0, devices, peak_flops, allow_over_100=True)
        notes += [str(w.message) for w in caught] + convention_notes(shape, convention)
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
    return rows, notes


def calculate(opts: FlopsOptions) -> dict[str, Any]:
    """The numbers `stx flops` prints, as a JSON-ready dict. Raises ValueError on bad input."""
    given_shape = [name for name in _SHAPE_FLAGS if getattr(opts, name) is not None]
    devices = opts.devices if opts.devices is not None else 1
    if devices < 1:
        raise ValueError(f"--devices must be >= 1, got {devices}")
    cfg, config_batch = None, None
    if opts.config is not None:
        if given_shape:
            raise ValueError(
                f"--config and explicit shape flags ({', '.join(given_shape)}) are exclusive; "
                "change the config with --override model.KEY=VALUE"
            )
        cfg, config_batch, shape, n_source = _model_from_config(opts, opts.config, devices)
    else:
        shape, n_source = _model_from_shape(opts)

    recompute = opts.activation_checkpointing or (cfg.parallel.activation_checkpointing if cfg else "none")
    dtype = normalize_dtype(opts.dtype or (cfg.train.precision if cfg else "bf16"))
    global_batch = opts.global_batch_size or (config_batch if cfg else None)
    if global_batch is not None and global_batch < 1:
        raise ValueError(f"--global-batch-size must be >= 1, got {global_batch}")
    samples_per_second = _samples_per_second(opts, global_batch, shape.seq_length)
    iteration_seconds = global_batch / samples_per_second if global_batch is not None else None

    device = opts.device or (cfg.logging.device_name if cfg else None)
    override = (
        opts.peak_tflops if opts.peak_tflops is not None else (cfg.logging.peak_tflops if cfg else None)
    )
    peak = None
    if device is not None or override is not None:
        device_type = "cpu" if (device or "").lower() == "cpu" else "cuda"
        peak = resolve_peak(device_type, dtype, None if device_type == "cpu" else device, override)
    peak_flops = peak.flops_per_second if peak else None
    rows, notes = _convention_rows(
        opts, shape, samples_per_second, recompute, devices, peak_flops, global_batch
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
