"""Pipeline parallelism (torch.distributed.pipelining) reproduces the single-process training run.

Every case builds the model with the same seed (fp32, dropout 0; 4 layers, hidden 64, 4 heads, seq
32, vocab 512), splits it with `split_model`, and trains 5 AdamW steps of 4 micro-batches of 2
sequences per data-parallel rank through `PipelineRunner` on fixed batches (BERT: binary head,
padded attention masks; GPT: rotary positions); some cases wrap the stages in parallel/apply.py's
order (tensor parallel with or without sequence parallel, activation checkpointing, then FSDP2 or
DDP over dp). After step 3 it evaluates 3 batches (a count no training schedule uses, so
evaluation builds its own schedule and the next step rebuilds the training one). The reference is
the plain model trained in this process on the same global batches with the same token-weighted
accumulation. All cases of one world size run inside one set of gloo processes.

Checked per case: every step's loss and gradient norm (over all stages, the tied copy counted once),
the evaluation metrics, and that the two word-embedding copies stay identical (the Megatron tie).

Tolerance: relative 1e-5 on losses, gradient norms and the evaluation loss. A pipelined step
computes the same fp32 operations on the same micro-batch shapes as the plain one (all runs use one
thread) except for (a) the tied word-embedding gradient, accumulated as (sum of the embedding-side
grads) + (sum of the head-side grads) instead of per micro-batch, (b) the data-parallel
all-reduce / reduce-scatter order with dp = 2, (c) tensor parallelism's partial sums; the gradient
norm is also summed differently (float64 here, fused fp32 in the reference). Each is a few ulps
per sum (~1e-7 relative); five Adam steps keep that below ~1e-6 (measured: losses <= 9e-8, and
bitwise equal when untied, gradient norms <= 5e-7, evaluation <= 8e-8).

What the bar catches (measured by breaking the runner): a missing tied-gradient sync moves step
2's loss by 1e-4 (GPT) to 1.5e-4 (BERT), the gradient norm by 3-5% and the copies drift apart
(checked exactly); the schedule's 1/n rescale scales the gradient norm by exactly 1/4 while the
losses move only ~1e-6 (Adam is invariant to the gradient's scale), and a doubled / missing
data-parallel reduction likewise shows in the gradient norm. MLM/binary correct counts are
integers and must agree within 1 (an argmax tie flipped by an ulp).
"""

from __future__ import annotations

import dataclasses
import math
import time

import pytest
import torch
import torch.distributed as dist
from harness import run_distributed
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.distributed.tensor import DTensor

from scalable_transformer.config.schema import Config, ModelConfig, ParallelConfig, TrainConfig
from scalable_transformer.models import build_model, compute_loss, model_inputs
from scalable_transformer.parallel.dims import ParallelDims
from scalable_transformer.parallel.pipeline import PipelineRunner, split_model, stage_ids
from scalable_transformer.parallel.tensor import apply_tensor_parallel

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS, EVAL_AFTER, MICRO, MICRO_BATCH, EVAL_BATCHES, SEED, LR = 5, 3, 4, 2, 3, 1234, 1e-3
LOSS_RTOL, NORM_RTOL, COUNT_ATOL = 1e-5, 1e-5, 1.0
VOCAB, SEQ = 512, 32

