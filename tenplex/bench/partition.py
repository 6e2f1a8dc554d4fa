"""``tenplex bench partition --link-mbit N``: a move to new hosts with a source or a destination cut off mid-way.

May import: every tenplex layer, numpy and the standard library.

A GPT state with Adam moments under dp=2, tp=2 (one full replica on each of
h0 and h1) moves to h2 and h3, on hosts with links of their own
(``tenplex.bench.cluster``). Three runs: without a fault; with the link of the
source h0 cut ``--cut-after`` seconds in (h1's replica must take over); with the
link of the destination h3 cut as well (the transformation must fail cleanly:
nothing committed anywhere, the old version intact). After each cut the link
is healed. Per run: ``seconds`` (until the transformation returned or failed),
``extra_seconds`` over the run without a fault, ``refetched_bytes`` (bytes
read from a replica after their source failed), whether version 2 was
committed on any host, and the error's first line.
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
    parser.add_argument("--layers", type=int, default=2, help="GPT layers (default 2: about 0.9 GB per replica)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--cut-after", type=float, default=1.5, help="seconds into the transfer (default 1.5)")
    parser.add_argument("--dir", type=Path, help="directory for the stores (default: /dev/shm)")


def run(args: argparse.Namespace) -> list[dict]:
    from ..errors import TransformError
    from ..gpt import gpt
    from ..parallel import ParallelConfig
    from ..planner import plan
    from ..ptc import layout
    from ..store import Store
    from .cluster import EmulatedCluster
    from .linked import LinkedStores
    from .reconfig import _write_base

    model = gpt(args.layers, args.hidden, 16, args.vocab, optimizer="adam")
    old = layout(model, ParallelConfig(2, 2, 1, ("h0/0", "h0/1", "h1/0", "h1/1")))
    new = layout(model, ParallelConfig(2, 2, 1, ("h2/0", "h2/1", "h3/0", "h3/1")))
    the_plan = plan(old, new)
    base_dir = args.dir or (Path("/dev/shm") if Path("/dev/shm").is_dir() else None)
    hosts = ["h0", "h1", "h2", "h3"]
    results = []
    with tempfile.TemporaryDirectory(prefix="tenplex-partition-", dir=base_dir) as tmp_name, \
            EmulatedCluster(hosts, mbit=args.link_mbit) as cluster:
        tmp = Path(tmp_name)
        _write_base(tmp, old)
        stores = LinkedStores(cluster, {h: tmp / h for h in hosts}, tmp / "work")
        for fault, cut in (("none", None), ("source h0 cut", "h0"), ("destination h3 cut", "h3")):
            outcome: dict = {}

            def transform(outcome: dict = outcome) -> None:
                try:
                    outcome["report"] = stores.transform(the_plan, old, new, 1, 2)
                except TransformError as e:
                    outcome["error"] = e

            thread = threading.Thread(target=transform)
            start = time.monotonic()
            thread.start()
            if cut is not None:
                thread.join(args.cut_after)
                cluster.cut(cut)
            thread.join()
            seconds = time.monotonic() - start
            if cut is not None:
                cluster.heal(cut)
            committed = [h for h in hosts if 2 in Store(tmp / h, h).versions()]
            report = outcome.get("report")
            results.append({
                "fault": fault, "seconds": round(seconds, 3), "succeeded": report is not None,
                "committed_on": committed,
                "old_version_intact": all(1 in Store(tmp / h, h).versions() for h in old.hosts()),
                "refetched_bytes": sum(h["refetched_bytes"] for h in report["hosts"].values()) if report else 0,
                "error": str(outcome["error"]).splitlines()[0] if "error" in outcome else None,
                "link_mbit": args.link_mbit, "inter_host_bytes": the_plan.stats.inter_host_bytes,
                "cut_after_seconds": args.cut_after if cut else None,
                "load_average": [round(x, 2) for x in os.getloadavg()]})
            for h in new.hosts():
                Store(tmp / h, h).delete(2)
    for row in results:
        row["extra_seconds"] = round(row["seconds"] - results[0]["seconds"], 3)
    return results
