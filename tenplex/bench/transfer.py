"""``tenplex bench transfer``: moving one large region between two store processes on loopback.

May import: every tenplex layer, numpy and the standard library.

Numbers from the same run and machine:

* ``tenplex_gbps``: a one-transfer plan (device h0/0 -> h1/0) executed by
  ``tenplex.transform`` between two ``tenplex store serve`` processes: the
  destination store pulls with ``--streams`` concurrent connections into its
  new shard file and the version is committed. Median of ``--repeat`` runs,
  timed end to end (RPC set-up, fsync, checksum, prepare and commit included).
  ``path`` says how the bytes travelled: ``dataplane`` (the store's plain-TCP
  bulk data plane, ``tenplex.store.dataplane``) when the source advertises it.
* ``grpc_gbps``: the same with the source serving ``--no-data-plane``, so
  every byte goes through gRPC ReadBox streams (the path TLS stores use).
  Runs alternate with the data-plane runs so both see the same machine load.
* ``raw_socket_gbps``: the same number of bytes through one plain TCP socket
  between two processes (sendall / recv_into a preallocated, touched buffer).
* ``raw_socket_file_gbps``: the physical limit of the same work. A plain TCP
  sender ``sendfile``s a source file of the same size (on the stores'
  filesystem) into one socket; the receiver writes what arrives into a fresh
  file on that filesystem and fsyncs it, as a store's new shard is written.
  ``tenplex_vs_file_ratio`` is ``tenplex_gbps`` over it (medians).
* ``memcpy_gbps``: ``numpy.copyto`` of the same number of bytes in one process.
* ``*_best_gbps``: the best of the ``--repeat`` runs (machines shared with other
  work are noisy; compare best with best and median with median).
* Context: ``tenplex_pull_gbps`` / ``grpc_pull_gbps`` pull the region from the
  source store into touched memory with the same number of streams (transport
  only, like the raw socket), and ``fresh_file_write_gbps`` writes the bytes
  into a new file on the stores' filesystem (the page allocation every new
  version pays, which the raw socket does not).
Stores live on tmpfs (/dev/shm) when it exists, so the disk is not measured.
With ``--link-mbit N`` the two stores sit on hosts with links of their own
instead (``tenplex.bench.transfer_linked``).
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

from ..runtime.hosts import await_store, spawn_store
from ..store.wire import DEFAULT_CHUNK_BYTES
from .warm import add_warm_argument, warm

DESCRIPTION = "throughput of moving one large region between two store processes vs raw TCP and memcpy"
ROW = 1 << 20  # bytes per row of the benchmark tensor


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bytes", type=int, default=1 << 30, help="region size in bytes (default 1 GiB)")
    parser.add_argument("--streams", type=int, default=4, help="concurrent pulls (default 4)")
    parser.add_argument("--chunk-bytes", type=int, default=0, help="gRPC chunk payload (default: the store's)")
    parser.add_argument("--repeat", type=int, default=3, help="tenplex and socket runs; the median is reported")
    parser.add_argument("--dir", type=Path, help="directory for the two stores (default: a tmpfs directory)")
    add_warm_argument(parser)
    parser.add_argument("--link-mbit", type=float,
                        help="put each store behind its own link of this many Mbit/s each way (emulated cluster; "
                             "needs root and iproute2) and report wire bytes and link efficiency")


def run(args: argparse.Namespace) -> dict:
    if args.link_mbit:
        from .transfer_linked import run as run_linked
        return run_linked(args)
    from ..store import Store

    move = _OneTensorMove(args.bytes)
    base_dir = args.dir or (Path("/dev/shm") if Path("/dev/shm").is_dir() else None)
    with tempfile.TemporaryDirectory(prefix="tenplex-bench-", dir=base_dir) as tmp_name:
        tmp = Path(tmp_name)
        data = np.random.default_rng(0).random(move.shape, dtype=np.float32)
        with Store(tmp / "h0", "h0").begin(1) as w:
            w.put("h0/0", "x", move.whole, data, "float32", shape=move.shape)
            w.commit()
        del data
        path, times = _measure(tmp, move, args)
        warm(args.warm_gb)
        fresh_write = fresh_file_seconds(tmp, move.nbytes)
    return _summary(move.nbytes, times, fresh_write, path, args, base_dir)


class _OneTensorMove:
    """One float32 tensor of about ``nbytes`` (whole rows), held whole by h0/0 and moved whole to h1/0."""

    def __init__(self, nbytes: int):
        from ..box import Box
        from ..layout import Layout, Shard, TensorSpec
        from ..transfer_plan import Plan, PlanStats, Transfer

        rows = max(1, nbytes // ROW)
        self.nbytes = rows * ROW
        self.shape = (rows, ROW // 4)
        spec = {"x": TensorSpec(self.shape, "float32")}
        self.whole = Box.whole(self.shape)
        self.old = Layout.build(spec, {"h0/0": [Shard("x", self.whole)]})
        self.new = Layout.build(spec, {"h1/0": [Shard("x", self.whole)]})
        self.plan = Plan((Transfer("x", "h0/0", "h1/0", "old", self.whole),),
                         PlanStats(target_bytes=self.nbytes, inter_host_bytes=self.nbytes,
                                   inter_host_lower_bound=self.nbytes))


def _measure(tmp: Path, move: _OneTensorMove, args: argparse.Namespace) -> tuple[str, dict[str, list[float]]]:
    """(the read path, seconds per repetition): tenplex's transform with and without the data plane, plain pulls
    over each, and the raw socket baselines, all in the same run."""
    from ..store import Store
    from ..transform import transform

    # h0 and h0-grpc serve the same store directory; h0-grpc without the data plane
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    try:
        for name, host, *extra in (("h0", "h0"), ("h0-grpc", "h0", "--no-data-plane"), ("h1", "h1")):
            servers[name] = _start_server(tmp, host, *extra)
        addresses = {name: address for name, (_, address) in servers.items()}
        path = _path_of(addresses["h0"])
        times: dict[str, list[float]] = {k: [] for k in ("tenplex", "grpc", "pull", "grpc_pull", "raw", "file")}
        version = 2
        for _ in range(args.repeat):
            for key, source in (("tenplex", "h0"), ("grpc", "h0-grpc")):
                warm(args.warm_gb)
                report = transform(move.plan, move.old, move.new, {"h0": addresses[source], "h1": addresses["h1"]},
                                   1, version, streams=args.streams, chunk_bytes=args.chunk_bytes)
                times[key].append(report["seconds"])
                Store(tmp / "h1", "h1").delete(version)
                version += 1
            warm(args.warm_gb)
            times["pull"].append(_pull_seconds(addresses["h0"], move.shape, args.streams, args.chunk_bytes))
            warm(args.warm_gb)
            times["grpc_pull"].append(_pull_seconds(addresses["h0-grpc"], move.shape, args.streams,
                                                    args.chunk_bytes))
            warm(args.warm_gb)
            times["raw"].append(_socket_seconds(move.nbytes))
            warm(args.warm_gb)
            times["file"].append(socket_file_seconds(tmp, move.nbytes))
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait()
    return path, times


def _summary(nbytes: int, times: dict[str, list[float]], fresh_write: float, path: str, args: argparse.Namespace,
             base_dir: Path | None) -> dict:
    """The benchmark's JSON: GB/s (median and best of the repetitions) and the ratios to the baselines."""
    def median(key: str) -> float:
        return nbytes / statistics.median(times[key]) / 1e9

    def best(key: str) -> float:
        return nbytes / min(times[key]) / 1e9

    gbps = {"tenplex_gbps": median("tenplex"), "grpc_gbps": median("grpc"), "raw_socket_gbps": median("raw"),
            "memcpy_gbps": nbytes / _memcpy_seconds(nbytes) / 1e9,
            "raw_socket_file_gbps": median("file"), "tenplex_vs_file_ratio": median("tenplex") / median("file"),
            "raw_socket_file_best_gbps": best("file"),
            "tenplex_vs_raw": median("tenplex") / median("raw"), "grpc_vs_raw": median("grpc") / median("raw"),
            "tenplex_best_gbps": best("tenplex"), "grpc_best_gbps": best("grpc"), "raw_socket_best_gbps": best("raw"),
            "tenplex_best_vs_raw_best": best("tenplex") / best("raw"),
            "tenplex_pull_gbps": median("pull"), "grpc_pull_gbps": median("grpc_pull"),
            "fresh_file_write_gbps": nbytes / fresh_write / 1e9}
    return {"bytes": nbytes, "path": path, **{key: round(value, 3) for key, value in gbps.items()},
            "streams": args.streams, "chunk_bytes": args.chunk_bytes or DEFAULT_CHUNK_BYTES, "repeat": args.repeat,
            "tenplex_seconds": [round(x, 4) for x in times["tenplex"]],
            "grpc_seconds": [round(x, 4) for x in times["grpc"]], "cpus": os.cpu_count(),
            "load_average": [round(x, 2) for x in os.getloadavg()],
            "store_dir": str(base_dir or tempfile.gettempdir())}


