"""Sharded, atomic, reshardable checkpoints on torch.distributed.checkpoint (DCP).

On disk (Megatron's naming):
  SAVE/iter_0000100/       __0_0.distcp ... (each rank's shards), .metadata (DCP's index),
                           rng/rank_00000.pt ... (every rank's python/numpy/torch RNG states),
                           metadata.json (iteration, consumed samples, layout, model shape, resolved
                           config, environment, scheduler and loss-scaler state, file sizes)
  SAVE/latest              the name of the newest complete checkpoint ("iter_0000100")

Atomicity: everything is written into SAVE/.tmp-iter_XXXXXXX; after a barrier rank 0 writes
metadata.json last, fsyncs, renames the directory to iter_XXXXXXX and only then replaces `latest`
(write + os.replace). A job killed at any point leaves the previous checkpoint latest and loadable;
keep_last_n deletes older checkpoints only after that.

Keys are layout-independent: model parameters under the full model's names (DDP's `module.`,
activation-checkpoint and compile wrappers, and the pipeline's stage index are stripped), optimizer
state flattened per parameter (`state.<fqn>.exp_avg`, `param_groups.<fqn>.lr`), so a checkpoint
written under one layout loads under any other: DCP reshards DTensor/FSDP shards on load.
ZeRO-1 (ZeroRedundancyOptimizer): each rank saves and loads its local optimizer's state, which holds
the parameters it owns, under the same per-parameter keys.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import time
import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.optim import ZeroRedundancyOptimizer

from ..errors import CheckpointError
from ..files import write_atomic
from ..parallel.torch_compat import init_optimizer_state

FORMAT_VERSION = 1
LATEST = "latest"
METADATA = "metadata.json"
ITER_RE = re.compile(r"^iter_(\d{7,})$")
# Fault injection for the atomicity tests: "ITERATION" makes rank 0 exit (status 17) during that
# iteration's save, after the shards are written and before the checkpoint is made visible.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def iter_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns that it 'assumes' a single process without a process group: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------ finding and checking checkpoints


def check_save_dir(save: str) -> None:
    """Create the save directory and prove it writable now, not at the first save hours later."""
    path = Path(save)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise CheckpointError(f"checkpoint.save = {save}: directory is not writable ({e})") from None


def latest_checkpoint(save_dir: str | Path) -> Path | None:
    """The checkpoint `SAVE/latest` names, or None when there is none yet."""
    latest = Path(save_dir) / LATEST
    if not latest.is_file():
        return None
    name = latest.read_text(encoding="utf-8").strip()
    if not ITER_RE.match(name):
        raise CheckpointError(f"{latest}: expected a checkpoint name like iter_0000100, got {name!r}")
    return Path(save_dir) / name


def find_checkpoint(load: str, save: str | None, label: str | None = None) -> Path | None:
    """The checkpoint directory `checkpoint.load` means, None for `auto` without any checkpoint yet.

    load = auto: the latest complete checkpoint in checkpoint.save (none: start fresh);
    load = a save directory (holding `latest`): its latest checkpoint;
    load = one checkpoint directory (holding metadata.json): that one.
    label: how messages name `load` (default "checkpoint.load = LOAD"; commands that take a directory
    argument name it as given, since the user set no such key).
    """
    label = label or f"checkpoint.load = {load}"
    if load == "auto":
        if not save:
            raise CheckpointError("checkpoint.load = auto resumes from checkpoint.save: set checkpoint.save")
        return latest_checkpoint(save) if Path(save).is_dir() else None
    path = Path(load)
    if not path.exists():
        raise CheckpointError(f"{label}: no such directory")
    if not path.is_dir():
        raise CheckpointError(f"{label}: not a directory")
    if (path / METADATA).is_file() or (path / ".metadata").is_file() or ITER_RE.match(path.name):
        return path  # one checkpoint (read_metadata says what is wrong with it, if anything)
    found = latest_checkpoint(path)
    if found is None:
        names = sorted(p.name for p in path.iterdir())[:10]
        raise CheckpointError(
            f"{label}: no checkpoint there (neither a '{LATEST}' file nor {METADATA}); "
            f"it holds {names or 'nothing'}"
        )
    return found


def read_metadata(path: Path, verify: bool = True) -> dict[str, Any]:
    """metadata.json of a checkpoint, after checking every file it lists is present at its size and
    (verify) has the CRC-32 it was written with."""
    meta_path = path / METADATA
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path}: no such directory")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path}: {METADATA} is missing (an incomplete save?)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint {path}: {METADATA} is corrupt ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION or "files" not in meta:
        raise CheckpointError(
            f"checkpoint {path}: {METADATA} is not a format-{FORMAT_VERSION} stx checkpoint record"
        )
    problems = []
    for name, size in meta["files"].items():
        file = path / name
        if not file.is_file():
            problems.append(f"{name} is missing")
        elif file.stat().st_size != size:
            problems.append(f"{name} has {file.stat().st_size} bytes, {size} were written")
    if not problems and verify:
        for name, crc in meta.get("crc32", {}).items():
            if file_crc32(path / name) != crc:
                problems.append(f"{name} does not match its CRC-32 (its bytes changed after the save)")
    if problems:
        raise CheckpointError(f"checkpoint {path} is truncated or corrupted: {'; '.join(problems)}")
    return meta


def file_crc32(path: Path, chunk: int = 1 << 24) -> int:
    """CRC-32 of a file, streamed (zlib runs at GB/s; the save and a load read each shard once more)."""
    crc = 0
    with path.open("rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


def saved_tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Global shape of every tensor in the checkpoint, by DCP key ('model.layers.0.mlp.up.weight')."""
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # a corrupt .metadata fails inside pickle with any error type
        raise CheckpointError(f"checkpoint {path}: DCP index .metadata is unreadable ({e})") from None
    return {
        key: tuple(m.size)
        for key, m in metadata.state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata)
    }


