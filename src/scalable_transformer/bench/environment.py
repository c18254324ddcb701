"""The environment fingerprint moved to `metrics.environment` (train/ records it, so it cannot live
above train/ in bench/); this name is kept for existing imports."""

from ..metrics.environment import PACKAGES, cpu_model, environment, record_sections

__all__ = ["PACKAGES", "cpu_model", "environment", "record_sections"]