PP2 = {  # name: (pipeline_schedule, virtual stages, pipeline_layers, tied, wrappers)
    "gpipe": ("gpipe", 1, None, True, ()),
    "1f1b": ("1f1b", 1, None, True, ()),
    "interleaved-1f1b-v2": ("interleaved-1f1b", 2, None, True, ()),
    "looped-bfs-v2": ("looped-bfs", 2, None, True, ()),
    "zero-bubble-v2": ("zero-bubble", 2, None, True, ()),
    "zbv": ("zbv", 2, None, True, ()),
    "1f1b-uneven-1,3": ("1f1b", 1, "1,3", True, ()),
    "1f1b-untied": ("1f1b", 1, None, False, ()),
    "zbv-checkpointed": ("zbv", 2, None, True, ("checkpoint",)),
}
FOUR = {  # name: ((dp, tp, pp), pipeline_schedule, virtual stages, wrappers in parallel/apply.py's order)
    "dp2-pp2-fsdp2-1f1b": ((2, 1, 2), "1f1b", 1, ("fsdp",)),
    "dp2-pp2-ddp-1f1b": ((2, 1, 2), "1f1b", 1, ("ddp",)),
    "dp2-pp2-checkpointed-fsdp2-interleaved-v2": ((2, 1, 2), "interleaved-1f1b", 2, ("checkpoint", "fsdp")),
    "pp4-1f1b": ((1, 1, 4), "1f1b", 1, ()),
    "tp2-pp2-1f1b": ((1, 2, 2), "1f1b", 1, ("tp",)),
    "tp2-sp-pp2-interleaved-v2": ((1, 2, 2), "interleaved-1f1b", 2, ("tp", "sp")),
}


def make_config(
    model_type: str,
    *,
    pp: int = 1,
    dp: int = 1,
    tp: int = 1,
    sp: bool = False,
    schedule: str = "1f1b",
    virtual: int = 1,
    layers: str | None = None,
    tied: bool = True,
) -> Config:
    cfg = Config()
    cfg.model = ModelConfig(
        type=model_type,
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=256,
        seq_length=SEQ,
        max_position_embeddings=SEQ,
        vocab_size=VOCAB,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tie_word_embeddings=tied,
        bert_binary_head=True,
        # GPT with rotary positions: later stages must know the full sequence length (sp shards it)
        position_embedding_type="rotary" if model_type == "gpt" else "learned",
    )
    cfg.parallel = ParallelConfig(
        dp=dp,
        tp=tp,
        pp=pp,
        sequence_parallel=sp,
        pipeline_schedule=schedule,
        virtual_pipeline_stages=virtual,
        pipeline_layers=layers,
    )
    cfg.train = TrainConfig(micro_batch_size=MICRO_BATCH, gradient_accumulation_steps=MICRO)
    return cfg


