"""The seams of the architecture: torch-free layout rules, the one topology object, trainer callbacks
and Stateful loop position, cross-rank timer min/max, module and function names that are not twins."""

from __future__ import annotations

import ast
import itertools
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import grimp
import pytest

import scalable_transformer
from scalable_transformer.config.load import load_config
from scalable_transformer.config.rules import layout_label, pipeline_bubble_fraction, stage_ids, stage_rank
from scalable_transformer.config.validate import resolve
from scalable_transformer.metrics.timers import minmax_over_ranks
from scalable_transformer.parallel.dims import ParallelDims
from scalable_transformer.train.trainer import Callback


def test_layout_rules_import_neither_torch_nor_models():
    """A planner checks thousands of layouts: resolving and checking one must not need torch."""
    code = (
        "import sys\n"
        "from scalable_transformer.config.load import load_config\n"
        "from scalable_transformer.config.validate import resolve\n"
        "from scalable_transformer.config.rules import check_layout, layout_label\n"
        "cfg = resolve(load_config('gpt-13b', ['parallel.tp=8', 'parallel.pp=4']), world_size=64)\n"
        "print(layout_label(cfg))\n"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('scalable_transformer.models')]\n"
        "assert not bad, bad\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith("dp=2 tp=8 pp=4 zero")


