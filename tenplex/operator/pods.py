"""The worker pod of a TenplexJob on one node: ``tenplex run`` with the job's limits.

May import: the package's pure modules, ``tenplex.elastic.envsettings`` (the
job settings' environment), ``tenplex.ops.logs`` (the job's variable), ``kubernetes`` (its typed models) and the
standard library. No API calls: this only builds the object.

Each worker runs one torchrun elastic agent through ``tenplex run``. It reuses
the node's store (the DaemonSet serves the same ``--store-root``, a hostPath),
joins the rendezvous service with the job's uid as the rendezvous id, and
mounts its job's dataset view itself (``tenplex run --dataset --data-mount``; see :mod:`.views`).

Metrics: ``tenplex run --metrics-port P`` on all addresses of the pod (``WorkerSettings.metrics_port``; 0:
none): the agent on P, each rank's ``tenplex_job_*`` on P+1+LOCAL_RANK, each a named container port (for a
PodMonitor), and ``prometheus.io/*`` annotations on P+1, local rank 0 (an annotation names one port: the first
rank's step, saves and world are the job's; the agent's port only says that it runs).
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, Mapping

from kubernetes import client as k8s

from ..elastic.envsettings import env_from_settings
from ..ops.logs import JOB_ENV
from . import JOB_LABEL, NODE_ANNOTATION, ROLE_LABEL, STORE_NODE_LABELS, WORKER_ROLE
from .settings import WorkerSettings
from .spec import JobSpec
from .views import view_args, view_volumes


# The store DaemonSet's init container copies the Secret tenplex-store-token (in its own namespace) here, into the
# node's store root: a worker in any namespace reads it from the hostPath it mounts anyway, and no namespace but
# the operator's needs a copy of the Secret (a Secret volume must name a Secret in the pod's own namespace).
TOKEN_FILE_NAME = ".tenplex-store.token"
_SERIALIZER = k8s.ApiClient()  # only turns typed models into camelCase JSON; makes no requests


def pod_name(job: str, node: str) -> str:
    """``<job>-<node>``, a valid DNS label; long names keep a hash of the full name so they stay unique."""
    name = re.sub(r"[^a-z0-9-]+", "-", f"{job}-{node}".lower()).strip("-")
    if len(name) <= 63:
        return name
    digest = hashlib.sha256(f"{job}/{node}".encode()).hexdigest()[:8]
    return f"{name[:54].rstrip('-')}-{digest}"


def worker_command(spec: JobSpec, job_uid: str, settings: WorkerSettings, gpus: int) -> list[str]:
    # The node's store is the DaemonSet's (host network, same root and host name): `tenplex run` finds it through
    # the port file in the root and reaches it at the node's address with the token.
    return ["tenplex", "run", *_metrics_args(settings), "--host", "$(NODE_NAME)", "--store-root", settings.store_root,
            "--store-advertise", "$(NODE_IP)", "--token-file",
            f"{settings.store_root}/{TOKEN_FILE_NAME}",
            "--nnodes", f"{spec.min_nodes}:{spec.max_nodes}", "--nproc-per-node", str(gpus),
            "--rdzv-backend", settings.rdzv_backend, "--rdzv-endpoint", settings.rdzv_endpoint,
            "--rdzv-id", job_uid, *(["--durable", spec.durable] if spec.durable else []),
            *(["--in-place"] if spec.in_place else []),
            *view_args(spec.dataset, settings.data_root, job_uid), *spec.command]


def _metrics_args(settings: WorkerSettings) -> list[str]:
    """``tenplex run``'s metrics options (before the script, where it takes them), reachable by a scraper."""
    if not settings.metrics_port:
        return []
    return ["--metrics-port", str(settings.metrics_port), "--metrics-bind", "0.0.0.0"]


def _metrics_ports(settings: WorkerSettings, gpus: int) -> tuple[dict[str, str], list[k8s.V1ContainerPort]]:
    """The scrape annotations and the named container ports of a worker with ``gpus`` ranks (see the module)."""
    port = settings.metrics_port
    if not port:
        return {}, []
    annotations = {"prometheus.io/scrape": "true", "prometheus.io/port": str(port + 1),
                   "prometheus.io/path": "/metrics"}
    ports = [k8s.V1ContainerPort(name="metrics", container_port=port)]
    ports += [k8s.V1ContainerPort(name=f"metrics-r{rank}", container_port=port + 1 + rank) for rank in range(gpus)]
    return annotations, ports


