"""The operator's cluster-wide settings (``tenplex operator run`` options and their ``TENPLEX_*`` defaults).

May import: the standard library only, so that ``tenplex --help`` works without the ``k8s`` extra.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class WorkerSettings:
    """Cluster-wide settings of the operator (``tenplex operator run`` options)."""

    resource: str = "nvidia.com/gpu"  # `cpu` on CPU-only clusters (kind)
    store_root: str = "/var/lib/tenplex/store"  # hostPath shared with the store DaemonSet
    data_root: str = "/var/lib/tenplex/datasets"  # hostPath of the packed datasets (spec.dataset.path is under it)
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str = "tenplex-rendezvous.tenplex-system.svc:29400"
    store_port: int = 29500  # the DaemonSet's store port on every node (status.step is read from it)
    token_file: str | None = None  # the operator's copy of the store token (to read status.step)
    unschedulable_grace: int = 60  # seconds a worker may stay Unschedulable before its node is left out
    metrics_port: int = 9400  # workers' `tenplex run --metrics-port` (its ranks on the next ports); 0: none

    @classmethod
    def from_env(cls) -> "WorkerSettings":
        """Defaults overridden by ``TENPLEX_*`` variables (the operator Deployment in k8s/ sets them)."""
        env = {"resource": "TENPLEX_GPU_RESOURCE", "store_root": "TENPLEX_STORE_ROOT_HOST",
               "data_root": "TENPLEX_DATA_ROOT_HOST", "rdzv_backend": "TENPLEX_RDZV_BACKEND",
               "rdzv_endpoint": "TENPLEX_RDZV_ENDPOINT", "store_port": "TENPLEX_STORE_PORT",
               "token_file": "TENPLEX_TOKEN_FILE", "unschedulable_grace": "TENPLEX_UNSCHEDULABLE_GRACE",
               "metrics_port": "TENPLEX_WORKER_METRICS_PORT"}
        values: dict[str, Any] = {field: os.environ[var] for field, var in env.items() if os.environ.get(var)}
        for number in ("store_port", "unschedulable_grace", "metrics_port"):
            if number in values:
                values[number] = int(values[number])
        return cls(**values)
