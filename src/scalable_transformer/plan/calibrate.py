"""`stx calibrate`: measure the constants of the planner's op-class time model on this machine.

Every rank of the job measures at once (as training runs them), in seven sections, each with a time
budget: GEMMs at the config's layer shapes, attention forward and backward for every SDPA kernel
this device offers, memory-bound kernels (bandwidth, fixed cost per op), on a CPU the model's own
layer and head against the sum of their kernels (`measure_model_layer`, `layer_factors`), the
collectives between the ranks (world > 1), the fixed cost of an FSDP unit's collective beyond its
bytes (world > 1: `measure_fsdp_unit`, `unit_overhead_us`) and of a tensor-parallel layer (world >
1: `measure_tp_layer`, `tp_layer_overhead_us`). Rank 0 gathers the results into a hardware profile
(plan/hardware_profile.py's format 1) that `stx plan --hardware` reads.

Timing: CUDA events around each call on a GPU, `time.perf_counter` on a CPU; each point keeps the
median of its repeats after a warm-up call, and the ranks' figures are averaged (compute) or the
slowest taken (collectives, which end together). The median, not the fastest: the planner predicts
the median step a run measures (`median_iteration_seconds`); on this project's shared 2-core CPU the
time model's median |error| over 15 layouts was 20.5% with fastest-repeat profiles and 17.3% with
median-repeat ones taken right after them (benchmarks/results/plan_accuracy_profile.md).
Before every point the ranks agree whether the section's budget allows it, so they always call
the same collectives in the same order, and a section over budget stops early instead of running on.

FLOP conventions (what the `tflops` figures mean):
- a GEMM (M, N, K): 2 M N K;
- attention forward: 4 b n s^2 d (q k^T and p v), half that when causal; backward 2.5 x forward
  (five matmuls of the same size: the FlashAttention-2 paper's count).
Bus bandwidth of a collective (nccl-tests' definitions, size = the whole tensor): all-reduce
2 (n-1)/n size / t; all-gather and reduce-scatter (n-1)/n size / t; send/recv size / t.

Shape legend: m, n, k GEMM dims (out = [m, k] @ [k, n]); b micro-batch, s sequence, h hidden,
f ffn, v padded vocabulary, n heads, d head dim.
"""

from __future__ import annotations

import contextlib
import copy
import datetime as dt
import itertools
import os
import socket
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..config.model_shapes import (
    causal_attention,
    default_ffn_hidden_size,
    family_options,
    gated_mlp,
    qkv_width,
)
from ..config.rules import padded_vocab_size, physical_memory_bytes
from ..config.schema import Config

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SECTIONS = ("gemm", "attention", "memory_bound", "model_layer", "collectives", "fsdp_unit", "tp_layer")
# seconds per section: the whole run stays under 3 minutes on 2 busy CPU cores with process startup
BUDGET_SECONDS = {
    "gemm": 40.0, "attention": 30.0, "memory_bound": 8.0, "model_layer": 8.0, "collectives": 40.0,
    "fsdp_unit": 15.0, "tp_layer": 15.0,
}  # fmt: skip
QUICK_BUDGET_SECONDS = {
    "gemm": 4.0, "attention": 3.0, "memory_bound": 1.5, "model_layer": 1.5, "collectives": 4.0,
    "fsdp_unit": 2.0, "tp_layer": 4.0,
}  # fmt: skip
# the FSDP unit point: this many blocks, each at most this many parameters (a GPU model's blocks are
# scaled down: the fixed cost per unit is what it measures, and plain + sharded copies must fit)
FSDP_UNITS = 4
FSDP_UNIT_MAX_PARAMS = 16 * 2**20
MAX_REPEATS = 20
COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")
MESSAGE_SIZES = tuple(4 * 2**10 * 4**i for i in range(9))  # 4 KiB .. 64 MiB, x4 apart
QUICK_MESSAGE_SIZES = (4 * 2**10, 256 * 2**10, 4 * 2**20)


