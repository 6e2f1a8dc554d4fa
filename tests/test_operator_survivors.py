"""A rescale never recreates a surviving worker's pod (issue 36 item 7): kopf against KMock and the kubelet stand-in.

A survivor is the same pod (uid, creationTimestamp) before and after a join, a scale-down and a lost GPU on its
node: only joining pods are created and only leaving pods deleted. A worker pod carries nothing that changes with
the world (its command and environment are the same whichever world it joins: the world is agreed in the
rendezvous), so there is never a reason to replace one.
"""

import pytest

pytest.importorskip("kmock")  # Python 3.11+ (setup.cfg installs it there)

from k8s_harness import Cluster, api_server, operator, running, start_job, wait_for  # noqa: E402


@pytest.fixture
def cluster():
    with api_server() as url:
        yield Cluster(url)


def identity(pod):
    return pod["metadata"]["uid"], pod["metadata"]["creationTimestamp"]


def survivors(c, nodes):
    pods = c.pods_by_node("j")
    return {n: identity(pods[n]) for n in nodes}


def world_of(c, gpus):
    def check():
        c.kubelet("j")
        st = c.status("j")
        return st if st.get("phase") == "Running" and st.get("nodeGpus") == gpus else None
    return wait_for(check, f"the world {gpus}")


def test_join_scale_down_and_a_lost_gpu_keep_every_survivors_pod(cluster):
    c = cluster
    with operator(c.url):
        start_job(c, minGpusPerNode=6, parallel={"maxTp": 1})
        before = survivors(c, ["n1", "n2"])
        c.add_node("n3")  # join: only n3's pod is created
        running(c, "j", ["n1", "n2", "n3"])
        assert survivors(c, ["n1", "n2"]) == before
        pods = c.pods_by_node("j")
        worker = [pods[n]["spec"]["containers"][0] for n in ("n1", "n3")]
        # created in a world of 2 and in a world of 3: the same command and environment
        assert worker[0]["command"] == worker[1]["command"] and worker[0]["env"] == worker[1]["env"]

        c.patch_spec("j", maxNodes=2)  # scale down: only n3's pod is deleted
        running(c, "j", ["n1", "n2"])
        assert survivors(c, ["n1", "n2"]) == before

        c.set_gpus("n2", 7)  # the device plugin took an unhealthy GPU out: n2's tenplex run drops it in place
        st = world_of(c, {"n1": 8, "n2": 7})
        assert survivors(c, ["n1", "n2"]) == before
        assert st["resizedInPlace"] == {"n2": {"pod": before["n2"][0], "gpus": 7}}
        rec = st["lastRescale"]
        assert (rec["type"], rec["reason"], rec["to"]["worldSize"]) == \
            ("Resize", "node n2: 8 -> 7 nvidia.com/gpu, in place", 15)
        wait_for(lambda: c.events("Resized"), "the Resized event")
    deleted = [e["message"] for e in c.events("WorkerDeleted")]
    assert deleted == ["j-n3 (grace 120s): scale down: maxNodes=2"]
    assert sorted(e["message"].split()[0] for e in c.events("WorkerCreated")) == ["j-n1", "j-n2", "j-n3"]
