"""Bad inputs a new user tried (issue 11, part 3): each is one clear error that names the file, key or
value and what would be valid, with exit status 2, and `stx config validate` rejects exactly what
`stx train` would (one validation path: load -> resolve)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest

from scalable_transformer.cli import main


def _write(tmp_path: Path, name: str, content: bytes | str) -> str:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return str(path)


# (case id, files to create {name: content}, argv after `stx`, regex the error must match)
CASES = [
    ("empty-file", {"cfg": ""}, ["config", "validate", "{cfg}"], r"c\.yaml' is empty"),
    ("only-comments", {"cfg": "# nothing\n"}, ["config", "validate", "{cfg}"], r"c\.yaml' is empty"),
    (
        "binary-file",
        {"cfg": bytes(range(128, 256))},
        ["config", "validate", "{cfg}"],
        r"c\.yaml' is not UTF-8 text",
    ),
    ("directory", {}, ["config", "validate", "{dir}"], r"is a directory; give a YAML file or a preset"),
    (
        "duplicate-key",
        {"cfg": "model:\n  num_layers: 2\n  num_layers: 3\n"},
        ["config", "validate", "{cfg}"],
        r"c\.yaml:3: duplicate key 'num_layers'",
    ),
    (
        "section-not-a-mapping",
        {"cfg": "model: 5\n"},
        ["config", "validate", "{cfg}"],
        r"c\.yaml: 'model' is a section and must be a mapping",
    ),
    (
        "range-error-names-the-file",
        {"cfg": "optim:\n  lr: -1\n"},
        ["config", "validate", "{cfg}"],
        r"c\.yaml: 'optim\.lr' must be >= 0, got -1",
    ),
    (
        "lr-nan",
        {},
        ["config", "validate", "tiny-gpt", "optim.lr=nan"],
        r"'optim\.lr' must be a finite number",
    ),
    (
        "lr-inf",
        {},
        ["config", "validate", "tiny-gpt", "optim.lr=inf"],
        r"'optim\.lr' must be a finite number",
    ),
    (
        "adam-beta-1",
        {},
        ["config", "validate", "tiny-gpt", "optim.adam_beta2=1"],
        r"'optim\.adam_beta2' must be in \[0, 1\), got 1",
    ),
    (
        "adam-beta-negative",
        {},
        ["config", "validate", "tiny-gpt", "optim.adam_beta1=-0.1"],
        r"'optim\.adam_beta1' must be in \[0, 1\)",
    ),
    ("world-size-0", {}, ["config", "validate", "tiny-gpt", "--world-size", "0"], r"world size must be >= 1"),
    (
        "split-not-numbers",
        {},
        ["config", "validate", "tiny-gpt", "data.split=abc"],
        r"data\.split must be 1-3 non-negative weights like '949,50,1'.*got 'abc'",
    ),
    (
        "blend-malformed",
        {"cfg": "base: tiny-gpt\ndata:\n  path: 0.3 A x B\n"},
        ["config", "validate", "{cfg}"],
        r"'x' in data\.path is not a positive number: a blend is 'WEIGHT PREFIX",
    ),
    (
        "blend-weight-without-prefix",
        {},
        ["config", "validate", "tiny-gpt", "data.path=0.3 A 0.7"],
        r"weight '0\.7' in data\.path has no dataset prefix",
    ),
    (
        "micro-batch-too-large-for-the-sample-index",
        {},
        ["config", "validate", "tiny-gpt", "train.micro_batch_size=1000000000"],
        r"whose sample index needs about .* GiB, more than this machine's .*lower train\.micro_batch",
    ),
    (
        "train-rejects-a-bad-split",
        {},
        ["train", "tiny-gpt", "data.split=abc", "logging.run_dir={dir}"],
        r"data\.split must be",
    ),
    (
        "yaml-error-one-line-naming-file-line-column",
        {"cfg": "model:\n  num_layers: 2\n   hidden_size: 3\n"},
        ["config", "validate", "{cfg}"],
        r"c\.yaml:3:15: not valid YAML: mapping values are not allowed here$",
    ),
    (
        "flops-names-the-option-not-the-dataclass-field",
        {},
        [
            "flops",
            "--num-layers",
            "0",
            "--hidden-size",
            "8",
            "--seq-length",
            "8",
            "--vocab-size",
            "10",
            "--samples-per-second",
            "1",
        ],
        r"^stx flops: error: --num-layers must be an integer >= 1, got 0$",
    ),
    (
        "checkpoint-info-names-the-argument-not-checkpoint-load",
        {},
        ["checkpoint", "info", "{dir}/missing"],
        r"^stx: checkpoint error: '.*/d/missing': no such directory$",
    ),
    (
        "train-rejects-the-same",
        {},
        ["train", "tiny-gpt", "optim.lr=nan", "logging.run_dir={dir}"],
        r"'optim\.lr' must be a finite number",
    ),
]


@pytest.mark.parametrize("files, argv, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_clear_error(tmp_path, capsys, files, argv, message):
    names = {key: _write(tmp_path, "c.yaml", content) for key, content in files.items()}
    (tmp_path / "d").mkdir()
    names["dir"] = str(tmp_path / "d")
    before = sorted(os.listdir(tmp_path / "d"))
    code = main([a.format(**names) for a in argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1, err  # one line, no traceback
    assert re.search(message, err.strip()), err
    assert sorted(os.listdir(tmp_path / "d")) == before  # nothing written (no run directory)


def test_gpt_index_out_of_memory_is_a_clear_error(monkeypatch):
    """The config rule bounds the train samples; the data layer still turns numpy's MemoryError
    (evaluation sets, many epochs of a tiny corpus) into what to change."""
    from scalable_transformer.data import gpt_dataset
    from scalable_transformer.errors import IndexedDatasetError

    def no_memory(*args, **kwargs):
        raise MemoryError("Unable to allocate 11.6 TiB")

    monkeypatch.setattr(gpt_dataset, "build_gpt_indices", no_memory)
    with pytest.raises(IndexedDatasetError, match=r"does not fit in memory: lower train\.micro_batch_size"):
        gpt_dataset._build_or_explain(np.ones(3, dtype=np.int32), 0, 8, 0, 10**9, 1)
