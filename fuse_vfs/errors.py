"""Errors of the FUSE layer.

May import: ``tenplex.errors`` only.
"""

from tenplex.errors import TenplexError

FALLBACK_HINT = ("without FUSE, read a rank in process with tenplex.dataset.open_fallback(DATASET, state, dp, rank) "
                 "or tenplex.dataset.torch_data.RankDataset.fallback(...): same samples, same order")


class VfsError(TenplexError, RuntimeError):
    """A mount, switch or unmount that could not be done (says why and what to do)."""


class FuseUnavailableError(VfsError):
    """FUSE cannot be used here (no /dev/fuse, no fusermount, no libfuse binding)."""
