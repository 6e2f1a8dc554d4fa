"""A TenplexJob's dataset view on Kubernetes: what the worker pod needs to mount it, and what status shows of it.

May import: ``kubernetes`` (its typed models), the standard library and ``tenplex.operator.settings``. Pure: no
API calls, no FUSE.

Who mounts: the worker pod, through its own ``tenplex run --dataset --data-mount`` (the same code as on any
other machine). Each world of the job switches the view in its workers (``Job.restore``), so the mount must
follow the job, not the node: in the worker pod it lives and dies with the pod that reads it, several jobs on
one node never share a mount point or a state file (each pod mounts at ``VIEW_ROOT/<job uid>`` in its own
mount namespace), and a replaced pod mounts a fresh view instead of inheriting a stale one. The cost: FUSE
needs ``/dev/fuse`` and CAP_SYS_ADMIN, so the worker container of a job with ``spec.dataset`` runs privileged
(the store DaemonSet no longer mounts any dataset).

Status: every save of a world with a view records that world in the training state (``extra``
``tenplex.data_view``); ``status.dataView`` shows the one of the newest committed save: the view's generation
(the world id) and its dp degree.
"""

from __future__ import annotations

from typing import Any, Mapping

VIEW_ROOT = "/var/lib/tenplex/views"   # inside the worker pod: each job's view at VIEW_ROOT/<job uid>
SAVED_KEY = "tenplex.data_view"        # tenplex.elastic.dataview.SAVED_KEY (a test keeps the two equal)


def view_args(dataset: str | None, data_root: str, job_uid: str) -> list[str]:
    """``tenplex run``'s options for the job's view of ``dataset`` (a path under ``data_root``); none without."""
    if not dataset:
        return []
    return ["--dataset", f"{data_root.rstrip('/')}/{dataset.lstrip('/')}", "--data-mount", f"{VIEW_ROOT}/{job_uid}"]


def view_volumes(data_root: str) -> tuple[list[Any], list[Any], Any]:
    """(volume mounts, volumes, security context) of a worker container that mounts a view: the packed
    datasets read-only and ``/dev/fuse``; privileged, which FUSE mounts need."""
    from kubernetes import client as k8s

    host = k8s.V1HostPathVolumeSource
    mounts = [k8s.V1VolumeMount(name="data", mount_path=data_root, read_only=True),
              k8s.V1VolumeMount(name="fuse", mount_path="/dev/fuse")]
    volumes = [k8s.V1Volume(name="data", host_path=host(path=data_root, type="DirectoryOrCreate")),
               k8s.V1Volume(name="fuse", host_path=host(path="/dev/fuse", type="CharDevice"))]
    return mounts, volumes, k8s.V1SecurityContext(privileged=True)


def view_status(state_doc: Mapping[str, Any]) -> dict[str, Any] | None:
    """``status.dataView`` from a committed training state document; None when its world read no view."""
    saved = (state_doc.get("extra") or {}).get(SAVED_KEY)
    if not isinstance(saved, Mapping) or not isinstance(saved.get("generation"), str):
        return None
    return {k: saved[k] for k in ("generation", "dp") if k in saved}