@dataclass
class Job:
    """This process's place in the calibration job: its device (cuda:LOCAL_RANK, or cpu), rank, world
    size, each rank's host name, and the budgets it runs under (`quick`: a tenth). The helpers below
    combine figures over the default process group (or `group`); with one process they return them."""

    device: torch.device
    rank: int = 0
    world: int = 1
    quick: bool = False
    hosts: list[str] = field(default_factory=list)  # hostname per rank

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def budget(self, section: str) -> float:
        return (QUICK_BUDGET_SECONDS if self.quick else BUDGET_SECONDS)[section]

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def reduce(self, values: list[float], op: Any = None, group: Any = None) -> list[float]:
        """values combined over the ranks (of `group`): SUM by default, or dist.ReduceOp.MAX."""
        if self.world == 1:
            return list(values)
        where = self.device if self.cuda else torch.device("cpu")
        t = torch.tensor(values, dtype=torch.float64, device=where)
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=group)
        return t.tolist()

    def agree(self, go: bool, group: Any = None) -> bool:
        """True when every rank says go: the ranks take the same branch, so collectives stay matched."""
        return self.reduce([0.0 if go else 1.0], dist.ReduceOp.MAX, group)[0] == 0.0

    def mean(self, values: list[float]) -> list[float]:
        return [v / self.world for v in self.reduce(values)]


def median_seconds(job: Job, fn: Callable[[], Any], seconds: float, repeats: int = MAX_REPEATS) -> float:
    """Seconds of the median of up to `repeats` calls of fn within about `seconds`, at least 3 when
    they fit in it (after one warm-up call, not counted): CUDA events on a GPU, perf_counter on a CPU."""
    fn()
    job.sync()
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    for i in range(max(1, repeats)):
        if job.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            took = start.elapsed_time(end) / 1000
        else:
            t0 = time.perf_counter()
            fn()
            took = time.perf_counter() - t0
        times.append(took)
        # at least 3 calls unless one alone takes the time given: the median of 3 sets aside one
        # call that met a preemption
        if time.perf_counter() > deadline and (i >= 2 or took > seconds):
            break
    return statistics.median(times)


class Section:
    """A section's budget: `go()` before each point (agreed by all ranks), a progress line at the end."""

    def __init__(self, job: Job, name: str, points: int, say: Callable[[str], None]) -> None:
        self.job, self.name, self.points, self.say = job, name, max(1, points), say
        self.budget = job.budget(name)
        self.start = time.perf_counter()
        self.done = 0

    def per_point(self) -> float:
        """Seconds of repeats each point may spend: the budget left shared by the points left."""
        left = self.budget - (time.perf_counter() - self.start)
        return max(0.0, left) / max(1, self.points - self.done) * 0.8

    def go(self) -> bool:
        """Whether the next point runs: within budget on every rank (the first point always runs)."""
        within = self.done == 0 or time.perf_counter() - self.start < self.budget
        return self.job.agree(within)

    def finish(self, what: str) -> None:
        took = time.perf_counter() - self.start
        skipped = self.points - self.done
        note = f"; {skipped} point(s) skipped: budget spent" if skipped > 0 else ""
        self.say(f"calibrate: {self.name}: {what} in {took:.1f} s (budget {self.budget:.0f} s){note}")


