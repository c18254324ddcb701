"""Strict YAML loading, key=value overrides and Megatron / GPT-NeoX / DeepSpeed aliases (each dialect's
names live in its own module: megatron_args.py, neox_args.py, deepspeed_json.py; the tables here join
them for the loader).

A config is built by applying *assignments* (dotted field, value, source) in order:
schema defaults <- `base:` preset <- the file <- command-line overrides. Every assignment is
checked against the schema at once, so an error names where the value came from, the key and
what would be valid. Nothing is silently ignored: an unknown key is an error that suggests the
nearest valid one (the nanotron rule).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import math
import types
import typing
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError, ConfigWarning
from . import deepspeed_json, megatron_args, neox_args
from .schema import SECTIONS, Config, check_value, section_fields


@dataclass(frozen=True)
class Assignment:
    path: str  # "section.field"
    value: Any
    source: str  # where it came from, for error messages


def norm_key(key: str) -> str:
    """Megatron spells keys in kebab case, DeepSpeed and NeoX in snake case: accept both."""
    return str(key).strip().replace("-", "_")


# --------------------------------------------------------------------------- alias tables


@functools.cache
def field_index() -> dict[str, str]:
    """Every flat name that sets one field -> "section.field": aliases and unambiguous field names."""
    index: dict[str, str] = {}
    seen: dict[str, int] = {}
    for section in SECTIONS:
        for name, f in section_fields(section).items():
            seen[name] = seen.get(name, 0) + 1
            index.setdefault(name, f"{section}.{name}")
            for alias in f.metadata.get("aliases", ()):
                index[norm_key(alias)] = f"{section}.{name}"
    # A field name used by two sections (none today) would be ambiguous as a flat key.
    for name, count in seen.items():
        if count > 1 and index.get(name, "").split(".")[-1] == name:
            del index[name]
    return index


def _flag(path: str, on: Any, off: Any = None):
    """A Megatron/NeoX boolean switch that sets another field to `on` (or `off` when false)."""

    def expand(value: Any, source: str, key: str) -> list[Assignment]:
        if not isinstance(value, bool):
            raise ConfigError(f"{source}: '{key}' must be true or false, got {value!r}")
        if value:
            return [Assignment(path, on, source)]
        return [] if off is None else [Assignment(path, off, source)]

    expand.__doc__ = f"Switch (Megatron/NeoX): true sets `{path}` to `{on}`" + (
        f", false to `{off}`." if off is not None else "."
    )
    return expand


def _megatron_precision(precision: str):
    """Megatron's `--fp16` / `--bf16` switch (a DeepSpeed `fp16: {...}` block is read by deepspeed_json)."""

    def expand(value: Any, source: str, key: str) -> list[Assignment]:
        """Megatron switch: true sets train.precision (a DeepSpeed block: see the DeepSpeed table)."""
        if not isinstance(value, bool):
            raise ConfigError(
                f"{source}: '{key}' must be true/false or a DeepSpeed block like "
                f"{{enabled: true}}, got {value!r}"
            )
        return [Assignment("train.precision", precision, source)] if value else []

    return expand


def _megatron_optimizer(value: Any, source: str, key: str) -> list[Assignment]:
    """Megatron's `--optimizer adam|sgd` (a DeepSpeed `optimizer: {type, params}` block: the DeepSpeed
    table)."""
    if not isinstance(value, str):
        raise ConfigError(f"{source}: '{key}' must be a block {{type: ..., params: {{...}}}}, got {value!r}")
    return assignments_from_mapping({"optimizer": {"type": value}}, source)


def _flat_activation_checkpointing(value: Any, source: str, key: str) -> list[Assignment]:
    """`activation_checkpointing: none|full|selective` (`parallel.activation_checkpointing`); DeepSpeed's
    block (partition_activations, cpu_checkpointing): the DeepSpeed table."""
    return [Assignment("parallel.activation_checkpointing", value, source)]


def _initial_loss_scale(value: Any, source: str, key: str) -> list[Assignment]:
    """Megatron's `--initial-loss-scale 2**k`: sets `train.initial_scale_power` to k."""
    if value is None:
        return []
    power = math.log2(value) if isinstance(value, int | float) and value > 0 else math.nan
    if not power.is_integer():
        raise ConfigError(f"{source}: '{key}' must be a power of two (the scale is 2**power), got {value!r}")
    return [Assignment("train.initial_scale_power", int(power), source)]


