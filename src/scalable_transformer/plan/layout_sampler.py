"""Random valid layouts: the planner's and the dry run's test set that nobody picks (issue 41).

A sample is what a user would type: a preset, `key=value` overrides (as `stx train`, `stx plan` and
`stx config validate` take them) and a process count. It is drawn at random over the space the
config accepts, then resolved by `config.validate.resolve` (the one validation path of `stx plan`,
`--dry-run`, `stx train` and `stx launch`); a draw the config refuses is drawn again, and the
refusals are counted. Layout `index` of seed `seed` depends on nothing else (its own generator), so
any one layout is reproduced from the two numbers alone.

Two scales: "small" (2-4 processes on a CPU, tiny models that train in seconds) and "large" (64-1024
devices of a GPU table, the presets up to 175B parameters: GPT, Llama-shaped with GQA, BERT).
Torch-free, as the rest of plan/.
"""

from __future__ import annotations

import random
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field

from ..config.load import load_config
from ..config.validate import resolve
from ..errors import ConfigError

SCALES = ("small", "large")
FAMILIES = ("gpt", "llama", "bert")
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "zero-bubble", "zbv")
INTERLEAVED = ("interleaved-1f1b", "looped-bfs", "zero-bubble")
RECOMPUTE = ("none", "selective", "full")
PRECISIONS = ("fp32", "bf16", "fp16")
MAX_DRAWS = 500  # draws per layout before giving up: far above what the space needs (a few)

SMALL_BASES = {"gpt": "tiny-gpt", "llama": "llama-tiny", "bert": "tiny-bert"}
LARGE_BASES = {
    "gpt": ("gpt-125m", "gpt-350m", "gpt-760m", "gpt-1b", "gpt-3b", "gpt-7b", "gpt-13b"),
    "llama": ("llama-1b", "llama-8b", "llama-70b"),
    "bert": ("bert-345m", "bert-large", "bert-175b"),
}
LARGE_DEVICES = ("a100-40gb", "a100-80gb", "h100-sxm", "h200-sxm")


@dataclass(frozen=True)
class SampledLayout:
    """One drawn layout. `axes` names the value each sampled axis took (for coverage and tables)."""

    seed: int
    index: int
    scale: str
    family: str
    base: str
    world_size: int
    device: str
    overrides: tuple[str, ...]
    axes: dict[str, object] = field(compare=False)
    rejections: int = 0

    @property
    def name(self) -> str:
        return f"{self.scale}-{self.seed}-{self.index}"

    def plan_argv(self, extra: list[str] | tuple[str, ...] = ()) -> list[str]:
        """`stx plan` arguments (without the program) for this layout on its device, `extra` overrides
        (the run's length, its logging) after the layout's."""
        size = ["--world-size", str(self.world_size), "--device", self.device]
        return ["plan", self.base, *self.overrides, *extra, *size]

    def train_argv(self, extra: list[str] | tuple[str, ...] = ()) -> list[str]:
        """`stx launch -n N train` arguments (without the program)."""
        return ["launch", "-n", str(self.world_size), "train", self.base, *self.overrides, *extra]

    def text(self) -> str:
        return f"{self.base} {shlex.join(self.overrides)} (world size {self.world_size}, {self.device})"


def sample_layouts(scale: str, count: int, seed: int, start: int = 0) -> list[SampledLayout]:
    """Layouts `start` .. `start + count - 1` of `seed` at `scale`, each resolved by the config."""
    if scale not in SCALES:
        raise ConfigError(f"layout scale {scale!r} is not one of {', '.join(SCALES)}")
    return [draw_valid_layout(scale, seed, index) for index in range(start, start + count)]


def draw_valid_layout(scale: str, seed: int, index: int) -> SampledLayout:
    """Draw layout `index` of `seed`, redrawing what `resolve` refuses (counted in `rejections`), then
    its newer axes (`_extend`)."""
    rng = random.Random(f"{scale}:{seed}:{index}")
    draw: Callable[[random.Random], tuple[str, str, int, str, dict[str, object]]]
    draw = _draw_small if scale == "small" else _draw_large
    last = ""
    for rejections in range(MAX_DRAWS):
        family, base, world, device, axes = draw(rng)
        overrides = tuple(_overrides(axes))
        try:
            resolve(load_config(base, list(overrides)), world)
        except ConfigError as e:
            last = str(e)
            continue
        axes, rejections = _extend(f"{scale}:{seed}:{index}", scale, family, base, world, axes, rejections)
        overrides = tuple(_overrides(axes))
        return SampledLayout(seed, index, scale, family, base, world, device, overrides, axes, rejections)
    raise ConfigError(f"no valid {scale} layout in {MAX_DRAWS} draws (seed {seed}, index {index}): {last}")