# ---------------------------------------------------------------------------- GEMMs


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
        "d": m.hidden_size // m.num_attention_heads,
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
            (rows, d["h"], d["h"] // tp),  # row-parallel: inner dimension split
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


def _tflops(flops: float, seconds: float) -> float:
    return _figure(flops / max(seconds, 1e-12) / 1e12)


def _figure(x: float) -> float:
    """x to 4 significant digits (a profile stays readable; timing noise is larger than that)."""
    return float(f"{x:.4g}")


# ---------------------------------------------------------------------------- attention

# the SDPA kernels by their hardware-profile name -> torch.nn.attention.SDPBackend member
BACKENDS = {
    "flash": "FLASH_ATTENTION",
    "mem_efficient": "EFFICIENT_ATTENTION",
    "math": "MATH",
    "cudnn": "CUDNN_ATTENTION",
}
KERNELS = tuple(BACKENDS)


def _backend(kernel: str) -> Any:
    from torch.nn.attention import SDPBackend

    return getattr(SDPBackend, BACKENDS[kernel])


def dispatched_kernel(job: Job, cfg: Config, dtype: str) -> str | None:
    """The kernel scaled_dot_product_attention takes here for the config's attention call (its
    micro-batch, heads, sequence, head dim, dtype, causality and attention dropout): what `stx plan`
    times on a GPU. None when torch does not say."""
    from ..parallel.torch_compat import sdpa_dispatch

    d = model_dims(cfg)
    shape = (d["b"], d["heads"], d["s"], d["d"])
    q = torch.empty(shape, device=job.device, dtype=DTYPES[dtype], requires_grad=True)  # as in training
    backend = sdpa_dispatch(q, q, q, cfg.model.attention_dropout, causal_attention(cfg.model))
    kernels = {name: kernel for kernel, name in BACKENDS.items()}
    return kernels.get(backend.name) if backend is not None else None


def available_kernels(job: Job, dtype: str) -> list[str]:
    """The SDPA kernels that run here in `dtype`, forward and backward, causal (tried on a tiny input);
    the same list on every rank (a kernel counts only when every rank has it)."""
    from torch.nn.attention import sdpa_kernel

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
    from torch.nn.attention import sdpa_kernel

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


# ---------------------------------------------------------------------------- memory-bound kernels


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
    import torch.nn.functional as F

    from ..models.spec import IGNORE_INDEX, cross_entropy_sum
    from .speed import _layer_bytes, _loss_bytes

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
    import torch.nn.functional as F

    from ..models.layers import TransformerBlock, rotary_for
    from ..models.spec import IGNORE_INDEX, cross_entropy_sum
    from .cluster import profile_cluster
    from .hardware_profile import profile_from_dict
    from .speed import model_layer_seconds

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


def _one_rank(cfg: Config) -> tuple[Any, Any]:
    """(the config resolved for one rank at tp 1 without recomputation, its time-model shape): the
    model and micro-batch alone, whatever layout the config names."""
    import dataclasses

    from ..config.validate import resolve
    from .speed import _shape

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


def _op_overhead(job: Job, seconds: float) -> float:
    x = torch.ones(8, 8, device=job.device, requires_grad=True)

    def chain() -> None:
        y = x
        for _ in range(100):
            y = y * 1.0
        y.sum().backward()

    return median_seconds(job, chain, seconds) / 201  # 100 forward, 100 backward, the sum


def host_link_gbps(job: Job) -> float:
    """GB/s of a pinned host -> device copy of 256 MiB (GPU); this CPU: its elementwise bandwidth."""
    if not job.cuda:
        return 0.0
    host = torch.empty(64 * 2**20, pin_memory=True)
    dev = torch.empty(64 * 2**20, device=job.device)
    seconds = median_seconds(job, lambda: dev.copy_(host, non_blocking=True), 1.0, 5)
    return _figure(host.numel() * 4 / seconds / 1e9)


# ---------------------------------------------------------------------------- collectives


def _busbw_factor(op: str, n: int) -> float:
    return {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n}.get(
        op, 1.0
    )


def _collective(op: str, size: int, group: Any, n: int, me: int, device: torch.device) -> Callable[[], Any]:
    """One call of `op` moving `size` bytes in all (nccl-tests' size: the whole tensor; send_recv:
    each rank sends `size` bytes to the next rank of the group and receives from the one before)."""
    numel = max(n, size // 4 // n * n)  # fp32, divisible by the group for the sharded ops
    full = torch.ones(numel, device=device)
    part = torch.ones(numel // n, device=device)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(n))
    if op == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    if op == "all_gather":
        return lambda: dist.all_gather_single(full, part, group=group)
    if op == "reduce_scatter":
        return lambda: dist.reduce_scatter_single(part, full, group=group)
    recv = torch.empty_like(full)
    dst, src = ranks[(me + 1) % n], ranks[(me - 1) % n]

    def send_recv() -> None:
        works = dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, full, dst, group), dist.P2POp(dist.irecv, recv, src, group)]
        )
        for w in works:
            w.wait()

    return send_recv


def _time_collective(job: Job, fn: Callable[[], Any], repeats: int, group: Any) -> float:
    """Seconds of the median of `repeats` calls, each started together (barrier) and counted until
    the slowest rank of the group is done; every rank returns the same figure."""
    fn()
    job.sync()
    times: list[float] = []
    for _ in range(repeats):
        dist.barrier(group=group)
        job.sync()
        t0 = time.perf_counter()
        fn()
        job.sync()
        times.append(time.perf_counter() - t0)
    return job.reduce([statistics.median(times)], dist.ReduceOp.MAX, group)[0]


def collective_groups(job: Job) -> list[tuple[str, Any, int, int]]:
    """(scope, group, its size, this rank's index in it): the ranks of this node (intra_node, when
    every node holds two or more), the smaller groups inside a node (`_sub_node_groups`) and, when
    the job spans nodes, all ranks (inter_node). Every rank creates every group (new_group is
    collective), in the same order."""
    nodes = sorted(set(job.hosts), key=job.hosts.index)
    per_node = {host: [r for r, h in enumerate(job.hosts) if h == host] for host in nodes}
    if len(nodes) == 1:
        whole = [("intra_node", None, job.world, job.rank)] if job.world > 1 else []
        return whole + _sub_node_groups(job, per_node)
    out: list[tuple[str, Any, int, int]] = []
    groups = {host: dist.new_group(ranks) for host, ranks in per_node.items()}
    mine = per_node[job.hosts[job.rank]]
    # every rank must run the same sections: intra_node only when every node has two ranks or more
    if min(len(r) for r in per_node.values()) > 1:
        out.append(("intra_node", groups[job.hosts[job.rank]], len(mine), mine.index(job.rank)))
        out += _sub_node_groups(job, per_node)
    return [*out, ("inter_node", None, job.world, job.rank)]


