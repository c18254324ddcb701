"""`stx report import-log`: Megatron-LM and DeepSpeed training logs into the results store.

Megatron-LM (training.py `training_log`) prints, every log interval,
    iteration      100/  500000 | consumed samples:  800 | elapsed time per iteration (ms): 512.3 | ...
with optional `samples per second:`, `TFLOPs:` (Megatron-DeepSpeed) or `throughput per GPU
(TFLOP/s/GPU):` (Megatron-LM core) fields, then its timers as
    time (ms) | forward-compute: 43.42 | backward-compute: 90.74 | ...
and, at the start, the argument dump (`  world_size ........ 8`), read for the layout.

DeepSpeed prints `SamplesPerSec=` / `RunningAvgSamplesPerSec=` / `CurrSamplesPerSec=` (engine and
ThroughputTimer), `MaxMemAllocated=1.2GB`, and the FLOPs profiler's "Profile Summary" block
(`world size:`, `batch size per GPU:`, `params per GPU:`, `iter latency:`, `FLOPS per GPU = ...:`,
`samples/second:`).

The first logged interval of a run is warm-up and is excluded from the medians, as for our runs.
"""

from __future__ import annotations

import hashlib
import json
import re
import statistics
from pathlib import Path
from typing import Any

from ..config.model_shapes import ModelShape, sized_model
from ..errors import LogFormatError
from ..metrics.flops import flops_per_iteration
from .results import ResultsStore

_ARG_RE = re.compile(r"^\s+([a-z_0-9]+) \.{3,} (.*)$")
_NUM = r"([-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)"
_UNITS = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}


# Megatron-LM's timer names before its distributed-optimizer rework -> the current ones, which our runs
# log too (train/trainer.py), so old logs and new runs share one column per phase
MEGATRON_TIMER_NAMES = {
    "backward-params-all-reduce": "all-grads-sync",
    "backward-embedding-all-reduce": "embedding-grads-all-reduce",
}


def _float(text: str) -> float | None:
    m = re.search(_NUM, text)
    return float(m.group(1)) if m else None


def _scaled(text: str) -> float | None:
    """'336.23 M' -> 336230000.0; '81.9 TFLOPS' -> 8.19e13; '76.67 ms' -> 0.07667 (seconds)."""
    m = re.search(_NUM + r"\s*([KMGTP]?)(ms|us|s)?", text.strip())
    if not m:
        return None
    value = float(m.group(1)) * _UNITS[m.group(2)]
    if m.group(3) == "ms":
        value /= 1e3
    elif m.group(3) == "us":
        value /= 1e6
    return value


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _post_warmup(values: list) -> list:
    return values[1:] if len(values) > 1 else values


def _iteration_fields(line: str) -> dict[str, float]:
    """The figures of a Megatron iteration line (' iteration N/ M | key: value | ...'), keys lower-cased."""
    fields: dict[str, float] = {}
    head, *rest = line.split("|")
    m = re.search(r"iteration\s+(\d+)\s*/\s*(\d+)", head)
    assert m is not None
    fields["iteration"], fields["train_iters"] = float(m.group(1)), float(m.group(2))
    for part in rest:
        if ":" not in part:
            continue
        key, _, value = part.rpartition(":")
        number = _float(value)
        if number is not None:
            fields[key.strip().lower()] = number
    return fields


def _timer_fields(line: str) -> dict[str, float]:
    """The timers of a Megatron 'time (ms) | forward-compute: ... | ...' line, by Megatron's names."""
    timer = {}
    for part in line.split("|")[1:]:
        if ":" in part:
            key, _, value = part.partition(":")
            number = _float(value)
            if number is not None:
                timer[key.strip()] = number
    return timer


def _megatron_lines(text: str) -> tuple[dict[str, str], list[dict[str, float]], list[dict[str, float]]]:
    """The arguments Megatron printed, its iteration lines and its timer lines, in log order."""
    args: dict[str, str] = {}
    iterations: list[dict[str, float]] = []
    timers: list[dict[str, float]] = []
    for line in text.splitlines():
        m = _ARG_RE.match(line)
        if m:
            args[m.group(1)] = m.group(2).strip()
            continue
        stripped = line.strip()
        if re.match(r"^(\[.*?\]\s*)?iteration\s+\d+\s*/\s*\d+\s*\|", stripped):
            iterations.append(_iteration_fields(stripped))
        elif stripped.startswith("time (ms)"):
            timers.append(_timer_fields(stripped))
    return args, iterations, timers


