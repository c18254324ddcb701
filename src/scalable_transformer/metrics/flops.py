"""The one FLOPs count of the project: training logs, reports, `stx flops` and the planner all call
`flops_per_iteration`. Every number here is a count of floating-point operations (FLOPs), never a
rate (FLOP/s), unless a name says "per second".

Legend: B samples (sequences) per optimizer step, s sequence length, L layers, h hidden size,
F MLP inner size (default 4h), V padded vocabulary, N parameter count, g/n key/value heads per
query head, w the sliding attention window (model.sliding_window; none = s), E the parameters of the
embedding tables (word, learned positions, token types). "Model FLOPs" are the FLOPs the model
mathematically needs for one forward + backward (the numerator of MFU); "hardware FLOPs" add what
activation recomputation repeats (the numerator of HFU).

Each convention is named by the code it reproduces, at a pinned version; tests/unit/
test_flops_upstream.py calls that code (the upstream function's own text, from its repository at the
commit below) on GPT-2, Llama-3-8B (GQA, SwiGLU, untied) and BERT shapes and asserts equality to
1e-12. Where the source counts model FLOPs only, hardware FLOPs here add one forward of everything
(x 4/3) for full recompute and one forward of that convention's attention-core term for selective
recompute: that part is ours, the source has no HFU.

megatron-deepspeed-2022 -- Megatron-DeepSpeed `megatron/utils.py::throughput_calculator` as of
  492e962 (2022-08-17, unchanged for dense models until b7b2d5e, 2024-08-19): Narayanan et al. 2021
  (arXiv 2104.04473) eq. 3,
      24 * f * B * s * L * h^2 * (1 + s/(6h) + V/(16*L*h)),  f = 4 with --checkpoint-activations, else 3;
  model FLOPs take f = 3, so the logits count 4.5*B*s*h*V. The source reads no F, no gate, no GQA and
  no window: a Llama is counted as if its MLP were 4h, ungated, with one K/V head per head.
  Selective recompute (not in the 2022 source) adds one attention-core forward, 4*B*s^2*h*L.
  Experts: none; the source sees no expert, so an MoE model is counted as if every layer had one
  dense 4h MLP (use another convention for MoE models).

megatron -- the name `logging.flops_convention` had before the conventions were named by source, and
  the default; NOT an alias: it is megatron-deepspeed-2022 generalised by this project (not by
  Megatron) to the shapes the 2022 formula cannot see, so the seeds' TFLOPs stay as they were and a
  Llama is not undercounted. Equal to megatron-deepspeed-2022 for F = 4h, ungated MLP, g = n, no
  window. The leading "1" becomes (1 + g/n)/6 + F*(1 + u)/(12h) with u = 2 for a gated MLP
  (GeGLU/SwiGLU) else 1 (6 FLOPs per token per matrix parameter of the blocks, as Megatron-LM's
  formula counts them), and with a sliding window the attention core is counted over the s x min(s, w)
  band a windowed kernel computes: s/(6h) becomes min(s, w)/(6h). Its only difference from
  megatron-lm-2024 for a dense model without window is then the logits (4.5 vs 6 B*s*h*V).
  Experts: an MoE layer's F is topk x the expert size + the shared expert's (the active experts,
  as Megatron-LM counts them), plus the router's h x E GEMM (6*h*E per token per MoE layer, which
  no Megatron formula counts); dense layers keep F.

megatron-lm-2024 -- NVIDIA Megatron-LM `megatron/training/training.py::num_floating_point_operations`
  as of ed7db1d (2025-02-27; the dense formula is the same from 2bfe9be, 2024-04-03):
      12 * B * s * L * h^2 * ((1 + g/n + s/h) * p + (F/h) * (3/2 if swiglu else 1) + V/(2*L*h)),
  p = kv_channels * n / h (1 here: head dim = h / n). Logits 6*B*s*h*V; attention core 12*B*s^2*L*h
  (no causal halving). No window term (Megatron-LM's --window-size is not in its FLOPs).
  Experts: with num_experts set, EVERY layer's F is moe_router_topk x moe_ffn_hidden_size, plus the
  shared expert's size (the 2024 text has no layer pattern); no router term.

megatron-lm -- the same function at Megatron-LM d98e8a6 (2026-08-22), whose attention core is halved
  for the causal mask (8873b55, 2025-03-06: s/h becomes s/(2h), i.e. 6*B*s^2*L*h), for every model
  type, BERT's bidirectional attention included, as the source does. No window term.
  Experts: MoE layers (moe_layer_freq's pattern, here with moe_first_k_dense, which the source takes
  as a list pattern) count moe_router_topk x moe_ffn_hidden_size + the shared expert's size, dense
  layers F; no router term.

torchtitan -- PyTorch torchtitan `torchtitan/models/utils.py::get_dense_model_nparams_and_flops` at
  b5bcd76 (2026-08-21), as its Llama/Qwen model args call it (head_dims = 2 * h / n): per token
      6 * N' + 6 * L * n * head_dims * s = 6 * N' + 12 * L * h * s,
  N' = N with tied embeddings, else N - E (the nn.Embedding children of the model: the output matrix
  stays counted). No causal halving ("we follow the convention and do not account for sparsity in
  causal attention"), no window term (its gpt-oss windows are not in its FLOPs).
  Experts: `get_moe_model_nparams_and_flops` at the same commit: N is the active N (dense + router +
  shared experts + routed experts x top_k / num_experts), the same formula otherwise.

llm-foundry -- MosaicML llm-foundry `llmfoundry/models/mpt/modeling_mpt.py`
  `ComposerMPTCausalLM.flops_per_batch` / `get_attention_flops` at 8c8dd48 (2025-07-21): per sequence
  params = 2*N*s (`n_active_params`: every parameter, a tied embedding once), attn = L*2*2*h*s^2;
  model FLOPs 3*(params + attn) = 6*N*s + 12*L*h*s^2; full recompute 4*(params + attn), selective
  3*params + 4*attn. MPT's sliding_window_size is not in its FLOPs: no window term. Its attention
  term is 3x (MFU) and 8/3x (HFU) the `mosaic` table's. Experts: N is the active N (what its
  `n_active_params` counts for MPT's MoE blocks: the top-k experts, router and everything else).

mosaic -- the formula of MosaicML's published MosaicGPT throughput table (llm-foundry's benchmarking
  README, as the users' table was computed): per sequence  params = 2*N*s,  attn = L*2*h*s^2;
  model FLOPs 3*params + 2*attn, hardware FLOPs with full activation checkpointing
  4*params + 3*attn (HFU = MFU without checkpointing); selective recompute adds one attention
  forward: 3*params + 3*attn. N is every parameter, embeddings included (a tied embedding once).
  Reproduces every row of the table to 1e-3 (tests/unit/test_flops.py::MOSAIC_TABLE). No window term.
  Experts: N is the active N (the table has dense models only).

6n -- PaLM (arXiv 2204.02311) appendix B, as used by nanoGPT's `estimate_mfu`: per token
  6*N + 12*L*h*s; with full recompute 8*N + 16*L*h*s; selective 6*N + 16*L*h*s. For the same N this
  equals `llm-foundry` exactly (12*L*h*s per token = 12*L*h*s^2 per sequence); the two names are kept
  because users quote both. nanoGPT passes N without the position table (`get_num_params()`); give
  such an N through `ModelShape.num_params` if you want that variant. No window term.
  Experts: N is the active N (`config.model_shapes.active_params`: the top-k experts, the shared
  expert, the router and every parameter outside the experts), the usual 6N for MoE models.

Head size (model.kv_channels: n x d != h): every convention with an attention term reads the query
heads' features n d where its source writes h, as Megatron-LM does through kv_channels (p = n d / h
multiplies its attention terms, core included), torchtitan through head_dims = 2 d and PaLM through
H x Q; llm-foundry and mosaic (MPT has no separate head size) are generalised the same way here.
megatron-deepspeed-2022 reads no head size (as it reads no F): it counts h. The q/k norms of
model.qk_norm are elementwise: no term (their weights are in N).

Architecture fields without a FLOPs term in any convention: ALiBi (an elementwise bias added to the
scores, no matmul), partial rotary and rotary itself (elementwise), the parallel residual (the same
matmuls in another order). q/k/v biases are parameters: the conventions counting 6*N see them through
N; the Megatron formulas count no bias. `convention_notes` says when a model's sliding window is
not counted by the chosen convention.

The shape the formulas read (`ModelShape`: layers, hidden, sequence, padded vocabulary, N, MLP size,
gated or not, key/value heads per head, window, embedding tables, tying) is built from a config by
`ModelShape.from_config`, in config/model_shapes.py with the parameter counts it takes N from; it is
re-exported here.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..config.model_shapes import ModelShape
from ..config.schema import FLOPS_CONVENTIONS
from ..errors import MFUError

if TYPE_CHECKING:
    from scalable_transformer.config.schema import ResolvedConfig

_log = logging.getLogger(__name__)

CONVENTIONS = FLOPS_CONVENTIONS  # the names logging.flops_convention takes, each a formula below
RECOMPUTE_MODES: tuple[str, ...] = ("none", "full", "selective")
# The conventions that count attention over the sliding window (the others' sources have no term).
WINDOWED_CONVENTIONS: tuple[str, ...] = ("megatron",)


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


# Each formula gives (model FLOPs, attention-core FLOPs within them) of ONE sample; `_with_recompute`
# adds what recomputation repeats: everything's forward (x 4/3) for full, the core's forward for
# selective (one third of its forward + backward).


def _megatron_deepspeed_2022(shape: ModelShape) -> tuple[float, float]:
    s, n_l, h, v = shape.seq_length, shape.num_layers, shape.hidden_size, shape.vocab_size
    scale = 24 * 3 * s * n_l * h * h
    return scale * (1 + s / (6 * h) + v / (16 * n_l * h)), scale * s / (6 * h)


def _mlp_width(shape: ModelShape, every_layer_moe: bool = False) -> float:
    """The MLP inner size a token runs through, averaged over the layers: F in a dense layer, topk x
    the expert size + the shared expert's in an MoE layer (every layer one with `every_layer_moe`,
    as Megatron-LM's 2024 formula counts a model with experts)."""
    if not shape.moe_layers:
        return float(shape.ffn)
    moe = shape.moe_topk * shape.expert_ffn + shape.shared_expert_size
    n_moe = shape.num_layers if every_layer_moe else shape.moe_layers
    return ((shape.num_layers - n_moe) * shape.ffn + n_moe * moe) / shape.num_layers