def _sub_node_groups(job: Job, per_node: dict[str, list[int]]) -> list[tuple[str, Any, int, int]]:
    """intra_node groups of k consecutive ranks, for every power of two 2 <= k < the ranks of a node
    that divides every node's: each node's ranks split into such groups, all timed at once, as a
    layout's tensor- or data-parallel groups run side by side. A collective of 2 of a node's 8 GPUs
    (NVLink pairs under NVSwitch) or of 2 of 4 processes sharing 2 CPU cores is not the full node's
    curve scaled by its ring factor (measured on 4 processes on 2 cores: 0.3-0.5 ms for a 2-rank
    all-reduce of 4-256 KiB, where the scaled 4-rank curve said 1.6 ms)."""
    out: list[tuple[str, Any, int, int]] = []
    for k in _smaller_group_sizes([len(ranks) for ranks in per_node.values()]):
        blocks = [ranks[i : i + k] for ranks in per_node.values() for i in range(0, len(ranks), k)]
        groups = [dist.new_group(block) for block in blocks]  # every rank creates every group
        (index,) = [i for i, block in enumerate(blocks) if job.rank in block]
        out.append(("intra_node", groups[index], k, blocks[index].index(job.rank)))
    return out


def _smaller_group_sizes(counts: list[int]) -> list[int]:
    """The powers of two 2 <= k < min(counts) that divide every count (ranks per node): the group
    sizes a node's ranks split into evenly, short of the whole node."""
    sizes = (2**i for i in range(1, min(counts).bit_length()))
    return [k for k in sizes if k < min(counts) and all(c % k == 0 for c in counts)]


