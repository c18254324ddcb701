"""The MoE layer and its pieces against plain per-token and per-expert loops; its losses, statistics,
init rules, and a step without host reads."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from scalable_transformer.config.load import load_config
from scalable_transformer.config.model_shapes import moe_layers
from scalable_transformer.config.validate import resolve
from scalable_transformer.dryrun import dry_run as dry
from scalable_transformer.models import moe
from scalable_transformer.models.gpt.model import GPTModel
from scalable_transformer.models.layers import MLP, init_rules
from scalable_transformer.models.moe import GroupedExperts, MoELayer, MoEStep
from scalable_transformer.train.measurement import load_imbalance


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


def test_an_unaligned_expert_width_alone_takes_the_loop():
    """h 64 with the expert size derived as 170 (gelu: w_up [e, 64, 170]): the activated rows [t, 170]
    fp32 have a 680-byte stride, which torch's grouped GEMM refuses; the loop runs them."""
    cfg = _moe_cfg("model.hidden_size=64", "model.num_attention_heads=2", "model.moe_ffn_hidden_size=170")
    experts = GroupedExperts(cfg)
    for w in (experts.w_up, experts.w_down):
        torch.nn.init.normal_(w, std=0.05)
    x_th = torch.randn(16, 64)
    assert not moe._grouped_mm_runs(x_th, experts.w_up, experts.w_down)
    counts = torch.full((cfg.num_experts,), 16 // cfg.num_experts)
    assert experts(x_th, counts).shape == (16, 64)


def _moe_cfg(*overrides: str):
    return resolve(
        load_config(
            "tiny-moe",
            ["model.vocab_size=512", "model.seq_length=16", "model.moe_ffn_hidden_size=32", *overrides],
        )
    ).model


def _layer(cfg, seed=0) -> MoELayer:
    torch.manual_seed(seed)
    layer = MoELayer(cfg, 0)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return layer


def _expert(layer: MoELayer, e: int, x_h: torch.Tensor) -> torch.Tensor:
    gate, value = (x_h @ layer.experts.w_up[e]).unflatten(-1, (-1, 2)).unbind(-1)
    return (F.silu(gate) * value) @ layer.experts.w_down[e]


def _reference(layer: MoELayer, x_th: torch.Tensor, capacity: int | None = None):
    """Token by token: each token's top-k experts weighted by their scores, an expert keeping only its
    `capacity` highest-scored assignments (ties: the earlier token). (output, dropped assignments)."""
    logits = x_th @ layer.router.weight.T
    scores = logits.softmax(-1) if layer.score == "softmax" else logits.sigmoid()
    weights, experts = scores.topk(layer.topk, dim=-1)
    if layer.balancing == "sinkhorn" and layer.training:
        experts = _neox_sinkhorn(logits.detach()).topk(layer.topk, dim=-1).indices
        weights = scores.gather(-1, experts)
    if layer.norm_topk:
        weights = weights / weights.sum(-1, keepdim=True)
    kept = torch.ones_like(experts, dtype=torch.bool)
    if capacity is not None:
        for e in range(layer.num_experts):
            mine = [(-weights[t, j].item(), t, j) for t in range(len(x_th)) for j in range(layer.topk)]
            mine = sorted(a for a in mine if experts[a[1], a[2]] == e)
            for _, t, j in mine[capacity:]:
                kept[t, j] = False
    rows = []
    for t in range(len(x_th)):
        parts = [
            weights[t, j] * _expert(layer, experts[t, j], x_th[t]) for j in range(layer.topk) if kept[t, j]
        ]
        rows.append(torch.stack(parts).sum(0) if parts else torch.zeros_like(x_th[t]))
    return torch.stack(rows), int((~kept).sum())


def _neox_sinkhorn(cost, tol=0.0001, max_iter=3):
    """GPT-NeoX's SinkhornRouter.sinkhorn (megatron/model/router.py at ea7aefd8), loop and early break
    as written there: the oracle of models/moe.py sinkhorn_balanced."""
    cost = torch.exp(cost)
    d0 = torch.ones(cost.size(0), dtype=cost.dtype)
    d1 = 1 / (cost.size(1) * torch.sum(cost, 0))
    eps, d1_old = 0.00000001, d1
    for _ in range(max_iter):
        d0 = (1 / d0.size(0)) * 1 / (torch.sum(d1 * cost, 1) + eps)
        d1 = (1 / d1.size(0)) * 1 / (torch.sum(d0.unsqueeze(1) * cost, 0) + eps)
        error = torch.mean(torch.abs(d1_old - d1))
        d1_old = d1
        if error < tol:
            break
    return d1 * cost * d0.unsqueeze(1)


@pytest.mark.parametrize("scale", [1e-5, 0.01, 1.0, 4.0])  # converged after 1, 2, 3 rounds or not at all
def test_sinkhorn_is_neoxs_loop_with_its_early_stop_and_no_host_read(scale):
    torch.manual_seed(0)
    logits = torch.randn(64, 8) * scale + torch.linspace(0, 3 * scale, 8)
    torch.testing.assert_close(moe.sinkhorn_balanced(logits), _neox_sinkhorn(logits), rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["model.moe_router_score=sigmoid", "model.moe_norm_topk_prob=false", "model.moe_router_topk=3"],
        [
            "model.moe_router_load_balancing=sinkhorn",
            "model.moe_router_topk=1",
            "model.moe_router_score=sigmoid",
        ],
        ["model.moe_router_load_balancing=sinkhorn", "model.moe_norm_topk_prob=false"],
    ],
)
def test_dropless_layer_equals_a_loop_over_tokens_forward_and_backward(overrides):
    cfg = _moe_cfg("model.moe_aux_loss_coeff=0", "model.moe_z_loss_coeff=0", *overrides)
    layer = _layer(cfg)
    x_bsh = torch.randn(2, 8, cfg.hidden_size, requires_grad=True)
    y_bsh = layer(x_bsh)
    grad = torch.randn_like(y_bsh)
    y_bsh.backward(grad)
    got = [y_bsh.detach(), x_bsh.grad, layer.router.weight.grad, layer.experts.w_up.grad]

    ref = _layer(cfg)
    x_ref = x_bsh.detach().clone().requires_grad_()
    y_ref, dropped = _reference(ref, x_ref.view(-1, cfg.hidden_size))
    y_ref.backward(grad.view(-1, cfg.hidden_size))
    want = [y_ref.detach().view_as(y_bsh), x_ref.grad, ref.router.weight.grad, ref.experts.w_up.grad]
    assert dropped == 0
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("factor", [0.5, 1.0, 4.0])
def test_capacity_keeps_each_experts_highest_scored_assignments_and_counts_the_rest(factor):
    cfg = _moe_cfg("model.moe_aux_loss_coeff=0", f"model.moe_capacity_factor={factor}")
    layer = _layer(cfg, seed=1)
    layer.train()
    x_th = torch.randn(16, cfg.hidden_size)
    capacity = math.ceil(factor * 16 * cfg.moe_router_topk / cfg.num_experts)
    y_ref, dropped = _reference(layer, x_th, capacity)
    y = layer(x_th.view(1, 16, -1)).view(16, -1)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-5)
    assert int(layer.stats.dropped) == dropped
    # 0.5: room for half the assignments; 4.0: each expert has room for all 16 tokens (16 x 2 / 8 x 4)
    assert dropped >= 16 if factor == 0.5 else dropped == 0 if factor == 4.0 else True
    assert int(layer.stats.tokens_e.sum()) == 16 * cfg.moe_router_topk  # routed, before the drop


