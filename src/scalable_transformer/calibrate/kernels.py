"""Calibration sections of one device's kernels: GEMMs at the config's layer shapes, attention forward
and backward for every SDPA kernel this device offers, and memory-bound kernels (bandwidth, fixed
cost per op). FLOP conventions: calibrate/calibration.py's docstring.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..config.model_shapes import (
    causal_attention,
    default_ffn_hidden_size,
    family_options,
    gated_mlp,
    qkv_width,
)
from ..config.rules import head_dim, padded_vocab_size
from ..config.schema import Config
from ..config.validate import resolve
from ..models.spec import IGNORE_INDEX, cross_entropy_sum
from ..parallel.torch_compat import sdpa_dispatch
from ..plan.speed import _layer_bytes, _loss_bytes, _shape
from .timing import DTYPES, Job, Section, _figure, _tflops, median_seconds


def model_dims(cfg: Config) -> dict[str, int]:
    """b, s, h, f (the up projection's width, 2 f when gated), qkv width, v, n heads, d head dim."""
    m = family_options(cfg.model)
    f = m.ffn_hidden_size or default_ffn_hidden_size(m)
    vocab = m.vocab_size or cfg.data.tokenizer_vocab_size
    return {
        "b": cfg.train.micro_batch_size,
        "s": m.seq_length,
        "h": m.hidden_size,
        "f": f,
        "up": 2 * f if gated_mlp(m) else f,
        "qkv": qkv_width(m),
        "v": padded_vocab_size(vocab, m.make_vocab_size_divisible_by),
        "heads": m.num_attention_heads,
        "d": head_dim(m),
    }


def gemm_shapes(cfg: Config, quick: bool = False) -> list[tuple[int, int, int]]:
    """(m, n, k) of the layer's GEMMs at tp 1 and 2 (qkv, attention out, MLP up and down, logits),
    each with its two backward GEMMs (grad-input (m, k, n), grad-weight (n, k, m)), plus
    the forward shapes at a quarter, half and twice the rows, so the model can interpolate in m.
    Sorted by work, smallest first: a section out of budget drops the biggest."""
    d = model_dims(cfg)
    rows = d["b"] * d["s"]
    forward: list[tuple[int, int, int]] = []
    for tp in (1, 2):
        forward += [
            (rows, d["qkv"] // tp, d["h"]),  # column-parallel: output columns split
            (rows, d["h"], d["heads"] * d["d"] // tp),  # row-parallel: inner dimension (n d) split
            (rows, d["up"] // tp, d["h"]),
            (rows, d["h"], d["f"] // tp),
            (rows, d["v"] // tp, d["h"]),
        ]
    shapes = set()
    for m, n, k in forward:
        shapes |= {(m, n, k), (m, k, n), (n, k, m)}
    scales = (0.5, 2.0) if quick else (0.25, 0.5, 2.0)
    for m, n, k in forward[:4] if quick else forward:
        shapes |= {(max(1, int(m * x)), n, k) for x in scales}
    shapes = {s for s in shapes if min(s) >= 1}
    return sorted(shapes, key=lambda s: (s[0] * s[1] * s[2], s))


def measure_gemm(job: Job, shapes: list[tuple[int, int, int]], dtype: str, say=print) -> list[dict]:
    """TFLOP/s of out[m, n] = a[m, k] @ b[k, n] in `dtype` per shape (2 m n k FLOPs), averaged over ranks."""
    section = Section(job, "gemm", len(shapes), say)
    out: list[dict[str, Any]] = []
    for m, n, k in shapes:
        if not section.go():
            break
        (seconds,) = job.mean([_gemm_seconds(job, m, n, k, dtype, section.per_point())])
        out.append({"dtype": dtype, "m": m, "n": n, "k": k, "tflops": _tflops(2 * m * n * k, seconds)})
        section.done += 1
    best = max((float(p["tflops"]) for p in out), default=0.0)
    section.finish(f"{len(out)} shapes, best {best:.3g} TFLOP/s {dtype}")
    return out


# Each timed GEMM reads operands that are not in the processor's cache, as a training step's are (a
# layer's weights were last touched a whole step of other work ago): the calls rotate through copies
# of a and b that together take at least this many bytes, more than a core's L2 (1-2 MiB), an AMD
# EPYC's L3 per core complex (32 MiB) or an H100's L2 (50 MB). Triton's do_bench flushes a 256 MB
# buffer between calls for the same reason; rotating costs no flush time.
COLD_BYTES = 64 * 2**20


MAX_COPIES = 64


def _gemm_seconds(job: Job, m: int, n: int, k: int, dtype: str, seconds: float) -> float:
    gen = torch.Generator(device=job.device).manual_seed(0)
    a = torch.randn(m, k, generator=gen, device=job.device).to(DTYPES[dtype])
    b = torch.randn(k, n, generator=gen, device=job.device).to(DTYPES[dtype])
    pair = a.numel() * a.element_size() + b.numel() * b.element_size()
    copies = max(1, min(MAX_COPIES, -(-COLD_BYTES // pair)))
    operands = [(a, b)] + [(a.clone(), b.clone()) for _ in range(copies - 1)]
    calls = itertools.count()
    return median_seconds(job, lambda: torch.mm(*operands[next(calls) % copies]), seconds)


# the SDPA kernels by their hardware-profile name -> torch.nn.attention.SDPBackend member
BACKENDS = {
    "flash": "FLASH_ATTENTION",
    "mem_efficient": "EFFICIENT_ATTENTION",
    "math": "MATH",
    "cudnn": "CUDNN_ATTENTION",
}


KERNELS = tuple(BACKENDS)


def _backend(kernel: str) -> Any:

    return getattr(SDPBackend, BACKENDS[kernel])


def dispatched_kernel(job: Job, cfg: Config, dtype: str) -> str | None:
    """The kernel scaled_dot_product_attention takes here for the config's attention call (its
    micro-batch, heads, sequence, head dim, dtype, causality and attention dropout): what `stx plan`
    times on a GPU. None when torch does not say."""

    d = model_dims(cfg)
    shape = (d["b"], d["heads"], d["s"], d["d"])
    q = torch.empty(shape, device=job.device, dtype=DTYPES[dtype], requires_grad=True)  # as in training
    backend = sdpa_dispatch(q, q, q, cfg.model.attention_dropout, causal_attention(cfg.model))
    kernels = {name: kernel for kernel, name in BACKENDS.items()}
    return kernels.get(backend.name) if backend is not None else None


def available_kernels(job: Job, dtype: str) -> list[str]:
    """The SDPA kernels that run here in `dtype`, forward and backward, causal (tried on a tiny input);
    the same list on every rank (a kernel counts only when every rank has it)."""

    found = []
    for kernel in KERNELS:
        q = torch.randn(1, 2, 16, 64, device=job.device, dtype=DTYPES[dtype], requires_grad=True)
        try:
            with sdpa_kernel([_backend(kernel)]):
                torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
            ok = True
        except RuntimeError:  # "No available kernel": this device/dtype has no such backend
            ok = False
        if job.agree(ok):
            found.append(kernel)
    return found


def attention_cases(cfg: Config, quick: bool = False) -> list[dict]:
    """(batch, heads, seq_len, head_dim, causal): the config's micro-batch and heads at tp 1 and 2,
    its sequence length and half and twice it (quick: its own only), causal and not."""
    d = model_dims(cfg)
    heads = sorted({d["heads"], max(1, d["heads"] // 2)}, reverse=True)
    seqs = [d["s"]] if quick else sorted({max(16, d["s"] // 2), d["s"], 2 * d["s"]})
    return [
        {"batch": d["b"], "heads": n, "seq_len": s, "head_dim": d["d"], "causal": causal}
        for s in seqs
        for n in heads
        for causal in (True, False)
    ]


def attention_flops(case: dict) -> float:
    """Forward FLOPs of one attention call: 4 b n s^2 d, half when causal (the backward: 2.5 x)."""
    full = 4 * case["batch"] * case["heads"] * case["seq_len"] ** 2 * case["head_dim"]
    return full / 2 if case["causal"] else full


def measure_attention(job: Job, cases: list[dict], dtype: str, say=print) -> list[dict]:
    """Forward and backward TFLOP/s of SDPA per available kernel and case (no dropout: the kernel
    alone), averaged over the ranks; a kernel that fails at a case's size (memory) is left out there."""

    kernels = available_kernels(job, dtype)
    section = Section(job, "attention", len(kernels) * len(cases), say)
    out: list[dict] = []
    for case in cases:
        for kernel in kernels:
            if not section.go():
                break
            shape = (case["batch"], case["heads"], case["seq_len"], case["head_dim"])
            with sdpa_kernel([_backend(kernel)]):
                times = _attention_times(job, shape, case["causal"], dtype, section.per_point())
            ok = job.agree(times is not None)
            fwd, bwd = job.mean(list(times)) if ok and times else (0.0, 0.0)
            section.done += 1
            if not ok:
                continue
            flops = attention_flops(case)
            for name, seconds, work in (("fwd", fwd, flops), ("bwd", bwd, 2.5 * flops)):
                out.append(
                    {"kernel": kernel, "dtype": dtype, **case, "pass": name, "tflops": _tflops(work, seconds)}
                )
    section.finish(f"{len(out)} points, kernels {', '.join(kernels) or 'none'}")
    return out


def _attention_times(
    job: Job, shape: tuple[int, int, int, int], causal: bool, dtype: str, seconds: float
) -> tuple[float, float] | None:
    """(forward, backward) seconds of one SDPA call with inputs that need gradients, or None when
    the kernel refuses the input (too large for it)."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    gen = torch.Generator(device=job.device).manual_seed(0)
    q, k, v = (
        torch.randn(shape, generator=gen, device=job.device).to(DTYPES[dtype]).requires_grad_()
        for _ in range(3)
    )
    grad = torch.randn(shape, generator=gen, device=job.device).to(DTYPES[dtype])
    try:
        fwd = median_seconds(job, lambda: sdpa(q, k, v, is_causal=causal), seconds / 2)
        out = sdpa(q, k, v, is_causal=causal)
        bwd = median_seconds(
            job, lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True), seconds / 2
        )
    except (RuntimeError, torch.OutOfMemoryError):
        return None
    return fwd, bwd


def measure_memory_bound(job: Job, cfg: Config | None = None, say=print) -> dict:
    """Achievable bandwidth of elementwise kernels on tensors far beyond the caches (GB/s: bytes read
    + written / s; the median of copy, scale and add) and the fixed cost of one dispatched op (us: a
    chain of tiny ops with autograd, forward and backward, per op), averaged over the ranks.
    On a CPU, given the model, also `activation_gbps`: its layers' and loss's own elementwise ops at
    its shapes (`_activation_gbps`), which a CPU runs well below a copy's bandwidth."""
    activation = cfg is not None and not job.cuda
    section = Section(job, "memory_bound", 5 if activation else 4, say)
    rates = _bandwidths(job, section)
    bandwidth = sorted(rates)[len(rates) // 2] if rates else 0.0
    overhead = _op_overhead(job, section.per_point()) if section.go() else 0.0
    section.done += 1
    figures = [bandwidth, overhead]
    if activation and section.go():
        assert cfg is not None
        figures.append(_activation_gbps(job, cfg, section.per_point()))
        section.done += 1
    figures = job.mean(figures)
    out = {"bandwidth_gbps": _figure(figures[0]), "op_overhead_us": _figure(figures[1] * 1e6)}
    what = f"{figures[0]:.1f} GB/s elementwise, {figures[1] * 1e6:.1f} us per op"
    if len(figures) > 2 and figures[2] > 0:
        out["activation_gbps"] = _figure(figures[2])
        what += f", {figures[2]:.2f} GB/s in the model's own elementwise ops"
    section.finish(what)
    return out


def _activation_gbps(job: Job, cfg: Config, seconds: float) -> float:
    """GB/s of the elementwise work plan/speed.py counts in bytes, run as a step runs it at the
    model's shapes on one rank (tp 1): per layer two layer norms, the activation (SiLU-gated or
    GELU), two residual adds, the hidden dropouts when the model has them and the math attention
    path's softmax (the dropout of its probabilities, the head split and merge copies), each
    forward and backward; and the model's fp32 cross-entropy over the vocabulary
    (models.spec.cross_entropy_sum) with its backward. The rate is the planner's byte count over
    the measured time, the layers weighted by their number, so that the planner, reading it back,
    predicts the measured time."""

    _, sh = _one_rank(cfg)
    dtype = DTYPES[sh.dtype]
    gen = torch.Generator().manual_seed(0)

    def tensor(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen).to(dtype)

    x0, a0 = tensor(sh.tokens, sh.h), tensor(sh.tokens, (2 if sh.gated else 1) * sh.f)
    scores0 = tensor(sh.b, sh.n, sh.s, sh.s) if sh.kernel == "math" else None
    logits0 = tensor(sh.tokens, sh.v)
    p, p_attention = cfg.model.hidden_dropout, cfg.model.attention_dropout

    def layer() -> None:
        x, a = x0.detach().requires_grad_(), a0.detach().requires_grad_()
        normed = F.layer_norm(x, (sh.h,))
        r1 = (F.dropout(normed, p, True) if sh.dropout else normed) + x
        normed2 = F.layer_norm(r1, (sh.h,))
        r2 = (F.dropout(normed2, p, True) if sh.dropout else normed2) + r1
        if sh.gated:
            gate, up = a.chunk(2, dim=-1)
            act = F.silu(gate) * up
        else:
            act = F.gelu(a)
        outs = [r2, act]
        if scores0 is not None:
            probs = torch.softmax(scores0.float().detach().requires_grad_(), dim=-1)
            outs.append(F.dropout(probs, p_attention, True) if sh.attention_dropout else probs)
            # the head split of q, k, v (g key/value heads) and the merge of the output: copies
            for heads in (sh.n, sh.g, sh.g, sh.n):
                part = x[:, : heads * sh.d].reshape(sh.b, sh.s, heads, sh.d)
                outs.append(part.transpose(1, 2).reshape(sh.b * heads, sh.s, sh.d))
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

    labels0 = torch.randint(0, sh.v, (sh.tokens,), generator=gen)

    def loss() -> None:
        logits = logits0.detach().requires_grad_()
        cross_entropy_sum(logits, labels0, IGNORE_INDEX).backward()

    layer_s = median_seconds(job, layer, seconds / 2)
    loss_s = median_seconds(job, loss, seconds / 2)
    layers = cfg.model.num_layers
    layer_bytes = 3 * _layer_bytes(sh)  # forward, and backward counted as twice the forward
    loss_bytes = sum(_loss_bytes(sh))
    return (layers * layer_bytes + loss_bytes) / (layers * layer_s + loss_s) / 1e9


def _op_overhead(job: Job, seconds: float) -> float:
    x = torch.ones(8, 8, device=job.device, requires_grad=True)

    def chain() -> None:
        y = x
        for _ in range(100):
            y = y * 1.0
        y.sum().backward()

    return median_seconds(job, chain, seconds) / 201  # 100 forward, 100 backward, the sum


def _bandwidths(job: Job, section: Section) -> list[float]:
    """Bytes/s of copy, scale and add (read + written) on fp32 tensors beyond the caches."""
    numel = (256 if job.cuda else 16) * 2**20  # 1 GiB / 64 MiB: beyond an L2 / a last-level cache
    if job.quick and not job.cuda:
        numel = 4 * 2**20
    a = torch.ones(numel, device=job.device)
    b, c = torch.empty_like(a), torch.ones_like(a)
    kernels = (
        (lambda: b.copy_(a), 2),
        (lambda: torch.mul(a, 1.5, out=b), 2),
        (lambda: torch.add(a, c, out=b), 3),
    )
    rates = []
    for fn, passes in kernels:
        if not section.go():
            break
        rates.append(passes * numel * 4 / median_seconds(job, fn, section.per_point()) / 1e9)
        section.done += 1
    return rates


def _one_rank(cfg: Config) -> tuple[Any, Any]:
    """(the config resolved for one rank at tp 1 without recomputation, its time-model shape): the
    model and micro-batch alone, whatever layout the config names."""

    one_rank = copy.deepcopy(cfg)
    one_rank.parallel.tp = one_rank.parallel.pp = 1
    one_rank.parallel.dp = -1
    one_rank.parallel.sequence_parallel = False
    one_rank.parallel.zero_stage = 0
    one_rank.parallel.activation_checkpointing = "none"
    one_rank.train.global_batch_size = None
    one_rank.train.gradient_accumulation_steps = None
    resolved = resolve(one_rank, 1)
    return resolved, dataclasses.replace(_shape(resolved, "cpu"), tp=1, sp=False)