def _flag_value(path: str, origin: str = "DeepSpeed"):
    def expand(value: Any, source: str, key: str) -> list[Assignment]:
        return [Assignment(path, value, source)]

    expand.__doc__ = f"{origin} key: sets `{path}`."
    return expand


def _megatron_value(path: str, names: dict[str, str]):
    """A Megatron option whose values are spelled differently here (`rope` for `rotary`); other values
    pass through to the field's own check, which names the valid ones."""

    def expand(value: Any, source: str, key: str) -> list[Assignment]:
        return [Assignment(path, names.get(str(value).lower(), value), source)]

    spellings = ", ".join(f"{k} -> {v}" for k, v in names.items())
    expand.__doc__ = f"Megatron option: sets `{path}` ({spellings})."
    return expand


def _switches(table: dict[str, tuple[str, Any, Any]]) -> dict[str, Any]:
    return {name: _flag(path, on, off) for name, (path, on, off) in table.items()}


# The foreign names a config of ours may use, each dialect's from its own module (megatron_args.py,
# neox_args.py, deepspeed_json.py): switches and values that set our keys, names accepted and ignored
# (a switch set to false or null asks for nothing and is silent; any other value prints one warning
# line), names refused (an error saying why, unless set to false or null).
SPECIAL_KEYS = {
    **_switches(megatron_args.MEGATRON_FILE_SWITCHES),
    **_switches(neox_args.NEOX_FILE_SWITCHES),
    "position_embedding_type": _megatron_value(
        "model.position_embedding_type", megatron_args.POSITION_EMBEDDING_NAMES
    ),
    "normalization": _megatron_value("model.norm", megatron_args.NORMALIZATION_NAMES),
    "fp16": _megatron_precision("fp16"),
    "bf16": _megatron_precision("bf16"),
    "optimizer": _megatron_optimizer,
    "activation_checkpointing": _flat_activation_checkpointing,
    "min_scale": _flag_value("train.min_loss_scale", "Megatron/NeoX"),
    "initial_loss_scale": _initial_loss_scale,
}
IGNORED_KEYS: dict[str, str] = {
    **megatron_args.MEGATRON_FILE_IGNORED,
    **neox_args.NEOX_FILE_IGNORED,
    # DeepSpeed's own top-level keys (GPT-NeoX forwards them): the DeepSpeed table says why
    **deepspeed_json.top_level_rules("ignored"),
}
UNSUPPORTED_KEYS: dict[str, str] = {
    **megatron_args.MEGATRON_FILE_REFUSED,
    **neox_args.NEOX_FILE_REFUSED,
    **deepspeed_json.top_level_rules("refused"),
}


def _asks_for_nothing(value: Any) -> bool:
    return value is None or value is False


def valid_flat_keys() -> list[str]:
    return sorted({*SECTIONS, *field_index(), *SPECIAL_KEYS, *deepspeed_json.top_level_keys(), "base"})


_unknown = deepspeed_json.unknown_key


# --------------------------------------------------------------------------- YAML


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys and reads 1e-4 / 5e8 as numbers (YAML 1.1 needs a dot)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    mapping: dict = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in mapping:
            mark = key_node.start_mark
            raise ConfigError(f"{mark.name}:{mark.line + 1}: duplicate key '{key}'")
        mapping[key] = loader.construct_object(value_node, deep=deep)
    return mapping


def _construct_str(loader: _StrictLoader, node: yaml.ScalarNode) -> Any:
    text = loader.construct_scalar(node)
    if node.style is None:  # only plain scalars: a quoted "1e-4" stays a string
        try:
            number = float(text)
        except ValueError:
            return text
        if math.isfinite(number):
            return (
                int(number) if number.is_integer() and "." not in text and "e" not in text.lower() else number
            )
    return text


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
_StrictLoader.add_constructor("tag:yaml.org,2002:str", _construct_str)


