"""Mixture of experts: the routed experts as one module with 3-D weights.

Shape legend: t tokens routed (token-expert assignments, sorted by expert), h hidden, f expert MLP
inner size, e experts held by this module (all of them, or this rank's share under expert
parallelism).

Contract relied on by parallel/ (expert parallelism shards the weights' first dimension and moves
tokens to their experts around `GroupedExperts.forward`):
    GroupedExperts.forward(x_th, counts_e) -> y_th
where x_th holds the tokens of expert 0, then of expert 1, ..., counts_e[i] rows each (an integer
tensor on x's device with one entry per expert this module holds), and y_th is each row's expert
output in the same order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from scalable_transformer.config.schema import ModelConfig

# torch's grouped GEMM reads each matrix's rows with a 16-byte aligned stride (checked on torch 2.13:
# "strides should be multiple of 16 bytes" otherwise); below that alignment the experts run one by one.
_GROUPED_MM_ALIGN_BYTES = 16


class GroupedExperts(nn.Module):
    """The routed experts of one MoE layer, each an MLP without biases (Mixtral, OLMoE, DeepSeek):
    w_up [e, h, up] (up = 2 f for a gated activation, gate and value columns interleaved as in
    `models.layers.MLP`, else f) and w_down [e, f, h]. All experts run in one grouped GEMM
    (`F.grouped_mm`, which takes the group boundaries as a device tensor, so no token count is read
    on the host); a loop over experts where the grouped GEMM cannot run."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.moe_ffn_hidden_size is not None, "resolve the config first"
        f, h = cfg.moe_ffn_hidden_size, cfg.hidden_size
        self.activation = cfg.activation
        gated = cfg.activation in ("geglu", "swiglu")
        self.w_up = nn.Parameter(torch.empty(cfg.num_experts, h, 2 * f if gated else f))
        self.w_down = nn.Parameter(torch.empty(cfg.num_experts, f, h))

    @property
    def num_local_experts(self) -> int:
        return self.w_up.shape[0]

    def forward(self, x_th: torch.Tensor, counts_e: torch.Tensor) -> torch.Tensor:
        w_up, w_down = self.w_up.to(x_th.dtype), self.w_down.to(x_th.dtype)
        if _grouped_mm_runs(x_th, w_up, w_down):
            offsets_e = torch.cumsum(counts_e, 0, dtype=torch.int32)
            y_tf = self._activate(F.grouped_mm(x_th, w_up, offs=offsets_e))
            return F.grouped_mm(y_tf, w_down, offs=offsets_e)
        # one GEMM per expert: the split sizes are read on the host (a sync on a GPU)
        rows = counts_e.tolist()
        outs = [self._activate(x @ w_up[i]) @ w_down[i] for i, x in enumerate(torch.split(x_th, rows, dim=0))]
        return torch.cat(outs, dim=0) if outs else x_th.new_zeros(0, w_down.shape[-1])

    def _activate(self, y_tu: torch.Tensor) -> torch.Tensor:
        if self.activation in ("geglu", "swiglu"):
            gate_tf, value_tf = y_tu.unflatten(-1, (-1, 2)).unbind(-1)
            act = F.silu if self.activation == "swiglu" else F.gelu
            return act(gate_tf) * value_tf
        return F.gelu(y_tu, approximate="tanh" if self.activation == "openai-gelu" else "none")


def _grouped_mm_runs(x_th: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> bool:
    """Whether F.grouped_mm takes these operands: row strides 16-byte aligned, fp32 or bf16."""
    if x_th.dtype not in (torch.float32, torch.bfloat16):
        return False
    size = x_th.element_size()
    widths = (x_th.shape[-1], w_up.shape[-1], w_down.shape[-1])
    return all(w * size % _GROUPED_MM_ALIGN_BYTES == 0 for w in widths)
