"""The transformer across real store server processes: every new shard equals the global slice, byte for byte."""

from __future__ import annotations

import itertools
import math

import pytest

from tenplex.planner import plan
from tenplex.store import Store
from tenplex.transform import transform

from store_helpers import Cluster, assert_version_matches, gpt_layout, random_globals, write_version

_versions = itertools.count(10, 10)

CASES = {
    # name: (old (dp, tp, pp, hosts, per_host, sharding, dtype), new (...))
    "tp change": ((2, 2, 1, 2, 2, "none", "float32"), (1, 4, 1, 2, 2, "none", "float32")),
    "pp change": ((2, 1, 2, 2, 2, "none", "float32"), (2, 2, 1, 2, 2, "none", "float32")),
    "dp change, more hosts": ((2, 2, 1, 2, 2, "none", "float32"), (3, 2, 1, 3, 2, "none", "float32")),
    "fewer hosts": ((2, 2, 1, 2, 2, "none", "float32"), (1, 2, 1, 1, 2, "none", "float32")),
    "sharded dp": ((4, 1, 1, 2, 2, "optimizer", "float32"), (2, 2, 1, 2, 2, "optimizer", "float32")),
    "bf16 tp+pp": ((1, 2, 2, 2, 2, "none", "bfloat16"), (1, 4, 1, 2, 2, "none", "bfloat16")),
    "hosts renamed": ((2, 2, 1, 2, 2, "none", "float32"), (2, 2, 1, 2, 2, "none", "float32")),
    # both replicas on one new host: every region crosses once, then the fan-out copies it to the other replica
    "replicas onto one new host": ((2, 2, 1, 2, 2, "none", "float32"), (2, 2, 1, 1, 4, "none", "float32")),
}
NEW_HOSTS = {"hosts renamed": ["h2", "h0"], "replicas onto one new host": ["h2"]}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with Cluster(tmp_path_factory.mktemp("transform"), ["h0", "h1", "h2"]) as c:
        yield c


@pytest.mark.parametrize("case", sorted(CASES))
def test_transformation_produces_exact_slices(cluster, case):
    (o_dp, o_tp, o_pp, o_hosts, o_per, o_sh, dtype), (n_dp, n_tp, n_pp, n_hosts, n_per, n_sh, _) = CASES[case]
    old = gpt_layout(o_dp, o_tp, o_pp, o_hosts, o_per, o_sh, dtype)
    new = gpt_layout(n_dp, n_tp, n_pp, n_hosts, n_per, n_sh, dtype, host_names=NEW_HOSTS.get(case))
    arrays = random_globals(old, seed=len(case))
    v = next(_versions)
    write_version(cluster.roots, old, v, arrays, docs={"step": {"step": v}, "rng": {"seed": 1234}})
    the_plan = plan(old, new)
    if case == "replicas onto one new host":  # every element crosses once; its other copies are fan-out
        assert sum(t.box.volume for t in the_plan.transfers if t.source == "old") == \
            sum(math.prod(spec.shape) for spec in new.tensors.values())
        assert sum(t.box.volume for t in the_plan.transfers if t.source == "new") > 0
    seen = {}
    report = transform(the_plan, old, new, cluster.addresses, v, v + 1, streams=3,
                       progress=lambda host, done, total: seen.__setitem__(host, (done, total)))
    assert_version_matches(cluster.roots, new, v + 1, arrays)
    assert_version_matches(cluster.roots, old, v, arrays)  # the old version is untouched
    for host in new.hosts():
        reader = Store(cluster.roots[host], host).open(v + 1)
        assert reader.get_json("step") == {"step": v} and reader.get_json("rng") == {"seed": 1234}
    for host in set(cluster.roots) - set(new.hosts()):
        assert v + 1 not in Store(cluster.roots[host], host).versions()
    # progress reached the total on every destination host
    assert set(seen) == set(new.hosts()) and all(done == total > 0 for done, total in seen.values())
    # bytes per category agree with the plan's statistics
    hosts = report["hosts"]
    stats = the_plan.stats
    assert sum(h["remote_bytes"] for h in hosts.values()) == stats.inter_host_bytes
    assert sum(h["kept_bytes"] + h["linked_bytes"] for h in hosts.values()) + \
        sum(h["local_bytes"] for h in hosts.values()) == stats.kept_bytes + stats.intra_host_bytes
    assert sum(h["bytes_total"] for h in hosts.values()) == stats.target_bytes
    assert all(h["refetched_bytes"] == 0 for h in hosts.values())


