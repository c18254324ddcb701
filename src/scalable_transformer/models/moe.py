"""Mixture of experts: the token-choice MoE layer of a GPT block (`MoELayer`: router, dispatch,
losses) and its routed experts as one module with 3-D weights (`GroupedExperts`).

Shape legend: t tokens (of the micro-batch, or routed: token-expert assignments sorted by expert), k
experts per token (top-k), n = t k assignments, h hidden, f expert MLP inner size, e experts held by
the experts module (all of them, or this rank's share under expert parallelism), E all experts, l
MoE layers of the model.

Auxiliary losses (load balancing, router z-loss): their gradients enter backward through
`_AuxLossScaler` on the layer's output (Megatron's MoEAuxLossAutoScaler), so a block still returns x
only (pipeline stages pass x alone). The convention, which every layout shares: the step's aux loss
is the mean, over the step's micro-batches and the data-parallel (x context-parallel) ranks, of each
micro-batch's aux loss, summed over the MoE layers, times its coefficient. The trainer backpropagates
every micro-batch's LM share times dp x cp (DDP/FSDP average over those ranks) times the fp16 loss
scale, so each micro-batch's aux loss gets the gradient scale coefficient x loss scale / micro-batches
(`MoEStep.begin`); dp x cp cancels, as in Megatron (loss_scale / num_microbatches).

Contract relied on by parallel/ (expert parallelism shards the weights' first dimension and moves
tokens to their experts around `GroupedExperts.forward`):
    GroupedExperts.forward(x_th, counts_e) -> y_th
where x_th holds the tokens of expert 0, then of expert 1, ..., counts_e[i] rows each (an integer
tensor on x's device with one entry per expert this module holds), and y_th is each row's expert
output in the same order.

Tensor parallelism (parallel/tensor.py sets `MoELayer.tensor_parallel`): every tp rank routes the same
tokens (the whole sequence, gathered under sequence parallelism) and runs its 1 / tp slice of every
expert's inner dimension, so routing, aux losses and dropped assignments are the same on every tp
rank; the routed output is a partial sum that `TensorParallelMoE.leave` reduces.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from scalable_transformer.config.model_shapes import moe_layers
from scalable_transformer.config.schema import ModelConfig
from scalable_transformer.models.context_parallel import ContextParallel

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
            y_tf = self._activate(_grouped_mm(x_th, w_up, offsets_e))
            return _grouped_mm(y_tf, w_down, offsets_e)
        rows = _expert_rows(counts_e, x_th.shape[0])
        outs = [self._activate(x @ w_up[i]) @ w_down[i] for i, x in enumerate(torch.split(x_th, rows, dim=0))]
        return torch.cat(outs, dim=0) if outs else x_th.new_zeros(0, w_down.shape[-1])

    def _activate(self, y_tu: torch.Tensor) -> torch.Tensor:
        if self.activation in ("geglu", "swiglu"):
            gate_tf, value_tf = y_tu.unflatten(-1, (-1, 2)).unbind(-1)
            act = F.silu if self.activation == "swiglu" else F.gelu
            return act(gate_tf) * value_tf
        return F.gelu(y_tu, approximate="tanh" if self.activation == "openai-gelu" else "none")


def _expert_rows(counts_e: torch.Tensor, rows: int) -> list[int]:
    """The rows of each expert, read on the host for the loop of one GEMM per expert (a sync on a GPU;
    the dry run answers it as balanced routing: dryrun/engine_stubs.py); `rows` is x's, which they
    add up to."""
    return counts_e.tolist()


def _grouped_mm(x_tk: torch.Tensor, w_ekn: torch.Tensor, offsets_e: torch.Tensor) -> torch.Tensor:
    """Rows offsets_e[i-1]:offsets_e[i] of x times w_ekn[i], in one grouped GEMM (the dry run replaces
    this for fp32 fake tensors, which torch's fake kernel refuses: dryrun/engine_stubs.py)."""
    return F.grouped_mm(x_tk, w_ekn, offs=offsets_e)


def _grouped_mm_runs(x_th: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> bool:
    """Whether F.grouped_mm takes these operands: row strides 16-byte aligned, fp32 or bf16."""
    if x_th.dtype not in (torch.float32, torch.bfloat16):
        return False
    size = x_th.element_size()
    # the activated rows [t, f] are the second GEMM's input: f (w_down's dim 1) must align too
    widths = (x_th.shape[-1], w_up.shape[-1], w_down.shape[-2], w_down.shape[-1])
    return all(w * size % _GROUPED_MM_ALIGN_BYTES == 0 for w in widths)


class _AuxLossScaler(torch.autograd.Function):
    """Identity on the layer's output y; in backward, the auxiliary loss gets the gradient `scale`
    (Megatron's MoEAuxLossAutoScaler, with the scale carried per call instead of in a global)."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        ctx.save_for_backward(aux)
        return y

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # type: ignore[override]
        (aux,) = ctx.saved_tensors
        return grad_y, torch.full_like(aux, ctx.scale), None


def _recomputing() -> bool:
    """Whether this forward runs inside backward (activation checkpointing's recompute), where the
    layer's statistics were already counted. torch's private graph-task id (-1 outside backward) is
    what torch.utils.checkpoint itself tests (torch 2.13); test_moe.py fails if it stops working."""
    return torch._C._current_graph_task_id() != -1


@dataclass
class RouterStats:
    """One MoE layer's statistics since the last `MoEStep.begin`, on the device (never read here):
    coefficient-weighted aux and z losses summed over micro-batches, dropped assignments, and the
    assignments routed to each expert (before any capacity drop)."""

    aux: torch.Tensor | None = None
    z: torch.Tensor | None = None
    dropped: torch.Tensor | None = None
    tokens_e: torch.Tensor | None = None

    def add(self, aux: torch.Tensor, z: torch.Tensor, dropped: torch.Tensor, tokens_e: torch.Tensor) -> None:
        if self.tokens_e is None:
            self.aux, self.z, self.dropped, self.tokens_e = aux, z, dropped, tokens_e
            return
        assert self.aux is not None and self.z is not None and self.dropped is not None
        self.aux, self.z = self.aux + aux, self.z + z
        self.dropped, self.tokens_e = self.dropped + dropped, self.tokens_e + tokens_e


def sinkhorn_balanced(logits_te: torch.Tensor, iterations: int = 3, tol: float = 1e-4) -> torch.Tensor:
    """exp(logits) rescaled by rows and columns towards equal row sums (one per token) and equal column
    sums (the same load per expert): Sinkhorn-Knopp as GPT-NeoX's dMoE and Megatron's sinkhorn router
    run it (choosing each token's experts by top-k of this matrix in training): at most `iterations`
    rounds, the last one taken once the column factors moved less than `tol` on average, eps 1e-8.
    Their early `break` reads the error on the host; here a finished loop keeps its factors by
    torch.where on the device, so the result is theirs with no host read."""
    cost_te = torch.exp(logits_te.float())
    t, e = cost_te.shape
    eps = 1e-8
    col_e = 1 / (e * cost_te.sum(0))
    row_t = cost_te.new_ones(t)
    done = torch.zeros((), dtype=torch.bool, device=cost_te.device)
    for _ in range(iterations):
        new_row_t = (1 / t) / ((cost_te * col_e).sum(1) + eps)
        new_col_e = (1 / e) / ((new_row_t.unsqueeze(1) * cost_te).sum(0) + eps)
        row_t = torch.where(done, row_t, new_row_t)
        moved = (new_col_e - col_e).abs().mean()
        col_e = torch.where(done, col_e, new_col_e)
        done = done | (moved < tol)
    return cost_te * col_e * row_t.unsqueeze(1)


@dataclass
class TensorParallelMoE:
    """An MoE layer's tensor-parallel seams over `size` ranks (built by parallel/tensor.py, so models/
    stays free of process groups). `enter`: the layer's input as this rank's plain whole tensor
    [b, s, h], whose gradient is taken as a partial sum over the tp ranks; `router_input`: the view
    the router reads (identity; its gradient, the same on every tp rank, divided by `size` so that the
    partial sum counts it once); `combine_weights`: the top-k weights (identity; their gradient, a
    partial sum because each rank holds part of every expert's output, summed over the tp ranks, so
    the router's gradient is whole and equal on every rank); `leave`: the routed output's partial
    sums reduced into the residual stream's layout (replicated, or the local sequence shard)."""

    size: int
    enter: Callable[[torch.Tensor], torch.Tensor]
    router_input: Callable[[torch.Tensor], torch.Tensor]
    combine_weights: Callable[[torch.Tensor], torch.Tensor]
    leave: Callable[[torch.Tensor], torch.Tensor]


class MoELayer(nn.Module):
    """A token-choice mixture of experts in a block's MLP place: `router` (h -> E logits, fp32),
    scores (softmax or sigmoid), top-k experts per token (renormalised under moe_norm_topk_prob),
    the tokens sorted by expert and run by `experts` (GroupedExperts; expert parallelism wraps this
    call), each output weighted by its score and added back in token order, plus the optional dense
    `shared_expert` (an MLP built by the caller, models/layers.py).

    Dropless by default: every assignment is computed, and no count is read on the host. With
    moe_capacity_factor each expert takes at most ceil(cf x t x k / E) assignments of the micro-batch
    (padded to that capacity, so shapes are static) and keeps those with the highest scores
    (Megatron's "probs" drop policy); the dropped ones are counted."""

    def __init__(self, cfg: ModelConfig, layer: int, shared_expert: nn.Module | None = None) -> None:
        super().__init__()
        self.layer = layer  # the block's index in the whole model
        self.num_experts, self.topk = cfg.num_experts, cfg.moe_router_topk
        self.score, self.norm_topk = cfg.moe_router_score, cfg.moe_norm_topk_prob
        self.balancing = cfg.moe_router_load_balancing
        balanced_by_loss = self.balancing == "aux_loss"
        self.aux_coeff = cfg.moe_aux_loss_coeff if balanced_by_loss else 0.0
        self.z_coeff = cfg.moe_z_loss_coeff
        self.capacity_factor = cfg.moe_capacity_factor
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = GroupedExperts(cfg)
        self.shared_expert = shared_expert
        self.backward_scale = 1.0  # the aux losses' gradient: set each step by MoEStep.begin
        self.stats = RouterStats()
        self.context_parallel: ContextParallel | None = None  # set by parallel/context.py
        self.tensor_parallel: TensorParallelMoE | None = None  # set by parallel/tensor.py

    def forward(self, x_bsh: torch.Tensor) -> torch.Tensor:
        tp = self.tensor_parallel
        x_full = x_bsh if tp is None else tp.enter(x_bsh)
        x_th = x_full.reshape(-1, x_full.shape[-1])
        logits_te, scores_te, weights_tk, experts_tk = self.route(
            x_th if tp is None else tp.router_input(x_th)
        )
        if tp is not None:
            weights_tk = tp.combine_weights(weights_tk)
        device = x_th.device.type  # the experts compute in autocast's dtype, if on
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x_th.dtype
        if self.capacity_factor is None:
            y_th, tokens_e = self._dropless(x_th.to(dtype), weights_tk, experts_tk)
            dropped = tokens_e.new_zeros(())
        else:
            y_th, tokens_e, dropped = self._with_capacity(x_th.to(dtype), weights_tk, experts_tk)
        aux, z = self._losses(logits_te, scores_te, tokens_e)
        if torch.is_grad_enabled() and logits_te.requires_grad and (self.aux_coeff or self.z_coeff):
            y_th = _AuxLossScaler.apply(y_th, aux + z, self.backward_scale)
        if self.training and not _recomputing():
            self.stats.add(aux.detach(), z.detach(), dropped, tokens_e)
        y_bsh = y_th.view(x_full.shape) if tp is None else tp.leave(y_th.view(x_full.shape))
        return y_bsh if self.shared_expert is None else y_bsh + self.shared_expert(x_bsh)

    def route(self, x_th: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(router logits [t, E], scores [t, E], top-k weights [t, k], top-k experts [t, k]), fp32:
        routing runs in fp32 whatever the compute dtype (Megatron, HF Mixtral)."""
        with torch.autocast(x_th.device.type, enabled=False):
            logits_te = F.linear(x_th.float(), self.router.weight.float())
        scores_te = logits_te.softmax(-1) if self.score == "softmax" else logits_te.sigmoid()
        if self.balancing == "sinkhorn" and self.training:
            with torch.no_grad():
                experts_tk = sinkhorn_balanced(logits_te).topk(self.topk, dim=-1).indices
            weights_tk = scores_te.gather(-1, experts_tk)
        else:
            weights_tk, experts_tk = scores_te.topk(self.topk, dim=-1)
        if self.norm_topk:
            weights_tk = weights_tk / weights_tk.sum(-1, keepdim=True)
        return logits_te, scores_te, weights_tk, experts_tk

    def _counts(self, experts_n: torch.Tensor) -> torch.Tensor:
        """Assignments per expert [E], on the device (scatter_add: bincount's size is data-dependent)."""
        counts_e = experts_n.new_zeros(self.num_experts)
        return counts_e.scatter_add_(0, experts_n, torch.ones_like(experts_n))

    def _dropless(
        self, x_th: torch.Tensor, weights_tk: torch.Tensor, experts_tk: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        experts_n = experts_tk.reshape(-1)
        order_n = torch.argsort(experts_n, stable=True)  # by expert, token order within one
        token_n = order_n // self.topk
        counts_e = self._counts(experts_n)
        y_nh = self.experts(x_th[token_n], counts_e)
        y_nh = y_nh * weights_tk.reshape(-1)[order_n].unsqueeze(-1).to(y_nh.dtype)
        return y_nh.new_zeros(x_th.shape).index_add_(0, token_n, y_nh), counts_e

    def _with_capacity(
        self, x_th: torch.Tensor, weights_tk: torch.Tensor, experts_tk: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each expert's `capacity` slots filled by its highest-scored assignments; the rest go to one
        spare slot whose output is zero (static shapes: E x capacity rows whatever the routing)."""
        assert self.capacity_factor is not None
        t, e = x_th.shape[0], self.num_experts
        capacity = math.ceil(self.capacity_factor * t * self.topk / e)
        experts_n, weights_n = experts_tk.reshape(-1), weights_tk.reshape(-1)
        by_score_n = torch.argsort(weights_n, descending=True, stable=True)
        order_n = by_score_n[torch.argsort(experts_n[by_score_n], stable=True)]
        counts_e = self._counts(experts_n)
        sorted_n = experts_n[order_n]
        starts_e = counts_e.cumsum(0) - counts_e
        position_n = torch.arange(order_n.numel(), device=order_n.device) - starts_e[sorted_n]
        kept_n = position_n < capacity
        slot_n = torch.where(kept_n, sorted_n * capacity + position_n, e * capacity)
        token_n = order_n // self.topk
        x_slots = x_th.new_zeros(e * capacity + 1, x_th.shape[1]).index_copy(0, slot_n, x_th[token_n])
        y_slots = self.experts(x_slots[:-1], counts_e.new_full((e,), capacity))
        y_nh = torch.cat([y_slots, y_slots.new_zeros(1, y_slots.shape[1])])[slot_n]
        y_nh = y_nh * weights_n[order_n].unsqueeze(-1).to(y_nh.dtype)
        y_th = y_nh.new_zeros(x_th.shape).index_add_(0, token_n, y_nh)
        return y_th, counts_e, (~kept_n).sum()

    def _losses(
        self, logits_te: torch.Tensor, scores_te: torch.Tensor, tokens_e: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(coefficient x load-balancing loss, coefficient x z-loss) of this micro-batch, fp32.
        Load balancing (Switch/GShard, Megatron's normalisation): E x sum_e f_e P_e, f_e the share of
        the t k assignments routed to e (sums to 1, so a uniform router gives 1 whatever k; HF's
        Mixtral sums to k instead), P_e the mean score of e (sigmoid scores normalised per token
        first, as Megatron). z-loss (ST-MoE): mean over tokens of logsumexp(logits)^2."""
        zero = logits_te.new_zeros(())
        aux = z = zero
        if self.aux_coeff:
            probs_te = scores_te if self.score == "softmax" else scores_te / scores_te.sum(-1, keepdim=True)
            routed_e, probs_e, t = tokens_e.float(), probs_te.sum(0), logits_te.shape[0]
            cp = self.context_parallel
            if cp is not None:  # the statistics of whole sequences, whose chunks the cp ranks share
                routed_e = cp.gather(routed_e.unsqueeze(0), 0).sum(0)
                probs_e, t = cp.gather(probs_e.unsqueeze(0), 0).sum(0), t * cp.size
            share_e = routed_e / (t * self.topk)
            aux = self.aux_coeff * self.num_experts * (share_e * probs_e / t).sum()
        if self.z_coeff:
            z = self.z_coeff * torch.logsumexp(logits_te, dim=-1).square().mean()
        return aux, z


MOE_METRICS = ("moe_aux_loss", "moe_z_loss", "moe_dropped_tokens")


class MoEStep:
    """The trainer's handle on the MoE layers a rank holds (the model, or its pipeline stages): the
    aux losses' gradient scale in before each step, the step's statistics out after it, as device
    tensors (the step ledger reads them at logging steps, train/measurement.py)."""

    def __init__(self, model: nn.Module, cfg: ModelConfig) -> None:
        self.layers = [m for m in model.modules() if isinstance(m, MoELayer)]
        self.rows = {layer: row for row, layer in enumerate(moe_layers(cfg))}
        self.num_experts = cfg.num_experts

    @classmethod
    def of(cls, model: nn.Module, cfg: ModelConfig) -> MoEStep | None:
        """The handle, or None for a dense model."""
        return cls(model, cfg) if cfg.num_experts > 0 else None

    def begin(self, loss_scale: float, micro_batches: int) -> None:
        """Before a step of `micro_batches` micro-batches whose losses are backpropagated times
        `loss_scale` (fp16's; 1.0 otherwise): see the module docstring for the convention."""
        for layer in self.layers:
            layer.backward_scale = loss_scale / micro_batches
            layer.stats = RouterStats()

    def end(self, share: float, device: torch.device) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """(metrics, tokens [l, E]) of the step on this rank. Metrics: `moe_aux_loss` and `moe_z_loss`
        (coefficient-weighted, mean over the MoE layers, as Megatron logs them) times `share` (this
        rank's micro-batch share of the step: 1 / (micro-batches x dp x cp)), so that summed over the
        ranks they are the step's mean; `moe_dropped_tokens`: the assignments dropped by the capacity
        factor, summed over layers and micro-batches. tokens: the assignments routed to each expert
        of each MoE layer (rows of layers another pipeline stage holds are 0), summed over the
        micro-batches; summed over the ranks, the step's."""
        zero = torch.zeros((), dtype=torch.float32, device=device)
        aux, z, dropped = zero, zero, zero
        tokens_le = torch.zeros(len(self.rows), self.num_experts, dtype=torch.float32, device=device)
        for layer in self.layers:
            s = layer.stats
            if s.tokens_e is None:
                continue
            assert s.aux is not None and s.z is not None and s.dropped is not None
            aux, z, dropped = aux + s.aux.float(), z + s.z.float(), dropped + s.dropped.float()
            tokens_le[self.rows[layer.layer]] = s.tokens_e.float()
        n = max(len(self.rows), 1)
        metrics = {
            "moe_aux_loss": aux * (share / n),
            "moe_z_loss": z * (share / n),
            "moe_dropped_tokens": dropped,
        }
        return metrics, tokens_le