def _megatron_phases(timers: list[dict[str, float]]) -> tuple[dict[str, float], dict[str, str]]:
    """Median post-warm-up time (ms) of each timer under our phase names, and the names mapped."""
    phases: dict[str, float] = {}
    timer_window = _post_warmup(timers)
    for key in dict.fromkeys(k for t in timer_window for k in t):
        name = MEGATRON_TIMER_NAMES.get(key, key)
        phases[name] = statistics.median(t[key] for t in timer_window if key in t)
    renamed = {old: new for old, new in MEGATRON_TIMER_NAMES.items() if any(old in t for t in timer_window)}
    return phases, renamed


def parse_megatron(text: str) -> dict[str, Any]:
    """Summary of a Megatron-LM log: median post-warm-up figures, timers, the parsed arguments."""
    args, iterations, timers = _megatron_lines(text)
    if not iterations and not timers:
        raise LogFormatError(
            "no Megatron-LM lines found (' iteration N/ M | ... elapsed time per iteration (ms): ...' "
            "or 'time (ms) | forward-compute: ...')"
        )

    def arg_int(name: str) -> int | None:
        value = args.get(name)
        return int(value) if value is not None and value.isdigit() else None

    window = _post_warmup(iterations)
    elapsed = _median(
        [it["elapsed time per iteration (ms)"] for it in window if "elapsed time per iteration (ms)" in it]
    )
    gbs = _median([it["global batch size"] for it in window if "global batch size" in it])
    gbs = gbs or arg_int("global_batch_size")
    sps = _median([it["samples per second"] for it in window if "samples per second" in it])
    if sps is None and elapsed and gbs:
        sps = gbs / (elapsed / 1e3)
    tflops = _median(
        [it[k] for it in window for k in ("tflops", "throughput per gpu (tflop/s/gpu)") if k in it]
    )
    seq = arg_int("seq_length") or arg_int("encoder_seq_length")
    # " > padded vocab (size: 28996) with 124 dummy tokens (new size: 29120)", or the argument
    padded = re.search(r"padded vocab \(size: \d+\) with \d+ dummy tokens \(new size: (\d+)\)", text)
    vocab = int(padded.group(1)) if padded else arg_int("padded_vocab_size")
    phases, renamed = _megatron_phases(timers)
    world = arg_int("world_size")
    return {
        "source": "megatron",
        "iterations": len(iterations),
        "warmup_iterations_excluded": 1 if len(iterations) > 1 else 0,
        "median_iteration_seconds": None if elapsed is None else elapsed / 1e3,
        "samples_per_second": sps,
        "tokens_per_second": None if sps is None or seq is None else sps * seq,
        "tflops_per_device": tflops,
        "flops_convention": "megatron (as logged)" if tflops is not None else None,
        "global_batch_size": None if gbs is None else int(gbs),
        "micro_batch_size": arg_int("micro_batch_size"),
        "seq_length": seq,
        "world_size": world,
        "tp": arg_int("tensor_model_parallel_size"),
        "pp": arg_int("pipeline_model_parallel_size"),
        "dp": arg_int("data_parallel_size"),
        "precision": "fp16" if args.get("fp16") == "True" else "bf16" if args.get("bf16") == "True" else None,
        "activation_checkpointing": "full"
        if args.get("checkpoint_activations") == "True" or args.get("recompute_granularity") == "full"
        else args.get("recompute_granularity") or ("none" if args else None),
        "num_layers": arg_int("num_layers"),
        "hidden_size": arg_int("hidden_size"),
        "ffn_hidden_size": arg_int("ffn_hidden_size"),
        "padded_vocab_size": vocab,
        # Megatron-DeepSpeed's "TFLOPs" counts recomputation (factor 4 with checkpointing): hardware
        # FLOPs; Megatron-LM core's "throughput per GPU" counts model FLOPs only.
        "tflops_kind": None
        if tflops is None
        else "model"
        if any("throughput per gpu (tflop/s/gpu)" in it for it in window)
        else "hardware",
        "phase_time_ms_median": phases,
        "phase_names_mapped": renamed,
    }


_DS_SPS = re.compile(r"(?<![A-Za-z])(RunningAvgSamplesPerSec|CurrSamplesPerSec|SamplesPerSec)=\s*" + _NUM)
_DS_MEM = re.compile(r"MaxMemAllocated=\s*" + _NUM + r"\s*([KMGT]?)B")
_DS_PROFILE_KEYS = {
    "world size": "world_size",
    "data parallel size": "dp",
    "model parallel size": "tp",
    "batch size per gpu": "micro_batch_size",
    "params per gpu": "params_per_gpu",
    "params of model = params per gpu * mp_size": "num_parameters",
    "fwd flops per gpu": "fwd_flops_per_gpu",
    "fwd latency": "fwd_latency_seconds",
    "bwd latency": "bwd_latency_seconds",
    "step latency": "step_latency_seconds",
    "iter latency": "iter_latency_seconds",
    "flops per gpu = 3 * fwd flops per gpu / iter latency": "flops_per_gpu",
    "samples/second": "profiler_samples_per_second",
}


