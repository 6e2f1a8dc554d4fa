"""tenplex: change a PyTorch job's parallel configuration without losing its state.

May import: every tenplex module, but only the pure core eagerly (the rest on
first use of a name that needs it).

The public face is curated: ``__all__`` lists what a user imports from
``tenplex`` (docs/reference/python-api.md describes each group). Three
public functions keep their module's name and so are reached through it, since
binding them here would hide the module: ``tenplex.gpt.gpt`` (the built-in GPT
partition rules), ``tenplex.ptc.layout`` (a PTC's layout under a
configuration) and ``tenplex.transform.transform`` (run a plan across the
stores). Modules whose names start with ``_`` are internal.

``import tenplex`` loads neither torch, nor numpy, nor gRPC: the names that
need them load on first use.
"""

from .box import Box
from .devices import make_devices, parse_host_addresses
from .errors import (BoxError, ConfigError, LayoutError, PermanentError, PlanError, StoreError, TemporaryError,
                     TenplexError, TransformError, UsageError, is_retryable)
from .layout import Layout, Shard, TensorSpec
from .parallel import ParallelConfig, detect, parse_degrees
from .planner import plan
from .ptc import PTC, LocalShard, TensorRule
from .transfer_plan import Plan, PlanStats, Transfer

__version__ = "0.1.0"

__all__ = [
    # the PTC core (pure): boxes, configurations, partition rules, layouts, plans
    "Box", "ParallelConfig", "parse_degrees", "detect", "make_devices", "parse_host_addresses",
    "PTC", "TensorRule", "LocalShard", "Layout", "Shard", "TensorSpec", "load_layout", "save_layout",
    "plan", "Plan", "PlanStats", "Transfer", "load_plan", "save_plan", "apply_plan",
    # saving and restoring a PyTorch job (torch)
    "Checkpointer", "save", "restore", "RestoreInfo", "Annotation", "ShardMap",
    # stores and datasets (numpy)
    "Store", "DatasetState",
    # errors, and whether retrying can help
    "TenplexError", "TemporaryError", "PermanentError", "is_retryable", "UsageError", "BoxError", "ConfigError",
    "LayoutError", "PlanError", "StoreError", "TransformError", "StateMismatchError", "CollectiveError",
    "LostStateError", "DatasetError",
    "__version__",
]

# Loaded on first use, so that `import tenplex` and the CLI stay fast: name -> module that defines it.
_LAZY = {
    **dict.fromkeys(("Checkpointer", "save", "restore", "RestoreInfo", "Annotation", "ShardMap", "StateMismatchError",
                     "CollectiveError"), "integration"),   # torch
    **dict.fromkeys(("DatasetState", "DatasetError"), "dataset"),  # numpy
    **dict.fromkeys(("load_layout", "save_layout", "load_plan", "save_plan"), "files"),  # file I/O, outside the core
    "Store": "store",            # numpy
    "apply_plan": "apply",       # numpy
    "LostStateError": "replication",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'tenplex' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