def check_model_shapes(path: Path, model_state: dict[str, Any]) -> None:
    """Fail, naming the tensors, when the checkpoint's model tensors differ from this model's."""
    saved = {
        k.removeprefix("model."): v for k, v in saved_tensor_shapes(path).items() if k.startswith("model.")
    }
    wanted = {k: tuple(v.shape) for k, v in model_state.items() if isinstance(v, torch.Tensor)}
    if _world() > 1:  # pipeline stages: each rank holds part of the model; compare the whole
        parts: list[Any] = [None] * _world()
        dist.all_gather_object(parts, wanted)
        wanted = {k: v for part in parts for k, v in part.items()}
    lines = [
        f"  {k}: checkpoint {saved[k]}, model {s}" for k, s in wanted.items() if k in saved and saved[k] != s
    ]
    lines += [f"  {k}: not in the checkpoint (model {s})" for k, s in wanted.items() if k not in saved]
    lines += [f"  {k}: not in the model (checkpoint {s})" for k, s in saved.items() if k not in wanted]
    if lines:
        raise CheckpointError(
            f"checkpoint {path} holds a different model shape ({len(lines)} tensors differ):\n"
            + "\n".join(lines[:20])
            + ("\n  ..." if len(lines) > 20 else "")
        )


# ------------------------------------------------------------------ layout-independent state dicts


def _strip_stage(key: str) -> str:
    """'3.layers.5.mlp.up.weight' (pipeline stage 3 of a ModuleList) -> 'layers.5.mlp.up.weight'."""
    return re.sub(r"^\d+\.", "", key)


def _strip_stage_optim(key: str) -> str:
    return re.sub(r"^(state|param_groups)\.\d+\.", r"\1.", key)