def _megatron(shape: ModelShape) -> tuple[float, float]:
    s, n_l, h, v = shape.seq_length, shape.num_layers, shape.hidden_size, shape.vocab_size
    up = 2 if shape.gated_mlp else 1
    p = shape.attn / h  # Megatron-LM's query_projection_to_hidden_size_ratio: 1 unless kv_channels
    # = 1 for a plain MLP with F = 4h and one K/V head per head; MoE layers: the active experts'
    # width, and the router's h x E GEMM (6 h E per token, E / (12 h) in these units)
    router = shape.moe_layers * shape.num_experts / (12 * h) / n_l
    dense = (1 + shape.kv_heads_ratio) / 6 * p + _mlp_width(shape) * (1 + up) / (12 * h) + router
    core = shape.attended_keys / (6 * h) * p
    scale = 24 * 3 * s * n_l * h * h
    return scale * (dense + core + v / (16 * n_l * h)), scale * core


def _megatron_lm(shape: ModelShape, causal_half: bool) -> tuple[float, float]:
    s, n_l, h, v = shape.seq_length, shape.num_layers, shape.hidden_size, shape.vocab_size
    gated = 3 / 2 if shape.gated_mlp else 1
    core = s / h / (2 if causal_half else 1)
    p = shape.attn / h  # query_projection_to_hidden_size_ratio = kv_channels x n / h
    scale = 12 * s * n_l * h * h
    # the 2024 text counts every layer of a model with experts as an MoE layer (no layer pattern)
    mlp = _mlp_width(shape, every_layer_moe=not causal_half)
    model = scale * ((1 + shape.kv_heads_ratio + core) * p + mlp / h * gated + v / (2 * n_l * h))
    return model, scale * core * p