def parse_deepspeed(text: str) -> dict[str, Any]:
    """Summary of a DeepSpeed log: median post-warm-up SamplesPerSec, max memory, FLOPs profiler."""
    samples: dict[str, list[float]] = {}
    mem: list[float] = []
    profile: dict[str, float] = {}
    in_profile = False
    for line in text.splitlines():
        for m in _DS_SPS.finditer(line):
            samples.setdefault(m.group(1), []).append(float(m.group(2)))
        mm = _DS_MEM.search(line)
        if mm:
            m = mm
            mem.append(
                float(m.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[m.group(2)]
            )
        if "DeepSpeed Flops Profiler" in line:
            in_profile = True
            continue
        if in_profile and ":" in line:
            key, _, value = line.rpartition(":")
            name = _DS_PROFILE_KEYS.get(re.sub(r"\s+", " ", key.strip().lower()))
            if name:
                number = _scaled(value)
                if number is not None:
                    profile[name] = number
        if in_profile and line.startswith("------") and "Profiler" not in line and profile:
            in_profile = False
    if not samples and not profile:
        raise LogFormatError(
            "no DeepSpeed lines found ('SamplesPerSec=...' / 'RunningAvgSamplesPerSec=...' or the "
            "'DeepSpeed Flops Profiler' summary)"
        )
    # The instantaneous figure over the window is the comparable one; the running average includes warm-up.
    for key in ("CurrSamplesPerSec", "SamplesPerSec", "RunningAvgSamplesPerSec"):
        if key in samples:
            sps = _median(_post_warmup(samples[key]))
            break
    else:
        sps = profile.get("profiler_samples_per_second")
    tflops = profile.get("flops_per_gpu")
    world = profile.get("world_size")
    phases = {
        name: profile[key] * 1e3
        for name, key in (
            ("forward", "fwd_latency_seconds"),
            ("backward", "bwd_latency_seconds"),
            ("optimizer", "step_latency_seconds"),
        )
        if key in profile
    }
    return {
        "source": "deepspeed",
        "iterations": max((len(v) for v in samples.values()), default=0),
        "samples_per_second": sps,
        "tflops_per_device": None if tflops is None else tflops / 1e12,
        "flops_convention": "deepspeed flops profiler (3 x measured forward)" if tflops is not None else None,
        "num_parameters": None if "num_parameters" not in profile else int(profile["num_parameters"]),
        "micro_batch_size": None if "micro_batch_size" not in profile else int(profile["micro_batch_size"]),
        "world_size": None if world is None else int(world),
        "dp": None if "dp" not in profile else int(profile["dp"]),
        "tp": None if "tp" not in profile else int(profile["tp"]),
        "median_iteration_seconds": profile.get("iter_latency_seconds"),
        "peak_memory_bytes_per_rank": [max(mem)] if mem else [],
        "phase_time_ms_median": phases,
    }


PARSERS = {"megatron": parse_megatron, "deepspeed": parse_deepspeed}

MISMATCH_TOLERANCE = 0.10  # a logged TFLOPs more than 10% off the recomputed one is flagged


def cross_check_tflops(summary: dict[str, Any], world: int | None) -> dict[str, Any]:
    """Recompute TFLOP/s per device from the log's samples/s with the convention the log names
    (Megatron logs: `megatron`, hardware FLOPs for Megatron-DeepSpeed's "TFLOPs", model FLOPs for
    Megatron-LM's "throughput per GPU") and compare with the logged figure.

    Returns {"recomputed": TFLOP/s per device or None, "mismatch": True/False/None, "note": str};
    None when the log lacks something the formula needs (named in the note). DeepSpeed's FLOPs
    profiler figure is a measurement (3 x the profiled forward), not a formula, so it is not checked.
    """
    logged, sps = summary.get("tflops_per_device"), summary.get("samples_per_second")
    if logged is None or sps is None:
        return {
            "recomputed": None,
            "mismatch": None,
            "note": "not checked: the log has not both samples/s and TFLOPs",
        }
    if summary.get("source") != "megatron":
        return {
            "recomputed": None,
            "mismatch": None,
            "note": "not checked: the DeepSpeed FLOPs profiler measures FLOPs, it names no formula",
        }
    need = {
        "num_layers": summary.get("num_layers"),
        "hidden_size": summary.get("hidden_size"),
        "seq_length": summary.get("seq_length"),
        "padded vocabulary": summary.get("padded_vocab_size"),
        "world size": world,
    }
    missing = [name for name, value in need.items() if not value]
    if missing or world is None:
        return {
            "recomputed": None,
            "mismatch": None,
            "note": f"not checked: no {', '.join(missing)} in the log",
        }
    # the log's sizes as a model (its vocabulary already padded); N does not enter the megatron formula
    logged_model = sized_model(
        summary["num_layers"],
        summary["hidden_size"],
        summary["seq_length"],
        summary["padded_vocab_size"],
        summary.get("ffn_hidden_size"),
    )
    shape = ModelShape.from_config(logged_model)
    recompute = "full" if summary.get("activation_checkpointing") == "full" else "none"
    count = flops_per_iteration(shape, sps, "megatron", recompute)  # FLOPs of one second
    kind = summary.get("tflops_kind") or "hardware"
    recomputed = (count.hardware_flops if kind == "hardware" else count.model_flops) / world / 1e12
    ratio = logged / recomputed
    mismatch = abs(ratio - 1) > MISMATCH_TOLERANCE
    note = (
        f"logged {logged:.4g} TFLOP/s per device vs {recomputed:.4g} recomputed from {sps:.4g} samples/s "
        f"on {world} devices (megatron convention, {kind} FLOPs, recompute {recompute}): "
        + (
            f"disagree by {max(ratio, 1 / ratio):.3g}x (logged {'below' if ratio < 1 else 'above'}): one of "
            "the two logged figures is wrong, or the log used another formula"
            if mismatch
            else "agree within 10%"
        )
    )
    return {"recomputed": recomputed, "mismatch": mismatch, "note": note}


def import_log(
    path: Path,
    fmt: str,
    store_path: Path,
    label: str | None = None,
    devices: int | None = None,
    nnodes: int = 1,
    seq_length: int | None = None,
) -> dict[str, Any]:
    """Parse `path` and store it as one result tagged source=fmt; importing the same file and label
    again replaces its row (the identity is a hash of the file's content and the label)."""
    if fmt not in PARSERS:
        raise ValueError(f"--format must be one of {', '.join(PARSERS)}, got {fmt!r}")
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        summary = PARSERS[fmt](text)
    except LogFormatError as e:
        raise ValueError(f"{path}: {e}") from e
    if seq_length and not summary.get("seq_length"):
        summary["seq_length"] = seq_length
        if summary.get("samples_per_second"):
            summary["tokens_per_second"] = summary["samples_per_second"] * seq_length
    world = devices or summary.get("world_size")
    check = cross_check_tflops(summary, world)
    summary["tflops_check"] = check["note"]
    if check["mismatch"]:
        # the report's conventions note prints this column, so the disagreement shows under the table
        summary["flops_convention"] = f"{summary['flops_convention']}; {check['note']}"
    label = label or f"{path.stem} ({fmt})"
    digest = hashlib.sha256(text.encode() + b"\0" + label.encode()).hexdigest()[:20]
    per_rank = summary.get("peak_memory_bytes_per_rank") or []
    record: dict[str, Any] = {
        "config_hash": f"{fmt}-{digest}",
        "repeat": 0,
        "source": fmt,
        "label": label,
        "status": "ok" if summary.get("samples_per_second") is not None else "crashed",
        "error": None if summary.get("samples_per_second") is not None else "no throughput in the log",
        "nproc": world,
        "nnodes": nnodes,
        "run_dir": str(path.resolve()),
        "summary_json": json.dumps(summary),
        "peak_memory_bytes_max": max(per_rank) if per_rank else None,
        "tflops_recomputed": check["recomputed"],
        "tflops_mismatch": None if check["mismatch"] is None else int(check["mismatch"]),
        "grad_sync_ms": (summary.get("phase_time_ms_median") or {}).get("all-grads-sync"),
    }
    for key in (
        "samples_per_second",
        "tokens_per_second",
        "tflops_per_device",
        "flops_convention",
        "seq_length",
        "num_parameters",
        "global_batch_size",
        "micro_batch_size",
        "tp",
        "pp",
        "dp",
        "precision",
        "activation_checkpointing",
    ):
        if summary.get(key) is not None:
            record[key] = summary[key]
    with ResultsStore(store_path) as store:
        store.put(record)
    return record
