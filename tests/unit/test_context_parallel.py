"""Context parallelism (parallel.cp): the pure pieces. Which tokens a cp rank holds and how the gathered
sequence goes back into order, the attention mask of global positions (the single process's mask,
restricted to a rank's rows), the layout rules, their errors and the peers' names. The attention on 2
gloo ranks against single-process SDPA is tests/distributed/test_context_parallel_attention.py, and
training equivalence (cp2, cp2 x FSDP2, cp2 x tp2 with and without SP, GPT / Llama (GQA, MQA) / BERT,
packed documents, sliding window, ALiBi) is tests/distributed/test_equivalence.py (CP_TWO, CP_FOUR,
ARCH_CP_TWO)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from scalable_transformer.config.foreign_configs import ImportSources, import_configs
from scalable_transformer.config.load import load_config
from scalable_transformer.config.validate import resolve
from scalable_transformer.errors import ConfigError
from scalable_transformer.models.context_parallel import (
    chunk_positions,
    context_parallel_mask,
    restore_sequence,
    sequence_order,
    split_sequence,
)
from scalable_transformer.models.layers import CoreAttention, alibi_slopes, document_mask
from scalable_transformer.parallel.context import split_batch
from scalable_transformer.parallel.dims import ParallelDims

TINY = [
    "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.seq_length=32",
    "model.vocab_size=512", "train.micro_batch_size=2", "train.global_batch_size=16",
]  # fmt: skip


# ---------------------------------------------------------------- chunks


def test_each_rank_keeps_chunks_r_and_2cp_minus_1_minus_r():
    assert chunk_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert chunk_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert chunk_positions(12, 3, 1).tolist() == [2, 3, 8, 9]
    assert chunk_positions(4, 1, 0).tolist() == [0, 1, 2, 3]
    # causal work: every rank attends to the same number of (query, key) pairs
    for cp in (2, 4):
        work = [int((chunk_positions(64, cp, r) + 1).sum()) for r in range(cp)]
        assert len(set(work)) == 1, work


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_split_then_gathered_in_rank_order_restores_the_sequence(cp):
    seq = 2 * cp * 5
    x = torch.arange(2 * seq * 3).view(2, seq, 3)
    shares = [split_sequence(x, cp, r, dim=1) for r in range(cp)]
    for r, share in enumerate(shares):
        assert torch.equal(share, x[:, chunk_positions(seq, cp, r)])
    gathered = torch.cat(shares, dim=1)  # what an all-gather along the sequence returns
    assert torch.equal(restore_sequence(gathered, cp, dim=1), x)
    assert sorted(sequence_order(seq, cp).tolist()) == list(range(seq))


def test_a_sequence_that_does_not_split_is_an_error():
    with pytest.raises(ValueError, match="not divisible by 2 x cp = 4"):
        chunk_positions(10, 2, 0)
    with pytest.raises(ValueError, match="rank 2 of 2"):
        chunk_positions(8, 2, 2)


def test_split_batch_cuts_the_sequence_tensors_and_keeps_per_sample_ones():
    batch = {
        "input_ids": torch.arange(16).view(2, 8),
        "attention_mask": torch.ones(2, 8, dtype=torch.int64),
        "nsp_labels": torch.tensor([0, 1]),
    }
    share = split_batch(batch, 2, 1, seq_length=8)
    assert share["input_ids"].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert share["attention_mask"].shape == (2, 4) and torch.equal(share["nsp_labels"], batch["nsp_labels"])
    assert split_batch(batch, 1, 0, seq_length=8) is batch


# ---------------------------------------------------------------- masks of global positions


def _rows(mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return mask.index_select(-2, positions)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize(
    ("causal", "window", "alibi"),
    [(True, None, False), (True, 3, False), (True, None, True), (False, None, False)],
)
def test_the_mask_is_the_single_process_mask_on_the_ranks_rows(cp, causal, window, alibi):
    seq, heads = 16, 4
    slopes = alibi_slopes(heads) if alibi else None
    core = CoreAttention(0.0, causal, window, slopes)
    full = core.bias(seq, torch.device("cpu"), torch.float32)
    if full is None:  # plain causal (SDPA's is_causal) or full attention
        full = torch.ones(seq, seq, dtype=torch.bool)
        full = full.tril() if causal else full
    for r in range(cp):
        positions = chunk_positions(seq, cp, r)
        got = context_parallel_mask(positions, seq, causal=causal, window=window, slopes=slopes)
        assert got.shape == ((1, heads, seq // cp, seq) if alibi else (1, 1, seq // cp, seq))
        assert torch.equal(got[0] if alibi else got[0, 0], _rows(full, positions))


def test_document_and_padding_masks_follow_the_global_positions():
    seq, cp = 12, 2
    docs = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2], [0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]])
    full = document_mask(docs, None)  # [b, 1, S, S], block-causal
    padding = torch.tensor([[1] * 10 + [0] * 2, [1] * 12])
    for r in range(cp):
        positions = chunk_positions(seq, cp, r)
        got = context_parallel_mask(positions, seq, causal=True, document_ids_bS=docs)
        assert torch.equal(got, _rows(full, positions))
        bidirectional = context_parallel_mask(positions, seq, causal=False, padding_bS=padding)
        want = padding.bool()[:, None, None, :].expand(2, 1, seq // cp, seq)
        assert torch.equal(bidirectional, want)


# ---------------------------------------------------------------- layout rules


def test_cp_is_part_of_the_world_size_rank_order_and_label():
    cfg = resolve(load_config("tiny-gpt", [*TINY, "parallel.cp=2", "parallel.tp=2"]), 8)
    assert (cfg.parallel.dp, cfg.parallel.cp) == (2, 2)
    assert cfg.parallel.layout_label == "dp=2 cp=2 tp=2 pp=1 zero0"
    dims = ParallelDims.from_config(cfg, rank=6)
    # Megatron's order: tp fastest, then cp, then dp, then pp
    assert dims.coordinates() == {"pp": 0, "dp": 1, "cp": 1, "tp": 0}
    assert [dims.coordinates(r)["cp"] for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert (dims.world_size, dims.grad_ranks) == (8, 4)
    plain = resolve(load_config("tiny-gpt", TINY), 8).parallel
    assert "cp=" not in plain.layout_label
    piped = resolve(
        load_config("tiny-gpt", [*TINY, "parallel.cp=2", "parallel.pp=2", "parallel.zero_stage=3"]), 8
    )
    assert piped.parallel.layout_label == "dp=2 cp=2 tp=1 pp=2 zero3 schedule 1f1b"


@pytest.mark.parametrize(
    ("overrides", "world", "named"),
    [
        (
            ["parallel.cp=3"],
            3,
            r"parallel.cp = 3: model.seq_length \(32\) must be divisible by 2 x cp = 6.*: 2, 4, 8, 16$",
        ),
        (
            ["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true", "model.seq_length=36"],
            4,
            r"parallel.cp = 2: model.seq_length \(36\) must be divisible by 2 x cp x parallel.tp \(2\) under "
            r"sequence parallelism = 8",
        ),
        (["parallel.cp=2", "parallel.compile=true"], 2, r"parallel.cp = 2 with parallel.compile"),
        (["parallel.cp=2", "parallel.dp=2"], 2, r"dp \(2\) x cp \(2\) x tp \(1\) x pp \(1\) = 4 must equal"),
        (["parallel.cp=2"], 3, r"not divisible by parallel.cp \(2\)"),
        (["parallel.cp=0"], 2, r"parallel.cp"),
    ],
)  # fmt: skip
def test_a_layout_context_parallelism_cannot_run_is_refused_naming_parallel_cp(overrides, world, named):
    with pytest.raises(ConfigError, match=named):
        resolve(load_config("tiny-gpt", [*TINY, *overrides]), world)


@pytest.mark.parametrize("name", ["context_parallel_degree", "context-parallel-size"])
def test_the_peers_names_set_parallel_cp(name):
    assert load_config("tiny-gpt", [*TINY, f"{name}=4"]).parallel.cp == 4


def test_a_megatron_script_with_context_parallelism_imports(tmp_path: Path):
    script = tmp_path / "run.sh"
    script.write_text(
        "#!/bin/bash\npython pretrain_gpt.py --num-layers 2 --hidden-size 64 --num-attention-heads 4 "
        "--seq-length 128 --max-position-embeddings 128 --context-parallel-size 2\n",
        encoding="utf-8",
    )
    imported = import_configs(ImportSources(megatron_args_file=script))
    assert imported.values["parallel.cp"][0] == 2