def make_batch(model_type: str, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    b, s = MICRO_BATCH, SEQ
    input_ids = torch.randint(0, VOCAB, (b, s), generator=gen)
    if model_type == "gpt":
        labels = torch.randint(0, VOCAB, (b, s), generator=gen)
        labels[:, -1] = -100
        return {"input_ids": input_ids, "labels": labels}
    attention_mask = torch.ones(b, s, dtype=torch.long)
    for row in range(b):  # 0..7 padding positions per sequence
        pad = int(torch.randint(0, 8, (1,), generator=gen))
        if pad:
            attention_mask[row, -pad:] = 0
    picked = (torch.rand(b, s, generator=gen) < 0.15) & attention_mask.bool()
    labels = torch.where(picked, torch.randint(0, VOCAB, (b, s), generator=gen), torch.full((b, s), -100))
    return {
        "input_ids": input_ids,
        "token_type_ids": (torch.arange(s) >= s // 2).long().expand(b, s).contiguous(),
        "attention_mask": attention_mask,
        "labels": labels,
        "nsp_labels": torch.randint(0, 2, (b,), generator=gen),
    }


def step_batches(model_type: str, step: int, dp: int) -> list[dict[str, torch.Tensor]]:
    """The global batch of one step: dp x MICRO micro-batches (dp rank r takes the r-th block of MICRO)."""
    return [make_batch(model_type, 1000 * step + i) for i in range(dp * MICRO)]


def eval_batches(model_type: str) -> list[dict[str, torch.Tensor]]:
    return [make_batch(model_type, 99_000 + i) for i in range(EVAL_BATCHES)]


def normalizers(batches: list[dict[str, torch.Tensor]]) -> dict[str, int]:
    labelled = sum(int((b["labels"] != -100).sum()) for b in batches)
    return {"tokens": max(labelled, 1), "samples": sum(int(b["input_ids"].shape[0]) for b in batches)}


def optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.01)


# ---------------------------------------------------------------- single-process reference


def reference_run(model_type: str, tied: bool, dp: int) -> dict:
    cfg = make_config(model_type, tied=tied)
    torch.manual_seed(SEED)
    model = build_model(cfg.model)
    opt = optimizer(model.parameters())
    losses, norms, evaluation = [], [], {}
    for step in range(STEPS):
        model.train()
        opt.zero_grad(set_to_none=True)
        batches = step_batches(model_type, step, dp)
        norm = normalizers(batches)
        total = 0.0
        for micro in batches:
            loss, metrics = compute_loss(model_type, model(*model_inputs(model_type, micro)), micro, norm)
            loss.backward()
            total += float(metrics["loss"])
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norms.append(float(torch.nn.utils.get_total_norm(grads, 2.0)))
        opt.step()
        losses.append(total)
        if step + 1 == EVAL_AFTER:
            model.eval()
            batches = eval_batches(model_type)
            norm = normalizers(batches)
            with torch.no_grad():
                for batch in batches:
                    outputs = model(*model_inputs(model_type, batch))
                    _, metrics = compute_loss(model_type, outputs, batch, norm)
                    for k, v in metrics.items():
                        evaluation[k] = evaluation.get(k, 0.0) + float(v)
    return {"losses": losses, "grad_norms": norms, "eval": evaluation}


_REFERENCES: dict[tuple, dict] = {}


def reference(model_type: str, tied: bool, dp: int) -> dict:
    key = (model_type, tied, dp)
    if key not in _REFERENCES:
        threads = torch.get_num_threads()
        # one thread, as in the children: on the shared 2 cores a second thread made this 10x slower
        torch.set_num_threads(1)
        try:
            _REFERENCES[key] = reference_run(model_type, tied, dp)
        finally:
            torch.set_num_threads(threads)
    return _REFERENCES[key]


# ---------------------------------------------------------------- pipelined run (in the children)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def grad_squares(grad: torch.Tensor, ranks_per_stage: int) -> torch.Tensor:
    """This rank's share of the squared gradient norm, such that the sum over all ranks counts each
    element once: the whole tensor's squared norm (a DTensor's reduced over its mesh, which also
    resolves Partial grads), split among the dp x tp ranks of the stage, which all compute it."""
    if isinstance(grad, DTensor):
        return torch.linalg.vector_norm(grad.double()).full_tensor() ** 2 / ranks_per_stage
    return grad.double().pow(2).sum() / ranks_per_stage


def pipelined_run(cfg: Config, wrappers: tuple[str, ...]) -> dict:
    """One case on this rank: build, split, wrap, train STEPS steps and evaluate once."""
    start = time.perf_counter()
    p, model_type = cfg.parallel, cfg.model.type
    dims = ParallelDims.from_config(cfg, rank=dist.get_rank())
    mesh = dims.build_mesh("cpu")
    dims = dataclasses.replace(dims, mesh=mesh)
    pp_group, dp_group = mesh.get_group("pp"), mesh.get_group("dp")
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    torch.manual_seed(SEED)
    model = build_model(cfg.model)
    ids = stage_ids(p.pp, pp_rank, p.virtual_pipeline_stages, p.pipeline_schedule)
    stages = split_model(model, cfg, pp_rank)
    del model
    if "tp" in wrappers:
        for stage in stages:
            apply_tensor_parallel(stage, mesh["tp"], p.sequence_parallel)
    if "checkpoint" in wrappers:
        for stage in stages:
            layers = stage.get_submodule("layers")
            for key, block in layers.items():  # type: ignore[operator]
                layers[key] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    if "fsdp" in wrappers:
        from torch.distributed.fsdp import fully_shard

        for stage in stages:
            for block in stage.get_submodule("layers").values():  # type: ignore[operator]
                fully_shard(block, mesh=mesh["dp"], reshard_after_forward=True)
            fully_shard(stage, mesh=mesh["dp"], reshard_after_forward=True)
    elif "ddp" in wrappers:
        from torch.nn.parallel import DistributedDataParallel

        stages = [DistributedDataParallel(stage, process_group=dp_group) for stage in stages]
    assert dims.stage_ids == ids
    runner = PipelineRunner(stages, dims, cfg, torch.device("cpu"), MICRO)
    params = [param for stage in stages for param in stage.parameters()]
    opt = optimizer(params)
    excluded = runner.grad_norm_excluded()
    losses, norms, evaluation, tie_gap = [], [], {}, 0.0
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        batches = step_batches(model_type, step, p.dp)
        mine = batches[dp_rank * MICRO : (dp_rank + 1) * MICRO]
        # DDP and FSDP average gradients over dp; each loss is already a share of the global mean
        metrics = runner.train_step(mine, normalizers(batches), loss_multiplier=float(p.dp))
        runner.sync_tied_grads()
        squares = torch.zeros((), dtype=torch.float64)
        for param in params:
            if param.grad is not None and id(param) not in excluded:
                squares += grad_squares(param.grad, p.dp * p.tp)
        dist.all_reduce(squares)
        opt.step()
        loss = metrics["loss"].detach().double().reshape(1)
        dist.all_reduce(loss, group=runner.group)  # the last stage's sum, zeros on the others
        dist.all_reduce(loss, group=dp_group)
        losses.append(float(loss))
        norms.append(float(squares.sqrt()))
        if step + 1 == EVAL_AFTER:
            batches = eval_batches(model_type)
            evaluation = runner.evaluate(batches, normalizers(batches))
    if cfg.model.tie_word_embeddings:  # the copies must still be identical (same dp shard on both)
        modules = [getattr(stage, "module", stage) for stage in stages]
        words = [
            _local(module.get_parameter("embedding.word.weight").detach()).clone()
            for module in modules
            if "embedding.word.weight" in dict(module.named_parameters())
        ]
        gathered: list = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(gathered, words, group=pp_group)
        copies = [w for per_rank in gathered for w in per_rank]
        tie_gap = max(float((w - copies[0]).abs().max()) for w in copies)
    return {
        "losses": losses,
        "grad_norms": norms,
        "eval": evaluation,
        "tie_gap": tie_gap,
        "seconds": time.perf_counter() - start,
    }


def _cases(rank: int, world_size: int, cases: dict[str, tuple[Config, tuple[str, ...]]]) -> dict[str, dict]:
    results = {}
    for name, (cfg, wrappers) in cases.items():
        results[name] = pipelined_run(cfg, wrappers)
        dist.barrier()
    return results


# ---------------------------------------------------------------- the tests


def check(name: str, got: dict, want: dict) -> dict[str, float]:
    """Assert got matches want; returns the largest relative differences (for the printed report)."""
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], want["losses"], strict=True))
    norm_diff = max(abs(a - b) / abs(b) for a, b in zip(got["grad_norms"], want["grad_norms"], strict=True))
    for step, (a, b) in enumerate(zip(got["losses"], want["losses"], strict=True)):
        assert math.isclose(a, b, rel_tol=LOSS_RTOL), f"{name}: loss of step {step + 1}: {a!r} != {b!r}"
    for step, (a, b) in enumerate(zip(got["grad_norms"], want["grad_norms"], strict=True)):
        assert math.isclose(a, b, rel_tol=NORM_RTOL), f"{name}: grad norm of step {step + 1}: {a!r} != {b!r}"
    assert sorted(got["eval"]) == sorted(want["eval"]), name
    eval_diff = 0.0
    for key, b in want["eval"].items():
        a = got["eval"][key]
        if key.endswith(("_correct", "_count")):
            assert abs(a - b) <= COUNT_ATOL, f"{name}: eval {key}: {a} != {b}"
        else:
            eval_diff = max(eval_diff, abs(a - b) / abs(b))
            assert math.isclose(a, b, rel_tol=LOSS_RTOL), f"{name}: eval {key}: {a!r} != {b!r}"
    assert got["tie_gap"] == 0.0, f"{name}: the tied word-embedding copies drifted by {got['tie_gap']}"
    return {"loss": loss_diff, "grad_norm": norm_diff, "eval": eval_diff}