def _path_of(address: str) -> str:
    """How a StoreClient reads large boxes from this store: ``dataplane`` or ``grpc``."""
    from ..store.client import StoreClient

    with StoreClient(address) as client:
        client.wait_ready()
        return "dataplane" if client.data_pool() is not None else "grpc"


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


def fresh_file_seconds(directory: Path, nbytes: int) -> float:
    """Time to write nbytes into a new file in ``directory`` (allocating its pages), fsync included."""
    block = np.ones(8 << 20, dtype=np.uint8)
    path = directory / "fresh.bin"
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


def file_copy_seconds(directory: Path, nbytes: int) -> float:
    """Time to copy a file of nbytes into a new file in ``directory`` by the kernel, page to page with no
    user-space buffer (``sendfile`` between the files; fsync included): the limit of a copy within a host.
    Not ``copy_file_range``, which clones extents instead of copying on filesystems with reflinks."""
    source, dest = directory / "copy-src.bin", directory / "copy-dst.bin"
    _write_source(source, nbytes)
    try:
        with open(source, "rb") as src, open(dest, "wb") as dst:
            start = time.perf_counter()
            offset = 0
            while offset < nbytes:
                copied = os.sendfile(dst.fileno(), src.fileno(), offset, nbytes - offset)
                if copied <= 0:
                    raise RuntimeError(f"the file copy stopped after {offset} of {nbytes} bytes")
                offset += copied
            os.fsync(dst.fileno())
            return time.perf_counter() - start
    finally:
        source.unlink(missing_ok=True)
        dest.unlink(missing_ok=True)


