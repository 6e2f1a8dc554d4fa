"""``tenplex bench compare --link-mbit N``: the store methods (tenplex, centralised) on hosts with links of their own.

May import: every tenplex layer and the standard library.

Each simulated host's store runs in the emulated cluster (``tenplex.cluster``,
N Mbit/s each way per host) and the coordinator in its control host
(``tenplex.bench.linked``). A row gains the link fields of ``linked.link_fields``
over the whole method (the centralised method's gather and scatter together).
For the centralised method, ``central_host_bytes`` is what the gathering host
received plus what it sent: its two phases run one after the other, so its
link is busy for that many bytes. :func:`link_speedups` adds, per change,
``link_speedup_allowed`` = ``central_host_bytes`` / tenplex's busiest link
bytes (the speedup the links allow) and ``speedup_vs_allowed`` = the measured
speedup (centralised seconds / tenplex seconds) over it.
"""

from __future__ import annotations

import time
from pathlib import Path


def run_store_method(method: str, root: Path, old, new, streams: int | None, verify: bool, mbit: float) -> dict:
    """``compare._run_store_method`` with every store behind its own link; version 2 is checked and deleted."""
    from ..planner import plan
    from ..store import Store
    from ..cluster import EmulatedCluster
    from .centralised import central_layout
    from .gpt_state import mismatches
    from .linked import LinkedStores, link_fields
    from .store_traffic import add_host_bytes, host_bytes, peak_rss

    hosts = sorted(set(old.hosts()) | set(new.hosts()))
    with EmulatedCluster(hosts, mbit=mbit) as cluster:
        stores = LinkedStores(cluster, {h: root / h for h in hosts}, root / f"work-{method}")
        before = cluster.counters()
        # Seconds: planning plus the coordinator's own transform time (not the start-up of its process).
        if method == "tenplex":
            start = time.perf_counter()
            the_plan = plan(old, new)
            planning = time.perf_counter() - start
            report = stores.transform(the_plan, old, new, 1, 2, streams=streams)
            seconds = planning + report["seconds"]
            traffic = host_bytes(the_plan, old, new, report)
            inter, bound = the_plan.stats.inter_host_bytes, the_plan.stats.inter_host_lower_bound
        else:
            central = central_layout(old)
            start = time.perf_counter()
            gather, scatter = plan(old, central), plan(central, new)
            planning = time.perf_counter() - start
            gathered = stores.transform(gather, old, central, 1, 3, streams=streams)
            scattered = stores.transform(scatter, central, new, 3, 2, streams=streams)
            seconds = planning + gathered["seconds"] + scattered["seconds"]
            traffic = add_host_bytes(host_bytes(gather, old, central, gathered),
                                     host_bytes(scatter, central, new, scattered))
            inter = gather.stats.inter_host_bytes + scatter.stats.inter_host_bytes
            bound = gather.stats.inter_host_lower_bound + scatter.stats.inter_host_lower_bound
        moved = cluster.counters() - before
        peak = {f"store {h}": peak_rss(proc.pid) for h, proc in stores.procs.items()}
        links = link_fields(moved, seconds, cluster.mbit, bound)
        if method == "centralised":
            center = central.hosts()[0]
            links["central_host"] = center
            links["central_host_bytes"] = moved[center].in_ + moved[center].out
    wrong = mismatches(root, new, 2) if verify else []
    for h in hosts:
        for version in (2, 3):
            Store(root / h, h).delete(version)
    row = {"seconds": seconds, "inter_host_bytes": inter, "hosts": traffic, "peak_rss": peak, **links}
    if verify:
        row["mismatches"] = wrong
    return row


def link_speedups(results: list[dict]) -> None:
    """Add ``link_speedup_allowed`` and ``speedup_vs_allowed`` to each centralised row whose change has a tenplex
    row that moves data between hosts."""
    for row in results:
        if row["method"] != "centralised" or "central_host_bytes" not in row:
            continue
        tenplex = next((r for r in results if r["change"] == row["change"] and r["method"] == "tenplex"), None)
        if tenplex is None or not tenplex["inter_host_lower_bound"]:
            continue  # tenplex keeps everything on its hosts: the links allow any speedup
        allowed = row["central_host_bytes"] / tenplex["busiest_link_bytes"]
        row["link_speedup_allowed"] = round(allowed, 3)
        row["speedup_vs_allowed"] = round(row["seconds"] / tenplex["seconds"] / allowed, 3)
