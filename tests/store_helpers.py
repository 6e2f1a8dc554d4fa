"""Test helpers for the store and transformer tests: real store server processes and random global tensors.

Each simulated host gets its own directory and its own ``tenplex store serve``
process on a free loopback port (port 0, reported through --port-file).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from tenplex.box import Box
from tenplex.devices import device_id, host_of, make_devices
from tenplex.dtypes import numpy_storage
from tenplex.layout import Layout
from tenplex.runtime import launch
from tenplex.runtime.hosts import STORE_COMMAND, await_store, spawn_store
from tenplex.store import Store, fill
from tenplex.store.client import StoreClient



class StoreProcess:
    """A ``tenplex store serve`` process for one host."""

    def __init__(self, root: Path, host: str, env: dict[str, str] | None = None, token_file: Path | None = None,
                 bind: str = "127.0.0.1", extra_args: tuple[str, ...] = (), full_cli: bool = False):
        self.root, self.host = Path(root), host
        self.root.parent.mkdir(parents=True, exist_ok=True)
        self.port_file = self.root.parent / f".{host}.port"
        log = self.root.parent / f".{host}.log"
        self.log = open(log, "ab")
        # full_cli: through the `tenplex` entry point; else the store-only module (what store hosts run)
        command = (str(Path(sys.executable).with_name("tenplex")), "store") if full_cli else STORE_COMMAND
        args = ["--bind", bind, *extra_args] + (["--token-file", str(token_file)] if token_file is not None else [])
        self.proc = spawn_store(root, host, self.port_file, *args, stdout=self.log, env={**os.environ, **(env or {})},
                                command=command)
        try:
            self.address = await_store(self.proc, host, self.port_file, time.monotonic() + 60, log)
        except BaseException:
            self.log.close()
            raise
        self.port = int(self.address.rsplit(":", 1)[1])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()

    def alive(self) -> bool:
        return self.proc.poll() is None


class Cluster:
    """One store directory and server process per host."""

    def __init__(self, base: Path, hosts: list[str], env: dict[str, dict[str, str]] | None = None):
        self.base = Path(base)
        self.roots = {h: self.base / h for h in hosts}
        self.procs: dict[str, StoreProcess] = {}
        try:
            for h in hosts:
                self.procs[h] = StoreProcess(self.roots[h], h, env=(env or {}).get(h))
        except BaseException:
            self.close()
            raise

    @property
    def addresses(self) -> dict[str, str]:
        return {h: p.address for h, p in self.procs.items()}

    def store(self, host: str) -> Store:
        return Store(self.roots[host], host)

    def client(self, host: str) -> StoreClient:
        return StoreClient(self.procs[host].address, timeout=30)

    def close(self) -> None:
        for p in self.procs.values():
            p.stop()

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def random_globals(layout: Layout, seed: int = 0) -> dict[str, np.ndarray]:
    """A random global array per tensor of ``layout`` (bfloat16 as random uint16 bit patterns)."""
    rng = np.random.default_rng(seed)
    arrays = {}
    for name, spec in sorted(layout.tensors.items()):
        storage = np.dtype(numpy_storage(spec.dtype))
        raw = rng.integers(0, 256, size=int(np.prod(spec.shape, dtype=np.int64)) * storage.itemsize, dtype=np.uint8)
        arrays[name] = raw.view(storage).reshape(spec.shape)
    return arrays


def write_version(roots: dict[str, Path], layout: Layout, version: int, arrays: dict[str, np.ndarray],
                  docs: dict[str, dict] | None = None) -> None:
    """Store ``layout``'s shards, cut from ``arrays``, as ``version`` on every host (direct local writes)."""
    fill.write_version({h: Store(roots[h], h) for h in layout.hosts()}, layout, version,
                       lambda tensor, box: arrays[tensor][box.slices()], docs)


