"""One optimizer step three ways, timed in one process: is our trainer as fast as bare PyTorch and HF?

  A  ours: `Trainer.train_step`, the trainer built as `train/build.py` builds it
  B  bare: the same model class and weights; inline `F.cross_entropy`, `backward`, `clip_grad_norm_`,
     `AdamW.step`; nothing of our framework but the model
  C  HF:   `transformers` BertForPreTraining (BertForMaskedLM without a binary head) / GPT2LMHeadModel
     of the same shape, random init, SDPA attention, its own loss

Every variant does forward + backward + clip + AdamW (fp32, dropout 0) on the same pre-built
micro-batches, so data loading is excluded. Within each repeat the variants alternate step by step
(A B C, B C A, C A B, A C B, ...) and are compared through per-repeat medians: a shared, noisy
machine slows all three alike within a repeat, so their ratios are far steadier than their absolute
times.

    python benchmarks/step_vs_bare.py --model both
    python benchmarks/step_vs_bare.py --model gpt --config gpt-125m model.num_layers=2 \
        model.seq_length=256 --micro-batch-size 2 --repeats 3 --output /tmp/gpt.md
    python benchmarks/step_vs_bare.py --threads 1     # steadier on a busy machine (see README)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from scalable_transformer.config.load import ConfigError, load_config, to_yaml
from scalable_transformer.config.schema import ResolvedConfig
from scalable_transformer.config.validate import resolve
from scalable_transformer.metrics.device_specs import resolve_peak
from scalable_transformer.metrics.device_table import PeakInfo
from scalable_transformer.metrics.environment import record_sections
from scalable_transformer.metrics.flops import (
    FlopsCount,
    MFUError,
    ModelShape,
    flops_per_iteration,
    throughput_metrics,
)
from scalable_transformer.metrics.sinks import Sinks
from scalable_transformer.models import build_model, count_parameters, padded_vocab_size
from scalable_transformer.parallel.apply import parallelize
from scalable_transformer.parallel.dims import ParallelDims
from scalable_transformer.train.measurement import Measurement
from scalable_transformer.train.optim import build_optimizer, build_scheduler
from scalable_transformer.train.trainer import Trainer

Batch = dict[str, torch.Tensor]
VARIANTS = ("A", "B", "C")
# Round orders: every three in a row put each variant once in each position; all six together put
# each variant after each other one equally often (a step may pay for what the previous one left).
ORDERS = ("ABC", "BCA", "CAB", "ACB", "CBA", "BAC")
NAMES = {"A": "ours: Trainer.train_step", "B": "bare PyTorch, same model", "C": "HF transformers"}
TARGET_VS_BARE = 1.02  # A/B at most this (issue 23)
TARGET_VS_HF = 1.00  # A/C (per FLOP) at most this
LOSS_TOLERANCE = 1e-6  # relative: A and B run the same ops on the same weights
REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- config and batches


def forced_settings(model_type: str, micro_batch: int | None, accumulation: int) -> list[str]:
    """Overrides applied after the user's: the same work in all three runs (fp32 on the CPU, no
    dropout, no recompute or compile, which the bare and HF runs do not apply) and the step's size."""
    forced = [
        f"model.type={model_type}",
        "model.hidden_dropout=0",
        "model.attention_dropout=0",
        "train.precision=fp32",
        "train.device=cpu",
        "parallel.activation_checkpointing=none",
        "parallel.compile=false",
        "train.global_batch_size=",  # derived: micro-batch x accumulation
        f"train.gradient_accumulation_steps={accumulation}",
    ]
    if micro_batch is not None:
        forced.append(f"train.micro_batch_size={micro_batch}")
    return forced


