"""Transformations between hosts with links of their own (tenplex.cluster): the wire carries the plan's
lower bound, a cut source falls back to a replica, a cut destination aborts cleanly, a healed host serves
again, and a slow host is asked for less. States are small (tens of MB) and links fast, to stay quick."""

from __future__ import annotations

import threading
import time

import pytest

from tenplex.cluster import emulated
from tenplex.cluster import EmulatedCluster
from tenplex.bench.linked import LinkedStores, inter_host_wire_bytes
from tenplex.errors import TransformError
from tenplex.planner import plan
from tenplex.store import Store

from store_helpers import assert_version_matches, gpt_layout, random_globals, write_version

REASON = emulated.unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"emulated cluster unavailable: {REASON}")

SIZE = {"layers": 2, "hidden": 256, "vocab": 4096}  # about 32 MB per replica with Adam states


def _layouts():
    """dp=2, tp=2 with one full replica on each of h0 and h1, moving to h2 and h3 (the issue's move)."""
    old = gpt_layout(2, 2, 1, 2, 2, **SIZE)
    new = gpt_layout(2, 2, 1, 2, 2, host_names=["h2", "h3"], **SIZE)
    return old, new


def _start(cluster, tmp_path, old):
    roots = {h: tmp_path / "stores" / h for h in cluster.hosts}
    arrays = random_globals(old, seed=3)
    write_version(roots, old, 1, arrays, docs={"step": {"step": 7}})
    return LinkedStores(cluster, roots, tmp_path / "work"), roots, arrays


def _in_background(stores, *args):
    """Run stores.transform(*args) in a thread; returns (thread, outcome dict: report or error)."""
    outcome: dict = {}

    def run():
        try:
            outcome["report"] = stores.transform(*args)
        except TransformError as e:
            outcome["error"] = e
    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def _wait_for_bytes(cluster, host, nbytes, thread):
    """Block until ``host`` has sent ``nbytes`` more through its link (the transfer is under way)."""
    start = cluster.counters()[host].out
    while cluster.counters()[host].out - start < nbytes and thread.is_alive():
        time.sleep(0.02)


def test_wire_bytes_match_the_plans_lower_bound(tmp_path):
    old, new = _layouts()
    the_plan = plan(old, new)
    with EmulatedCluster(["h0", "h1", "h2", "h3"], mbit=800) as cluster:
        stores, roots, arrays = _start(cluster, tmp_path, old)
        before = cluster.counters()
        report = stores.transform(the_plan, old, new, 1, 2)
        moved = cluster.counters() - before
        wire = inter_host_wire_bytes(moved)
        bound = the_plan.stats.inter_host_lower_bound
        assert bound > 40e6  # two destinations, a full replica each
        assert bound <= wire <= 1.05 * bound, (wire, bound)
        # every byte came from the old hosts; the new ones sent only acknowledgements and control messages
        assert moved["h0"].out + moved["h1"].out >= bound
        assert moved["h2"].out + moved["h3"].out < 0.01 * bound
        assert sum(h["remote_bytes"] for h in report["hosts"].values()) == the_plan.stats.inter_host_bytes
        assert_version_matches(roots, new, 2, arrays)


def test_cut_source_falls_back_to_a_replica_and_heals(tmp_path):
    old, new = _layouts()
    with EmulatedCluster(["h0", "h1", "h2", "h3"], mbit=200) as cluster:
        stores, roots, arrays = _start(cluster, tmp_path, old)
        thread, outcome = _in_background(stores, plan(old, new), old, new, 1, 2)
        _wait_for_bytes(cluster, "h0", 2 << 20, thread)
        cluster.cut("h0")
        thread.join()
        assert "error" not in outcome, outcome.get("error")
        report = outcome["report"]
        # The silent source was given up and its regions came from h1: the fallback path, not a deadline.
        assert sum(h["refetched_bytes"] for h in report["hosts"].values()) > 0
        assert_version_matches(roots, new, 2, arrays)
        assert Store(roots["h2"], "h2").open(2).get_json("step") == {"step": 7}
        # After the heal, h0's store serves again: version 2 goes back onto h0 and h1 as version 3.
        cluster.heal("h0")
        stores.transform(plan(new, old), new, old, 2, 3)
        assert_version_matches(roots, old, 3, arrays)


def test_cut_destination_aborts_cleanly_and_a_retry_after_heal_succeeds(tmp_path):
    old, new = _layouts()
    the_plan = plan(old, new)
    with EmulatedCluster(["h0", "h1", "h2", "h3"], mbit=200) as cluster:
        stores, roots, arrays = _start(cluster, tmp_path, old)
        thread, outcome = _in_background(stores, the_plan, old, new, 1, 2)
        _wait_for_bytes(cluster, "h0", 2 << 20, thread)
        cluster.cut("h3")
        thread.join()
        error = outcome.get("error")
        assert error is not None, "the transformation succeeded although a destination was cut off"
        assert "h3" in error.failures and "version 1 is unchanged" in str(error)
        for host, root in roots.items():  # nothing committed anywhere, the old version intact
            assert 2 not in Store(root, host).versions(), host
        assert_version_matches(roots, old, 1, arrays)
        cluster.heal("h3")
        stores.transform(the_plan, old, new, 1, 2)
        assert_version_matches(roots, new, 2, arrays)


