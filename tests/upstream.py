"""Other projects' files the tests read: the configs and launch scripts users have (GPT-NeoX's configs/,
Megatron's example scripts, DeepSpeed JSONs), each at the commit tests/fixtures/upstream/SOURCES.md pins.

They are read from a git snapshot of the project, never copied into this repository (the snapshots come
from the search tool's `fetch`, whose terms keep fetched files out of commits). The snapshots live in
`STX_UPSTREAM_MIRRORS`/OWNER+NAME/repo (a bare git directory; default /work/.mirror, where `fetch` leaves
them). Where a snapshot or the pinned commit is missing, a test that needs it is skipped and says which;
what our code derives from these files and the figures their projects publish are asserted by the tests
themselves, so a snapshot only has to be present, not trusted.
"""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import pytest

MIRRORS = Path(os.environ.get("STX_UPSTREAM_MIRRORS", "/work/.mirror"))

MEGATRON_LM = ("NVIDIA/Megatron-LM", "d98e8a64ddf34856e74b24714e3bedb2f5a39553")
MEGATRON_DEEPSPEED = ("microsoft/Megatron-DeepSpeed", "f4157bea69f3df8c6cb66f2ebcda66ba03d1288e")
GPT_NEOX = ("EleutherAI/gpt-neox", "ea7aefd8f8e183256992d9fede4d7c71a46d67a5")


@dataclass(frozen=True)
class Upstream:
    """One file of another project: its repository (owner/name), the commit, the path there."""

    repo: str
    commit: str
    path: str

    @property
    def name(self) -> str:
        return PurePosixPath(self.path).name

    def __str__(self) -> str:  # pytest ids
        return self.name


def _git_dir(repo: str) -> Path:
    return MIRRORS / repo.replace("/", "+") / "repo"


def _git(repo: str, *args: str) -> bytes:
    git_dir = _git_dir(repo)
    if not git_dir.is_dir():
        pytest.skip(f"no snapshot of {repo} in {git_dir.parent} (STX_UPSTREAM_MIRRORS): fetch github:{repo}")
    done = subprocess.run(["git", f"--git-dir={git_dir}", *args], capture_output=True, timeout=120)
    if done.returncode:
        pytest.skip(f"the snapshot of {repo} lacks what this test reads: {done.stderr.decode().strip()}")
    return done.stdout


def read_upstream(src: Upstream) -> bytes:
    """The file's bytes at its commit (the test is skipped when no snapshot holds them)."""
    return _git(src.repo, "show", f"{src.commit}:{src.path}")


def upstream_file(src: Upstream, directory: Path) -> Path:
    """The file written to directory/NAME, as the project ships it; returns its path."""
    out = directory / src.name
    out.write_bytes(read_upstream(src))
    return out


def upstream_tree(repo: str, commit: str, path: str, directory: Path) -> Path:
    """The folder `path` of the repository at `commit`, written under directory; returns it."""
    archive = _git(repo, "archive", "--format=tar", commit, path)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(directory, filter="data")
    return directory / path
