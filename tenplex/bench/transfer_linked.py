"""``tenplex bench transfer --link-mbit N``: the one-region transfer between two hosts with links of their own.

May import: every tenplex layer, numpy and the standard library.

Hosts h0 (source) and h1 (destination) each sit behind an N Mbit/s link
(``tenplex.cluster``); their stores bind the hosts' private addresses
(with a token) and the coordinator runs in the control host. Per run: the
seconds, what crossed the links by the kernel's counters, the link-bound
time and ``link_efficiency`` (``tenplex.bench.linked.link_fields``). The
same-run baseline ``raw_socket_link_gbps`` sends the same bytes through one
plain TCP socket from h0 to h1 over the same links.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

ROW = 1 << 20

_RECEIVER = """
import socket, sys, time
n = int(sys.argv[2])
srv = socket.create_server((sys.argv[1], 0))
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
buf = bytearray(4 << 20)
got = conn.recv_into(buf)
start = time.perf_counter()
first = got
while got < n:
    k = conn.recv_into(buf)
    if not k:
        sys.exit(f"sender stopped after {got} of {n} bytes")
    got += k
print((time.perf_counter() - start) * n / max(1, n - first), flush=True)
"""
_SENDER = """
import socket, sys
n = int(sys.argv[3])
s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
block = bytes(4 << 20)
while n:
    k = min(n, len(block))
    s.sendall(memoryview(block)[:k])
    n -= k
s.close()
"""


def run(args: argparse.Namespace) -> dict:
    from ..box import Box
    from ..layout import Layout, Shard, TensorSpec
    from ..store import Store
    from ..transfer_plan import Plan, PlanStats, Transfer
    from ..cluster import EmulatedCluster
    from .linked import LinkedStores, measured_transform

    rows = max(1, args.bytes // ROW)
    nbytes = rows * ROW
    shape = (rows, ROW // 4)
    whole = Box.whole(shape)
    spec = {"x": TensorSpec(shape, "float32")}
    old = Layout.build(spec, {"h0/0": [Shard("x", whole)]})
    new = Layout.build(spec, {"h1/0": [Shard("x", whole)]})
    plan = Plan((Transfer("x", "h0/0", "h1/0", "old", whole),),
                PlanStats(target_bytes=nbytes, inter_host_bytes=nbytes, inter_host_lower_bound=nbytes))
    base_dir = args.dir or (Path("/dev/shm") if Path("/dev/shm").is_dir() else None)
    runs, raw = [], []
    with tempfile.TemporaryDirectory(prefix="tenplex-bench-", dir=base_dir) as tmp_name, \
            EmulatedCluster(["h0", "h1"], mbit=args.link_mbit) as cluster:
        tmp = Path(tmp_name)
        with Store(tmp / "h0", "h0").begin(1) as w:
            w.put("h0/0", "x", whole, np.random.default_rng(0).random(shape, dtype=np.float32), "float32",
                  shape=shape)
            w.commit()
        stores = LinkedStores(cluster, {"h0": tmp / "h0", "h1": tmp / "h1"}, tmp / "work")
        for version in range(2, 2 + args.repeat):
            report, links = measured_transform(stores, plan, old, new, 1, version, streams=args.streams)
            runs.append({"seconds": report["seconds"], **links})
            Store(tmp / "h1", "h1").delete(version)
            raw.append(_raw_seconds(cluster, nbytes))
    middle = sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]
    return {"bytes": nbytes, "link_mbit": args.link_mbit, "streams": args.streams, "repeat": args.repeat,
            "tenplex_gbps": round(nbytes / middle["seconds"] / 1e9, 3),
            "raw_socket_link_gbps": round(nbytes / statistics.median(raw) / 1e9, 3),
            "tenplex_vs_raw_link": round(statistics.median(raw) / middle["seconds"], 3),
            "tenplex_seconds": [round(r["seconds"], 3) for r in runs],
            "link_efficiency": middle["link_efficiency"], "link_efficiencies": [r["link_efficiency"] for r in runs],
            **{k: middle[k] for k in ("inter_host_wire_bytes", "wire_vs_lower_bound", "link_bound_seconds",
                                      "host_bytes_out", "host_bytes_in")},
            "inter_host_lower_bound": nbytes, "cpus": os.cpu_count(),
            "load_average": [round(x, 2) for x in os.getloadavg()]}


def _raw_seconds(cluster, nbytes: int) -> float:
    """One plain TCP stream of nbytes from h0 to h1 over the emulated links, timed by the receiver."""
    import subprocess

    receiver = cluster.popen("h1", [sys.executable, "-c", _RECEIVER, cluster.address("h1"), str(nbytes)],
                             stdout=subprocess.PIPE, text=True)
    port = receiver.stdout.readline().strip()
    cluster.run("h0", [sys.executable, "-c", _SENDER, cluster.address("h1"), port, str(nbytes)], check=True)
    seconds = float(receiver.stdout.readline())
    receiver.wait()
    return seconds