@dataclass
class TrainState:
    """What a checkpoint restores: the model (pipeline stages as an nn.ModuleList when `pipeline`),
    optimizer, schedule, loss scaler, and the counters of the loop."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: Any
    pipeline: bool = False
    # canonical key -> the keys of this rank's state dict that hold it (the pipeline's tied copy of
    # the word embedding can sit twice on one rank, e.g. zbv; both copies are equal)
    _aliases: dict[str, list[str]] = field(default_factory=dict)

    def _canonical(self, sd: dict[str, Any], strip: Callable[[str], str]) -> dict[str, Any]:
        if not self.pipeline:
            return sd
        out: dict[str, Any] = {}
        for key, value in sd.items():
            canonical = strip(key)
            aliases = self._aliases.setdefault(canonical, [])
            if key not in aliases:
                aliases.append(key)
            out.setdefault(canonical, value)
        return out

    def _expand(self, sd: dict[str, Any]) -> dict[str, Any]:
        if not self.pipeline:
            return sd
        out: dict[str, Any] = {}
        for key, value in sd.items():
            for i, alias in enumerate(self._aliases.get(key, [key])):
                # each copy gets its own tensor: optimizer.load_state_dict keeps the objects it is
                # given, and one exp_avg shared by two parameters would be updated twice per step
                out[alias] = value.clone() if i and isinstance(value, torch.Tensor) else value
        return out

    def model_state(self) -> dict[str, Any]:
        return self._canonical(get_model_state_dict(self.model, options=_OPTIONS), _strip_stage)

    def optimizer_state(self) -> dict[str, Any]:
        if _is_zero1(self.optimizer):
            return _zero1_state(self.model, self.optimizer)
        sd = get_optimizer_state_dict(self.model, self.optimizer, options=_OPTIONS)
        return self._canonical(sd, _strip_stage_optim)

    def load_model_state(self, sd: dict[str, Any]) -> None:
        set_model_state_dict(self.model, self._expand(sd), options=_OPTIONS)

    def load_optimizer_state(self, sd: dict[str, Any]) -> None:
        if _is_zero1(self.optimizer):
            return  # dcp.load wrote into the local optimizer's own state tensors (see _zero1_state)
        set_optimizer_state_dict(self.model, self.optimizer, self._expand(sd), options=_OPTIONS)


def _is_zero1(optimizer: torch.optim.Optimizer) -> bool:
    return isinstance(optimizer, ZeroRedundancyOptimizer)


def _clean_fqn(name: str) -> str:
    """DDP's `module.` and the activation-checkpoint / compile wrappers are not part of a name."""
    name = name.removeprefix("module.")
    return name.replace("._checkpoint_wrapped_module", "").replace("._orig_mod", "")


