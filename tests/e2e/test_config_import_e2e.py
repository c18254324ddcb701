"""`stx config import` as a user runs it: a DeepSpeed ZeRO-3 + offload JSON and a Megatron BERT command
line become one config whose resolved layout (`stx config show`) is the one the original run used."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

DS_ZERO3_OFFLOAD = {
    "train_batch_size": 64,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 4,
    "gradient_clipping": 1.0,
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "hysteresis": 2},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": 5e8,
        "stage3_prefetch_bucket_size": 5e8,
    },
    "steps_per_print": 10,
}
MEGATRON_BERT = (
    "torchrun --nproc_per_node 8 pretrain_bert.py --num-layers 24 --hidden-size 1024 "
    "--num-attention-heads 16 --seq-length 512 --max-position-embeddings 512 "
    "--tensor-model-parallel-size 2 --micro-batch-size 4 --global-batch-size 64 --lr 0.0001 "
    "--train-iters 1000 --fp16 --checkpoint-activations --data-path /gpfs/data/text_sentence "
    "--vocab-file /gpfs/vocab.txt --deepspeed --deepspeed_config ds_config.json"
)


def stx(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "scalable_transformer.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ.copy(),
    )


def test_deepspeed_zero3_offload_and_megatron_bert_import(tmp_path):
    (tmp_path / "ds_config.json").write_text(json.dumps(DS_ZERO3_OFFLOAD), encoding="utf-8")
    proc = stx(
        "config",
        "import",
        "--deepspeed",
        "ds_config.json",
        "--megatron-args",
        MEGATRON_BERT,
        "-o",
        "c.yaml",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "c.yaml").read_text(encoding="utf-8")
    # the DeepSpeed tuning knobs are listed in the file, and the cluster paths are left to fill in
    assert "zero_optimization.overlap_comm" in text and "zero_optimization.reduce_bucket_size" in text
    assert "#   data.path: /gpfs/data/text_sentence" in text

    # 8 processes: tp 2 x dp 4 (64 = micro 4 x accumulation 4 x dp 4)
    shown = stx("config", "show", "c.yaml", "--world-size", "8", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    cfg = yaml.safe_load(shown.stdout)
    assert cfg["model"]["type"] == "bert" and cfg["model"]["num_layers"] == 24
    assert cfg["parallel"]["tp"] == 2 and cfg["parallel"]["dp"] == 4
    assert cfg["parallel"]["zero_stage"] == 3
    assert cfg["parallel"]["offload_optimizer"] is True and cfg["parallel"]["offload_param"] is True
    assert cfg["parallel"]["activation_checkpointing"] == "full"
    assert cfg["train"]["micro_batch_size"] == 4
    assert cfg["train"]["gradient_accumulation_steps"] == 4
    assert cfg["train"]["global_batch_size"] == 64
    assert cfg["train"]["precision"] == "fp16"

    # never overwrites without --force; the file is unchanged
    again = stx("config", "import", "--deepspeed", "ds_config.json", "-o", "c.yaml", cwd=tmp_path)
    assert again.returncode == 2 and "exists; give --force" in again.stderr
    assert (tmp_path / "c.yaml").read_text(encoding="utf-8") == text