def test_sinkhorn_spreads_a_biased_routers_load_in_training_only():
    cfg = _moe_cfg("model.moe_router_load_balancing=sinkhorn", "model.moe_router_topk=1")
    layer = _layer(cfg)
    with torch.no_grad():
        layer.router.weight[0] += 1.0  # expert 0 scores highest for most tokens
    x_th = torch.randn(256, cfg.hidden_size)
    counts = {}
    for training in (True, False):
        layer.train(training)
        experts = layer.route(x_th)[3]
        counts[training] = torch.bincount(experts.flatten(), minlength=cfg.num_experts)
    assert counts[False].max() > 2 * counts[True].max()  # plain top-1 piles onto expert 0; Sinkhorn spreads
    assert layer.aux_coeff == 0  # sinkhorn balances by choice, with no loss (moe_aux_loss_coeff unused)


def test_aux_and_z_losses_reach_backward_with_the_steps_scale_and_leave_the_output_alone():
    cfg = _moe_cfg("model.moe_aux_loss_coeff=0.1", "model.moe_z_loss_coeff=0.01", "model.num_layers=1")
    layer, plain = _layer(cfg), _layer(_moe_cfg("model.moe_aux_loss_coeff=0", "model.moe_z_loss_coeff=0"))
    step = MoEStep(layer, cfg)
    step.begin(loss_scale=8.0, micro_batches=4)  # the aux losses' gradient: 8 / 4 = 2 x their own
    x_bsh = torch.randn(2, 8, cfg.hidden_size)
    y = layer(x_bsh)
    y.sum().backward()

    y_plain = plain(x_bsh)
    logits, scores, _, experts = plain.route(x_bsh.view(-1, cfg.hidden_size))
    tokens_e = torch.bincount(experts.flatten(), minlength=cfg.num_experts)
    share_e = tokens_e / (16 * cfg.moe_router_topk)
    aux = 0.1 * cfg.num_experts * (share_e * scores.mean(0)).sum()  # Switch, Megatron's normalisation
    z = 0.01 * torch.logsumexp(logits, -1).square().mean()
    (y_plain.sum() + 2.0 * (aux + z)).backward()
    torch.testing.assert_close(y.detach(), y_plain.detach())
    torch.testing.assert_close(layer.router.weight.grad, plain.router.weight.grad)
    output_only = torch.autograd.grad(plain(x_bsh).sum(), plain.router.weight)[0]
    assert not torch.allclose(layer.router.weight.grad, output_only)  # the aux losses did contribute

    metrics, tokens_le = step.end(share=0.25, device=torch.device("cpu"))
    torch.testing.assert_close(metrics["moe_aux_loss"], 0.25 * aux.detach())  # one MoE layer: its value
    torch.testing.assert_close(metrics["moe_z_loss"], 0.25 * z.detach())
    assert tokens_le.tolist() == [tokens_e.float().tolist()]


