"""The planner: predict memory per device, fit/OOM and step time of a parallel layout before running
it, and rank every layout of a cluster (`stx plan`). Torch-free on the GPU path: the search checks
thousands of layouts with `config.rules` and closed-form models (docs/PLANNER.md has every formula
and its source); only planning for this machine's CPU measures (and caches) rates with torch.

Modules: `layout` (the layout of one candidate), `cluster` (devices and clusters: the table, a YAML
file, or this CPU), `memory_model` (bytes per device), `speed` (seconds per step), `search` (one
layout or all of them), `probe` (measured step times on this CPU), `dry_run` (the real engine on fake
tensors). Parameter counts per pipeline stage are `config.model_shapes`'.
"""

from .cluster import Cluster, load_cluster
from .layout import Layout
from .search import Prediction, plan_config, predict, search_layouts

__all__ = ["Cluster", "Layout", "Prediction", "load_cluster", "plan_config", "predict", "search_layouts"]
