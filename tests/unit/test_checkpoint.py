"""Checkpoints in one process: contents, finetune and no_load_optim semantics, and every bad input
failing before any training step with nothing existing touched."""

from __future__ import annotations

import gc
import json
import os
import warnings
from pathlib import Path

import pytest

from scalable_transformer.checkpoint.manager import CheckpointError, describe_checkpoint, prune
from scalable_transformer.cli.checkpoint import render_info
from scalable_transformer.config.load import load_config
from scalable_transformer.train.run import run_training

pytestmark = pytest.mark.slow

TINY = [
    "model.type=gpt",
    "model.num_layers=2",
    "model.hidden_size=32",
    "model.num_attention_heads=2",
    "model.seq_length=32",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.train_iters=4",
    "train.eval_interval=0",
    "train.eval_iters=1",
    "logging.log_interval=1",
    "logging.tensorboard=false",
    "logging.warmup_iters=0",
]


def train(tmp: Path, name: str, *overrides: str) -> list[dict]:
    cfg = load_config(
        None, [*TINY, f"logging.run_dir={tmp / 'runs'}", f"logging.run_name={name}", *overrides]
    )
    out, _ = run_training(cfg)
    assert out is not None
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "train"]


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 4-iteration run saving at 2 and 4: (tmp dir, its records, the save directory)."""
    tmp = tmp_path_factory.mktemp("saved")
    records = train(tmp, "saved", f"checkpoint.save={tmp / 'ckpt'}", "checkpoint.save_interval=2")
    return tmp, records, tmp / "ckpt"


def test_layout_on_disk_and_info(saved):
    _, _, ckpt = saved
    assert (ckpt / "latest").read_text() == "iter_0000004\n"
    assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000002", "iter_0000004", "latest"]
    meta = json.loads((ckpt / "iter_0000004" / "metadata.json").read_text())
    assert (meta["iteration"], meta["consumed_samples"], meta["world_size"]) == (4, 16, 1)
    assert meta["model"]["hidden_size"] == 32 and "model:" in meta["config_yaml"]
    assert meta["environment"]["torch"] and meta["scheduler"]["last_epoch"] == 4
    assert "rng/rank_00000.pt" in meta["files"] and "__0_0.distcp" in meta["files"]
    info = render_info(describe_checkpoint(str(ckpt)))
    for text in ("iteration: 4 (16 consumed samples)", "layout dp=1 tp=1 pp=1 zero0", "2 layers x 32 hidden"):
        assert text in info


def test_keep_last_n_and_leftovers_of_killed_saves(tmp_path):
    for i in (2, 4, 6):
        (tmp_path / f"iter_{i:07d}").mkdir()
        (tmp_path / f"iter_{i:07d}" / "metadata.json").write_text("{}")
    (tmp_path / "iter_0000008").mkdir()  # incomplete: never counted, never the reason to delete
    (tmp_path / ".tmp-iter_0000010").mkdir()
    prune(tmp_path, 2, keep="iter_0000006")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000004", "iter_0000006", "iter_0000008"]


def test_finetune_loads_weights_only(saved, tmp_path):
    _, records, ckpt = saved
    fresh = train(tmp_path, "fresh", "train.train_iters=2")
    tuned = train(
        tmp_path, "tuned", "train.train_iters=2", f"checkpoint.load={ckpt}", "checkpoint.finetune=true"
    )
    assert [r["iteration"] for r in tuned] == [1, 2]
    assert [r["consumed_samples"] for r in tuned] == [4, 8]  # the data from the start
    assert [r["lr"] for r in tuned] == [r["lr"] for r in fresh]  # a fresh schedule (2 iterations)
    assert tuned[0]["loss"] < records[0]["loss"] - 0.01  # trained weights, not a fresh init


def test_no_load_optim_keeps_position_and_schedule(saved, tmp_path):
    _, records, ckpt = saved
    got = train(
        tmp_path, "no-optim", f"checkpoint.load={ckpt / 'iter_0000002'}", "checkpoint.no_load_optim=true"
    )
    assert [r["iteration"] for r in got] == [3, 4]
    assert [r["lr"] for r in got] == [r["lr"] for r in records[2:]]
    assert got[0]["loss"] == records[2]["loss"]  # same weights and batch; only the update differs
    exact = train(tmp_path, "exact", f"checkpoint.load={ckpt / 'iter_0000002'}")
    assert [(r["loss"], r["lr"]) for r in exact] == [(r["loss"], r["lr"]) for r in records[2:]]


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize(
    "damage, message",
    [
        ("truncate-shard", r"truncated or corrupted: __0_0\.distcp has \d+ bytes, \d+ were written"),
        ("delete-shard", r"__0_0\.distcp is missing"),
        ("corrupt-metadata", r"metadata\.json is corrupt"),
        ("delete-metadata", r"metadata\.json is missing"),
        ("corrupt-dcp-index", r"\.metadata does not match its CRC-32"),
        ("flip-shard-bytes", r"__0_0\.distcp does not match its CRC-32"),
    ],
)
def test_damaged_checkpoint_fails_before_training(saved, tmp_path, damage, message):
    ckpt = _copy(saved[2] / "iter_0000004", tmp_path / "iter_0000004")
    shard, index, meta = ckpt / "__0_0.distcp", ckpt / ".metadata", ckpt / "metadata.json"
    if damage == "truncate-shard":
        shard.write_bytes(shard.read_bytes()[:1000])
    elif damage == "delete-shard":
        shard.unlink()
    elif damage == "corrupt-metadata":
        meta.write_text(meta.read_text()[:50])
    elif damage == "delete-metadata":
        meta.unlink()
    elif damage == "flip-shard-bytes":  # same size: a bit flip on disk or a partial overwrite
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    else:  # same size, so only reading it can tell
        index.write_bytes(b"\x00" * index.stat().st_size)
    with pytest.raises(CheckpointError, match=message):
        train(tmp_path, "damaged", f"checkpoint.load={ckpt}")
    assert not (tmp_path / "runs").exists()  # failed before the run directory, before any step


def test_missing_load_dir_and_unwritable_save_dir(tmp_path):
    with pytest.raises(CheckpointError, match=r"checkpoint.load = .*nope: no such directory"):
        train(tmp_path, "x", f"checkpoint.load={tmp_path / 'nope'}")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="no checkpoint there"):
        train(tmp_path, "x", f"checkpoint.load={empty}")
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(CheckpointError, match=r"checkpoint.save = .*: directory is not writable"):
        train(tmp_path, "x", f"checkpoint.save={blocker / 'ckpt'}")
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(CheckpointError, match="not writable"):
            train(tmp_path, "x", f"checkpoint.save={ro}")
    assert not (tmp_path / "runs").exists()


def test_other_model_shape_names_the_tensors_and_touches_nothing(saved, tmp_path):
    ckpt = _copy(saved[2], tmp_path / "ckpt")
    before = snapshot(ckpt)
    with pytest.raises(CheckpointError, match="different model shape") as err:
        train(
            tmp_path,
            "wider",
            "model.hidden_size=64",
            f"checkpoint.save={ckpt}",
            "checkpoint.load=auto",
        )
    assert "layers.0.mlp.up.weight: checkpoint (128, 32), model (256, 64)" in str(err.value)
    assert snapshot(ckpt) == before
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        with pytest.raises(CheckpointError, match=r"layers\.2\.mlp\.up\.weight: not in the checkpoint"):
            train(tmp_path, "deeper", "model.num_layers=3", f"checkpoint.load={ckpt}")
        gc.collect()  # an unclosed metrics file would warn when collected
    # the run never started: no stub run directory, no file left open (issue 11)
    assert not (tmp_path / "runs" / "wider").exists() and not (tmp_path / "runs" / "deeper").exists()
    assert [w for w in caught if issubclass(w.category, ResourceWarning)] == []


def test_resuming_a_finished_run_trains_nothing_and_rewrites_nothing(saved, tmp_path):
    ckpt = _copy(saved[2], tmp_path / "ckpt")
    before = snapshot(ckpt)
    cfg = load_config(
        None,
        [*TINY, f"logging.run_dir={tmp_path / 'runs'}", f"checkpoint.save={ckpt}", "checkpoint.load=auto"],
    )
    _, summary = run_training(cfg)
    assert summary == {"iterations": 0, "resumed_at_iteration": 4}
    assert snapshot(ckpt) == before