def yaml_error_line(error: yaml.YAMLError, name: str) -> str:
    """One line 'FILE:LINE:COLUMN: not valid YAML: problem (context)' instead of PyYAML's multi-line
    text, which quotes the source and names '<unicode string>' for text it was given as a string."""
    mark = getattr(error, "problem_mark", None)
    where = f"{name}:{mark.line + 1}:{mark.column + 1}" if mark is not None else name
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    context = getattr(error, "context", None)
    return f"{where}: not valid YAML: {problem}" + (f" ({context})" if context else "")


def parse_yaml(text: str, name: str) -> Any:
    loader = _StrictLoader(text)
    loader.name = name  # marks in messages name the file, not "<unicode string>"
    try:
        return loader.get_single_data()
    except yaml.YAMLError as e:
        raise ConfigError(yaml_error_line(e, name)) from None
    finally:
        loader.dispose()


# --------------------------------------------------------------------------- presets and files


def preset_names() -> list[str]:
    folder = resources.files("scalable_transformer.config") / "presets"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))


def _read_source(spec: str) -> tuple[str, str]:
    """(text, display name) of a preset name or a YAML path."""
    path = Path(spec)
    if path.is_dir():
        raise ConfigError(f"config file '{spec}' is a directory; give a YAML file or a preset name")
    if path.suffix in (".yaml", ".yml", ".json") or path.exists():
        if not path.is_file():
            raise ConfigError(f"config file '{spec}' does not exist; presets: {', '.join(preset_names())}")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"config file '{spec}' is not UTF-8 text (byte {e.start}): give a YAML config file"
            ) from None
        except OSError as e:
            raise ConfigError(f"config file '{spec}' cannot be read: {e.strerror}") from None
        if not text.strip() or parse_yaml(text, str(path)) is None:
            raise ConfigError(
                f"config file '{spec}' is empty (or only comments): write at least one key, e.g. "
                "'base: tiny-gpt', or name a preset"
            )
        return text, str(path)
    if spec in preset_names():
        folder = resources.files("scalable_transformer.config") / "presets"
        return (folder / f"{spec}.yaml").read_text(encoding="utf-8"), f"preset '{spec}'"
    near = difflib.get_close_matches(spec, preset_names(), n=1)
    hint = f"; did you mean '{near[0]}'?" if near else ""
    raise ConfigError(
        f"'{spec}' is neither a config file nor a preset{hint} (presets: {', '.join(preset_names())})"
    )


def assignments_from_mapping(data: Any, source: str) -> list[Assignment]:
    """Flatten a loaded YAML mapping (nested sections, flat aliases or both) into assignments."""
    if data is None:
        return []
    if not isinstance(data, dict):
        raise ConfigError(
            f"{source}: the top level must be a mapping of keys to values, got {type(data).__name__}"
        )
    deepspeed = {k: v for k, v in data.items() if _speaks_deepspeed(norm_key(k), v, data)}
    out = _deepspeed_assignments(deepspeed, source) if deepspeed else []
    for raw_key, value in data.items():
        key = norm_key(raw_key)
        if raw_key in deepspeed:
            continue
        if key in SECTIONS and not isinstance(value, dict):
            raise ConfigError(
                f"{source}: '{raw_key}' is a section and must be a mapping of its keys "
                f"(e.g. {raw_key}: {{{next(iter(section_fields(key)))}: ...}}), got {value!r}"
            )
        if key in SECTIONS:
            fields = section_fields(key)
            aliases = {norm_key(a): n for n, f in fields.items() for a in f.metadata.get("aliases", ())}
            for sub, v in value.items():
                k = norm_key(sub)
                if k not in fields and isinstance(v, dict) and any(f.startswith(k + "_") for f in fields):
                    # a group of fields written as a mapping: logging.profile: {start_step: 5} sets
                    # logging.profile_start_step; a list value becomes the comma-separated string
                    for sub2, v2 in v.items():
                        k2 = f"{k}_{norm_key(sub2)}"
                        if k2 not in fields:
                            valid = [f.removeprefix(k + "_") for f in fields if f.startswith(k + "_")]
                            raise ConfigError(
                                _unknown(source, f"{raw_key}.{sub}.{sub2}", norm_key(sub2), valid)
                            )
                        if isinstance(v2, list):
                            v2 = ",".join(str(x) for x in v2)
                        out.append(Assignment(f"{key}.{k2}", v2, source))
                    continue
                name = k if k in fields else aliases.get(k)
                if name is None:
                    raise ConfigError(_unknown(source, f"{raw_key}.{sub}", k, [*fields, *aliases]))
                out.append(Assignment(f"{key}.{name}", v, source))
        elif key in SPECIAL_KEYS:
            out += SPECIAL_KEYS[key](value, source, str(raw_key))
        elif key in field_index():
            out.append(Assignment(field_index()[key], value, source))
        elif key == "base":
            continue  # handled by load_config
        elif key.lower() in UNSUPPORTED_KEYS:
            if not _asks_for_nothing(value):
                raise ConfigError(f"{source}: '{raw_key}' = {value!r}: {UNSUPPORTED_KEYS[key.lower()]}")
        elif key.lower() in IGNORED_KEYS:
            if not _asks_for_nothing(value):
                warnings.warn(ConfigWarning(source, str(raw_key), IGNORED_KEYS[key.lower()]), stacklevel=2)
        else:
            raise ConfigError(_unknown(source, str(raw_key), key, valid_flat_keys()))
    return out


