"""The one FLOPs count of the project: training logs, reports, `stx flops` and the planner all call
`flops_per_iteration`. Every number here is a count of floating-point operations (FLOPs), never a
rate (FLOP/s), unless a name says "per second".

Legend: B samples (sequences) per optimizer step, s sequence length, L layers, h hidden size,
F MLP inner size (default 4h), V padded vocabulary, N parameter count. "Model FLOPs" are the FLOPs
the model mathematically needs for one forward + backward (the numerator of MFU); "hardware FLOPs"
add what activation recomputation repeats (the numerator of HFU).

Conventions, and what their sources actually compute (checked against the sources' code):

megatron -- Narayanan et al. 2021 (arXiv 2104.04473) eq. 3, as computed by Megatron-DeepSpeed's
  `megatron/utils.py::throughput_calculator`:
      24 * f * B * s * L * h^2 * (1 + s/(6h) + V/(16*L*h)),  f = 4 with --checkpoint-activations, else 3.
  We use f = 3 for model FLOPs; hardware FLOPs use f = 4 for full recompute, f = 3 for none, and for
  selective recompute add one forward of the attention core (QK^T and AV: 4*B*s^2*h per layer).
  Generalised (reduces to the formula above for F = 4h and no grouped-query attention): the leading "1"
  becomes (1 + g/n)/6 + F*(1 + u)/(12h) with u = 2 for a gated MLP (GeGLU/SwiGLU: gate and value,
  h -> 2F, then F -> h: three matrices) else 1, and g/n the key/value heads per query head (grouped-
  query attention: K and V project to g*d = h*g/n features; 1 without it), as Megatron-LM's
  `num_floating_point_operations` counts both. That leading term is exactly 6 FLOPs per token per
  matrix parameter of the blocks (6 x the parameters without embeddings, norms and biases).
  Differences from NVIDIA Megatron-LM's current `training.py::num_floating_point_operations`:
  (a) Megatron-LM reports model FLOPs only (no recompute factor, no HFU);
  (b) it counts the logit layer as 6*B*s*h*V, while scaling eq. 3 by f/4 gives 4.5*B*s*h*V at f = 3
      (eq. 3 was written for f = 4, where its logit term is exactly 6*B*s*h*V); we keep the
      Megatron-DeepSpeed figure because the "tflops/gpu" numbers users compare with come from it;
  (c) current Megatron-LM halves the attention core for the causal mask (s/(12h) instead of
      s/(6h)), for every model type; we do not halve (BERT is bidirectional, and we count the work
      of a dense attention kernel). Megatron-LM's earlier form (expansion factor 12),
      72*B*s*L*h^2*(1 + s/(6h) + V/(12*L*h)) for F = 4h, differs from ours only by (b).

mosaic -- the formula of MosaicML's published MosaicGPT throughput table (llm-foundry's benchmarking
  README, as the users' table was computed): per sequence  params = 2*N*s,  attn = L*2*h*s^2;
  model FLOPs 3*params + 2*attn, hardware FLOPs with full activation checkpointing
  4*params + 3*attn (HFU = MFU without checkpointing); selective recompute adds one attention
  forward: 3*params + 3*attn. N is every parameter, embeddings included (a tied embedding once).
  Reproduces every row of the table to 1e-3 (tests/unit/test_flops.py::MOSAIC_TABLE).

llm-foundry -- MosaicML llm-foundry's current code (`scripts/train/benchmarking/collect_results.py`
  and the MPT `flops_per_batch`): params = 2*N*s,  attn = L * 2 * 2 * h * s^2 per sequence (QK^T and
  AV, 2 FLOPs per MAC); model FLOPs 3*(params + attn) = 6*N*s + 12*L*h*s^2, full recompute
  4*(params + attn), selective 3*params + 4*attn. Its attention term is 3x (MFU) and 8/3x (HFU) the
  table's: the table's attn counts one s x s product of 2*h FLOPs per position pair per layer where the
  code counts both (QK^T and AV) at 2 FLOPs per MAC, and the table's backward factor for attention is
  1x, not 2x. (MosaicML notes a flash-attention backward recomputes attention once more; neither
  counts it.)

6n -- PaLM (arXiv 2204.02311) appendix B, as used by nanoGPT's `estimate_mfu`: per token
  6*N + 12*L*h*s; with full recompute 8*N + 16*L*h*s; selective 6*N + 16*L*h*s. For the same N this
  equals `llm-foundry` exactly (12*L*h*s per token = 12*L*h*s^2 per sequence); the two names are kept
  because users quote both. nanoGPT passes N without the position table (`get_num_params()`); give
  such an N through `ModelShape.num_params` if you want that variant.

The shape the formulas read (`ModelShape`: layers, hidden, sequence, padded vocabulary, N, MLP size,
gated or not, key/value heads per head) is built from a config by `ModelShape.from_config`, in
config/model_shapes.py with the parameter counts it takes N from; it is re-exported here.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..config.model_shapes import ModelShape
from ..errors import MFUError

if TYPE_CHECKING:
    from scalable_transformer.config.schema import ResolvedConfig

_log = logging.getLogger(__name__)

CONVENTIONS: tuple[str, ...] = ("megatron", "mosaic", "llm-foundry", "6n")
RECOMPUTE_MODES: tuple[str, ...] = ("none", "full", "selective")


@dataclass(frozen=True)
class FlopsCount:
    """FLOPs of one optimizer step (not a rate): model FLOPs (MFU numerator) and hardware FLOPs
    (HFU numerator, includes recomputation), under the named convention."""

    model_flops: float
    hardware_flops: float
    convention: str


def _check(convention: str, recompute: str, samples: float) -> None:
    if convention not in CONVENTIONS:
        raise ValueError(f"unknown FLOPs convention {convention!r}; choose one of {', '.join(CONVENTIONS)}")
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"unknown recompute mode {recompute!r}; choose one of {', '.join(RECOMPUTE_MODES)}")
    if samples < 0:
        raise ValueError(f"samples must be >= 0 sequences, got {samples}")


def _megatron(shape: ModelShape, samples: float, recompute: str) -> tuple[float, float]:
    b, s, n_l, h, v = samples, shape.seq_length, shape.num_layers, shape.hidden_size, shape.vocab_size
    up = 2 if shape.gated_mlp else 1
    # = 1 for a plain MLP with F = 4h and one K/V head per head
    dense = (1 + shape.kv_heads_ratio) / 6 + shape.ffn * (1 + up) / (12 * h)
    bracket = dense + s / (6 * h) + v / (16 * n_l * h)
    model = 24 * 3 * b * s * n_l * h * h * bracket
    if recompute == "full":
        hardware = 24 * 4 * b * s * n_l * h * h * bracket
    elif recompute == "selective":
        hardware = model + 4 * b * s * s * h * n_l  # one more forward of QK^T and AV
    else:
        hardware = model
    return model, hardware


def _mosaic(shape: ModelShape, samples: float, recompute: str) -> tuple[float, float]:
    s = shape.seq_length
    params_per_seq = 2 * shape.num_params * s
    attn_per_seq = shape.num_layers * 2 * shape.hidden_size * s * s
    model = (3 * params_per_seq + 2 * attn_per_seq) * samples
    if recompute == "full":
        hardware = (4 * params_per_seq + 3 * attn_per_seq) * samples
    elif recompute == "selective":
        hardware = (3 * params_per_seq + 3 * attn_per_seq) * samples  # one more attention forward
    else:
        hardware = model
    return model, hardware


def _llm_foundry(shape: ModelShape, samples: float, recompute: str) -> tuple[float, float]:
    s = shape.seq_length
    params_per_seq = 2 * shape.num_params * s
    attn_per_seq = shape.num_layers * 2 * 2 * shape.hidden_size * s * s
    model = 3 * (params_per_seq + attn_per_seq) * samples
    if recompute == "full":
        hardware = 4 * (params_per_seq + attn_per_seq) * samples
    elif recompute == "selective":
        hardware = (3 * params_per_seq + 4 * attn_per_seq) * samples
    else:
        hardware = model
    return model, hardware


def _six_n(shape: ModelShape, samples: float, recompute: str) -> tuple[float, float]:
    n, s = shape.num_params, shape.seq_length
    attn_per_token = shape.num_layers * shape.hidden_size * s
    tokens = samples * s
    model = (6 * n + 12 * attn_per_token) * tokens
    if recompute == "full":
        hardware = (8 * n + 16 * attn_per_token) * tokens
    elif recompute == "selective":
        hardware = (6 * n + 16 * attn_per_token) * tokens
    else:
        hardware = model
    return model, hardware


_FORMULAS = {"megatron": _megatron, "mosaic": _mosaic, "llm-foundry": _llm_foundry, "6n": _six_n}


def flops_per_iteration(
    shape: ModelShape, samples: float, convention: str, recompute: str = "none"
) -> FlopsCount:
    """FLOPs (not FLOP/s) of one optimizer step over `samples` sequences of shape.seq_length tokens
    (samples = the global batch: every micro-batch on every data-parallel rank).

    recompute is the activation checkpointing mode ("none", "full", "selective"); it changes
    hardware FLOPs only. See the module docstring for each convention's formula and source.
    """
    _check(convention, recompute, samples)
    model, hardware = _FORMULAS[convention](shape, samples, recompute)
    return FlopsCount(model_flops=float(model), hardware_flops=float(hardware), convention=convention)


def step_flops(cfg: ResolvedConfig, num_params: int | None = None) -> FlopsCount:
    """FLOPs of one optimizer step of a resolved run config: its global batch, its
    `logging.flops_convention` and recompute mode; `num_params` is N, by default the model's count
    (`config.model_shapes.total_params`, equal to `models.count_parameters(cfg.model)`)."""
    return flops_per_iteration(
        ModelShape.from_config(cfg.model, num_params),
        cfg.train.global_batch_size,
        cfg.logging.flops_convention,
        cfg.parallel.activation_checkpointing,
    )


# Impossible-utilisation warnings already given in this process, so a run warns once, not at every
# log line (keyed by what makes the figure: the step's FLOPs, convention, devices and peak).
_WARNED: set[tuple] = set()


def throughput_metrics(
    count: FlopsCount,
    iteration_seconds: float,
    num_devices: int,
    peak_flops_per_device: float | None,
    *,
    allow_over_100: bool = False,
    strict: bool = False,
) -> dict[str, Any]:
    """Rates and utilisations of one step that took iteration_seconds on num_devices devices.

    count holds FLOPs of the whole step (all devices); peak_flops_per_device is in FLOP/s.
    Returns tflops_per_device and hw_tflops_per_device (TFLOP/s = 1e12 FLOP/s per device), mfu and
    hfu (fractions of the peak, 0..1; None when the peak is None) and the convention.

    MFU or HFU above 1 is impossible, so it is never a result. By default (training: a metric must
    never stop a run) both become None and a warning naming the likely causes is logged once per
    (FLOPs, devices, peak); strict=True raises MFUError instead (a checked calculation);
    allow_over_100=True keeps the values and issues a RuntimeWarning (the calculator, which reports
    what it was given).
    """
    if not iteration_seconds > 0:
        raise ValueError(f"iteration_seconds must be > 0, got {iteration_seconds}")
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}")
    model_rate = count.model_flops / iteration_seconds / num_devices
    hw_rate = count.hardware_flops / iteration_seconds / num_devices
    metrics: dict[str, Any] = {
        "convention": count.convention,
        "tflops_per_device": model_rate / 1e12,
        "hw_tflops_per_device": hw_rate / 1e12,
        "mfu": None,
        "hfu": None,
    }
    if peak_flops_per_device is None:
        return metrics
    if not peak_flops_per_device > 0:
        raise ValueError(f"peak_flops_per_device must be > 0 FLOP/s, got {peak_flops_per_device}")
    mfu, hfu = model_rate / peak_flops_per_device, hw_rate / peak_flops_per_device
    if max(mfu, hfu) > 1.0:
        message = (
            f"{count.convention}: MFU {mfu:.1%} / HFU {hfu:.1%} exceed 100% of the peak "
            f"({peak_flops_per_device / 1e12:.4g} TFLOP/s per device): impossible, so a bug in the peak "
            "or the inputs, not a result. Likely causes: a peak measured on other kernels or under load than "
            "the run's (on CPU: the cached measured peak), logging.peak_tflops / --peak-tflops set too low, "
            "logging.device_name naming another device or dtype; or samples not the global batch of one "
            "step, iteration_seconds not that step's time, num_devices not every device that shared it."
        )
        if strict:
            raise MFUError(message)
        if allow_over_100:
            warnings.warn(message, RuntimeWarning, stacklevel=2)
        else:
            key = (count, num_devices, peak_flops_per_device)
            if key not in _WARNED:
                _WARNED.add(key)
                _log.warning("%s MFU and HFU are recorded as null (n/a).", message)
            return metrics
    metrics["mfu"], metrics["hfu"] = mfu, hfu
    return metrics
