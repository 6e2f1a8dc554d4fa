"""Offline checks of k8s/: built-in manifests against current Kubernetes schemas (kubernetes-validate),
TenplexJobs and the operator's status against the CRD's openAPIV3Schema (jsonschema), RBAC against the operator
guide's table."""

import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tenplex.operator.decide import decide
from tenplex.operator.outcome import merge_patch
from tenplex.operator.observe import NodeState, PodState
from tenplex.operator.pods import worker_pod
from tenplex.operator.settings import WorkerSettings
from tenplex.operator.spec import parse_spec

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "k8s"
BUILT_IN = {"Namespace", "CustomResourceDefinition", "ServiceAccount", "ClusterRole", "ClusterRoleBinding",
            "Deployment", "Service", "DaemonSet", "Pod", "NetworkPolicy"}
VERSION = kubernetes_validate.latest_version()


def docs(path):
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


OPTIONAL = ("podmonitor.yaml",)  # needs the Prometheus operator's CRD: applied by hand (test_ops_k8s.py)


def manifests():
    return {p.name: docs(p) for p in sorted(K8S.glob("*.yaml")) if p.name not in ("kustomization.yaml", *OPTIONAL)}


def crd_schema(part=None):
    crd = next(d for d in docs(K8S / "crd.yaml") if d["kind"] == "CustomResourceDefinition")
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema if part is None else schema["properties"][part]


def validate_builtin(doc):
    # strict: unknown fields are errors too (a misspelt key would be dropped silently by the API server)
    kubernetes_validate.validate(doc, VERSION, strict=True)


def test_kustomization_lists_every_manifest():
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kust["resources"]) == sorted(manifests())
    assert kust["namespace"] == "tenplex-system"


@pytest.mark.parametrize("name", sorted(manifests()))
def test_builtin_manifests_validate_against_current_kubernetes(name):
    for doc in manifests()[name]:
        if doc["kind"] in BUILT_IN:
            validate_builtin(doc)
        else:
            assert doc["apiVersion"] == "kopf.dev/v1"  # the peering object: its CRD is in kopf-peering.yaml


def test_kubernetes_validate_would_silently_pass_a_custom_resource():
    # why the TenplexJob needs its own check below
    example = docs(K8S / "examples" / "tenplexjob.yaml")[0]
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate(example, VERSION, strict=True)


def test_example_job_matches_the_crd_schema_and_the_operator_accepts_it():
    example = docs(K8S / "examples" / "tenplexjob.yaml")[0]
    jsonschema.validate(example, crd_schema())
    job = parse_spec(example["spec"])
    assert (job.min_nodes, job.max_nodes, job.gpus_per_node) == (1, 4, 8)
    assert job.parallel(3) == "dp=1,tp=8,pp=3"  # the pinned world of 24


@pytest.mark.parametrize("change, where", [
    ({"minNodes": 0}, "minNodes"),
    ({"gpusPerNode": 0}, "gpusPerNode"),
    ({"command": []}, "command"),
    ({"image": None}, "image"),
    ({"replicas": -1}, "replicas"),
    ({"parallel": {"maxTp": "8"}}, "maxTp"),
    ({"inPlace": "yes"}, "inPlace"),
])
def test_crd_schema_rejects_what_it_can(change, where):
    spec = {"image": "i", "command": ["t.py"], "minNodes": 1, "maxNodes": 2, **change}
    spec = {k: v for k, v in spec.items() if v is not None}
    with pytest.raises(jsonschema.ValidationError) as e:
        jsonschema.validate({"spec": spec}, crd_schema())
    assert where in str(e.value.path) + str(e.value.message)


