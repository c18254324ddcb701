"""The MoE layer's pieces against plain per-expert matmuls."""

from __future__ import annotations

import pytest
import torch

from scalable_transformer.config.load import load_config
from scalable_transformer.config.validate import resolve
from scalable_transformer.models import moe
from scalable_transformer.models.moe import GroupedExperts


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_grouped_experts_equal_one_matmul_per_expert_forward_and_backward(activation):
    cfg = resolve(
        load_config(
            "tiny-gpt",
            ["model.num_experts=4", f"model.activation={activation}", "model.moe_ffn_hidden_size=96"],
        )
    ).model
    torch.manual_seed(0)
    experts = GroupedExperts(cfg)
    for w in (experts.w_up, experts.w_down):
        torch.nn.init.normal_(w, std=0.05)
    counts_e = torch.tensor([3, 0, 5, 2])  # an expert with no token must work too
    x_th = torch.randn(10, cfg.hidden_size, requires_grad=True)
    grad_th = torch.randn(10, cfg.hidden_size)
    assert moe._grouped_mm_runs(x_th, experts.w_up, experts.w_down)
    y_th = experts(x_th, counts_e)
    y_th.backward(grad_th)
    got = (y_th.detach(), x_th.grad, experts.w_up.grad, experts.w_down.grad)

    x_ref = x_th.detach().clone().requires_grad_()
    w_up = experts.w_up.detach().clone().requires_grad_()
    w_down = experts.w_down.detach().clone().requires_grad_()
    outs, start = [], 0
    for e, n in enumerate(counts_e.tolist()):
        up = x_ref[start : start + n] @ w_up[e]
        if activation == "swiglu":
            gate, value = up.unflatten(-1, (-1, 2)).unbind(-1)
            up = torch.nn.functional.silu(gate) * value
        else:
            up = torch.nn.functional.gelu(up)
        outs.append(up @ w_down[e])
        start += n
    y_ref = torch.cat(outs)
    y_ref.backward(grad_th)
    for a, b in zip(got, (y_ref.detach(), x_ref.grad, w_up.grad, w_down.grad), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_grouped_experts_fall_back_to_a_loop_on_unaligned_widths():
    cfg = resolve(
        load_config(
            "tiny-gpt", ["model.num_experts=2", "model.hidden_size=130", "model.num_attention_heads=2"]
        )
    ).model
    experts = GroupedExperts(cfg)
    for w in (experts.w_up, experts.w_down):
        torch.nn.init.normal_(w, std=0.05)
    x_th = torch.randn(5, 130)
    assert not moe._grouped_mm_runs(x_th, experts.w_up, experts.w_down)
    y_th = experts(x_th, torch.tensor([2, 3]))
    torch.testing.assert_close(y_th[2:], experts(x_th[2:], torch.tensor([0, 3])))
