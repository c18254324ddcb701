"""`stx env`: versions and hardware fingerprint (the env.json of every run directory)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from ..metrics.environment import environment


@dataclasses.dataclass(frozen=True)
class EnvOptions:
    as_json: bool = False  # the whole fingerprint as JSON instead of one line per entry


def run(args: argparse.Namespace) -> int:
    opts = EnvOptions(as_json=args.json)
    env = environment()
    if opts.as_json:
        print(json.dumps(env, indent=2))
    else:
        for line in env_lines(env):
            print(line)
    return 0


def env_lines(env: dict[str, Any]) -> list[str]:
    """One `key: value` line per entry, keys right-aligned; dicts and lists on one line."""
    lines = []
    for key, value in env.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k} {v}" for k, v in value.items()) or "-"
        elif isinstance(value, list):
            value = "; ".join(json.dumps(v) for v in value) or "-"
        lines.append(f"{key:>22}: {value}")
    return lines