def test_whole_kept_shards_are_hard_linked_not_copied(cluster):
    old = gpt_layout(2, 2, 1, 2, 2)
    new = gpt_layout(1, 2, 1, 2, 1, host_names=["h0", "h1"])  # h0/0 and h1/0 keep exactly their old shards
    arrays = random_globals(old, seed=5)
    v = next(_versions)
    write_version(cluster.roots, old, v, arrays)
    report = transform(plan(old, new), old, new, cluster.addresses, v, v + 1)
    assert_version_matches(cluster.roots, new, v + 1, arrays)
    assert all(h["linked_bytes"] == h["bytes_total"] and h["remote_bytes"] == 0 for h in report["hosts"].values())
    old_reader = Store(cluster.roots["h0"], "h0").open(v)
    new_reader = Store(cluster.roots["h0"], "h0").open(v + 1)
    entry = new_reader.entries_of("h0/0")[0]
    same = old_reader.find("h0/0", entry.tensor, entry.box)
    assert (new_reader.path / entry.file).stat().st_ino == (old_reader.path / same.file).stat().st_ino


def test_host_that_lost_its_old_version_is_refilled_from_replicas(cluster):
    """h1's store lost version v (a wiped disk); its new shards come from h0's replica instead."""
    old = gpt_layout(2, 2, 1, 2, 2)   # h0 and h1 each hold a full replica
    new = gpt_layout(1, 4, 1, 2, 2)
    arrays = random_globals(old, seed=21)
    v = next(_versions)
    write_version(cluster.roots, old, v, arrays, docs={"step": {"step": v}})
    assert Store(cluster.roots["h1"], "h1").delete(v)
    report = transform(plan(old, new), old, new, cluster.addresses, v, v + 1)
    assert report["hosts"]["h1"]["refetched_bytes"] > 0
    assert_version_matches(cluster.roots, new, v + 1, arrays)
    assert Store(cluster.roots["h1"], "h1").open(v + 1).get_json("step") == {"step": v}


def test_plan_for_other_layouts_or_missing_stores_fail_before_touching_hosts(cluster):
    from tenplex.errors import ConfigError, TransformError

    old, new = gpt_layout(2, 2, 1, 2, 2), gpt_layout(1, 4, 1, 2, 2)
    other = gpt_layout(1, 2, 1, 1, 2, host_names=["h2"])
    v = next(_versions)
    with pytest.raises(TransformError, match="the plan does not match the layouts"):
        transform(plan(old, other), old, new, cluster.addresses, v, v + 1)
    with pytest.raises(TransformError, match="no store address for destination host\\(s\\) \\['h1'\\]") as info:
        transform(plan(old, new), old, new, {"h0": cluster.addresses["h0"]}, v, v + 1)
    assert set(info.value.failures) == {"h1"} and isinstance(info.value.failures["h1"], ConfigError)
    assert "no store address for host h1" in str(info.value.failures["h1"]) and not info.value.retryable
    assert all(v + 1 not in Store(root, h).versions() for h, root in cluster.roots.items())


def test_the_old_layout_document_is_not_carried_or_even_read(cluster):
    """The new version records its own layout; the old one (tens of MB at 1,024 devices) is neither copied nor
    fetched: with it damaged on every old host, the other documents still travel, locally and to a new host."""
    old = gpt_layout(2, 2, 1, 2, 2)
    new = gpt_layout(3, 2, 1, 3, 2)  # h2 is new: it fetches the documents from an old host
    arrays = random_globals(old, seed=23)
    v = next(_versions)
    write_version(cluster.roots, old, v, arrays, docs={"step": {"step": v}})
    for host in ("h0", "h1"):
        reader = Store(cluster.roots[host], host).open(v)
        (reader.path / reader.manifest["json"]["layout"]).write_text("{damaged")
    transform(plan(old, new), old, new, cluster.addresses, v, v + 1)
    assert_version_matches(cluster.roots, new, v + 1, arrays)  # includes each host's recorded (new) layout
    for host in ("h0", "h1", "h2"):
        assert Store(cluster.roots[host], host).open(v + 1).get_json("step") == {"step": v}
