"""tenplex: change a PyTorch job's parallel configuration without losing its state.

The public face is curated: everything a user needs is listed in ``__all__``.
Modules whose names start with ``_`` are internal.
"""

from .box import Box
from .errors import BoxError, ConfigError, LayoutError, PlanError, StoreError, TenplexError, TransformError
from .layout import Layout, Shard, TensorSpec
from .transfer_plan import Plan, PlanStats, Transfer
from .parallel import ParallelConfig
from .ptc import PTC, LocalShard, TensorRule
from .planner import plan
from .replication import LostStateError

__version__ = "0.1.0"

__all__ = [
    "Box", "Layout", "Shard", "TensorSpec", "Plan", "PlanStats", "Transfer",
    "ParallelConfig", "PTC", "TensorRule", "LocalShard", "plan",
    "TenplexError", "BoxError", "ConfigError", "LayoutError", "PlanError",
    "__version__",
    "Checkpointer", "save", "restore", "Annotation", "StateMismatchError", "CollectiveError", "RestoreInfo",
    "Store", "StoreError", "TransformError", "LostStateError",
    "DatasetState", "DatasetError",
]

# The PyTorch integration imports torch: load it on first use so that `import tenplex` and the CLI stay fast.
_INTEGRATION = ("Checkpointer", "save", "restore", "Annotation", "StateMismatchError", "CollectiveError",
                "RestoreInfo")


def __getattr__(name: str):
    if name in _INTEGRATION:
        from . import integration
        return getattr(integration, name)
    if name in ("DatasetState", "DatasetError"):  # numpy-backed: loaded on first use
        from . import dataset
        return getattr(dataset, name)
    if name == "Store":  # numpy-backed: also loaded on first use
        from .store import Store
        return Store
    raise AttributeError(f"module 'tenplex' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