EXTENSION_DRAWS = 40  # draws of the newer axes before the layout is kept without them


def _extend(
    key: str, scale: str, family: str, base: str, world: int, axes: dict[str, object], rejections: int
) -> tuple[dict[str, object], int]:
    """The axes added after the first layouts were recorded (context parallelism, hybrid sharding,
    mixture of experts with expert parallelism, document masking, FP8), drawn from a stream of their
    own so that a seed's earlier axes stay as they were drawn: the layouts recorded before these axes
    existed are drawn again unchanged, with the new axes beside them. A draw the config refuses is
    redrawn (counted); after EXTENSION_DRAWS refusals the layout keeps none of them."""
    rng = random.Random(f"{key}:extension")
    for _ in range(EXTENSION_DRAWS):
        extra = _extension_axes(rng, scale, family, axes)
        if not extra:
            return axes, rejections
        merged = {**axes, **extra}
        try:
            resolve(load_config(base, _overrides(merged)), world)
        except ConfigError:
            rejections += 1
            continue
        return merged, rejections
    return axes, rejections


def _extension_axes(
    rng: random.Random, scale: str, family: str, axes: dict[str, object]
) -> dict[str, object]:
    """One draw of the newer axes (empty: none this time). cp takes its ranks from dp (the world size
    stays), so a large layout's global batch follows the smaller dp."""
    dp, zero = int(axes["dp"]), int(axes["parallel.zero_stage"])  # type: ignore[call-overload]
    extra: dict[str, object] = {}
    if dp % 2 == 0 and rng.random() < 0.25:
        extra["parallel.cp"] = 2
        dp //= 2
        extra["dp"] = dp
        if scale == "large":
            micro, accum = axes["train.micro_batch_size"], axes["train.gradient_accumulation_steps"]
            extra["train.global_batch_size"] = int(micro) * int(accum) * dp  # type: ignore[call-overload]
    shards = [d for d in range(2, dp) if dp % d == 0]
    if zero >= 2 and shards and rng.random() < 0.5:
        extra["parallel.dp_shard"] = rng.choice(shards)
    if family != "bert" and rng.random() < 0.25:
        experts = rng.choice((4, 8))
        extra["model.num_experts"] = experts
        extra["model.moe_router_topk"] = rng.choice((1, 2))
        extra["model.moe_layer_freq"] = rng.choice((1, 1, 2))
        if scale == "small":
            extra["model.moe_ffn_hidden_size"] = rng.choice((64, 128, 256))
        extra["model.moe_capacity_factor"] = 1.25 if rng.random() < 0.2 else None
        cp = int(extra.get("parallel.cp", 1))  # type: ignore[call-overload]
        eps = [e for e in (1, 2, 4, 8) if experts % e == 0 and (dp * cp) % e == 0]
        ep = rng.choice(eps[1:]) if len(eps) > 1 and rng.random() < 0.7 else 1
        extra["parallel.ep"] = ep if ep > 1 else None
    if family != "bert" and rng.random() < 0.2:
        extra["model.reset_position_ids"] = True
        extra["model.reset_attention_mask"] = True
        extra["data.eod_mask_loss"] = rng.random() < 0.5 or None
    if scale == "large" and axes["train.precision"] == "bf16" and rng.random() < 0.3:
        extra["train.fp8"] = rng.choice(("tensorwise", "rowwise"))
    return extra


def _overrides(axes: dict[str, object]) -> list[str]:
    """The `key=value` overrides of the axes that are config keys (dotted names), in a fixed order."""
    out = []
    for key, value in axes.items():
        if "." not in key or value is None:
            continue
        text = str(value).lower() if isinstance(value, bool) else str(value)
        out.append(f"{key}={text}")
    return out