def report(title: str, rows: dict[str, dict[str, float]], seconds: dict[str, float]) -> None:
    print(f"\n{title}: max relative difference to the single-process run, seconds per case (rank 0)")
    for name, diffs in rows.items():
        print(
            f"  {name:42s} loss {diffs['loss']:.1e}  grad norm {diffs['grad_norm']:.1e}  "
            f"eval {diffs['eval']:.1e}  {seconds[name]:5.1f} s"
        )


@pytest.fixture(scope="module")
def pp2_results(tmp_path_factory):
    cases = {
        f"{model}/{name}": (
            make_config(model, pp=2, schedule=schedule, virtual=virtual, layers=layers, tied=tied),
            wrappers,
        )
        for model in ("gpt", "bert")
        for name, (schedule, virtual, layers, tied, wrappers) in PP2.items()
    }
    return run_distributed(_cases, 2, cases, tmp_dir=tmp_path_factory.mktemp("pp2"), timeout=600)


@pytest.fixture(scope="module")
def four_results(tmp_path_factory):
    cases = {
        f"{model}/{name}": (
            make_config(model, dp=dp, tp=tp, pp=pp, sp="sp" in wrappers, schedule=schedule, virtual=virtual),
            wrappers,
        )
        for model in ("gpt", "bert")
        for name, ((dp, tp, pp), schedule, virtual, wrappers) in FOUR.items()
    }
    return run_distributed(_cases, 4, cases, tmp_dir=tmp_path_factory.mktemp("four"), timeout=600)