def _write_source(path: Path, nbytes: int) -> None:
    """A source file of ``nbytes`` for a baseline (not timed)."""
    block = np.full(8 << 20, 7, dtype=np.uint8)
    with open(path, "wb") as f:
        for offset in range(0, nbytes, block.nbytes):
            f.write(memoryview(block)[:min(block.nbytes, nbytes - offset)])


def _start_server(tmp: Path, host: str, *extra: str) -> tuple[subprocess.Popen, str]:
    port_file = tmp / f"{host}{''.join(extra)}.port"
    proc = spawn_store(tmp / host, host, port_file, *extra)
    return proc, await_store(proc, host, port_file, time.monotonic() + 60)


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
    got = conn.recv_into(view, min(nbytes, 64 << 10))
    first = got
    start = time.perf_counter()  # from the first bytes, so process start-up is not measured
    while got < nbytes:
        n = conn.recv_into(view[got:], min(nbytes - got, 4 << 20))
        if n == 0:
            raise RuntimeError(f"raw socket sender stopped after {got} of {nbytes} bytes")
        got += n
    seconds = time.perf_counter() - start
    conn.close()
    listener.close()
    sender.wait()
    return seconds * nbytes / max(1, nbytes - first)


_FILE_SENDER = """
import os, socket, sys
path, port = sys.argv[1], int(sys.argv[2])
with open(path, "rb") as f, socket.create_connection(("127.0.0.1", port)) as s:
    size, offset = os.fstat(f.fileno()).st_size, 0
    while offset < size:
        offset += s.sendfile(f, offset, size - offset)
"""


def socket_file_seconds(directory: Path, nbytes: int) -> float:
    """Wall time of nbytes from a file, through one TCP socket between two processes (``sendfile``), into a
    fresh file in ``directory`` that is fsynced: the raw work of one shard crossing hosts into a new version."""
    source, dest = directory / "socket-file-src.bin", directory / "socket-file-dst.bin"
    _write_source(source, nbytes)
    buffer = bytearray(4 << 20)
    view = memoryview(buffer)
    listener = socket.create_server(("127.0.0.1", 0))
    sender = subprocess.Popen([sys.executable, "-c", _FILE_SENDER, str(source), str(listener.getsockname()[1])])
    try:
        conn, _ = listener.accept()
        with conn, open(dest, "wb", buffering=0) as out:
            got = conn.recv_into(view)
            first = got
            start = time.perf_counter()  # from the first bytes, so process start-up is not measured
            out.write(view[:got])
            while got < nbytes:
                n = conn.recv_into(view)
                if n == 0:
                    raise RuntimeError(f"socket-to-file sender stopped after {got} of {nbytes} bytes")
                out.write(view[:n])
                got += n
            os.fsync(out.fileno())
            seconds = time.perf_counter() - start
    finally:
        listener.close()
        sender.wait()
        source.unlink(missing_ok=True)
        dest.unlink(missing_ok=True)
    return seconds * nbytes / max(1, nbytes - first)


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