def _split(
    rng: random.Random, world: int, tps: tuple[int, ...], pps: tuple[int, ...]
) -> tuple[int, int, int]:
    """dp, tp, pp with dp x tp x pp = world: one of the splits with tp in `tps` and pp in `pps`, each
    split as likely as any other (so pipelines are as common as the data-parallel layouts)."""
    splits = [(world // (t * p), t, p) for t in tps for p in pps if world % (t * p) == 0]
    return rng.choice(splits)


def _layout_axes(rng: random.Random, dp: int, tp: int, pp: int, layers: int) -> dict[str, object]:
    """The parallel keys of one draw: ZeRO, offload, SP, recompute and pipeline schedule."""
    zero = rng.choice((0, 1, 2, 3))
    recompute = rng.choice(RECOMPUTE)
    axes: dict[str, object] = {
        "parallel.tp": tp,
        "parallel.pp": pp,
        "parallel.zero_stage": zero,
        "parallel.offload_optimizer": (zero >= 2 and rng.random() < 0.25) or None,
        "parallel.offload_param": (zero == 3 and rng.random() < 0.2) or None,
        "parallel.sequence_parallel": (tp > 1 and rng.random() < 0.5) or None,
        "parallel.activation_checkpointing": recompute,
        "parallel.reduce_each_micro_batch": (zero >= 2 and pp == 1 and rng.random() < 0.3) or None,
    }
    if recompute == "full":
        axes["parallel.checkpoint_num_layers"] = rng.choice((1, 1, 2))
        axes["parallel.cpu_checkpointing"] = rng.random() < 0.2 or None
        sp = axes["parallel.sequence_parallel"]
        axes["parallel.distribute_saved_activations"] = (tp > 1 and not sp and rng.random() < 0.3) or None
    if pp > 1:
        schedule = rng.choice(SCHEDULES)
        axes["parallel.pipeline_schedule"] = schedule
        if schedule == "zbv":
            axes["parallel.virtual_pipeline_stages"] = 2
        elif schedule in INTERLEAVED:
            axes["parallel.virtual_pipeline_stages"] = rng.choice(
                [v for v in (2, 3, 4) if v * pp <= layers] or [2]
            )
    axes["dp"] = dp
    return axes


def _batch_axes(rng: random.Random, axes: dict[str, object], micro: tuple[int, ...], accum: int) -> None:
    """Micro-batch and accumulation; a pipeline's accumulation is drawn from what its schedule runs."""
    pp = int(axes.get("parallel.pp", 1))  # type: ignore[call-overload]
    stages = pp * int(axes.get("parallel.virtual_pipeline_stages", 1))  # type: ignore[call-overload]
    schedule = axes.get("parallel.pipeline_schedule")
    low = stages if schedule in ("1f1b", "zbv") else 1
    choices = [a for a in range(low, max(low, accum) + 1) if schedule not in INTERLEAVED or a % pp == 0]
    axes["train.micro_batch_size"] = rng.choice(micro)
    axes["train.gradient_accumulation_steps"] = rng.choice(choices or [stages])


def _draw_small(rng: random.Random) -> tuple[str, str, int, str, dict[str, object]]:
    family = rng.choice(FAMILIES)
    world = rng.choice((2, 2, 3, 4))
    layers = rng.randint(2, 6)
    hidden = rng.choice((64, 128, 192, 256))
    heads = rng.choice([h for h in (1, 2, 4, 8) if hidden // h >= 16])
    dp, tp, pp = _split(rng, world, (1, 2, 4), (1, 2, 3, 4))
    axes: dict[str, object] = {
        "model.num_layers": layers,
        "model.hidden_size": hidden,
        "model.num_attention_heads": heads,
        "model.seq_length": rng.choice((64, 128, 192, 256)),
    }
    if family == "llama":
        axes["model.num_query_groups"] = rng.choice([g for g in (1, 2, 4, 8) if heads % g == 0])
    if family == "bert":
        axes["model.bert_binary_head"] = rng.random() < 0.5
    axes.update(_layout_axes(rng, dp, tp, pp, layers))
    _batch_axes(rng, axes, (1, 2, 4), 4)
    axes["train.precision"] = rng.choice(PRECISIONS)
    return family, SMALL_BASES[family], world, "cpu", axes


def _draw_large(rng: random.Random) -> tuple[str, str, int, str, dict[str, object]]:
    family = rng.choice(FAMILIES)
    base = rng.choice(LARGE_BASES[family])
    world = rng.choice((64, 128, 256, 512, 1024))
    dp, tp, pp = _split(rng, world, (1, 2, 4, 8), (1, 2, 4, 8, 16))
    layers = load_config(base).model.num_layers
    axes = _layout_axes(rng, dp, tp, pp, layers)
    _batch_axes(rng, axes, (1, 2, 4), 16)
    micro, accum = axes["train.micro_batch_size"], axes["train.gradient_accumulation_steps"]
    axes["train.global_batch_size"] = int(micro) * int(accum) * dp  # type: ignore[call-overload]
    axes["train.precision"] = rng.choice(("bf16", "bf16", "fp16"))
    axes["device"] = rng.choice(LARGE_DEVICES)
    return family, base, world, str(axes["device"]), axes