def _torchtitan(shape: ModelShape) -> tuple[float, float]:
    s, n_l = shape.seq_length, shape.num_layers
    matmul_params = shape.active_n if shape.tied_embeddings else shape.active_n - shape.embedding_params
    core = 12 * n_l * shape.attn * s * s  # 6 L n head_dims s per token, head_dims = 2 d
    return 6 * matmul_params * s + core, core


def _llm_foundry(shape: ModelShape) -> tuple[float, float]:
    s = shape.seq_length
    core = 3 * shape.num_layers * 2 * 2 * shape.attn * s * s
    return 3 * 2 * shape.active_n * s + core, core


def _six_n(shape: ModelShape) -> tuple[float, float]:
    s = shape.seq_length
    core = 12 * shape.num_layers * shape.attn * s * s  # PaLM's 12 L H Q T: heads x head size
    return 6 * shape.active_n * s + core, core


def _with_recompute(counts: tuple[float, float], recompute: str) -> tuple[float, float]:
    model, core = counts
    if recompute == "full":
        return model, model * 4 / 3
    if recompute == "selective":
        return model, model + core / 3
    return model, model


def _mosaic(shape: ModelShape, recompute: str) -> tuple[float, float]:
    """The table's own factors: 3*params + 2*attn, full 4*params + 3*attn, selective 3*params + 3*attn."""
    s = shape.seq_length
    params_per_seq = 2 * shape.active_n * s
    attn_per_seq = shape.num_layers * 2 * shape.attn * s * s
    model = 3 * params_per_seq + 2 * attn_per_seq
    if recompute == "full":
        return model, 4 * params_per_seq + 3 * attn_per_seq
    if recompute == "selective":
        return model, 3 * params_per_seq + 3 * attn_per_seq  # one more attention forward
    return model, model


