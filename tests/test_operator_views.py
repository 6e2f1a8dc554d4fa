"""Kubernetes: each TenplexJob's spec.dataset.path gets a view of its own in its worker pods (tenplex run
--dataset --data-mount, at a mount point named by the job's uid), and status.dataView shows the generation of
the view that the newest committed save read, from the store of the job's node. Two jobs with two datasets on a
KMock cluster, each with its own node and real store: one job's new world (a rescale) changes its status only."""

from __future__ import annotations

import pytest

pytest.importorskip("kmock")  # Python 3.11+ (setup.cfg installs it there)

from k8s_harness import Cluster, api_server, operator, running, wait_for  # noqa: E402
from store_helpers import StoreProcess, tiny_layout  # noqa: E402

from tenplex.elastic import dataview  # noqa: E402
from tenplex.operator import views  # noqa: E402
from tenplex.operator.progress import STATE_DOC  # noqa: E402
from tenplex.operator.settings import WorkerSettings  # noqa: E402
from tenplex.store import Store, fill  # noqa: E402

IPS = {"n1": "127.0.0.1", "n2": "127.0.0.2"}


def _save(root, host: str, version: int, step: int, world: str) -> None:
    """A committed version on ``host``'s store whose training state says which view its world read."""
    import numpy as np

    layout = tiny_layout({"w": ((4,), "float32")}, {f"{host}/0": [("w", (0,), (4,))]})
    doc = {"step": step, "extra": {dataview.SAVED_KEY: {"generation": world, "dp": 1}}}
    fill.write_version({host: Store(root, host)}, layout, version, lambda t, box: np.zeros(box.lengths, "float32"),
                       {STATE_DOC: doc})


def test_saved_key_is_the_one_the_operator_reads():
    assert views.SAVED_KEY == dataview.SAVED_KEY


def test_two_jobs_two_datasets_each_view_its_own_and_its_own_generation(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    roots = {n: tmp_path / "stores" / n for n in IPS}
    _save(roots["n1"], "n1", 1, 4, "world-1")
    _save(roots["n2"], "n2", 1, 4, "world-1")
    stores = {"n1": StoreProcess(roots["n1"], "n1", token_file=token, bind=IPS["n1"])}
    port = stores["n1"].port
    stores["n2"] = StoreProcess(roots["n2"], "n2", token_file=token, bind=IPS["n2"], extra_args=("--port", str(port)))
    try:
        with api_server() as url:
            c = Cluster(url)
            for n, ip in IPS.items():
                c.add_node(n, ip=ip)
            with operator(url, settings=WorkerSettings(store_port=port, token_file=str(token))):
                c.create_job("a", minNodes=1, maxNodes=1, gpusPerNode=8, dataset={"path": "ds-a"})
                node_a = wait_for(lambda: list(c.pods_by_node("a")), "a's worker")[0]
                running(c, "a", [node_a])
                node_b = next(n for n in IPS if n != node_a)
                c.create_job("b", minNodes=1, maxNodes=1, gpusPerNode=8, dataset={"path": "ds-b"})
                running(c, "b", [node_b])
                commands = {j: c.pods_by_node(j)[n]["spec"]["containers"][0]["command"]
                            for j, n in (("a", node_a), ("b", node_b))}
                for j, cmd in commands.items():
                    uid = c.job(j)["metadata"]["uid"]
                    assert cmd[cmd.index("--dataset") + 1] == f"/var/lib/tenplex/datasets/ds-{j}"
                    assert cmd[cmd.index("--data-mount") + 1] == f"{views.VIEW_ROOT}/{uid}"
                for j in ("a", "b"):
                    assert wait_for(lambda: c.status(j).get("dataView"), f"{j}'s status.dataView") == {  # noqa: B023
                        "generation": "world-1", "dp": 1}
                # Job a's next world switched its view and saved: only a's status follows.
                stores[node_a].stop()
                _save(roots[node_a], node_a, 2, 6, "world-2")
                stores[node_a] = StoreProcess(roots[node_a], node_a, token_file=token, bind=IPS[node_a],
                                              extra_args=("--port", str(port)))
                assert wait_for(lambda: c.status("a").get("dataView", {}).get("generation") == "world-2",
                                "a's new generation")
                assert c.status("a")["step"] == 6
                assert c.status("b")["dataView"] == {"generation": "world-1", "dp": 1} and c.status("b")["step"] == 4
    finally:
        for s in stores.values():
            s.stop()