def measure_collectives(job: Job, say=print) -> list[dict]:
    """Time and bus bandwidth of each collective at each message size, per scope: the ranks of one
    node, and across nodes. Rank 0's node's figures are kept for intra_node. Empty for one process."""
    if job.world == 1:
        say("calibrate: collectives: one process, nothing to measure")
        return []
    sizes = QUICK_MESSAGE_SIZES if job.quick else MESSAGE_SIZES
    groups = collective_groups(job)
    section = Section(job, "collectives", len(COLLECTIVE_OPS) * len(sizes) * len(groups), say)
    out: list[dict] = []
    # sizes outermost: a section out of budget drops the largest messages of every op and scope
    for size in sizes:
        for scope, group, n, me in groups:
            for op in COLLECTIVE_OPS:
                if not section.go():
                    break
                repeats = 3 if job.quick else int(min(MAX_REPEATS, max(3, 2**24 // size)))
                fn = _collective(op, size, group, n, me, job.device)
                seconds = _time_collective(job, fn, repeats, group)
                seconds = job.reduce([seconds], dist.ReduceOp.MAX)[0]  # the other nodes' groups too
                section.done += 1
                busbw = _busbw_factor(op, n) * size / seconds / 1e9
                out.append(
                    {"op": op, "scope": scope, "ranks": n, "size_bytes": size,
                     "time_us": _figure(seconds * 1e6), "busbw_gbps": _figure(busbw)}
                )  # fmt: skip
    best = max((c["busbw_gbps"] for c in out), default=0.0)
    section.finish(f"{len(out)} points, best bus bandwidth {best:.2f} GB/s")
    return out


# ---------------------------------------------------------------------------- FSDP units


@dataclass
class FsdpUnitTiming:
    """What the FSDP unit point measured: the extra seconds of a forward + backward of FSDP_UNITS
    blocks sharded one per unit (ZeRO-3: gathered in forward and again in backward, gradients
    reduce-scattered) over the same blocks unsharded, and the collectives FSDP2 issued in it as
    (op, bytes of the whole tensor)."""

    extra_seconds: float
    calls: list[tuple[str, int]]
    scope: str


def _unit_dims(cfg: Config) -> tuple[int, int, int]:
    """(rows, h, f) of the point's blocks: the micro-batch's tokens and the model's widths, both
    widths scaled down together when a block would exceed FSDP_UNIT_MAX_PARAMS."""
    d = model_dims(cfg)
    h, f = d["h"], d["f"]
    scale = min(1.0, (FSDP_UNIT_MAX_PARAMS / (4 * h * h + 2 * h * f)) ** 0.5)
    return d["b"] * d["s"], max(8, int(h * scale)), max(8, int(f * scale))


def measure_fsdp_unit(job: Job, cfg: Config, say=print) -> FsdpUnitTiming | None:
    """Time FSDP_UNITS transformer-sized blocks (an attention-sized pair of linears, 4 h^2, and the
    MLP's, 2 h f) forward and backward, plain and under FSDP2 (`fully_shard` per block, as
    parallel/apply.py shards a model), alternating, and count the collectives FSDP2 issues by
    wrapping torch.distributed's all_gather_single / reduce_scatter_single for one call. The
    planner's share of the difference, the collectives' bytes on this profile's curves, is taken
    out in `unit_overhead_us`; what is left is the fixed cost per unit collective (hooks, copy-in
    and copy-out, the ranks meeting). None with one process."""
    if job.world == 1:
        return None
    from unittest import mock

    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    section = Section(job, "fsdp_unit", 1, say)
    rows, h, f = _unit_dims(cfg)
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)

    plain = nn.Sequential(*[nn.Sequential(_Pair(h, 2 * h), _Pair(h, f)) for _ in range(FSDP_UNITS)]).to(
        job.device
    )
    sharded = copy.deepcopy(plain)
    mesh = init_device_mesh(job.device.type, (job.world,))
    for unit in sharded:
        fully_shard(unit, mesh=mesh, reshard_after_forward=True)
    fully_shard(sharded, mesh=mesh, reshard_after_forward=True)
    x = torch.randn(rows, h, generator=gen).to(job.device)

    calls: list[tuple[str, int]] = []
    gather, scatter = dist.all_gather_single, dist.reduce_scatter_single

    def counted_gather(output: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append(("all_gather", output.numel() * output.element_size()))
        return gather(output, *args, **kwargs)

    def counted_scatter(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append(("reduce_scatter", input.numel() * input.element_size()))
        return scatter(output, input, *args, **kwargs)

    with (
        mock.patch.object(dist, "all_gather_single", counted_gather),
        mock.patch.object(dist, "reduce_scatter_single", counted_scatter),
    ):
        _train_call(sharded, x)()  # also FSDP2's lazy initialization, not timed
    extra = _paired_extra(job, _train_call(plain, x), _train_call(sharded, x), section.per_point())
    section.done += 1
    section.finish(
        f"{FSDP_UNITS} units of {sum(p.numel() for p in plain[0].parameters()):,} parameters, "
        f"{len(calls)} collectives, {extra * 1e3:.1f} ms more than unsharded per forward + backward"
    )
    scope = "inter_node" if len(set(job.hosts)) > 1 else "intra_node"
    return FsdpUnitTiming(extra, calls, scope)


def _train_call(model: Any, x: torch.Tensor) -> Callable[[], None]:
    """A forward and backward of `model` on x, its gradients dropped after (as a step's zero_grad)."""

    def call() -> None:
        model(x).sum().backward()
        x.grad = None
        for p in model.parameters():
            p.grad = None

    return call


def _paired_extra(job: Job, baseline: Callable[[], Any], test: Callable[[], Any], seconds: float) -> float:
    """Seconds `test` takes beyond `baseline`: each called once untimed, then alternately (the ranks
    starting each call together, as a step's collectives meet them) until `seconds` have passed, at
    least 3 and at most MAX_REPEATS pairs; the difference of the medians, averaged over the ranks.
    The ranks decide together whether to run another pair (`Job.agree`): their clocks cross the
    deadline at different calls, and a rank that stopped alone would leave its peers' collectives
    in `test` unmatched (4 ranks on 2 cores hung there for 10 minutes until gloo timed out)."""
    baseline()
    test()
    job.sync()
    times: tuple[list[float], list[float]] = ([], [])
    deadline = time.perf_counter() + seconds
    while job.agree(len(times[0]) < 3 or (time.perf_counter() < deadline and len(times[0]) < MAX_REPEATS)):
        for fn, out in zip((baseline, test), times, strict=True):
            job.reduce([0.0])
            t0 = time.perf_counter()
            fn()
            job.sync()
            out.append(time.perf_counter() - t0)
    return job.mean([statistics.median(times[1]) - statistics.median(times[0])])[0]


def unit_overhead_us(profile: Any, timing: FsdpUnitTiming, ranks: int) -> float:
    """The fixed cost of one FSDP unit collective (us) that `plan/speed.py` adds to each: the measured
    extra seconds less the collectives' bytes on the profile's own curves, per collective, at
    least 0 (a measurement noisier than the cost it looks for)."""
    if not timing.calls:
        return 0.0
    moved = sum(profile.collective_seconds(op, timing.scope, ranks, n) for op, n in timing.calls)
    return max(0.0, (timing.extra_seconds - moved) / len(timing.calls)) * 1e6


# ---------------------------------------------------------------------------- tensor-parallel layers


@dataclass
class TpLayerTiming:
    """The extra seconds of one tensor-parallel layer per micro-batch (forward + backward) over the
    same layer unsharded at its local widths, without and with sequence parallelism, on `ranks`
    ranks, and the collectives' tensor size (bytes of b s h)."""

    extra_seconds: dict[str, float]  # "tp" | "sp" -> seconds per layer
    ranks: int
    tensor_bytes: int
    scope: str = "intra_node"


def tp_group_sizes(job: Job) -> list[int]:
    """The tensor-parallel group sizes a layout can put inside a node: the powers of two from 2 to
    the ranks of a node, and that number itself. Empty when the nodes hold different numbers of
    ranks, ranks are not numbered node by node, or a node holds one rank."""
    nodes = sorted(set(job.hosts), key=job.hosts.index)
    per = job.world // len(nodes)
    if per < 2 or job.hosts != [h for h in nodes for _ in range(per)]:
        return []
    return [*_smaller_group_sizes([per]), per]


def _tp_mesh(job: Job, t: int) -> Any:
    """A 1-D mesh over each block of `t` consecutive ranks (inside a node: `tp_group_sizes`); every
    rank builds every block's group, so the blocks run side by side as a layout's do."""
    from torch.distributed.device_mesh import init_device_mesh

    if t == job.world:
        return init_device_mesh(job.device.type, (t,))
    return init_device_mesh(job.device.type, (job.world // t, t), mesh_dim_names=("rest", "tp"))["tp"]


class _Pair(torch.nn.Module):
    """Two linears h -> w -> h with GELU between: an attention's qkv/out pair (w = 2 h: 4 h^2
    weights) or an MLP (w = f)."""

    def __init__(self, h: int, w: int) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(h, w), torch.nn.Linear(w, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


class _Layer(torch.nn.Module):
    """A pre-norm layer of the model's widths (its attention core left out: the heads split without
    communication), its linears `t` times narrower when `t` > 1 (a tensor-parallel rank's shapes)."""

    def __init__(self, h: int, f: int, t: int = 1) -> None:
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(h), torch.nn.LayerNorm(h)
        self.attention, self.mlp = _Pair(h, 2 * h // t), _Pair(h, f // t)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def _tp_plan(sp: bool) -> dict[str, Any]:
    """parallel/tensor.py's styles for a layer: column-parallel up, row-parallel down; with SP the
    norms on the sequence shard and the pairs' inputs gathered from it, their outputs scattered."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    plan: dict[str, Any] = {}
    for pair in ("attention", "mlp"):
        plan[f"{pair}.up"] = ColwiseParallel()
        plan[f"{pair}.down"] = RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel()
        if sp:
            plan[pair] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    if sp:
        plan["norm1"] = plan["norm2"] = SequenceParallel(use_local_output=True)
    return plan


def measure_tp_layer(job: Job, cfg: Config, say=print) -> list[TpLayerTiming]:
    """At each tensor-parallel group size of a node (`tp_group_sizes`, the node's groups of that size
    side by side), time FSDP_UNITS layers (`_Layer`, the FSDP unit point's widths) forward and
    backward under torch's tensor-parallel styles as parallel/tensor.py applies them, without and
    with sequence parallelism, each against the same layers unsharded at one rank's widths,
    alternating. The collectives' bytes as the planner counts them are taken out in
    `tp_layer_overhead_us`; the rest is DTensor's cost per layer, and where processes share cores,
    the wait for a peer to be scheduled at each collective. Empty with one process or ranks that do
    not form per-node groups."""
    if job.world == 1:
        return []
    sizes = tp_group_sizes(job)
    if not sizes:
        say("calibrate: tp_layer: skipped: the nodes do not hold 2 or more ranks each, numbered by node")
        return []
    section = Section(job, "tp_layer", 2 * len(sizes), say)
    out: list[TpLayerTiming] = []
    for t in sizes:
        timing = _tp_layer_timing(job, cfg, t, section)
        if timing is None:
            break
        out.append(timing)
    figures = [
        f"{timing.ranks} ranks " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in timing.extra_seconds.items())
        for timing in out
    ]
    section.finish("per layer beyond its local GEMMs: " + "; ".join(figures))
    return out


def _tp_layer_timing(job: Job, cfg: Config, t: int, section: Section) -> TpLayerTiming | None:
    """The extra seconds per layer at group size `t`, "tp" and "sp" (those the budget allowed; None
    when it allowed neither)."""
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = _tp_mesh(job, t)
    d = model_dims(cfg)
    _, h, f = _unit_dims(cfg)
    h, f = -(-h // t) * t, -(-f // t) * t  # the sharded widths divide evenly
    b, s = d["b"], max(t, d["s"] // t * t)
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    extra: dict[str, float] = {}
    for kind in ("tp", "sp"):
        if not section.go():
            break
        local = torch.nn.Sequential(*[_Layer(h, f, t) for _ in range(FSDP_UNITS)]).to(job.device)
        sharded = torch.nn.Sequential(*[_Layer(h, f) for _ in range(FSDP_UNITS)]).to(job.device)
        for layer in sharded:
            parallelize_module(layer, mesh, _tp_plan(kind == "sp"))
        x = torch.randn(b, s, h, generator=gen).to(job.device).requires_grad_()
        xs = x[:, : s // t].detach().clone().requires_grad_() if kind == "sp" else x
        seconds = _paired_extra(job, _train_call(local, x), _train_call(sharded, xs), section.per_point())
        extra[kind] = seconds / FSDP_UNITS
        section.done += 1
    if not extra:
        return None
    scope = "inter_node" if len(set(job.hosts)) > 1 and t == job.world else "intra_node"
    return TpLayerTiming(extra, t, b * s * h * 4, scope)


def tp_layer_overhead_us(profile: Any, timing: TpLayerTiming) -> dict[str, float]:
    """{"tp_layer_overhead_us", "sp_layer_overhead_us"}: each variant's extra seconds per layer less
    the layer's collectives as plan/speed.py counts them (`tp_layer_collectives`) on the profile's
    curves, at least 0."""
    from .speed import tp_layer_collectives

    out = {}
    for kind, extra in timing.extra_seconds.items():
        moved = sum(
            n * profile.collective_seconds(op, timing.scope, timing.ranks, timing.tensor_bytes)
            for op, n in tp_layer_collectives(kind == "sp", full=False)
        )
        out[f"{kind}_layer_overhead_us"] = max(0.0, extra - moved) * 1e6
    return out


# ---------------------------------------------------------------------------- the whole run


def calibrate(cfg: Config, job: Job, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Every section at the config's shapes and dtype; returns the hardware profile as a mapping
    (plan/hardware_profile.py format 1), the same on every rank. Collective: every rank calls it."""
    dtype = cfg.train.precision
    start = time.perf_counter()
    gemm = measure_gemm(job, gemm_shapes(cfg, job.quick), dtype, say)
    attention = measure_attention(job, attention_cases(cfg, job.quick), dtype, say)
    memory = measure_memory_bound(job, cfg, say)
    mapping = profile_mapping(job, dtype, gemm, attention, memory, [])  # what model_layer plans with
    factors = measure_model_layer(job, cfg, mapping, say)
    collectives = measure_collectives(job, say)
    fsdp = measure_fsdp_unit(job, cfg, say)
    tp = measure_tp_layer(job, cfg, say)
    mapping["collectives"] = collectives
    if factors:
        mapping["layer_factors"] = factors
    dispatched = dispatched_kernel(job, cfg, dtype)
    if dispatched is not None:
        mapping["attention_kernel"] = dispatched
        say(
            f"calibrate: attention: scaled_dot_product_attention dispatches the config's call to {dispatched}"
        )
    if collectives:
        from .hardware_profile import profile_from_dict

        profile = profile_from_dict(mapping)
        if fsdp is not None:
            unit_us = unit_overhead_us(profile, fsdp, job.world)
            mapping["memory_bound"]["unit_overhead_us"] = _figure(unit_us)
            say(f"calibrate: fsdp_unit: {unit_us / 1e3:.2f} ms per unit collective beyond its bytes")
        for timing in tp:
            overheads = {key: _figure(us) for key, us in tp_layer_overhead_us(profile, timing).items()}
            mapping.setdefault("tp_layers", []).append({"ranks": timing.ranks, **overheads})
            mapping["memory_bound"].update(overheads)  # the largest group size's, last
            for key, us in overheads.items():
                say(f"calibrate: {key.removesuffix('_overhead_us')}: {timing.ranks} ranks: {us / 1e3:.2f} ms "
                    "per layer and micro-batch beyond its GEMMs and collectives")  # fmt: skip
    say(f"calibrate: all sections in {time.perf_counter() - start:.1f} s")
    return mapping


def profile_mapping(
    job: Job, dtype: str, gemm: list[dict], attention: list[dict], memory: dict, collectives: list[dict]
) -> dict[str, Any]:
    """The measured sections with what identifies the machine: the profile's YAML mapping."""
    from .hardware_profile import CORRECTION_CLASSES, FORMAT, fingerprint_here

    now = dt.datetime.now(dt.timezone.utc)
    fingerprint = fingerprint_here(processes=job.world, threads_per_process=torch.get_num_threads())
    fingerprint["hostname"] = job.hosts[0] if job.hosts else socket.gethostname()  # rank 0's
    device_name = str(fingerprint["device_name"])
    per_node = job.hosts.count(job.hosts[0]) if job.hosts else 1
    if job.cuda:
        memory_gb = torch.cuda.get_device_properties(job.device).total_memory / 2**30
    else:
        memory_gb = (physical_memory_bytes() or 0) / per_node / 2**30
    backend = "nccl" if job.cuda else "gloo"
    threads = f", {fingerprint['threads_per_process']} thread(s) per process" if not job.cuda else ""
    return {
        "format": FORMAT,
        "name": f"{fingerprint['hostname']} {device_name} ({backend}{threads})",
        "kind": "gpu" if job.cuda else "cpu",
        "source": f"measured by stx calibrate {now:%Y-%m-%dT%H:%MZ}",
        "fingerprint": fingerprint,
        "peak_tflops": _peak_tflops_by_dtype(job, dtype, gemm),
        "device_memory_gb": _figure(memory_gb),
        "host_link_gbps": host_link_gbps(job) if job.cuda else memory["bandwidth_gbps"],
        "gemm": gemm,
        "attention": attention,
        "memory_bound": memory,
        "collectives": collectives,
        "corrections": dict.fromkeys(CORRECTION_CLASSES, 1.0),
        "corrections_source": None,
    }


def _peak_tflops_by_dtype(job: Job, dtype: str, gemm: list[dict]) -> dict[str, float]:
    """The measured dtype's peak (`_peak_tflops`) and, on a GPU of the device table, the table's peak of
    every other dtype it lists: the profile then scales its measured points to a run in another
    dtype (fp16 from bf16 points), where with one peak `stx plan` refused (an H200 profile measured
    in bf16 could not plan an fp16 run)."""
    peaks = {dtype: _peak_tflops(job, dtype, gemm)}
    if job.cuda:
        from ..metrics.device_specs import PEAK_TFLOPS, detect_device_name

        name = detect_device_name(torch.cuda.get_device_name(job.device))
        for other, tflops in PEAK_TFLOPS.get(name or "", {}).items():
            peaks.setdefault(other, float(tflops))
    return peaks


def _peak_tflops(job: Job, dtype: str, gemm: list[dict]) -> float:
    """A GPU's datasheet peak when the device table knows it (MFU's convention), else the fastest
    GEMM measured here (a CPU: per process at its threads)."""
    measured = max((p["tflops"] for p in gemm), default=0.0)
    if job.cuda:
        from ..metrics.device_specs import detect_device_name, lookup_peak

        name = detect_device_name(torch.cuda.get_device_name(job.device))
        if name is not None:
            with contextlib.suppress(ValueError, KeyError):
                return lookup_peak(name, dtype) / 1e12
    return measured


@contextlib.contextmanager
def calibration_job(device: torch.device, quick: bool, timeout_minutes: float) -> Iterator[Job]:
    """The job this process belongs to (the launcher's RANK / WORLD_SIZE, see cli/calibrate.py), its
    process group started here and torn down on the way out (also after an error)."""
    from ..parallel.distributed import env_world_size, init_distributed, shutdown_distributed

    world = env_world_size()
    created = init_distributed(device, timeout_minutes, needed=world > 1)
    try:
        job = Job(device, int(os.environ.get("RANK", "0")), world, quick)
        hosts: list[Any] = [None] * world
        if world > 1:
            dist.all_gather_object(hosts, socket.gethostname())
        else:
            hosts = [socket.gethostname()]
        job.hosts = [str(h) for h in hosts]
        yield job
    finally:
        shutdown_distributed(created)


def calibration_device() -> torch.device:
    """cuda:LOCAL_RANK where CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")