def test_each_micro_batch_is_counted_once_under_activation_checkpointing():
    cfg = _moe_cfg("model.num_layers=2")
    model = GPTModel(cfg)
    step = MoEStep(model, cfg)
    step.begin(1.0, 1)
    ids = torch.randint(0, 512, (2, 16))
    x = model.embedding(ids)
    # every block recomputed in backward, as parallel/ checkpoints them; whole (early stop would end the
    # recompute at the block's last saved tensor, which may come before the layer's statistics)
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        for block in model.layers:
            x = torch.utils.checkpoint.checkpoint(block, x, None, None, use_reentrant=False)
        x.sum().backward()
    _, tokens_le = step.end(1.0, torch.device("cpu"))
    assert tokens_le.sum(1).tolist() == [2 * 16 * cfg.moe_router_topk] * 2


def test_moe_parameters_and_their_init_rules():
    cfg = _moe_cfg("model.moe_shared_expert_size=64", "model.num_layers=4", "model.moe_first_k_dense=1")
    model = GPTModel(cfg)
    names = {n for n, _ in model.named_parameters() if n.startswith("layers.1.mlp.")}
    assert names == {
        "layers.1.mlp.router.weight",
        "layers.1.mlp.experts.w_up",
        "layers.1.mlp.experts.w_down",
        "layers.1.mlp.shared_expert.up.weight",
        "layers.1.mlp.shared_expert.down.weight",
    }
    assert isinstance(model.layers[0].mlp, MLP) and isinstance(model.layers[3].mlp, MoELayer)
    rules = init_rules(model, cfg)
    std, out_std = cfg.init_method_std, cfg.init_method_std / math.sqrt(2 * 4)
    assert rules["layers.1.mlp.router.weight"].std == rules["layers.1.mlp.experts.w_up"].std == std
    assert rules["layers.1.mlp.experts.w_down"].std == out_std
    assert rules["layers.1.mlp.shared_expert.down.weight"].std == out_std
    assert rules["layers.0.mlp.down.weight"].std == out_std
    assert model.layers[1].mlp.experts.w_down.std().item() == pytest.approx(out_std, rel=0.1)


