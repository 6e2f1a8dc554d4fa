"""tenplex: change a PyTorch job's parallel configuration without losing its state.

The public face is curated: everything a user needs is listed in ``__all__``.
Modules whose names start with ``_`` are internal.
"""

from .box import Box
from .errors import BoxError, ConfigError, LayoutError, PlanError, TenplexError
from .layout import Layout, Shard, TensorSpec
from .plan import Plan, PlanStats, Transfer

__version__ = "0.1.0"

__all__ = [
    "Box", "Layout", "Shard", "TensorSpec", "Plan", "PlanStats", "Transfer",
    "TenplexError", "BoxError", "ConfigError", "LayoutError", "PlanError",
    "__version__",
]
