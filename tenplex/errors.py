"""Error types shared by every layer, and whether retrying can help.

May import: nothing from tenplex. Each error subclasses the builtin that best
describes it, so callers can catch either. Messages name the tensor, shapes and
configuration involved and say what would be valid.

Retrying. Controllers (the elastic runtime, an operator) must know whether
waiting can help, as kopf's ``TemporaryError`` and ``PermanentError`` say:

* ``error.retryable`` is True when the same call may succeed later without
  anyone changing anything: a store that is not up yet, a peer that is
  restarting, a network that heals. Such errors derive from
  :class:`TemporaryError` or compute the attribute from their cause (a store
  call's gRPC status, a transformation's per-host causes).
* It is False when only a change can help: a malformed configuration or
  layout, state that does not match the model, a region with no surviving
  copy. Such errors derive from :class:`PermanentError`; every other
  :class:`TenplexError` is also not retryable unless it says otherwise.
* :func:`is_retryable` answers for any exception, including the builtin
  ``ConnectionError`` and ``TimeoutError`` (retryable) and everything else
  that is not a :class:`TenplexError` (not retryable: a bug does not heal).
"""

from __future__ import annotations


class TenplexError(Exception):
    """Base class of every error raised on purpose by tenplex; ``retryable`` says whether waiting can help."""

    retryable: bool = False


class TemporaryError(TenplexError):
    """Waiting and retrying the same call can help (a store not up yet, a peer restarting)."""

    retryable = True


class PermanentError(TenplexError):
    """Retrying the same call cannot help: the input, the configuration or the stored state must change."""

    retryable = False


# gRPC status names after which the same call can succeed later: the store was down, slow or busy.
RETRYABLE_STATUS = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "ABORTED"})


def is_retryable(error: BaseException) -> bool:
    """Whether retrying the call that raised ``error`` can help (see the module docstring)."""
    if isinstance(error, TenplexError):
        return bool(error.retryable)
    return isinstance(error, (ConnectionError, TimeoutError))


class UsageError(PermanentError, ValueError):
    """A command-line argument, option combination or input file the user must fix."""


class BoxError(PermanentError, ValueError):
    """Boxes of different rank, negative lengths, or other malformed boxes."""


class ConfigError(PermanentError, ValueError):
    """An invalid parallel configuration or device list."""


class LayoutError(PermanentError, ValueError):
    """A layout that is malformed or inconsistent with its tensors."""


class PlanError(PermanentError, ValueError):
    """Two layouts that cannot be transformed into each other."""


class StoreError(TenplexError, RuntimeError):
    """A tensor store operation failed: unknown version, missing shard, corrupt data, staging conflicts.

    Not retryable by default; the store client's errors are retryable when
    their status says the store was unreachable or busy.
    """


class TransformError(TenplexError, RuntimeError):
    """A state transformation failed on one or more hosts.

    ``failures`` maps each failed host (or ``"coordinator"``) to its cause, an
    exception with its own chain and traceback. The transformation is
    retryable when there are causes and every one of them is.
    """

    def __init__(self, message: str, failures: dict[str, BaseException] | None = None):
        super().__init__(message)
        self.failures = dict(failures or {})

    @property
    def retryable(self) -> bool:  # type: ignore[override]  # computed from the causes
        return bool(self.failures) and all(is_retryable(cause) for cause in self.failures.values())