def test_slow_source_is_asked_for_less(tmp_path):
    old = gpt_layout(2, 2, 1, 2, 2, **SIZE)                        # a full replica on h0 and on h1
    new = gpt_layout(1, 2, 1, 1, 2, host_names=["h2"], **SIZE)     # h2 pulls everything
    the_plan = plan(old, new)
    planned_h0 = sum(t.box.volume * new.tensors[t.tensor].itemsize for t in the_plan.transfers
                     if t.src.startswith("h0/"))
    assert planned_h0 > 0.4 * the_plan.stats.inter_host_bytes  # the planner splits evenly
    with EmulatedCluster(["h0", "h1", "h2"], mbit=400) as cluster:
        cluster.set_rate("h0", 40)
        stores, roots, arrays = _start(cluster, tmp_path, old)
        before = cluster.counters()
        stores.transform(the_plan, old, new, 1, 2)
        moved = cluster.counters() - before
        # h1's link is ten times faster: it takes over pieces queued for h0
        assert moved["h0"].out < 0.5 * planned_h0, (moved["h0"].out, planned_h0)
        assert_version_matches(roots, new, 2, arrays)


def _bench(*argv, env=None):
    import json
    import os
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "tenplex.cli", "bench", *argv, "--json"], capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, timeout=300)
    return proc, [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_bench_transfer_on_links_reports_wire_bytes_and_efficiency(tmp_path):
    proc, rows = _bench("transfer", "--bytes", str(8 << 20), "--repeat", "1", "--link-mbit", "400",
                        "--dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    (row,) = rows
    assert row["link_mbit"] == 400 and row["inter_host_lower_bound"] == 8 << 20
    assert 1.0 <= row["wire_vs_lower_bound"] <= 1.05
    assert row["host_bytes_out"]["h0"] >= 8 << 20 and row["host_bytes_in"]["h1"] >= 8 << 20
    # the busiest link carried the region: the bound is its bytes at 400 Mbit/s
    assert row["link_bound_seconds"] == pytest.approx(row["host_bytes_out"]["h0"] / 50e6, abs=2e-3)
    assert 0 < row["link_efficiency"] and row["raw_socket_link_gbps"] > 0


def test_bench_compare_on_links_reports_the_speedup_the_links_allow(tmp_path):
    proc, rows = _bench("compare", "--quick", "--methods", "tenplex,centralised", "--link-mbit", "800",
                        "--dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    tenplex, central = rows
    assert tenplex["mismatches"] == [] and central["mismatches"] == []
    assert central["central_host"] == "h0"
    assert central["central_host_bytes"] >= central["inter_host_bytes"]
    # this change keeps everything on tenplex's hosts: the links allow any speedup, so no ratio is given
    assert tenplex["inter_host_lower_bound"] == 0 and "link_speedup_allowed" not in central


def test_speedup_the_links_allow_is_central_host_bytes_over_tenplex_busiest_link():
    from tenplex.bench.compare_linked import link_speedups

    rows = [{"change": "c", "method": "tenplex", "seconds": 10.0, "inter_host_lower_bound": 100,
             "busiest_link_bytes": 500},
            {"change": "c", "method": "centralised", "seconds": 24.0, "central_host_bytes": 1500}]
    link_speedups(rows)
    assert rows[1]["link_speedup_allowed"] == 3.0 and rows[1]["speedup_vs_allowed"] == 0.8


def test_bench_partition_survives_a_cut_source_and_aborts_a_cut_destination():
    proc, rows = _bench("partition", "--layers", "1", "--hidden", "256", "--vocab", "4096", "--link-mbit", "100",
                        "--cut-after", "0.2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    none, source, destination = rows
    assert [r["fault"] for r in rows] == ["none", "source h0 cut", "destination h3 cut"]
    assert none["succeeded"] and source["succeeded"] and not destination["succeeded"]
    assert none["committed_on"] == source["committed_on"] == ["h2", "h3"] and destination["committed_on"] == []
    assert all(r["old_version_intact"] for r in rows)
    assert source["refetched_bytes"] > 0 and none["refetched_bytes"] == 0  # h1's replica took over
    assert source["link_bound_seconds"] > none["link_bound_seconds"] > 0 and destination["link_bound_seconds"] is None
    assert source["extra_link_bound_seconds"] == round(source["link_bound_seconds"] - none["link_bound_seconds"], 3)


def test_partition_bench_link_bound_is_what_the_surviving_link_must_still_carry():
    from types import SimpleNamespace

    from tenplex.bench.partition import _link_bound

    the_plan = SimpleNamespace(stats=SimpleNamespace(inter_host_bytes=1_600_000_000, max_host_send_bytes=800_000_000))
    assert _link_bound(the_plan, 800, None, None, None) == 8.0  # 0.8 GB over 100 MB/s
    # cut 1.5 s in, after the two sources had sent 0.3 GB: the other 1.3 GB leave through h1 alone
    assert _link_bound(the_plan, 800, "h0", 1.5, 300_000_000) == 1.5 + 13.0
    assert _link_bound(the_plan, 800, "h3", 1.5, 300_000_000) is None  # a cut destination must fail


def test_benches_refuse_without_iproute2():
    proc, rows = _bench("transfer", "--bytes", "1000000", "--link-mbit", "100", env={"PATH": "/nonexistent"})
    assert proc.returncode == 2 and rows == []
    assert proc.stderr.strip().count("\n") == 0 and "iproute2" in proc.stderr