def test_crd_min_le_max_rule_and_printer_columns():
    spec = crd_schema("spec")
    rule = spec["x-kubernetes-validations"][0]
    assert (rule["rule"], rule["fieldPath"]) == ("self.minNodes <= self.maxNodes", ".minNodes")
    crd = docs(K8S / "crd.yaml")[0]["spec"]["versions"][0]
    assert crd["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in crd["additionalPrinterColumns"]}
    assert list(columns) == ["Phase", "Nodes", "World", "Parallel", "Step", "Age"]
    status = crd_schema("status")["properties"]
    for path in columns.values():
        if path.startswith(".status."):
            assert path.split(".")[2] in status


def test_operator_status_matches_the_crd_status_schema():
    """The API server prunes status fields the schema lacks: every field decide() writes must be in it."""
    s = parse_spec({"image": "i", "command": ["t.py"], "minNodes": 1, "maxNodes": 3, "gpusPerNode": 8})
    nodes = [NodeState(n, True, True, 8) for n in ("n1", "n2", "n3")]
    pods = [PodState(f"j-{n}", f"u{n}", n, "Running") for n in ("n1", "n2")]
    kw = dict(used_by_others={}, generation=1, resource="nvidia.com/gpu")
    status = merge_patch({}, decide(s, nodes[:2], pods, status=None, now="2026-01-01T00:00:00Z", **kw).status)
    failed = [pods[0], PodState("j-n2", "u2", "n2", "Failed")]
    d = decide(s, nodes, failed, status=status, now="2026-01-01T00:01:00Z", **kw)
    status = merge_patch(status, d.status)
    assert status["phase"] == "Recovering" and status["failures"] and status["lastRescale"]
    validator = jsonschema.Draft7Validator(_closed(crd_schema("status")), format_checker=jsonschema.FormatChecker())
    assert list(validator.iter_errors(status)) == []
    # a scale-up to n3 dropped (n3 NotReady), then a worker on n3 Unschedulable past the grace period
    status = merge_patch({}, decide(s, nodes[:2], pods, status=None, now="2026-01-01T00:00:00Z", **kw).status)
    for round_nodes, round_pods, now in (
            (nodes, pods, "2026-01-01T00:01:00Z"),
            (nodes[:2] + [NodeState("n3", False, True, 8)], pods, "2026-01-01T00:02:00Z"),
            (nodes, pods + [PodState("j-n3", "u3", "n3", "Pending", unschedulable_since="2026-01-01T00:00:00Z")],
             "2026-01-01T00:03:00Z")):
        status = merge_patch(status, decide(s, round_nodes, round_pods, status=status, now=now, **kw).status)
    assert status["unschedulable"] and status["lastRescale"]["abandoned"]
    assert list(validator.iter_errors(status)) == []
    # n2 lost a GPU: its worker stays, resized in place
    s = parse_spec({"image": "i", "command": ["t.py"], "minNodes": 1, "maxNodes": 3, "gpusPerNode": 8,
                    "minGpusPerNode": 6})
    nodes[1] = NodeState("n2", True, True, 7)
    pods = [PodState(f"j-{n}", f"u{n}", n, "Running", gpus=8) for n in ("n1", "n2")]
    status = merge_patch(status, decide(s, nodes, pods, status=status, now="2026-01-01T00:04:00Z", **kw).status)
    assert status["resizedInPlace"] == {"n2": {"pod": "un2", "gpus": 7}}
    assert list(validator.iter_errors(status)) == []


def _closed(schema):
    """The schema with additionalProperties false wherever it lists properties: unknown fields fail."""
    if isinstance(schema, dict):
        out = {k: _closed(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_closed(v) for v in schema]
    return schema


def test_worker_pod_is_a_valid_pod_with_the_exact_labels():
    example = docs(K8S / "examples" / "tenplexjob.yaml")[0]
    job = {**example, "metadata": {**example["metadata"], "uid": "1234"}}
    pod = worker_pod(job, parse_spec(example["spec"]), "node-a", WorkerSettings())
    validate_builtin(pod)
    assert pod["metadata"]["labels"] == {"tenplex.io/job": "gpt-example", "tenplex.io/role": "worker"}
    mounts = {m["name"]: m for m in pod["spec"]["containers"][0]["volumeMounts"]}
    # the job's own dataset view: the pod mounts it (FUSE: /dev/fuse, privileged) at a path named by the job's uid
    assert mounts["data"] == {"name": "data", "mountPath": "/var/lib/tenplex/datasets", "readOnly": True}
    assert mounts["fuse"]["mountPath"] == "/dev/fuse" and pod["spec"]["containers"][0]["securityContext"]["privileged"]
    command = pod["spec"]["containers"][0]["command"]
    assert command[command.index("--dataset"):command.index("--data-mount") + 2] == [
        "--dataset", "/var/lib/tenplex/datasets/example", "--data-mount", "/var/lib/tenplex/views/1234"]
    # the worker's `tenplex run` reuses the DaemonSet's store: same root, host name, token file and port file
    ds = next(d for d in manifests()["store.yaml"] if d["kind"] == "DaemonSet")
    store = next(c for c in ds["spec"]["template"]["spec"]["containers"] if c["name"] == "store")
    cmd, scmd = pod["spec"]["containers"][0]["command"], store["command"]
    for flag, sflag in (("--store-root", "--root"), ("--host", "--host")):
        assert cmd[cmd.index(flag) + 1] == scmd[scmd.index(sflag) + 1], flag
    # the token: the DaemonSet's init container copies the store's token file into the store root, where the
    # worker (in any namespace) reads it; the worker mounts no Secret (it would have to be in its namespace)
    init = next(c for c in ds["spec"]["template"]["spec"]["initContainers"] if c["name"] == "token")
    assert init["command"][-2:] == [scmd[scmd.index("--token-file") + 1], cmd[cmd.index("--token-file") + 1]]
    assert cmd[cmd.index("--token-file") + 1] == f"{WorkerSettings().store_root}/.tenplex-store.token"
    assert not [v for v in pod["spec"]["volumes"] if "secret" in v]
    # only on the nodes that run the store DaemonSet, tolerating what it tolerates
    assert pod["spec"]["nodeSelector"] == ds["spec"]["template"]["spec"]["nodeSelector"]
    assert ds["spec"]["template"]["spec"]["tolerations"] == pod["spec"]["tolerations"]
    assert scmd[scmd.index("--port-file") + 1] == f"{WorkerSettings().store_root}/.tenplex-store.port"
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert {k: v for k, v in env.items() if k.startswith("TENPLEX_")} == {
        "TENPLEX_MAX_TP": "8", "TENPLEX_REPLICAS": "1", "TENPLEX_SAVE_INTERVAL": "50",
        "TENPLEX_PINNED": '{"24": "tp=8,pp=3"}',  # TENPLEX_DATASET: tenplex run --dataset sets it
        "TENPLEX_JOB": "default/gpt-example"}  # the job key of its JSON logs
    assert pod["spec"]["containers"][0]["resources"]["requests"] == {"nvidia.com/gpu": "8", "cpu": "8",
                                                                      "memory": "64Gi"}


def test_worker_pods_serve_metrics_with_scrape_annotations():
    """tenplex run --metrics-port before the script (where it takes its own options), on the pod's addresses; the
    annotations name local rank 0's port (the job's numbers), every port is a named container port."""
    from tenplex.cli._run_operations import take

    example = docs(K8S / "examples" / "tenplexjob.yaml")[0]
    job = {**example, "metadata": {**example["metadata"], "uid": "1234"}}
    pod = worker_pod(job, parse_spec(example["spec"]), "node-a", WorkerSettings(), 2)
    container = pod["spec"]["containers"][0]
    _, options = take(container["command"][2:])
    assert (options.metrics_port, options.metrics_bind) == (9400, "0.0.0.0")
    assert {k: v for k, v in pod["metadata"]["annotations"].items() if k.startswith("prometheus.io/")} == {
        "prometheus.io/scrape": "true", "prometheus.io/port": "9401", "prometheus.io/path": "/metrics"}
    assert container["ports"] == [{"name": "metrics", "containerPort": 9400},
                                  {"name": "metrics-r0", "containerPort": 9401},
                                  {"name": "metrics-r1", "containerPort": 9402}]
    validate_builtin(pod)
    off = worker_pod(job, parse_spec(example["spec"]), "node-a", WorkerSettings(metrics_port=0), 2)
    assert "--metrics-port" not in off["spec"]["containers"][0]["command"] and "ports" not in \
        off["spec"]["containers"][0] and not any(k.startswith("prometheus.io/") for k in off["metadata"]["annotations"])


def test_store_daemonset_mounts_token_and_no_dataset():
    ds = next(d for d in manifests()["store.yaml"] if d["kind"] == "DaemonSet")
    containers = {c["name"]: c for c in ds["spec"]["template"]["spec"]["containers"]}
    assert "--token-file" in containers["store"]["command"]
    volumes = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
    assert volumes["token"]["secret"]["secretName"] == "tenplex-store-token"
    # each job's worker pods mount their own view (tenplex.operator.views): no fixed dataset, nothing privileged
    assert list(containers) == ["store"] and set(volumes) == {"store", "token"}
    assert volumes["store"]["hostPath"]["path"] == WorkerSettings().store_root


def test_rbac_grants_exactly_what_the_operator_guide_table_explains():
    role = next(d for d in manifests()["rbac.yaml"] if d["kind"] == "ClusterRole")
    granted = set()
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for res in rule["resources"]:
                granted |= {(group or "core", res, verb) for verb in rule["verbs"]}
    section = (ROOT / "docs" / "guides" / "operator.md").read_text()
    table = section[section.index("| API group |"):]
    explained = set()
    for line in table.splitlines()[2:]:
        if not line.startswith("|"):
            break
        group, res, verb, why = [c.strip() for c in line.strip("|").split("|")]
        assert why, line
        explained.add((group.strip("`"), res.strip("`"), verb.strip("`")))
    assert granted == explained
    assert not any(v in ("*", "update", "deletecollection") for _, _, v in granted)
    assert re.search(r"resourceNames", (K8S / "rbac.yaml").read_text())


@pytest.mark.parametrize("in_place", [False, True])
def test_worker_command_is_what_tenplex_run_parses(in_place):
    """The command parses with `tenplex run`'s own parsers: an option the operator passes that `tenplex run` lacks
    fails here, not in every worker pod. spec.inPlace (default false) becomes `tenplex run --in-place`."""
    from tenplex.cli._run_operations import take
    from tenplex.elastic.launcher import parser, parse

    if in_place and "--in-place" not in parser()._option_string_actions:
        pytest.skip("this tenplex run has no --in-place yet (issue 36, branch wip/inplace)")
    example = docs(K8S / "examples" / "tenplexjob.yaml")[0]
    spec = {**example["spec"], **({"inPlace": True} if in_place else {})}
    jsonschema.validate({**example, "spec": spec}, crd_schema())
    job = {**example, "metadata": {**example["metadata"], "uid": "1234"}}
    pod = worker_pod(job, parse_spec(spec), "node-a", WorkerSettings())
    command = pod["spec"]["containers"][0]["command"]
    assert command[:2] == ["tenplex", "run"] and ("--in-place" in command) == in_place
    run = parse(take(command[2:])[0])  # as `tenplex run` does: its operations options first, then the launcher's
    assert (run.target, run.args, run.host) == (spec["command"][0], spec["command"][1:], "$(NODE_NAME)")
    assert getattr(run, "in_place", False) == in_place
