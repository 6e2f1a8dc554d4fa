"""``tenplex operator run``: the Kubernetes operator for TenplexJob resources (kopf).

May import: ``tenplex.operator`` (and through it kopf and kubernetes, the
``k8s`` extra), ``tenplex.errors``, ``tenplex.ops`` and the standard library.
``kopf run -m tenplex.operator.main`` runs the same operator with its settings
from the environment.
"""

from __future__ import annotations

import argparse
import os

from ..errors import PermanentError, UsageError
from ..operator.settings import WorkerSettings
from ._operations import add_arguments as add_operations_arguments, serve_metrics, setup_logs


def register(subparsers) -> None:
    parser = subparsers.add_parser("operator", help="run the Kubernetes operator for TenplexJobs (kopf)")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    run = actions.add_parser(
        "run", help="watch TenplexJobs, their worker pods and the nodes; rescale and recover the jobs",
        description="Runs in the cluster (in-cluster service account) or against the current kubeconfig. "
                    "Defaults come from TENPLEX_* environment variables (the Deployment in k8s/ sets them).")
    where = run.add_mutually_exclusive_group()
    where.add_argument("-A", "--all-namespaces", action="store_true", help="watch TenplexJobs in every namespace")
    where.add_argument("-n", "--namespace", action="append", default=[], help="watch this namespace (repeatable)")
    d = WorkerSettings.from_env()
    run.add_argument("--gpu-resource", default=d.resource,
                     help="node resource that counts as an accelerator (`cpu` on CPU-only clusters such as kind; "
                          "env TENPLEX_GPU_RESOURCE)")
    run.add_argument("--rdzv-backend", default=d.rdzv_backend)
    run.add_argument("--rdzv-endpoint", default=d.rdzv_endpoint,
                     help="the rendezvous Service the workers' torchrun agents meet at")
    run.add_argument("--store-root", default=d.store_root,
                     help="host directory the store DaemonSet serves (mounted into the workers)")
    run.add_argument("--data-root", default=d.data_root,
                     help="host directory of the packed datasets; each job's worker pods mount their view of "
                          "spec.dataset.path under it")
    run.add_argument("--store-port", type=int, default=d.store_port, help="the stores' port on every node (29500)")
    run.add_argument("--token-file", default=d.token_file,
                     help="the store token, to read each job's last committed step from its stores")
    run.add_argument("--unschedulable-grace", type=int, default=d.unschedulable_grace,
                     help="seconds a worker pod may stay Unschedulable before its node is left out "
                          "(default 60; env TENPLEX_UNSCHEDULABLE_GRACE)")
    run.add_argument("--worker-metrics-port", type=int, default=d.metrics_port,
                     help="workers serve Prometheus metrics here (tenplex run --metrics-port: the agent; its "
                          "ranks on the next ports), with prometheus.io/* scrape annotations (default 9400; 0: "
                          "none; env TENPLEX_WORKER_METRICS_PORT)")
    run.add_argument("--interval", type=float, default=float(os.environ.get("TENPLEX_RECONCILE_INTERVAL", "10")),
                     help="seconds between reconciliations when nothing changes (default 10)")
    peering = run.add_mutually_exclusive_group()
    peering.add_argument("--peering", help="kopf peering object: only one operator replica is active")
    peering.add_argument("--standalone", action="store_true", help="no peering (a single replica)")
    run.add_argument("--liveness", help="kopf liveness endpoint, e.g. http://0.0.0.0:8080/healthz")
    add_operations_arguments(run)
    run.set_defaults(handler=run_operator)


def run_operator(args: argparse.Namespace) -> int:
    setup_logs(args)  # first: under --log-format json even a missing extra or credentials is a JSON line
    if not args.all_namespaces and not args.namespace:
        raise UsageError("say which TenplexJobs to watch: --all-namespaces, or --namespace NAME")
    try:
        import kopf
        import kubernetes
    except ImportError as e:
        raise PermanentError(f"the operator needs kopf and kubernetes ({e}): pip install 'tenplex[k8s]'") from None
    from ..operator.handlers import Operator

    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        try:
            kubernetes.config.load_kube_config()
        except (kubernetes.config.ConfigException, OSError) as e:
            raise PermanentError(f"no Kubernetes credentials (not in a pod, and no usable kubeconfig): {e}") from None
    settings = WorkerSettings(resource=args.gpu_resource, store_root=args.store_root, data_root=args.data_root,
                              rdzv_backend=args.rdzv_backend, rdzv_endpoint=args.rdzv_endpoint,
                              store_port=args.store_port, token_file=args.token_file,
                              unschedulable_grace=args.unschedulable_grace, metrics_port=args.worker_metrics_port)
    operator = Operator(kubernetes.client.ApiClient(), settings, interval=args.interval)
    serve_metrics(args, operator.metrics.registry)
    registry = operator.register(kopf.get_default_registry())
    kopf.run(registry=registry, clusterwide=args.all_namespaces, namespaces=args.namespace,
             standalone=args.standalone or None, peering_name=args.peering, liveness_endpoint=args.liveness)
    return 0