@pytest.mark.parametrize(
    "extra",
    [
        ["train.precision=bf16"],
        ["train.precision=bf16", "model.moe_capacity_factor=1.0"],
        ["train.precision=bf16", "model.moe_router_load_balancing=sinkhorn"],
        ["parallel.ep=2"],
    ],
    ids=["dropless", "capacity", "sinkhorn", "fp32-ep2"],
)
def test_an_moe_step_reads_nothing_on_the_host_between_logging_steps(extra):
    # fp32: torch's fake grouped GEMM takes bf16 only; the dry run stands in for it (engine_stubs)
    overrides = [
        "model.seq_length=32",
        "model.vocab_size=512",
        "train.micro_batch_size=2",
        "train.global_batch_size=16",
    ]
    cfg = resolve(load_config("tiny-moe", [*overrides, "parallel.zero_stage=3", *extra]), 8)
    out = dry.dry_run(cfg, 8, "cpu").to_dict()
    # expert parallelism reads each MoE layer's row counts once per micro-batch (parallel/expert.py)
    ep = "scalable_transformer/parallel/expert.py"
    ep_reads = (
        len(moe_layers(cfg.model)) * cfg.train.gradient_accumulation_steps if cfg.parallel.ep > 1 else 0
    )
    assert out["host_syncs_per_step"] == ep_reads, out["host_syncs"]
    logged = {s["where"].split(":")[0] for s in out["host_syncs"] if s["logging_step"]} - {ep}
    assert logged == {"scalable_transformer/train/measurement.py"}, out["host_syncs"]


def test_load_imbalance_is_the_worst_layers_max_over_mean():
    assert load_imbalance([2, 2, 2, 2, 1, 1, 1, 5], 4) == pytest.approx(2.5)
    assert load_imbalance([0, 0, 0, 0], 4) == 1.0


@pytest.mark.parametrize("ep", [1, 2])
def test_experts_are_sharded_over_every_rank_when_they_are_fewer_than_the_ranks(ep):
    # 8 experts over 16 ZeRO-3 ranks (ep 1), or 4 local experts over 8 edp ranks (ep 2): on dim 0 each
    # rank would hold a whole expert (twice its share); FSDP2 shards them on dim 1 instead
    overrides = ["model.seq_length=32", "model.vocab_size=512", "train.micro_batch_size=1"]
    cfg = resolve(load_config("tiny-moe", [*overrides, "parallel.zero_stage=3", f"parallel.ep={ep}"]), 16)
    out = dry.dry_run(cfg, 16, "cpu").to_dict()
    held = out["ranks"][0]["memory_breakdown_bytes"]["parameters"]
    with torch.device("meta"):
        total = sum(p.numel() for p in GPTModel(cfg.model).parameters())
    assert held == pytest.approx(4 * total / 16, rel=0.02)


def test_experts_that_split_evenly_on_no_dim_are_sharded_on_dim_0_padded():
    """4 experts of h 128 and 2f 256 over 3 ZeRO-2 ranks: no dim splits evenly, and FSDP2 takes uneven
    shards on dim 0 only (a sampled layout, small-78-18, failed to build on dim 1)."""
    overrides = ["model.seq_length=32", "model.vocab_size=512", "train.micro_batch_size=1"]
    overrides += ["model.num_experts=4", "model.moe_ffn_hidden_size=128", "parallel.zero_stage=2"]
    cfg = resolve(load_config("tiny-moe", overrides), 3)
    out = dry.dry_run(cfg, 3, "cpu").to_dict()
    assert out["ranks"][0]["memory_breakdown_bytes"]["parameters"] > 0


def test_the_loop_of_one_gemm_per_expert_dry_runs_with_one_read_per_layer_and_micro_batch():
    """fp16 experts run one GEMM per expert (F.grouped_mm takes fp32 and bf16), which reads each
    expert's rows on the host to split the input: the dry run answers the read as balanced routing
    (it used to answer zero rows and fail the split) and counts it."""
    overrides = ["model.seq_length=32", "model.vocab_size=512", "train.micro_batch_size=2"]
    overrides += ["train.global_batch_size=4", "train.precision=fp16", "parallel.pp=2"]
    cfg = resolve(load_config("tiny-moe", overrides), 2)
    out = dry.dry_run(cfg, 2, "cpu").to_dict()
    reads = [s for s in out["host_syncs"] if s["where"].startswith("scalable_transformer/models/moe.py")]
    plain = sum(s["count"] for s in reads if not s["logging_step"])
    # rank 0's: pipeline stage 0 holds half the MoE layers
    assert plain == len(moe_layers(cfg.model)) // 2 * cfg.train.gradient_accumulation_steps