# Keys DeepSpeed shares with Megatron's switches or our own flat keys, in the form that is not DeepSpeed's
_NOT_DEEPSPEED_FORM = {
    "fp16": lambda v: not isinstance(v, dict),  # Megatron's --fp16
    "bf16": lambda v: not isinstance(v, dict),
    "optimizer": lambda v: not isinstance(v, dict),  # Megatron's --optimizer adam
    "activation_checkpointing": lambda v: not isinstance(v, dict),  # ours: none|full|selective
    "scheduler": lambda v: not isinstance(v, dict),  # ours: optim.scheduler
    "tensorboard": lambda v: not isinstance(v, dict),  # ours: logging.tensorboard
}


def _speaks_deepspeed(key: str, value: Any, data: dict) -> bool:
    """Whether a top-level key is read as DeepSpeed's (deepspeed_json's table, over the whole file):
    DeepSpeed's keys in DeepSpeed's form. `gradient_accumulation_steps` is our flat key too: it joins
    DeepSpeed's batch triple only beside train_batch_size or train_micro_batch_size_per_gpu."""
    if key not in deepspeed_json.top_level_keys() or key in SECTIONS:
        return False
    if key in _NOT_DEEPSPEED_FORM and _NOT_DEEPSPEED_FORM[key](value):
        return False
    if key == "gradient_accumulation_steps":
        return bool({"train_batch_size", "train_micro_batch_size_per_gpu"} & {norm_key(k) for k in data})
    return True


def _deepspeed_assignments(data: dict, source: str) -> list[Assignment]:
    """A DeepSpeed mapping's assignments; its ignored keys print one warning line each (grouped)."""
    translation = deepspeed_json.translate(data, source)
    for key, why in translation.warnings.items():
        warnings.warn(ConfigWarning(source, key, why), stacklevel=3)
    return [Assignment(path, value, source) for path, value in translation.assignments]


def parse_override(text: str) -> list[Assignment]:
    """`optim.lr=3e-4`, `num-layers=4` or `--num-layers=4` from the command line."""
    source = f"command-line override '{text}'"
    if "=" not in text:
        raise ConfigError(f"{source}: expected key=value (for example optim.lr=3e-4 or num-layers=4)")
    key, raw = text.split("=", 1)
    key = key.strip().lstrip("-")
    value = parse_yaml(raw, source) if raw.strip() else None
    nested: Any = value
    for part in reversed(key.split(".")):  # "fp16.enabled=true" -> {fp16: {enabled: true}}
        nested = {part: nested}
    return assignments_from_mapping(nested, source)


# --------------------------------------------------------------------------- applying values


@functools.cache
def _hints(section: str) -> dict[str, Any]:
    return typing.get_type_hints(SECTIONS[section])


