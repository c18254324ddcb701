"""Valid layouts that once crashed in `stx train`, `stx plan` or its dry run (issue 41: a crash on a
valid layout is a bug, kept here once fixed). Each runs as a user ran it, through the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from scalable_transformer.config.load import load_config
from scalable_transformer.config.validate import resolve
from scalable_transformer.models.registry import build_model

pytestmark = pytest.mark.slow

STX = str(Path(sys.executable).with_name("stx"))


def test_the_default_bert_without_a_binary_head_trains_under_pipeline_parallelism(tmp_path: Path) -> None:
    """tiny-bert has no binary head, so its batches carry no nsp_labels; the pipeline's packed target
    read them anyway (KeyError: 'nsp_labels' in the last stage, found by a randomly drawn layout)."""
    argv = [STX, "launch", "-n", "2", "train", "tiny-bert", "parallel.pp=2"]
    argv += ["train.gradient_accumulation_steps=2", "train.train_iters=4", "train.eval_interval=2"]
    argv += ["logging.log_interval=2", "logging.tensorboard=false", f"logging.run_dir={tmp_path}"]
    argv += ["logging.run_name=pp2"]
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = (tmp_path / "pp2" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    train = [r for r in records if r["kind"] == "train"]
    valid = [r for r in records if r["kind"] == "valid"]
    assert [r["iteration"] for r in train] == [2, 4] and len(valid) == 2
    assert all(0 < r["loss"] < 20 for r in train + valid)  # an MLM loss alone: no binary term was added
    assert all("binary_loss" not in r for r in train + valid)


def test_the_planner_sizes_a_derived_swiglu_mlp_as_the_engine_builds_it() -> None:
    """llama-tiny gives no model.ffn_hidden_size: resolve (and so the engine) derives Llama's 2/3 x 4h
    rounded to ffn_multiple_of (352), but the planner's own preparation took 4h (512) and planned 5%
    more parameters (and their gradients and optimizer state) than any sampled Llama-shaped layout ran."""
    overrides = ["model.vocab_size=16384", "model.hidden_size=192", "model.num_attention_heads=4"]
    argv = [STX, "plan", "llama-tiny", *overrides, "--world-size", "1", "--device", "a100-80gb", "--json"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    planned = json.loads(proc.stdout)["layouts"][0]["memory_breakdown_bytes"]["parameters"]
    model = build_model(resolve(load_config("llama-tiny", overrides), 1).model)
    assert planned == 4 * sum(p.numel() for p in model.parameters())  # fp32 parameters, ZeRO-0


def test_a_zero_bubble_pipeline_under_zero3_dry_runs() -> None:
    """The zero-bubble schedules compute a stage's input gradients with torch.autograd.grad, where the
    dry run's module tracker (its backward hooks ask autograd which nodes will run) made torch raise "A
    leaf node was passed to _will_engine_execute_node" (found by a sampled layout; the real run trains)."""
    from scalable_transformer.dryrun import dry_run as dry

    overrides = ["model.num_layers=4", "parallel.pp=2", "parallel.zero_stage=3"]
    overrides += ["parallel.pipeline_schedule=zero-bubble", "parallel.virtual_pipeline_stages=2"]
    overrides += ["train.gradient_accumulation_steps=2", "train.micro_batch_size=1"]
    cfg = resolve(load_config("tiny-gpt", overrides), 4)
    rank = dry.run_rank(cfg, 4, 0, "cpu")
    assert rank.peak_memory_bytes > 0 and rank.peak_at["phase"]
    assert any(c["kind"] == "reduce_scatter" for c in rank.collectives), rank.collectives