def _zero1_state(model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """This rank's part of a ZeroRedundancyOptimizer state in DCP's flattened per-parameter format
    (`state.<fqn>.<key>`, `param_groups.<fqn>.<key>`), holding the local optimizer's own tensors so
    that dcp.load fills them in place. torch's get/set_optimizer_state_dict cannot take the local
    optimizer: a rank may own no parameter of a group (an empty group breaks its unflattening)."""
    local = optimizer.optim
    init_optimizer_state(local)  # creates the state tensors of a fresh optimizer (a zero-lr step)
    fqns = {id(p): _clean_fqn(n) for n, p in model.named_parameters()}
    out: dict[str, Any] = {}
    for group in local.param_groups:
        for p in group["params"]:
            fqn = fqns[id(p)]
            for key, value in local.state[p].items():
                out[f"state.{fqn}.{key}"] = value
            for key, value in group.items():
                if key != "params":
                    out[f"param_groups.{fqn}.{key}"] = value
    return out


# ------------------------------------------------------------------ RNG


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ------------------------------------------------------------------ save


@dataclass
class SaveOptions:
    save_dir: str
    keep_last_n: int | None = None
    save_optim: bool = True
    save_rng: bool = True


def save_checkpoint(
    state: TrainState,
    options: SaveOptions,
    iteration: int,
    consumed_samples: int,
    info: dict[str, Any],
    on_staged: Callable[[], None] | None = None,
) -> Path:
    """Write SAVE/iter_<iteration> atomically on every rank (a collective) and make it `latest`.

    `info`: JSON-able facts recorded in metadata.json (layout, model shape, config, environment).
    `on_staged`: called on every rank once all shards are written, before the checkpoint is published
    (the fault-injection tests kill the process there).
    Returns the checkpoint's path; seconds spent are in its metadata.json (`save_seconds`).
    """
    start = time.perf_counter()
    rank, world = _rank(), _world()
    root = Path(options.save_dir)
    final, tmp = root / iter_name(iteration), root / f".tmp-{iter_name(iteration)}"
    if rank == 0:
        if tmp.exists():  # left by a save that was killed
            shutil.rmtree(tmp)
        (tmp / "rng").mkdir(parents=True)
    _barrier()
    to_save: dict[str, Any] = {"model": state.model_state()}
    if options.save_optim:
        to_save["optim"] = state.optimizer_state()
    with _quiet_single_process():
        dcp.save(to_save, checkpoint_id=str(tmp))
    if options.save_rng:
        rng_file = tmp / "rng" / f"rank_{rank:05d}.pt"
        torch.save(rng_state(), rng_file)
        _fsync(rng_file)
    _barrier()
    if on_staged is not None:
        on_staged()
    if rank == 0:
        checksums = {}
        for file in sorted(tmp.rglob("*")):
            if file.is_file():
                _fsync(file)
                checksums[str(file.relative_to(tmp))] = file_crc32(file)
        meta = {
            "format": FORMAT_VERSION,
            "iteration": iteration,
            "consumed_samples": consumed_samples,
            "world_size": world,
            "contents": {"optimizer": options.save_optim, "rng": options.save_rng},
            "scheduler": {
                "last_epoch": state.scheduler.last_epoch,
                "_step_count": getattr(state.scheduler, "_step_count", 0),
            },
            "scaler": state.scaler.state_dict(),
            **info,
            "files": {
                str(f.relative_to(tmp)): f.stat().st_size for f in sorted(tmp.rglob("*")) if f.is_file()
            },
            "crc32": checksums,
            "save_seconds": time.perf_counter() - start,
        }
        write_atomic(tmp / METADATA, json.dumps(meta, indent=2, default=str) + "\n", durable=True)
        _fsync(tmp)
        old = root / f".old-{final.name}"
        if final.exists():  # the same iteration saved again (e.g. finetuning into the same directory)
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync(root)
        write_atomic(root / LATEST, final.name + "\n", durable=True)
        shutil.rmtree(old, ignore_errors=True)
        if options.keep_last_n:
            prune(root, options.keep_last_n, keep=final.name)
    _barrier()
    return final


def prune(root: Path, keep_last_n: int, keep: str) -> list[Path]:
    """Delete all but the newest `keep_last_n` complete checkpoints (never `keep`), and leftovers of
    killed saves; returns what was deleted."""
    complete = sorted(
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := ITER_RE.match(p.name)) and (p / METADATA).is_file()
    )
    doomed = [p for _, p in complete[:-keep_last_n] if p.name != keep]
    doomed += [p for p in root.glob(".tmp-iter_*") if p.is_dir()]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


# ------------------------------------------------------------------ load


@dataclass
class LoadOptions:
    load_optim: bool = True
    load_rng: bool = True
    finetune: bool = False


@dataclass
class Resume:
    """Where a loaded run continues; `rng` is this rank's saved RNG state (None: not restored)."""

    path: Path
    meta: dict[str, Any]
    iteration: int
    consumed_samples: int
    rng: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)


def open_checkpoint(path: Path, options: LoadOptions) -> Resume:
    """Check a checkpoint before anything is built from it: files complete, DCP index readable."""
    meta = read_metadata(path, verify=_rank() == 0)  # one reader suffices: a mismatch stops the job
    saved_tensor_shapes(path)  # the DCP index must be readable
    if options.finetune:
        return Resume(path, meta, 0, 0)
    return Resume(path, meta, int(meta["iteration"]), int(meta["consumed_samples"]))


