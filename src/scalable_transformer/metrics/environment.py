"""The environment fingerprint stored with every result: versions, hardware, and this package's revision.

Throughput figures are only comparable between runs whose fingerprints match, so every run
directory and every stored result carries one (`stx env` prints it).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import socket
import subprocess
from pathlib import Path
from typing import Any

import torch

import scalable_transformer

from .device_table import cpu_model

PACKAGES = (
    "torch",
    "tokenizers",
    "numpy",
    "pyyaml",
    "tensorboard",
    "rich",
    "psutil",
    "zstandard",
    "transformers",
)


def _git_revision() -> str | None:
    """Revision of the source checkout this package runs from (None for an installed wheel)."""
    root = Path(scalable_transformer.__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        rev = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return rev + ("-dirty" if dirty else "")


def _memory_bytes() -> int | None:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except ImportError:  # psutil is a dependency, but the fingerprint must never crash a run
        return None


def environment() -> dict[str, Any]:
    """Versions and hardware of this process's machine (JSON-serialisable)."""
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            gpus.append({"name": props.name, "memory_bytes": props.total_memory})
    nccl = None
    if torch.cuda.is_available() and torch.distributed.is_nccl_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    return {
        "scalable_transformer": scalable_transformer.__version__,
        "git_revision": _git_revision(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl,
        "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        "packages": versions,
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_bytes": _memory_bytes(),
        "gpus": gpus,
        "env": {
            k: os.environ[k]
            for k in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "WORLD_SIZE")
            if k in os.environ
        },
    }


def record_sections(resolved_config_yaml: str | None = None) -> list[str]:
    """Markdown lines every benchmark record ends with: the resolved config (if any) and this environment."""
    lines: list[str] = []
    if resolved_config_yaml is not None:
        lines += ["## Resolved config", "", "```yaml", resolved_config_yaml.rstrip(), "```", ""]
    lines += ["## Environment", "", "```json", json.dumps(environment(), indent=2, default=str), "```", ""]
    return lines
