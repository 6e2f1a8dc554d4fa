"""The operator started exactly as k8s/operator.yaml starts it, against KMock: identity, peering, takeover, RBAC.

The Deployment's container command and env run in a subprocess as uid 65532, which has no passwd entry here
(nor in the image); the only stand-ins are the API server's address (a kubeconfig instead of the in-cluster
service account), the token volume (a directory), and the liveness and metrics ports (free ones
instead of 8080 and 9102).
"""

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import yaml

pytest.importorskip("kmock")  # Python 3.11+ (setup.cfg installs it there)

from k8s_harness import Cluster, api_server, wait_for  # noqa: E402
from tenplex.ports import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "k8s"
UID = 65532  # k8s/operator.yaml's runAsUser
SETPRIV = shutil.which("setpriv")


def _docs(name):
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


class Pod:
    """One pod of the operator Deployment: its container's command and env, as uid 65532."""

    def __init__(self, name: str, url: str, root: Path):
        deployment = next(d for d in _docs("operator.yaml") if d["kind"] == "Deployment")
        pod = deployment["spec"]["template"]["spec"]
        container = pod["containers"][0]
        assert pod["containers"][0]["securityContext"]["runAsUser"] == UID
        mounts = {m["mountPath"]: root / m["name"] for m in container["volumeMounts"]}
        env = {"PATH": f"{Path(os.sys.executable).parent}:/usr/bin:/bin", "HOME": "/",  # HOME: as the runtime sets it
               "PYTHONPATH": str(ROOT), "KUBECONFIG": str(root / "kubeconfig")}
        for item in container["env"]:
            if "value" in item:
                value = item["value"]
                for path, local in mounts.items():  # a mounted volume: the same file in its stand-in directory
                    value = value.replace(path, str(local))
            else:  # the downward API
                assert item["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}, item
                value = name
            env[item["name"]] = value
        # Each pod has a network namespace of its own; here they share the machine (and other test processes
        # run at once): the liveness and metrics ports become free ones, as the stand-in for that namespace.
        self.liveness, self.metrics = free_port(), free_port()
        command = [c.replace(":8080/", f":{self.liveness}/") for c in container["command"]]
        at = command.index("--metrics-port") + 1
        assert command[at] == str(container["ports"][0]["containerPort"]), command  # the port the pod declares
        command[at] = str(self.metrics)
        self.proc = subprocess.Popen(
            [SETPRIV, f"--reuid={UID}", f"--regid={UID}", "--clear-groups", *command], env=env, cwd="/",
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def output(self) -> str:
        self.proc.kill()
        return self.proc.communicate(timeout=30)[0]


@pytest.fixture
def deployment(tmp_path):
    """The API server with the peering object, and stand-ins for what the pod mounts; readable by uid 65532."""
    requests: list = []
    root = Path(tempfile.mkdtemp(prefix="tenplex-operator-"))
    os.chmod(root, 0o755)
    pods: list[Pod] = []
    try:
        with api_server(requests) as url:
            (root / "kubeconfig").write_text(yaml.safe_dump({
                "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
                "clusters": [{"name": "kmock", "cluster": {"server": url}}],
                "users": [{"name": "operator", "user": {"token": "t"}}],
                "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "operator"}}]}))
            (root / "token").mkdir()
            (root / "token" / "token").write_text("s3cret\n")
            for path in root.rglob("*"):
                os.chmod(path, 0o755 if path.is_dir() else 0o644)
            c = Cluster(url)
            peering = next(d for d in _docs("kopf-peering.yaml") if d["kind"] == "ClusterKopfPeering")
            c.custom.create_cluster_custom_object("kopf.dev", "v1", "clusterkopfpeerings", peering)
            c.add_node("n1")

            def start(name):
                pods.append(Pod(name, url, root))
                return pods[-1]
            try:
                yield c, start, requests
            finally:  # before the server stops: its open watches would hold the shutdown
                for pod in pods:
                    if pod.proc.poll() is None:
                        pod.proc.kill()
                        pod.proc.wait(30)
    finally:
        shutil.rmtree(root)


def _worker(c, job):
    c.kubelet(job)
    return c.pods(job)


@pytest.mark.skipif(os.geteuid() != 0 or SETPRIV is None, reason="needs root and setpriv to run as uid 65532")
def test_operator_deployment_runs_as_its_uid_and_a_successor_takes_over_after_sigkill(deployment):
    c, start, requests = deployment
    first = start("tenplex-operator-6d9f-a")
    c.create_job("a", minNodes=1, maxNodes=1, gpusPerNode=4)  # n1 has 8: room for job b
    wait_for(lambda: _worker(c, "a") or first.proc.poll() is not None, "the first operator's worker", timeout=60)
    if first.proc.poll() is not None:
        raise AssertionError(f"the operator exited: {first.output()[-3000:]}")
    # (read with `list`, which the operator uses too: a `get` here would spoil the RBAC check below)
    peers = c.custom.list_cluster_custom_object("kopf.dev", "v1", "clusterkopfpeerings")["items"][0]
    assert peers["status"]["tenplex-operator-6d9f-a"]["lifetime"] == 15  # the pod's name is its identity

    first.proc.send_signal(signal.SIGKILL)  # no goodbye in the peering object: its entry must expire
    first.proc.wait(30)
    killed = time.monotonic()
    second = start("tenplex-operator-6d9f-b")
    c.create_job("b", minNodes=1, maxNodes=1, gpusPerNode=4)
    try:
        wait_for(lambda: c.pods("b"), "the successor's worker", timeout=90)
    except AssertionError:
        raise AssertionError(second.output()[-3000:]) from None
    print(f"takeover: the successor created a worker {time.monotonic() - killed:.1f} s after SIGKILL")

    # RBAC: on the peering object, exactly the verbs k8s/rbac.yaml grants (least privilege, all of them used)
    role = next(d for d in _docs("rbac.yaml") if d["kind"] == "ClusterRole")
    granted = {v for rule in role["rules"] if "clusterkopfpeerings" in rule["resources"] for v in rule["verbs"]}
    used = {verb for verb, group, resource in requests if resource == "clusterkopfpeerings"} - {"create"}
    assert used == granted == {"list", "watch", "patch"}