@pytest.mark.slow
def test_the_planner_predicts_a_table_gpu_without_torch():
    """plan/ is torch-free (its import contract in pyproject.toml): a search on a table device's
    cluster loads neither torch nor the measuring side (calibrate/, dryrun/)."""
    code = (
        "import sys\n"
        "from scalable_transformer.config.load import load_config\n"
        "from scalable_transformer.plan.cluster import table_cluster\n"
        "from scalable_transformer.plan.search import search_layouts\n"
        "results = search_layouts(load_config('gpt-1b', []), table_cluster('h100-sxm', 2, 8))\n"
        "print(sum(r.fits for r in results))\n"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('scalable_transformer.calibrate', "
        "'scalable_transformer.dryrun'))]\n"
        "assert not bad, bad\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) > 0


@pytest.mark.parametrize(
    "schedule, pp, virtual, want",
    [
        ("1f1b", 4, 1, [[0], [1], [2], [3]]),
        ("interleaved-1f1b", 2, 2, [[0, 2], [1, 3]]),
        ("zbv", 2, 2, [[0, 3], [1, 2]]),
    ],
)
def test_parallel_dims_knows_each_ranks_stages(schedule, pp, virtual, want):
    for pp_rank, ids in enumerate(want):
        rank = pp_rank * 2  # dp = 2, tp = 1: pipeline rank r is global rank 2 r (Megatron order)
        dims = ParallelDims(dp=2, tp=1, pp=pp, virtual_stages=virtual, schedule=schedule, rank=rank)
        assert dims.pp_rank == pp_rank and dims.dp_rank == 0 and dims.stage_ids == ids
        assert dims.has_first_stage == (0 in ids)
        assert dims.has_last_stage == (pp * virtual - 1 in ids)
        assert [stage_rank(s, pp, virtual, schedule) for s in ids] == [pp_rank] * len(ids)
    assert stage_ids(pp, 0, virtual, schedule) == want[0]


def test_parallel_dims_without_a_process_group_has_no_groups():
    cfg = resolve(
        load_config("tiny-gpt", ["parallel.tp=2", "parallel.pp=2", "train.global_batch_size=32"]), 8
    )
    dims = ParallelDims.from_config(cfg, rank=5)
    assert (dims.dp, dims.world_size, dims.coordinates()) == (2, 8, {"pp": 1, "dp": 0, "cp": 0, "tp": 1})
    assert dims.mesh is None and dims.dp_group is None and dims.pp_group is None and not dims.is_main
    assert dims.cp_group is None and dims.grad_group is None


def test_one_layout_label_and_bubble():
    cfg = resolve(
        load_config(
            "tiny-gpt",
            [
                "parallel.pp=2",
                "parallel.zero_stage=3",
                "parallel.offload_optimizer=true",
                "parallel.activation_checkpointing=full",
                "train.micro_batch_size=1",
                "train.global_batch_size=4",
            ],
        ),
        world_size=2,
    )
    assert layout_label(cfg) == "dp=1 tp=1 pp=2 zero3+offload schedule 1f1b recompute full"
    assert pipeline_bubble_fraction(2, 1, 4) == pytest.approx(1 / 5)
    assert pipeline_bubble_fraction(1, 1, 4) is None


def test_minmax_over_one_rank_is_the_value_itself():
    got = minmax_over_ranks({"optimizer": 3.0, "forward-compute": 1.5}, ["forward-compute", "optimizer", "x"])
    assert got == {"forward-compute": (1.5, 1.5), "optimizer": (3.0, 3.0)}


class Recorder(Callback):
    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    def on_step_start(self, trainer):
        self.events.append(("start", trainer.iteration))

    def on_step_end(self, trainer, result):
        self.events.append(("end", trainer.iteration))

    def on_evaluate(self, trainer, metrics):
        self.events.append(("evaluate", trainer.iteration))

    def on_fit_end(self, trainer, history):
        self.events.append(("fit_end", trainer.iteration))


def test_trainer_calls_callbacks_in_order_and_restores_its_position(tmp_path):
    from test_trainer import global_batches, make_trainer, split, tiny_cfg

    cfg = tiny_cfg("gpt", 2, 2, "train.eval_interval=2", "train.train_iters=3")
    micro = [m for b in global_batches("gpt", 4, 3) for m in split(b, 2)]
    trainer = make_trainer(cfg, micro)
    trainer.valid_batches = lambda: global_batches("gpt", 2, 1, seed=1)
    recorder = Recorder()
    trainer.callbacks.append(recorder)
    trainer.fit()
    assert recorder.events == [
        ("start", 0), ("end", 1),
        ("start", 1), ("evaluate", 2), ("end", 2),
        ("start", 2), ("evaluate", 3), ("end", 3),
        ("fit_end", 3),
    ]  # fmt: skip
    assert trainer.state_dict() == {"iteration": 3, "consumed_samples": 3 * cfg.train.global_batch_size}
    fresh = make_trainer(cfg, [])
    fresh.load_state_dict(trainer.state_dict())
    assert (fresh.iteration, fresh.consumed_samples) == (trainer.iteration, trainer.consumed_samples)


def twin_modules(root: Path) -> dict[str, list[str]]:
    """Base names held by more than one module under `root`, with their paths relative to it.
    Allowed to repeat (docs/ARCHITECTURE.md): `__init__.py` and `__main__.py`; `cli/<command>.py`, the
    one front-end per `stx` command, next to the library module it calls; and the same role in each
    model family's package (`models/bert/model.py`, `models/gpt/model.py`)."""
    by_name: dict[str, set[str]] = defaultdict(set)
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if rel.name in ("__init__.py", "__main__.py") or rel.parts[0] == "cli":
            continue
        if rel.parts[0] == "models" and len(rel.parts) == 3:
            by_name[rel.name].add(f"models/<family>/{rel.name}")
        else:
            by_name[rel.name].add(rel.as_posix())
    return {name: sorted(paths) for name, paths in sorted(by_name.items()) if len(paths) > 1}


def test_no_two_modules_share_a_base_name():
    """A base name says what a module holds: `metrics/memory.py` next to `plan/memory.py` made every
    reader open both to learn which one measured and which one predicted (issue 23)."""
    twins = twin_modules(Path(scalable_transformer.__file__).parent)
    assert not twins, "modules sharing a base name across packages (rename one of each): " + "; ".join(
        f"{name}: {', '.join(paths)}" for name, paths in twins.items()
    )


def test_twin_check_sees_twins_and_allows_the_exceptions(tmp_path):
    for rel in (
        "__init__.py", "a/__init__.py", "cli/__main__.py", "cli/report.py", "bench/report.py",
        "models/bert/model.py", "models/gpt/model.py", "metrics/memory.py", "plan/memory.py",
    ):  # fmt: skip
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).touch()
    assert twin_modules(tmp_path) == {"memory.py": ["metrics/memory.py", "plan/memory.py"]}


def import_circles(graph: grimp.ImportGraph) -> list[str]:
    """Pairs of modules of one package that import each other, directly or through any chain (imports
    inside functions and under TYPE_CHECKING count: grimp reads them all), with both chains."""
    circles = []
    for a, b in itertools.combinations(sorted(graph.modules), 2):
        package = a.rpartition(".")[0]
        if package != b.rpartition(".")[0]:
            continue
        there = graph.find_shortest_chain(importer=a, imported=b)
        back = graph.find_shortest_chain(importer=b, imported=a) if there else None
        if there and back:
            circles.append(f"{' -> '.join(there)} and {' -> '.join(back)}")
    return circles


def test_no_package_has_an_import_circle_among_its_modules():
    """Modules of one package import each other in one direction, so a package reads from its leaves
    up (issue 39: the sweep's modules and data/preprocess.py with data/tokenizers.py went round)."""
    circles = import_circles(grimp.build_graph("scalable_transformer"))
    assert not circles, "import circles (move the shared part into a module both import):\n" + "\n".join(
        circles
    )


# Module-level functions whose one name is one protocol, each module implementing it for itself:
SHARED_FUNCTION_NAMES = {
    "run",  # cli/<command>.py: runs the parsed command
    "main",  # a program's entry point: `stx` (cli/__init__.py) and the ssh node agent (launch/ssh_node.py)
    "overrides_from_hf",  # models/<family>/hf.py: the family's half of `ModelFamily.overrides`
}


def twin_functions(root: Path) -> dict[str, list[str]]:
    """Public module-level function names defined in more than one module under `root` (private `_`
    helpers are named only inside their own module), less SHARED_FUNCTION_NAMES."""
    by_name: dict[str, list[str]] = defaultdict(list)
    for path in sorted(root.rglob("*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not node.name.startswith("_"):
                by_name[node.name].append(path.relative_to(root).as_posix())
    return {
        name: paths
        for name, paths in sorted(by_name.items())
        if len(paths) > 1 and name not in SHARED_FUNCTION_NAMES
    }


def test_no_two_modules_define_a_function_of_the_same_name():
    """One name, one meaning: two `cross_entropy_sum`s (models/spec.py's plain one and parallel/tensor.py's
    for vocabulary-sharded logits) made a reader check which one a call site imported (issue 39)."""
    twins = twin_functions(Path(scalable_transformer.__file__).parent)
    assert not twins, "module-level functions sharing a name across modules (rename one): " + "; ".join(
        f"{name}: {', '.join(paths)}" for name, paths in twins.items()
    )


def test_twin_function_check_sees_twins_and_allows_the_protocols(tmp_path):
    files = {
        "a.py": "def loss():\n    pass\n\ndef _helper():\n    pass\n\ndef run():\n    pass\n",
        "b/c.py": "def loss():\n    pass\n\ndef _helper():\n    pass\n\ndef run():\n    pass\n",
        "d.py": "class K:\n    def loss(self):\n        pass\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert twin_functions(tmp_path) == {"loss": ["a.py", "b/c.py"]}


def test_no_function_in_src_is_longer_than_80_lines():
    """A function reads top to bottom in one screen (issues 23, 39): one that grew past 80 lines has
    taken on a second job, which belongs in a function (or module) of its own."""
    root = Path(scalable_transformer.__file__).parent
    long = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if lines > 80:
                    long.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long
