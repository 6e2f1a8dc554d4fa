"""``tenplex bench transfer``: moving one large region between two store processes on loopback.

May import: every tenplex layer, numpy and the standard library.

Numbers from the same run and machine:

* ``tenplex_gbps``: a one-transfer plan (device h0/0 -> h1/0) executed by
  ``tenplex.transform`` between two ``tenplex store serve`` processes: the
  destination store pulls with ``--streams`` concurrent gRPC streams into its
  new shard file and the version is committed. Median of ``--repeat`` runs,
  timed end to end (RPC set-up, fsync, checksum, prepare and commit included).
* ``raw_socket_gbps``: the same number of bytes through one plain TCP socket
  between two processes (sendall / recv_into a preallocated, touched buffer).
* ``memcpy_gbps``: ``numpy.copyto`` of the same number of bytes in one process.
* Context: ``tenplex_pull_gbps`` pulls the region from the source store
  into touched memory with the same number of streams (transport only, like
  the raw socket), and ``fresh_file_write_gbps`` writes the bytes into a new
  file on the stores' filesystem (the page allocation every new version pays).
Stores live on tmpfs (/dev/shm) when it exists, so the disk is not measured.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ..store.wire import DEFAULT_CHUNK_BYTES

DESCRIPTION = "throughput of moving one large region between two store processes vs raw TCP and memcpy"
ROW = 1 << 20  # bytes per row of the benchmark tensor


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bytes", type=int, default=1 << 30, help="region size in bytes (default 1 GiB)")
    parser.add_argument("--streams", type=int, default=4, help="concurrent pulls (default 4)")
    parser.add_argument("--chunk-bytes", type=int, default=0, help="gRPC chunk payload (default: the store's)")
    parser.add_argument("--repeat", type=int, default=3, help="tenplex and socket runs; the median is reported")
    parser.add_argument("--dir", type=Path, help="directory for the two stores (default: a tmpfs directory)")


def run(args: argparse.Namespace) -> dict:
    from ..layout import Layout, Shard, TensorSpec
    from ..box import Box
    from ..plan import Plan, PlanStats, Transfer
    from ..store import Store
    from ..transform import transform

    rows = max(1, args.bytes // ROW)
    nbytes = rows * ROW
    shape = (rows, ROW // 4)
    spec = {"x": TensorSpec(shape, "float32")}
    whole = Box.whole(shape)
    old = Layout.build(spec, {"h0/0": [Shard("x", whole)]})
    new = Layout.build(spec, {"h1/0": [Shard("x", whole)]})
    plan = Plan((Transfer("x", "h0/0", "h1/0", "old", whole),),
                PlanStats(target_bytes=nbytes, inter_host_bytes=nbytes, inter_host_lower_bound=nbytes))
    base_dir = args.dir or (Path("/dev/shm") if Path("/dev/shm").is_dir() else None)
    with tempfile.TemporaryDirectory(prefix="tenplex-bench-", dir=base_dir) as tmp:
        tmp = Path(tmp)
        data = np.random.default_rng(0).random(shape, dtype=np.float32)
        with Store(tmp / "h0", "h0").begin(1) as w:
            w.put("h0/0", "x", whole, data, "float32", shape=shape)
            w.commit()
        del data
        servers = [_start_server(tmp, h) for h in ("h0", "h1")]
        try:
            stores = {h: address for h, (_, address) in zip(("h0", "h1"), servers)}
            seconds, pull_seconds = [], []
            for i in range(args.repeat):
                report = transform(plan, old, new, stores, 1, 2 + i, streams=args.streams,
                                   chunk_bytes=args.chunk_bytes)
                seconds.append(report["seconds"])
                Store(tmp / "h1", "h1").delete(2 + i)
                pull_seconds.append(_pull_seconds(stores["h0"], shape, args.streams, args.chunk_bytes))
        finally:
            for proc, _ in servers:
                proc.terminate()
                proc.wait()
        fresh_write = _fresh_file_seconds(tmp, nbytes)
    tenplex_gbps = nbytes / statistics.median(seconds) / 1e9
    raw = statistics.median(_socket_seconds(nbytes) for _ in range(args.repeat))
    raw_gbps = nbytes / raw / 1e9
    return {"bytes": nbytes, "tenplex_gbps": round(tenplex_gbps, 3), "raw_socket_gbps": round(raw_gbps, 3),
            "memcpy_gbps": round(nbytes / _memcpy_seconds(nbytes) / 1e9, 3),
            "tenplex_vs_raw": round(tenplex_gbps / raw_gbps, 3),
            "tenplex_pull_gbps": round(nbytes / statistics.median(pull_seconds) / 1e9, 3),
            "fresh_file_write_gbps": round(nbytes / fresh_write / 1e9, 3),
            "streams": args.streams, "chunk_bytes": args.chunk_bytes or DEFAULT_CHUNK_BYTES, "repeat": args.repeat,
            "tenplex_seconds": [round(s, 4) for s in seconds], "cpus": os.cpu_count(),
            "load_average": [round(x, 2) for x in os.getloadavg()],
            "store_dir": str(base_dir or tempfile.gettempdir())}


def _pull_seconds(address: str, shape: tuple[int, int], streams: int, chunk_bytes: int) -> float:
    """Pull the whole region into touched memory with ``streams`` concurrent streams (transport only)."""
    from concurrent.futures import ThreadPoolExecutor

    from ..box import Box
    from ..store.client import StoreClient

    out = np.ones(shape, dtype=np.float32)  # touched, like the raw socket's buffer
    clients = [StoreClient(address, chunk_bytes=chunk_bytes or DEFAULT_CHUNK_BYTES, own_connection=True)
               for _ in range(streams)]
    rows = -(-shape[0] // streams)
    pieces = [Box((r, 0), (min(rows, shape[0] - r), shape[1])) for r in range(0, shape[0], rows)]
    try:
        for client in clients:
            client.wait_ready()
        start = time.perf_counter()
        with ThreadPoolExecutor(streams) as pool:
            list(pool.map(lambda cp: cp[0].read_box_into(1, "h0/0", "x", cp[1], out[cp[1].slices()]),
                          zip(clients, pieces)))
        return time.perf_counter() - start
    finally:
        for client in clients:
            client.close()


def _fresh_file_seconds(tmp: Path, nbytes: int) -> float:
    """Time to write nbytes into a new file in ``tmp`` (allocating its pages), fsync included."""
    block = np.ones(8 << 20, dtype=np.uint8)
    path = tmp / "fresh.bin"
    start = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left:
            left -= f.write(memoryview(block)[:min(left, block.nbytes)])
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return seconds


def _start_server(tmp: Path, host: str) -> tuple[subprocess.Popen, str]:
    port_file = tmp / f"{host}.port"
    proc = subprocess.Popen([sys.executable, "-m", "tenplex.cli.store", "serve", "--root", str(tmp / host),
                             "--host", host, "--port", "0", "--port-file", str(port_file)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"store server {host} did not start (exit {proc.poll()})")
        time.sleep(0.05)
    return proc, f"127.0.0.1:{int(port_file.read_text())}"


_SENDER = """
import socket, sys
n, port = int(sys.argv[1]), int(sys.argv[2])
buf = bytes(bytearray(4 << 20))
s = socket.create_connection(("127.0.0.1", port))
left = n
while left:
    k = min(left, len(buf))
    s.sendall(memoryview(buf)[:k])
    left -= k
s.close()
"""


def _socket_seconds(nbytes: int) -> float:
    """Wall time of nbytes through one TCP connection between two processes (receiver: this process)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    target = bytearray(nbytes)
    view = memoryview(target)
    sender = subprocess.Popen([sys.executable, "-c", _SENDER, str(nbytes), str(port)])
    conn, _ = listener.accept()
    got = conn.recv_into(view, min(nbytes, 4 << 20))
    start = time.perf_counter()  # from the first byte, so process start-up is not measured
    while got < nbytes:
        n = conn.recv_into(view[got:], min(nbytes - got, 4 << 20))
        if n == 0:
            raise RuntimeError(f"raw socket sender stopped after {got} of {nbytes} bytes")
        got += n
    seconds = time.perf_counter() - start
    conn.close()
    listener.close()
    sender.wait()
    return seconds * nbytes / max(1, nbytes - min(nbytes, 4 << 20))


def _memcpy_seconds(nbytes: int) -> float:
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # touch the pages first
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return best