def assert_version_matches(roots: dict[str, Path], layout: Layout, version: int, arrays: dict[str, np.ndarray]) -> None:
    """Every shard of ``layout`` in ``version`` equals the global slice byte for byte, and checksums hold."""
    for host in layout.hosts():
        reader = Store(roots[host], host).open(version)
        expected = {(d, s.tensor, s.box) for d, shards in layout.devices.items() if host_of(d) == host for s in shards}
        stored = {(e.device, e.tensor, e.box) for e in reader.entries}
        assert stored == expected, f"host {host}: stored shards differ from the layout"
        for device, tensor, box in expected:
            got = reader.read(device, tensor, box)
            want = arrays[tensor][box.slices()]
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), f"{device} {tensor} {box} differs"
        assert reader.verify() == [], reader.verify()
        assert reader.layout().to_dict() == layout.to_dict()


def tiny_layout(tensors: dict[str, tuple[tuple[int, ...], str]], devices: dict[str, list[tuple[str, tuple, tuple]]]):
    """Hand-written Layout: tensors {name: (shape, dtype)}, devices {dev: [(tensor, offsets, lengths)]}."""
    from tenplex.layout import Shard, TensorSpec
    return Layout.build({n: TensorSpec(shape, dtype) for n, (shape, dtype) in tensors.items()},
                        {d: [Shard(t, Box(o, n)) for t, o, n in shards] for d, shards in devices.items()})


def gpt_layout(dp: int, tp: int, pp: int, hosts: int, per_host: int, sharding: str = "none",
               dtype: str = "float32", layers: int = 2, hidden: int = 16, vocab: int = 50, host_names=None) -> Layout:
    """A small GPT (with Adam states) laid out by the built-in rules under (dp, tp, pp) on hosts x per_host devices."""
    from tenplex.gpt import gpt
    from tenplex.parallel import ParallelConfig
    from tenplex.ptc import layout

    devices = tuple(make_devices(hosts, per_host) if host_names is None else
                    (device_id(h, i) for h in host_names for i in range(per_host)))
    model = gpt(layers, hidden, 4, vocab, dtype=dtype, optimizer="adam", optim_dtype="float32")
    return layout(model, ParallelConfig(dp, tp, pp, devices, sharding=sharding))


def flip_data_byte(path: Path, data_byte: int, mask: int = 0x10) -> None:
    """Corrupt a stored shard file in place: XOR ``mask`` into its data byte ``data_byte`` (from the data start)."""
    from tenplex.store._safetensors import read_header

    offset, _ = read_header(path)
    with open(path, "r+b") as f:
        f.seek(offset + data_byte)
        byte = f.read(1)
        f.seek(offset + data_byte)
        f.write(bytes([byte[0] ^ mask]))


# ------------------------------------------------------------ replica_worker jobs (gloo)
REPLICA_WORKER = Path(__file__).parent / "mp" / "replica_worker.py"


def run_replica_job(base: Path, name: str, devices: list[str], stores: dict[str, StoreProcess], ops: list[dict],
                    replicas: int | None = None, keep: int = 2) -> list[list[dict]]:
    """Run ``ops`` (see ``mp/replica_worker.py``) on ``devices``, each host's rank on its store; every rank's
    results, in rank order."""
    out = base / name
    out.mkdir(parents=True)
    spec = {"out": str(out), "ops": ops, "replicas": replicas, "keep": keep,
            "stores": {h: p.address for h, p in stores.items()}}
    (out / "spec.json").write_text(json.dumps(spec))
    roots = {h: p.root for h, p in stores.items()}
    launch.run_job([sys.executable, str(REPLICA_WORKER), str(out / "spec.json")], devices, roots, {}, out / "logs",
                   timeout=240)
    return [json.loads((out / f"result_r{r}.json").read_text()) for r in range(len(devices))]


def assert_bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].shape == b[key].shape and torch.equal(a[key].view(torch.int32), b[key].view(torch.int32)), key