def coerce(value: Any, hint: Any, where: str, choices: tuple[str, ...] = ()) -> Any:
    """Check (and gently convert) a value against a field's type; raise ConfigError naming `where`."""
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        if value is None and type(None) in args:
            return None
        hint = next(a for a in args if a is not type(None))
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    if hint is int:
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                value = float(value)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{where} must be an integer, got {value!r}")
    if hint is float:
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                value = float(value)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{where} must be a number, got {value!r}")
    if hint is str:
        if isinstance(value, int | float) and not isinstance(value, bool) and not choices:
            value = str(value)
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string, got {value!r}")
        if choices and value not in choices:
            low = value.lower().replace("_", "-")
            match = [c for c in choices if c.replace("_", "-") == low]
            if not match:
                raise ConfigError(f"{where} = {value!r} is not valid; choose one of: {', '.join(choices)}")
            value = match[0]
        return value
    raise TypeError(f"unsupported field type {hint!r} at {where}")


def apply_assignments(cfg: Config, assignments: list[Assignment]) -> Config:
    """Apply assignments in order (later wins) and return cfg; conflicting values within one source fail."""
    set_by: dict[str, tuple[Any, str]] = {}
    for a in assignments:
        section, name = a.path.split(".")
        f = section_fields(section)[name]
        where = f"{a.source}: '{a.path}'"
        value = coerce(a.value, _hints(section)[name], where, f.metadata.get("choices", ()))
        check_value(f, value, where)
        previous = set_by.get(a.path)
        if previous and previous[1] == a.source and previous[0] != value:
            raise ConfigError(
                f"{a.source}: '{a.path}' is set twice (through an alias) to different values: "
                f"{previous[0]!r} and {value!r}"
            )
        set_by[a.path] = (value, a.source)
        setattr(getattr(cfg, section), name, value)
    return cfg


# More ignored keys than this from one file for one reason print as a single line listing them.
GROUP_WARNINGS_ABOVE = 2


@contextlib.contextmanager
def grouped_config_warnings(emit: bool = True) -> Iterator[list[ConfigWarning]]:
    """Collect the ConfigWarnings raised inside; on exit re-emit them grouped by (source, reason), so a
    DeepSpeed file with ten tuning knobs prints one line, not ten. The yielded list holds them all
    (emit=False: only collect, for `stx config import`, which lists them in the file it writes)."""
    collected: list[ConfigWarning] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield collected
    for w in caught:
        if isinstance(w.message, ConfigWarning):
            collected.append(w.message)
        else:  # not ours to group: pass it on as it came
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if not emit:
        return
    groups: dict[tuple[str, str], list[ConfigWarning]] = {}
    for c in collected:
        groups.setdefault((c.source, c.reason), []).append(c)
    for (source, reason), group in groups.items():
        if len(group) > GROUP_WARNINGS_ABOVE:
            keys = ", ".join(c.key for c in group)
            line = f"{source}: {len(group)} keys ignored, each {reason}: {keys}"
            warnings.warn(ConfigWarning(source, keys, reason, line), stacklevel=3)
        else:
            for c in group:
                warnings.warn(c, stacklevel=3)


def load_config(spec: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Build a Config from a preset name or YAML path (None = the embedded default) plus overrides.

    The result is not yet resolved: call `config.validate.resolve` for derived values and checks.
    Keys accepted and ignored print one warning line each (grouped when many).
    """
    with grouped_config_warnings():
        return _load_config(spec, overrides)


def _load_config(spec: str | None, overrides: list[str] | tuple[str, ...]) -> Config:
    chain: list[tuple[Any, str]] = []
    seen: set[str] = set()
    current: str | None = spec or "tiny-bert"
    while current is not None:
        if current in seen:
            raise ConfigError(f"'base:' chain loops back to '{current}'")
        seen.add(current)
        text, name = _read_source(current)
        data = parse_yaml(text, name)
        chain.append((data, name))
        base = data.get("base") if isinstance(data, dict) else None
        if base is not None and not isinstance(base, str):
            raise ConfigError(f"{name}: 'base' must be a preset name or a path, got {base!r}")
        if (
            base is not None
            and not Path(base).is_absolute()
            and Path(name).is_file()
            and (Path(name).parent / base).exists()
        ):
            base = str(Path(name).parent / base)
        current = base
    assignments: list[Assignment] = []
    for data, name in reversed(chain):
        assignments += assignments_from_mapping(data, name)
    for text in overrides:
        assignments += parse_override(text)
    return apply_assignments(Config(), assignments)


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)
