"""Error types shared by every layer.

May import: nothing from tenplex. Each error subclasses the builtin that best
describes it, so callers can catch either. Messages name the tensor, shapes and
configuration involved and say what would be valid.
"""


class TenplexError(Exception):
    """Base class of every error raised on purpose by tenplex."""


class BoxError(TenplexError, ValueError):
    """Boxes of different rank, negative lengths, or other malformed boxes."""


class ConfigError(TenplexError, ValueError):
    """An invalid parallel configuration or device list."""


class LayoutError(TenplexError, ValueError):
    """A layout that is malformed or inconsistent with its tensors."""


class PlanError(TenplexError, ValueError):
    """Two layouts that cannot be transformed into each other."""


class StoreError(TenplexError, RuntimeError):
    """A tensor store operation failed: unknown version, missing shard, corrupt data, staging conflicts."""


class TransformError(TenplexError, RuntimeError):
    """A state transformation failed on one or more hosts; ``failures`` maps each host to its cause."""

    def __init__(self, message: str, failures: "dict[str, str] | None" = None):
        super().__init__(message)
        self.failures = dict(failures or {})