def benchmark_config(
    model_type: str, spec: str | None, overrides: list[str], micro_batch: int | None, accumulation: int = 1
) -> ResolvedConfig:
    """The resolved config: the preset/YAML, the user's overrides, then `forced_settings`."""
    forced = forced_settings(model_type, micro_batch, accumulation)
    cfg = resolve(load_config(spec or f"tiny-{model_type}", [*overrides, *forced]), world_size=1)
    if cfg.model.vocab_size is None:
        raise ConfigError("model.vocab_size is unset (a non-embedded tokenizer): set model.vocab_size")
    return cfg


def synthetic_batches(cfg: ResolvedConfig, seed: int) -> list[Batch]:
    """The micro-batches of one optimizer step, shaped as the datasets make them.

    BERT: 15% of the real tokens labelled, two segments, NSP labels, and ceil(10%) of the samples
    shorter than seq_length (padding, as short_seq_prob gives), so every model must apply the mask.
    GPT: a window of seq_length + 1 tokens split into inputs and next-token labels.
    """
    m, t = cfg.model, cfg.train
    b, s, vocab = t.micro_batch_size, m.seq_length, m.vocab_size
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(t.gradient_accumulation_steps):
        if m.type == "gpt":
            window_bs = torch.randint(0, vocab, (b, s + 1), generator=gen)
            batches.append({"input_ids": window_bs[:, :-1].clone(), "labels": window_bs[:, 1:].clone()})
            continue
        lengths = torch.full((b,), s)
        short = math.ceil(0.1 * b)
        lengths[b - short :] = torch.randint(s // 2, s, (short,), generator=gen)
        positions_bs = torch.arange(s).expand(b, s)
        real_bs = positions_bs < lengths[:, None]
        input_ids_bs = torch.randint(0, vocab, (b, s), generator=gen) * real_bs
        labelled_bs = real_bs & (torch.rand(b, s, generator=gen) < 0.15)
        batches.append(
            {
                "input_ids": input_ids_bs,
                "token_type_ids": (real_bs & (positions_bs >= lengths[:, None] // 2)).long(),
                "attention_mask": real_bs.long(),
                "labels": torch.where(labelled_bs, input_ids_bs, -100),
                "nsp_labels": torch.randint(0, 2, (b,), generator=gen),
            }
        )
    return batches


# ----------------------------------------------------------------------------- the three steps


def build_ours(cfg: ResolvedConfig, flops: FlopsCount, peak: PeakInfo) -> Trainer:
    """A: the trainer as `run_training` builds it (no data iterators, no sinks: batches come pre-built)."""
    device = torch.device("cpu")
    model = parallelize(build_model(cfg.model).to(device), cfg)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.train_iters)
    dims = ParallelDims(dp=1, tp=1, pp=1)
    measurement = Measurement(cfg, device, dims, flops, peak.flops_per_second, Sinks([]))
    return Trainer(cfg, model, optimizer, scheduler, iter(()), list, measurement)


def adamw(model: torch.nn.Module, cfg: ResolvedConfig) -> torch.optim.AdamW:
    """AdamW with the trainer's settings: same lr/betas/eps, weight decay on matrices only, foreach
    (torch's CPU default is the slower per-tensor loop, which would make our step look fast)."""
    o = cfg.optim
    params = list(model.parameters())  # tied weights once
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups, lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps, foreach=True
    )


def bare_step(
    model: torch.nn.Module, opt: torch.optim.Optimizer, micro: list[Batch], model_type: str, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """B: one step in plain PyTorch; returns the loss and the pre-clip gradient norm as tensors
    (no sync, no logging: the bare loop does nothing it does not need)."""
    opt.zero_grad(set_to_none=True)
    # Sum / step-wide count = the mean of one big batch, also when the step has several micro-batches.
    tokens = sum(int((mb["labels"] != -100).sum()) for mb in micro)
    samples = sum(mb["input_ids"].shape[0] for mb in micro)
    total = torch.zeros(())
    for mb in micro:
        if model_type == "bert":
            logits_bsv, binary_b2 = model(mb["input_ids"], mb["token_type_ids"], mb["attention_mask"])
        else:
            logits_bsv, binary_b2 = model(mb["input_ids"]), None
        loss = F.cross_entropy(logits_bsv.flatten(0, 1), mb["labels"].flatten(), reduction="sum") / tokens
        if binary_b2 is not None:
            loss = loss + F.cross_entropy(binary_b2, mb["nsp_labels"], reduction="sum") / samples
        loss.backward()
        total += loss.detach()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    return total, grad_norm


def build_hf(cfg: ResolvedConfig) -> torch.nn.Module:
    """C: the HF model of our shape (padded vocabulary, max positions, ffn, eps), random init, SDPA.

    HF BERT is post-LN (embedding norm, none at the end) where ours is pre-LN by default: same
    parameter count and the same GEMMs, norms in other places.
    """
    try:
        import transformers
    except ImportError as e:
        raise SystemExit("variant C needs transformers: pip install -e '.[bench]'") from e
    transformers.logging.set_verbosity_error()
    m = cfg.model
    unsupported = {
        "model.norm": (m.norm, "layernorm"),
        "model.position_embedding_type": (m.position_embedding_type, "learned"),
    }
    if m.activation == "geglu":
        unsupported["model.activation"] = (m.activation, "gelu or openai-gelu")
    if m.type == "gpt" and m.apply_residual_connection_post_layernorm:
        unsupported["model.apply_residual_connection_post_layernorm"] = (True, "false for GPT-2")
    bad = {k: v for k, v in unsupported.items() if v[0] not in v[1].split(" or ")}
    if bad:
        raise ConfigError(
            "no same-shape HF model for "
            + ", ".join(f"{k}={v[0]!r} (HF needs {v[1]})" for k, v in bad.items())
        )
    vocab = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by)
    act = "gelu_pytorch_tanh" if m.activation == "openai-gelu" else "gelu"
    if m.type == "bert":
        config = transformers.BertConfig(
            vocab_size=vocab,
            hidden_size=m.hidden_size,
            num_hidden_layers=m.num_layers,
            num_attention_heads=m.num_attention_heads,
            intermediate_size=m.ffn_hidden_size,
            hidden_act=act,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            max_position_embeddings=m.max_position_embeddings,
            type_vocab_size=max(m.num_tokentypes, 1),
            initializer_range=m.init_method_std,
            layer_norm_eps=m.layernorm_epsilon,
            tie_word_embeddings=m.tie_word_embeddings,
            attn_implementation="sdpa",
        )
        cls = transformers.BertForPreTraining if m.bert_binary_head else transformers.BertForMaskedLM
    else:
        config = transformers.GPT2Config(
            vocab_size=vocab,
            n_positions=m.max_position_embeddings,
            n_embd=m.hidden_size,
            n_layer=m.num_layers,
            n_head=m.num_attention_heads,
            n_inner=m.ffn_hidden_size,
            activation_function=act,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            layer_norm_epsilon=m.layernorm_epsilon,
            initializer_range=m.init_method_std,
            tie_word_embeddings=m.tie_word_embeddings,
            attn_implementation="sdpa",
        )
        cls = transformers.GPT2LMHeadModel
    model = cls(config)
    if model.config._attn_implementation != "sdpa":
        raise RuntimeError(f"HF picked attention {model.config._attn_implementation!r}, not sdpa")
    return model


def hf_step(
    model: torch.nn.Module, opt: torch.optim.Optimizer, micro: list[Batch], model_type: str, clip: float
) -> torch.Tensor:
    """C: one step with HF's own losses (MLM + NSP means; causal LM shifts `labels` itself)."""
    opt.zero_grad(set_to_none=True)
    total = torch.zeros(())
    for mb in micro:
        if model_type == "bert":
            kwargs = {"token_type_ids": mb["token_type_ids"], "attention_mask": mb["attention_mask"]}
            if type(model).__name__ == "BertForPreTraining":  # BertForMaskedLM has no binary head
                kwargs["next_sentence_label"] = mb["nsp_labels"]
            out = model(input_ids=mb["input_ids"], labels=mb["labels"], **kwargs)
        else:
            out = model(input_ids=mb["input_ids"], labels=mb["input_ids"])
        loss = out.loss / len(micro)
        loss.backward()
        total += loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    return total


# ----------------------------------------------------------------------------- measurement


def quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


def mfu_text(flops: FlopsCount, seconds: float, peak: PeakInfo) -> tuple[str, str]:
    try:
        perf = throughput_metrics(flops, seconds, 1, peak.flops_per_second, strict=True)
    except MFUError as e:  # a peak measured under load can be too low: say so, keep the timings
        return f"n/a ({e})", "n/a"
    return f"{100 * perf['mfu']:.2f}%", f"{100 * perf['hfu']:.2f}%"


def run_one(model_type: str, args: argparse.Namespace) -> tuple[dict, bool]:
    """Build, verify and time A, B and C for one model type; returns the report data and whether
    A and B agreed on the first step's loss."""
    cfg = benchmark_config(model_type, args.config, args.overrides, args.micro_batch_size, args.accumulation)
    torch.manual_seed(cfg.train.seed)
    micro = synthetic_batches(cfg, cfg.train.seed)
    global_batch = cfg.train.global_batch_size
    num_params = count_parameters(cfg.model)
    shape = ModelShape.from_config(cfg.model, num_params)
    flops = flops_per_iteration(shape, global_batch, cfg.logging.flops_convention)
    peak = resolve_peak("cpu", "fp32", None, None)
    clip = cfg.optim.clip_grad or math.inf

    trainer = build_ours(cfg, flops, peak)
    bare = build_model(cfg.model)
    bare.load_state_dict(trainer.model.state_dict())  # identical initial weights
    bare_opt = adamw(bare, cfg)
    hf = build_hf(cfg)
    hf_opt = adamw(hf, cfg)
    hf_params = sum(p.numel() for p in hf.parameters())
    hf_flops = flops_per_iteration(
        dataclasses.replace(shape, num_params=hf_params), global_batch, cfg.logging.flops_convention
    )
    # Param-count based (6N) FLOPs: the per-FLOP normalisation of A/C when the counts differ.
    six_n = {
        "A": flops_per_iteration(shape, global_batch, "6n").model_flops,
        "C": flops_per_iteration(
            dataclasses.replace(shape, num_params=hf_params), global_batch, "6n"
        ).model_flops,
    }

    # Like-for-like check: the first step of A and B from the same weights on the same batch.
    first_a = trainer.train_step(micro)
    loss_b, norm_b = (float(x) for x in bare_step(bare, bare_opt, micro, model_type, clip))
    loss_c = float(hf_step(hf, hf_opt, micro, model_type, clip))
    loss_diff = abs(first_a.loss - loss_b)
    agree = loss_diff <= LOSS_TOLERANCE * max(1.0, abs(loss_b))

    steps: dict[str, Callable[[], object]] = {
        "A": lambda: trainer.train_step(micro),
        "B": lambda: bare_step(bare, bare_opt, micro, model_type, clip),
        "C": lambda: hf_step(hf, hf_opt, micro, model_type, clip),
    }
    for _ in range(args.warmup):
        for v in VARIANTS:
            steps[v]()
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}  # every timed step, seconds
    medians: dict[str, list[float]] = {v: [] for v in VARIANTS}  # one per repeat
    load = [os.getloadavg()[0]]
    start = time.perf_counter()
    rounds = 0
    for r in range(args.repeats):
        elapsed = time.perf_counter() - start
        if r >= 1 and elapsed + elapsed / r > args.max_seconds:  # the next repeat would overrun
            break
        gc.collect()  # start every repeat with nothing left for the cyclic collector
        block: dict[str, list[float]] = {v: [] for v in VARIANTS}
        # Step by step, so that contention that comes and goes over seconds hits the three alike.
        for _ in range(args.steps_per_repeat):
            for v in ORDERS[rounds % len(ORDERS)]:
                t0 = time.perf_counter()
                steps[v]()
                block[v].append(time.perf_counter() - t0)
            rounds += 1
        for v in VARIANTS:
            times[v] += block[v]
            medians[v].append(statistics.median(block[v]))
        load.append(os.getloadavg()[0])
    wall = time.perf_counter() - start

    ratio_ab = [a / b for a, b in zip(medians["A"], medians["B"], strict=True)]
    ratio_ac = [a / c for a, c in zip(medians["A"], medians["C"], strict=True)]
    per_flop = six_n["C"] / six_n["A"]  # (A_s / A_flops) / (C_s / C_flops) = A/C * C_flops / A_flops
    data = {
        "model_type": model_type,
        "cfg": cfg,
        "num_params": {"A": num_params, "B": sum(p.numel() for p in bare.parameters()), "C": hf_params},
        "flops": {"A": flops, "C": hf_flops},
        "six_n": six_n,
        "peak": peak,
        "times": times,
        "medians": medians,
        "ratio_ab": ratio_ab,
        "ratio_ac": ratio_ac,
        "ratio_ac_per_flop": [r * per_flop for r in ratio_ac],
        "first": {
            "A": first_a.loss,
            "B": loss_b,
            "C": loss_c,
            "grad_norm_A": first_a.grad_norm,
            "grad_norm_B": norm_b,
        },
        "loss_diff": loss_diff,
        "agree": agree,
        "wall": wall,
        "repeats_done": len(medians["A"]),
        "load": (min(load), max(load)),
        "hf_class": type(hf).__name__,
        "hf_attention": hf.config._attn_implementation,
    }
    return data, agree


