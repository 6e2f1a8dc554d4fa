"""``tenplex bench reconfig``: wall time of full state transformations of a GPT model (>= 2 GB fp32 with Adam).

May import: every tenplex layer, numpy and the standard library.

One ``tenplex store serve`` process per simulated host. Version 1 holds the
model under dp=2, tp=2, pp=2 on 2 hosts x 4 devices (parameters and both Adam
states, fp32, random values; data-parallel replicas identical). Each change
plans with ``tenplex.planner.plan`` and runs ``tenplex.transform.transform``
(two-phase, committed) to version 2, which is then deleted again.

Per change it prints the measured seconds and the bytes the stores actually
moved in each category (linked = kept without copying), next to the plan's
statistics. Baselines from the same run: the time ``memcpy`` would need for
the target bytes, the time one raw TCP socket would need for the inter-host
bytes, and ``raw_socket_file_gbps``: one TCP socket from a file into a fresh,
fsynced file on the stores' filesystem (``bench transfer``'s baseline), the
physical limit of moving a shard between hosts into a new version. Next to
it, per change, ``inter_host_gbps`` (inter-host bytes / seconds) and their
ratio ``inter_host_vs_file_ratio``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import zlib
from pathlib import Path

import numpy as np

DESCRIPTION = "full state transformations of a >= 2 GB GPT+Adam model across store processes (dp, tp, pp, hosts)"

BASE = ("dp=2,tp=2,pp=2 on 2 hosts x 4 devices", 2, 2, 2, 2, 4)
CHANGES = [
    # (name, dp, tp, pp, hosts, devices per host)
    ("dp 2->1 (2 hosts x 2 devices)", 1, 2, 2, 2, 2),
    ("tp 2->4, pp 2->1", 2, 4, 1, 2, 4),
    ("pp 2->4, tp 2->1", 2, 1, 4, 2, 4),
    ("hosts 2->4 (4 hosts x 2 devices)", 2, 2, 2, 4, 2),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=10, help="GPT layers (default 10: 2.1 GB with Adam)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--streams", type=int, default=4, help="concurrent pulls per destination host")
    parser.add_argument("--dir", type=Path, help="directory for the stores (default: tmpfs if it has room)")


def run(args: argparse.Namespace) -> list[dict]:
    from ..gpt import gpt
    from ..parallel import ParallelConfig
    from ..planner import plan
    from ..ptc import layout
    from ..store import Store
    from ..transform import transform
    from .transfer import _memcpy_seconds, _socket_seconds, _start_server, socket_file_seconds

    model = gpt(args.layers, args.hidden, args.heads, args.vocab, optimizer="adam")

    def make(dp, tp, pp, hosts, per_host):
        devices = tuple(f"h{h}/{i}" for h in range(hosts) for i in range(per_host))
        return layout(model, ParallelConfig(dp, tp, pp, devices))

    old = make(*BASE[1:])
    state_bytes = old.total_bytes()
    hosts = sorted({f"h{h}" for _, _, _, _, n, _ in CHANGES for h in range(n)} | set(old.hosts()))
    memcpy_gbps = (256 << 20) / _memcpy_seconds(256 << 20) / 1e9
    socket_gbps = (512 << 20) / _socket_seconds(512 << 20) / 1e9
    base_dir = args.dir or _default_dir(3 * 2 * state_bytes)
    results = []
    with tempfile.TemporaryDirectory(prefix="tenplex-reconfig-", dir=base_dir) as tmp:
        tmp = Path(tmp)
        file_gbps = (512 << 20) / socket_file_seconds(tmp, 512 << 20) / 1e9
        _write_base(tmp, old)
        servers = {}
        try:
            for h in hosts:
                servers[h] = _start_server(tmp, h)
            stores = {h: address for h, (_, address) in servers.items()}
            for name, *config in CHANGES:
                new = make(*config)
                the_plan = plan(old, new)
                report = transform(the_plan, old, new, stores, 1, 2, streams=args.streams)
                moved = report["hosts"]
                stats = the_plan.stats
                results.append({
                    "change": name, "from": BASE[0], "seconds": round(report["seconds"], 3),
                    "state_bytes": state_bytes, "target_bytes": stats.target_bytes,
                    "kept_bytes": stats.kept_bytes, "intra_host_bytes": stats.intra_host_bytes,
                    "inter_host_bytes": stats.inter_host_bytes,
                    "inter_host_lower_bound": stats.inter_host_lower_bound,
                    "max_host_send_bytes": stats.max_host_send_bytes, "max_host_recv_bytes": stats.max_host_recv_bytes,
                    "measured_linked_bytes": sum(h["linked_bytes"] for h in moved.values()),
                    "measured_kept_copied_bytes": sum(h["kept_bytes"] for h in moved.values()),
                    "measured_intra_host_bytes": sum(h["local_bytes"] for h in moved.values()),
                    "measured_inter_host_bytes": sum(h["remote_bytes"] for h in moved.values()),
                    "transfers": len(the_plan.transfers),
                    "target_gbps": round(stats.target_bytes / report["seconds"] / 1e9, 3),
                    "inter_host_gbps": round(stats.inter_host_bytes / report["seconds"] / 1e9, 3),
                    "raw_socket_file_gbps": round(file_gbps, 3),
                    "inter_host_vs_file_ratio": round(stats.inter_host_bytes / report["seconds"] / 1e9 / file_gbps, 3),
                    "baseline_memcpy_seconds": round(stats.target_bytes / memcpy_gbps / 1e9, 3),
                    "baseline_raw_socket_seconds": round(stats.inter_host_bytes / socket_gbps / 1e9, 3),
                    "streams": args.streams, "store_dir": str(base_dir), "cpus": os.cpu_count(),
                })
                for h in new.hosts():
                    Store(tmp / h, h).delete(2)
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait()
    return results


def _default_dir(needed: int) -> Path | None:
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > needed:
        return shm
    return None


def _write_base(tmp: Path, old) -> None:
    """Version 1 on every old host; a (tensor, box) gets the same random values on every replica."""
    from ..devices import host_of
    from ..store import Store

    for host in old.hosts():
        with Store(tmp / host, host).begin(1) as w:
            for device, shards in sorted(old.devices.items()):
                if host_of(device) != host:
                    continue
                for shard in shards:
                    spec = old.tensors[shard.tensor]
                    seed = zlib.crc32(f"{shard.tensor}{shard.box}".encode())
                    values = np.random.default_rng(seed).random(shard.box.lengths, dtype=np.float32)
                    w.put(device, shard.tensor, shard.box, values, spec.dtype, shape=spec.shape)
            w.put_json("step", {"step": 1000})
            w.commit()