def load_checkpoint(state: TrainState, resume: Resume, options: LoadOptions) -> None:
    """Load model (and unless finetune / no_load_optim: optimizer, schedule, scaler) and this rank's
    RNG state into `resume.rng` (set it with `set_rng_state` right before training starts)."""
    meta, path = resume.meta, resume.path
    model_sd = state.model_state()
    check_model_shapes(path, model_sd)
    to_load: dict[str, Any] = {"model": model_sd}
    with_optim = options.load_optim and not options.finetune
    if with_optim and not meta["contents"]["optimizer"]:
        raise CheckpointError(
            f"checkpoint {path} was saved without optimizer state (no_save_optim); "
            "set checkpoint.no_load_optim=true or checkpoint.finetune=true"
        )
    if with_optim:
        to_load["optim"] = state.optimizer_state()
    try:
        with _quiet_single_process():
            dcp.load(to_load, checkpoint_id=str(path))
    except Exception as e:
        raise CheckpointError(f"checkpoint {path} could not be read: {type(e).__name__}: {e}") from e
    state.load_model_state(to_load["model"])
    if with_optim:
        state.load_optimizer_state(to_load["optim"])
    if options.finetune:
        resume.notes.append("finetune: weights only; iteration 0, fresh optimizer and schedule")
        return
    # The schedule is rebuilt from the config; only its position is restored (layout-independent).
    sched = state.scheduler.state_dict()
    sched.update(meta["scheduler"])
    state.scheduler.load_state_dict(sched)
    state.scaler.load_state_dict(meta["scaler"])
    if not with_optim:
        resume.notes.append("no_load_optim: fresh optimizer state")
    rng_file = path / "rng" / f"rank_{_rank():05d}.pt"
    if not options.load_rng:
        resume.notes.append("no_load_rng: RNG states not restored")
    elif meta["world_size"] != _world() or not rng_file.is_file():
        resume.notes.append(
            f"RNG states not restored: saved by {meta['world_size']} rank(s), loaded by {_world()}"
        )
    else:
        resume.rng = torch.load(rng_file, weights_only=False)  # our own file: numpy state is pickled


def directory_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


class Saver:
    """Saves every `checkpoint.save_interval` iterations and once at the end (as Megatron at exit).

    Reads the loop's position through the trainer's `state_dict()`; `on_staged(trainer, iteration)`
    runs between writing a checkpoint's shards and publishing it (see `save_checkpoint`)."""

    def __init__(
        self,
        state: TrainState,
        cfg: Any,
        info: dict[str, Any],
        console: Any = None,
        on_staged: Callable[[Any, int], None] | None = None,
    ):
        c = cfg.checkpoint
        self.state, self.info, self.console = state, info, console
        self.interval = c.save_interval
        self.options = SaveOptions(c.save, c.keep_last_n, not c.no_save_optim, not c.no_save_rng)
        self.last_saved: int | None = None
        self.on_staged = on_staged

    def save(self, trainer: Any) -> float:
        """Save now; returns the seconds it took."""
        start = time.perf_counter()
        position = trainer.state_dict()
        iteration = position["iteration"]
        hook = None if self.on_staged is None else (lambda: self.on_staged(trainer, iteration))  # type: ignore[misc]
        path = save_checkpoint(
            self.state, self.options, iteration, position["consumed_samples"], self.info, on_staged=hook
        )
        self.last_saved = iteration
        seconds = time.perf_counter() - start
        if self.console is not None:
            self.console.print(
                f"saved checkpoint {path} ({directory_size(path) / 2**20:.1f} MiB) in {seconds:.2f} s"
            )
        return seconds

    def maybe_save(self, trainer: Any) -> float:
        if self.interval and trainer.state_dict()["iteration"] % self.interval == 0:
            return self.save(trainer)
        return 0.0

    def save_final(self, trainer: Any) -> None:
        if self.last_saved != trainer.state_dict()["iteration"]:
            self.save(trainer)


def describe_checkpoint(path: str) -> dict[str, Any]:
    """`stx checkpoint info`: what a checkpoint holds, checked for completeness first.

    Returns {"path": the checkpoint directory, "metadata": its metadata.json, "model_tensors":
    how many saved tensors belong to the model, "size_bytes": the directory's size on disk,
    "metadata_file": {name of metadata.json: its size in bytes}} (metadata lists the other files).
    """
    found = find_checkpoint(path, None, label=f"'{path}'")
    if found is None:  # only for load = auto, which find_checkpoint rejects without a save dir
        raise CheckpointError(f"{path}: no checkpoint")
    meta = read_metadata(found)
    shapes = saved_tensor_shapes(found)
    return {
        "path": found,
        "metadata": meta,
        "model_tensors": sum(1 for k in shapes if k.startswith("model.")),
        "size_bytes": directory_size(found),
        "metadata_file": {METADATA: (found / METADATA).stat().st_size},
    }
