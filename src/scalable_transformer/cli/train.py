"""`stx train [CONFIG] [key=value ...]`."""

from __future__ import annotations

import argparse
import dataclasses


def split_config_args(items: list[str]) -> tuple[str | None, list[str]]:
    """`[CONFIG] [key=value ...]`: the first item is the config unless it is an override."""
    if items and "=" not in items[0]:
        return items[0], items[1:]
    return None, items


@dataclasses.dataclass(frozen=True)
class TrainOptions:
    """config: preset name or YAML path (None: the embedded default); overrides: key=value strings."""

    config: str | None
    overrides: tuple[str, ...] = ()

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TrainOptions:
        config, overrides = split_config_args(args.items)
        return cls(config, tuple(overrides))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train (no CONFIG = the embedded tiny BERT on the bundled corpus)",
        description="stx train [CONFIG] [key=value ...]; CONFIG is a preset name or a YAML "
        "path; overrides take dotted (optim.lr=3e-4) or Megatron/NeoX (num-layers=4) names.",
    )
    p.add_argument("items", nargs="*", metavar="CONFIG|key=value")
    p.set_defaults(fn=run)


def run(args: argparse.Namespace) -> int:
    from ..config.load import load_config
    from ..parallel.cluster_env import apply as apply_cluster_env
    from ..train.resilience import exit_status
    from ..train.run import run_training

    opts = TrainOptions.from_args(args)
    # Started by srun / mpiexec rather than torchrun: RANK, WORLD_SIZE... from their variables.
    apply_cluster_env()
    _, summary = run_training(load_config(opts.config, list(opts.overrides)))
    return exit_status(summary)