# ----------------------------------------------------------------------------- report


def render(data: dict, args: argparse.Namespace, command: str) -> str:
    cfg: ResolvedConfig = data["cfg"]
    m, t = cfg.model, cfg.train
    ms = {v: [1000 * x for x in data["medians"][v]] for v in VARIANTS}
    peak: PeakInfo = data["peak"]
    med_ab, med_ac, med_acf = (
        statistics.median(data[k]) for k in ("ratio_ab", "ratio_ac", "ratio_ac_per_flop")
    )
    iqr = {k: quartiles(data[k]) for k in ("ratio_ab", "ratio_ac", "ratio_ac_per_flop")}
    flops_of = {"A": data["flops"]["A"], "B": data["flops"]["A"], "C": data["flops"]["C"]}
    lines = [
        f"# step_vs_bare: {data['model_type']}",
        "",
        "One optimizer step (forward + backward + clip + AdamW, fp32, dropout 0) of A ours "
        "(`Trainer.train_step`), B bare PyTorch on the same model class and weights, C HF "
        f"`{data['hf_class']}` (attention `{data['hf_attention']}`), on the same pre-built batch: "
        f"{t.gradient_accumulation_steps} micro-batch(es) of {t.micro_batch_size} x {m.seq_length} tokens.",
        "",
        f"Command: `{command}`",
        "",
        "Forced after the config and overrides, so that all three do the same work: `"
        + " ".join(forced_settings(m.type, args.micro_batch_size, args.accumulation)[1:])
        + "`.",
        "",
        f"Threads: torch intra-op {torch.get_num_threads()}, inter-op {torch.get_num_interop_threads()}; "
        f"{data['repeats_done']} repeats (of {args.repeats} requested; time budget {args.max_seconds:g} s) x "
        f"{args.steps_per_repeat} steps per variant, alternating step by step in orders that cycle "
        f"through {', '.join(' '.join(o) for o in ORDERS)}; {args.warmup} warm-up "
        f"steps each; {data['wall']:.1f} s timed. Machine load while timing (1-min load average, sampled "
        f"every repeat): {data['load'][0]:.1f}-{data['load'][1]:.1f} on {os.cpu_count()} CPUs, of which "
        f"this run accounts for up to {torch.get_num_threads()}; the rest is other processes competing "
        "for the cores, which inflates absolute times.",
        "",
        "## Timings",
        "",
        "Median over repeats of each repeat's median step; IQR of the per-repeat medians; min of all steps.",
        "",
        "| variant | what | median (ms) | IQR (ms) | min (ms) | MFU | HFU |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for v in VARIANTS:
        q1, q3 = quartiles(ms[v])
        mfu, hfu = mfu_text(flops_of[v], statistics.median(data["medians"][v]), peak)
        lines.append(
            f"| {v} | {NAMES[v]} | {statistics.median(ms[v]):.2f} | {q1:.2f}-{q3:.2f} | "
            f"{1000 * min(data['times'][v]):.2f} | {mfu} | {hfu} |"
        )
    lines += [
        "",
        "| ratio | median of per-repeat ratios | IQR |",
        "|---|---:|---:|",
        f"| A/B | {med_ab:.3f} | {iqr['ratio_ab'][0]:.3f}-{iqr['ratio_ab'][1]:.3f} |",
        f"| A/C | {med_ac:.3f} | {iqr['ratio_ac'][0]:.3f}-{iqr['ratio_ac'][1]:.3f} |",
        f"| A/C per FLOP (6N) | {med_acf:.3f} | {iqr['ratio_ac_per_flop'][0]:.3f}-"
        f"{iqr['ratio_ac_per_flop'][1]:.3f} |",
        "",
        "## Targets",
        "",
        "| target | measured | result |",
        "|---|---:|---|",
        target_row(f"ours <= {TARGET_VS_BARE:.2f}x bare (A/B)", med_ab, iqr["ratio_ab"], TARGET_VS_BARE),
        target_row("ours not slower than HF (A/C per FLOP)", med_acf, iqr["ratio_ac_per_flop"], TARGET_VS_HF),
        "",
        'PASS/FAIL is decided on the median ratio; "within noise" marks an IQR that straddles the threshold.',
        "",
        "## Like-for-like check",
        "",
        "- loss agreement (first step, B loaded from A's state_dict, same batch): "
        f"A {data['first']['A']:.8f}, "
        f"B {data['first']['B']:.8f}, |A-B| = {data['loss_diff']:.2e} "
        f"(tolerance {LOSS_TOLERANCE:g} relative): {'PASS' if data['agree'] else 'FAIL'}",
        f"- grad norm before clipping, first step: A {data['first']['grad_norm_A']:.8f}, "
        f"B {data['first']['grad_norm_B']:.8f}",
        f"- C first-step loss {data['first']['C']:.6f} (own random init; ln(vocab) = "
        f"{math.log(padded(cfg)):.4f} for reference)",
        "- B: AdamW (foreach) over two groups as the trainer's (weight decay on matrices, none on "
        "vectors), same lr/betas/eps, constant lr (A follows its schedule: same work per step); C: the same.",
        "",
        "## Parameters and FLOPs",
        "",
        f"FLOPs convention for MFU/HFU: `{data['flops']['A'].convention}` "
        "(`scalable_transformer.metrics.flops.flops_per_iteration`, model FLOPs per step, no recompute); "
        f"peak {peak.flops_per_second / 1e9:.1f} GFLOP/s per device, {peak.source}.",
        "",
        f"| model | parameters | {data['flops']['A'].convention} GFLOPs/step | 6N GFLOPs/step |",
        "|---|---:|---:|---:|",
        f"| ours (A, B) | {data['num_params']['A']:,} | {data['flops']['A'].model_flops / 1e9:.3f} | "
        f"{data['six_n']['A'] / 1e9:.3f} |",
        f"| HF (C) | {data['num_params']['C']:,} | {data['flops']['C'].model_flops / 1e9:.3f} | "
        f"{data['six_n']['C'] / 1e9:.3f} |",
        "",
    ]
    if m.type == "bert":
        lines += [
            "HF BERT is post-LN (a norm after the embeddings, none at the end); ours is "
            f"{'post' if m.apply_residual_connection_post_layernorm else 'pre'}-LN: the same parameter "
            "count and GEMMs with the norms elsewhere.",
            "",
        ]
    lines += record_sections(to_yaml(cfg))
    return "\n".join(lines)


def padded(cfg: ResolvedConfig) -> int:
    return padded_vocab_size(cfg.model.vocab_size, cfg.model.make_vocab_size_divisible_by)


def target_row(name: str, value: float, iqr: tuple[float, float], threshold: float) -> str:
    result = "PASS" if value <= threshold else "FAIL"
    if iqr[0] <= threshold < iqr[1]:
        result += " (within noise)"
    return f"| {name} | {value:.3f} (IQR {iqr[0]:.3f}-{iqr[1]:.3f}) | {result} |"


# ----------------------------------------------------------------------------- entry point


def output_path(template: str | None, model_type: str, several: bool) -> Path:
    if template is None:
        return REPO / "benchmarks" / "results" / f"step_vs_bare-{model_type}.md"
    if "{model}" in template:
        return Path(template.format(model=model_type))
    path = Path(template)
    return path.with_name(f"{path.stem}-{model_type}{path.suffix}") if several else path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "overrides", nargs="*", metavar="key=value", help="config overrides, e.g. model.num_layers=4"
    )
    p.add_argument("--model", choices=("bert", "gpt", "both"), default="both")
    p.add_argument("--config", help="preset name or YAML path; default tiny-bert / tiny-gpt")
    p.add_argument("--micro-batch-size", type=int, help="default: the config's train.micro_batch_size")
    p.add_argument("--accumulation", type=int, default=1, help="micro-batches per optimizer step (default 1)")
    p.add_argument("--repeats", type=int, default=15, help="interleaved repeats (default 15)")
    p.add_argument("--steps-per-repeat", type=int, default=3, help="timed steps per variant per repeat")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant before timing")
    p.add_argument(
        "--max-seconds",
        type=float,
        default=60.0,
        help="per model: start no repeat that would end after this many seconds of timing, once one "
        "repeat is done (default 60)",
    )
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    p.add_argument(
        "--output",
        help="markdown file; '{model}' is replaced by bert/gpt (default "
        "benchmarks/results/step_vs_bare-<model>.md in the repository)",
    )
    args = p.parse_args(argv)
    if min(args.repeats, args.steps_per_repeat, args.accumulation) < 1 or args.warmup < 0:
        p.error("--repeats, --steps-per-repeat and --accumulation must be >= 1, --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    command = shlex.join(
        ["python", *sys.argv] if argv is None else ["python", "benchmarks/step_vs_bare.py", *argv]
    )
    models = ["bert", "gpt"] if args.model == "both" else [args.model]
    ok = True
    for model_type in models:
        try:
            data, agree = run_one(model_type, args)
        except ConfigError as e:
            print(f"step_vs_bare: config error: {e}", file=sys.stderr)
            return 2
        ok &= agree
        path = output_path(args.output, model_type, len(models) > 1)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render(data, args, command), encoding="utf-8")
        med = {v: 1000 * statistics.median(data["medians"][v]) for v in VARIANTS}
        print(
            f"{model_type}: A {med['A']:.2f} ms, B {med['B']:.2f} ms, C {med['C']:.2f} ms; "
            f"A/B {statistics.median(data['ratio_ab']):.3f}, A/C {statistics.median(data['ratio_ac']):.3f}; "
            f"first-step loss A {data['first']['A']:.6f} B {data['first']['B']:.6f} "
            f"({'agree' if agree else 'DISAGREE'}); report: {path}"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
