"""The manifests expose what tenplex.ops serves: the stores' gRPC health probe, metrics ports with scrape
annotations, and the optional PodMonitors (Prometheus operator) selecting those pods and ports."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import yaml

K8S = Path(__file__).parents[1] / "k8s"


def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def _pod_template(name: str, kind: str) -> dict:
    return next(d for d in _docs(name) if d["kind"] == kind)["spec"]["template"]


def _metrics_port(template: dict, container: str) -> int:
    c = next(c for c in template["spec"]["containers"] if c["name"] == container)
    port = next(p["containerPort"] for p in c["ports"] if p["name"] == "metrics")
    command = c["command"]
    assert command[command.index("--metrics-port") + 1] == str(port)
    assert command[command.index("--metrics-bind") + 1] == "0.0.0.0"  # the scraper is on another machine
    assert template["metadata"]["annotations"] == {"prometheus.io/scrape": "true", "prometheus.io/port": str(port),
                                                   "prometheus.io/path": "/metrics"}
    return port


def test_store_daemonset_probes_grpc_health_and_exposes_metrics():
    template = _pod_template("store.yaml", "DaemonSet")
    store = template["spec"]["containers"][0]
    assert store["readinessProbe"]["grpc"] == {"port": 29501}  # grpc.health.v1 on the probe port: no token
    command = store["command"]
    assert command[command.index("--probe-port") + 1] == "29501"
    assert _metrics_port(template, "store") == 9450
    assert _metrics_port(_pod_template("operator.yaml", "Deployment"), "operator") == 9102


def _workers_monitor_matches_a_worker_pod(monitor: dict) -> None:
    """The workers' PodMonitor selects the operator's worker pods, and scrapes the ports of a pod of 8 ranks."""
    from tenplex.operator.pods import worker_pod
    from tenplex.operator.settings import WorkerSettings
    from tenplex.operator.spec import parse_spec

    spec = {"image": "i", "command": ["train.py"], "minNodes": 1, "maxNodes": 2, "gpusPerNode": 8}
    job = {"apiVersion": "tenplex.io/v1alpha1", "kind": "TenplexJob", "spec": spec,
           "metadata": {"name": "j", "namespace": "team", "uid": "u"}}
    pod = worker_pod(job, parse_spec(spec), "node-a", WorkerSettings())
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == \
        [p["name"] for p in pod["spec"]["containers"][0]["ports"]]


def test_podmonitors_select_the_pods_and_their_metrics_ports():
    monitors = _docs("podmonitor.yaml")
    assert [m["kind"] for m in monitors] == ["PodMonitor", "PodMonitor", "PodMonitor"]
    _workers_monitor_matches_a_worker_pod(monitors[2])
    for monitor, (manifest, kind) in zip(monitors, (("store.yaml", "DaemonSet"), ("operator.yaml", "Deployment"))):
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        template = _pod_template(manifest, kind)
        assert monitor["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
        assert monitor["spec"]["podMetricsEndpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "15s"}]
    for name in ("store.yaml", "operator.yaml"):  # still valid built-in objects with the new fields
        for doc in _docs(name):
            if doc["kind"] in ("DaemonSet", "Deployment"):
                kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
