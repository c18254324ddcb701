"""Bad inputs to the commands around training (issue 11, part 3): `stx report`, `stx report import-log`,
`stx sweep`, `stx preprocess`. Each is one clear error line naming the file, option or value and what
would be valid, exit status 2, and nothing written or modified."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import sqlite3
from pathlib import Path

import pytest

from scalable_transformer.cli import main

TOKENIZER = str(Path(__file__).parents[1] / "fixtures" / "tokenizers" / "bert-cased" / "vocab.txt")


def _snapshot(folder: Path) -> dict[str, tuple[str, int]]:
    """Every file under folder: (sha256 of its bytes, mtime in ns)."""
    out = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            out[str(path.relative_to(folder))] = (
                hashlib.sha256(path.read_bytes()).hexdigest(),
                path.stat().st_mtime_ns,
            )
        else:
            out[str(path.relative_to(folder))] = ("dir", 0)
    return out


def _other_programs_sqlite(path: Path) -> None:
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE notes (x TEXT)")
    conn.execute("INSERT INTO notes VALUES ('theirs')")
    conn.commit()
    conn.close()


def _empty_sqlite(path: Path) -> None:
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA user_version = 7")
    conn.commit()
    conn.close()


def _sweep(text: str):
    return lambda p: p.write_text(text, encoding="utf-8")


def _zst_truncated(path: Path) -> None:
    zstandard = pytest.importorskip("zstandard")
    data = "".join(json.dumps({"text": f"document {i} " * 30}) + "\n" for i in range(3000)).encode()
    compressed = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(compressed[: len(compressed) // 2])


def _gz_truncated(path: Path) -> None:
    data = gzip.compress("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(3000)).encode())
    path.write_bytes(data[: len(data) // 2])


# (id, {name: maker(path)}, argv after `stx` ({name} = that file, {dir} = the test folder), regex)
CASES = [
    (
        "report-empty-file",
        {"s.sqlite": lambda p: p.write_bytes(b"")},
        ["report", "{s.sqlite}"],
        r"s\.sqlite: an empty file, not a results store",
    ),
    (
        "report-export-empty-file",
        {"s.sqlite": lambda p: p.write_bytes(b"")},
        ["report", "export", "{s.sqlite}", "--format", "csv", "--output", "{dir}/x.csv"],
        r"s\.sqlite: an empty file, not a results store",
    ),
    (
        "report-other-programs-sqlite",
        {"s.sqlite": _other_programs_sqlite},
        ["report", "{s.sqlite}"],
        r"s\.sqlite: an SQLite file, but not a results store of scalable-transformer \(tables: notes\)",
    ),
    (
        "report-empty-sqlite-database",
        {"s.sqlite": _empty_sqlite},
        ["report", "{s.sqlite}"],
        r"s\.sqlite: an empty SQLite database, not a results store",
    ),
    (
        "import-log-devices-0",
        {"run.log": lambda p: p.write_text("iteration 1\n")},
        [
            "report",
            "import-log",
            "{run.log}",
            "--format",
            "megatron",
            "--devices",
            "0",
            "--store",
            "{dir}/r.sqlite",
        ],
        r"--devices must be an integer >= 1, got 0",
    ),
    (
        "import-log-negative-nodes",
        {"run.log": lambda p: p.write_text("iteration 1\n")},
        [
            "report",
            "import-log",
            "{run.log}",
            "--format",
            "megatron",
            "--nnodes",
            "-2",
            "--store",
            "{dir}/r.sqlite",
        ],
        r"--nnodes must be an integer >= 1, got -2",
    ),
    (
        "import-log-negative-seq-length",
        {"run.log": lambda p: p.write_text("iteration 1\n")},
        [
            "report",
            "import-log",
            "{run.log}",
            "--format",
            "megatron",
            "--seq-length",
            "-1",
            "--store",
            "{dir}/r.sqlite",
        ],
        r"--seq-length must be an integer >= 1, got -1",
    ),
    (
        "sweep-axes-empty-list",
        {"sweep.yaml": _sweep("base: tiny-gpt\naxes: []\nstore: results.sqlite\n")},
        ["sweep", "{sweep.yaml}", "--dry-run"],
        r"sweep\.yaml: 'axes': must be a non-empty mapping of config key .* got \[\]",
    ),
    (
        "sweep-axes-missing",
        {"sweep.yaml": _sweep("base: tiny-gpt\n")},
        ["sweep", "{sweep.yaml}", "--dry-run"],
        r"sweep\.yaml: 'axes': must be a non-empty mapping",
    ),
    (
        "preprocess-truncated-zst",
        {"in.jsonl.zst": _zst_truncated},
        [
            "preprocess",
            "--input",
            "{in.jsonl.zst}",
            "--output-prefix",
            "{dir}/out/c",
            "--tokenizer",
            TOKENIZER,
        ],
        r"in\.jsonl\.zst: truncated compressed stream",
    ),
    (
        "preprocess-truncated-zst-not-skippable",
        {"in.jsonl.zst": _zst_truncated},
        [
            "preprocess",
            "--input",
            "{in.jsonl.zst}",
            "--output-prefix",
            "{dir}/out/c",
            "--tokenizer",
            TOKENIZER,
            "--skip-bad-lines",
        ],
        r"in\.jsonl\.zst: truncated compressed stream.*--skip-bad-lines does not skip this",
    ),
    (
        "preprocess-truncated-gz-not-skippable",
        {"in.jsonl.gz": _gz_truncated},
        [
            "preprocess",
            "--input",
            "{in.jsonl.gz}",
            "--output-prefix",
            "{dir}/out/c",
            "--tokenizer",
            TOKENIZER,
            "--skip-bad-lines",
        ],
        r"in\.jsonl\.gz: truncated compressed stream",
    ),
    (
        "preprocess-output-prefix-under-a-file",
        {"in.jsonl": lambda p: p.write_text('{"text": "a b c"}\n'), "afile": lambda p: p.write_text("x")},
        ["preprocess", "--input", "{in.jsonl}", "--output-prefix", "{afile}/sub/c", "--tokenizer", TOKENIZER],
        r"output prefix '.*afile/sub/c': '.*afile' is a file, not a folder",
    ),
]


@pytest.mark.parametrize("files, argv, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_clear_error_and_changes_nothing(tmp_path, capsys, files, argv, message):
    names = {"dir": str(tmp_path)}
    for name, make in files.items():
        make(tmp_path / name)
        names[name] = str(tmp_path / name)
    for path in tmp_path.iterdir():
        os.utime(path, ns=(10**18, 10**18))
    before = _snapshot(tmp_path)
    code = main([re.sub(r"\{([^}]+)\}", lambda m: names[m.group(1)], a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1, err  # one line, no traceback, no debugging hint
    assert re.search(message, err), err
    assert _snapshot(tmp_path) == before  # no byte, no mtime, no file changed or added (WAL, -shm, out/)


def test_rows_key_unknown_names_the_valid_ones(tmp_path, capsys):
    from scalable_transformer.bench.results import ResultsStore

    with ResultsStore(tmp_path / "r.sqlite") as store:
        store.put(
            {
                "config_hash": "h",
                "status": "ok",
                "label": "tiny",
                "nproc": 1,
                "samples_per_second": 2.0,
                "overrides_json": json.dumps({"parallel.tp": 1}),
            }
        )
    code = main(["report", str(tmp_path / "r.sqlite"), "--rows", "nosuchcol"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert re.search(r"--rows: unknown key 'nosuchcol'; valid: devices, config_hash, .*label", err), err
    assert "sweep axes in this store: parallel.tp" in err
    assert main(["report", str(tmp_path / "r.sqlite"), "--rows", "parallel.tp"]) == 0  # an axis is valid