def _env(spec: JobSpec, settings: WorkerSettings, job: str) -> list[k8s.V1EnvVar]:
    env = [k8s.V1EnvVar(name=name, value_from=k8s.V1EnvVarSource(field_ref=k8s.V1ObjectFieldSelector(field_path=path)))
           for name, path in (("NODE_NAME", "spec.nodeName"), ("NODE_IP", "status.hostIP"))]
    # What the training-loop API needs from the spec (issue 8): the policy's inputs, replication and saving.
    # (TENPLEX_DATASET: tenplex run --dataset sets it, with the job's view.)
    values = env_from_settings(max_tp=spec.max_tp, pp=spec.pp, pinned=spec.pinned, replicas=spec.replicas,
                               save_every=spec.save_interval)
    env += [k8s.V1EnvVar(name=k, value=v) for k, v in values.items()]
    env.append(k8s.V1EnvVar(name=JOB_ENV, value=job))  # the `job` of its JSON log lines: NAMESPACE/NAME
    env += [k8s.V1EnvVar(name=k, value=v) for k, v in spec.env]
    return env


def _merge(ours: Any, theirs: Any) -> Any:
    """The user's template under ours: ours wins on scalars, dicts merge, lists concatenate (volumes, tolerations)."""
    if isinstance(ours, dict) and isinstance(theirs, Mapping):
        out = dict(theirs)
        for key, value in ours.items():
            out[key] = _merge(value, theirs[key]) if key in theirs else value
        return out
    if isinstance(ours, list) and isinstance(theirs, list):
        return ours + [t for t in theirs if t not in ours]
    return ours


def worker_pod(job: Mapping[str, Any], spec: JobSpec, node: str, settings: WorkerSettings,
               gpus: int | None = None) -> dict:
    """The worker pod of TenplexJob ``job`` (its raw object) on ``node``, as a JSON-able dict: one worker per
    unit of the resource, ``gpus`` of them (default ``gpusPerNode``; fewer on a node that lost some)."""
    meta = job["metadata"]
    name, namespace, uid = meta["name"], meta["namespace"], meta["uid"]
    gpus = spec.gpus_per_node if gpus is None else gpus
    resources = {"limits": {settings.resource: str(gpus)}, "requests": {settings.resource: str(gpus)}}
    resources = _merge(resources, dict(spec.resources))
    host = k8s.V1HostPathVolumeSource
    view_mounts, view_vols, security = view_volumes(settings.data_root) if spec.dataset else ([], [], None)
    scrape, ports = _metrics_ports(settings, gpus)
    pod = k8s.V1Pod(
        api_version="v1", kind="Pod",
        metadata=k8s.V1ObjectMeta(
            name=pod_name(name, node), namespace=namespace,
            labels={JOB_LABEL: name, ROLE_LABEL: WORKER_ROLE},
            annotations={NODE_ANNOTATION: node, **scrape},
            # No blockOwnerDeletion: setting it needs `update` on tenplexjobs/finalizers, which the operator lacks.
            owner_references=[k8s.V1OwnerReference(api_version=job["apiVersion"], kind=job["kind"], name=name,
                                                   uid=uid, controller=True)]),
        spec=k8s.V1PodSpec(
            restart_policy="Never",  # the operator replaces failed workers (and counts the failures)
            termination_grace_period_seconds=spec.grace_seconds,
            # Pinned to its node as a DaemonSet pins its pods: the operator chose the node by its free GPUs.
            affinity=k8s.V1Affinity(node_affinity=k8s.V1NodeAffinity(
                required_during_scheduling_ignored_during_execution=k8s.V1NodeSelector(node_selector_terms=[
                    k8s.V1NodeSelectorTerm(match_fields=[k8s.V1NodeSelectorRequirement(
                        key="metadata.name", operator="In", values=[node])])]))),
            containers=[k8s.V1Container(
                name="worker", image=spec.image, command=worker_command(spec, uid, settings, gpus),
                env=_env(spec, settings, f"{namespace}/{name}"), ports=ports or None,
                resources=k8s.V1ResourceRequirements(limits=resources.get("limits"),
                                                     requests=resources.get("requests")),
                security_context=security,
                volume_mounts=[k8s.V1VolumeMount(name="store", mount_path=settings.store_root), *view_mounts])],
            # Only nodes that run the store DaemonSet, and its taints tolerated: the nodes the operator qualifies.
            node_selector=dict(STORE_NODE_LABELS),
            tolerations=[k8s.V1Toleration(**t) for t in spec.tolerations(settings.resource)],
            volumes=[k8s.V1Volume(name="store", host_path=host(path=settings.store_root, type="DirectoryOrCreate")),
                     *view_vols]))
    body = _SERIALIZER.sanitize_for_serialization(pod)
    # Containers in the template are added as sidecars (lists concatenate).
    return _merge(body, {"metadata": spec.template.get("metadata") or {}, "spec": spec.template.get("spec") or {}})