@pytest.mark.parametrize("model", ["gpt", "bert"])
def test_pp2_schedules_match_single_process(model, pp2_results):
    rows, seconds = {}, {}
    for name, (_, _, _, tied, _) in PP2.items():
        key = f"{model}/{name}"
        ranks = [results[key] for results in pp2_results]
        assert ranks[0]["losses"] == ranks[1]["losses"], f"{key}: pipeline ranks disagree on the losses"
        assert ranks[0]["eval"] == ranks[1]["eval"], f"{key}: pipeline ranks disagree on the evaluation"
        rows[name] = check(key, ranks[0], reference(model, tied, dp=1))
        seconds[name] = ranks[0]["seconds"]
    report(f"{model} pp=2", rows, seconds)


@pytest.mark.parametrize("model", ["gpt", "bert"])
def test_four_process_layouts_match_single_process(model, four_results):
    rows, seconds = {}, {}
    for name, ((dp, _, _), _, _, _) in FOUR.items():
        key = f"{model}/{name}"
        ranks = [results[key] for results in four_results]
        assert all(r["losses"] == ranks[0]["losses"] for r in ranks), f"{key}: ranks disagree on the losses"
        rows[name] = check(key, ranks[0], reference(model, True, dp=dp))
        seconds[name] = ranks[0]["seconds"]
    report(f"{model} on 4 processes", rows, seconds)


def test_stage_ids_and_split_keep_parameter_names():
    assert stage_ids(4, 1, 2, "interleaved-1f1b") == [1, 5]
    assert stage_ids(2, 0, 2, "zbv") == [0, 3] and stage_ids(2, 1, 2, "zbv") == [1, 2]
    for model_type in ("gpt", "bert"):
        cfg = make_config(model_type, pp=2, schedule="1f1b", layers="1,3")
        torch.manual_seed(SEED)
        model = build_model(cfg.model)
        full = model.state_dict()
        split = {}
        for rank in range(2):
            (stage,) = split_model(model, cfg, rank)
            for key, value in stage.state_dict().items():
                if key in split:  # only the tied copy appears twice
                    assert key == "embedding.word.weight" and torch.equal(value, split[key]), key
                split[key] = value
        assert sorted(split) == sorted(full)
        assert all(torch.equal(split[key], full[key]) for key in full)
