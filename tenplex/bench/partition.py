"""``tenplex bench partition --link-mbit N``: a move to new hosts with a source or a destination cut off mid-way.

May import: every tenplex layer, numpy and the standard library.

A GPT state with Adam moments under dp=2, tp=2 (one full replica on each of
h0 and h1) moves to h2 and h3, on hosts with links of their own
(``tenplex.cluster``). The default size is the issue's case: about
0.8 GB per replica (2 layers, hidden 1024, vocab 20480), so each old host sends
about 0.8 GB. Three runs: without a fault; with the link of the source h0 cut
``--cut-after`` seconds after h0's first bytes left (h1's replica must take
over); with the link of the destination h3 cut as well (the transformation
must fail cleanly: nothing committed anywhere, the old version intact). After
each cut the link is healed, and the next run is the proof that the stores
serve again. Per run: ``seconds`` (until the transformation returned or
failed), ``extra_seconds`` over the run without a fault, ``refetched_bytes``
(bytes read from a replica after their source failed), whether version 2 was
committed on any host, and the error's first line.

What the links allow, per run: ``link_bound_seconds``. Without a fault it is
the busiest old host's bytes over its link rate. With the source cut at
``t`` seconds, every byte that neither h0 nor h1 had sent by then must leave
through h1's link alone: ``t + (inter-host bytes - bytes both had sent) / rate``
(``t`` counted from h0's first bytes, like the cut; start-up is in neither bound).
``extra_link_bound_seconds`` is the difference between the two, the part of
``extra_seconds`` that no schedule can avoid; the rest is detection (the
stall limit) and re-fetching.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from pathlib import Path

DESCRIPTION = "a move to new hosts on emulated links with a source or a destination cut off mid-transfer"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--link-mbit", type=float, default=800, help="rate of every host's link (default 800)")
    parser.add_argument("--layers", type=int, default=2, help="GPT layers (default 2: 0.8 GB per replica)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=20480)
    parser.add_argument("--cut-after", type=float, default=1.5,
                        help="seconds after the source's first bytes left (default 1.5)")
    parser.add_argument("--dir", type=Path, help="directory for the stores (default: /dev/shm)")


def run(args: argparse.Namespace) -> list[dict]:
    from ..gpt import gpt
    from ..parallel import ParallelConfig
    from ..planner import plan
    from ..ptc import layout
    from ..cluster import EmulatedCluster
    from .linked import LinkedStores
    from .reconfig import _write_base

    model = gpt(args.layers, args.hidden, 16, args.vocab, optimizer="adam")
    old = layout(model, ParallelConfig(2, 2, 1, ("h0/0", "h0/1", "h1/0", "h1/1")))
    new = layout(model, ParallelConfig(2, 2, 1, ("h2/0", "h2/1", "h3/0", "h3/1")))
    the_plan = plan(old, new)
    base_dir = args.dir or (Path("/dev/shm") if Path("/dev/shm").is_dir() else None)
    hosts = ["h0", "h1", "h2", "h3"]
    with tempfile.TemporaryDirectory(prefix="tenplex-partition-", dir=base_dir) as tmp_name, \
            EmulatedCluster(hosts, mbit=args.link_mbit) as cluster:
        tmp = Path(tmp_name)
        _write_base(tmp, old)
        stores = LinkedStores(cluster, {h: tmp / h for h in hosts}, tmp / "work")
        results = [_run_fault(args, stores, tmp, the_plan, old, new, fault, cut)
                   for fault, cut in (("none", None), ("source h0 cut", "h0"), ("destination h3 cut", "h3"))]
    for row in results:
        row["extra_seconds"] = round(row["seconds"] - results[0]["seconds"], 3)
        bound = row["link_bound_seconds"]
        row["extra_link_bound_seconds"] = None if bound is None else round(bound - results[0]["link_bound_seconds"], 3)
    return results


def _run_fault(args: argparse.Namespace, stores, tmp: Path, the_plan, old, new, fault: str, cut: str | None) -> dict:
    """One transformation, with host ``cut``'s link cut ``args.cut_after`` seconds into it (and healed after);
    its row, version 2 deleted again."""
    from ..errors import TransformError
    from ..store import Store

    cluster = stores.cluster
    outcome: dict = {}

    def transform() -> None:
        try:
            outcome["report"] = stores.transform(the_plan, old, new, 1, 2)
        except TransformError as e:
            outcome["error"] = e

    thread = threading.Thread(target=transform)
    before = cluster.counters()
    start = time.monotonic()
    thread.start()
    cut_at = sent_at_cut = None
    if cut is not None:
        cut_at, sent_at_cut = _cut_into_transfer(cluster, cut, before, start, args.cut_after, thread)
    thread.join()
    seconds = time.monotonic() - start
    if cut is not None:
        cluster.heal(cut)
    hosts = sorted(stores.roots)
    report = outcome.get("report")
    row = {"fault": fault, "seconds": round(seconds, 3), "succeeded": report is not None,
           "committed_on": [h for h in hosts if 2 in Store(tmp / h, h).versions()],
           "old_version_intact": all(1 in Store(tmp / h, h).versions() for h in old.hosts()),
           "refetched_bytes": sum(h["refetched_bytes"] for h in report["hosts"].values()) if report else 0,
           "error": str(outcome["error"]).splitlines()[0] if "error" in outcome else None,
           "link_mbit": args.link_mbit, "inter_host_bytes": the_plan.stats.inter_host_bytes,
           "cut_after_seconds": args.cut_after if cut else None,
           "cut_into_transfer_seconds": None if cut_at is None else round(cut_at, 3),
           "link_bound_seconds": _round(_link_bound(the_plan, args.link_mbit, cut, cut_at, sent_at_cut)),
           "load_average": [round(x, 2) for x in os.getloadavg()]}
    for h in new.hosts():
        Store(tmp / h, h).delete(2)
    return row


def _cut_into_transfer(cluster, host: str, before, start: float, after: float, thread: threading.Thread):
    """Cut ``host``'s link ``after`` seconds after h0 (the source) sent its first MiB; returns (seconds from
    then to the cut, bytes h0 and h1 had sent by the cut)."""
    while thread.is_alive() and (cluster.counters() - before)["h0"].out < (1 << 20):
        time.sleep(0.02)
    first_bytes = time.monotonic()
    thread.join(after)
    moved = cluster.counters() - before
    cluster.cut(host)
    return time.monotonic() - first_bytes, moved["h0"].out + moved["h1"].out


def _link_bound(the_plan, mbit: float, cut: str | None, cut_at: float | None, sent: int | None) -> float | None:
    """The shortest transfer the links allow (see the module docstring); None for a cut destination (the
    transformation must fail)."""
    rate = mbit * 1e6 / 8
    if cut is None:
        return the_plan.stats.max_host_send_bytes / rate
    if cut != "h0":
        return None
    assert cut_at is not None and sent is not None
    return cut_at + max(0, the_plan.stats.inter_host_bytes - sent) / rate


def _round(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 3)
