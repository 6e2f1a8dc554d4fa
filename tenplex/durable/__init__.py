"""A durable tier: committed versions flushed to an S3-compatible bucket, and restores from it into any layout.

May import: this package's modules (``bucket``, ``flush``, ``restore``, ``uploader``) and the standard library.

The layer sits beside ``tenplex.transform``: it reads committed versions of a host's store and
commits restored versions into it through the store's contract, and plans with ``tenplex.planner`` (a flush) and
``tenplex.share_planner`` (a restore: each host its own share).
``bucket`` wraps the client (obstore, the ``durable`` extra); ``flush`` uploads a host's share of a
version and writes the commit marker; ``uploader`` is the background policy (every N versions or T
seconds, newest first, capped bandwidth, retries with back-off); ``restore`` fetches one host's regions
of a new layout with verified ranged reads.
"""

from .bucket import Bucket, BucketDenied, BucketUnreachable, DurableError, RateLimit, parse_url
from .flush import FlushResult, durable_versions, flush_host, gc
from .restore import DurableVersion, restore_host

__all__ = ["Bucket", "BucketDenied", "BucketUnreachable", "DurableError", "DurableVersion", "FlushResult",
           "RateLimit", "durable_versions", "flush_host", "gc", "parse_url", "restore_host"]