_FORMULAS: dict[str, Callable[[ModelShape], tuple[float, float]]] = {
    "megatron": _megatron,
    "megatron-deepspeed-2022": _megatron_deepspeed_2022,
    "megatron-lm": lambda shape: _megatron_lm(shape, causal_half=True),
    "megatron-lm-2024": lambda shape: _megatron_lm(shape, causal_half=False),
    "torchtitan": _torchtitan,
    "llm-foundry": _llm_foundry,
    "6n": _six_n,
}


def convention_notes(shape: ModelShape, convention: str) -> list[str]:
    """What the convention leaves out of this shape, said beside its figures (empty when nothing)."""
    windowed = shape.sliding_window is not None and shape.sliding_window < shape.seq_length
    if windowed and convention not in WINDOWED_CONVENTIONS:
        return [
            f"{convention}: its source has no sliding-window term, so attention is counted over the "
            f"whole sequence ({shape.seq_length} tokens), not the {shape.sliding_window}-token window; "
            f"{', '.join(WINDOWED_CONVENTIONS)} counts the window"
        ]
    return []


def flops_per_iteration(
    shape: ModelShape, samples: float, convention: str, recompute: str = "none"
) -> FlopsCount:
    """FLOPs (not FLOP/s) of one optimizer step over `samples` sequences of shape.seq_length tokens
    (samples = the global batch: every micro-batch on every data-parallel rank).

    recompute is the activation checkpointing mode ("none", "full", "selective"); it changes
    hardware FLOPs only. See the module docstring for each convention's formula and source.
    """
    _check(convention, recompute, samples)
    if convention == "mosaic":
        model, hardware = _mosaic(shape, recompute)
    else:
        model, hardware = _with_recompute(_FORMULAS[convention](shape), recompute)
    return FlopsCount(
        model_flops=float(model * samples), hardware_flops=float(hardware * samples), convention=convention
    )


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
