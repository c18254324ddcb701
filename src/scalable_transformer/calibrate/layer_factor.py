"""Calibration section `model_layer` (on a CPU): the model's own layer and head timed against the sum of
their kernels as the time model adds them (`measure_model_layer`, the profile's `layer_factors`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..config.schema import Config
from ..models.layers import TransformerBlock, rotary_for
from ..models.spec import IGNORE_INDEX, cross_entropy_sum
from ..plan.cluster import profile_cluster
from ..plan.hardware_profile import profile_from_dict
from ..plan.speed import model_layer_seconds
from .kernels import _one_rank
from .timing import DTYPES, Job, Section, _figure, median_seconds

# the model layer point's depth: the second block's input is the first one's output, as in a model
LAYER_BLOCKS = 2


def measure_model_layer(job: Job, cfg: Config, measured: dict[str, Any], say=print) -> dict[str, float]:
    """CPU: `layer_factors`, the model's own code at its shapes on one rank (tp 1) timed forward and
    backward over what the time model predicts for it from the points just measured (`measured`,
    the profile so far): "layer", LAYER_BLOCKS of the config's TransformerBlock (models/layers.py,
    with its dropouts and its padding mask or rotary tables), per block; "head", its logits GEMM
    with the fp32 cross-entropy over the vocabulary (models.spec.cross_entropy_sum, in place as
    training runs it). What a real layer adds to its kernels timed one by one (operands arriving
    cold from the op before, the dropout masks' RNG, the mask and rotary work, autograd's
    bookkeeping, and on shared cores the other ranks) is in the factor. Its ratio held at
    micro-batches of 2, 4 and 8 alike (x1.24-1.26 on this project's CPU against a profile three
    hours old), so it is a factor and not a fixed cost per layer; a fresh calibration put it at
    x1.05 for one process and x1.57 for each of 4 processes sharing 2 cores. Averaged over the
    ranks, which run it together as a layout's ranks run their layers. Empty on a GPU (not
    measured there yet) or when the budget allowed no point."""
    if job.cuda:
        return {}

    resolved, sh = _one_rank(cfg)
    dtype = DTYPES[sh.dtype]
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(TransformerBlock(resolved.model, sh.causal) for _ in range(LAYER_BLOCKS))
    blocks.to(dtype)
    x0 = torch.randn(sh.b, sh.s, sh.h, generator=gen).to(dtype)
    mask = None if sh.causal else torch.ones(sh.b, 1, 1, sh.s, dtype=torch.bool)  # BERT's padding mask
    tables = rotary_for(resolved.model)
    rotary = None if tables is None else tables(sh.s)

    def layers() -> None:
        x = x0.detach().requires_grad_()
        y = x
        for block in blocks:
            y = block(y, mask, rotary)
        y.sum().backward()
        for p in blocks.parameters():
            p.grad = None

    hidden0 = torch.randn(sh.tokens, sh.h, generator=gen).to(dtype)
    weight = (torch.randn(sh.v, sh.h, generator=gen) / sh.h**0.5).to(dtype).requires_grad_()
    labels0 = torch.randint(0, sh.v, (sh.tokens,), generator=gen)

    def head() -> None:
        hidden = hidden0.detach().requires_grad_()
        cross_entropy_sum(F.linear(hidden, weight), labels0, IGNORE_INDEX).backward()
        weight.grad = None

    section = Section(job, "model_layer", 2, say)
    timed: list[float] = []
    for fn, per in ((layers, LAYER_BLOCKS), (head, 1)):
        if not section.go():
            break
        timed.append(median_seconds(job, fn, section.per_point()) / per)
        section.done += 1
    timed = job.mean(timed)
    predicted = model_layer_seconds(profile_cluster(profile_from_dict(measured, "<this calibration>"), 1), sh)
    factors = {
        key: _figure(t / p) for key, t, p in zip(("layer", "head"), timed, predicted, strict=False) if p > 0
    }
    parts = [f"{k} {timed[i] * 1e3:.2f} ms measured / {predicted[i] * 1e3:.2f} ms from the kernels"
             for i, k in enumerate(factors)]  # fmt: skip
    section.finish("the model's own " + "; ".join(parts) if parts else "no point")
    return factors
