"""``tenplex bench reconfig``: wall time of full state transformations of a GPT model (>= 2 GB fp32 with Adam).

May import: every tenplex layer, numpy and the standard library.

One ``tenplex store serve`` process per simulated host. Version 1 holds the
model under dp=2, tp=2, pp=2 on 2 hosts x 4 devices (parameters and both Adam
states, fp32, random values; data-parallel replicas identical). Each change
plans with ``tenplex.planner.plan`` and runs ``tenplex.transform.transform``
(two-phase, committed) to version 2, which is then deleted again.

Per change it prints the measured seconds and the bytes the stores actually
moved in each category (linked = without copying a byte: whole old files,
and slices of them, ``measured_sliced_bytes``), next to the plan's
statistics. Baselines from the same run: the time ``memcpy`` would need for
the target bytes, the time one raw TCP socket would need for the inter-host
bytes, and ``raw_socket_file_gbps``: one TCP socket from a file into a fresh,
fsynced file on the stores' filesystem (``bench transfer``'s baseline), the
physical limit of moving a shard between hosts into a new version. Next to
it, per change, ``inter_host_gbps`` (inter-host bytes / seconds) and their
ratio ``inter_host_vs_file_ratio``.

With ``--link-mbit N`` every host's store runs inside an emulated cluster
(``tenplex.cluster``: a network namespace per host, N Mbit/s each way
per host link) and the coordinator in its control host. Each change then also
reports what crossed the links by the kernel's counters
(``inter_host_wire_bytes``, ``wire_vs_lower_bound``, bytes per host), the
link-bound time and ``link_efficiency`` (``tenplex.bench.linked``). Without
root and iproute2 it refuses rather than measuring loopback.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
import zlib
from pathlib import Path

import numpy as np

from .warm import add_warm_argument, warm

DESCRIPTION = "full state transformations of a >= 2 GB GPT+Adam model across store processes (dp, tp, pp, hosts)"

BASE = ("dp=2,tp=2,pp=2 on 2 hosts x 4 devices", 2, 2, 2, 2, 4)
CHANGES = [
    # (name, dp, tp, pp, hosts, devices per host)
    ("dp 2->1 (2 hosts x 2 devices)", 1, 2, 2, 2, 2),
    ("tp 2->4, pp 2->1", 2, 4, 1, 2, 4),
    ("pp 2->4, tp 2->1", 2, 1, 4, 2, 4),
    ("hosts 2->4 (4 hosts x 2 devices)", 2, 2, 2, 4, 2),
    ("move to new hosts h2,h3 (same config)", 2, 2, 2, 2, 4, 2),  # last field: index of the first host
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=10, help="GPT layers (default 10: 2.1 GB with Adam)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--streams", type=int, default=None,
                        help="concurrent pulls per destination host (default: each store's own, one per CPU, 2 to 4)")
    parser.add_argument("--dir", type=Path, help="directory for the stores (default: tmpfs if it has room)")
    add_warm_argument(parser)
    parser.add_argument("--link-mbit", type=float,
                        help="run each host's store behind its own link of this many Mbit/s each way (emulated "
                             "cluster; needs root and iproute2) and report wire bytes and link efficiency")


def run(args: argparse.Namespace) -> list[dict]:
    from ..gpt import gpt
    from ..parallel import ParallelConfig
    from ..planner import plan
    from ..ptc import layout
    from ..store import Store
    from ..transform.host import default_streams
    from .transfer import _memcpy_seconds, _socket_seconds, socket_file_seconds

    model = gpt(args.layers, args.hidden, args.heads, args.vocab, optimizer="adam")

    def make(dp, tp, pp, hosts, per_host, first_host=0):
        devices = tuple(f"h{h}/{i}" for h in range(first_host, first_host + hosts) for i in range(per_host))
        return layout(model, ParallelConfig(dp, tp, pp, devices))

    old = make(*BASE[1:])
    hosts = sorted({h for _, *config in CHANGES for h in make(*config).hosts()} | set(old.hosts()))
    baselines = {"memcpy_gbps": (256 << 20) / _memcpy_seconds(256 << 20) / 1e9,
                 "socket_gbps": (512 << 20) / _socket_seconds(512 << 20) / 1e9}
    base_dir = args.dir or _default_dir(3 * 2 * old.total_bytes())
    results = []
    with tempfile.TemporaryDirectory(prefix="tenplex-reconfig-", dir=base_dir) as tmp_name:
        tmp = Path(tmp_name)
        warm(args.warm_gb)  # the baseline writes a fresh file too: the same memory conditions as each change
        baselines["file_gbps"] = (512 << 20) / socket_file_seconds(tmp, 512 << 20) / 1e9
        _write_base(tmp, old)
        with contextlib.ExitStack() as stack:
            run_change = _change_runner(stack, args, tmp, hosts, old)
            for name, *config in CHANGES:
                new = make(*config)
                the_plan = plan(old, new)
                warm(args.warm_gb)
                report, links = run_change(the_plan, new)
                results.append({**_row(str(name), old, the_plan, report, baselines),
                                "streams": args.streams or default_streams(),
                                "store_dir": str(base_dir), "cpus": os.cpu_count(),
                                "load_average": [round(x, 2) for x in os.getloadavg()], **links})
                for h in new.hosts():
                    Store(tmp / h, h).delete(2)
    return results


def _change_runner(stack: contextlib.ExitStack, args: argparse.Namespace, tmp: Path, hosts: list[str], old):
    """``run_change(plan, new) -> (report, link measurements)``: version 1 -> 2 across store processes, one per
    host (behind emulated links with ``--link-mbit``); they stop when ``stack`` closes."""
    from ..transform import transform
    from ..cluster import EmulatedCluster
    from .linked import LinkedStores, measured_transform
    from .transfer import _start_server

    if args.link_mbit:  # refuses (ClusterUnavailable) rather than measuring loopback
        cluster = stack.enter_context(EmulatedCluster(hosts, mbit=args.link_mbit))
        linked = LinkedStores(cluster, {h: tmp / h for h in hosts}, tmp / "work")
        return lambda the_plan, new: measured_transform(linked, the_plan, old, new, 1, 2, streams=args.streams)
    servers: dict = {}
    stack.callback(_stop, servers)
    for h in hosts:
        servers[h] = _start_server(tmp, h)
    stores = {h: address for h, (_, address) in servers.items()}
    return lambda the_plan, new: (transform(the_plan, old, new, stores, 1, 2, streams=args.streams), {})


def _row(name: str, old, the_plan, report: dict, baselines: dict[str, float]) -> dict:
    """One change's measurements next to its plan's statistics and the same run's baselines."""
    moved = report["hosts"]
    stats = the_plan.stats
    file_gbps = baselines["file_gbps"]
    return {
        "change": name, "from": BASE[0], "seconds": round(report["seconds"], 3),
        "state_bytes": old.total_bytes(), "target_bytes": stats.target_bytes,
        "kept_bytes": stats.kept_bytes, "intra_host_bytes": stats.intra_host_bytes,
        "inter_host_bytes": stats.inter_host_bytes,
        "inter_host_lower_bound": stats.inter_host_lower_bound,
        "max_host_send_bytes": stats.max_host_send_bytes, "max_host_recv_bytes": stats.max_host_recv_bytes,
        "measured_linked_bytes": sum(h["linked_bytes"] for h in moved.values()),
        "measured_sliced_bytes": sum(h["sliced_bytes"] for h in moved.values()),
        "measured_kept_copied_bytes": sum(h["kept_bytes"] for h in moved.values()),
        "measured_intra_host_bytes": sum(h["local_bytes"] for h in moved.values()),
        "measured_inter_host_bytes": sum(h["remote_bytes"] for h in moved.values()),
        "transfers": len(the_plan.transfers),
        "target_gbps": round(stats.target_bytes / report["seconds"] / 1e9, 3),
        "inter_host_gbps": round(stats.inter_host_bytes / report["seconds"] / 1e9, 3),
        "raw_socket_file_gbps": round(file_gbps, 3),
        "inter_host_vs_file_ratio": round(stats.inter_host_bytes / report["seconds"] / 1e9 / file_gbps, 3),
        "baseline_memcpy_seconds": round(stats.target_bytes / baselines["memcpy_gbps"] / 1e9, 3),
        "baseline_raw_socket_seconds": round(stats.inter_host_bytes / baselines["socket_gbps"] / 1e9, 3),
    }


def _stop(servers: dict) -> None:
    for proc, _ in servers.values():
        proc.terminate()
        proc.wait()


def _default_dir(needed: int) -> Path | None:
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > needed:
        return shm
    return None


def _write_base(tmp: Path, old) -> None:
    """Version 1 on every old host; a (tensor, box) gets the same random values on every replica."""
    from ..store import Store, fill

    def values(tensor, box):
        return np.random.default_rng(zlib.crc32(f"{tensor}{box}".encode())).random(box.lengths, dtype=np.float32)

    fill.write_version({h: Store(tmp / h, h) for h in old.hosts()}, old, 1, values, {"step": {"step": 1000}})
